"""From every health source to one verdict per replica, and the snapshot the servers answer from."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from denv_agent import conditions
from denv_agent.conditions import Condition, Effect
from denv_agent.config import AgentConfig, Replica
from denv_agent.gpu_health import gpu_conditions
from denv_agent.gpu_monitor import GpuView
from denv_agent.pod_resources import Assigned
from denv_agent.replica_health import ReplicaReading, replica_conditions
from denv_agent.state import Drains

_MAX_REASON = 100
_UNSAFE = re.compile(r"[^\x20-\x7e]|#")


def clean_reason(reason: str) -> str:
    """A reason HAProxy can show: one short printable line, no `#`."""
    text = " ".join(_UNSAFE.sub(" ", reason).split()).lower()
    return text[:_MAX_REASON].rstrip()


@dataclass(frozen=True)
class Verdict:
    state: str  # "up", "drain" or "down"
    weight_pct: int
    reasons: tuple[str, ...]
    gpu: int | None = None

    @property
    def reply(self) -> str:
        if self.state == "up":
            # `ready` is what ends a DRAIN (or MAINT) that this agent set earlier: HAProxy
            # leaves an agent-set drain only on that word, and `up` alone would keep it.
            return f"up ready {self.weight_pct}%"
        return f"{self.state} #{clean_reason(self.reasons[0])}"


def decide(found: Iterable[Condition], gpu: int | None = None) -> Verdict:
    """down > drain > up; `up` takes the lowest weight asked for, and never 0%."""
    ordered = sorted(found, key=lambda c: -c.effect)
    reasons = tuple(dict.fromkeys(c.reason for c in ordered))
    strongest = ordered[0].effect if ordered else Effect.NOTE
    if strongest is Effect.DOWN:
        return Verdict("down", 0, reasons, gpu)
    if strongest is Effect.DRAIN:
        return Verdict("drain", 0, reasons, gpu)
    weights = [c.weight_pct for c in ordered if c.effect is Effect.WEIGHT]
    return Verdict("up", max(1, min(weights, default=100)), reasons, gpu)


@dataclass(frozen=True)
class Snapshot:
    verdicts: Mapping[str, Verdict]
    replies: Mapping[str, bytes]
    gpus: GpuView
    replicas: Mapping[str, ReplicaReading]
    drains: Drains
    node_reasons: tuple[str, ...] = ()
    gpu_reasons: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.monotonic)


def compose(
    config: AgentConfig,
    gpus: GpuView,
    replicas: Mapping[str, ReplicaReading],
    drains: Drains,
    pods: Mapping[str, Assigned] | None = None,
) -> Snapshot:
    """`pods`: on Kubernetes, the devices of the replicas whose pods run on this node (see
    pod_resources.replica_devices). A replica given by pod but not there has no verdict here:
    the agent-check answers it as unknown, so the gateway asks another node's agent."""
    thresholds = config.thresholds
    node = _node_conditions(gpus, drains)
    per_gpu: dict[int, list[Condition]] = {}
    for index in sorted(set(gpus.readings) | set(gpus.faults.gpus) | set(gpus.stalled_s)):
        reading = gpus.readings.get(index)
        found = gpu_conditions(reading, thresholds) if reading else []
        found.extend(gpus.faults.gpus.get(index, ()))
        if index in gpus.stalled_s:
            found.append(conditions.note(f"nvml poll stalled {gpus.stalled_s[index]:.0f}s"))
        per_gpu[index] = found
    verdicts: dict[str, Verdict] = {}
    for configured in config.replicas:
        replica, found = configured, []
        if configured.pod is not None:
            assigned = (pods or {}).get(configured.id)
            if assigned is None:
                continue
            replica, found = _pod_device(configured, assigned, gpus)
        gpu, placed = _placement(replica, gpus)
        found += placed
        found = node + found + per_gpu.get(gpu, []) if gpu is not None else node + found
        found += replica_conditions(replicas.get(replica.id, ReplicaReading()), replica, thresholds)
        if replica.id in drains.replicas:
            found.append(conditions.drain("operator"))
        if replica.id in drains.stopping:
            found.append(conditions.drain("pod stopping"))
        verdicts[replica.id] = decide(found, gpu)
    return Snapshot(
        verdicts=verdicts,
        replies={rid: f"{v.reply}\n".encode() for rid, v in verdicts.items()},
        gpus=gpus,
        replicas=replicas,
        drains=drains,
        node_reasons=tuple(c.reason for c in node),
        gpu_reasons={i: tuple(dict.fromkeys(c.reason for c in f)) for i, f in per_gpu.items()},
    )


def not_warm(verdict: Verdict, reading: ReplicaReading, replica: Replica) -> str | None:
    """Why a replica whose pod is on this node is not warm yet, or None when it is: it answers
    its health check and is not down, and where it has a first-token probe, a probe has streamed
    a first token. A drained replica is still warm: its pod stays ready."""
    if verdict.state == "down":
        return verdict.reasons[0] if verdict.reasons else "down"
    if not reading.ever_ok:
        return "health never answered"
    if replica.probe is not None and reading.ttft_ms is None:
        return "no first token from the probe yet"
    return None


def _node_conditions(gpus: GpuView, drains: Drains) -> list[Condition]:
    found: list[Condition] = []
    if gpus.nvml.state == "unavailable":
        found.append(conditions.down("nvml unavailable"))
    elif gpus.init_stalled_s is not None:
        # Hung in NVML's start-up nothing about the GPUs is known, as when NVML cannot load.
        found.append(conditions.down("nvml init stalled"))
    if gpus.xid_wait_stalled_s is not None:
        # The GPUs are still polled, so their own readings decide; only new XIDs go unseen.
        found.append(conditions.note(f"xid event wait stalled {gpus.xid_wait_stalled_s:.0f}s"))
    found.extend(gpus.faults.node)
    if drains.unreadable:
        found.append(conditions.drain(drains.unreadable))
    elif drains.node:
        found.append(conditions.drain("operator"))
    return found


def _pod_device(
    replica: Replica, assigned: Assigned, gpus: GpuView
) -> tuple[Replica, list[Condition]]:
    """The replica placed where the kubelet put its pod: its GPU's index, or its MIG device."""
    held = len(assigned.gpus) + len(assigned.mig_devices)
    if held != 1:
        return replica, [conditions.down(f"pod {replica.pod} holds {held} gpu devices, not 1")]
    if assigned.mig_devices:
        (mig,) = assigned.mig_devices
        return replace(replica, mig_uuid=mig), []
    (uuid,) = assigned.gpus
    index = next((i for i, r in gpus.readings.items() if r.uuid == uuid), None)
    if index is not None:
        return replace(replica, gpu=index), []
    all_polled = gpus.nvml.state == "ok" and len(gpus.readings) >= gpus.nvml.gpu_count
    return replica, [conditions.down(f"gpu {uuid} not found")] if all_polled else []


def _placement(replica: Replica, gpus: GpuView) -> tuple[int | None, list[Condition]]:
    """The GPU a replica runs on, and what is wrong with that placement (GPU or MIG layout)."""
    if gpus.nvml.state != "ok":
        return replica.gpu, []
    gpu = replica.gpu
    if replica.mig_uuid is not None:
        homes = [i for i, r in gpus.readings.items() if replica.mig_uuid in r.mig_devices]
        gpu = homes[0] if homes else gpu
    if gpu is not None and gpu >= gpus.nvml.gpu_count:
        return gpu, [conditions.down(f"gpu {gpu} not found")]
    reading = gpus.readings.get(gpu) if gpu is not None else None
    found: list[Condition] = []
    if reading is not None and reading.mig_current is not None:
        if reading.mig_current != (replica.mig_uuid is not None):
            mode = "enabled" if reading.mig_current else "disabled"
            found.append(conditions.down(f"mig {mode} on gpu {gpu}, not as configured"))
        elif reading.mig_pending is not None and reading.mig_pending != reading.mig_current:
            found.append(conditions.drain(f"mig mode change pending on gpu {gpu}"))
    if replica.mig_uuid is not None and not any(c.effect is Effect.DOWN for c in found):
        all_polled = len(gpus.readings) >= gpus.nvml.gpu_count
        polled = reading is not None if gpu is not None else all_polled
        if polled and replica.mig_uuid not in (reading.mig_devices if reading else ()):
            found.append(conditions.down("mig instance missing"))
    return gpu, found
