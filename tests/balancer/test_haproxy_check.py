"""Rendered configs pass `haproxy -c` with no warning; a broken one fails with HAProxy's words."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from denv_iac.core.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    render_haproxy_config,
)
from denv_iac.haproxy import HaproxyConfigCheckError, check_haproxy_config

from .sample_pools import LLM, MAP_DIR, POOLS, SCOPED_SETTINGS, SETTINGS, VOICE

pytestmark = pytest.mark.needs_haproxy


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A throwaway self-signed certificate and key in one PEM, as `ssl crt` takes it."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    directory = tmp_path_factory.mktemp("tls")
    key, cert = directory / "key.pem", directory / "cert.pem"
    command = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1"
    subprocess.run(
        [*command.split(), "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    bundle = directory / "endpoint.pem"
    bundle.write_text(cert.read_text() + key.read_text())
    return str(bundle)


def _many_pools(pools: int, tiers: int, servers: int) -> tuple[BalancerPool, ...]:
    return tuple(
        BalancerPool(
            f"pool-{p}",
            tuple(
                BalancerTier(
                    t,
                    (f"site-{t}",),
                    tuple(
                        BalancerServer(
                            f"pool-{p}.site-{t}.node-{s}.0",
                            f"site-{t}",
                            f"node-{s}",
                            f"10.{p}.{t}.{s + 1}",
                            8000,
                            9100,
                        )
                        for s in range(servers)
                    ),
                )
                for t in range(tiers)
            ),
            session_affinity=p % 2 == 0,
        )
        for p in range(pools)
    )


_IPV6_POOL = BalancerPool(
    "v6",
    (
        BalancerTier(
            0,
            ("dc1",),
            (
                BalancerServer("v6.dc1.a.0", "dc1", "a", "fd00::10", 8000, 9100, "/v1/models"),
                BalancerServer(
                    "v6.dc1.b.0", "dc1", "b", "gpu-b.dc1.internal", 8000, 9100, "/v1/models"
                ),
            ),
        ),
        BalancerTier(1, ("dc2",), ()),  # a tier whose site has no replica yet
    ),
)

CONFIGS = {
    "representative-without-tls": (POOLS, dataclasses.replace(SETTINGS, tls_cert_path=None)),
    "minimal": ((LLM,), BalancerSettings(prometheus_port=None)),
    "scoped-keys": (POOLS, dataclasses.replace(SCOPED_SETTINGS, tls_cert_path=None)),
    "ipv6-hostnames-empty-tier": ((_IPV6_POOL,), BalancerSettings(bind_address="::")),
    "forty-pools": (_many_pools(40, 3, 5), BalancerSettings(api_key_digests=("0" * 64,))),
    "fast-timers": (
        (VOICE,),
        BalancerSettings(agent_inter_ms=50, check_inter_ms=100, connect_timeout_ms=20),
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rendered_config_passes_haproxy_check(name: str, tmp_path: Path) -> None:
    pools, balancer = CONFIGS[name]
    check_haproxy_config(render_haproxy_config(pools, balancer, MAP_DIR), tmp_path)
    assert (tmp_path / "haproxy.cfg").is_file() and (tmp_path / "pools.map").is_file()


def test_tls_config_passes_haproxy_check(tls_cert: str, tmp_path: Path) -> None:
    balancer = dataclasses.replace(SETTINGS, tls_cert_path=tls_cert)
    check_haproxy_config(render_haproxy_config(POOLS, balancer, MAP_DIR), tmp_path)


def test_checked_copy_reads_maps_from_workdir(tmp_path: Path) -> None:
    rendered = render_haproxy_config(POOLS, BalancerSettings(), MAP_DIR)
    check_haproxy_config(rendered, tmp_path)
    checked = (tmp_path / "haproxy.cfg").read_text()
    assert f"map({tmp_path}/pools.map)" in checked
    assert MAP_DIR not in checked


def test_missing_certificate_fails_with_haproxys_message(tmp_path: Path) -> None:
    balancer = dataclasses.replace(SETTINGS, tls_cert_path=str(tmp_path / "absent.pem"))
    with pytest.raises(HaproxyConfigCheckError, match=r"\[ALERT\].*absent\.pem"):
        check_haproxy_config(render_haproxy_config(POOLS, balancer, MAP_DIR), tmp_path)


def test_missing_haproxy_is_reported_plainly(tmp_path: Path) -> None:
    rendered = render_haproxy_config((LLM,), BalancerSettings(), MAP_DIR)
    with pytest.raises(HaproxyConfigCheckError, match="install HAProxy"):
        check_haproxy_config(rendered, tmp_path, haproxy_bin="haproxy-not-installed")
