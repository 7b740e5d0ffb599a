"""A replica's own 503 (an engine loading its model after a restart answers it, as llama.cpp's
`Loading model` does) is retried on another replica before any byte reaches the client, in the
moments before the health checks have taken it out."""

import asyncio
from pathlib import Path

import httpx
import pytest

from benchmarks.lab.waiting import eventually
from denv_iac.core.stack.reader import read_stack
from denv_iac.local.processes import free_port
from denv_iac.local.replica_model import control_headers
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.loadgen import run_load
from tests.stacks import local_site

pytestmark = pytest.mark.needs_haproxy

CONFIG = {
    "denv:sites": [local_site("local", nodes=2, gpus=1)],
    "denv:recipes": [
        {
            "name": "chat",
            "min_warm": 1,
            "spare": 1,
            "sites": ["local"],
            "simulate": {"ttft_ms": 20, "itl_ms": 5, "tokens": 4},
        }
    ],
    "denv:balancer": {"sites": ["local"]},
}


def test_a_replica_answering_503_while_it_restarts_costs_the_client_nothing(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(read_stack("t", CONFIG), tmp_path, free_port())
    state = cluster.up()
    try:
        victim = state.replicas[0]
        # Restarting for 2 s: every request and health check it gets is answered 503.
        httpx.post(
            f"{victim.url}/control/fault",
            json={"mode": "engine_restart", "k": 2000},
            headers=control_headers(state.control_token),
        ).raise_for_status()
        report = asyncio.run(run_load(state.endpoint, "chat", concurrency=4, duration_s=1.5))
        assert report.errors() == {}, report.errors()
        assert len(report.results) >= 20
        # It met some of them (nothing else had taken it out yet) and each went elsewhere.
        served_by = {r.replica for r in report.results}
        assert served_by == {state.replicas[1].id}
        stats = httpx.get(f"{victim.url}/stats").json()
        assert stats["requests"] >= 1, "the restarting replica was never tried"
        eventually(lambda: httpx.get(f"{victim.url}/health").status_code == 200, 5, "restarted")
    finally:
        cluster.down()
