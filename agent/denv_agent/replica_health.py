"""Replica health: the health path, the optional first-token probe, and what they imply."""

from __future__ import annotations

import functools
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from denv_agent import conditions
from denv_agent.conditions import Condition
from denv_agent.config import Intervals, Probe, Replica, Thresholds
from denv_agent.periodic import start_periodic

_MAX_LINE = 64 * 1024
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


def probe_first_token(url: str, model: str, timeout_s: float) -> float:
    """TTFT in ms of a one-token streamed chat completion; raises ProbeError on any failure."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
            "stream": True,
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    started = time.perf_counter()
    deadline = started + timeout_s
    conn, path = _connection(url, timeout_s)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            raise ProbeError(f"http {response.status}")
        # readline() may return early on a trickling server; the deadline bounds the whole probe.
        while time.perf_counter() < deadline:
            line = response.readline(_MAX_LINE)
            if not line:
                raise ProbeError("stream ended without a token")
            if _is_token(line):
                return (time.perf_counter() - started) * 1000
        raise ProbeError("timeout")
    except ProbeError:
        raise
    except Exception as e:
        raise ProbeError(describe_failure(e)) from e
    finally:
        conn.close()


def _is_token(line: bytes) -> bool:
    line = line.strip()
    if not line.startswith(b"data:"):
        return False
    payload = line[5:].strip()
    if payload == b"[DONE]":
        raise ProbeError("stream ended without a token")
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
    return found


class ReplicaMonitor:
    """One health thread per replica, plus one probe thread where a TTFT budget is set."""

    def __init__(
        self,
        replicas: tuple[Replica, ...],
        intervals: Intervals,
        on_change: Callable[[], None],
        on_ttft: Callable[[str, float], None],
    ) -> None:
        self.replicas = replicas
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

    def _probe(self, replica_id: str, probe: Probe) -> None:
        try:
            ttft_ms = probe_first_token(probe.url, probe.model, self.intervals.probe_timeout_s)
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
        self.on_ttft(replica_id, ttft_ms / 1000)
        self._update(
            replica_id,
            lambda old: replace(
                old, probes=old.probes + 1, probe_failures=0, probe_error=None, ttft_ms=ttft_ms
            ),
        )
