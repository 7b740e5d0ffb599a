"""Before a driver install on a fresh host: nouveau blacklisted (the initramfs rebuilt with it)
and the running kernel's headers installed; nothing of it where no driver is installed."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from denv_iac.node import NodeDeploySpec, NodeFacts, plan_node
from denv_iac.node.driver import NOUVEAU_CONF, install_steps, nouveau_blacklist

from .fixtures import DEBIAN_12, node_facts

SPEC = NodeDeploySpec(node_id="n1")
HEADERS = "install linux-headers-6.8.0-45-generic (the driver's modules are built against them)"
BLACKLIST = f"blacklist nouveau ({NOUVEAU_CONF})"
WRITTEN = {NOUVEAU_CONF: nouveau_blacklist().sha256}
LAMBDA_570 = {"nvidia-driver-570-server-open": "570.172.08-0ubuntu1"}


@pytest.mark.parametrize(
    ("case", "facts", "expected"),
    [
        ("fresh joined host", node_facts(), [BLACKLIST, HEADERS]),
        ("fresh Debian 12 host", node_facts(os=DEBIAN_12), [BLACKLIST, HEADERS]),
        (
            "another branch replaced",
            node_facts(driver="570.172.08", packages=LAMBDA_570),
            [BLACKLIST, HEADERS],
        ),
        (
            "blacklist there, headers there",
            node_facts(files=WRITTEN, packages={"linux-headers-6.8.0-45-generic": "6.8.0-45.45"}),
            [],
        ),
        (
            "blacklist edited since",
            node_facts(files={NOUVEAU_CONF: "0" * 64}),
            [BLACKLIST, HEADERS],
        ),
        # A chroot runs the build host's kernel: its release names no headers of the image's.
        ("image build in a chroot", node_facts(systemd=False), [BLACKLIST]),
        ("working driver of the branch", node_facts(driver="580.95.05"), []),
        (
            "modules to reload, nothing installed",
            node_facts(
                packages={"nvidia-open": "580.95.05-1"},
                smi_error="Failed to initialize NVML: Driver/library version mismatch",
            ),
            [],
        ),
    ],
)
def test_prerequisites_come_before_a_driver_install_only(
    case: str, facts: NodeFacts, expected: list[str]
) -> None:
    titles = [s.title for s in plan_node(facts, SPEC) if s.area == "driver"]
    assert [t for t in titles if t in (BLACKLIST, HEADERS)] == expected, case
    if expected:
        install = titles.index("pin branch 580 and install nvidia-open")
        assert all(titles.index(t) < install for t in expected), case


def test_the_headers_follow_the_running_kernel_and_the_repair_reinstall_gets_them_too() -> None:
    facts = dataclasses.replace(node_facts(), kernel="6.1.0-28-cloud-amd64")
    steps = install_steps(facts, SPEC, purge=[])
    assert (
        steps[1]
        .commands[0]
        .endswith("install --no-install-recommends linux-headers-6.1.0-28-cloud-amd64")
    )
    assert steps[1].uses_apt


def test_what_the_blacklist_step_writes_is_what_the_next_run_compares() -> None:
    blacklist = next(s for s in plan_node(node_facts(), SPEC) if s.title == BLACKLIST)
    write, initramfs = blacklist.commands
    printed = write.split(" && ", 1)[1].rsplit(" > ", 1)[0]
    out = subprocess.run(["sh", "-c", printed], capture_output=True, check=True).stdout
    assert out == nouveau_blacklist().content == b"blacklist nouveau\noptions nouveau modeset=0\n"
    assert "update-initramfs -u" in initramfs


@pytest.mark.parametrize(
    ("modules", "rebuilt"),
    [(["6.8.0-45-generic/kernel/drivers/gpu/drm/nouveau/nouveau.ko.zst"], True), ([], False)],
    ids=["a kernel with nouveau", "cloud kernel without it"],
)
def test_the_initramfs_is_rebuilt_only_where_a_kernel_has_nouveau(
    tmp_path: Path, modules: list[str], rebuilt: bool
) -> None:
    blacklist = next(s for s in plan_node(node_facts(), SPEC) if s.title == BLACKLIST)
    # The command as the node runs it, against a stand-in /lib/modules and update-initramfs.
    command = blacklist.commands[1].replace("/lib/modules", str(tmp_path / "modules"))
    (tmp_path / "modules").mkdir()
    for module in modules:
        (tmp_path / "modules" / module).parent.mkdir(parents=True)
        (tmp_path / "modules" / module).touch()
    tool = tmp_path / "bin" / "update-initramfs"
    tool.parent.mkdir()
    tool.write_text(f'#!/bin/sh\necho "$*" > {tmp_path}/called\n')
    tool.chmod(0o755)
    env = {"PATH": f"{tmp_path}/bin:/usr/bin:/bin"}
    subprocess.run(["sh", "-c", command], env=env, check=True)
    assert (tmp_path / "called").exists() is rebuilt
