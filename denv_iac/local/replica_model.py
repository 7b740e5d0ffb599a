"""What a simulated replica is: the settings it runs with (ReplicaSimConfig), the faults it can
be put in to fail as real replicas do, the header that proves the right to do so, and the
counters it keeps of what it received and how each answer ended."""

from __future__ import annotations

import enum
import secrets
from collections import Counter
from dataclasses import dataclass, field

from denv_iac.core.stack.model import SIMULATED_SPEECH, SimulatedServer


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
class ReplicaStats:
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
