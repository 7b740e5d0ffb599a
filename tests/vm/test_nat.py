"""The bed's NAT: a VM behind it reaches the bridge's VMs (seen as the router's address), nothing
on the bridge opens a connection to it, and the deployer (the test's own address) still does.
"""

from __future__ import annotations

import shlex

import pytest

from tests.vm.bed import HOST, NAT_ADDRESS, NAT_SUBNET, OUTSIDE, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.test_join import reach

LISTEN_PORT = 7000
CONNECT_TIMEOUT_S = 5


def connect(vm: Vm, address: str, port: int) -> str:
    """A TCP connection from inside `vm`: open, refused or timeout."""
    probe = shlex.quote(f"</dev/tcp/{address}/{port}")
    code = vm.ssh(f"timeout {CONNECT_TIMEOUT_S} bash -c {probe} 2>/dev/null; echo $?").split()[-1]
    return {"0": "open", "124": "timeout"}.get(code, "refused")


@pytest.mark.vm
def test_a_vm_behind_nat_dials_out_and_nothing_on_the_bridge_dials_in(bed: Bed) -> None:
    public = bed.start("public1")
    office = bed.start("office1", behind_nat=True)
    TIMINGS["two VMs, one behind NAT, boot to SSH"] = max(public.wait_ssh(), office.wait_ssh())
    assert office.address.startswith(f"{NAT_SUBNET}.")

    # Out: the office VM reaches a listener on the bridge, which sees the router's address.
    server = (
        "import socket; s = socket.create_server(('0.0.0.0', "
        f"{LISTEN_PORT})); s.settimeout(60); c, peer = s.accept(); print(peer[0])"
    )
    public.ssh(f"nohup timeout 90 python3 -c {shlex.quote(server)} > /root/peer 2>&1 &")
    public.ssh(f"for _ in $(seq 50); do ss -ltn | grep -q :{LISTEN_PORT} && break; sleep 0.2; done")
    assert connect(office, public.address, LISTEN_PORT) == "open"
    public.ssh("for _ in $(seq 50); do [ -s /root/peer ] && break; sleep 0.2; done")
    assert public.ssh("cat /root/peer").strip() == NAT_ADDRESS

    # In: a machine on the bridge that routes the LAN through the router gets nothing through;
    # the router itself is reachable (it answers with a reset: nothing is forwarded).
    public.ssh(f"ip route replace {NAT_SUBNET}.0/24 via {NAT_ADDRESS}")
    assert connect(public, office.address, 22) == "timeout"
    assert connect(public, NAT_ADDRESS, 22) == "refused"
    # The same from the outside address; the deployer's own address gets SSH.
    seen = reach(bed, office, [(OUTSIDE, 22), (HOST, 22)])
    assert seen == {(OUTSIDE, 22): "timeout", (HOST, 22): "open"}
