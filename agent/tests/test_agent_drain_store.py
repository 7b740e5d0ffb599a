"""A drain state file the agent did not write drains every replica, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from denv_agent.state import Drains, DrainStore


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,  # deeper than the JSON reader recurses
        '{"node_drained": false, "drained_replicas": {"voice.local.node-a.0": 1}}',
    ],
    ids=["nested-too-deeply", "replicas-a-mapping"],
)
def test_a_state_file_the_agent_did_not_write_drains_every_replica(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "state.json"
    path.write_text(text)
    assert DrainStore(path).load() == Drains(unreadable="state file unreadable")
