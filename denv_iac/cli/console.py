"""Console output shared by the commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

if TYPE_CHECKING:
    from rich.console import Console

# rich is imported where output is drawn: `fail` and the CLI's start must not load it.


# The endpoint's API key is read from the environment, never from an argument (process lists
# and shell history show arguments).
API_KEY_ENV = click.option(
    "--api-key-env",
    default="DENV_API_KEY",
    show_default=True,
    help="Environment variable holding the endpoint's API key, if it needs one.",
)


def wide_console(stderr: bool = False) -> Console:
    """A console that never truncates ids when output goes to a file or a CI log."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=160)


def output_file_problems(option: str, name: str | None) -> list[str]:
    """Why FILE of `--json FILE` (or another output option) cannot be written, checked before
    the work whose result it would hold is done."""
    if name is None or name == "-":
        return []
    path = Path(name)
    if path.is_dir():
        return [f"{option} {name}: is a folder; give a file name, e.g. {option} {path / 'out'}"]
    if not path.parent.is_dir():
        return [f"{option} {name}: folder {path.parent} does not exist; create it first"]
    return []


def write_output(option: str, name: str, text: str) -> None:
    """Write an output file, failing with one line (exit 1) if the system refuses."""
    try:
        Path(name).write_text(text, encoding="utf-8")
    except OSError as error:
        fail([f"{option} {name}: cannot write it ({error.strerror})"], code=1)


def fail(problems: list[str], code: int = 2) -> NoReturn:
    """Print each problem on its own line and exit: 2 for bad input, 1 for a failed action."""
    for line in problems:
        click.echo(f"error: {line}", err=True)
    sys.exit(code)


class StepProgress:
    """Progress of long work on stderr: a live bar in a terminal, one line per finished step.

    The lines are what a CI log keeps (no live bar is drawn when stderr is not a terminal);
    `quiet` keeps both away, for scripts that want only the result.
    """

    def __init__(self, what: str, quiet: bool = False) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._quiet = quiet
        console = wide_console(stderr=True)
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            # A log gets the step lines alone: a live display there ends in a stray blank line.
            disable=quiet or not console.is_terminal,
        )
        self._task = self._progress.add_task(what, total=None)

    def __enter__(self) -> StepProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def started(self, index: int, total: int | None, label: str) -> None:
        """Step `index` of `total` (None when unknown) is running."""
        self._progress.update(self._task, total=total, completed=index - 1, description=label)

    def finished(self, index: int, total: int | None, label: str, status: str) -> None:
        """Step `index` ended with `status`: its line is printed above the bar."""
        self._progress.update(self._task, total=total, completed=index)
        if not self._quiet:
            where = f"[{index}/{total}] " if total is not None else ""
            self._progress.console.print(f"{where}{label} ... {status}", highlight=False)
