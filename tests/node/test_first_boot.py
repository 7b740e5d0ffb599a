"""A machine's first boot, as a fresh cloud image has it: cloud-init still running, and
unattended-upgrades holding the package lock. The plans wait for both; the waits' commands are
run for real here, against this machine's apt in a scratch state and a stand-in cloud-init."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from denv_iac.node import plan_node
from denv_iac.node.balancer_host import plan_host
from denv_iac.node.facts import FactQuery, parse_facts, probe_script
from denv_iac.node.firewall import BalancerAccess
from denv_iac.node.steps import APT_LOCK_WAIT_S, APT_UPDATE, Step, apt_install

from .fixtures import node_facts
from .test_balancer_host import RENDERED
from .test_plan import commands, spec

WAIT_TITLE = "base: wait for cloud-init's first boot to finish"
LOCK_WAIT = f"-o DPkg::Lock::Timeout={APT_LOCK_WAIT_S}"
HELD_S = 2.0  # how long the tests hold a lock


def titles(steps: list[Step]) -> list[str]:
    return [f"{step.area}: {step.title}" for step in steps]


@pytest.mark.parametrize(
    ("status", "waits"),
    [
        ("running", True),
        ("degraded running", True),
        ("done", False),
        ("degraded done", False),
        ("error", False),
        ("disabled", False),
        (None, False),  # no cloud-init on the machine
    ],
)
def test_a_node_and_a_balancer_host_wait_for_cloud_init_first_while_it_runs(
    status: str | None, waits: bool
) -> None:
    facts = node_facts(cloud_init=status)
    access = BalancerAccess((), 8405)
    for steps in (plan_node(facts, spec()), plan_host(facts, RENDERED, access)):
        assert (titles(steps)[0] == WAIT_TITLE) is waits
        assert titles(steps).count(WAIT_TITLE) == int(waits)
    if waits:
        (wait,) = plan_node(facts, spec())[0].commands
        assert wait.startswith("timeout 900 cloud-init status --wait")


def test_every_apt_command_of_a_fresh_node_and_balancer_host_waits_for_the_package_lock() -> None:
    facts = node_facts(packages={})  # not even the base tools
    node = commands(plan_node(facts, spec()))
    host = commands(plan_host(facts, RENDERED, BalancerAccess((), 8405)))
    apt = [c for c in node + host if "apt-get" in c]
    assert len(apt) >= 6
    for command in apt:
        assert command == APT_UPDATE or LOCK_WAIT in command, command
    # dpkg itself waits for no lock: the keyring package goes through apt too.
    assert not [c for c in node + host if c.startswith("dpkg ")]
    assert apt_install("/tmp/cuda-keyring_1.1-1_all.deb") in node


def test_the_probe_reads_what_cloud_init_says_and_nothing_without_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = probe_script(FactQuery())
    bare = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout
    assert parse_facts(bare.splitlines()).cloud_init is None
    stub = bin_dir / "cloud-init"
    stub.write_text("#!/bin/sh\necho 'status: running'\n")
    stub.chmod(0o755)
    out = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    ).stdout
    assert parse_facts(out.splitlines()).cloud_init == "running"


def test_the_cloud_init_wait_goes_on_whatever_cloud_init_ended_with(tmp_path: Path) -> None:
    (wait,) = plan_node(node_facts(cloud_init="running"), spec())[0].commands
    stub = tmp_path / "cloud-init"
    stub.write_text("#!/bin/sh\nsleep 1\necho 'status: error'\nexit 1\n")
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    started = time.monotonic()
    subprocess.run(["sh", "-c", wait], check=True, env=env, timeout=60)
    assert time.monotonic() - started >= 1


# Real apt, in a scratch state of its own: a wrapper named apt-get on PATH points it there.
needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get (Debian)")


def _scratch_apt(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """PATH leading to an apt-get that works in `tmp_path`; its lists and dpkg frontend locks."""
    lists, admin, cache = tmp_path / "lists", tmp_path / "dpkg", tmp_path / "cache"
    for folder in (lists / "partial", admin, cache / "archives/partial", tmp_path / "parts"):
        folder.mkdir(parents=True)
    (admin / "status").touch()
    (tmp_path / "sources.list").touch()
    real = shutil.which("apt-get")
    options = (
        f"-o Dir::State::Lists={lists} -o Dir::State::status={admin}/status "
        f"-o Dir::Cache={cache} -o Dir::Etc::SourceList={tmp_path}/sources.list "
        f"-o Dir::Etc::SourceParts={tmp_path}/parts"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "apt-get"
    wrapper.write_text(f'#!/bin/sh\nexec {real} {options} "$@"\n')
    wrapper.chmod(0o755)
    return (
        {"PATH": f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin"},
        lists / "lock",
        admin / "lock-frontend",
    )


def _held(lock: Path) -> threading.Event:
    """Hold `lock` as apt and dpkg do (fcntl) for HELD_S; set once it is held."""
    held = threading.Event()

    def hold() -> None:
        with lock.open("a") as file:
            fcntl.lockf(file, fcntl.LOCK_EX)
            held.set()
            time.sleep(HELD_S)

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(10)
    return held


@needs_apt
def test_the_index_refresh_tries_again_while_another_apt_holds_the_lists_lock(
    tmp_path: Path,
) -> None:
    env, lists_lock, _ = _scratch_apt(tmp_path)
    _held(lists_lock)
    started = time.monotonic()
    done = subprocess.run(["sh", "-c", APT_UPDATE], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started >= HELD_S


@needs_apt
def test_an_install_waits_while_another_apt_holds_the_dpkg_lock(tmp_path: Path) -> None:
    env, _, frontend_lock = _scratch_apt(tmp_path)
    _held(frontend_lock)
    started = time.monotonic()
    done = subprocess.run(["sh", "-c", apt_install()], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started >= HELD_S - 0.5
