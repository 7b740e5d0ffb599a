"""One agent: monitors feed a snapshot; the agent-check and HTTP servers answer from it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from denv_agent.agentcheck import AgentCheckServer
from denv_agent.config import AgentConfig, Replica
from denv_agent.gpu_monitor import GpuMonitor
from denv_agent.healthz import document
from denv_agent.http_api import ControlError, ControlHandler, HttpApi, PodAnswer, PodApi
from denv_agent.kubelet import KubeletPodResources
from denv_agent.metrics import Metrics
from denv_agent.nvml_api import Nvml
from denv_agent.nvml_double import FakeNvml
from denv_agent.pod_resources import Assigned, PodMonitor, PodResourcesSource
from denv_agent.replica_health import ReplicaMonitor, ReplicaReading
from denv_agent.state import Drains, DrainStore
from denv_agent.verdict import Snapshot, compose, not_warm

log = logging.getLogger("denv_agent")


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        nvml: Nvml,
        *,
        simulator: FakeNvml | None = None,
        pod_source: PodResourcesSource | None = None,
    ) -> None:
        """`simulator`, when given, is also served at POST /control/simulate for fault injection.
        `pod_source` stands in for the kubelet's socket on Kubernetes (tests)."""
        self.config = config
        self.simulator = simulator
        self.store = DrainStore(config.state_file)
        self.drains = self.store.load()
        self.metrics = Metrics(lambda: self.snapshot)
        self.gpus = GpuMonitor(nvml, config, self.publish)
        self.pods: PodMonitor | None = None
        if config.kubernetes is not None:
            source = pod_source or KubeletPodResources(config.kubernetes.pod_resources_socket)
            interval = config.intervals.gpu_poll_s
            self.pods = PodMonitor(
                source, config.kubernetes, config.replicas, interval, self.publish
            )
        self.replicas = ReplicaMonitor(
            config.replicas,
            config.intervals,
            self.publish,
            self.metrics.observe_ttft,
            here=self.pods.here if self.pods else None,
        )
        self._publish_lock = threading.Lock()
        self._control_lock = threading.Lock()
        # Replicas whose pods are stopping -> when their drain ends at the latest (monotonic).
        self._stopping: dict[str, float] = {}
        self.snapshot: Snapshot = compose(
            config, self.gpus.view(), self.replicas.view(), self.drains, self._pod_view()
        )
        self.agent_check: AgentCheckServer | None = None
        self.http: HttpApi | None = None
        self.pod_api: PodApi | None = None

    def start(self) -> None:
        """Bind both ports (raising OSError if one is taken), then start polling."""
        config = self.config
        self.agent_check = AgentCheckServer(
            config.listen.agent_check,
            lambda: self.snapshot.replies,
            config.intervals.agent_check_read_timeout_s,
        )
        try:
            self.http = HttpApi(
                config.listen.http,
                config.control_token,
                self.healthz,
                self.metrics.render,
                self._control_routes(),
            )
            if config.listen.pods is not None:
                self.pod_api = PodApi(config.listen.pods, self.pod_ready, self.stop_pod)
        except OSError:
            self.agent_check.stop()
            if self.http:
                self.http.stop()
            raise
        self.agent_check.start()
        self.http.start()
        if self.pod_api:
            self.pod_api.start()
        self.gpus.start()
        if self.pods:
            self.pods.start()
        self.replicas.start()

    def stop(self) -> None:
        if self.agent_check:
            self.agent_check.stop()
        if self.http:
            self.http.stop()
        if self.pod_api:
            self.pod_api.stop()
        self.replicas.stop()
        if self.pods:
            self.pods.stop()
        self.gpus.stop()

    def publish(self) -> None:
        """Recompute every verdict from the monitors' latest readings and swap the snapshot."""
        with self._publish_lock:
            old = self.snapshot
            readings = self.replicas.view()
            self._end_stopped(readings)
            drains = replace(self.drains, stopping=frozenset(self._stopping))
            new = compose(self.config, self.gpus.view(), readings, drains, self._pod_view())
            self.snapshot = new
        for rid, verdict in new.verdicts.items():
            before = old.verdicts.get(rid)
            if before is None or (before.state, before.weight_pct) != (
                verdict.state,
                verdict.weight_pct,
            ):
                log.info("%s: %s", rid, verdict.reply)

    def _end_stopped(self, readings: Mapping[str, ReplicaReading]) -> None:
        """A stopping pod's drain ends once its server stopped (its health check failed
        `fail_after` times: the pod that replaces it starts cold, and its own checks decide),
        or at the drain's end, when the kubelet has killed it anyway."""
        now = time.monotonic()
        fail_after = self.config.thresholds.fail_after
        for rid, until in list(self._stopping.items()):
            reading = readings.get(rid)
            if now >= until or (reading is not None and reading.failures >= fail_after):
                del self._stopping[rid]
                log.info("%s: its pod stopped; the stopping drain ended", rid)

    def _pod_replica(self, pod: str) -> Replica | None:
        """The replica of `pod`, when the pod runs on this node now."""
        replica = next((r for r in self.config.replicas if r.pod == pod and pod), None)
        if replica is None or replica.id not in self.snapshot.verdicts:
            return None
        return replica

    def pod_ready(self, pod: str) -> PodAnswer:
        """A replica pod's readiness: warm (200) or not yet (503), 404 when not on this node."""
        replica = self._pod_replica(pod)
        if replica is None:
            return 404, {"error": f"pod {pod} runs no replica on node {self.config.node}"}
        snap = self.snapshot
        verdict = snap.verdicts[replica.id]
        why = not_warm(verdict, snap.replicas.get(replica.id, ReplicaReading()), replica)
        doc = {"replica": replica.id, "ready": why is None, "verdict": verdict.reply}
        return (200, doc) if why is None else (503, doc | {"reason": why})

    def stop_pod(self, pod: str, hold_s: float) -> PodAnswer:
        """Drain a replica whose pod is stopping (its preStop asks), for at most `hold_s`."""
        replica = self._pod_replica(pod)
        if replica is None:
            return 404, {"error": f"pod {pod} runs no replica on node {self.config.node}"}
        with self._publish_lock:
            self._stopping[replica.id] = time.monotonic() + hold_s
        log.info("%s: pod %s stopping, drained for at most %.0f s", replica.id, pod, hold_s)
        self.publish()
        return 200, {"replica": replica.id, "verdict": self.snapshot.verdicts[replica.id].reply}

    def _pod_view(self) -> Mapping[str, Assigned] | None:
        return self.pods.view() if self.pods else None

    def healthz(self) -> dict[str, Any]:
        return document(self.config.node, self.snapshot, simulated=self.simulator is not None)

    def drain(self, replica: str | None = None) -> Drains:
        """Drain one replica, or the whole node; persisted before it takes effect."""
        with self._control_lock:
            d = self.drains
            if replica is None:
                return self._save(Drains(node=True, replicas=d.replicas, unreadable=d.unreadable))
            self._known(replica)
            return self._save(Drains(d.node, d.replicas | {replica}, d.unreadable))

    def undrain(self, replica: str | None = None) -> Drains:
        """Undrain one replica, or clear every drain on the node."""
        with self._control_lock:
            if replica is None:
                return self._save(Drains())
            self._known(replica)
            d = self.drains
            return self._save(Drains(d.node, d.replicas - {replica}, d.unreadable))

    def clear_faults(self, gpu: int | None = None) -> None:
        self.gpus.faults.clear(gpu)
        log.info("faults cleared on %s", "the node" if gpu is None else f"gpu {gpu}")
        self.publish()

    def _known(self, replica: str) -> None:
        if all(r.id != replica for r in self.config.replicas):
            raise ControlError(404, f"unknown replica {replica!r}")

    def _save(self, drains: Drains) -> Drains:
        try:
            self.store.save(drains)
        except OSError as e:
            raise ControlError(500, f"state file not written ({e}); nothing changed") from e
        self.drains = drains
        log.info("drains now: node %s, replicas %s", drains.node, sorted(drains.replicas) or "none")
        self.publish()
        return drains

    def _control_routes(self) -> dict[str, ControlHandler]:
        routes: dict[str, ControlHandler] = {
            "drain": lambda body: _drains_doc(self.drain(_optional(body, "replica", str))),
            "undrain": lambda body: _drains_doc(self.undrain(_optional(body, "replica", str))),
            "clear": self._control_clear,
        }
        simulator = self.simulator
        if simulator is not None:
            routes["simulate"] = lambda body: _simulate(simulator, body)
        return routes

    def _control_clear(self, body: dict[str, Any]) -> dict[str, Any]:
        self.clear_faults(_optional(body, "gpu", int))
        return {"ok": True}


def _simulate(simulator: FakeNvml, body: dict[str, Any]) -> dict[str, Any]:
    try:
        simulator.apply(body)
    except ValueError as e:
        raise ControlError(400, str(e)) from None
    log.info("simulated fault: %s", body)
    return {"ok": True}


def _optional(body: dict[str, Any], key: str, kind: type[Any]) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ControlError(400, f"{key} must be a {kind.__name__}")
    return value


def _drains_doc(drains: Drains) -> dict[str, Any]:
    return {"ok": True, "drains": {"node": drains.node, "replicas": sorted(drains.replicas)}}
