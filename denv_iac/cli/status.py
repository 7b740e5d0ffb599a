"""The `denv status` command: one table per pool, by site and replica, and a verdict per pool.

Exit status: 0 when all is well; 1 when a pool has fewer healthy replicas than its min_warm, a
node agent cannot be heard or the balancer of a local run is dead (one line each); 2 for bad
input (unknown stack, stack not running, an admin socket or endpoint that cannot be read).
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from denv_iac.cli.console import fail, wide_console
from denv_iac.core.balancer.saturation import PoolSaturation, pool_saturation
from denv_iac.core.balancer.stats import server_rows
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.reader import StackError
from denv_iac.haproxy.runtime import stats_rows
from denv_iac.local.processes import HAPROXY_MARK, HOST, ours
from denv_iac.local.run_state import RunState, read_state, run_dir
from denv_iac.ops.status import (
    AgentEndpoint,
    AgentHealth,
    PoolStatus,
    ReplicaStatus,
    SiteDistance,
    StatsUnreadable,
    pool_statuses,
    problems,
    read_agents,
    read_remote_stats,
    replica_statuses,
    site_distances,
    with_agent_health,
)
from denv_iac.stacks_dir import find_stacks_dir, load_stack

DEFAULT_STACK = "local"
EXAMPLE = "http://203.0.113.5:8405"


def _run_state(stack_name: str, required: bool) -> RunState | None:
    state = read_state(run_dir(find_stacks_dir().parent, stack_name))
    if state is not None:
        return state
    if required:
        raise StackError(
            [
                f"--stack: {stack_name} is not running here; start it with "
                f"`denv local up --stack {stack_name} --detach`, or pass --admin-socket"
            ]
        )
    return None


def _sources(
    stack_name: str | None, admin_socket: Path | None, remote: bool
) -> tuple[StackSpec | None, RunState | None, Path | None]:
    """The stack (for min_warm), the local run state (for agents) and the socket to read.

    A remote balancer (`--endpoint`) has no local run: only its stack, when named, is read.
    """
    if stack_name is None and (admin_socket is not None or remote):
        return None, None, admin_socket
    name = stack_name or DEFAULT_STACK
    try:
        stack = load_stack(find_stacks_dir(), name)
        state = None if remote else _run_state(name, required=admin_socket is None)
    except StackError as error:
        fail(error.problems)
    if admin_socket is None and state is not None:
        admin_socket = Path(state.admin_socket)
    return stack, state, admin_socket


def _stat_rows(
    socket_path: Path | None, endpoint: str | None, state: RunState | None
) -> list[dict[str, str]]:
    if state is not None and not ours(state.haproxy_pid, HAPROXY_MARK):
        # A failure of the running stack, not bad input: exit 1, as for any other failure.
        fail(
            [
                f"balancer of {state.stack} (pid {state.haproxy_pid}) is not running: the "
                f"endpoint {state.endpoint} is down; a foreground `denv local up` restarts it"
            ],
            code=1,
        )
    if endpoint is not None:
        try:
            return read_remote_stats(endpoint)
        except StatsUnreadable as error:
            fail([f"--endpoint: {error}; pass the balancer's metrics address, e.g. {EXAMPLE}"])
    assert socket_path is not None  # _sources gives one without --endpoint
    try:
        return stats_rows(socket_path)
    except OSError as error:
        fail([f"admin socket {socket_path}: cannot read the balancer's stats ({error.strerror})"])
    except KeyError:
        fail(
            [f"admin socket {socket_path}: answers, but not with HAProxy's stats; name its socket"]
        )


def _agent_endpoints(state: RunState | None) -> list[AgentEndpoint]:
    if state is None:
        return []
    return [AgentEndpoint(a.node, f"http://{HOST}:{a.http_port}") for a in state.agents]


def _pool_line(pool: PoolStatus) -> str:
    if pool.min_warm is None:
        return f"pool {pool.pool}: {pool.healthy} healthy, min_warm unknown (pass --stack)"
    mark = "ok" if pool.ok else "BELOW MIN_WARM"
    return f"pool {pool.pool}: {pool.healthy} healthy, min_warm {pool.min_warm}: {mark}"


def _saturation_line(pool: str, full: PoolSaturation) -> str:
    mark = ": SATURATED" if full.saturated else ""
    return (
        f"pool {pool}: slots {full.slots_in_use}/{full.slots} in use, {full.queued} queued;"
        f" since the balancer started {full.spilled} spilled to a later tier,"
        f" {full.shed} shed{mark}"
    )


def _pool_table(pool: PoolStatus, replicas: list[ReplicaStatus]) -> Table:
    table = Table(title=f"pool {pool.pool}", title_justify="left")
    for column, justify in (
        ("site", "left"),
        ("replica", "left"),
        ("state", "left"),
        ("weight", "right"),
        ("streams", "right"),
        ("engine run/queue", "right"),
        ("probe TTFT ms", "right"),
        ("reason", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for r in sorted(replicas, key=lambda r: (r.site, r.id)):
        ttft = "-" if r.probe_ttft_ms is None else f"{r.probe_ttft_ms:.1f}"
        engine = (
            "-"
            if r.engine_running is None or r.engine_waiting is None
            else f"{r.engine_running:.0f}/{r.engine_waiting:.0f}"
        )
        style = None if r.healthy else "red"
        table.add_row(
            r.site,
            r.id,
            r.state,
            str(r.weight),
            str(r.streams),
            engine,
            ttft,
            r.reason,
            style=style,
        )
    return table


def _versions_table(pool: PoolStatus) -> Table:
    """The recipe's version and its canary's, side by side."""
    table = Table(title=f"pool {pool.pool}: stable and canary", title_justify="left")
    for column in (
        "version",
        "replicas of",
        "ready",
        "new sessions now",
        "stack share",
        "probe TTFT ms",
        "request ms",
        "requests",
    ):
        table.add_column(column, justify="left" if column.startswith(("v", "rep")) else "right")
    for v in pool.versions:
        table.add_row(
            v.version,
            v.pool,
            f"{v.ready}/{v.replicas}",
            "-" if v.share_now is None else f"{100 * v.share_now:.1f} %",
            f"{100 * v.share_stack:.1f} %",
            "-" if v.probe_ttft_ms is None else f"{v.probe_ttft_ms:.1f}",
            "-" if v.total_ms is None else f"{v.total_ms:.0f}",
            str(v.served),
            style=None if v.ready else "red",
        )
    return table


def _distance_line(distance: SiteDistance) -> str:
    measured = distance.measured_round_trip_ms
    seen = "not yet measured" if measured is None else f"about {measured:g} ms"
    stated = distance.stated_round_trip_ms
    said = "not stated" if stated is None else f"{stated:g} ms"
    return (
        f"site {distance.site}: round trip {seen} by the health checks;"
        f" stack's round_trip_ms {said}"
    )


def _render(
    console: Console,
    title: str,
    pools: list[PoolStatus],
    replicas: list[ReplicaStatus],
    agents: list[AgentHealth],
    distances: list[SiteDistance],
) -> None:
    console.print(title, highlight=False)
    for pool in pools:
        mine = [r for r in replicas if r.pool in (pool.pool, pool.canary_pool)]
        if pool.versions:
            console.print(_versions_table(pool))
        if mine:
            console.print(_pool_table(pool, mine))
        else:
            console.print(_pool_line(pool) + " (no replica in the balancer)", highlight=False)
    for pool in pools:
        console.print(_pool_line(pool), highlight=False)
        if pool.saturation is not None:
            console.print(_saturation_line(pool.pool, pool.saturation), highlight=False)
    for distance in distances:
        console.print(_distance_line(distance), highlight=False)
    for line in problems(pools, replicas, agents):
        if line.startswith("agent"):
            console.print(f"FAILED {line}", highlight=False)


@click.command()
@click.option(
    "--stack",
    "stack_name",
    help=f"Stack name; with no --admin-socket, its local run (default: {DEFAULT_STACK}).",
)
@click.option(
    "--admin-socket",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read this HAProxy admin socket instead (with --stack too: judged against its min_warm).",
)
@click.option(
    "--endpoint",
    help=(
        "Read a remote balancer's stats page at its metrics address "
        f"(the balancer's prometheus_port, open to admin CIDRs), e.g. {EXAMPLE}."
    ),
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def status(
    stack_name: str | None, admin_socket: Path | None, endpoint: str | None, as_json: bool
) -> None:
    """Per pool, site and replica: state, weight, reason, active streams, last probe TTFT;
    per pool, its slots in use, queued, spilled and shed requests; for a pool with a canary,
    both versions side by side (ready, share of new sessions, probe TTFT, request time); per
    site, its round trip from the balancer as the health checks measure it, beside the one
    the stack states (which sets its tiers' connect timeouts).

    Exits 1 when a pool has fewer healthy replicas than its min_warm, a node agent cannot be
    heard or the local balancer is dead; 2 for bad input.
    """
    if endpoint is not None and admin_socket is not None:
        fail(["--endpoint and --admin-socket name two balancers; pass one of them"])
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        fail([f"--endpoint: {endpoint!r} is not an http(s) URL; e.g. {EXAMPLE}"])
    stack, state, socket_path = _sources(stack_name, admin_socket, remote=endpoint is not None)
    rows = _stat_rows(socket_path, endpoint, state)
    agents = read_agents(_agent_endpoints(state))
    replicas = with_agent_health(replica_statuses(server_rows(rows)), agents)
    pools = pool_statuses(stack, replicas, pool_saturation(rows))
    distances = site_distances(stack, replicas)
    failures = problems(pools, replicas, agents)
    if state is not None:
        endpoint = state.endpoint
    if as_json:
        document = {
            "stack": stack.name if stack is not None else None,
            "endpoint": endpoint,
            "pools": [
                asdict(p)
                | {
                    "ok": p.ok,
                    "saturation": None
                    if p.saturation is None
                    else asdict(p.saturation) | {"saturated": p.saturation.saturated},
                }
                for p in pools
            ],
            "replicas": [asdict(r) | {"healthy": r.healthy} for r in replicas],
            "sites": [asdict(d) for d in distances],
            "agents": [
                {"node": a.node, "url": a.url, "reachable": a.reachable, "error": a.error}
                for a in agents
            ],
            "ok": not failures,
            "problems": failures,
        }
        click.echo(json.dumps(document, indent=2))
    else:
        where = f" at {endpoint}" if endpoint else f" via {socket_path}"
        if state is None and endpoint is not None:
            where += " (remote: node agents are not read)"
        title = f"Stack {stack.name}{where}" if stack is not None else f"Balancer{where}"
        _render(wide_console(), title, pools, replicas, agents, distances)
    sys.exit(1 if failures else 0)
