"""What `denv local up` records of a run in `.denv/<stack>/`: `state.json` (the endpoint, the
admin socket, each replica's and agent's address, ports and pid), read back by `denv local
down`, `denv status` and scripts; and the folder's private files."""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from denv_iac.core.stack.reader import StackError
from denv_iac.core.stack.stackfile import check_stack_name
from denv_iac.local.processes import HOST

STATE_FILE = "state.json"


@dataclass
class ReplicaState:
    id: str
    pool: str
    site: str
    node: str
    gpu: int
    address: str
    port: int
    agent_port: int
    pid: int
    # What its /proc cmdline holds while it runs, and whether it leads a process group of its
    # own (a recipe's command does, with whatever it starts).
    mark: str = ""
    group: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"


@dataclass
class AgentState:
    node: str
    agent_port: int
    http_port: int
    pid: int
    config: str
    address: str = HOST

    @property
    def url(self) -> str:
        """The agent's HTTP API: /healthz, /metrics and the control endpoint."""
        return f"http://{self.address}:{self.http_port}"


@dataclass
class RunState:
    stack: str
    endpoint: str
    admin_socket: str
    prometheus: str
    haproxy_pid: int
    control_token: str
    replicas: list[ReplicaState] = field(default_factory=list)
    agents: list[AgentState] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "RunState":
        raw = json.loads(text)
        raw["replicas"] = [ReplicaState(**r) for r in raw["replicas"]]
        raw["agents"] = [AgentState(**a) for a in raw["agents"]]
        return cls(**raw)

    def agent_of(self, node: str) -> AgentState:
        return next(a for a in self.agents if a.node == node)


def run_dir(project: Path, stack: str) -> Path:
    return project / ".denv" / check_stack_name(stack)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read: run state holds the agents' control token."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an older file keeps its mode through O_CREAT
    with os.fdopen(descriptor, "w") as file:
        file.write(text)


def read_state(directory: Path) -> RunState | None:
    """The run's state file, None without one; StackError when it is not one `local up` wrote."""
    state_file = directory / STATE_FILE
    if not state_file.exists():
        return None
    try:
        return RunState.from_json(state_file.read_text(encoding="utf-8"))
    except (ValueError, TypeError, KeyError, AttributeError, OSError):
        raise StackError(
            [
                f"{state_file}: not the run state `denv local up` writes (cut short or edited); "
                "stop the stack's processes by hand (pgrep -f denv) and delete the file"
            ]
        ) from None
