"""plan_node, table-tested: facts in, commands out, and nothing left to do on a second run."""

from __future__ import annotations

import dataclasses

import pytest

from denv_iac.node import (
    MigSlice,
    NodeDeploySpec,
    ReplicaSpec,
    Step,
    UnsupportedNode,
    agent,
    plan_node,
)
from denv_iac.node.mig import MigLayoutError
from denv_iac.node.steps import APT_UPDATE, wants_link

from .fixtures import DEBIAN_12, UBUNTU_2204, UBUNTU_2404, converged, node_facts

RUNTIME = {"docker.io": "26.1.5", "nvidia-container-toolkit": "1.17.8-1", "cuda-keyring": "1.1-1"}
FRESH = {"nvidia-open": "580.95.05-1", "nvidia-driver-pinning-580": "580.95.05-1", **RUNTIME}


def spec(**fields: object) -> NodeDeploySpec:
    base = NodeDeploySpec(
        node_id="hetzner.gex44-1",
        replicas=(
            ReplicaSpec("voice.hetzner.gex44-1.0", "ghcr.io/acme/voice:1.4", 8000, 0),
            ReplicaSpec("voice.hetzner.gex44-1.1", "ghcr.io/acme/voice:1.4", 8001, 1),
        ),
        balancer_addresses=("203.0.113.10", "2001:db8::10"),
    )
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def commands(steps: list[Step]) -> list[str]:
    return [command for step in steps for command in step.commands]


def titles(steps: list[Step]) -> list[str]:
    return [f"{step.area}: {step.title}" for step in steps]


def joined(steps: list[Step]) -> str:
    return "\n".join(commands(steps))


@pytest.mark.parametrize(
    ("os", "distro"),
    [(UBUNTU_2204, "ubuntu2204"), (UBUNTU_2404, "ubuntu2404"), (DEBIAN_12, "debian12")],
)
def test_fresh_pcie_node_gets_the_pinned_open_driver_from_nvidias_repository(
    os: tuple[str, str], distro: str
) -> None:
    facts = node_facts(os=os)
    steps = plan_node(facts, spec())
    text = joined(steps)
    url = f"https://developer.download.nvidia.com/compute/cuda/repos/{distro}/x86_64"
    assert f"curl -fsSL -o /tmp/cuda-keyring_1.1-1_all.deb {url}/cuda-keyring_1.1-1_all.deb" in text
    install = commands([s for s in steps if s.title.startswith("pin branch 580")])
    assert install[0].endswith("install --no-install-recommends nvidia-driver-pinning-580")
    assert install[1].endswith("install --no-install-recommends nvidia-open")
    assert "purge" not in text
    assert "fabricmanager" not in text  # PCIe board: no NVSwitch
    assert "modprobe nvidia" in text
    assert "systemctl enable --now nvidia-persistenced.service" in text
    assert "install --no-install-recommends docker.io nvidia-container-toolkit" in text
    assert "nvidia-ctk runtime configure --runtime=docker" in text
    assert steps[0].commands == (APT_UPDATE,)
    order = titles(steps)
    # The driver is verified before anything that needs it.
    verify = order.index("driver: verify branch 580 through NVML")
    assert verify < order.index("runtime: install docker.io nvidia-container-toolkit")
    assert "systemctl restart denv-replica-voice.hetzner.gex44-1.0.service" in text


def test_second_run_on_a_converged_node_changes_nothing() -> None:
    facts = node_facts()
    first = plan_node(facts, spec())
    after = converged(facts, spec(), FRESH)
    written = {step.file.path for step in first if step.file is not None}
    # The plan writes exactly the files compared later, and the agent's wheel, which a node
    # then knows by the agent's version; the token is made on the node itself.
    (wheel,) = {path for path in written if path.startswith(f"{agent.DIST_DIR}/")}
    assert written - {wheel} | {agent.TOKEN} == set(after.files)
    assert f"agent: create the control token {agent.TOKEN}" in titles(first)
    assert plan_node(after, spec()) == []


def test_working_driver_of_the_branch_is_verified_not_reinstalled() -> None:
    # A Deep Learning AMI / Lambda Stack image: driver from Ubuntu's archive, already loaded.
    preinstalled = {"nvidia-driver-580-server-open": "580.95.05-0ubuntu0.22.04.1"}
    facts = node_facts(driver="580.95.05", packages=preinstalled)
    steps = plan_node(facts, spec())
    text = joined(steps)
    assert "nvidia-open" not in text and "purge" not in text and "modprobe" not in text
    assert not [s for s in steps if s.area == "driver" and s.title.startswith("verify")]
    after = converged(facts, spec(), RUNTIME)
    assert plan_node(after, spec()) == []


# Lambda Stack's driver: another branch than the pin, from the image, matched to its kernel.
LAMBDA_STACK_570 = {
    "nvidia-driver-570-server-open": "570.172.08-0ubuntu1",
    "nvidia-utils-570-server": "570.172.08-0ubuntu1",
}


def test_image_driver_of_another_branch_is_verified_and_kept() -> None:
    facts = node_facts(driver="570.172.08", packages=LAMBDA_STACK_570)
    steps = plan_node(facts, spec(image_driver=True))
    assert not [s for s in steps if s.area == "driver" and "persistence" not in s.title]
    assert "purge" not in joined(steps) and not [s for s in steps if s.reboot]
    after = converged(facts, spec(image_driver=True), RUNTIME)
    assert after.driver_version == "570.172.08"
    assert plan_node(after, spec(image_driver=True)) == []
    # The same node joined without image_driver gets the pinned branch instead.
    assert "driver: purge 2 other driver packages" in titles(plan_node(facts, spec()))


def test_image_driver_that_stopped_answering_is_repaired_within_its_branch() -> None:
    facts = node_facts(
        packages=LAMBDA_STACK_570,
        smi_error="Failed to initialize NVML: Driver/library version mismatch",
    )
    steps = [s for s in plan_node(facts, spec(image_driver=True)) if s.area == "driver"]
    assert titles(steps)[:2] == [
        "driver: reload the kernel modules",
        "driver: verify branch 570 through NVML",
    ]


def test_image_without_a_driver_gets_the_pinned_branch() -> None:
    steps = plan_node(node_facts(), spec(image_driver=True))
    assert "driver: pin branch 580 and install nvidia-open" in titles(steps)


def test_wrong_branch_is_purged_and_replaced_then_rebooted_into() -> None:
    old = {
        "nvidia-driver-570-server-open": "570.172.08-0ubuntu1",
        "libnvidia-compute-570-server": "570.172.08-0ubuntu1",
        "nvidia-utils-570-server": "570.172.08-0ubuntu1",
        "nvidia-container-toolkit": "1.17.8-1",
        "libnvidia-container1": "1.17.8-1",
    }
    facts = node_facts(os=DEBIAN_12, driver="570.172.08", packages=old)
    steps = plan_node(facts, spec())
    purge = next(s for s in steps if s.title.startswith("purge"))
    assert purge.commands[0].endswith(
        "purge libnvidia-compute-570-server nvidia-driver-570-server-open nvidia-utils-570-server"
    )  # the container toolkit is not the driver: kept
    reboot = [s for s in steps if s.reboot]
    assert len(reboot) == 1 and titles(steps).index("driver: reboot into the new driver") < titles(
        steps
    ).index("driver: verify branch 580 through NVML")
    removed = tuple(p for p in old if "570" in p)
    after = converged(facts, spec(), FRESH, removed=removed)
    assert plan_node(after, spec()) == []


def test_version_mismatch_reloads_the_modules_instead_of_reinstalling() -> None:
    facts = node_facts(
        packages={"nvidia-open": "580.95.05-1", "cuda-keyring": "1.1-1"},
        smi_error="Failed to initialize NVML: Driver/library version mismatch",
    )
    steps = plan_node(facts, spec())
    driver_steps = [s for s in steps if s.area == "driver"]
    assert titles(driver_steps)[:2] == [
        "driver: reload the kernel modules",
        "driver: verify branch 580 through NVML",
    ]
    assert (
        "modprobe -r nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia"
        in (driver_steps[0].commands[0])
    )
    assert "install --no-install-recommends nvidia-open" not in joined(steps)


def test_proprietary_modules_install_cuda_drivers() -> None:
    steps = plan_node(node_facts(), spec(open_modules=False))
    assert "driver: pin branch 580 and install cuda-drivers" in titles(steps)


def test_mig_layout_on_a_gpu_with_mig_off_enables_resets_and_creates() -> None:
    layout = (MigSlice(1, "3g.40gb", 2), MigSlice(1, "1g.10gb", 1))
    replicas = (
        ReplicaSpec("voice.h.n.0", "img:1", 8000, 0),
        ReplicaSpec("llm.h.n.1.0", "img:1", 8001, 1, mig_profile="3g.40gb", mig_instance=1),
    )
    the_spec = spec(mig=layout, replicas=replicas)
    facts = node_facts(driver="580.95.05", packages={"nvidia-open": "580.95.05-1", **RUNTIME})
    steps = plan_node(facts, the_spec)
    mig = [s for s in steps if s.area == "mig" and s.title.startswith("GPU")]
    # persistenced is not running yet, but this run's driver steps start it before the reset.
    assert [s.commands for s in mig] == [
        (
            "rc=0; s=0; { systemctl stop nvidia-persistenced.service"
            " && nvidia-smi -i 1 -mig 1 && nvidia-smi -i 1 -r"
            " && nvidia-smi mig -i 1 -cgi 3g.40gb,3g.40gb,1g.10gb -C; } || rc=$?; "
            "systemctl start nvidia-persistenced.service || s=1; "
            '[ "$rc" -eq 0 ] || exit "$rc"; exit "$s"',
        )
    ]
    unit = next(s for s in steps if s.file and s.file.path.endswith("llm.h.n.1.0.service"))
    assert unit.file is not None
    assert b"denv-replica-run 1 3g.40gb 1 /usr/bin/docker run" in unit.file.content
    after = converged(facts, the_spec, RUNTIME)
    assert plan_node(after, the_spec) == []


def test_mig_layout_change_stops_the_gpus_replicas_recreates_and_starts_them() -> None:
    replica = ReplicaSpec("llm.h.n.0.0", "img:1", 8001, 0, mig_profile="1g.10gb")
    the_spec = spec(mig=(MigSlice(0, "1g.10gb", 7),), replicas=(replica,))
    facts = node_facts(driver="580.95.05", mig={0: ["3g.40gb", "3g.40gb"], 1: ["7g.80gb"]})
    facts = dataclasses.replace(facts, active_units=frozenset({replica.unit}))
    mig = [s for s in plan_node(facts, the_spec) if s.area == "mig" and s.title.startswith("GPU")]
    # One command each: the replicas start again even when a MIG command fails.
    assert [s.commands for s in mig] == [
        (
            f"rc=0; s=0; {{ systemctl stop {replica.unit} nvidia-persistenced.service"
            " && nvidia-smi mig -i 0 -dci && nvidia-smi mig -i 0 -dgi"
            " && nvidia-smi mig -i 0 -cgi " + ",".join(["1g.10gb"] * 7) + " -C; } || rc=$?; "
            "systemctl start nvidia-persistenced.service || s=1; "
            f"systemctl start {replica.unit} || s=1; "
            '[ "$rc" -eq 0 ] || exit "$rc"; exit "$s"',
        ),
        (  # GPU 1 is outside the layout
            "rc=0; s=0; { systemctl stop nvidia-persistenced.service"
            " && nvidia-smi -i 1 -mig 0 && nvidia-smi -i 1 -r; } || rc=$?; "
            "systemctl start nvidia-persistenced.service || s=1; "
            '[ "$rc" -eq 0 ] || exit "$rc"; exit "$s"',
        ),
    ]


def test_mig_layout_naming_a_missing_gpu_is_refused() -> None:
    with pytest.raises(MigLayoutError, match="GPU index 5 not on this node"):
        plan_node(node_facts(driver="580.95.05"), spec(mig=(MigSlice(5, "1g.10gb"),)))


@pytest.mark.parametrize(
    ("os", "found"),
    [(("ubuntu", "20.04"), "ubuntu 20.04"), (("rocky", "9.4"), "rocky 9.4"), (("", ""), "unknown")],
)
def test_unsupported_os_is_refused_with_what_would_work(os: tuple[str, str], found: str) -> None:
    with pytest.raises(UnsupportedNode) as error:
        plan_node(node_facts(os=os), spec())
    assert str(error.value) == (
        f"{found} is not supported: use Ubuntu 22.04, Ubuntu 24.04 or Debian 12"
    )


def test_node_without_a_gpu_is_refused() -> None:
    with pytest.raises(UnsupportedNode, match="no NVIDIA GPU"):
        plan_node(node_facts(gpus=0), spec())


def test_without_systemd_units_are_enabled_by_links_and_nothing_is_started() -> None:
    facts = node_facts(os=DEBIAN_12, systemd=False)
    steps = plan_node(facts, spec())
    text = joined(steps)
    assert "systemctl" not in text and "modprobe " not in text and "nft -c" not in text
    assert "ln -sfn /etc/systemd/system/denv-agent.service " + wants_link("denv-agent.service") in (
        text
    )
    assert "driver: load the kernel modules: skipped, no booted kernel of its own" in titles(steps)
    after = converged(facts, spec(), FRESH)
    assert plan_node(after, spec()) == []


def test_replica_no_longer_placed_here_is_stopped_and_removed() -> None:
    stale = "denv-replica-voice.old.service"
    facts = dataclasses.replace(
        converged(node_facts(), spec(), FRESH),
        replica_units=frozenset({stale, "denv-replica-voice.hetzner.gex44-1.0.service"}),
    )
    steps = plan_node(facts, spec())
    assert [s.commands for s in steps] == [
        (
            f"systemctl disable --now {stale}",
            f"rm -f /etc/systemd/system/{stale} {wants_link(stale)} "
            "/etc/denv/replicas/voice.old.env",
        )
    ]


def test_changed_agent_config_restarts_the_agent_only() -> None:
    facts = converged(node_facts(), spec(), FRESH)
    changed = spec(agent_port=9200)
    steps = plan_node(facts, changed)
    assert "agent: restart the agent" in titles(steps)
    assert "firewall: load the new rules" in titles(steps)  # the agent port moved
    assert not [s for s in steps if s.area in ("driver", "runtime", "replicas")]
