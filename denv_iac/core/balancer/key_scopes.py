"""Which pools each API key may use, and how many requests a second it may send: the scopes
of the listed keys, as api_keys.map gives them and the frontend's acls test them.

Pure.
"""

from __future__ import annotations

from denv_iac.core.balancer.model import BalancerSettings
from denv_iac.core.stack.model import KeyScope

# A key's scope as api_keys.map gives it: this for every pool, else its pools joined by commas
# (pool names have none).
ALL_POOLS = "*"


def scope_of(scope: KeyScope) -> str:
    """A key's scope as api_keys.map gives it."""
    return ALL_POOLS if scope.pools is None else ",".join(sorted(set(scope.pools)))


def scopes(settings: BalancerSettings) -> dict[str, KeyScope]:
    """Each listed key's scope, by its lower-case digest; a key without one has every pool."""
    scoped = {scope.digest.lower(): scope for scope in settings.key_scopes}
    return {
        digest.lower(): scoped.get(digest.lower(), KeyScope(digest.lower()))
        for digest in settings.api_key_digests
    }


def pool_scopes(settings: BalancerSettings) -> list[tuple[str, ...]]:
    """The distinct sets of pools keys are limited to, sorted."""
    found = {scope_of(scope) for scope in scopes(settings).values()} - {ALL_POOLS}
    return [tuple(scope.split(",")) for scope in sorted(found)]


def scope_acl(pools: tuple[str, ...]) -> str:
    return f"{{ var(txn.key_scope) -m str {','.join(pools)} }}"


def key_rates(settings: BalancerSettings) -> dict[str, int]:
    return {
        digest: scope.rate for digest, scope in scopes(settings).items() if scope.rate is not None
    }
