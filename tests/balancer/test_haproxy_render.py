"""The rendered HAProxy config: structure, escaping, determinism, validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from denv_iac.core.balancer import (
    BalancerConfigError,
    BalancerPool,
    BalancerSettings,
    BalancerTier,
    KeyScope,
    RenderedConfig,
    render_haproxy_config,
)
from denv_iac.core.balancer.api_surface import MODELS_LIST_LIMIT, models_list
from denv_iac.core.balancer.model import connect_timeout_for

from .sample_pools import (
    LLM,
    LLM_KEY_DIGEST,
    MAP_DIR,
    POOLS,
    SCOPED_SETTINGS,
    SETTINGS,
    VOICE,
    aliases_filling,
    server,
)

GOLDEN = Path(__file__).parent / "golden" / "representative.cfg"


def render(
    pools: tuple[BalancerPool, ...] = POOLS, balancer: BalancerSettings = SETTINGS
) -> RenderedConfig:
    return render_haproxy_config(pools, balancer, MAP_DIR)


def section(cfg: str, title: str) -> list[str]:
    """The directive lines of one section, comments dropped."""
    block = re.split(r"\n\n(?=\S)", cfg.split(f"\n{title}\n", 1)[1], maxsplit=1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and line[4] != "#"]


def test_golden_snapshot() -> None:
    cfg = render().haproxy_cfg
    if os.environ.get("DENV_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(cfg)
    assert cfg == GOLDEN.read_text(), "rendering changed: DENV_UPDATE_GOLDEN=1 to accept it"


def test_sections_come_in_a_stable_order() -> None:
    titles = [line for line in render().haproxy_cfg.splitlines() if re.match(r"^[a-z]", line)]
    assert titles == [
        "global",
        "defaults",
        "frontend denv.prometheus",
        "frontend denv.endpoint",
        "backend llm-8b.tier1",
        "backend voice.tier1",
        "backend voice.tier2",
        "backend llm-8b.tier1.realtime",
        "backend voice.tier1.realtime",
        "backend voice.tier2.realtime",
        "backend llm-8b.tier1.speech",
        "backend voice.tier1.speech",
        "backend voice.tier2.speech",
        "backend denv.no-healthy-replica",
    ]


def test_realtime_sessions_get_tunnel_timers_and_close_with_their_replica() -> None:
    cfg = render().haproxy_cfg
    realtime = section(cfg, "backend voice.tier1.realtime")
    assert "timeout tunnel 10m" in realtime
    assert "default-server no-check no-agent-check on-marked-down shutdown-sessions" in realtime
    servers = [line for line in realtime if line.startswith("server ")]
    assert servers and all(" track voice.tier1/" in line for line in servers)
    assert not any("set-timeout" in line for line in realtime)
    assert "hard-stop-after 1h" in section(cfg, "global")
    frontend = section(cfg, "frontend denv.endpoint")
    realtime_rule = "use_backend voice.tier1.realtime if pool:voice realtime !empty:voice.tier1"
    assert frontend.index(realtime_rule) < frontend.index(
        "use_backend voice.tier1 if pool:voice !full:voice.tier1"
    )


@pytest.mark.parametrize(
    ("balancer", "present", "absent"),
    [
        (
            BalancerSettings(),
            ["bind 0.0.0.0:8080\n", "bind 0.0.0.0:8405", "timeout connect 80ms", "stats socket "],
            ["ssl crt", "http_auth_bearer", "server-state-file", "api_keys.map"],
        ),
        (
            BalancerSettings(tls_cert_path="/etc/denv/tls.pem", port=443),
            ["bind 0.0.0.0:443 ssl crt /etc/denv/tls.pem\n"],
            [],
        ),
        (BalancerSettings(prometheus_port=None), [], ["prometheus"]),
        (
            BalancerSettings(bind_address="::", prometheus_port=9090),
            ["bind [::]:8080\n", "bind [::]:9090\n"],
            [],
        ),
        (
            BalancerSettings(api_key_digests=("ab" * 32,)),
            [
                "http-request return status 401 content-type application/json string '{",
                "http-request set-var(txn.key) http_auth_bearer,sha2(256),hex,lower\n",
                f"http-request set-var(txn.key_scope) var(txn.key),map({MAP_DIR}/api_keys.map)\n",
                "hdr WWW-Authenticate Bearer unless { var(txn.key_scope) -m found }\n",
                "http-request del-header Authorization",
            ],
            [],
        ),
        (
            BalancerSettings(state_file="/var/lib/denv/state"),
            ["server-state-file /var/lib/denv/state\n", "load-server-state-from-file global"],
            [],
        ),
        (
            BalancerSettings(
                agent_inter_ms=150,
                check_inter_ms=800,
                connect_timeout_ms=40,
                stream_idle_timeout_s=60,
            ),
            [
                "agent-inter 150ms",
                "inter 800ms fastinter 200ms downinter 200ms fall 2 rise 2",
                "timeout connect 40ms",
                "timeout client 60s\n",
                "timeout server 60s\n",
                "http-request set-timeout server 60s"
                " if { path /v1/chat/completions /v1/completions /v1/embeddings }"
                " !{ req.body,json_query('$.stream') -m bool }",
            ],
            [],
        ),
        (
            BalancerSettings(stats_socket="/run/x/h.sock"),
            ["stats socket /run/x/h.sock mode 600 level admin expose-fd listeners\n"],
            [],
        ),
    ],
    ids=["defaults", "tls", "no-prometheus", "ipv6", "api-keys", "state-file", "timers", "socket"],
)
def test_settings_shape_the_config(
    balancer: BalancerSettings, present: list[str], absent: list[str]
) -> None:
    cfg = render(balancer=balancer).haproxy_cfg
    for text in present:
        assert text in cfg
    for text in absent:
        assert text not in cfg


def test_defaults_hold_the_streaming_and_retry_policy() -> None:
    lines = section(render().haproxy_cfg, "defaults")
    for directive in (
        "option http-no-delay",
        "retries 2",
        "retry-on conn-failure empty-response response-timeout 503",
        "option redispatch 1",
        "option http-server-close",
    ):
        assert directive in lines
    errors = [line.split(" content-type ")[0] for line in lines if line.startswith("http-error")]
    assert errors == [f"http-error status {status}" for status in (502, 503, 504)]
    (default_server,) = [line for line in lines if line.startswith("default-server")]
    for option in (
        " check ",
        " agent-check ",
        " weight 100 ",
        " observe layer4 error-limit 1 on-error mark-down ",
        " fall 2 rise 2 ",
    ):
        assert option in f"{default_server} "


def test_frontend_strips_replica_header_and_buffers_the_body() -> None:
    lines = section(render().haproxy_cfg, "frontend denv.endpoint")
    assert "option http-buffer-request" in lines
    assert "http-request del-header X-Denv-Replica" in lines
    assert lines.index("http-request del-header X-Denv-Replica") < lines.index(
        "acl pool_header req.hdr(X-Denv-Pool) -m found"
    )
    assert (
        f"http-request set-var(txn.pool) req.body,json_query('$.model'),map({MAP_DIR}/pools.map)"
        " if !pool_header METH_POST !multipart"
    ) in lines


def test_tiers_chain_in_order_and_end_in_503() -> None:
    lines = section(render().haproxy_cfg, "frontend denv.endpoint")
    assert [
        line for line in lines if "voice" in line and not line.startswith("http-request return")
    ] == [
        "acl pool:voice var(txn.pool) -m str voice",
        "acl empty:voice.tier1 nbsrv(voice.tier1) eq 0",
        "acl empty:voice.tier2 nbsrv(voice.tier2) eq 0",
        # A conversation's turn finds a tier of two replicas full with one slot left (its own
        # replica may be the full one); a tier of one replica has no other to hash to.
        "acl full:voice.tier1 be_conn_free(voice.tier1),sub(txn.turn_slots) le 0",
        "acl full:voice.tier2 be_conn_free(voice.tier2) eq 0",
        # Speech counts its own slots: HAProxy's maxconn is per backend.
        "acl full:voice.tier1.speech be_conn_free(voice.tier1.speech) eq 0",
        "acl full:voice.tier2.speech be_conn_free(voice.tier2.speech) eq 0",
        "use_backend voice.tier1.realtime if pool:voice realtime reloading",
        "use_backend voice.tier1.speech if pool:voice speech reloading",
        "use_backend voice.tier1 if pool:voice reloading",
        "use_backend voice.tier1.realtime if pool:voice realtime !empty:voice.tier1",
        "use_backend voice.tier2.realtime if pool:voice realtime empty:voice.tier1"
        " !empty:voice.tier2",
        # Speech and the rest: a tier with a free slot, most preferred first (a full tier
        # spills like an empty one); every tier full: queue in the first that has a replica.
        "use_backend voice.tier1.speech if pool:voice speech !full:voice.tier1.speech",
        "use_backend voice.tier2.speech if pool:voice speech full:voice.tier1.speech"
        " !full:voice.tier2.speech",
        "use_backend voice.tier1.speech if pool:voice speech !empty:voice.tier1",
        "use_backend voice.tier2.speech if pool:voice speech empty:voice.tier1 !empty:voice.tier2",
        "use_backend voice.tier1 if pool:voice !full:voice.tier1",
        "use_backend voice.tier2 if pool:voice full:voice.tier1 !full:voice.tier2",
        "use_backend voice.tier1 if pool:voice !empty:voice.tier1",
        "use_backend voice.tier2 if pool:voice empty:voice.tier1 !empty:voice.tier2",
        "use_backend denv.no-healthy-replica if pool:voice",
    ]


def test_a_stopping_worker_keeps_to_the_first_tier_with_servers() -> None:
    unstaffed = BalancerTier(0, ("aws-euc1",), ())
    pool = dataclasses.replace(VOICE, tiers=(unstaffed, *VOICE.tiers))
    lines = section(render((pool,)).haproxy_cfg, "frontend denv.endpoint")
    assert "acl reloading stopping" in lines
    assert "use_backend voice.tier1 if pool:voice reloading" in lines


def test_tier_comment_names_pool_priority_and_sites() -> None:
    cfg = render().haproxy_cfg
    assert "# pool voice, tier 1: sites aws-use1, lambda-use1\nbackend voice.tier1\n" in cfg
    assert "# pool voice: tier 1 (aws-use1, lambda-use1) -> tier 2 (nebius-eun1) -> 503" in cfg


@pytest.mark.parametrize(
    ("backend", "balance"),
    [
        (
            "backend voice.tier1",
            ["balance hdr(X-Denv-Session)", "hash-type consistent", "hash-balance-factor 101"],
        ),
        ("backend llm-8b.tier1", ["balance leastconn", "timeout queue 80ms"]),
    ],
)
def test_balance_follows_session_affinity(backend: str, balance: list[str]) -> None:
    lines = section(render().haproxy_cfg, backend)
    assert lines[: len(balance)] == balance
    assert "http-response set-header X-Denv-Replica %s" in lines
    assert "option httpchk GET /health" in lines
    assert "http-check expect status 200" in lines


def test_server_lines_name_replicas_sorted_with_agent_send() -> None:
    cfg = render().haproxy_cfg
    block = cfg.split("\nbackend voice.tier1\n", 1)[1].split("\n\n", 1)[0]
    servers = re.findall(
        r"^    server (\S+) (\S+) id (\d+) maxconn 32 agent-port (\d+) agent-send (.*)$",
        block,
        re.M,
    )
    assert [(name, address) for name, address, *_ in servers] == [
        ("voice.aws-use1.node-0.0", "10.0.0.7:8001"),
        ("voice.aws-use1.node-0.1", "10.0.0.7:8000"),
        ("voice.lambda-use1.node-0.0", "10.1.0.5:8000"),
    ]
    for name, _address, _id, agent_port, agent_send in servers:
        assert agent_port == "9100"
        # HAProxy turns the two characters \n into the newline the agent reads up to.
        assert agent_send == f'"{name}\\n"'
        assert f"    # replica {name} (site {name.split('.')[1]}, node node-0)\n" in block


def test_far_tier_gets_its_own_connect_timeout() -> None:
    assert "timeout connect 250ms" in section(render().haproxy_cfg, "backend voice.tier2")
    assert not any(
        "timeout connect" in line for line in section(render().haproxy_cfg, "backend voice.tier1")
    )


@pytest.mark.parametrize(
    ("first_token_ms", "stall_ms", "timer"),
    [(1000, 1000, "1000ms"), (800, 2500, "2500ms"), (3000, 1200, "3000ms")],
)
def test_each_pool_bounds_replica_silence_by_its_budgets(
    first_token_ms: int, stall_ms: int, timer: str
) -> None:
    voice = dataclasses.replace(
        VOICE, first_token_timeout_ms=first_token_ms, stall_timeout_ms=stall_ms
    )
    cfg = render((voice, LLM)).haproxy_cfg
    for tier in voice.tiers:
        lines = section(cfg, f"backend voice.tier{tier.priority}")
        assert f"timeout server {timer}" in lines
        # Unstreamed JSON answers keep the endpoint's long timer; a transcription, which comes
        # whole, gets the first-byte budget and its retry.
        assert (
            "http-request set-timeout server 300s"
            " if { path /v1/chat/completions /v1/completions /v1/embeddings }"
            " !{ req.body,json_query('$.stream') -m bool }" in lines
        )
        assert (
            f"http-request set-timeout server {first_token_ms}ms"
            " if { path /v1/audio/transcriptions /v1/audio/translations }" in lines
        )
        # Speech always streams, with or without a stream field: the stream's budget, and its
        # streams end when their replica is marked down.
        speech = section(cfg, f"backend voice.tier{tier.priority}.speech")
        assert f"timeout server {timer}" in speech
        assert not any("set-timeout" in line for line in speech)
        assert "default-server no-check no-agent-check on-marked-down shutdown-sessions" in speech
    assert "timeout server 1000ms" in section(cfg, "backend llm-8b.tier1")


@pytest.mark.parametrize(
    ("max_concurrency", "first_token_ms", "stall_ms", "queue_budget_ms"),
    [(1, 1000, 1000, None), (2, 800, 2500, None), (32, 3000, 1200, 400), (256, 50, 50, None)],
)
def test_a_replica_takes_its_pool_capacity_and_the_rest_wait_for_the_queue_budget(
    max_concurrency: int, first_token_ms: int, stall_ms: int, queue_budget_ms: int | None
) -> None:
    # The recipe's queue budget, else 80 ms and at most a fifth of the first-token budget (the
    # rest is the prefill).
    queue_ms = {1000: 80, 800: 80, 3000: 400, 50: 10}[first_token_ms]
    voice = dataclasses.replace(
        VOICE,
        max_concurrency=max_concurrency,
        first_token_timeout_ms=first_token_ms,
        stall_timeout_ms=stall_ms,
        queue_budget_ms=queue_budget_ms,
    )
    cfg = render((voice, LLM)).haproxy_cfg
    for tier in voice.tiers:
        lines = section(cfg, f"backend voice.tier{tier.priority}")
        servers = [line for line in lines if line.startswith("server ")]
        assert len(servers) == len(tier.servers)
        assert all(f" maxconn {max_concurrency} " in line for line in servers)
        # The wait for a slot is bounded by the queue budget, not by the stall budget; and a
        # request with every slot taken waits only if the tier would start it within it, by
        # the requests ahead of it and those the tier started in the last second.
        assert f"timeout queue {queue_ms}ms" in lines
        full = "{ var(txn.unavailable) -m found }"
        assert lines[lines.index(f"timeout queue {queue_ms}ms") + 1 :][:3] == [
            "http-request set-var(txn.unavailable) str(pool_full)"
            " if { be_conn_free eq 0 } { nbsrv gt 0 }",
            f"http-request set-var(txn.ahead) queue,add(1),mul(1000) if {full}",
            "http-request return status 503 default-errorfiles"
            f" if {full} {{ be_sess_rate,mul({queue_ms}),sub(txn.ahead) lt 0 }}",
        ]
        # Realtime sessions are not held to the slots of streamed requests.
        realtime = section(cfg, f"backend voice.tier{tier.priority}.realtime")
        assert not any("maxconn" in line or "timeout queue" in line for line in realtime)
    other = [line for line in section(cfg, "backend llm-8b.tier1") if line.startswith("server ")]
    assert other and all(" maxconn 32 " in line for line in other)


@pytest.mark.parametrize(
    ("title", "answer"),
    [
        (
            "defaults",
            "http-error status 503 content-type application/json lf-string"
            ' \'{"error":{"type":"service_unavailable",'
            '"code":"%[var(txn.unavailable,no_healthy_replica)]",'
            '"message":"no replica could take the request in time; retry after Retry-After'
            " seconds\"}}' hdr Retry-After 1",
        ),
        (
            "backend denv.no-healthy-replica",
            "http-request return status 503 content-type application/json lf-string"
            ' \'{"error":{"type":"service_unavailable","code":"no_healthy_replica",'
            '"message":"no healthy replica in any allowed site of pool %[var(txn.pool)]"}}\''
            " hdr Retry-After 1",
        ),
    ],
)
def test_every_503_of_a_pool_says_when_to_retry(title: str, answer: str) -> None:
    assert answer in section(render().haproxy_cfg, title)


def test_a_down_server_is_checked_at_fastinter_and_its_sessions_left_to_the_timers() -> None:
    (default_server,) = [
        line for line in section(render().haproxy_cfg, "defaults") if "default-server" in line
    ]
    # Shutting a marked-down server's sessions also ended requests still connecting to it with
    # no answer at all (lost, in the partition scenario); the stall budget cuts silent streams.
    assert "shutdown-sessions" not in default_server
    assert "fastinter 250ms downinter 250ms" in default_server


def test_a_silence_budget_must_be_positive() -> None:
    with pytest.raises(BalancerConfigError, match=r"pools\[\d\]\.stall_timeout_ms"):
        render((dataclasses.replace(VOICE, stall_timeout_ms=0), LLM))


def test_server_ids_survive_adding_a_replica() -> None:
    def ids(pool: BalancerPool) -> dict[str, str]:
        cfg = render((pool,)).haproxy_cfg
        return dict(re.findall(r"^    server (\S+) \S+ id (\d+)", cfg, re.M))

    tier = VOICE.tiers[0]
    grown = dataclasses.replace(
        tier, servers=(*tier.servers, server("voice.aws-use1.node-0.00", "10.0.0.8"))
    )
    before = ids(VOICE)
    after = ids(dataclasses.replace(VOICE, tiers=(grown, *VOICE.tiers[1:])))
    assert {name: after[name] for name in before} == before
    assert len(set(after.values())) == len(after)


@pytest.mark.parametrize(
    ("balancer", "error_count", "other_count"),
    [
        # 401, 404 (no such endpoint, unknown pool), 413 (too large to route), 400 (a control
        # character in a header, not JSON, no model part, an ambiguous model key), 503 of ours;
        # HAProxy's own 502, 503, 504. Others: /health's 503 (one line per pool) and 200; the
        # model list.
        (SETTINGS, 12, 4),
        # And a key's 429 past its rate, the unknown pool's 404 for a pool outside its scope;
        # the model list of its scope.
        (SCOPED_SETTINGS, 14, 5),
    ],
)
def test_answers_of_the_balancer_are_json_and_cannot_break_out_of_their_quotes(
    balancer: BalancerSettings, error_count: int, other_count: int
) -> None:
    cfg = render(balancer=balancer).haproxy_cfg
    bodies = re.findall(r"(?:lf-)?string '([^']*)'", cfg)
    errors = [body for body in bodies if body.startswith('{"error":{')]
    assert len(errors) == error_count
    assert len(bodies) == len(errors) + other_count
    for body in bodies:
        assert body.endswith("}") and "\n" not in body
        if "%[" not in body:  # lf-string bodies are JSON once HAProxy fills them in
            json.loads(body)


@pytest.mark.parametrize("size", [MODELS_LIST_LIMIT, MODELS_LIST_LIMIT + 1])
def test_the_model_list_fits_one_buffer_or_the_stack_is_refused(size: int) -> None:
    # HAProxy answered a longer list with a 200 and an empty body.
    aliases = aliases_filling((VOICE.name, LLM.name), size)
    pools = (dataclasses.replace(VOICE, models=aliases), LLM)
    if size > MODELS_LIST_LIMIT:
        with pytest.raises(BalancerConfigError) as refused:
            render(pools)
        assert str(refused.value) == (
            f"recipes[].models: the model list the endpoint answers on /v1/models would be"
            f" {size} bytes, over HAProxy's limit of {MODELS_LIST_LIMIT} (one buffer);"
            " give fewer aliases or shorter names"
        )
        return
    cfg = render(pools).haproxy_cfg
    listed = models_list([VOICE.name, LLM.name, *aliases])
    assert f" string '{listed}' if METH_GET api:models" in cfg


OTHER_KEY = hashlib.sha256(b"other").hexdigest()
_NO_SCOPE_RULES = ["key_scope) -m str", "track-sc0", "key_rates.map", "backend denv.key-rates"]


def _scoped(*scopes: KeyScope, listed: bool = True) -> BalancerSettings:
    """SETTINGS with OTHER_KEY and LLM_KEY_DIGEST listed too (unless not `listed`), and these
    scopes."""
    more = (OTHER_KEY, LLM_KEY_DIGEST) if listed else ()
    return dataclasses.replace(
        SETTINGS, api_key_digests=(*SETTINGS.api_key_digests, *more), key_scopes=scopes
    )


def _refused_outside(scope: str, pools: str) -> str:
    return (
        'string \'{"error":{"type":"invalid_request_error","code":"model_not_found"'
        f',"message":"unknown pool: set the model field or the X-Denv-Pool header to a served'
        f" pool: {pools.replace(' ', ', ')}\"}}}}' if {{ var(txn.key_scope) -m str {scope} }}"
        f" !{{ var(txn.pool) -m str {pools} }}"
    )


def _listed_for(scope: str, *names: str) -> str:
    listed = models_list(names)
    return f"string '{listed}' if METH_GET api:models {{ var(txn.key_scope) -m str {scope} }}"


_RATE_RULES = [
    f"http-request set-var(txn.key_rate) var(txn.key),map_str_int({MAP_DIR}/key_rates.map)\n",
    "http-request track-sc0 var(txn.key) table denv.key-rates if { var(txn.key_rate) -m found }",
    "if { var(txn.key_rate) -m found } { sc_http_req_rate(0),sub(txn.key_rate) gt 0 }\n",
    "backend denv.key-rates\n    stick-table type string len 64 size 100k expire 10s"
    " store http_req_rate(1s)\n",
]


@pytest.mark.parametrize(
    ("scopes", "keys_map", "rates_map", "present", "absent"),
    [
        pytest.param((), {OTHER_KEY: "*", LLM_KEY_DIGEST: "*"}, None, [], _NO_SCOPE_RULES),
        pytest.param(
            (KeyScope(LLM_KEY_DIGEST, ("llm-8b",)),),
            {OTHER_KEY: "*", LLM_KEY_DIGEST: "llm-8b"},
            None,
            [_refused_outside("llm-8b", "llm-8b"), _listed_for("llm-8b", "llm-8b")],
            _NO_SCOPE_RULES[1:],
            id="one-pool",
        ),
        pytest.param(
            # Listed in any order, twice: one scope, its pools sorted.
            (KeyScope(LLM_KEY_DIGEST, ("voice", "llm-8b", "voice")),),
            {OTHER_KEY: "*", LLM_KEY_DIGEST: "llm-8b,voice"},
            None,
            [
                _refused_outside("llm-8b,voice", "llm-8b voice"),
                _listed_for("llm-8b,voice", "llm-8b", "voice"),
            ],
            _NO_SCOPE_RULES[1:],
            id="two-pools",
        ),
        pytest.param(
            # Two keys of one scope share its rules.
            (KeyScope(LLM_KEY_DIGEST, ("voice",)), KeyScope(OTHER_KEY.upper(), ("voice",), 7)),
            {OTHER_KEY: "voice", LLM_KEY_DIGEST: "voice"},
            {OTHER_KEY: "7"},
            [_refused_outside("voice", "voice"), _listed_for("voice", "voice"), *_RATE_RULES],
            [],
            id="shared-scope-and-a-rate",
        ),
        pytest.param(
            (KeyScope(LLM_KEY_DIGEST, None, 5),),
            {OTHER_KEY: "*", LLM_KEY_DIGEST: "*"},
            {LLM_KEY_DIGEST: "5"},
            _RATE_RULES,
            _NO_SCOPE_RULES[:1],
            id="rate-alone",
        ),
    ],
)
def test_key_scopes_shape_the_maps_and_rules(
    scopes: tuple[KeyScope, ...],
    keys_map: dict[str, str],
    rates_map: dict[str, str] | None,
    present: list[str],
    absent: list[str],
) -> None:
    rendered = render(balancer=_scoped(*scopes))
    keys = dict(line.split() for line in rendered.files["api_keys.map"].splitlines()[1:])
    assert keys == {**dict.fromkeys(SETTINGS.api_key_digests, "*"), **keys_map}
    rates = rendered.files.get("key_rates.map")
    assert (rates and dict(line.split() for line in rates.splitlines()[1:])) == rates_map
    cfg = rendered.haproxy_cfg
    for text in present:
        assert text in cfg
    for text in absent:
        assert text not in cfg
    frontend = cfg.split("frontend denv.endpoint\n", 1)[1]
    # The key's scope is known before the model list is answered, the pool before it is checked,
    # and both before any request is sent to a backend.
    order = [
        frontend.index("set-var(txn.key_scope)"),
        frontend.index("if METH_GET api:models"),
        frontend.index("unless routed"),
        frontend.index("use_backend"),
    ]
    assert order == sorted(order)
    for rule in ("api:models { var(txn.key_scope)", "!{ var(txn.pool) -m str", "track-sc0"):
        assert rule not in frontend or order[0] < frontend.index(rule) < order[-1]
    # The scope's 404 follows the pool's choice and comes before the one for a request naming
    # no served pool, so that a scoped key's 404 names the pools of its scope alone.
    assert frontend.count("!{ var(txn.pool) -m str") == 0 or (
        frontend.rindex("set-var(txn.pool)")
        < frontend.index("!{ var(txn.pool) -m str")
        < frontend.index("unless routed")
    )


def test_map_files() -> None:
    upper = hashlib.sha256(b"other").hexdigest().upper()
    balancer = dataclasses.replace(
        SETTINGS, api_key_digests=(upper, *SETTINGS.api_key_digests, upper)
    )
    rendered = render(balancer=balancer)
    assert rendered.map_dir == MAP_DIR
    assert rendered.files["pools.map"] == (
        "# model field or X-Denv-Pool header -> pool\nllm-8b llm-8b\nvoice voice\n"
    )
    digests = sorted({upper.lower(), *SETTINGS.api_key_digests})
    assert rendered.files["api_keys.map"] == (
        "# SHA-256 of an API key (lowercase hex) -> its pools, or * for every pool\n"
        + "".join(f"{d} *\n" for d in digests)
    )
    assert "api_keys.map" not in render(balancer=BalancerSettings()).files
    assert "key_rates.map" not in rendered.files


def test_no_timestamps_or_machine_details() -> None:
    cfg = render().haproxy_cfg
    assert not re.search(r"\d{4}-\d{2}-\d{2}|\d{2}:\d{2}:\d{2}", cfg)


def _shuffled(pools: list[BalancerPool], rand: st.DrawFn) -> list[BalancerPool]:
    result = []
    for pool in rand(st.permutations(pools)):
        tiers = tuple(
            dataclasses.replace(
                tier,
                sites=tuple(rand(st.permutations(tier.sites))),
                servers=tuple(rand(st.permutations(tier.servers))),
            )
            for tier in pool.tiers  # tier order carries meaning: kept
        )
        result.append(dataclasses.replace(pool, tiers=tiers))
    return result


@st.composite
def _reordered_inputs(rand: st.DrawFn) -> tuple[list[BalancerPool], BalancerSettings]:
    digests = tuple(
        rand(st.permutations([hashlib.sha256(bytes([n])).hexdigest() for n in range(4)]))
    )
    return _shuffled(list(POOLS), rand), dataclasses.replace(SETTINGS, api_key_digests=digests)


@settings(max_examples=40, deadline=None)
@given(_reordered_inputs())
def test_output_does_not_depend_on_input_order(
    inputs: tuple[list[BalancerPool], BalancerSettings],
) -> None:
    pools, balancer = inputs
    canonical = dataclasses.replace(
        balancer, api_key_digests=tuple(sorted(balancer.api_key_digests))
    )
    assert render_haproxy_config(pools, balancer, MAP_DIR) == render(POOLS, canonical)


def _with_server(**changes: object) -> tuple[BalancerPool, ...]:
    tier = LLM.tiers[0]
    changed = dataclasses.replace(tier.servers[0], **changes)
    return (dataclasses.replace(LLM, tiers=(dataclasses.replace(tier, servers=(changed,)),)),)


def _with_tier(**changes: object) -> tuple[BalancerPool, ...]:
    return (dataclasses.replace(LLM, tiers=(dataclasses.replace(LLM.tiers[0], **changes),)),)


_FAR = BalancerTier(2, ("aws-usw2",), (server("voice.aws-usw2.n.0", "10.9.0.1"),))

Case = Callable[[], object]
VALIDATION_CASES: list[tuple[str, Case, str]] = [
    ("no pools", lambda: render_haproxy_config([], SETTINGS, MAP_DIR), "pools: no pool given"),
    (
        "pool name injects a line",
        lambda: render((dataclasses.replace(LLM, name="llm\nbackend evil"),)),
        "pools[0].name: 'llm\\nbackend evil'",
    ),
    ("empty pool name", lambda: render((dataclasses.replace(LLM, name=""),)), "pools[0].name:"),
    ("duplicate pool", lambda: render((LLM, LLM)), "pools[1].name: pool 'llm-8b' appears twice"),
    (
        "replica id with a space",
        lambda: render(_with_server(replica_id="llm 8b")),
        "pools[0].tiers[0].servers[0].replica_id:",
    ),
    (
        "replica id with a quote",
        lambda: render(_with_server(replica_id='llm"8b')),
        "pools[0].tiers[0].servers[0].replica_id:",
    ),
    (
        "replica in two pools",
        lambda: render((LLM, dataclasses.replace(LLM, name="llm-copy"))),
        "pools[1].tiers[0].servers[0].replica_id: replica",
    ),
    ("port 0", lambda: render(_with_server(port=0)), "servers[0].port: 0 is not a TCP port"),
    ("port too big", lambda: render(_with_server(port=70000)), "servers[0].port: 70000"),
    ("agent port", lambda: render(_with_server(agent_port=-1)), "servers[0].agent_port: -1"),
    (
        "address with an option",
        lambda: render(_with_server(address="10.0.0.1 backup")),
        "servers[0].address:",
    ),
    (
        "health path without slash",
        lambda: render(_with_server(health_path="health")),
        "servers[0].health_path:",
    ),
    (
        "health path with a space",
        lambda: render(_with_server(health_path="/health check")),
        "servers[0].health_path:",
    ),
    (
        "server site not in tier",
        lambda: render(_with_server(site="aws-use1")),
        "servers[0].site: site 'aws-use1' is not one of the tier's sites",
    ),
    ("tier without sites", lambda: render(_with_tier(sites=())), "pools[0].tiers[0].sites:"),
    (
        "pool without servers",
        lambda: render(_with_tier(servers=())),
        "pools[0].tiers: pool 'llm-8b' has no server",
    ),
    (
        "site in two tiers",
        lambda: render(
            (
                dataclasses.replace(
                    VOICE,
                    tiers=(
                        *VOICE.tiers,
                        dataclasses.replace(_FAR, priority=3, sites=("aws-use1",)),
                    ),
                ),
            )
        ),
        "pools[0].tiers[2].sites[0]: site 'aws-use1' is in more than one tier",
    ),
    (
        "duplicate priority",
        lambda: render(
            (
                dataclasses.replace(
                    VOICE, tiers=(*VOICE.tiers, dataclasses.replace(_FAR, priority=1))
                ),
            )
        ),
        "pools[0].tiers[2].priority: priority 1 is used twice",
    ),
    (
        "mixed health paths",
        lambda: render(
            (
                dataclasses.replace(
                    VOICE,
                    tiers=(
                        dataclasses.replace(
                            VOICE.tiers[0],
                            servers=(
                                *VOICE.tiers[0].servers[1:],
                                dataclasses.replace(
                                    VOICE.tiers[0].servers[0], health_path="/ready"
                                ),
                            ),
                        ),
                    ),
                ),
            )
        ),
        "pools[0].tiers[0].servers: servers disagree on the health path",
    ),
    (
        "replica capacity of zero",
        lambda: render((dataclasses.replace(VOICE, max_concurrency=0),)),
        "pools[0].max_concurrency: 0 is not a positive whole number; use >= 1",
    ),
    (
        "replica capacity as a flag",
        lambda: render((dataclasses.replace(VOICE, max_concurrency=True),)),
        "pools[0].max_concurrency: True is not a positive whole number; use >= 1",
    ),
    (
        "queue budget as long as the first-token budget",
        lambda: render((dataclasses.replace(VOICE, queue_budget_ms=1000),)),
        "pools[0].queue_budget_ms: 1000 is not between 1 and first_token_timeout_ms (1000),"
        " which also holds the replica's prefill; give a smaller budget, or None for the default",
    ),
    (
        "tier connect timeout",
        lambda: render(_with_tier(connect_timeout_ms=0)),
        "pools[0].tiers[0].connect_timeout_ms: 0 is not positive",
    ),
    ("endpoint port", lambda: render(balancer=BalancerSettings(port=0)), "settings.port: 0"),
    (
        "exporter on the endpoint port",
        lambda: render(balancer=BalancerSettings(port=9000, prometheus_port=9000)),
        "settings.prometheus_port: 9000 is also the endpoint port",
    ),
    (
        "bind address",
        lambda: render(balancer=BalancerSettings(bind_address="0.0.0.0:80")),
        "settings.bind_address:",
    ),
    (
        "api key in plaintext",
        lambda: render(balancer=BalancerSettings(api_key_digests=("sk-plain",))),
        "settings.api_key_digests[0]: is not a SHA-256 hex digest",
    ),
    (
        "cert path with a space",
        lambda: render(balancer=BalancerSettings(tls_cert_path="/etc/my cert.pem")),
        "settings.tls_cert_path:",
    ),
    (
        "socket path with a quote",
        lambda: render(balancer=BalancerSettings(stats_socket="/run/'x")),
        "settings.stats_socket:",
    ),
    (
        "zero agent interval",
        lambda: render(balancer=BalancerSettings(agent_inter_ms=0)),
        "settings.agent_inter_ms: 0 is not positive",
    ),
    ("map dir", lambda: render_haproxy_config(POOLS, SETTINGS, "/etc/my maps"), "map_dir:"),
    (
        "scope of a key not listed",
        lambda: render(balancer=_scoped(KeyScope(OTHER_KEY, ("voice",)), listed=False)),
        f"settings.key_scopes[0].digest: {OTHER_KEY[:12]}... is not one of api_key_digests",
    ),
    (
        "scope naming a pool not served",
        lambda: render(balancer=_scoped(KeyScope(OTHER_KEY, ("vocie",)))),
        f"settings.key_scopes[0].pools: key {OTHER_KEY[:12]}... may use pool 'vocie', which is"
        " not served; use one of llm-8b, voice",
    ),
    (
        "scope with no pool",
        lambda: render(balancer=_scoped(KeyScope(OTHER_KEY, ()))),
        "settings.key_scopes[0].pools: is empty",
    ),
    (
        "scope limiting nothing",
        lambda: render(balancer=_scoped(KeyScope(OTHER_KEY))),
        "settings.key_scopes[0]: limits nothing; give pools, a rate, or both",
    ),
    (
        "rate of zero",
        lambda: render(balancer=_scoped(KeyScope(OTHER_KEY, None, 0))),
        "settings.key_scopes[0].rate: 0 is not positive",
    ),
    (
        "key scoped twice",
        lambda: render(
            balancer=_scoped(KeyScope(OTHER_KEY, ("voice",)), KeyScope(OTHER_KEY, None, 3))
        ),
        f"settings.key_scopes[1].digest: {OTHER_KEY[:12]}... is not one of api_key_digests, or"
        " is scoped twice",
    ),
]


@pytest.mark.parametrize(
    ("make", "message"),
    [(make, message) for _, make, message in VALIDATION_CASES],
    ids=[name for name, _, _ in VALIDATION_CASES],
)
def test_invalid_inputs_are_rejected_with_one_line_naming_field_and_fix(
    make: Case, message: str
) -> None:
    with pytest.raises(BalancerConfigError) as raised:
        make()
    text = str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert message in text
    assert "\n" not in text
    assert "; " in text  # problem; fix
    assert text.startswith(raised.value.field)


@pytest.mark.parametrize(
    ("voice_models", "problem"),
    [
        (("llm-8b",), r"pools\[\d\]\.models\[0\].*'llm-8b' would route to pools"),
        (("whisper large",), r"pools\[\d\]\.models\[0\].*characters"),
        (("x'y",), r"pools\[\d\]\.models\[0\].*characters"),
    ],
)
def test_a_model_name_routes_to_one_pool_and_stays_inside_its_quotes(
    voice_models: tuple[str, ...], problem: str
) -> None:
    with pytest.raises(BalancerConfigError, match=problem):
        render((dataclasses.replace(VOICE, models=voice_models), LLM))


def test_aliases_route_to_their_pool_and_are_listed() -> None:
    rendered = render((dataclasses.replace(VOICE, models=("tts-1", "voice")), LLM))
    assert rendered.files["pools.map"].splitlines()[1:] == [
        "llm-8b llm-8b",
        "tts-1 voice",
        "voice voice",
    ]
    listed = re.search(r"string '(\{\"object\":\"list\".*?)' if METH_GET", rendered.haproxy_cfg)
    assert listed is not None
    assert [m["id"] for m in json.loads(listed.group(1))["data"]] == ["llm-8b", "tts-1", "voice"]


@pytest.mark.parametrize(
    ("round_trip_ms", "connect_ms"),
    [
        (0.0, 7),  # a local site: the busy host's scheduling alone
        (0.3, 8),  # a region: two round trips, rounded up
        (75.0, 157),  # another continent
        (600.0, 1000),  # past 1 s a lost SYN is resent anyway: no longer
    ],
)
def test_a_tiers_connect_timeout_follows_its_round_trip(
    round_trip_ms: float, connect_ms: int
) -> None:
    assert connect_timeout_for(round_trip_ms) == connect_ms
