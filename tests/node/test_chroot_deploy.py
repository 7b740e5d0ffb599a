"""The real deploy and repair, through pyinfra's @chroot connector, into a Debian 12 root.

NVIDIA's and Docker's packages are stand-ins from a local apt repository (tests/node/standin.py);
apt, dpkg, pip, the files, units and links are all real. The root is a fresh copy of a
debootstrapped one cached between runs; nothing is loaded into this machine's kernel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from denv_iac.cli.node import node
from denv_iac.node import (
    AgentSettings,
    MigSlice,
    NodeDeploySpec,
    RepairLevel,
    ReplicaSpec,
    StepReport,
    Target,
    prepare_node,
    repair_node,
)

from . import standin
from .debian_root import ensure_root

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot deploys need root (CI runs them as root)"),
    pytest.mark.skipif(
        shutil.which("debootstrap") is None or shutil.which("dpkg-scanpackages") is None,
        reason="needs debootstrap and dpkg-dev (apt-get install debootstrap dpkg-dev)",
    ),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    started = time.monotonic()
    pristine = ensure_root()
    built = time.monotonic()
    work = tmp_path_factory.mktemp("node") / "root"
    subprocess.run(["cp", "-a", str(pristine), str(work)], check=True)
    # Offline: only the stand-in repository, once cuda-keyring has added it.
    (work / "etc/apt/sources.list").unlink(missing_ok=True)
    standin.build_repo(work / standin.REPO_IN_ROOT.lstrip("/"), wireguard=True)
    standin.fake_pci_bus(work, gpus=2, nvswitches=2)
    print(
        f"\nroot ready in {time.monotonic() - started:.1f} s (debootstrap {built - started:.1f} s)"
    )
    yield work
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def spec(root: Path) -> NodeDeploySpec:
    wheel = standin.agent_wheel(root.parent)
    return NodeDeploySpec(
        node_id="joined.box-1",
        mig=(MigSlice(1, "1g.10gb", 2),),
        agent=AgentSettings(
            wheel=str(wheel), pip_args=("--no-index",), config={"thresholds": {"fail_after": 2}}
        ),
        replicas=(
            ReplicaSpec("voice.joined.box-1.0", "ghcr.io/acme/voice:1.4", 8000, 0, env={"A": "1"}),
            ReplicaSpec(
                "side.joined.box-1.1.1",
                "ghcr.io/acme/side:2",
                8001,
                1,
                mig_profile="1g.10gb",
                mig_instance=1,
            ),
        ),
        balancer_addresses=("203.0.113.10", "2001:db8::/64"),
        nvidia_repo=f"file://{standin.REPO_IN_ROOT}",
    )


def in_root(root: Path, *command: str) -> str:
    return subprocess.run(
        ["chroot", str(root), *command], check=True, capture_output=True, text=True
    ).stdout


def versions(root: Path) -> dict[str, str]:
    out = in_root(root, "dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${Package} ${Version}\n")
    return {p[1]: p[2] for p in (line.split() for line in out.splitlines()) if p[0] == "ii"}


def spec_file(root: Path, spec: NodeDeploySpec) -> Path:
    path = root.parent / "node.json"
    data = {
        "node_id": spec.node_id,
        "mig": [{"gpu": 1, "profile": "1g.10gb", "instances": 2}],
        "agent": {
            "wheel": spec.agent.wheel,
            "pip_args": ["--no-index"],
            "config": dict(spec.agent.config),
        },
        "replicas": [
            {
                "id": r.id,
                "image": r.image,
                "port": r.port,
                "gpu": r.gpu,
                "env": dict(r.env),
                "mig_profile": r.mig_profile,
                "mig_instance": r.mig_instance,
            }
            for r in spec.replicas
        ],
        "balancer_addresses": list(spec.balancer_addresses),
        "nvidia_repo": spec.nvidia_repo,
    }
    path.write_text(json.dumps(data))
    return path


def join_cli(root: Path, spec: NodeDeploySpec, *args: str) -> Result:
    """`denv node join` of the root as a joined node, through the CLI."""
    command = ["join", f"@chroot{root}", "--site", "joined", "--spec", str(spec_file(root, spec))]
    return CliRunner().invoke(node, [*command, *args])


def test_1_dry_join_prints_the_plan_and_changes_nothing(root: Path, spec: NodeDeploySpec) -> None:
    result = join_cli(root, spec, "--dry")
    assert result.exit_code == 0, result.output
    assert "driver: pin branch 580 and install nvidia-open" in result.output
    assert "nvidia-smi mig -i 1 -cgi 1g.10gb,1g.10gb -C" in result.output
    assert "write /etc/denv/firewall.nft" in result.output
    assert "nvidia-open" not in versions(root)
    assert not (root / "etc/denv").exists()


def test_2_join_installs_the_pinned_branch_and_writes_everything(
    root: Path, spec: NodeDeploySpec
) -> None:
    started = time.monotonic()
    steps = prepare_node(Target(f"@chroot{root}"), spec)
    print(f"\nfirst deploy: {len(steps)} steps in {time.monotonic() - started:.1f} s")
    installed = versions(root)
    assert installed["nvidia-open"] == f"{standin.DRIVER}-1"  # 590 is in the repo: pinned out
    assert installed["nvidia-driver-pinning-580"] == f"{standin.DRIVER}-1"
    # NVSwitch board: the driver's upstream version under fabric manager's own revision, not
    # the later 580 release apt would pick by itself.
    fabric = f"{standin.DRIVER}-{standin.FABRIC_REVISION}"
    assert installed["nvidia-fabricmanager-580"] == installed["libnvidia-nscq-580"] == fabric
    assert "nvidia-container-toolkit" in installed and "docker.io" in installed
    assert "nvidia" in json.loads((root / "etc/docker/daemon.json").read_text())["runtimes"]
    config = tomllib.loads((root / "etc/denv/agent.toml").read_text())
    assert config["node"] == "joined.box-1"
    assert config["listen"]["agent_check"] == "0.0.0.0:9100"
    assert config["thresholds"] == {"fail_after": 2}
    assert [r["id"] for r in config["replicas"]] == [r.id for r in spec.replicas]
    assert (root / "etc/denv/agent.token").stat().st_mode & 0o777 == 0o600
    wants = root / "etc/systemd/system/multi-user.target.wants"
    for unit in (
        "denv-agent.service",
        "denv-firewall.service",
        "docker.service",
        "nvidia-persistenced.service",
        "nvidia-fabricmanager.service",
        *(r.unit for r in spec.replicas),
    ):
        assert (wants / unit).is_symlink(), unit
        assert (root / os.readlink(wants / unit).lstrip("/")).is_file(), unit
    env = root / "etc/denv/replicas/voice.joined.box-1.0.env"
    assert env.stat().st_mode & 0o777 == 0o600
    assert "HF_HOME=/var/lib/denv/cache/huggingface\n" in env.read_text()
    assert (root / "var/lib/denv/cache/torchinductor").is_dir()
    rules = (root / "etc/denv/firewall.nft").read_text()
    assert "elements = { 203.0.113.10/32 }" in rules and "elements = { 2001:db8::/64 }" in rules
    assert "tcp dport { 8000, 8001, 9100 } drop" in rules
    assert "MIG 1g.10gb" in in_root(root, "nvidia-smi", "-L")
    assert in_root(root, "/usr/local/bin/denv-agent", "drain") == "drained\n"
    in_root(root, "/usr/local/bin/denv-agent", "undrain")


@pytest.mark.needs_nft
def test_3_the_rendered_firewall_is_valid_nftables(root: Path) -> None:
    # A network namespace of its own: the rules are checked, never loaded into this machine.
    result = subprocess.run(
        ["unshare", "--net", "nft", "-c", "-f", str(root / "etc/denv/firewall.nft")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_4_replica_launcher_selects_the_mig_instance_by_uuid(root: Path) -> None:
    out = in_root(root, "/opt/denv/bin/denv-replica-run", "1", "1g.10gb", "1", "echo", "run", "x")
    assert out == "run -e NVIDIA_VISIBLE_DEVICES=MIG-1-1-1g.10gb x\n"
    whole = in_root(root, "/opt/denv/bin/denv-replica-run", "0", "-", "0", "echo", "run")
    assert whole == "run -e NVIDIA_VISIBLE_DEVICES=GPU-00000000-aaaa-bbbb-cccc-000000000000\n"


def test_5_second_join_changes_nothing(root: Path, spec: NodeDeploySpec) -> None:
    started = time.monotonic()
    assert prepare_node(Target(f"@chroot{root}"), spec) == []
    print(f"\nsecond deploy: 0 steps in {time.monotonic() - started:.1f} s")
    result = join_cli(root, spec, "--dry")
    assert result.exit_code == 0 and "nothing to change" in result.output
    applied = join_cli(root, spec, "--json")
    assert applied.exit_code == 0, applied.output
    assert json.loads(applied.output) == {"host": f"@chroot{root}", "dry": False, "steps": []}


def break_driver(root: Path) -> None:
    (root / standin.MODULE_VERSION_FILE.lstrip("/")).write_text("575.64.05\n")
    result = subprocess.run(
        ["chroot", str(root), "nvidia-smi", "-L"], capture_output=True, text=True
    )
    assert "version mismatch" in result.stdout


def test_6_repair_reinstall_fixes_a_version_mismatch_and_undrains(
    root: Path, spec: NodeDeploySpec
) -> None:
    break_driver(root)
    started = time.monotonic()
    result = repair_node(Target(f"@chroot{root}"), spec, RepairLevel.REINSTALL)
    print(f"\nrepair (reinstall): {time.monotonic() - started:.1f} s")
    statuses = {step.name: step.status for step in result.steps}
    assert result.ok, result.steps
    assert statuses["drain"] == statuses["verify through NVML"] == statuses["undrain"] == "ok"
    # The stand-in GPU keeps its MIG instances across a driver reinstall, so none to restore.
    assert statuses["restore MIG layout"] == "skipped"
    assert (root / standin.AGENT_STATE_FILE.lstrip("/")).read_text() == "up\n"
    assert versions(root)["nvidia-open"] == f"{standin.DRIVER}-1"
    assert "version mismatch" not in in_root(root, "nvidia-smi", "-L")


def test_7_repair_whose_verify_fails_leaves_the_node_drained(
    root: Path, spec: NodeDeploySpec
) -> None:
    break_driver(root)
    reports: list[StepReport] = []
    # In a chroot the modules are not ours to reload: the step passes, and NVML still says no.
    result = repair_node(Target(f"@chroot{root}"), spec, RepairLevel.RELOAD, report=reports.append)
    assert not result.ok and result.drained
    assert reports[3].name == "reload" and "no booted kernel" in reports[3].detail
    assert [r.name for r in reports][-1] == "verify through NVML"
    assert reports[-1].status == "failed" and "version mismatch" in reports[-1].detail
    assert (root / standin.AGENT_STATE_FILE.lstrip("/")).read_text() == "drain\n"
    assert "undrain" not in [r.name for r in reports]
    again = CliRunner().invoke(
        node,
        [
            "repair",
            f"@chroot{root}",
            "--level",
            "reload",
            "--spec",
            str(spec_file(root, spec)),
            "--json",
        ],
    )
    assert again.exit_code == 1
    document = json.loads(again.output)
    assert document["ok"] is False and document["drained"] is True
    assert document["steps"][-1]["name"] == "verify through NVML"
