"""Reject balancer inputs that HAProxy would refuse, misread, or that could inject config lines.

Every value interpolated into the config passes through here first, so the renderer can print
values verbatim without quoting.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from denv_iac.core.balancer.model import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
)
from denv_iac.core.stack.values import MODEL_NAME

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_HOSTNAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*"
)
_HEALTH_PATH = re.compile(r"/[A-Za-z0-9._~/%?&=+-]*")
_FILE_PATH = re.compile(r"[A-Za-z0-9._/+@,-]+")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


class BalancerConfigError(ValueError):
    """An input the balancer config cannot be rendered from; the message names field and fix."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        super().__init__(f"{field}: {problem}; {fix}")
        self.field = field


def validate_balancer_inputs(
    pools: Sequence[BalancerPool], settings: BalancerSettings, map_dir: str
) -> None:
    """Raise BalancerConfigError for the first input that cannot be rendered safely."""
    _check_settings(settings)
    _check_file_path("map_dir", map_dir)
    if not pools:
        raise BalancerConfigError("pools", "no pool given", "place at least one pool")
    pool_names: set[str] = set()
    replica_ids: set[str] = set()
    for p, pool in enumerate(pools):
        field = f"pools[{p}]"
        _check_name(f"{field}.name", pool.name)
        if pool.name in pool_names:
            raise BalancerConfigError(
                f"{field}.name", f"pool {pool.name!r} appears twice", "give each pool one entry"
            )
        pool_names.add(pool.name)
        _check_pool(field, pool, replica_ids)
    _check_model_names(pools)
    _check_key_scopes(pools, settings)
    _check_gateway_credentials(pools, settings)


def _check_key_scopes(pools: Sequence[BalancerPool], settings: BalancerSettings) -> None:
    """A scope is of a listed key, names served pools, and bounds something."""
    digests = {digest.lower() for digest in settings.api_key_digests}
    names = sorted(pool.name for pool in pools)
    seen: set[str] = set()
    for i, scope in enumerate(settings.key_scopes):
        field = f"settings.key_scopes[{i}]"
        key = scope.digest.lower()
        if key not in digests or key in seen:
            raise BalancerConfigError(
                f"{field}.digest",
                f"{scope.digest[:12]}... is not one of api_key_digests, or is scoped twice",
                "scope each listed key at most once",
            )
        seen.add(key)
        if scope.pools is None and scope.rate is None:
            raise BalancerConfigError(field, "limits nothing", "give pools, a rate, or both")
        if scope.pools is not None and not scope.pools:
            raise BalancerConfigError(
                f"{field}.pools", "is empty", "list the pools the key may use, or None for all"
            )
        for pool in scope.pools or ():
            if pool not in names:
                raise BalancerConfigError(
                    f"{field}.pools",
                    f"key {scope.digest[:12]}... may use pool {pool!r}, which is not served",
                    f"use one of {', '.join(names)}",
                )
        if scope.rate is not None and scope.rate < 1:
            raise BalancerConfigError(f"{field}.rate", f"{scope.rate} is not positive", "use >= 1")


def _check_gateway_credentials(pools: Sequence[BalancerPool], settings: BalancerSettings) -> None:
    """A replica behind a Kubernetes gateway is reached over mutual TLS: both files are needed."""
    behind = [s.replica_id for p in pools for t in p.tiers for s in t.servers if s.gateway]
    for name in ("gateway_ca_file", "gateway_client_cert"):
        if behind and getattr(settings, name) is None:
            raise BalancerConfigError(
                f"settings.{name}",
                f"missing, and replica {behind[0]!r} is reached through a gateway over TLS",
                "give the stack's gateway CA and the balancer's client certificate",
            )


def _check_model_names(pools: Sequence[BalancerPool]) -> None:
    """Each model name routes to one pool: a pool's own name or one of its aliases."""
    owner = {pool.name: pool.name for pool in pools}
    for p, pool in enumerate(pools):
        for m, model in enumerate(pool.models):
            field = f"pools[{p}].models[{m}]"
            if not MODEL_NAME.fullmatch(model):
                raise BalancerConfigError(
                    field,
                    f"{model!r} has characters a model name may not have",
                    "use letters, digits and . _ : / -",
                )
            if owner.setdefault(model, pool.name) != pool.name:
                raise BalancerConfigError(
                    field,
                    f"model {model!r} would route to pools {owner[model]!r} and {pool.name!r}",
                    "give each model name to one pool",
                )


def _check_settings(settings: BalancerSettings) -> None:
    _check_address("settings.bind_address", settings.bind_address)
    if settings.prometheus_address is not None:
        _check_address("settings.prometheus_address", settings.prometheus_address)
    _check_port("settings.port", settings.port)
    if settings.prometheus_port is not None:
        _check_port("settings.prometheus_port", settings.prometheus_port)
        if settings.prometheus_port == settings.port:
            raise BalancerConfigError(
                "settings.prometheus_port",
                f"{settings.prometheus_port} is also the endpoint port",
                "pick another port or None to disable the exporter",
            )
    _check_port("settings.agent_relay_port_base", settings.agent_relay_port_base)
    for name in (
        "tls_cert_path",
        "stats_socket",
        "state_file",
        "gateway_ca_file",
        "gateway_client_cert",
        "client_secret_key_file",
    ):
        value = getattr(settings, name)
        if value is not None:
            _check_file_path(f"settings.{name}", value)
    if settings.client_secret_key_file is not None and not settings.api_key_digests:
        raise BalancerConfigError(
            "settings.client_secret_key_file",
            "client secrets are minted for a key, and no API key is listed",
            "list api_key_digests, or leave client secrets off",
        )
    for i, digest in enumerate(settings.api_key_digests):
        if not _SHA256_HEX.fullmatch(digest):
            raise BalancerConfigError(
                f"settings.api_key_digests[{i}]",
                "is not a SHA-256 hex digest",
                "store hashlib.sha256(key.encode()).hexdigest(), never the key itself",
            )
    for name in (
        "agent_inter_ms",
        "check_inter_ms",
        "check_timeout_ms",
        "connect_timeout_ms",
        "stream_idle_timeout_s",
        "realtime_tunnel_timeout_s",
    ):
        value = getattr(settings, name)
        if value < 1:
            raise BalancerConfigError(f"settings.{name}", f"{value} is not positive", "use >= 1")


def _check_pool(field: str, pool: BalancerPool, replica_ids: set[str]) -> None:
    for name in ("first_token_timeout_ms", "stall_timeout_ms", "max_concurrency"):
        value = getattr(pool, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BalancerConfigError(
                f"{field}.{name}", f"{value!r} is not a positive whole number", "use >= 1"
            )
    budget = pool.queue_budget_ms
    if budget is not None and not 1 <= budget < pool.first_token_timeout_ms:
        raise BalancerConfigError(
            f"{field}.queue_budget_ms",
            f"{budget!r} is not between 1 and first_token_timeout_ms"
            f" ({pool.first_token_timeout_ms}), which also holds the replica's prefill",
            "give a smaller budget, or None for the default",
        )
    if not any(tier.servers for tier in pool.tiers):
        raise BalancerConfigError(
            f"{field}.tiers", f"pool {pool.name!r} has no server", "place at least one replica"
        )
    priorities: set[int] = set()
    sites_seen: set[str] = set()
    for t, tier in enumerate(pool.tiers):
        tier_field = f"{field}.tiers[{t}]"
        if tier.priority in priorities:
            raise BalancerConfigError(
                f"{tier_field}.priority",
                f"priority {tier.priority} is used twice in pool {pool.name!r}",
                "give each tier of a pool its own priority",
            )
        priorities.add(tier.priority)
        _check_tier(tier_field, tier, sites_seen, replica_ids)


def _check_tier(
    field: str, tier: BalancerTier, sites_seen: set[str], replica_ids: set[str]
) -> None:
    if tier.connect_timeout_ms is not None and tier.connect_timeout_ms < 1:
        raise BalancerConfigError(
            f"{field}.connect_timeout_ms",
            f"{tier.connect_timeout_ms} is not positive",
            "use >= 1, or None for the settings' value",
        )
    if not tier.sites:
        raise BalancerConfigError(f"{field}.sites", "no site listed", "list the tier's sites")
    for s, site in enumerate(tier.sites):
        _check_name(f"{field}.sites[{s}]", site)
        if site in sites_seen:
            raise BalancerConfigError(
                f"{field}.sites[{s}]",
                f"site {site!r} is in more than one tier of the pool",
                "list each site in one tier only",
            )
        sites_seen.add(site)
    health_paths = {server.health_path for server in tier.servers}
    if len(health_paths) > 1:
        raise BalancerConfigError(
            f"{field}.servers",
            f"servers disagree on the health path {sorted(health_paths)}",
            "one tier is one HAProxy backend with one health check; use one path",
        )
    for i, server in enumerate(tier.servers):
        _check_server(f"{field}.servers[{i}]", server, tier)
        if server.replica_id in replica_ids:
            raise BalancerConfigError(
                f"{field}.servers[{i}].replica_id",
                f"replica {server.replica_id!r} appears twice",
                "list each replica once, in one tier of one pool",
            )
        replica_ids.add(server.replica_id)


def _check_server(field: str, server: BalancerServer, tier: BalancerTier) -> None:
    _check_name(f"{field}.replica_id", server.replica_id)
    _check_name(f"{field}.site", server.site)
    _check_name(f"{field}.node", server.node)
    if server.site not in tier.sites:
        raise BalancerConfigError(
            f"{field}.site",
            f"site {server.site!r} is not one of the tier's sites {list(tier.sites)}",
            "add the site to the tier or move the replica to the tier listing its site",
        )
    _check_address(f"{field}.address", server.address)
    _check_port(f"{field}.port", server.port)
    _check_port(f"{field}.agent_port", server.agent_port)
    if not _HEALTH_PATH.fullmatch(server.health_path):
        raise BalancerConfigError(
            f"{field}.health_path",
            f"{server.health_path!r} is not a plain URL path",
            "start with '/' and use no spaces, quotes or '#'",
        )
    if server.gateway is not None and not _HOSTNAME.fullmatch(server.gateway):
        raise BalancerConfigError(
            f"{field}.gateway",
            f"{server.gateway!r} is not a host name",
            "give the name in the gateway's certificate, e.g. gateway.k8s.denv.internal",
        )


def _check_name(field: str, value: str) -> None:
    if not _NAME.fullmatch(value):
        raise BalancerConfigError(
            field,
            f"{value!r} is empty or has characters HAProxy cannot take in a name",
            "use only letters, digits, '.', '_' and '-'",
        )


def _check_port(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise BalancerConfigError(field, f"{value!r} is not a TCP port", "use 1-65535")


def _check_address(field: str, value: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not _HOSTNAME.fullmatch(value):
            raise BalancerConfigError(
                field, f"{value!r} is neither an IP address nor a host name", "fix the address"
            ) from None


def _check_file_path(field: str, value: str) -> None:
    if not _FILE_PATH.fullmatch(value):
        raise BalancerConfigError(
            field,
            f"{value!r} is empty or has spaces, quotes or other characters HAProxy would misread",
            "use a plain path of letters, digits and ./_-+@,",
        )
