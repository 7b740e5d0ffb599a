"""The VM bed for the tests under tests/vm: one cached image, one namespace per module.

Tests marked `vm` are the whole VM suite (`make vm`, which sets DENV_VM_SUITE=full); a plain
`pytest` runs only the unmarked fast subset here. The times each step took are printed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vm.bed import Bed, accel, missing_tools
from tests.vm.image import CACHE_DIR, Image, ensure_image

TIMINGS: dict[str, float] = {}
_HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vm: part of the whole VM suite (make vm); a plain pytest leaves it out"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("DENV_VM_SUITE") == "full":
        return
    left_out = [item for item in items if item.get_closest_marker("vm") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker("vm") is None]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.write_sep("-", f"VM timings ({_accel_used or 'no VM booted'})")
        for name, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")


_accel_used = ""


@pytest.fixture(scope="session")
def vm_image() -> Image:
    missing = missing_tools()
    if missing:
        pytest.skip(f"VMs need {', '.join(missing)}")
    built = not (CACHE_DIR / "disk.img").is_file()
    start = time.monotonic()
    image = ensure_image()
    if built:
        TIMINGS["image build"] = time.monotonic() - start
    global _accel_used
    start = time.monotonic()
    _accel_used = accel(image)
    TIMINGS["accelerator probe"] = time.monotonic() - start
    return image


@pytest.fixture(scope="module")
def bed(vm_image: Image) -> Iterator[Bed]:
    # A short folder: SSH's control sockets live there and a socket path has at most 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="denv-vm-"))
    try:
        with Bed(vm_image, workdir) as made:
            yield made
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
