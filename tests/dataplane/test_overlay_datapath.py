"""Traffic between sites over the overlay: encrypted on the link, served as before.

Two namespaces joined by a veth pair stand for two sites on the internet: the balancer's (a
real HAProxy with the generated config) and a site's (a simulated replica and a real agent).
The same run starts the data plane twice, once with the replica on the link's address and once
on its overlay address behind wireguard-go, and captures every frame on the link for each. A
marker prompt shows in the plain capture and never in the overlay's, which carries WireGuard
datagrams instead. The site is behind NAT for WireGuard (no flow to its port may start from the
link, and the balancer has no endpoint for it): the node dials out, and the overlay serves.
"""

from __future__ import annotations

import secrets
import socket
import statistics
import time
from collections.abc import Iterator

import pytest

from benchmarks.lab.overlay import (
    NETNS_ETC,
    SITE,
    Capture,
    Client,
    Lab,
    hub_interface,
    measure_ttft,
    nat_dropped,
    plain_and_overlay,
    unavailable_reason,
    wg_show,
)
from denv_iac.local.netns import NetnsLab

TTFT_PAIRS = 100
reason = unavailable_reason()
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One lab for the module: the data plane up twice, plain and over the overlay."""
    # The site is behind NAT: the node dials out, and the overlay serves as ever.
    with plain_and_overlay(tmp_path_factory.mktemp("overlay"), behind_nat=True) as lab:
        yield lab


def _capture_one(lab: NetnsLab, port: int, prompt: str) -> tuple[Capture, bytes]:
    """One streamed request through the balancer at `port`, the site's link captured meanwhile."""
    capture = Capture(lab.balancer_namespace, lab.links[SITE].balancer_device)

    def call() -> bytes:
        client = Client(lab.balancer_host.address, port)
        try:
            answer = client.stream("voice", prompt)
        finally:
            client.close()
        assert answer.status == 200 and b"data: [DONE]" in answer.body, answer
        return answer.body

    body = lab.call(call)
    capture.stop()
    return capture, body


def test_the_overlay_hides_a_prompt_that_the_plain_link_shows(both: Lab) -> None:
    marker = f"denv-marker-{secrets.token_hex(8)}"
    assert {r.address for r in both.tunnel.state.replicas} == {both.overlay.node_address}
    seen, _ = _capture_one(both.lab, both.plain.port, f"say {marker}")
    assert marker.encode() in b"".join(seen.frames)  # the check can fail: it sees plain text

    hidden, body = _capture_one(both.lab, both.tunnel.port, f"say {marker}")
    assert marker.encode() not in b"".join(hidden.frames)
    assert hidden.udp_payload_bytes(both.overlay.plan.spec.port) > len(body)


def test_a_reload_of_either_end_keeps_the_tunnel_serving(both: Lab) -> None:
    # What `systemctl reload wg-quick@...` runs on a machine whose peers changed.
    both.overlay.reload()
    capture, _ = _capture_one(both.lab, both.tunnel.port, "after the reload")
    assert capture.udp_payload_bytes(both.overlay.plan.spec.port) > 0


def test_ttft_added_by_the_overlay(both: Lab) -> None:
    """Interleaved streams over the plain link and over the overlay, in the same run."""
    times = measure_ttft(both, TTFT_PAIRS)
    plain, overlay = statistics.median(times["plain"]), statistics.median(times["overlay"])
    added_ms = (overlay - plain) * 1000
    print(
        f"\noverlay TTFT p50: plain {plain * 1000:.3f} ms, overlay {overlay * 1000:.3f} ms, "
        f"added {added_ms:.3f} ms"
    )
    # wireguard-go in userspace, two namespaces on one shared 2-core machine: a loose bound that
    # still catches a tunnel that stalls (a handshake per request, a lost keepalive).
    assert added_ms < 20


def _knock(address: str, port: int) -> None:
    """A datagram to the WireGuard port from outside, as a peer dialling in would send."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"\x01" + bytes(147), (address, port))


def test_a_node_behind_nat_dials_out_and_serves(both: Lab) -> None:
    """The balancer has no endpoint for the node and the site admits no WireGuard flow from
    outside; the balancer learns the node's endpoint from the node's own handshake."""
    lab, overlay = both.lab, both.overlay
    hub_config = NETNS_ETC / lab.balancer_namespace / "wireguard" / f"{hub_interface()}.conf"
    assert "[Peer]" in hub_config.read_text() and "Endpoint" not in hub_config.read_text()
    capture, body = _capture_one(lab, both.tunnel.port, "from behind NAT")
    assert capture.udp_payload_bytes(overlay.plan.spec.port) > len(body)
    link, port = lab.links[SITE], overlay.plan.spec.port
    endpoints = wg_show(lab.balancer_namespace, hub_interface(), "endpoints")
    assert f"{link.address}:{port}" in endpoints  # learned, never given
    site = link.namespace
    before = nat_dropped(site)
    lab.call(_knock, link.address, port)
    deadline = time.monotonic() + 2
    while nat_dropped(site) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert nat_dropped(site) == before + 1  # a flow from outside is stopped
