"""Golden snapshots of what one site registers: a reviewable diff whenever it changes."""

import json
import os
from pathlib import Path

from denv_iac.components.preview import Run

GOLDEN = Path(__file__).parent / "golden"


def site_snapshot(run: Run, site_component: str) -> str:
    """Every registered input of a site component and the resources named from it, as JSON."""
    snapshot = {
        r.urn: {"inputs": r.inputs, "ignore_changes": list(r.ignore_changes)}
        for r in sorted(run.registrations, key=lambda r: r.urn)
        if r.name == site_component or r.name.startswith(f"{site_component}-")
    }
    return json.dumps(snapshot, indent=1, sort_keys=True) + "\n"


def assert_golden(text: str, name: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DENV_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), "registrations changed: DENV_UPDATE_GOLDEN=1 to accept it"
