"""`denv node`: join, repair, drain and undrain GPU nodes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from denv_iac.console import fail
from denv_iac.node.deploy import (
    NodeUnreachable,
    StepFailed,
    Target,
    check_target,
    connect,
    prepare_node,
)
from denv_iac.node.driver import UnsupportedNode
from denv_iac.node.mig import MigLayoutError
from denv_iac.node.repair import DRAIN, UNDRAIN, RepairLevel, RepairRefused, StepReport, repair_node
from denv_iac.node.spec import NodeDeploySpec, NodeSpecError, load_spec
from denv_iac.node.steps import Step

F = TypeVar("F", bound=Callable[..., Any])


def _connection_options(func: F) -> F:
    func = click.option("--sudo", is_flag=True, help="Run as root through sudo on the node.")(func)
    func = click.option("--port", type=int, help="SSH port (default 22).")(func)
    func = click.option(
        "--key", type=click.Path(dir_okay=False, path_type=Path), help="SSH private key file."
    )(func)
    func = click.option("--user", help="SSH user (default: your SSH config's).")(func)
    return click.argument("host")(func)


def _spec_options(func: F) -> F:
    func = click.option(
        "--balancer", "balancers", multiple=True, help="Balancer address or CIDR (repeatable)."
    )(func)
    func = click.option("--branch", default="580", show_default=True, help="Driver branch.")(func)
    func = click.option("--node-id", help="Node id (default: SITE.HOST).")(func)
    return click.option(
        "--spec",
        "spec_file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Node spec, JSON (see docs/node.md); without it a minimal one is built from flags.",
    )(func)


def _target(host: str, user: str | None, key: Path | None, port: int | None, sudo: bool) -> Target:
    target = Target(host=host, user=user, key=key, port=port, sudo=sudo)
    problems = check_target(target)
    if problems:
        fail(problems)
    return target


def _spec(
    spec_file: Path | None,
    node_id: str | None,
    site: str,
    host: str,
    branch: str,
    balancers: tuple[str, ...],
) -> NodeDeploySpec:
    try:
        if spec_file is not None:
            spec = load_spec(spec_file)
        else:
            name = host.rsplit("/", 1)[-1].split("@")[-1].split(":")[0].lstrip("@") or "node"
            spec = NodeDeploySpec(
                node_id=node_id or f"{site}.{name}",
                driver_branch=branch,
                balancer_addresses=balancers,
            )
    except NodeSpecError as error:
        fail(error.problems)
    return spec


def _progress(index: int, total: int, step: Step, status: str) -> None:
    if status != "run":
        click.echo(f"[{index}/{total}] {step.area}: {step.title} ... {status}", err=True)


def _print_plan(steps: list[Step]) -> None:
    if not steps:
        click.echo("nothing to change: the node is as the spec asks")
    for step in steps:
        for line in step.describe():
            click.echo(line)


@click.group()
def node() -> None:
    """Join, repair, drain and undrain GPU nodes (pyinfra over SSH, or @local / @chroot/PATH)."""


@node.command()
@_connection_options
@click.option("--site", required=True, help="Site the node belongs to, e.g. hetzner-fsn1.")
@_spec_options
@click.option("--dry", is_flag=True, help="Print the operations; change nothing.")
def join(
    host: str,
    user: str | None,
    key: Path | None,
    port: int | None,
    sudo: bool,
    site: str,
    spec_file: Path | None,
    node_id: str | None,
    branch: str,
    balancers: tuple[str, ...],
    dry: bool,
) -> None:
    """Prepare HOST: driver, runtime, MIG layout, agent, replica units and firewall."""
    target = _target(host, user, key, port, sudo)
    spec = _spec(spec_file, node_id, site, host, branch, balancers)
    try:
        steps = prepare_node(target, spec, dry=dry, progress=_progress)
    except (UnsupportedNode, MigLayoutError) as error:
        fail([f"{host}: {error}"])
    except (NodeUnreachable, StepFailed) as error:
        fail([str(error)], code=1)
    if dry:
        _print_plan(steps)
    else:
        click.echo(f"{host}: {len(steps)} change(s) applied" if steps else f"{host}: up to date")


@node.command()
@_connection_options
@click.option("--level", type=click.Choice([lvl.value for lvl in RepairLevel]), required=True)
@click.option("--site", default="joined", show_default=True, help="Site, for a spec from flags.")
@_spec_options
def repair(
    host: str,
    user: str | None,
    key: Path | None,
    port: int | None,
    sudo: bool,
    level: str,
    site: str,
    spec_file: Path | None,
    node_id: str | None,
    branch: str,
    balancers: tuple[str, ...],
) -> None:
    """Drain HOST, repair its GPUs at LEVEL, verify through NVML, undrain (stays drained if not)."""
    target = _target(host, user, key, port, sudo)
    spec = _spec(spec_file, node_id, site, host, branch, balancers)

    def show(step: StepReport) -> None:
        detail = f": {step.detail.splitlines()[-1]}" if step.detail else ""
        click.echo(f"{step.name} ... {step.status}{detail}", err=True)

    try:
        result = repair_node(target, spec, RepairLevel(level), report=show)
    except RepairRefused as error:
        fail([str(error)])
    except NodeUnreachable as error:
        fail([str(error)], code=1)
    if not result.ok:
        state = "left drained" if result.drained else "not drained"
        fail([f"{host}: repair failed at '{result.steps[-1].name}'; node {state}"], code=1)
    click.echo(f"{host}: repaired ({level}) and back in rotation")


def _agent_command(command: str, done: str) -> Callable[..., None]:
    def run(host: str, user: str | None, key: Path | None, port: int | None, sudo: bool) -> None:
        target = _target(host, user, key, port, sudo)
        try:
            with connect(target) as session:
                ok, output = session.run(command)
        except NodeUnreachable as error:
            fail([str(error)], code=1)
        if not ok:
            fail([f"{host}: `{command}` failed: {output or 'no output'}"], code=1)
        click.echo(f"{host}: {done}")

    return run


node.command(name="drain", help="Stop new requests to HOST's replicas; in-flight ones finish.")(
    _connection_options(_agent_command(DRAIN, "drained"))
)
node.command(name="undrain", help="Put HOST's replicas back into rotation.")(
    _connection_options(_agent_command(UNDRAIN, "back in rotation"))
)
