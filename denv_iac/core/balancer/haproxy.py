"""Render the HAProxy configuration of the endpoint from placed pools: the global and defaults
sections, the metrics frontend, and the endpoint frontend, which composes the checks, routing
and backends of the modules beside this one.

Pure: the same pools and settings always give byte-identical text. Order is kept where it
carries meaning (tiers, rule order) and sorted everywhere else (pools, servers, sites, keys).
"""

from __future__ import annotations

from collections.abc import Sequence

from denv_iac.core.balancer import client_secrets as ek
from denv_iac.core.balancer.agent_relays import agent_relay_sections, agent_relays
from denv_iac.core.balancer.api_surface import (
    API_ROUTES,
    ERROR_NO_SUCH_ENDPOINT,
    HAPROXY_ERRORS,
    MODELS_PATH,
    REQUEST_ID_HEADER,
    REQUEST_ID_MAX,
    REQUEST_ID_PATTERN,
    RETRY_AFTER_HEADER,
    error_unknown_pool,
    models_list_error,
    pool_models_list,
)
from denv_iac.core.balancer.body_checks import (
    BUFSIZE,
    ambiguous_model_check,
    control_byte_check,
    multipart_model,
    unrouted_refusals,
)
from denv_iac.core.balancer.key_checks import (
    ERROR_CLIENT_SECRET,
    MINT_REQUEST,
    key_check,
    key_rates_backend,
    scope_refusals,
)
from denv_iac.core.balancer.key_scopes import key_rates, pool_scopes, scope_acl
from denv_iac.core.balancer.maps import (
    API_KEYS_MAP,
    KEY_RATES_MAP,
    POOLS_MAP,
    MapPaths,
    api_keys_map,
    key_rates_map,
    pools_map,
)
from denv_iac.core.balancer.model import BalancerPool, BalancerSettings, RenderedConfig
from denv_iac.core.balancer.sections import LOG_STDOUT, config_word, header, host_port, section
from denv_iac.core.balancer.tiers import (
    TURN_SLOTS,
    TWINS,
    default_server,
    no_replica_backend,
    pool_routing,
    tier_backend,
    tier_backend_name,
    twin_backend,
)
from denv_iac.core.balancer.validation import validate_balancer_inputs

ENDPOINT_FRONTEND = "denv.endpoint"
PROMETHEUS_FRONTEND = "denv.prometheus"
STATS_PATH = "/stats"

# How long an old worker keeps its sessions after a reload: a voice call of up to an hour
# (OpenAI caps a realtime session at 60 min) finishes on the worker it started on.
_HARD_STOP_AFTER = "1h"
HEALTH_PATH = "/health"
_HEALTH_OK = '{"status":"ok"}'
_HEALTH_UNAVAILABLE = '{"status":"unavailable","message":"a pool has no healthy replica"}'


def render_haproxy_config(
    pools: Sequence[BalancerPool], settings: BalancerSettings, map_dir: str
) -> RenderedConfig:
    """Render haproxy.cfg and its map files; map files are referenced under `map_dir`.

    Raises BalancerConfigError (a ValueError) naming the offending field.
    """
    validate_balancer_inputs(pools, settings, map_dir)
    error = models_list_error(name for pool in pools for name in (pool.name, *pool.models))
    if error is not None:
        raise error
    ordered = sorted(pools, key=lambda pool: pool.name)
    maps = MapPaths(map_dir)
    relays = agent_relays(ordered, settings)
    sections = [
        _header(),
        _global_section(settings),
        _defaults_section(settings),
        *([_prometheus_frontend(settings)] if settings.prometheus_port is not None else []),
        _endpoint_frontend(ordered, settings, maps),
        *(tier_backend(pool, tier, settings, relays) for pool in ordered for tier in pool.tiers),
        *(
            twin_backend(pool, tier, settings, twin)
            for twin in TWINS
            for pool in ordered
            for tier in pool.tiers
        ),
        no_replica_backend(),
        *([key_rates_backend()] if key_rates(settings) else []),
        *agent_relay_sections(relays, settings),
    ]
    files = {POOLS_MAP: pools_map(ordered)}
    if settings.api_key_digests:
        files[API_KEYS_MAP] = api_keys_map(settings)
    if key_rates(settings):
        files[KEY_RATES_MAP] = key_rates_map(settings)
    return RenderedConfig(haproxy_cfg="\n".join(sections), files=files, map_dir=map_dir)


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
    lines.append(f"tune.bufsize {BUFSIZE}")
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
        *default_server(settings),
        "# When every try failed, a replica timed out or a queued request waited past its",
        "# budget, HAProxy answers; in JSON too, and a 503 says when to retry.",
        *(_haproxy_error(status, body) for status, body in sorted(HAPROXY_ERRORS.items())),
    ]
    if settings.state_file is not None:
        lines.append("load-server-state-from-file global")
    return section("defaults", [], lines)


def _haproxy_error(status: int, body: str) -> str:
    kind = "lf-string" if "%[" in body else "string"
    line = f"http-error status {status} content-type application/json {kind} '{body}'"
    return f"{line} {RETRY_AFTER_HEADER}" if status == 503 else line


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


def _endpoint_frontend(
    pools: Sequence[BalancerPool], settings: BalancerSettings, maps: MapPaths
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
        *control_byte_check(),
        "# Only the balancer says which replica served.",
        "http-request del-header X-Denv-Replica",
        "",
        f"# Every answer carries {REQUEST_ID_HEADER}, the client's when it sent one; the replica",
        "# gets it too, and this log shows it among the captured headers. A client's id sent",
        f"# twice, longer than {REQUEST_ID_MAX} characters or with others than letters, digits and",
        "# . _ : / + = - is replaced by a fresh one, which the answer then carries.",
        f"http-request set-header {REQUEST_ID_HEADER} %[uuid]"
        f" unless {{ req.fhdr_cnt({REQUEST_ID_HEADER}) eq 1 }}"
        f" {{ req.fhdr({REQUEST_ID_HEADER}) -m reg {config_word(REQUEST_ID_PATTERN)} }}",
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
        f" string '{ERROR_NO_SUCH_ENDPOINT}' unless "
        + " || ".join(
            [
                *(f"METH_{method} api:{method}" for method, _ in API_ROUTES),
                "METH_GET api:models",
                *([MINT_REQUEST] if minting else []),
            ]
        ),
    ]
    if settings.api_key_digests:
        lines += ["", *key_check(settings, maps, [pool.name for pool in pools])]
    lines += [
        "",
        "# The served models are the pools, as OpenAI's model list; a key limited to some pools",
        "# is shown those alone.",
        *(
            "http-request return status 200 content-type application/json"
            f" string '{pool_models_list([p for p in pools if p.name in scope])}'"
            f" if METH_GET api:models {scope_acl(scope)}"
            for scope in pool_scopes(settings)
        ),
        "http-request return status 200 content-type application/json"
        f" string '{pool_models_list(pools)}' if METH_GET api:models",
        "",
        "# Pool: the X-Denv-Pool header when sent, else the model field of the JSON body or",
        "# of the multipart form (an audio upload), or of the query string for a GET (a realtime",
        "# session: /v1/realtime?model=voice). pools.map takes pool names and their aliases.",
        "acl pool_header req.hdr(X-Denv-Pool) -m found",
        "acl multipart req.hdr(Content-Type) -m beg -i multipart/form-data",
        *ambiguous_model_check(),
        f"http-request set-var(txn.pool) req.hdr(X-Denv-Pool),map({maps.pools}) if pool_header",
        "http-request set-var(txn.pool)"
        f" req.body,json_query('$.model'),map({maps.pools}) if !pool_header METH_POST !multipart",
        "http-request set-var(txn.pool)"
        f" {config_word(multipart_model(maps.pools))}"
        " if !pool_header METH_POST multipart",
        f"http-request set-var(txn.pool) url_param(model),map({maps.pools})"
        " if !pool_header METH_GET",
        *(
            [
                "# A session opened with a client secret is for the secret's pool alone.",
                "http-request return status 401 content-type application/json"
                f" string '{ERROR_CLIENT_SECRET}' if {{ var(txn.ek_session) -m found }}"
                " !{ var(txn.pool),strcmp(txn.ek_session) eq 0 }",
            ]
            if minting
            else []
        ),
        "acl routed var(txn.pool) -m found",
        "# Not routed: say why. Only the first tune.bufsize bytes of a body are buffered; when the",
        "# model field lies past them, only the header can name the pool.",
        *unrouted_refusals(),
    ]
    if pool_scopes(settings):
        lines += [
            "# A key limited to some pools is answered for any other as for a pool that does not",
            "# exist, as OpenAI answers a model a key may not use: a key learns nothing of pools",
            "# outside its scope, and nothing reaches a replica (a realtime session: before the",
            "# upgrade).",
            *scope_refusals(settings, "txn.pool"),
        ]
    lines += [
        "http-request return status 404 content-type application/json"
        f" string '{error_unknown_pool(pool.name for pool in pools)}' unless routed",
        "",
        "# After a reload the old worker still answers the requests already on its keep-alive",
        "# connections, and in a stopping process nbsrv() is 0 for every backend: those go to",
        "# the first tier rather than to a 503.",
        "acl reloading stopping",
        *(
            [
                "# A conversation's turn (X-Denv-Session) is hashed to its replica, which may be",
                "# the full one while its tier has one slot left: the turn takes a tier with two.",
                f"http-request set-var({TURN_SLOTS}) req.fhdr_cnt(X-Denv-Session),bool",
            ]
            if any(pool.session_affinity for pool in pools)
            else []
        ),
        "# A realtime session or a speech stream goes to the twin of the same tier (the same",
        "# replicas), which ends it when its replica is marked down.",
        *(f"acl {twin.acl} path {twin.path}" for twin in TWINS),
    ]
    for pool in pools:
        lines += ["", *pool_routing(pool)]
    return section(
        f"frontend {ENDPOINT_FRONTEND}",
        ["The endpoint: authenticate, pick the pool, then the most preferred tier with a replica."],
        lines,
    )


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
