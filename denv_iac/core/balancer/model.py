"""What the balancer is built from: placed pools and endpoint settings, as plain frozen data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from denv_iac.core.stack.model import (
    AGENT_INTER_MS,
    CHECK_INTER_MS,
    CHECK_TIMEOUT_MS,
    CONNECT_TIMEOUT_MS,
    FIRST_TOKEN_TIMEOUT_MS,
    MAX_CONCURRENCY,
    STALL_TIMEOUT_MS,
    KeyScope,
)

# HAProxy's runtime API on a balancer host. Its folder is made by the haproxy unit at each
# start (the balancer host deploy's RuntimeDirectory), so it is the one place that names it.
STATS_SOCKET = "/run/denv/haproxy.sock"
CONFIG_DIR = "/etc/haproxy/denv"  # the map files and the certificate the config reads
TLS_CERT_PATH = f"{CONFIG_DIR}/tls.pem"  # certificate and key in one PEM, as `ssl crt` reads it
# Mutual TLS to Kubernetes gateways: the stack's CA, which the gateways' certificates must be
# signed by, and the balancer's client certificate and key in one PEM.
GATEWAY_CA_PATH = f"{CONFIG_DIR}/gateway-ca.pem"
GATEWAY_CLIENT_PATH = f"{CONFIG_DIR}/gateway-client.pem"
# The key that signs realtime client secrets, as a map file (see balancer.client_secrets).
CLIENT_SECRET_KEY_PATH = f"{CONFIG_DIR}/client-secret.map"


# Every server's weight, unless a canary shares its tier: the agent's percentages scale it.
SERVER_WEIGHT = 100


@dataclass(frozen=True)
class BalancerServer:
    """One replica as HAProxy sees it: where to send requests and where its node agent listens."""

    replica_id: str  # pool.site.node.gpu[.slice], also the HAProxy server name
    site: str
    node: str
    address: str
    port: int
    agent_port: int
    health_path: str = "/health"
    # Set when the replica is reached through a Kubernetes site's gateway over mutual TLS: the
    # name in the gateway's certificate, sent as SNI and verified (see spec.gateway_link).
    gateway: str | None = None
    # Its share of the tier's new sessions against the other servers' (see balancer.canary).
    weight: int = SERVER_WEIGHT
    canary: bool = False  # a replica of the pool's canary, the recipe's new version


# A TCP handshake takes one round trip. The tier's connect timeout allows two, and a few
# milliseconds for the scheduling of a busy host: a connect that takes longer has lost its SYN
# (resent after 1 s) or met a dead host, and the request is better retried on another replica
# at once. HAProxy waits min(timeout connect, 1 s) before it retries a refused connect, so this
# is also what a replica that has just died costs the next request: a few ms on the same site
# rather than the stack's one value for every tier (80 ms), which also cut every connect to a
# site farther than about 80 ms. Not fewer than 7: HAProxy counts a connect it gets to only
# after the timeout as failed, and marks that replica down (observe layer4); with 5, while a
# replica died and its requests moved, a busy host took the healthy one out too in 2 runs of 10
# (every request 503 until its checks passed); with 7 and 8, in none of 12. Not more: the wait
# after a death is this plus about a millisecond (whole-millisecond timers), and a tier on the
# same site may cost the next request at most 10 ms (8.4 at worst with 7; up to 10.0 with 8).
CONNECT_SLACK_MS = 7
CONNECT_ROUND_TRIPS = 2
CONNECT_CEILING_MS = 1000  # a SYN lost is resent after 1 s: past that no timer helps


def connect_timeout_for(round_trip_ms: float) -> int:
    """The connect timeout of a tier whose farthest site is `round_trip_ms` away."""
    wanted = CONNECT_SLACK_MS + math.ceil(CONNECT_ROUND_TRIPS * round_trip_ms)
    return min(CONNECT_CEILING_MS, wanted)


@dataclass(frozen=True)
class BalancerTier:
    """Replicas of one pool that are equally preferred; a pool fails over tier by tier."""

    priority: int
    sites: tuple[str, ...]
    servers: tuple[BalancerServer, ...]
    # The tier's own connect timeout, from the round trip to its sites (connect_timeout_for);
    # None: the settings' value.
    connect_timeout_ms: int | None = None


# How long a request may wait for a slot when its recipe states no `queue_budget_ms`: at most
# QUEUE_BUDGET_MS, and no more than a fifth of a short first-token budget (the rest is the
# replica's prefill). A voice agent refused within about 100 ms can still use its fallback
# inside the turn (another provider, a cached phrase); with three quarters of the 1 s budget as
# the wait (this default's old value), refusals came at 750 ms and the requests served had
# waited most of it (TTFT p50 576 ms at 1.0x of a pool's capacity, where the engine's own is
# 100 ms). A refused request waits this long at most; most are refused at once (see
# docs/balancer.md, Capacity).
QUEUE_BUDGET_MS = 80
QUEUE_SHARE_PCT = 20


@dataclass(frozen=True)
class BalancerPool:
    """A served model: its tiers, most preferred first."""

    name: str
    tiers: tuple[BalancerTier, ...]
    session_affinity: bool = True  # consistent hash on X-Denv-Session
    # The recipe's silence budgets: no response byte by the first, the request is retried
    # elsewhere; a started stream silent for the second, it is cut.
    first_token_timeout_ms: int = FIRST_TOKEN_TIMEOUT_MS
    stall_timeout_ms: int = STALL_TIMEOUT_MS
    # Other `model` names served by this pool (the recipe's `models:` list); the pool's own
    # name always routes too.
    models: tuple[str, ...] = ()
    # Requests one replica takes at once (the recipe's max_concurrency): HAProxy's maxconn on
    # each server; the rest wait in the balancer's queue for at most `queue_timeout_ms`.
    max_concurrency: int = MAX_CONCURRENCY
    # The recipe's `queue_budget_ms`; None: default_queue_budget_ms.
    queue_budget_ms: int | None = None

    @property
    def queue_timeout_ms(self) -> int:
        """How long a request may wait for a slot, and what a full tier must start it within
        to take it into its queue at all."""
        if self.queue_budget_ms is not None:
            return self.queue_budget_ms
        return default_queue_budget_ms(self.first_token_timeout_ms)


def default_queue_budget_ms(first_token_timeout_ms: int) -> int:
    """How long a request may wait for a free slot when the recipe does not say: the
    first-token budget covers that wait and the replica's own time to its first token (the
    prefill), so the queue gets QUEUE_BUDGET_MS and at most QUEUE_SHARE_PCT of it."""
    return max(1, min(QUEUE_BUDGET_MS, first_token_timeout_ms * QUEUE_SHARE_PCT // 100))


@dataclass(frozen=True)
class BalancerSettings:
    """Endpoint-wide choices: listeners, credentials, timers."""

    bind_address: str = "0.0.0.0"
    port: int = 8080
    tls_cert_path: str | None = None
    api_key_digests: tuple[str, ...] = ()  # SHA-256 hex digests of API keys; empty = no auth
    # Keys among those that may use only some pools, or send only so many requests a second.
    key_scopes: tuple[KeyScope, ...] = ()
    stats_socket: str = STATS_SOCKET
    prometheus_port: int | None = 8405
    # The map file holding the key that signs realtime client secrets (client_secrets.key_map);
    # None: no client secrets. Like the certificate, a file of the host, never rendered here.
    client_secret_key_file: str | None = None
    # Where the metrics and stats page listen; None: bind_address, as the endpoint.
    prometheus_address: str | None = None
    # The stack's `timers` (see BalancerTimers for why each default).
    agent_inter_ms: int = AGENT_INTER_MS
    check_inter_ms: int = CHECK_INTER_MS
    check_timeout_ms: int = CHECK_TIMEOUT_MS
    connect_timeout_ms: int = CONNECT_TIMEOUT_MS
    # The timer of requests that do not ask for a stream (their answer comes whole, at the end),
    # and of the client side of every stream.
    stream_idle_timeout_s: int = 300
    # A realtime session is a WebSocket tunnel that idles between a caller's turns. Its silence
    # limit, once upgraded: clients ping every 20-30 s (the websockets library, LiveKit,
    # Pipecat), so ten minutes without a byte is a dead peer, not a caller thinking.
    realtime_tunnel_timeout_s: int = 600
    state_file: str | None = None  # server-state-file path
    # Mutual TLS to Kubernetes gateways: the stack's CA, which signed the gateways'
    # certificates, and the balancer's client certificate and key in one PEM. Needed when a
    # server has a `gateway`.
    gateway_ca_file: str | None = None
    gateway_client_cert: str | None = None
    # Agent checks to a gateway go through a loopback relay that speaks TLS (HAProxy's
    # agent-check cannot); the relays listen on 127.0.0.1 from this port up, one per gateway
    # address.
    agent_relay_port_base: int = 19100


@dataclass(frozen=True)
class RenderedConfig:
    """An HAProxy configuration and the map files it reads, by file name."""

    haproxy_cfg: str
    files: dict[str, str] = field(default_factory=dict)
    map_dir: str = ""  # where haproxy_cfg expects the files
