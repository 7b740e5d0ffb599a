"""`denv plan` says how the Kubernetes sites' gateways are reached, and warns when in the clear."""

import io

import pytest
from rich.console import Console

from denv_iac.cli.plan_view import render_gateway_link
from denv_iac.core.plan import make_plan
from denv_iac.core.stack.reader import read_stack
from tests.test_kube_manifests import EDGE, VOICE, _site

LOCAL = {"name": "box", "kind": "local", "nodes": [{"name": "n", "gpu": "L4", "gpus": 1}]}


def _shown(sites: list[dict[str, object]], recipes: list[dict[str, object]], on: bool) -> str:
    balancer = {"sites": ["edge"], "overlay": {"enabled": on}}
    stack = read_stack(
        "prod", {"denv:sites": [*sites, EDGE], "denv:recipes": recipes, "denv:balancer": balancer}
    )
    out = io.StringIO()
    render_gateway_link(make_plan(stack), Console(file=out, width=300, color_system=None))
    return out.getvalue().strip()


@pytest.mark.parametrize(
    "sites, on, expected",
    [
        (
            [_site(), _site(name="k8s-b")],
            True,
            "Kubernetes link: mutual TLS to the gateway of k8s, k8s-b (TLS 1.3, the stack's own "
            "CA, a client certificate required; agent checks relayed over the same TLS)",
        ),
        (
            [_site()],
            False,
            "warning: Kubernetes link: plain TCP to the gateway of k8s "
            "(balancer.overlay.enabled: false); prompts, streams and agent checks cross "
            "unencrypted",
        ),
        ([LOCAL], True, ""),
    ],
    ids=["tls", "plain", "no-kubernetes"],
)
def test_the_plan_states_how_the_kubernetes_link_is_protected(
    sites: list[dict[str, object]], on: bool, expected: str
) -> None:
    local = {**VOICE, "sites": ["box"], "min_warm": 1, "spare": 0}
    recipe = VOICE if sites[0]["kind"] == "kubernetes" else local
    assert _shown(sites, [recipe], on) == expected
