"""The capacity of a simulated model server: slots, a FIFO queue, and the engines' metrics.

Continuous batching as vLLM, SGLang and TGI do it: `slots` sequences decode at once and every
decode step gets slower as the batch grows; a request that finds every slot taken waits in a
FIFO queue until a sequence ends (past `queue_limit` waiting requests, when one is set, a new
request is refused before any byte, as vLLM and SGLang answer 503 when full). With n sequences
running, the time between two tokens of each is

    itl(n) = itl_ms * (1 + itl_growth * (n - 1))

and a request's time to first token is its wait in the queue plus the prefill (`ttft_ms`).

Scheduling on the event loop only: no I/O here. The replica (replica_sim) writes the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class EngineFull(Exception):
    """The queue holds `queue_limit` requests: the request is refused before any byte."""


_RESTARTED = "the engine restarted"


class EngineLost(Exception):
    """The engine restarted: the request ends with the tokens it had, or its place is lost."""


@dataclass(frozen=True)
class Capacity:
    slots: int
    queue_limit: int | None = None  # None: the queue has no bound
    itl_growth: float = 0.0


@dataclass(frozen=True)
class Load:
    """What an engine reports at one moment."""

    running: int
    waiting: int
    usage: float  # share of the KV cache in use, modelled as the share of slots decoding (0-1)
    requests: int
    prompt_tokens: int
    generation_tokens: int


class Sequence:
    """One request in the engine: waiting for a slot, then decoding."""

    def __init__(self, engine: Engine, prompt_tokens: int) -> None:
        self.engine = engine
        self.prompt_tokens = prompt_tokens
        self.lost = False
        self.began = 0.0  # monotonic time its slot was granted
        self._slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def started(self) -> float:
        """Wait for a slot, in arrival order; the time decoding began."""
        # Shielded: a request aborted while it waits leaves the future to the engine, which may
        # grant it a slot before the abort lands; release() then frees that slot.
        await asyncio.shield(self._slot)
        if self.lost:
            raise EngineLost(_RESTARTED)
        return self.began

    async def until(self, deadline: float) -> float:
        """Wait until the token due at `deadline` is made; later by the time the engine stalled.

        Returns the time the token was due, the base of the next deadline, so that the pace
        carries no drift.
        """
        while True:
            if self.lost:
                raise EngineLost(_RESTARTED)
            if self.engine.stalled:
                await self.engine.changed(None)
                deadline = max(deadline, time.monotonic())
                continue
            delay = deadline - time.monotonic()
            if delay <= 0:
                return deadline
            await self.engine.changed(delay)

    def emitted(self) -> None:
        self.engine.generation_tokens += 1

    def _begin(self, now: float) -> None:
        self.began = now
        self._slot.set_result(None)

    def _lose(self) -> None:
        self.lost = True
        if not self._slot.done():
            self._slot.set_result(None)


class Engine:
    """Slots and the FIFO queue behind them, for one kind of request (chat, speech, ...)."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.stalled = False  # a wedged engine: sequences hold their slots, no token comes
        self.requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._running: set[Sequence] = set()
        self._waiting: deque[Sequence] = deque()
        self._changed = asyncio.Event()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def load(self) -> Load:
        return Load(
            running=self.running,
            waiting=self.waiting,
            usage=self.running / self.capacity.slots,
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )

    def submit(self, prompt_tokens: int = 0) -> Sequence:
        """Admit a request: it decodes now if a slot is free, else it waits behind the others."""
        limit = self.capacity.queue_limit
        if self.running >= self.capacity.slots and limit is not None and self.waiting >= limit:
            raise EngineFull(f"{self.waiting} requests are waiting for {self.capacity.slots} slots")
        sequence = Sequence(self, prompt_tokens)
        self.requests += 1
        self._waiting.append(sequence)
        self._schedule()
        return sequence

    def release(self, sequence: Sequence) -> None:
        """The request ended, finished or aborted: its slot or its place in the queue is free."""
        if sequence in self._running:
            self._running.discard(sequence)
        elif sequence in self._waiting:
            self._waiting.remove(sequence)
        self._schedule()

    def restart(self) -> None:
        """The engine process restarts: every request, decoding or waiting, ends at once."""
        lost = [*self._running, *self._waiting]
        self._running.clear()
        self._waiting.clear()
        for sequence in lost:
            sequence._lose()
        self._notify()

    def stall(self, stalled: bool) -> None:
        self.stalled = stalled
        self._notify()

    def itl_s(self, itl_ms: float) -> float:
        """The time between two tokens with the batch as it is now."""
        extra = max(self.running - 1, 0)
        return itl_ms * (1 + self.capacity.itl_growth * extra) / 1000.0

    async def changed(self, timeout_s: float | None) -> None:
        """Until the engine stalls, resumes or restarts, or `timeout_s` passes."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()

    def _schedule(self) -> None:
        while self._waiting and self.running < self.capacity.slots:
            sequence = self._waiting.popleft()
            self._running.add(sequence)
            self.prompt_tokens += sequence.prompt_tokens  # the prefill, when decoding begins
            sequence._begin(time.monotonic())

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def total(loads: list[Load]) -> Load:
    """One replica's engines together, as its metrics report them: counts add up, the usage is
    that of the fullest engine."""
    return Load(
        running=sum(load.running for load in loads),
        waiting=sum(load.waiting for load in loads),
        usage=max((load.usage for load in loads), default=0.0),
        requests=sum(load.requests for load in loads),
        prompt_tokens=sum(load.prompt_tokens for load in loads),
        generation_tokens=sum(load.generation_tokens for load in loads),
    )


# Each engine's own names for what a router reads. Sources: vLLM's "Production Metrics"
# (docs.vllm.ai, v1 engine), SGLang's "Production Metrics" (docs.sglang.ai) and TGI's metrics
# reference (huggingface.co/docs/text-generation-inference/reference/metrics). A counter's family
# is named without `_total`, as prometheus_client writes it (vLLM, SGLang); TGI's Rust exporter
# names counters as they are.
@dataclass(frozen=True)
class _Metric:
    sample: str
    kind: str  # gauge or counter
    help: str
    value: Callable[[Load], float]

    @property
    def family(self) -> str:
        return self.sample.removesuffix("_total") if self.kind == "counter" else self.sample


_FAMILIES: dict[str, tuple[bool, tuple[_Metric, ...]]] = {
    "vllm": (
        True,
        (
            _Metric(
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                lambda load: load.running,
            ),
            _Metric(
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                lambda load: load.waiting,
            ),
            _Metric(
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                lambda load: load.usage,
            ),
            _Metric(
                "vllm:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                lambda load: load.prompt_tokens,
            ),
            _Metric(
                "vllm:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                lambda load: load.generation_tokens,
            ),
        ),
    ),
    "sglang": (
        True,
        (
            _Metric(
                "sglang:num_running_reqs",
                "gauge",
                "The number of running requests.",
                lambda load: load.running,
            ),
            _Metric(
                "sglang:num_queue_reqs",
                "gauge",
                "The number of requests in the waiting queue.",
                lambda load: load.waiting,
            ),
            _Metric("sglang:token_usage", "gauge", "The token usage.", lambda load: load.usage),
            _Metric(
                "sglang:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                lambda load: load.prompt_tokens,
            ),
            _Metric(
                "sglang:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                lambda load: load.generation_tokens,
            ),
        ),
    ),
    "tgi": (
        False,
        (
            _Metric(
                "tgi_batch_current_size",
                "gauge",
                "Current batch size",
                lambda load: load.running,
            ),
            _Metric("tgi_queue_size", "gauge", "Current queue size", lambda load: load.waiting),
            _Metric(
                "tgi_request_count",
                "counter",
                "Total number of requests",
                lambda load: load.requests,
            ),
        ),
    ),
}


def render_metrics(family: str, model: str, load: Load) -> str:
    """Prometheus text exposition of `load` under the names `family` (vllm, sglang, tgi) uses."""
    labelled, metrics = _FAMILIES[family]
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    labels = f'{{model_name="{escaped}"}}' if labelled else ""
    lines: list[str] = []
    for metric in metrics:
        lines += [
            f"# HELP {metric.family} {metric.help}",
            f"# TYPE {metric.family} {metric.kind}",
            f"{metric.sample}{labels} {float(metric.value(load))!r}",
        ]
    return "\n".join(lines) + "\n"
