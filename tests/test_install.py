"""The two packages install the way a team installs them, each into a fresh virtual environment.

With no index: third-party packages come from the wheelhouse `make setup` filled, at
requirements.lock's pins; denv-iac and denv-agent come from this tree, built by uv or by pip
itself. No index is consulted, so denv-agent (on none) must be found the way the install line
finds it.
"""

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.components.stacks import SSH_KEYS
from tests.wheelhouse import no_index

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("team_program_probe.py")
VERSION = version("denv-iac")
WHEELS = (f"denv_agent-{VERSION}-py3-none-any.whl", f"denv_iac-{VERSION}-py3-none-any.whl")
SDISTS = (f"denv_agent-{VERSION}.tar.gz", f"denv_iac-{VERSION}.tar.gz")


def _uv() -> str:
    uv = shutil.which("uv")
    assert uv, "uv is not on PATH; `make setup` installs it"
    return uv


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _venv(path: Path, *requirements: str | Path) -> Path:
    """A fresh environment with `requirements` (uv's arguments), from the wheelhouse; its python."""
    _run(_uv(), "venv", "--quiet", "--python", sys.executable, path)
    python = path / "bin" / "python"
    if requirements:
        _run(_uv(), "pip", "install", *no_index(), "--quiet", "--python", python, *requirements)
    return python


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """requirements.lock less our own two packages: every third-party pin, hashes included."""
    path = tmp_path_factory.mktemp("lock") / "third-party.txt"
    lines = (ROOT / "requirements.lock").read_text("utf-8").splitlines()
    path.write_text("\n".join(line for line in lines if not line.startswith("-e ")) + "\n")
    return path


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # The build backend (setuptools, locked) comes from the wheelhouse too.
    _run(_uv(), "build", "--all-packages", *no_index(), "--quiet", "--out-dir", out, cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git repository holding this tree as it is now, as a team's clone of it would."""
    repo = tmp_path_factory.mktemp("checkout")
    listed = _run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    git = ("git", "-c", "user.name=test", "-c", "user.email=test@example.com")
    _run(*git, "init", "--quiet", cwd=repo)
    _run(*git, "add", "--all", cwd=repo)
    _run(*git, "commit", "--quiet", "--message", "snapshot", cwd=repo)
    return repo


# The package's own data: the catalog, and the programs it ships as files.
DATA_FILES = [
    "data/catalog.json",
    *(f"data/scripts/{p.name}" for p in (ROOT / "denv_iac" / "data" / "scripts").iterdir()),
]


def test_uv_build_gives_both_wheels_and_sdists_with_the_catalog(dist: Path) -> None:
    assert sorted(p.name for p in dist.glob("denv_*")) == sorted((*WHEELS, *SDISTS))
    with tarfile.open(dist / SDISTS[1]) as sdist:
        for data in DATA_FILES:
            assert f"denv_iac-{VERSION}/denv_iac/{data}" in sdist.getnames()
        pkg_info = sdist.extractfile(f"denv_iac-{VERSION}/PKG-INFO")
        assert pkg_info is not None
        sdist_metadata = pkg_info.read().decode()
    with zipfile.ZipFile(dist / WHEELS[1]) as wheel:
        assert {f"denv_iac/{data}" for data in DATA_FILES} <= set(wheel.namelist())
        wheel_metadata = wheel.read(f"denv_iac-{VERSION}.dist-info/METADATA").decode()
    # Both go to other machines: they name the agent by version, never by a path on this one.
    for metadata in (sdist_metadata, wheel_metadata):
        assert f"Requires-Dist: denv-agent=={VERSION}" in metadata.splitlines()
        assert "file:" not in metadata


def test_the_built_wheels_run_a_team_program(dist: Path, third_party: Path, tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv", "--constraint", third_party, *(dist / w for w in WHEELS))
    key = tmp_path / "gpu_key"
    key.write_text(SSH_KEYS["office"], "utf-8")
    team = ROOT / "examples" / "team-repo"
    report = json.loads(_run(python, PROBE, team, key, cwd=tmp_path))
    assert Path(report["denv_iac"]).is_relative_to(tmp_path / "venv")
    types = report["types"]
    assert types["aws:s3/bucket:Bucket"] == 1 and types["denv:index:Cluster"] == 1
    assert types["denv:index:NodeSetup"] >= 2  # the office machine and the AWS nodes
    assert report["endpoint"].endswith(":8080")  # the balancer port the stack file sets
    versions = _run(tmp_path / "venv" / "bin" / "denv", "--version").splitlines()
    assert versions == [f"denv-iac {VERSION}", f"denv-agent {VERSION}"]


@pytest.fixture
def pip_env(third_party: Path, tmp_path: Path) -> Iterator[Path]:
    """A fresh environment with pip and every third-party package but without ours."""
    yield _venv(tmp_path / "venv", "--require-hashes", "--requirement", third_party)


@pytest.mark.parametrize(
    "line",
    [("./agent", "."), (".",), ("denv-iac @ git+file://{checkout}",)],
    ids=["agent-and-checkout", "checkout", "git-url"],
)
def test_pip_installs_the_checkout_and_finds_the_agent_in_it(
    pip_env: Path, checkout: Path, line: tuple[str, ...]
) -> None:
    requirements = [arg.format(checkout=checkout) for arg in line]
    # --no-index: the agent must come from the checkout, as no index has it. --isolated keeps
    # this machine's pip configuration out; the build backend is installed, as no index serves it.
    pip = (pip_env, "-m", "pip", "install", "--isolated", "--no-index", "--no-build-isolation")
    _run(*pip, "--quiet", *requirements, cwd=checkout)
    denv = pip_env.parent / "denv"
    assert _run(denv, "--version").splitlines() == [
        f"denv-iac {VERSION}",
        f"denv-agent {VERSION}",
    ]
    shown = _run(pip_env, "-m", "pip", "show", "--files", "denv-agent")
    assert "denv_agent/agent.py" in shown
