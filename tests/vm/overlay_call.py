"""A machine's overlay interface put on a VM over SSH, as the node deploy's overlay area plans
and applies it (denv_iac.node.overlay).

Run inside the bed's network namespace (`python -m tests.vm.overlay_call`): reads {"host", "key",
"config"} as JSON on stdin, `config` the machine's denv0.conf with its private key filled in
(`with_private_key`), and prints the steps applied.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from denv_iac.node import overlay
from denv_iac.node.deploy import Target, connect, quiet_progress
from denv_iac.node.facts import FactQuery
from denv_iac.node.steps import APT_UPDATE, Step, wants_link
from denv_iac.overlay import CONFIG_PATH


def main() -> None:
    call = json.load(sys.stdin)
    query = FactQuery(
        files=(CONFIG_PATH,), links=(wants_link(overlay.UNIT),), units=(overlay.UNIT,)
    )
    with connect(Target(host=call["host"], user="root", key=Path(call["key"]))) as session:
        steps = overlay.plan(session.facts(query), call["config"])
        if any(step.uses_apt for step in steps):  # as plan_node does
            steps.insert(0, Step("base", "refresh the package index", (APT_UPDATE,)))
        session.apply(steps, quiet_progress)
    json.dump([f"{step.area}: {step.title}" for step in steps], sys.stdout)


if __name__ == "__main__":
    main()
