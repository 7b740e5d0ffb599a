"""`denv plan`: where every replica goes, the nodes to create and the warm cost, offline."""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from denv_iac.cli.console import fail, output_file_problems, wide_console, write_output
from denv_iac.cli.plan_view import render_plan, render_resources
from denv_iac.core.plan import make_plan
from denv_iac.core.stack.exposure import stack_warnings
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.reader import StackError
from denv_iac.stacks_dir import (
    check_lock_writable,
    find_stacks_dir,
    load_lock,
    load_stack,
    load_stack_config,
    write_lock,
)

if TYPE_CHECKING:
    from denv_iac.components.preview import PreviewResource


@click.command()
@click.option("--stack", "stack_name", required=True, help="Stack name, e.g. local.")
@click.option(
    "--stacks-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder holding Pulumi.<stack>.yaml (default: stacks/ of the project here).",
)
@click.option(
    "--json",
    "json_file",
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
@click.option(
    "--strict",
    is_flag=True,
    help="Refuse the stack on warnings too (SSH open to the world, an endpoint without keys).",
)
def plan(
    stack_name: str,
    stacks_dir: Path | None,
    json_file: str | None,
    lock: bool,
    show_resources: bool,
    strict: bool,
) -> None:
    """Show where every replica goes, the nodes to create and the warm cost, offline."""
    problems = output_file_problems("--json", json_file)
    if problems:
        fail(problems)
    try:
        folder = stacks_dir or find_stacks_dir()
        if lock:
            check_lock_writable(folder, stack_name)
        stack = load_stack(folder, stack_name)
        warnings = stack_warnings(stack)
        if strict and warnings:
            fail([f"{line} (--strict)" for line in warnings])
        for line in warnings:
            click.echo(f"warning: {line}", err=True)
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
            write_output("--json", json_file, json.dumps(document, indent=2) + "\n")
    if lock:
        try:
            path = write_lock(folder, stack_name, [r.id for r in result.placement.replicas])
        except StackError as error:
            fail(error.problems)
        click.echo(f"wrote {path.name}", err=True)


def _preview(
    stack: StackSpec, config: dict[str, Any], previous: list[str]
) -> "list[PreviewResource]":
    # Imported here: Pulumi and the provider SDKs take seconds to load, a plain plan none.
    from denv_iac.components.preview import preview_stack

    return preview_stack(stack, config, previous)
