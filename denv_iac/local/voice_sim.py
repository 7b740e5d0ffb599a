"""The voice answers of the simulated replica: streamed speech, the transcript of an upload,
and the events of a realtime session; the wire forms they travel in (PCM frames, the multipart
upload, the WebSocket) are denv_iac.wire's, which the load generator speaks too.

Timing follows the replica's config: the first audio frame `ttft_ms` after the request (or after
`response.create`), then one frame every `itl_ms`, `tokens` frames per answer.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from denv_iac.wire.audio import SAMPLE_RATE
from denv_iac.wire.multipart import Upload


def transcript_text(upload: Upload) -> str:
    seconds = len(upload.audio) / (SAMPLE_RATE * 2)
    return f"simulated transcript of {upload.filename or 'audio'} ({seconds:.2f} s of audio)"


def realtime_event(kind: str, seq: int, **fields: Any) -> bytes:
    """A realtime event as the UTF-8 JSON text of one message."""
    event = {"type": kind, "event_id": f"event_{seq}", **fields}
    return json.dumps(event, separators=(",", ":")).encode()


class WavToPcm:
    """A streamed WAV (PCM16 mono, any rate) in, OpenAI's `pcm` out: the header dropped and the
    samples resampled to 24 kHz by linear interpolation, piece by piece as they arrive (espeak-ng
    speaks at 22.05 kHz; a client asking for `pcm` plays what it gets at 24 kHz)."""

    def __init__(self, rate_out: int = SAMPLE_RATE) -> None:
        self._rate_out = rate_out
        self._head = b""  # the header, until its data chunk starts
        self._step: float | None = None  # input samples per output sample, once the header is read
        self._odd = b""  # half a sample carried to the next piece
        self._tail: list[int] = []  # input samples not yet passed
        self._pos = 0.0  # the next output sample's place in _tail

    def feed(self, piece: bytes) -> bytes:
        """The PCM this piece of the WAV stream makes; ValueError when it is not PCM16 mono."""
        if self._step is None:
            self._head += piece
            start = self._head.find(b"data")
            if len(self._head) < 44 or start < 0 or len(self._head) < start + 8:
                return b""
            channels, rate = struct.unpack_from("<HI", self._head, 22)
            bits = struct.unpack_from("<H", self._head, 34)[0]
            if self._head[:4] != b"RIFF" or channels != 1 or bits != 16:
                raise ValueError("expected a PCM16 mono WAV stream")
            self._step = rate / self._rate_out
            piece, self._head = self._head[start + 8 :], b""
        data = self._odd + piece
        whole = len(data) // 2 * 2
        self._odd = data[whole:]
        samples = self._tail + list(struct.unpack(f"<{whole // 2}h", data[:whole]))
        step, first = self._step, self._pos
        count = max(0, math.ceil((len(samples) - 1 - first) / step))
        places = [first + k * step for k in range(count)]
        out = [
            round(samples[i] + (samples[i + 1] - samples[i]) * (place - i))
            for place, i in zip(places, map(int, places), strict=True)
        ]
        pos = first + count * step
        passed = min(int(pos), len(samples))
        self._tail, self._pos = samples[passed:], pos - passed
        return struct.pack(f"<{len(out)}h", *out)
