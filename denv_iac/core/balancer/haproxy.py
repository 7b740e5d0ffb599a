"""Render the HAProxy configuration of the endpoint from placed pools.

Pure: the same pools and settings always give byte-identical text. Order is kept where it
carries meaning (tiers, rule order) and sorted everywhere else (pools, servers, sites, keys).
"""

from __future__ import annotations

import math
import posixpath
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from denv_iac.core.balancer import client_secrets as ek
from denv_iac.core.balancer.model import (
    SERVER_WEIGHT,
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    RenderedConfig,
)
from denv_iac.core.balancer.sections import (
    LOG_STDOUT,
    TLS_MIN_VERSION,
    agent_send,
    duration,
    header,
    host_port,
    section,
)
from denv_iac.core.balancer.validation import BalancerConfigError, validate_balancer_inputs
from denv_iac.core.stack.model import KeyScope

POOLS_MAP = "pools.map"
API_KEYS_MAP = "api_keys.map"
KEY_RATES_MAP = "key_rates.map"
KEY_RATES_TABLE = "denv.key-rates"
# A key's scope as api_keys.map gives it: this for every pool, else its pools joined by commas
# (pool names have none).
ALL_POOLS = "*"
NO_REPLICA_BACKEND = "denv.no-healthy-replica"
ENDPOINT_FRONTEND = "denv.endpoint"
PROMETHEUS_FRONTEND = "denv.prometheus"
STATS_PATH = "/stats"

# Routing on the `model` field reads the body from one buffer; 64 KiB holds typical chat
# requests whole, so they can also be retried (a request larger than the buffer never is).
_BUFSIZE = 65536

_ERROR_UNAUTHORIZED = (
    '{"error":{"type":"authentication_error","code":"invalid_api_key",'
    '"message":"missing or unknown API key: send Authorization: Bearer <key>"}}'
)
_ERROR_CLIENT_SECRET = (
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
_CLIENT_SECRET_OFFERED = (
    r"^(?:.*[\s\x2c])?"
    + ek.SUBPROTOCOL_KEY_PREFIX.replace(".", r"\.")
    + ek.SECRET_PREFIX
    + r"([A-Za-z0-9._-]+)\.([0-9]+)\.([0-9a-f]{64})(?:[\s\x2c].*)?$"
)
_ERROR_RATE = (
    '{"error":{"type":"requests","code":"rate_limit_exceeded","message":"this key sent more than'
    ' %[var(txn.key_rate)] requests in the last second; retry after Retry-After seconds"}}'
)


def _error_unknown_pool(served: Iterable[str]) -> str:
    """The 404 of a pool not served (to the key that asks): it names those that are."""
    return (
        '{"error":{"type":"invalid_request_error","code":"model_not_found",'
        '"message":"unknown pool: set the model field or the X-Denv-Pool header to a served pool:'
        f' {", ".join(sorted(served))}"}}}}'
    )


_ERROR_BODY_TOO_LARGE = (
    '{"error":{"type":"invalid_request_error","code":"body_too_large_to_route",'
    '"message":"the model field is not within the first 64 KiB of the body:'
    ' send the X-Denv-Pool header to name the pool"}}'
)
_ERROR_CONTROL_BYTE = (
    '{"error":{"type":"invalid_request_error","code":"invalid_header",'
    '"message":"a header holds a control character (NUL, ESC, DEL, ...): send printable text"}}'
)
# HAProxy's regex matching ends at the first NUL byte, so the headers are matched as hex, where
# a byte is two digits from an even offset. The hex converter writes into one buffer of
# tune.bufsize and silently stops when it is full: the headers (at most one buffer) are read
# in pieces whose hex fits.
_HEX_PIECE = _BUFSIZE * 3 // 8
# Possessive, so that the match never backtracks: every printable byte (or tab, CR, LF) is
# consumed, and the next byte, if any, is a control character.
_CONTROL_BYTE_HEX = "^(?:[2-689A-F].|7[0-9A-E]|0[9AD])*+(?:0|1|7F)"
_ERROR_NOT_JSON = (
    '{"error":{"type":"invalid_request_error","code":"invalid_json",'
    '"message":"the body is not a JSON object: send JSON, or multipart for audio uploads"}}'
)
_ERROR_AMBIGUOUS_MODEL = (
    '{"error":{"type":"invalid_request_error","code":"ambiguous_model",'
    '"message":"the body has more than one model key, or one spelled with \\\\u escapes:'
    ' send model once, spelled plainly, or send the X-Denv-Pool header"}}'
)
# A key `model` of a JSON body, in every spelling a JSON parser reads as "model": each letter
# plain or as a \u escape (JSON has no other escape for a letter). The quotes are raw, so
# the match is a key, never text inside a string (where a quote is escaped), and the `{` or
# `,` before it keeps a string's closing quote from starting a match. Keys at any depth count:
# a regex cannot tell the top level from a nested object.
_MODEL_KEY = (
    r'[{,][[:space:]]*"(?:m|\\u006[dD])(?:o|\\u006[fF])(?:d|\\u0064)(?:e|\\u0065)'
    r'(?:l|\\u006[cC])"[[:space:]]*:'
)
_MODEL_KEY_TWICE = f"{_MODEL_KEY}[\\s\\S]*?{_MODEL_KEY}"
# The same key with an escape: the balancer's json_query reads it otherwise than a replica.
_MODEL_KEY_ESCAPED = _MODEL_KEY.replace('"(?:m', '"(?=[^"]*\\\\)(?:m', 1)
_ERROR_NO_MODEL_PART = (
    '{"error":{"type":"invalid_request_error","code":"missing_model",'
    '"message":"no model field before the file in the multipart body:'
    ' send the model field first, or the X-Denv-Pool header"}}'
)
# The `model` part of a multipart upload (transcriptions, translations): HAProxy 2.6 has no
# multipart parser, so a regex over the buffered body takes the value of the part named model.
# HAProxy's regex matching ends at the first NUL byte, and audio has NUL bytes: the model part
# has to come before the file, as the openai SDK, httpx, requests and curl -F send it.
_MULTIPART_MODEL = (
    r'^[\s\S]*?\r\n(?i:content-disposition): *form-data; *name="?model"?\r\n'
    r"(?:[^\r\n]+\r\n)*\r\n([^\r\n]*)\r\n[\s\S]*"
)
_ERROR_NO_SUCH_ENDPOINT = (
    '{"error":{"type":"invalid_request_error","code":"not_found",'
    '"message":"no such endpoint: the endpoint serves POST /v1/chat/completions, /v1/completions,'
    ' /v1/embeddings, /v1/audio/*, GET /v1/realtime, /v1/models and /health"}}'
)
# The endpoint's API surface, decided here alone: what it forwards to a pool's replicas, by
# method. Everything else is answered by the balancer and never forwarded: a replica's own
# control, metrics and admin paths are not the public's.
# What a route is decides its silence budget (see _silence_budget), never a body field a
# client may leave out: a JSON answer comes whole unless its body asks for a stream; speech
# always streams; a transcription comes whole, at the end; a realtime session is a tunnel.
JSON_ANSWER_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
SPEECH_PATH = "/v1/audio/speech"
TRANSCRIPTION_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
REALTIME_PATH = "/v1/realtime"
API_ROUTES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("POST", (*JSON_ANSWER_PATHS, SPEECH_PATH, *TRANSCRIPTION_PATHS)),
    ("GET", (REALTIME_PATH,)),
)


@dataclass(frozen=True)
class _Twin:
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


_TWINS = (
    _Twin(".realtime", "realtime", REALTIME_PATH, "realtime sessions", bounded=False),
    _Twin(".speech", "speech", SPEECH_PATH, "speech streams", bounded=True),
)
# The twins' rows in HAProxy's stats repeat their tier's servers.
TWIN_SUFFIXES = tuple(twin.suffix for twin in _TWINS)
# The twins whose requests take replica slots, as the tier backend's do.
BOUNDED_TWIN_SUFFIXES = tuple(twin.suffix for twin in _TWINS if twin.bounded)
# How long an old worker keeps its sessions after a reload: a voice call of up to an hour
# (OpenAI caps a realtime session at 60 min) finishes on the worker it started on.
_HARD_STOP_AFTER = "1h"
HEALTH_PATH = "/health"
_HEALTH_OK = '{"status":"ok"}'
_HEALTH_UNAVAILABLE = '{"status":"unavailable","message":"a pool has no healthy replica"}'
MODELS_PATH = "/v1/models"
# HAProxy builds a `return` answer in one buffer of tune.bufsize, less the room it keeps for
# header rewrites (tune.maxrewrite, 1 KiB): a longer body came back empty with a 200, or as a
# 500. The model list stays below this, leaving room for the answer's own headers.
MODELS_LIST_LIMIT = 60 * 1024
REQUEST_ID_HEADER = "X-Request-Id"
# A client's own request id is kept when it is one header of at most this many characters, each
# a letter, a digit or one of . _ : / + = -; any other is replaced by a fresh one, as a missing
# one is made. It goes into a log line, the replica's log and every answer: a long or odd one
# would bloat or break them.
REQUEST_ID_MAX = 128
_REQUEST_ID = f"^[A-Za-z0-9._:/+=-]{{1,{REQUEST_ID_MAX}}}$"
# Every 503 of the endpoint tells the client when to try again; the OpenAI SDKs and most HTTP
# clients honour it. One second: a voice turn frees a slot within about that.
RETRY_AFTER_S = 1
_RETRY_AFTER = f"hdr Retry-After {RETRY_AFTER_S}"
# The code of HAProxy's own 503: a tier backend sets it to pool_full when a request has to wait
# for a free slot, so a 503 after that wait (timeout queue) says the pool was full.
_UNAVAILABLE_CODE = "txn.unavailable"
# The requests ahead of one that found every slot of its tier taken, itself included, times
# 1000 (compared with the requests the tier started in the last second times the budget in ms).
_AHEAD = "txn.ahead"
POOL_FULL = "pool_full"
NO_HEALTHY_REPLICA = "no_healthy_replica"
# HAProxy's own error pages, as JSON like every other answer of the endpoint; bodies with %[
# are lf-strings, filled in when sent.
_HAPROXY_ERRORS = {
    502: '{"error":{"type":"service_unavailable","code":"bad_gateway",'
    '"message":"the replica failed before its answer started; retry"}}',
    503: '{"error":{"type":"service_unavailable",'
    f'"code":"%[var({_UNAVAILABLE_CODE},{NO_HEALTHY_REPLICA})]",'
    '"message":"no replica could take the request in time; retry after Retry-After seconds"}}',
    504: '{"error":{"type":"timeout","code":"replica_timeout",'
    '"message":"the replica did not answer in time; retry"}}',
}
# lf-string: the pool name is validated to JSON-safe characters before it gets here.
_ERROR_NO_REPLICA = (
    f'{{"error":{{"type":"service_unavailable","code":"{NO_HEALTHY_REPLICA}",'
    '"message":"no healthy replica in any allowed site of pool %[var(txn.pool)]"}}'
)
# Bounded-load consistent hashing: a conversation's replica is passed over for the next on the
# ring once it serves more than the tier's average load (HAProxy's lowest factor, 101), so one
# hot conversation cannot pile requests onto one replica while others idle, and a turn rarely
# waits on its full replica while another has a free slot: with the short queue budget such a
# wait ends in a 503. Measured at 0.9x of a pool's capacity with an equal fallback tier: with
# 150, 94.4 % of turns had their first token in budget; with 101, 98.4-98.7 %.
HASH_BALANCE_FACTOR = 101

_MAX_SERVER_ID = 2**31 - 1
_MAX_PORT = 65535
# Where the agent relays listen: this host only.
_RELAY_ADDRESS = "127.0.0.1"


def render_haproxy_config(
    pools: Sequence[BalancerPool], settings: BalancerSettings, map_dir: str
) -> RenderedConfig:
    """Render haproxy.cfg and its map files; map files are referenced under `map_dir`.

    Raises BalancerConfigError (a ValueError) naming the offending field.
    """
    validate_balancer_inputs(pools, settings, map_dir)
    error = _models_list_error(name for pool in pools for name in (pool.name, *pool.models))
    if error is not None:
        raise error
    ordered = sorted(pools, key=lambda pool: pool.name)
    maps = _MapPaths(map_dir)
    relays = agent_relays(ordered, settings)
    sections = [
        _header(),
        _global_section(settings),
        _defaults_section(settings),
        *([_prometheus_frontend(settings)] if settings.prometheus_port is not None else []),
        _endpoint_frontend(ordered, settings, maps),
        *(_tier_backend(pool, tier, settings, relays) for pool in ordered for tier in pool.tiers),
        *(
            _twin_backend(pool, tier, settings, twin)
            for twin in _TWINS
            for pool in ordered
            for tier in pool.tiers
        ),
        _no_replica_backend(),
        *([_key_rates_backend()] if _key_rates(settings) else []),
        *_agent_relay_sections(relays, settings),
    ]
    files = {POOLS_MAP: _pools_map(ordered)}
    if settings.api_key_digests:
        files[API_KEYS_MAP] = _api_keys_map(settings)
    if _key_rates(settings):
        files[KEY_RATES_MAP] = _key_rates_map(settings)
    return RenderedConfig(haproxy_cfg="\n".join(sections), files=files, map_dir=map_dir)


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


class _MapPaths:
    def __init__(self, map_dir: str) -> None:
        self.pools = posixpath.join(map_dir, POOLS_MAP)
        self.api_keys = posixpath.join(map_dir, API_KEYS_MAP)
        self.key_rates = posixpath.join(map_dir, KEY_RATES_MAP)


def _header() -> str:
    comments = header("endpoint", "the pools or balancer settings")
    return "".join(f"# {comment}\n" for comment in comments)


def _global_section(settings: BalancerSettings) -> str:
    lines = [
        LOG_STDOUT,
        f"stats socket {settings.stats_socket} mode 600 level admin expose-fd listeners",
    ]
    if settings.state_file is not None:
        lines.append(f"server-state-file {settings.state_file}")
    lines.append(f"tune.bufsize {_BUFSIZE}")
    lines += [
        "# After a reload the old worker serves its open sessions until they end, or this long.",
        f"hard-stop-after {_HARD_STOP_AFTER}",
    ]
    return section("global", [], lines)


def _defaults_section(settings: BalancerSettings) -> str:
    idle = f"{settings.stream_idle_timeout_s}s"
    lines = [
        "mode http",
        "log global",
        "# Send each streamed token as soon as it arrives: without this a small SSE chunk waits",
        "# for more data, and the first token reaches the client only with the second.",
        "option http-no-delay",
        "# Retry only failures that happen before any response byte reaches the client, each",
        "# time on another replica; a stream that has started is never replayed. A replica's",
        "# own 503 is one too: an engine restarting answers it while it loads its model",
        "# (llama.cpp's `Loading model`) before the health checks have seen it go.",
        "retries 2",
        "retry-on conn-failure empty-response response-timeout 503",
        "option redispatch 1",
        "# A retry after a refused connect first waits min(timeout connect, 1 s), so this is",
        "# what a replica that has just died costs the next request.",
        f"timeout connect {settings.connect_timeout_ms}ms",
        "# Inactivity timers: a stream may run for minutes as long as tokens keep coming.",
        "# Each pool's backends bound the replica side far tighter (its silence budget).",
        f"timeout client {idle}",
        f"timeout server {idle}",
        "timeout http-request 10s",
        "timeout http-keep-alive 10s",
        "# A health check that hangs fails here, not at `inter`: a hung replica is out sooner,",
        "# and one that answers again is not kept out by a check still waiting on it.",
        f"timeout check {settings.check_timeout_ms}ms",
        "# One replica connection per request, closed when its answer ends: engines close a",
        "# connection right after a streamed answer while they announce keep-alive (llama.cpp's",
        "# llama-server does, every time), and a queued request handed that connection at once",
        "# met the close, was retried after a turn-around and at times lost its client's",
        "# connection. A fresh connect costs a round trip to the replica, as nginx pays by",
        "# default (measured: 0 retries, 0 resets at 2x; reused: 38 % retried, 4 in 185 reset).",
        "option http-server-close",
        *_default_server(settings),
        "# When every try failed, a replica timed out or a queued request waited past its",
        "# budget, HAProxy answers; in JSON too, and a 503 says when to retry.",
        *(_haproxy_error(status, body) for status, body in sorted(_HAPROXY_ERRORS.items())),
    ]
    if settings.state_file is not None:
        lines.append("load-server-state-from-file global")
    return section("defaults", [], lines)


def _haproxy_error(status: int, body: str) -> str:
    kind = "lf-string" if "%[" in body else "string"
    line = f"http-error status {status} content-type application/json {kind} '{body}'"
    return f"{line} {_RETRY_AFTER}" if status == 503 else line


def _prometheus_frontend(settings: BalancerSettings) -> str:
    assert settings.prometheus_port is not None
    address = settings.prometheus_address or settings.bind_address
    return section(
        f"frontend {PROMETHEUS_FRONTEND}",
        [
            "Prometheus metrics of every frontend, backend and server, on their own port,",
            "and the stats page (`/stats;csv` is `show stat`) for `denv status --endpoint`.",
        ],
        [
            f"bind {host_port(address, settings.prometheus_port)}",
            "no log",
            "http-request use-service prometheus-exporter if { path /metrics }",
            "# Read-only: without `stats admin` nobody can change a server from here.",
            "stats enable",
            f"stats uri {STATS_PATH}",
        ],
    )


def _header_pieces() -> list[str]:
    """`bytes` converters that cut a header block of up to one buffer into pieces whose hex
    fits the converter's buffer."""
    starts = range(0, _BUFSIZE, _HEX_PIECE)
    return [
        f"bytes({start},{_HEX_PIECE})" if start + _HEX_PIECE < _BUFSIZE else f"bytes({start})"
        for start in starts
    ]


def _endpoint_frontend(
    pools: Sequence[BalancerPool], settings: BalancerSettings, maps: _MapPaths
) -> str:
    bind = f"bind {host_port(settings.bind_address, settings.port)}"
    minting = settings.client_secret_key_file is not None
    if settings.tls_cert_path is not None:
        bind += f" ssl crt {settings.tls_cert_path}"
    lines = [
        bind,
        "option httplog",
        "option dontlognull",
        "# The whole request body is needed to read the model field and to retry the request.",
        "option http-buffer-request",
        "# A control character in a header (all but the tab) is refused, never forwarded: a",
        "# replica's parser could cut the header there or read it otherwise. HAProxy's regex",
        "# ends at a NUL, so the headers are matched as hex, a byte per two digits, in pieces.",
        *(
            f"acl control_byte req.hdrs,{piece},hex -m reg {_CONTROL_BYTE_HEX}"
            for piece in _header_pieces()
        ),
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_CONTROL_BYTE}' if control_byte",
        "# Only the balancer says which replica served.",
        "http-request del-header X-Denv-Replica",
        "",
        f"# Every answer carries {REQUEST_ID_HEADER}, the client's when it sent one; the replica",
        "# gets it too, and this log shows it among the captured headers. A client's id sent",
        f"# twice, longer than {REQUEST_ID_MAX} characters or with others than letters, digits and",
        "# . _ : / + = - is replaced by a fresh one, which the answer then carries.",
        f"http-request set-header {REQUEST_ID_HEADER} %[uuid]"
        f" unless {{ req.fhdr_cnt({REQUEST_ID_HEADER}) eq 1 }}"
        f" {{ req.fhdr({REQUEST_ID_HEADER}) -m reg {_config_word(_REQUEST_ID)} }}",
        f"http-request set-var(txn.request_id) req.fhdr({REQUEST_ID_HEADER})",
        f"http-request capture var(txn.request_id) len {REQUEST_ID_MAX}",
        f"http-after-response set-header {REQUEST_ID_HEADER} %[var(txn.request_id)]",
        "",
        *_health_answer(pools),
        "",
        "# The API surface: anything else is answered here, never forwarded to a replica.",
        *(f"acl api:{method} path {' '.join(paths)}" for method, paths in API_ROUTES),
        f"acl api:models path {MODELS_PATH}",
        *([f"acl api:client_secrets path {ek.CLIENT_SECRETS_PATH}"] if minting else []),
        "http-request return status 404 content-type application/json"
        f" string '{_ERROR_NO_SUCH_ENDPOINT}' unless "
        + " || ".join(
            [
                *(f"METH_{method} api:{method}" for method, _ in API_ROUTES),
                "METH_GET api:models",
                *([_MINT] if minting else []),
            ]
        ),
    ]
    multipart_model = f"req.body,regsub('{_MULTIPART_MODEL}','\\1'),map({maps.pools})"
    if settings.api_key_digests:
        lines += ["", *_key_check(settings, maps, [pool.name for pool in pools])]
    lines += [
        "",
        "# The served models are the pools, as OpenAI's model list; a key limited to some pools",
        "# is shown those alone.",
        *(
            "http-request return status 200 content-type application/json"
            f" string '{_models_list([p for p in pools if p.name in scope])}'"
            f" if METH_GET api:models {_scope_acl(scope)}"
            for scope in _pool_scopes(settings)
        ),
        "http-request return status 200 content-type application/json"
        f" string '{_models_list(pools)}' if METH_GET api:models",
        "",
        "# Pool: the X-Denv-Pool header when sent, else the model field of the JSON body or",
        "# of the multipart form (an audio upload), or of the query string for a GET (a realtime",
        "# session: /v1/realtime?model=voice). pools.map takes pool names and their aliases.",
        "acl pool_header req.hdr(X-Denv-Pool) -m found",
        "acl multipart req.hdr(Content-Type) -m beg -i multipart/form-data",
        "# The balancer reads the first model key, a replica's JSON parser the last: a body",
        "# routed by its model key must have one, spelled plainly (see docs/balancer.md).",
        f"acl model_key_twice req.body -m reg {_config_word(_MODEL_KEY_TWICE)}",
        f"acl model_key_escaped req.body -m reg {_config_word(_MODEL_KEY_ESCAPED)}",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_AMBIGUOUS_MODEL}' if !pool_header METH_POST !multipart"
        " model_key_twice || !pool_header METH_POST !multipart model_key_escaped",
        f"http-request set-var(txn.pool) req.hdr(X-Denv-Pool),map({maps.pools}) if pool_header",
        "http-request set-var(txn.pool)"
        f" req.body,json_query('$.model'),map({maps.pools}) if !pool_header METH_POST !multipart",
        "http-request set-var(txn.pool)"
        f" {_config_word(multipart_model)}"
        " if !pool_header METH_POST multipart",
        f"http-request set-var(txn.pool) url_param(model),map({maps.pools})"
        " if !pool_header METH_GET",
        *(
            [
                "# A session opened with a client secret is for the secret's pool alone.",
                "http-request return status 401 content-type application/json"
                f" string '{_ERROR_CLIENT_SECRET}' if {{ var(txn.ek_session) -m found }}"
                " !{ var(txn.pool),strcmp(txn.ek_session) eq 0 }",
            ]
            if minting
            else []
        ),
        "acl routed var(txn.pool) -m found",
        "# Not routed: say why. Only the first tune.bufsize bytes of a body are buffered; when the",
        "# model field lies past them, only the header can name the pool.",
        "http-request set-var(txn.body_len) req.body_len if !routed METH_POST",
        "http-request set-var(txn.body_unread) req.body_size,sub(txn.body_len)"
        " if !routed METH_POST",
        "http-request return status 413 content-type application/json"
        f" string '{_ERROR_BODY_TOO_LARGE}' if !routed METH_POST"
        " { var(txn.body_unread) -m int gt 0 }",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_NOT_JSON}' if !routed METH_POST !multipart"
        " !{ req.body -m reg ^[[:space:]]*[{] }",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_NO_MODEL_PART}' if !routed METH_POST multipart"
        ' !{ req.body -m sub name=\\"model\\" }',
    ]
    if _pool_scopes(settings):
        lines += [
            "# A key limited to some pools is answered for any other as for a pool that does not",
            "# exist, as OpenAI answers a model a key may not use: a key learns nothing of pools",
            "# outside its scope, and nothing reaches a replica (a realtime session: before the",
            "# upgrade).",
            *_scope_refusals(settings, "txn.pool"),
        ]
    lines += [
        "http-request return status 404 content-type application/json"
        f" string '{_error_unknown_pool(pool.name for pool in pools)}' unless routed",
        "",
        "# After a reload the old worker still answers the requests already on its keep-alive",
        "# connections, and in a stopping process nbsrv() is 0 for every backend: those go to",
        "# the first tier rather than to a 503.",
        "acl reloading stopping",
        "# A realtime session or a speech stream goes to the twin of the same tier (the same",
        "# replicas), which ends it when its replica is marked down.",
        *(f"acl {twin.acl} path {twin.path}" for twin in _TWINS),
    ]
    for pool in pools:
        lines += ["", *_pool_routing(pool)]
    return section(
        f"frontend {ENDPOINT_FRONTEND}",
        ["The endpoint: authenticate, pick the pool, then the most preferred tier with a replica."],
        lines,
    )


def _key_check(settings: BalancerSettings, maps: _MapPaths, served: Sequence[str]) -> list[str]:
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
    if _key_rates(settings):
        lines += [
            "# A key with a rate: its requests of the last second on this host, counted by",
            "# digest; past its rate, a 429 before anything else is read.",
            f"http-request set-var(txn.key_rate) var(txn.key),map_str_int({maps.key_rates})",
            f"http-request track-sc0 var(txn.key) table {KEY_RATES_TABLE}"
            " if { var(txn.key_rate) -m found }",
            "http-request return status 429 content-type application/json"
            f" lf-string '{_ERROR_RATE}' {_RETRY_AFTER} if {{ var(txn.key_rate) -m found }}"
            " { sc_http_req_rate(0),sub(txn.key_rate) gt 0 }",
        ]
    if key_file is not None:
        lines += _client_secret_mint(settings, maps, served)
    return lines


# A session offered a client secret and no API key; and a request to mint one.
_EK_SESSION = "METH_GET ek:realtime ek:offered !{ var(txn.key_scope) -m found }"
_MINT = "METH_POST api:client_secrets"


def _client_secret_check(key_file: str) -> list[str]:
    """A realtime session without an API key may offer a client secret as a subprotocol: its
    signature and expiry are checked here (a 401 when wrong), its pool once the pool is known."""
    offered = "var(txn.ek_source),regsub('" + _CLIENT_SECRET_OFFERED + "','{}')"
    parts = {"ek_claim": r"\1", "ek_exp": r"\2", "ek_mac": r"\3", "ek_signed": r"\1.\2"}
    extract = {name: _config_word(offered.replace("{}", group)) for name, group in parts.items()}
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
        f"acl ek:offered var(txn.ek_source) -m reg {_config_word(_CLIENT_SECRET_OFFERED)}",
        f"http-request set-var(txn.ek_key) str({ek.KEY_MAP_ENTRY}),map({key_file})"
        f" if {_EK_SESSION} || {_MINT}",
        *(
            f"http-request set-var(txn.{name}) {word} if {_EK_SESSION}"
            for name, word in extract.items()
        ),
        "http-request set-var(txn.ek_want)"
        f" var(txn.ek_signed),hmac(sha256,txn.ek_key),hex,lower if {_EK_SESSION}",
        f"http-request set-var(txn.ek_left) date,neg,add(txn.ek_exp) if {_EK_SESSION}",
        "http-request return status 401 content-type application/json"
        f" string '{_ERROR_CLIENT_SECRET}' if {_EK_SESSION}"
        " !{ var(txn.ek_want),secure_memcmp(txn.ek_mac) }"
        f" || {_EK_SESSION} !{{ var(txn.ek_left) -m int gt 0 }}",
        f"http-request set-var(txn.ek_session) var(txn.ek_claim) if {_EK_SESSION}",
    ]


def _client_secret_mint(
    settings: BalancerSettings, maps: _MapPaths, served: Sequence[str]
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
        f"http-request set-var(txn.ek_pool) {_config_word(session_pool)} if {_MINT}",
        *_scope_refusals(settings, "txn.ek_pool", _MINT),
        "http-request return status 404 content-type application/json"
        f" string '{_error_unknown_pool(served)}' if {_MINT} !{{ var(txn.ek_pool) -m found }}",
        f"http-request set-var(txn.ek_ttl) int({ek.DEFAULT_TTL_S}) if {_MINT}",
        f"http-request set-var(txn.ek_ttl) {_config_word(ttl_given)} if {_MINT}",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_CLIENT_SECRET_TTL}'"
        f" if {_MINT} !{{ var(txn.ek_ttl) -m reg {_config_word(ttl)} }}"
        f" || {_MINT} !{{ var(txn.ek_ttl) -m int {ek.MIN_TTL_S}:{ek.MAX_TTL_S} }}",
        f"http-request set-var(txn.ek_exp) date,add(txn.ek_ttl) if {_MINT}",
        f"http-request set-var(txn.ek_signed) var(txn.ek_pool),concat(.,txn.ek_exp,) if {_MINT}",
        "http-request set-var(txn.ek_want)"
        f" var(txn.ek_signed),hmac(sha256,txn.ek_key),hex,lower if {_MINT}",
        "http-request return status 200 content-type application/json"
        f" lf-string '{_CLIENT_SECRET_ANSWER}' hdr Cache-Control no-store if {_MINT}",
    ]


def _scope_refusals(settings: BalancerSettings, pool_var: str, condition: str = "") -> list[str]:
    """A key limited to some pools is answered for another as for a pool that does not exist."""
    prefix = f"{condition} " if condition else ""
    return [
        "http-request return status 404 content-type application/json"
        f" string '{_error_unknown_pool(scope)}' if {prefix}{_scope_acl(scope)}"
        f" !{{ var({pool_var}) -m str {' '.join(scope)} }}"
        for scope in _pool_scopes(settings)
    ]


def _scope_of(scope: KeyScope) -> str:
    """A key's scope as api_keys.map gives it."""
    return ALL_POOLS if scope.pools is None else ",".join(sorted(set(scope.pools)))


def _scopes(settings: BalancerSettings) -> dict[str, KeyScope]:
    """Each listed key's scope, by its lower-case digest; a key without one has every pool."""
    scoped = {scope.digest.lower(): scope for scope in settings.key_scopes}
    return {
        digest.lower(): scoped.get(digest.lower(), KeyScope(digest.lower()))
        for digest in settings.api_key_digests
    }


def _pool_scopes(settings: BalancerSettings) -> list[tuple[str, ...]]:
    """The distinct sets of pools keys are limited to, sorted."""
    found = {_scope_of(scope) for scope in _scopes(settings).values()} - {ALL_POOLS}
    return [tuple(scope.split(",")) for scope in sorted(found)]


def _scope_acl(pools: tuple[str, ...]) -> str:
    return f"{{ var(txn.key_scope) -m str {','.join(pools)} }}"


def _key_rates(settings: BalancerSettings) -> dict[str, int]:
    return {
        digest: scope.rate for digest, scope in _scopes(settings).items() if scope.rate is not None
    }


def _health_answer(pools: Sequence[BalancerPool]) -> list[str]:
    """`GET /health` for load balancers and DNS checks in front, without a key: 503 while a
    pool has no healthy replica in any tier (a line per pool: HAProxy caps a line's words),
    else 200."""
    return [
        f"# {HEALTH_PATH} for checks in front (no key needed): 503 while a pool has no healthy",
        "# replica in any of its tiers.",
        f"acl health path {HEALTH_PATH}",
        *(
            "http-request return status 503 content-type application/json"
            f" string '{_HEALTH_UNAVAILABLE}' if METH_GET health "
            + " ".join(f"{{ nbsrv({tier_backend_name(pool, tier)}) eq 0 }}" for tier in pool.tiers)
            for pool in pools
        ),
        "http-request return status 200 content-type application/json"
        f" string '{_HEALTH_OK}' if METH_GET health",
    ]


def _models_list(pools: Sequence[BalancerPool]) -> str:
    """OpenAI's `GET /v1/models` answer: each pool and its aliases (names are JSON-safe,
    validated)."""
    return models_list({name for pool in pools for name in (pool.name, *pool.models)})


def models_list(names: Iterable[str]) -> str:
    """OpenAI's model list of these names, as the endpoint answers `GET /v1/models`."""
    models = ",".join(
        f'{{"id":"{name}","object":"model","owned_by":"denv"}}' for name in sorted(set(names))
    )
    return f'{{"object":"list","data":[{models}]}}'


def models_list_problem(names: Iterable[str]) -> str | None:
    """Why the endpoint could not answer `GET /v1/models` whole with these model names, as one
    line naming the field and the fix; None when it can. `denv plan` and the renderer both
    refuse on it."""
    error = _models_list_error(names)
    return None if error is None else str(error)


def _models_list_error(names: Iterable[str]) -> BalancerConfigError | None:
    size = len(models_list(names).encode())
    if size <= MODELS_LIST_LIMIT:
        return None
    return BalancerConfigError(
        "recipes[].models",
        f"the model list the endpoint answers on {MODELS_PATH} would be {size} bytes,"
        f" over HAProxy's limit of {MODELS_LIST_LIMIT} (one buffer)",
        "give fewer aliases or shorter names",
    )


def _config_word(text: str) -> str:
    """One config word in double quotes: a backslash, a quote or a `$` stays literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'"{escaped}"'


def _pool_routing(pool: BalancerPool) -> list[str]:
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
    bounded = ["", *(twin.suffix for twin in _TWINS if twin.bounded)]
    lines += [
        f"acl full:{backend}{suffix} be_conn_free({backend}{suffix}) eq 0"
        for suffix in bounded
        for backend in backends
    ]
    first_staffed = next(tier_backend_name(pool, tier) for tier in pool.tiers if tier.servers)
    routes = [(twin.suffix, [twin.acl], twin.bounded) for twin in _TWINS]
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


def _tier_backend(
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


def _twin_backend(
    pool: BalancerPool, tier: BalancerTier, settings: BalancerSettings, twin: _Twin
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
            f"{_weight(server)}{_gateway_tls(server.gateway, settings)}"
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
    full = f"{{ var({_UNAVAILABLE_CODE}) -m found }}"
    return [
        f"# Each replica takes {pool.max_concurrency} requests at once (maxconn). With none free, a"
        " request waits in",
        f"# this queue only if the tier would start it within the {budget} ms queue budget (of the",
        f"# {pool.first_token_timeout_ms} ms first-token budget): the requests ahead of it, itself"
        " included, at most",
        "# those the tier started in the last second times the budget. Else, and past the budget,",
        f"# a 503 {POOL_FULL} with Retry-After: at once, or after the budget.",
        f"timeout queue {budget}ms",
        f"http-request set-var({_UNAVAILABLE_CODE}) str({POOL_FULL})"
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


def _default_server(settings: BalancerSettings) -> list[str]:
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
        agent = f"agent-addr {_RELAY_ADDRESS} agent-port {relay}"
    return (
        f"{line}{_gateway_tls(server.gateway, settings)}"
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


def _gateway_tls(gateway: str | None, settings: BalancerSettings) -> str:
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


def _agent_relay_sections(
    relays: Mapping[AgentRelay, int], settings: BalancerSettings
) -> list[str]:
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
                    f"bind {_RELAY_ADDRESS}:{port}",
                    f"server gateway {host_port(relay.address, relay.port)}"
                    f"{_gateway_tls(relay.gateway, settings)} init-addr last,libc,none",
                ],
            )
        )
    return sections


def _no_replica_backend() -> str:
    return section(
        f"backend {NO_REPLICA_BACKEND}",
        ["Every allowed tier of the pool is empty: answer at once rather than queue."],
        [
            "http-request return status 503 content-type application/json"
            f" lf-string '{_ERROR_NO_REPLICA}' {_RETRY_AFTER}",
        ],
    )


def _pools_map(pools: Sequence[BalancerPool]) -> str:
    lines = ["# model field or X-Denv-Pool header -> pool"]
    lines += sorted(f"{name} {pool.name}" for pool in pools for name in {pool.name, *pool.models})
    return "\n".join(lines) + "\n"


def _api_keys_map(settings: BalancerSettings) -> str:
    lines = [f"# SHA-256 of an API key (lowercase hex) -> its pools, or {ALL_POOLS} for every pool"]
    lines += [f"{digest} {_scope_of(scope)}" for digest, scope in sorted(_scopes(settings).items())]
    return "\n".join(lines) + "\n"


def _key_rates_map(settings: BalancerSettings) -> str:
    lines = ["# SHA-256 of an API key (lowercase hex) -> requests a second it may send"]
    lines += [f"{digest} {rate}" for digest, rate in sorted(_key_rates(settings).items())]
    return "\n".join(lines) + "\n"


def _key_rates_backend() -> str:
    return section(
        f"backend {KEY_RATES_TABLE}",
        ["Requests of the last second of each key that has a rate, by the key's digest."],
        ["stick-table type string len 64 size 100k expire 10s store http_req_rate(1s)"],
    )
