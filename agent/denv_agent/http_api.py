"""The agent's HTTP side: /healthz, /metrics and the token-guarded /control/* endpoints, and
the pod endpoints a replica pod asks on Kubernetes (PodApi)."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("denv_agent.http")

MAX_BODY = 64 * 1024
ControlHandler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Serving:
    """One threaded HTTP server on `address` (IPv6 when the host has a colon)."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        server_class = _Server6 if ":" in address[0] else _Server
        self._server = server_class(address, handler)
        self.address: tuple[str, int] = self._server.socket.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name=type(self).__name__,
            kwargs={"poll_interval": 0.1},
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


class HttpApi(_Serving):
    def __init__(
        self,
        address: tuple[str, int],
        token: str,
        healthz: Callable[[], dict[str, Any]],
        metrics: Callable[[], bytes],
        control: Mapping[str, ControlHandler],
    ) -> None:
        class Handler(_Handler):
            api = self

        self.token = token.encode()
        self.healthz = healthz
        self.metrics = metrics
        self.control = control
        super().__init__(address, Handler)

    def authorized(self, header: str | None) -> bool:
        scheme, _, presented = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode(), self.token
        )


PodAnswer = tuple[int, dict[str, Any]]


class PodApi(_Serving):
    """What a replica pod asks its node's agent, without a token (the site's network policy lets
    only its replica pods reach it): `GET /pods/<pod>/ready` (200 when warm, 503 when not, 404
    when the pod is not on this node) and `POST /pods/<pod>/drain?hold_s=N` (send it nothing
    new; the drain ends when its server stops, at most `hold_s` later)."""

    def __init__(
        self,
        address: tuple[str, int],
        ready: Callable[[str], PodAnswer],
        drain: Callable[[str, float], PodAnswer],
    ) -> None:
        class Handler(_PodHandler):
            api = self

        self.ready = ready
        self.drain = drain
        super().__init__(address, Handler)


class JsonHandler(BaseHTTPRequestHandler):
    """Answers with a body of a known length, JSON by default."""

    server_version = "denv-agent"
    # A slow or silent client holds one thread for at most this long.
    timeout = 5

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def _json(self, status: int, doc: Mapping[str, Any]) -> None:
        self._send(status, json.dumps(doc, indent=1).encode() + b"\n", "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _PodHandler(JsonHandler):
    api: PodApi

    def do_GET(self) -> None:
        pod, action, _ = self._target()
        self._json(*(self.api.ready(pod) if action == "ready" else _NOT_FOUND))

    def do_POST(self) -> None:
        pod, action, query = self._target()
        if action != "drain":
            self._json(*_NOT_FOUND)
            return
        hold = query.get("hold_s", ["0"])[-1]
        try:
            hold_s = float(hold)
        except ValueError:
            hold_s = -1.0
        if not 0 < hold_s <= MAX_HOLD_S:
            self._json(400, {"error": f"hold_s must be seconds in (0, {MAX_HOLD_S:.0f}]"})
            return
        self._json(*self.api.drain(pod, hold_s))

    def _target(self) -> tuple[str, str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        route = parts.path.split("/")
        if len(route) != 4 or route[1] != "pods":
            return "", "", {}
        return route[2], route[3], parse_qs(parts.query)


_NOT_FOUND: PodAnswer = (404, {"error": "not found"})
# A drain held longer than two days is a mistake in the caller, not a voice call (a recipe's
# drain bound is at most a day, and the grace period adds its server's stop).
MAX_HOLD_S = 172800.0


class _Handler(JsonHandler):
    api: HttpApi

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/healthz":
            self._json(200, self.api.healthz())
        elif path == "/metrics":
            self._send(200, self.api.metrics(), CONTENT_TYPE_LATEST)
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        name = path.removeprefix("/control/")
        handler = self.api.control.get(name) if name != path else None
        if handler is None:
            self._json(404, {"error": "not found"})
            return
        if not self.api.authorized(self.headers.get("Authorization")):
            self._json(401, {"error": "missing or wrong control token"})
            return
        try:
            self._json(200, handler(self._body()))
        except ControlError as e:
            self._json(e.status, {"error": str(e)})

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ControlError(400, "bad Content-Length") from None
        if length > MAX_BODY:
            raise ControlError(413, f"body over {MAX_BODY} bytes")
        raw = self.rfile.read(length) if length > 0 else b"{}"
        try:
            body = json.loads(raw)
        except ValueError:
            raise ControlError(400, "body is not JSON") from None
        if not isinstance(body, dict):
            raise ControlError(400, "body must be a JSON object")
        return body
