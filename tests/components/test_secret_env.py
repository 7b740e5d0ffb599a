"""A recipe's `secure:` env values: Pulumi secrets from the stack file to the node's env file
or the site's Kubernetes Secret, and nowhere in plain text on the way."""

import stat
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml
from click.testing import CliRunner

from denv_iac.cli import main
from denv_iac.components.node_setup import NodeSetupProvider, _node_spec
from denv_iac.components.preview import SECRET_MARK, SECRET_SIG, shown
from denv_iac.components.secrets import seal_secrets, with_secret_recipes
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.node.replicas import env_file
from tests.components import stacks
from tests.components.harness import Run, cluster_outputs, plain_strings, run_program
from tests.components.test_kubernetes import SITE, k8s_args
from tests.components.test_secrets import _secret_flag

TOKEN = "hf_TOKEN-MATERIAL-1f2e3d"
PREVIEW = pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
DEPLOYMENT = "pulumi-python:dynamic/denv:NodeDeployment"


def _with_token(args: Any, recipe: str) -> Any:
    for raw in args["recipes"]:
        if raw["name"] == recipe:
            raw["env"] = {"LOG_LEVEL": "info", "HF_TOKEN": {"secure": TOKEN}}
    return args


def _config(args: Any) -> dict[str, Any]:
    return {f"denv:{key}": args[key] for key in ("sites", "recipes", "balancer")}


def test_the_reader_keeps_secure_env_values_apart_and_never_prints_them() -> None:
    stack = read_stack("prod", _config(_with_token(stacks.multicloud(), "assist")))
    (assist,) = [r for r in stack.recipes if r.name == "assist"]
    assert assist.env == (("LOG_LEVEL", "info"),)
    assert [name for name, _ in assist.secret_env] == ["HF_TOKEN"]
    assert TOKEN not in repr(assist)


def test_an_env_value_that_is_neither_text_nor_secure_is_one_line_naming_the_field() -> None:
    args = stacks.multicloud()
    args["recipes"][2]["env"] = {"HF_TOKEN": {"secure": 5}}
    with pytest.raises(StackError) as error:
        read_stack("prod", _config(args))
    assert str(error.value) == (
        "recipes[2].env: expected a mapping of names to string values or secure: values"
    )


@pytest.mark.parametrize("value", ["/elsewhere", {"secure": "v1:c"}], ids=["plain", "secure"])
def test_env_the_deploy_sets_is_refused_in_a_recipe(value: Any) -> None:
    args = stacks.multicloud()
    args["recipes"][2]["env"] = {"HF_HOME": value}
    with pytest.raises(StackError) as error:
        read_stack("prod", _config(args))
    assert str(error.value) == (
        "recipes[2].env.HF_HOME: set by the deploy for every replica; remove it"
    )


def test_seal_secrets_takes_secure_env_values_out_as_secrets() -> None:
    args = _with_token(stacks.multicloud(), "assist")
    found: dict[tuple[str, str], Any] = {}

    def program() -> dict[str, Any]:
        _, _, recipes, secrets = seal_secrets(args["sites"], args["balancer"], args["recipes"])
        found.update(secrets)
        assert recipes[2]["env"] == {"LOG_LEVEL": "info", "HF_TOKEN": {"secure": "sealed"}}
        value = secrets[("recipes.assist", "env.HF_TOKEN")]
        return {"token": pulumi.Output.all(value, _secret_flag(value))}

    run = run_program(program, preview=False)
    assert run.outputs["token"] == [TOKEN, True]
    assert [key for key in found if key[0].startswith("recipes.")] == [
        ("recipes.assist", "env.HF_TOKEN")
    ]


@pytest.mark.parametrize(
    ("declared", "secret_names"),
    [
        # The stack file says which were `secure:`; Pulumi's plain read has lost it.
        (
            [{"name": "voice", "env": {"LOG_LEVEL": "info", "HF_TOKEN": {"secure": "v1:c"}}}],
            {"HF_TOKEN"},
        ),
        # Nothing says which were secure: every value is taken as one.
        (None, {"HF_TOKEN", "LOG_LEVEL"}),
    ],
    ids=["declared", "unknown"],
)
def test_with_secret_recipes_takes_secure_values_from_the_secret_read(
    declared: Any, secret_names: set[str]
) -> None:
    decrypted = [{"name": "voice", "env": {"LOG_LEVEL": "info", "HF_TOKEN": TOKEN}}]

    def program() -> dict[str, Any]:
        (recipe,) = with_secret_recipes(decrypted, pulumi.Output.secret(decrypted), declared)
        env = recipe["env"]
        secure = {name for name, value in env.items() if isinstance(value, dict)}
        assert secure == secret_names
        assert "LOG_LEVEL" in secure or env["LOG_LEVEL"] == "info"
        value = env["HF_TOKEN"]["secure"]
        return {"token": pulumi.Output.all(value, _secret_flag(value))}

    run = run_program(program, preview=False)
    assert run.outputs["token"] == [TOKEN, True]


def _never_plain(run: Run) -> None:
    for registration in run.registrations:
        assert not any(TOKEN in s for s in plain_strings(registration.inputs)), registration.name


@PREVIEW
def test_a_node_gets_the_secret_env_as_a_secret_input_of_its_deploy(preview: bool) -> None:
    args = _with_token(stacks.multicloud(), "assist")
    run = run_program(lambda: cluster_outputs(args), preview=preview)
    _never_plain(run)
    deploys = {r.name: r.inputs for r in run.of_type(DEPLOYMENT)}
    with_env = sorted(name for name, inputs in deploys.items() if "secret_env" in inputs)
    assert with_env == [
        "prod-hetzner-fsn-gex-1-setup-deploy",
        "prod-hetzner-fsn-gex-2-setup-deploy",
    ]
    inputs = deploys["prod-hetzner-fsn-gex-1-setup-deploy"]
    assert shown(inputs)["secret_env"] == "[secret]"
    if preview:
        return
    assert inputs["secret_env"][SECRET_SIG] == SECRET_MARK
    # The deploy, as the engine hands it the decrypted inputs, writes the value to the env file.
    props = {
        k: v["value"] if isinstance(v, dict) and SECRET_SIG in v else v for k, v in inputs.items()
    }
    spec = _node_spec(props)
    (replica,) = spec.replicas
    assert replica.env == {"LOG_LEVEL": "info", "HF_TOKEN": TOKEN}
    content = env_file(spec, replica)
    assert f"HF_TOKEN={TOKEN}\n" in content.content.decode()
    assert stat.S_IMODE(int(content.mode, 8)) == 0o600
    # A rotated token re-runs the deploy.
    rotated = {**props, "secret_env": {replica.id: {"HF_TOKEN": "hf_rotated"}}}
    assert NodeSetupProvider().diff("hetzner-fsn.gex-1", props, rotated).changes


@PREVIEW
def test_a_kubernetes_pool_reads_the_secret_env_from_its_own_secret(preview: bool) -> None:
    args = _with_token(k8s_args(), "voice")
    run = run_program(lambda: cluster_outputs(args), preview=preview)
    _never_plain(run)
    secret = run.named(f"{SITE}-secret-voice-env")
    assert secret.type == "kubernetes:core/v1:Secret"
    assert shown(secret.inputs)["stringData"] == "[secret]"
    if not preview:
        assert secret.inputs["stringData"]["value"] == {"HF_TOKEN": TOKEN}
    stateful_set = shown(run.named(f"{SITE}-statefulset-voice").inputs)
    (server, *_) = stateful_set["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in server["env"]}
    assert env["LOG_LEVEL"] == {"name": "LOG_LEVEL", "value": "info"}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "voice-env", "key": "HF_TOKEN"}},
    }
    # A pool without secure values has no Secret.
    assert not [r for r in run.registrations if r.name == f"{SITE}-secret-side-env"]


def test_plan_shows_the_secret_env_masked_in_text_and_json(tmp_path: Path) -> None:
    args = _with_token(stacks.multicloud(), "assist")
    document = {"config": _config(args)}
    (tmp_path / "Pulumi.prod.yaml").write_text(yaml.safe_dump(document))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--stack",
            "prod",
            "--stacks-dir",
            str(tmp_path),
            "--resources",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "secret_env=[secret]" in result.output
    assert TOKEN not in result.output
    assert TOKEN not in out.read_text()
    assert "HF_TOKEN" not in out.read_text()  # not even which variables are secret


def test_a_canary_runs_with_its_recipes_secure_values_and_holds_none_of_its_own() -> None:
    args = _with_token(stacks.multicloud(), "assist")
    hetzner = next(site for site in args["sites"] if site["name"] == "hetzner-fsn")
    hetzner["nodes"].append({"name": "gex-3", "address": "203.0.113.23", "server_model": "GEX130"})
    assist = next(recipe for recipe in args["recipes"] if recipe["name"] == "assist")
    assist["canary"] = {"share": 0.2, "image": "vllm/vllm-openai:v0.12.0"}
    run = run_program(lambda: cluster_outputs(args), preview=False)
    _never_plain(run)
    deploys = {r.name: r.inputs for r in run.of_type(DEPLOYMENT)}
    inputs = deploys["prod-hetzner-fsn-gex-3-setup-deploy"]
    props = {
        k: v["value"] if isinstance(v, dict) and SECRET_SIG in v else v for k, v in inputs.items()
    }
    (replica,) = _node_spec(props).replicas
    assert replica.id.startswith("assist-canary.hetzner-fsn.gex-3.")
    assert replica.image == "vllm/vllm-openai:v0.12.0"
    assert replica.env == {"LOG_LEVEL": "info", "HF_TOKEN": TOKEN}
    # A secure: value in the canary's own env, decrypted by Pulumi, is sealed, then refused.
    declared = [{"name": "voice", "canary": {"env": {"HF_TOKEN": {"secure": "v1:abc"}}}}]
    decrypted = [{"name": "voice", "canary": {"share": 0.1, "env": {"HF_TOKEN": TOKEN}}}]
    (recipe,) = with_secret_recipes(decrypted, pulumi.Output.secret(decrypted), declared)
    assert TOKEN not in str(recipe)
    config = stacks.multicloud()
    voice = next(r for r in config["recipes"] if r["name"] == "assist")
    voice["canary"] = {"share": 0.1, "env": recipe["canary"]["env"]}
    with pytest.raises(StackError) as error:
        read_stack("prod", _config(config))
    assert error.value.problems == [
        "recipes[2].canary.env.HF_TOKEN: a canary runs with the recipe's secure: values and holds"
        " none of its own; put it in the recipe's env as secure:, or give the canary a plain value"
    ]
