"""`denv bench --protocol` through a real HAProxy, and a replica called directly in one run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from benchmarks.lab.dataplane import Dataplane
from denv_iac.cli import main
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.local.replica_sim import ReplicaProcess
from denv_iac.ops.voice_failover import realtime_failover


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dataplane]:
    """One data plane for the module: each run is short, the plane's start is not."""
    started = Dataplane.start(tmp_path_factory.mktemp("bench-plane"))
    yield started
    started.close()


def _bench(plane: Dataplane, *args: str) -> dict[str, object]:
    direct = plane.replicas["voice.home-a.n0.0"].url
    argv = ["bench", plane.url, "--pool", "voice", "--direct", direct, "--json", "-", *args]
    outcome = CliRunner().invoke(main, argv)
    assert outcome.exit_code == 0, outcome.output
    # stdout only: the agent stand-in's threads may log to stderr meanwhile
    summary: dict[str, object] = json.loads(outcome.stdout)
    return summary


def _total(plane: Dataplane, stat: str) -> int:
    return sum(int(r.stats()[stat]) for r in plane.replicas.values())


def test_realtime_turns_through_the_endpoint_and_direct(plane: Dataplane) -> None:
    args = ["--protocol", "realtime", "--requests", "6", "--concurrency", "2"]
    sessions, turns = _total(plane, "realtime_sessions"), _total(plane, "realtime_turns_completed")
    summary = _bench(plane, *args)
    assert summary["ok"] == 6 and summary["errors"] == {}
    direct = summary["direct"]
    assert isinstance(direct, dict) and direct["ok"] == 6
    replicas = summary["replicas"]
    assert isinstance(replicas, dict) and all(r.startswith("voice.home-") for r in replicas)
    p50, added = summary["first_audio_p50_ms"], summary["added_p50_ms"]
    assert isinstance(p50, float) and isinstance(added, float)
    assert p50 >= 20  # the replicas' first-audio time: the figure is the turn's, not the socket's
    # One session per worker and path, kept for all its turns, each turn served once.
    assert _total(plane, "realtime_sessions") - sessions == 4
    assert _total(plane, "realtime_turns_completed") - turns == 12


@pytest.mark.parametrize(
    ("protocol", "key"), [("speech", "first_audio"), ("transcription", "transcript")]
)
def test_speech_and_transcription_through_the_endpoint_and_direct(
    plane: Dataplane, protocol: str, key: str
) -> None:
    summary = _bench(plane, "--protocol", protocol, "--requests", "4", "--concurrency", "1")
    assert summary["ok"] == 4 and summary["protocol"] == protocol
    direct = summary["direct"]
    assert isinstance(direct, dict) and direct["ok"] == 4
    assert isinstance(summary[f"{key}_p50_ms"], float)
    assert isinstance(direct[f"{key}_p50_ms"], float)


def test_realtime_failover_cuts_with_a_close_and_reconnects_elsewhere(plane: Dataplane) -> None:
    def seen() -> dict[str, list[str]]:
        receipts: dict[str, list[str]] = {}
        for replica_id, replica in plane.replicas.items():
            if replica.process.port is not None and replica_id != killed[0]:
                for request_id, count in replica.stats()["by_request_id"].items():
                    receipts.setdefault(request_id, []).extend([replica_id] * count)
        return receipts

    killed = [""]

    def kill(replica_id: str) -> None:
        killed[0] = replica_id
        plane.replicas[replica_id].kill()

    failover = realtime_failover(plane.url, "voice", kill, seen, sessions=4)
    report = asyncio.run(failover)
    plane.replicas[report.victim].restart()
    plane.wait_until(plane.all_up, timeout_s=10, what="every server up again")
    figures = report.figures()
    assert report.victim.startswith("voice.home-")
    assert isinstance(figures["cut"], int) and figures["cut"] >= 1
    assert figures["cut_as"] == {"aborted": figures["cut"]}  # the socket goes: 1006, no frame
    assert figures["stalled"] == 0 and figures["replayed"] == 0
    assert figures["failed_reconnects"] == 0
    assert figures["reconnected_elsewhere"] == figures["cut"]
    reconnect = figures["reconnect_max_ms"]
    assert isinstance(reconnect, float) and reconnect < 1000  # the bench holds it to 100 ms


def test_realtime_turns_without_audio_fail_the_bench(tmp_path: Path) -> None:
    """A replica whose turns end (`response.done`) without one audio delta: every turn is
    `no_audio` and the run exits non-zero, not a success with no figure."""
    silent = ReplicaProcess(
        ReplicaSimConfig("voice.silent.n0.0", ttft_ms=5, tokens=0), log_path=tmp_path / "sim.log"
    )
    silent.spawn()
    try:
        silent.wait_ready()
        url = f"http://127.0.0.1:{silent.port}"
        argv = ["bench", url, "--pool", "voice", "--protocol", "realtime", "--requests", "3"]
        outcome = CliRunner().invoke(main, [*argv, "--concurrency", "1", "--json", "-"])
        turns = silent_turns(url)
    finally:
        silent.stop()
    assert outcome.exit_code == 1, outcome.output
    summary = json.loads(outcome.stdout)
    assert summary["ok"] == 0 and summary["errors"] == {"no_audio": 3}
    assert summary["first_audio_p50_ms"] is None
    assert turns == 3  # the turns were served: only their audio was missing


def silent_turns(url: str) -> int:
    return int(httpx.get(f"{url}/stats", timeout=2).json()["realtime_turns_completed"])
