"""Every object of one kubernetes site, together and in the order they apply (site_manifests),
and what a stack must satisfy for them beyond what the stack reader checks (site_problems,
resource_name_problems)."""

from collections.abc import Sequence
from dataclasses import dataclass

from denv_iac.core.agent_config import AgentReplica
from denv_iac.core.balancer.gateway import (
    GatewayRoute,
    render_gateway_config,
)
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.kube_manifests.agent import (
    AGENT_NAME,
    agent_daemon_set,
    agent_local_service,
    agent_network_policy,
    agent_replica,
    agent_service,
    site_agent_toml,
)
from denv_iac.core.kube_manifests.gateway import (
    GATEWAY_NAME,
    GATEWAY_PORT_BASE,
    MAX_PORT,
    gateway_deployment,
    gateway_site,
    gateway_tls_secret,
    listen_port,
    node_service,
    node_stride,
)
from denv_iac.core.kube_manifests.objects import (
    Manifest,
    config_map,
    disruption_budget,
    gateway_labels,
    kube_object,
    site_labels,
)
from denv_iac.core.kube_manifests.pods import (
    POD_NAME_ENV,
    PoolManifests,
    pool_manifests,
    replica_network_policy,
)
from denv_iac.core.placement import PlacedReplica
from denv_iac.core.stack.gateway_link import gateway_tls_on
from denv_iac.core.stack.model import RecipeSpec, SiteSpec, StackSpec
from denv_iac.core.stack.ports import PORTS_PER_GPU, replica_port


@dataclass(frozen=True)
class SiteManifests:
    namespace: Manifest
    pools: tuple[PoolManifests, ...]
    network_policy: Manifest
    agent_config: Manifest
    agent: Manifest  # the DaemonSet
    agent_service: Manifest  # headless: every node's agent, by one DNS name
    agent_local_service: Manifest  # each replica pod's own node's agent (pod endpoints)
    agent_network_policy: Manifest
    gateway_config: Manifest
    # The frame of the gateway's TLS Secret (no data): None when the link is plain TCP.
    gateway_tls: Manifest | None
    gateway: Manifest
    gateway_budget: Manifest
    node_services: dict[str, Manifest]  # planning node -> its LoadBalancer Service
    routes: tuple[GatewayRoute, ...]

    def objects(self) -> list[Manifest]:
        """Every object, in the order they can be applied."""
        pools = [
            m
            for p in self.pools
            for m in (p.env_secret, p.service, p.stateful_set, p.disruption_budget)
            if m is not None
        ]
        agent = [
            self.agent_config,
            self.agent_service,
            self.agent_local_service,
            self.agent,
            self.agent_network_policy,
        ]
        tls = [self.gateway_tls] if self.gateway_tls is not None else []
        gateway = [self.gateway_config, *tls, self.gateway, self.gateway_budget]
        services = [self.node_services[node] for node in sorted(self.node_services)]
        return [self.namespace, *pools, self.network_policy, *agent, *gateway, *services]


# The agent mounts the kubelet's pod-resources folder (a hostPath volume), which the Pod Security
# Standards' baseline and restricted levels forbid: a cluster whose admission default enforces
# either would refuse its pods. The namespace is the stack's own, so it says its level itself,
# as the GPU operator's namespace does; a policy engine that forbids the label is not seen here.
POD_SECURITY = {"pod-security.kubernetes.io/enforce": "privileged"}


def site_problems(site: SiteSpec, recipes: Sequence[RecipeSpec]) -> list[str]:
    """What a kubernetes site needs beyond what the stack reader checks, one line each."""
    problems = []
    highest = GATEWAY_PORT_BASE + site.max_nodes * node_stride(site) - 1
    if highest > MAX_PORT:
        most = (MAX_PORT - GATEWAY_PORT_BASE + 1) // PORTS_PER_GPU
        problems.append(
            f"sites: {site.name}.max_nodes: {site.max_nodes} nodes of {site.gpus_per_node} GPUs "
            f"need gateway ports up to {highest}; keep max_nodes x gpus_per_node at most {most}"
        )
    for index, recipe in enumerate(recipes):
        if site.name not in recipe.sites:
            continue
        if not recipe.image:
            problems.append(
                f"recipes[{index}].image: missing; a kubernetes site ({site.name}) runs the "
                "model server as a container: add image: vllm/vllm-openai:v0.11.0"
            )
        if any(name == POD_NAME_ENV for name, _ in (*recipe.env, *recipe.secret_env)):
            problems.append(
                f"recipes[{index}].env.{POD_NAME_ENV}: the pod's own name on a kubernetes site "
                f"({site.name}), which its hooks read: remove it from env"
            )
    return problems


def resource_parts(manifest: Manifest) -> tuple[str, str]:
    """What a site's Pulumi resource for this object is named after, below the site's own
    name: its kind in lower case and its name (dash-joined, as every child's name is)."""
    return manifest["kind"].lower(), manifest["metadata"]["name"]


def resource_name_problems(stack: StackSpec, replicas: Sequence[PlacedReplica]) -> list[str]:
    """Objects of kubernetes sites whose Pulumi names would be one: site a's Service b-service-c
    and site a-service-b's Service c are both a-service-b-service-c, and a recipe named like one
    of a site's own objects (denv-agent) is that object's name twice. One line per clash,
    naming both objects; `denv plan` and the Cluster refuse the stack on them."""
    owners: dict[tuple[str, str], str] = {}
    problems = []
    for site in stack.sites:
        if site.kind != "kubernetes":
            continue
        placed = [r for r in replicas if r.site == site.name]
        manifests = site_manifests(stack, site, placed)
        for manifest in manifests.objects()[1:]:  # the Namespace is named after the site alone
            kind, name = resource_parts(manifest)
            full = "-".join((site.name, kind, name))
            pool = manifest["metadata"]["labels"].get("denv/pool")
            owner = (
                f"recipe {pool}'s {manifest['kind']} on kubernetes site {site.name}"
                if pool
                else f"kubernetes site {site.name}'s own {manifest['kind']} {name}"
            )
            key = (manifest["kind"], full)
            if key in owners:
                problems.append(
                    f"sites: {site.name}: {owner} and {owners[key]} would both be the resource "
                    f"{full}; rename a site or a recipe (names starting with denv- are the "
                    "sites' own)"
                )
            owners.setdefault(key, owner)
    return problems


def site_manifests(
    stack: StackSpec, site: SiteSpec, replicas: Sequence[PlacedReplica]
) -> SiteManifests:
    """Every object of one kubernetes site for the replicas placed on it."""
    ns = site.namespace
    pools = []
    routes: list[GatewayRoute] = []
    agent_replicas: list[AgentReplica] = []
    for recipe in stack.recipes:
        placed = [r for r in replicas if r.pool == recipe.name and r.site == site.name]
        if not placed:
            continue
        pools.append(pool_manifests(stack, site, recipe, placed))
        for ordinal, replica in enumerate(placed):
            pod = f"{recipe.name}-{ordinal}"
            route = GatewayRoute(
                replica.id,
                replica.node,
                replica_port(recipe, replica),
                listen_port(site, replica),
                f"{pod}.{recipe.name}.{ns}.svc.cluster.local",
                recipe.port,
            )
            routes.append(route)
            agent_replicas.append(agent_replica(route, pod, recipe))
    tls = gateway_tls_on(stack)
    haproxy_cfg = render_gateway_config(gateway_site(site, tls), routes, balancer_settings(stack))
    agent_toml = site_agent_toml(site, agent_replicas)
    nodes = sorted({route.node for route in routes})
    return SiteManifests(
        namespace=kube_object(
            "v1", "Namespace", {"name": ns, "labels": site_labels(stack.name, site) | POD_SECURITY}
        ),
        pools=tuple(pools),
        network_policy=replica_network_policy(stack.name, site, [p.pool for p in pools], stack),
        agent_config=config_map(stack.name, site, AGENT_NAME, "agent", {"agent.toml": agent_toml}),
        agent=agent_daemon_set(stack.name, site, agent_toml),
        agent_service=agent_service(stack.name, site),
        agent_local_service=agent_local_service(stack.name, site),
        agent_network_policy=agent_network_policy(stack.name, site),
        gateway_config=config_map(
            stack.name, site, GATEWAY_NAME, "gateway", {"haproxy.cfg": haproxy_cfg}
        ),
        gateway_tls=gateway_tls_secret(stack.name, site) if tls else None,
        gateway=gateway_deployment(stack.name, site, haproxy_cfg, tls),
        gateway_budget=disruption_budget(
            stack.name, site, GATEWAY_NAME, gateway_labels(stack.name, site), 1
        ),
        node_services={
            node: node_service(stack.name, site, node, [r for r in routes if r.node == node])
            for node in nodes
        },
        routes=tuple(routes),
    )
