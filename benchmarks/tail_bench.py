"""The tail of time to first token, as a caller sees it: each request on a new TCP connection,
through the endpoint (a real HAProxy running the generated config) and through nginx (Debian's
package, as dstack's gateway configures it: `proxy_buffering off`, both replicas in one
upstream), against the same two simulated replicas called directly, interleaved in one run.

Figures (the endpoint's targets: p99 within nginx's + 0.5 ms one at a time, + 1 ms in bursts):
- one_*: one request at a time, ONE_ROUNDS rounds; each round sends one request to each
  target (direct, endpoint, nginx) in a rotating order, so drift and noise hit all alike.
- burst_*: BURST_SIZE requests at once, each on a new connection, BURST_ROUNDS rounds, the
  targets taking turns; TTFT quantiles over all the requests of a target's bursts.
- *_added_pXX_ms: the target's TTFT quantile less the direct one; *_ratio_p50: the same as a
  ratio; endpoint_minus_nginx_p99_ms: the margin the targets are about.

Why the data-plane bench's ttft_added_p99_ms once read 0.2 ms where a caller saw more: it kept
one connection alive per target, so the client's connect, the endpoint's accept and its
per-connection work never counted, and its p99 of 150 samples was the second worst. It now
opens a connection per request too; this bench adds nginx, bursts and more rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import pwd
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lab.dataplane import STANDARD_POOLS, Dataplane
from denv_iac.local.processes import free_port
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.ops.loadgen_protocols import stream_once
from denv_iac.ops.loadgen_transport import CONNECT_TIMEOUT_S, Connection, Endpoint

HOME = ("voice.home-a.n0.0", "voice.home-b.n1.0")
ONE_ROUNDS = 300
BURST_SIZE = 32
BURST_ROUNDS = 24
# The replicas: 50 ms to the first token, 20 ms between tokens; room for every burst.
REPLICA = ReplicaSimConfig(
    "template", ttft_ms=50, itl_ms=20, tokens=20, slots=4 * BURST_SIZE, itl_growth=0.0
)
POOLS = tuple(
    dataclasses.replace(layout, max_concurrency=4 * BURST_SIZE) for layout in STANDARD_POOLS
)
TIMEOUT_S = 30.0
QUANTILES = (50, 99)

# dstack's gateway template inside Debian's stock nginx.conf (worker_processes auto).
NGINX_CONF = """\
{user}worker_processes auto;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{
    worker_connections 768;
}}
http {{
    sendfile on;
    tcp_nopush on;
    types_hash_max_size 2048;
    access_log {dir}/access.log;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream replicas {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://replicas;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header Host $host;
            proxy_read_timeout 300s;
            proxy_buffering off;
        }}
    }}
}}
"""


class Nginx:
    """Debian's nginx with the gateway's config in a directory of its own; stop() ends it."""

    def __init__(self, workdir: Path, upstreams: Sequence[int]) -> None:
        self.workdir = workdir
        self.port = free_port()
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        # As root the workers would run as nobody, who cannot write into the temp directory.
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
        servers = "\n".join(f"        server 127.0.0.1:{port};" for port in upstreams)
        conf = workdir / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(user=user, dir=workdir, servers=servers, port=self.port),
            encoding="utf-8",
        )
        command = [binary, "-p", str(workdir), "-e", str(workdir / "error.log"), "-c", str(conf)]
        self._process = subprocess.Popen(
            [*command, "-g", "daemon off;"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while True:
            if self._process.poll() is not None:
                log = (workdir / "error.log").read_text(errors="replace")
                raise RuntimeError(f"nginx exited at start:\n{log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("nginx did not listen within 10 s") from None
                time.sleep(0.02)

    def stop(self) -> None:
        process = self._process
        if process.poll() is None:
            os.killpg(process.pid, 15)  # its own group: master and workers
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait(5)


async def _ttft_ms(port: int) -> float:
    """One streamed answer on a new connection, closed after; the client's time to the first
    token, the connect included."""
    connection = Connection(Endpoint(f"http://127.0.0.1:{port}"), TIMEOUT_S, CONNECT_TIMEOUT_S)
    try:
        result = await stream_once(connection, "voice", max_tokens=1)
    finally:
        connection.close()
    assert result.ok and result.ttft_ms is not None, f"stream failed: {result}"
    return result.ttft_ms


@contextlib.contextmanager
def no_client_gc() -> Iterator[None]:
    """The client's garbage collector held off while it measures: a full collection of the
    client's heap pauses its event loop for milliseconds, and would land on whichever target
    it happens to be timing."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Targets:
    """Where each target's requests go: its ports, taken in turn (the two replicas, called
    directly, in turn as the proxies spread requests)."""

    def __init__(self, ports: dict[str, Sequence[int]]) -> None:
        self.ports = ports
        self._turn = dict.fromkeys(ports, 0)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.ports)

    def port(self, target: str) -> int:
        self._turn[target] += 1
        ports = self.ports[target]
        return ports[self._turn[target] % len(ports)]


async def one_at_a_time(targets: Targets, rounds: int) -> dict[str, list[float]]:
    """Each round one request to each target, in an order that rotates and turns round."""
    names = targets.names
    times: dict[str, list[float]] = {target: [] for target in names}
    for _ in range(3):  # warm every path (first connects, the client's own code paths)
        for target in names:
            await _ttft_ms(targets.port(target))
    for n in range(rounds):
        order = names[n % len(names) :] + names[: n % len(names)]
        for target in order if n % 2 else reversed(order):
            times[target].append(await _ttft_ms(targets.port(target)))
    return times


async def bursts(targets: Targets, rounds: int, size: int) -> dict[str, list[float]]:
    """`size` requests at once to one target, the targets taking turns, `rounds` each."""
    names = targets.names
    times: dict[str, list[float]] = {target: [] for target in names}
    for n in range(rounds * len(names)):
        target = names[(n + n // len(names)) % len(names)]
        burst = [_ttft_ms(targets.port(target)) for _ in range(size)]
        times[target] += await asyncio.gather(*burst)
        await asyncio.sleep(0.1)  # every stream of the burst is over before the next
    return times


def figures_of(prefix: str, times: dict[str, list[float]]) -> dict[str, float]:
    figures: dict[str, float] = {}
    direct = {q: _quantile(times["direct"], q) for q in QUANTILES}
    for q in QUANTILES:
        figures[f"{prefix}_direct_ttft_p{q}_ms"] = direct[q]
    for target in ("endpoint", "nginx"):
        for q in QUANTILES:
            value = _quantile(times[target], q)
            figures[f"{prefix}_{target}_ttft_p{q}_ms"] = value
            figures[f"{prefix}_{target}_added_p{q}_ms"] = value - direct[q]
        figures[f"{prefix}_{target}_ratio_p50"] = statistics.median(times[target]) / direct[50]
        figures[f"{prefix}_{target}_ratio_p99"] = _quantile(times[target], 99) / direct[99]
    for q in QUANTILES:
        figures[f"{prefix}_endpoint_minus_nginx_p{q}_ms"] = _quantile(
            times["endpoint"], q
        ) - _quantile(times["nginx"], q)
    return figures


def measure(plane: Dataplane, nginx: Nginx) -> dict[str, float]:
    targets = Targets(
        {
            "direct": [plane.replicas[rid].process.port for rid in HOME],
            "endpoint": [plane.settings.port],
            "nginx": [nginx.port],
        }
    )
    with no_client_gc():
        figures = figures_of("one", asyncio.run(one_at_a_time(targets, ONE_ROUNDS)))
        figures |= figures_of("burst", asyncio.run(bursts(targets, BURST_ROUNDS, BURST_SIZE)))
    return {key: round(value, 3) for key, value in figures.items()}


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="denv-tail-bench-") as workdir:
        plane = Dataplane.start(Path(workdir) / "endpoint", pools=POOLS, sim=REPLICA)
        try:
            (Path(workdir) / "nginx").mkdir()
            nginx = Nginx(
                Path(workdir) / "nginx", [plane.replicas[rid].process.port for rid in HOME]
            )
            try:
                return measure(plane, nginx)
            finally:
                nginx.stop()
        finally:
            plane.close()


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:40} {value}")
