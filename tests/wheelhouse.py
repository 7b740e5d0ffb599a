"""The wheelhouse `make setup` fills from requirements.lock, beside the environment running tests.

Fresh environments in the install tests take every third-party package from it, with no index:
the tests hold on a machine whose package caches are empty, and never depend on the network.
"""

import sys
from pathlib import Path

WHEELHOUSE = Path(sys.prefix) / "wheelhouse"


def no_index() -> tuple[str, ...]:
    """uv's (and pip's) arguments to install from the wheelhouse alone."""
    assert WHEELHOUSE.is_dir(), f"{WHEELHOUSE} is missing; `make setup` fills it"
    return ("--no-index", "--find-links", str(WHEELHOUSE))
