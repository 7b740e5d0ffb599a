"""A recipe change on a node rolls each serving replica: drain, wait for its connections,
restart, healthy within the bound, undrain; one that never answers stops the deploy, named."""

import dataclasses
import os
import stat
import subprocess
from pathlib import Path

from denv_iac.core.balancer.model import BalancerSettings
from denv_iac.core.balancer.tiers import rejoin_ms
from denv_iac.node import replicas
from denv_iac.node.plan import plan_node
from denv_iac.node.spec import ReplicaSpec

from .fixtures import converged, node_facts
from .test_plan import FRESH, spec


def _titles(new_image: str, active: bool = True) -> list[str]:
    before = spec()
    facts = converged(node_facts(), before, FRESH)
    if not active:
        facts = dataclasses.replace(facts, active_units=frozenset())
    voice0, voice1 = before.replicas
    after = dataclasses.replace(
        before, replicas=(dataclasses.replace(voice0, image=new_image), voice1)
    )
    return [s.title for s in plan_node(facts, after) if s.area == "replicas"]


def test_a_changed_serving_replica_is_rolled_and_the_other_left_alone() -> None:
    unit = "/etc/systemd/system/denv-replica-voice.hetzner.gex44-1.0.service"
    assert _titles("ghcr.io/acme/voice:1.5") == [
        f"voice.hetzner.gex44-1.0: write {unit}",
        "voice.hetzner.gex44-1.0: roll (drain, restart, warm, undrain)",
    ]
    assert _titles("ghcr.io/acme/voice:1.4") == []  # nothing changed: nothing applied


def test_a_replica_that_was_not_serving_is_just_started() -> None:
    titles = _titles("ghcr.io/acme/voice:1.5", active=False)
    assert "voice.hetzner.gex44-1.0: (re)start" in titles
    assert not any("roll" in t for t in titles)


def _stand_ins(bin_dir: Path, healthy: bool) -> Path:
    """denv-agent, systemctl, ss and curl that log what they were asked to a file."""
    log = bin_dir / "log"
    scripts = {
        "denv-agent": f'echo "agent $*" >> {log}',
        "systemctl": f'echo "systemctl $*" >> {log}',
        "ss": "exit 0",  # no connection left on the port
        "curl": f'echo "curl" >> {log}; exit {0 if healthy else 7}',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return log


def _roll(tmp_path: Path, healthy: bool) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = _stand_ins(tmp_path, healthy)
    node = dataclasses.replace(spec(), drain_timeout_s=5, ready_timeout_s=1, rejoin_s=1)
    replica: ReplicaSpec = node.replicas[0]
    done = subprocess.run(
        ["sh", "-c", replicas.roll_command(node, replica)],
        env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done, log.read_text().splitlines()


def test_the_roll_drains_restarts_waits_for_health_then_undrains(tmp_path: Path) -> None:
    done, log = _roll(tmp_path, healthy=True)
    assert done.returncode == 0, done.stderr
    assert log == [
        "agent drain --replica voice.hetzner.gex44-1.0",
        "systemctl restart denv-replica-voice.hetzner.gex44-1.0.service",
        "curl",
        "agent undrain --replica voice.hetzner.gex44-1.0",
    ]
    assert "no streams open" in done.stdout


def test_a_replica_that_never_answers_stops_the_deploy_named_and_left_drained(
    tmp_path: Path,
) -> None:
    done, log = _roll(tmp_path, healthy=False)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "replica voice.hetzner.gex44-1.0 never became healthy within ready_timeout_s 1 s after "
        "its restart: left drained, the rollout stopped, the pool's other replicas serve the "
        "old version"
    ]
    assert log[0].startswith("agent drain") and not any("undrain" in line for line in log)


def test_a_node_waits_after_each_undrain_as_long_as_its_balancers_take_to_count_it_up() -> None:
    # The agent's next answer, one check interval, then two passing checks at fastinter, each
    # up to its timeout.
    settings = BalancerSettings(agent_inter_ms=200, check_inter_ms=2000, check_timeout_ms=2000)
    assert rejoin_ms(settings) == 200 + 2000 + 2 * (500 + 2000)
    node = dataclasses.replace(spec(), rejoin_s=7)
    command = replicas.roll_command(node, node.replicas[0])
    assert "undrain --replica voice.hetzner.gex44-1.0 >/dev/null; sleep 7;" in command


def test_a_drained_replica_is_counted_only_once_its_balancers_heard_the_drain() -> None:
    # A request the balancers send before their next agent check would land after a count of
    # none and be cut by the restart: the count waits `rejoin_s`, which bounds that check.
    node = dataclasses.replace(spec(), rejoin_s=7)
    command = replicas.roll_command(node, node.replicas[0])
    drain = command.index("denv-agent drain --replica voice.hetzner.gex44-1.0")
    settle = command.index("sleep 7; ")
    count = command.index("ss -Htni")
    restart = command.index("systemctl restart")
    assert drain < settle < count < restart
