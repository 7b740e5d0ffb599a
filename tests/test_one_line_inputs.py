"""Every name, image, address and user checked by a pattern is checked whole: a regular
expression's `$` also matches before a final newline, so a value ending in one would pass a
`match` and start a line of its own in a unit file, a rule set or a config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from denv_iac.core.stack.reader import StackError
from denv_iac.core.stack.stackfile import check_stack_name
from denv_iac.core.stack.values import is_host
from denv_iac.node.spec import NodeSpecError, spec_from_json

REPLICA = {"id": "voice.n1.0", "image": "ghcr.io/acme/voice:1.4", "port": 8000, "gpu": 0}


def node_spec(**changes: Any) -> None:
    replica = {**REPLICA, **changes.pop("replica", {})}
    spec_from_json({"node_id": "n1", "replicas": [replica], **changes})


def refused(call: Callable[[], object], error: type[Exception]) -> bool:
    try:
        call()
    except error:
        return True
    return False


@pytest.mark.parametrize(
    ("what", "call", "error"),
    [
        ("stack name", lambda v: check_stack_name(v), StackError),
        ("node id", lambda v: node_spec(node_id=v), NodeSpecError),
        ("replica id", lambda v: node_spec(replica={"id": v}), NodeSpecError),
        ("replica image", lambda v: node_spec(replica={"image": v}), NodeSpecError),
        ("replica env name", lambda v: node_spec(replica={"env": {v: "1"}}), NodeSpecError),
    ],
)
def test_a_value_ending_in_a_newline_is_refused(
    what: str, call: Callable[[str], object], error: type[Exception]
) -> None:
    good = {"replica image": "ghcr.io/acme/voice:1.4", "replica env name": "HF_TOKEN"}
    value = good.get(what, "voice1")
    assert not refused(lambda: call(value), error), what
    assert refused(lambda: call(value + "\n"), error), what


def test_a_host_name_ending_in_a_newline_is_no_host() -> None:
    assert is_host("gpu-1.example.com") and not is_host("gpu-1.example.com\n")
