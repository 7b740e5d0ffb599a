"""The resource graph of a stack, offline: the program run under Pulumi's unit-test mocks.

Pulumi's documented mocks (`pulumi.runtime.set_mocks`) run a program in-process against the real
provider SDK classes, with no engine, CLI or cloud account. The mocks here record every
registration as the engine would receive it (parent, options, serialized inputs) and answer the
few invokes the components make with stable canned values, so the same stack always gives the
same graph. Importing this module imports Pulumi: keep it out of code paths that do not need it.
"""

import asyncio
import base64
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
from google.protobuf import json_format
from pulumi.runtime import rpc

from denv_iac.components import Cluster, ClusterArgs
from denv_iac.core.stack.model import StackSpec

AMI_ID = "ami-0123456789abcdef0"
SECRET_SIG = rpc._special_sig_key
SECRET_MARK = rpc._special_secret_sig
SECRET_SHOWN = "[secret]"
UNKNOWN_SHOWN = "[unknown]"

# Awaits everything a program registers and applies before returning (the SDK leaves it untyped).
_awaited: Callable[[Callable[[], Any]], Callable[[], None]] = pulumi.runtime.test


@dataclass(frozen=True)
class Registration:
    urn: str
    type: str
    name: str
    parent: str
    custom: bool
    inputs: dict[str, Any]  # as serialized for the engine: secrets still wrapped
    ignore_changes: tuple[str, ...]
    provider: str  # the provider reference, "" for the default provider
    delete_before_replace: bool = False
    dependencies: tuple[str, ...] = ()  # the URNs it waits for: depends_on and its inputs'
    # customTimeouts: "create", "update", "delete" as the engine gets them ("600s"), where set.
    custom_timeouts: dict[str, str] = field(default_factory=dict)


def _address(name: str) -> str:
    """A stable public address per resource name, so outputs never depend on order."""
    digest = hashlib.sha256(name.encode()).digest()
    return f"198.18.{digest[0]}.{digest[1] % 250 + 1}"


class RecordingMocks(pulumi.runtime.Mocks):
    def __init__(
        self,
        hcloud_keys: Sequence[Mapping[str, Any]] = (),
        kept_outputs: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
    ) -> None:
        self.invokes: list[tuple[str, dict[str, Any]]] = []
        # The SSH keys the Hetzner Cloud project holds (none, offline), as getSshKeys lists them.
        self.hcloud_keys = [dict(key) for key in hcloud_keys]
        # (type, name) -> the outputs of the resource's state, kept as the engine keeps them
        # where the provider's diff finds no change.
        self.kept_outputs = dict(kept_outputs or {})

    def new_resource(
        self, args: pulumi.runtime.MockResourceArgs
    ) -> tuple[str | None, dict[Any, Any]]:
        state = dict(args.inputs)
        if not args.custom:
            return "", {}
        kept = self.kept_outputs.get((args.typ, args.name))
        if kept is not None:
            return f"{args.name}-id", dict(kept)
        if args.typ.startswith("hcloud:"):
            # hcloud ids are integers in many arguments (firewall_ids, ssh_keys): numeric ones.
            if args.typ == "hcloud:index/server:Server":
                state["ipv4Address"] = _address(args.name)
            return str(int(hashlib.sha256(args.name.encode()).hexdigest()[:6], 16)), state
        if args.typ == "aws:ec2/instance:Instance":
            state |= {"publicIp": _address(args.name), "availabilityZone": "us-east-1a"}
        if args.typ == "aws:ec2/eip:Eip":
            state["publicIp"] = _address(args.name)
        if args.typ == "aws:ec2/keyPair:KeyPair":
            state["keyName"] = args.name
        if (
            args.typ == "kubernetes:core/v1:Service"
            and state.get("spec", {}).get("type") == "LoadBalancer"
        ):
            state["status"] = {"loadBalancer": {"ingress": [{"ip": _address(args.name)}]}}
        if args.typ == "pulumi-python:dynamic/lambda:Instance":
            state["ip"] = _address(args.name)
        if args.typ == "pulumi-python:dynamic/denv:WireGuardKey":
            # A stand-in public key, stable per name; the private key's slot stays a secret.
            digest = hashlib.sha256(args.name.encode()).digest()
            state["public_key"] = base64.b64encode(digest).decode()
        if args.typ == "pulumi-python:dynamic/denv:GatewayTls":
            # Stand-ins that name what they stand for; the keys' slots stay secrets.
            state["ca_certificate"] = f"(the gateway CA of {args.name})"
            state["client_pem"] = "(the balancer's client certificate and key)"
            state["gateway_pems"] = {
                site: f"(the gateway certificate and key of {site})"
                for site in state.get("sites") or ()
            }
        if args.typ == "nebius:index/computeV1Instance:ComputeV1Instance":
            # Nebius reports an interface's public address with its prefix length.
            public = {"address": f"{_address(args.name)}/32"}
            state["status"] = {"networkInterfaces": [{"publicIpAddress": public}]}
        return f"{args.name}-id", state

    def call(
        self, args: pulumi.runtime.MockCallArgs
    ) -> tuple[dict[Any, Any], list[tuple[str, str]]]:
        self.invokes.append((args.token, dict(args.args)))
        if args.token == "aws:ssm/getParameter:getParameter":
            name = args.args["name"]
            return {
                "id": name,
                "name": name,
                "type": "String",
                "value": AMI_ID,
                "insecureValue": AMI_ID,
                "version": 1,
                "arn": f"arn:{name}",
            }, []
        if args.token == "aws:ec2/getSubnet:getSubnet":
            return {"id": args.args["id"], "vpcId": "vpc-0example"}, []
        if args.token == "hcloud:index/getSshKeys:getSshKeys":
            return {"id": "ssh-keys", "sshKeys": self.hcloud_keys}, []
        if args.token == "nebius:index/getVpcV1Subnet:getVpcV1Subnet":
            return {"id": args.args["id"], "networkId": "vpcnetwork-e00example"}, []
        # An unanswered invoke would silently yield None and a wrong graph: refuse it.
        raise RuntimeError(f"unmocked invoke {args.token}({args.args})")


class RecordingMonitor(pulumi.runtime.mocks.MockMonitor):
    """Sees each registration request whole: parent, options, and duplicate URNs."""

    def __init__(self, mocks: RecordingMocks) -> None:
        super().__init__(mocks)
        self.registrations: list[Registration] = []
        self._urns: set[str] = set()  # a set: a large stack must not cost a scan per resource

    def RegisterResource(self, request: Any) -> Any:
        urn = self.make_urn(request.parent, request.type, request.name)
        if request.type != "pulumi:pulumi:Stack":
            # The stock mock accepts a duplicate URN; the real engine refuses the whole update.
            if urn in self._urns:
                raise RuntimeError(f"duplicate URN {urn}")
            self._urns.add(urn)
            self.registrations.append(
                Registration(
                    urn,
                    request.type,
                    request.name,
                    request.parent,
                    bool(request.custom),
                    json_format.MessageToDict(request.object),
                    tuple(request.ignoreChanges),
                    request.provider,
                    bool(request.deleteBeforeReplace),
                    tuple(request.dependencies),
                    json_format.MessageToDict(request.customTimeouts),
                )
            )
        return super().RegisterResource(request)  # type: ignore[no-untyped-call]


@dataclass
class Run:
    """What one program run registered and invoked, and the Outputs it returned."""

    registrations: list[Registration] = field(default_factory=list)
    invokes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    def of_type(self, type_: str) -> list[Registration]:
        return [r for r in self.registrations if r.type == type_]

    def named(self, name: str) -> Registration:
        return next(r for r in self.registrations if r.name == name)

    def by_urn(self) -> dict[str, dict[str, Any]]:
        return {r.urn: r.inputs for r in self.registrations}


def _ensure_event_loop() -> None:
    """Pulumi's mocks run on the thread's current event loop. An `asyncio.run` earlier in the
    process (a team's own code, a test) leaves the thread without one, so one is made."""
    try:
        loop = asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        loop = None
    if loop is None or loop.is_closed():
        asyncio.set_event_loop(asyncio.new_event_loop())


def run_program(
    program: Callable[[], dict[str, pulumi.Output[Any]]],
    *,
    preview: bool,
    run: Run | None = None,
    hcloud_keys: Sequence[Mapping[str, Any]] = (),
    kept_outputs: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
) -> Run:
    """Run `program` under fresh mocks; its returned Outputs are resolved into `outputs`.

    Pass `run` to keep what was registered when the program raises, and `hcloud_keys` for the
    SSH keys the Hetzner Cloud project holds already (fingerprint, id, labels, name, publicKey),
    and `kept_outputs` for resources, by (type, name), whose state keeps its outputs: those the
    engine does not update, since their provider's diff finds no change.
    """
    run = run or Run()
    _ensure_event_loop()
    mocks = RecordingMocks(hcloud_keys, kept_outputs)
    monitor = RecordingMonitor(mocks)
    monitor.registrations = run.registrations
    mocks.invokes = run.invokes
    pulumi.runtime.set_mocks(mocks, preview=preview, monitor=monitor)

    @_awaited
    def scenario() -> pulumi.Output[Any]:
        outputs = program()
        names = sorted(outputs)
        return pulumi.Output.all(*(outputs[n] for n in names)).apply(
            lambda values: run.outputs.update(zip(names, values, strict=True))
        )

    scenario()
    return run


@dataclass(frozen=True)
class PreviewResource:
    """One registered resource as a person reads it: secrets masked, unknowns marked."""

    type: str
    name: str
    parent: str  # the parent's name, "" for a resource directly under the stack
    inputs: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "name": self.name, "parent": self.parent, "inputs": self.inputs}


def shown(value: Any) -> Any:
    """Serialized inputs with every secret replaced by `[secret]`, never its plaintext."""
    if isinstance(value, Mapping):
        if value.get(SECRET_SIG) == SECRET_MARK:
            return SECRET_SHOWN
        return {str(k): shown(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shown(item) for item in value]
    if value == rpc.UNKNOWN:
        return UNKNOWN_SHOWN  # known only once the resource exists
    return value


def offline_secrets(value: Any) -> Any:
    """Stack config whose `{secure: ...}` values are unknown secrets.

    A stack file holds ciphertext that only the Pulumi CLI can decrypt. An unknown secret is
    what a preview sees before it has the value: everything derived from it stays unknown and
    masked, and nothing tries to read ciphertext as a key.
    """
    if isinstance(value, Mapping):
        if set(value) == {"secure"}:
            return {"secure": pulumi.Output.secret(pulumi.output.UNKNOWN)}
        return {k: offline_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [offline_secrets(item) for item in value]
    return value


def preview_cluster(name: str, args: Callable[[], ClusterArgs]) -> list[PreviewResource]:
    """Every resource one `Cluster` registers at preview, in registration order.

    `args` is called under the mocks, so it may build Outputs. A bad stack raises `StackError`.
    """
    run = run_program(lambda: {"endpoint": Cluster(name, args()).endpoint}, preview=True)
    names = {r.urn: r.name for r in run.registrations}
    return [
        PreviewResource(r.type, r.name, names.get(r.parent, ""), shown(r.inputs))
        for r in run.registrations
    ]


def preview_stack(
    stack: StackSpec, config: Mapping[str, Any], previous: Sequence[str] = ()
) -> list[PreviewResource]:
    """The resource graph of a stack file's config, as `stacks/__main__.py` would register it."""

    def args() -> ClusterArgs:
        offline = offline_secrets(config)
        return {
            "sites": offline["denv:sites"],
            "recipes": offline["denv:recipes"],
            "balancer": offline["denv:balancer"],
            "previous": list(previous),
        }

    return preview_cluster(stack.name, args)
