"""A simulated GPU replica: an OpenAI-compatible streaming server with configurable latency.

It stands in for a model server in the local runner, the data-plane tests and the benchmarks:
`POST /v1/chat/completions` (SSE when `stream` is true), the voice paths (`POST
/v1/audio/speech` streamed PCM, `POST /v1/audio/transcriptions` and `/translations` of a
multipart upload, `GET /v1/realtime` over WebSocket; see voice_sim and denv_iac.wire), `GET
/health`, `GET /metrics` (the engine's own Prometheus names: vLLM's, SGLang's or TGI's), `GET
/stats` (what it received, so tests can prove a request was never replayed) and `POST
/control/fault` to make it fail the ways real replicas do (only with `Authorization: Bearer
<control token>`, see control_headers). Plain asyncio and a minimal HTTP/1.1, so that it is
never the bottleneck of a measurement; beyond the standard library it needs only two sans-IO
protocols: h11, which parses each request's head, and `websockets`, which frames the realtime
sessions (see denv_iac.wire.websocket).

Chat, speech and transcription each have the capacity of an engine (see engine_sim): a few
slots and a FIFO queue behind them. As a uvicorn/starlette StreamingResponse does, a streamed
response's status and headers go out when the request is admitted, before it has a slot; the
first chunk follows when it is decoded. A client that disconnects is aborted, freeing its slot
or its place in the queue, as vLLM aborts it.

    python -m denv_iac.local.replica_sim --id voice.local.n0.0 --port 0 --ttft-ms 50

This module is the simulator's command and its process (ReplicaProcess starts it so); the rest
is a module each: its settings, faults and counters (replica_model), its HTTP/1.1 and OpenAI
shapes (replica_http), its server and routes (replica_server), its realtime sessions
(replica_realtime).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import selectors
import subprocess
import sys
from pathlib import Path

from denv_iac.child_process import ChildProcess
from denv_iac.core.stack.model import SIMULATED_ENGINES, SIMULATED_SPEECH, SimulatedServer
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.local.replica_server import ReplicaSim

READY_PREFIX = "replica_sim ready"
# The fault route's token reaches the process in its environment, which only its owner can read
# (its command line, any user).
CONTROL_TOKEN_ENV = "DENV_REPLICA_CONTROL_TOKEN"


class ReplicaProcess(ChildProcess):
    """A simulated replica in its own process, as the local runner and the tests start it."""

    def __init__(
        self,
        config: ReplicaSimConfig,
        log_path: Path | None = None,
        command_prefix: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.command_prefix = command_prefix  # e.g. `ip netns exec NAME`: where it runs
        self.port = config.port
        self._process: subprocess.Popen[str] | None = None

    def spawn(self) -> None:
        """Start the process; wait_ready() then gives its port. Split so that many replicas
        start in parallel."""
        command = [
            *self.command_prefix,
            *(sys.executable, "-m", "denv_iac.local.replica_sim", *self._arguments()),
        ]
        log = self.log_path.open("a") if self.log_path is not None else None
        try:
            self._process = subprocess.Popen(
                command,
                env={**os.environ, CONTROL_TOKEN_ENV: self.config.control_token},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log if log is not None else subprocess.DEVNULL,
                text=True,
            )
        finally:
            if log is not None:
                log.close()

    def wait_ready(self, timeout_s: float = 10.0) -> int:
        process = self._process
        if process is None or process.stdout is None:
            raise RuntimeError("spawn() the replica first")
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                self.stop()
                raise RuntimeError(f"replica {self.config.replica_id} not ready in {timeout_s} s")
        line = process.stdout.readline()
        if not line.startswith(READY_PREFIX):
            self.stop()
            raise RuntimeError(f"replica {self.config.replica_id} failed to start: {line!r}")
        self.port = int(line.rsplit("port=", 1)[1])
        return self.port

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        if self._process is not None:
            self._process.wait()
            if self._process.stdout is not None:
                self._process.stdout.close()

    def _arguments(self) -> list[str]:
        config = self.config
        return [
            f"--id={config.replica_id}",
            f"--host={config.host}",
            f"--port={self.port}",
            f"--ttft-ms={config.ttft_ms}",
            f"--itl-ms={config.itl_ms}",
            f"--tokens={config.tokens}",
            f"--speech-engine={config.speech_engine}",
            f"--engine={config.engine}",
            f"--model={config.model}",
            f"--slots={config.slots}",
            f"--itl-growth={config.itl_growth}",
            f"--speech-slots={config.speech_slots}",
            f"--transcription-slots={config.transcription_slots}",
        ] + ([] if config.queue_limit is None else [f"--queue-limit={config.queue_limit}"])


def _parse_args(argv: list[str] | None) -> ReplicaSimConfig:
    parser = argparse.ArgumentParser(
        prog="python -m denv_iac.local.replica_sim",
        description="A simulated GPU replica: OpenAI-compatible streaming with set latency.",
    )
    parser.add_argument("--id", dest="replica_id", required=True, help="replica id to report")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ttft-ms", type=float, default=50.0, help="time to first token")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="gap between tokens")
    parser.add_argument("--tokens", type=int, default=20, help="tokens per completion")
    parser.add_argument(
        "--speech-engine",
        choices=SIMULATED_SPEECH,
        default=SIMULATED_SPEECH[0],
        help="espeak-ng: real synthesized speech for /v1/audio/speech",
    )
    parser.add_argument(
        "--engine",
        choices=SIMULATED_ENGINES,
        default=SimulatedServer.engine,
        help="whose Prometheus metric names /metrics serves",
    )
    parser.add_argument("--model", default="simulated", help="model_name label of /metrics")
    parser.add_argument(
        "--slots", type=int, default=SimulatedServer.slots, help="chat sequences decoding at once"
    )
    parser.add_argument(
        "--itl-growth",
        type=float,
        default=SimulatedServer.itl_growth,
        help="share of --itl-ms each running sequence past the first adds",
    )
    parser.add_argument(
        "--queue-limit", type=int, default=None, help="waiting requests past which a 503 answers"
    )
    parser.add_argument("--speech-slots", type=int, default=SimulatedServer.speech_slots)
    parser.add_argument(
        "--transcription-slots", type=int, default=SimulatedServer.transcription_slots
    )
    args = parser.parse_args(argv)
    return ReplicaSimConfig(
        replica_id=args.replica_id,
        host=args.host,
        port=args.port,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        tokens=args.tokens,
        speech_engine=args.speech_engine,
        engine=args.engine,
        model=args.model,
        slots=args.slots,
        itl_growth=args.itl_growth,
        queue_limit=args.queue_limit,
        speech_slots=args.speech_slots,
        transcription_slots=args.transcription_slots,
        **({"control_token": token} if (token := os.environ.get(CONTROL_TOKEN_ENV)) else {}),
    )


async def _serve(config: ReplicaSimConfig) -> None:
    sim = ReplicaSim(config)
    await sim.start()
    print(f"{READY_PREFIX} id={config.replica_id} host={config.host} port={sim.port}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    config = _parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(config))


if __name__ == "__main__":
    main()
