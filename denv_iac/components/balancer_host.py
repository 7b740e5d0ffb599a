"""A machine that runs HAProxy for the endpoint, on one of the balancer's sites."""

import base64
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

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
from denv_iac.core.ingress import IngressRule, balancer_ingress_rules
from denv_iac.core.stack.catalog import load_catalog
from denv_iac.core.stack.model import BalancerSpec, SiteSpec

AWS_INSTANCE_TYPE = "c7i.large"
AWS_AMI_PARAMETER = (
    "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
)
# Preferred first: shared AMD vCPUs where offered, else dedicated (the US locations); the
# catalog says which location offers which type (cpx21 left the API at the end of 2025).
HCLOUD_SERVER_TYPES = ("cpx22", "ccx13")
HCLOUD_IMAGE = "ubuntu-24.04"


def hcloud_fingerprint(public_key: str) -> str:
    """An OpenSSH public key's fingerprint as Hetzner Cloud gives it: MD5, colon-separated."""
    blob = base64.b64decode(public_key.split()[1])
    digest = hashlib.md5(blob, usedforsecurity=False).hexdigest()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


@dataclass(frozen=True)
class HcloudKey:
    """An SSH key a Hetzner balancer host of the stack uploads, by its name in the project."""

    site: str
    name: str
    public_key: pulumi.Output[str]
    resource: hcloud.SshKey


def _hcloud_key_problem(
    public_key: str, project: Sequence[Any], own: str, uploaded: Sequence[tuple[str, str, str]]
) -> str:
    """Why the site's key cannot be uploaded as `own`: Hetzner Cloud refuses a second key of
    one fingerprint (uniqueness_error), in the project already or uploaded by another site of
    the stack (`uploaded`: site, key name, public key)."""
    fingerprint = hcloud_fingerprint(public_key)
    fix = "and Hetzner Cloud refuses a second copy; set hcloud_ssh_key: {} on the site to use it"
    for site, name, other in uploaded:
        if other == public_key:
            return f"site {site} uploads the same SSH key, as {name}, {fix.format(name)}"
    for name in (k["name"] for k in project if k["fingerprint"] == fingerprint):
        if name != own:
            return f"the Hetzner Cloud project holds this SSH key already, as {name}, {fix}".format(
                name
            )
    return ""


def _named_key_problem(public_key: str, name: str, project: Sequence[Any]) -> str:
    """Why the key `name` in the project cannot stand for the site's key, if it cannot."""
    found = [key for key in project if key["name"] == name]
    if not found:
        return (
            f"no SSH key {name} in the Hetzner Cloud project; upload the site's public key under "
            "that name, or leave hcloud_ssh_key out to have the balancer host upload it"
        )
    fingerprint, theirs = hcloud_fingerprint(public_key), found[0]["fingerprint"]
    if theirs != fingerprint:
        return (
            f"the key {name} in the Hetzner Cloud project ({theirs}) is not the "
            f"public half of the site's ssh_private_key ({fingerprint}); name the key that is, "
            "or leave hcloud_ssh_key out"
        )
    return ""


def _refused(site: str, problem: str) -> None:
    """A plan-time refusal: one line, no traceback (Pulumi prints a RunError as its message)."""
    if problem:
        raise pulumi.RunError(f"sites: {site}.hcloud_ssh_key: {problem}")


class BalancerHostArgs(TypedDict):
    stack: str
    site: SiteSpec
    balancer: BalancerSpec
    public_key: NotRequired[pulumi.Input[str]]  # needed on sites that create the machine


class BalancerHost(pulumi.ComponentResource):
    """An AWS instance or hcloud server made for HAProxy, or a joined/local node reused."""

    address: pulumi.Output[str]
    """The host's public address: replica and agent ports are opened to it."""

    hcloud_key: HcloudKey | None
    """The SSH key a Hetzner host uploads; None where it uploads none."""

    def __init__(
        self,
        name: str,
        args: BalancerHostArgs,
        opts: pulumi.ResourceOptions | None = None,
        uploaded: Sequence[HcloudKey] = (),
    ) -> None:
        """`uploaded`: the keys the stack's other Hetzner balancer hosts upload, made before."""
        super().__init__("denv:index:BalancerHost", name, None, opts)
        site = args["site"]
        self._name = name
        self.hcloud_key = None
        self._security: SecurityGroupWiring | None = None
        self._server: hcloud.Server | None = None
        self._labels: dict[str, str] = {}
        if site.kind == "aws":
            address = self._aws(name, args)
        elif site.kind == "hetzner":
            address = self._hetzner(name, args, uploaded)
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
        key_name, key = site_key_pair(self, name, stack, site, args["public_key"])
        instance = aws.ec2.Instance(
            child_name(name, "vm"),
            ami=pinned_ami(AWS_AMI_PARAMETER, site.region, self),
            instance_type=AWS_INSTANCE_TYPE,
            region=site.region,
            key_name=key_name,
            subnet_id=site.subnet_id or None,
            vpc_security_group_ids=[security.group.id],
            metadata_options=aws.ec2.InstanceMetadataOptionsArgs(http_tokens="required"),
            tags=tags,
            opts=pulumi.ResourceOptions(
                parent=self, ignore_changes=list(KEPT_AT_LAUNCH), depends_on=[key]
            ),
        )
        return elastic_ip(self, child_name(name, "vm"), instance, site.region, tags)

    def _ssh_key(
        self,
        name: str,
        args: BalancerHostArgs,
        labels: dict[str, str],
        uploaded: Sequence[HcloudKey],
    ) -> tuple[pulumi.Input[str], list[pulumi.Resource]]:
        """The key the hcloud server is made with, and what must exist before it.

        The site's key, found by name where the site names it (`hcloud_ssh_key`), else uploaded;
        either way checked against the project's keys by fingerprint before anything is made.
        """
        site = args["site"]
        public_key = pulumi.Output.from_input(args["public_key"])
        project = hcloud.get_ssh_keys_output(opts=pulumi.InvokeOutputOptions(parent=self))
        made = {key.name: key for key in uploaded}
        if site.hcloud_ssh_key in made:  # another site of the stack uploads it
            other = made[site.hcloud_ssh_key]

            def same(keys: list[str]) -> str:
                if keys[0] != keys[1]:
                    _refused(
                        site.name,
                        f"{other.name} is site {other.site}'s SSH key, not the public half of "
                        "this site's ssh_private_key; name the key that is, or leave "
                        "hcloud_ssh_key out",
                    )
                return other.name

            return pulumi.Output.all(public_key, other.public_key).apply(same), [other.resource]
        if site.hcloud_ssh_key:

            def found(values: list[Any]) -> str:
                given = site.hcloud_ssh_key
                _refused(site.name, _named_key_problem(values[0], given, values[1]))
                return given

            return pulumi.Output.all(public_key, project.ssh_keys).apply(found), []
        key_name = child_name(name, "key")

        def unique(values: list[Any]) -> str:
            public, keys, *others = values
            taken = [(k.site, k.name, o) for k, o in zip(uploaded, others, strict=True)]
            _refused(site.name, _hcloud_key_problem(public, keys, key_name, taken))
            return str(public)

        checked = pulumi.Output.all(
            public_key, project.ssh_keys, *(k.public_key for k in uploaded)
        ).apply(unique)
        # A rotated key replaces the SshKey under the same name, so the old one goes first
        # (Hetzner refuses a second key of one name); the server names it, not its id, and
        # waits for it without taking an input from it, so the engine never counts the server
        # among what that deletion replaces.
        key = hcloud.SshKey(
            key_name,
            name=key_name,
            public_key=checked,
            labels=labels,
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True),
        )
        self.hcloud_key = HcloudKey(site.name, key_name, public_key, key)
        return key_name, [key]

    def _hetzner(
        self, name: str, args: BalancerHostArgs, uploaded: Sequence[HcloudKey]
    ) -> pulumi.Output[str]:
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
        key, made_first = self._ssh_key(name, args, labels, uploaded)
        server = hcloud.Server(
            child_name(name, "vm"),
            server_type=load_catalog().hcloud_types.pick(HCLOUD_SERVER_TYPES, site.region),
            image=HCLOUD_IMAGE,
            location=site.region,
            ssh_keys=[key],
            firewall_ids=[firewall.id.apply(int)],
            # The overlay's firewall is attached by a FirewallAttachment (`allow_overlay`): the
            # hcloud provider then requires the server to ignore the firewall ids it reads back,
            # or a refresh records both and the next `up` detaches the overlay's.
            ignore_remote_firewall_ids=True,
            labels=labels,
            # Keys are read at creation only, and named: the name holds the current key after a
            # rotation, so a rotation changes nothing here (it reaches the host through its
            # deploy) and a replacement is made with the current key. Ignored still, so that a
            # server made when ssh_keys held the key's id is not rebuilt for the name.
            opts=pulumi.ResourceOptions(
                parent=self, ignore_changes=["ssh_keys"], depends_on=made_first
            ),
        )
        self._server, self._labels = server, labels
        return server.ipv4_address
