"""AWS: GPU nodes as EC2 instances with a cache volume, behind a security group."""

from collections.abc import Mapping, Sequence
from typing import NotRequired, TypedDict

import pulumi
import pulumi_aws as aws

from denv_iac.components.naming import aws_tags, child_name, resolved
from denv_iac.core.ingress import IngressRule, OverlayAccess, host_cidr, site_ingress_rules
from denv_iac.core.placement import PlacedNode
from denv_iac.core.stack.model import RecipeSpec, SiteSpec

CACHE_DEVICE = "/dev/sdf"  # the name at attach; see ebs_device for where the node sees it
ROOT_VOLUME_GB = 200  # the Deep Learning AMI and container images
# Instance arguments that replace the instance when changed, left as they were at launch: a
# newer AMI behind the parameter must not replace a warm node, nor the switch of key_name to the
# site key pair's own name (`site_key_pair`) a node launched before it. A rotated key changes no
# instance input at all: the key pair's name stays, and holds the current key.
KEPT_AT_LAUNCH = ("ami", "key_name")


class SecurityGroupWiring:
    """A security group, its ingress rows as rules, and open egress (weights, packages)."""

    def __init__(
        self,
        parent: pulumi.Resource,
        name: str,
        description: str,
        tags: dict[str, str],
        rules: Sequence[IngressRule],
        addresses: Mapping[str, pulumi.Input[str]],
        vpc_id: pulumi.Input[str] | None,
        region: str,
    ) -> None:
        self._parent, self._name, self._region = parent, name, region
        child = pulumi.ResourceOptions(parent=parent)
        self.group = aws.ec2.SecurityGroup(
            child_name(name, "sg"),
            description=description,
            vpc_id=vpc_id,
            region=region,
            tags=tags,
            opts=child,
        )
        self.allow(rules, addresses)
        for family, v4, v6 in (("v4", "0.0.0.0/0", None), ("v6", None, "::/0")):
            aws.vpc.SecurityGroupEgressRule(
                child_name(name, "out", family),
                security_group_id=self.group.id,
                region=region,
                cidr_ipv4=v4,
                cidr_ipv6=v6,
                ip_protocol="-1",
                description="weights, images and packages",
                opts=child,
            )

    def allow(
        self, rules: Sequence[IngressRule], addresses: Mapping[str, pulumi.Input[str]]
    ) -> None:
        """Ingress rules in the group; a machine's rule opens to its public address.

        Separate rule resources, so rules that name machines made later (a balancer host's
        WireGuard peers) can be added once those exist.
        """
        for rule in rules:
            if rule.from_machine:
                cidr = pulumi.Output.from_input(addresses[rule.source]).apply(host_cidr)
            else:
                cidr = pulumi.Output.from_input(rule.source)
            aws.vpc.SecurityGroupIngressRule(
                child_name(self._name, "in", rule.name),
                security_group_id=self.group.id,
                region=self._region,
                cidr_ipv4=cidr.apply(lambda c: None if ":" in c else c),
                cidr_ipv6=cidr.apply(lambda c: c if ":" in c else None),
                ip_protocol=rule.protocol,
                from_port=rule.from_port,
                to_port=rule.to_port,
                description=rule.description,
                opts=pulumi.ResourceOptions(parent=self._parent),
            )


def pinned_ami(parameter: str, region: str, parent: pulumi.Resource) -> pulumi.Output[str]:
    """The AMI id an SSM public parameter names (`name:version` pins a version)."""
    found = aws.ssm.get_parameter_output(
        name=parameter, region=region, opts=pulumi.InvokeOutputOptions(parent=parent)
    )
    return found.insecure_value


def site_key_pair(
    parent: pulumi.Resource, name: str, stack: str, site: SiteSpec, public_key: pulumi.Input[str]
) -> tuple[str, aws.ec2.KeyPair]:
    """The SSH key pair a site's machines are launched with, and its name, tagged from the site.

    The name is the resource's own and never changes: a rotated key replaces the key pair under
    it (the old one goes first, EC2 names being unique per region), so an instance launched
    after a rotation, a replacement included, gets the current key. Instances take the name as
    a plain value and wait for the key pair: with no input taken from it, the engine never
    counts them among what its deletion replaces. (`ssh-key`: the key pairs of earlier versions,
    `key`, had generated names; they go, and no instance is replaced for it.)
    """
    key_name = child_name(name, "ssh-key")
    key = aws.ec2.KeyPair(
        key_name,
        key_name=key_name,
        public_key=public_key,
        region=site.region,
        tags=aws_tags(stack, site.name, "ssh-key"),
        opts=pulumi.ResourceOptions(parent=parent, delete_before_replace=True),
    )
    return key_name, key


def vpc_of(subnet_id: str, region: str, parent: pulumi.Resource) -> pulumi.Output[str] | None:
    """The VPC of the site's subnet; None puts the security group in the default VPC."""
    if not subnet_id:
        return None
    subnet = aws.ec2.get_subnet_output(
        id=subnet_id, region=region, opts=pulumi.InvokeOutputOptions(parent=parent)
    )
    return subnet.vpc_id


def ebs_device(volume_id: str) -> str:
    """Where an EBS volume shows on a Nitro instance: its NVMe serial is the volume id.

    The device name given at attach (`/dev/sdf`) is not where it shows, and NVMe names
    (`/dev/nvme1n1`) follow discovery order; this path names the one volume only.
    """
    return f"/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_{volume_id.replace('-', '')}"


def elastic_ip(
    parent: pulumi.Resource,
    name: str,
    instance: aws.ec2.Instance,
    region: str,
    tags: Mapping[str, str],
) -> pulumi.Output[str]:
    """A public address that survives stop/start and exists in any subnet.

    An instance's own public IP is empty in a subnet that does not assign one, and changes on a
    stop/start under every /32 rule, server line and record made from it: an Elastic IP does
    neither.
    """
    eip = aws.ec2.Eip(
        child_name(name, "eip"),
        domain="vpc",
        instance=instance.id,
        region=region,
        tags=dict(tags),
        opts=pulumi.ResourceOptions(parent=parent),
    )
    return eip.public_ip


class AwsSiteArgs(TypedDict):
    stack: str
    site: SiteSpec
    recipes: Sequence[RecipeSpec]
    nodes: Sequence[PlacedNode]  # the placed nodes of this site
    public_key: pulumi.Input[str]  # OpenSSH public key of the site's SSH key
    balancer_addresses: Mapping[str, pulumi.Input[str]]  # balancer site -> host address
    # The nodes join the WireGuard overlay: its port instead of replica and agent ports
    # (`denv_iac.core.ingress.node_overlay_access`).
    overlay: NotRequired[OverlayAccess]


class AwsSite(pulumi.ComponentResource):
    """One EC2 instance per created node, each with a persistent EBS cache volume."""

    node_addresses: pulumi.Output[dict[str, str]]
    """Public address of each node, by node name."""
    cache_devices: pulumi.Output[dict[str, str]]
    """The block device of each node's cache volume, by node name."""

    def __init__(
        self, name: str, args: AwsSiteArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("denv:index:AwsSite", name, None, opts)
        site, stack = args["site"], args["stack"]
        child = pulumi.ResourceOptions(parent=self)
        rules = site_ingress_rules(
            site,
            tuple(args["recipes"]),
            tuple(args["balancer_addresses"]),
            args.get("overlay"),
        )
        security = SecurityGroupWiring(
            self,
            name,
            f"denv {stack} {site.name}: GPU nodes",
            aws_tags(stack, site.name, "gpu-node"),
            rules,
            args["balancer_addresses"],
            vpc_of(site.subnet_id, site.region, self),
            site.region,
        )
        key_name, key = site_key_pair(self, name, stack, site, args["public_key"])
        ami = pinned_ami(site.image, site.region, self)
        addresses: dict[str, pulumi.Output[str]] = {}
        devices: dict[str, pulumi.Output[str]] = {}
        for node in args["nodes"]:
            if not node.create:
                continue
            node_name = child_name(name, node.name)
            tags = aws_tags(stack, site.name, "gpu-node", node.name)
            instance = aws.ec2.Instance(
                node_name,
                ami=ami,
                instance_type=node.offering,
                region=site.region,
                key_name=key_name,
                subnet_id=site.subnet_id or None,
                vpc_security_group_ids=[security.group.id],
                metadata_options=aws.ec2.InstanceMetadataOptionsArgs(http_tokens="required"),
                root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(
                    volume_size=ROOT_VOLUME_GB, volume_type="gp3", encrypted=True
                ),
                tags=tags,
                opts=pulumi.ResourceOptions(
                    parent=self, ignore_changes=list(KEPT_AT_LAUNCH), depends_on=[key]
                ),
            )
            cache = aws.ebs.Volume(
                child_name(node_name, "cache"),
                availability_zone=instance.availability_zone,
                size=site.cache_size_gb,
                region=site.region,
                type="gp3",
                encrypted=True,
                tags=tags,
                opts=child,
            )
            aws.ec2.VolumeAttachment(
                child_name(node_name, "cache-attach"),
                device_name=CACHE_DEVICE,
                instance_id=instance.id,
                volume_id=cache.id,
                region=site.region,
                # Detach only from a stopped instance: the OS has then unmounted the cache
                # cleanly (AWS: a volume detached while mounted can stay "busy" indefinitely).
                # A detach comes on destroy, scale-down or node replacement, when the instance
                # goes anyway; stopping needs nothing from the node, where an unmount over SSH
                # would fail on the very node that is unreachable or broken.
                stop_instance_before_detaching=True,
                # A volume attaches to one instance: its replacement cannot attach first
                # (VolumeInUse, pulumi/pulumi-aws#2769), so the old attachment goes first.
                opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True),
            )
            addresses[node.name] = elastic_ip(self, node_name, instance, site.region, tags)
            devices[node.name] = cache.id.apply(ebs_device)
        self.node_addresses = resolved(addresses)
        self.cache_devices = resolved(devices)
        self.register_outputs(
            {"node_addresses": self.node_addresses, "cache_devices": self.cache_devices}
        )
