"""A scriptable stand-in for `pynvml`: same function names, same error classes, simulated GPUs.

Used by the tests and by `denv-agent --simulate`. Errors are pynvml's own classes, so code that
handles the real library handles the double unchanged.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pynvml

from denv_agent.config import AgentConfig, ConfigError
from denv_agent.nvml_api import CLOCKS_EVENT_REASONS, RECOVERY_ACTIONS

_RECOVERY_BY_NAME = {name.replace(" ", "_"): value for value, (name, _) in RECOVERY_ACTIONS.items()}
_ERROR_CODES: dict[str, int] = {
    pynvml.nvmlExceptionClass(getattr(pynvml, name)).__name__: getattr(pynvml, name)
    for name in dir(pynvml)
    if name.startswith("NVML_ERROR_")
}


@dataclass
class SimulatedGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    temperature_c: int = 45
    utilization_gpu: int = 0
    utilization_memory: int = 0
    memory_total: int = 80 * 2**30
    memory_used: int = 0
    ecc_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    clocks_event_reasons: int = 0
    mig_current: bool = False
    mig_pending: bool = False
    mig_devices: list[str] = field(default_factory=list)
    # None: the driver predates the recovery-action field.
    recovery_action: int | None = 0
    lost: bool = False


# What a repair puts back to healthy; the identity, memory size and MIG layout stay.
_FAULT_FIELDS = (
    "temperature_c",
    "ecc_uncorrectable",
    "remap_pending",
    "remap_failure",
    "clocks_event_reasons",
    "recovery_action",
    "lost",
)


@dataclass(frozen=True, eq=False)
class _Handle:
    gpu: int
    mig: int | None = None


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _Value:
    uiVal: int


@dataclass(frozen=True)
class _FieldValue:
    fieldId: int
    nvmlReturn: int
    value: _Value


@dataclass(frozen=True)
class _EventData:
    device: _Handle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass(eq=False)
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)
    queue: collections.deque[_EventData] = field(default_factory=collections.deque)
    freed: bool = False


class FakeNvml:
    """pynvml's API over simulated GPUs, plus methods to script faults."""

    NVMLError: type[Exception] = pynvml.NVMLError
    NVMLError_Timeout: type[Exception] = pynvml.NVMLError_Timeout
    NVMLError_GpuIsLost: type[Exception] = pynvml.NVMLError_GpuIsLost
    NVMLError_NotSupported: type[Exception] = pynvml.NVMLError_NotSupported
    NVMLError_NotFound: type[Exception] = pynvml.NVMLError_NotFound
    NVMLError_ResetRequired: type[Exception] = pynvml.NVMLError_ResetRequired
    NVMLError_LibRmVersionMismatch: type[Exception] = pynvml.NVMLError_LibRmVersionMismatch
    NVMLError_LibraryNotFound: type[Exception] = pynvml.NVMLError_LibraryNotFound
    NVMLError_Uninitialized: type[Exception] = pynvml.NVMLError_Uninitialized
    NVML_SUCCESS: int = pynvml.NVML_SUCCESS
    NVML_TEMPERATURE_GPU: int = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED: int = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC: int = pynvml.NVML_VOLATILE_ECC
    NVML_DEVICE_MIG_ENABLE: int = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: int = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    nvmlEventTypeXidCriticalError: int = pynvml.nvmlEventTypeXidCriticalError

    def __init__(
        self,
        gpus: int | Sequence[SimulatedGpu] = 1,
        *,
        library_found: bool = True,
        driver_version: str = "550.54.15",
    ) -> None:
        self.gpus = [SimulatedGpu() for _ in range(gpus)] if isinstance(gpus, int) else list(gpus)
        for index, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or f"GPU-00000000-0000-0000-0000-{index:012d}"
        self.library_found = library_found
        self.driver_version = driver_version
        self.slow_s = 0.0
        self.initialized = False
        self.calls: collections.Counter[str] = collections.Counter()
        self._failures: dict[tuple[str, int | None], int] = {}
        self._event_sets: list[_EventSet] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = threading.Event()

    # -- scripting ------------------------------------------------------------------------------

    def inject_xid(self, gpu: int, xid: int) -> None:
        """Deliver an XID to every event set registered for critical XIDs on this GPU."""
        self._gpu(gpu)
        with self._changed:
            for event_set in self._event_sets:
                if event_set.registered.get(gpu, 0) & self.nvmlEventTypeXidCriticalError:
                    event_set.queue.append(
                        _EventData(_Handle(gpu), self.nvmlEventTypeXidCriticalError, xid)
                    )
            self._changed.notify_all()

    def lose_gpu(self, gpu: int) -> None:
        self._gpu(gpu).lost = True

    def set_pending_remap(self, gpu: int, pending: bool = True) -> None:
        self._gpu(gpu).remap_pending = pending

    def throttle(self, gpu: int, *reasons: str) -> None:
        """Set the GPU's clock event reasons by name (see CLOCKS_EVENT_REASONS); none clears."""
        mask = 0
        for reason in reasons:
            if reason not in CLOCKS_EVENT_REASONS:
                raise ValueError(f"unknown throttle reason {reason!r}")
            mask |= CLOCKS_EVENT_REASONS[reason]
        self._gpu(gpu).clocks_event_reasons = mask

    def set_mig_mode(self, gpu: int, current: bool, pending: bool | None = None) -> None:
        sim = self._gpu(gpu)
        sim.mig_current = current
        sim.mig_pending = current if pending is None else pending

    def set_slowdown(self, seconds: float) -> None:
        """Every later call sleeps this long first, as NVML does on a wedged GPU."""
        self.slow_s = max(0.0, seconds)

    def fail_call(self, call: str, error: int | str | None, gpu: int | None = None) -> None:
        """Make `call` (on one GPU, or on any) raise the NVML error with this code or class name."""
        if call != "*" and not callable(getattr(self, call, None)):
            raise ValueError(f"unknown call {call!r}")
        if gpu is not None:
            self._gpu(gpu)
        key = (call, gpu)
        if error is None:
            self._failures.pop(key, None)
            return
        code = _ERROR_CODES.get(error) if isinstance(error, str) else error
        if code is None:
            raise ValueError(f"unknown NVML error {error!r}")
        self._failures[key] = code

    def repair(self, gpu: int) -> None:
        """Back to a healthy GPU, as after a successful reset."""
        sim, healthy = self._gpu(gpu), SimulatedGpu()
        for name in _FAULT_FIELDS:
            setattr(sim, name, getattr(healthy, name))
        for key in [key for key in self._failures if key[1] == gpu]:
            del self._failures[key]

    def apply(self, command: Mapping[str, object]) -> None:
        """Apply one JSON fault command, as sent to POST /control/simulate."""
        command = dict(command)
        slow = command.pop("slow_s", None)
        if slow is not None:
            self.set_slowdown(_number(slow, "slow_s"))
        gpu_value = command.pop("gpu", None)
        if gpu_value is None:
            if command:
                raise ValueError(f"{sorted(command)[0]!r} needs a gpu")
            if slow is None:
                raise ValueError("empty command")
            return
        if isinstance(gpu_value, bool) or not isinstance(gpu_value, int):
            raise ValueError("gpu must be a GPU index")
        gpu = gpu_value
        sim = self._gpu(gpu)
        if command.pop("repair", False):
            self.repair(gpu)
        call = command.pop("call", "*")
        if "error" in command:
            error = command.pop("error")
            if not isinstance(call, str) or not isinstance(error, str | int | type(None)):
                raise ValueError("error needs an NVMLError_* name and call a function name")
            self.fail_call(call, error, gpu)
        elif call != "*":
            raise ValueError("call needs an error")
        for key, value in command.items():
            self._apply_one(gpu, sim, key, value)

    def _apply_one(self, gpu: int, sim: SimulatedGpu, key: str, value: object) -> None:
        if key == "xid":
            self.inject_xid(gpu, int(_number(value, key)))
        elif key in ("lost", "remap_pending", "remap_failure", "mig_pending"):
            setattr(sim, key, _flag(value, key))
        elif key == "mig":
            self.set_mig_mode(gpu, _flag(value, key))
        elif key in ("temperature_c", "utilization_gpu", "ecc_uncorrectable", "memory_used"):
            setattr(sim, key, int(_number(value, key)))
        elif key == "throttle":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError("throttle must be a list of reason names")
            self.throttle(gpu, *value)
        elif key == "recovery_action":
            if value not in _RECOVERY_BY_NAME:
                raise ValueError(f"recovery_action must be one of {sorted(_RECOVERY_BY_NAME)}")
            sim.recovery_action = _RECOVERY_BY_NAME[str(value)]
        else:
            raise ValueError(f"unknown fault {key!r}")

    def close(self) -> None:
        """Cut short every sleeping or waiting call, so threads blocked in the double can exit."""
        self._closed.set()
        with self._changed:
            self._changed.notify_all()

    # -- pynvml API -----------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._check_gpu("nvmlDeviceGetHandleByIndex", index)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._device("nvmlDeviceGetIndex", handle)
        return handle.gpu

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        sim = self._device("nvmlDeviceGetUUID", handle)
        return sim.uuid if handle.mig is None else sim.mig_devices[handle.mig]

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        return self._device("nvmlDeviceGetTemperature", handle).temperature_c

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> _Utilization:
        sim = self._device("nvmlDeviceGetUtilizationRates", handle)
        return _Utilization(sim.utilization_gpu, sim.utilization_memory)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> _Memory:
        sim = self._device("nvmlDeviceGetMemoryInfo", handle)
        return _Memory(sim.memory_total, sim.memory_total - sim.memory_used, sim.memory_used)

    def nvmlDeviceGetTotalEccErrors(
        self, handle: _Handle, error_type: int, counter_type: int
    ) -> int:
        sim = self._device("nvmlDeviceGetTotalEccErrors", handle)
        return sim.ecc_uncorrectable if error_type == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0

    def nvmlDeviceGetRemappedRows(self, handle: _Handle) -> tuple[int, int, int, int]:
        sim = self._device("nvmlDeviceGetRemappedRows", handle)
        return (0, 0, int(sim.remap_pending), int(sim.remap_failure))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return self._device("nvmlDeviceGetCurrentClocksEventReasons", handle).clocks_event_reasons

    def nvmlDeviceGetFieldValues(
        self, handle: _Handle, field_ids: Sequence[int]
    ) -> list[_FieldValue]:
        sim = self._device("nvmlDeviceGetFieldValues", handle)
        values = []
        for field_id in field_ids:
            known = field_id == self.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
            action = sim.recovery_action if known else None
            result = pynvml.NVML_ERROR_NOT_SUPPORTED if action is None else self.NVML_SUCCESS
            values.append(_FieldValue(field_id, result, _Value(action or 0)))
        return values

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        sim = self._device("nvmlDeviceGetMigMode", handle)
        return [int(sim.mig_current), int(sim.mig_pending)]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._device("nvmlDeviceGetMaxMigDeviceCount", handle)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        sim = self._device("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if not sim.mig_current:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(sim.mig_devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _Handle(handle.gpu, index)

    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        self._device("nvmlDeviceGetSupportedEventTypes", handle)
        return int(pynvml.nvmlEventTypeAll)

    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        event_set = _EventSet()
        with self._lock:
            self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(
        self, handle: _Handle, event_types: int, event_set: _EventSet
    ) -> None:
        self._device("nvmlDeviceRegisterEvents", handle)
        with self._lock:
            event_set.registered[handle.gpu] = event_set.registered.get(handle.gpu, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> _EventData:
        self._enter("nvmlEventSetWait_v2")
        with self._changed:
            self._changed.wait_for(
                lambda: bool(event_set.queue) or self._closed.is_set(), timeout_ms / 1000
            )
            if event_set.queue:
                return event_set.queue.popleft()
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        with self._lock:
            event_set.freed = True
            if event_set in self._event_sets:
                self._event_sets.remove(event_set)

    # -- internals ------------------------------------------------------------------------------

    def _gpu(self, gpu: int) -> SimulatedGpu:
        if not 0 <= gpu < len(self.gpus):
            raise ValueError(f"no simulated gpu {gpu} (this node has {len(self.gpus)})")
        return self.gpus[gpu]

    def _enter(self, call: str) -> None:
        """What every call does first: the slowdown, then the errors real NVML would raise."""
        self.calls[call] += 1
        if self.slow_s > 0:
            self._closed.wait(self.slow_s)
        if not self.library_found:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if call != "nvmlInit" and not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        code = self._failures.get((call, None)) or self._failures.get(("*", None))
        if code:
            raise pynvml.NVMLError(code)

    def _device(self, call: str, handle: _Handle) -> SimulatedGpu:
        self._enter(call)
        return self._check_gpu(call, handle.gpu)

    def _check_gpu(self, call: str, gpu: int) -> SimulatedGpu:
        sim = self.gpus[gpu]
        if sim.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        code = self._failures.get((call, gpu)) or self._failures.get(("*", gpu))
        if code:
            raise pynvml.NVMLError(code)
        return sim


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key} must be a number, 0 or more")
    return float(value)


def _flag(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false")
    return value


def for_config(config: AgentConfig) -> FakeNvml:
    """Healthy simulated GPUs for a node: enough for its replicas, MIG on where they ask for it."""
    layout: dict[int, list[str]] = {}
    for n, replica in enumerate(config.replicas):
        if replica.mig_uuid is None:
            continue
        if replica.gpu is None:
            raise ConfigError(
                f"replicas[{n}].gpu", "missing (--simulate places MIG slices by gpu)", "add gpu = 0"
            )
        layout.setdefault(replica.gpu, []).append(replica.mig_uuid)
    needed = 1 + max((r.gpu for r in config.replicas if r.gpu is not None), default=0)
    sims = [
        SimulatedGpu(name=config.simulate.gpu_name)
        for _ in range(max(config.simulate.gpus or 0, needed))
    ]
    for index, uuids in layout.items():
        sims[index].mig_current = sims[index].mig_pending = True
        sims[index].mig_devices = uuids
    fake = FakeNvml(sims)
    fake.set_slowdown(config.simulate.slow_s)
    return fake
