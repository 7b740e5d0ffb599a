"""GlobalBalancer: the HAProxy config of the one endpoint, from the pools' replica addresses."""

from collections.abc import Mapping, Sequence
from typing import NotRequired, TypedDict

import pulumi
import pulumi_aws as aws

from denv_iac.components.naming import child_name
from denv_iac.components.node_setup import (
    BalancerFiles,
    GatewayTlsFiles,
    NodeSetup,
    NodeSetupArgs,
)
from denv_iac.components.overlay import MachineOverlay
from denv_iac.components.pool import ReplicaEndpoint
from denv_iac.core.balancer import RenderedConfig, render_haproxy_config
from denv_iac.core.balancer.model import CONFIG_DIR
from denv_iac.core.dataplane import balancer_pools
from denv_iac.core.endpoint import balancer_settings, endpoint_url
from denv_iac.core.placement import PlacedReplica, Placement
from denv_iac.core.stack.model import DnsSpec, StackSpec

# Every balancer host serves the same config, so each takes an equal share of clients.
DNS_WEIGHT = 100


class HostAccess(TypedDict):
    ssh_user: str
    ssh_private_key: pulumi.Input[str]  # a secret
    overlay: NotRequired[MachineOverlay]  # a machine made for the balancer, on the overlay


class GlobalBalancerArgs(TypedDict):
    stack: StackSpec
    placement: Placement
    pools: Sequence[pulumi.Input[list[ReplicaEndpoint]]]  # WarmPool.replicas of every pool
    hosts: Mapping[str, pulumi.Input[str]]  # balancer site -> host address
    # Balancer site -> how to log in to its host, for the hosts the config is installed on.
    access: NotRequired[Mapping[str, HostAccess]]
    # The endpoint's certificate and key (a secret PEM), installed where the config reads it;
    # given when the balancer has a tls_certificate.
    tls_certificate: NotRequired[pulumi.Input[str]]
    # The gateway CA and the balancer's client certificate and key (a secret), installed where
    # the config reads them; given when Kubernetes gateways are reached over mutual TLS.
    gateway_tls: NotRequired[pulumi.Input[GatewayTlsFiles]]
    # The key that signs realtime client secrets (a secret), installed where the config reads
    # it; given when the balancer has a client_secret_key.
    client_secret_key: NotRequired[pulumi.Input[str]]


class GlobalBalancer(pulumi.ComponentResource):
    """The endpoint: one HAProxy config that every balancer host serves, same on each."""

    haproxy_config: pulumi.Output[str]
    """haproxy.cfg, rendered once every replica's address is known."""
    map_files: pulumi.Output[dict[str, str]]
    """The map files haproxy.cfg reads, by file name, under /etc/haproxy/denv."""
    endpoint: pulumi.Output[str]
    """The URL clients call."""
    host_addresses: pulumi.Output[list[str]]
    """The balancer hosts' addresses."""

    def __init__(
        self, name: str, args: GlobalBalancerArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("denv:index:GlobalBalancer", name, None, opts)
        stack, placement = args["stack"], args["placement"]
        settings = balancer_settings(stack)

        def render(pools: list[list[ReplicaEndpoint]]) -> RenderedConfig:
            where = {r["id"]: (r["address"], r["port"], r["agent_port"]) for p in pools for r in p}

            def locate(replica: PlacedReplica) -> tuple[str, int, int]:
                return where[replica.id]

            return render_haproxy_config(
                balancer_pools(stack, placement, locate), settings, CONFIG_DIR
            )

        rendered = pulumi.Output.all(*args["pools"]).apply(render)
        self.haproxy_config = rendered.apply(lambda r: r.haproxy_cfg)
        self.map_files = rendered.apply(lambda r: dict(sorted(r.files.items())))
        hosts = [args["hosts"][site] for site in stack.balancer.sites]
        self.host_addresses = pulumi.Output.all(*hosts).apply(lambda a: [str(h) for h in a])
        self.endpoint = self.host_addresses.apply(lambda a: endpoint_url(stack, a[0]))
        files = pulumi.Output.all(self.haproxy_config, self.map_files).apply(
            lambda v: BalancerFiles(haproxy_config=v[0], map_files=v[1], map_dir=CONFIG_DIR)
        )
        if stack.balancer.dns is not None:
            self._dns(name, stack.balancer.dns, stack, args["hosts"])
        for site, access in sorted(args.get("access", {}).items()):
            setup: NodeSetupArgs = {
                "host": args["hosts"][site],
                "ssh_user": access["ssh_user"],
                "ssh_private_key": access["ssh_private_key"],
                "balancer": files,
                "balancer_firewall": {
                    "admin_cidrs": stack.site(site).admin_cidrs,
                    "stats_port": stack.balancer.prometheus_port,
                },
            }
            if "tls_certificate" in args:
                setup["tls_certificate"] = args["tls_certificate"]
            if "gateway_tls" in args:
                setup["gateway_tls"] = args["gateway_tls"]
            if "client_secret_key" in args:
                setup["client_secret_key"] = args["client_secret_key"]
            if "overlay" in access:
                setup["overlay_config"] = access["overlay"]["overlay_config"]
                setup["overlay_private_key"] = access["overlay"]["overlay_private_key"]
                setup["overlay_senders"] = access["overlay"]["overlay_senders"]
                setup["overlay_port"] = stack.balancer.overlay.port
            NodeSetup(child_name(name, site, "setup"), setup, pulumi.ResourceOptions(parent=self))
        self.register_outputs(
            {
                "haproxy_config": self.haproxy_config,
                "map_files": self.map_files,
                "endpoint": self.endpoint,
                "host_addresses": self.host_addresses,
                # Digests only: the keys themselves never reach the stack.
                "api_key_digests": list(stack.balancer.api_key_digests),
            }
        )

    def _dns(
        self, name: str, dns: DnsSpec, stack: StackSpec, hosts: Mapping[str, pulumi.Input[str]]
    ) -> None:
        """One health-checked record per host under the endpoint's name.

        Weighted, equal weights: with several active balancers, DNS then answers with every
        healthy one, and a host whose check fails drops out; failover routing would hold all
        clients on one host and leave the others idle. The check is TCP on the endpoint port:
        the endpoint serves no unauthenticated path (each request is authenticated and routed
        to a pool), so an HTTP check would read a 401 or 404 as a dead host.
        """
        child = pulumi.ResourceOptions(parent=self)
        for site in stack.balancer.sites:
            address = pulumi.Output.from_input(hosts[site])
            check = aws.route53.HealthCheck(
                child_name(name, site, "health"),
                type="TCP",
                ip_address=address,
                port=stack.balancer.port,
                failure_threshold=2,
                request_interval=10,
                tags={"Name": f"{dns.name} {site}", "denv:site": site},
                opts=child,
            )
            aws.route53.Record(
                child_name(name, site, "dns"),
                zone_id=dns.zone_id,
                name=dns.name,
                type=address.apply(lambda a: "AAAA" if ":" in a else "A"),
                ttl=dns.ttl,
                records=[address],
                set_identifier=site,
                health_check_id=check.id,
                weighted_routing_policies=[
                    aws.route53.RecordWeightedRoutingPolicyArgs(weight=DNS_WEIGHT)
                ],
                opts=child,
            )
