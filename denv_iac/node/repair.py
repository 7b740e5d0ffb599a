"""repair_node: drain, fix the GPU at the level asked, verify through NVML, then undrain.

Steps run one at a time and each is reported. The first failure ends the repair with the
node still drained: it never goes back into rotation unverified.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from denv_iac.node import driver, fabric, mig
from denv_iac.node.deploy import NodeSession, Target, connect
from denv_iac.node.facts import NodeFacts
from denv_iac.node.holders import FABRICMANAGER, PERSISTENCED, active, stopped_around
from denv_iac.node.plan import fact_query
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import before_deadline, set_deadline, wait_streams_command

DRAIN = "denv-agent drain"
# A repaired GPU's faults are sticky in the agent until cleared; only then does undrain count.
UNDRAIN = "denv-agent clear-faults && denv-agent undrain"


class RepairLevel(StrEnum):
    RESET = "reset"  # nvidia-smi -r on every GPU
    RELOAD = "reload"  # unload and load the kernel modules (driver/library version mismatch)
    REINSTALL = "reinstall"  # purge the driver, install the pinned branch, load it
    REBOOT = "reboot"  # XID 79 and other node-fatal faults


class RepairRefused(ValueError):
    """The repair cannot run on this target at this level; nothing was changed."""


@dataclass(frozen=True)
class StepReport:
    name: str
    status: str  # "ok", "skipped" or "failed"
    detail: str = ""
    seconds: float = 0.0  # how long the step took


@dataclass
class RepairReport:
    level: RepairLevel
    steps: list[StepReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.status != "failed" for s in self.steps)

    @property
    def drained(self) -> bool:
        """Whether the node was left drained (a step after the drain failed)."""
        names = [s.name for s in self.steps if s.status == "ok"]
        return "drain" in names and "undrain" not in names


class _Skip(Exception):
    """A step with nothing to do on this node; the reason is reported."""


class _Fail(Exception):
    """A step that failed; the message is the node's output."""


_Action = Callable[[NodeSession, NodeFacts], str]


# A deadline in the node's shell, `seconds` from now. `date +%s` counts whole seconds, so a
# deadline passes only once the clock reads past it: never less than `seconds` after it is set.
class _Repair:
    def __init__(self, spec: NodeDeploySpec, level: RepairLevel) -> None:
        self.spec, self.level = spec, level

    def steps(self) -> list[tuple[str, _Action]]:
        return [
            ("drain", self.drain),
            ("wait for in-flight streams", self.wait_streams),
            ("stop replicas", self.stop_replicas),
            (self.level.value, self.fix),
            ("verify through NVML", self.verify),
            ("restore MIG layout", self.restore_mig),
            ("start GPU services", self.start_services),
            ("start replicas", self.start_replicas),
            ("wait until replicas are ready", self.wait_ready),
            ("undrain", self.undrain),
        ]

    @staticmethod
    def _run(session: NodeSession, command: str) -> str:
        ok, output = session.run(command)
        if not ok:
            raise _Fail(output or f"exited non-zero: {command}")
        return output

    def drain(self, session: NodeSession, facts: NodeFacts) -> str:
        return self._run(session, DRAIN)

    def wait_streams(self, session: NodeSession, facts: NodeFacts) -> str:
        ports = [r.port for r in self.spec.replicas]
        if not ports:
            raise _Skip("no replicas on this node")
        return self._run(
            session,
            wait_streams_command(ports, self.spec.drain_plan()),
        )

    def _units(self, facts: NodeFacts) -> list[str]:
        return sorted({r.unit for r in self.spec.replicas} | facts.replica_units)

    def stop_replicas(self, session: NodeSession, facts: NodeFacts) -> str:
        # They stay stopped until the GPUs are verified; the daemons holding NVML are stopped
        # and started again by the fix itself, so a failed fix leaves them (the agent) running.
        units = self._units(facts)
        if not facts.systemd or not units:
            raise _Skip("no systemd running" if units else "no replicas on this node")
        return self._run(session, f"systemctl stop {' '.join(units)}")

    def fix(self, session: NodeSession, facts: NodeFacts) -> str:
        if self.level is RepairLevel.RESET:
            count = len(facts.gpus) or len(facts.pci_gpus)
            resets = [f"nvidia-smi -r -i {i}" for i in range(count)]
            return self._run(session, stopped_around(active(facts), resets))
        if self.level is RepairLevel.REBOOT:
            session.reboot()
            return "rebooted and reconnected"
        output = []
        if self.level is RepairLevel.REINSTALL:
            purge = driver.installed_driver_packages(facts)
            for step in driver.install_steps(facts, self.spec, purge):
                output += [self._run(session, command) for command in step.commands]
            board = fabric.board(facts)
            if board is not fabric.Board.PLAIN:
                output.append(self._run(session, fabric.install_command(self.spec, board)))
        if not facts.systemd:
            output.append("modules not reloaded: no booted kernel of its own (chroot)")
        else:
            ok, text = session.run(driver.reload_modules_command(active(facts)))
            if not ok and self.level is RepairLevel.REINSTALL and session.can_reboot:
                session.reboot()  # the old modules are in use; a reboot swaps them
                text = "modules busy: rebooted"
            elif not ok:
                raise _Fail(text or "unloading the kernel modules failed; try --level reboot")
            output.append(text)
        return "\n".join(line for line in output if line)

    def verify(self, session: NodeSession, facts: NodeFacts) -> str:
        self._run(session, driver.verify_command(self.spec))
        return self._run(
            session, "nvidia-smi --query-gpu=index,driver_version --format=csv,noheader"
        )

    def restore_mig(self, session: NodeSession, facts: NodeFacts) -> str:
        fresh = session.facts(fact_query(self.spec))
        # Replicas are stopped: the layout may be recreated without stopping anything first.
        steps = mig.plan(fresh, self.spec)
        if not steps:
            raise _Skip("layout already as asked" if self.spec.mig else "no MIG layout")
        return "\n".join(self._run(session, c) for step in steps for c in step.commands)

    def start_services(self, session: NodeSession, facts: NodeFacts) -> str:
        if not facts.systemd:
            raise _Skip("no systemd running")
        board = fabric.board(facts) is not fabric.Board.PLAIN
        units = [PERSISTENCED] + ([FABRICMANAGER] if board else [])
        return self._run(session, f"systemctl start {' '.join(units)}")

    def start_replicas(self, session: NodeSession, facts: NodeFacts) -> str:
        units = [r.unit for r in self.spec.replicas]
        if not facts.systemd or not units:
            raise _Skip("no systemd running" if units else "no replicas on this node")
        return self._run(session, f"systemctl start {' '.join(units)}")

    def wait_ready(self, session: NodeSession, facts: NodeFacts) -> str:
        if not facts.systemd or not self.spec.replicas:
            raise _Skip("no replicas started")
        urls = " ".join(
            shlex.quote(f"http://127.0.0.1:{r.port}{r.health_path}") for r in self.spec.replicas
        )
        command = (
            f"{set_deadline('deadline', self.spec.ready_timeout_s)}; "
            f"for url in {urls}; do "
            'until curl -fsS -o /dev/null --max-time 5 "$url"; do '
            f"{before_deadline('deadline')}"
            ' || { echo "not ready: $url"; exit 1; }; '
            "sleep 2; done; done; echo ready"
        )
        return self._run(session, command)

    def undrain(self, session: NodeSession, facts: NodeFacts) -> str:
        return self._run(session, UNDRAIN)


def repair_node(
    target: Target,
    spec: NodeDeploySpec,
    level: RepairLevel,
    report: Callable[[StepReport], None] = lambda step: None,
) -> RepairReport:
    """Repair the node's GPUs at `level`; every step is passed to `report` as it ends.

    Raises RepairRefused (before draining anything) when the level cannot apply to the target.
    """
    if level is RepairLevel.REBOOT and not target.is_ssh:
        raise RepairRefused(f"--level reboot: {target.host} is not a machine of its own; use SSH")
    with connect(target) as session:
        return repair_session(session, spec, level, report)


def repair_session(
    session: NodeSession,
    spec: NodeDeploySpec,
    level: RepairLevel,
    report: Callable[[StepReport], None] = lambda step: None,
) -> RepairReport:
    """The repair's steps on a connected node, up to the first failure."""
    result = RepairReport(level)
    facts = session.facts(fact_query(spec))
    repair = _Repair(driver.branch_for(facts, spec), level)
    for name, action in repair.steps():
        start = time.monotonic()
        try:
            status, detail = "ok", action(session, facts)
        except _Skip as skip:
            status, detail = "skipped", str(skip)
        except _Fail as failure:
            status, detail = "failed", str(failure)
        step = StepReport(name, status, detail, round(time.monotonic() - start, 1))
        result.steps.append(step)
        report(step)
        if step.status == "failed":
            break
    return result
