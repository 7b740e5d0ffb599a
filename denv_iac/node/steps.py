"""The unit of a node plan: what to change and why, decided from facts, run by pyinfra later."""

from __future__ import annotations

import hashlib
import posixpath
import shlex
from dataclasses import dataclass, field

from denv_iac.core.drain import DrainPlan
from denv_iac.core.scripts import script
from denv_iac.core.stack.values import control_character

UNIT_DIR = "/etc/systemd/system"
PACKAGE_UNIT_DIR = "/lib/systemd/system"
WANTS_DIR = f"{UNIT_DIR}/multi-user.target.wants"
# A fresh cloud machine runs unattended-upgrades (and apt-daily's index refresh) at first boot:
# apt would fail at once on the lock they hold. Installs wait for dpkg's lock up to this long
# (`DPkg::Lock::Timeout`); `apt-get update` takes no lock timeout (apt 2.6 fails at once on a
# held lists lock whatever DPkg::Lock::Timeout or Acquire::Lock::Timeout say), so it is tried
# again every APT_RETRY_S while the lock is the reason, as long.
APT_LOCK_WAIT_S = 300
APT_RETRY_S = 5
# Keep the node's own edits of conffiles and never stop on a debconf question.
APT = (
    "DEBIAN_FRONTEND=noninteractive apt-get -y -q "
    "-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "
    f"-o DPkg::Lock::Timeout={APT_LOCK_WAIT_S}"
)
# cloud-init's states (`cloud-init status`) while its boot stages still run: they install
# packages and write files a deploy also writes. sshd starts after its first stage, so a
# machine that answers SSH shows one of these or a finished state.
CLOUD_INIT_RUNNING = frozenset({"running", "degraded running"})
CLOUD_INIT_WAIT_S = 900


@dataclass(frozen=True)
class FileContent:
    """A file to put on the node; compared with the node's copy by SHA-256."""

    path: str
    content: bytes = field(repr=False)  # may be a secret (a key, a token): never shown
    mode: str = "0644"

    @property
    def private(self) -> bool:
        """Readable by its owner only: the content must never be readable by others."""
        return int(self.mode, 8) & 0o077 == 0

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclass(frozen=True)
class Step:
    """One change: the file is written first, then the commands run; a reboot comes last."""

    area: str
    title: str
    commands: tuple[str, ...] = ()
    file: FileContent | None = None
    reboot: bool = False
    uses_apt: bool = False  # needs a fresh package index; plan_node puts an apt update first

    def describe(self) -> list[str]:
        lines = [f"{self.area}: {self.title}"]
        if self.file is not None:
            lines.append(f"    write {self.file.path} (mode {self.file.mode})")
        lines += [f"    $ {command}" for command in self.commands]
        if self.reboot:
            lines.append("    reboot, then reconnect")
        return lines


def text_file(path: str, text: str, mode: str = "0644") -> FileContent:
    return FileContent(path, text.encode(), mode)


def cloud_init_wait(status: str | None) -> list[Step]:
    """A wait for cloud-init's boot stages to finish, when they still run (`status`: what
    `cloud-init status` says; None where there is no cloud-init); bounded by
    CLOUD_INIT_WAIT_S. Whether they succeeded is cloud-init's own business: the deploy goes on."""
    if status not in CLOUD_INIT_RUNNING:
        return []
    command = (
        f"timeout {CLOUD_INIT_WAIT_S} cloud-init status --wait >/dev/null; "
        f'[ "$?" -ne 124 ] || {{ echo "cloud-init still running after {CLOUD_INIT_WAIT_S} s"; '
        "exit 1; }"
    )
    return [Step("base", "wait for cloud-init's first boot to finish", (command,))]


def with_package_index(steps: list[Step]) -> list[Step]:
    """`steps`, led by one refresh of the package index when any of them installs from it."""
    if any(step.uses_apt for step in steps):
        return [Step("base", "refresh the package index", (APT_UPDATE,)), *steps]
    return steps


def apt_install(*packages: str) -> str:
    return f"{APT} install --no-install-recommends " + " ".join(map(shlex.quote, packages))


def apt_purge(*packages: str) -> str:
    return f"{APT} purge " + " ".join(map(shlex.quote, packages))


def enable_link(unit: str, unit_dir: str = UNIT_DIR) -> str:
    """What `systemctl enable` does for a WantedBy=multi-user.target unit, without systemd."""
    return (
        f"mkdir -p {WANTS_DIR} && "
        f"ln -sfn {posixpath.join(unit_dir, unit)} {posixpath.join(WANTS_DIR, unit)}"
    )


def wants_link(unit: str) -> str:
    return posixpath.join(WANTS_DIR, unit)


def unit_path(unit: str) -> str:
    return posixpath.join(UNIT_DIR, unit)


def systemd_quote(argument: str) -> str:
    """One ExecStart= argument, quoted the way systemd splits and expands command lines.

    Control characters are written as C escapes, which systemd decodes: a raw newline would end
    the directive and start one of the writer's choosing.
    """
    escaped = argument.replace("%", "%%").replace("$", "$$")
    if escaped and not any(c in escaped for c in " \t\"'\\;") and not control_character(escaped):
        return escaped
    quoted = escaped.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(_c_escape(c) if control_character(c) else c for c in quoted) + '"'


def _c_escape(character: str) -> str:
    code = ord(character)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def set_deadline(var: str, seconds: int) -> str:
    """Shell: `var` holds the epoch second `seconds` from now."""
    return f"{var}=$(( $(date +%s) + {seconds} ))"


def before_deadline(var: str) -> str:
    """A shell test: the deadline in `var` has not passed."""
    return f'[ "$(date +%s)" -le "${var}" ]'


# apt's messages in English (LC_ALL=C), so that its "Could not get lock" is found in them.
APT_UPDATE = (
    f"{set_deadline('end', APT_LOCK_WAIT_S)}; "
    "until out=$(LC_ALL=C DEBIAN_FRONTEND=noninteractive apt-get -q update 2>&1); do "
    'case "$out" in *"Could not get lock"*) ;; *) printf \'%s\\n\' "$out"; exit 1 ;; esac; '
    f"{before_deadline('end')} || {{ printf '%s\\n' \"$out\" "
    f'"package index lock still held after {APT_LOCK_WAIT_S} s"; exit 1; }}; '
    f"sleep {APT_RETRY_S}; done"
)


# data/scripts/busy_connections.awk reads `ss -Htni` (a connection's line, then its TCP info
# line) and prints how many connections carry work, how many are idle, then each busy peer's
# address and count, by the drain plan's rule (denv_iac.core.drain).
_BUSY_AWK = script("busy_connections.awk")


def wait_streams_command(ports: list[int], plan: DrainPlan) -> str:
    """Shell, run right after a drain, by its plan (denv_iac.core.drain): first its settle
    time, the time the balancers take to hear the drain at their next agent check (a node's
    `rejoin_s`), so that no request they still send lands after the count; then wait until no
    connection to `ports` carries work, at most its bound (by the clock, not by rounds: a round
    takes longer on a busy machine); past it, say how many are left and who held them (peer
    address and count): those get cut. A connection that moved no byte either way for its
    quiet window is idle (a balancer's connection kept for reuse), not waited for: it closes
    with the replica, and the end names how many."""
    timeout_s, quiet_s, settle_s = plan.bound_s, plan.quiet_s, plan.settle_s
    match = " or ".join(f"sport = :{port}" for port in ports)
    count = (
        f"ss -Htni state established '( {match} )'"
        f" | awk -v quiet={quiet_s * 1000} {shlex.quote(_BUSY_AWK)}"
    )
    idle_note = f"idle connection(s), quiet for {quiet_s} s or more, left to close with it"
    return (
        "command -v ss >/dev/null || { echo 'ss missing: not waited'; exit 0; }; "
        f"sleep {settle_s}; {set_deadline('end', timeout_s)}; while :; do "
        f"set -- $({count}); n=$1 idle=$2; shift 2; "
        '[ "$n" -eq 0 ] && { if [ "$idle" -eq 0 ]; then echo "no streams open"; '
        f'else echo "no streams open; $idle {idle_note}"; fi; break; }}; '
        f"{before_deadline('end')} || {{ "
        f'echo "$n connections still open after {timeout_s} s (from $*): cut"; break; }}; '
        "sleep 1; done"
    )
