"""The pools' backends: a backend per tier and its twins for realtime sessions and speech
streams, with their capacity (maxconn and the bounded queue) and silence budgets; their server
lines (stable ids, weights, canaries, health and agent checks, and when a replica rejoins); the
frontend's choice of tier; and the backend that answers when no tier has a replica.

Pure.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from denv_iac.core.balancer.agent_relays import RELAY_ADDRESS, AgentRelay, gateway_tls
from denv_iac.core.balancer.api_surface import (
    ERROR_NO_REPLICA,
    JSON_ANSWER_PATHS,
    POOL_FULL,
    REALTIME_PATH,
    RETRY_AFTER_HEADER,
    SPEECH_PATH,
    TRANSCRIPTION_PATHS,
    UNAVAILABLE_CODE,
)
from denv_iac.core.balancer.model import (
    SERVER_WEIGHT,
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
)
from denv_iac.core.balancer.sections import agent_send, duration, host_port, section

NO_REPLICA_BACKEND = "denv.no-healthy-replica"
# The requests ahead of one that found every slot of its tier taken, itself included, times
# 1000 (compared with the requests the tier started in the last second times the budget in ms).
_AHEAD = "txn.ahead"
# Bounded-load consistent hashing: a conversation's replica is passed over for the next on the
# ring once it serves more than the tier's average load (HAProxy's lowest factor, 101), so one
# hot conversation cannot pile requests onto one replica while others idle, and a turn rarely
# waits on its full replica while another has a free slot: with the short queue budget such a
# wait ends in a 503. Measured at 0.9x of a pool's capacity with an equal fallback tier: with
# 150, 94.4 % of turns had their first token in budget; with 101, 98.4-99.4 % over three runs.
HASH_BALANCE_FACTOR = 101
# 1 for a request that names its conversation, else 0. HAProxy rounds the balance factor's
# share up, so with one slot left in a tier one replica's share is a slot above its maxconn: a
# turn hashed to it, full, would wait in that replica's own queue (no other replica takes it)
# and be refused at the end of the queue budget, the next tier idle. So such a turn takes a
# tier of two replicas or more only while it has two slots free; with one left it goes to the
# next tier (with every tier full, to the first tier's queue as any request). Measured at
# 0.9x of a pool's capacity with an equal fallback tier: 98.4-99.4 % of turns in budget
# without it, 319 of 319 in each of three runs with it.
TURN_SLOTS = "txn.turn_slots"

_MAX_SERVER_ID = 2**31 - 1


@dataclass(frozen=True)
class Twin:
    """A tier's replicas again, in a backend of their own, for the requests of one path whose
    streams must end when their replica is marked down (`on-marked-down shutdown-sessions`,
    which on the tier backend would also end chat requests still connecting, unanswered)."""

    suffix: str  # the backend is `<pool>.tier<n><suffix>`
    acl: str  # the frontend's acl for its path
    path: str
    what: str
    # Whether its requests take an engine's slots (maxconn, a bounded queue, spill when full).
    # A realtime session holds a connection for a whole call, idle between turns: not a slot.
    bounded: bool


TWINS = (
    Twin(".realtime", "realtime", REALTIME_PATH, "realtime sessions", bounded=False),
    Twin(".speech", "speech", SPEECH_PATH, "speech streams", bounded=True),
)
# The twins' rows in HAProxy's stats repeat their tier's servers.
TWIN_SUFFIXES = tuple(twin.suffix for twin in TWINS)
# The twins whose requests take replica slots, as the tier backend's do.
BOUNDED_TWIN_SUFFIXES = tuple(twin.suffix for twin in TWINS if twin.bounded)


def tier_backend_name(pool: BalancerPool, tier: BalancerTier) -> str:
    """The backend serving one tier of a pool.

    Unique: the text after the last '.tier' is the priority, the rest is the pool name.
    """
    return f"{pool.name}.tier{tier.priority}"


@dataclass(frozen=True)
class TierBackend:
    """What a backend named by tier_backend_name (or one of its twins) serves."""

    pool: str
    priority: int
    twin: str  # "" for the tier backend itself, else the twin's suffix (`.speech`, ...)

    @property
    def bounded(self) -> bool:
        """Whether its requests take replica slots (maxconn, the queue, pool_full)."""
        return self.twin == "" or self.twin in BOUNDED_TWIN_SUFFIXES


def parse_tier_backend(name: str) -> TierBackend | None:
    """The pool, tier and twin of a backend's name; None for any other proxy."""
    twin = next((suffix for suffix in TWIN_SUFFIXES if name.endswith(suffix)), "")
    pool, tier, priority = name.removesuffix(twin).rpartition(".tier")
    if not (pool and tier and priority.isdigit()):
        return None
    return TierBackend(pool, int(priority), twin)


def pool_routing(pool: BalancerPool) -> list[str]:
    chain = " -> ".join(
        f"tier {tier.priority} ({', '.join(sorted(tier.sites))})" for tier in pool.tiers
    )
    pool_acl = f"pool:{pool.name}"
    lines = [
        f"# pool {pool.name}: {chain} -> 503",
        f"acl {pool_acl} var(txn.pool) -m str {pool.name}",
    ]
    backends = [tier_backend_name(pool, tier) for tier in pool.tiers]
    lines += [f"acl empty:{backend} nbsrv({backend}) eq 0" for backend in backends]
    # No replica in rotation with a free slot (each takes maxconn requests): full, or empty.
    # Speech twins count their own connections: HAProxy's maxconn is per backend.
    bounded = ["", *(twin.suffix for twin in TWINS if twin.bounded)]
    # A conversation's turn, hashed to its replica, also finds a tier of two replicas or more
    # full with one slot left (see TURN_SLOTS): its own replica may be the full one.
    hashed = {
        tier_backend_name(pool, tier)
        for tier in pool.tiers
        if pool.session_affinity and len(tier.servers) > 1
    }
    lines += [
        f"acl full:{backend}{suffix} be_conn_free({backend}{suffix})"
        + (f",sub({TURN_SLOTS}) le 0" if backend in hashed and not suffix else " eq 0")
        for suffix in bounded
        for backend in backends
    ]
    first_staffed = next(tier_backend_name(pool, tier) for tier in pool.tiers if tier.servers)
    routes = [(twin.suffix, [twin.acl], twin.bounded) for twin in TWINS]
    routes.append(("", [], True))  # every other request: the tier backend
    for suffix, acls, _ in routes:
        lines.append(
            f"use_backend {first_staffed}{suffix} if {' '.join([pool_acl, *acls])} reloading"
        )
    for suffix, acls, with_slots in routes:
        if with_slots:
            lines += [
                f"# {' '.join(acls) or 'Other requests'}: the first tier with a free slot (a full"
                " one spills to the next);",
                "# every tier full: the queue of the first tier with a replica.",
            ]
            lines += _tier_chain(pool_acl, acls, backends, suffix, "full", suffix)
        # An empty tier's twin is empty too (its servers track the tier's): one acl serves all.
        lines += _tier_chain(pool_acl, acls, backends, suffix, "empty", "")
    lines.append(f"use_backend {NO_REPLICA_BACKEND} if {pool_acl}")
    return lines


def tier_backend(
    pool: BalancerPool,
    tier: BalancerTier,
    settings: BalancerSettings,
    relays: Mapping[AgentRelay, int],
) -> str:
    servers = sorted(tier.servers, key=lambda server: server.replica_id)
    if pool.session_affinity:
        lines = [
            "# A conversation stays on its replica (warm KV cache); if that replica fails, only",
            "# its sessions move, and one that holds more than the balance factor's share of the",
            "# tier's load goes to the next replica on the ring. Requests without the header go",
            "# round robin over the replicas with a free slot.",
            "balance hdr(X-Denv-Session)",
            "hash-type consistent",
            f"hash-balance-factor {HASH_BALANCE_FACTOR}",
        ]
    else:
        lines = ["balance leastconn"]
    if tier.connect_timeout_ms is not None:
        lines += [
            "# A farther tier: its handshakes need longer.",
            f"timeout connect {tier.connect_timeout_ms}ms",
        ]
    lines += _capacity(pool)
    lines += _silence_budget(pool, settings)
    lines.append("http-response set-header X-Denv-Replica %s")
    if servers:
        # Validation guarantees one health path per tier.
        lines += [f"option httpchk GET {servers[0].health_path}", "http-check expect status 200"]
    lines += _canary_note(servers)
    for server, server_id in zip(servers, _stable_server_ids(servers), strict=True):
        version = ", canary" if server.canary else ""
        lines += [
            f"# replica {server.replica_id} (site {server.site}, node {server.node}{version})"
        ]
        lines += [_server_line(server, server_id, settings, relays, pool.max_concurrency)]
    sites = ", ".join(sorted(tier.sites))
    return section(
        f"backend {tier_backend_name(pool, tier)}",
        [f"pool {pool.name}, tier {tier.priority}: sites {sites}"],
        lines,
    )


def twin_backend(
    pool: BalancerPool, tier: BalancerTier, settings: BalancerSettings, twin: Twin
) -> str:
    """The tier's replicas for one path's streams: their state tracks the tier backend's checks
    and agent, and a replica marked down ends its streams at once."""
    tracked = tier_backend_name(pool, tier)
    servers = sorted(tier.servers, key=lambda server: server.replica_id)
    lines = (
        ["balance hdr(X-Denv-Session)", "hash-type consistent"]
        if pool.session_affinity
        else ["balance leastconn"]
    )
    if tier.connect_timeout_ms is not None:
        lines.append(f"timeout connect {tier.connect_timeout_ms}ms")
    if twin.path == REALTIME_PATH:
        lines += [
            "# The upgrade answer is the first byte: the first-token budget, then a retry.",
            f"timeout server {pool.first_token_timeout_ms}ms",
            "# Once upgraded the tunnel timer alone applies, on both sides: a session idles",
            "# between a caller's turns, so the stream's silence budget would cut healthy calls.",
            f"timeout tunnel {duration(settings.realtime_tunnel_timeout_s)}",
        ]
    else:
        lines += _stream_budget(pool)
    if twin.bounded:
        lines += _capacity(pool)
    lines += [
        "http-response set-header X-Denv-Replica %s",
        "# State follows the tier backend's checks and agent (no checks of its own). A replica",
        f"# marked down (dead, frozen, agent down) ends its {twin.what} at once: none is",
        "# moved or replayed, and its caller asks again of a healthy replica. A drain keeps them.",
        "default-server no-check no-agent-check on-marked-down shutdown-sessions",
    ]
    for server, server_id in zip(servers, _stable_server_ids(servers), strict=True):
        lines.append(
            f"server {server.replica_id} {host_port(server.address, server.port)} id {server_id}"
            f"{_weight(server)}{gateway_tls(server.gateway, settings)}"
            f" track {tracked}/{server.replica_id}"
            + (f" maxconn {pool.max_concurrency}" if twin.bounded else "")
        )
    return section(
        f"backend {tracked}{twin.suffix}",
        [f"pool {pool.name}, tier {tier.priority}: {twin.what}"],
        lines,
    )


def _tier_chain(
    pool_acl: str, acls: list[str], backends: list[str], suffix: str, unusable: str, of: str
) -> list[str]:
    """One rule a tier, most preferred first: a tier is used when its acl `unusable:<backend><of>`
    (full, or empty) is false and that of every more preferred tier true. Each rule spells
    that out, so a tier is used only then, whatever the rule order."""
    rules = []
    for i, backend in enumerate(backends):
        preferred = [f"{unusable}:{more}{of}" for more in backends[:i]]
        conditions = " ".join([pool_acl, *acls, *preferred, f"!{unusable}:{backend}{of}"])
        rules.append(f"use_backend {backend}{suffix} if {conditions}")
    return rules


def _capacity(pool: BalancerPool) -> list[str]:
    """A replica takes at most `max_concurrency` requests (maxconn on each server line); the
    rest wait here, not in the engine, where a request already has its headers and can no
    longer be retried; but only those the tier would start within the pool's queue budget,
    and for no longer than it. The others are refused at once, before any byte, so a caller
    learns it in milliseconds and can use its fallback within the turn."""
    budget = pool.queue_timeout_ms
    full = f"{{ var({UNAVAILABLE_CODE}) -m found }}"
    return [
        f"# Each replica takes {pool.max_concurrency} requests at once (maxconn). With none free, a"
        " request waits in",
        f"# this queue only if the tier would start it within the {budget} ms queue budget (of the",
        f"# {pool.first_token_timeout_ms} ms first-token budget): the requests ahead of it, itself"
        " included, at most",
        "# those the tier started in the last second times the budget. Else, and past the budget,",
        f"# a 503 {POOL_FULL} with Retry-After: at once, or after the budget.",
        f"timeout queue {budget}ms",
        f"http-request set-var({UNAVAILABLE_CODE}) str({POOL_FULL})"
        " if { be_conn_free eq 0 } { nbsrv gt 0 }",
        f"http-request set-var({_AHEAD}) queue,add(1),mul(1000) if {full}",
        "http-request return status 503 default-errorfiles"
        f" if {full} {{ be_sess_rate,mul({budget}),sub({_AHEAD}) lt 0 }}",
    ]


def _stream_budget(pool: BalancerPool) -> list[str]:
    """`timeout server` is HAProxy's one inactivity timer of the replica side: it bounds the
    wait for the first response byte (then `retry-on response-timeout` sends the request to
    another replica) and every pause of a started stream (then the stream is cut)."""
    first, stall = pool.first_token_timeout_ms, pool.stall_timeout_ms
    if first == stall:
        lines = [
            f"# Silence budget: no response byte within {first} ms, the request is retried on",
            "# another replica (nothing reached the client); a stream silent that long is cut,",
            "# so its client hears the abort instead of waiting on a frozen replica.",
        ]
    else:
        # 2.6 cannot change the timer once the response has started (no http-response
        # set-timeout): the larger budget is the one that never cuts a healthy answer.
        lines = [
            f"# Silence budgets: {first} ms to the first response byte (then a retry on another",
            f"# replica), {stall} ms between chunks of a stream (then it is cut). HAProxy keeps",
            "# one inactivity timer per request, so both phases get the larger of the two.",
        ]
    return [*lines, f"timeout server {max(first, stall)}ms"]


def _silence_budget(pool: BalancerPool, settings: BalancerSettings) -> list[str]:
    """The stream's budget, and the timers of the routes whose answer comes whole, by path
    (speech, which always streams, has its own backend)."""
    return [
        *_stream_budget(pool),
        "# A transcription comes whole, at the end: none within the first-byte budget and it is",
        "# retried on another replica, as nothing reached the client (a body within",
        "# tune.bufsize only: a larger one cannot be sent again, and gets the 504).",
        f"http-request set-timeout server {pool.first_token_timeout_ms}ms"
        f" if {{ path {' '.join(TRANSCRIPTION_PATHS)} }}",
        "# A JSON answer not asked for as a stream comes whole, at the end: the long timer.",
        f"http-request set-timeout server {settings.stream_idle_timeout_s}s"
        f" if {{ path {' '.join(JSON_ANSWER_PATHS)} }}"
        " !{ req.body,json_query('$.stream') -m bool }",
    ]


# Failed health checks that take a server out, and passing ones that bring it back.
CHECK_FALL = CHECK_RISE = 2


def rejoin_ms(settings: BalancerSettings) -> int:
    """The longest a replica healthy again, and undrained by its agent, takes to be counted UP by
    every balancer: the agent's next answer, then CHECK_RISE health checks at the down server's
    pace (a check each `fastinter`, the first of them up to an `inter` away)."""
    inter = settings.check_inter_ms
    checks = CHECK_RISE * (_fast_inter(inter) + settings.check_timeout_ms)
    return settings.agent_inter_ms + inter + checks


def rejoin_s(settings: BalancerSettings) -> int:
    """rejoin_ms in whole seconds, rounded up: what a rollout waits after a replica is warm
    again before it takes the next one away."""
    return math.ceil(rejoin_ms(settings) / 1000)


def _fast_inter(inter: int) -> int:
    return max(inter // 4, 1)


def default_server(settings: BalancerSettings) -> list[str]:
    inter = settings.check_inter_ms
    fast = _fast_inter(inter)
    return [
        "# Out of rotation fast: the node agent's verdict (GPU faults) every agent-inter; a",
        "# refused connect on live traffic at once (observe layer4); a failed health check",
        "# confirmed at fastinter. Back fast too: a down server is checked at fastinter, so",
        "# a replica that answers again is in rotation within two of them. Weight 100 so that",
        "# the agent's percentages can scale it. No on-marked-down shutdown-sessions: it also",
        "# killed requests still connecting, unanswered; the stall budget cuts silent streams.",
        "# A replica host name that does not resolve leaves that server out (init-addr none)",
        "# instead of failing the whole endpoint.",
        f"default-server check inter {inter}ms fastinter {fast}ms downinter {fast}ms"
        f" fall {CHECK_FALL} rise {CHECK_RISE} agent-check agent-inter {settings.agent_inter_ms}ms"
        f" weight {SERVER_WEIGHT}"
        " observe layer4 error-limit 1 on-error mark-down init-addr last,libc,none",
    ]


def _stable_server_ids(servers: Sequence[BalancerServer]) -> list[int]:
    """HAProxy server ids derived from replica ids, so that they survive config changes.

    Consistent hashing places each server on the ring by its id; HAProxy numbers servers by
    position otherwise, and adding one replica would then move other replicas' sessions.
    """
    taken: set[int] = set()
    ids = []
    for server in servers:
        server_id = zlib.crc32(server.replica_id.encode()) % _MAX_SERVER_ID + 1
        while server_id in taken:  # rare crc collision: probe to the next free id
            server_id = server_id % _MAX_SERVER_ID + 1
        taken.add(server_id)
        ids.append(server_id)
    return ids


def _server_line(
    server: BalancerServer,
    server_id: int,
    settings: BalancerSettings,
    relays: Mapping[AgentRelay, int],
    max_concurrency: int,
) -> str:
    line = (
        f"server {server.replica_id} {host_port(server.address, server.port)} id {server_id}"
        f"{_weight(server)} maxconn {max_concurrency}"
    )
    if server.gateway is None:
        agent = f"agent-port {server.agent_port}"
    else:
        relay = relays[AgentRelay(server.address, server.agent_port, server.gateway)]
        agent = f"agent-addr {RELAY_ADDRESS} agent-port {relay}"
    return (
        f"{line}{gateway_tls(server.gateway, settings)}"
        f" {agent} agent-send {agent_send(server.replica_id)}"
    )


def _weight(server: BalancerServer) -> str:
    """A server's weight when it is not the default's (a tier shared with a canary)."""
    return "" if server.weight == SERVER_WEIGHT else f" weight {server.weight}"


def _canary_note(servers: Sequence[BalancerServer]) -> list[str]:
    """What share of new sessions a tier's canary replicas take, by their weights."""
    canary = sum(server.weight for server in servers if server.canary)
    if not canary:
        return []
    total = sum(server.weight for server in servers)
    return [
        "# Canary: its replicas take their weight's share of new sessions (weighted hash, or",
        f"# round robin without X-Denv-Session): {canary} of {total}, {100 * canary / total:.1f} %."
        " A session stays where it started.",
    ]


def no_replica_backend() -> str:
    return section(
        f"backend {NO_REPLICA_BACKEND}",
        ["Every allowed tier of the pool is empty: answer at once rather than queue."],
        [
            "http-request return status 503 content-type application/json"
            f" lf-string '{ERROR_NO_REPLICA}' {RETRY_AFTER_HEADER}",
        ],
    )
