"""The Kubernetes objects of a kubernetes site, as plain manifests: pure, no Pulumi.

Replicas are pods: one StatefulSet per pool, pod `<pool>-<ordinal>` serving the pool's
`ordinal`-th replica placed on the site, on one `nvidia.com/gpu` or one MIG device
(`nvidia.com/mig-<profile>`, the GPU operator's mixed strategy).

The global balancer reaches every replica at its node's address and `replica_port`, and asks
every node's agent on AGENT_PORT, sending the replica id (`agent-send`). On this site the
placement's nodes are planning units of `gpus_per_node` GPUs, not Kubernetes nodes: the
scheduler picks those. Two replicas on different planning nodes often share a port (the same
GPU index on each), so one address for the whole site would make them indistinguishable.
Hence the gateway design: one HAProxy Deployment in the cluster forwarding TCP, and one
LoadBalancer Service per planning node, whose address is that node's address. A Service maps
each replica port of its node onto a gateway listener of its own (GATEWAY_PORT_BASE plus the
node's ordinal and the replica's GPU and slice, so a listener never moves when replicas are
added), which forwards to the pod's stable name `<pool>-<i>.<pool>.<ns>.svc.cluster.local`.

The agent runs as NVIDIA's own exporters do (dcgm-exporter): one pod per GPU node, a
DaemonSet, in the `nvidia` runtime class with every GPU of the node visible, reading from the
kubelet's pod-resources API which GPU or MIG device each replica pod was given. A container
that asks for no GPU sees none: since GPU Operator 25.10, CDI is on and `nvidia` is no longer
the default runtime, so without the runtime class NVML fails. Every agent of the site has the
same config, naming all the site's replicas by pod; it answers for the replicas whose pods run
on its node and says AGENT_UNKNOWN (denv_iac.core.balancer.gateway) for the others. Agent checks all
arrive at the gateway on AGENT_PORT; it routes each by the replica id it carries to a backend
holding every node's agent, where a check sending that id marks down each agent that does not
know the replica, so the balancer's check is relayed to the agent of the replica's node. The
global balancer keeps its per-replica health checks, agent verdicts and session affinity
exactly as on machines; the gateway is only a relay, its haproxy.cfg rendered by
`denv_iac.core.balancer.gateway`. The price is one cloud load balancer per planning node.

A replica pod rolls as a replica on a machine does. Its readiness means warm, and its preStop
drains it and waits for its calls to end; both ask the agent of the pod's own node, through a
Service that keeps traffic on the caller's node (AGENT_LOCAL_NAME), on the agent's pod endpoints.

Every listener the balancer calls (replica ports and the agent frontend) takes only TLS with a
client certificate of the stack's own CA, whose certificate and key reach the pods as a Secret
(see `denv_iac.core.stack.gateway_link` for why TLS and not a WireGuard peer).
"""

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from denv_iac.core.agent_config import AgentConfig, AgentReplica, agent_config_toml, recipe_probe
from denv_iac.core.balancer.gateway import (
    GATEWAY_HEALTH_PORT,
    GatewayRoute,
    GatewaySite,
    GatewayTls,
    gateway_rejoin_ms,
    render_gateway_config,
)
from denv_iac.core.balancer.haproxy import rejoin_s
from denv_iac.core.drain import drain_plan
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.placement import PlacedReplica
from denv_iac.core.scripts import script
from denv_iac.core.stack.command import ANY_ADDRESS, render_command
from denv_iac.core.stack.gateway_link import gateway_tls_on
from denv_iac.core.stack.model import SERVER_STOP_S, RecipeSpec, SiteSpec, StackSpec
from denv_iac.core.stack.ports import AGENT_PORT, PORTS_PER_GPU, replica_port

Manifest = dict[str, Any]

GATEWAY_NAME = "denv-gateway"
GATEWAY_IMAGE = "haproxy:2.8"  # the official image; it reads /usr/local/etc/haproxy/haproxy.cfg
GATEWAY_CONFIG_DIR = "/usr/local/etc/haproxy"
GATEWAY_REPLICAS = 2
GATEWAY_PORT_BASE = 10000
# Mutual TLS on the gateway's listeners (spec.gateway_link): the Secret holding its certificate
# and key (GATEWAY_TLS_PEM) and the stack's CA that signed the balancer's client certificate
# (GATEWAY_TLS_CA), mounted read-only where the config reads them. The component fills the
# Secret's data; no manifest holds a key.
GATEWAY_TLS_SECRET = "denv-gateway-tls"
GATEWAY_TLS_DIR = "/etc/denv/gateway-tls"
GATEWAY_TLS_PEM = "gateway.pem"
GATEWAY_TLS_CA = "ca.pem"
# The official image runs HAProxy as user and group haproxy, 99: the Secret's files are that
# group's, readable by it alone (0440).
HAPROXY_GID = 99
GATEWAY_TLS_MODE = 0o440
MAX_PORT = 65535
AGENT_IMAGE = "denv/denv-agent:0.1.0"  # built from agent/; the version the node deploy installs
AGENT_NAME = "denv-agent"
AGENT_CONFIG_DIR = "/etc/denv/agent"
AGENT_RUN_DIR = "/run/denv"
# The GPU operator's runtime class: the one that gives a container the GPUs it names in
# NVIDIA_VISIBLE_DEVICES without asking for them as a resource.
NVIDIA_RUNTIME_CLASS = "nvidia"
# The kubelet's pod-resources API socket lives here (the v1 PodResourcesLister).
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
SERVER_CONTAINER = "server"
# The agent's pod endpoints (readiness that means warm, drain before a pod stops), which each
# replica pod asks its own node's agent through AGENT_LOCAL_NAME: a Service whose traffic stays
# on the caller's node (internalTrafficPolicy Local), so it reaches that node's agent alone. The
# port is the agent pod's own (not the node's), free beside AGENT_PORT and its HTTP port.
AGENT_PODS_PORT = AGENT_PORT + 2
AGENT_LOCAL_NAME = "denv-agent-local"
# The replica pod's own name, given to its hooks by the downward API.
POD_NAME_ENV = "DENV_POD"
# How often the warm readiness is asked, how long one answer may take (python3's start-up
# included), and how many misses make a ready pod unready.
READY_PERIOD_S = 10
READY_TIMEOUT_S = 5
READY_FAILURES = 3
CACHE_VOLUME = "cache"
STARTUP_PERIOD_S = 10
# What GPU feature discovery labels nodes with (`nvidia.com/gpu.product`): the driver's product
# name with spaces as dashes. Each catalog model lists exactly the cards with its memory and MIG
# profiles, since replicas are placed and sliced by those: an H100 NVL (94 GB, 1g.12gb slices)
# is not an H100 (80 GB, 1g.10gb), nor an H200 NVL an H200 SXM (the catalog's H200 offerings).
# Every catalog model has its entry: a model without one would let pods land on any GPU.
GPU_PRODUCTS = {
    "A10": ("NVIDIA-A10",),
    "A10G": ("NVIDIA-A10G",),
    "A30": ("NVIDIA-A30",),
    "A100-40GB": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
    "A100-80GB": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "B200": ("NVIDIA-B200",),
    "B300": ("NVIDIA-B300-SXM6-AC",),
    "H100": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"),
    "H200": ("NVIDIA-H200",),
    "H200-NVL": ("NVIDIA-H200-NVL",),
    "L4": ("NVIDIA-L4",),
    "L40S": ("NVIDIA-L40S",),
    "RTX-4000-SFF-ADA": ("NVIDIA-RTX-4000-SFF-Ada-Generation",),
    "RTX-6000-ADA": ("NVIDIA-RTX-6000-Ada-Generation",),
    "RTX-PRO-4000-SFF-BLACKWELL": ("NVIDIA-RTX-PRO-4000-Blackwell-SFF-Edition",),
    "RTX-PRO-6000-BLACKWELL-MAXQ": ("NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition",),
}


@dataclass(frozen=True)
class PoolManifests:
    pool: str
    stateful_set: Manifest
    service: Manifest  # headless: gives each pod its stable DNS name
    disruption_budget: Manifest
    # The recipe's `secure:` env values, without them: the component fills `stringData` with
    # the secrets themselves, so no manifest or preview of the StatefulSet ever holds one.
    env_secret: Manifest | None
    # How long `pulumi up` waits for the StatefulSet's rollout (see rollout_timeout_s).
    rollout_timeout_s: int


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
    highest = GATEWAY_PORT_BASE + site.max_nodes * _node_stride(site) - 1
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
        pools.append(_pool_manifests(stack, site, recipe, placed))
        for ordinal, replica in enumerate(placed):
            pod = f"{recipe.name}-{ordinal}"
            route = GatewayRoute(
                replica.id,
                replica.node,
                replica_port(recipe, replica),
                _listen_port(site, replica),
                f"{pod}.{recipe.name}.{ns}.svc.cluster.local",
                recipe.port,
            )
            routes.append(route)
            agent_replicas.append(_agent_replica(route, pod, recipe))
    tls = gateway_tls_on(stack)
    haproxy_cfg = render_gateway_config(gateway_site(site, tls), routes, balancer_settings(stack))
    agent_toml = _agent_toml(site, agent_replicas)
    nodes = sorted({route.node for route in routes})
    return SiteManifests(
        namespace=_object(
            "v1", "Namespace", {"name": ns, "labels": _labels(stack.name, site) | POD_SECURITY}
        ),
        pools=tuple(pools),
        network_policy=_network_policy(stack.name, site, [p.pool for p in pools], stack),
        agent_config=_config_map(stack.name, site, AGENT_NAME, "agent", {"agent.toml": agent_toml}),
        agent=_agent_daemon_set(stack.name, site, agent_toml),
        agent_service=_agent_service(stack.name, site),
        agent_local_service=_agent_local_service(stack.name, site),
        agent_network_policy=_agent_network_policy(stack.name, site),
        gateway_config=_config_map(
            stack.name, site, GATEWAY_NAME, "gateway", {"haproxy.cfg": haproxy_cfg}
        ),
        gateway_tls=_gateway_tls_secret(stack.name, site) if tls else None,
        gateway=_gateway(stack.name, site, haproxy_cfg, tls),
        gateway_budget=_disruption_budget(
            stack.name, site, GATEWAY_NAME, _gateway_labels(stack.name, site), 1
        ),
        node_services={
            node: _node_service(stack.name, site, node, [r for r in routes if r.node == node])
            for node in nodes
        },
        routes=tuple(routes),
    )


def gpu_resource(recipe: RecipeSpec) -> str:
    """The extended resource a replica asks for: a whole GPU, or one MIG device."""
    return f"nvidia.com/mig-{recipe.share}" if recipe.is_mig else "nvidia.com/gpu"


def startup_failure_threshold(recipe: RecipeSpec) -> int:
    """Probes every STARTUP_PERIOD_S, enough of them to cover the recipe's cold start."""
    return math.ceil(recipe.cold_start_budget_s / STARTUP_PERIOD_S)


def min_available(recipe: RecipeSpec, on_site: int) -> int:
    """The PodDisruptionBudget's minAvailable for `on_site` replicas of the pool here.

    A pool survives losing `spare` replicas, but each of its sites may be drained by its own
    operators at the same time: a site may give up only its proportional part of the spare,
    rounded down, so that all sites' allowances together never exceed it. At least one replica
    stays, even when that makes a drain wait, since an empty site means a cold start.
    """
    share = recipe.spare * on_site // recipe.replicas_wanted
    return max(1, on_site - share)


def max_unavailable(recipe: RecipeSpec, on_site: int) -> int:
    """How many of the pool's pods here a rollout may restart at once: the site's share of the
    spare (what the disruption budget lets go), and at least one, so that a rollout moves.
    The controller takes a pod down only once the one before it is ready again; above one it
    needs the MaxUnavailableStatefulSet feature, and one at a time without it."""
    return max(1, on_site - min_available(recipe, on_site))


def termination_grace_s(recipe: RecipeSpec) -> int:
    """How long a stopping pod may take: its sessions' drain bound, then the server's own stop
    (what `docker stop -t` gives it on a node)."""
    return recipe.drain_timeout_s + SERVER_STOP_S


# What a rollout takes beyond its pods' drains and cold starts: scheduling, pulling the image
# (the provider's own default bound for a whole StatefulSet).
ROLLOUT_SLACK_S = 600


def pod_rejoin_s(stack: StackSpec) -> int:
    """How long a pod that is warm again takes to be counted UP by the endpoint: first by its
    site's gateway, whose relay the endpoint's checks pass through, then by the endpoint."""
    return math.ceil(gateway_rejoin_ms() / 1000) + rejoin_s(balancer_settings(stack))


def rollout_timeout_s(recipe: RecipeSpec, on_site: int, rejoin: int) -> int:
    """How long `pulumi up` waits for a pool's StatefulSet here to finish a rollout before it
    fails the update: each wave of `max_unavailable` pods stops within its grace period, is
    warm within `cold_start_budget_s` and back in rotation within `rejoin` s (pod_rejoin_s),
    plus ROLLOUT_SLACK_S. The provider's default, 10
    minutes for the whole StatefulSet, is shorter than one default cold start (900 s): a
    healthy rollout would fail the update and stop the pool's later rollout units."""
    waves = math.ceil(on_site / max_unavailable(recipe, on_site))
    wave = termination_grace_s(recipe) + recipe.cold_start_budget_s + rejoin
    return waves * wave + ROLLOUT_SLACK_S


def gateway_site(site: SiteSpec, tls: bool) -> GatewaySite:
    """What the gateway's config needs of the site: its agents, and the TLS files the Secret
    mounts (`tls`) or none."""
    files = GatewayTls(
        f"{GATEWAY_TLS_DIR}/{GATEWAY_TLS_PEM}", f"{GATEWAY_TLS_DIR}/{GATEWAY_TLS_CA}"
    )
    return GatewaySite(site.name, agent_host(site), max_agents(site), files if tls else None)


def _node_stride(site: SiteSpec) -> int:
    return site.gpus_per_node * PORTS_PER_GPU


def _listen_port(site: SiteSpec, replica: PlacedReplica) -> int:
    ordinal = int(replica.node.removeprefix("node-"))
    offset = replica.gpu * PORTS_PER_GPU + (replica.slice or 0)
    return GATEWAY_PORT_BASE + ordinal * _node_stride(site) + offset


def agent_host(site: SiteSpec) -> str:
    """The headless Service's name: it resolves to every agent pod of the site."""
    return f"{AGENT_NAME}.{site.namespace}.svc.cluster.local"


def max_agents(site: SiteSpec) -> int:
    """How many agents the gateway may find: the most GPU nodes the site can span, if every
    Kubernetes node held a single GPU."""
    return site.max_nodes * site.gpus_per_node


def _object(api_version: str, kind: str, metadata: Manifest, **body: Any) -> Manifest:
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **body}


def _labels(stack: str, site: SiteSpec, **extra: str) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/managed-by": "denv",
        "app.kubernetes.io/part-of": "denv",
        "denv/stack": stack,
        "denv/site": site.name,
        **{f"denv/{key}": value for key, value in extra.items()},
    }
    return dict(sorted(labels.items()))


def _replica_labels(stack: str, site: SiteSpec, pool: str) -> dict[str, str]:
    return _labels(stack, site, role="replica", pool=pool)


def _gateway_labels(stack: str, site: SiteSpec) -> dict[str, str]:
    return _labels(stack, site, role="gateway")


def _agent_labels(stack: str, site: SiteSpec) -> dict[str, str]:
    return _labels(stack, site, role="agent")


def _selector(labels: dict[str, str]) -> dict[str, str]:
    """What selects pods: everything but the descriptive labels."""
    return {k: v for k, v in labels.items() if k.startswith("denv/")}


def _meta(site: SiteSpec, name: str, labels: dict[str, str]) -> Manifest:
    return {"name": name, "namespace": site.namespace, "labels": labels}


def _config_map(stack: str, site: SiteSpec, name: str, role: str, data: dict[str, str]) -> Manifest:
    return _object("v1", "ConfigMap", _meta(site, name, _labels(stack, site, role=role)), data=data)


def _disruption_budget(
    stack: str, site: SiteSpec, name: str, labels: dict[str, str], least: int
) -> Manifest:
    return _object(
        "policy/v1",
        "PodDisruptionBudget",
        _meta(site, name, labels),
        spec={"minAvailable": least, "selector": {"matchLabels": _selector(labels)}},
    )


def _http_probe(path: str, port: str, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _agent_toml(site: SiteSpec, replicas: Sequence[AgentReplica]) -> str:
    # Every node's agent reads this same file.
    kubernetes = {
        "namespace": site.namespace,
        "container": SERVER_CONTAINER,
        "pod_resources_socket": f"{POD_RESOURCES_DIR}/kubelet.sock",
    }
    return agent_config_toml(
        AgentConfig(
            node=site.name,
            state_file=f"{AGENT_RUN_DIR}/state.json",
            control_token_file=f"{AGENT_RUN_DIR}/agent.token",
            agent_check=f"0.0.0.0:{AGENT_PORT}",
            http=f"127.0.0.1:{AGENT_PORT + 1}",
            pods=f"0.0.0.0:{AGENT_PODS_PORT}",
            replicas=tuple(replicas),
            tables={"kubernetes": kubernetes},
        )
    )


def _agent_replica(route: GatewayRoute, pod: str, recipe: RecipeSpec) -> AgentReplica:
    return AgentReplica(
        id=route.replica_id,
        pod=pod,
        health_url=f"http://{route.pod_host}:{route.pod_port}{recipe.health_path}",
        probe=recipe_probe(recipe),
        metrics_url=f"http://{route.pod_host}:{route.pod_port}{recipe.metrics_path}",
    )


def env_secret_name(recipe: RecipeSpec) -> str:
    """The Secret that holds a recipe's `secure:` env values on a kubernetes site."""
    return f"{recipe.name}-env"


# A replica pod's hooks, run by python3 in the recipe's image (the engines' images have it; not
# every one has curl). Each asks the agent of the pod's own node (AGENT_LOCAL_NAME), never
# through a proxy the recipe's env may name. Arguments after the script: the pod's agent URL,
# then the hook's own.
# Readiness (data/scripts/pod_ready.py): exit 0 only on the agent's 200 (warm); its reason, or
# why it was not asked, is what the kubelet shows in the pod's events.
READY_HOOK = script("pod_ready.py")
# preStop (data/scripts/pod_stop.py): drain, then wait by the pod's drain plan (the one rule,
# denv_iac.core.drain, that nodes follow too): `settle` s for the balancers to hear the drain at
# their next agent check, then until no connection to the server's port carries work, `wait` s
# at most in all; past it, what is open is cut when the server stops. A connection quiet for
# `quiet` s (a balancer's idle pooled one) is not waited for. Arguments: url, port, wait,
# settle, hold, quiet.
STOP_HOOK = script("pod_stop.py")


def drain_settle_s(agent_inter_ms: int) -> float:
    """How long a stopping pod waits after its drain before it may stop with no connection open:
    the balancers ask the agent every `agent_inter_ms` through the gateway's relay, so two of
    their checks and a second for the relay, after which nothing new arrives."""
    return round(2 * agent_inter_ms / 1000 + 1, 3)


def agent_pods_url(site: SiteSpec) -> str:
    """Where a replica pod reaches its own node's agent's pod endpoints."""
    return f"http://{AGENT_LOCAL_NAME}.{site.namespace}.svc.cluster.local:{AGENT_PODS_PORT}"


def ready_command(site: SiteSpec) -> list[str]:
    return ["python3", "-c", READY_HOOK, agent_pods_url(site)]


def stop_command(site: SiteSpec, recipe: RecipeSpec, agent_inter_ms: int) -> list[str]:
    """The preStop: drain, wait for the connections that carry work to end, by the recipe's
    drain plan; the agent holds the drain at most the grace period, by whose end the kubelet
    has stopped the pod."""
    plan = drain_plan([recipe], drain_settle_s(agent_inter_ms))
    hold = termination_grace_s(recipe)
    args = (recipe.port, plan.bound_s, float(plan.settle_s), hold, plan.quiet_s)
    return ["python3", "-c", STOP_HOOK, agent_pods_url(site), *(str(a) for a in args)]


def _server_container(recipe: RecipeSpec, site: SiteSpec, agent_inter_ms: int) -> Manifest:
    cache_env = {"HF_HOME": recipe.cache_dirs[0], "VLLM_CACHE_ROOT": recipe.cache_dirs[-1]}
    env: list[Manifest] = [{"name": k, "value": v} for k, v in recipe.env if k not in cache_env]
    env += [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": env_secret_name(recipe), "key": k}}}
        for k, _ in recipe.secret_env
        if k not in cache_env
    ]
    env += [{"name": k, "value": v} for k, v in cache_env.items()]
    env.append({"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    container: Manifest = {
        "name": SERVER_CONTAINER,
        "image": recipe.image,
        "ports": [{"name": "http", "containerPort": recipe.port, "protocol": "TCP"}],
        "env": env,
        "resources": {"limits": {gpu_resource(recipe): "1"}},
        "startupProbe": _http_probe(
            recipe.health_path, "http", STARTUP_PERIOD_S, startup_failure_threshold(recipe)
        ),
        # Ready means warm, as the agent of the pod's node judges it: the server answers and,
        # where the recipe has a first-token probe, has streamed a first token. The rollout's
        # next pod, and the disruption budget, wait on it.
        "readinessProbe": {
            "exec": {"command": ready_command(site)},
            "periodSeconds": READY_PERIOD_S,
            "timeoutSeconds": READY_TIMEOUT_S,
            "failureThreshold": READY_FAILURES,
        },
        # Before the kubelet stops the server: drain it, let its calls end (scripts/pod_stop.py).
        "lifecycle": {"preStop": {"exec": {"command": stop_command(site, recipe, agent_inter_ms)}}},
        # One claim for every cache folder, each in its own sub-folder of it.
        "volumeMounts": [
            {"name": CACHE_VOLUME, "mountPath": path, "subPath": f"dir-{index}"}
            for index, path in enumerate(recipe.cache_dirs)
        ],
    }
    if recipe.command:
        # arguments to the image's entrypoint
        container["args"] = list(render_command(recipe.command, port=recipe.port, host=ANY_ADDRESS))
    return container


def _agent_daemon_set(stack: str, site: SiteSpec, agent_toml: str) -> Manifest:
    labels = _agent_labels(stack, site)
    digest = hashlib.sha256(agent_toml.encode()).hexdigest()
    # The control token is random per pod and never leaves it, as on machines.
    start = (
        f"umask 077 && od -An -N24 -tx1 /dev/urandom | tr -d ' \\n' > {AGENT_RUN_DIR}/agent.token"
        f" && exec denv-agent --config {AGENT_CONFIG_DIR}/agent.toml"
    )
    container: Manifest = {
        "name": "agent",
        "image": AGENT_IMAGE,
        "command": ["sh", "-c", start],
        "env": [
            # Every GPU of the node, read-only (NVML without compute), given by the nvidia
            # runtime class: the agent asks for no GPU, so the device plugin gives it none.
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
        ],
        "ports": [
            {"name": "agent", "containerPort": AGENT_PORT, "protocol": "TCP"},
            {"name": "pods", "containerPort": AGENT_PODS_PORT, "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"memory": "128Mi"},
        },
        # The kubelet's socket is root's: the agent connects as root, with no capability.
        "securityContext": {
            "runAsUser": 0,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": AGENT_CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": AGENT_RUN_DIR},
            {"name": "pod-resources", "mountPath": POD_RESOURCES_DIR, "readOnly": True},
        ],
    }
    pod_spec: Manifest = {
        "runtimeClassName": NVIDIA_RUNTIME_CLASS,
        "containers": [container],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": _pod_affinity(site),
        "volumes": [
            {"name": "config", "configMap": {"name": AGENT_NAME}},
            {"name": "run", "emptyDir": {}},
            {
                "name": "pod-resources",
                "hostPath": {"path": POD_RESOURCES_DIR, "type": "Directory"},
            },
        ],
    }
    return _object(
        "apps/v1",
        "DaemonSet",
        _meta(site, AGENT_NAME, labels),
        spec={
            "selector": {"matchLabels": _selector(labels)},
            # One node's agent at a time: its replicas are unknown to the balancer meanwhile.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels, "annotations": {"denv/config-sha256": digest}},
                "spec": pod_spec,
            },
        },
    )


def _agent_service(stack: str, site: SiteSpec) -> Manifest:
    """Every node's agent, by one DNS name (headless): the gateway relays checks to them all."""
    port = {"name": "agent", "port": AGENT_PORT}
    # A starting agent answers `starting`-like verdicts too: let the gateway find it.
    headless = {"clusterIP": "None", "publishNotReadyAddresses": True}
    return _agent_ports_service(stack, site, AGENT_NAME, port, headless)


def _agent_local_service(stack: str, site: SiteSpec) -> Manifest:
    """The agent of the caller's own node: a replica pod's hooks ask it about that pod alone.
    Only endpoints on the client's node (internalTrafficPolicy Local): never another node's
    agent, which would answer 404 (the pod is not on its node). None there: the call fails,
    and the pod is not ready (its warmth is unknown) and stops undrained."""
    port = {"name": "pods", "port": AGENT_PODS_PORT}
    local = {"internalTrafficPolicy": "Local"}
    return _agent_ports_service(stack, site, AGENT_LOCAL_NAME, port, local)


def _agent_ports_service(
    stack: str, site: SiteSpec, name: str, port: dict[str, Any], spec: Manifest
) -> Manifest:
    labels = _agent_labels(stack, site)
    ports = [{**port, "targetPort": port["name"], "protocol": "TCP"}]
    return _object(
        "v1",
        "Service",
        _meta(site, name, labels),
        spec={**spec, "selector": _selector(labels), "ports": ports},
    )


def _agent_network_policy(stack: str, site: SiteSpec) -> Manifest:
    """Agent checks from the gateway; the pod endpoints from the site's replica pods alone (they
    take no token: a pod may drain a replica of its node, nothing else)."""
    return _object(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        _meta(site, "denv-agents-from-gateway", _agent_labels(stack, site)),
        spec={
            "podSelector": {"matchLabels": _selector(_agent_labels(stack, site))},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": _selector(_gateway_labels(stack, site))}}
                    ],
                    "ports": [{"protocol": "TCP", "port": AGENT_PORT}],
                },
                {
                    "from": [{"podSelector": {"matchLabels": _replica_pods(site)}}],
                    "ports": [{"protocol": "TCP", "port": AGENT_PODS_PORT}],
                },
            ],
        },
    )


def _pod_affinity(site: SiteSpec) -> Manifest:
    products = list(GPU_PRODUCTS[site.gpu])
    term = {"key": "nvidia.com/gpu.product", "operator": "In", "values": products}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [term]}]
            }
        }
    }


def _pool_manifests(
    stack: StackSpec, site: SiteSpec, recipe: RecipeSpec, placed: Sequence[PlacedReplica]
) -> PoolManifests:
    labels = _replica_labels(stack.name, site, recipe.name)
    selector = _selector(labels)
    pod_spec: Manifest = {
        "containers": [_server_container(recipe, site, stack.balancer.timers.agent_inter_ms)],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        # The placement spreads replicas over nodes so that one lost node costs at most
        # `spare`; the scheduler is asked for the same.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": selector},
            }
        ],
        "affinity": _pod_affinity(site),
        "terminationGracePeriodSeconds": termination_grace_s(recipe),
    }
    stateful_set = _object(
        "apps/v1",
        "StatefulSet",
        _meta(site, recipe.name, labels),
        spec={
            "serviceName": recipe.name,
            "replicas": len(placed),
            # Every replica cold-starts at once, not one after another.
            "podManagementPolicy": "Parallel",
            # A changed template rolls pod by pod, each ready before the next (see
            # max_unavailable); the cold start above is for scaling only.
            # A ready (warm) pod counts as available, letting the rollout take the next one,
            # only once the balancers count it UP again (as a node's roll waits `rejoin_s`).
            "minReadySeconds": pod_rejoin_s(stack),
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": max_unavailable(recipe, len(placed))},
            },
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": CACHE_VOLUME, "labels": labels},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": f"{site.cache_size_gb}Gi"}},
                    },
                }
            ],
            # A replica scaled away and back, or replaced, finds its weights and kernels.
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": "Retain",
                "whenScaled": "Retain",
            },
        },
    )
    service = _object(
        "v1",
        "Service",
        _meta(site, recipe.name, labels),
        spec={
            "clusterIP": "None",
            "selector": selector,
            # Starting pods get their DNS name too, so their agent can answer `starting`.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "http", "port": recipe.port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    )
    budget = _disruption_budget(
        stack.name, site, recipe.name, labels, min_available(recipe, len(placed))
    )
    env_secret = (
        _object("v1", "Secret", _meta(site, env_secret_name(recipe), labels), type="Opaque")
        if recipe.secret_env
        else None
    )
    return PoolManifests(
        recipe.name,
        stateful_set,
        service,
        budget,
        env_secret,
        rollout_timeout_s(recipe, len(placed), pod_rejoin_s(stack)),
    )


def _network_policy(stack: str, site: SiteSpec, pools: list[str], spec: StackSpec) -> Manifest:
    """Replica ports: the gateway relays requests there, the agents check health there."""
    ports = sorted({r.port for r in spec.recipes if r.name in pools})
    sources = [_gateway_labels(stack, site), _agent_labels(stack, site)]
    return _object(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        _meta(site, "denv-replicas-from-gateway", _labels(stack, site, role="replica")),
        spec={
            "podSelector": {"matchLabels": _replica_pods(site)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": _selector(s)}} for s in sources],
                    "ports": [{"protocol": "TCP", "port": port} for port in ports],
                }
            ],
        },
    )


def _replica_pods(site: SiteSpec) -> dict[str, str]:
    """Every replica pod of the site, whatever its pool."""
    return {"denv/site": site.name, "denv/role": "replica"}


def _gateway_tls_secret(stack: str, site: SiteSpec) -> Manifest:
    meta = _meta(site, GATEWAY_TLS_SECRET, _labels(stack, site, role="gateway"))
    return _object("v1", "Secret", meta, type="Opaque")


def _gateway(stack: str, site: SiteSpec, haproxy_cfg: str, tls: bool) -> Manifest:
    labels = _gateway_labels(stack, site)
    digest = hashlib.sha256(haproxy_cfg.encode()).hexdigest()
    health = _http_probe("/healthz", "health", 5, 2)
    mounts: list[Manifest] = [{"name": "config", "mountPath": GATEWAY_CONFIG_DIR, "readOnly": True}]
    volumes: list[Manifest] = [{"name": "config", "configMap": {"name": GATEWAY_NAME}}]
    pod: Manifest = {}
    if tls:
        mounts.append({"name": "tls", "mountPath": GATEWAY_TLS_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "tls",
                "secret": {"secretName": GATEWAY_TLS_SECRET, "defaultMode": GATEWAY_TLS_MODE},
            }
        )
        pod["securityContext"] = {"fsGroup": HAPROXY_GID}
    return _object(
        "apps/v1",
        "Deployment",
        _meta(site, GATEWAY_NAME, labels),
        spec={
            "replicas": GATEWAY_REPLICAS,
            "selector": {"matchLabels": _selector(labels)},
            # A new config rolls the gateway one pod at a time, never both at once.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels, "annotations": {"denv/config-sha256": digest}},
                "spec": {
                    "containers": [
                        {
                            "name": "haproxy",
                            "image": GATEWAY_IMAGE,
                            "ports": [
                                {"name": "health", "containerPort": GATEWAY_HEALTH_PORT},
                                {"name": "agent", "containerPort": AGENT_PORT},
                            ],
                            "readinessProbe": health,
                            "livenessProbe": health,
                            "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}},
                            "volumeMounts": mounts,
                        }
                    ],
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": _selector(labels)},
                        }
                    ],
                    "volumes": volumes,
                    **pod,
                },
            },
        },
    )


def _node_service(
    stack: str, site: SiteSpec, node: str, routes: Sequence[GatewayRoute]
) -> Manifest:
    """The address the global balancer sees for one planning node.

    loadBalancerSourceRanges (the balancer hosts) are added by the component: they are known
    only once those hosts exist.
    """
    labels = _gateway_labels(stack, site)
    ports = [
        {
            "name": f"r-{route.listen_port}",
            "port": route.service_port,
            "targetPort": route.listen_port,
            "protocol": "TCP",
        }
        for route in sorted(routes, key=lambda r: r.service_port)
    ]
    ports.append({"name": "agent", "port": AGENT_PORT, "targetPort": AGENT_PORT, "protocol": "TCP"})
    return _object(
        "v1",
        "Service",
        _meta(site, f"{GATEWAY_NAME}-{node}", {**labels, "denv/node": node}),
        spec={
            "type": "LoadBalancer",
            "selector": _selector(labels),
            # Keeps the balancer hosts' source addresses, which the source ranges filter on.
            "externalTrafficPolicy": "Local",
            "ports": ports,
        },
    )
