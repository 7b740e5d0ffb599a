"""Where the tests keep what they build once and reuse between runs (a Debian root, a VM image,
downloaded .debs): `/var/cache/denv-test`, or `DENV_TEST_CACHE` (CI points it at an empty folder,
so that every run builds them as a new machine does)."""

import os
from pathlib import Path

TEST_CACHE = Path(os.environ.get("DENV_TEST_CACHE") or "/var/cache/denv-test")
