"""The MIG layout: MIG mode and GPU instances per GPU, as the spec's layout asks, and a unit
that recreates the instances at boot."""

from __future__ import annotations

from denv_iac.core.scripts import script
from denv_iac.node.fabric import Board, board
from denv_iac.node.facts import NodeFacts
from denv_iac.node.holders import FABRICMANAGER, PERSISTENCED, STOP_ORDER, active, stopped_around
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import (
    FileContent,
    Step,
    enable_link,
    text_file,
    unit_path,
    wants_link,
)

# MIG mode survives a reboot, the GPU and compute instances do not: this unit recreates them
# before the replicas that run on them start (their units Require and come After it).
UNIT = "denv-mig.service"
RESTORE = "/opt/denv/bin/denv-mig-restore"
_RESTORE_SCRIPT = script("mig_restore.sh")  # data/scripts/mig_restore.sh


class MigLayoutError(RuntimeError):
    """The layout names a GPU the node does not have."""


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    """Steps that bring every GPU to the layout; GPUs outside it get MIG turned off.

    Without working NVML (the driver is installed in this same run) the GPUs are taken as
    fresh: MIG off, no instances.
    """
    layout = spec.mig_layout()
    if facts.smi_ok:
        known = {gpu.index for gpu in facts.gpus}
        missing = sorted(set(layout) - known)
        if missing:
            raise MigLayoutError(
                f"mig: GPU index {missing[0]} not on this node (it has {len(known)} GPUs); "
                "fix the mig layout"
            )
    steps: list[Step] = []
    for index in sorted(layout):
        steps += _gpu_steps(facts, spec, index, layout[index])
    for gpu in facts.gpus:
        if gpu.index not in layout and gpu.mig_enabled:
            commands = _around(facts, spec, gpu.index, _mode(gpu.index, 0))
            steps.append(Step("mig", f"GPU {gpu.index}: turn MIG off", commands))
    return steps


def _gpu_steps(
    facts: NodeFacts, spec: NodeDeploySpec, index: int, profiles: list[str]
) -> list[Step]:
    gpu = facts.gpu(index)
    enabled = gpu is not None and gpu.mig_enabled
    current = sorted(device.profile for device in gpu.mig_devices) if gpu else []
    if enabled and current == sorted(profiles):
        return []
    commands = [] if enabled else _mode(index, 1)
    if current:
        commands += [f"nvidia-smi mig -i {index} -dci", f"nvidia-smi mig -i {index} -dgi"]
    commands.append(f"nvidia-smi mig -i {index} -cgi {','.join(profiles)} -C")
    title = f"GPU {index}: {' '.join(profiles)}"
    return [Step("mig", title, _around(facts, spec, index, commands))]


def _mode(index: int, mode: int) -> list[str]:
    # A mode change stays pending until the GPU is reset; nothing runs on it at this point.
    return [f"nvidia-smi -i {index} -mig {mode}", f"nvidia-smi -i {index} -r"]


def _around(
    facts: NodeFacts, spec: NodeDeploySpec, index: int, commands: list[str]
) -> tuple[str, ...]:
    """The commands with the GPU's running replicas and the NVML holders stopped around them.

    A mode change needs a GPU reset, and DCGM and fabric manager keep GPU instances in use, so
    the holders stop for any change; they start again even when a command fails.
    """
    replicas = [r.unit for r in spec.replicas if r.gpu == index and r.unit in facts.active_units]
    return (stopped_around(replicas + _holders(facts), commands),)


def _holders(facts: NodeFacts) -> list[str]:
    """The holders running when the MIG commands run: those running when the node was read,
    and the ones this run's driver steps start before them (persistenced, and fabric manager on
    an NVSwitch board), which a fresh machine's facts cannot show."""
    started = set()
    if facts.systemd:
        started.add(PERSISTENCED)
        if board(facts) is not Board.PLAIN:
            started.add(FABRICMANAGER)
    return [unit for unit in STOP_ORDER if unit in started or unit in active(facts)]


def files(spec: NodeDeploySpec) -> list[FileContent]:
    """The restore script and its unit; none without a MIG layout."""
    layout = spec.mig_layout()
    if not layout:
        return []
    arguments = " ".join(f"{gpu}={','.join(layout[gpu])}" for gpu in sorted(layout))
    unit = text_file(
        unit_path(UNIT),
        f"""[Unit]
Description=denv MIG layout: recreate the GPU instances a reboot removed
# The driver is loaded and kept by persistenced; on NVSwitch boards the fabric is up.
After=systemd-modules-load.service {PERSISTENCED} {FABRICMANAGER}

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart={RESTORE} {arguments}

[Install]
WantedBy=multi-user.target
""",
    )
    return [FileContent(RESTORE, _RESTORE_SCRIPT.encode(), "0755"), unit]


PATHS = (RESTORE, unit_path(UNIT))  # what the probe reads, with or without a layout


def boot_steps(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    """Write and enable the boot unit; remove it once the node has no MIG layout any more."""
    wanted = files(spec)
    if not wanted:
        if not any(path in facts.files for path in PATHS):
            return []
        remove = f"rm -f {' '.join(PATHS)} {wants_link(UNIT)}"
        commands = (
            (f"systemctl disable {UNIT}", remove, "systemctl daemon-reload")
            if facts.systemd
            else (remove,)
        )
        return [Step("mig", "remove the boot unit (no MIG layout)", commands)]
    steps = [
        Step("mig", f"write {content.path}", file=content)
        for content in wanted
        if facts.files.get(content.path) != content.sha256
    ]
    enabled = wants_link(UNIT) in facts.links
    if facts.systemd and (steps or not enabled):
        # Enabled, not started: the steps above made this boot's instances already.
        enable = ("systemctl daemon-reload", f"systemctl enable {UNIT}")
        steps.append(Step("mig", "enable the boot unit", enable))
    elif not facts.systemd and not enabled:
        steps.append(Step("mig", "enable the boot unit (no systemd)", (enable_link(UNIT),)))
    return steps
