"""The node agent's TOML config (the format `denv-agent --config` reads), from plain data.

The one description of that file: a node's deploy, the local runner and the Kubernetes agents'
ConfigMap each describe what their agent watches and get the text from here. The text itself
comes from the agent package's TOML writer (denv_agent.toml_text), the one the agent's own
tools use too: every string a TOML basic string with each character the format forbids
escaped, and anything outside ASCII written as a Unicode escape, so whatever a field holds
reads back as exactly that.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from denv_agent.toml_text import to_toml
from denv_agent.toml_text import toml_value as toml_value

from denv_iac.core.stack.model import RecipeSpec

Scalar = str | int | float | bool
Table = Mapping[str, Scalar]


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
    """The config file's text; a field that is None is left out."""
    top: dict[str, object] = _given(
        {
            "node": config.node,
            "state_file": config.state_file,
            "control_token": config.control_token,
            "control_token_file": config.control_token_file,
        }
    )
    top["listen"] = _given(
        {"agent_check": config.agent_check, "http": config.http, "pods": config.pods}
    )
    top.update((name, _given(table)) for name, table in config.tables.items())
    replicas = [_replica_table(replica) for replica in config.replicas]
    if replicas:
        top["replicas"] = replicas
    return to_toml(top)


def _replica_table(replica: AgentReplica) -> dict[str, object]:
    probe = replica.probe
    return _given(
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


def _given(table: Mapping[str, object]) -> dict[str, object]:
    """The entries that are not None: TOML has no null, an absent key is the agent's default."""
    return {k: v for k, v in table.items() if v is not None}
