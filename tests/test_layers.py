"""The layout's promise: each layer imports only from the layers below it (README, Layout)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "denv_iac"
# Lowest first. A module belongs to the first layer whose prefix it starts with.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core",
        (
            "denv_iac.spec",
            "denv_iac.catalog",
            "denv_iac.placement",
            "denv_iac.rollout",
            "denv_iac.overlay",
            "denv_iac.plan",
            "denv_iac.balancer",
            "denv_iac.kube_manifests",
            "denv_iac.dataplane",
            "denv_iac.schema_docs",
            "denv_iac.endpoint",
            "denv_iac.ingress",
            "denv_iac.sites",
            "denv_iac.agent_config",
            "denv_iac.robot_firewall",
        ),
    ),
    ("machines", ("denv_iac.node", "denv_iac.local", "denv_iac.lambda_api", "denv_iac.robot_api")),
    ("wiring", ("denv_iac.components",)),
    ("ops", ("denv_iac.ops",)),
    ("cli", ("denv_iac.cli", "denv_iac.__main__")),
)
# What the pure core may not import at all, even indirectly through a third-party name.
NOT_IN_CORE = (
    "pulumi",
    "pulumi_aws",
    "pulumi_hcloud",
    "pulumi_kubernetes",
    "pulumi_nebius",
    "pyinfra",
    "httpx",
    "click",
    "rich",
    "matplotlib",
)


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            if node.module == "denv_iac":
                found += [f"denv_iac.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


MODULES = sorted(
    (p for p in PACKAGE.rglob("*.py") if _module(p) != "denv_iac"), key=lambda p: _module(p)
)


def test_every_module_has_a_layer() -> None:
    assert [_module(p) for p in MODULES if _layer(_module(p)) is None] == []


@pytest.mark.parametrize("path", MODULES, ids=_module)
def test_imports_go_down_the_layers_only(path: Path) -> None:
    module = _module(path)
    own = _layer(module)
    assert own is not None
    upward = []
    for name in _imports(path):
        if name.startswith("denv_iac."):
            other = _layer(name)
            if other is not None and other > own:
                upward.append(f"{name} ({LAYERS[other][0]})")
        elif own == 0 and name.split(".")[0] in NOT_IN_CORE:
            upward.append(name)
    assert upward == [], f"{module} ({LAYERS[own][0]}) imports from above: {upward}"
