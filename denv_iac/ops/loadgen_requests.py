"""The requests the load generator sends, one builder per protocol: a streamed chat completion,
a speech request, and a transcription's multipart upload of a short PCM16 WAV.
"""

import io
import json

from denv_iac.local import voice_sim


def speech_request(pool: str) -> tuple[str, dict[str, str], bytes]:
    body = {"model": pool, "input": "Hello, how can I help?", "voice": "alloy"}
    body["response_format"] = "pcm"
    return "/v1/audio/speech", {"Content-Type": "application/json"}, json.dumps(body).encode()


def wav(seconds: float) -> bytes:
    """A PCM16 mono 24 kHz WAV of the simulator's tone: the upload a transcription bench sends."""
    frames = round(seconds * 1000 / voice_sim.FRAME_MS)
    audio = b"".join(voice_sim.audio_frame(index) for index in range(frames))
    out = io.BytesIO()
    header = voice_sim.wav_header()  # sizes filled in: a file, not a stream
    out.write(header[:4] + (36 + len(audio)).to_bytes(4, "little") + header[8:-4])
    out.write(len(audio).to_bytes(4, "little") + audio)
    return out.getvalue()


UPLOAD = wav(1.0)
BOUNDARY = "denv-bench-boundary"


def transcription_request(pool: str) -> tuple[str, dict[str, str], bytes]:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{pool}\r\n'.encode(),
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="bench.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + UPLOAD
        + b"\r\n",
        f"--{BOUNDARY}--\r\n".encode(),
    ]
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    return "/v1/audio/transcriptions", headers, b"".join(parts)


def chat_request(pool: str, max_tokens: int | None) -> tuple[str, dict[str, str], bytes]:
    request: dict[str, object] = {
        "model": pool,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    if max_tokens:
        request["max_tokens"] = max_tokens
    headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    return "/v1/chat/completions", headers, json.dumps(request).encode()
