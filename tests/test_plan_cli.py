"""`denv plan` on the shipped stacks and on broken ones."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.core.stack.catalog import load_catalog

ROOT = Path(__file__).resolve().parents[1]
STACKS = ROOT / "stacks"


def run(*args: str, stacks: Path = STACKS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "denv_iac", *args, "--stacks-dir", str(stacks)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_local_plan_table() -> None:
    result = CliRunner().invoke(main, ["plan", "--stack", "local", "--stacks-dir", str(STACKS)])
    assert result.exit_code == 0, result.output
    for replica in (
        "voice.local.node-a.0",
        "voice.local.node-b.0",
        "side.local.node-a.1.0",
        "side.local.node-b.1.0",
    ):
        assert replica in result.output
    assert "Warm capacity: $0.00/hour" in result.output
    shown = " ".join(result.output.split())
    assert (
        "Balancer timers: connect 80 ms, health check 500 ms every 1000 ms, agent every 200 ms;"
        " a replica that has just died costs the next request up to its tier's connect timeout"
    ) in shown
    # Every site of the local stack is on the balancer's machine: round trip 0, 5 ms.
    assert "voice tier 10 (local): connect 7 ms (round trip 0 ms)" in shown


def test_multicloud_plan_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        main,
        ["plan", "--stack", "voice-multicloud", "--stacks-dir", str(STACKS), "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert set(plan) >= {"replicas", "nodes", "cost"}
    assert set(plan["replicas"][0]) >= {"id", "pool", "site", "node", "gpu", "share"}
    voice_sites = {r["site"] for r in plan["replicas"] if r["pool"] == "voice"}
    assert len(voice_sites) == 3  # survive: site with min_warm 2 needs three sites
    assert plan["cost"]["usd_per_hour"] > 0
    assert plan["cost"]["usd_per_month"] == pytest.approx(plan["cost"]["usd_per_hour"] * 730, 0.01)
    assert "v1:" not in out.read_text()  # no ciphertext, let alone a secret, in the plan
    # --json carries the resource graph too: every provider the stack's sites use.
    types = {r["type"] for r in plan["resources"]}
    for kind in ("denv:index:AwsSite", "denv:index:LambdaSite", "denv:index:NebiusSite"):
        assert kind in types
    assert {"denv:index:HetznerSite", "denv:index:JoinedSite", "denv:index:Cluster"} <= types
    assert any(t.startswith("aws:ec2/instance") for t in types)
    assert any(t.startswith("nebius:") for t in types)
    assert any(t.startswith("hcloud:") for t in types)
    assert "[secret]" in out.read_text()


def write_stack(folder: Path, config: object) -> Path:
    (folder / "Pulumi.bad.yaml").write_text(yaml.safe_dump({"config": config}))
    return folder


def test_bad_stack_exits_2_with_every_line_and_no_traceback(tmp_path: Path) -> None:
    config = {
        "denv:sites": [
            {"name": "a", "kind": "local", "nodes": [{"name": "n", "gpu": "L40S", "gpus": 1}]}
        ],
        "denv:recipes": [{"name": "v", "gpu": "1g.10gb", "min_warm": 0, "sites": ["a", "b"]}],
        "denv:balancer": {"sites": ["a"]},
    }
    result = run("plan", "--stack", "bad", stacks=write_stack(tmp_path, config))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "error: recipes[0].min_warm: 0 is out of range; use a number from 1 to 10000",
        'error: recipes[0].gpu: MIG profile "1g.10gb" does not exist on L40S (L40S has no MIG, '
        "site a); use a whole GPU",
        'error: recipes[0].sites: site "b" is not defined; define it under denv:sites or use one '
        "of a",
    ]


def test_reference_errors_reported_together(tmp_path: Path) -> None:
    config = {
        "denv:sites": [
            {"name": "a", "kind": "local", "nodes": [{"name": "n", "gpu": "L40S", "gpus": 1}]}
        ],
        "denv:recipes": [{"name": "v", "gpu": "1g.10gb", "min_warm": 1, "sites": ["a", "b"]}],
        "denv:balancer": {"sites": ["a"]},
    }
    result = run("plan", "--stack", "bad", stacks=write_stack(tmp_path, config))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'error: recipes[0].gpu: MIG profile "1g.10gb" does not exist on L40S (L40S has no MIG, '
        "site a); use a whole GPU",
        'error: recipes[0].sites: site "b" is not defined; define it under denv:sites or use one '
        "of a",
    ]


def test_capacity_shortfall_exits_2(tmp_path: Path) -> None:
    config = {
        "denv:sites": [
            {"name": "a", "kind": "local", "nodes": [{"name": "n", "gpu": "H100", "gpus": 8}]}
        ],
        "denv:recipes": [{"name": "v", "min_warm": 1, "sites": ["a"]}],
        "denv:balancer": {"sites": ["a"]},
    }
    result = run("plan", "--stack", "bad", stacks=write_stack(tmp_path, config))
    assert result.returncode == 2
    assert "v needs 2 GPUs on >= 2 nodes" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "config: [1",
            "error: Pulumi.bad.yaml line 1: expected ',' or ']', but got '<stream end>'; "
            "fix the YAML syntax",
        ),
        ("- 1\n", "error: Pulumi.bad.yaml: expected a mapping with a config: key"),
        ("config: 3\n", "error: Pulumi.bad.yaml: config: must be a mapping of keys to values"),
    ],
)
def test_malformed_stack_file(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "Pulumi.bad.yaml").write_text(text)
    result = run("plan", "--stack", "bad", stacks=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == expected


def test_unknown_stack_lists_the_known_ones() -> None:
    result = run("plan", "--stack", "nope")
    assert result.returncode == 2
    known = sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in STACKS.glob("Pulumi.*.yaml"))
    assert "local" in known and "voice-multicloud" in known
    assert f"stacks here: {', '.join(known)}" in result.stderr


def test_lock_pins_replicas(tmp_path: Path) -> None:
    config = yaml.safe_load((STACKS / "Pulumi.local.yaml").read_text())["config"]
    write_stack(tmp_path, config)
    assert run("plan", "--stack", "bad", "--lock").returncode == 2  # wrong folder is refused
    result = run("plan", "--stack", "bad", "--lock", stacks=tmp_path)
    assert result.returncode == 0, result.stderr
    locked = json.loads((tmp_path / "Pulumi.bad.placement.json").read_text())["replicas"]
    assert "voice.local.node-a.0" in locked
    # A new node listed first would win first-fit; the lock keeps voice where it was.
    config["denv:sites"][0]["nodes"].insert(0, {"name": "node-0", "gpu": "H100", "gpus": 2})
    write_stack(tmp_path, config)
    result = run("plan", "--stack", "bad", "--json", "-", stacks=tmp_path)
    assert result.returncode == 0, result.stderr
    assert set(locked) <= {r["id"] for r in json.loads(result.stdout)["replicas"]}


def test_key_digest() -> None:
    result = CliRunner().invoke(main, ["key", "digest"], input="test\n")
    assert result.output.strip() == (
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    )


def test_plan_names_when_and_where_each_list_price_was_read(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--stack", "voice-multicloud", "--stacks-dir", str(STACKS)]
    shown = CliRunner().invoke(main, args)
    assert shown.exit_code == 0, shown.output
    assert CliRunner().invoke(main, [*args, "--json", str(out)]).exit_code == 0
    prices = json.loads(out.read_text())["cost"]["list_prices"]
    # The stack creates nodes on AWS, Lambda, Nebius and Hetzner: each rests on a list price.
    assert len(prices) == 4
    catalog = load_catalog()
    for price in prices:
        offering = next(
            o
            for by_name in catalog.offerings.values()
            for o in by_name.values()
            if o.name == price["offering"]
        )
        assert (price["read"], price["source"]) == (offering.price_read, offering.source)
        price_line = f"{offering.name}: ${offering.usd_per_gpu_hour:,.2f}/GPU-hour"
        assert f"{price_line}, read {offering.price_read}, source: " in shown.output
        assert offering.source in " ".join(shown.output.split())
