"""The stack's alerting rules, checked and unit-tested by Prometheus's own promtool."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.ops.alerts import AGENT_JOB, BALANCER_JOB, alert_rules
from denv_iac.spec.reader import read_stack
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


def _server(pool: str, replica: str, state: str, balancer: str = "lb-1:8405") -> dict[str, str]:
    labels = f'proxy="{pool}.tier10",server="{replica}",state="{state}",instance="{balancer}"'
    return {"series": f"haproxy_server_status{{{labels}}}"}


@needs_promtool
def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(alert_rules(STACK))
    checked = _promtool(tmp_path, "check", "rules", "rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 4 rules found" in checked.stdout


@needs_promtool
def test_rules_fire_for_a_dead_agent_a_dead_balancer_and_a_short_pool(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(alert_rules(STACK))
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
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "alert_rule_test": [
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
                ],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = _promtool(tmp_path, "test", "rules", "tests.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_a_pool_with_no_balancer_reporting_is_short() -> None:
    (voice,) = [
        r
        for r in yaml.safe_load(alert_rules(STACK))["groups"][0]["rules"]
        if r.get("labels", {}).get("pool") == "voice"
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
