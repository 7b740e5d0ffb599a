"""What `denv local up` records of a run in `.denv/<stack>/`: `state.json` (the endpoint, the
admin socket, each replica's and agent's address, ports and pid), read back by `denv local
down`, `denv status` and scripts; and the folder's private files."""

import dataclasses
import json
import os
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from denv_iac.core.stack.fields import describe
from denv_iac.core.stack.reader import StackError
from denv_iac.core.stack.stackfile import check_stack_name, parse_json
from denv_iac.core.stack.values import control_character, describe_character
from denv_iac.local.processes import HOST

STATE_FILE = "state.json"
# What to do with a state file that cannot be read: its processes may still run, and nothing
# else says which they are.
STATE_FIX = (
    "the file was cut short or edited: stop the stack's processes by hand (pgrep -f denv) and "
    "delete it"
)


class StateFieldError(ValueError):
    """A field of a state file that `local up` would not have written: its path and what is
    wrong with it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path} {problem}" if path else problem)


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
        return cls.from_document(json.loads(text))

    @classmethod
    def from_document(cls, raw: object) -> "RunState":
        """The state a parsed state file holds; StateFieldError naming the first field that is
        missing, unknown or of another type than `local up` writes."""
        state: RunState = _record(cls, raw, "")
        return state

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
        data = state_file.read_bytes()
    except OSError as error:
        raise StackError(
            [f"{state_file}: cannot read it ({error.strerror}); check the file and its permissions"]
        ) from None
    try:
        return RunState.from_document(parse_json(data, str(state_file), STATE_FIX))
    except StateFieldError as error:
        raise StackError([f"{state_file}: {error}; {STATE_FIX}"]) from None


def _record(cls: type[Any], raw: object, path: str) -> Any:
    """An instance of the dataclass `cls` from a JSON object, each field of its declared type
    (str, int, bool, or a list of another such dataclass); `path` names `raw` in errors."""
    if not isinstance(raw, dict):
        what = f"is {describe(raw)}" if path else f"holds {describe(raw)}"
        raise StateFieldError(path, f"{what}, not an object of fields")
    types = typing.get_type_hints(cls)
    declared = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in declared:
            # A key is any JSON string, a newline included: quoted, it stays on one line.
            raise StateFieldError(_field(path, json.dumps(key)), "is not a field of the run state")
    values: dict[str, Any] = {}
    for name, spec in declared.items():
        where = _field(path, name)
        if name not in raw:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise StateFieldError(where, "is missing")
            continue
        values[name] = _typed(types[name], raw[name], where)
    return cls(**values)


def _field(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _typed(kind: Any, value: object, where: str) -> object:
    if typing.get_origin(kind) is list:
        if not isinstance(value, list):
            raise StateFieldError(where, f"is {describe(value)}, not a list")
        (item,) = typing.get_args(kind)
        return [_record(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    # bool is an int in Python: a pid of `true` is not one `local up` writes.
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        whole = isinstance(value, int) and not isinstance(value, bool)
        shown = str(value) if whole else describe(value)
        raise StateFieldError(where, f"is {shown}, not a whole number of 0 or more")
    if kind in (str, bool) and not isinstance(value, kind):
        expected = "a string" if kind is str else "true or false"
        raise StateFieldError(where, f"is {describe(value)}, not {expected}")
    # What `local up` records is printed back on one line, which a line break would split.
    character = control_character(value) if isinstance(value, str) else None
    if character is not None:
        raise StateFieldError(where, f"holds {describe_character(character)}")
    return value
