"""The audio both ends send: PCM16 mono at 24 kHz, in 20 ms frames (480 samples, 960 bytes), as
OpenAI's realtime API and `response_format=pcm` speech send it; a tone to fill them, and the WAV
header a streamed answer starts with."""

import math
import struct

SAMPLE_RATE = 24_000
FRAME_MS = 20
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000
FRAME_BYTES = FRAME_SAMPLES * 2  # PCM16 mono


def audio_frame(index: int) -> bytes:
    """20 ms of a 440 Hz tone, continuous across frames: real PCM any player can play."""
    start = index * FRAME_SAMPLES
    samples = (
        int(8000 * math.sin(2 * math.pi * 440 * (start + n) / SAMPLE_RATE))
        for n in range(FRAME_SAMPLES)
    )
    return struct.pack(f"<{FRAME_SAMPLES}h", *samples)


def wav_header() -> bytes:
    """A WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as streaming TTS sends)."""
    byte_rate = SAMPLE_RATE * 2
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, byte_rate, 2, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


def wav(seconds: float) -> bytes:
    """A PCM16 mono 24 kHz WAV file of the tone, `seconds` long: a transcription's upload."""
    frames = round(seconds * 1000 / FRAME_MS)
    audio = b"".join(audio_frame(index) for index in range(frames))
    header = wav_header()  # its sizes filled in: a file, not a stream
    riff = (36 + len(audio)).to_bytes(4, "little")
    return header[:4] + riff + header[8:-4] + len(audio).to_bytes(4, "little") + audio
