"""`denv node`: join, repair, drain and undrain GPU nodes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click

from denv_iac.cli.console import StepProgress, fail
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
        "--admin",
        "admins",
        multiple=True,
        help="Address or CIDR that may reach SSH (repeatable; none: SSH is left open).",
    )(func)
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
    admins: tuple[str, ...],
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
                admin_cidrs=admins,
            )
    except NodeSpecError as error:
        fail(error.problems)
    return spec


def _output_options(func: F) -> F:
    func = click.option(
        "--json", "as_json", is_flag=True, help="Print the result as JSON on stdout, no progress."
    )(func)
    return click.option("--quiet", is_flag=True, help="No progress: only the result line.")(func)


def _step_progress(bar: StepProgress) -> Callable[[int, int, Step, str], None]:
    def show(index: int, total: int, step: Step, status: str) -> None:
        label = f"{step.area}: {step.title}"
        if status == "run":
            bar.started(index, total, label)
        else:
            bar.finished(index, total, label, status)

    return show


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
@_output_options
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
    admins: tuple[str, ...],
    dry: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Prepare HOST: driver, runtime, MIG layout, agent, replica units and firewall."""
    target = _target(host, user, key, port, sudo)
    spec = _spec(spec_file, node_id, site, host, branch, balancers, admins)
    ssh_port = target.inventory()[1].get("ssh_port")
    try:
        if ssh_port is not None:  # the port this join reaches sshd on: the one admin_cidrs guard
            spec = dataclasses.replace(spec, ssh_port=ssh_port)
        with StepProgress(f"joining {host}", quiet=quiet or as_json) as bar:
            steps = prepare_node(target, spec, dry=dry, progress=_step_progress(bar))
    except (UnsupportedNode, MigLayoutError) as error:
        fail([f"{host}: {error}"])
    except NodeSpecError as error:  # the spec would shut this deploy out (its admin_cidrs)
        fail([f"{host}: {problem}" for problem in error.problems])
    except (NodeUnreachable, StepFailed) as error:
        fail([str(error)], code=1)
    if as_json:
        document = {
            "host": host,
            "dry": dry,
            "steps": [{"area": s.area, "title": s.title, "lines": s.describe()} for s in steps],
        }
        click.echo(json.dumps(document, indent=2))
    elif dry:
        _print_plan(steps)
    else:
        click.echo(f"{host}: {len(steps)} change(s) applied" if steps else f"{host}: up to date")


@node.command()
@_connection_options
@click.option("--level", type=click.Choice([lvl.value for lvl in RepairLevel]), required=True)
@click.option("--site", default="joined", show_default=True, help="Site, for a spec from flags.")
@_spec_options
@_output_options
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
    admins: tuple[str, ...],
    quiet: bool,
    as_json: bool,
) -> None:
    """Drain HOST, repair its GPUs at LEVEL, verify through NVML, undrain (stays drained if not)."""
    target = _target(host, user, key, port, sudo)
    spec = _spec(spec_file, node_id, site, host, branch, balancers, admins)
    try:
        with StepProgress(f"repairing {host} ({level})", quiet=quiet or as_json) as bar:
            done: list[StepReport] = []

            def show(step: StepReport) -> None:
                done.append(step)
                detail = f": {step.detail.splitlines()[-1]}" if step.detail else ""
                took = f" ({step.seconds:.0f} s)" if step.seconds >= 1 else ""
                bar.finished(len(done), None, step.name, f"{step.status}{took}{detail}")

            result = repair_node(target, spec, RepairLevel(level), report=show)
    except RepairRefused as error:
        fail([str(error)])
    except NodeUnreachable as error:
        fail([str(error)], code=1)
    if as_json:
        document = {
            "host": host,
            "level": level,
            "ok": result.ok,
            "drained": result.drained,
            "steps": [asdict(step) for step in result.steps],
        }
        click.echo(json.dumps(document, indent=2))
        if not result.ok:
            raise SystemExit(1)
        return
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
