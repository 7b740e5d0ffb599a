"""The agent's production NVML path, real pynvml over the stand-in libnvidia-ml.so.1: every call
the agent makes answered, and each scripted fault giving the verdict the agent gives with its
Python double, then clearing back to up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from denv_agent import control
from denv_agent.config import to_toml
from denv_agent.process import AgentProcess

from agent.tests.agent_testkit import (
    TOKEN,
    ReplicaServer,
    ask,
    config_data,
    replica,
    replica_servers,
    wait_for,
)
from tests import nvml_standin
from tests.node import standin

R0, R1 = "voice.local.node-a.0", "voice.local.node-a.1"
UP = "up ready 100%\n"
STALL_S = 0.5
MISMATCH = "driver/library version mismatch"


def machine(root: Path, gpus: int = 2) -> dict[str, str]:
    """A GPU machine below `root` (PCI listing, loaded module) and the environment to load the
    stand-in there."""
    standin.fake_pci_bus(root, gpus=gpus, nvswitches=1)
    module = root / nvml_standin.MODULE_VERSION
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_text(f"{standin.DRIVER}\n")
    nvml_standin.set_faults(root)
    return {
        **os.environ,
        "LD_LIBRARY_PATH": str(nvml_standin.build(standin.DRIVER)),
        "DENV_NVML_STANDIN_ROOT": str(root),
    }


_READ_ALL = """
import json, pynvml
from denv_agent.gpu_health import open_gpu, read_gpu
from denv_agent.nvml_api import real_nvml
nvml = real_nvml()
nvml.nvmlInit()
out = {"driver": nvml.nvmlSystemGetDriverVersion(), "count": nvml.nvmlDeviceGetCount(), "gpus": []}
for index in range(out["count"]):
    device = open_gpu(nvml, index)
    reading = read_gpu(nvml, device)
    pci = pynvml.nvmlDeviceGetPciInfo(device.handle)
    out["gpus"].append({
        "index": nvml.nvmlDeviceGetIndex(device.handle),
        "reading": {k: v for k, v in vars(reading).items() if k != "polled_at"},
        "bus_id": pci.busId, "power_mw": pynvml.nvmlDeviceGetPowerUsage(device.handle),
    })
nvml.nvmlShutdown()
print(json.dumps(out))
"""


def read_all(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _READ_ALL], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_every_read_the_agent_makes_answers_through_pynvml(tmp_path: Path) -> None:
    env = machine(tmp_path)
    # GPU 0: MIG on once reset; GPU 1: on, with two instances.
    mode = {"mig": {"1": True}, "pending": {"0": True}}
    (tmp_path / nvml_standin.MIG_MODE).write_text(json.dumps(mode))
    instances = tmp_path / nvml_standin.MIG_INSTANCES
    instances.parent.mkdir(parents=True)
    instances.write_text(json.dumps({"devices": {"1": ["3g.40gb", "3g.40gb"]}}))
    got = read_all(env)
    assert got["driver"] == standin.DRIVER and got["count"] == 2
    gpus = got["gpus"]
    assert isinstance(gpus, list)
    healthy = {
        "temperature_c": 34,
        "utilization_pct": 0,
        "memory_total_bytes": 81559 * 2**20,
        "ecc_uncorrectable": 0,
        "remap_pending": False,
        "remap_failure": False,
        "recovery_action": 0,
        "throttle": [],
        "lost": False,
        "errors": [],
    }
    for index, gpu in enumerate(gpus):
        reading = gpu["reading"]
        assert gpu["index"] == index and gpu["power_mw"] == 72000
        assert gpu["bus_id"] == f"00000000:{0x18 + index:02X}:00.0"
        assert reading["uuid"] == f"GPU-{index:08d}-aaaa-bbbb-cccc-{index:012d}"
        assert reading["name"] == "NVIDIA H100 80GB HBM3"
        assert {k: reading[k] for k in healthy} == healthy
    assert (gpus[0]["reading"]["mig_current"], gpus[0]["reading"]["mig_pending"]) == (False, True)
    assert (gpus[1]["reading"]["mig_current"], gpus[1]["reading"]["mig_pending"]) == (True, True)
    assert gpus[1]["reading"]["mig_devices"] == ["MIG-1-0-3g.40gb", "MIG-1-1-3g.40gb"]


_HOLDS = """
import os, pynvml
device = os.path.join(os.environ["DENV_NVML_STANDIN_ROOT"], "{device}")
def holds():
    found = False
    for fd in os.listdir("/proc/self/fd"):  # the listing's own descriptor is gone by now
        try:
            found = found or os.readlink(f"/proc/self/fd/{{fd}}") == device
        except OSError:
            pass
    return found
before = holds()
pynvml.nvmlInit()
pynvml.nvmlInit()
during = holds()
pynvml.nvmlShutdown()
still = holds()
pynvml.nvmlShutdown()
print(before, during, still, holds())
"""


def test_nvml_holds_the_device_from_init_to_the_last_shutdown(tmp_path: Path) -> None:
    # What makes the stand-in nvidia-smi refuse a reset while the agent runs, as the real one
    # refuses while a process has /dev/nvidia* open.
    env = machine(tmp_path)
    (tmp_path / nvml_standin.DEVICE).parent.mkdir(parents=True)
    code = _HOLDS.format(device=nvml_standin.DEVICE)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "False"]


def test_every_nvml_constant_the_stand_in_defines_is_pynvml_s() -> None:
    defined = dict(
        re.findall(r"^#define ((?:NVML_|nvml)\w+) (\w+)", nvml_standin.SOURCE.read_text(), re.M)
    )
    assert {"NVML_ERROR_GPU_IS_LOST", "nvmlEventTypeXidCriticalError"} <= set(defined)
    assert {name: int(value.rstrip("ULul"), 0) for name, value in defined.items()} == {
        name: getattr(pynvml, name) for name in defined
    }


@pytest.mark.parametrize(
    ("module", "error"),
    [(None, "driver not loaded"), ("575.57.08", MISMATCH)],
)
def test_nvml_init_fails_as_the_driver_state_says(
    tmp_path: Path, module: str | None, error: str
) -> None:
    env = machine(tmp_path)
    path = tmp_path / nvml_standin.MODULE_VERSION
    if module is None:
        path.unlink()
    else:
        path.write_text(f"{module}\n")
    code = (
        "from denv_agent.nvml_api import real_nvml, describe_error\n"
        "try:\n    real_nvml().nvmlInit()\nexcept Exception as e:\n    print(describe_error(e))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == error, done.stderr


@pytest.fixture
def replicas() -> Iterator[list[ReplicaServer]]:
    with replica_servers() as servers:
        yield servers


def start_agent(tmp_path: Path, replicas: list[ReplicaServer], *faults: str) -> AgentProcess:
    """`denv-agent` with real pynvml over the stand-in, with these faults from the start."""
    env = machine(tmp_path / "root")
    nvml_standin.set_faults(tmp_path / "root", *faults)
    data = config_data(
        tmp_path,
        [replica(i, s.health_url) for i, s in enumerate(replicas)],
        intervals={"nvml_stall_s": STALL_S},
    )
    config = tmp_path / "agent.toml"
    config.write_text(to_toml(data))
    return AgentProcess(config, env=env)


@pytest.fixture
def agent(tmp_path: Path, replicas: list[ReplicaServer]) -> Iterator[AgentProcess]:
    """The agent over healthy stand-in GPUs: both replicas up, XIDs registered."""
    with start_agent(tmp_path, replicas) as process:
        wait_for(lambda: replies(process), (UP, UP))
        wait_for(lambda: [g["xid_events"] for g in healthz(process)["gpus"]], ["registered"] * 2)
        yield process


def replies(process: AgentProcess) -> tuple[str, str]:
    one, two = (ask(process.agent_check, f"{r}\n".encode()).decode() for r in (R0, R1))
    return one, two


def healthz(process: AgentProcess) -> dict[str, object]:
    with urllib.request.urlopen(f"{process.http_url}/healthz", timeout=5) as response:
        doc: dict[str, object] = json.loads(response.read())
    return doc


def test_healthy_gpus_read_through_real_nvml(agent: AgentProcess) -> None:
    doc = healthz(agent)
    assert doc["nvml"] == {
        "state": "ok",
        "error": None,
        "driver_version": standin.DRIVER,
        "gpu_count": 2,
    }
    gpus = doc["gpus"]
    assert isinstance(gpus, list)
    assert [g["uuid"] for g in gpus] == [f"GPU-{i:08d}-aaaa-bbbb-cccc-{i:012d}" for i in (0, 1)]
    assert [g["reasons"] for g in gpus] == [[], []]


# Each fault as the test writes it, the replies it gives (the verdicts the agent tests give with
# the Python double), and whether it is sticky (cleared by an operator after the repair).
FAULTS = [
    (["xid 1 79"], ("down #xid 79 gpu fell off the bus\n",) * 2, True),
    (["xid 0 48"], ("down #xid 48 double-bit ecc error\n", UP), True),
    (["xid 1 63"], (UP, "drain #xid 63 row remap pending\n"), True),
    (["xid 0 13"], (UP, UP), False),
    (["lost 1"], (UP, "down #gpu lost\n"), True),
    (["remap_pending 0"], ("drain #pending row remap\n", UP), False),
    (["remap_failure 1"], (UP, "down #row remap failed\n"), False),
    (["ecc 0 2"], ("drain #uncorrectable ecc errors: 2\n", UP), False),
    (["recovery 1 2"], (UP, "down #recovery action: node reboot\n"), False),
    (["error nvmlDeviceGetTemperature 16 0"], ("down #gpu requires reset\n", UP), False),
    (["error nvmlDeviceGetMemoryInfo 18"], (f"drain #{MISMATCH}\n",) * 2, False),
]


@pytest.mark.parametrize(("lines", "expected", "sticky"), FAULTS, ids=[f[0][0] for f in FAULTS])
def test_a_scripted_fault_gives_its_verdict_and_clearing_it_brings_the_gpu_back(
    agent: AgentProcess, tmp_path: Path, lines: list[str], expected: tuple[str, str], sticky: bool
) -> None:
    root = tmp_path / "root"
    nvml_standin.set_faults(root, *lines)
    if expected == (UP, UP):  # counted only: wait for the count, then check the replies hold
        wait_for(lambda: healthz(agent)["gpus"][0]["xids"], {"13": 1})  # type: ignore[index]
    wait_for(lambda: replies(agent), expected)
    nvml_standin.set_faults(root)
    if sticky:
        time.sleep(0.3)  # a few polls: the fault stays until an operator clears it
        assert replies(agent) == expected
        control.clear_faults(agent.http_url, TOKEN)
    wait_for(lambda: replies(agent), (UP, UP))


@pytest.mark.timing
def test_a_hung_nvml_call_is_reported_and_never_blocks_replies_or_stopping(
    agent: AgentProcess, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    nvml_standin.set_faults(root, "hang nvmlDeviceGetTemperature")

    def reasons() -> list[object]:
        return [g["reasons"] for g in healthz(agent)["gpus"]]  # type: ignore[index]

    wait_for(reasons, lambda found: all(r and "nvml poll stalled" in r[0] for r in found))
    started = time.monotonic()
    assert replies(agent) == (UP, UP)
    assert time.monotonic() - started < 2  # the call hangs for good: any bound shows it
    nvml_standin.set_faults(root)
    wait_for(reasons, [[], []])
    nvml_standin.set_faults(root, "hang *")
    time.sleep(STALL_S * 2)
    started = time.monotonic()
    assert agent.stop() == 0
    assert time.monotonic() - started < 5


def test_a_hung_xid_event_wait_is_reported_while_the_gpus_keep_serving(
    agent: AgentProcess, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    nvml_standin.set_faults(root, "hang nvmlEventSetWait_v2")

    def node_reasons() -> object:
        return healthz(agent)["reasons"]  # type: ignore[index]

    wait_for(node_reasons, lambda found: bool(found) and "xid event wait stalled" in found[0])
    assert replies(agent) == (UP, UP)  # the GPUs are still polled: their readings decide
    nvml_standin.set_faults(root)
    wait_for(node_reasons, [])
    nvml_standin.set_faults(root, "xid 0 48")  # and the wait sees XIDs again
    wait_for(lambda: replies(agent)[0], lambda reply: reply.startswith("down"))
    nvml_standin.set_faults(root)
    control.clear_faults(agent.http_url, TOKEN)
    wait_for(lambda: replies(agent), (UP, UP))


def test_nvml_hung_in_its_start_up_takes_every_replica_down_until_it_returns(
    tmp_path: Path, replicas: list[ReplicaServer]
) -> None:
    with start_agent(tmp_path, replicas, "hang nvmlInitWithFlags") as process:
        wait_for(lambda: replies(process), ("down #nvml init stalled\n",) * 2)
        assert healthz(process)["nvml"]["state"] == "initializing"  # type: ignore[index]
        nvml_standin.set_faults(tmp_path / "root")
        wait_for(lambda: replies(process), (UP, UP))
        assert healthz(process)["nvml"]["gpu_count"] == 2  # type: ignore[index]
