"""A machine that runs HAProxy for the endpoint, on one of the balancer's sites."""

from collections.abc import Mapping, Sequence
from typing import NotRequired, TypedDict

import pulumi
import pulumi_aws as aws
import pulumi_hcloud as hcloud

from denv_iac.components.aws import (
    KEPT_AT_LAUNCH,
    SecurityGroupWiring,
    elastic_ip,
    pinned_ami,
    site_key_pair,
    vpc_of,
)
from denv_iac.components.hcloud_firewall import hcloud_rules, overlay_firewall
from denv_iac.components.joined import LOOPBACK
from denv_iac.components.naming import aws_tags, child_name, hcloud_labels
from denv_iac.core.catalog import load_catalog
from denv_iac.core.ingress import IngressRule, balancer_ingress_rules
from denv_iac.core.stack.model import BalancerSpec, SiteSpec

AWS_INSTANCE_TYPE = "c7i.large"
AWS_AMI_PARAMETER = (
    "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
)
# Preferred first: shared AMD vCPUs where offered, else dedicated (the US locations); the
# catalog says which location offers which type (cpx21 left the API at the end of 2025).
HCLOUD_SERVER_TYPES = ("cpx22", "ccx13")
HCLOUD_IMAGE = "ubuntu-24.04"


class BalancerHostArgs(TypedDict):
    stack: str
    site: SiteSpec
    balancer: BalancerSpec
    public_key: NotRequired[pulumi.Input[str]]  # needed on sites that create the machine


class BalancerHost(pulumi.ComponentResource):
    """An AWS instance or hcloud server made for HAProxy, or a joined/local node reused."""

    address: pulumi.Output[str]
    """The host's public address: replica and agent ports are opened to it."""

    def __init__(
        self, name: str, args: BalancerHostArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("denv:index:BalancerHost", name, None, opts)
        site = args["site"]
        self._name = name
        self._security: SecurityGroupWiring | None = None
        self._server: hcloud.Server | None = None
        self._labels: dict[str, str] = {}
        if site.kind == "aws":
            address = self._aws(name, args)
        elif site.kind == "hetzner":
            address = self._hetzner(name, args)
        elif site.kind in ("joined", "local"):
            # The balancer shares the site's first machine; joined sites list at least one.
            first = site.nodes[0].address if site.nodes else ""
            address = pulumi.Output.from_input(first or LOOPBACK)
        else:
            raise ValueError(f"balancer site {site.name}: kind {site.kind} cannot host it yet")
        self.address = address
        self.register_outputs({"address": self.address})

    def allow_overlay(
        self, rules: Sequence[IngressRule], addresses: Mapping[str, pulumi.Input[str]]
    ) -> None:
        """The overlay's WireGuard rules (`security.host_overlay_access`), once its nodes exist.

        A joined site's first node gets them from the node deploy's own firewall.
        """
        if self._security is not None:
            self._security.allow(rules, addresses)
        if self._server is not None:
            server_id = self._server.id.apply(int)
            overlay_firewall(self, self._name, self._labels, rules, addresses, server_id)

    def _aws(self, name: str, args: BalancerHostArgs) -> pulumi.Output[str]:
        site, stack = args["site"], args["stack"]
        tags = aws_tags(stack, site.name, "balancer", "balancer")
        security = SecurityGroupWiring(
            self,
            name,
            f"denv {stack} {site.name}: balancer",
            aws_tags(stack, site.name, "balancer"),
            balancer_ingress_rules(args["balancer"], site.admin_cidrs),
            {},
            vpc_of(site.subnet_id, site.region, self),
            site.region,
        )
        self._security = security
        key = site_key_pair(self, name, stack, site, args["public_key"])
        instance = aws.ec2.Instance(
            child_name(name, "vm"),
            ami=pinned_ami(AWS_AMI_PARAMETER, site.region, self),
            instance_type=AWS_INSTANCE_TYPE,
            region=site.region,
            key_name=key.key_name,
            subnet_id=site.subnet_id or None,
            vpc_security_group_ids=[security.group.id],
            metadata_options=aws.ec2.InstanceMetadataOptionsArgs(http_tokens="required"),
            tags=tags,
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=list(KEPT_AT_LAUNCH)),
        )
        return elastic_ip(self, child_name(name, "vm"), instance, site.region, tags)

    def _hetzner(self, name: str, args: BalancerHostArgs) -> pulumi.Output[str]:
        site, stack = args["site"], args["stack"]
        labels = hcloud_labels(stack, site.name, "balancer")
        child = pulumi.ResourceOptions(parent=self)
        rules = balancer_ingress_rules(args["balancer"], site.admin_cidrs)
        firewall = hcloud.Firewall(
            child_name(name, "fw"),
            labels=labels,
            rules=hcloud_rules(rules, {}),
            opts=child,
        )
        key = hcloud.SshKey(
            child_name(name, "key"), public_key=args["public_key"], labels=labels, opts=child
        )
        server = hcloud.Server(
            child_name(name, "vm"),
            server_type=load_catalog().hcloud_types.pick(HCLOUD_SERVER_TYPES, site.region),
            image=HCLOUD_IMAGE,
            location=site.region,
            ssh_keys=[key.id],
            firewall_ids=[firewall.id.apply(int)],
            # The overlay's firewall is attached by a FirewallAttachment (`allow_overlay`): the
            # hcloud provider then requires the server to ignore the firewall ids it reads back,
            # or a refresh records both and the next `up` detaches the overlay's.
            ignore_remote_firewall_ids=True,
            labels=labels,
            # Keys are read at creation only: a rotated key (a new SshKey, made before the old
            # goes) reaches the host through its deploy, not by rebuilding it.
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["ssh_keys"]),
        )
        self._server, self._labels = server, labels
        return server.ipv4_address
