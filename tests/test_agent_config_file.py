"""The agent's config file, as the one writer makes it, read back by the agent's own parser."""

import tomllib
from pathlib import Path

import pytest
from denv_agent.config import parse

from denv_iac.core.agent_config import (
    AgentConfig,
    AgentProbe,
    AgentReplica,
    agent_config_toml,
    toml_value,
)
from denv_iac.node import agent
from denv_iac.node.spec import AgentSettings, NodeDeploySpec

HOSTILE = {
    "quotes": 'a"b\'c"""d',
    "backslashes": "C:\\new\\table \\u0041 \\",
    "newline": 'x\n[[replicas]]\nid = "forged"',
    "carriage return and tab": "x\r\ty",
    "control characters": "nul\x00bell\x07esc\x1bdel\x7f",
    "unicode": "modèle-ü ß 中文 \u2028 \ufeff",
    "beyond the basic plane": "voice 🎙️ 𝄞",
    "table header": "x]\n[listen]\nhttp = ",
}
IDS = list(HOSTILE)
TOKEN_TAIL = "-0123456789abcdef"  # the agent wants a control token of 16 characters or more


def _config(value: str, **changes: object) -> AgentConfig:
    replica = AgentReplica(
        id="voice.local.n0.0",
        health_url=f"http://127.0.0.1:8000/{value}",
        gpu=0,
        probe=AgentProbe(model=value, ttft_budget_ms=250, stall_budget_ms=900),
    )
    fields: dict[str, object] = {
        "node": value,
        "state_file": f"state/{value}.json",
        "control_token": value + TOKEN_TAIL,
        "agent_check": f"{value}:9300",
        "http": f"{value}:9301",
        "replicas": (replica,),
        "tables": {"intervals": {"health_s": 0.5}, "simulate": {"gpu_name": value, "gpus": 2}},
    }
    return AgentConfig(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_every_string_field_reads_back_as_written(value: str, tmp_path: Path) -> None:
    parsed = parse(agent_config_toml(_config(value)), tmp_path)
    assert parsed.node == value
    assert parsed.state_file == tmp_path / f"state/{value}.json"
    assert parsed.control_token == value + TOKEN_TAIL
    assert (parsed.listen.agent_check, parsed.listen.http) == ((value, 9300), (value, 9301))
    assert parsed.intervals.health_s == 0.5
    assert (parsed.simulate.gpu_name, parsed.simulate.gpus) == (value, 2)
    (replica,) = parsed.replicas
    assert (replica.id, replica.gpu) == ("voice.local.n0.0", 0)
    assert replica.health_url == f"http://127.0.0.1:8000/{value}"
    assert replica.probe is not None
    assert (replica.probe.model, replica.probe.ttft_budget_ms) == (value, 250.0)
    assert replica.probe.stall_budget_ms == 900.0


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_a_kubernetes_agent_reads_its_pod_and_table_back(value: str, tmp_path: Path) -> None:
    replica = AgentReplica(id="voice.k8s.node-0.0", health_url="http://voice-0:8000/h", pod=value)
    kubernetes = {"namespace": value, "container": value, "pod_resources_socket": value}
    token_file = tmp_path / "agent.token"
    token_file.write_text("t" * 32)
    config = _config(
        value,
        control_token=None,
        control_token_file=str(token_file),
        replicas=(replica,),
        tables={"kubernetes": kubernetes},
    )
    parsed = parse(agent_config_toml(config), tmp_path)
    assert parsed.control_token == "t" * 32
    assert parsed.kubernetes is not None
    assert (parsed.kubernetes.namespace, parsed.kubernetes.container) == (value, value)
    assert parsed.kubernetes.pod_resources_socket == tmp_path / value
    assert [(r.id, r.pod, r.probe) for r in parsed.replicas] == [
        ("voice.k8s.node-0.0", value, None)
    ]


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_a_nodes_extra_agent_settings_read_back_as_written(value: str) -> None:
    spec = NodeDeploySpec("n", agent=AgentSettings(config={"thresholds": {"reason": value}}))
    parsed = tomllib.loads(agent.config(spec).content.decode())
    assert parsed["thresholds"] == {"reason": value}
    assert parsed["node"] == "n"


def test_what_toml_cannot_hold_is_refused() -> None:
    for value in ("\ud800", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="TOML"):
            toml_value(value)


def test_the_file_is_ascii_and_plain_values_stay_as_they_were() -> None:
    text = agent_config_toml(_config("node-a"))
    assert text.isascii()
    assert text.startswith('node = "node-a"\nstate_file = "state/node-a.json"\n')
    assert '\n[listen]\nagent_check = "node-a:9300"\nhttp = "node-a:9301"\n' in text
    assert toml_value("modèle 🎙") == '"mod\\u00e8le \\U0001f399"'
