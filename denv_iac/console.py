"""Console output shared by the commands."""

import sys
from typing import NoReturn

import click
from rich.console import Console


def wide_console(stderr: bool = False) -> Console:
    """A console that never truncates ids when output goes to a file or a CI log."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=160)


def fail(problems: list[str], code: int = 2) -> NoReturn:
    """Print each problem on its own line and exit: 2 for bad input, 1 for a failed action."""
    for line in problems:
        click.echo(f"error: {line}", err=True)
    sys.exit(code)
