"""denv-agent footprint and agent-check latency, on the agent as a real process.

The agent runs with `--simulate` on 8 GPUs with 8 replicas (stand-in model servers in this
process), polling GPUs and health paths at 1 Hz and probing first tokens every 5 s, while it
answers agent-checks at HAProxy's pace (each replica once a second). CPU and RSS come from
/proc. Then every NVML call is slowed to 1 s and agent-check latency is measured again: the
replies must not wait for NVML.

The agent runs with compiled bytecode, as an installed one does (pip compiles at install time;
otherwise Python writes __pycache__ on the first start). Where bytecode writing is disabled
(PYTHONDONTWRITEBYTECODE), every start compiles nvidia-ml-py's large module and RSS stays higher:
`agent_rss_mb_compiling_at_start` reports that case.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from denv_agent.config import to_toml
from denv_agent.control import inject_fault
from denv_agent.process import AgentProcess

GPUS = 8
CPU_WINDOW_S = 10.0
LATENCY_SAMPLES = 2000
SLOW_NVML_S = 1.0
TARGETS = {"agentcheck_p99_ms": 5.0, "agent_rss_mb": 50.0, "agent_cpu_pct_of_core": 2.0}


class _Replicas(BaseHTTPRequestHandler):
    """Eight healthy model servers behind one port: /health/N and a one-token stream."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        token = {"choices": [{"delta": {"content": "hi"}}]}
        self.wfile.write(f"data: {json.dumps(token)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _ask(address: tuple[str, int], replica_id: str) -> float:
    """One agent-check exchange; returns its latency in seconds."""
    started = time.perf_counter()
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(f"{replica_id}\n".encode())
        reply = b""
        while chunk := s.recv(256):
            reply += chunk
    elapsed = time.perf_counter() - started
    if not reply.endswith(b"\n"):
        raise RuntimeError(f"agent-check reply {reply!r}")
    return elapsed


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _percentile_ms(samples: list[float], pct: int) -> float:
    return round(statistics.quantiles(samples, n=100)[pct - 1] * 1000, 3)


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.perf_counter()
    while not condition():
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.001)
    return time.perf_counter() - started


def _reply(address: tuple[str, int], replica_id: str) -> bytes:
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(f"{replica_id}\n".encode())
        return s.recv(256)


def _steady(agent: AgentProcess, ids: list[str]) -> None:
    """Every replica up, first probes and polls done."""
    _wait(
        lambda: all(_reply(agent.agent_check, r) == b"up ready 100%\n" for r in ids),
        20,
        "replicas up",
    )
    time.sleep(2)


def _measure(agent: AgentProcess, token: str, ids: list[str]) -> dict[str, float]:
    address = agent.agent_check
    _steady(agent, ids)

    # HAProxy's pace: every replica checked once a second.
    cpu_before, started = _cpu_seconds(agent.pid), time.monotonic()
    for n in range(int(CPU_WINDOW_S * len(ids))):
        time.sleep(max(0.0, started + n / len(ids) - time.monotonic()))
        _ask(address, ids[n % len(ids)])
    window = time.monotonic() - started
    cpu_pct = (_cpu_seconds(agent.pid) - cpu_before) / window * 100
    rss = _rss_mb(agent.pid)

    fast = [_ask(address, ids[n % len(ids)]) for n in range(LATENCY_SAMPLES // 4)]

    xid_started = time.perf_counter()
    inject_fault(agent.http_url, token, gpu=3, xid=48)
    _wait(lambda: _reply(address, ids[3]).startswith(b"down #xid 48"), 5, "xid 48 down")
    xid_ms = (time.perf_counter() - xid_started) * 1000

    inject_fault(agent.http_url, token, slow_s=SLOW_NVML_S)
    time.sleep(2 * SLOW_NVML_S)  # every poller now parked inside a slow NVML call
    slow = [_ask(address, ids[n % len(ids)]) for n in range(LATENCY_SAMPLES)]
    return {
        "agentcheck_p50_ms": _percentile_ms(slow, 50),
        "agentcheck_p99_ms": _percentile_ms(slow, 99),
        "agentcheck_max_ms": round(max(slow) * 1000, 3),
        "agentcheck_p99_ms_fast_nvml": _percentile_ms(fast, 99),
        "xid_to_down_ms": round(xid_ms, 1),
        "agent_rss_mb": round(rss, 1),
        "agent_cpu_pct_of_core": round(cpu_pct, 2),
    }


def _with_bytecode(cache: Path) -> dict[str, str]:
    """An environment whose Python reads compiled bytecode, filled here once."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(cache)
    subprocess.run([sys.executable, "-c", "import denv_agent.cli"], env=env, check=True)
    return env


def run() -> dict[str, float]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Replicas)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    ids = [f"voice.local.bench.{n}" for n in range(GPUS)]
    token = secrets.token_hex(16)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp, "agent.toml")
            config.write_text(
                to_toml(
                    {
                        "node": "bench",
                        "state_file": str(Path(tmp, "state.json")),
                        "control_token": token,
                        "listen": {"agent_check": "127.0.0.1:0", "http": "127.0.0.1:0"},
                        "intervals": {"gpu_poll_s": 1.0, "health_s": 1.0, "probe_s": 5.0},
                        "simulate": {"gpus": GPUS},
                        "replicas": [
                            {
                                "id": rid,
                                "health_url": f"{base}/health/{n}",
                                "gpu": n,
                                "ttft_budget_ms": 300,
                                "probe_model": "voice",
                            }
                            for n, rid in enumerate(ids)
                        ],
                    }
                )
            )
            quiet = ["--log-level", "warning"]
            env = _with_bytecode(Path(tmp, "pycache"))
            with AgentProcess(config, simulate=True, extra_args=quiet, env=env) as agent:
                figures = _measure(agent, token, ids)
            no_bytecode = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
            with AgentProcess(config, simulate=True, extra_args=quiet, env=no_bytecode) as agent:
                _steady(agent, ids)
                figures["agent_rss_mb_compiling_at_start"] = round(_rss_mb(agent.pid), 1)
    finally:
        server.shutdown()
        server.server_close()
    figures.update({f"target_{key}": value for key, value in TARGETS.items()})
    return figures


def report(figures: dict[str, float]) -> str:
    f = figures
    return "\n".join(
        [
            f"denv-agent, {GPUS} simulated GPUs and {GPUS} replicas, 1 Hz polling",
            f"  agent-check, NVML at {SLOW_NVML_S:g} s per call: p50 {f['agentcheck_p50_ms']} ms, "
            f"p99 {f['agentcheck_p99_ms']} ms, max {f['agentcheck_max_ms']} ms "
            f"(target p99 < {TARGETS['agentcheck_p99_ms']:g} ms)",
            f"  agent-check p99, NVML at full speed: {f['agentcheck_p99_ms_fast_nvml']} ms",
            f"  critical XID to down reply: {f['xid_to_down_ms']} ms (target < 500 ms)",
            f"  RSS: {f['agent_rss_mb']} MB (target < {TARGETS['agent_rss_mb']:g} MB); "
            f"{f['agent_rss_mb_compiling_at_start']} MB where bytecode is never cached",
            f"  CPU: {f['agent_cpu_pct_of_core']}% of one core "
            f"(target < {TARGETS['agent_cpu_pct_of_core']:g}%)",
        ]
    )


if __name__ == "__main__":
    print(report(run()))
