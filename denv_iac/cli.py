"""The `denv` command."""

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from denv_iac.bench_cli import bench
from denv_iac.console import fail, wide_console
from denv_iac.local.cli import local
from denv_iac.node.cli import node
from denv_iac.plan import make_plan
from denv_iac.plan_view import render_plan, render_resources
from denv_iac.spec.model import StackSpec
from denv_iac.spec.reader import StackError
from denv_iac.spec.stackfile import (
    find_stacks_dir,
    load_lock,
    load_stack,
    load_stack_config,
    write_lock,
)
from denv_iac.status_cli import status

if TYPE_CHECKING:
    from denv_iac.preview import PreviewResource

STACKS_DIR = click.option(
    "--stacks-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder holding Pulumi.<stack>.yaml (default: stacks/ of the project here).",
)


@click.group()
@click.version_option(package_name="denv-iac")
def main() -> None:
    """One cluster, one endpoint, warm GPU replicas across providers."""


@main.command()
@click.option("--stack", "stack_name", required=True, help="Stack name, e.g. local.")
@STACKS_DIR
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Also write the plan as JSON to FILE ('-' for standard output), resources included.",
)
@click.option(
    "--lock",
    is_flag=True,
    help="Write Pulumi.<stack>.placement.json so later edits never move these replicas.",
)
@click.option(
    "--resources",
    "show_resources",
    is_flag=True,
    help="Also show the Pulumi resources the stack registers (a preview under mocks, offline).",
)
def plan(
    stack_name: str,
    stacks_dir: Path | None,
    json_file: str | None,
    lock: bool,
    show_resources: bool,
) -> None:
    """Show where every replica goes, the nodes to create and the warm cost, offline."""
    try:
        folder = stacks_dir or find_stacks_dir()
        stack = load_stack(folder, stack_name)
        previous = load_lock(folder, stack_name)
        result = make_plan(stack, previous)
        resources = (
            _preview(stack, load_stack_config(folder, stack_name), previous)
            if show_resources or json_file
            else None
        )
    except StackError as error:
        fail(error.problems)
    document = result.to_json()
    if resources is not None:
        document["resources"] = [r.to_json() for r in resources]
    if json_file == "-":
        click.echo(json.dumps(document, indent=2))
    else:
        console = wide_console()
        render_plan(result, console)
        if resources is not None:
            render_resources(resources, console)
        if json_file:
            Path(json_file).write_text(json.dumps(document, indent=2) + "\n", "utf-8")
    if lock:
        path = write_lock(folder, stack_name, [r.id for r in result.placement.replicas])
        click.echo(f"wrote {path.name}", err=True)


def _preview(
    stack: StackSpec, config: dict[str, Any], previous: list[str]
) -> "list[PreviewResource]":
    # Imported here: Pulumi and the provider SDKs take seconds to load, a plain plan none.
    from denv_iac.preview import preview_stack

    return preview_stack(stack, config, previous)


@main.group()
def key() -> None:
    """API keys for the endpoint (only their digests go into stack config)."""


@key.command()
def digest() -> None:
    """Read an API key on standard input and print its SHA-256 digest for api_key_digests."""
    secret = sys.stdin.readline().strip()
    if not secret:
        fail(['stdin: no API key given; pipe one in, e.g. `printf %s "$KEY" | denv key digest`'])
    click.echo(hashlib.sha256(secret.encode()).hexdigest())


main.add_command(local)
main.add_command(bench)
main.add_command(node)
main.add_command(status)
