"""Who may reach what on a site, as plain data: the components turn these rows into rules.

Replica and agent ports are open only to the balancer hosts; SSH (and the balancer's metrics
port) only to the site's admin CIDRs; the balancer's endpoint port to everyone.
"""

from dataclasses import dataclass

from denv_iac.spec.model import BalancerSpec, RecipeSpec, SiteSpec
from denv_iac.spec.ports import (
    AGENT_PORT,
    AGENT_PORTS,
    MAX_GPUS_PER_NODE,
    PORTS_PER_GPU,
    SSH_PORT,
    recipe_port_range,
    replica_port,
)

# The port plan lives with the stack model (pure); components read it from here too.
__all__ = [
    "AGENT_PORT",
    "AGENT_PORTS",
    "MAX_GPUS_PER_NODE",
    "PORTS_PER_GPU",
    "SSH_PORT",
    "IngressRule",
    "balancer_ingress_rules",
    "recipe_port_range",
    "replica_port",
    "site_ingress_rules",
    "ssh_rules",
]
ANYWHERE = {"v4": "0.0.0.0/0", "v6": "::/0"}


@dataclass(frozen=True)
class IngressRule:
    name: str  # stable suffix of the rule's resource name
    description: str
    from_port: int
    to_port: int
    source: str  # a CIDR, or the site name of a balancer host when from_balancer
    from_balancer: bool = False


def _cidr_slug(cidr: str) -> str:
    return cidr.replace(".", "-").replace(":", "-").replace("/", "-")


def ssh_rules(admin_cidrs: tuple[str, ...]) -> list[IngressRule]:
    return [
        IngressRule(f"ssh-{_cidr_slug(c)}", f"SSH from admin {c}", SSH_PORT, SSH_PORT, c)
        for c in sorted(admin_cidrs)
    ]


def site_ingress_rules(
    site: SiteSpec, recipes: tuple[RecipeSpec, ...], balancer_sites: tuple[str, ...]
) -> tuple[IngressRule, ...]:
    """Ingress to a site's GPU nodes: per recipe that may run there, per balancer host."""
    rules = ssh_rules(site.admin_cidrs)
    for host in sorted(balancer_sites):
        rules.append(
            IngressRule(
                f"agent-from-{host}",
                f"agent-check from balancer {host}",
                AGENT_PORT,
                AGENT_PORT,
                host,
                from_balancer=True,
            )
        )
        for recipe in recipes:
            if site.name not in recipe.sites:
                continue
            low, high = recipe_port_range(recipe, site.gpus_per_node)
            rules.append(
                IngressRule(
                    f"{recipe.name}-from-{host}",
                    f"{recipe.name} replicas from balancer {host}",
                    low,
                    high,
                    host,
                    from_balancer=True,
                )
            )
    return tuple(rules)


def balancer_ingress_rules(
    balancer: BalancerSpec, admin_cidrs: tuple[str, ...]
) -> tuple[IngressRule, ...]:
    """Ingress to a balancer host: the endpoint from anywhere, metrics and SSH from admins."""
    rules = [
        IngressRule(f"endpoint-{family}", "the endpoint", balancer.port, balancer.port, cidr)
        for family, cidr in ANYWHERE.items()
    ]
    rules += [
        IngressRule(
            f"metrics-{_cidr_slug(c)}",
            f"Prometheus metrics from admin {c}",
            balancer.prometheus_port,
            balancer.prometheus_port,
            c,
        )
        for c in sorted(admin_cidrs)
    ]
    return (*rules, *ssh_rules(admin_cidrs))
