"""Replica health: the health path, the optional first-token probe, and what they imply."""

from __future__ import annotations

import functools
import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from denv_agent import conditions
from denv_agent.conditions import Condition
from denv_agent.config import Engine, Intervals, Probe, Replica, Thresholds
from denv_agent.engine_metrics import (
    EngineWatch,
    MetricsError,
    MetricsTimeout,
    engine_conditions,
    engine_names,
    failed,
    needs_token,
    observe,
    parse_load,
    recovered,
)
from denv_agent.periodic import start_periodic

_MAX_LINE = 64 * 1024
_MAX_METRICS = 4 * 1024 * 1024
_JOIN_S = 2.0


class ProbeError(Exception):
    pass


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return http.client.HTTPConnection(
        parts.hostname or "", parts.port or 80, timeout=timeout_s
    ), path


def describe_failure(error: BaseException) -> str:
    if isinstance(error, ProbeError):
        return str(error)
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, http.client.RemoteDisconnected):
        return "connection closed"
    if isinstance(error, ConnectionResetError):
        return "connection reset"
    if isinstance(error, socket.gaierror):
        return "name resolution failed"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return "bad response"


def check_health(url: str, timeout_s: float) -> str | None:
    """None when the health path answers 2xx in time, else why not, e.g. `connection refused`."""
    conn, path = _connection(url, timeout_s)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        status = conn.getresponse().status
    except Exception as e:  # refused, timeout, garbage instead of HTTP: all a failed check
        return describe_failure(e)
    finally:
        conn.close()
    return None if 200 <= status < 300 else f"http {status}"


def fetch_metrics(url: str, timeout_s: float) -> str:
    """The Prometheus text at `url`; MetricsError on failure."""
    conn, path = _connection(url, timeout_s)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        response = conn.getresponse()
        if response.status != 200:
            raise MetricsError(f"http {response.status}")
        return response.read(_MAX_METRICS).decode("utf-8", "replace")
    except MetricsError:
        raise
    except TimeoutError as e:
        raise MetricsTimeout(describe_failure(e)) from e
    except Exception as e:
        raise MetricsError(describe_failure(e)) from e
    finally:
        conn.close()


# Tokens the probe asks for: enough to time the gaps between them as well as the first one.
PROBE_TOKENS = 3


@dataclass(frozen=True)
class ProbeTiming:
    ttft_ms: float
    # The longest silence between two of the probe's tokens; None when only one came.
    max_gap_ms: float | None


def probe_stream(
    url: str,
    model: str,
    timeout_s: float,
    stall_budget_ms: float | None = None,
    on_first_token: Callable[[float], None] | None = None,
) -> ProbeTiming:
    """First token and longest gap of a short streamed chat completion; ProbeError on failure.

    `on_first_token` hears the TTFT (ms) as soon as it is known, so a slow replica's weight
    drops without waiting for the rest of the stream. With a stall budget the probe ends as
    soon as a silence after a token outlasts it: the verdict is known by then.
    """
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": PROBE_TOKENS,
            "stream": True,
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    started = time.perf_counter()
    deadline = started + timeout_s
    tokens: list[float] = []
    conn, path = _connection(url, timeout_s)
    try:
        conn.request("POST", path, body=body, headers=headers)
        sock = conn.sock  # the response reads from it even after the connection lets it go
        response = conn.getresponse()
        if response.status != 200:
            raise ProbeError(f"http {response.status}")
        # readline() may return early on a trickling server; the deadline bounds the whole probe.
        late, stalled_at = False, float("inf")
        while len(tokens) < PROBE_TOKENS:
            try:
                line = response.readline(_MAX_LINE)
            except TimeoutError:
                line = b""
            now = time.perf_counter()
            late = now >= min(deadline, stalled_at)
            if late or not line or _is_done(line):
                break
            if _is_token(line):
                tokens.append(time.perf_counter())
                if len(tokens) == 1 and on_first_token is not None:
                    on_first_token((tokens[0] - started) * 1000)
                if stall_budget_ms is not None and sock is not None:
                    left = deadline - time.perf_counter()
                    sock.settimeout(max(0.001, min(stall_budget_ms / 1000, left)))
                    stalled_at = tokens[-1] + stall_budget_ms / 1000
        if not tokens:
            raise ProbeError("timeout" if late else "stream ended without a token")
        if late:  # silent since its last token until the deadline: that silence is a gap
            tokens.append(time.perf_counter())
    except ProbeError:
        raise
    except Exception as e:
        raise ProbeError(describe_failure(e)) from e
    finally:
        conn.close()
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(tokens)]
    return ProbeTiming((tokens[0] - started) * 1000, max(gaps) if gaps else None)


def _is_done(line: bytes) -> bool:
    line = line.strip()
    return line.startswith(b"data:") and line[5:].strip() == b"[DONE]"


def _is_token(line: bytes) -> bool:
    line = line.strip()
    if not line.startswith(b"data:"):
        return False
    payload = line[5:].strip()
    try:
        choice = json.loads(payload)["choices"][0]
        text = (choice.get("delta") or {}).get("content") or choice.get("text")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ProbeError("bad stream") from None
    return isinstance(text, str) and bool(text)


@dataclass(frozen=True)
class ReplicaReading:
    checks: int = 0
    ever_ok: bool = False
    failures: int = 0
    last_error: str | None = None
    last_ok_at: float | None = None
    probes: int = 0
    probe_failures: int = 0
    probe_error: str | None = None
    ttft_ms: float | None = None
    gap_ms: float | None = None  # the last probe's longest silence between tokens
    engine: EngineWatch | None = None  # what the engine's own metrics show, where it names them


def replica_conditions(
    reading: ReplicaReading, replica: Replica, thresholds: Thresholds
) -> list[Condition]:
    found: list[Condition] = []
    limit = thresholds.fail_after
    if reading.checks == 0:
        found.append(conditions.down("starting"))
    elif reading.failures:
        # Shown as at most `limit`x so that the reply text settles while the replica stays down.
        text = f"health check failed {min(reading.failures, limit)}x: {reading.last_error}"
        failed = reading.failures >= limit or not reading.ever_ok
        found.append(conditions.down(text) if failed else conditions.note(text))
    if reading.probe_failures:
        count = min(reading.probe_failures, limit)
        text = f"first-token probe failed {count}x: {reading.probe_error}"
        failed = reading.probe_failures >= limit
        found.append(conditions.down(text) if failed else conditions.note(text))
    budget = replica.probe.ttft_budget_ms if replica.probe else None
    if budget is not None and reading.ttft_ms is not None and reading.ttft_ms > budget:
        found.append(
            conditions.weight(
                f"ttft {reading.ttft_ms:.0f} ms over {budget:.0f} ms budget",
                thresholds.slow_weight_pct,
            )
        )
    stall = replica.probe.stall_budget_ms if replica.probe else None
    if stall is not None and reading.gap_ms is not None and reading.gap_ms >= stall:
        # Its streams are cut at the balancer's stall budget anyway: send new ones elsewhere
        # until a probe streams without such a pause.
        found.append(
            conditions.drain(f"stream stalled {reading.gap_ms:.0f} ms, over {stall:.0f} ms budget")
        )
    if replica.engine is not None:
        found += engine_conditions(reading.engine, replica.engine, thresholds)
    return found


class ReplicaMonitor:
    """One health thread per replica, plus one probe thread where a TTFT budget is set and one
    metrics thread where the replica names its engine."""

    def __init__(
        self,
        replicas: tuple[Replica, ...],
        intervals: Intervals,
        on_change: Callable[[], None],
        on_ttft: Callable[[str, float], None],
        here: Callable[[str], bool] | None = None,
    ) -> None:
        """`here`: whether a replica runs on this node now (on Kubernetes, where every node's
        agent knows every replica of the site); those elsewhere are neither checked nor probed."""
        self.replicas = replicas
        self.here = here or (lambda _replica_id: True)
        self.intervals = intervals
        self.on_change = on_change
        self.on_ttft = on_ttft
        self._readings = {r.id: ReplicaReading() for r in replicas}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for r in self.replicas:
            self._threads.append(
                start_periodic(
                    f"health {r.id}",
                    self.intervals.health_s,
                    functools.partial(self._check, r),
                    self._stop,
                )
            )
            if r.probe:
                self._threads.append(
                    start_periodic(
                        f"probe {r.id}",
                        r.probe.interval_s,
                        functools.partial(self._probe, r.id, r.probe),
                        self._stop,
                    )
                )
            if r.engine:
                self._threads.append(
                    start_periodic(
                        f"metrics {r.id}",
                        self.intervals.metrics_s,
                        functools.partial(self._watch_engine, r.id, r.engine),
                        self._stop,
                    )
                )

    def stop(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + _JOIN_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def view(self) -> Mapping[str, ReplicaReading]:
        with self._lock:
            return dict(self._readings)

    def _update(self, replica_id: str, change: Callable[[ReplicaReading], ReplicaReading]) -> None:
        with self._lock:
            self._readings[replica_id] = change(self._readings[replica_id])
        self.on_change()

    def _check(self, replica: Replica) -> None:
        if not self.here(replica.id):
            # Gone to another node: when its pod comes back here it is a new pod, starting.
            with self._lock:
                self._readings[replica.id] = ReplicaReading()
            return
        error = check_health(replica.health_url, self.intervals.health_timeout_s)
        now = time.monotonic()
        self._update(
            replica.id,
            lambda old: replace(
                old,
                checks=old.checks + 1,
                ever_ok=old.ever_ok or error is None,
                failures=0 if error is None else old.failures + 1,
                last_error=error,
                last_ok_at=now if error is None else old.last_ok_at,
            ),
        )

    def _first_token(self, replica_id: str, ttft_ms: float) -> None:
        self._update(replica_id, lambda old: replace(old, ttft_ms=ttft_ms))

    def _probe(self, replica_id: str, probe: Probe) -> None:
        if not self.here(replica_id):
            return
        try:
            timing = probe_stream(
                probe.url,
                probe.model,
                self.intervals.probe_timeout_s,
                probe.stall_budget_ms,
                functools.partial(self._first_token, replica_id),
            )
        except ProbeError as e:
            error = str(e)
            self._update(
                replica_id,
                lambda old: replace(
                    old,
                    probes=old.probes + 1,
                    probe_failures=old.probe_failures + 1,
                    probe_error=error,
                ),
            )
            return
        self.on_ttft(replica_id, timing.ttft_ms / 1000)
        self._update(
            replica_id,
            lambda old: replace(
                old,
                probes=old.probes + 1,
                probe_failures=0,
                probe_error=None,
                ttft_ms=timing.ttft_ms,
                gap_ms=timing.max_gap_ms,
            ),
        )
        stall = probe.stall_budget_ms
        if stall is not None and timing.max_gap_ms is not None and timing.max_gap_ms >= stall:
            # A stall drains the replica: the verdict stands a whole interval, so HAProxy's
            # agent checks see it before the next probe could overturn it.
            self._stop.wait(probe.interval_s)

    def _watch_engine(self, replica_id: str, engine: Engine) -> None:
        if not self.here(replica_id):
            return
        asked = time.monotonic()
        try:
            text = fetch_metrics(engine.metrics_url, self.intervals.health_timeout_s)
            load = parse_load(text, engine_names(engine.family, text))
        except MetricsError as e:
            error, now, budget = str(e), time.monotonic(), engine.stall_budget_ms
            # Unanswered: nothing came from the moment the read was sent.
            since = asked if isinstance(e, MetricsTimeout) else None
            self._update(
                replica_id,
                lambda old: replace(old, engine=failed(_watch(old), error, now, budget, since)),
            )
            return
        now = time.monotonic()
        watch = observe(_watch(self.view()[replica_id]), load, now, engine.stall_budget_ms)
        self._update(replica_id, lambda old: replace(old, engine=watch))
        if needs_token(watch) and self._engine_made_a_token(engine):
            # Nothing reaches a replica that is down, so its counter would never move again:
            # the agent's own request shows the engine serving.
            self._update(replica_id, lambda old: replace(old, engine=recovered(_watch(old))))

    def _engine_made_a_token(self, engine: Engine) -> bool:
        try:
            probe_stream(engine.probe_url, engine.probe_model, engine.stall_budget_ms / 1000)
        except ProbeError:
            return False
        return True


def _watch(reading: ReplicaReading) -> EngineWatch:
    return reading.engine or EngineWatch()
