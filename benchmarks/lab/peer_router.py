"""A peer router on 127.0.0.1: vllm-router (the vLLM project's router) in front of replicas.

The overload benchmark runs the same simulated replicas behind it and behind the product's
balancer, to set the product's figures beside those of a router teams already run. It forwards
`/v1/chat/completions` (streamed or not) to the worker its policy picks, checks each worker's
`GET /health` (every `--health-check-interval-secs`) and tracks the requests it has in flight on
each, which is the load that `power_of_two` compares: the replica's `/get_load` (an SGLang
route) is absent, as on a vLLM server. Started in its own process and stopped by pid.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from denv_iac.local.processes import free_port

# The load-aware policy: of two workers drawn at random, the one with fewer requests in flight.
PEER_POLICY = "power_of_two"
_READY_TIMEOUT_S = 20.0


class PeerRouter:
    """vllm-router in front of `worker_urls`; `close()` stops it, whatever happened."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        workdir: Path,
        policy: str = PEER_POLICY,
        options: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.log_path = workdir / "vllm-router.log"
        self.command = [
            *(sys.executable, "-m", "vllm_router.launch_router"),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--worker-urls", *worker_urls),
            *("--policy", policy),
            # Its metrics listen on a port of their own (29000 unless told): a free one here.
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
            *("--worker-startup-timeout-secs", "10", "--worker-startup-check-interval", "1"),
            # Info logs a line per routed request: that would cost the router CPU in a benchmark.
            *("--log-level", "warning"),
            *options,
        ]
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PeerRouter:
        """Start it and wait until it serves; stopped again if it does not."""
        try:
            self._spawn()
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _wait_ready(self) -> None:
        """Until it serves: it listens only once every worker answered its health check."""
        assert self._process is not None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/readiness", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"vllm-router not ready in {_READY_TIMEOUT_S} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "no output"

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
