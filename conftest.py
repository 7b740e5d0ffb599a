"""What every test folder shares: the markers that skip a test where this machine lacks a tool.

Mark a test, or a module with `pytestmark`, `needs_haproxy`, `needs_espeak`, `needs_nft` or
`needs_netns`: where the tool is missing it is skipped, with a reason that says how to get it.
Each condition is checked once a run, and only when a collected test carries its marker. The
waits that tests poll with are in benchmarks/lab/waiting.py (a conftest is not for importing).
"""

import shutil
from collections.abc import Callable
from functools import cache

import pytest


def _missing(tools: tuple[str, ...], reason: str) -> Callable[[], str | None]:
    return lambda: reason if any(shutil.which(tool) is None for tool in tools) else None


def _netns_unavailable() -> str | None:
    from denv_iac.local.netns import unavailable_reason

    return unavailable_reason()


# marker: (what it needs, the check: why not here, or None where it is)
NEEDS: dict[str, tuple[str, Callable[[], str | None]]] = {
    "needs_haproxy": (
        "HAProxy",
        _missing(("haproxy",), "HAProxy is not installed (make setup installs it)"),
    ),
    "needs_espeak": (
        "espeak-ng",
        _missing(("espeak-ng",), "espeak-ng is not installed (make setup installs it)"),
    ),
    "needs_nft": (
        "nft and unshare",
        _missing(("nft", "unshare"), "needs nft and unshare (apt-get install nftables)"),
    ),
    "needs_netns": ("network namespaces (root, ip, nft)", _netns_unavailable),
}


@cache
def _unavailable(marker: str) -> str | None:
    return NEEDS[marker][1]()


def pytest_configure(config: pytest.Config) -> None:
    for marker, (what, _) in NEEDS.items():
        config.addinivalue_line("markers", f"{marker}: skipped where {what} is missing")


@pytest.hookimpl(trylast=True)  # after a folder's conftest has marked its own tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for marker in NEEDS:
            if item.get_closest_marker(marker) is not None and (why := _unavailable(marker)):
                item.add_marker(pytest.mark.skip(reason=why))
