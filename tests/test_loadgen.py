"""The load client against a real simulated replica: TTFT measured, aborts seen as aborts."""

import asyncio
import json
import statistics
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from denv_iac.local.replica_model import ReplicaSimConfig, control_headers
from denv_iac.local.replica_sim import ReplicaProcess
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_arrivals import OPEN_SESSIONS, Arrival, arrivals, open_loop_problems
from denv_iac.ops.loadgen_report import percentile
from tests.timing import assert_within


@pytest.fixture
def replica() -> Iterator[ReplicaProcess]:
    process = ReplicaProcess(ReplicaSimConfig("voice.t.n0.0", ttft_ms=30, itl_ms=2, tokens=5))
    process.spawn()
    process.wait_ready()
    yield process
    process.stop()


def test_streams_are_measured(replica: ReplicaProcess) -> None:
    url = f"http://127.0.0.1:{replica.port}"
    report = asyncio.run(run_load(url, "voice", concurrency=4, requests=12))
    summary = report.summary()
    assert summary["requests"] == 12 and summary["ok"] == 12 and summary["errors"] == {}
    p50 = report.ttft_ms(50)
    assert p50 is not None and 25 <= p50 < 500
    assert all(r.tokens == 5 for r in report.results)
    stats = httpx.get(f"{url}/stats").json()
    assert sorted(stats["by_request_id"]) == sorted(r.request_id for r in report.results)


def test_a_stream_cut_short_is_an_abort(replica: ReplicaProcess) -> None:
    url = f"http://127.0.0.1:{replica.port}"
    headers = control_headers(replica.config.control_token)
    fault = {"mode": "die_after_tokens", "k": 2}
    httpx.post(f"{url}/control/fault", json=fault, headers=headers).raise_for_status()
    report = asyncio.run(run_load(url, "voice", concurrency=1, requests=2))
    assert [r.error for r in report.results] == ["aborted", "aborted"]
    assert all(r.tokens == 2 for r in report.results)


def test_refused_connection_is_a_connect_error() -> None:
    report = asyncio.run(run_load("http://127.0.0.1:9", "voice", concurrency=1, requests=1))
    assert [r.error for r in report.results] == ["connect"]


@pytest.mark.parametrize(
    ("values", "q", "expected"), [([], 50, None), ([5.0], 99, 5.0), ([1, 2, 3, 4, 5], 50, 3)]
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_bench_command_reports_json(replica: ReplicaProcess) -> None:
    from click.testing import CliRunner

    from denv_iac.cli import main

    url = f"http://127.0.0.1:{replica.port}"
    result = CliRunner().invoke(
        main,
        ["bench", url, "--pool", "voice", "--requests", "6", "--concurrency", "2", "--json", "-"],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["ok"] == 6 and summary["replicas"] == {}  # direct: no balancer header
    bad = CliRunner().invoke(main, ["bench", "127.0.0.1:1", "--pool", "voice"])
    assert bad.exit_code == 2 and "is not an http(s) URL" in bad.output


def test_arrivals_are_poisson_and_seeded() -> None:
    plan = list(arrivals(200.0, requests=4000, seed=7))
    assert plan == list(arrivals(200.0, requests=4000, seed=7))
    assert plan != list(arrivals(200.0, requests=4000, seed=8))
    gaps = [b.at_s - a.at_s for a, b in zip([Arrival(0.0), *plan], plan, strict=False)]
    mean = statistics.fmean(gaps)
    # Exponential gaps: the mean is 1/rate and the standard deviation equals the mean.
    assert abs(mean - 1 / 200) < 0.05 / 200
    assert 0.9 < statistics.pstdev(gaps) / mean < 1.1
    assert all(a.session is None for a in plan)


@pytest.mark.parametrize(
    ("requests", "duration_s", "count"),
    [(10, None, range(10, 11)), (None, 2.0, range(80, 121)), (5, 2.0, range(5, 6))],
)
def test_arrivals_are_bounded(requests: int | None, duration_s: float | None, count: range) -> None:
    plan = list(arrivals(50.0, requests=requests, duration_s=duration_s, seed=1))
    assert len(plan) in count
    assert all(a.at_s < (duration_s or float("inf")) for a in plan)
    assert [a.at_s for a in plan] == sorted(a.at_s for a in plan)


def test_arrivals_mix_sessions_and_single_requests() -> None:
    plan = list(arrivals(100.0, requests=4000, session_share=0.4, session_turns=4, seed=3))
    turns = Counter(a.session for a in plan if a.session is not None)
    assert abs(sum(turns.values()) / len(plan) - 0.4) < 0.03
    assert max(turns.values()) == 4  # a conversation has its turns, never more
    # Conversations end and give way: at most OPEN_SESSIONS are still short of their turns.
    assert sum(1 for n in turns.values() if n < 4) <= OPEN_SESSIONS
    # A conversation's turns are spread among the others', not back to back.
    first = next(a.session for a in plan if a.session)
    positions = [i for i, a in enumerate(plan) if a.session == first]
    assert positions[-1] - positions[0] > 4
    everyone = list(arrivals(100.0, requests=50, session_share=1.0, session_turns=2))
    assert all(a.session for a in everyone)


@pytest.mark.parametrize(
    ("rate", "share", "turns", "problem"),
    [
        (5.0, 0.5, 3, None),
        (5.0, 0.0, 0, None),
        (0.0, 0.0, 0, "rate: 0.0 is not a positive number"),
        (float("nan"), 0.0, 0, "rate: nan is not a positive number"),
        (5.0, 1.5, 3, "session share: 1.5 is not between 0 and 1"),
        (5.0, 0.5, 0, "session share: needs turns per conversation"),
    ],
)
def test_open_loop_problems(rate: float, share: float, turns: int, problem: str | None) -> None:
    problems = open_loop_problems(rate, share, turns)
    assert problems == [] if problem is None else (len(problems) == 1 and problem in problems[0])
    if problem is not None:
        with pytest.raises(ValueError, match=problem.split(":")[0]):
            list(arrivals(rate, requests=1, session_share=share, session_turns=turns))


@pytest.mark.timing
def test_open_loop_never_waits_for_an_answer() -> None:
    """Answers take 400 ms and arrivals come every 25 ms on average: each request still leaves
    at its planned time, on a connection of its own while the others are busy."""
    slow = ReplicaProcess(ReplicaSimConfig("voice.t.n0.1", ttft_ms=400, itl_ms=2, tokens=3))
    slow.spawn()
    slow.wait_ready()
    try:
        url = f"http://127.0.0.1:{slow.port}"
        load = run_load(
            url, "voice", rate=40.0, requests=24, session_share=0.5, session_turns=3, seed=5
        )
        report = asyncio.run(load)
        stats = httpx.get(f"{url}/stats").json()
    finally:
        slow.stop()
    plan = list(arrivals(40.0, requests=24, session_share=0.5, session_turns=3, seed=5))
    assert len(report.results) == 24 and report.summary()["ok"] == 24
    assert sorted(stats["by_request_id"]) == sorted(r.request_id for r in report.results)
    started = sorted(r.started_s for r in report.results)
    for arrival, start in zip(plan, started, strict=True):
        assert_within(start, arrival.at_s, "open-loop arrival sent on time")
    # All 24 were sent within the first ~0.6 s: a closed loop of any size below 24 could not.
    assert_within(report.wall_s, plan[-1].at_s + 0.4, "open-loop run ends with its last answer")


def test_open_loop_sends_the_sessions() -> None:
    """The share of arrivals that are turns carry their conversation's X-Denv-Session."""
    seen: list[str | None] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            fields = dict(
                line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:-2]
            )
            await reader.readexactly(int(fields["content-length"]))
            seen.append(fields.get("x-denv-session"))
            done = b"data: [DONE]\n\n"
            token = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(token + done))
            writer.write(token + done)

    async def run() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            options = {"requests": 60, "session_share": 0.5, "session_turns": 3, "seed": 2}
            await run_load(f"http://127.0.0.1:{port}", "voice", rate=500.0, **options)

    asyncio.run(run())
    plan = list(arrivals(500.0, requests=60, session_share=0.5, session_turns=3, seed=2))
    assert Counter(seen) == Counter(a.session for a in plan)
    assert 10 < sum(1 for s in seen if s) < 50


def test_run_load_refuses_a_session_share_without_a_rate() -> None:
    with pytest.raises(ValueError, match="session_share needs an open-loop rate"):
        asyncio.run(run_load("http://127.0.0.1:9", "voice", requests=1, session_share=0.5))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--rate", "0"], "--rate: 0.0 is not a positive number of requests/s"),
        (["--rate", "5", "--concurrency", "4"], "--concurrency: a closed loop's"),
        (["--session-share", "0.5"], "--session-share: applies to an open loop; add --rate"),
        (["--rate", "5", "--session-share", "2"], "--session-share: 2.0 is not between 0 and 1"),
        (["--rate", "5", "--session-share", "0.5"], "needs turns per conversation (--session-"),
    ],
)
def test_bench_refuses_a_bad_open_loop(args: list[str], error: str) -> None:
    from click.testing import CliRunner

    from denv_iac.cli import main

    result = CliRunner().invoke(main, ["bench", "http://127.0.0.1:9", "--pool", "voice", *args])
    assert result.exit_code == 2 and error in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_bench_runs_an_open_loop(replica: ReplicaProcess) -> None:
    from click.testing import CliRunner

    from denv_iac.cli import main

    url = f"http://127.0.0.1:{replica.port}"
    args = ["bench", url, "--pool", "voice", "--rate", "50", "--requests", "10", "--json", "-"]
    args += ["--session-share", "0.5", "--session-turns", "2", "--seed", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ok"] == 10
