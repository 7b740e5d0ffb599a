"""Kubernetes: replicas as pods of a cluster the team runs, behind an in-cluster gateway.

The objects and the gateway design are in `denv_iac.core.kube_manifests`; this component only
registers them, each through a provider made from the site's kubeconfig (a secret).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NotRequired, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from denv_iac.components.naming import child_name, resolved
from denv_iac.components.site import SiteContext, SiteNodes
from denv_iac.core.ingress import host_cidr
from denv_iac.core.kube_manifests.gateway import GATEWAY_TLS_CA, GATEWAY_TLS_PEM
from denv_iac.core.kube_manifests.pods import PoolManifests
from denv_iac.core.kube_manifests.site import resource_parts, site_manifests, site_problems
from denv_iac.core.placement import PlacedReplica, place_replicas
from denv_iac.core.stack.model import SiteSpec, StackSpec
from denv_iac.core.stack.reader import StackError

_KINDS: dict[str, Callable[..., pulumi.CustomResource]] = {
    "ConfigMap": k8s.core.v1.ConfigMap,
    "DaemonSet": k8s.apps.v1.DaemonSet,
    "Deployment": k8s.apps.v1.Deployment,
    "NetworkPolicy": k8s.networking.v1.NetworkPolicy,
    "PodDisruptionBudget": k8s.policy.v1.PodDisruptionBudget,
    "Service": k8s.core.v1.Service,
    "StatefulSet": k8s.apps.v1.StatefulSet,
}


class GatewayTlsSecret(TypedDict):
    """What the gateway's TLS Secret holds: its certificate and key, and the stack's CA."""

    pem: pulumi.Input[str]  # the site gateway's certificate and key, one PEM (a secret)
    ca: pulumi.Input[str]  # the CA that signed the balancer's client certificate


class KubernetesSiteArgs(TypedDict):
    stack: StackSpec
    site: SiteSpec
    replicas: Sequence[PlacedReplica]  # the replicas placed on this site
    kubeconfig: pulumi.Input[str]  # a secret
    balancer_addresses: Mapping[str, pulumi.Input[str]]  # balancer site -> host address
    # Each recipe's `secure:` env values: recipe name -> variable -> secret.
    env_secrets: NotRequired[Mapping[str, Mapping[str, pulumi.Input[str]]]]
    # Needed when the balancer reaches the gateway over mutual TLS (spec.gateway_link).
    gateway_tls: NotRequired[GatewayTlsSecret]


class KubernetesSite(pulumi.ComponentResource):
    """A namespace of StatefulSets (one per pool), a NetworkPolicy, and the gateway."""

    node_addresses: pulumi.Output[dict[str, str]]
    """The gateway's load-balancer address of each planning node, by node name."""

    def __init__(
        self,
        name: str,
        args: KubernetesSiteArgs,
        opts: pulumi.ResourceOptions | None = None,
        waits_on: Mapping[str, Sequence[pulumi.Resource]] | None = None,
    ) -> None:
        """`waits_on`: by pool, what must have ended its update before the pool's StatefulSet
        here is created or updated: the pool's previous rollout units, on other sites
        (denv_iac.core.rollout.rollout_after), so that the pool rolls in one place at a time.

        Why a dependency on the StatefulSet orders rollouts: the Kubernetes provider ends a
        StatefulSet's create or update only once its rollout has, "1. The value of
        'spec.replicas' matches '.status.replicas', '.status.currentReplicas', and
        '.status.readyReplicas'. 2. The value of '.status.updateRevision' matches
        '.status.currentRevision'" (the StatefulSet reference of pulumi-kubernetes 4.34, its
        apps/v1 StatefulSet docstring and registry page), and ready here means warm. So what
        waits on it starts after every pod of the pool here rolled and is warm. The same page:
        "If the StatefulSet has not reached a Ready state after 10 minutes, it will time out
        and mark the resource update as Failed", overridable with `customTimeouts`, which each
        StatefulSet gets from its pool (kube_manifests.pods.rollout_timeout_s). A failed or timed
        out update stops what waits on it: the pool's later units keep the old version."""
        site, stack = args["site"], args["stack"]
        problems = site_problems(site, stack.recipes)
        if problems:
            raise StackError(problems)
        manifests = site_manifests(stack, site, args["replicas"])
        super().__init__("denv:index:KubernetesSite", name, None, opts)
        provider = k8s.Provider(
            child_name(name, "provider"),
            kubeconfig=pulumi.Output.secret(args["kubeconfig"]),
            opts=pulumi.ResourceOptions(parent=self),
        )
        namespace = k8s.core.v1.Namespace(
            child_name(name, "namespace"),
            metadata=manifests.namespace["metadata"],
            opts=pulumi.ResourceOptions(parent=self, provider=provider),
        )
        inside = pulumi.ResourceOptions(parent=self, provider=provider, depends_on=[namespace])
        sources = [
            pulumi.Output.from_input(args["balancer_addresses"][host]).apply(host_cidr)
            for host in sorted(args["balancer_addresses"])
        ]
        addresses: dict[str, pulumi.Output[str]] = {}
        pools = {id(pool.stateful_set): pool for pool in manifests.pools}
        # What rolls each pool's replicas here: what the pool's next rollout unit waits on.
        self.workloads: dict[str, pulumi.Resource] = {}
        for manifest in manifests.objects()[1:]:
            node = manifest["metadata"]["labels"].get("denv/node")
            if id(manifest) in pools:
                pool = pools[id(manifest)]
                self.workloads[pool.pool] = _register(
                    name, manifest, _rolling(inside, pool, (waits_on or {}).get(pool.pool, ()))
                )
            elif node is not None:
                # Only the balancer hosts may reach the gateway from outside the cluster.
                spec = {**manifest["spec"], "loadBalancerSourceRanges": sources}
                addresses[node] = _load_balancer_address(
                    _register(name, {**manifest, "spec": spec}, inside)
                )
            elif manifest is manifests.gateway_tls:
                _register_gateway_secret(name, manifest, args.get("gateway_tls"), inside)
            elif manifest["kind"] == "Secret":
                _register_env_secret(name, manifest, args.get("env_secrets", {}), inside)
            else:
                _register(name, manifest, inside)
        self.node_addresses = resolved(addresses)
        self.register_outputs({"node_addresses": self.node_addresses})


def _register(name: str, manifest: dict[str, Any], opts: pulumi.ResourceOptions) -> Any:
    body = {key: value for key, value in manifest.items() if key not in ("apiVersion", "kind")}
    resource_name = child_name(name, *resource_parts(manifest))
    return _KINDS[manifest["kind"]](resource_name, **body, opts=opts)


def _rolling(
    inside: pulumi.ResourceOptions,
    pool: PoolManifests,
    waits_on: Sequence[pulumi.Resource],
) -> pulumi.ResourceOptions:
    """A pool's StatefulSet: after the pool's previous rollout units, and awaited as long as
    its rollout may take."""
    timeout = f"{pool.rollout_timeout_s}s"
    return pulumi.ResourceOptions.merge(
        inside,
        pulumi.ResourceOptions(
            depends_on=list(waits_on),
            custom_timeouts=pulumi.CustomTimeouts(create=timeout, update=timeout),
        ),
    )


def _register_env_secret(
    name: str,
    manifest: dict[str, Any],
    env_secrets: Mapping[str, Mapping[str, pulumi.Input[str]]],
    opts: pulumi.ResourceOptions,
) -> None:
    """A pool's env Secret: the manifest's frame, `stringData` from the recipe's secrets."""
    pool = manifest["metadata"]["labels"]["denv/pool"]
    if pool not in env_secrets:
        raise ValueError(f"KubernetesSite {name}: give env_secrets for recipe {pool}")
    k8s.core.v1.Secret(
        child_name(name, *resource_parts(manifest)),
        metadata=manifest["metadata"],
        type=manifest["type"],
        string_data={k: pulumi.Output.secret(v) for k, v in sorted(env_secrets[pool].items())},
        opts=opts,
    )


def _register_gateway_secret(
    name: str,
    manifest: dict[str, Any],
    tls: GatewayTlsSecret | None,
    opts: pulumi.ResourceOptions,
) -> None:
    """The gateway's TLS Secret: the manifest's frame, `stringData` from the stack's CA."""
    if tls is None:
        raise ValueError(f"KubernetesSite {name}: give gateway_tls, the gateway's TLS link is on")
    k8s.core.v1.Secret(
        child_name(name, *resource_parts(manifest)),
        metadata=manifest["metadata"],
        type=manifest["type"],
        string_data={
            GATEWAY_TLS_CA: tls["ca"],
            GATEWAY_TLS_PEM: pulumi.Output.secret(tls["pem"]),
        },
        opts=opts,
    )


def _load_balancer_address(service: k8s.core.v1.Service) -> pulumi.Output[str]:
    """The Service's load-balancer address: an IP, or a host name (as AWS load balancers give)."""

    def first(status: Any) -> str:
        ingress = status.load_balancer.ingress[0]
        return str(ingress.ip or ingress.hostname)

    return service.status.apply(first)


def kubernetes_site(
    name: str, site: SiteSpec, context: SiteContext, opts: pulumi.ResourceOptions
) -> SiteNodes:
    """Cluster's builder for kubernetes sites."""
    stack = context["spec"]
    # The site context carries nodes, not replicas: place again, and make sure it is the
    # placement the Cluster made (a locked placement may differ from a fresh one).
    placement = place_replicas(stack)
    fresh = {(n.name, n.replicas) for n in placement.nodes if n.site == site.name}
    if fresh != {(n.name, n.replicas) for n in context["nodes"]}:
        raise StackError(
            [
                f"sites: {site.name}: the locked placement (Pulumi.{stack.name}.placement.json) "
                "differs from a fresh one, which kubernetes sites do not follow yet; "
                "delete the lock file or run `denv plan --lock` again"
            ]
        )
    replicas = [r for r in placement.replicas if r.site == site.name]
    args: KubernetesSiteArgs = {
        "stack": stack,
        "site": site,
        "replicas": replicas,
        "kubeconfig": context["secrets"]["kubeconfig"],
        "env_secrets": context["env_secrets"],
        "balancer_addresses": context["balancer_addresses"],
    }
    if "gateway_tls" in context:
        args["gateway_tls"] = {
            "pem": context["gateway_tls"].gateway_pems.apply(lambda pems: pems[site.name]),
            "ca": context["gateway_tls"].ca_certificate,
        }
    component = KubernetesSite(name, args, opts, context.get("waits_on"))
    return SiteNodes(component, component.node_addresses, workloads=component.workloads)
