"""NVSwitch boards: fabric manager's packages and pin, chosen from the running driver."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from denv_iac.node import NodeDeploySpec, plan_node
from denv_iac.node.fabric import Board, board, packages

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
