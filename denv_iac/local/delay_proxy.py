"""A TCP proxy that delays every byte by a set time, as a farther network link would.

The kernel of the build machines has no `netem` qdisc, so the reliability harness puts this
between the balancer and a site to make that site slow: HAProxy's server address for the site
points here, and each listened port forwards to the same port at the site. Bytes keep their
order and the pace they came at; only their arrival moves later, in each direction. The TCP
handshake with the proxy itself is not delayed.

The balancer's own connect timeout would see a handshake lost on the link, but the proxy
completes the balancer's handshake at once. So the proxy bounds its own connect to the site the
same way (`--connect-timeout-ms`): one that does not complete in time resets the balancer's
connection before any answer byte, which the balancer retries on another replica, as it would
its own failed connect.

    python -m denv_iac.local.delay_proxy --listen 10.231.1.1 --to 10.231.1.2 --port 8001

It prints one ready line, then reads lines from stdin, each a new one-way delay in
milliseconds, and answers each with a line once it holds; closing stdin stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass

READY_LINE = "delay_proxy ready"
DELAY_SET_LINE = "delay_proxy delay"
_CHUNK = 65536


class Delay:
    """The current one-way delay, in seconds; changed while connections run."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    """Copy one direction, each chunk written `delay` after it was read; EOF is delayed too."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while True:
            data = await reader.read(_CHUNK)
            await queue.put((time.monotonic() + delay.seconds, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()


@dataclass(frozen=True)
class _Route:
    target_host: str
    port: int
    delay: Delay
    connect_timeout_s: float | None


async def _relay(
    route: _Route, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.wait_for(
            asyncio.open_connection(route.target_host, route.port), route.connect_timeout_s
        )
    except (OSError, TimeoutError):
        client_writer.transport.abort()
        return
    pipes = [
        asyncio.ensure_future(_pipe(client_reader, upstream_writer, route.delay)),
        asyncio.ensure_future(_pipe(upstream_reader, client_writer, route.delay)),
    ]
    try:
        done, _ = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
        # A reset on one side is passed on as a reset, not as a clean close.
        if any(task.exception() is not None for task in done):
            client_writer.transport.abort()
            upstream_writer.transport.abort()
        await asyncio.gather(*pipes, return_exceptions=True)
    finally:
        client_writer.close()
        upstream_writer.close()


async def _read_delays(delay: Delay) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        delay.seconds = float(line) / 1000
        print(f"{DELAY_SET_LINE} {line.decode().strip()}", flush=True)


async def serve(
    listen_host: str,
    target_host: str,
    ports: list[int],
    delay_ms: float,
    connect_timeout_ms: float | None = None,
) -> None:
    delay = Delay(delay_ms / 1000)
    timeout_s = None if connect_timeout_ms is None else connect_timeout_ms / 1000
    servers = []
    for port in ports:
        relay = functools.partial(_relay, _Route(target_host, port, delay, timeout_s))
        servers.append(await asyncio.start_server(relay, listen_host, port, reuse_address=True))
    print(f"{READY_LINE} ports={','.join(map(str, ports))}", flush=True)
    await _read_delays(delay)
    for server in servers:
        server.close()


class DelayProxyProcess:
    """The proxy in its own process; `set_delay` changes the delay of every port at once."""

    def __init__(
        self,
        listen_host: str,
        target_host: str,
        ports: list[int],
        command_prefix: tuple[str, ...] = (),
        connect_timeout_ms: float | None = None,
    ) -> None:
        self.command = [
            *command_prefix,
            *(sys.executable, "-m", "denv_iac.local.delay_proxy"),
            *(f"--listen={listen_host}", f"--to={target_host}"),
            *(f"--port={port}" for port in ports),
        ]
        if connect_timeout_ms is not None:
            self.command.append(f"--connect-timeout-ms={connect_timeout_ms}")
        self._process: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, timeout_s: float = 10.0) -> None:
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self._process.stdout is not None
        line = _readline_within(self._process, timeout_s)
        if not line.startswith(READY_LINE):
            self.stop()
            raise RuntimeError(f"delay proxy failed to start: {line!r}")

    def set_delay(self, one_way_ms: float, timeout_s: float = 10.0) -> None:
        """Returns once the new delay holds, so that the next byte sent is delayed by it: on a
        busy machine the proxy may read its stdin only after a connection that follows."""
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(f"{one_way_ms}\n")
        self._process.stdin.flush()
        line = _readline_within(self._process, timeout_s)
        if not line.startswith(DELAY_SET_LINE):
            raise RuntimeError(f"delay proxy did not take the delay {one_way_ms} ms: {line!r}")

    def stop(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _readline_within(process: subprocess.Popen[str], timeout_s: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return f"nothing within {timeout_s} s"
    return process.stdout.readline()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m denv_iac.local.delay_proxy",
        description="Forward TCP ports to another host, delaying every byte.",
    )
    parser.add_argument("--listen", required=True, help="address to listen on")
    parser.add_argument("--to", required=True, help="address to forward to, same port")
    parser.add_argument("--port", type=int, action="append", required=True, help="repeatable")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay at start")
    parser.add_argument(
        "--connect-timeout-ms",
        type=float,
        help="reset the client when the connect to --to takes longer (default: wait)",
    )
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, args.to, args.port, args.delay_ms, args.connect_timeout_ms))


if __name__ == "__main__":
    main()
