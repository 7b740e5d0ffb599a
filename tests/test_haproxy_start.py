"""HAProxy's start gives up in one line when the process dies or never opens its stats socket.

A stand-in for the binary (a shell script) plays both failures, so no HAProxy is needed here.
"""

from pathlib import Path

import pytest

from denv_iac.haproxy.runtime import HaproxyProcess, HaproxyStartError


def _process(tmp_path: Path, script: str) -> HaproxyProcess:
    binary = tmp_path / "haproxy"
    binary.write_text(f"#!/bin/sh\n{script}\n")
    binary.chmod(0o755)
    return HaproxyProcess(
        tmp_path / "haproxy.cfg", tmp_path / "stats.sock", tmp_path / "log", str(binary)
    )


def test_a_process_that_exits_fails_the_start_with_its_log(tmp_path: Path) -> None:
    process = _process(tmp_path, "echo 'no such section' >&2; exit 1")
    with pytest.raises(HaproxyStartError, match="haproxy exited at start:\nno such section"):
        process.start(timeout_s=10)


def test_no_stats_socket_in_time_stops_the_process_and_says_so(tmp_path: Path) -> None:
    process = _process(tmp_path, "echo started; exec sleep 30")
    with pytest.raises(HaproxyStartError, match=r"haproxy gave no stats socket in 0.3 s:\nstarted"):
        process.start(timeout_s=0.3)
    assert process.pid is not None and not process.running  # stopped: nothing is left behind
