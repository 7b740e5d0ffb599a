"""The probe's output, parsed; and the probe itself, run on this machine."""

from __future__ import annotations

import subprocess

from denv_iac.node.facts import FactQuery, MigDevice, parse_facts, probe_script

H100_MIG = [
    "os\tubuntu\t22.04",
    "kernel\t6.8.0-45-generic",
    "arch\tamd64",
    "systemd",
    "pci\t0000:18:00.0\t0x030200",
    "pci\t0000:2a:00.0\t0x030200",
    "pci\t0000:05:00.0\t0x068000",
    "pkg\tii \tnvidia-open\t580.95.05-1",
    "pkg\trc \tnvidia-open-570\t570.1-1",
    "smi_rc\t0",
    "smi\t0, GPU-5f0e, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 580.95.05, Disabled",
    "smi\t1, GPU-9a1c, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 580.95.05, Enabled",
    "smil\tGPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f0e)",
    "smil\tGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-9a1c)",
    "smil\t  MIG 3g.40gb     Device  0: (UUID: MIG-aaaa)",
    "smil\t  MIG 1g.10gb     Device  1: (UUID: MIG-bbbb)",
    "file\t/etc/denv/agent.toml\tabc123",
    "link\t/usr/local/bin/denv-agent\t/opt/denv/agent/bin/denv-agent",
    "dir\t/opt/denv/agent",
    "active\tdocker.service",
    "replica_unit\tdenv-replica-a.service",
    "runtime",
    "agent\t/opt/denv/agent/lib/python3.11/site-packages/denv_agent-0.1.0.dist-info",
]


def test_parse_a_working_h100_node_with_mig_on_one_gpu() -> None:
    facts = parse_facts(H100_MIG)
    assert (facts.os_id, facts.os_version, facts.arch, facts.systemd) == (
        "ubuntu",
        "22.04",
        "amd64",
        True,
    )
    assert facts.pci_gpus == ("0000:18:00.0", "0000:2a:00.0") and facts.nvswitches == 1
    assert facts.packages == {"nvidia-open": "580.95.05-1"}  # removed-but-configured skipped
    assert facts.smi_ok and facts.driver_version == "580.95.05" and facts.driver_branch == "580"
    gpu1 = facts.gpu(1)
    assert gpu1 is not None and gpu1.mig_enabled and gpu1.uuid == "GPU-9a1c"
    assert gpu1.mig_devices == (MigDevice("3g.40gb", "MIG-aaaa"), MigDevice("1g.10gb", "MIG-bbbb"))
    assert facts.gpu(0) is not None and not facts.gpu(0).mig_enabled  # type: ignore[union-attr]
    assert facts.files == {"/etc/denv/agent.toml": "abc123"}
    assert facts.links["/usr/local/bin/denv-agent"] == "/opt/denv/agent/bin/denv-agent"
    assert facts.active_units == {"docker.service"} and facts.runtime_configured
    assert facts.replica_units == {"denv-replica-a.service"} and facts.agent_version == "0.1.0"


def test_parse_a_version_mismatch() -> None:
    facts = parse_facts(
        [
            "os\tdebian\t12",
            "smi_rc\t18",
            "smi\tFailed to initialize NVML: Driver/library version mismatch",
        ]
    )
    assert facts.smi_present and not facts.smi_ok and not facts.gpus
    assert facts.smi_error == "Failed to initialize NVML: Driver/library version mismatch"
    assert facts.driver_version == ""


def test_probe_runs_under_sh_and_parses_on_this_machine(tmp_path: object) -> None:
    query = FactQuery(files=("/etc/os-release",), dirs=("/etc", "/nonexistent"), links=("/x",))
    out = subprocess.run(
        ["sh", "-c", probe_script(query)], capture_output=True, text=True, check=True
    ).stdout
    facts = parse_facts(out.splitlines())
    assert facts.os_id and facts.kernel and facts.arch
    assert set(facts.files) == {"/etc/os-release"} and len(facts.files["/etc/os-release"]) == 64
    assert facts.dirs == {"/etc"} and facts.links == {}
    assert "dpkg" in facts.packages


def test_parse_the_docker_command_the_loaded_modules_version_and_gpu_pci_ids() -> None:
    facts = parse_facts(["docker_cli", "module\t550.127.05", "pci\t0000:18:00.0\t0x030200\t0x2901"])
    assert facts.docker_cli and facts.module_version == "550.127.05"
    assert facts.pci_gpus == ("0000:18:00.0",) and facts.pci_gpu_ids == {"0x2901"}
    bare = parse_facts(["os\tdebian\t12"])
    assert not bare.docker_cli and bare.module_version == ""
