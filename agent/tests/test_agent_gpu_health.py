from __future__ import annotations

import pynvml
import pytest
from denv_agent.conditions import Condition, Effect
from denv_agent.config import Thresholds
from denv_agent.gpu_health import Device, FaultBook, GpuReading, gpu_conditions, open_gpu, read_gpu
from denv_agent.nvml_double import FakeNvml
from denv_agent.xid import XidClass, XidTable

ERROR_CODES = sorted(
    {getattr(pynvml, name) for name in dir(pynvml) if name.startswith("NVML_ERROR_")}
)


def _fake(gpus: int = 1) -> FakeNvml:
    fake = FakeNvml(gpus)
    fake.nvmlInit()
    return fake


def _read(fake: FakeNvml, index: int = 0) -> GpuReading:
    device = open_gpu(fake, index)
    assert isinstance(device, Device), device
    return read_gpu(fake, device)


DEFAULTS = Thresholds()


def _conditions(fake: FakeNvml, thresholds: Thresholds = DEFAULTS) -> list[Condition]:
    return gpu_conditions(_read(fake), thresholds)


def test_healthy_gpu_reading() -> None:
    reading = _read(_fake())
    assert reading.uuid.startswith("GPU-") and reading.name == "NVIDIA H100 80GB HBM3"
    assert reading.temperature_c == 45 and reading.utilization_pct == 0
    assert reading.memory_total_bytes == 80 * 2**30 and reading.memory_used_bytes == 0
    assert reading.remap_pending is False and reading.ecc_uncorrectable == 0
    assert reading.mig_current is False and reading.recovery_action == 0
    assert reading.errors == () and not reading.lost
    assert gpu_conditions(reading, Thresholds()) == []


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ({"remap_pending": True}, Condition(Effect.DRAIN, "pending row remap")),
        ({"remap_failure": True}, Condition(Effect.DOWN, "row remap failed")),
        ({"ecc_uncorrectable": 2}, Condition(Effect.DRAIN, "uncorrectable ecc errors: 2")),
        ({"recovery_action": "gpu_reset"}, Condition(Effect.DRAIN, "recovery action: gpu reset")),
        (
            {"recovery_action": "node_reboot"},
            Condition(Effect.DOWN, "recovery action: node reboot"),
        ),
        ({"throttle": ["hw_thermal"]}, Condition(Effect.WEIGHT, "throttled: hw thermal", 50)),
        (
            {"throttle": ["hw_slowdown", "sw_thermal"]},
            Condition(Effect.WEIGHT, "throttled: hw slowdown, sw thermal", 50),
        ),
        ({"temperature_c": 85}, Condition(Effect.WEIGHT, "temperature 85c, limit 85c", 50)),
    ],
)
def test_faults_become_conditions(fault: dict[str, object], expected: Condition) -> None:
    fake = _fake()
    fake.apply({"gpu": 0, **fault})
    assert _conditions(fake) == [expected]


def test_power_cap_and_idle_do_not_lower_the_weight_by_default() -> None:
    fake = _fake()
    fake.throttle(0, "sw_power_cap", "gpu_idle")
    assert _read(fake).throttle == ("gpu_idle", "sw_power_cap")
    assert _conditions(fake) == []
    tuned = Thresholds(throttle_reasons=frozenset({"sw_power_cap"}), throttle_weight_pct=70)
    assert _conditions(fake, tuned) == [Condition(Effect.WEIGHT, "throttled: sw power cap", 70)]


def test_drivers_without_the_recovery_field_are_fine() -> None:
    fake = _fake()
    fake.gpus[0].recovery_action = None
    assert _read(fake).recovery_action is None


def test_mig_instances_are_listed_when_mig_is_on() -> None:
    fake = _fake()
    fake.set_mig_mode(0, True)
    fake.gpus[0].mig_devices = ["MIG-a", "MIG-b"]
    reading = _read(fake)
    assert reading.mig_current is True and reading.mig_devices == ("MIG-a", "MIG-b")


@pytest.mark.parametrize("code", ERROR_CODES)
def test_every_nvml_error_on_every_call_is_contained(code: int) -> None:
    fake = _fake()
    device = open_gpu(fake, 0)
    assert isinstance(device, Device)
    fake.fail_call("*", code, gpu=0)
    reading = read_gpu(fake, device)
    name = pynvml.nvmlExceptionClass(code).__name__
    if name == "NVMLError_GpuIsLost":
        assert reading.lost
    elif name == "NVMLError_ResetRequired":
        assert gpu_conditions(reading, Thresholds()) == [
            Condition(Effect.DOWN, "gpu requires reset")
        ]
    elif name == "NVMLError_LibRmVersionMismatch":
        assert gpu_conditions(reading, Thresholds()) == [
            Condition(Effect.DRAIN, "driver/library version mismatch")
        ]
    elif name == "NVMLError_NotSupported":
        assert reading.errors == () and reading.temperature_c is None
    else:
        found = gpu_conditions(reading, Thresholds())
        assert found and all(c.effect is Effect.NOTE for c in found)
        assert found[0].reason.startswith("nvml temperature: ")


def test_a_lost_gpu_stops_the_poll_at_the_first_call() -> None:
    fake = _fake()
    device = open_gpu(fake, 0)
    assert isinstance(device, Device)
    fake.lose_gpu(0)
    before = sum(fake.calls.values())
    reading = read_gpu(fake, device)
    assert reading.lost and sum(fake.calls.values()) == before + 1


def test_a_lost_gpu_at_open_is_a_lost_reading() -> None:
    fake = _fake()
    fake.lose_gpu(0)
    reading = open_gpu(fake, 0)
    assert isinstance(reading, GpuReading) and reading.lost


def test_a_misbehaving_binding_is_a_note_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake()

    def broken(handle: object) -> object:
        raise TypeError("argument 1: wrong type")

    monkeypatch.setattr(fake, "nvmlDeviceGetUtilizationRates", broken)
    reading = _read(fake)
    assert reading.errors == ("utilization: argument 1: wrong type",)
    assert reading.temperature_c == 45


@pytest.mark.parametrize(
    ("gpu", "xid", "klass", "node", "gpu_faults"),
    [
        (0, 13, XidClass.APPLICATION, (), ()),
        (0, 63, XidClass.RESET_PENDING, (), (Condition(Effect.DRAIN, "xid 63 row remap pending"),)),
        (0, 48, XidClass.GPU_FATAL, (), (Condition(Effect.DOWN, "xid 48 double-bit ecc error"),)),
        (
            0,
            109,
            XidClass.GPU_FATAL,
            (),
            (Condition(Effect.DOWN, "xid 109 context switch timeout"),),
        ),
        (0, 79, XidClass.NODE_FATAL, (Condition(Effect.DOWN, "xid 79 gpu fell off the bus"),), ()),
        (
            None,
            48,
            XidClass.GPU_FATAL,
            (Condition(Effect.DOWN, "xid 48 double-bit ecc error"),),
            (),
        ),
        (0, 999, XidClass.UNKNOWN, (), ()),
    ],
)
def test_fault_book_applies_each_class(
    gpu: int | None,
    xid: int,
    klass: XidClass,
    node: tuple[Condition, ...],
    gpu_faults: tuple[Condition, ...],
) -> None:
    book = FaultBook(XidTable.default())
    assert book.record_xid(gpu, xid) is klass
    book.record_xid(gpu, xid)
    faults = book.snapshot()
    assert faults.node == node
    assert faults.gpus.get(0, ()) == gpu_faults
    assert faults.xid_counts[gpu, xid] == 2 and faults.class_counts[gpu, klass] == 2


def test_faults_are_sticky_until_cleared() -> None:
    book = FaultBook(XidTable.default())
    book.record_xid(0, 48)
    book.record_lost(1)
    book.record_xid(1, 79)
    book.clear(0)
    faults = book.snapshot()
    assert 0 not in faults.gpus and faults.gpus[1] == (Condition(Effect.DOWN, "gpu lost"),)
    assert faults.node
    book.clear()
    assert book.snapshot().node == () and book.snapshot().gpus == {}
    assert book.snapshot().xid_counts[1, 79] == 1  # counters are history, not state
