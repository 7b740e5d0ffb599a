"""The node agent's config as the deploy writes it, read by the agent's own parser."""

from pathlib import Path

import pytest
from denv_agent.config import parse

from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.reader import read_stack
from denv_iac.node import agent
from denv_iac.node.from_stack import node_deploy_specs
from denv_iac.node.spec import NodeSpecError, spec_from_json
from tests.components import stacks


def _agent_config(ttft_budget_ms: int | None, engine: str | None = None) -> tuple[str, str]:
    args = stacks.multicloud()
    if ttft_budget_ms is not None:
        args["recipes"][2]["ttft_budget_ms"] = ttft_budget_ms  # assist, on the Hetzner boxes
    if engine is not None:
        args["recipes"][2]["engine"] = engine
    stack = read_stack("prod", {f"denv:{k}": args[k] for k in ("sites", "recipes", "balancer")})
    spec = node_deploy_specs(stack, place_replicas(stack))["hetzner-fsn.gex-1"]
    token = "t" * 32
    text = (
        agent.config(spec)
        .content.decode()
        .replace(f'control_token_file = "{agent.TOKEN}"', f'control_token = "{token}"')
    )
    return text, spec.replicas[0].id


def test_a_recipe_with_a_ttft_budget_gets_the_stream_probe_on_its_nodes(tmp_path: Path) -> None:
    text, replica_id = _agent_config(250)
    (replica,) = parse(text, tmp_path).replicas
    assert replica.id == replica_id
    assert replica.probe is not None
    assert (replica.probe.model, replica.probe.ttft_budget_ms) == ("assist", 250.0)
    assert replica.probe.stall_budget_ms == 1000.0  # the recipe's stall_timeout_ms
    assert replica.probe.url == "http://127.0.0.1:8000/v1/chat/completions"


def test_without_a_budget_no_stream_probe_but_the_engine_metrics_by_default(
    tmp_path: Path,
) -> None:
    """A zombie (health 200, headers, no token) is out within 2 s on nodes with no setting:
    the agent reads /metrics every 250 ms and knows vLLM, SGLang or TGI by the names."""
    text, _ = _agent_config(None)
    config = parse(text, tmp_path)
    replica = config.replicas[0]
    assert replica.probe is None
    assert replica.engine is not None
    assert (replica.engine.family, replica.engine.stall_budget_ms) == ("auto", 1000.0)
    assert replica.engine.metrics_url == "http://127.0.0.1:8000/metrics"
    assert config.intervals.metrics_s == 0.25


def test_engine_none_reads_no_metrics(tmp_path: Path) -> None:
    text, _ = _agent_config(None, engine="none")
    replica = parse(text, tmp_path).replicas[0]
    assert (replica.probe, replica.engine) == (None, None)
    assert "probe_model" not in text


@pytest.mark.parametrize("ttft_budget_ms", [None, 250])
def test_a_recipe_naming_its_engine_gets_its_metrics_read_on_its_nodes(
    tmp_path: Path, ttft_budget_ms: int | None
) -> None:
    text, _ = _agent_config(ttft_budget_ms, engine="sglang")
    config = parse(text, tmp_path)
    engine = config.replicas[0].engine
    assert engine is not None
    assert (engine.family, engine.metrics_url) == ("sglang", "http://127.0.0.1:8000/metrics")
    # The stall budget is where the balancer cuts a silent stream; polled every 250 ms, a stall
    # is seen within 1.25 s of a request starting, inside the 2 s goal.
    assert engine.stall_budget_ms == 1000.0 and config.intervals.metrics_s == 0.25
    assert (engine.probe_model, config.replicas[0].probe is not None) == (
        "assist",
        ttft_budget_ms is not None,
    )


def test_a_hand_written_spec_with_a_bad_probe_is_refused() -> None:
    replica = {"id": "a", "image": "img", "port": 8000, "gpu": 0}
    with pytest.raises(NodeSpecError) as error:
        spec_from_json(
            {
                "node_id": "joined.box-1",
                "replicas": [{**replica, "probe": {"model": "two words", "ttft_budget_ms": 0}}],
            }
        )
    assert error.value.problems == [
        "replica 'a' probe model: the model name the server serves, no blanks",
        "replica 'a' probe ttft_budget_ms 0: milliseconds, a whole number over 0",
    ]
