"""NVML off the reply path: one poller thread per GPU and one thread waiting on XID events."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from denv_agent.config import AgentConfig
from denv_agent.gpu_health import Device, FaultBook, Faults, GpuReading, open_gpu, read_gpu
from denv_agent.nvml_api import Nvml, describe_error
from denv_agent.periodic import start_periodic

log = logging.getLogger("denv_agent.gpu")

NVML_RETRY_S = 30.0
# Short, so that stopping the agent never waits long on a thread parked in NVML.
XID_WAIT_MS = 200
_JOIN_S = 2.0


@dataclass(frozen=True)
class NvmlStatus:
    state: str  # "initializing", "ok" or "unavailable"
    error: str | None = None
    driver_version: str | None = None
    gpu_count: int = 0


@dataclass(frozen=True)
class GpuView:
    nvml: NvmlStatus
    readings: Mapping[int, GpuReading]
    faults: Faults
    xid_events: Mapping[int, str]
    stalled_s: Mapping[int, float]
    # How long NVML's start-up (nvmlInit, count, handles) has run, once past the stall limit.
    init_stalled_s: float | None = None
    # How long the wait for XID events has been inside NVML, once past the stall limit: new
    # XIDs go unseen meanwhile.
    xid_wait_stalled_s: float | None = None


class GpuMonitor:
    def __init__(self, nvml: Nvml, config: AgentConfig, on_change: Callable[[], None]) -> None:
        self.nvml = nvml
        self.config = config
        self.on_change = on_change
        self.faults = FaultBook(config.xids)
        self._status = NvmlStatus("initializing")
        self._devices: dict[int, Device] = {}
        self._readings: dict[int, GpuReading] = {}
        self._xid_events: dict[int, str] = {}
        self._poll_started: dict[int, float] = {}
        self._open_started: float | None = None
        self._xid_wait_started: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="nvml", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + _JOIN_S
        for thread in self._threads:
            # A thread stuck inside a real NVML call cannot be interrupted; it is a daemon.
            thread.join(max(0.0, deadline - time.monotonic()))

    def view(self) -> GpuView:
        now = time.monotonic()
        stall_s = self.config.intervals.nvml_stall_s
        stalled = {
            gpu: now - started
            for gpu, started in self._poll_started.copy().items()
            if now - started >= stall_s
        }
        opening, waiting = self._open_started, self._xid_wait_started
        return GpuView(
            nvml=self._status,
            readings=self._readings.copy(),
            faults=self.faults.snapshot(),
            xid_events=self._xid_events.copy(),
            stalled_s=stalled,
            init_stalled_s=_stalled(opening, now, stall_s),
            xid_wait_stalled_s=_stalled(waiting, now, stall_s),
        )

    def _run(self) -> None:
        devices = self._open()
        while devices is None:
            if self._stop.wait(NVML_RETRY_S):
                return
            devices = self._open()
        for index in range(len(devices)):
            self._threads.append(
                start_periodic(
                    f"gpu{index}",
                    self.config.intervals.gpu_poll_s,
                    functools.partial(self._poll, index),
                    self._stop,
                )
            )
        self._watch_xids(devices)

    def _open(self) -> list[Device | GpuReading] | None:
        nvml = self.nvml
        self._open_started = time.monotonic()
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            error = describe_error(e)
            if self._status.error != error:
                log.warning(
                    "nvml unavailable (%s): every replica reports down #nvml unavailable; "
                    "retrying every %.0f s",
                    error,
                    NVML_RETRY_S,
                )
            self._open_started = None
            self._status = NvmlStatus("unavailable", error)
            self.on_change()
            return None
        try:
            driver: str | None = nvml.nvmlSystemGetDriverVersion()
        except Exception:
            driver = None
        opened = [open_gpu(nvml, index) for index in range(count)]
        for item in opened:
            self._store_open(item)
        log.info("nvml: driver %s, %d gpu(s)", driver or "unknown", count)
        self._open_started = None
        self._status = NvmlStatus("ok", driver_version=driver, gpu_count=count)
        self.on_change()
        return opened

    def _store_open(self, item: Device | GpuReading) -> None:
        if isinstance(item, Device):
            self._devices[item.index] = item
        else:
            self._store(item)

    def _poll(self, index: int) -> None:
        self._poll_started[index] = time.monotonic()
        try:
            device = self._devices.get(index)
            if device is None:
                self._store_open(open_gpu(self.nvml, index))
                device = self._devices.get(index)
            if device is not None:
                self._store(read_gpu(self.nvml, device))
        finally:
            self._poll_started.pop(index, None)

    def _store(self, reading: GpuReading) -> None:
        if reading.lost:
            self.faults.record_lost(reading.index)
        self._readings[reading.index] = reading
        self.on_change()

    def _watch_xids(self, opened: list[Device | GpuReading]) -> None:
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except Exception as e:
            error = f"failed: {describe_error(e)}"
            self._xid_events.update(dict.fromkeys(range(len(opened)), error))
            log.warning("xid events unavailable: %s", error)
            return
        try:
            for item in opened:
                self._xid_events[item.index] = (
                    self._register(event_set, item.handle)
                    if isinstance(item, Device)
                    else "failed: no handle"
                )
            self.on_change()
            if "registered" in self._xid_events.values():
                self._wait_loop(event_set)
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception as e:
                log.debug("freeing the event set: %s", describe_error(e))

    def _register(self, event_set: Any, handle: Any) -> str:
        nvml = self.nvml
        xid_bit = nvml.nvmlEventTypeXidCriticalError
        try:
            if not nvml.nvmlDeviceGetSupportedEventTypes(handle) & xid_bit:
                return "unsupported"
            nvml.nvmlDeviceRegisterEvents(handle, xid_bit, event_set)
        except nvml.NVMLError_NotSupported:
            return "unsupported"
        except Exception as e:
            return f"failed: {describe_error(e)}"
        return "registered"

    def _wait_loop(self, event_set: Any) -> None:
        nvml = self.nvml
        last_error = ""
        while not self._stop.is_set():
            self._xid_wait_started = time.monotonic()
            try:
                event = nvml.nvmlEventSetWait_v2(event_set, XID_WAIT_MS)
            except nvml.NVMLError_Timeout:
                continue
            except Exception as e:
                if describe_error(e) != last_error:
                    last_error = describe_error(e)
                    log.warning("waiting for xid events: %s", last_error)
                self._stop.wait(XID_WAIT_MS / 1000)
                continue
            finally:
                self._xid_wait_started = None
            if event.eventType & nvml.nvmlEventTypeXidCriticalError:
                self.faults.record_xid(self._event_gpu(event), int(event.eventData))
                self.on_change()

    def _event_gpu(self, event: Any) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetIndex(event.device))
        except Exception:
            return None


def _stalled(started: float | None, now: float, limit_s: float) -> float | None:
    """How long a call begun at `started` has run, once past `limit_s`; None before (or idle)."""
    return None if started is None or now - started < limit_s else now - started
