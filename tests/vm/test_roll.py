"""A recipe change rolled under load on VMs, through NodeSetup's provider: the stack of
tests/vm/test_stack.py (a TLS balancer host, two joined machines of two GPUs, each replica the
simulator run by its own systemd unit), its pool with `min_warm: 2, spare: 2` so that a replica
can leave rotation while the rest carry the load.

The recipe's env changes. Each machine's deploy is diffed as the engine diffs it (the nodes
update in place, the balancer host has nothing to change), then each node's deploy runs as the
engine runs it: after the units `rollout_after` names for it (the pool's previous node), the
rest side by side. Meanwhile streamed chat and realtime sessions run through the endpoint, and
HAProxy's view of the pool is sampled every half second.

Asserted: lost 0, cut 0, replayed 0 (counted as in test_stack.py); at least `min_warm` replicas
in rotation at every sample; every replica runs the new env; the second run of each deploy
diffs and applies nothing. Timed: the rollout, each node's deploy, and how long each replica
stayed drained before its restart (the wait for its in-flight work).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from denv_iac.core.rollout import rollout_after, rollout_units
from denv_iac.core.sites import node_id
from denv_iac.core.stack.reader import read_stack
from tests.vm.bed import Bed
from tests.vm.conftest import TIMINGS
from tests.vm.test_join import provider
from tests.vm.test_stack import (
    CONCURRENCY,
    MACHINES,
    NODES,
    OFFICE,
    Stack,
    assert_second_run_changes_nothing,
    build_stack,
    deploy_inputs,
    stack_config,
    under_load,
)

pytestmark = pytest.mark.vm

# Sized for the bed: a stream lasts about a second, a realtime session one load round (5 s),
# so none should outlive the drain bound; a simulated replica is warm within seconds.
RECIPE = {"min_warm": 2, "spare": 2, "drain_timeout_s": 60, "cold_start_budget_s": 120}
LOAD = {"chat": CONCURRENCY, "realtime": 2}
ROLL_STEP = "roll (drain, restart, warm, undrain)"


@pytest.fixture(scope="module")
def stack(bed: Bed) -> Stack:
    return build_stack(bed, RECIPE)


def in_engine_order(
    after: dict[str, tuple[str, ...]], run: Callable[[str], Any]
) -> dict[str, tuple[float, float, Any]]:
    """`run` for each node as the engine runs dependent updates: each once the nodes it waits
    on have ended, the rest at once; (start, end, result) by node."""
    ended = {node: threading.Event() for node in after}
    times: dict[str, tuple[float, float, Any]] = {}

    def one(node: str) -> None:
        for before in after[node]:
            ended[before].wait()
        start = time.monotonic()
        try:
            result = run(node)
            times[node] = (start, time.monotonic(), result)
        finally:
            times.setdefault(node, (start, time.monotonic(), None))
            ended[node].set()

    with ThreadPoolExecutor(max_workers=len(after)) as pool:
        for future in [pool.submit(one, node) for node in after]:
            future.result()
    return times


def drained_for(seen: list[tuple[float, dict[str, str]]], replica: str) -> float | None:
    """Seconds from HAProxy's first sample of `replica` drained to its first sample of it
    otherwise (down for its restart, or back UP): its wait for in-flight work, to a sample."""
    start = next((t for t, states in seen if states.get(replica, "").startswith("DRAIN")), None)
    if start is None:
        return None
    end = next(
        (t for t, s in seen if t > start and not s.get(replica, "").startswith("DRAIN")), None
    )
    return None if end is None else end - start


def roll(stack: Stack, label: str, version: str, quiet_s: int | None = None) -> None:
    """The recipe's env changed to DENV_ROLL=`version`, rolled under load; `quiet_s`: the
    nodes' drains given that window instead of the product's."""
    changed = {**RECIPE, "env": {"DENV_ROLL": version}}
    spec = read_stack("vm", stack_config(stack.nodes, changed))
    placement, specs, rendered = deploy_inputs(spec, stack.nodes)
    if quiet_s is not None:
        specs = {name: dataclasses.replace(s, quiet_s=quiet_s) for name, s in specs.items()}
    assert {r.id for s in specs.values() for r in s.replicas} == set(stack.replicas)
    stack.spec, stack.specs, stack.rendered = spec, specs, rendered
    diffs = {
        m: provider(stack.bed, "diff", stack.ids[m], stack.state[m], stack.inputs(m))
        for m in MACHINES
    }
    assert diffs["balancer"] == {"changes": False, "replaces": []}, diffs
    for name in NODES:
        assert diffs[name] == {"changes": True, "replaces": []}, (name, diffs[name])
    ids = {node_id(OFFICE, name): name for name in NODES}
    after = {
        ids[node]: tuple(ids[b] for b in before)
        for node, before in rollout_after(rollout_units(spec, placement)).items()
    }
    assert after == {"node1": (), "node2": ("node1",)}, after

    def update(name: str) -> list[str]:
        inputs = stack.inputs(name)
        args = (stack.ids[name], stack.state[name], inputs)
        try:
            outs = provider(stack.bed, "update", *args)["outs"]
        except AssertionError as error:
            # The emulated machines on shared cores: pyinfra's connect may time out. Nothing ran
            # then (the engine would fail the up; `pulumi up` again is the operator's retry).
            if "CannotConnect" not in str(error):
                raise
            TIMINGS[f"{label}: {name}'s update could not connect; again"] = 0.0
            outs = provider(stack.bed, "update", *args)["outs"]
        stack.state[name] = outs
        applied: list[str] = outs["applied"]
        return applied

    with under_load(stack, label, load=LOAD) as counted:
        runs = in_engine_order(after, update)
        roll_s = max(end for _, end, _ in runs.values()) - min(s for s, _, _ in runs.values())
        stack.wait(stack.at_full_strength, "every replica UP after the roll")
    (done,) = counted
    min_warm = RECIPE["min_warm"]
    TIMINGS[f"{label}: rollout of 4 replicas on 2 nodes under load ({done.line})"] = roll_s
    for name, (start, end, _) in runs.items():
        TIMINGS[f"{label}: {name}'s deploy (provider update)"] = end - start
    for replica in sorted(stack.replicas):
        waited = drained_for(done.seen, replica) or -1.0
        TIMINGS[f"{label}: {replica} drained before its restart (to a 0.5 s sample)"] = waited
    TIMINGS[
        f"{label}: samples of HAProxy's view {len(done.ready)}, fewest replicas in rotation"
        f" {min(done.ready, default=-1)} (min_warm {min_warm})"
    ] = 0.0
    assert runs["node2"][0] >= runs["node1"][1], "node2's deploy started before node1's ended"
    for name, (_, _, applied) in runs.items():
        rolled = {step.split(":")[1].strip() for step in applied if step.endswith(ROLL_STEP)}
        assert rolled == {r.id for r in specs[name].replicas}, (name, applied)
    assert (done.lost, done.cut, done.replayed) == ([], 0, 0), done.why
    assert done.ready and min(done.ready) >= min_warm, (done.ready, done.why)
    for replica, (name, _) in stack.replicas.items():
        unit = f"denv-replica-{replica}.service"
        pid = stack.nodes[name].ssh(f"systemctl show -p MainPID --value {unit}").strip()
        env = stack.nodes[name].ssh(f"tr '\\0' '\\n' < /proc/{pid}/environ")
        assert f"DENV_ROLL={version}" in env.splitlines(), (replica, env)


def test_a_a_roll_whose_drains_wait_for_every_open_connection(stack: Stack) -> None:
    # As before idle connections were told apart: every established connection counted, idle
    # or not (a window longer than any connection here lives). The figures to compare with b.
    roll(stack, "a (every connection counted)", "1", quiet_s=3600)


def test_b_a_recipe_change_rolls_under_load_keeping_min_warm(stack: Stack) -> None:
    roll(stack, "b", "2")


def test_c_a_second_run_of_every_deploy_applies_nothing(stack: Stack) -> None:
    assert_second_run_changes_nothing(stack, "c")
