"""Pulumi's mock engine, recording every registration as the engine would receive it."""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi
from google.protobuf import json_format
from pulumi.runtime import rpc

from denv_iac.components import Cluster

AMI_ID = "ami-0123456789abcdef0"
SECRET_SIG = rpc._special_sig_key
SECRET_MARK = rpc._special_secret_sig


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


def _address(name: str) -> str:
    """A stable public address per resource name, so outputs never depend on order."""
    digest = hashlib.sha256(name.encode()).digest()
    return f"198.18.{digest[0]}.{digest[1] % 250 + 1}"


class RecordingMocks(pulumi.runtime.Mocks):
    def __init__(self) -> None:
        self.invokes: list[tuple[str, dict[str, Any]]] = []

    def new_resource(
        self, args: pulumi.runtime.MockResourceArgs
    ) -> tuple[str | None, dict[Any, Any]]:
        state = dict(args.inputs)
        if not args.custom:
            return "", {}
        if args.typ.startswith("hcloud:"):
            # hcloud ids are integers in many arguments (firewall_ids, ssh_keys): numeric ones.
            if args.typ == "hcloud:index/server:Server":
                state["ipv4Address"] = _address(args.name)
            return str(int(hashlib.sha256(args.name.encode()).hexdigest()[:6], 16)), state
        if args.typ == "aws:ec2/instance:Instance":
            state |= {"publicIp": _address(args.name), "availabilityZone": "us-east-1a"}
        if args.typ == "aws:ec2/keyPair:KeyPair":
            state["keyName"] = args.name
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
        raise AssertionError(f"unmocked invoke {args.token}({args.args})")


class RecordingMonitor(pulumi.runtime.mocks.MockMonitor):
    """Sees each registration request whole: parent, options, and duplicate URNs."""

    def __init__(self, mocks: RecordingMocks) -> None:
        super().__init__(mocks)
        self.registrations: list[Registration] = []

    def RegisterResource(self, request: Any) -> Any:
        urn = self.make_urn(request.parent, request.type, request.name)
        if request.type != "pulumi:pulumi:Stack":
            if any(r.urn == urn for r in self.registrations):
                raise AssertionError(f"duplicate URN {urn}")
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
                )
            )
        return super().RegisterResource(request)


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


def run_program(
    program: Callable[[], dict[str, pulumi.Output[Any]]], *, preview: bool, run: Run | None = None
) -> Run:
    """Run `program` under fresh mocks; its returned Outputs are resolved into `outputs`.

    Pass `run` to keep what was registered when the program raises.
    """
    run = run or Run()
    mocks = RecordingMocks()
    monitor = RecordingMonitor(mocks)
    monitor.registrations = run.registrations
    mocks.invokes = run.invokes
    pulumi.runtime.set_mocks(mocks, preview=preview, monitor=monitor)

    @pulumi.runtime.test
    def scenario() -> pulumi.Output[Any]:
        outputs = program()
        names = sorted(outputs)
        return pulumi.Output.all(*(outputs[n] for n in names)).apply(
            lambda values: run.outputs.update(zip(names, values, strict=True))
        )

    scenario()
    return run


def plain_strings(value: Any) -> list[str]:
    """Every string in serialized inputs, leaving out the insides of secret values."""
    if isinstance(value, dict):
        if value.get(SECRET_SIG) == SECRET_MARK:
            return []
        return [s for k, v in value.items() for s in [str(k), *plain_strings(v)]]
    if isinstance(value, list):
        return [s for item in value for s in plain_strings(item)]
    return [value] if isinstance(value, str) else []


def cluster_outputs(args: Any, name: str = "prod") -> dict[str, Any]:
    """A program building one Cluster; its outputs are what the tests read."""
    cluster = Cluster(name, args)
    return {
        "balancer_addresses": cluster.balancer_addresses,
        "endpoint": cluster.endpoint,
        "haproxy_config": cluster.haproxy_config,
        "replica_ids": cluster.replica_ids,
    }
