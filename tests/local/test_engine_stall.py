"""Busy is not broken: a zombie engine is out of rotation within 2 s, a full one never.

A real local stack (simulated replicas with slots, their agents reading the engine's metrics,
HAProxy) with the stack's defaults: stall budget 1000 ms, metrics read every 250 ms.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from denv_iac.core.stack.reader import read_stack
from denv_iac.local.processes import free_port
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.demo import replica_fault
from tests.engine_load import agent_reply, all_up, server_row, streaming, wait_for, watch_full
from tests.stacks import local_site
from tests.timing import assert_within

pytestmark = pytest.mark.needs_haproxy

# The done-when goal: out of rotation within 2 s of the first stalled request.
ZOMBIE_OUT_S = 2.0
CONFIG = {
    "denv:sites": [local_site("local", nodes=2, gpus=1)],
    "denv:recipes": [
        {
            "name": "voice",
            "min_warm": 1,
            "spare": 1,
            "sites": ["local"],
            "max_concurrency": 4,
            # Two slots: the balancer's four requests leave two queued in the engine; each
            # stream (16 tokens, 30 ms apart) ends well inside the first-token budget.
            "simulate": {"ttft_ms": 20, "itl_ms": 30, "tokens": 16, "slots": 2},
        }
    ],
    "denv:balancer": {"sites": ["local"]},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunState]:
    cluster = LocalCluster(read_stack("t", CONFIG), tmp_path_factory.mktemp("run"), free_port())
    state = cluster.up()
    try:
        yield state
    finally:
        cluster.down()


def _row(state: RunState, replica_id: str) -> dict[str, str]:
    return server_row(Path(state.admin_socket), replica_id)


def _agent_reply(state: RunState, replica_id: str) -> str:
    replica = next(r for r in state.replicas if r.id == replica_id)
    return agent_reply("127.0.0.1", replica.agent_port, replica_id)


def _all_up(state: RunState) -> bool:
    return all_up(Path(state.admin_socket), [r.id for r in state.replicas])


@pytest.mark.timing
def test_a_zombie_is_out_of_rotation_within_2_s_and_back_once_it_makes_tokens(
    stack: RunState,
) -> None:
    wait_for("every replica up", lambda: _all_up(stack), 20)
    zombie = stack.replicas[0].id
    with streaming(stack.endpoint, streams=2):
        # The clock starts with a stream running on it: the first stalled request is at once.
        wait_for("a stream on the replica", lambda: int(_row(stack, zombie)["scur"] or 0) > 0, 5)
        replica_fault(stack, zombie, "zombie")
        out_s = wait_for(
            "the zombie marked down",
            lambda: _row(stack, zombie)["status"].startswith("DOWN"),
            ZOMBIE_OUT_S + 3,
        )
        assert_within(out_s, ZOMBIE_OUT_S, "zombie replica out of rotation")
        assert _agent_reply(stack, zombie).startswith("down #engine stalled")
        # Its healthy peer is never touched.
        assert _row(stack, stack.replicas[1].id)["status"] == "UP"
        replica_fault(stack, zombie, "none")
        # Back once the agent's own request shows a token: a metrics poll, that request, an
        # agent check.
        wait_for("the replica back up", lambda: _row(stack, zombie)["status"] == "UP", 5)
    assert _agent_reply(stack, zombie).startswith("up ready")


@pytest.mark.timing
def test_a_full_replica_is_never_marked_down_and_its_queue_lowers_its_weight(
    stack: RunState,
) -> None:
    wait_for("every replica up", lambda: _all_up(stack), 20)
    replies, states = watch_full(
        stack.endpoint,
        [r.id for r in stack.replicas],
        lambda r: _agent_reply(stack, r),
        lambda r: _row(stack, r)["status"],
    )
    assert states == {"UP"}, states
    assert all(reply.startswith("up ready") for reply in replies), replies
    assert any(reply != "up ready 100%" for reply in replies), replies
