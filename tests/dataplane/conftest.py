"""Fixtures that bring up a real data plane on 127.0.0.1 and always take it down."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lab.dataplane import Dataplane

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs a data plane, and so HAProxy (the root conftest skips them without)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.needs_haproxy)


@pytest.fixture
def start_dataplane(tmp_path: Path) -> Iterator[Callable[..., Dataplane]]:
    """Start data planes on demand; every one started is closed after the test, pass or fail."""
    planes: list[Dataplane] = []

    def start(**kwargs: Any) -> Dataplane:
        plane = Dataplane.start(tmp_path / f"plane{len(planes)}", **kwargs)
        planes.append(plane)
        return plane

    yield start
    for plane in planes:
        plane.close()


@pytest.fixture
def dataplane(start_dataplane: Callable[..., Dataplane]) -> Dataplane:
    """The standard layout: voice on two home sites and a fallback site, llm elsewhere."""
    return start_dataplane()
