"""A real speech-to-text server on the CPU: pocketsphinx behind OpenAI's transcription API.

    python -m denv_iac.local.transcriber --host 127.0.0.1 --port 8000

`POST /v1/audio/transcriptions` takes OpenAI's multipart form (`file`: a PCM16 WAV of any rate
and channel count, `model`: any name, `response_format`: `json` by default or `text`) and answers
`{"text": ...}`, the recogniser's best hypothesis. The audio is mixed down to mono and resampled
to the 16 kHz of pocketsphinx's en-us model, which its wheel ships (acoustic model, language
model, dictionary): nothing is downloaded. `GET /health` answers 503 while the model loads, then
200. One utterance is decoded at a time (a decoder is not shared between threads); give the
recipe `max_concurrency: 1` so the balancer holds the rest.
"""

from __future__ import annotations

import argparse
import io
import json
import threading
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from denv_iac.wire.multipart import parse_multipart

PATH = "/v1/audio/transcriptions"
HEALTH_PATH = "/health"
MODEL_RATE = 16_000  # the en-us acoustic model's sample rate
MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # OpenAI's own limit on an upload


class Recogniser:
    """pocketsphinx's decoder with its default en-us model, one utterance at a time."""

    def __init__(self) -> None:
        from pocketsphinx import Decoder  # loads the model: the slow part of starting

        self._decoder = Decoder(samprate=MODEL_RATE, loglevel="ERROR")
        self._lock = threading.Lock()

    def transcribe(self, wav: bytes) -> str:
        """The words heard in a PCM16 WAV; ValueError when it is not one."""
        pcm = model_pcm(wav)
        with self._lock:
            self._decoder.start_utt()
            self._decoder.process_raw(pcm, full_utt=True)
            self._decoder.end_utt()
            hypothesis = self._decoder.hyp()
        return "" if hypothesis is None else str(hypothesis.hypstr)


def model_pcm(wav: bytes) -> bytes:
    """A PCM16 WAV's samples as the model hears them: mono, 16 kHz (linear interpolation)."""
    try:
        with wave.open(io.BytesIO(wav)) as audio:
            channels, width, rate = audio.getnchannels(), audio.getsampwidth(), audio.getframerate()
            frames = audio.readframes(audio.getnframes())
    except (wave.Error, EOFError) as error:
        raise ValueError(f"the file is not a WAV ({error or 'it ends early'})") from None
    if width != 2:
        raise ValueError(f"the WAV has {8 * width}-bit samples; send 16-bit PCM")
    samples = np.frombuffer(frames[: len(frames) // (2 * channels) * 2 * channels], "<i2")
    mono = samples.reshape(-1, channels).mean(axis=1)
    if rate != MODEL_RATE and len(mono):
        count = round(len(mono) * MODEL_RATE / rate)
        mono = np.interp(np.arange(count) * (rate / MODEL_RATE), np.arange(len(mono)), mono)
    return bytes(np.round(mono).astype("<i2").tobytes())


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        if self.path.split("?")[0] != HEALTH_PATH:
            self._error(404, f"no route for GET {self.path}; try GET {HEALTH_PATH}")
        elif self.server.recogniser is None:
            self._error(503, "loading the model")
        else:
            self._send(200, "application/json", b'{"status":"ok"}')

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._error(400, "send the body's length as Content-Length")
            return
        if length > MAX_UPLOAD_BYTES:
            self.close_connection = True
            self._error(413, f"the upload is over {MAX_UPLOAD_BYTES} bytes")
            return
        body = self.rfile.read(length)
        if self.path.split("?")[0] != PATH:
            self._error(404, f"no route for POST {self.path}; try POST {PATH}")
            return
        recogniser = self.server.recogniser
        if recogniser is None:
            self._error(503, "loading the model")
            return
        try:
            upload = parse_multipart(self.headers.get("Content-Type", ""), body)
            text = recogniser.transcribe(upload.audio)
        except ValueError as error:
            self._error(400, f"invalid upload: {error}")
            return
        if upload.fields.get("response_format") == "text":
            self._send(200, "text/plain; charset=utf-8", text.encode())
        else:
            self._send(200, "application/json", json.dumps({"text": text}).encode())

    def _error(self, status: int, message: str) -> None:
        """OpenAI's error body."""
        error = {"message": message, "type": "invalid_request_error", "param": None}
        self._send(status, "application/json", json.dumps({"error": {**error, "code": status}}))

    def _send(self, status: int, content_type: str, body: bytes | str) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged: the balancer logs each one."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    recogniser: Recogniser | None = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    server = _Server((args.host, args.port), _Handler)

    def load() -> None:
        server.recogniser = Recogniser()

    # Listening first, so that /health says the model is loading rather than nothing answering.
    threading.Thread(target=load, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
