"""The node agent's TOML config (the format `denv-agent --config` reads), from plain data.

The one writer of that file: a node's deploy, the local runner and the Kubernetes agents'
ConfigMap each describe what their agent watches and get the text from here. Every string is a
TOML basic string with each character the format forbids escaped, and anything outside ASCII
written as a Unicode escape, so whatever a field holds reads back as exactly that.
"""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from denv_iac.core.stack.model import RecipeSpec

Scalar = str | int | float | bool
Table = Mapping[str, Scalar]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


@dataclass(frozen=True)
class AgentProbe:
    """The agent's checks of a replica beyond its health path. The stream probe: a slow first
    token lowers its weight; a pause between tokens past the stall budget (where the balancer
    cuts streams) drains it. The engine's metrics (at `metrics_path`): requests running with no
    token for the stall budget take it down, its queue lowers the weight."""

    model: str
    ttft_budget_ms: int | None
    stall_budget_ms: int | None = None
    engine: str | None = None
    metrics_path: str = "/metrics"


def recipe_probe(recipe: RecipeSpec, engine: str | None = None) -> AgentProbe | None:
    """The checks of a recipe's replicas: on when the recipe has a TTFT budget or the agent
    reads an engine's metrics (`engine`, else the recipe's own)."""
    engine = engine or recipe.engine
    if recipe.ttft_budget_ms is None and engine is None:
        return None
    return AgentProbe(
        recipe.model_names[0],
        recipe.ttft_budget_ms,
        recipe.stall_timeout_ms,
        engine,
        recipe.metrics_path,
    )


@dataclass(frozen=True)
class AgentReplica:
    """One replica the agent answers for: on a GPU (`gpu`) or in a Kubernetes pod (`pod`)."""

    id: str
    health_url: str
    gpu: int | None = None
    pod: str | None = None
    probe: AgentProbe | None = None
    metrics_url: str | None = None  # where the engine's metrics are, when the probe names one


@dataclass(frozen=True)
class AgentConfig:
    """What one agent's config file says; `tables` (e.g. intervals) follow [listen], in order."""

    node: str
    state_file: str
    agent_check: str  # host:port, where the balancers' agent checks arrive
    http: str  # host:port of the control endpoint
    replicas: tuple[AgentReplica, ...]
    pods: str | None = None  # host:port of the pod endpoints (Kubernetes): readiness, drain
    control_token: str | None = None
    control_token_file: str | None = None
    tables: Mapping[str, Table] = field(default_factory=dict)


def agent_config_toml(config: AgentConfig) -> str:
    """The config file's text."""
    top: dict[str, Scalar | None] = {
        "node": config.node,
        "state_file": config.state_file,
        "control_token": config.control_token,
        "control_token_file": config.control_token_file,
    }
    lines = _pairs(top)
    listen = {"agent_check": config.agent_check, "http": config.http, "pods": config.pods}
    for name, table in [("listen", listen), *config.tables.items()]:
        lines += ["", f"[{_key(name)}]", *_pairs(table)]
    for replica in config.replicas:
        probe = replica.probe
        lines += ["", "[[replicas]]"]
        lines += _pairs(
            {
                "id": replica.id,
                "pod": replica.pod,
                "health_url": replica.health_url,
                "gpu": replica.gpu,
                "ttft_budget_ms": probe.ttft_budget_ms if probe else None,
                "probe_model": probe.model if probe else None,
                "stall_budget_ms": probe.stall_budget_ms if probe else None,
                "engine": probe.engine if probe else None,
                "metrics_url": replica.metrics_url if probe and probe.engine else None,
            }
        )
    return "\n".join(lines) + "\n"


def toml_value(value: Scalar) -> str:
    """A TOML scalar that reads back as `value`; ValueError for what TOML cannot hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r}: TOML has no such number here; use a finite one")
        return repr(value)
    return '"' + "".join(_escaped(char) for char in value) + '"'


def _escaped(char: str) -> str:
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    if 0x20 <= code < 0x7F:
        return char
    if 0xD800 <= code <= 0xDFFF:
        raise ValueError(f"{char!r}: a lone surrogate is no Unicode character; TOML cannot hold it")
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else toml_value(name)


def _pairs(table: Mapping[str, Scalar | None]) -> list[str]:
    return [f"{_key(k)} = {toml_value(v)}" for k, v in table.items() if v is not None]
