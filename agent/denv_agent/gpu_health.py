"""One GPU's health: a reading through NVML, the conditions it implies, and sticky faults."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from denv_agent import conditions
from denv_agent.conditions import Condition, Effect
from denv_agent.config import Thresholds
from denv_agent.nvml_api import CLOCKS_EVENT_REASONS, RECOVERY_ACTIONS, Nvml, describe_error
from denv_agent.xid import XidClass, XidTable, describe

log = logging.getLogger("denv_agent.gpu")

T = TypeVar("T")


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str = ""
    name: str = ""
    polled_at: float | None = None
    temperature_c: int | None = None
    utilization_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    throttle: tuple[str, ...] = ()
    ecc_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    recovery_action: int | None = None
    mig_current: bool | None = None
    mig_pending: bool | None = None
    mig_devices: tuple[str, ...] = ()
    lost: bool = False
    reset_required: bool = False
    version_mismatch: bool = False
    errors: tuple[str, ...] = ()


class _Reader:
    """Runs NVML reads for one GPU, turning each failure into a note instead of an exception."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self.errors: list[str] = []
        self.lost = False
        self.reset_required = False
        self.version_mismatch = False

    def read(self, what: str, call: Callable[[], T]) -> T | None:
        if self.lost:
            return None
        nvml = self.nvml
        try:
            return call()
        except nvml.NVMLError_NotSupported:
            return None
        except nvml.NVMLError_GpuIsLost:
            self.lost = True
        except nvml.NVMLError_ResetRequired:
            self.reset_required = True
        except nvml.NVMLError_LibRmVersionMismatch:
            self.version_mismatch = True
        except Exception as e:  # an NVML error of any other kind, or a misbehaving binding
            self.errors.append(f"{what}: {describe_error(e)}")
        return None

    def finish(self, index: int, **values: Any) -> GpuReading:
        return GpuReading(
            index=index,
            polled_at=time.monotonic(),
            lost=self.lost,
            reset_required=self.reset_required,
            version_mismatch=self.version_mismatch,
            errors=tuple(self.errors),
            **values,
        )


@dataclass(frozen=True)
class Device:
    index: int
    handle: Any
    uuid: str
    name: str


def open_gpu(nvml: Nvml, index: int) -> Device | GpuReading:
    """A handle and identity for one GPU, or a reading that says why there is none."""
    r = _Reader(nvml)
    handle = r.read("handle", lambda: nvml.nvmlDeviceGetHandleByIndex(index))
    if handle is None:
        return r.finish(index)
    uuid = r.read("uuid", lambda: nvml.nvmlDeviceGetUUID(handle)) or ""
    name = r.read("name", lambda: nvml.nvmlDeviceGetName(handle)) or ""
    return Device(index, handle, uuid, name)


def read_gpu(nvml: Nvml, device: Device) -> GpuReading:
    r = _Reader(nvml)
    handle = device.handle
    temperature = r.read(
        "temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
    )
    utilization = r.read("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    memory = r.read("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    ecc = r.read(
        "ecc",
        lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        ),
    )
    remap = r.read("remapped rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    clocks = r.read("clock events", lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    mig = r.read("mig mode", lambda: nvml.nvmlDeviceGetMigMode(handle))
    mig_on = mig is not None and mig[0] == nvml.NVML_DEVICE_MIG_ENABLE
    mig_devices = _mig_devices(nvml, r, handle) if mig_on else ()
    return r.finish(
        device.index,
        uuid=device.uuid,
        name=device.name,
        temperature_c=None if temperature is None else int(temperature),
        utilization_pct=None if utilization is None else int(utilization.gpu),
        memory_used_bytes=None if memory is None else int(memory.used),
        memory_total_bytes=None if memory is None else int(memory.total),
        throttle=tuple(n for n, bit in CLOCKS_EVENT_REASONS.items() if clocks and clocks & bit),
        ecc_uncorrectable=None if ecc is None else int(ecc),
        remap_pending=None if remap is None else bool(remap[2]),
        remap_failure=None if remap is None else bool(remap[3]),
        recovery_action=_recovery_action(nvml, r, handle),
        mig_current=None if mig is None else mig[0] == nvml.NVML_DEVICE_MIG_ENABLE,
        mig_pending=None if mig is None else mig[1] == nvml.NVML_DEVICE_MIG_ENABLE,
        mig_devices=mig_devices,
    )


def _mig_devices(nvml: Nvml, r: _Reader, handle: Any) -> tuple[str, ...]:
    count = r.read("mig devices", lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0
    uuids = []
    for slot in range(count):
        uuid = r.read("mig device", functools.partial(_mig_uuid, nvml, handle, slot))
        if uuid:
            uuids.append(uuid)
    return tuple(uuids)


def _mig_uuid(nvml: Nvml, handle: Any, slot: int) -> str | None:
    try:
        mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
    except nvml.NVMLError_NotFound:
        return None  # an empty slot
    return nvml.nvmlDeviceGetUUID(mig)


def _recovery_action(nvml: Nvml, r: _Reader, handle: Any) -> int | None:
    # Only recent drivers and nvidia-ml-py releases have this field.
    field_id = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        return None
    values = r.read("recovery action", lambda: nvml.nvmlDeviceGetFieldValues(handle, [field_id]))
    if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
        return None
    return int(values[0].value.uiVal)


def gpu_conditions(reading: GpuReading, thresholds: Thresholds) -> list[Condition]:
    """What one reading says about every replica on this GPU (sticky faults are kept elsewhere)."""
    found: list[Condition] = []
    if reading.reset_required:
        found.append(conditions.down("gpu requires reset"))
    if reading.remap_failure:
        found.append(conditions.down("row remap failed"))
    if reading.version_mismatch:
        found.append(conditions.drain("driver/library version mismatch"))
    if reading.remap_pending:
        found.append(conditions.drain("pending row remap"))
    if reading.ecc_uncorrectable:
        # Volatile counts reset with the GPU, so a non-zero count means a reset is still owed.
        found.append(conditions.drain(f"uncorrectable ecc errors: {reading.ecc_uncorrectable}"))
    if reading.recovery_action is not None:
        name, effect = RECOVERY_ACTIONS.get(reading.recovery_action, ("unknown", Effect.DRAIN))
        if effect is not None:
            found.append(Condition(effect, f"recovery action: {name}"))
    throttled = [t.replace("_", " ") for t in reading.throttle if t in thresholds.throttle_reasons]
    if throttled:
        found.append(
            conditions.weight(f"throttled: {', '.join(throttled)}", thresholds.throttle_weight_pct)
        )
    if reading.temperature_c is not None and reading.temperature_c >= thresholds.temperature_c:
        found.append(
            conditions.weight(
                f"temperature {reading.temperature_c}c, limit {thresholds.temperature_c}c",
                thresholds.hot_weight_pct,
            )
        )
    found.extend(conditions.note(f"nvml {error}") for error in reading.errors)
    return found


@dataclass(frozen=True)
class Faults:
    node: tuple[Condition, ...] = ()
    gpus: Mapping[int, tuple[Condition, ...]] = field(default_factory=dict)
    xid_counts: Mapping[tuple[int | None, int], int] = field(default_factory=dict)
    class_counts: Mapping[tuple[int | None, XidClass], int] = field(default_factory=dict)


class FaultBook:
    """Sticky faults: they stay until the agent restarts or an operator clears them."""

    def __init__(self, table: XidTable) -> None:
        self.table = table
        self._lock = threading.Lock()
        self._node: list[Condition] = []
        self._gpus: dict[int, list[Condition]] = {}
        self._xids: Counter[tuple[int | None, int]] = Counter()
        self._classes: Counter[tuple[int | None, XidClass]] = Counter()

    def record_xid(self, gpu: int | None, xid: int) -> XidClass:
        """Count an XID and apply its class. `gpu` is None when the event named no known GPU."""
        klass = self.table.classify(xid)
        where = "gpu ?" if gpu is None else f"gpu {gpu}"
        log.warning("%s: %s (%s)", where, describe(xid), klass.value)
        with self._lock:
            self._xids[gpu, xid] += 1
            self._classes[gpu, klass] += 1
        if klass is XidClass.NODE_FATAL or (klass is XidClass.GPU_FATAL and gpu is None):
            # A fatal XID we cannot pin on one GPU could be on any of them.
            self._add(None, conditions.down(describe(xid)))
        elif klass is XidClass.GPU_FATAL:
            self._add(gpu, conditions.down(describe(xid)))
        elif klass is XidClass.RESET_PENDING:
            self._add(gpu, conditions.drain(describe(xid)))
        return klass

    def record_lost(self, gpu: int) -> None:
        if self._add(gpu, conditions.down("gpu lost")):
            log.error("gpu %d: lost (fell off the bus or stopped answering NVML)", gpu)

    def clear(self, gpu: int | None = None) -> None:
        """The repair flow's last step: forget faults on one GPU, or on the whole node."""
        with self._lock:
            if gpu is None:
                self._node.clear()
                self._gpus.clear()
            else:
                self._gpus.pop(gpu, None)

    def snapshot(self) -> Faults:
        with self._lock:
            return Faults(
                node=tuple(self._node),
                gpus={gpu: tuple(found) for gpu, found in self._gpus.items()},
                xid_counts=dict(self._xids),
                class_counts=dict(self._classes),
            )

    def _add(self, gpu: int | None, condition: Condition) -> bool:
        with self._lock:
            found = self._node if gpu is None else self._gpus.setdefault(gpu, [])
            if condition in found:
                return False
            found.append(condition)
            return True
