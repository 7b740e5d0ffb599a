"""What keeps NVML and the GPU devices open, by unit name: the one place these names are set.

A GPU reset (`nvidia-smi -r`), unloading the kernel modules and a MIG mode change all fail
while any process holds the device; these daemons do, for as long as they run.
"""

from __future__ import annotations

from collections.abc import Sequence

from denv_iac.node.facts import NodeFacts

AGENT = "denv-agent.service"  # the node agent polls NVML (agent.py writes its unit)
PERSISTENCED = "nvidia-persistenced.service"
FABRICMANAGER = "nvidia-fabricmanager.service"
# DCGM's host engine: `nvidia-dcgm` since DCGM 2 (datacenter-gpu-manager), `dcgm` before.
DCGM = ("nvidia-dcgm.service", "dcgm.service")
DCGM_EXPORTER = "dcgm-exporter.service"

# Readers before what they read from: the exporter reads DCGM, DCGM and the agent read NVML;
# persistenced last. They start again in the reverse order.
STOP_ORDER = (AGENT, DCGM_EXPORTER, *DCGM, FABRICMANAGER, PERSISTENCED)


def active(facts: NodeFacts) -> list[str]:
    """The holders running on the node, in stop order; a node without systemd runs none."""
    return [unit for unit in STOP_ORDER if unit in facts.active_units]


def stopped_around(units: Sequence[str], commands: Sequence[str]) -> str:
    """One shell command: stop `units`, run `commands` (each after the last succeeded), then
    start the units again in reverse order, whether the commands succeeded or not.

    One command, not several: the deploy and the repair stop at the first failing command,
    which would leave the agent and the GPU daemons stopped on a node whose reset failed. Like
    a `trap ... EXIT`, the starts always run; the command exits with the first failure's status
    (a failed start counts when the commands succeeded). Replica units go first in `units`.
    """
    if not units:
        return " && ".join(commands)
    body = " && ".join((f"systemctl stop {' '.join(units)}", *commands))
    starts = "; ".join(f"systemctl start {unit} || s=1" for unit in reversed(units))
    return f'rc=0; s=0; {{ {body}; }} || rc=$?; {starts}; [ "$rc" -eq 0 ] || exit "$rc"; exit "$s"'
