"""A far site's link for the network-namespace lab: two TUN devices and a process that moves
every packet from one to the other after a fixed delay.

This kernel has no `netem`, and a delaying TCP proxy completes the handshake itself, so a
connect through it takes no longer than on the near side. Through this link every packet is
late, the SYN and the SYN-ACK included: a connect takes the round trip, as it does to a site
on another continent, which is what a tier's connect timeout must allow for.

The process is started in the site's namespace by NetnsLab (`SlowLink.start`); it makes both
devices there, says `ready`, and forwards until it is killed (the devices go with it).
`start` then moves the balancer's end into the balancer's namespace: a TUN device keeps its
file descriptor across the move. Cutting the link (the device down) and the lab's loss rules
work on it as on a veth link.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import struct
import subprocess
import sys
from collections.abc import Sequence

# <linux/if_tun.h>
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_MAX_PACKET = 65536
READY = "ready"
_START_TIMEOUT_S = 10.0


def _open_tun(name: str) -> int:
    """A TUN device named `name` in the calling thread's namespace; its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def _forward(loop: asyncio.AbstractEventLoop, source: int, target: int, delay_s: float) -> None:
    def write(packet: bytes) -> None:
        # The far end down (a cut link): the packet is lost, as on a wire.
        with contextlib.suppress(OSError):
            os.write(target, packet)

    def readable() -> None:
        while True:
            try:
                packet = os.read(source, _MAX_PACKET)
            except BlockingIOError:
                return
            except OSError:  # this end is down
                return
            loop.call_later(delay_s, write, packet)

    loop.add_reader(source, readable)


def serve(site_device: str, balancer_device: str, one_way_ms: float) -> None:
    site = _open_tun(site_device)
    balancer = _open_tun(balancer_device)
    loop = asyncio.new_event_loop()
    delay_s = one_way_ms / 1000
    _forward(loop, site, balancer, delay_s)
    _forward(loop, balancer, site, delay_s)
    print(READY, flush=True)
    loop.run_forever()


class SlowLink:
    """The forwarding process of one far site's link."""

    def __init__(
        self,
        site_namespace: str,
        site_device: str,
        balancer_namespace: str,
        balancer_device: str,
        round_trip_ms: float,
    ) -> None:
        self.command = [
            *("ip", "netns", "exec", site_namespace),
            *(sys.executable, "-m", "denv_iac.local.slow_link"),
            *(site_device, balancer_device, f"--one-way-ms={round_trip_ms / 2}"),
        ]
        self.move = [
            *("ip", "-n", site_namespace, "link", "set", "dev", balancer_device),
            *("netns", balancer_namespace),
        ]
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        """Start it and wait until both devices exist."""
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != READY:
            self.stop()
            raise RuntimeError(f"the slow link did not start: {line or 'no answer'}")
        moved = subprocess.run(self.move, capture_output=True, text=True, check=False)
        if moved.returncode != 0:
            self.stop()
            raise RuntimeError(f"{' '.join(self.move)}: {moved.stderr.strip()}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.kill()
        self.process.communicate(timeout=_START_TIMEOUT_S)  # reaped, its pipes closed
        self.process = None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site_device")
    parser.add_argument("balancer_device")
    parser.add_argument("--one-way-ms", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        serve(args.site_device, args.balancer_device, args.one_way_ms)
    except OSError as error:
        print(f"{type(error).__name__}: {error}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
