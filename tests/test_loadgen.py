"""The load client against a real simulated replica: TTFT measured, aborts seen as aborts."""

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from denv_iac.local.replica_sim import ReplicaProcess, ReplicaSimConfig, control_headers
from denv_iac.ops.loadgen import percentile, run_load


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
