"""The requests the load generator sends, one builder per protocol: a streamed chat completion,
a speech request, and a transcription's multipart upload of a short PCM16 WAV.
"""

import json

from denv_iac.wire.audio import wav
from denv_iac.wire.multipart import form_data


def speech_request(pool: str) -> tuple[str, dict[str, str], bytes]:
    body = {"model": pool, "input": "Hello, how can I help?", "voice": "alloy"}
    body["response_format"] = "pcm"
    return "/v1/audio/speech", {"Content-Type": "application/json"}, json.dumps(body).encode()


UPLOAD = wav(1.0)
BOUNDARY = "denv-bench-boundary"


def transcription_request(pool: str) -> tuple[str, dict[str, str], bytes]:
    content_type, body = form_data(BOUNDARY, {"model": pool}, "bench.wav", "audio/wav", UPLOAD)
    return "/v1/audio/transcriptions", {"Content-Type": content_type}, body


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
