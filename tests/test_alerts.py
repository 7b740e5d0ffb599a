"""The stack's alerting rules, checked and unit-tested by Prometheus's own promtool."""

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.reader import read_stack
from denv_iac.ops.alerts import AGENT_JOB, BALANCER_JOB, alert_rules
from tests.stacks import local_site

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (make setup installs prometheus)"
)
CONFIG = {
    "denv:sites": [local_site("local", nodes=2, gpus=1)],
    "denv:recipes": [
        {"name": "voice", "min_warm": 2, "spare": 0, "sites": ["local"]},
        {"name": "llm-8b", "min_warm": 1, "spare": 0, "sites": ["local"]},
    ],
    "denv:balancer": {"sites": ["local"]},
}
STACK = read_stack("t", CONFIG)


def _promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )


def _rule_tests(
    tmp_path: Path,
    stack: StackSpec,
    series: list[dict[str, str]],
    alerts: list[Any],
    exprs: list[Any] | None = None,
) -> None:
    """Run promtool's unit tests of `stack`'s rules over `series`, sampled every 15 s."""
    (tmp_path / "rules.yml").write_text(alert_rules(stack))
    case: dict[str, Any] = {"interval": "15s", "input_series": series}
    if exprs:
        case["promql_expr_test"] = exprs
    case["alert_rule_test"] = alerts
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [case]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = _promtool(tmp_path, "test", "rules", "tests.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def _server(pool: str, replica: str, state: str, balancer: str = "lb-1:8405") -> dict[str, str]:
    labels = f'proxy="{pool}.tier10",server="{replica}",state="{state}",instance="{balancer}"'
    return {"series": f"haproxy_server_status{{{labels}}}"}


@needs_promtool
def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(alert_rules(STACK))
    checked = _promtool(tmp_path, "check", "rules", "rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # 4 alerts, 4 recording rules per pool (one pool of one tier, so no spill), 2 alerts.
    assert "SUCCESS: 14 rules found" in checked.stdout


@needs_promtool
def test_rules_fire_for_a_dead_agent_a_dead_balancer_and_a_short_pool(tmp_path: Path) -> None:
    # 15 s samples: the agent of n1 stops answering at 30 s, balancer lb-2 at 30 s; voice
    # loses one of its two replicas at 30 s; llm-8b keeps its one.
    series = [
        {"series": f'up{{job="{AGENT_JOB}",instance="n0:9101"}}', "values": "1x10"},
        {"series": f'up{{job="{AGENT_JOB}",instance="n1:9101"}}', "values": "1 1 0x8"},
        {"series": f'up{{job="{BALANCER_JOB}",instance="lb-2:8405"}}', "values": "1 1 0x8"},
        {**_server("voice", "voice.local.n0.0", "UP"), "values": "1x10"},
        {**_server("voice", "voice.local.n1.0", "UP"), "values": "1 1 0x8"},
        {**_server("voice", "voice.local.n1.0", "DOWN"), "values": "0 0 1x8"},
        {**_server("llm-8b", "llm-8b.local.n0.0", "UP"), "values": "1x10"},
    ]
    labels = {"severity": "critical", "stack": "t"}
    fired = [
        {
            "alertname": "DenvAgentDown",
            "exp_labels": {**labels, "job": AGENT_JOB, "instance": "n1:9101"},
            "exp_annotations": {
                "summary": "agent n1:9101 unreachable: its GPU faults go unseen, its replicas"
                " are routed on health checks alone"
            },
        },
        {
            "alertname": "DenvBalancerDown",
            "exp_labels": {**labels, "job": BALANCER_JOB, "instance": "lb-2:8405"},
            "exp_annotations": {
                "summary": "balancer lb-2:8405 is down: its clients must fail over to another"
                " balancer host"
            },
        },
        {
            "alertname": "DenvPoolBelowMinWarm",
            "exp_labels": {**labels, "pool": "voice"},
            "exp_annotations": {"summary": "pool voice: 1 healthy, below min_warm 2"},
        },
    ]
    alerts = [
        # Before the faults, and while they are younger than `for`: nothing.
        *(
            {"eval_time": t, "alertname": a, "exp_alerts": []}
            for t in ("15s", "50s")
            for a in ("DenvAgentDown", "DenvBalancerDown", "DenvPoolBelowMinWarm")
        ),
        *(
            {
                "eval_time": "90s",
                "alertname": alert["alertname"],
                "exp_alerts": [{k: v for k, v in alert.items() if k != "alertname"}],
            }
            for alert in fired
        ),
    ]
    _rule_tests(tmp_path, STACK, series, alerts)


def test_a_pool_with_no_balancer_reporting_is_short() -> None:
    (voice,) = [
        r
        for r in yaml.safe_load(alert_rules(STACK))["groups"][0]["rules"]
        if r.get("alert") == "DenvPoolBelowMinWarm" and r["labels"]["pool"] == "voice"
    ]
    assert voice["expr"] == (
        '(min(sum by (instance) (haproxy_server_status{proxy=~"voice\\\\.tier[0-9]+",'
        'state="UP"})) or vector(0)) < 2'
    )


def test_alerts_command_writes_the_rules_or_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stacks").mkdir()
    (tmp_path / "Pulumi.yaml").write_text("name: t\nruntime: python\n")
    (tmp_path / "stacks" / "Pulumi.t.yaml").write_text(yaml.safe_dump({"config": CONFIG}))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    printed = runner.invoke(main, ["alerts", "--stack", "t"])
    assert printed.exit_code == 0 and printed.output == alert_rules(STACK)
    written = runner.invoke(main, ["alerts", "--stack", "t", "--out", "rules.yml"])
    assert written.exit_code == 0 and written.output == "wrote rules.yml\n"
    assert (tmp_path / "rules.yml").read_text() == alert_rules(STACK)
    missing = runner.invoke(main, ["alerts", "--stack", "nope"])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1
    unwritable = runner.invoke(main, ["alerts", "--stack", "t", "--out", "no/such/dir/r.yml"])
    assert unwritable.exit_code == 2, unwritable.output
    assert unwritable.output.startswith("error: --out: cannot write no/such/dir/r.yml")


TWO_TIERS = read_stack(
    "t",
    {
        **CONFIG,
        "denv:sites": [local_site("local", nodes=2, gpus=1), local_site("far", nodes=1, gpus=1)],
        "denv:recipes": [
            {"name": "voice", "min_warm": 1, "spare": 0, "sites": ["local", "far"]},
            {"name": "llm-8b", "min_warm": 1, "spare": 0, "sites": ["local"]},
        ],
    },
)
LB = "lb-1:8405"


def _series(metric: str, values: str, **labels: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in {**labels, "instance": LB}.items())
    return {"series": f"{metric}{{{text}}}", "values": values}


def _answers_5xx(proxy: str, backend: str, server: str, by_server: str) -> list[dict[str, str]]:
    """A backend's 5xx answers, and those of its one server (the replica's own)."""
    metric = "haproxy_{}_http_responses_total"
    return [
        _series(metric.format("backend"), backend, proxy=proxy, code="5xx"),
        _series(metric.format("server"), by_server, proxy=proxy, server=server, code="5xx"),
    ]


@needs_promtool
def test_saturation_is_recorded_per_pool_and_shedding_or_spilling_for_a_minute_alerts(
    tmp_path: Path,
) -> None:
    a, b, far = "voice.local.n0.0", "voice.local.n1.0", "voice.far.n0.0"
    llm = "llm-8b.local.n0.0"
    # 15 s samples. From 30 s on, voice's balancer answers 6 requests itself (503 pool_full)
    # and sends 3 to the far tier every 15 s; llm-8b's replica answers 2 5xx of its own.
    series = [
        _series("haproxy_server_current_sessions", "2x12", proxy="voice.tier10", server=a),
        _series("haproxy_server_current_sessions", "1x12", proxy="voice.tier10.speech", server=a),
        # Realtime sessions are no slots.
        _series("haproxy_server_current_sessions", "5x12", proxy="voice.tier10.realtime", server=a),
        _series("haproxy_server_limit_sessions", "2x12", proxy="voice.tier10", server=a),
        _series("haproxy_server_limit_sessions", "2x12", proxy="voice.tier10", server=b),
        _series("haproxy_server_status", "1x12", proxy="voice.tier10", server=a, state="UP"),
        _series("haproxy_server_status", "0x12", proxy="voice.tier10", server=b, state="UP"),
        _series("haproxy_backend_current_queue", "3x12", proxy="voice.tier10"),
        _series("haproxy_server_current_queue", "1x12", proxy="voice.tier10", server=a),
        *_answers_5xx("voice.tier10", "0 0 0+6x10", a, "0x12"),
        _series("haproxy_backend_sessions_total", "0 0 0+3x10", proxy="voice.tier20"),
        _series("haproxy_server_current_sessions", "1x12", proxy="voice.tier20", server=far),
        *_answers_5xx("llm-8b.tier10", "0+2x12", llm, "0+2x12"),
    ]
    labels = {"stack": "t", "pool": "voice", "instance": LB}
    exprs = [
        {
            "expr": '{__name__=~"denv:pool_.+",pool="voice"}',
            "eval_time": "90s",
            "exp_samples": [
                {"labels": f'{name}{{instance="{LB}",pool="voice",stack="t"}}', "value": value}
                for name, value in (
                    ("denv:pool_slots_in_use", 4),  # 2 + 1 speech + 1 far tier
                    ("denv:pool_slots", 2),  # b is down
                    ("denv:pool_queued", 4),
                    ("denv:pool_shed:rate1m", 0.4),
                    ("denv:pool_spilled:rate1m", 0.2),
                )
            ],
        },
        {
            # The replica's own 5xx are not shed.
            "expr": 'denv:pool_shed:rate1m{pool="llm-8b"}',
            "eval_time": "90s",
            "exp_samples": [
                {
                    "labels": f'denv:pool_shed:rate1m{{instance="{LB}",pool="llm-8b",stack="t"}}',
                    "value": 0,
                }
            ],
        },
    ]
    add = "add capacity (min_warm or spare, or max_concurrency if its replicas take more)"
    alerts = [
        # Shedding and spilling for less than a minute: nothing yet.
        *(
            {"eval_time": "75s", "alertname": alert, "exp_alerts": []}
            for alert in ("DenvPoolShedding", "DenvPoolSpilling")
        ),
        {
            "eval_time": "165s",
            "alertname": "DenvPoolShedding",
            "exp_alerts": [
                {
                    "exp_labels": {**labels, "severity": "critical"},
                    "exp_annotations": {
                        "summary": f"pool voice sheds 0.4 requests/s at balancer {LB}: every"
                        " slot of every allowed tier is taken past the first-token budget, and"
                        f" its clients get 503 pool_full; {add}"
                    },
                }
            ],
        },
        {
            "eval_time": "165s",
            "alertname": "DenvPoolSpilling",
            "exp_alerts": [
                {
                    "exp_labels": {**labels, "severity": "warning"},
                    "exp_annotations": {
                        "summary": f"pool voice sends 0.2 requests/s to a later tier at balancer"
                        f" {LB}: its first tier is full (or empty), so those requests pay the"
                        f" farther tier's latency; {add}"
                    },
                }
            ],
        },
    ]
    _rule_tests(tmp_path, TWO_TIERS, series, alerts, exprs)


def test_a_pool_of_one_tier_records_no_spill() -> None:
    rules = yaml.safe_load(alert_rules(TWO_TIERS))["groups"][0]["rules"]
    spilled = {
        r["labels"]["pool"]: r["expr"]
        for r in rules
        if r.get("record", "").startswith("denv:pool_spilled")
    }
    assert spilled == {
        "voice": 'sum by (instance) (rate(haproxy_backend_sessions_total{proxy=~"voice\\\\.tier(20)'
        '(\\\\.realtime|\\\\.speech)?"}[1m]))'
    }
