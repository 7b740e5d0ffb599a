"""A balancer host on a booted VM: NodeSetup's provider puts the generated HAProxy config live
with TLS on, as the engine calls it, and a streamed chat completion goes through it.

The replica is the simulator (denv_iac.local.replica_sim) run on the test's own address in the
bed's namespace (HOST): a joined node with a replica unit would cost a join (minutes under TCG)
and prove nothing more about the balancer. The certificate comes from a CA the test makes, and
the client checks the endpoint's certificate against that CA. HAProxy comes from the Debian
archive through a repository of the VM's own (tests/vm/debian_repo.py).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from denv_iac.core.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    RenderedConfig,
    render_haproxy_config,
)
from denv_iac.core.balancer.model import CONFIG_DIR, STATS_SOCKET, TLS_CERT_PATH
from denv_iac.local.replica_sim import READY_PREFIX
from denv_iac.node.balancer_host import CONFIG
from tests.vm.bed import HOST, OUTSIDE, Bed, Vm
from tests.vm.conftest import TIMINGS
from tests.vm.debian_repo import offer_packages
from tests.vm.test_join import STATS_PORT, provider, reach

ROOT = Path(__file__).resolve().parents[2]
REPLICA = "voice.joined.node1.0"
REPLICA_PORT = 8000
ENDPOINT_PORT = 8443
API_KEY = "sk-denv-vm-test"


@dataclass(frozen=True)
class Tls:
    ca: Path  # the test CA's certificate, what the client trusts
    pem: str  # the endpoint's certificate and key, as the stack's tls_certificate holds them
    key_line: str  # a line of the private key's material, to look for where it must not be


def make_tls(folder: Path, address: str) -> Tls:
    """A CA of the test's own and a certificate it signed for the balancer VM's address."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "denv test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    ca_path = folder / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pem = cert.public_bytes(serialization.Encoding.PEM).decode() + key_pem
    return Tls(ca_path, pem, key_pem.splitlines()[1])


def rendered_config() -> RenderedConfig:
    """What GlobalBalancer renders for one replica on HOST, TLS on, API keys checked."""
    server = BalancerServer(REPLICA, "joined", "node1", HOST, REPLICA_PORT, 9100)
    pool = BalancerPool("voice", (BalancerTier(10, ("joined",), (server,)),))
    settings = BalancerSettings(
        port=ENDPOINT_PORT,
        tls_cert_path=TLS_CERT_PATH,
        api_key_digests=(hashlib.sha256(API_KEY.encode()).hexdigest(),),
    )
    return render_haproxy_config([pool], settings, CONFIG_DIR)


@pytest.fixture(scope="module")
def balancer(bed: Bed) -> Vm:
    vm = bed.start("balancer1")
    TIMINGS["balancer VM boot to SSH"] = vm.wait_ssh()
    start = time.monotonic()
    assert "haproxy" in offer_packages(vm, bed.workdir, "haproxy")
    TIMINGS["balancer VM package repository"] = time.monotonic() - start
    return vm


@pytest.fixture(scope="module")
def replica(bed: Bed) -> Iterator[subprocess.Popen[str]]:
    """The simulator on HOST, where the balancer VM reaches it."""
    argv = [
        "ip", "netns", "exec", bed.netns, sys.executable, "-m", "denv_iac.local.replica_sim",
        "--id", REPLICA, "--host", HOST, "--port", str(REPLICA_PORT),
        "--ttft-ms", "20", "--itl-ms", "5", "--tokens", "8",
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith(READY_PREFIX)
        yield process
    finally:
        process.kill()
        process.wait()


def stream_through(bed: Bed, vm: Vm, tls: Tls, timeout_s: float = 30.0) -> str:
    """A streamed chat completion through the balancer, the certificate checked against the
    test's CA: the response head and body, tried again until it is served or `timeout_s` ends
    (HAProxy's first health checks, a restart, a reboot)."""
    body = '{"model": "voice", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    argv = [
        "curl", "-sS", "-N", "--max-time", "20", "--cacert", str(tls.ca), "-D", "-",
        "-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json",
        "-d", body, f"https://{vm.address}:{ENDPOINT_PORT}/v1/chat/completions",
    ]  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        done = bed.netns_run(*argv, timeout=30)
        if done.returncode == 0 and done.stdout.split(maxsplit=2)[1:2] == ["200"]:
            return done.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"not served in {timeout_s:.0f} s: {done.stderr or done.stdout}")
        time.sleep(1)


def stats_socket(vm: Vm, command: str) -> str:
    """HAProxy's runtime API on the stats socket the generated config names."""
    script = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.connect({STATS_SOCKET!r})\n"
        f"s.sendall({(command + chr(10)).encode()!r})\n"
        "out = b''\n"
        "while chunk := s.recv(65536):\n"
        "    out += chunk\n"
        "sys.stdout.write(out.decode())\n"
    )
    return vm.ssh(f"python3 - <<'EOF'\n{script}EOF")


def props(bed: Bed, vm: Vm, rendered: RenderedConfig, tls: Tls) -> dict[str, Any]:
    """What NodeSetup registers for a balancer host with a tls_certificate, on a site whose
    admin_cidrs hold the test's address."""
    return {
        "host": vm.address,
        "ssh_user": "root",
        "ssh_private_key": bed.key.read_text(),
        "balancer": {
            "haproxy_config": rendered.haproxy_cfg,
            "map_files": dict(sorted(rendered.files.items())),
            "map_dir": rendered.map_dir,
        },
        "tls_certificate": tls.pem,
        "balancer_firewall": {"admin_cidrs": [f"{HOST}/32"], "stats_port": STATS_PORT},
        "applied": None,
    }


def test_a_fresh_host_serves_the_generated_config_over_tls_and_a_second_run_changes_nothing(
    bed: Bed, balancer: Vm, replica: subprocess.Popen[str]
) -> None:
    tls = make_tls(bed.workdir, balancer.address)
    rendered = rendered_config()
    inputs = props(bed, balancer, rendered, tls)
    start = time.monotonic()
    created = provider(bed, "create", inputs)
    TIMINGS["balancer host (provider create)"] = time.monotonic() - start
    applied = created["outs"]["applied"]
    # The firewall first: HAProxy's stats port never listens unguarded.
    assert applied[0] == "firewall: write /etc/denv/balancer-firewall.nft"
    assert "balancer: install haproxy" in applied
    assert (
        applied[-1]
        == "balancer: restart HAProxy with its runtime directory and the config put live"
    )

    # The certificate: root's only, where the config reads it, and nowhere else on the host.
    assert balancer.ssh(f"stat -c '%a %U %G' {TLS_CERT_PATH}").strip() == "600 root root"
    assert balancer.ssh(f"sha256sum < {TLS_CERT_PATH}").split()[0] == (
        hashlib.sha256(tls.pem.encode()).hexdigest()
    )
    found = balancer.ssh(
        f"grep -rlF -- {tls.key_line!r} /etc /tmp /root /var/log 2>/dev/null; "
        f"journalctl --no-pager -o cat | grep -cF -- {tls.key_line!r} || true"
    ).split()
    assert found == [TLS_CERT_PATH, "0"], found

    # The generated config serves, not the package's: the unit runs, its stats socket in the
    # folder systemd made answers, and it knows the replica.
    assert balancer.ssh("systemctl is-active haproxy.service").strip() == "active"
    assert balancer.ssh(f"sha256sum < {CONFIG}").split()[0] == (
        hashlib.sha256(rendered.haproxy_cfg.encode()).hexdigest()
    )
    assert "Name: HAProxy" in stats_socket(balancer, "show info")
    assert REPLICA in stats_socket(balancer, "show servers state")

    start = time.monotonic()
    answer = stream_through(bed, balancer, tls)
    TIMINGS["balancer first stream (TLS)"] = time.monotonic() - start
    head, _, stream = answer.partition("\n\n")  # text mode: CRLF reads as LF
    assert head.splitlines()[0].split()[1] == "200", head
    assert f"x-denv-replica: {REPLICA}" in head.lower()
    assert "text/event-stream" in head
    chunks = [line for line in stream.splitlines() if line.startswith("data: {")]
    assert len(chunks) >= 8 and stream.rstrip().endswith("data: [DONE]"), stream

    # From outside: the endpoint answers, SSH and the stats port do not; the admin gets stats.
    tries = [(OUTSIDE, ENDPOINT_PORT), (OUTSIDE, STATS_PORT), (OUTSIDE, 22), (HOST, STATS_PORT)]
    assert reach(bed, balancer, tries) == {
        (OUTSIDE, ENDPOINT_PORT): "open",
        (OUTSIDE, STATS_PORT): "timeout",
        (OUTSIDE, 22): "timeout",
        (HOST, STATS_PORT): "open",
    }

    olds = created["outs"]
    assert "tls_certificate" in olds  # the state keeps it: the engine marks it secret
    assert provider(bed, "diff", created["id"], olds, inputs) == {"changes": False, "replaces": []}
    start = time.monotonic()
    again = provider(bed, "update", created["id"], olds, inputs)
    TIMINGS["balancer host second run (provider update)"] = time.monotonic() - start
    assert again["outs"]["applied"] == []


def serving_again(bed: Bed, vm: Vm, tls: Tls, since: float) -> float:
    """Seconds from `since` until a whole stream is served through the balancer again."""
    answer = stream_through(bed, vm, tls, timeout_s=300)
    assert answer.rstrip().endswith("data: [DONE]"), answer
    return time.monotonic() - since


@pytest.mark.vm
def test_haproxy_comes_back_serving_after_its_worker_is_killed_and_after_a_reboot(
    bed: Bed, balancer: Vm, replica: subprocess.Popen[str]
) -> None:
    # A login that sudoes, as on AWS: the upload goes through a file of that user's first.
    offer_packages(balancer, bed.workdir, "sudo")
    balancer.ssh(
        "apt-get -q update >/dev/null && apt-get install -y -q sudo >/dev/null"
        " && useradd -m -s /bin/sh deployer && install -d -m 0700 -o deployer /home/deployer/.ssh"
        " && install -m 0600 -o deployer /root/.ssh/authorized_keys /home/deployer/.ssh/"
        " && echo 'deployer ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/deployer",
        timeout=300,
    )
    tls = make_tls(bed.workdir, balancer.address)  # a renewed certificate, from a new CA
    inputs = {**props(bed, balancer, rendered_config(), tls), "ssh_user": "deployer"}
    created = provider(bed, "create", inputs)
    assert created["outs"]["applied"][-1] == "balancer: reload HAProxy (hitless)"
    assert balancer.ssh(f"stat -c '%a %U %G' {TLS_CERT_PATH}").strip() == "600 root root"
    left = balancer.ssh("ls -d /tmp/denv-upload-* /tmp/pyinfra-* 2>/dev/null || true")
    assert left.split() == [], "no upload left behind"
    stream_through(bed, balancer, tls)

    # A worker dying takes its master with it; systemd starts the unit again, and with it the
    # stats socket's folder.
    master = balancer.ssh("systemctl show -p MainPID --value haproxy.service").strip()
    balancer.ssh(f"pkill -9 -P {master} haproxy")
    TIMINGS["balancer worker kill -9 to serving"] = serving_again(
        bed, balancer, tls, time.monotonic()
    )
    assert balancer.ssh("systemctl show -p MainPID --value haproxy.service").strip() != master
    assert REPLICA in stats_socket(balancer, "show servers state")

    before = balancer.boot_id()
    start = balancer.reboot()
    TIMINGS["balancer reboot to serving"] = serving_again(bed, balancer, tls, start)
    assert balancer.boot_id() != before
    assert REPLICA in stats_socket(balancer, "show servers state")
