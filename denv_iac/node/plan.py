"""plan_node: from a node's facts and its spec, the steps that converge it. Pure."""

from __future__ import annotations

import dataclasses

from denv_iac.node import (
    agent,
    cache,
    driver,
    fabric,
    firewall,
    mig,
    replicas,
    runtime,
    ssh_keys,
    wireguard,
)
from denv_iac.node.driver import UnsupportedNode, check_supported
from denv_iac.node.facts import AGENT_VENV, FactQuery, NodeFacts
from denv_iac.node.holders import STOP_ORDER
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.ssh_keys import SshKeys
from denv_iac.node.steps import (
    Step,
    apt_install,
    cloud_init_wait,
    wants_link,
    with_package_index,
)

# Tools the deploy itself runs on the node: curl (the keyring), venv (the agent), nft, ss.
BASE_PACKAGES = ("ca-certificates", "curl", "python3", "python3-venv", "nftables", "iproute2")


def fact_query(spec: NodeDeploySpec) -> FactQuery:
    """Every path and unit plan_node compares against, for the probe to read."""
    files = [*agent.files(spec), *replicas.files(spec), *firewall.files(spec)]
    volume = spec.cache_volume
    units = [
        *STOP_ORDER,  # the NVML holders: stopped around resets, reloads and MIG changes
        runtime.ENGINE_UNIT,
        firewall.UNIT,
        *(r.unit for r in spec.replicas),
    ]
    return wireguard.fact_query() | FactQuery(
        files=(
            *(content.path for content in files),
            agent.TOKEN,
            *mig.PATHS,
            driver.NOUVEAU_CONF,
            fabric.PIN,
        ),
        links=(agent.COMMAND_LINK, wants_link(mig.UNIT), *(wants_link(u) for u in units)),
        dirs=(AGENT_VENV, *spec.cache.paths()),
        units=tuple(units),
        devices=(volume.device,) if volume else (),
        mounts=(volume.mount_point,) if volume else (),
        fstab_lines=(cache.fstab_line(volume),) if volume else (),
    )


def plan_node(
    facts: NodeFacts,
    spec: NodeDeploySpec,
    overlay_config: str | None = None,
    keys: SshKeys | None = None,
) -> list[Step]:
    """The steps, in order, that bring the node to `spec`; [] when it is there already.

    `overlay_config` is the node's WireGuard config with its private key (a secret: written
    0600, never shown in a step); None when the node is not on the overlay. `keys`: the SSH
    login's keys to keep (`denv_iac.node.ssh_keys`), before any other change, so a rotated key
    lands even where a later step fails; None leaves authorized_keys alone.

    Raises UnsupportedNode for an operating system outside Ubuntu 22.04/24.04 and Debian 12,
    or a node without an NVIDIA GPU.
    """
    check_supported(facts)
    if not facts.pci_gpus and not facts.gpus:
        raise UnsupportedNode("no NVIDIA GPU on the PCI bus: join GPU machines only")
    missing = [p for p in BASE_PACKAGES if p not in facts.packages]
    steps = ssh_keys.plan(facts, keys)
    if missing:
        steps.append(
            Step("base", f"install {' '.join(missing)}", (apt_install(*missing),), uses_apt=True)
        )
    # Before any port it guards listens (and before a reboot): right after nft is installed.
    steps += firewall.plan(facts, spec)
    # Up before the agent and the replicas bind its address; behind the firewall's UDP guard.
    steps += wireguard.plan(facts, overlay_config)
    spec = driver.branch_for(facts, spec)
    steps += driver.keyring_steps(facts, spec)
    steps += driver.plan(facts, spec)
    steps += fabric.plan(facts, spec)
    steps += mig.plan(facts, spec)
    steps += mig.boot_steps(facts, spec)  # before replica units that Require it start
    steps += cache.plan(facts, spec)  # before the replicas make their cache dirs on it
    steps += runtime.plan(facts, spec)
    steps += agent.plan(facts, spec)
    steps += replicas.plan(facts, spec)
    # cloud-init's first boot installs packages and writes files too: it finishes first.
    return cloud_init_wait(facts.cloud_init) + with_package_index(steps)


def removal_steps(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    """What leaving the stack removes: every replica unit, then the MIG boot unit they
    Require, then the overlay interface and its key, then the firewall that guarded their
    ports; the driver, runtime and agent stay for whatever the machine does next."""
    bare = dataclasses.replace(spec, replicas=(), mig=())
    return (
        replicas.stale_steps(facts, bare)
        + mig.boot_steps(facts, bare)
        + wireguard.removal_steps(facts)
        + firewall.removal_steps(facts)
    )


__all__ = ["UnsupportedNode", "fact_query", "plan_node", "removal_steps"]
