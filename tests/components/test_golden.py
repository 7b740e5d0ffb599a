"""Golden snapshot of everything the multicloud stack registers: a reviewable diff per change.

Secrets are masked as a preview shows them: their values are no part of a reviewable diff.
"""

import json
import os
from pathlib import Path

from denv_iac.components.preview import shown
from tests.components import stacks
from tests.components.harness import cluster_outputs, run_program

GOLDEN = Path(__file__).parent / "golden" / "multicloud.json"


def test_registered_inputs_match_the_golden_snapshot() -> None:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=False)
    snapshot = {
        r.urn: {"inputs": shown(r.inputs), "ignore_changes": list(r.ignore_changes)}
        for r in sorted(run.registrations, key=lambda r: r.urn)
    }
    text = json.dumps(snapshot, indent=1, sort_keys=True) + "\n"
    if os.environ.get("DENV_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "registrations changed: DENV_UPDATE_GOLDEN=1 to accept it"
