"""How the balancer reaches a Kubernetes site's in-cluster gateway: mutual TLS, or plain TCP.

Machines reached over SSH join the WireGuard overlay; a Kubernetes site's gateway does not. A
WireGuard peer in a pod needs NET_ADMIN and the WireGuard module (or a userspace wireguard-go and
/dev/net/tun) on the cluster's nodes, which managed clusters (EKS, GKE, AKS, Nebius) restrict or
forbid. TLS to the gateway needs nothing of the nodes, and HAProxy does it natively at both ends:
the gateway's listeners accept only TLS with a client certificate of the stack's own private CA
(`verify required`), and the balancer verifies the gateway's certificate by its name. Agent
checks, which HAProxy's agent-check cannot send over TLS, go through a relay on the balancer host's
loopback that forwards them over the same mutual TLS (see `denv_iac.core.balancer.agent_relays`).

Pure: no Pulumi, no I/O.
"""

from denv_iac.core.stack.model import StackSpec

KUBERNETES = "kubernetes"
# Names under a domain reserved for private use (ICANN, 2024): never resolved, only verified.
_TLS_DOMAIN = "denv.internal"


def kubernetes_sites(stack: StackSpec) -> tuple[str, ...]:
    """The stack's Kubernetes sites, by name, in the stack's order."""
    return tuple(site.name for site in stack.sites if site.kind == KUBERNETES)


def gateway_tls_on(stack: StackSpec) -> bool:
    """Whether the balancer reaches Kubernetes gateways over mutual TLS.

    On wherever the overlay is: `balancer.overlay.enabled: false` says every site shares one
    private network with the balancer, and then the gateways are reached in plain TCP too.
    """
    return stack.balancer.overlay.enabled and bool(kubernetes_sites(stack))


def gateway_tls_name(site: str) -> str:
    """The name in a site's gateway certificate: the balancer sends it as SNI and verifies it."""
    return f"gateway.{site}.{_TLS_DOMAIN}"


def gateway_link_warnings(stack: StackSpec) -> list[str]:
    """Kubernetes sites the balancer reaches in plain TCP because private links are off."""
    used = {site for recipe in stack.recipes for site in recipe.sites}
    plain = [site for site in kubernetes_sites(stack) if site in used]
    if stack.balancer.overlay.enabled or not plain:
        return []
    return [
        f"balancer.overlay.enabled: false also sends prompts, streams and agent checks to the "
        f"gateway of {', '.join(plain)} in plain TCP; turn it back on (mutual TLS to the "
        "gateway) unless the cluster shares one private network with the balancer"
    ]
