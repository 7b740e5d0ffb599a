"""HAProxy's agent-check: one TCP port for every replica on the node, answered from a snapshot.

HAProxy connects, sends its `agent-send` string (a replica id, with or without a newline, or
nothing at all), reads one line and closes. Replies come from the latest published snapshot
only, so a slow NVML call or a hung replica never delays one.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Mapping

MAX_REQUEST = 256
MALFORMED = b"down #malformed request\n"
UNKNOWN = b"down #unknown replica\n"
UNNAMED = b"down #agent-send names no replica\n"


def answer(request: bytes, replies: Mapping[str, bytes]) -> bytes:
    """The reply line for one request, whatever bytes it holds."""
    line, newline, _ = request.partition(b"\n")
    if len(line) > MAX_REQUEST or (not newline and len(request) > MAX_REQUEST):
        return MALFORMED
    try:
        name = line.decode("ascii").strip()
    except UnicodeDecodeError:
        return MALFORMED
    if not name.isprintable():
        return MALFORMED
    if not name:
        # Without agent-send, a node with a single replica is unambiguous.
        return next(iter(replies.values())) if len(replies) == 1 else UNNAMED
    return replies.get(name, UNKNOWN)


def bind(address: tuple[str, int]) -> socket.socket:
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


class AgentCheckServer:
    def __init__(
        self,
        address: tuple[str, int],
        replies: Callable[[], Mapping[str, bytes]],
        read_timeout_s: float,
    ) -> None:
        self.replies = replies
        self.read_timeout_s = read_timeout_s
        self.sock = bind(address)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="agent-check", daemon=True)
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self.sock.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, sock=self.sock))
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await self._read(reader)
            writer.write(answer(request, self.replies()))
            await writer.drain()
        except OSError:
            pass  # the balancer went away first; nothing to tell it
        finally:
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> bytes:
        """Read until a newline, EOF, MAX_REQUEST + 1 bytes, a known id, or the read timeout."""
        request = b""
        try:
            async with asyncio.timeout(self.read_timeout_s):
                while b"\n" not in request and len(request) <= MAX_REQUEST:
                    chunk = await reader.read(MAX_REQUEST + 1 - len(request))
                    if not chunk:
                        break
                    request += chunk
                    # agent-send arrives in one segment; a full id needs no newline to answer.
                    if request.strip().decode("ascii", "replace") in self.replies():
                        break
        except TimeoutError:
            pass
        return request
