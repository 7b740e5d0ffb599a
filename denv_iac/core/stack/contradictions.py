"""Warnings about settings that are each valid but work against each other.

Each is one line naming the field and the fix; `denv plan` prints them with the exposure
warnings (denv_iac.core.stack.exposure) and `denv plan --strict` refuses the stack on them.
"""

import ipaddress

from denv_iac.core.stack.model import StackSpec

# Networks container runtimes and Kubernetes distributions route on a node by default (a
# bridge, a pod network): an overlay that overlaps one sends the balancer's traffic into it.
# Service ranges are left out: they are virtual addresses, matched one by one, not routed.
CONTAINER_RANGES = (
    ("Docker's default bridge", "172.17.0.0/16"),
    ("Flannel's default pod network", "10.244.0.0/16"),
    ("k3s's default pod network", "10.42.0.0/16"),
)


def contradiction_warnings(stack: StackSpec) -> list[str]:
    return _probe_budget_warnings(stack) + _overlay_range_warnings(stack)


def _probe_budget_warnings(stack: StackSpec) -> list[str]:
    """A probe budget past the balancer's first-token timeout: the balancer has already given
    up on a replica (and sent the request elsewhere) before the agent would call it slow, so
    the probe never takes a slow replica out first."""
    out = []
    for index, recipe in enumerate(stack.recipes):
        budget = recipe.ttft_budget_ms
        if budget is not None and budget > recipe.first_token_timeout_ms:
            out.append(
                f"recipes[{index}].ttft_budget_ms: {budget} is longer than its"
                f" first_token_timeout_ms ({recipe.first_token_timeout_ms}), so the balancer"
                " retries a slow replica's requests elsewhere before its agent would call it"
                f" slow; make it at most {recipe.first_token_timeout_ms}"
            )
    return out


def _overlay_range_warnings(stack: StackSpec) -> list[str]:
    overlay = stack.balancer.overlay
    if not overlay.enabled:
        return []
    ours = ipaddress.ip_network(overlay.cidr, strict=False)
    return [
        f"balancer.overlay.cidr: {overlay.cidr} overlaps {name} ({cidr}), so on a node that"
        " runs it the overlay's traffic can be routed into that network; pick a range clear"
        " of it, e.g. the default 10.99.0.0/16"
        for name, cidr in CONTAINER_RANGES
        if ours.overlaps(ipaddress.ip_network(cidr))
    ]
