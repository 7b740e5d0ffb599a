"""Reading a stack's `denv:balancer`: its sites and port, the API keys' digests with their
scopes and rates, TLS and client-secret keys, DNS, the overlay, and the balancer's timers.
"""

import re
from collections.abc import Mapping

from denv_iac.core.stack.fields import SECRET_HOW, Fields, describe, is_secret
from denv_iac.core.stack.model import (
    BalancerSpec,
    BalancerTimers,
    DnsSpec,
    KeyScope,
    OverlaySpec,
)
from denv_iac.core.stack.overlay_reader import read_overlay
from denv_iac.core.stack.values import (
    HOST_NAME,
    HOST_RULE,
)

DIGEST = re.compile(r"^[0-9a-f]{64}$")
_CLIENT_SECRET_HOW = (
    "set 32 or more random characters with 'pulumi config set --secret'"
    " (e.g. from `openssl rand -base64 32`; see docs/balancer.md)"
)


def read_balancer(f: Fields) -> BalancerSpec:
    sites = f.text_list("sites", required=True)
    if f.has("sites") and f.raw["sites"] == []:
        f.problem("sites", "is empty; name the site or sites that run the balancer")
    digests, key_scopes = _read_api_keys(f)
    dns_fields = f.child("dns")
    dns = None
    if dns_fields is not None:
        dns = DnsSpec(
            dns_fields.text("zone_id", example="Z0123456789ABC"),
            dns_fields.text("name", example="llm.example.com"),
            dns_fields.integer("ttl", 30, 5, 86400),
        )
        if dns.name and not HOST_NAME.fullmatch(dns.name):
            dns_fields.problem("name", f'"{dns.name}" is not a DNS name; {HOST_RULE}')
        dns_fields.finish()
    overlay_fields = f.child("overlay")
    overlay = read_overlay(overlay_fields) if overlay_fields is not None else OverlaySpec()
    timers_fields = f.child("timers")
    timers = _read_timers(timers_fields) if timers_fields is not None else BalancerTimers()
    balancer = BalancerSpec(
        sites=sites,
        port=f.integer("port", 8080, 1, 65535),
        api_key_digests=digests,
        key_scopes=key_scopes,
        tls_certificate=f.secret("tls_certificate", required=False, how=SECRET_HOW),
        client_secret_key=f.secret("client_secret_key", required=False, how=_CLIENT_SECRET_HOW),
        prometheus_port=f.integer("prometheus_port", 8405, 1, 65535),
        dns=dns,
        overlay=overlay,
        timers=timers,
    )
    if balancer.client_secret_key is not None and not balancer.api_key_digests:
        f.problem(
            "client_secret_key",
            "client secrets are minted with an API key and none is listed;"
            " add api_key_digests (see `denv key digest`) or remove client_secret_key",
        )
    if balancer.port == balancer.prometheus_port:
        f.problem("prometheus_port", f"{balancer.port} is also the endpoint port; pick another")
    f.finish()
    return balancer


def _read_api_keys(f: Fields) -> tuple[tuple[str, ...], tuple[KeyScope, ...]]:
    """`api_key_digests`: each entry a key's digest (the key may use every pool), or a mapping
    of its `digest`, the `pools` it may use and the `rate` it may send (requests a second)."""
    raw = f.raw.get("api_key_digests")
    f.known.add("api_key_digests")
    entries = (
        [(f.at("api_key_digests"), raw)]
        if isinstance(raw, str)
        else list(f.items("api_key_digests", required=False))
    )
    digests: list[str] = []
    scopes: list[KeyScope] = []
    for path, entry in entries:
        if isinstance(entry, Mapping) and not is_secret(entry):
            scope = _read_key_scope(Fields(f.problems, path, entry))
            digest = scope.digest
            if scope.pools is not None or scope.rate is not None:
                scopes.append(scope)
        elif isinstance(entry, str) and entry.strip():
            digest = entry if f.one_line("api_key_digests", entry) else ""
        else:
            f.problems.add(
                path,
                f"expected a key's digest, or a mapping of digest, pools and rate, got"
                f" {describe(entry)}",
            )
            continue
        if digest and digest in digests:
            f.problems.add(path, f"key {digest[:12]}... is listed twice; give each key one entry")
        digests.append(digest)
    if any(digest and not DIGEST.fullmatch(digest) for digest in digests):
        f.problem(
            "api_key_digests",
            "entries must be SHA-256 hex digests (64 lower-case hex "
            "characters); compute one with `denv key digest`",
        )
    return tuple(digest for digest in digests if digest), tuple(scopes)


def _read_key_scope(f: Fields) -> KeyScope:
    digest = f.text("digest", example="<output of `denv key digest`>")
    f.known.update(("pools", "rate"))  # both may be left out
    pools = f.text_list("pools") if f.has("pools") else None
    if f.raw.get("pools", ()) in ([], None):
        f.problem("pools", "is empty; list the recipes this key may use, or leave pools out")
    rate = f.integer("rate", 0, 1, 1_000_000) if f.has("rate") else None
    f.finish()
    return KeyScope(digest, pools or None, rate or None)


def _read_timers(f: Fields) -> BalancerTimers:
    """The balancer's timers: each from 1 ms to a minute; a check's timeout within its
    interval, since a check still waiting when the next is due delays the verdict."""
    default = BalancerTimers()
    timers = BalancerTimers(
        connect_timeout_ms=f.integer("connect_timeout_ms", default.connect_timeout_ms, 1, 60000),
        check_timeout_ms=f.integer("check_timeout_ms", default.check_timeout_ms, 1, 60000),
        check_inter_ms=f.integer("check_inter_ms", default.check_inter_ms, 10, 60000),
        agent_inter_ms=f.integer("agent_inter_ms", default.agent_inter_ms, 10, 60000),
    )
    if timers.check_timeout_ms > timers.check_inter_ms:
        f.problem(
            "check_timeout_ms",
            f"{timers.check_timeout_ms} exceeds check_inter_ms ({timers.check_inter_ms}); a"
            " check would still wait when the next is due: lower it or raise check_inter_ms",
        )
    f.finish()
    return timers
