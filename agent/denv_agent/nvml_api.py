"""The slice of NVML the agent uses: a protocol that `pynvml` and the test double both satisfy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from denv_agent.conditions import Effect

# Bit values of nvmlClocksEventReason* (NVML ABI constants; a test checks them against pynvml).
CLOCKS_EVENT_REASONS: Mapping[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clock": 0x100,
}

# NVML_GPU_RECOVERY_ACTION_* values and what each asks of the balancer.
RECOVERY_ACTIONS: Mapping[int, tuple[str, Effect | None]] = {
    0: ("none", None),
    1: ("gpu reset", Effect.DRAIN),
    2: ("node reboot", Effect.DOWN),
    3: ("drain p2p", Effect.DRAIN),
    4: ("drain and reset", Effect.DRAIN),
    5: ("recover imex domain", Effect.DRAIN),
    6: ("bus reset", Effect.DOWN),
    7: ("system reboot", Effect.DOWN),
}


class Nvml(Protocol):
    """Names and signatures as in nvidia-ml-py's `pynvml` module."""

    NVMLError: type[Exception]
    NVMLError_Timeout: type[Exception]
    NVMLError_GpuIsLost: type[Exception]
    NVMLError_NotSupported: type[Exception]
    NVMLError_NotFound: type[Exception]
    NVMLError_ResetRequired: type[Exception]
    NVMLError_LibRmVersionMismatch: type[Exception]
    NVML_SUCCESS: int
    NVML_TEMPERATURE_GPU: int
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED: int
    NVML_VOLATILE_ECC: int
    NVML_DEVICE_MIG_ENABLE: int
    nvmlEventTypeXidCriticalError: int

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetIndex(self, handle: Any) -> int: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTotalEccErrors(
        self, handle: Any, error_type: int, counter_type: int
    ) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: Sequence[int]) -> Sequence[Any]: ...
    def nvmlDeviceGetMigMode(self, handle: Any) -> Sequence[int]: ...
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any: ...
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any: ...
    def nvmlEventSetFree(self, event_set: Any) -> None: ...


def real_nvml() -> Nvml:
    import pynvml

    return cast(Nvml, pynvml)


def describe_error(error: BaseException) -> str:
    """Short lower-case text for an NVML (or unexpected) error, fit for a reason string."""
    if type(error).__name__ == "NVMLError_LibRmVersionMismatch":
        return "driver/library version mismatch"
    try:
        text = str(error)
    except Exception:
        text = ""
    return text.strip().rstrip(".").lower() or type(error).__name__.lower()
