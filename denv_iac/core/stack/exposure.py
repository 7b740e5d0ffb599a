"""Warnings about what a valid stack exposes: legal, but rarely what anyone means.

Each is one line naming the field and the fix. `denv plan` prints them and still succeeds;
`denv plan --strict` (for CI) refuses the stack instead.
"""

import hashlib
import ipaddress

from denv_iac.core.stack.contradictions import contradiction_warnings
from denv_iac.core.stack.gateway_link import KUBERNETES, gateway_link_warnings
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.overlay_reader import overlay_warnings

# Kinds whose machines get a cloud firewall from the stack: without admin_cidrs it has no SSH
# rule, so the deploy cannot reach the machines it just created.
FIREWALLED_KINDS = ("aws", "lambda", "nebius", "hetzner")
# Kinds whose machines exist already: only their host firewall (the node deploy's nftables)
# guards SSH, and without admin_cidrs it leaves SSH as it found it.
HOST_FIREWALLED_KINDS = ("joined",)
# Keys anyone would try first: an endpoint that accepts one is open to everyone.
GUESSABLE_KEYS = ("test", "secret", "password", "changeme", "admin", "key", "demo", "1234")
_GUESSABLE = {hashlib.sha256(key.encode()).hexdigest(): key for key in GUESSABLE_KEYS}
# Lambda regions where firewall rules do not apply (Lambda Cloud API spec 1.8.3, on its
# firewall endpoints): the site's ruleset is made but filters nothing there.
LAMBDA_UNFILTERED_REGIONS = ("us-south-1",)
# Kinds whose endpoint is reachable from other machines (a local stack listens on loopback).
REMOTE_KINDS = ("aws", "hetzner", "joined")


def _link_local(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_link_local
    except ValueError:
        return False  # a host name


def metrics_on_loopback(stack: StackSpec) -> bool:
    """Whether the balancer's metrics and stats page listen on 127.0.0.1 only: on a joined
    machine without admin_cidrs no firewall guards their port (the host firewall is left as the
    machine has it), and the stats page names every replica's address. Every balancer host
    serves one config, so one such host puts them on loopback on every host."""
    sites = {site.name: site for site in stack.sites}
    return any(
        sites[name].kind in HOST_FIREWALLED_KINDS and not sites[name].admin_cidrs
        for name in stack.balancer.sites
        if name in sites
    )


def stack_warnings(stack: StackSpec) -> list[str]:
    warnings = []
    for index, site in enumerate(stack.sites):
        if site.kind not in (*FIREWALLED_KINDS, *HOST_FIREWALLED_KINDS):
            continue  # local and Kubernetes sites have no SSH
        if site.kind == "lambda" and site.region in LAMBDA_UNFILTERED_REGIONS:
            warnings.append(
                f"sites[{index}].region: Lambda applies no firewall rules in {site.region}, so "
                "every port of its instances is open to the internet and only the node "
                "deploy's host firewall guards them; pick another Lambda region to have both"
            )
        path = f"sites[{index}].admin_cidrs"
        world = [
            c for c in site.admin_cidrs if ipaddress.ip_network(c, strict=False).prefixlen == 0
        ]
        for j, node in enumerate(site.nodes):
            if _link_local(node.address):
                warnings.append(
                    f"sites[{index}].nodes[{j}].address: {node.address} is link-local (where "
                    "clouds serve instance metadata), reachable only on its own link; give the "
                    "machine's routable address"
                )
        if world:
            warnings.append(
                f"{path}: {', '.join(world)} opens SSH (and the balancer's metrics) to the whole "
                "internet; list only the addresses you administer from"
            )
        if not site.admin_cidrs and site.kind in HOST_FIREWALLED_KINDS:
            metrics = (
                " (the balancer's metrics listen on 127.0.0.1 only: reach them over SSH)"
                if site.name in stack.balancer.sites
                else ""
            )
            warnings.append(
                f"{path}: none given, so the node firewall leaves SSH open to every address"
                f"{metrics}; add the addresses you administer from, e.g. "
                "admin_cidrs: [198.51.100.7/32]"
            )
        elif not site.admin_cidrs:
            warnings.append(
                f"{path}: none given, so the firewall admits no SSH and the deploy cannot reach "
                "the machines; add your address, e.g. admin_cidrs: [198.51.100.7/32]"
            )
    kinds = {site.name: site.kind for site in stack.sites}
    balancer = stack.balancer
    remote = any(kinds.get(site) in REMOTE_KINDS for site in balancer.sites)
    if remote and not balancer.api_key_digests and balancer.tls_certificate is None:
        warnings.append(
            "balancer: the endpoint takes neither API keys nor TLS, so anyone who finds it can "
            "use the GPUs; add api_key_digests (see `denv key digest`) or a tls_certificate"
        )
    for digest in balancer.api_key_digests:
        key = _GUESSABLE.get(digest.lower())
        if key is not None:
            warnings.append(
                f'balancer.api_key_digests: {digest[:12]}... is the SHA-256 of "{key}", a key '
                "anyone would try; make one with `openssl rand -hex 32` and list its digest"
            )
    warnings += mig_strategy_warnings(stack)
    warnings += contradiction_warnings(stack)
    return warnings + overlay_warnings(stack) + gateway_link_warnings(stack)


def mig_strategy_warnings(stack: StackSpec) -> list[str]:
    """A MIG recipe on a kubernetes site asks for `nvidia.com/mig-<profile>`, which the GPU
    operator advertises only under its `mixed` MIG strategy; its default, `single`, advertises
    MIG devices as `nvidia.com/gpu`, and the pods stay Pending. The stack does not read the
    cluster: a site states its strategy (`mig_strategy`), and until it does this is said."""
    unstated = {
        site.name for site in stack.sites if site.kind == KUBERNETES and not site.mig_strategy
    }
    out = []
    for index, recipe in enumerate(stack.recipes):
        sites = sorted(unstated & set(recipe.sites))
        if recipe.is_mig and sites:
            out.append(
                f"recipes[{index}].share: {recipe.share} on {', '.join(sites)} needs the GPU "
                f"operator's mixed MIG strategy (its default, single, never offers "
                f"nvidia.com/mig-{recipe.share} and the pods stay Pending); install it with "
                "--set mig.strategy=mixed and set the site's mig_strategy: mixed"
            )
    return out
