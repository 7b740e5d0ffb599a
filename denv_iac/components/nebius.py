"""Nebius: GPU nodes as compute instances of a GPU platform and preset, with a shared cache."""

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict

import pulumi
import pulumi.dynamic
import pulumi_nebius as nebius
import yaml

from denv_iac.components.dynamic_resource import DynamicResource
from denv_iac.components.naming import child_name, nebius_labels, resolved
from denv_iac.components.secrets import public_key_output
from denv_iac.components.site import SiteContext, SiteNodes
from denv_iac.core.ingress import (
    IngressRule,
    OverlayAccess,
    host_cidr,
    node_overlay_access,
    site_ingress_rules,
)
from denv_iac.core.placement import PlacedNode
from denv_iac.core.sites import CACHE_MOUNT_POINT, CLOUD_SSH_USER
from denv_iac.core.stack.model import RecipeSpec, SiteSpec
from denv_iac.core.stack.values import machine_name

BOOT_DISK_GB = 200  # the image's drivers and CUDA, and container images
CACHE_MOUNT_TAG = "denv-cache"
MAX_PORTS_PER_RULE = 8  # Nebius allows at most 8 destination ports in one rule
# Instance inputs read only when the instance is made, left as they were then: the public
# address's kind (made static for nodes made from now on; an interface's address is not changed
# under a running node). The user data is not among them: the engine would put it back into a
# replacement too, and boot it with the key a rotation retired. `LaunchUserData` keeps it instead.
KEPT_AT_LAUNCH = ("networkInterfaces[*].publicIpAddress.static",)


def offering_parts(offering: str) -> tuple[str, str]:
    """The platform and preset of a Nebius offering written "platform/preset"."""
    platform, _, preset = offering.partition("/")
    return platform, preset


def cloud_init(public_key: str) -> str:
    """User data for a node: the login with the site's key, and the cache filesystem mounted.

    Only the public half of the key is here: user data is no place for a secret.
    """
    config = {
        "users": [
            {
                "name": CLOUD_SSH_USER,  # the login NodeSetup uses
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "shell": "/bin/bash",
                "ssh_authorized_keys": [public_key],
            }
        ],
        # virtiofs is how Nebius shares a filesystem into an instance, by its mount tag; the
        # node deploy puts the replicas' caches under the mount point.
        "mounts": [[CACHE_MOUNT_TAG, CACHE_MOUNT_POINT, "virtiofs", "defaults,nofail", "0", "0"]],
    }
    return "#cloud-config\n" + yaml.safe_dump(config, sort_keys=True)


class LaunchUserDataProvider(pulumi.dynamic.ResourceProvider):
    """The user data an instance was launched with, the current one taken only for a launch.

    `launch` holds the instance's inputs that launch it again when they change (those the Nebius
    API marks IMMUTABLE: the platform, the boot disk, the interface's subnet) and its preset. A
    new `user_data` alone (a rotated key, another cloud-init) is no change: the engine keeps the
    recorded one, so the instance's inputs stay as they were and nothing is relaunched; the
    running machine gets the key from its deploy. With another `launch`, the update records the
    current user data, and the instance, replaced for the same change, boots with it.
    """

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        return pulumi.dynamic.CreateResult(id_="launch", outs=_launch_state(props))

    def diff(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.DiffResult:
        relaunch = olds.get("launch") != news.get("launch")
        return pulumi.dynamic.DiffResult(changes=relaunch, replaces=[], delete_before_replace=False)

    def update(
        self, _id: str, _olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(_launch_state(news))


def _launch_state(props: dict[str, Any]) -> dict[str, Any]:
    return {"launch": props["launch"], "user_data": props["user_data"]}


class LaunchUserData(DynamicResource, module="nebius", name="LaunchUserData"):
    """An instance's cloud-init user data as of its launch (see `LaunchUserDataProvider`)."""

    user_data: pulumi.Output[str]

    def __init__(
        self,
        name: str,
        user_data: pulumi.Input[str],
        launch: Mapping[str, pulumi.Input[str]],
        opts: pulumi.ResourceOptions,
    ) -> None:
        props = {"launch": dict(launch), "user_data": user_data}
        super().__init__(LaunchUserDataProvider(), name, props, opts)


def port_groups(rule: IngressRule) -> list[list[int]]:
    """The rule's ports in lists Nebius accepts, in order."""
    ports = list(range(rule.from_port, rule.to_port + 1))
    return [ports[i : i + MAX_PORTS_PER_RULE] for i in range(0, len(ports), MAX_PORTS_PER_RULE)]


def public_address(status: Any) -> str:
    """The public IPv4 of an instance's first interface, without its prefix length."""
    address = str(status.network_interfaces[0].public_ip_address.address)
    return address.partition("/")[0]


class NebiusSiteArgs(TypedDict):
    stack: str
    site: SiteSpec
    recipes: Sequence[RecipeSpec]
    nodes: Sequence[PlacedNode]  # the placed nodes of this site
    public_key: pulumi.Input[str]  # OpenSSH public key of the site's SSH key
    balancer_addresses: Mapping[str, pulumi.Input[str]]  # balancer site -> host address
    # The nodes join the WireGuard overlay: its port instead of replica and agent ports.
    overlay: NotRequired[OverlayAccess]


class NebiusSite(pulumi.ComponentResource):
    """One compute instance per created node, in the site's project and subnet.

    Each node boots from a disk made from an image family with drivers (the site's
    `image_family`, `ubuntu22.04-cuda12` by default), runs the offering's platform and preset,
    has a public address, and mounts the site's one shared filesystem, where weights and compile
    caches outlive any node. A security group on the subnet's network opens SSH to the admin
    CIDRs and, to the balancer hosts only, WireGuard's UDP port with the overlay on (the
    replica and agent ports with it off).
    """

    node_addresses: pulumi.Output[dict[str, str]]
    """Public address of each node, by node name."""

    def __init__(
        self, name: str, args: NebiusSiteArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("denv:index:NebiusSite", name, None, opts)
        site, stack = args["site"], args["stack"]
        child = pulumi.ResourceOptions(parent=self)
        labels = nebius_labels(stack, site.name, "gpu-node")
        cache = nebius.ComputeV1Filesystem(
            child_name(name, "cache"),
            parent_id=site.project_id,
            name=machine_name(stack, site.name, "cache"),
            type="NETWORK_SSD",
            size_gibibytes=site.cache_size_gb,
            labels=labels,
            opts=child,
        )
        group = self._security_group(name, args, labels)
        user_data = pulumi.Output.from_input(args["public_key"]).apply(cloud_init)
        platform, preset = offering_parts(site.offering)
        addresses: dict[str, pulumi.Output[str]] = {}
        for node in args["nodes"]:
            if not node.create:
                continue
            node_name = child_name(name, node.name)
            host = machine_name(stack, site.name, node.name)
            boot = nebius.ComputeV1Disk(
                child_name(node_name, "boot"),
                parent_id=site.project_id,
                name=f"{host}-boot",
                type="NETWORK_SSD",
                size_gibibytes=BOOT_DISK_GB,
                source_image_family=nebius.ComputeV1DiskSourceImageFamilyArgs(
                    image_family=site.image
                ),
                labels=labels,
                # Another family (a new default) must not replace a warm node's disk, and with
                # it the node: it applies to the nodes made from then on.
                opts=pulumi.ResourceOptions(parent=self, ignore_changes=["source_image_family"]),
            )
            launch = LaunchUserData(
                child_name(node_name, "user-data"),
                user_data,
                {
                    "platform": platform,
                    "preset": preset,
                    "boot_disk": boot.id,
                    "subnet_id": site.subnet_id,
                },
                child,
            )
            instance = nebius.ComputeV1Instance(
                node_name,
                parent_id=site.project_id,
                name=host,
                hostname=host,
                resources=nebius.ComputeV1InstanceResourcesArgs(platform=platform, preset=preset),
                boot_disk=nebius.ComputeV1InstanceBootDiskArgs(
                    attach_mode="READ_WRITE",
                    existing_disk=nebius.ComputeV1InstanceBootDiskExistingDiskArgs(id=boot.id),
                ),
                network_interfaces=[
                    nebius.ComputeV1InstanceNetworkInterfaceArgs(
                        name="eth0",
                        subnet_id=site.subnet_id,
                        ip_address=nebius.ComputeV1InstanceNetworkInterfaceIpAddressArgs(),
                        # Static: allocated with the interface, kept across a stop and start
                        # (a dynamic one is released at a stop and another given at the start,
                        # under every /32 rule, server line and deploy target made from it).
                        public_ip_address=(
                            nebius.ComputeV1InstanceNetworkInterfacePublicIpAddressArgs(static=True)
                        ),
                        security_groups=[
                            nebius.ComputeV1InstanceNetworkInterfaceSecurityGroupArgs(id=group.id)
                        ],
                    )
                ],
                filesystems=[
                    nebius.ComputeV1InstanceFilesystemArgs(
                        attach_mode="READ_WRITE",
                        mount_tag=CACHE_MOUNT_TAG,
                        existing_filesystem=(
                            nebius.ComputeV1InstanceFilesystemExistingFilesystemArgs(id=cache.id)
                        ),
                    )
                ],
                cloud_init_user_data=launch.user_data,
                labels=labels | {"denv-node": node.name},
                # Nebius refuses a second instance of the same name in a project: a replacement
                # deletes the old instance before it creates the new one.
                opts=pulumi.ResourceOptions(
                    parent=self, ignore_changes=list(KEPT_AT_LAUNCH), delete_before_replace=True
                ),
            )
            addresses[node.name] = instance.status.apply(public_address)
        self.node_addresses = resolved(addresses)
        self.register_outputs({"node_addresses": self.node_addresses})

    def _security_group(
        self, name: str, args: NebiusSiteArgs, labels: dict[str, str]
    ) -> nebius.VpcV1SecurityGroup:
        """The nodes' security group: site_ingress_rules as ALLOW rules, and open egress."""
        site = args["site"]
        child = pulumi.ResourceOptions(parent=self)
        subnet = nebius.get_vpc_v1_subnet_output(
            id=site.subnet_id, opts=pulumi.InvokeOutputOptions(parent=self)
        )
        group = nebius.VpcV1SecurityGroup(
            child_name(name, "sg"),
            parent_id=site.project_id,
            network_id=subnet.network_id,
            name=machine_name(args["stack"], site.name, "gpu-nodes"),
            labels=labels,
            opts=child,
        )
        balancers = args["balancer_addresses"]
        rules = site_ingress_rules(
            site, tuple(args["recipes"]), tuple(balancers), args.get("overlay")
        )
        for rule in rules:
            source = (
                pulumi.Output.from_input(balancers[rule.source]).apply(host_cidr)
                if rule.from_machine
                else pulumi.Output.from_input(rule.source)
            )
            groups = port_groups(rule)
            for index, ports in enumerate(groups):
                suffix = (rule.name,) if len(groups) == 1 else (rule.name, str(index))
                nebius.VpcV1SecurityRule(
                    child_name(name, "in", *suffix),
                    name=child_name(name, "in", *suffix),
                    parent_id=group.id,
                    access="ALLOW",
                    protocol=rule.protocol.upper(),
                    ingress=nebius.VpcV1SecurityRuleIngressArgs(
                        destination_ports=ports, source_cidrs=[source]
                    ),
                    labels=labels,
                    opts=child,
                )
        nebius.VpcV1SecurityRule(
            child_name(name, "out"),
            name=child_name(name, "out"),
            parent_id=group.id,
            access="ALLOW",
            protocol="ANY",
            egress=nebius.VpcV1SecurityRuleEgressArgs(destination_cidrs=["0.0.0.0/0"]),
            labels=labels,
            opts=child,
        )
        return group


def nebius_site(
    name: str, site: SiteSpec, context: SiteContext, opts: pulumi.ResourceOptions
) -> SiteNodes:
    """Cluster's builder of a Nebius site (see `denv_iac.components.site.SiteBuilder`)."""
    args: NebiusSiteArgs = {
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
    component = NebiusSite(name, args, opts)
    return SiteNodes(component, component.node_addresses)
