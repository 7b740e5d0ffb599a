"""No input ends in a traceback: arbitrary YAML-shaped stacks and bytes through the stack
reader, the plan and `denv plan`; arbitrary arguments to `bench`, `node join`, `status`,
`local down` and `key digest`. Exit 0 or 2, one line per message, in bounded time."""

import contextlib
import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from denv_iac.cli import main
from denv_iac.core.plan import make_plan
from denv_iac.core.stack.exposure import stack_warnings
from denv_iac.core.stack.reader import StackError, read_stack
from tests.stacks import valid_config

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["local", "whole", "1g.10gb", "H100", "-x", "a\nb", "0.0.0.0/0", "22"])
)
KEYS = st.text(max_size=12) | st.integers() | st.sampled_from(["name", "kind", "nodes", "sites"])
TREES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=20,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


@st.composite
def mutated_stacks(draw: st.DrawFn) -> dict[Any, Any]:
    """A valid stack with a few of its values, lists or mappings replaced by arbitrary trees:
    deep enough to reach placement and the checks that come after the reader's."""
    config: dict[Any, Any] = valid_config()
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(config) if p]
        path = draw(st.sampled_from(paths))
        parent: Any = config
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = draw(TREES)
    return config


CONFIGS = mutated_stacks() | st.dictionaries(KEYS, TREES, max_size=4)


def _one_line(line: str) -> bool:
    return bool(line) and "\n" not in line and "\r" not in line and "Traceback" not in line


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(CONFIGS)
def test_the_reader_and_the_plan_answer_or_refuse_in_one_line_each(config: dict[Any, Any]) -> None:
    original = copy.deepcopy(config)
    try:
        stack = read_stack("fuzz", config)
        plan = make_plan(stack)
        warnings = stack_warnings(stack)
    except StackError as error:
        assert error.problems and all(_one_line(p) for p in error.problems), error.problems
        return
    assert all(_one_line(w) for w in warnings)
    assert math.isfinite(plan.usd_per_hour)
    assert config == original or _has_nan(original)  # the reader never edits its input


def _has_nan(node: Any) -> bool:
    if isinstance(node, float):
        return math.isnan(node)
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return any(_has_nan(v) for v in values)


def _plan(folder: Path, data: bytes, *args: str) -> None:
    (folder / "Pulumi.fuzz.yaml").write_bytes(data)
    result = CliRunner().invoke(
        main, ["plan", "--stack", "fuzz", "--stacks-dir", str(folder), *args]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code in (0, 2), result.output
    lines = result.stderr.splitlines()
    assert all(line.startswith(("error: ", "warning: ")) for line in lines), lines
    if result.exit_code == 2:
        assert any(line.startswith("error: ") for line in lines)


@settings(max_examples=80, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(CONFIGS)
def test_denv_plan_exits_0_or_2_on_any_stack(tmp_path_factory: Any, config: Any) -> None:
    folder = tmp_path_factory.mktemp("stacks")
    try:
        data = yaml.safe_dump({"config": config}, allow_unicode=True).encode()
    except yaml.YAMLError:
        return
    _plan(folder, data)


@settings(max_examples=80, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(max_size=200)
    | st.builds(
        lambda text, junk: text.encode() + junk,
        st.sampled_from(["config:\n  denv:sites: ", "config:\n  a: 1\n  a: 2\n", "config: [", ""]),
        st.binary(max_size=40),
    )
)
def test_denv_plan_exits_0_or_2_on_any_bytes(tmp_path_factory: Any, data: bytes) -> None:
    _plan(tmp_path_factory.mktemp("stacks"), data, "--strict")


# The other commands, with arbitrary arguments. Each call is arranged so that it is refused (or
# done) without real work: no load is sent, no SSH is opened, no process is started.
ARGUMENTS = st.text(max_size=30) | st.sampled_from(
    ["", "-", "--", "..", "../../x", "http://", "http://[::1", "@local", "-oProxyCommand=id", "nan"]
)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("project")
    (root / "stacks").mkdir()
    (root / "Pulumi.yaml").write_text("name: p\nruntime: python\n")
    return root


def _denv(project: Path, *args: str, stdin: bytes | None = None) -> None:
    with contextlib.chdir(project):
        result = CliRunner().invoke(main, list(args), input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code in (0, 2), (args, result.output)
    lines = result.stderr.splitlines()
    if result.exit_code == 2 and not (lines and lines[0].startswith("Usage:")):  # click's own
        assert lines and all(line.startswith("error: ") for line in lines), lines


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(ARGUMENTS, ARGUMENTS, ARGUMENTS)
def test_bench_with_any_arguments_refuses_before_any_load(
    project: Path, url: str, duration: str, pool: str
) -> None:
    # --json into a missing folder: refused before the load, whatever the other arguments.
    args = ["bench", url, "--pool", pool, "--json", str(project / "missing" / "x.json")]
    _denv(project, *args, *(["--duration", duration] if duration else []))


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(ARGUMENTS, ARGUMENTS)
@example(host=":@:", user="")  # a ':' in the user part once read as an empty port
def test_node_join_with_any_host_refuses_before_connecting(
    project: Path, host: str, user: str
) -> None:
    # An unreadable --key is refused with the host's own problems, before any connection.
    missing_key = str(project / "no-such-key")
    _denv(
        project,
        "node",
        "join",
        "--site",
        "s",
        "--dry",
        "--key",
        missing_key,
        "--user",
        user,
        "--",
        host,
    )


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(ARGUMENTS)
def test_stack_commands_with_any_stack_name(project: Path, name: str) -> None:
    for command in (["plan"], ["status"], ["local", "down"]):
        _denv(project, *command, "--stack", name)


@settings(max_examples=60, deadline=2000)
@given(st.binary(max_size=100))
def test_key_digest_of_any_bytes(project: Path, data: bytes) -> None:
    _denv(project, "key", "digest", stdin=data)
