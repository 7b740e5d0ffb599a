"""The MIG layout: MIG mode and GPU instances per GPU, as the spec's layout asks."""

from __future__ import annotations

from denv_iac.node.facts import NodeFacts
from denv_iac.node.holders import active, stopped_around
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import Step


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
    return (stopped_around(replicas + active(facts), commands),)
