"""Hostile values never change the shape of what they are written into.

Each value is either refused where it enters (the stack reader, the node spec, the SSH target)
with one line naming the field, or written so that the unit, the command line, the env file, the
rule set or the manifest keeps its shape and carries the value as one intact item.
"""

import shlex
import tomllib
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from denv_iac.core.kube_manifests.site import site_manifests
from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.node import agent, cache, firewall, replicas
from denv_iac.node.deploy import Target, check_target
from denv_iac.node.spec import (
    AgentSettings,
    CacheVolume,
    NodeDeploySpec,
    NodeSpecError,
    ReplicaSpec,
)
from tests.node.fixtures import node_facts
from tests.stacks import valid_config

HOSTILE = {
    "newline": "x\nExecStartPre=/bin/sh -c id",
    "carriage return": "x\rExecStart=/bin/true",
    "leading dash": "--privileged",
    "quotes": "a\"b'c",
    "command substitution": "$(touch /tmp/owned)",
    "spaces": "a b  c",
    "non-ascii": "modèle-ü",
    "specifiers and escapes": "%h $HOME \\n ;",
}
CONTROLS = ("newline", "carriage return")
VALUES = list(HOSTILE.items())
IDS = list(HOSTILE)
IMAGE = "vllm/vllm-openai:v0.11.0"

Config = dict[str, Any]


def _refusal(change: Callable[[Config], object]) -> list[str]:
    config = valid_config()
    change(config)
    return _problems(config)


def _problems(config: Config) -> list[str]:
    try:
        read_stack("t", config)
    except StackError as error:
        assert all("\n" not in line and "\r" not in line for line in error.problems)
        return error.problems
    return []


def _one_line(path: str, value: str) -> str:
    what = "a newline" if "\n" in value else "a carriage return"
    return f"{path}: {value!r} holds {what}; write it on one line"


def _recipe(config: Config) -> dict[str, Any]:
    return config["denv:recipes"][2]  # type: ignore[no-any-return]  # on joined/hetzner nodes


def _joined_node(config: Config) -> dict[str, Any]:
    return config["denv:sites"][5]["nodes"][0]  # type: ignore[no-any-return]


# Values that reach a unit, a command line or a manifest as data: any one-line value is fine.
@pytest.mark.parametrize(("kind", "value"), VALUES, ids=IDS)
@pytest.mark.parametrize(
    ("field", "path", "change"),
    [
        ("command", "recipes[2].command", lambda c, v: _recipe(c).update(command=["serve", v])),
        (
            "env value",
            "recipes[2].env.HF_TOKEN",
            lambda c, v: _recipe(c).update(env={"HF_TOKEN": v}),
        ),
    ],
)
def test_data_values_are_refused_only_with_a_control_character(
    kind: str, value: str, field: str, path: str, change: Callable[[Config, str], object]
) -> None:
    problems = _refusal(lambda c: change(c, value))
    assert problems == ([_one_line(path, value)] if kind in CONTROLS else [])


# Values that name something to a tool (an image to docker, a host and a user to ssh, a variable
# to the env file): a hostile one is refused, with the rule for that field.
NAMES: list[tuple[str, Callable[[Config, str], object], Callable[[str], str]]] = [
    (
        "recipes[2].image",
        lambda c, v: _recipe(c).update(image=v),
        lambda v: (
            f'recipes[2].image: "{v}" is not a container image; give a container image '
            "reference like vllm/vllm-openai:v0.11.0"
        ),
    ),
    (
        "sites[5].nodes[0].address",
        lambda c, v: _joined_node(c).update(address=v),
        lambda v: (
            f'sites[5].nodes[0].address: "{v}" is not an IP address or host name; write a '
            "host name in letters, digits, '.' and '-', no part starting with '-'"
        ),
    ),
    (
        "sites[5].nodes[0].ssh_user",
        lambda c, v: _joined_node(c).update(ssh_user=v),
        lambda v: (
            f'sites[5].nodes[0].ssh_user: "{v}" is not a login name; use a login name of '
            "lower-case letters, digits, '_' and '-', starting with a letter"
        ),
    ),
    (
        "recipes[2].env",
        lambda c, v: _recipe(c).update(env={v: "1"}),
        lambda v: (
            f"recipes[2].env: {v!r} is not a variable name; use letters, digits and '_', "
            "not starting with a digit"
        ),
    ),
]


@pytest.mark.parametrize(("kind", "value"), VALUES, ids=IDS)
@pytest.mark.parametrize(("path", "change", "message"), NAMES, ids=[n[0] for n in NAMES])
def test_names_given_to_tools_are_refused(
    kind: str,
    value: str,
    path: str,
    change: Callable[[Config, str], object],
    message: Callable[[str], str],
) -> None:
    problems = _refusal(lambda c: change(c, value))
    controlled = kind in CONTROLS and not path.endswith(".env")
    assert problems == [_one_line(path, value) if controlled else message(value)]


def test_every_text_of_a_stack_refuses_a_newline() -> None:
    """Walk every string in a valid stack: each one, given a newline, is refused by its path."""
    leaves: list[tuple[str, list[Any] | dict[str, Any], Any]] = []

    def walk(path: str, node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = f"{path}.{key}" if isinstance(node, dict) else f"{path}[{key}]"
            if isinstance(value, dict | list) and not (
                isinstance(value, dict) and "secure" in value
            ):
                walk(where, value)
            elif isinstance(value, str):
                leaves.append((where, node, key))

    config = valid_config()
    for key in ("denv:sites", "denv:recipes", "denv:balancer"):
        walk(key.removeprefix("denv:"), config[key])
    assert len(leaves) > 40
    for path, _, key in leaves:
        fresh = valid_config()
        target: Any = {k.removeprefix("denv:"): v for k, v in fresh.items()}
        for part in path.replace("]", "").replace("[", ".").split(".")[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[key if isinstance(target, dict) else int(key)] += "\nx=y"
        problems = _problems(fresh)
        assert any(line.startswith(path.rsplit("[", 1)[0]) for line in problems), (path, problems)


# The writers: a value the node spec accepts keeps the unit, command line and env file in shape.


def systemd_split(line: str) -> list[str]:
    """Split an ExecStart= value the way systemd does, for the quoting systemd_quote writes."""
    words, i = [], 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        word: list[str] = []
        if line[i] == '"':
            i += 1
            while line[i] != '"':
                if line[i] == "\\":
                    code = line[i + 1]
                    if code in "xu":
                        width = 2 if code == "x" else 4
                        word.append(chr(int(line[i + 2 : i + 2 + width], 16)))
                        i += 2 + width
                        continue
                    word.append(code)
                    i += 2
                    continue
                word.append(line[i])
                i += 1
            i += 1
        else:
            while i < len(line) and line[i] != " ":
                assert line[i] not in "\"'\\;\n\r", line  # unquoted, these would be syntax
                word.append(line[i])
                i += 1
        words.append("".join(word).replace("$$", "$").replace("%%", "%"))
    return words


def _node(command: tuple[str, ...] = ("serve",), env: dict[str, str] | None = None) -> Any:
    replica = ReplicaSpec("voice.joined.a.0", IMAGE, 8000, 0, command, env=env or {})
    return NodeDeploySpec("joined.a", replicas=(replica,), balancer_addresses=("192.0.2.1",))


def _shape(text: str) -> list[str]:
    """Each line's directive (or section), without its value."""
    return [line.split("=", 1)[0] for line in text.splitlines()]


def _exec_start(text: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    return systemd_split(line.removeprefix("ExecStart="))


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_a_command_item_stays_one_argument_of_docker_in_the_unit(value: str) -> None:
    baseline = _node()
    spec = _node(("serve", value))
    unit = replicas.unit(spec, spec.replicas[0]).content.decode()
    plain = replicas.unit(baseline, baseline.replicas[0]).content.decode()
    assert _shape(unit) == _shape(plain)
    argv, plain_argv = _exec_start(unit), _exec_start(plain)
    # Everything up to the image (docker's own options) is untouched; the value comes after it.
    assert argv == [*plain_argv, value]
    assert argv.index(IMAGE) == plain_argv.index(IMAGE)


@pytest.mark.parametrize(("kind", "value"), VALUES, ids=IDS)
def test_an_env_value_is_one_line_of_the_env_file_or_refused(kind: str, value: str) -> None:
    if kind in CONTROLS:
        with pytest.raises(NodeSpecError) as raised:
            _node(env={"HF_TOKEN": value})
        assert raised.value.problems == [
            "replica 'voice.joined.a.0' env 'HF_TOKEN': use NAME=value without newlines"
        ]
        return
    spec = _node(env={"HF_TOKEN": value})
    text = replicas.env_file(spec, spec.replicas[0]).content.decode()
    lines = text.splitlines()
    # the token, the three cache variables and the replica's own port
    assert len(lines) == 5
    assert f"HF_TOKEN={value}" in lines
    assert f"PORT={spec.replicas[0].port}" in lines


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_a_hostile_image_never_reaches_docker(value: str) -> None:
    with pytest.raises(NodeSpecError) as raised:
        NodeDeploySpec("n", replicas=(ReplicaSpec("r", value, 8000, 0),))
    assert raised.value.problems == [
        f"replica 'r' image {value!r}: give a container image reference like "
        "vllm/vllm-openai:v0.11.0"
    ]


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_the_rule_set_takes_no_hostile_address_or_node_id(value: str) -> None:
    # The rule set holds only parsed addresses, ports and the node id: hostile ones never enter.
    with pytest.raises(NodeSpecError) as raised:
        NodeDeploySpec("n", balancer_addresses=(value,))
    assert raised.value.problems == [f"balancer_addresses {value!r}: give an IP address or CIDR"]
    with pytest.raises(NodeSpecError) as raised:
        NodeDeploySpec(value)
    assert raised.value.problems == [f"node_id {value!r}: use letters, digits, '.', '_' or '-'"]
    plain = firewall.rules(_node()).content.decode()
    assert "\t\ttcp dport { 8000, 9100 } ip saddr @balancer_v4 accept" in plain
    assert "\t\telements = { 192.0.2.1/32 }" in plain


@pytest.mark.parametrize(("kind", "value"), VALUES, ids=IDS)
def test_a_cache_device_stays_one_shell_word(kind: str, value: str) -> None:
    device = f"/dev/disk/by-id/{value.replace(' ', '_')}"
    if kind in CONTROLS:
        with pytest.raises(NodeSpecError):
            NodeDeploySpec("n", cache_volume=CacheVolume(device))
        return
    spec = NodeDeploySpec("n", cache_volume=CacheVolume(device))
    steps = cache.plan(node_facts(), spec)
    wait, mkfs = steps[0].commands
    assert shlex.split(mkfs) == [
        *("blkid", "-p", device, ">/dev/null", "||"),
        *("mkfs.ext4", "-q", "-L", cache.LABEL, device),
    ]
    assert f"echo {shlex.quote(f'{device} not attached after {cache.ATTACH_WAIT_S} s')};" in wait


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_ssh_targets_take_no_hostile_host_or_user(value: str) -> None:
    assert check_target(Target(host=value)) != []
    assert check_target(Target(host="203.0.113.9", user=value)) == [
        f"user {value!r}: not a login name; use a login name of lower-case letters, digits, '_' "
        "and '-', starting with a letter"
    ]


def test_an_ssh_option_as_host_is_refused() -> None:
    assert check_target(Target(host="-oProxyCommand=sh -c id")) == [
        "HOST '-oProxyCommand=sh -c id': not an IP address or host name; write a host name in "
        "letters, digits, '.' and '-', no part starting with '-'"
    ]


# Kubernetes: manifests are written by a YAML serializer, so a value stays one item.


@pytest.mark.parametrize(("kind", "value"), [v for v in VALUES if v[0] not in CONTROLS])
def test_a_value_stays_one_item_of_the_statefulset(kind: str, value: str) -> None:
    site = {
        "name": "k8s",
        "kind": "kubernetes",
        "kubeconfig": {"secure": "sealed"},
        "gpu": "H100",
        "gpus_per_node": 8,
        "max_nodes": 2,
    }
    edge = {"name": "edge", "kind": "local", "nodes": [{"name": "lb", "gpu": "L4", "gpus": 1}]}
    recipe = {
        "name": "voice",
        "min_warm": 1,
        "sites": ["k8s"],
        "image": IMAGE,
        "command": ["--model", value],
        "env": {"HF_TOKEN": value},
    }
    config = {
        "denv:sites": [site, edge],
        "denv:recipes": [recipe],
        "denv:balancer": {"sites": ["edge"]},
    }
    stack = read_stack("prod", config)
    manifests = site_manifests(stack, stack.site("k8s"), place_replicas(stack).replicas)
    stateful_set = yaml.safe_load(yaml.safe_dump(manifests.pools[0].stateful_set))
    container = stateful_set["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["--model", value]
    assert {"name": "HF_TOKEN", "value": value} in container["env"]
    assert container["image"] == IMAGE


@pytest.mark.parametrize("value", HOSTILE.values(), ids=IDS)
def test_agent_settings_stay_one_toml_value_or_are_refused(value: str) -> None:
    settings = {"thresholds": {"reason": value}}
    spec = NodeDeploySpec("n", agent=AgentSettings(config=settings))
    parsed = tomllib.loads(agent.config(spec).content.decode())
    assert parsed["thresholds"] == {"reason": value}
    # A hostile table or key name is refused, or (a bare TOML key such as --privileged) read back
    # as exactly that one key.
    for config in ({value: {"fail_after": 2}}, {"thresholds": {value: 2}}):
        try:
            spec = NodeDeploySpec("n", agent=AgentSettings(config=config))
        except NodeSpecError:
            continue
        parsed = tomllib.loads(agent.config(spec).content.decode())
        assert {k: parsed[k] for k in config} == config
    with pytest.raises(NodeSpecError):
        NodeDeploySpec("n", agent=AgentSettings(config={"thresholds": {"x": float("nan")}}))
