"""Cluster: sites, warm pools and the balancer of a whole stack, from plain data."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NotRequired, TypedDict

import pulumi

from denv_iac.components.aws import AwsSite, AwsSiteArgs
from denv_iac.components.balancer import GlobalBalancer, GlobalBalancerArgs, HostAccess
from denv_iac.components.balancer_host import BalancerHost, BalancerHostArgs, HcloudKey
from denv_iac.components.gateway_tls import GatewayTls
from denv_iac.components.hetzner_robot import hetzner_site
from denv_iac.components.joined import JoinedSite, LocalSite
from denv_iac.components.kubernetes import kubernetes_site
from denv_iac.components.lambda_cloud import lambda_site
from denv_iac.components.naming import child_name
from denv_iac.components.nebius import nebius_site
from denv_iac.components.node_setup import NodeSetup, NodeSetupArgs
from denv_iac.components.overlay import Overlay
from denv_iac.components.pool import ReplicaEndpointArgs, WarmPool
from denv_iac.components.secrets import (
    SecretValues,
    public_key_of,
    public_key_output,
    recipe_env_secrets,
    seal_secrets,
)
from denv_iac.components.site import SiteBuilder, SiteContext, SiteNodes
from denv_iac.core.ingress import (
    AGENT_PORT,
    host_overlay_access,
    node_overlay_access,
    replica_port,
    wireguard_rules,
)
from denv_iac.core.overlay_plan import host_member, node_member, overlay_hosts, plan_overlay
from denv_iac.core.placement import Placement, place_replicas
from denv_iac.core.plan import deploy_problems
from denv_iac.core.rollout import rollout_after, rollout_units, workload_id
from denv_iac.core.sites import CLOUD_SITE_KINDS, balancer_ssh_user, node_id, node_ssh_user
from denv_iac.core.stack.gateway_link import KUBERNETES, gateway_tls_on, kubernetes_sites
from denv_iac.core.stack.model import (
    MADE_BALANCER_HOST_KINDS,
    SSH_SITE_KINDS,
    RecipeSpec,
    SiteSpec,
    StackSpec,
)
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.node import NodeDeploySpec
from denv_iac.node.from_stack import node_deploy_specs

_EXISTING_NODE_SITES = {"joined": JoinedSite, "local": LocalSite}


def _aws_site(
    name: str, site: SiteSpec, context: SiteContext, opts: pulumi.ResourceOptions
) -> SiteNodes:
    args: AwsSiteArgs = {
        "stack": context["stack"],
        "site": site,
        "recipes": context["spec"].recipes,
        "nodes": context["nodes"],
        "public_key": public_key_output(context["secrets"]["ssh_private_key"]),
        "balancer_addresses": context["balancer_addresses"],
    }
    overlay = node_overlay_access(context["spec"], site.name)
    if overlay:
        args["overlay"] = overlay
    component = AwsSite(name, args, opts)
    return SiteNodes(component, component.node_addresses, component.cache_devices)


def _existing_site(
    name: str, site: SiteSpec, context: SiteContext, opts: pulumi.ResourceOptions
) -> SiteNodes:
    component = _EXISTING_NODE_SITES[site.kind](name, {"nodes": context["nodes"]}, opts)
    return SiteNodes(component, component.node_addresses)


SITE_BUILDERS: dict[str, SiteBuilder] = {
    "aws": _aws_site,
    "hetzner": hetzner_site,
    "joined": _existing_site,
    "kubernetes": kubernetes_site,
    "lambda": lambda_site,
    "local": _existing_site,
    "nebius": nebius_site,
}


class ClusterArgs(TypedDict):
    """The `denv:` keys of a stack's config, as plain data (see docs/stacks.md)."""

    sites: Sequence[Mapping[str, Any]]
    """Where GPUs live (`denv:sites`): name, kind and the kind's keys; see docs/stacks.md."""
    recipes: Sequence[Mapping[str, Any]]
    """What to serve (`denv:recipes`): GPU share, min_warm, spare, sites by tier, image, ports."""
    balancer: Mapping[str, Any]
    """The endpoint (`denv:balancer`): its sites, port, API key digests, TLS, DNS."""
    previous: NotRequired[Sequence[str]]
    """Replica ids of the locked placement (`denv plan --lock`): those that still fit stay."""


def validate_cluster(name: str, args: ClusterArgs) -> tuple[StackSpec, Placement, SecretValues]:
    """The stack, its placement and its secrets; StackError with every problem otherwise."""
    sites, balancer, recipes, secrets = seal_secrets(
        args["sites"], args["balancer"], list(args["recipes"])
    )
    config = {"denv:sites": sites, "denv:recipes": recipes, "denv:balancer": balancer}
    stack = read_stack(name, config)
    problems = _key_problems(args["sites"], stack)
    if problems:
        raise StackError(problems)
    placement = place_replicas(stack, args.get("previous", ()))
    problems = deploy_problems(stack, placement)
    if problems:
        raise StackError(problems)
    return stack, placement, secrets


def _key_problems(raw_sites: Sequence[Mapping[str, Any]], stack: StackSpec) -> list[str]:
    """SSH keys given as strings are read now, so a bad one fails before anything exists.

    A key given as an Output (the stack program's) is only known later, when it is used.
    """
    hosts = {s for s in stack.balancer.sites if stack.site(s).kind in MADE_BALANCER_HOST_KINDS}
    # Sites that create machines with the site's key: a bad one is refused before any exists.
    need_key = hosts | {site.name for site in stack.sites if site.kind in CLOUD_SITE_KINDS}
    problems = []
    for raw in raw_sites:
        value = raw.get("ssh_private_key", {}).get("secure")
        if raw.get("name") in need_key and isinstance(value, str):
            try:
                public_key_of(value)
            except ValueError as error:
                problems.append(f"sites: {raw['name']}.{error}")
    return problems


class Cluster(pulumi.ComponentResource):
    """A whole stack: validated and placed before any resource is registered."""

    endpoint: pulumi.Output[str]
    """The URL clients call."""
    haproxy_config: pulumi.Output[str]
    """The balancer hosts' haproxy.cfg."""
    replica_ids: pulumi.Output[list[str]]
    """Every placed replica; lock them with `denv plan --lock` to pin placement."""
    balancer_addresses: pulumi.Output[list[str]]
    """The balancer hosts' addresses, in the order of the balancer's sites (for DNS)."""

    def __init__(
        self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        stack, placement, secrets = validate_cluster(name, args)
        node_specs = node_deploy_specs(stack, placement)
        super().__init__("denv:index:Cluster", name, None, opts)
        self._name, self._stack, self._secrets = name, stack, secrets
        self._placement = placement
        self._overlay_plan = plan_overlay(stack, placement)
        hosts = self._balancer_hosts()
        self._gateway_tls = self._gateway_link()
        # The machines first: the overlay needs their addresses.
        sites = {
            site.name: self._site(site, placement, hosts)
            for site in stack.sites
            if site.kind != KUBERNETES
        }
        addresses = {site: nodes.addresses for site, (_, nodes) in sites.items()}
        # Before the node deploys, which take their machine's config and key from it.
        overlay = self._overlay(hosts, addresses)
        # Then what rolls replicas, in the rollout order: a pool's node deploys and Kubernetes
        # workloads one after another (denv_iac.core.rollout.rollout_after); each waits on the ones
        # before it, which therefore exist already.
        self._rolled: dict[str, pulumi.Resource] = {}  # rollout unit -> its resource
        self._rollout_after = rollout_after(rollout_units(stack, placement))
        for site in stack.sites:
            if site.kind == KUBERNETES:
                sites[site.name] = self._site(site, placement, hosts)
                addresses[site.name] = sites[site.name][1].addresses
            elif site.kind in SSH_SITE_KINDS:
                context, nodes = sites[site.name]
                self._node_setups(site, context, nodes, node_specs, overlay)
        pools = [self._pool(recipe, placement, addresses).replicas for recipe in stack.recipes]
        balancer_args: GlobalBalancerArgs = {
            "stack": stack,
            "placement": placement,
            "pools": pools,
            "hosts": hosts,
            "access": {
                site: self._host_access(site, overlay)
                for site in stack.balancer.sites
                if stack.site(site).kind in SSH_SITE_KINDS
            },
        }
        if ("balancer", "tls_certificate") in secrets:
            balancer_args["tls_certificate"] = secrets[("balancer", "tls_certificate")]
        if ("balancer", "client_secret_key") in secrets:
            balancer_args["client_secret_key"] = secrets[("balancer", "client_secret_key")]
        if self._gateway_tls is not None:
            balancer_args["gateway_tls"] = pulumi.Output.all(
                self._gateway_tls.ca_certificate, self._gateway_tls.client_pem
            ).apply(lambda pems: {"ca": pems[0], "client": pems[1]})
        balancer = GlobalBalancer(
            child_name(name, "balancer"), balancer_args, pulumi.ResourceOptions(parent=self)
        )
        self.endpoint = balancer.endpoint
        self.haproxy_config = balancer.haproxy_config
        self.replica_ids = pulumi.Output.from_input([r.id for r in placement.replicas])
        self.balancer_addresses = balancer.host_addresses
        self.register_outputs(
            {
                "endpoint": self.endpoint,
                "haproxy_config": self.haproxy_config,
                "replica_ids": self.replica_ids,
                "balancer_addresses": self.balancer_addresses,
            }
        )

    def _balancer_hosts(self) -> dict[str, pulumi.Output[str]]:
        """Balancer site -> host address; made first, since every site's rules name them."""
        hosts = {}
        self._host_components: dict[str, BalancerHost] = {}
        uploaded: list[HcloudKey] = []  # Hetzner Cloud takes one key of a fingerprint once
        for site_name in self._stack.balancer.sites:
            site = self._stack.site(site_name)
            args: BalancerHostArgs = {
                "stack": self._name,
                "site": site,
                "balancer": self._stack.balancer,
            }
            if site.kind in MADE_BALANCER_HOST_KINDS:
                args["public_key"] = public_key_output(
                    self._secrets[(site_name, "ssh_private_key")]
                )
            host = BalancerHost(
                child_name(self._name, "balancer", site_name),
                args,
                pulumi.ResourceOptions(parent=self),
                uploaded=tuple(uploaded),
            )
            if host.hcloud_key is not None:
                uploaded.append(host.hcloud_key)
            hosts[site_name] = host.address
            self._host_components[site_name] = host
        return hosts

    def _host_access(self, site_name: str, overlay: Overlay | None) -> HostAccess:
        """How the deploy reaches a balancer host, and its overlay config where the host is a
        machine made for the balancer (a joined site's first node gets it as a node)."""
        access: HostAccess = {
            "ssh_user": balancer_ssh_user(self._stack.site(site_name)),
            "ssh_private_key": self._secrets[(site_name, "ssh_private_key")],
        }
        member = host_member(self._stack, site_name)
        made = self._stack.site(site_name).kind in MADE_BALANCER_HOST_KINDS
        if overlay is not None and made and member is not None:
            access["overlay"] = overlay.access(member)
        return access

    def _site(
        self, site: SiteSpec, placement: Placement, hosts: dict[str, pulumi.Output[str]]
    ) -> tuple[SiteContext, SiteNodes]:
        """What a site's builder was given, and its nodes (and workloads, on Kubernetes)."""
        context: SiteContext = {
            "stack": self._name,
            "spec": self._stack,
            "nodes": [node for node in placement.nodes if node.site == site.name],
            "secrets": {f: v for (owner, f), v in self._secrets.items() if owner == site.name},
            # A canary's pool runs with its recipe's secure: values.
            "env_secrets": {
                recipe.name: recipe_env_secrets(self._secrets, recipe.canary_of or recipe.name)
                for recipe in self._stack.recipes
            },
            "balancer_addresses": hosts,
        }
        if self._gateway_tls is not None:
            context["gateway_tls"] = self._gateway_tls
        if site.kind == KUBERNETES:
            context["waits_on"] = {
                recipe.name: self._waits_on(workload_id(site.name, recipe.name))
                for recipe in self._stack.recipes
                if workload_id(site.name, recipe.name) in self._rollout_after
            }
        nodes = SITE_BUILDERS[site.kind](
            child_name(self._name, site.name),
            site,
            context,
            pulumi.ResourceOptions(parent=self),
        )
        for pool, workload in nodes.workloads.items():
            self._rolled[workload_id(site.name, pool)] = workload
        return context, nodes

    def _waits_on(self, unit: str) -> list[pulumi.Resource]:
        """The resources of the rollout units before `unit` (`rollout.rollout_after`)."""
        return [self._rolled[previous] for previous in self._rollout_after[unit]]

    def _node_setups(
        self,
        site: SiteSpec,
        context: SiteContext,
        nodes: SiteNodes,
        node_specs: dict[str, NodeDeploySpec],
        overlay: Overlay | None,
    ) -> None:
        """The node deploy on each node, once the node exists (its address says when)."""
        balancers = sorted(context["balancer_addresses"].items())
        for node in context["nodes"]:
            args: NodeSetupArgs = {
                "host": nodes.addresses.apply(_node_address(node.name)),
                "ssh_user": node_ssh_user(site, node.name),
                "ssh_private_key": context["secrets"]["ssh_private_key"],
                "node": node_specs[node_id(site.name, node.name)],
                "balancer_addresses": pulumi.Output.all(*(a for _, a in balancers)),
            }
            if overlay is not None:
                # The balancers come through the tunnel, from their overlay addresses.
                member = node_member(site.name, node.name)
                args["balancer_addresses"] = list(self._overlay_plan.hub_addresses)
                access = overlay.access(member)
                args["overlay_config"] = access["overlay_config"]
                args["overlay_private_key"] = access["overlay_private_key"]
                args["overlay_senders"] = access["overlay_senders"]
            secret_env = {
                r.id: context["env_secrets"][r.pool]
                for r in self._placement.replicas
                if (r.site, r.node) == (site.name, node.name) and context["env_secrets"][r.pool]
            }
            if secret_env:
                args["secret_env"] = secret_env
            if nodes.cache_devices is not None:
                args["cache_device"] = nodes.cache_devices.apply(_node_cache_device(node.name))
            if site.kind in CLOUD_SITE_KINDS:  # its provider deletes the machine with the node
                args["deleted_by"] = site.kind
            key = node_id(site.name, node.name)
            setup = NodeSetup(
                child_name(self._name, site.name, node.name, "setup"),
                args,
                pulumi.ResourceOptions(parent=nodes.component),
                # A firewall on the node's path, then the pool's previous rollout units.
                waits_on=[*nodes.ready.get(node.name, ()), *self._waits_on(key)],
            )
            self._rolled[key] = setup.deployment

    def _gateway_link(self) -> GatewayTls | None:
        """The CA and certificates of mutual TLS to Kubernetes gateways (spec.gateway_link)."""
        if not gateway_tls_on(self._stack):
            return None
        return GatewayTls(
            child_name(self._name, "gateway-tls"),
            self._name,
            kubernetes_sites(self._stack),
            pulumi.ResourceOptions(parent=self),
        )

    def _overlay(
        self,
        hosts: dict[str, pulumi.Output[str]],
        addresses: dict[str, pulumi.Output[dict[str, str]]],
    ) -> Overlay | None:
        """The WireGuard overlay's keys and configs, when it links anything (see docs/stacks.md)."""
        plan = self._overlay_plan
        if not plan.on:
            return None
        public: dict[str, pulumi.Input[str]] = {}
        for member in plan.members:
            if member.public_address:
                continue  # a listed machine: its address is in the stack
            if member.node_name:
                public[member.name] = addresses[member.site].apply(_node_address(member.node_name))
            else:
                public[member.name] = hosts[member.site]
        # Each host's WireGuard rules name its nodes' addresses, known now that they exist.
        known = {m.name: public.get(m.name, m.public_address) for m in plan.members}
        for site_name, host in overlay_hosts(self._stack).items():
            access = host_overlay_access(plan, host)
            if access:
                self._host_components[site_name].allow_overlay(wireguard_rules(access), known)
        return Overlay(
            child_name(self._name, "overlay"), plan, public, pulumi.ResourceOptions(parent=self)
        )

    def _pool(
        self,
        recipe: RecipeSpec,
        placement: Placement,
        addresses: dict[str, pulumi.Output[dict[str, str]]],
    ) -> WarmPool:
        replicas: list[ReplicaEndpointArgs] = [
            {
                "id": r.id,
                "site": r.site,
                "node": r.node,
                "tier": r.tier,
                "address": self._replica_address(r.site, r.node, addresses),
                "port": replica_port(recipe, r),
                "agent_port": AGENT_PORT,
            }
            for r in placement.replicas_of(recipe.name)
        ]
        return WarmPool(
            child_name(self._name, "pool", recipe.name),
            {"recipe": recipe.name, "replicas": replicas},
            pulumi.ResourceOptions(parent=self),
        )

    def _replica_address(
        self, site: str, node: str, addresses: dict[str, pulumi.Output[dict[str, str]]]
    ) -> pulumi.Input[str]:
        """Where the balancer reaches a node's replicas and agent: its overlay address, known
        from the plan, when it is on the overlay; its own address otherwise."""
        plan = self._overlay_plan
        if plan.on and self._stack.site(site).kind in SSH_SITE_KINDS:
            return plan.address_of(site, node)
        return addresses[site].apply(_node_address(node))


def _node_address(node: str) -> Callable[[dict[str, str]], str]:
    def pick(addresses: dict[str, str]) -> str:
        return addresses[node]

    return pick


def _node_cache_device(node: str) -> Callable[[dict[str, str]], str]:
    def pick(devices: dict[str, str]) -> str:
        return devices.get(node, "")  # a node the site did not create has no volume of its own

    return pick
