"""One realtime WebSocket session of the simulated replica (`GET /v1/realtime`): its session
object and events, each turn's audio frames and transcript paced as the replica's tokens are."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any, Protocol

from denv_iac.local.replica_http import ConnectionAborted, Request, reset_connection, token_text
from denv_iac.local.replica_model import FaultMode, ReplicaSimConfig, ReplicaStats
from denv_iac.local.voice_sim import realtime_event
from denv_iac.wire.audio import SAMPLE_RATE, audio_frame
from denv_iac.wire.websocket import WebSocket


class ServingReplica(Protocol):
    """What a realtime session needs of the replica serving it (ReplicaSim)."""

    config: ReplicaSimConfig
    stats: ReplicaStats
    fault: FaultMode
    fault_k: int

    def gap_s(self, index: int, itl_s: float) -> float: ...

    async def hang_if_asked(self) -> None: ...


class RealtimeSession:
    """One realtime WebSocket session of the simulated replica, in OpenAI's current (GA)
    realtime dialect: the events and fields the `openai` SDK's realtime client types
    (`openai.types.realtime`), e.g. `response.output_audio.delta`, not the beta
    `response.audio.delta`."""

    def __init__(self, sim: ServingReplica, ws: WebSocket, request: Request) -> None:
        self.sim, self.ws = sim, ws
        self.seq = 0
        self.turns = 0
        self.model = request.query.get("model", "")
        session = request.headers.get("x-denv-session", "")
        self.id = f"sess_{sim.config.replica_id}_{session or sim.stats.realtime_sessions}"

    def config(self) -> dict[str, Any]:
        """The session object of `session.created` and `session.updated`; `replica` is the
        simulator's own addition (which replica serves the session)."""
        audio_format = {"type": "audio/pcm", "rate": SAMPLE_RATE}
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
        await self.ws.send_text(realtime_event(kind, self.seq, **fields))

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
        await sim.hang_if_asked()
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
            due += sim.gap_s(index, sim.config.itl_ms / 1000.0)
            await _sleep_until(due)
            if index == die_after:
                sim.stats.realtime_turns_aborted += 1
                reset_connection(self.ws.writer)
                raise ConnectionAborted
            audio = base64.b64encode(audio_frame(index)).decode()
            await self.send("response.output_audio.delta", **at_part, delta=audio)
            await self.send(
                "response.output_audio_transcript.delta", **at_part, delta=token_text(index)
            )
            transcript += token_text(index)
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


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
