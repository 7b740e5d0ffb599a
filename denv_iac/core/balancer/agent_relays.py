"""Kubernetes gateways as the endpoint reaches them: the TLS options of a server behind one, and
the loopback relays that carry agent checks to them over the same mutual TLS.

Pure: the relays' ports and their config sections.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from denv_iac.core.balancer.model import BalancerPool, BalancerSettings
from denv_iac.core.balancer.sections import TLS_MIN_VERSION, host_port, section
from denv_iac.core.balancer.validation import BalancerConfigError

_MAX_PORT = 65535
# Where the agent relays listen: this host only.
RELAY_ADDRESS = "127.0.0.1"


def gateway_tls(gateway: str | None, settings: BalancerSettings) -> str:
    """A gateway's server options: TLS 1.3 only, its certificate checked against the stack's CA
    and its name (on requests through SNI, on health checks through check-sni and verifyhost),
    the balancer's own certificate presented. "" for a server reached directly."""
    if gateway is None:
        return ""
    return (
        f" ssl verify required ca-file {settings.gateway_ca_file}"
        f" crt {settings.gateway_client_cert} {TLS_MIN_VERSION}"
        f" sni str({gateway}) check-sni {gateway} verifyhost {gateway}"
    )


@dataclass(frozen=True, order=True)
class AgentRelay:
    """A Kubernetes gateway's agent port, as the agent checks of its replicas reach it."""

    address: str
    port: int
    gateway: str  # the name in its certificate


def agent_relays(
    pools: Sequence[BalancerPool], settings: BalancerSettings
) -> dict[AgentRelay, int]:
    """Each gateway's agent relay and its loopback port, numbered up from the settings' base.

    HAProxy's agent-check speaks plain TCP and has no TLS setting (only health checks do,
    `check-ssl`), so the agent checks of a replica behind a gateway go to a relay on this
    host's loopback (`agent-addr`), which forwards them over the same mutual TLS as requests.
    """
    found = sorted(
        {
            AgentRelay(server.address, server.agent_port, server.gateway)
            for pool in pools
            for tier in pool.tiers
            for server in tier.servers
            if server.gateway is not None
        }
    )
    ports = {relay: settings.agent_relay_port_base + n for n, relay in enumerate(found)}
    taken = {settings.port, settings.prometheus_port} & set(ports.values())
    if ports and (taken or max(ports.values()) > _MAX_PORT):
        raise BalancerConfigError(
            "settings.agent_relay_port_base",
            f"{settings.agent_relay_port_base} gives {len(ports)} agent relays ports up to "
            f"{max(ports.values())}, past {_MAX_PORT} or onto the endpoint's ports",
            "pick a base whose range holds neither the endpoint port nor the metrics port",
        )
    return ports


def agent_relay_sections(relays: Mapping[AgentRelay, int], settings: BalancerSettings) -> list[str]:
    """A defaults section of their own (plain TCP, short timers), then one listener per relay."""
    if not relays:
        return []
    check = f"{settings.check_timeout_ms}ms"
    sections = [
        section(
            "defaults",
            ["Agent checks to Kubernetes gateways, relayed over TLS: plain TCP, check timers."],
            [
                "mode tcp",
                "log global",
                f"timeout connect {check}",
                f"timeout client {check}",
                f"timeout server {check}",
            ],
        )
    ]
    for relay, port in sorted(relays.items(), key=lambda item: item[1]):
        sections.append(
            section(
                f"listen denv.agent-relay.{port}",
                [f"agent checks to the gateway {relay.gateway} at {relay.address}"],
                [
                    f"bind {RELAY_ADDRESS}:{port}",
                    f"server gateway {host_port(relay.address, relay.port)}"
                    f"{gateway_tls(relay.gateway, settings)} init-addr last,libc,none",
                ],
            )
        )
    return sections
