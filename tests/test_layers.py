"""The layout's promise: each layer imports only from the layers below it (README, Layout)."""

import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "denv_iac"
# Lowest first. A module belongs to the first layer whose prefix it starts with.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("denv_iac.core",)),
    (
        "machines",
        (
            "denv_iac.node",
            "denv_iac.local",
            "denv_iac.haproxy",
            "denv_iac.stacks_dir",
            "denv_iac.lambda_api",
            "denv_iac.robot_api",
            "denv_iac.waits",
            "denv_iac.child_process",
            "denv_iac.wire",
        ),
    ),
    ("wiring", ("denv_iac.components",)),
    ("ops", ("denv_iac.ops",)),
    ("cli", ("denv_iac.cli", "denv_iac.__main__")),
)
# What the pure core may not import at all, even indirectly through a third-party name.
NOT_IN_CORE = (
    "pulumi",
    "pulumi_aws",
    "pulumi_hcloud",
    "pulumi_kubernetes",
    "pulumi_nebius",
    "pyinfra",
    "httpx",
    "click",
    "rich",
    "matplotlib",
)
# Within the machines layer, lowest first, as LAYERS: the local data plane runs the installed
# HAProxy, never the other way round; the protocols the simulator and the load generator share
# (denv_iac.wire) sit below both.
MACHINES: tuple[tuple[str, ...], ...] = (
    (
        "denv_iac.waits",
        "denv_iac.child_process",
        "denv_iac.stacks_dir",
        "denv_iac.lambda_api",
        "denv_iac.robot_api",
        "denv_iac.wire",
    ),
    ("denv_iac.node", "denv_iac.haproxy"),
    ("denv_iac.local",),
)
# What the core may import of the agent package (a dependency of denv-iac): its pure modules,
# which do no I/O either (test_the_agent_modules_the_core_uses_do_no_io).
AGENT_IN_CORE = ("denv_agent.toml_text",)
# Nor the standard library's doors to the world: processes, signals, sockets, files and folders,
# threads and event loops, the clock, randomness, the interpreter's streams. `posixpath` does path
# arithmetic on strings; `pathlib` is allowed for the same (its I/O methods are refused below).
IO_MODULES = (
    "os",
    "sys",
    "subprocess",
    "signal",
    "socket",
    "socketserver",
    "ssl",
    "select",
    "selectors",
    "http",
    "urllib",
    "ftplib",
    "smtplib",
    "shutil",
    "tempfile",
    "glob",
    "fileinput",
    "mmap",
    "asyncio",
    "threading",
    "multiprocessing",
    "concurrent",
    "time",
    "random",
    "secrets",
)
# Methods that touch the file system (pathlib's, and a file's open), and the builtins that do I/O.
IO_METHODS = frozenset(
    {
        "open",
        "read_text",
        "write_text",
        "read_bytes",
        "write_bytes",
        "mkdir",
        "touch",
        "unlink",
        "rmdir",
        "rename",
        "symlink_to",
        "hardlink_to",
        "chmod",
        "glob",
        "rglob",
        "iterdir",
        "exists",
        "is_file",
        "is_dir",
        "is_symlink",
        "stat",
        "lstat",
        "resolve",
        "samefile",
        "expanduser",
        "cwd",
        "home",
    }
)
IO_BUILTINS = frozenset(("open", "print", "input", "breakpoint"))
# The one read the core may make: the package's own data (denv_iac/data/), through
# importlib.resources. It is shipped inside the package, read-only, the same bytes for every
# caller, and depends on no working directory, user file, clock or network: a constant kept in
# a JSON file rather than in a module.
OWN_DATA = "denv_iac"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    return _level(module, tuple(prefixes for _, prefixes in LAYERS))


def _level(module: str, levels: tuple[tuple[str, ...], ...]) -> int | None:
    for index, prefixes in enumerate(levels):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _imports_of(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not node.module or node.level != 0:
        return []
    if node.module == "denv_iac" or node.module.startswith("denv_iac."):
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return [node.module]


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += _imports_of(node)
    return found


# Programs the package ships as data (denv_iac/data/scripts/) run elsewhere, in a pod or on a
# node: they import nothing of the package and belong to no layer.
DATA = PACKAGE / "data"
MODULES = sorted(
    (p for p in PACKAGE.rglob("*.py") if _module(p) != "denv_iac" and DATA not in p.parents),
    key=lambda p: _module(p),
)


def test_every_module_has_a_layer() -> None:
    assert [_module(p) for p in MODULES if _layer(_module(p)) is None] == []


def _refused_in_core(name: str) -> bool:
    top = name.split(".")[0]
    return top in NOT_IN_CORE or (top == "denv_agent" and name not in AGENT_IN_CORE)


def layers_upward(module: str, imports: list[str]) -> list[str]:
    """What `module` imports from a layer above its own (with that layer's name), and, in the
    core, what it may not import at all."""
    own = _layer(module)
    assert own is not None
    upward = []
    for name in imports:
        if name.startswith("denv_iac."):
            other = _layer(name)
            if other is not None and other > own:
                upward.append(f"{name} ({LAYERS[other][0]})")
        elif own == 0 and _refused_in_core(name):
            upward.append(name)
    return upward


@pytest.mark.parametrize("path", MODULES, ids=_module)
def test_imports_go_down_the_layers_only(path: Path) -> None:
    module = _module(path)
    upward = layers_upward(module, _imports(path))
    assert upward == [], f"{module} ({LAYERS[_layer(module) or 0][0]}) imports from above: {upward}"


@pytest.mark.parametrize(
    ("module", "imports", "upward"),
    [
        (
            "denv_iac.core.plan",
            ["denv_iac.core.placement", "denv_iac.components.preview"],
            ["denv_iac.components.preview (wiring)"],
        ),
        ("denv_iac.core.overlay_plan", ["ipaddress", "pulumi"], ["pulumi"]),
        (
            "denv_iac.core.agent_config",
            ["denv_agent.toml_text", "denv_agent.control"],
            ["denv_agent.control"],
        ),
        ("denv_iac.local.runner", ["denv_iac.cli.console"], ["denv_iac.cli.console (cli)"]),
        ("denv_iac.components.cluster", ["denv_iac.ops.status"], ["denv_iac.ops.status (ops)"]),
        # Down the layers, and a third-party name anywhere above the core: allowed.
        (
            "denv_iac.cli.plan",
            ["denv_iac.core.plan", "denv_iac.stacks_dir", "denv_iac.components.preview", "click"],
            [],
        ),
        ("denv_iac.node.deploy", ["pyinfra", "denv_iac.waits", "denv_iac.core.polling"], []),
    ],
)
def test_the_layer_check_sees_an_upward_arrow(
    module: str, imports: list[str], upward: list[str]
) -> None:
    assert layers_upward(module, imports) == upward


MACHINE_MODULES = [p for p in MODULES if _level(_module(p), MACHINES) is not None]


def test_every_machines_module_has_a_place_in_their_order() -> None:
    machines = [_module(p) for p in MODULES if _layer(_module(p)) == 1]
    assert [m for m in machines if _level(m, MACHINES) is None] == []


def machines_upward(module: str, imports: list[str]) -> list[str]:
    """What `module` imports from above its own place in MACHINES."""
    own = _level(module, MACHINES)
    assert own is not None
    return [n for n in imports if (other := _level(n, MACHINES)) is not None and other > own]


@pytest.mark.parametrize("path", MACHINE_MODULES, ids=_module)
def test_the_machines_import_down_their_order_only(path: Path) -> None:
    upward = machines_upward(_module(path), _imports(path))
    assert upward == [], f"{_module(path)} imports from above it in the machines layer: {upward}"


def _dependencies(path: Path, modules: frozenset[str]) -> set[str]:
    """The package's modules `path` imports: `from a.b import c` is a.b.c where that is a
    module, else a.b; a module's own enclosing packages are left out (Python runs them first,
    whatever it imports)."""
    module, found = _module(path), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> the modules it imports): each strongly connected
    group of more than one module, sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return sorted(found)


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    modules = frozenset({"denv_iac", *map(_module, MODULES)})
    return {_module(p): _dependencies(p, modules) for p in MODULES}


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    assert cycles(_import_graph()) == []


def room_of(module: str) -> str:
    """The part of the house `module` lives in: a package with no packages inside is one room
    (denv_iac.local, denv_iac.core.stack); in a package that holds others (denv_iac,
    denv_iac.core) each of its own modules is a room of its own."""
    parts = module.split(".")
    for depth in range(2, len(parts) + 1):
        folder = PACKAGE.parent.joinpath(*parts[:depth])
        inner = [d for d in folder.glob("*/__init__.py") if d.parent != DATA]
        if (folder / "__init__.py").exists() and not inner:
            return ".".join(parts[:depth])
    return module


def core_together(module: str) -> str:
    """The house drawn coarser, as its layout was first drawn: the core's own modules
    (placement, drain, endpoint, ...) together as one room, `denv_iac.core`; the rest as
    `room_of`."""
    room = room_of(module)
    core, _, name = room.rpartition(".")
    return core if core == "denv_iac.core" and (PACKAGE / "core" / f"{name}.py").is_file() else room


def rooms(graph: dict[str, set[str]], room: Callable[[str], str] = room_of) -> dict[str, set[str]]:
    """`graph` between rooms, each module's room as `room` says: an arrow from a room to each
    other room one of its modules imports."""
    out: dict[str, set[str]] = {}
    for module, imports in graph.items():
        home = room(module)
        out.setdefault(home, set()).update(room(o) for o in imports if room(o) != home)
    return out


def test_no_room_imports_itself_through_another() -> None:
    """Two packages each importing the other is a circle even where no module does: the stack
    reader importing the balancer's tiers while the balancer reads the stack model."""
    assert cycles(rooms(_import_graph())) == []


def test_drawn_with_the_core_s_own_modules_together_the_house_has_no_circle() -> None:
    """The stack reads the catalog from inside its own room, and the plan, which reads every
    part of the core (the Kubernetes manifests' checks among them, which read the core's own
    modules), is a package of its own above them: no circle through the core's modules."""
    assert cycles(rooms(_import_graph(), core_together)) == []


def test_the_coarse_drawing_sees_a_circle_the_room_check_does_not() -> None:
    graph = {
        "denv_iac.core.placement": {"denv_iac.core.stack.model"},
        "denv_iac.core.stack.model": set(),
        "denv_iac.core.stack.reader": {"denv_iac.core.drain"},
        "denv_iac.core.drain": set(),
    }
    assert cycles(rooms(graph)) == []
    assert cycles(rooms(graph, core_together)) == [["denv_iac.core", "denv_iac.core.stack"]]
    assert core_together("denv_iac.core.plan") == "denv_iac.core.plan"
    assert core_together("denv_iac.core.stack.catalog") == "denv_iac.core.stack"


def test_the_room_check_sees_a_circle_the_module_check_does_not() -> None:
    graph = {
        "denv_iac.core.stack.reader": {"denv_iac.core.balancer.tiers"},
        "denv_iac.core.balancer.tiers": set(),
        "denv_iac.core.balancer.haproxy": {"denv_iac.core.stack.model"},
        "denv_iac.core.stack.model": set(),
    }
    assert cycles(graph) == []
    assert cycles(rooms(graph)) == [["denv_iac.core.balancer", "denv_iac.core.stack"]]
    assert room_of("denv_iac.core.plan") == "denv_iac.core.plan"
    assert room_of("denv_iac.local.runner") == "denv_iac.local"


@pytest.mark.parametrize(
    ("graph", "found"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"a"}}, [["a"]]),
        # Across layers: the core's plan and the command that shows it, each importing the other.
        (
            {
                "denv_iac.core.plan": {"denv_iac.cli.plan"},
                "denv_iac.cli.plan": {"denv_iac.core.plan"},
            },
            [["denv_iac.cli.plan", "denv_iac.core.plan"]],
        ),
    ],
)
def test_the_cycle_check_sees_a_cycle(graph: dict[str, set[str]], found: list[list[str]]) -> None:
    assert cycles(graph) == found


def test_a_cycle_between_layers_is_refused_by_both_checks() -> None:
    """A cycle across layers holds an import up the layers: the cycle check refuses the loop,
    and the layer check the one import that goes up, naming the module that makes it."""
    graph = {
        "denv_iac.core.plan": {"denv_iac.core.placement"},
        "denv_iac.core.placement": {"denv_iac.stacks_dir"},
        "denv_iac.stacks_dir": {"denv_iac.core.plan"},
    }
    assert cycles(graph) == [sorted(graph)]
    refused = {m: layers_upward(m, sorted(deps)) for m, deps in graph.items()}
    assert refused == {
        "denv_iac.core.plan": [],
        "denv_iac.core.placement": ["denv_iac.stacks_dir (machines)"],
        "denv_iac.stacks_dir": [],
    }


@pytest.mark.parametrize(
    ("module", "imports", "upward"),
    [
        # What haproxy/runtime.py did before ChildProcess moved below it.
        ("denv_iac.haproxy.runtime", ["denv_iac.local.child"], ["denv_iac.local.child"]),
        (
            "denv_iac.waits",
            ["denv_iac.node.steps", "denv_iac.core.polling"],
            ["denv_iac.node.steps"],
        ),
        ("denv_iac.local.runner", ["denv_iac.haproxy.runtime", "denv_iac.child_process"], []),
    ],
)
def test_the_order_check_sees_an_upward_arrow(
    module: str, imports: list[str], upward: list[str]
) -> None:
    assert machines_upward(module, imports) == upward


# The load generator speaks the simulator's protocols through denv_iac.wire, never through the
# simulator itself: it measures any endpoint, and the simulator is one replica among others. The
# one operating tool on the local data plane is the demo, which runs a local stack and acts out
# faults on its replicas.
ON_LOCAL = ("denv_iac.ops.demo",)
OPS = [p for p in MODULES if _module(p).startswith("denv_iac.ops.") and _module(p) not in ON_LOCAL]


@pytest.mark.parametrize("path", OPS, ids=_module)
def test_the_operating_tools_import_no_local_data_plane(path: Path) -> None:
    local = [n for n in _imports(path) if n == "denv_iac.local" or n.startswith("denv_iac.local.")]
    assert local == [], f"{_module(path)} imports the local data plane: {local}"


# The benchmarks run on their own lab (benchmarks/lab/), which the tests share; they never import
# the tests, so that a benchmark runs from a checkout whatever the test suite holds.
BENCHMARKS = sorted((PACKAGE.parent / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize(
    "path", BENCHMARKS, ids=lambda p: str(p.relative_to(PACKAGE.parent / "benchmarks"))
)
def test_the_benchmarks_import_no_tests(path: Path) -> None:
    found = [n for n in _imports(path) if n == "tests" or n.startswith("tests.")]
    assert found == [], f"{path.name} imports the tests: {found}"


def _reads_own_data(call: ast.AST) -> bool:
    """Whether a call chain starts at `resources.files("denv_iac")`: the package's own data."""
    while isinstance(call, ast.Call | ast.Attribute):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "files"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "resources"
        ):
            return [ast.dump(a) for a in call.args] == [ast.dump(ast.Constant(OWN_DATA))]
        call = call.func if isinstance(call, ast.Call) else call.value
    return False


def io_in(source: str) -> list[str]:
    """The I/O a module's source does: imports of IO_MODULES, file-system calls, I/O builtins."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            for name in _imports_of(node):
                if name.split(".")[0] in IO_MODULES:
                    found.append(f"line {line}: import {name}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in IO_BUILTINS:
                found.append(f"line {line}: {func.id}()")
            elif (
                isinstance(func, ast.Attribute)
                and func.attr in IO_METHODS
                and not _reads_own_data(func.value)
            ):
                found.append(f"line {line}: .{func.attr}()")
    return found


CORE = [p for p in MODULES if _layer(_module(p)) == 0]


@pytest.mark.parametrize("path", CORE, ids=_module)
def test_the_core_does_no_io(path: Path) -> None:
    found = io_in(path.read_text())
    assert found == [], f"{_module(path)} (core) does I/O: {found}; move it to the machines layer"


WIRE = [p for p in MODULES if _module(p).startswith("denv_iac.wire")]


@pytest.mark.parametrize("path", WIRE, ids=_module)
def test_the_wire_does_io_only_on_the_streams_it_is_given(path: Path) -> None:
    """The shared protocols hold rules, not connections: asyncio's stream types are all the I/O
    they name, and only on the streams a caller opened."""
    found = [io for io in io_in(path.read_text()) if not io.endswith(": import asyncio")]
    assert found == [], f"{_module(path)} does I/O of its own: {found}"


@pytest.mark.parametrize("module", AGENT_IN_CORE)
def test_the_agent_modules_the_core_uses_do_no_io(module: str) -> None:
    path = PACKAGE.parent / "agent" / (module.replace(".", "/") + ".py")
    found = io_in(path.read_text())
    assert found == [], f"{module} (imported by the core) does I/O: {found}"
    assert [n for n in _imports(path) if n.startswith(("denv_agent", "denv_iac"))] == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import subprocess", ["line 1: import subprocess"]),
        ("from socket import socket", ["line 1: import socket"]),
        ("import os.path", ["line 1: import os.path"]),
        (
            "from concurrent.futures import ThreadPoolExecutor",
            ["line 1: import concurrent.futures"],
        ),
        ("from pathlib import Path\nPath('x').write_text('y')", ["line 2: .write_text()"]),
        ("def f(p):\n    return p.read_bytes()", ["line 2: .read_bytes()"]),
        ("print('x')", ["line 1: print()"]),
        ("from pathlib import Path\nPath.cwd() / 'stacks'", ["line 2: .cwd()"]),
        ("resources.files('other').joinpath('x').read_text()", ["line 1: .read_text()"]),
        # Allowed: path arithmetic, pure parsing, the package's own data.
        ("from pathlib import Path\nPath('a') / 'b'", []),
        ("import posixpath\nposixpath.join('a', 'b')", []),
        ("import io, csv\ncsv.reader(io.StringIO('a,b'))", []),
        ("resources.files('denv_iac').joinpath('data/catalog.json').read_text()", []),
    ],
)
def test_the_io_check_sees_io(source: str, found: list[str]) -> None:
    assert io_in(source) == found


README = PACKAGE.parent / "README.md"
# The README's names for the layers of LAYERS, in the same order.
README_LAYERS = ("pure core", "machines", "Pulumi wiring", "operating tools", "command")


def _layout_rows() -> list[tuple[str, list[str]]]:
    """(layer, package paths) of each row of the README's Layout table; a blank layer is the
    previous row's."""
    section = README.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows, layer = [], ""
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "---"):
            continue
        layer = cells[0] or layer
        rows.append((layer, re.findall(r"`(denv_iac/[^`]*)`", cells[1])))
    return rows


def test_the_readme_layout_table_matches_the_tree() -> None:
    """Each path the table names exists and sits in the layer of its row; every module and
    package at the top of denv_iac/, and at the top of the core, has a row of its own."""
    named: dict[str, str] = {}
    for layer, paths in _layout_rows():
        for path in paths:
            assert (PACKAGE.parent / path).exists(), f"README Layout names {path}: not in the tree"
            if not path.startswith("denv_iac/data/"):
                named[_module(PACKAGE.parent / path.rstrip("/"))] = layer
    assert len(README_LAYERS) == len(LAYERS)
    misplaced = {
        module: layer
        for module, layer in named.items()
        if (index := _layer(module)) is None or README_LAYERS[index] != layer
    }
    assert misplaced == {}, "README Layout puts these in another layer than tests/test_layers.py"

    def children(folder: Path) -> set[str]:
        return {
            _module(p)
            for p in folder.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
        }

    core = PACKAGE / "core"
    tops = (children(PACKAGE) - {"denv_iac.core"}) | children(core)
    assert tops - set(named) == set(), (
        "every module and package at the top of denv_iac/ and denv_iac/core/ has a row"
    )
