"""Node facts as the probe would read them, for the table tests of plan_node."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from denv_iac.node import agent, driver, fabric, firewall, holders, mig, replicas, wireguard
from denv_iac.node.facts import AGENT_VENV, GpuInfo, MigDevice, NodeFacts
from denv_iac.node.plan import BASE_PACKAGES, fact_query
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import wants_link

UBUNTU_2204 = ("ubuntu", "22.04")
UBUNTU_2404 = ("ubuntu", "24.04")
DEBIAN_12 = ("debian", "12")


def node_facts(
    os: tuple[str, str] = UBUNTU_2204,
    systemd: bool = True,
    gpus: int = 2,
    nvswitches: int = 0,
    driver: str | None = None,
    packages: Mapping[str, str] | None = None,
    smi_error: str = "",
    mig: Mapping[int, list[str]] | None = None,
    **fields: object,
) -> NodeFacts:
    """A fresh cloud image by default: base tools installed, no NVIDIA software, MIG off.

    `driver` gives a working driver of that version (nvidia-smi answers); `smi_error` a
    failing nvidia-smi; `mig` the MIG devices per GPU (MIG mode on for those GPUs).
    """
    mig = mig or {}
    gpu_list = tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            name="NVIDIA H100 80GB HBM3",
            bus_id=f"00000000:{0x18 + i:02X}:00.0",
            mig_enabled=i in mig,
            mig_devices=tuple(
                MigDevice(profile, f"MIG-{i}-{n}") for n, profile in enumerate(mig.get(i, []))
            ),
        )
        for i in range(gpus)
    )
    base = NodeFacts(
        os_id=os[0],
        os_version=os[1],
        kernel="6.8.0-45-generic",
        arch="amd64",
        systemd=systemd,
        pci_gpus=tuple(f"0000:{0x18 + i:02x}:00.0" for i in range(gpus)),
        nvswitches=nvswitches,
        packages={**dict.fromkeys(BASE_PACKAGES, "1.0"), **(packages or {})},
        smi_present=driver is not None or bool(smi_error),
        smi_ok=driver is not None,
        smi_error=smi_error,
        driver_version=driver or "",
        gpus=gpu_list if driver else (),
    )
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def converged(
    facts: NodeFacts,
    spec: NodeDeploySpec,
    packages: Mapping[str, str],
    removed: tuple[str, ...] = (),
) -> NodeFacts:
    """The facts a node would show after a successful deploy of `spec` from `facts`.

    `packages`: what the deploy installed, at the versions the repository would have given;
    `removed`: what it purged.
    """
    query = fact_query(spec)
    # The overlay's interface is the deploy's only on a node that listens on it.
    off_overlay = set() if spec.listen_address else {wireguard.UNIT, wants_link(wireguard.UNIT)}
    files = {
        c.path: c.sha256 for c in (*agent.files(spec), *replicas.files(spec), *mig.files(spec))
    }
    files[agent.TOKEN] = "token-present"
    files.update({c.path: c.sha256 for c in firewall.files(spec)})
    layout = spec.mig_layout()
    branch = driver.branch_for(facts, spec).driver_branch
    version = facts.driver_version if facts.driver_branch == branch else "580.95.05"
    if fabric.board(facts) is not fabric.Board.PLAIN:
        files[fabric.PIN] = fabric.pin(version, branch).sha256
    gpus = [
        dataclasses.replace(
            gpu,
            mig_enabled=gpu.index in layout,
            mig_devices=tuple(
                MigDevice(p, f"MIG-new-{gpu.index}-{n}")
                for n, p in enumerate(layout.get(gpu.index, []))
            ),
        )
        for gpu in node_facts(gpus=len(facts.pci_gpus), driver=version).gpus
    ]
    kept = {name: v for name, v in facts.packages.items() if name not in removed}
    return dataclasses.replace(
        facts,
        packages={**kept, **packages},
        smi_present=True,
        smi_ok=True,
        smi_error="",
        driver_version=version,
        gpus=tuple(gpus),
        files=files,
        links={
            **dict.fromkeys(set(query.links) - off_overlay, "target"),
            agent.COMMAND_LINK: agent.AGENT_BIN,
        },
        dirs=frozenset(query.dirs) | {AGENT_VENV},
        # Everything the deploy starts runs; DCGM is not the deploy's: it runs where it ran.
        active_units=(frozenset(query.units) - {*holders.DCGM, holders.DCGM_EXPORTER} - off_overlay)
        | (facts.active_units & {*holders.DCGM, holders.DCGM_EXPORTER})
        if facts.systemd
        else frozenset(),
        replica_units=frozenset(r.unit for r in spec.replicas),
        runtime_configured=True,
        agent_version=spec.agent.version,
    )
