"""docs/dashboards/denv.json queries only metrics that HAProxy's exporter and the agent serve.

The metric names are read from a running local data plane: HAProxy's own Prometheus exporter
and a real agent's /metrics, so a renamed metric on either side fails here, not on a dashboard.
"""

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from denv_iac.core.stack.reader import read_stack
from denv_iac.local.processes import free_port
from denv_iac.local.run_state import RunState
from denv_iac.local.runner import LocalCluster
from denv_iac.ops.alerts import alert_rules
from tests.test_status import CONFIG

DASHBOARD = Path(__file__).parent.parent / "docs" / "dashboards" / "denv.json"
METRIC = re.compile(r"\b(?:haproxy|denv_agent|process)_[a-z0-9_]+")
# Each Prometheus type's series names, from the family name in its `# TYPE` line.
SUFFIXES = {"counter": ("", "_total"), "histogram": ("_bucket", "_sum", "_count")}


def exposed(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names |= {family + suffix for suffix in SUFFIXES.get(kind, ("",))}
    return names


def queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict):
                yield value["query"]
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    directory = tmp_path_factory.mktemp("dash") / "run"
    cluster = LocalCluster(read_stack("t", CONFIG), directory, free_port())
    state: RunState = cluster.up()
    try:
        time.sleep(0.3)  # one agent poll, so per-replica families have samples
        names = exposed(httpx.get(state.prometheus, timeout=5).text)
        for agent in state.agents:
            names |= exposed(httpx.get(f"http://127.0.0.1:{agent.http_port}/metrics").text)
        yield names
    finally:
        cluster.down()


@pytest.mark.needs_haproxy
def test_every_queried_metric_is_served(served: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for query in queries(dashboard) for name in METRIC.findall(query)}
    assert {"haproxy_server_status", "haproxy_backend_active_servers"} <= used
    assert any(name.startswith("denv_agent_") for name in used)
    assert used - served == set()


def test_panels_have_unique_ids_and_a_query() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert all(p["targets"] for p in panels if p["type"] != "row")


@pytest.mark.needs_haproxy
def test_every_metric_of_the_alert_rules_is_served(served: set[str]) -> None:
    used = set(METRIC.findall(alert_rules(read_stack("t", CONFIG))))
    assert {"haproxy_server_current_sessions", "haproxy_backend_current_queue"} <= used
    assert used - served == set()
