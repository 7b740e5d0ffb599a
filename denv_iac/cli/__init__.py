"""The `denv` command."""

import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from denv_iac.cli.console import fail, output_file_problems, wide_console, write_output

if TYPE_CHECKING:
    from denv_iac.components.preview import PreviewResource
    from denv_iac.core.stack.model import StackSpec

# Each command's module is imported only when that command runs: together they pull in
# matplotlib, pyinfra, httpx and rich, seconds of start-up that `denv --help` must not pay.
# The summary is what `denv --help` lists; tests/test_cli_start.py checks it is the command's own.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "alerts": (
        "denv_iac.cli.alerts:alerts",
        "Prometheus alerting rules: a balancer or agent down, a pool below min_warm.",
    ),
    "bench": (
        "denv_iac.cli.bench:bench",
        "Load URL with one protocol; its latency p50/p90/p99, gaps, errors by kind.",
    ),
    "doctor": (
        "denv_iac.cli.doctor:doctor",
        "Check this machine for what a stack needs, and say what to install.",
    ),
    "local": (
        "denv_iac.cli.local:local",
        "Run a stack's whole data plane here: simulated GPUs, real agents, real HAProxy.",
    ),
    "node": (
        "denv_iac.cli.node:node",
        "Join, repair, drain and undrain GPU nodes (pyinfra over SSH, or @local / @chroot/PATH).",
    ),
    "status": (
        "denv_iac.cli.status:status",
        "Per pool, site and replica: state, weight, reason, active streams, last probe TTFT;"
        " per pool, its slots in use, queued, spilled and shed requests; for a pool with a"
        " canary, both versions side by side (ready, share of new sessions, probe TTFT,"
        " request time); per site, its round trip from the balancer as the health checks"
        " measure it, beside the one the stack states (which sets its tiers' connect"
        " timeouts).",
    ),
}
PACKAGES = ("denv-iac", "denv-agent")


class LazyGroup(click.Group):
    """A group that imports a subcommand's module when that subcommand is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module, _, attr = LAZY_COMMANDS[cmd_name][0].partition(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # The listing shows the declared summaries, so that help imports no command module.
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        commands = [
            self.commands.get(name) or click.Command(name, help=LAZY_COMMANDS[name][1])
            for name in names
        ]
        rows = [(c.name or "", c.get_short_help_str(limit)) for c in commands if not c.hidden]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _versions() -> str:
    # Imported here: importlib.metadata costs a sixth of `denv --help`'s start.
    from importlib.metadata import PackageNotFoundError, version

    lines = []
    for package in PACKAGES:
        try:
            lines.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            lines.append(f"{package} not installed")
    return "\n".join(lines)


def _print_versions(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_versions())
        ctx.exit()


STACKS_DIR = click.option(
    "--stacks-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder holding Pulumi.<stack>.yaml (default: stacks/ of the project here).",
)


@click.group(cls=LazyGroup)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_versions,
    help="Show denv-iac's and denv-agent's versions and exit.",
)
def main() -> None:
    """One cluster, one endpoint, warm GPU replicas across providers."""


@main.command()
@click.option("--stack", "stack_name", required=True, help="Stack name, e.g. local.")
@STACKS_DIR
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
    from denv_iac.cli.plan_view import render_plan, render_resources
    from denv_iac.core.plan import make_plan
    from denv_iac.core.stack.exposure import stack_warnings
    from denv_iac.core.stack.reader import StackError
    from denv_iac.stacks_dir import (
        check_lock_writable,
        find_stacks_dir,
        load_lock,
        load_stack,
        load_stack_config,
        write_lock,
    )

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
    stack: "StackSpec", config: dict[str, Any], previous: list[str]
) -> "list[PreviewResource]":
    # Imported here: Pulumi and the provider SDKs take seconds to load, a plain plan none.
    from denv_iac.components.preview import preview_stack

    return preview_stack(stack, config, previous)


@main.group()
def key() -> None:
    """API keys for the endpoint (only their digests go into stack config)."""


@key.command()
def digest() -> None:
    """Read an API key on standard input and print its SHA-256 digest for api_key_digests."""
    # Bytes, not text: a key is whatever its owner typed, in any encoding, and is hashed as is.
    # One key, one line: a trailing newline (echo's) is not part of it, and a second line is
    # refused rather than silently left out of the digest.
    lines = sys.stdin.buffer.read().strip().splitlines()
    if len(lines) > 1:
        fail(
            [
                f"stdin: {len(lines)} lines given, and a key is one line; pipe one key at a "
                'time, e.g. `printf %s "$KEY" | denv key digest`'
            ]
        )
    secret = lines[0].strip() if lines else b""
    if not secret:
        fail(['stdin: no API key given; pipe one in, e.g. `printf %s "$KEY" | denv key digest`'])
    click.echo(hashlib.sha256(secret).hexdigest())
