"""`denv status`: what is warm where, and healthy, read from the balancer and the node agents.

HAProxy's `show stat` is the truth about rotation (state, weight, active streams); each node
agent's `/healthz` adds what only the node knows (the full reason, the last probe TTFT). Agents
are asked best effort with a short timeout: a node whose agent does not answer is reported as
such, and its replicas keep what HAProxy says.
"""

import asyncio
import csv
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from denv_iac.core.balancer.haproxy import STATS_PATH
from denv_iac.core.balancer.saturation import PoolSaturation
from denv_iac.core.balancer.stats import parse_stats_rows
from denv_iac.core.balancer.tiers import parse_tier_backend
from denv_iac.core.stack.model import StackSpec

AGENT_TIMEOUT_S = 1.0
STATS_TIMEOUT_S = 5.0
AGENT_UNREACHABLE = "agent unreachable"
# HAProxy's `agent_status` of a server whose agent answered its last check (L7OK for `up`,
# L7STS for `down`), has not been asked yet (INI, just after a start or reload) or has none
# (""); anything else (L4CON refused, L4TOUT timed out, L7RSP a reply it could not read) means
# the balancer cannot hear the agent.
AGENT_ANSWERED = ("L7OK", "L7STS", "INI", "")


@dataclass(frozen=True)
class ReplicaStatus:
    id: str
    pool: str
    site: str
    node: str
    backend: str
    state: str  # UP, DOWN, DRAIN, MAINT, ... as HAProxy reports it
    weight: int
    streams: int
    reason: str  # the agent's or the health check's last word; "" when there is nothing to say
    probe_ttft_ms: float | None = None  # the agent's last first-token probe, when it runs one
    # The engine's own figures, as its node agent last read them from its metrics: requests
    # it decodes now and requests waiting inside it; None where the agent reads none.
    engine_running: float | None = None
    engine_waiting: float | None = None
    # Whether the balancer heard the node agent at its last agent check. An agent it cannot
    # hear fails open: the replica stays in rotation on its health checks alone, its GPU
    # faults unseen, so this is reported as a failure, never as a routing change.
    agent_heard: bool = True
    served: int = 0  # requests it was sent since the balancer started (HAProxy `stot`)
    # HAProxy's `ttime`: the average total time, ms, of its last 1024 requests (a stream's
    # whole length); None before its first.
    total_ms: int | None = None
    # HAProxy's `check_duration`: how long its last health check took, ms (a new connection,
    # then the request and its answer: about two round trips); None before the first.
    check_ms: int | None = None

    @property
    def healthy(self) -> bool:
        return self.state.startswith("UP")


@dataclass(frozen=True)
class VersionStatus:
    """One version of a pool with a canary: the recipe's (`stable`) or its canary's."""

    version: str  # "stable" or "canary"
    pool: str  # whose replicas: the recipe's pool, or its canary's
    replicas: int
    ready: int  # UP in the balancer: taking new sessions
    # The share of new sessions its ready replicas take now, by their weights in the most
    # preferred tier that has a ready replica; None when no tier has one.
    share_now: float | None
    share_stack: float  # what the stack asks: the canary's share, or the rest
    probe_ttft_ms: float | None  # the median of its replicas' last agent probes
    total_ms: float | None  # the mean of its replicas' HAProxy ttime
    served: int


@dataclass(frozen=True)
class PoolStatus:
    pool: str
    healthy: int
    min_warm: int | None  # None when no stack spec says (status read from a bare admin socket)
    # Slots in use, queued, spilled and shed; None when the balancer has no backend of it.
    saturation: PoolSaturation | None = None
    # A pool with a canary: its recipe's version and its canary's, side by side. `healthy`
    # counts the recipe's own replicas: the canary is no part of min_warm.
    versions: tuple[VersionStatus, ...] = ()
    canary_pool: str | None = None

    @property
    def ok(self) -> bool:
        return self.min_warm is None or self.healthy >= self.min_warm


@dataclass(frozen=True)
class AgentEndpoint:
    node: str  # site/node
    url: str  # base URL of the agent's HTTP port


@dataclass(frozen=True)
class AgentHealth:
    node: str
    url: str
    reachable: bool
    error: str  # why it could not be read; "" when reachable
    replicas: Mapping[str, Mapping[str, Any]]  # /healthz replica documents by replica id


def haproxy_reason(row: Mapping[str, str]) -> str:
    """The agent's word as HAProxy last heard it: `via agent : down (xid 79 ...)` -> `xid 79 ...`.

    A plain `up` says nothing an operator needs, so it becomes "".
    """
    text = (row.get("last_agt") or row.get("last_chk") or "").strip()
    text = text.removeprefix("via agent : ")
    if text.endswith(")") and "(" in text:
        return text[text.index("(") + 1 : -1]
    return "" if text == "up" else text


def replica_statuses(rows: Mapping[str, Mapping[str, str]]) -> list[ReplicaStatus]:
    """From `show stat` rows by server name (replica ids `pool.site.node.gpu[.slice]`)."""
    statuses = []
    for name, row in sorted(rows.items()):
        pool, site, node = [*name.split("."), "", ""][:3]
        statuses.append(
            ReplicaStatus(
                id=name,
                pool=pool,
                site=site,
                node=node,
                backend=row.get("pxname", ""),
                state=row.get("status", "?"),
                weight=int(row.get("weight") or 0),
                streams=int(row.get("scur") or 0),
                reason=haproxy_reason(row),
                agent_heard=row.get("agent_status", "") in AGENT_ANSWERED,
                served=int(row.get("stot") or 0),
                total_ms=int(row["ttime"]) if row.get("ttime") else None,
                check_ms=int(row["check_duration"]) if row.get("check_duration") else None,
            )
        )
    return statuses


def with_agent_health(
    replicas: Sequence[ReplicaStatus], agents: Sequence[AgentHealth]
) -> list[ReplicaStatus]:
    """Replicas completed by their node agent's reasons and probe TTFT."""
    by_node = {agent.node: agent for agent in agents}
    merged = []
    for replica in replicas:
        agent = by_node.get(f"{replica.site}/{replica.node}")
        if agent is None:
            merged.append(replica)
        elif not agent.reachable:
            reason = "; ".join(r for r in (replica.reason, AGENT_UNREACHABLE) if r)
            merged.append(replace(replica, reason=reason))
        else:
            doc = agent.replicas.get(replica.id, {})
            health = doc.get("health") or {}
            engine = health.get("engine") or {}
            read = engine.get("error") is None and "running" in engine
            reasons = "; ".join(doc.get("reasons") or ())
            merged.append(
                replace(
                    replica,
                    reason=reasons or replica.reason,
                    probe_ttft_ms=health.get("ttft_ms"),
                    engine_running=engine.get("running") if read else None,
                    engine_waiting=engine.get("waiting") if read else None,
                )
            )
    return merged


@dataclass(frozen=True)
class SiteDistance:
    """How far a site is from the balancer: as measured, and as the stack states it (the
    stated round trip sets its tiers' connect timeouts; see balancer.model)."""

    site: str
    # Half the quickest last health check of its replicas (each a handshake, then a request
    # and its answer), to the ms HAProxy reports; None before any was checked.
    measured_round_trip_ms: float | None
    stated_round_trip_ms: float | None  # None: not stated, or no stack given


def site_distances(
    stack: StackSpec | None, replicas: Sequence[ReplicaStatus]
) -> list[SiteDistance]:
    """Per site with a replica in the balancer, by name."""
    distances = []
    for site in sorted({r.site for r in replicas}):
        checks = [r.check_ms for r in replicas if r.site == site and r.check_ms is not None]
        stated = None
        if stack is not None and site in {s.name for s in stack.sites}:
            stated = stack.site(site).round_trip_ms
        distances.append(SiteDistance(site, min(checks) / 2 if checks else None, stated))
    return distances


def pool_statuses(
    stack: StackSpec | None,
    replicas: Sequence[ReplicaStatus],
    saturation: Mapping[str, PoolSaturation] | None = None,
) -> list[PoolStatus]:
    """Healthy replicas per pool against its min_warm, and how full it is; without a stack,
    the pools seen."""
    if stack is None:
        wanted: dict[str, int | None] = dict.fromkeys(sorted({r.pool for r in replicas}))
    else:
        wanted = {recipe.name: recipe.min_warm for recipe in stack.pools}
    full = saturation or {}
    statuses = []
    for pool, min_warm in wanted.items():
        canary = None if stack is None else stack.canary_pool(pool)
        versions: tuple[VersionStatus, ...] = ()
        if stack is not None and canary is not None and canary.canary_of:
            versions = version_statuses(stack, pool, canary.name, replicas)
        statuses.append(
            PoolStatus(
                pool,
                sum(1 for r in replicas if r.pool == pool and r.healthy),
                min_warm,
                full.get(pool),
                versions,
                None if canary is None else canary.name,
            )
        )
    return statuses


def version_statuses(
    stack: StackSpec, pool: str, canary_pool: str, replicas: Sequence[ReplicaStatus]
) -> tuple[VersionStatus, ...]:
    """The recipe's version and its canary's, from the balancer's rows and the agents'
    probes: replicas, ready, the share of new sessions each takes now (by weight), TTFT."""
    recipe = next(r for r in stack.pools if r.name == pool)
    share = recipe.canary.share if recipe.canary is not None else 0.0
    mine = [r for r in replicas if r.pool in (pool, canary_pool)]
    weights = _serving_tier_weights(mine)
    total = sum(weights.values())
    versions = []
    for version, name, asked in (("stable", pool, 1 - share), ("canary", canary_pool, share)):
        own = [r for r in mine if r.pool == name]
        probes = [r.probe_ttft_ms for r in own if r.probe_ttft_ms is not None]
        times = [r.total_ms for r in own if r.total_ms is not None]
        versions.append(
            VersionStatus(
                version,
                name,
                len(own),
                sum(1 for r in own if r.healthy),
                sum(w for r, w in weights.items() if r.startswith(f"{name}.")) / total
                if total
                else None,
                asked,
                statistics.median(probes) if probes else None,
                statistics.fmean(times) if times else None,
                sum(r.served for r in own),
            )
        )
    return tuple(versions)


def _serving_tier_weights(replicas: Sequence[ReplicaStatus]) -> dict[str, int]:
    """The weights of the ready replicas of the most preferred tier that has one: where the
    balancer sends a pool's new sessions."""
    tiers: dict[int, dict[str, int]] = {}
    for r in replicas:
        tier = parse_tier_backend(r.backend)
        if tier is not None and r.healthy and r.weight > 0:
            tiers.setdefault(tier.priority, {})[r.id] = r.weight
    return tiers[min(tiers)] if tiers else {}


def problems(
    pools: Sequence[PoolStatus], replicas: Sequence[ReplicaStatus], agents: Sequence[AgentHealth]
) -> list[str]:
    """One line per failure that must alert: a pool short of min_warm, an agent that neither
    answers us nor the balancer. Empty when all is well."""
    lines = [
        f"pool {p.pool}: {p.healthy} healthy, below min_warm {p.min_warm}"
        for p in pools
        if not p.ok
    ]
    unreachable = {a.node: f"at {a.url}: {a.error}" for a in agents if not a.reachable}
    for replica in replicas:
        node = f"{replica.site}/{replica.node}"
        if not replica.agent_heard and node not in unreachable:
            unreachable[node] = "not heard by the balancer's agent checks"
    lines += [
        f"agent of {node} {why}: its GPU faults go unseen, its replicas are routed on health"
        " checks alone"
        for node, why in sorted(unreachable.items())
    ]
    return lines


async def _read_agent(client: httpx.AsyncClient, endpoint: AgentEndpoint) -> AgentHealth:
    try:
        response = await client.get(f"{endpoint.url}/healthz")
        response.raise_for_status()
        doc = response.json()
        replicas = {r["id"]: r for r in doc.get("replicas", [])}
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as error:
        return AgentHealth(endpoint.node, endpoint.url, False, _describe(error), {})
    return AgentHealth(endpoint.node, endpoint.url, True, "", replicas)


def _describe(error: Exception) -> str:
    if isinstance(error, httpx.TimeoutException):
        return "timed out"
    if isinstance(error, httpx.ConnectError):
        return "connection refused"
    return str(error) or type(error).__name__


async def _read_agents(endpoints: Sequence[AgentEndpoint], timeout_s: float) -> list[AgentHealth]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        return list(await asyncio.gather(*(_read_agent(client, e) for e in endpoints)))


def read_agents(
    endpoints: Sequence[AgentEndpoint], timeout_s: float = AGENT_TIMEOUT_S
) -> list[AgentHealth]:
    """Every agent's /healthz at once, so the whole read takes one timeout at most."""
    if not endpoints:
        return []
    # The overall deadline also bounds an agent that accepts but trickles its answer.
    deadline = timeout_s + 0.5
    try:
        return asyncio.run(asyncio.wait_for(_read_agents(endpoints, timeout_s), deadline))
    except TimeoutError:
        return [AgentHealth(e.node, e.url, False, "timed out", {}) for e in endpoints]


class StatsUnreadable(Exception):
    """A balancer's stats page could not be read; the message says why, in one line."""


def stats_url(endpoint: str) -> str:
    """The CSV stats page of a balancer's metrics address (`http://HOST:8405`)."""
    base = endpoint.rstrip("/").removesuffix(STATS_PATH)
    return f"{base}{STATS_PATH};csv"


def read_remote_stats(endpoint: str, timeout_s: float = STATS_TIMEOUT_S) -> list[dict[str, str]]:
    """Every `show stat` row, read over HTTP from a balancer's stats page."""
    url = stats_url(endpoint)
    try:
        response = httpx.get(url, timeout=timeout_s)
        response.raise_for_status()
        return parse_stats_rows(response.text)
    except httpx.HTTPStatusError as error:
        raise StatsUnreadable(f"{url}: HTTP {error.response.status_code}") from None
    except httpx.HTTPError as error:
        raise StatsUnreadable(f"{url}: {_describe(error)}") from None
    except (KeyError, csv.Error):
        raise StatsUnreadable(f"{url}: not HAProxy's stats CSV") from None
