"""Lambda Cloud: GPU nodes as Lambda instances, through dynamic providers over its REST API.

Lambda has no Pulumi or Terraform provider of record, so three `pulumi.dynamic` providers call
`denv_iac.lambda_api`: an instance, an SSH key and a filesystem. The API key is a secret input of
each; it is kept in the resource's state, marked secret, because the engine hands `delete` and
`read` only the state, and they must reach Lambda too.
"""

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import httpx
import pulumi
import pulumi.dynamic as dynamic

from denv_iac.components.dynamic_resource import DynamicResource
from denv_iac.components.naming import child_name, machine_name, resolved
from denv_iac.components.secrets import public_key_output
from denv_iac.components.site import SiteContext, SiteNodes
from denv_iac.lambda_api import (
    DEFAULT_RETRY,
    GONE_STATUSES,
    PACER,
    Instance,
    LambdaApiError,
    LambdaClient,
    Pacer,
    Retry,
)
from denv_iac.placement import PlacedNode
from denv_iac.spec.model import SiteSpec

# Re-exported: the name rule lives with the stack model, which checks names for their length.
from denv_iac.spec.values import lambda_name as lambda_name

API_KEY = "api_key"
LAMBDA_NFS = "/lambda/nfs"  # Lambda mounts each filesystem at /lambda/nfs/<its name>


def cache_file_system_name(stack: str, site: str) -> str:
    """The name of the site's cache filesystem; names are unique per Lambda account."""
    return lambda_name(stack, site, "cache")


def cache_mount_point(stack: str, site: str) -> str:
    """Where Lambda mounts the site's cache filesystem on every instance launched with it."""
    return f"{LAMBDA_NFS}/{cache_file_system_name(stack, site)}"


def changed_keys(
    olds: Mapping[str, Any], news: Mapping[str, Any], keys: Sequence[str]
) -> list[str]:
    """The keys whose value differs (an unknown new value counts as a change)."""
    return [key for key in keys if olds.get(key) != news.get(key)]


def _inputs(props: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The state to keep: the inputs named, the API key among them, and nothing else."""
    return {key: props[key] for key in (API_KEY, *keys) if key in props}


class _LambdaProvider(dynamic.ResourceProvider):
    """What the three providers share: a client from the resource's own API key."""

    inputs: tuple[str, ...] = ()
    replace_on: tuple[str, ...] = ()  # inputs Lambda cannot change in place
    delete_before_replace = False

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        retry: Retry = DEFAULT_RETRY,
        pacer: Pacer | None = None,
    ) -> None:
        super().__init__()
        # The provider is serialized into each resource and unpickled per call: the process's
        # PACER is looked up at call time, so every resource shares it (a pickled copy would not).
        self._transport, self._retry, self._pacer = transport, retry, pacer

    def client(self, props: Mapping[str, Any]) -> LambdaClient:
        return LambdaClient(
            str(props[API_KEY]),
            transport=self._transport,
            retry=self._retry,
            pacer=self._pacer or PACER,
        )

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> dynamic.DiffResult:
        # The serialized provider is compared by nobody: its bytes change with library versions.
        changes = changed_keys(olds, news, (API_KEY, *self.inputs))
        replaces = [key for key in changes if key in self.replace_on]
        return dynamic.DiffResult(
            changes=bool(changes),
            replaces=replaces,
            delete_before_replace=self.delete_before_replace and bool(replaces),
        )

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> dynamic.UpdateResult:
        # Only the API key changed (anything else replaces): keep the new one for later calls.
        return dynamic.UpdateResult(_inputs(news, self.inputs))


INSTANCE_INPUTS = ("name", "region", "instance_type", "ssh_key_names", "file_system_names")


def _instance_outs(props: Mapping[str, Any], instance: Instance) -> dict[str, Any]:
    return {**_inputs(props, INSTANCE_INPUTS), "ip": instance.ip}


def _same_launch(instance: Instance, props: Mapping[str, Any]) -> bool:
    """An instance this resource launched before its create was recorded (a retried `up`)."""
    return (
        instance.name == props["name"]
        and instance.region == props["region"]
        and instance.instance_type == props["instance_type"]
        and sorted(instance.ssh_key_names) == sorted(props["ssh_key_names"])
        and sorted(instance.file_system_names) == sorted(props["file_system_names"])
        and instance.status not in GONE_STATUSES
    )


class LambdaInstanceProvider(_LambdaProvider):
    """One Lambda instance; its type, region, SSH keys and filesystems are fixed at launch."""

    inputs = INSTANCE_INPUTS
    replace_on = ("region", "instance_type", "ssh_key_names", "file_system_names")

    def create(self, props: dict[str, Any]) -> dynamic.CreateResult:
        with self.client(props) as lambda_api:
            # A GPU instance bills by the hour: never launch a second one for the same resource.
            found = [i for i in lambda_api.list_instances() if _same_launch(i, props)]
            instance_id = (
                found[0].id
                if found
                else lambda_api.launch(
                    name=props["name"],
                    region=props["region"],
                    instance_type=props["instance_type"],
                    ssh_key_names=props["ssh_key_names"],
                    file_system_names=props["file_system_names"],
                )
            )
            instance = lambda_api.wait_active(instance_id)
        return dynamic.CreateResult(instance.id, _instance_outs(props, instance))

    def read(self, id_: str, props: dict[str, Any]) -> dynamic.ReadResult:
        with self.client(props) as lambda_api:
            try:
                instance = lambda_api.get_instance(id_)
            except LambdaApiError as error:
                if error.not_found:
                    return dynamic.ReadResult("", {})
                raise
        if instance.status in ("terminated", "preempted"):
            # Gone for good (Lambda preempts without notice): the next `up` launches anew.
            return dynamic.ReadResult("", {})
        return dynamic.ReadResult(id_, _instance_outs(props, instance))

    def update(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> dynamic.UpdateResult:
        if olds.get("name") == news["name"]:
            return dynamic.UpdateResult({**_inputs(news, self.inputs), "ip": olds.get("ip", "")})
        with self.client(news) as lambda_api:
            instance = lambda_api.rename(id_, news["name"])
        return dynamic.UpdateResult(_instance_outs(news, instance))

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        # Terminate is asynchronous; the site's filesystem is deleted after the instances, and
        # Lambda refuses that while one still holds it: return only once this one is gone.
        with self.client(props) as lambda_api:
            lambda_api.terminate(id_)
            lambda_api.wait_gone(id_)


class LambdaSshKeyProvider(_LambdaProvider):
    """One account SSH key; Lambda has no update, and key names are unique per account."""

    inputs = ("name", "public_key")
    replace_on = inputs
    delete_before_replace = True

    def create(self, props: dict[str, Any]) -> dynamic.CreateResult:
        with self.client(props) as lambda_api:
            found = [
                k
                for k in lambda_api.list_ssh_keys()
                if k.name == props["name"] and k.public_key.strip() == props["public_key"].strip()
            ]
            key = found[0] if found else lambda_api.add_ssh_key(props["name"], props["public_key"])
        return dynamic.CreateResult(key.id, _inputs(props, self.inputs))

    def read(self, id_: str, props: dict[str, Any]) -> dynamic.ReadResult:
        with self.client(props) as lambda_api:
            found = [k for k in lambda_api.list_ssh_keys() if k.id == id_]
        if not found:
            return dynamic.ReadResult("", {})
        outs = {**_inputs(props, self.inputs), "name": found[0].name}
        return dynamic.ReadResult(id_, outs | {"public_key": found[0].public_key})

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        with self.client(props) as lambda_api:
            lambda_api.delete_ssh_key(id_)


class LambdaFileSystemProvider(_LambdaProvider):
    """One regional filesystem; it has no rename, and names are unique per account.

    An existing filesystem of the same name and region is adopted, not recreated: it holds the
    weights and compile caches that make a replacement node start in minutes.
    """

    inputs = ("name", "region")
    replace_on = inputs
    delete_before_replace = True

    def create(self, props: dict[str, Any]) -> dynamic.CreateResult:
        with self.client(props) as lambda_api:
            found = [
                f
                for f in lambda_api.list_file_systems()
                if f.name == props["name"] and f.region == props["region"]
            ]
            fs = (
                found[0] if found else lambda_api.create_file_system(props["name"], props["region"])
            )
        return dynamic.CreateResult(
            fs.id, {**_inputs(props, self.inputs), "mount_point": fs.mount_point}
        )

    def read(self, id_: str, props: dict[str, Any]) -> dynamic.ReadResult:
        with self.client(props) as lambda_api:
            found = [f for f in lambda_api.list_file_systems() if f.id == id_]
        if not found:
            return dynamic.ReadResult("", {})
        outs = {**_inputs(props, self.inputs), "mount_point": found[0].mount_point}
        return dynamic.ReadResult(id_, outs)

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        with self.client(props) as lambda_api:
            lambda_api.delete_file_system(id_)


def _secret_state(opts: pulumi.ResourceOptions | None) -> pulumi.ResourceOptions:
    # The API key is a secret input; its copy in the state must stay one, whatever the engine.
    return pulumi.ResourceOptions.merge(
        opts, pulumi.ResourceOptions(additional_secret_outputs=[API_KEY])
    )


class LambdaInstance(DynamicResource, module="lambda", name="Instance"):
    """A Lambda instance, active with an address once created."""

    name: pulumi.Output[str]
    ip: pulumi.Output[str]

    def __init__(
        self,
        resource_name: str,
        props: Mapping[str, pulumi.Input[Any]],
        opts: pulumi.ResourceOptions | None = None,
        provider: LambdaInstanceProvider | None = None,
    ) -> None:
        super().__init__(
            provider or LambdaInstanceProvider(),
            resource_name,
            {**props, "ip": None},
            _secret_state(opts),
        )


class LambdaSshKey(DynamicResource, module="lambda", name="SshKey"):
    """An SSH key of the Lambda account, named for the instances launched with it."""

    name: pulumi.Output[str]

    def __init__(
        self,
        resource_name: str,
        props: Mapping[str, pulumi.Input[Any]],
        opts: pulumi.ResourceOptions | None = None,
        provider: LambdaSshKeyProvider | None = None,
    ) -> None:
        super().__init__(
            provider or LambdaSshKeyProvider(), resource_name, dict(props), _secret_state(opts)
        )


class LambdaFileSystem(DynamicResource, module="lambda", name="FileSystem"):
    """A Lambda filesystem, mounted on the instances launched with it."""

    name: pulumi.Output[str]
    mount_point: pulumi.Output[str]

    def __init__(
        self,
        resource_name: str,
        props: Mapping[str, pulumi.Input[Any]],
        opts: pulumi.ResourceOptions | None = None,
        provider: LambdaFileSystemProvider | None = None,
    ) -> None:
        super().__init__(
            provider or LambdaFileSystemProvider(),
            resource_name,
            {**props, "mount_point": None},
            _secret_state(opts),
        )


class LambdaSiteArgs(TypedDict):
    stack: str
    site: SiteSpec
    nodes: Sequence[PlacedNode]  # the placed nodes of this site
    public_key: pulumi.Input[str]  # OpenSSH public key of the site's SSH key
    api_key: pulumi.Input[str]  # the Lambda Cloud API key, a secret


class LambdaSite(pulumi.ComponentResource):
    """One Lambda instance per created node, all launched with the site's filesystem.

    Lambda filesystems are regional and attach only at launch, so the site has one, in its
    region, made before any instance: it holds the weights and compile caches, and a node that
    replaces another finds them there. Drivers come preinstalled (Lambda Stack).

    Lambda's cloud firewall allows only SSH and ICMP by default, and its rules belong to the
    whole account, not to one instance; this component does not change them. Open the replica
    and agent ports (see `denv_iac.components.security.site_ingress_rules`) to the balancer
    addresses in the account's firewall rules; the node deploy's host firewall then limits them
    to the balancer hosts on each node.
    """

    node_addresses: pulumi.Output[dict[str, str]]
    """Public address of each node, by node name."""

    def __init__(
        self, name: str, args: LambdaSiteArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("denv:index:LambdaSite", name, None, opts)
        site, stack = args["site"], args["stack"]
        child = pulumi.ResourceOptions(parent=self)
        api_key = pulumi.Output.secret(args["api_key"])
        key = LambdaSshKey(
            child_name(name, "key"),
            {
                API_KEY: api_key,
                "name": lambda_name(stack, site.name),
                "public_key": args["public_key"],
            },
            child,
        )
        cache = LambdaFileSystem(
            child_name(name, "cache"),
            {
                API_KEY: api_key,
                "name": cache_file_system_name(stack, site.name),
                "region": site.region,
            },
            child,
        )
        addresses: dict[str, pulumi.Output[str]] = {}
        for node in args["nodes"]:
            if not node.create:
                continue
            instance = LambdaInstance(
                child_name(name, node.name),
                {
                    API_KEY: api_key,
                    "name": lambda_name(machine_name(stack, site.name, node.name)),
                    "region": site.region,
                    "instance_type": node.offering,
                    "ssh_key_names": [key.name],
                    "file_system_names": [cache.name],
                },
                child,
            )
            addresses[node.name] = instance.ip
        self.node_addresses = resolved(addresses)
        self.register_outputs({"node_addresses": self.node_addresses})


def lambda_site(
    name: str, site: SiteSpec, context: SiteContext, opts: pulumi.ResourceOptions
) -> SiteNodes:
    """Cluster's builder of a Lambda site (see `denv_iac.components.site.SiteBuilder`)."""
    args: LambdaSiteArgs = {
        "stack": context["stack"],
        "site": site,
        "nodes": context["nodes"],
        "public_key": public_key_output(context["secrets"]["ssh_private_key"]),
        "api_key": context["secrets"][API_KEY],
    }
    component = LambdaSite(name, args, opts)
    return SiteNodes(component, component.node_addresses)
