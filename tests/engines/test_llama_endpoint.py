"""llama.cpp's llama-server, a real engine nobody here wrote, behind the endpoint: streamed with
the openai SDK, at twice its slots, killed, frozen, wedged, drained and rolled.

The stack is stacks/Pulumi.local-llama.yaml as a newcomer starts it (two servers of two slots,
`max_concurrency: 2`), run by the local runner with its supervisor, as `denv local up` runs it.
Every fault is shown to recover: the pool back at two replicas in rotation.
"""

import asyncio
import dataclasses
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from denv_agent.control import drain, undrain

from benchmarks.lab.waiting import eventually
from denv_iac.haproxy.runtime import server_stats
from denv_iac.local.processes import free_port
from denv_iac.local.rollout import roll
from denv_iac.local.run_state import ReplicaState, RunState
from denv_iac.local.runner import LocalCluster, supervised
from denv_iac.ops.llama import DecodeLoopFreeze, LlamaEngine, build_engine
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_report import LoadReport

pytestmark = pytest.mark.needs_haproxy

POOL = "chat"
# Answers long enough to be in flight when a fault lands, short enough for a CI run.
MAX_TOKENS = 48
# Clients while one replica is faulted: what the other's two slots take, so that every answer
# but those cut on the faulted one is served (more would be refused at once, 503 pool_full).
FAULT_LOAD = 2


@pytest.fixture(scope="session")
def engine() -> LlamaEngine:
    # Built once (minutes, the first time) and never skipped: this suite is the real thing.
    return build_engine(Path(__file__).parent)


@pytest.fixture(scope="module")
def cluster(
    engine: LlamaEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    directory = tmp_path_factory.mktemp("llama")
    running = LocalCluster(engine.stack(), directory, free_port(), project=engine.project)
    with supervised(running):
        yield running


def state_of(cluster: LocalCluster) -> RunState:
    assert cluster.state is not None
    return cluster.state


def chat_replicas(cluster: LocalCluster) -> list[ReplicaState]:
    return [r for r in state_of(cluster).replicas if r.pool == POOL]


def rows(cluster: LocalCluster) -> dict[str, dict[str, str]]:
    """`show stat` of the chat pool's servers, by replica id."""
    servers = server_stats(Path(state_of(cluster).admin_socket))
    return {name: row for name, row in servers.items() if row["pxname"] == f"{POOL}.tier10"}


def in_rotation(cluster: LocalCluster) -> set[str]:
    return {name for name, row in rows(cluster).items() if row["status"] == "UP"}


def full_strength(cluster: LocalCluster) -> float:
    """Seconds until both replicas are in rotation again."""
    return eventually(
        lambda: len(in_rotation(cluster)) == 2,
        30,
        "both llama.cpp replicas back in rotation",
        detail=lambda: {n: r["status"] for n, r in rows(cluster).items()},
    )


def load(cluster: LocalCluster, concurrency: int, seconds: float) -> LoadReport:
    return asyncio.run(
        run_load(
            state_of(cluster).endpoint,
            POOL,
            concurrency=concurrency,
            duration_s=seconds,
            max_tokens=MAX_TOKENS,
        )
    )


def test_a_real_model_streams_through_the_endpoint_with_the_openai_sdk(
    cluster: LocalCluster,
) -> None:
    full_strength(cluster)
    client = openai.OpenAI(base_url=f"{state_of(cluster).endpoint}/v1", api_key="none")
    served: Counter[str] = Counter()
    for _ in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=POOL,
            stream=True,
            max_completion_tokens=16,
            messages=[{"role": "user", "content": "Name a colour."}],
        )
        served[raw.headers["x-denv-replica"]] += 1
        text = "".join(
            chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices
        )
        assert text.strip(), "the model answered nothing"
    # Least loaded with ties broken in turn: both replicas served.
    assert set(served) == {r.id for r in chat_replicas(cluster)}


def test_completions_and_embeddings_route_to_their_pools(cluster: LocalCluster) -> None:
    client = openai.OpenAI(base_url=f"{state_of(cluster).endpoint}/v1", api_key="none")
    completion = client.completions.create(model=POOL, prompt="The sky is", max_tokens=8)
    assert completion.choices[0].text.strip()
    raw = client.embeddings.with_raw_response.create(model="embed", input="a voice agent")
    assert raw.headers["x-denv-replica"].startswith("embed.")
    vector = raw.parse().data[0].embedding
    assert len(vector) >= 64 and any(value != 0 for value in vector)


def test_the_agent_and_status_read_the_engines_own_figures(cluster: LocalCluster) -> None:
    full_strength(cluster)
    state = state_of(cluster)
    replica = chat_replicas(cluster)[0]
    agent = state.agent_of(f"{replica.site}/{replica.node}")
    busy = threading.Thread(target=load, args=(cluster, 4, 4.0))
    busy.start()
    seen: list[dict[str, object]] = []

    def running() -> bool:
        doc = httpx.get(f"{agent.url}/healthz").json()
        engine = next(r for r in doc["replicas"] if r["id"] == replica.id)["health"]["engine"]
        seen.append(engine)
        return bool(engine["error"] is None and engine["running"] >= 1)

    eventually(
        running, 10, "the agent reads llama.cpp's requests running", detail=lambda: seen[-1:]
    )
    busy.join()
    assert {"running", "waiting", "generation_tokens"} <= set(seen[-1])


def test_twice_the_slots_is_answered_200_or_503_and_nothing_is_cut(cluster: LocalCluster) -> None:
    full_strength(cluster)
    before = {name: int(row["wretr"] or 0) for name, row in rows(cluster).items()}
    report = load(cluster, 8, 20.0)  # 8 clients on 4 slots
    served = [r for r in report.results if r.ok]
    errors = report.errors()
    # Only a full pool's refusal: no 502, no reset, no stream cut mid-answer.
    assert set(errors) <= {"http_503"}, errors
    assert len(served) >= 20
    retried = sum(int(r["wretr"] or 0) for r in rows(cluster).values()) - sum(before.values())
    # A connection reused after an engine closed it was retried on 38 % of requests.
    assert retried <= 0.05 * len(report.results), f"{retried} retries of {len(report.results)}"


def test_a_killed_engine_costs_only_its_streams_in_flight_and_comes_back(
    cluster: LocalCluster,
) -> None:
    full_strength(cluster)
    victim = chat_replicas(cluster)[0]
    old_pid = victim.pid
    timer = threading.Timer(2.0, os.killpg, args=(old_pid, signal.SIGKILL))
    timer.start()
    report = load(cluster, FAULT_LOAD, 6.0)
    timer.join()
    errors = report.errors()
    # Cut: at most what was decoding on it (its two slots); nothing else lost, nothing replayed.
    assert sum(errors.values()) <= 2 and set(errors) <= {"aborted"}, errors
    assert sum(1 for r in report.results if r.ok) >= 4
    full_strength(cluster)
    assert chat_replicas(cluster)[0].pid != old_pid  # the supervisor started it again


def test_a_stopped_engine_ends_its_stream_within_the_stall_budget(cluster: LocalCluster) -> None:
    full_strength(cluster)
    victim = chat_replicas(cluster)[0]
    timer = threading.Timer(2.0, os.killpg, args=(victim.pid, signal.SIGSTOP))
    timer.start()
    try:
        report = load(cluster, FAULT_LOAD, 6.0)
    finally:
        timer.join()
        os.killpg(victim.pid, signal.SIGCONT)
    cut = [r for r in report.results if r.error]
    assert all(r.error == "aborted" for r in cut), report.errors()
    assert len(cut) <= 2
    for result in cut:
        # The stall budget (1000 ms) past its last token, and not much more.
        assert result.gaps_ms == () or max(result.gaps_ms) < 2500, result
    assert sum(1 for r in report.results if r.ok) >= 4
    full_strength(cluster)


def test_a_wedged_decode_loop_is_out_of_rotation_within_2_s(cluster: LocalCluster) -> None:
    full_strength(cluster)
    victim = chat_replicas(cluster)[0]
    busy = threading.Thread(target=load, args=(cluster, FAULT_LOAD, 6.0))
    busy.start()
    time.sleep(1.5)  # requests running on it
    with DecodeLoopFreeze(victim.pid):
        # Its API still answers its health path: only its own metrics tell.
        assert httpx.get(f"{victim.url}/health", timeout=2).status_code == 200
        took = eventually(
            lambda: victim.id not in in_rotation(cluster),
            5,
            "the wedged replica out of rotation",
            detail=lambda: rows(cluster)[victim.id]["last_agt"],
        )
    busy.join()
    assert took < 2.0, f"out of rotation after {took:.2f} s"
    full_strength(cluster)


def test_a_drained_engine_finishes_its_streams_and_takes_no_new_ones(
    cluster: LocalCluster,
) -> None:
    full_strength(cluster)
    state = state_of(cluster)
    victim = chat_replicas(cluster)[0]
    agent = state.agent_of(f"{victim.site}/{victim.node}")
    served_before = int(rows(cluster)[victim.id]["stot"])
    drain(agent.url, state.control_token, victim.id)
    try:
        eventually(lambda: rows(cluster)[victim.id]["status"].startswith("DRAIN"), 5, "drained")
        report = load(cluster, 2, 3.0)
        assert report.errors() == Counter() and report.results
        assert int(rows(cluster)[victim.id]["stot"]) == served_before
    finally:
        undrain(agent.url, state.control_token, victim.id)
    full_strength(cluster)


def test_a_rollout_that_changes_the_commands_arguments_loses_nothing(
    cluster: LocalCluster,
) -> None:
    full_strength(cluster)
    stack = cluster.stack
    recipe = next(r for r in stack.recipes if r.name == POOL)
    context = recipe.command.index("-c")
    command = list(recipe.command)
    command[context + 1] = "1024"  # a smaller context per slot: a new version of the server
    recipes = tuple(
        dataclasses.replace(r, command=tuple(command)) if r is recipe else r for r in stack.recipes
    )
    after = dataclasses.replace(stack, recipes=recipes)
    old_pids = {r.id: r.pid for r in chat_replicas(cluster)}
    results: list[LoadReport] = []
    busy = threading.Thread(target=lambda: results.append(load(cluster, 2, 12.0)))
    busy.start()
    time.sleep(1.0)
    report = roll(cluster, after, lambda _: None)
    busy.join()
    assert report.cut == 0
    assert results[0].errors() == Counter(), results[0].errors()
    for replica in chat_replicas(cluster):
        assert replica.pid != old_pids[replica.id]
        cmdline = Path(f"/proc/{replica.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"-c") + 1] == b"1024"
    full_strength(cluster)
