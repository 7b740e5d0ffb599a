"""Server lines to Kubernetes gateways: mutual TLS on requests and checks, agent checks relayed."""

from __future__ import annotations

from pathlib import Path

import pytest

from denv_iac.core.balancer import (
    BalancerConfigError,
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    render_haproxy_config,
)
from denv_iac.haproxy import check_haproxy_config
from tests.gateway_pki import write_pki

CA, CLIENT = "/etc/haproxy/denv/gateway-ca.pem", "/etc/haproxy/denv/gateway-client.pem"
SETTINGS = BalancerSettings(gateway_ca_file=CA, gateway_client_cert=CLIENT)
NAME = "gateway.k8s.denv.internal"
TLS = (
    f"ssl verify required ca-file {CA} crt {CLIENT} ssl-min-ver TLSv1.3"
    f" sni str({NAME}) check-sni {NAME} verifyhost {NAME}"
)


def _server(replica: str, address: str, gateway: str | None = NAME) -> BalancerServer:
    site = replica.split(".")[1]
    node = replica.split(".")[2]
    return BalancerServer(replica, site, node, address, 8000, 9100, gateway=gateway)


def _pool(*servers: BalancerServer) -> BalancerPool:
    sites = tuple(sorted({s.site for s in servers}))
    return BalancerPool("voice", (BalancerTier(10, sites, servers),))


def _lines(cfg: str, start: str) -> list[str]:
    return [line.strip() for line in cfg.splitlines() if line.strip().startswith(start)]


@pytest.mark.parametrize(
    "server, expected",
    [
        (
            _server("voice.k8s.node-0.0", "203.0.113.5"),
            f"server voice.k8s.node-0.0 203.0.113.5:8000 id 1578507372 maxconn 32 {TLS}"
            ' agent-addr 127.0.0.1 agent-port 19100 agent-send "voice.k8s.node-0.0\\n"',
        ),
        (
            _server("voice.k8s.node-0.0", "a1b2.elb.amazonaws.com"),
            f"server voice.k8s.node-0.0 a1b2.elb.amazonaws.com:8000 id 1578507372 maxconn 32 {TLS}"
            ' agent-addr 127.0.0.1 agent-port 19100 agent-send "voice.k8s.node-0.0\\n"',
        ),
        (
            _server("voice.box.n1.0", "192.0.2.7", gateway=None),
            "server voice.box.n1.0 192.0.2.7:8000 id 1318784495 maxconn 32 agent-port 9100"
            ' agent-send "'
            'voice.box.n1.0\\n"',
        ),
    ],
    ids=["gateway-ip", "gateway-hostname", "machine"],
)
def test_server_lines(server: BalancerServer, expected: str) -> None:
    cfg = render_haproxy_config([_pool(server)], SETTINGS, "/m").haproxy_cfg
    assert _lines(cfg, f"server {server.replica_id} ")[0] == expected
    # The realtime twin reaches the same replica over the same TLS, with no checks of its own.
    realtime = _lines(cfg, f"server {server.replica_id} ")[1]
    assert (TLS in realtime) == (server.gateway is not None)
    assert realtime.endswith(f"track voice.tier10/{server.replica_id}")


def test_one_relay_per_gateway_address_forwards_agent_checks_over_the_same_tls() -> None:
    servers = (
        _server("voice.k8s.node-0.0", "203.0.113.5"),
        _server("voice.k8s.node-0.1", "203.0.113.5"),
        _server("voice.k8s.node-1.0", "203.0.113.6"),
        _server("voice.box.n1.0", "192.0.2.7", gateway=None),
    )
    cfg = render_haproxy_config([_pool(*servers)], SETTINGS, "/m").haproxy_cfg
    relays = {
        line.split()[1]: _lines(cfg.split(f"{line}\n")[1].split("\n\n")[0], "")
        for line in _lines(cfg, "listen denv.agent-relay.")
    }
    assert relays == {
        "denv.agent-relay.19100": [
            "bind 127.0.0.1:19100",
            f"server gateway 203.0.113.5:9100 {TLS} init-addr last,libc,none",
        ],
        "denv.agent-relay.19101": [
            "bind 127.0.0.1:19101",
            f"server gateway 203.0.113.6:9100 {TLS} init-addr last,libc,none",
        ],
    }
    checked = [line for line in _lines(cfg, "server voice.") if "agent-send" in line]
    agent = {line.split()[1]: line.split(" agent-")[1:] for line in checked}
    assert agent["voice.k8s.node-0.1"][:2] == ["addr 127.0.0.1", "port 19100"]
    assert agent["voice.k8s.node-1.0"][:2] == ["addr 127.0.0.1", "port 19101"]
    # The relays get a plain-TCP defaults section of their own: no HTTP options, no checks.
    relay_defaults = cfg.split("\ndefaults\n")[2].split("\n\n")[0]
    assert "mode tcp" in relay_defaults and "check" not in relay_defaults.replace("timeout", "")


def test_a_stack_without_gateways_renders_no_relay() -> None:
    cfg = render_haproxy_config(
        [_pool(_server("voice.box.n1.0", "192.0.2.7", gateway=None))], SETTINGS, "/m"
    ).haproxy_cfg
    assert " ssl " not in cfg and "agent-relay" not in cfg and cfg.count("\ndefaults\n") == 1


@pytest.mark.parametrize(
    "settings, field",
    [
        (BalancerSettings(gateway_client_cert=CLIENT), "settings.gateway_ca_file"),
        (BalancerSettings(gateway_ca_file=CA), "settings.gateway_client_cert"),
        (
            BalancerSettings(gateway_ca_file=CA, gateway_client_cert=CLIENT, port=19100),
            "settings.agent_relay_port_base",
        ),
        (
            BalancerSettings(
                gateway_ca_file=CA, gateway_client_cert=CLIENT, agent_relay_port_base=65535
            ),
            "settings.agent_relay_port_base",
        ),
        (
            BalancerSettings(gateway_ca_file="/etc/my ca.pem", gateway_client_cert=CLIENT),
            "settings.gateway_ca_file",
        ),
    ],
    ids=["no-ca", "no-client", "relay-on-endpoint", "relay-past-65535", "space-in-path"],
)
def test_refused_gateway_settings_name_their_field(settings: BalancerSettings, field: str) -> None:
    servers = (_server("voice.k8s.node-0.0", "203.0.113.5"), _server("voice.k8s.node-1.0", "h"))
    with pytest.raises(BalancerConfigError) as error:
        render_haproxy_config([_pool(*servers)], settings, "/m")
    assert error.value.field == field


def test_a_gateway_name_that_is_no_host_name_is_refused() -> None:
    server = _server("voice.k8s.node-0.0", "203.0.113.5", gateway="gw k8s")
    with pytest.raises(BalancerConfigError) as error:
        render_haproxy_config([_pool(server)], SETTINGS, "/m")
    assert error.value.field == "pools[0].tiers[0].servers[0].gateway"


@pytest.mark.needs_haproxy
def test_haproxy_accepts_the_config_with_the_credentials_in_place(tmp_path: Path) -> None:
    pki = write_pki(tmp_path / "tls", "k8s")
    settings = BalancerSettings(
        gateway_ca_file=str(pki.ca), gateway_client_cert=str(pki.client_pem)
    )
    servers = (_server("voice.k8s.node-0.0", "203.0.113.5"), _server("voice.k8s.node-1.0", "h"))
    rendered = render_haproxy_config([_pool(*servers)], settings, str(tmp_path / "maps"))
    check_haproxy_config(rendered, tmp_path / "check")
