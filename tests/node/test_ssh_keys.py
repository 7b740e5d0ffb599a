"""The SSH login's keys: a rotated stack key reaches running machines through the deploy.

The plan is pure and table-driven; its command and the fact probe's lines run for real in a
copy of the cached Debian root (chroot), for root and for an unprivileged login.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from denv_iac.node.facts import NodeFacts, parse_facts, probe_script
from denv_iac.node.plan import plan_node
from denv_iac.node.ssh_keys import SshKeys, fact_query, key_blob, plan
from tests.node.fixtures import converged, node_facts
from tests.node.test_plan import FRESH, spec

OLD = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOldOldOldOldOldOldOldOldOldOldOldOldOldOld stack"
NEW = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINewNewNewNewNewNewNewNewNewNewNewNewNewNew"
MINE = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQMine admin@laptop"
ROTATION = SshKeys("ubuntu", NEW, (OLD,))


def _found(*keys: str, user: str = "ubuntu") -> NodeFacts:
    return NodeFacts(ssh_keys=frozenset(f"{user}:{key_blob(k)}" for k in keys))


@pytest.mark.parametrize(
    ("present", "title"),
    [
        ((OLD,), "authorize the stack's key and remove 1 retired key(s) for ubuntu"),
        ((OLD, NEW), "remove 1 retired key(s) for ubuntu"),
        ((), "authorize the stack's key for ubuntu"),
        ((NEW,), None),
        ((NEW, MINE), None),  # keys the stack never had are the machine's own: left alone
    ],
)
def test_a_rotation_adds_the_new_key_and_removes_the_old_only_where_needed(
    present: tuple[str, ...], title: str | None
) -> None:
    steps = plan(_found(*present), ROTATION)
    assert [s.title for s in steps] == ([title] if title else [])
    for step in steps:
        assert step.area == "ssh" and len(step.commands) == 1
        (command,) = step.commands
        assert (NEW in command) == (NEW not in present)
        assert (key_blob(OLD) in command) == (OLD in present)
        assert key_blob(MINE) not in command


def test_without_keys_the_login_is_left_alone_and_nothing_is_probed() -> None:
    assert plan(_found(OLD), None) == [] and fact_query(None).ssh_keys == ()
    assert fact_query(ROTATION).ssh_keys == (
        f"ubuntu:{key_blob(NEW)}",
        f"ubuntu:{key_blob(OLD)}",
    )


def test_the_node_deploy_authorizes_the_key_before_any_other_change() -> None:
    steps = plan_node(node_facts(), spec(), keys=ROTATION)
    first_change = next(s for s in steps if s.title != "refresh the package index")
    assert (first_change.area, first_change.title) == (
        "ssh",
        "authorize the stack's key for ubuntu",
    )
    # A converged node whose login still has the old key: the rotation is the only change.
    done = converged(node_facts(), spec(), FRESH)
    rotated = dataclasses.replace(done, ssh_keys=_found(OLD).ssh_keys)
    assert [s.area for s in plan_node(rotated, spec(), keys=ROTATION)] == ["ssh"]
    landed = dataclasses.replace(done, ssh_keys=_found(NEW).ssh_keys)
    assert plan_node(landed, spec(), keys=ROTATION) == []


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("chroot") is None, reason="chroot needs root"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from tests.node.debian_root import CACHE_DIR

    if not (CACHE_DIR / "etc/debian_version").is_file():
        pytest.skip("needs the cached Debian root (built by tests/node/test_chroot_deploy.py)")
    work = tmp_path_factory.mktemp("keys") / "root"
    subprocess.run(["cp", "-a", "--reflink=auto", str(CACHE_DIR), str(work)], check=True)
    _sh(work, "useradd -m -s /bin/sh ubuntu")
    yield work
    shutil.rmtree(work, ignore_errors=True)


def _sh(root: Path, script: str) -> str:
    done = subprocess.run(
        ["chroot", str(root), "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _probe(root: Path, keys: SshKeys) -> NodeFacts:
    return parse_facts(_sh(root, probe_script(fact_query(keys))).splitlines())


@needs_root
@pytest.mark.parametrize(("user", "home"), [("ubuntu", "home/ubuntu"), ("root", "root")])
def test_a_rotation_runs_for_real_and_a_second_deploy_changes_nothing(
    root: Path, user: str, home: str
) -> None:
    keys = SshKeys(user, NEW, (OLD,))
    folder = root / home / ".ssh"
    shutil.rmtree(folder, ignore_errors=True)
    # A fresh login has no folder: the deploy makes it, the user's own, 0700.
    (step,) = plan(_probe(root, keys), keys)
    _sh(root, step.commands[0])
    assert (folder / "authorized_keys").read_text() == NEW + "\n"
    # As a cloud made it: the old stack key and the admin's own.
    (folder / "authorized_keys").write_text(f"{OLD}\n{MINE}\n")
    (step,) = plan(_probe(root, keys), keys)
    _sh(root, step.commands[0])
    assert (folder / "authorized_keys").read_text() == f"{MINE}\n{NEW}\n"
    info = (folder / "authorized_keys").stat()
    assert oct(info.st_mode & 0o777) == "0o600" and oct(folder.stat().st_mode & 0o777) == "0o700"
    owner = _sh(root, f"stat -c %U {'/' + home}/.ssh {'/' + home}/.ssh/authorized_keys").split()
    assert owner == [user, user]
    assert plan(_probe(root, keys), keys) == []
