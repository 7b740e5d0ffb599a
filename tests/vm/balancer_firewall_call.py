"""A balancer host's firewall put on a VM over SSH, as `prepare_balancer` plans and applies it.

Run inside the bed's network namespace (`python -m tests.vm.balancer_firewall_call`): reads
{"host", "key", "admin_cidrs", "stats_port"} as JSON on stdin and prints the steps applied.
Only the firewall: HAProxy itself needs packages the bed's VMs have no source for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from denv_iac.node import firewall
from denv_iac.node.deploy import Target, connect, quiet_progress
from denv_iac.node.firewall import BalancerAccess


def main() -> None:
    call = json.load(sys.stdin)
    access = BalancerAccess(tuple(call["admin_cidrs"]), int(call["stats_port"]))
    with connect(Target(host=call["host"], user="root", key=Path(call["key"]))) as session:
        steps = firewall.plan_balancer_host(session.facts(firewall.balancer_fact_query()), access)
        session.apply(steps, quiet_progress)
    json.dump([f"{step.area}: {step.title}" for step in steps], sys.stdout)


if __name__ == "__main__":
    main()
