"""`denv local up|down|roll|demo`: the data plane of a local stack on this machine."""

import json
import os
import signal
import sys
import threading
from dataclasses import asdict

import click
from rich.console import Console
from rich.table import Table

from denv_iac.cli.console import API_KEY_ENV, fail, wide_console
from denv_iac.cli.status import status
from denv_iac.core.stack.reader import StackError
from denv_iac.local.rollout import ROLL_SIGNAL, ask_roll, roll_bound_s, serve_roll_requests
from denv_iac.local.run_state import STATE_FILE, RunState, run_dir
from denv_iac.local.runner import LocalCluster
from denv_iac.local.stopping import StackLock, running_recorded, stop_stack
from denv_iac.ops.demo import run_demo
from denv_iac.stacks_dir import find_stacks_dir, load_stack

STACK = click.option(
    "--stack",
    "stack_name",
    default="local",
    show_default=True,
    help="A stack whose sites are all local.",
)


def _cluster(stack_name: str, port: int | None) -> tuple[LocalCluster, StackLock]:
    """The stack's local cluster, with the stack's lock held until the process ends."""
    try:
        stacks = find_stacks_dir()
        stack = load_stack(stacks, stack_name)
        directory = run_dir(stacks.parent, stack_name)
        lock = StackLock(directory)
        lock.acquire(stack_name)
    except StackError as error:
        fail(error.problems)
    try:
        if running_recorded(directory):  # a detached run: its processes hold no lock
            raise StackError(
                [
                    f"--stack: {stack_name} is already running locally; "
                    f"`denv local down --stack {stack_name}` stops it"
                ]
            )
        # A state file whose processes are all gone (a crash, a reboot) is left over: drop it.
        (directory / STATE_FILE).unlink(missing_ok=True)
        return LocalCluster(stack, directory, port, project=stacks.parent), lock
    except StackError as error:
        lock.abandon()
        fail(error.problems)


def _start(cluster: LocalCluster, console: Console, quiet: bool) -> RunState:
    try:
        with console.status("starting the local data plane") as status:
            cluster.up(lambda line: status.update(line) if not quiet else None)
    except StackError as error:
        fail(error.problems)
    except RuntimeError as error:
        fail([f"local up: {error}"])
    assert cluster.state is not None
    return cluster.state


def _table(state: RunState) -> Table:
    table = Table(title=f"Endpoint {state.endpoint}", title_justify="left")
    for column in ("replica", "pool", "node", "address", "agent port", "pid"):
        table.add_column(column)
    for r in state.replicas:
        table.add_row(
            r.id,
            r.pool,
            f"{r.site}/{r.node}",
            f"{r.address}:{r.port}",
            str(r.agent_port),
            str(r.pid),
        )
    return table


@click.group()
def local() -> None:
    """Run a stack's whole data plane here: simulated GPUs, real agents, real HAProxy."""


@local.command()
@STACK
@click.option("--port", type=click.IntRange(1, 65535), help="Endpoint port (default: the stack's).")
@click.option("--detach", is_flag=True, help="Leave it running; `denv local down` stops it.")
@click.option("--quiet", is_flag=True, help="Print only the endpoint.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the endpoint and replicas as JSON, no progress."
)
def up(stack_name: str, port: int | None, detach: bool, quiet: bool, as_json: bool) -> None:
    """Start the data plane and print the endpoint; Ctrl-C stops everything."""
    quiet = quiet or as_json
    console = wide_console(stderr=quiet)
    stop = threading.Event()
    if not detach:
        # Set before anything starts, so that a stop asked for at any moment ends the whole
        # stack: SIGTERM is what `denv local down` sends; SIGINT too, explicitly, as a shell
        # starts a background job with SIGINT ignored and Python then raises no KeyboardInterrupt.
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: stop.set())
    cluster, lock = _cluster(stack_name, port)
    state = _start(cluster, console, quiet)
    if as_json:
        # The control token drives the agents' fault injection: it stays in state.json (0600).
        document = {k: v for k, v in asdict(state).items() if k != "control_token"}
        click.echo(json.dumps(document, indent=2))
    elif quiet:
        click.echo(state.endpoint)
    else:
        console.print(_table(state))
        console.print(f"admin socket {state.admin_socket}; metrics {state.prometheus}")
    if detach:
        # A detached stack is what state.json records; the lock only guarded its start.
        lock.release()
        return
    if not quiet:
        console.print("serving; a process that dies is restarted; Ctrl-C stops everything")
    # Lines about restarts and rolls go to stderr when stdout carries only the endpoint or JSON.

    def say(line: str) -> None:
        console.print(line, highlight=False)

    # `denv local roll` asks this process to roll the stack file onto what it supervises.
    asked = threading.Event()
    signal.signal(ROLL_SIGNAL, lambda *_: asked.set())
    threading.Thread(
        target=serve_roll_requests,
        args=(cluster, lambda: load_stack(find_stacks_dir(), stack_name), asked, stop, say),
        daemon=True,
    ).start()
    try:
        cluster.supervise_until(stop, say)
    finally:
        cluster.down()
        lock.release()


@local.command()
@STACK
def down(stack_name: str) -> None:
    """Stop a local data plane: its supervising `local up` first, then what it recorded."""
    try:
        stopped = stop_stack(run_dir(find_stacks_dir().parent, stack_name))
    except StackError as error:
        fail(error.problems)
    click.echo(f"stopped {stopped} processes" if stopped else f"{stack_name} is not running")


@local.command()
@STACK
def roll(stack_name: str) -> None:
    """Roll a changed stack file onto the running stack, one replica of a pool at a time."""
    try:
        stacks = find_stacks_dir()
        stack = load_stack(stacks, stack_name)
        directory = run_dir(stacks.parent, stack_name)
        supervisor = StackLock(directory).holder()
        if supervisor is None:
            raise StackError(
                [
                    f"--stack: {stack_name} has no supervising `denv local up` (it is stopped or "
                    "was started with --detach); a roll runs in that process: start the stack "
                    f"with `denv local up --stack {stack_name}` and roll again"
                ]
            )
    except StackError as error:
        fail(error.problems)
    answer = ask_roll(directory, supervisor, roll_bound_s(stack))
    if answer.problems:
        # 1: the roll stopped (the old replicas serve); 2: the stack file was refused.
        fail(answer.problems, answer.code or 1)
    for line in answer.lines:
        click.echo(line)


@local.command()
@STACK
@click.option(
    "--duration",
    type=click.FloatRange(9, 600),
    default=10.0,
    show_default=True,
    help="Seconds of traffic.",
)
@API_KEY_ENV
def demo(stack_name: str, duration: float, api_key_env: str) -> None:
    """Traffic through the endpoint while replicas die and a GPU fails; counts what was lost."""
    console = wide_console()
    cluster, lock = _cluster(stack_name, None)
    api_key = os.environ.get(api_key_env)
    if cluster.stack.balancer.api_key_digests and not api_key:
        lock.abandon()
        fail(
            [
                f"--api-key-env: {api_key_env} is not set, and stack {stack_name}'s endpoint"
                " answers only keys in balancer.api_key_digests; export one of those keys as"
                f" {api_key_env}"
            ]
        )
    state = _start(cluster, console, quiet=False)
    console.print(_table(state))
    try:
        result = run_demo(cluster, console.print, duration, api_key)
    finally:
        cluster.down()
    console.print(result.line, highlight=False, soft_wrap=True)
    sys.exit(0 if result.ok else 1)


# `denv local status` is kept as another name for `denv status`.
local.add_command(status)
