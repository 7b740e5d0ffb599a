"""A simulated GPU replica: an OpenAI-compatible streaming server with configurable latency.

It stands in for a model server in the local runner, the data-plane tests and the benchmarks:
`POST /v1/chat/completions` (SSE when `stream` is true), the voice paths (`POST
/v1/audio/speech` streamed PCM, `POST /v1/audio/transcriptions` and `/translations` of a
multipart upload, `GET /v1/realtime` over WebSocket; see voice_sim), `GET /health`, `GET
/metrics` (the engine's own Prometheus names: vLLM's, SGLang's or TGI's), `GET /stats` (what
it received, so tests can prove a request was never replayed) and `POST /control/fault` to make
it fail the ways real replicas do (only with `Authorization: Bearer <control token>`, see
control_headers). Plain asyncio and a minimal HTTP/1.1, so that it is never the bottleneck of a
measurement; beyond the standard library it needs only the `websockets` sans-IO protocol, which
frames the realtime sessions (see voice_sim).

Chat, speech and transcription each have the capacity of an engine (see engine_sim): a few
slots and a FIFO queue behind them. As a uvicorn/starlette StreamingResponse does, a streamed
response's status and headers go out when the request is admitted, before it has a slot; the
first chunk follows when it is decoded. A client that disconnects is aborted, freeing its slot
or its place in the queue, as vLLM aborts it.

    python -m denv_iac.local.replica_sim --id voice.local.n0.0 --port 0 --ttft-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import enum
import hmac
import json
import os
import secrets
import selectors
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.frames import Opcode
from websockets.protocol import Side

from denv_iac.core.stack.model import SIMULATED_ENGINES, SIMULATED_SPEECH, SimulatedServer
from denv_iac.local import voice_sim
from denv_iac.local.child import ChildProcess
from denv_iac.local.engine_sim import (
    Capacity,
    Engine,
    EngineFull,
    EngineLost,
    Sequence,
    render_metrics,
    total,
)

READY_PREFIX = "replica_sim ready"
SELF_HEADER = "X-Denv-Replica-Self"
# The fault route's token reaches the process in its environment, which only its owner can read
# (its command line, any user).
CONTROL_TOKEN_ENV = "DENV_REPLICA_CONTROL_TOKEN"

_MAX_HEAD_BYTES = 64 * 1024
_MAX_BODY_BYTES = 16 * 1024 * 1024
_ROUTES = (
    "/stats",
    "/metrics",
    "/control/fault",
    "/health",
    "/v1/chat/completions",
    "/v1/audio/speech",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/realtime",
)
_TRANSCRIPTION_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The speech formats served, by either speech engine: what each says it is (`wav` is also the
# answer when none is named). OpenAI's mp3, opus, aac and flac get a 400 naming these.
SPEECH_FORMATS = ("pcm", "wav")
_SPEECH_PIECE_BYTES = 4096


class FaultMode(enum.StrEnum):
    NONE = "none"
    EXIT = "exit"  # the process exits at once: every connection is reset, the port refuses
    DIE_AFTER_TOKENS = "die_after_tokens"  # streams are reset after k tokens, no final chunk
    REFUSE = "refuse"  # the listening socket closes: new connections are refused
    HANG = "hang"  # requests are read but never answered (health checks included)
    SLOW = "slow"  # time to first token k times the configured one, as on a throttled GPU
    DRIP = "drip"  # every token, the first too, k ms after the one before: a stalling engine
    # The API answers (health 200, headers at admission) while the engine makes no token: every
    # request holds its slot or its place in the queue, in silence, until the fault is cleared.
    ZOMBIE = "zombie"
    # A request fails in the engine after k tokens: a stream ends with an OpenAI error event
    # (speech, which has no events, is closed before its last chunk); a whole answer is a 500.
    ERROR_AFTER_HEADERS = "error_after_headers"
    # The engine restarts: every request, decoding or queued, ends at once as above and the
    # queue is lost; for k ms health and requests are answered 503, then it serves again.
    ENGINE_RESTART = "engine_restart"


@dataclass(frozen=True)
class ReplicaSimConfig:
    replica_id: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, see ReplicaSim.port
    ttft_ms: float = 50.0
    itl_ms: float = 10.0
    tokens: int = 20
    # "espeak-ng": /v1/audio/speech is synthesized by espeak-ng on the CPU (WAV, 22.05 kHz mono
    # PCM16, streamed as it is made); "tone": the simulated tone, paced like tokens.
    speech_engine: str = SIMULATED_SPEECH[0]
    engine: str = SimulatedServer.engine  # whose metric names /metrics serves
    model: str = "simulated"  # the model_name label of /metrics
    slots: int = SimulatedServer.slots
    itl_growth: float = SimulatedServer.itl_growth
    queue_limit: int | None = SimulatedServer.queue_limit
    speech_slots: int = SimulatedServer.speech_slots
    transcription_slots: int = SimulatedServer.transcription_slots
    # Whoever sends it may inject faults (control_headers); made afresh unless given (the local
    # runner gives its stack's token).
    control_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)


def control_headers(token: str) -> dict[str, str]:
    """The headers of a `POST /control/fault` that the replica with this token obeys."""
    return {"Authorization": f"Bearer {token}"}


@dataclass
class _Request:
    method: str
    path: str
    keep_alive: bool
    headers: dict[str, str]
    body: bytes


@dataclass
class _Stats:
    requests: int = 0
    health_checks: int = 0
    streams_completed: int = 0
    streams_aborted: int = 0
    streams_failed: int = 0  # ended with an error from the engine (error event, 500)
    requests_aborted: int = 0  # the client disconnected before the answer ended
    realtime_sessions: int = 0
    realtime_turns_completed: int = 0
    realtime_turns_aborted: int = 0
    # The subprotocols the last realtime session offered, as they reached the replica.
    realtime_subprotocols: str = ""
    by_request_id: Counter[str] = field(default_factory=Counter)


class _ConnectionAborted(Exception):
    """The simulated fault reset the connection; stop serving it."""


class _RequestFailed(Exception):
    """The engine failed the request (error_after_headers)."""


class ReplicaSim:
    """The server; `start()` binds and serves in the running event loop."""

    def __init__(self, config: ReplicaSimConfig) -> None:
        self.config = config
        self.fault = FaultMode.NONE
        self.fault_k = 0
        self.stats = _Stats()
        self._server: asyncio.Server | None = None
        self._port = config.port
        self._idle: set[asyncio.StreamWriter] = set()
        self._open: set[asyncio.StreamWriter] = set()
        self._completion_seq = 0
        queue_limit = config.queue_limit
        self.chat_engine = Engine(Capacity(config.slots, queue_limit, config.itl_growth))
        self.speech_engine = Engine(Capacity(config.speech_slots, queue_limit))
        self.transcription_engine = Engine(Capacity(config.transcription_slots, queue_limit))
        self._engines = (self.chat_engine, self.speech_engine, self.transcription_engine)
        self._restarted: asyncio.TimerHandle | None = None

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve_connection,
            self.config.host,
            self._port,
            reuse_address=True,
            limit=_MAX_HEAD_BYTES,
        )
        self._port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._stop_listening()
        for writer in list(self._open):
            writer.transport.abort()

    def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _set_fault(self, mode: FaultMode, k: int) -> None:
        self.fault, self.fault_k = mode, k
        if self._restarted is not None:
            self._restarted.cancel()
            self._restarted = None
        for engine in self._engines:
            engine.stall(mode is FaultMode.ZOMBIE)
        if mode is FaultMode.ENGINE_RESTART:
            for engine in self._engines:
                engine.restart()
            self._restarted = asyncio.get_running_loop().call_later(k / 1000.0, self._serve_again)
        if mode is FaultMode.REFUSE:
            self._stop_listening()
            # A replica whose port refuses has no idle keep-alive connections left either.
            for writer in list(self._idle):
                writer.transport.abort()
        elif self._server is None:
            await self.start()

    def _serve_again(self) -> None:
        self._restarted = None
        self.fault, self.fault_k = FaultMode.NONE, 0

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._open.add(writer)
        # The next request is read while one is served: the read ending (the client closed or
        # reset the connection) is how a client that left is noticed.
        pending = asyncio.ensure_future(_read_request(reader))
        try:
            while True:
                self._idle.add(writer)
                request = await pending
                self._idle.discard(writer)
                if request is None:
                    return
                if (request.method, request.path.split("?", 1)[0]) == ("GET", "/v1/realtime"):
                    # A WebSocket reads its own frames from the connection.
                    await self._dispatch(request, reader, writer)
                    return
                pending = asyncio.ensure_future(_read_request(reader))
                if not await self._serve_watched(request, reader, writer, pending):
                    return
        except (ConnectionError, _ConnectionAborted):
            return
        except _BadRequest as error:
            body = _openai_error(str(error), error.status)
            await _respond_json(writer, error.status, body, self.config, False)
        finally:
            pending.cancel()
            if pending.done() and not pending.cancelled():
                pending.exception()  # retrieved: the connection is over either way
            self._idle.discard(writer)
            self._open.discard(writer)
            writer.transport.close()

    async def _serve_watched(
        self,
        request: _Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        next_request: asyncio.Future[_Request | None],
    ) -> bool:
        """Serve a request, aborted if its client disconnects first; False: close the connection."""
        serving = asyncio.ensure_future(self._dispatch(request, reader, writer))
        try:
            await asyncio.wait((serving, next_request), return_when=asyncio.FIRST_COMPLETED)
            if not serving.done() and _client_left(next_request):
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
                self.stats.requests_aborted += 1
                return False
            return await serving
        finally:
            serving.cancel()

    async def _dispatch(
        self, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        path = request.path.split("?", 1)[0]
        route = (request.method, path)
        if route == ("GET", "/stats"):
            await self._respond(writer, 200, self._stats_body(), request)
        elif route == ("POST", "/control/fault"):
            await self._control_fault(request, writer)
        elif route == ("GET", "/health"):
            self.stats.health_checks += 1
            await self._hang_if_asked()
            healthy = not self._restarting
            await self._respond(
                writer,
                200 if healthy else 503,
                {"status": "ok" if healthy else "restarting", "replica": self.config.replica_id},
                request,
            )
        elif route == ("GET", "/metrics"):
            load = total([engine.load() for engine in self._engines])
            page = render_metrics(self.config.engine, self.config.model, load).encode()
            await _respond_bytes(writer, 200, _METRICS_TYPE, page, self.config, request.keep_alive)
        elif route == ("POST", "/v1/chat/completions"):
            await self._chat_completion(request, writer)
        elif route == ("POST", "/v1/audio/speech"):
            await self._speech(request, writer)
        elif request.method == "POST" and path in _TRANSCRIPTION_PATHS:
            await self._transcription(request, writer)
        elif route == ("GET", "/v1/realtime"):
            await self._realtime(request, reader, writer)
            return False
        elif path in _ROUTES:
            message = f"method {request.method} is not allowed on {path}"
            await self._respond(writer, 405, _openai_error(message, 405), request)
        else:
            message = f"no route {request.method} {path}"
            await self._respond(writer, 404, _openai_error(message, 404), request)
        return request.keep_alive

    @property
    def _restarting(self) -> bool:
        return self.fault is FaultMode.ENGINE_RESTART

    async def _hang_if_asked(self) -> None:
        if self.fault is FaultMode.HANG:
            await asyncio.Event().wait()

    async def _control_fault(self, request: _Request, writer: asyncio.StreamWriter) -> None:
        sent = request.headers.get("authorization", "").encode()
        expected = control_headers(self.config.control_token)["Authorization"].encode()
        if not self.config.control_token or not hmac.compare_digest(sent, expected):
            error = _openai_error("send Authorization: Bearer <the replica's control token>", 401)
            await self._respond(writer, 401, error, request)
            return
        try:
            body = json.loads(request.body or b"{}")
            mode = FaultMode(body["mode"])
            k = int(body.get("k", 0))
        except (ValueError, KeyError, TypeError):
            modes = ", ".join(mode.value for mode in FaultMode)
            error = _openai_error(f"send mode: one of {modes}", 400, "mode")
            await self._respond(writer, 400, error, request)
            return
        if mode is not FaultMode.EXIT:
            await self._set_fault(mode, k)
        await self._respond(writer, 200, {"fault": mode.value, "k": k}, request)
        if mode is FaultMode.EXIT:
            os._exit(1)

    def _stats_body(self) -> dict[str, Any]:
        return {
            "replica": self.config.replica_id,
            "fault": self.fault.value,
            "requests": self.stats.requests,
            "health_checks": self.stats.health_checks,
            "streams_completed": self.stats.streams_completed,
            "streams_aborted": self.stats.streams_aborted,
            "streams_failed": self.stats.streams_failed,
            "requests_aborted": self.stats.requests_aborted,
            "realtime_sessions": self.stats.realtime_sessions,
            "realtime_turns_completed": self.stats.realtime_turns_completed,
            "realtime_turns_aborted": self.stats.realtime_turns_aborted,
            "realtime_subprotocols": self.stats.realtime_subprotocols,
            "by_request_id": dict(sorted(self.stats.by_request_id.items())),
        }

    async def _chat_completion(self, request: _Request, writer: asyncio.StreamWriter) -> None:
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
            # vLLM reads both; the current OpenAI SDK and routers send max_completion_tokens.
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            tokens = int(limit or self.config.tokens)
        except (ValueError, TypeError) as error:
            await self._respond(
                writer, 400, _openai_error(f"invalid request body: {error}", 400), request
            )
            return
        self._count(request.headers.get("x-request-id") or body.get("user"))
        await self._hang_if_asked()
        sequence = await self._admit(self.chat_engine, _prompt_tokens(body), request, writer)
        if sequence is None:
            return
        self._completion_seq += 1
        completion = _Completion(
            id=f"chatcmpl-{self.config.replica_id}-{self._completion_seq}",
            model=str(body.get("model", "")),
            replica_id=self.config.replica_id,
        )
        try:
            if body.get("stream"):
                await self._stream(completion, sequence, tokens, request, writer)
            else:
                await self._whole(completion, sequence, tokens, request, writer)
        finally:
            self.chat_engine.release(sequence)

    async def _admit(
        self, engine: Engine, prompt_tokens: int, request: _Request, writer: asyncio.StreamWriter
    ) -> Sequence | None:
        """The request's place in the engine, or None once it was refused with a 503."""
        try:
            if self._restarting:
                raise EngineFull("the engine is restarting")
            return engine.submit(prompt_tokens)
        except EngineFull as error:
            body = _openai_error(f"the server is full: {error}; retry later", 503)
            await self._respond(writer, 503, body, request)
            return None

    async def _token(self, sequence: Sequence, index: int, previous: float) -> float:
        """Wait for token `index` of a sequence; the time it was due, the base of the next."""
        itl_s = sequence.engine.itl_s(self.config.itl_ms)
        made = await sequence.until(previous + self._gap_s(index, itl_s))
        if self.fault is FaultMode.ERROR_AFTER_HEADERS and index >= self.fault_k:
            raise _RequestFailed("the engine failed the request")
        sequence.emitted()
        return made

    async def _whole(
        self,
        completion: _Completion,
        sequence: Sequence,
        tokens: int,
        request: _Request,
        writer: asyncio.StreamWriter,
    ) -> None:
        try:
            made = await sequence.started()
            for index in range(tokens):
                made = await self._token(sequence, index, made)
        except (EngineLost, _RequestFailed) as error:
            self.stats.streams_failed += 1
            await self._respond(writer, 500, _openai_error(str(error), 500), request)
            return
        await self._respond(writer, 200, completion.whole(tokens), request)

    async def _stream(
        self,
        completion: _Completion,
        sequence: Sequence,
        tokens: int,
        request: _Request,
        writer: asyncio.StreamWriter,
    ) -> None:
        # Headers go out at admission, before a slot: the first chunk when decoding begins.
        writer.write(
            _head(200, "text/event-stream", self.config, request.keep_alive, chunked=True)
            + b"Cache-Control: no-cache\r\n\r\n"
        )
        await writer.drain()
        die_after = self.fault_k if self.fault is FaultMode.DIE_AFTER_TOKENS else None
        try:
            made = await sequence.started()
            for index in range(tokens):
                made = await self._token(sequence, index, made)
                if index == die_after:
                    self.stats.streams_aborted += 1
                    _reset(writer)
                    raise _ConnectionAborted
                writer.write(_chunk(_sse(completion.token_chunk(index))))
                await writer.drain()
        except (EngineLost, _RequestFailed) as error:
            # As vLLM's stream generator does: one error event, then [DONE].
            self.stats.streams_failed += 1
            writer.write(
                _chunk(_sse(_openai_error(str(error), 500)))
                + _chunk(b"data: [DONE]\n\n")
                + b"0\r\n\r\n"
            )
            await writer.drain()
            return
        writer.write(
            _chunk(_sse(completion.final_chunk())) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        )
        await writer.drain()
        self.stats.streams_completed += 1

    def _count(self, request_id: object) -> None:
        self.stats.requests += 1
        if request_id:
            self.stats.by_request_id[str(request_id)] += 1

    async def _speech(self, request: _Request, writer: asyncio.StreamWriter) -> None:
        """Streamed speech: audio frames paced like tokens, a crash (die_after_tokens) cuts it."""
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict) or not str(body.get("input", "")):
                raise ValueError("send a JSON object with input")
        except (ValueError, TypeError) as error:
            await self._respond(
                writer, 400, _openai_error(f"invalid request body: {error}", 400), request
            )
            return
        response_format = str(body.get("response_format") or "wav")
        if response_format not in SPEECH_FORMATS:
            served = ", ".join(SPEECH_FORMATS)
            message = (
                f"response_format {response_format!r} is not served here: send one of {served}"
            )
            refusal = _openai_error(message, 400, "response_format", "unsupported_response_format")
            await self._respond(writer, 400, refusal, request)
            return
        pcm = response_format == "pcm"
        espeak = self.config.speech_engine == "espeak-ng"
        self._count(request.headers.get("x-request-id"))
        await self._hang_if_asked()
        sequence = await self._admit(self.speech_engine, 0, request, writer)
        if sequence is None:
            return
        try:
            content_type = "audio/pcm" if pcm else "audio/wav"
            writer.write(_head(200, content_type, self.config, request.keep_alive, chunked=True))
            writer.write(b"\r\n")
            await writer.drain()
            try:
                if espeak:
                    await sequence.started()
                    await self._espeak(writer, str(body["input"]), pcm)
                else:
                    await self._tone(sequence, pcm, writer)
            except (EngineLost, _RequestFailed):
                # Audio has no error event: the stream is closed before its last chunk.
                self.stats.streams_failed += 1
                raise _ConnectionAborted from None
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            self.stats.streams_completed += 1
        finally:
            self.speech_engine.release(sequence)

    async def _tone(self, sequence: Sequence, pcm: bool, writer: asyncio.StreamWriter) -> None:
        die_after = self.fault_k if self.fault is FaultMode.DIE_AFTER_TOKENS else None
        made = await sequence.started()
        for index in range(self.config.tokens):
            made = await self._token(sequence, index, made)
            if index == die_after:
                self.stats.streams_aborted += 1
                _reset(writer)
                raise _ConnectionAborted
            header = voice_sim.wav_header() if index == 0 and not pcm else b""
            writer.write(_chunk(header + voice_sim.audio_frame(index)))
            await writer.drain()

    @staticmethod
    async def _espeak(writer: asyncio.StreamWriter, text: str, pcm: bool) -> None:
        """Real speech: espeak-ng's WAV (or, for `pcm`, its samples at 24 kHz), each piece sent
        as soon as espeak-ng writes it."""
        to_pcm = voice_sim.WavToPcm() if pcm else None
        # The text goes after `--` as one argument: never read as an option, no shell.
        engine = await asyncio.create_subprocess_exec(
            "espeak-ng",
            "--stdout",
            "--",
            text,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert engine.stdout is not None
        try:
            # Small pieces: each goes out as soon as it is made (and, for pcm, resampled).
            while piece := await engine.stdout.read(_SPEECH_PIECE_BYTES):
                if to_pcm is not None:
                    piece = to_pcm.feed(piece)
                if piece:
                    writer.write(_chunk(piece))
                await writer.drain()
        finally:
            if engine.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    engine.kill()
            await engine.wait()

    async def _transcription(self, request: _Request, writer: asyncio.StreamWriter) -> None:
        """The transcript of an uploaded file, whole, after the first-token time."""
        try:
            upload = voice_sim.parse_multipart(
                request.headers.get("content-type", ""), request.body
            )
        except ValueError as error:
            await self._respond(
                writer, 400, _openai_error(f"invalid upload: {error}", 400), request
            )
            return
        self._count(request.headers.get("x-request-id"))
        await self._hang_if_asked()
        sequence = await self._admit(self.transcription_engine, 0, request, writer)
        if sequence is None:
            return
        try:
            await self._token(sequence, 0, await sequence.started())
        except (EngineLost, _RequestFailed) as error:
            self.stats.streams_failed += 1
            await self._respond(writer, 500, _openai_error(str(error), 500), request)
            return
        finally:
            self.transcription_engine.release(sequence)
        text = voice_sim.transcript_text(upload)
        if upload.fields.get("response_format") == "text":
            await _respond_bytes(
                writer, 200, "text/plain", text.encode(), self.config, request.keep_alive
            )
        else:
            await self._respond(writer, 200, {"text": text}, request)

    async def _realtime(
        self, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A realtime session: session.created, then one answer per response.create."""
        handshake = voice_sim.handshake_response(
            request.headers, {SELF_HEADER: self.config.replica_id}
        )
        if handshake is None:
            await self._respond(
                writer, 400, _openai_error("send a WebSocket upgrade", 400), request
            )
            return
        self.stats.realtime_sessions += 1
        self.stats.realtime_subprotocols = request.headers.get("sec-websocket-protocol", "")
        self._count(request.headers.get("x-request-id"))
        await self._hang_if_asked()
        writer.write(handshake)
        ws = voice_sim.WebSocket(reader, writer, Side.SERVER)
        session = _RealtimeSession(self, ws, request)
        await session.send("session.created", session=session.config())
        while True:
            try:
                opcode, payload = await ws.receive()
            except voice_sim.WebSocketClosed:
                return
            if opcode == Opcode.CLOSE:  # the protocol has sent the answering close frame
                writer.close()
                return
            if opcode == Opcode.TEXT:
                await session.on_event(payload)

    def _gap_s(self, index: int, itl_s: float) -> float:
        """The time from the token before (from the slot, for the first) to token `index`."""
        if self.fault is FaultMode.DRIP:
            return self.fault_k / 1000.0
        if index == 0:
            return self.config.ttft_ms * (self.fault_k if self.fault is FaultMode.SLOW else 1) / 1e3
        return itl_s

    async def _respond(
        self, writer: asyncio.StreamWriter, status: int, body: dict[str, Any], request: _Request
    ) -> None:
        await _respond_json(writer, status, body, self.config, request.keep_alive)


@dataclass(frozen=True)
class _Completion:
    id: str
    model: str
    replica_id: str

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
            "replica": self.replica_id,
        }

    def token_chunk(self, index: int) -> dict[str, Any]:
        delta = {"content": _token_text(index)}
        if index == 0:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {**self._envelope("chat.completion.chunk"), "choices": [choice]}

    def final_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {}, "finish_reason": "stop"}
        return {**self._envelope("chat.completion.chunk"), "choices": [choice]}

    def whole(self, tokens: int) -> dict[str, Any]:
        text = "".join(_token_text(index) for index in range(tokens))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        return {**self._envelope("chat.completion"), "choices": [choice], "usage": usage}


class _RealtimeSession:
    """One realtime WebSocket session of the simulated replica, in OpenAI's current (GA)
    realtime dialect: the events and fields the `openai` SDK's realtime client types
    (`openai.types.realtime`), e.g. `response.output_audio.delta`, not the beta
    `response.audio.delta`."""

    def __init__(self, sim: ReplicaSim, ws: voice_sim.WebSocket, request: _Request) -> None:
        self.sim, self.ws = sim, ws
        self.seq = 0
        self.turns = 0
        query = request.path.partition("?")[2]
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        self.model = params.get("model", "")
        session = request.headers.get("x-denv-session", "")
        self.id = f"sess_{sim.config.replica_id}_{session or sim.stats.realtime_sessions}"

    def config(self) -> dict[str, Any]:
        """The session object of `session.created` and `session.updated`; `replica` is the
        simulator's own addition (which replica serves the session)."""
        audio_format = {"type": "audio/pcm", "rate": voice_sim.SAMPLE_RATE}
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.model,
            "output_modalities": ["audio"],
            "audio": {"input": {"format": audio_format}, "output": {"format": audio_format}},
            "replica": self.sim.config.replica_id,
        }

    async def send(self, kind: str, **fields: Any) -> None:
        self.seq += 1
        await self.ws.send_text(voice_sim.realtime_event(kind, self.seq, **fields))

    async def on_event(self, payload: bytes) -> None:
        try:
            event = json.loads(payload)
            kind = event["type"]
        except (ValueError, KeyError, TypeError):
            await self.send("error", error={"type": "invalid_request_error", "message": "bad"})
            return
        if kind == "session.update":
            await self.send("session.updated", session=self.config())
        elif kind == "input_audio_buffer.commit":
            await self.send("input_audio_buffer.committed", item_id=f"item_in_{self.seq}")
        elif kind == "response.create":
            options = event.get("response")
            metadata = options.get("metadata") if isinstance(options, dict) else None
            await self.turn(metadata if isinstance(metadata, dict) else None)

    async def turn(self, metadata: dict[str, Any] | None) -> None:
        """One response: an assistant message item with one audio part, its 20 ms PCM16 frames
        at 24 kHz and their transcript, then done; `metadata` (from `response.create`) is
        echoed in the response object, as clients match responses by it."""
        sim = self.sim
        due = time.monotonic()
        await sim._hang_if_asked()
        self.turns += 1
        response_id = f"resp_{self.id}_{self.turns}"
        item_id = f"item_{response_id}"
        response = {
            "id": response_id,
            "object": "realtime.response",
            "output_modalities": ["audio"],
            "metadata": metadata,
        }
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
        }
        at_item = {"response_id": response_id, "output_index": 0}
        at_part = {**at_item, "item_id": item_id, "content_index": 0}
        await self.send("response.created", response={**response, "status": "in_progress"})
        await self.send(
            "response.output_item.added",
            **at_item,
            item={**item, "status": "in_progress", "content": []},
        )
        await self.send(
            "response.content_part.added", **at_part, part={"type": "audio", "transcript": ""}
        )
        die_after = sim.fault_k if sim.fault is FaultMode.DIE_AFTER_TOKENS else None
        transcript = ""
        for index in range(sim.config.tokens):
            # Realtime sessions are not batched: the pace of a sequence decoding alone.
            due += sim._gap_s(index, sim.config.itl_ms / 1000.0)
            await _sleep_until(due)
            if index == die_after:
                sim.stats.realtime_turns_aborted += 1
                _reset(self.ws.writer)
                raise _ConnectionAborted
            audio = base64.b64encode(voice_sim.audio_frame(index)).decode()
            await self.send("response.output_audio.delta", **at_part, delta=audio)
            await self.send(
                "response.output_audio_transcript.delta", **at_part, delta=_token_text(index)
            )
            transcript += _token_text(index)
        await self.send("response.output_audio.done", **at_part)
        await self.send("response.output_audio_transcript.done", **at_part, transcript=transcript)
        await self.send(
            "response.content_part.done",
            **at_part,
            part={"type": "audio", "transcript": transcript},
        )
        done_item = {
            **item,
            "status": "completed",
            "content": [{"type": "output_audio", "transcript": transcript}],
        }
        await self.send("response.output_item.done", **at_item, item=done_item)
        await self.send(
            "response.done",
            response={
                **response,
                "status": "completed",
                "output": [done_item],
                "replica": sim.config.replica_id,
            },
        )
        sim.stats.realtime_turns_completed += 1


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """One request from the connection, or None when the peer closed it between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        if error.partial.strip():
            raise _BadRequest(400, "truncated request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise _BadRequest(400, "request head too large") from None
    request_line, *header_lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    try:
        method, target, version = request_line.split(" ", 2)
    except ValueError:
        raise _BadRequest(400, "malformed request line") from None
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _BadRequest(501, "chunked request bodies are not supported; send Content-Length")
    length = int(headers.get("content-length") or 0)
    if length > _MAX_BODY_BYTES:
        raise _BadRequest(413, "request body too large")
    body = await reader.readexactly(length) if length else b""
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    return _Request(method, target, keep_alive, headers, body)


def _head(
    status: int, content_type: str, config: ReplicaSimConfig, keep_alive: bool, chunked: bool
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}",
        f"Content-Type: {content_type}",
        f"{SELF_HEADER}: {config.replica_id}",
        "Connection: keep-alive" if keep_alive else "Connection: close",
    ]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


async def _respond_json(
    writer: asyncio.StreamWriter,
    status: int,
    body: dict[str, Any],
    config: ReplicaSimConfig,
    keep_alive: bool,
) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    await _respond_bytes(writer, status, "application/json", payload, config, keep_alive)


async def _respond_bytes(
    writer: asyncio.StreamWriter,
    status: int,
    content_type: str,
    payload: bytes,
    config: ReplicaSimConfig,
    keep_alive: bool,
) -> None:
    head = _head(status, content_type, config, keep_alive, chunked=False)
    writer.write(head + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()


def _openai_error(
    message: str, status: int, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, as vLLM and SGLang answer it (and send it as a stream's event):
    a client's mistake is an `invalid_request_error` naming the `param` at fault; the engine's
    own failures keep vLLM's types and its numeric code."""
    if status >= 500 and status != 501:
        kind = "ServiceUnavailableError" if status == 503 else "InternalServerError"
        code = status if code is None else code
    else:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's length as the engine would count it, a word for a token."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))


def _client_left(next_request: asyncio.Future[_Request | None]) -> bool:
    """Whether the read of the next request ended because the client closed or reset."""
    if not next_request.done():
        return False
    error = next_request.exception()
    if error is not None:
        return isinstance(error, ConnectionError)
    return next_request.result() is None


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _token_text(index: int) -> str:
    return f"tok{index} "


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort with a TCP reset, as a crashed model server's kernel would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


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
