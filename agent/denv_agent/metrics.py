"""Prometheus /metrics, read from the published snapshot at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from denv_agent.verdict import Snapshot

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_STATES = ("up", "drain", "down")


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self.snapshot()
        nvml_up = GaugeMetricFamily("denv_agent_nvml_up", "1 when NVML answers on this node")
        nvml_up.add_metric([], 1.0 if snap.gpus.nvml.state == "ok" else 0.0)
        yield nvml_up
        yield from self._gpus(snap)
        yield from self._replicas(snap)

    def _gpus(self, snap: Snapshot) -> Iterable[Metric]:
        labels = ["gpu", "uuid"]
        temperature = GaugeMetricFamily(
            "denv_agent_gpu_temperature_celsius", "GPU core temperature", labels=labels
        )
        utilization = GaugeMetricFamily(
            "denv_agent_gpu_utilization_ratio", "GPU busy time, 0 to 1", labels=labels
        )
        used = GaugeMetricFamily(
            "denv_agent_gpu_memory_used_bytes", "GPU memory used", labels=labels
        )
        total = GaugeMetricFamily(
            "denv_agent_gpu_memory_total_bytes", "GPU memory installed", labels=labels
        )
        for index, reading in sorted(snap.gpus.readings.items()):
            key = [str(index), reading.uuid]
            for family, value in (
                (temperature, reading.temperature_c),
                (utilization, _ratio(reading.utilization_pct)),
                (used, reading.memory_used_bytes),
                (total, reading.memory_total_bytes),
            ):
                if value is not None:
                    family.add_metric(key, float(value))
        xids = CounterMetricFamily(
            "denv_agent_xid_events", "XID events by class", labels=["gpu", "class"]
        )
        for (gpu, klass), count in sorted(
            snap.gpus.faults.class_counts.items(), key=lambda item: (str(item[0][0]), item[0][1])
        ):
            xids.add_metric(["unknown" if gpu is None else str(gpu), klass.value], float(count))
        return [temperature, utilization, used, total, xids]

    def _replicas(self, snap: Snapshot) -> Iterable[Metric]:
        state = GaugeMetricFamily(
            "denv_agent_replica_state",
            "1 for the replica's current reply",
            labels=["replica", "state"],
        )
        weight = GaugeMetricFamily(
            "denv_agent_replica_weight_percent", "weight in the up reply", labels=["replica"]
        )
        failures = GaugeMetricFamily(
            "denv_agent_replica_health_failures",
            "consecutive failed health checks",
            labels=["replica"],
        )
        for rid, verdict in snap.verdicts.items():
            for name in _STATES:
                state.add_metric([rid, name], 1.0 if verdict.state == name else 0.0)
            weight.add_metric([rid], float(verdict.weight_pct))
            reading = snap.replicas.get(rid)
            failures.add_metric([rid], float(reading.failures if reading else 0))
        return [state, weight, failures]


def _ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100


class Metrics:
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        # A registry of its own: several agents may share one process in tests.
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot))
        ProcessCollector(registry=self.registry)
        self.ttft = Histogram(
            "denv_agent_probe_ttft_seconds",
            "time to first token of the first-token probe",
            ["replica"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )

    def observe_ttft(self, replica_id: str, seconds: float) -> None:
        self.ttft.labels(replica_id).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
