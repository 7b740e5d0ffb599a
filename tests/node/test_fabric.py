"""NVSwitch boards: fabric manager's packages and pin, chosen from the running driver."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
from pathlib import Path

import pytest

from denv_iac.node import NodeDeploySpec, fabric, plan_node
from denv_iac.node.fabric import Board, board, install_command, packages
from denv_iac.node.holders import FABRICMANAGER
from denv_iac.node.steps import wants_link

from .fixtures import UBUNTU_2404, converged, node_facts

RUNTIME = {"docker.io": "26.1.5", "nvidia-container-toolkit": "1.17.8-1", "cuda-keyring": "1.1-1"}


@pytest.mark.parametrize(
    ("driver", "branch", "kind", "expected"),
    [
        # NVIDIA's repository: the driver is 550.127.05-0ubuntu1, fabric manager 550.127.05-1.
        (
            "550.127.05",
            "550",
            Board.NVSWITCH,
            ("nvidia-fabricmanager-550=550.127.05-*", "libnvidia-nscq-550=550.127.05-*"),
        ),
        (
            "580.95.05",
            "580",
            Board.NVSWITCH,
            ("nvidia-fabricmanager-580=580.95.05-*", "libnvidia-nscq-580=580.95.05-*"),
        ),
        # From branch 590 the names drop the branch suffix.
        (
            "590.44.01",
            "590",
            Board.NVSWITCH,
            ("nvidia-fabricmanager=590.44.01-*", "libnvidia-nscq=590.44.01-*"),
        ),
        # B200: NVLink 5 also needs the NVLink subnet manager, versioned on its own.
        (
            "580.95.05",
            "580",
            Board.NVLINK5,
            ("nvidia-fabricmanager-580=580.95.05-*", "libnvidia-nscq-580=580.95.05-*", "nvlsm"),
        ),
        (
            "590.44.01",
            "590",
            Board.NVLINK5,
            ("nvidia-fabricmanager=590.44.01-*", "libnvidia-nscq=590.44.01-*", "nvlsm"),
        ),
        ("580.95.05", "580", Board.PLAIN, ()),
    ],
)
def test_packages_and_pin_follow_the_driver_branch_and_board(
    driver: str, branch: str, kind: Board, expected: tuple[str, ...]
) -> None:
    assert packages(driver, branch, kind) == expected


B200 = "NVIDIA B200"


@pytest.mark.parametrize(
    ("case", "fields", "expected"),
    [
        ("PCIe cards", {}, Board.PLAIN),
        ("HGX H100: NVSwitch bridges on the PCI bus", {"nvswitches": 4}, Board.NVSWITCH),
        # HGX B200: no NVIDIA bridge on the bus; the GPUs' PCI IDs say it, with no driver yet.
        ("HGX B200 before any driver", {"pci_gpu_ids": frozenset({"0x2901"})}, Board.NVLINK5),
        ("HGX B300 before any driver", {"pci_gpu_ids": frozenset({"0x3182"})}, Board.NVLINK5),
    ],
)
def test_board_from_facts(case: str, fields: dict[str, object], expected: Board) -> None:
    assert board(node_facts(gpus=8, **fields)) is expected, case


@pytest.mark.parametrize("name", [B200, "NVIDIA B300 SXM6 AC"])
def test_board_from_the_gpu_names_nvml_reports(name: str) -> None:
    facts = node_facts(gpus=8, driver="580.95.05")
    hgx = dataclasses.replace(
        facts, gpus=tuple(dataclasses.replace(g, name=name) for g in facts.gpus)
    )
    assert board(hgx) is Board.NVLINK5


SPEC = NodeDeploySpec(node_id="n1")
IMAGE = NodeDeploySpec(node_id="n1", image_driver=True)


def fabric_steps(facts: object, spec: NodeDeploySpec) -> list[str]:
    steps = plan_node(facts, spec)  # type: ignore[arg-type]
    return [c for s in steps if "fabric manager" in s.title for c in s.commands]


@pytest.mark.parametrize(
    ("case", "spec", "facts", "install"),
    [
        (
            "Ubuntu archive driver (revision 0ubuntu1) on an H100 board",
            IMAGE,
            node_facts(
                gpus=8,
                nvswitches=4,
                driver="550.127.05",
                packages={"nvidia-driver-550-server-open": "550.127.05-0ubuntu1"},
            ),
            "nvidia-fabricmanager-550=550.127.05-* libnvidia-nscq-550=550.127.05-*",
        ),
        (
            "driver from NVIDIA's .run installer: no package, the loaded module says",
            IMAGE,
            node_facts(gpus=8, nvswitches=4, driver="570.172.08", module_version="570.172.08"),
            "nvidia-fabricmanager-570=570.172.08-* libnvidia-nscq-570=570.172.08-*",
        ),
        (
            "branch 590 on a B200 board",
            IMAGE,
            node_facts(gpus=8, driver="590.44.01", pci_gpu_ids=frozenset({"0x2901"})),
            "nvidia-fabricmanager=590.44.01-* libnvidia-nscq=590.44.01-* nvlsm",
        ),
    ],
)
def test_fabric_manager_matches_the_running_driver(
    case: str, spec: NodeDeploySpec, facts: object, install: str
) -> None:
    (command, *_) = fabric_steps(facts, spec)
    expected = " ".join(map(shlex.quote, install.split()))
    assert command.endswith(f"install --no-install-recommends {expected}"), case


MISMATCH = node_facts(
    gpus=8,
    pci_gpu_ids=frozenset({"0x2901"}),
    smi_error="Failed to initialize NVML: Driver/library version mismatch",
    module_version="580.82.07",  # still loaded; the reload in this run loads 580.95.05
    packages={"nvidia-open": "580.95.05-1"},
)


@pytest.mark.parametrize(
    "facts",
    [node_facts(gpus=8, pci_gpu_ids=frozenset({"0x2901"})), MISMATCH],
    ids=["fresh", "mismatch"],
)
def test_a_driver_loaded_in_this_run_has_its_version_read_on_the_node(facts: object) -> None:
    command = fabric_steps(facts, SPEC)[0]
    assert command.startswith(
        "v=$(cat /sys/module/nvidia/version 2>/dev/null || dpkg-query -W -f='${Version}' "
        "nvidia-open | sed -e 's/^[0-9]*://' -e 's/-[^-]*$//') && [ -n \"$v\" ] && "
    )
    assert command.endswith('"nvidia-fabricmanager-580=$v-*" "libnvidia-nscq-580=$v-*" "nvlsm"')


def test_installed_fabric_manager_of_the_running_version_plans_nothing() -> None:
    installed = {"nvidia-open": "580.95.05-1"}
    facts = node_facts(os=UBUNTU_2404, gpus=8, nvswitches=4, driver="580.95.05", packages=installed)
    assert fabric_steps(facts, SPEC)[0].endswith(
        "'nvidia-fabricmanager-580=580.95.05-*' 'libnvidia-nscq-580=580.95.05-*'"
    )
    fm = {"nvidia-fabricmanager-580": "580.95.05-1", "libnvidia-nscq-580": "580.95.05-1"}
    after = converged(facts, SPEC, {**installed, **fm, **RUNTIME})
    assert plan_node(after, SPEC) == []
    # The driver moved on (580.105.08 loaded): fabric manager follows it.
    newer = dataclasses.replace(after, driver_version="580.105.08")
    assert "580.105.08-*" in fabric_steps(newer, SPEC)[0]


PIN_580 = (
    "Package: nvidia-fabricmanager-580 libnvidia-nscq-580\n"
    "Pin: version 580.95.05-*\nPin-Priority: 1001\n"
)
PIN_590 = (
    "Package: nvidia-fabricmanager libnvidia-nscq\nPin: version 590.44.01-*\nPin-Priority: 1001\n"
)


@pytest.mark.parametrize(
    ("driver", "suffix", "text"),
    [("580.95.05", "-580", PIN_580), ("590.44.01", "", PIN_590)],
    ids=["580", "590"],
)
def test_installed_fabric_manager_is_held_at_the_driver_version_by_an_apt_pin(
    driver: str, suffix: str, text: str
) -> None:
    # The branch's pinning package admits any later release of the branch: an upgrade would
    # move fabric manager off the loaded driver's version, and it would not start.
    branch = driver.split(".")[0]
    packages = {
        "nvidia-open": f"{driver}-1",
        f"nvidia-fabricmanager{suffix}": f"{driver}-1",
        f"libnvidia-nscq{suffix}": f"{driver}-1",
    }
    running = node_facts(gpus=8, nvswitches=4, driver=driver, packages=packages)
    # Fabric manager installed and running, as a deploy before the pin left it.
    facts = dataclasses.replace(
        running,
        active_units=frozenset({FABRICMANAGER}),
        links={wants_link(FABRICMANAGER): "target"},
    )
    spec = NodeDeploySpec(node_id="n1", driver_branch=branch, image_driver=True)
    steps = [s for s in plan_node(facts, spec) if "fabric manager" in s.title]
    assert [(s.title, s.commands) for s in steps] == [(f"pin fabric manager to {driver}", ())]
    assert steps[0].file is not None
    assert (steps[0].file.path, steps[0].file.content.decode()) == (fabric.PIN, text)
    pinned = dataclasses.replace(facts, files={fabric.PIN: steps[0].file.sha256})
    assert [s for s in plan_node(pinned, spec) if "fabric manager" in s.title] == []


def test_an_install_at_the_driver_read_on_the_node_writes_the_same_pin(tmp_path: Path) -> None:
    # A fresh machine: the version is known only once the driver is in; the second run compares
    # the pin it would write with what the first run's command wrote.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("dpkg-query", "echo 580.95.05-1"), ("apt-get", 'echo apt-get "$@"')):
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    pin = tmp_path / "pin"
    command = install_command(SPEC, Board.NVSWITCH).replace(fabric.PIN, str(pin))
    done = subprocess.run(
        ["sh", "-c", command],
        env={"PATH": f"{stubs}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "nvidia-fabricmanager-580=580.95.05-*" in done.stdout
    assert pin.read_text() == PIN_580
