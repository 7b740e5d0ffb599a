"""The simulated replica's server (ReplicaSim): its routes, the engines behind chat, speech and
transcription, and the faults it acts out; served in the running event loop."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import subprocess
from typing import Any

from websockets.frames import Opcode
from websockets.protocol import Side

from denv_iac.local import voice_sim
from denv_iac.local.engine_sim import (
    Capacity,
    Engine,
    EngineFull,
    EngineLost,
    Sequence,
    render_metrics,
    total,
)
from denv_iac.local.replica_http import (
    MAX_HEAD_BYTES,
    SELF_HEADER,
    BadRequest,
    Completion,
    ConnectionAborted,
    Request,
    body_piece,
    client_left,
    openai_error,
    prompt_tokens,
    read_request,
    refusal,
    reset_connection,
    respond_bytes,
    respond_json,
    response_end,
    response_head,
    sse_event,
    switching_protocols,
)
from denv_iac.local.replica_model import FaultMode, ReplicaSimConfig, ReplicaStats, control_headers
from denv_iac.local.replica_realtime import RealtimeSession
from denv_iac.wire.audio import audio_frame, wav_header
from denv_iac.wire.multipart import parse_multipart
from denv_iac.wire.websocket import WebSocket, WebSocketClosed, handshake_headers

_DONE_EVENT = b"data: [DONE]\n\n"
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
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The speech formats served, by either speech engine: what each says it is (`wav` is also the
# answer when none is named). OpenAI's mp3, opus, aac and flac get a 400 naming these.
SPEECH_FORMATS = ("pcm", "wav")
_SPEECH_PIECE_BYTES = 4096


class _RequestFailed(Exception):
    """The engine failed the request (error_after_headers)."""


class ReplicaSim:
    """The server; `start()` binds and serves in the running event loop."""

    def __init__(self, config: ReplicaSimConfig) -> None:
        self.config = config
        self.fault = FaultMode.NONE
        self.fault_k = 0
        self.stats = ReplicaStats()
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
            limit=MAX_HEAD_BYTES,
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
        pending = asyncio.ensure_future(read_request(reader))
        try:
            while True:
                self._idle.add(writer)
                request = await pending
                self._idle.discard(writer)
                if request is None:
                    return
                if (request.method, request.path) == ("GET", "/v1/realtime"):
                    # A WebSocket reads its own frames from the connection.
                    await self._dispatch(request, reader, writer)
                    return
                pending = asyncio.ensure_future(read_request(reader))
                if not await self._serve_watched(request, reader, writer, pending):
                    return
        except (ConnectionError, ConnectionAborted):
            return
        except BadRequest as error:
            body = openai_error(str(error), error.status)
            await respond_json(writer, error.status, body, self.config, refusal())
        finally:
            pending.cancel()
            if pending.done() and not pending.cancelled():
                pending.exception()  # retrieved: the connection is over either way
            self._idle.discard(writer)
            self._open.discard(writer)
            writer.transport.close()

    async def _serve_watched(
        self,
        request: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        next_request: asyncio.Future[Request | None],
    ) -> bool:
        """Serve a request, aborted if its client disconnects first; False: close the connection."""
        serving = asyncio.ensure_future(self._dispatch(request, reader, writer))
        try:
            await asyncio.wait((serving, next_request), return_when=asyncio.FIRST_COMPLETED)
            if not serving.done() and client_left(next_request):
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
                self.stats.requests_aborted += 1
                return False
            return await serving
        finally:
            serving.cancel()

    async def _dispatch(
        self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        path = request.path
        route = (request.method, path)
        if route == ("GET", "/stats"):
            await self._respond(writer, 200, self._stats_body(), request)
        elif route == ("POST", "/control/fault"):
            await self._control_fault(request, writer)
        elif route == ("GET", "/health"):
            self.stats.health_checks += 1
            await self.hang_if_asked()
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
            await respond_bytes(writer, 200, _METRICS_TYPE, page, self.config, request)
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
            await self._respond(writer, 405, openai_error(message, 405), request)
        else:
            message = f"no route {request.method} {path}"
            await self._respond(writer, 404, openai_error(message, 404), request)
        return request.keep_alive

    @property
    def _restarting(self) -> bool:
        return self.fault is FaultMode.ENGINE_RESTART

    async def hang_if_asked(self) -> None:
        if self.fault is FaultMode.HANG:
            await asyncio.Event().wait()

    async def _control_fault(self, request: Request, writer: asyncio.StreamWriter) -> None:
        sent = request.headers.get("authorization", "").encode()
        expected = control_headers(self.config.control_token)["Authorization"].encode()
        if not self.config.control_token or not hmac.compare_digest(sent, expected):
            error = openai_error("send Authorization: Bearer <the replica's control token>", 401)
            await self._respond(writer, 401, error, request)
            return
        try:
            body = json.loads(request.body or b"{}")
            mode = FaultMode(body["mode"])
            k = int(body.get("k", 0))
        except (ValueError, KeyError, TypeError):
            modes = ", ".join(mode.value for mode in FaultMode)
            error = openai_error(f"send mode: one of {modes}", 400, "mode")
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

    async def _chat_completion(self, request: Request, writer: asyncio.StreamWriter) -> None:
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
            # vLLM reads both; the current OpenAI SDK and routers send max_completion_tokens.
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            tokens = int(limit or self.config.tokens)
        except (ValueError, TypeError) as error:
            await self._respond(
                writer, 400, openai_error(f"invalid request body: {error}", 400), request
            )
            return
        self._count(request.headers.get("x-request-id") or body.get("user"))
        await self.hang_if_asked()
        sequence = await self._admit(self.chat_engine, prompt_tokens(body), request, writer)
        if sequence is None:
            return
        self._completion_seq += 1
        completion = Completion(
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
        self, engine: Engine, prompt_tokens: int, request: Request, writer: asyncio.StreamWriter
    ) -> Sequence | None:
        """The request's place in the engine, or None once it was refused with a 503."""
        try:
            if self._restarting:
                raise EngineFull("the engine is restarting")
            return engine.submit(prompt_tokens)
        except EngineFull as error:
            body = openai_error(f"the server is full: {error}; retry later", 503)
            await self._respond(writer, 503, body, request)
            return None

    async def _token(self, sequence: Sequence, index: int, previous: float) -> float:
        """Wait for token `index` of a sequence; the time it was due, the base of the next."""
        itl_s = sequence.engine.itl_s(self.config.itl_ms)
        made = await sequence.until(previous + self.gap_s(index, itl_s))
        if self.fault is FaultMode.ERROR_AFTER_HEADERS and index >= self.fault_k:
            raise _RequestFailed("the engine failed the request")
        sequence.emitted()
        return made

    async def _whole(
        self,
        completion: Completion,
        sequence: Sequence,
        tokens: int,
        request: Request,
        writer: asyncio.StreamWriter,
    ) -> None:
        try:
            made = await sequence.started()
            for index in range(tokens):
                made = await self._token(sequence, index, made)
        except (EngineLost, _RequestFailed) as error:
            self.stats.streams_failed += 1
            await self._respond(writer, 500, openai_error(str(error), 500), request)
            return
        await self._respond(writer, 200, completion.whole(tokens), request)

    async def _stream(
        self,
        completion: Completion,
        sequence: Sequence,
        tokens: int,
        request: Request,
        writer: asyncio.StreamWriter,
    ) -> None:
        # Headers go out at admission, before a slot: the first chunk when decoding begins.
        writer.write(
            response_head(
                request,
                200,
                "text/event-stream",
                self.config,
                extra=(("Cache-Control", "no-cache"),),
            )
        )
        await writer.drain()
        die_after = self.fault_k if self.fault is FaultMode.DIE_AFTER_TOKENS else None
        try:
            made = await sequence.started()
            for index in range(tokens):
                made = await self._token(sequence, index, made)
                if index == die_after:
                    self.stats.streams_aborted += 1
                    reset_connection(writer)
                    raise ConnectionAborted
                writer.write(body_piece(request, sse_event(completion.token_chunk(index))))
                await writer.drain()
        except (EngineLost, _RequestFailed) as error:
            # As vLLM's stream generator does: one error event, then [DONE].
            self.stats.streams_failed += 1
            writer.write(
                body_piece(request, sse_event(openai_error(str(error), 500)))
                + body_piece(request, _DONE_EVENT)
                + response_end(request)
            )
            await writer.drain()
            return
        writer.write(
            body_piece(request, sse_event(completion.final_chunk()))
            + body_piece(request, _DONE_EVENT)
            + response_end(request)
        )
        await writer.drain()
        self.stats.streams_completed += 1

    def _count(self, request_id: object) -> None:
        self.stats.requests += 1
        if request_id:
            self.stats.by_request_id[str(request_id)] += 1

    async def _speech(self, request: Request, writer: asyncio.StreamWriter) -> None:
        """Streamed speech: audio frames paced like tokens, a crash (die_after_tokens) cuts it."""
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict) or not str(body.get("input", "")):
                raise ValueError("send a JSON object with input")
        except (ValueError, TypeError) as error:
            await self._respond(
                writer, 400, openai_error(f"invalid request body: {error}", 400), request
            )
            return
        response_format = str(body.get("response_format") or "wav")
        if response_format not in SPEECH_FORMATS:
            served = ", ".join(SPEECH_FORMATS)
            message = (
                f"response_format {response_format!r} is not served here: send one of {served}"
            )
            refusal = openai_error(message, 400, "response_format", "unsupported_response_format")
            await self._respond(writer, 400, refusal, request)
            return
        pcm = response_format == "pcm"
        espeak = self.config.speech_engine == "espeak-ng"
        self._count(request.headers.get("x-request-id"))
        await self.hang_if_asked()
        sequence = await self._admit(self.speech_engine, 0, request, writer)
        if sequence is None:
            return
        try:
            content_type = "audio/pcm" if pcm else "audio/wav"
            writer.write(response_head(request, 200, content_type, self.config))
            await writer.drain()
            try:
                if espeak:
                    await sequence.started()
                    await self._espeak(sequence, request, writer, str(body["input"]), pcm)
                else:
                    await self._tone(sequence, pcm, request, writer)
            except (EngineLost, _RequestFailed):
                # Audio has no error event: the stream is closed before its last chunk.
                self.stats.streams_failed += 1
                raise ConnectionAborted from None
            writer.write(response_end(request))
            await writer.drain()
            self.stats.streams_completed += 1
        finally:
            self.speech_engine.release(sequence)

    async def _tone(
        self, sequence: Sequence, pcm: bool, request: Request, writer: asyncio.StreamWriter
    ) -> None:
        die_after = self.fault_k if self.fault is FaultMode.DIE_AFTER_TOKENS else None
        made = await sequence.started()
        for index in range(self.config.tokens):
            made = await self._token(sequence, index, made)
            if index == die_after:
                self.stats.streams_aborted += 1
                reset_connection(writer)
                raise ConnectionAborted
            header = wav_header() if index == 0 and not pcm else b""
            writer.write(body_piece(request, header + audio_frame(index)))
            await writer.drain()

    @staticmethod
    async def _espeak(
        sequence: Sequence, request: Request, writer: asyncio.StreamWriter, text: str, pcm: bool
    ) -> None:
        """Real speech: espeak-ng's WAV (or, for `pcm`, its samples at 24 kHz), each piece sent
        as soon as espeak-ng writes it. Each piece is the engine's progress, as a token is: the
        agent calls an engine with requests running and no progress for its stall budget stalled,
        and a sentence espeak-ng takes over a second to write on a busy CPU is not."""
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
                    writer.write(body_piece(request, piece))
                sequence.emitted()
                await writer.drain()
        finally:
            if engine.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    engine.kill()
            await engine.wait()

    async def _transcription(self, request: Request, writer: asyncio.StreamWriter) -> None:
        """The transcript of an uploaded file, whole, after the first-token time."""
        try:
            upload = parse_multipart(request.headers.get("content-type", ""), request.body)
        except ValueError as error:
            await self._respond(writer, 400, openai_error(f"invalid upload: {error}", 400), request)
            return
        self._count(request.headers.get("x-request-id"))
        await self.hang_if_asked()
        sequence = await self._admit(self.transcription_engine, 0, request, writer)
        if sequence is None:
            return
        try:
            await self._token(sequence, 0, await sequence.started())
        except (EngineLost, _RequestFailed) as error:
            self.stats.streams_failed += 1
            await self._respond(writer, 500, openai_error(str(error), 500), request)
            return
        finally:
            self.transcription_engine.release(sequence)
        text = voice_sim.transcript_text(upload)
        if upload.fields.get("response_format") == "text":
            await respond_bytes(writer, 200, "text/plain", text.encode(), self.config, request)
        else:
            await self._respond(writer, 200, {"text": text}, request)

    async def _realtime(
        self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A realtime session: session.created, then one answer per response.create."""
        handshake = handshake_headers(request.headers, {SELF_HEADER: self.config.replica_id})
        if handshake is None:
            await self._respond(writer, 400, openai_error("send a WebSocket upgrade", 400), request)
            return
        self.stats.realtime_sessions += 1
        self.stats.realtime_subprotocols = request.headers.get("sec-websocket-protocol", "")
        self._count(request.headers.get("x-request-id"))
        await self.hang_if_asked()
        writer.write(switching_protocols(request, handshake))
        ws = WebSocket(reader, writer, Side.SERVER)
        session = RealtimeSession(self, ws, request)
        await session.send("session.created", session=session.config())
        while True:
            try:
                opcode, payload = await ws.receive()
            except WebSocketClosed:
                return
            if opcode == Opcode.CLOSE:  # the protocol has sent the answering close frame
                writer.close()
                return
            if opcode == Opcode.TEXT:
                await session.on_event(payload)

    def gap_s(self, index: int, itl_s: float) -> float:
        """The time from the token before (from the slot, for the first) to token `index`."""
        if self.fault is FaultMode.DRIP:
            return self.fault_k / 1000.0
        if index == 0:
            return self.config.ttft_ms * (self.fault_k if self.fault is FaultMode.SLOW else 1) / 1e3
        return itl_s

    async def _respond(
        self, writer: asyncio.StreamWriter, status: int, body: dict[str, Any], request: Request
    ) -> None:
        await respond_json(writer, status, body, self.config, request)
