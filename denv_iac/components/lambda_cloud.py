"""Lambda Cloud: GPU nodes as Lambda instances, through dynamic providers over its REST API.

Lambda has no Pulumi or Terraform provider of record, so four `pulumi.dynamic` providers call
`denv_iac.lambda_api`: an instance, an SSH key, a filesystem and a firewall ruleset. The API key
is a secret input of each; it is kept in the resource's state, marked secret, because the engine
hands `delete` and `read` only the state, and they must reach Lambda too.
"""

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict

import httpx
import pulumi
import pulumi.dynamic as dynamic

from denv_iac.components.dynamic_resource import DynamicResource, whole_numbers
from denv_iac.components.naming import child_name, resolved
from denv_iac.components.secrets import public_key_output
from denv_iac.components.site import SiteContext, SiteNodes
from denv_iac.core.ingress import (
    IngressRule,
    OverlayAccess,
    ipv4_source,
    node_overlay_access,
    site_ingress_rules,
)
from denv_iac.core.placement import PlacedNode
from denv_iac.core.sites import cache_file_system_name
from denv_iac.core.stack.model import RecipeSpec, SiteSpec

# Re-exported: the name rule lives with the stack model, which checks names for their length.
from denv_iac.core.stack.values import LAMBDA_NAME_LENGTH, machine_name
from denv_iac.core.stack.values import lambda_name as lambda_name
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

API_KEY = "api_key"
KEY_ID_LENGTH = 8  # hex digits of the public key's digest in its account key's name


def ssh_key_name(public_key: str, *parts: str) -> str:
    """The account key's name: the site's, then a digest of the key, so a rotated key has a
    name of its own and is made before the old one goes (names are unique per account)."""
    digest = hashlib.sha256(public_key.strip().encode()).hexdigest()[:KEY_ID_LENGTH]
    base = lambda_name(*parts)[: LAMBDA_NAME_LENGTH - KEY_ID_LENGTH - 1].rstrip("-")
    return f"{base}-{digest}"


def firewall_rules(
    rules: Sequence[IngressRule], addresses: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Spec FirewallRule objects from the site's ingress rows (Lambda filters IPv4 only).

    A machine's row opens its port to that machine's address; an IPv6 source has no
    place in a Lambda ruleset and is left to the node's own firewall.
    """
    out = []
    for rule in rules:
        source = ipv4_source(rule, addresses)
        if source is None:
            continue
        out.append(
            {
                "protocol": rule.protocol,
                "port_range": [rule.from_port, rule.to_port],
                "source_network": source,
                "description": rule.description[:128],
            }
        )
    return out


def wire_rules(rules: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rules as Lambda takes them: the engine hands a dynamic provider numbers as floats."""
    return [{**rule, "port_range": whole_numbers(rule["port_range"])} for rule in rules]


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
    # Names are unique per account: a replacement that keeps its name must delete first.
    unique_name = False

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
        same_name = self.unique_name and olds.get("name") == news.get("name")
        return dynamic.DiffResult(
            changes=bool(changes),
            replaces=replaces,
            delete_before_replace=(self.delete_before_replace or same_name) and bool(replaces),
        )

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> dynamic.UpdateResult:
        # Only the API key changed (anything else replaces): keep the new one for later calls.
        return dynamic.UpdateResult(_inputs(news, self.inputs))


INSTANCE_INPUTS = (
    "name",
    "region",
    "instance_type",
    "ssh_key_names",
    "file_system_names",
    "firewall_rulesets",
)


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
    """One Lambda instance; its type, region, SSH keys and filesystems are fixed at launch.

    SSH keys are read at launch only, yet a change of them relaunches nothing: it is recorded,
    so that a later launch (another type, region or filesystem) is made with the current keys,
    and a rotated key reaches the running instance through its node deploy (authorized_keys).
    An `ignore_changes` would keep the launch's keys for a replacement too: deleted ones.
    """

    inputs = INSTANCE_INPUTS
    replace_on = ("region", "instance_type", "file_system_names")

    def diff(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> dynamic.DiffResult:
        # A ruleset attaches only at launch, and its rules are patched in place: an instance
        # launched before its site had one keeps running (the account's rules apply to it)
        # rather than be replaced, billed GPU and warm caches lost, for a firewall.
        if "firewall_rulesets" not in olds:
            news = {k: v for k, v in news.items() if k != "firewall_rulesets"}
        return super().diff(id_, olds, news)

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
                    firewall_ruleset_ids=props.get("firewall_rulesets") or (),
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
    """One account SSH key; Lambda has no update, and key names are unique per account.

    A rotated key is another key of another name (`ssh_key_name`), made before the old one is
    deleted: the instances launched with the old one keep running, and the node deploy puts the
    new key in their authorized_keys (Lambda reads an instance's keys only at launch).
    """

    inputs = ("name", "public_key")
    replace_on = inputs
    unique_name = True

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


class LambdaFirewallRulesetProvider(_LambdaProvider):
    """One regional firewall ruleset: its name and rules are patched in place.

    One of the same name and region is adopted (a retried create, or a state lost), its rules
    set to these.
    """

    inputs = ("name", "region", "rules")
    replace_on = ("region",)

    def create(self, props: dict[str, Any]) -> dynamic.CreateResult:
        with self.client(props) as lambda_api:
            found = [
                r
                for r in lambda_api.list_firewall_rulesets()
                if r.name == props["name"] and r.region == props["region"]
            ]
            if found:
                ruleset = lambda_api.update_firewall_ruleset(
                    found[0].id, props["name"], wire_rules(props["rules"])
                )
            else:
                ruleset = lambda_api.create_firewall_ruleset(
                    props["name"], props["region"], wire_rules(props["rules"])
                )
        return dynamic.CreateResult(ruleset.id, _inputs(props, self.inputs))

    def read(self, id_: str, props: dict[str, Any]) -> dynamic.ReadResult:
        with self.client(props) as lambda_api:
            found = [r for r in lambda_api.list_firewall_rulesets() if r.id == id_]
        if not found:
            return dynamic.ReadResult("", {})
        return dynamic.ReadResult(
            id_, {**_inputs(props, self.inputs), "rules": list(found[0].rules)}
        )

    def update(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> dynamic.UpdateResult:
        if changed_keys(olds, news, ("name", "rules")):
            with self.client(news) as lambda_api:
                lambda_api.update_firewall_ruleset(id_, news["name"], wire_rules(news["rules"]))
        return dynamic.UpdateResult(_inputs(news, self.inputs))

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        with self.client(props) as lambda_api:
            lambda_api.delete_firewall_ruleset(id_)


def _secret_state(opts: pulumi.ResourceOptions | None) -> pulumi.ResourceOptions:
    # The API key is a secret input; its copy in the state must stay one, whatever the engine.
    return pulumi.ResourceOptions.merge(
        opts, pulumi.ResourceOptions(additional_secret_outputs=[API_KEY])
    )


class _LambdaResource(DynamicResource):
    """What the four resources share: their provider, the secret API key, outputs to fill."""

    default_provider: type[_LambdaProvider] = _LambdaProvider
    outputs: tuple[str, ...] = ()  # outputs that only the provider sets

    def __init__(
        self,
        resource_name: str,
        props: Mapping[str, pulumi.Input[Any]],
        opts: pulumi.ResourceOptions | None = None,
        provider: _LambdaProvider | None = None,
    ) -> None:
        super().__init__(
            provider or self.default_provider(),
            resource_name,
            {**props, **dict.fromkeys(self.outputs)},
            _secret_state(opts),
        )


class LambdaInstance(_LambdaResource, module="lambda", name="Instance"):
    """A Lambda instance, active with an address once created."""

    default_provider = LambdaInstanceProvider
    outputs = ("ip",)
    name: pulumi.Output[str]
    ip: pulumi.Output[str]


class LambdaSshKey(_LambdaResource, module="lambda", name="SshKey"):
    """An SSH key of the Lambda account, named for the instances launched with it."""

    default_provider = LambdaSshKeyProvider
    name: pulumi.Output[str]


class LambdaFileSystem(_LambdaResource, module="lambda", name="FileSystem"):
    """A Lambda filesystem, mounted on the instances launched with it."""

    default_provider = LambdaFileSystemProvider
    outputs = ("mount_point",)
    name: pulumi.Output[str]
    mount_point: pulumi.Output[str]


class LambdaFirewallRuleset(_LambdaResource, module="lambda", name="FirewallRuleset"):
    """A Lambda firewall ruleset of one region, attached to the site's instances at launch."""

    default_provider = LambdaFirewallRulesetProvider
    name: pulumi.Output[str]


class LambdaSiteArgs(TypedDict):
    stack: str
    site: SiteSpec
    nodes: Sequence[PlacedNode]  # the placed nodes of this site
    public_key: pulumi.Input[str]  # OpenSSH public key of the site's SSH key
    api_key: pulumi.Input[str]  # the Lambda Cloud API key, a secret
    recipes: NotRequired[Sequence[RecipeSpec]]  # what may run here: the ports to open
    balancer_addresses: NotRequired[Mapping[str, pulumi.Input[str]]]  # balancer site -> address
    # The nodes join the WireGuard overlay: its port instead of replica and agent ports.
    overlay: NotRequired[OverlayAccess]


class LambdaSite(pulumi.ComponentResource):
    """One Lambda instance per created node, all launched with the site's filesystem.

    Lambda filesystems are regional and attach only at launch, so the site has one, in its
    region, made before any instance: it holds the weights and compile caches, and a node that
    replaces another finds them there. Drivers come preinstalled (Lambda Stack).

    Lambda's firewall allows only SSH and ICMP by default. The site has a firewall ruleset in
    its region (spec 1.8.3's `/firewall-rulesets`), attached to each instance at launch:
    WireGuard's UDP port open to the balancer hosts' addresses when the overlay is on (replica
    and agent ports to them when it is off), SSH to the admin CIDRs
    (`denv_iac.core.ingress.site_ingress_rules`); a balancer moving patches its rules in
    place. The node deploy's host firewall narrows them again on each node.
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
        public_key = pulumi.Output.from_input(args["public_key"])
        key = LambdaSshKey(
            child_name(name, "key"),
            {
                API_KEY: api_key,
                "name": public_key.apply(lambda k: ssh_key_name(k, stack, site.name)),
                "public_key": public_key,
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
        balancers = args.get("balancer_addresses", {})
        rows = site_ingress_rules(
            site, tuple(args.get("recipes", ())), tuple(balancers), args.get("overlay")
        )
        hosts = sorted(balancers)
        ruleset = LambdaFirewallRuleset(
            child_name(name, "fw"),
            {
                API_KEY: api_key,
                "name": lambda_name(stack, site.name),
                "region": site.region,
                "rules": pulumi.Output.all(*(balancers[h] for h in hosts)).apply(
                    lambda addresses: firewall_rules(rows, dict(zip(hosts, addresses, strict=True)))
                ),
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
                    "firewall_rulesets": [ruleset.id],
                },
                # A rotated key is recorded, never a relaunch (a billed GPU, warm caches
                # lost): see LambdaInstanceProvider.
                pulumi.ResourceOptions(parent=self),
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
        "recipes": context["spec"].recipes,
        "balancer_addresses": context["balancer_addresses"],
    }
    overlay = node_overlay_access(context["spec"], site.name)
    if overlay:
        args["overlay"] = overlay
    component = LambdaSite(name, args, opts)
    return SiteNodes(component, component.node_addresses)
