"""An engine's own Prometheus metrics: how busy it is, and whether it still makes tokens.

Busy is not broken: a replica whose slots are all taken while its token counter moves is full,
and only its weight drops with its queue. A replica with requests running whose token counter
has not moved for longer than the stall budget is a zombie (its API answers, its engine makes
nothing): it is down until the engine makes a token again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from denv_agent import conditions
from denv_agent.conditions import Condition
from denv_agent.config import AUTO, Engine, Thresholds


@dataclass(frozen=True)
class EngineNames:
    running: str  # requests decoding now (a gauge)
    waiting: str  # requests queued in the engine (a gauge)
    # A counter that moves whenever the engine makes a token; None: the engine exports none.
    progress: str | None


# The sample names of each engine family (vLLM's and SGLang's "Production Metrics" pages, TGI's
# metrics reference, llama.cpp's server with --metrics). TGI exports generated tokens only as a
# histogram observed when a request ends, which does not move while a long stream decodes: for
# TGI only the queue is read. llama.cpp's own token counter (`tokens_predicted_total`) moves only
# when a request ends too; its count of llama_decode() calls moves with every token of every
# running request, so that is its progress.
ENGINE_NAMES: dict[str, EngineNames] = {
    "vllm": EngineNames(
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total"
    ),
    "sglang": EngineNames(
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens_total"
    ),
    "tgi": EngineNames("tgi_batch_current_size", "tgi_queue_size", None),
    "llamacpp": EngineNames(
        "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:n_decode_total"
    ),
}


class MetricsError(ValueError):
    pass


class MetricsTimeout(MetricsError):
    """The server took the connection and did not answer within the timeout."""


def engine_names(family: str, text: str) -> EngineNames:
    """The names to read: the family's; for AUTO, those of the first family whose running
    gauge the text has (MetricsError when it has none: not an engine the agent knows)."""
    if family != AUTO:
        return ENGINE_NAMES[family]
    for names in ENGINE_NAMES.values():
        if names.running in text:
            return names
    raise MetricsError(f"no metrics of {', '.join(ENGINE_NAMES)} (engine auto)")


@dataclass(frozen=True)
class EngineLoad:
    running: float
    waiting: float
    progress: float | None  # None: the engine family has no token counter


def parse_load(text: str, names: EngineNames) -> EngineLoad:
    """The engine's load from Prometheus text; samples of one name add up over their labels
    (one per model). MetricsError when the text is not Prometheus text or lacks a metric."""
    wanted = {names.running, names.waiting}
    if names.progress is not None:
        wanted.add(names.progress)
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    if not math.isfinite(sample.value):
                        raise MetricsError(f"{sample.name} is {sample.value}")
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    except MetricsError:
        raise
    except Exception as e:  # the parser raises ValueError, IndexError, ... on malformed lines
        raise MetricsError(f"not prometheus text ({type(e).__name__})") from None
    missing = [name for name in (names.running, names.waiting, names.progress) if name]
    for name in missing:
        if name not in sums:
            raise MetricsError(f"no {name}")
    return EngineLoad(
        running=sums[names.running],
        waiting=sums[names.waiting],
        progress=sums[names.progress] if names.progress is not None else None,
    )


@dataclass(frozen=True)
class EngineWatch:
    """What the metrics polls have shown so far."""

    polls: int = 0
    running: float = 0.0
    waiting: float = 0.0
    progress: float | None = None
    # Since when requests have run without a token: the last poll where the counter moved, or
    # the first that saw requests running; None while idle.
    silent_since: float | None = None
    stalled_ms: float | None = None  # set once the silence outlasted the budget; cleared by a token
    error: str | None = None


def observe(
    watch: EngineWatch, load: EngineLoad, now: float, stall_budget_ms: float
) -> EngineWatch:
    """The watch after one poll at `now` (seconds, monotonic).

    The silence is timed from the first poll that saw requests running, never from an earlier
    idle poll, so a replica is never called stalled before a request had the whole budget. A
    stall stands until the counter moves (a request of the agent's own shows it, see
    `needs_token`): requests ending without a token, as they do when clients give up on a
    zombie, do not bring it back.
    """
    moved = load.progress is not None and load.progress != watch.progress and watch.polls > 0
    silent_since = watch.silent_since
    stalled_ms = watch.stalled_ms
    if moved:
        silent_since = now if load.running > 0 else None
    elif load.running <= 0:
        # Requests that ended without a token (clients cut at the balancer's stall budget, as
        # on a zombie) keep the silence timed, for at most twice the budget of idleness.
        if silent_since is not None and (now - silent_since) * 1000 > 2 * stall_budget_ms:
            silent_since = None
    elif silent_since is None:
        silent_since = now
    if moved:
        stalled_ms = None
    if load.progress is not None and silent_since is not None:
        silent_ms = (now - silent_since) * 1000
        if silent_ms > stall_budget_ms:
            stalled_ms = silent_ms
    return EngineWatch(
        polls=watch.polls + 1,
        running=load.running,
        waiting=load.waiting,
        progress=load.progress,
        silent_since=silent_since,
        stalled_ms=stalled_ms,
        error=None,
    )


def failed(
    watch: EngineWatch,
    error: str,
    now: float,
    stall_budget_ms: float,
    unanswered_since: float | None = None,
) -> EngineWatch:
    """A poll that got no metrics: the health check judges an unreachable server; a stall
    already seen stands. A read that fails shows no token either, so the silence goes on where
    requests were running without one at the last read, and where the server took the read and
    said nothing (`unanswered_since`: when that read was sent): past the budget that is a
    stall. An engine whose metrics are served by its decode loop (llama.cpp's are) answers its
    health path and never its metrics once that loop is wedged, and would otherwise stay in
    rotation, each request sent to it waiting out the first-token budget. A refused read or
    one with no engine metrics (a server the agent does not know) is a note only."""
    silent_since, stalled_ms = watch.silent_since, watch.stalled_ms
    if watch.progress is not None and (watch.running > 0 or unanswered_since is not None):
        starts = [t for t in (silent_since, unanswered_since) if t is not None]
        silent_since = min(starts, default=now)
        silent_ms = (now - silent_since) * 1000
        if silent_ms > stall_budget_ms:
            stalled_ms = silent_ms
    return replace(watch, error=error, silent_since=silent_since, stalled_ms=stalled_ms)


def recovered(watch: EngineWatch) -> EngineWatch:
    """The engine made a token for the agent's own request."""
    return replace(watch, stalled_ms=None, silent_since=None)


def needs_token(watch: EngineWatch) -> bool:
    return watch.stalled_ms is not None


def queued_weight_pct(waiting: float, thresholds: Thresholds) -> int:
    """Each request waiting in the engine takes `queued_weight_step_pct` off the weight, down
    to `queued_weight_floor_pct`."""
    lowered = 100 - thresholds.queued_weight_step_pct * math.ceil(waiting)
    return max(thresholds.queued_weight_floor_pct, min(100, lowered))


def engine_conditions(
    watch: EngineWatch | None, engine: Engine, thresholds: Thresholds
) -> list[Condition]:
    if watch is None or watch.polls == 0:
        return [conditions.note("engine metrics not read yet")] if watch and watch.error else []
    found: list[Condition] = []
    if watch.stalled_ms is not None:
        found.append(
            conditions.down(
                f"engine stalled: no token for {watch.stalled_ms:.0f} ms with requests running,"
                f" over {engine.stall_budget_ms:.0f} ms budget"
            )
        )
    if watch.error is not None:
        found.append(conditions.note(f"engine metrics: {watch.error}"))
    if watch.waiting > 0:
        found.append(
            conditions.weight(
                f"{watch.waiting:.0f} queued in the engine",
                queued_weight_pct(watch.waiting, thresholds),
            )
        )
    return found
