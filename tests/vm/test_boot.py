"""A booted Debian VM on the test's own bridge: SSH with the run's key, systemd up, no way out."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.vm.bed import HOST, OUTSIDE, Bed, Vm
from tests.vm.conftest import TIMINGS


@pytest.fixture(scope="module")
def node(bed: Bed) -> Vm:
    vm = bed.start("node1")
    TIMINGS["boot to SSH"] = vm.wait_ssh()
    return vm


def test_systemd_runs_and_the_key_is_this_runs(node: Vm, bed: Bed) -> None:
    assert node.ssh("systemctl is-system-running --wait", timeout=180).strip() == "running"
    assert node.ssh("hostname").strip() == "node1"
    assert "cloud-amd64" in node.ssh("uname -r")
    authorized = node.ssh("cat /root/.ssh/authorized_keys").strip()
    assert authorized == bed.key.with_suffix(".pub").read_text().strip()


def test_the_vm_reaches_the_bed_and_nothing_else(node: Vm, bed: Bed) -> None:
    for address in (HOST, OUTSIDE):
        argv = [
            "ip", "netns", "exec", bed.netns, sys.executable, "-m", "http.server",
            "--bind", address, "--directory", str(bed.workdir), "8765",
        ]  # fmt: skip
        server = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            got = node.ssh(
                f"for i in $(seq 20); do curl -sS -o /dev/null -w '%{{http_code}}' "
                f"http://{address}:8765/ && exit 0; sleep 0.5; done; exit 1"
            )
            assert got.endswith("200")
        finally:
            server.kill()
            server.wait()
    # No route out of the VM, and none out of the namespace it sits in.
    unreachable = node.ssh("ip route get 1.1.1.1 2>&1; echo rc=$?", check=False)
    assert "unreachable" in unreachable and "rc=0" not in unreachable
    routes = bed.netns_run("ip", "route").stdout
    assert "default" not in routes and f"{HOST.rsplit('.', 1)[0]}.0/24" in routes


@pytest.mark.vm
def test_a_reboot_comes_back_with_a_new_boot(node: Vm) -> None:
    before = node.boot_id()
    start = node.reboot()
    TIMINGS["reboot to SSH"] = time.monotonic() - start
    assert node.boot_id() != before
    assert node.ssh("systemctl is-system-running --wait", timeout=180).strip() == "running"
