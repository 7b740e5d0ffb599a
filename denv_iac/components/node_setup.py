"""NodeSetup: the node deploy of `denv_iac.node`, run over SSH on one machine, as a resource.

A `pulumi.dynamic` resource does the work. Create and update converge a GPU node (driver, MIG
layout, runtime, agent, replica units, host firewall) or a balancer host (HAProxy config and
maps, checked, then reloaded) and report the steps they applied; delete stops a node's replicas
and leaves its driver. Under Pulumi's unit-test mocks the provider is never called.
"""

import dataclasses
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import pulumi
import pulumi.dynamic

from denv_iac.components.dynamic_resource import DynamicResource, whole_numbers
from denv_iac.components.naming import child_name
from denv_iac.components.secrets import public_key_of
from denv_iac.core.balancer import RenderedConfig
from denv_iac.core.overlay_plan import with_private_key
from denv_iac.core.stack.model import WIREGUARD_PORT
from denv_iac.node import (
    NodeDeploySpec,
    Step,
    Target,
    prepare_balancer,
    prepare_node,
    spec_from_json,
)
from denv_iac.node.balancer_host import GatewayCredentials
from denv_iac.node.deploy import (
    SSH_WAIT_S,
    CannotConnect,
    NodeUnreachable,
    connect,
    quiet_progress,
)
from denv_iac.node.firewall import BalancerAccess
from denv_iac.node.plan import fact_query, removal_steps
from denv_iac.node.spec import spec_to_json
from denv_iac.node.ssh_keys import SshKeys

# A change of these re-runs the deploy in place; another host is another machine.
UPDATE_ON = (
    "ssh_user",
    "ssh_private_key",
    "node",
    "balancer_addresses",
    "cache_device",
    "balancer",
    "secret_env",
    "balancer_firewall",
    "tls_certificate",
    "gateway_tls",
    "client_secret_key",
    "overlay_config",
    "overlay_private_key",
    "overlay_senders",
    "overlay_port",
)
REPLACE_ON = ("host",)
# Kept in the state for `delete` alone: no reason to re-run a deploy.
KEPT = ("deleted_by",)
# Node ids, comma- or space-separated: nodes whose removal in this `pulumi up` (or `destroy`)
# may forget a machine it cannot reach, as the user says (see docs/node.md).
FORGET_ENV = "DENV_FORGET_NODES"


def deploy_node(
    target: Target, spec: NodeDeploySpec, overlay_config: str | None, keys: SshKeys | None
) -> list[Step]:
    """The node deploy, with the node's overlay config (its private key filled in) if any, and
    the SSH login's keys to keep; a machine the same `up` just created is waited for."""
    return prepare_node(
        target, spec, overlay_config=overlay_config, keys=keys, ssh_wait_s=SSH_WAIT_S
    )


def deploy_balancer(
    target: Target,
    rendered: RenderedConfig,
    access: BalancerAccess,
    certificate: str | None,
    gateway: GatewayCredentials | None,
    client_secret_key: str | None,
    overlay_config: str | None,
    keys: SshKeys | None,
) -> list[Step]:
    """The balancer host's deploy, with its overlay config (private key filled in) if any, and
    the SSH login's keys to keep; a machine the same `up` just created is waited for."""
    return prepare_balancer(
        target,
        rendered,
        access,
        certificate,
        gateway,
        overlay_config=overlay_config,
        keys=keys,
        client_secret_key=client_secret_key,
        ssh_wait_s=SSH_WAIT_S,
    )


def forget_named() -> frozenset[str]:
    """The node ids the user allows this run to forget unreached (FORGET_ENV)."""
    return frozenset(re.split(r"[\s,]+", os.environ.get(FORGET_ENV, "").strip())) - {""}


def node_forgotten_warning(node: str, error: NodeUnreachable, deleted_by: str) -> str:
    """Why a node that cannot be reached leaves the state: its provider deletes the machine
    (`deleted_by`), or the user said to forget it."""
    if deleted_by:
        why = f"its {deleted_by} machine is deleted by its provider in this same update"
    else:
        why = f"{FORGET_ENV} names it; if its machine still runs, stop its denv-replica units"
    return f"node {node}: {error}; forgotten: {why}"


def node_kept_error(node: str, error: NodeUnreachable) -> NodeUnreachable:
    """The one line that keeps an unreached node in the state: what happened and the fix."""
    if error.answered:
        happened = "no sign that the machine is gone"
        fix = "fix the SSH access from here (key, host key, network)"
    else:
        happened = "nothing answers, and no provider deletes this machine: its replicas may run on"
        fix = "let this machine reach its SSH port (admin_cidrs, its network)"
    return NodeUnreachable(
        f"node {node}: {error}; {happened}; {fix} and run again, or run with "
        f"{FORGET_ENV}={node} to forget it",
        error.answered,
    )


def stop_replicas(target: Target, spec: NodeDeploySpec) -> list[Step]:
    """Stop and remove every replica unit and the MIG boot unit; driver, runtime, agent stay."""
    with connect(target) as session:
        facts = session.facts(fact_query(spec))
        steps = removal_steps(facts, spec)
        session.apply(steps, quiet_progress)
        return steps


@dataclasses.dataclass(frozen=True)
class DeployRunner:
    """How the provider reaches machines: the real deploys, or a test's stand-ins."""

    node: Callable[[Target, NodeDeploySpec, str | None, SshKeys | None], list[Step]] = deploy_node
    balancer: Callable[
        [
            Target,
            RenderedConfig,
            BalancerAccess,
            str | None,
            GatewayCredentials | None,
            str | None,
            str | None,
            SshKeys | None,
        ],
        list[Step],
    ] = deploy_balancer
    stop: Callable[[Target, NodeDeploySpec], list[Step]] = stop_replicas


@contextmanager
def ssh_target(props: Mapping[str, Any], key: str | None = None) -> Iterator[Target]:
    """The machine as a deploy target, its key (the state's, unless `key` is given) in a 0600
    file that lives only this long."""
    user = str(props["ssh_user"])
    if key is None:
        key = str(props.get("ssh_private_key") or "")
    with tempfile.TemporaryDirectory(prefix="denv-ssh-") as folder:
        path = None
        if key:
            path = Path(folder) / "key"
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(key if key.endswith("\n") else key + "\n")
        yield Target(host=str(props["host"]), user=user, key=path, sudo=user != "root")


def login_keys(news: Mapping[str, Any], olds: Mapping[str, Any] | None) -> list[str]:
    """The private keys to log in with, in order: the stack's, then the one it rotated away
    from, which the machine still accepts until a deploy has put the new one there."""
    current = str(news.get("ssh_private_key") or "")
    previous = str((olds or {}).get("ssh_private_key") or "")
    return [current] + ([previous] if previous and previous != current else [])


def ssh_keys(news: Mapping[str, Any], olds: Mapping[str, Any] | None) -> SshKeys | None:
    """The login's keys to keep: the stack's public key, the one it replaces retired.

    None without a key of the stack's own (a joined machine reached through the SSH agent).
    """
    current, *previous = login_keys(news, olds)
    if not current:
        return None
    try:
        retired = tuple(public_key_of(key) for key in previous)
        return SshKeys(str(news["ssh_user"]), public_key_of(current), retired)
    except ValueError:  # refused with one line when the stack is read; nothing to keep here
        return None


def _rendered(props: Mapping[str, Any]) -> RenderedConfig:
    balancer = props["balancer"]
    return RenderedConfig(
        str(balancer["haproxy_config"]),
        {str(k): str(v) for k, v in balancer["map_files"].items()},
        str(balancer["map_dir"]),
    )


def _balancer_access(props: Mapping[str, Any]) -> BalancerAccess:
    given = whole_numbers(props.get("balancer_firewall") or {})
    access = BalancerAccess(tuple(given.get("admin_cidrs", ())), given.get("stats_port", 0))
    if not props.get("overlay_config"):
        return access
    senders = tuple(sorted(str(a) for a in props.get("overlay_senders") or ()))
    port = int(whole_numbers(props["overlay_port"]))
    return dataclasses.replace(access, overlay_port=port, overlay_senders=senders)


def _gateway_credentials(props: Mapping[str, Any]) -> GatewayCredentials | None:
    given = props.get("gateway_tls")
    return GatewayCredentials(str(given["ca"]), str(given["client"])) if given else None


def _overlay_config(props: Mapping[str, Any]) -> str | None:
    """The machine's overlay config as written to it: the private key (a secret) filled in
    here, on its way to the 0600 file, and nowhere else; None when it is not on the overlay."""
    config = props.get("overlay_config")
    if not config:
        return None
    return with_private_key(str(config), str(props.get("overlay_private_key") or ""))


def _node_spec(props: Mapping[str, Any]) -> NodeDeploySpec:
    node = {**whole_numbers(props["node"])}
    # Secret env values join each replica's env only here, on their way to its 0600 env file.
    secret_env = props.get("secret_env") or {}
    node["replicas"] = [
        {**r, "env": {**r.get("env", {}), **secret_env.get(r["id"], {})}}
        for r in node.get("replicas", ())
    ]
    node["balancer_addresses"] = sorted(str(a) for a in props.get("balancer_addresses") or ())
    if node.get("listen_address"):
        node["overlay_senders"] = sorted(str(a) for a in props.get("overlay_senders") or ())
    if props.get("cache_device"):  # the site's volume, known once it exists; else the spec's own
        node["cache_volume"] = {"device": props["cache_device"]}
    return spec_from_json(node)


class NodeSetupProvider(pulumi.dynamic.ResourceProvider):
    """Create/update run the deploy; delete stops a node's replicas."""

    def __init__(self, runner: DeployRunner | None = None) -> None:
        super().__init__()
        self.runner = runner or DeployRunner()

    def _deploy(self, target: Target, props: Mapping[str, Any], keys: SshKeys | None) -> list[Step]:
        if props.get("node") is not None:
            return self.runner.node(target, _node_spec(props), _overlay_config(props), keys)
        return self.runner.balancer(
            target,
            _rendered(props),
            _balancer_access(props),
            props.get("tls_certificate") or None,
            _gateway_credentials(props),
            props.get("client_secret_key") or None,
            _overlay_config(props),
            keys,
        )

    def _converge(
        self, props: Mapping[str, Any], olds: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Run the deploy; after a key rotation, logged in with the old key if the machine
        does not take the new one yet (the deploy then puts the new one there)."""
        keys = ssh_keys(props, olds)
        logins = login_keys(props, olds)
        for index, login in enumerate(logins):
            try:
                with ssh_target(props, login) as target:
                    steps = self._deploy(target, props, keys)
                break
            except CannotConnect as error:  # refused before anything ran: another key may get in
                # ...but not where nothing answers at all, which the deploy waited for already.
                if index == len(logins) - 1 or not error.answered:
                    raise
        outs = {key: props[key] for key in (*REPLACE_ON, *UPDATE_ON, *KEPT) if key in props}
        return outs | {"applied": [f"{s.area}: {s.title}" for s in steps]}

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        name = props["node"]["node_id"] if props.get("node") else f"balancer.{props['host']}"
        return pulumi.dynamic.CreateResult(id_=str(name), outs=self._converge(props))

    def diff(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.DiffResult:
        changed = [key for key in (*REPLACE_ON, *UPDATE_ON) if olds.get(key) != news.get(key)]
        replaces = [key for key in changed if key in REPLACE_ON]
        return pulumi.dynamic.DiffResult(
            changes=bool(changed), replaces=replaces, delete_before_replace=False
        )

    def update(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(outs=self._converge(news, olds))

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        """Stop a node's replicas. A node that cannot be reached leaves the state only where
        its machine goes with it (a cloud's, deleted by its provider in the same update, when
        nothing answers there) or where the user named it in FORGET_ENV; otherwise one line
        says what happened and how to go on, and the node stays."""
        # A balancer host goes with its BalancerHost, or keeps serving as a joined machine.
        if props.get("node") is None:
            return
        deleted_by = str(props.get("deleted_by") or "")
        with ssh_target(props) as target:
            try:
                self.runner.stop(target, _node_spec(props))
            except NodeUnreachable as error:
                # Raising keeps the node in the state, and every later `up` fails on it until
                # the machine answers or the user says to forget it. A joined or Hetzner box is
                # deleted by no provider: silence there (a timeout, a firewall dropping SSH) may
                # be a live machine whose replicas still serve. An SSH server that answers but
                # refuses the key or shows another host key is a live machine whose access
                # changed (a rotated key, a reinstall, someone in the middle), wherever it is.
                if id_ in forget_named():
                    pulumi.log.warn(node_forgotten_warning(id_, error, ""))
                elif deleted_by and not error.answered:
                    pulumi.log.warn(node_forgotten_warning(id_, error, deleted_by))
                else:
                    raise node_kept_error(id_, error) from None


class NodeDeployment(DynamicResource, module="denv", name="NodeDeployment"):
    """The dynamic resource behind a NodeSetup: its state is the deploy's inputs."""

    applied: pulumi.Output[list[str]]

    def __init__(
        self,
        name: str,
        props: dict[str, Any],
        opts: pulumi.ResourceOptions,
        provider: NodeSetupProvider | None = None,
    ) -> None:
        super().__init__(provider or NodeSetupProvider(), name, {**props, "applied": None}, opts)


class BalancerFiles(TypedDict):
    haproxy_config: str
    map_files: Mapping[str, str]  # by file name
    map_dir: str  # where haproxy_config reads them


class GatewayTlsFiles(TypedDict):
    ca: str  # the stack's gateway CA certificate
    client: str  # the balancer's client certificate and key, one PEM


class BalancerFirewall(TypedDict):
    admin_cidrs: Sequence[str]  # who may reach SSH and the stats port; none: left as they are
    stats_port: int  # HAProxy's stats and metrics port


class NodeSetupArgs(TypedDict):
    host: pulumi.Input[str]  # the machine's SSH address
    ssh_user: str  # root, or a user that may sudo
    ssh_private_key: pulumi.Input[str]  # kept a secret end to end
    node: NotRequired[NodeDeploySpec]  # a GPU node: what it runs
    balancer_addresses: NotRequired[pulumi.Input[Sequence[str]]]  # who may reach its replicas
    # The node's own cache volume, a block device, mounted where `node` keeps caches ("": the
    # spec's own `cache_volume`, if any).
    cache_device: NotRequired[pulumi.Input[str]]
    balancer: NotRequired[pulumi.Input[BalancerFiles]]  # a balancer host: what HAProxy serves
    balancer_firewall: NotRequired[BalancerFirewall]  # a balancer host: who administers it
    # A balancer host: the endpoint's certificate and key as one PEM, kept a secret end to end.
    tls_certificate: NotRequired[pulumi.Input[str]]
    # A balancer host that reaches Kubernetes gateways: the stack's gateway CA and its client
    # certificate and key, kept a secret end to end.
    gateway_tls: NotRequired[pulumi.Input[GatewayTlsFiles]]
    # A balancer host with realtime client secrets: the key that signs them, a secret end to end.
    client_secret_key: NotRequired[pulumi.Input[str]]
    # A recipe's `secure:` env values, by replica id then variable: kept secrets end to end.
    secret_env: NotRequired[Mapping[str, Mapping[str, pulumi.Input[str]]]]
    # A machine on the overlay: its wg-quick config, the private key a placeholder (plain), and
    # the private key (kept a secret end to end, filled in only where the file is written).
    overlay_config: NotRequired[pulumi.Input[str]]
    overlay_private_key: NotRequired[pulumi.Input[str]]
    # On the overlay: the public addresses its WireGuard port admits (its peers'), and, on a
    # balancer host, that port (a node's is in its spec).
    overlay_senders: NotRequired[pulumi.Input[Sequence[str]]]
    overlay_port: NotRequired[int]
    # A node whose machine its site's provider deletes when the node leaves the stack ("aws",
    # "lambda", "nebius"): its removal forgets the deploy where nothing answers any more.
    # Left out (a joined or Hetzner machine, which nothing deletes), a removal that cannot reach
    # the machine fails, unless the node is named in DENV_FORGET_NODES.
    deleted_by: NotRequired[str]


class NodeSetup(pulumi.ComponentResource):
    """The node deploy run on one GPU node or balancer host, re-run when what it runs changes."""

    deployment: NodeDeployment
    """The dynamic resource that runs the deploy: what another node's deploy waits on."""

    applied: pulumi.Output[list[str]]
    """The steps the last deploy applied; empty when the machine already was as asked."""

    def __init__(
        self,
        name: str,
        args: NodeSetupArgs,
        opts: pulumi.ResourceOptions | None = None,
        waits_on: Sequence[pulumi.Resource] = (),
    ) -> None:
        """`waits_on`: what must exist, or have ended its update, before the deploy starts
        (a firewall on the node's path; the pool's previous rollout units, so that a rollout
        goes one place at a time, denv_iac.core.rollout.rollout_after). The engine waits on them for
        create and update. A component's own `depends_on` does not reach its children."""
        if ("node" in args) == ("balancer" in args):
            raise ValueError(f"NodeSetup {name}: give either node or balancer")
        super().__init__("denv:index:NodeSetup", name, None, opts)
        props: dict[str, Any] = {
            "host": args["host"],
            "ssh_user": args["ssh_user"],
            "ssh_private_key": pulumi.Output.secret(args["ssh_private_key"]),
        }
        if "node" in args:
            # Given on their own: known only once the machines exist.
            spec = spec_to_json(args["node"])
            given = ("balancer_addresses", "overlay_senders")
            props["node"] = {k: v for k, v in spec.items() if k not in given}
            props["balancer_addresses"] = pulumi.Output.from_input(
                args.get("balancer_addresses", [])
            ).apply(sorted)
            if "cache_device" in args:
                props["cache_device"] = args["cache_device"]
            if "secret_env" in args:
                props["secret_env"] = pulumi.Output.secret(args["secret_env"])
            if "deleted_by" in args:
                props["deleted_by"] = args["deleted_by"]
        else:
            props["balancer"] = args["balancer"]
            firewall = args.get("balancer_firewall")
            # Added after the first release: left out without admin_cidrs, so the state of a
            # stack without them stays as it was and its next preview shows no change.
            if firewall is not None and firewall["admin_cidrs"]:
                props["balancer_firewall"] = {
                    "admin_cidrs": sorted(firewall["admin_cidrs"]),
                    "stats_port": firewall["stats_port"],
                }
            if "tls_certificate" in args:
                props["tls_certificate"] = pulumi.Output.secret(args["tls_certificate"])
            if "gateway_tls" in args:
                props["gateway_tls"] = pulumi.Output.secret(args["gateway_tls"])
            if "client_secret_key" in args:
                props["client_secret_key"] = pulumi.Output.secret(args["client_secret_key"])
        if ("overlay_config" in args) != ("overlay_private_key" in args):
            raise ValueError(f"NodeSetup {name}: give overlay_config with overlay_private_key")
        if "overlay_config" in args:
            props["overlay_config"] = args["overlay_config"]
            props["overlay_private_key"] = pulumi.Output.secret(args["overlay_private_key"])
            senders = pulumi.Output.from_input(args.get("overlay_senders", []))
            props["overlay_senders"] = senders.apply(sorted)
            if "balancer" in args:  # a node's port is in its spec
                props["overlay_port"] = args.get("overlay_port", WIREGUARD_PORT)
        deployment = NodeDeployment(
            child_name(name, "deploy"),
            props,
            # Delete gets only the state, so the key stays there, as a secret (the env and the
            # certificate too).
            pulumi.ResourceOptions(
                parent=self,
                depends_on=list(waits_on),
                additional_secret_outputs=[
                    "ssh_private_key",
                    "secret_env",
                    "tls_certificate",
                    "gateway_tls",
                    "client_secret_key",
                    "overlay_private_key",
                ],
            ),
        )
        self.deployment = deployment
        self.applied = deployment.applied
        self.register_outputs({"applied": self.applied})
