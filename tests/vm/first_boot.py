"""A VM's next boot made as unkind as a fresh cloud instance's first one.

A cloud reports a new instance running while it still boots: its sshd starts late (cloud-init
makes the host keys first), cloud-init's stages still run, and a first-boot job (unattended-
upgrades, apt-daily) holds the package locks. `first_boot_ahead` gives a booted VM all three for
its next boot only; `Vm.power_cycle` then starts it as a cloud starts an instance, reported
running at once.

- **sshd**: a drop-in on ssh.service holds it back `ssh_late_s` from its own start.
- **cloud-init**: a stand-in `/usr/bin/cloud-init` whose `status` says `running` until
  `/var/lib/cloud/instance/boot-finished` exists (the file cloud-init writes when its last stage
  ends) and whose `status --wait` waits for it; a unit writes the file `cloud_init_s` after it
  starts.
- **The package locks**: a unit holds dpkg's `lock-frontend` and `lock` and apt's lists lock for
  `lock_s`, as fcntl locks, the kind apt and dpkg take (flock(1) takes another kind, which apt
  never sees).

Each records the VM's uptime at its moments in RECORDS, for a test to see what a deploy met.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from tests.vm.bed import Vm

RECORDS = "/var/lib/denv-first-boot"
BOOT_FINISHED = "/var/lib/cloud/instance/boot-finished"
LOCKS = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock", "/var/lib/apt/lists/lock")
_SCRIPT = "/usr/local/sbin/denv-first-boot"

# `denv-first-boot sshd|cloud-init|locks SECONDS`: what each first-boot unit runs.
_JOBS = f"""#!/usr/bin/python3
import fcntl, sys, time
from pathlib import Path

RECORDS = Path({RECORDS!r})


def record(moment):
    RECORDS.mkdir(exist_ok=True)
    (RECORDS / moment).write_text(Path("/proc/uptime").read_text().split()[0])


role, seconds = sys.argv[1], float(sys.argv[2])
if role == "sshd":  # once: ssh.service starts again without waiting
    if not (RECORDS / "sshd-up").exists():
        record("sshd-held")
        time.sleep(seconds)
        record("sshd-up")
elif role == "cloud-init":
    record("cloud-init-start")
    time.sleep(seconds)
    Path({BOOT_FINISHED!r}).parent.mkdir(parents=True, exist_ok=True)
    Path({BOOT_FINISHED!r}).touch()
    record("cloud-init-done")
elif role == "locks":
    held = [open(path, "a") for path in {LOCKS!r}]
    for file in held:
        fcntl.lockf(file, fcntl.LOCK_EX)
    record("locks-taken")
    time.sleep(seconds)
    record("locks-released")  # then let go, as the process ends
"""

_CLOUD_INIT = f"""#!/bin/sh
# A stand-in for cloud-init's status: running until its last stage writes boot-finished.
case "$*" in
  status) ;;
  "status --wait") until [ -e {BOOT_FINISHED} ]; do sleep 1; done ;;
  *) echo "cloud-init stand-in: only status and status --wait" >&2; exit 1 ;;
esac
if [ -e {BOOT_FINISHED} ]; then echo "status: done"; else echo "status: running"; fi
"""


def _unit(description: str, condition: str, command: str) -> str:
    return (
        f"[Unit]\nDescription={description}\nConditionPathExists=!{condition}\n\n"
        f"[Service]\nExecStart={command}\n\n[Install]\nWantedBy=multi-user.target\n"
    )


@dataclass(frozen=True)
class FirstBoot:
    ssh_late_s: int  # sshd starts this long after ssh.service does
    cloud_init_s: int  # cloud-init's stages end this long after they start
    lock_s: int  # the package locks are held this long from early in the boot


def first_boot_ahead(vm: Vm, first: FirstBoot) -> None:
    """Make the VM's next boot a fresh cloud instance's first (once: the boots after it are
    plain). Nothing changes on the running boot but the files."""
    files = {
        _SCRIPT: _JOBS,
        "/usr/bin/cloud-init": _CLOUD_INIT,
        "/etc/systemd/system/ssh.service.d/denv-first-boot.conf": (
            f"[Service]\nExecStartPre={_SCRIPT} sshd {first.ssh_late_s}\nTimeoutStartSec=300\n"
        ),
        "/etc/systemd/system/denv-first-boot-cloud-init.service": _unit(
            "cloud-init's boot stages (a stand-in)",
            BOOT_FINISHED,
            f"{_SCRIPT} cloud-init {first.cloud_init_s}",
        ),
        "/etc/systemd/system/denv-first-boot-locks.service": _unit(
            "first-boot package upgrades holding the package locks (a stand-in)",
            f"{RECORDS}/locks-released",
            f"{_SCRIPT} locks {first.lock_s}",
        ),
    }
    writes = " && ".join(
        f"mkdir -p $(dirname {path}) && printf %s {shlex.quote(text)} > {path}"
        for path, text in files.items()
    )
    vm.ssh(
        f"{writes} && chmod 755 {_SCRIPT} /usr/bin/cloud-init && rm -rf {RECORDS} {BOOT_FINISHED}"
        " && systemctl daemon-reload"
        " && systemctl enable denv-first-boot-cloud-init.service denv-first-boot-locks.service"
    )


def first_boot_record(vm: Vm) -> dict[str, float]:
    """The VM's uptime at each first-boot moment it has passed, by name."""
    out = vm.ssh(f"cd {RECORDS} && grep -H . *")
    return {name: float(value) for name, value in (line.split(":") for line in out.split())}
