from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path

import pynvml
import pytest
from denv_agent.config import ConfigError
from denv_agent.nvml_api import CLOCKS_EVENT_REASONS, RECOVERY_ACTIONS
from denv_agent.nvml_double import FakeNvml, for_config

from agent.tests.agent_testkit import make_config

API = [
    name for name in dir(FakeNvml) if name.startswith("nvml") and callable(getattr(FakeNvml, name))
]


@pytest.mark.parametrize("name", API)
def test_every_call_has_pynvmls_name_and_arity(name: str) -> None:
    real = inspect.signature(getattr(pynvml, name)).parameters
    ours = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]
    required = [p for p in real.values() if p.default is inspect.Parameter.empty]
    assert len(required) <= len(ours) <= len(real)


def test_errors_and_constants_are_pynvmls_own() -> None:
    names = [n for n in dir(FakeNvml) if n.startswith(("NVMLError", "NVML_", "nvmlEventType"))]
    assert len(names) > 10
    for name in names:
        assert getattr(FakeNvml, name) == getattr(pynvml, name), name
    assert FakeNvml.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost


PYNVML_REASONS = {
    "gpu_idle": "GpuIdle",
    "applications_clocks": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal": "SwThermalSlowdown",
    "hw_thermal": "HwThermalSlowdown",
    "hw_power_brake": "HwPowerBrakeSlowdown",
    "display_clock": "DisplayClockSetting",
}


def test_shared_tables_match_nvml_constants() -> None:
    assert set(CLOCKS_EVENT_REASONS) == set(PYNVML_REASONS)
    for name, bit in CLOCKS_EVENT_REASONS.items():
        assert getattr(pynvml, f"nvmlClocksEventReason{PYNVML_REASONS[name]}") == bit
    for value, (name, _) in RECOVERY_ACTIONS.items():
        assert (
            getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{name.upper().replace(' ', '_')}") == value
        )


def test_calls_before_init_raise_uninitialized_and_a_missing_library_says_so() -> None:
    fake = FakeNvml(1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        FakeNvml(1, library_found=False).nvmlInit()


def test_healthy_gpu_reads_like_nvml() -> None:
    fake = FakeNvml(2)
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 2
    handle = fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetIndex(handle) == 1
    assert fake.nvmlDeviceGetUUID(handle).startswith("GPU-")
    assert fake.nvmlDeviceGetMemoryInfo(handle).total == 80 * 2**30
    assert fake.nvmlDeviceGetRemappedRows(handle) == (0, 0, 0, 0)
    assert fake.nvmlDeviceGetMigMode(handle) == [0, 0]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(2)


def test_xid_reaches_registered_event_sets_and_waits_time_out() -> None:
    fake = FakeNvml(2)
    fake.nvmlInit()
    event_set = fake.nvmlEventSetCreate()
    handle = fake.nvmlDeviceGetHandleByIndex(1)
    fake.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 10)
    fake.inject_xid(0, 13)  # GPU 0 is not registered: lost, as with real NVML
    fake.inject_xid(1, 79)
    event = fake.nvmlEventSetWait_v2(event_set, 1000)
    assert (event.eventType, event.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    assert fake.nvmlDeviceGetIndex(event.device) == 1
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 10)
    fake.nvmlEventSetFree(event_set)


@pytest.mark.timing
def test_slowdown_delays_every_call_and_close_cuts_it_short() -> None:
    fake = FakeNvml(1)
    fake.nvmlInit()
    fake.set_slowdown(0.2)
    started = time.monotonic()
    fake.nvmlDeviceGetCount()
    assert time.monotonic() - started >= 0.2
    fake.set_slowdown(30)
    waiter = threading.Thread(target=fake.nvmlDeviceGetCount)
    waiter.start()
    fake.close()
    waiter.join(2)
    assert not waiter.is_alive()


def test_lost_gpu_and_injected_errors_raise_pynvml_classes() -> None:
    fake = FakeNvml(2)
    fake.nvmlInit()
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    fake.lose_gpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetTemperature(h0, pynvml.NVML_TEMPERATURE_GPU)
    fake.fail_call("nvmlDeviceGetTemperature", "NVMLError_Timeout", gpu=1)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlDeviceGetTemperature(h1, pynvml.NVML_TEMPERATURE_GPU)
    assert fake.nvmlDeviceGetName(h1)
    fake.fail_call("*", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(pynvml.NVMLError_Unknown):
        fake.nvmlDeviceGetCount()
    fake.fail_call("*", None)
    fake.repair(0)
    assert fake.nvmlDeviceGetTemperature(h0, pynvml.NVML_TEMPERATURE_GPU) == 45
    with pytest.raises(ValueError, match="unknown call"):
        fake.fail_call("nvmlNoSuchCall", "NVMLError_Timeout")
    with pytest.raises(ValueError, match="unknown NVML error"):
        fake.fail_call("*", "NVMLError_Nope")


def test_apply_scripts_every_fault() -> None:
    fake = FakeNvml(2)
    fake.apply({"gpu": 1, "remap_pending": True, "throttle": ["hw_thermal"], "temperature_c": 91})
    fake.apply({"gpu": 1, "mig": True, "mig_pending": False, "recovery_action": "gpu_reset"})
    fake.apply({"gpu": 0, "lost": True, "ecc_uncorrectable": 2})
    fake.apply({"gpu": 0, "error": "NVMLError_Timeout", "call": "nvmlDeviceGetName"})
    fake.apply({"slow_s": 0.5})
    sim0, sim1 = fake.gpus
    assert sim1.remap_pending and sim1.temperature_c == 91
    assert sim1.clocks_event_reasons == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert sim1.mig_current and not sim1.mig_pending and sim1.recovery_action == 1
    assert sim0.lost and sim0.ecc_uncorrectable == 2
    assert fake.slow_s == 0.5
    fake.apply({"gpu": 0, "repair": True})
    assert not sim0.lost and sim0.ecc_uncorrectable == 0


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ({}, "empty command"),
        ({"xid": 79}, "'xid' needs a gpu"),
        ({"gpu": 9, "xid": 79}, "no simulated gpu 9"),
        ({"gpu": "0", "xid": 79}, "gpu must be a GPU index"),
        ({"gpu": 0, "lost": "yes"}, "lost must be true or false"),
        ({"gpu": 0, "throttle": ["warm"]}, "unknown throttle reason"),
        ({"gpu": 0, "melt": True}, "unknown fault 'melt'"),
        ({"gpu": 0, "recovery_action": "pray"}, "recovery_action must be one of"),
        ({"slow_s": -1}, "slow_s must be a number"),
        ({"gpu": 0, "call": "nvmlDeviceGetName"}, "call needs an error"),
        ({"gpu": 3, "error": "NVMLError_Timeout"}, "no simulated gpu 3"),
    ],
)
def test_apply_refuses_bad_commands(command: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FakeNvml(1).apply(command)


def test_for_config_builds_the_node_the_replicas_need(tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        [
            {"id": "a", "health_url": "http://x/h", "gpu": 0},
            {"id": "b", "health_url": "http://x/h", "gpu": 2, "mig_uuid": "MIG-b"},
        ],
        simulate={"gpu_name": "NVIDIA A100-SXM4-80GB", "slow_s": 0.25},
    )
    fake = for_config(config)
    assert len(fake.gpus) == 3
    assert fake.gpus[2].mig_current and fake.gpus[2].mig_devices == ["MIG-b"]
    assert fake.gpus[0].name == "NVIDIA A100-SXM4-80GB" and fake.slow_s == 0.25
    orphan = make_config(tmp_path, [{"id": "c", "health_url": "http://x/h", "mig_uuid": "MIG-c"}])
    with pytest.raises(ConfigError, match=r"replicas\[0\].gpu: missing"):
        for_config(orphan)
