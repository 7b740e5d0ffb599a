"""The `denv` command."""

import importlib

import click

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
    "key": (
        "denv_iac.cli.key:key",
        "API keys for the endpoint (only their digests go into stack config).",
    ),
    "node": (
        "denv_iac.cli.node:node",
        "Join, repair, drain and undrain GPU nodes (pyinfra over SSH, or @local / @chroot/PATH).",
    ),
    "plan": (
        "denv_iac.cli.plan:plan",
        "Show where every replica goes, the nodes to create and the warm cost, offline.",
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
