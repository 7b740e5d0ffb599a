"""The endpoint frontend's authentication: the API key (a 401 when unknown), its rate (a 429),
the refusal of pools outside its scope, and client secrets for realtime sessions (checked when
offered, minted at `POST /v1/realtime/client_secrets`).

Pure: the rules, their error bodies, and the stick table that counts each key's rate.
"""

from __future__ import annotations

from collections.abc import Sequence

from denv_iac.core.balancer import client_secrets as ek
from denv_iac.core.balancer.api_surface import REALTIME_PATH, RETRY_AFTER_HEADER, error_unknown_pool
from denv_iac.core.balancer.key_scopes import ALL_POOLS, key_rates, pool_scopes, scope_acl
from denv_iac.core.balancer.maps import MapPaths
from denv_iac.core.balancer.model import BalancerSettings
from denv_iac.core.balancer.sections import config_word, section

KEY_RATES_TABLE = "denv.key-rates"
_ERROR_UNAUTHORIZED = (
    '{"error":{"type":"authentication_error","code":"invalid_api_key",'
    '"message":"missing or unknown API key: send Authorization: Bearer <key>"}}'
)
ERROR_CLIENT_SECRET = (
    '{"error":{"type":"authentication_error","code":"invalid_api_key",'
    '"message":"the client secret is malformed, tampered, expired or for another pool:'
    f' mint a new one at POST {ek.CLIENT_SECRETS_PATH}"}}}}'
)
_ERROR_CLIENT_SECRET_TTL = (
    '{"error":{"type":"invalid_request_error","code":"invalid_value",'
    f'"message":"expires_after.seconds must be a whole number from {ek.MIN_TTL_S}'
    f' to {ek.MAX_TTL_S}"}}}}'
)
# The minted secret, shaped as OpenAI's answer (lf-string: the pool is validated JSON-safe).
_CLIENT_SECRET_ANSWER = (
    f'{{"value":"{ek.SECRET_PREFIX}%[var(txn.ek_signed)].%[var(txn.ek_want)]",'
    '"expires_at":%[var(txn.ek_exp)],'
    f'"session":{{"type":"{ek.REALTIME_SUBPROTOCOL}","model":"%[var(txn.ek_pool)]"}}}}'
)
# A client secret among the offered subprotocols: pool, expiry and signature, one group each.
# No comma in it (converter arguments split there): \x2c is one.
CLIENT_SECRET_OFFERED = (
    r"^(?:.*[\s\x2c])?"
    + ek.SUBPROTOCOL_KEY_PREFIX.replace(".", r"\.")
    + ek.SECRET_PREFIX
    + r"([A-Za-z0-9._-]+)\.([0-9]+)\.([0-9a-f]{64})(?:[\s\x2c].*)?$"
)
_ERROR_RATE = (
    '{"error":{"type":"requests","code":"rate_limit_exceeded","message":"this key sent more than'
    ' %[var(txn.key_rate)] requests in the last second; retry after Retry-After seconds"}}'
)


def key_check(settings: BalancerSettings, maps: MapPaths, served: Sequence[str]) -> list[str]:
    """The API key: listed, or a 401 (a realtime session may instead offer a client secret);
    then its rate, when it has one; then client secrets minted for it (of the `served`
    pools)."""
    key_file = settings.client_secret_key_file
    lines = [
        "# API keys are stored as SHA-256 digests; the bearer token's digest must be listed. Its",
        "# value is the key's scope: the pools it may use, joined by commas, or"
        f" {ALL_POOLS} for all.",
        "http-request set-var(txn.key) http_auth_bearer,sha2(256),hex,lower",
        f"http-request set-var(txn.key_scope) var(txn.key),map({maps.api_keys})",
        *(_client_secret_check(key_file) if key_file is not None else []),
        "http-request return status 401 content-type application/json"
        f" string '{_ERROR_UNAUTHORIZED}' hdr WWW-Authenticate Bearer"
        " unless { var(txn.key_scope) -m found }"
        + (" || { var(txn.ek_session) -m found }" if key_file is not None else ""),
        "# The endpoint key is ours: replicas never see it, nor a key or secret offered as a",
        f"# WebSocket subprotocol ({ek.SUBPROTOCOL_KEY_PREFIX}<key>): they are offered"
        f" {ek.REALTIME_SUBPROTOCOL} alone.",
        "http-request del-header Authorization",
        f"http-request set-header Sec-WebSocket-Protocol {ek.REALTIME_SUBPROTOCOL}"
        f" if {{ req.fhdr(Sec-WebSocket-Protocol) -m sub -i {ek.SUBPROTOCOL_KEY_PREFIX} }}",
    ]
    if key_rates(settings):
        lines += [
            "# A key with a rate: its requests of the last second on this host, counted by",
            "# digest; past its rate, a 429 before anything else is read.",
            f"http-request set-var(txn.key_rate) var(txn.key),map_str_int({maps.key_rates})",
            f"http-request track-sc0 var(txn.key) table {KEY_RATES_TABLE}"
            " if { var(txn.key_rate) -m found }",
            "http-request return status 429 content-type application/json"
            f" lf-string '{_ERROR_RATE}' {RETRY_AFTER_HEADER} if {{ var(txn.key_rate) -m found }}"
            " { sc_http_req_rate(0),sub(txn.key_rate) gt 0 }",
        ]
    if key_file is not None:
        lines += _client_secret_mint(settings, maps, served)
    return lines


# A session offered a client secret and no API key; and a request to mint one.
_EK_SESSION = "METH_GET ek:realtime ek:offered !{ var(txn.key_scope) -m found }"
MINT_REQUEST = "METH_POST api:client_secrets"


def _client_secret_check(key_file: str) -> list[str]:
    """A realtime session without an API key may offer a client secret as a subprotocol: its
    signature and expiry are checked here (a 401 when wrong), its pool once the pool is known."""
    offered = "var(txn.ek_source),regsub('" + CLIENT_SECRET_OFFERED + "','{}')"
    parts = {"ek_claim": r"\1", "ek_exp": r"\2", "ek_mac": r"\3", "ek_signed": r"\1.\2"}
    extract = {name: config_word(offered.replace("{}", group)) for name, group in parts.items()}
    return [
        "# Client secrets (docs/balancer.md): a browser opens a realtime session offering the",
        f"# subprotocols {ek.REALTIME_SUBPROTOCOL} and {ek.SUBPROTOCOL_KEY_PREFIX}"
        f"{ek.SECRET_PREFIX}<pool>.<expires_at>.<mac>, the mac an",
        "# HMAC-SHA256 of <pool>.<expires_at> under the key in the key file (never in this file).",
        "# A client that can send a header (a native app, the OpenAI SDKs) may instead send the",
        "# secret as its bearer token, on this path alone.",
        f"acl ek:realtime path {REALTIME_PATH}",
        "http-request set-var(txn.ek_source) req.fhdr(Sec-WebSocket-Protocol)"
        " if METH_GET ek:realtime",
        "http-request set-var(txn.ek_bearer) http_auth_bearer"
        f" if METH_GET ek:realtime {{ http_auth_bearer -m beg {ek.SECRET_PREFIX} }}",
        f"http-request set-var(txn.ek_source) str({ek.SUBPROTOCOL_KEY_PREFIX})"
        ",concat(,txn.ek_bearer,) if { var(txn.ek_bearer) -m found }",
        f"acl ek:offered var(txn.ek_source) -m reg {config_word(CLIENT_SECRET_OFFERED)}",
        f"http-request set-var(txn.ek_key) str({ek.KEY_MAP_ENTRY}),map({key_file})"
        f" if {_EK_SESSION} || {MINT_REQUEST}",
        *(
            f"http-request set-var(txn.{name}) {word} if {_EK_SESSION}"
            for name, word in extract.items()
        ),
        "http-request set-var(txn.ek_want)"
        f" var(txn.ek_signed),hmac(sha256,txn.ek_key),hex,lower if {_EK_SESSION}",
        f"http-request set-var(txn.ek_left) date,neg,add(txn.ek_exp) if {_EK_SESSION}",
        "http-request return status 401 content-type application/json"
        f" string '{ERROR_CLIENT_SECRET}' if {_EK_SESSION}"
        " !{ var(txn.ek_want),secure_memcmp(txn.ek_mac) }"
        f" || {_EK_SESSION} !{{ var(txn.ek_left) -m int gt 0 }}",
        f"http-request set-var(txn.ek_session) var(txn.ek_claim) if {_EK_SESSION}",
    ]


def _client_secret_mint(
    settings: BalancerSettings, maps: MapPaths, served: Sequence[str]
) -> list[str]:
    """`POST /v1/realtime/client_secrets` with an API key: a secret for the pool of
    `session.model`, if the key's scope has it, valid for `expires_after.seconds`. A key
    limited to some pools is refused first, so its 404 names only those."""
    ttl = f"^[0-9]{{1,{len(str(ek.MAX_TTL_S))}}}$"
    session_pool = f"req.body,json_query('$.session.model'),map({maps.pools})"
    ttl_given = "req.body,json_query('$.expires_after.seconds')"
    return [
        f"# {ek.CLIENT_SECRETS_PATH}: a client secret for a pool of the key's scope, as OpenAI's",
        f"# answer; it expires after expires_after.seconds ({ek.MIN_TTL_S}-{ek.MAX_TTL_S},"
        f" default {ek.DEFAULT_TTL_S}).",
        f"http-request set-var(txn.ek_pool) {config_word(session_pool)} if {MINT_REQUEST}",
        *scope_refusals(settings, "txn.ek_pool", MINT_REQUEST),
        "http-request return status 404 content-type application/json"
        f" string '{error_unknown_pool(served)}'"
        f" if {MINT_REQUEST} !{{ var(txn.ek_pool) -m found }}",
        f"http-request set-var(txn.ek_ttl) int({ek.DEFAULT_TTL_S}) if {MINT_REQUEST}",
        f"http-request set-var(txn.ek_ttl) {config_word(ttl_given)} if {MINT_REQUEST}",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_CLIENT_SECRET_TTL}'"
        f" if {MINT_REQUEST} !{{ var(txn.ek_ttl) -m reg {config_word(ttl)} }}"
        f" || {MINT_REQUEST} !{{ var(txn.ek_ttl) -m int {ek.MIN_TTL_S}:{ek.MAX_TTL_S} }}",
        f"http-request set-var(txn.ek_exp) date,add(txn.ek_ttl) if {MINT_REQUEST}",
        "http-request set-var(txn.ek_signed) var(txn.ek_pool),concat(.,txn.ek_exp,)"
        f" if {MINT_REQUEST}",
        "http-request set-var(txn.ek_want)"
        f" var(txn.ek_signed),hmac(sha256,txn.ek_key),hex,lower if {MINT_REQUEST}",
        "http-request return status 200 content-type application/json"
        f" lf-string '{_CLIENT_SECRET_ANSWER}' hdr Cache-Control no-store if {MINT_REQUEST}",
    ]


def scope_refusals(settings: BalancerSettings, pool_var: str, condition: str = "") -> list[str]:
    """A key limited to some pools is answered for another as for a pool that does not exist."""
    prefix = f"{condition} " if condition else ""
    return [
        "http-request return status 404 content-type application/json"
        f" string '{error_unknown_pool(scope)}' if {prefix}{scope_acl(scope)}"
        f" !{{ var({pool_var}) -m str {' '.join(scope)} }}"
        for scope in pool_scopes(settings)
    ]


def key_rates_backend() -> str:
    return section(
        f"backend {KEY_RATES_TABLE}",
        ["Requests of the last second of each key that has a rate, by the key's digest."],
        ["stick-table type string len 64 size 100k expire 10s store http_req_rate(1s)"],
    )
