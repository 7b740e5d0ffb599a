"""The /healthz document: everything the agent knows, for people and scripts."""

from __future__ import annotations

import time
from typing import Any

from denv_agent.engine_metrics import EngineWatch
from denv_agent.gpu_health import GpuReading
from denv_agent.nvml_api import RECOVERY_ACTIONS
from denv_agent.verdict import Snapshot


def _age(at: float | None, now: float) -> float | None:
    return None if at is None else round(now - at, 3)


def _by_xid(item: tuple[tuple[int | None, int], int]) -> int:
    return item[0][1]


def _engine(watch: EngineWatch | None) -> dict[str, Any] | None:
    if watch is None:
        return None
    return {
        "running": watch.running,
        "waiting": watch.waiting,
        "generation_tokens": watch.progress,
        "stalled_ms": None if watch.stalled_ms is None else round(watch.stalled_ms),
        "error": watch.error,
    }


def _gpu(index: int, reading: GpuReading | None, snap: Snapshot, now: float) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "index": index,
        "xid_events": snap.gpus.xid_events.get(index, "pending"),
        "xids": {
            str(xid): count
            for (gpu, xid), count in sorted(snap.gpus.faults.xid_counts.items(), key=_by_xid)
            if gpu == index
        },
        "reasons": list(snap.gpu_reasons.get(index, ())),
    }
    if reading is None:
        return doc
    action = reading.recovery_action
    doc.update(
        uuid=reading.uuid,
        name=reading.name,
        polled_age_s=_age(reading.polled_at, now),
        temperature_c=reading.temperature_c,
        utilization_pct=reading.utilization_pct,
        memory_used_bytes=reading.memory_used_bytes,
        memory_total_bytes=reading.memory_total_bytes,
        throttle=list(reading.throttle),
        ecc_uncorrectable=reading.ecc_uncorrectable,
        remapped_rows={"pending": reading.remap_pending, "failure": reading.remap_failure},
        recovery_action=None if action is None else RECOVERY_ACTIONS.get(action, ("unknown",))[0],
        mig={
            "enabled": reading.mig_current,
            "pending": reading.mig_pending,
            "devices": list(reading.mig_devices),
        },
    )
    return doc


def document(node: str, snap: Snapshot, *, simulated: bool) -> dict[str, Any]:
    now = time.monotonic()
    nvml = snap.gpus.nvml
    indexes = sorted(set(range(nvml.gpu_count)) | set(snap.gpus.readings) | set(snap.gpu_reasons))
    replicas = []
    for rid, verdict in snap.verdicts.items():
        reading = snap.replicas.get(rid)
        replicas.append(
            {
                "id": rid,
                "gpu": verdict.gpu,
                "state": verdict.state,
                "weight_pct": verdict.weight_pct if verdict.state == "up" else 0,
                "reply": verdict.reply,
                "reasons": list(verdict.reasons),
                "drained": snap.drains.drained(rid),
                "health": None
                if reading is None
                else {
                    "checks": reading.checks,
                    "failures": reading.failures,
                    "last_error": reading.last_error,
                    "last_ok_age_s": _age(reading.last_ok_at, now),
                    "probes": reading.probes,
                    "probe_failures": reading.probe_failures,
                    "probe_error": reading.probe_error,
                    "ttft_ms": None if reading.ttft_ms is None else round(reading.ttft_ms, 1),
                    "gap_ms": None if reading.gap_ms is None else round(reading.gap_ms, 1),
                    "engine": _engine(reading.engine),
                },
            }
        )
    return {
        "node": node,
        "simulated": simulated,
        "nvml": {
            "state": nvml.state,
            "error": nvml.error,
            "driver_version": nvml.driver_version,
            "gpu_count": nvml.gpu_count,
        },
        "reasons": list(snap.node_reasons),
        "drains": {
            "node": snap.drains.node,
            "replicas": sorted(snap.drains.replicas),
            "stopping": sorted(snap.drains.stopping),
        },
        "gpus": [_gpu(i, snap.gpus.readings.get(i), snap, now) for i in indexes],
        "replicas": replicas,
        "snapshot_age_s": _age(snap.taken_at, now),
    }
