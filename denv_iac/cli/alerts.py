"""`denv alerts`: the stack's Prometheus alerting rules."""

from pathlib import Path

import click

from denv_iac.cli.console import fail
from denv_iac.core.stack.reader import StackError
from denv_iac.ops.alerts import alert_rules
from denv_iac.stacks_dir import find_stacks_dir, load_stack


@click.command()
@click.option("--stack", "stack_name", required=True, help="Stack name, e.g. local.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write the rules to FILE instead of standard output.",
)
def alerts(stack_name: str, out: Path | None) -> None:
    """Prometheus alerting rules: a balancer or agent down, a pool below min_warm."""
    try:
        text = alert_rules(load_stack(find_stacks_dir(), stack_name))
    except StackError as error:
        fail(error.problems)
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        out.write_text(text)
    except OSError as error:
        fail([f"--out: cannot write {out} ({error.strerror}); pass a writable file"])
    click.echo(f"wrote {out}")
