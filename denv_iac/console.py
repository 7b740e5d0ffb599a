"""Console output shared by the commands."""

from rich.console import Console


def wide_console(stderr: bool = False) -> Console:
    """A console that never truncates ids when output goes to a file or a CI log."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=160)
