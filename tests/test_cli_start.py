"""`denv` starts without the heavy libraries; each command loads what it uses when it runs."""

import subprocess
import sys
from importlib.metadata import version

import click
import pytest
from click.testing import CliRunner

from denv_iac.cli import LAZY_COMMANDS, main

# Seconds of start-up between them (matplotlib alone is about three).
HEAVY = ("matplotlib", "numpy", "pyinfra", "paramiko", "pulumi", "rich", "httpx")
LOADED = (
    "import sys\n"
    "from denv_iac.cli import main\n"
    "if sys.argv[1:]:\n"
    "    try:\n"
    "        main(sys.argv[1:])\n"
    "    except SystemExit:\n"
    "        pass\n"
    "heavy = {m.split('.')[0] for m in sys.modules} & set(HEAVY)\n"
    "heavy |= {m for m in sys.modules if m.startswith('pulumi_')}\n"
    "print('loaded:', *sorted(heavy), file=sys.stderr)\n"
)


def _heavy_loaded(*args: str) -> tuple[str, set[str]]:
    result = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{LOADED}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    last = result.stderr.splitlines()[-1].split()
    assert last[0] == "loaded:", result.stderr
    return result.stdout, set(last[1:])


@pytest.mark.parametrize("args", [(), ("--help",), ("--version",)], ids=["import", "help", "ver"])
def test_the_cli_starts_without_the_heavy_libraries(args: tuple[str, ...]) -> None:
    stdout, heavy = _heavy_loaded(*args)
    assert heavy == set()
    if args == ("--help",):
        assert all(name in stdout for name in LAZY_COMMANDS)


def test_a_command_loads_what_it_uses_when_it_runs() -> None:
    # The probe itself must see a heavy import, or the test above proves nothing.
    _, heavy = _heavy_loaded("node", "--help")
    assert "pyinfra" in heavy


def test_the_listed_summary_is_each_commands_own() -> None:
    group = click.Context(main)
    for name, (_, summary) in LAZY_COMMANDS.items():
        command = main.get_command(group, name)
        assert command is not None, name
        assert command.get_short_help_str(limit=500) == summary, name


def test_version_names_both_packages() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"denv-iac {version('denv-iac')}",
        f"denv-agent {version('denv-agent')}",
    ]
