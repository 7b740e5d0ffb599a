"""The node agent on a kubernetes site: one pod per GPU node (a DaemonSet in the `nvidia`
runtime class, reading the kubelet's pod-resources API), the config every one of them reads,
the Services the gateway and the replica pods reach it by, and who may reach it."""

import hashlib
from collections.abc import Sequence
from typing import Any

from denv_iac.core.agent_config import AgentConfig, AgentReplica, agent_config_toml, recipe_probe
from denv_iac.core.balancer.gateway import (
    GatewayRoute,
)
from denv_iac.core.kube_manifests.objects import (
    SERVER_CONTAINER,
    Manifest,
    agent_labels,
    gateway_labels,
    gpu_node_affinity,
    kube_object,
    object_meta,
    pod_selector,
    replica_pods,
)
from denv_iac.core.stack.model import RecipeSpec, SiteSpec
from denv_iac.core.stack.ports import AGENT_PORT

AGENT_IMAGE = "denv/denv-agent:0.1.0"  # built from agent/; the version the node deploy installs
AGENT_NAME = "denv-agent"
AGENT_CONFIG_DIR = "/etc/denv/agent"
AGENT_RUN_DIR = "/run/denv"
# The GPU operator's runtime class: the one that gives a container the GPUs it names in
# NVIDIA_VISIBLE_DEVICES without asking for them as a resource.
NVIDIA_RUNTIME_CLASS = "nvidia"
# The kubelet's pod-resources API socket lives here (the v1 PodResourcesLister).
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
# The agent's pod endpoints (readiness that means warm, drain before a pod stops), which each
# replica pod asks its own node's agent through AGENT_LOCAL_NAME: a Service whose traffic stays
# on the caller's node (internalTrafficPolicy Local), so it reaches that node's agent alone. The
# port is the agent pod's own (not the node's), free beside AGENT_PORT and its HTTP port.
AGENT_PODS_PORT = AGENT_PORT + 2
AGENT_LOCAL_NAME = "denv-agent-local"


def agent_host(site: SiteSpec) -> str:
    """The headless Service's name: it resolves to every agent pod of the site."""
    return f"{AGENT_NAME}.{site.namespace}.svc.cluster.local"


def max_agents(site: SiteSpec) -> int:
    """How many agents the gateway may find: the most GPU nodes the site can span, if every
    Kubernetes node held a single GPU."""
    return site.max_nodes * site.gpus_per_node


def agent_pods_url(site: SiteSpec) -> str:
    """Where a replica pod reaches its own node's agent's pod endpoints."""
    return f"http://{AGENT_LOCAL_NAME}.{site.namespace}.svc.cluster.local:{AGENT_PODS_PORT}"


def site_agent_toml(site: SiteSpec, replicas: Sequence[AgentReplica]) -> str:
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


def agent_replica(route: GatewayRoute, pod: str, recipe: RecipeSpec) -> AgentReplica:
    return AgentReplica(
        id=route.replica_id,
        pod=pod,
        health_url=f"http://{route.pod_host}:{route.pod_port}{recipe.health_path}",
        probe=recipe_probe(recipe),
        metrics_url=f"http://{route.pod_host}:{route.pod_port}{recipe.metrics_path}",
    )


def agent_daemon_set(stack: str, site: SiteSpec, agent_toml: str) -> Manifest:
    labels = agent_labels(stack, site)
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
        "affinity": gpu_node_affinity(site),
        "volumes": [
            {"name": "config", "configMap": {"name": AGENT_NAME}},
            {"name": "run", "emptyDir": {}},
            {
                "name": "pod-resources",
                "hostPath": {"path": POD_RESOURCES_DIR, "type": "Directory"},
            },
        ],
    }
    return kube_object(
        "apps/v1",
        "DaemonSet",
        object_meta(site, AGENT_NAME, labels),
        spec={
            "selector": {"matchLabels": pod_selector(labels)},
            # One node's agent at a time: its replicas are unknown to the balancer meanwhile.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels, "annotations": {"denv/config-sha256": digest}},
                "spec": pod_spec,
            },
        },
    )


def agent_service(stack: str, site: SiteSpec) -> Manifest:
    """Every node's agent, by one DNS name (headless): the gateway relays checks to them all."""
    port = {"name": "agent", "port": AGENT_PORT}
    # A starting agent answers `starting`-like verdicts too: let the gateway find it.
    headless = {"clusterIP": "None", "publishNotReadyAddresses": True}
    return _agent_ports_service(stack, site, AGENT_NAME, port, headless)


def agent_local_service(stack: str, site: SiteSpec) -> Manifest:
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
    labels = agent_labels(stack, site)
    ports = [{**port, "targetPort": port["name"], "protocol": "TCP"}]
    return kube_object(
        "v1",
        "Service",
        object_meta(site, name, labels),
        spec={**spec, "selector": pod_selector(labels), "ports": ports},
    )


def agent_network_policy(stack: str, site: SiteSpec) -> Manifest:
    """Agent checks from the gateway; the pod endpoints from the site's replica pods alone (they
    take no token: a pod may drain a replica of its node, nothing else)."""
    return kube_object(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        object_meta(site, "denv-agents-from-gateway", agent_labels(stack, site)),
        spec={
            "podSelector": {"matchLabels": pod_selector(agent_labels(stack, site))},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": pod_selector(gateway_labels(stack, site))}}
                    ],
                    "ports": [{"protocol": "TCP", "port": AGENT_PORT}],
                },
                {
                    "from": [{"podSelector": {"matchLabels": replica_pods(site)}}],
                    "ports": [{"protocol": "TCP", "port": AGENT_PODS_PORT}],
                },
            ],
        },
    )
