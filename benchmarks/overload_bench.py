"""Goodput under overload: the product's balancer beside a peer router, in front of the same
replicas, in one run.

Two simulated replicas shaped like an engine (8 slots each, a FIFO queue behind them, headers
at admission, a client that leaves is aborted; see engine_sim) give a known capacity: a request
holds its slot for SERVICE_S, so the pool completes CAPACITY_RPS requests/s at best. Open-loop
Poisson arrivals of streamed chat (loadgen's `run_load(rate=...)`) at each LEVELS multiple of
that capacity go for WINDOW_S (those of the first WARMUP_S, which meet empty queues, are not
counted) through

- product: the balancer (HAProxy, the rendered config) with the recipe's max_concurrency equal
  to the slots: a request that finds every slot taken waits in the balancer only when the tier
  would start it within the pool's queue budget, and at most that long; any other is
  answered 503 pool_full with Retry-After, at once or after that wait;
- peer: vllm-router (PEER_POLICY, its load-aware policy, its other settings as shipped), which
  forwards every request to a replica, where it waits in the engine's queue.

A client gives up on a stream whose next byte is PATIENCE_S late. Per router and level, counted
by benchmarks/goodput.py:
- goodput: requests completed with their first token within the first-token budget, per second
  of the counted window, as a fraction of the capacity (1.0: the pool did all it can);
- offered: arrivals per second as a fraction of the capacity (Poisson: near the level);
- completed_late: completed, first token past the budget (as a share of the requests sent);
  ttft_p50_ms, ttft_p90_ms: time to first token of the completed requests;
- cut: streams broken off after they began, by the router or a replica; gave_up: streams the
  client left after PATIENCE_S of silence; rejected: answered 503/429 before any stream,
  with the p50, p99 and worst time to that answer.
And per level, goodput_ratio: the product's goodput over the peer's, both from this run, since
the machine is shared and its absolute speed varies from run to run (None when the peer served
nothing within budget), and goodput_gain: the product's goodput less the peer's.
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.goodput import account
from benchmarks.lab.dataplane import Dataplane, PoolLayout
from benchmarks.lab.peer_router import PeerRouter
from denv_iac.core.stack.model import FIRST_TOKEN_TIMEOUT_MS
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_report import StreamResult

REPLICA_IDS = ("voice.home-a.n0.0", "voice.home-b.n1.0")
SLOTS = 8
# A request holds its slot for the prefill and the tokens after the first: 100 + 18 x 50 ms.
REPLICA = ReplicaSimConfig(
    "template", ttft_ms=100, itl_ms=50, tokens=19, slots=SLOTS, itl_growth=0.0
)
SERVICE_S = (REPLICA.ttft_ms + (REPLICA.tokens - 1) * REPLICA.itl_ms) / 1000
CAPACITY_RPS = len(REPLICA_IDS) * SLOTS / SERVICE_S
BUDGET_MS = FIRST_TOKEN_TIMEOUT_MS
POOL = PoolLayout(
    "voice",
    ((10, ("home-a", "home-b")),),
    session_affinity=False,
    max_concurrency=SLOTS,
    first_token_timeout_ms=BUDGET_MS,
)
LEVELS = (1.0, 1.3, 2.0)
WINDOW_S = 13.0
# Requests of the first seconds of a run meet empty queues: they are sent but not counted.
WARMUP_S = 3.0
PATIENCE_S = 3.0
SEED = 26
_IDLE_TIMEOUT_S = 30.0


def goodput_ratio(product: dict[str, float], peer: dict[str, float]) -> float | None:
    """The product's goodput over the peer's; None when the peer served nothing in budget."""
    return round(product["goodput"] / peer["goodput"], 2) if peer["goodput"] else None


def _in_flight(replica_url: str) -> float:
    """Requests decoding or waiting on a replica, from its vLLM metrics."""
    page = httpx.get(f"{replica_url}/metrics", timeout=2).text
    pattern = r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$"
    return sum(float(value) for value in re.findall(pattern, page, re.MULTILINE))


def _wait_idle(replica_urls: Sequence[str]) -> None:
    """Until no request of the last run is left on a replica: each run starts on idle engines."""
    deadline = time.monotonic() + _IDLE_TIMEOUT_S
    while any(_in_flight(url) for url in replica_urls):
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas still busy {_IDLE_TIMEOUT_S} s after a run")
        time.sleep(0.1)


def _offer(url: str, level: float) -> list[StreamResult]:
    report = asyncio.run(
        run_load(
            url,
            POOL.name,
            rate=level * CAPACITY_RPS,
            duration_s=WINDOW_S,
            timeout_s=PATIENCE_S,
            seed=SEED,
        )
    )
    return report.results


def run() -> dict[str, float | None]:
    with tempfile.TemporaryDirectory(prefix="denv-overload-bench-") as workdir:
        plane = Dataplane.start(
            Path(workdir) / "plane", pools=(POOL,), replica_ids=REPLICA_IDS, sim=REPLICA
        )
        peer: PeerRouter | None = None
        try:
            urls = [replica.url for replica in plane.replicas.values()]
            peer = PeerRouter(urls, Path(workdir)).start()

            def offer(url: str, level: float) -> list[StreamResult]:
                _wait_idle(urls)
                return _offer(url, level)

            return measure({"product": plane.url, "peer": peer.url}, offer)
        finally:
            if peer is not None:
                peer.close()
            plane.close()


def measure(
    routers: dict[str, str], offer: Callable[[str, float], list[StreamResult]]
) -> dict[str, float | None]:
    """Every level through every router, the order of the routers swapped from one level to
    the next so that drift on the machine hits both alike."""
    figures: dict[str, float | None] = {
        "capacity_rps": CAPACITY_RPS,
        "budget_ms": float(BUDGET_MS),
        "window_s": WINDOW_S,
        "warmup_s": WARMUP_S,
    }
    for n, level in enumerate(LEVELS):
        names = list(routers) if n % 2 == 0 else list(reversed(routers))
        by_router = {}
        for name in names:
            results = offer(routers[name], level)
            by_router[name] = account(
                results,
                since_s=WARMUP_S,
                until_s=WINDOW_S,
                capacity_rps=CAPACITY_RPS,
                budget_ms=BUDGET_MS,
            )
            figures |= {f"{name}_{level}x_{key}": value for key, value in by_router[name].items()}
        product, peer = by_router["product"], by_router["peer"]
        figures[f"goodput_ratio_{level}x"] = goodput_ratio(product, peer)
        figures[f"goodput_gain_{level}x"] = round(product["goodput"] - peer["goodput"], 3)
    return figures


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:36} {value}")
