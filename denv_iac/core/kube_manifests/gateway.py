"""A kubernetes site's gateway: the HAProxy Deployment that relays the global balancer's
connections to the pods (its config rendered by `denv_iac.core.balancer.gateway`), the port of
each replica's listener on it, its TLS Secret, and one LoadBalancer Service per planning node."""

import hashlib
from collections.abc import Sequence

from denv_iac.core.balancer.gateway import (
    GATEWAY_HEALTH_PORT,
    GatewayRoute,
    GatewaySite,
    GatewayTls,
)
from denv_iac.core.kube_manifests.agent import agent_host, max_agents
from denv_iac.core.kube_manifests.objects import (
    Manifest,
    gateway_labels,
    http_probe,
    kube_object,
    object_meta,
    pod_selector,
    site_labels,
)
from denv_iac.core.placement import PlacedReplica
from denv_iac.core.stack.model import SiteSpec
from denv_iac.core.stack.ports import AGENT_PORT, PORTS_PER_GPU

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


def gateway_site(site: SiteSpec, tls: bool) -> GatewaySite:
    """What the gateway's config needs of the site: its agents, and the TLS files the Secret
    mounts (`tls`) or none."""
    files = GatewayTls(
        f"{GATEWAY_TLS_DIR}/{GATEWAY_TLS_PEM}", f"{GATEWAY_TLS_DIR}/{GATEWAY_TLS_CA}"
    )
    return GatewaySite(site.name, agent_host(site), max_agents(site), files if tls else None)


def node_stride(site: SiteSpec) -> int:
    return site.gpus_per_node * PORTS_PER_GPU


def listen_port(site: SiteSpec, replica: PlacedReplica) -> int:
    ordinal = int(replica.node.removeprefix("node-"))
    offset = replica.gpu * PORTS_PER_GPU + (replica.slice or 0)
    return GATEWAY_PORT_BASE + ordinal * node_stride(site) + offset


def gateway_tls_secret(stack: str, site: SiteSpec) -> Manifest:
    meta = object_meta(site, GATEWAY_TLS_SECRET, site_labels(stack, site, role="gateway"))
    return kube_object("v1", "Secret", meta, type="Opaque")


def gateway_deployment(stack: str, site: SiteSpec, haproxy_cfg: str, tls: bool) -> Manifest:
    labels = gateway_labels(stack, site)
    digest = hashlib.sha256(haproxy_cfg.encode()).hexdigest()
    health = http_probe("/healthz", "health", 5, 2)
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
    return kube_object(
        "apps/v1",
        "Deployment",
        object_meta(site, GATEWAY_NAME, labels),
        spec={
            "replicas": GATEWAY_REPLICAS,
            "selector": {"matchLabels": pod_selector(labels)},
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
                            "labelSelector": {"matchLabels": pod_selector(labels)},
                        }
                    ],
                    "volumes": volumes,
                    **pod,
                },
            },
        },
    )


def node_service(stack: str, site: SiteSpec, node: str, routes: Sequence[GatewayRoute]) -> Manifest:
    """The address the global balancer sees for one planning node.

    loadBalancerSourceRanges (the balancer hosts) are added by the component: they are known
    only once those hosts exist.
    """
    labels = gateway_labels(stack, site)
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
    return kube_object(
        "v1",
        "Service",
        object_meta(site, f"{GATEWAY_NAME}-{node}", {**labels, "denv/node": node}),
        spec={
            "type": "LoadBalancer",
            "selector": pod_selector(labels),
            # Keeps the balancer hosts' source addresses, which the source ranges filter on.
            "externalTrafficPolicy": "Local",
            "ports": ports,
        },
    )
