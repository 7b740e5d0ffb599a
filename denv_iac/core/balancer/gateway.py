"""The in-cluster gateway of a Kubernetes site: its HAProxy config, rendered from its routes.

The gateway is only a relay (see denv_iac.core.kube_manifests for its design): a TCP listener per
replica, forwarding to the replica's pod, and one agent-check frontend that routes each check by
the replica id it carries to the agent of the replica's node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from denv_iac.core.balancer import sections
from denv_iac.core.balancer.model import BalancerSettings
from denv_iac.core.stack.ports import AGENT_PORT

GATEWAY_HEALTH_PORT = 8404
# What an agent answers for a replica whose pod is not on its node (denv_agent.agentcheck).
AGENT_UNKNOWN = "down #unknown replica"
# How often the gateway asks every agent which of them knows a replica.
AGENT_FIND_INTERVAL_S = 2
# The gateway's connect to a pod: a hop inside the cluster, not the balancer's to a site.
GATEWAY_CONNECT = "500ms"


@dataclass(frozen=True)
class GatewayRoute:
    """One replica as the gateway relays it: the port the balancer calls, and the pod behind it."""

    replica_id: str
    node: str
    service_port: int  # replica_port: what the global balancer calls on the node's address
    listen_port: int  # the gateway pods' listener for it
    pod_host: str  # the pod's stable DNS name
    pod_port: int


@dataclass(frozen=True)
class GatewayTls:
    """Where the gateway's certificate and key, and the stack's CA, are read from."""

    crt: str
    ca_file: str


def gateway_bind(port: int, tls: GatewayTls | None) -> str:
    """A listener the balancer calls: with `tls`, only TLS 1.3 with a client certificate of the
    stack's CA (`verify required`), so plaintext and unknown clients never reach a replica."""
    bind = f"bind :{port}"
    if tls is None:
        return bind
    return (
        f"{bind} ssl crt {tls.crt} ca-file {tls.ca_file} verify required {sections.TLS_MIN_VERSION}"
    )


@dataclass(frozen=True)
class GatewaySite:
    """What the gateway's config needs of its site."""

    name: str
    agents: str  # a DNS name that resolves to every agent of the site
    max_agents: int  # how many agents it may resolve to
    tls: GatewayTls | None  # None: the link is plain TCP


def render_gateway_config(
    site: GatewaySite, routes: Sequence[GatewayRoute], settings: BalancerSettings
) -> str:
    """The gateway's haproxy.cfg: TCP relays, agent checks routed by the replica id they carry;
    its idle timers from the endpoint's `settings` (see gateway_idle_timers).

    With TLS, both the replicas' listeners and the agent-check frontend take TLS only; the
    relays inside the cluster are plain, guarded by the NetworkPolicies."""
    ordered = sorted(routes, key=lambda r: r.replica_id)
    parts = [
        sections.section(
            "global",
            sections.header(f"gateway of site {site.name}", "the stack"),
            [sections.LOG_STDOUT],
        ),
        _defaults_section(settings),
        sections.section("resolvers cluster", [], ["parse-resolv-conf", "hold valid 5s"]),
        sections.section(
            "frontend denv.health",
            [],
            [
                "mode http",
                gateway_bind(GATEWAY_HEALTH_PORT, None),
                "timeout http-request 5s",
                "monitor-uri /healthz",
            ],
        ),
        _agent_frontend(site, ordered),
    ]
    for route in ordered:
        parts += [_agent_backend(site, route), _replica_listener(site, route)]
    return "\n".join(parts)


def gateway_idle_timers(settings: BalancerSettings) -> tuple[int, int]:
    """The gateway's idle timers, in seconds, from the endpoint's settings (the stack's, by
    denv_iac.core.endpoint.balancer_settings): `timeout client`/`server`, then `timeout tunnel`.

    Which of the endpoint's timers the gateway takes, and why:
    - Idle timers, at least the endpoint's. The gateway relays, in the middle, every stream
      the endpoint holds to a pod of this site. An idle timer of the gateway shorter than the
      endpoint's on the same stream would cut a stream, or a realtime session idling between
      turns, that the endpoint still holds: an abort no node site gives. A longer one cuts
      nothing: when the endpoint gives up it closes its side, and the gateway then the pod's.
      In TCP mode `timeout tunnel` replaces `client` and `server` once a connection is
      relayed (no analyser left), so it gets the longest idle timer any stream has at the
      endpoint: the realtime tunnel's or the stream idle timer, the larger. `client` and
      `server` (the time before that) are the endpoint's `timeout client`.
    - The endpoint's silence budgets (first token, stall) stay the endpoint's alone: the
      endpoint retries or cuts on them, and the gateway must not act first.
    - `timeout connect` is not the endpoint's: that one covers the handshake from a balancer to
      its farthest site (a far tier raises it); the gateway's connects to a pod in the same
      cluster (GATEWAY_CONNECT).
    - Health and agent check timers are not the endpoint's: the endpoint's checks go through
      the gateway to the pod and the node's agent and decide rotation; the gateway's own only
      find where to relay (whether a pod accepts, which agent knows a replica).
    """
    idle = settings.stream_idle_timeout_s
    return idle, max(idle, settings.realtime_tunnel_timeout_s)


def _defaults_section(settings: BalancerSettings) -> str:
    idle, tunnel = gateway_idle_timers(settings)
    return sections.section(
        "defaults",
        [],
        [
            "mode tcp",
            "log global",
            "# In-cluster hops are sub-millisecond: a pod that does not answer fast is gone, and",
            "# closing at once lets the global balancer retry elsewhere before any byte is sent.",
            f"timeout connect {GATEWAY_CONNECT}",
            "# Inactivity timers, as the global balancer's: a stream lives while tokens flow.",
            f"timeout client {idle}s",
            f"timeout server {idle}s",
            "# A relayed connection has this one (TCP mode): the balancer's longest, so that a",
            "# realtime session idling between turns is never cut here before it is there.",
            f"timeout tunnel {sections.duration(tunnel)}",
            "# Pods get new addresses when rescheduled, and may not exist yet: resolve them in",
            "# the cluster's DNS at run time, and start without them.",
            "default-server resolvers cluster init-addr last,libc,none",
        ],
    )


def _agent_frontend(site: GatewaySite, ordered: Sequence[GatewayRoute]) -> str:
    return sections.section(
        "frontend denv.agent",
        [],
        [
            gateway_bind(AGENT_PORT, site.tls),
            "# agent-send carries the replica id (and a newline): route on it, whole (after TLS).",
            "tcp-request inspect-delay 1s",
            "tcp-request content accept if { req.len gt 0 }",
            *(
                f"use_backend agent.{r.replica_id} if {{ req.payload(0,0) -m str "
                f'{sections.agent_send(r.replica_id)} "{r.replica_id}" }}'
                for r in ordered
            ),
        ],
    )


def _agent_backend(site: GatewaySite, route: GatewayRoute) -> str:
    agents = sections.host_port(site.agents, AGENT_PORT)
    return sections.section(
        f"backend agent.{route.replica_id}",
        [],
        [
            "# Every node's agent; only the one on the replica's node knows it and passes.",
            "option tcp-check",
            f"tcp-check send {sections.agent_send(route.replica_id)}",
            f'tcp-check expect ! string "{AGENT_UNKNOWN}"',
            # The resolver fills the slots with the agents' addresses at run time.
            f"server-template agent 1-{site.max_agents} {agents} init-addr none check inter"
            f" {AGENT_FIND_INTERVAL_S}s rise 1 fall 1",
        ],
    )


# The gateway's own health check of each pod: every REPLICA_CHECK_INTER_S, HAProxy's default
# `rise 2` passing checks to count a pod UP again.
REPLICA_CHECK_INTER_S = 1
_REPLICA_CHECK_RISE = 2


def gateway_rejoin_ms() -> int:
    """The longest a pod that is ready again takes to be counted UP by its site's gateway: the
    next check up to an `inter` away, then `rise` checks. The endpoint's own checks pass through
    the gateway, so this comes before the endpoint's rejoin."""
    return REPLICA_CHECK_INTER_S * 1000 * (1 + _REPLICA_CHECK_RISE)


def _replica_listener(site: GatewaySite, route: GatewayRoute) -> str:
    return sections.section(
        f"listen replica.{route.replica_id}",
        [f"replica {route.replica_id}: node {route.node} port {route.service_port}"],
        [
            gateway_bind(route.listen_port, site.tls),
            f"server replica {sections.host_port(route.pod_host, route.pod_port)} check inter"
            f" {REPLICA_CHECK_INTER_S}s",
        ],
    )
