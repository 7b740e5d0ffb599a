"""The map files beside haproxy.cfg: model names and aliases to pools, API key digests to
their scopes, and key digests to their rates; and where the config finds them.

Pure: their names and text.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from denv_iac.core.balancer.key_scopes import ALL_POOLS, key_rates, scope_of, scopes
from denv_iac.core.balancer.model import BalancerPool, BalancerSettings

POOLS_MAP = "pools.map"
API_KEYS_MAP = "api_keys.map"
KEY_RATES_MAP = "key_rates.map"


class MapPaths:
    """Where haproxy.cfg finds each map file: in the map folder."""

    def __init__(self, map_dir: str) -> None:
        self.pools = posixpath.join(map_dir, POOLS_MAP)
        self.api_keys = posixpath.join(map_dir, API_KEYS_MAP)
        self.key_rates = posixpath.join(map_dir, KEY_RATES_MAP)


def pools_map(pools: Sequence[BalancerPool]) -> str:
    lines = ["# model field or X-Denv-Pool header -> pool"]
    lines += sorted(f"{name} {pool.name}" for pool in pools for name in {pool.name, *pool.models})
    return "\n".join(lines) + "\n"


def api_keys_map(settings: BalancerSettings) -> str:
    lines = [f"# SHA-256 of an API key (lowercase hex) -> its pools, or {ALL_POOLS} for every pool"]
    lines += [f"{digest} {scope_of(scope)}" for digest, scope in sorted(scopes(settings).items())]
    return "\n".join(lines) + "\n"


def key_rates_map(settings: BalancerSettings) -> str:
    lines = ["# SHA-256 of an API key (lowercase hex) -> requests a second it may send"]
    lines += [f"{digest} {rate}" for digest, rate in sorted(key_rates(settings).items())]
    return "\n".join(lines) + "\n"
