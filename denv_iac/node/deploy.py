"""The pyinfra layer: connect to a node, read its facts, run planned steps as operations."""

from __future__ import annotations

import errno
import logging
import posixpath
import shlex
import uuid
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

from paramiko import SSHException
from paramiko.ssh_exception import NoValidConnectionsError
from pyinfra.api.command import FileUploadCommand, StringCommand
from pyinfra.api.config import Config
from pyinfra.api.exceptions import ConnectError, PyinfraError
from pyinfra.api.host import Host
from pyinfra.api.inventory import Inventory
from pyinfra.api.operation import add_op, operation
from pyinfra.api.operations import run_ops
from pyinfra.api.state import BaseStateCallback, State
from pyinfra.operations import server

from denv_iac.core.stack.values import HOST_RULE, USER_NAME, USER_RULE, is_host
from denv_iac.node.facts import FactQuery, NodeFacts, NodeProbe
from denv_iac.node.plan import fact_query, plan_node
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.ssh_keys import SshKeys
from denv_iac.node.ssh_keys import fact_query as key_query
from denv_iac.node.steps import Step
from denv_iac.waits import wait_until

# Called with (index from 1, total, step, status) where status is "run", "ok" or "failed".
Progress = Callable[[int, int, Step, str], None]


class NodeUnreachable(RuntimeError):
    """Could not connect to the node; the message says where and why (never a key's content).
    `answered`: something at the address answered (an SSH server that refused the key or showed
    another host key, or spoke no SSH); False when nothing did (see `no_answer`)."""

    def __init__(self, message: str, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


# Connection errors that mean nothing at the address answers: refused (a machine without our
# sshd there), no route to the host or the host down (ICMP from the path), or a timeout. Not
# ENETUNREACH: no route to the whole network is the deployer's own network, down.
_NO_ANSWER = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT})


class CannotConnect(NodeUnreachable):
    """The first connection failed: nothing was read or changed on the node."""


class StepFailed(RuntimeError):
    """A step's command failed on the node; later steps were not run."""

    def __init__(self, step: Step, output: str) -> None:
        super().__init__(f"{step.area}: {step.title} failed" + (f": {output}" if output else ""))
        self.step = step
        self.output = output


@dataclass(frozen=True)
class Target:
    """Where a node is: `@local`, `@chroot/<path>`, or `[user@]host[:port]` over SSH."""

    host: str
    user: str | None = None
    port: int | None = None
    key: Path | None = None
    sudo: bool = False

    @property
    def is_ssh(self) -> bool:
        return not self.host.startswith("@")

    def inventory(self) -> tuple[str, dict[str, Any]]:
        if not self.is_ssh:
            return self.host, {}
        name, user = self.host, self.user
        if "@" in name:
            user, name = name.split("@", 1)
        port = self.port
        if name.count(":") == 1:
            name, port_text = name.split(":")
            port = int(port_text) if port_text.isdigit() else port
        data: dict[str, Any] = {"ssh_hostname": name}
        if user:
            data["ssh_user"] = user
        if port:
            data["ssh_port"] = port
        if self.key is not None:
            data["ssh_key"] = str(self.key)
        return name, data


def check_target(target: Target) -> list[str]:
    """Problems with a target before connecting, one line each naming the option and fix."""
    problems = []
    # A control character would break the one-line message: such a host is shown quoted.
    host = target.host if target.host.isprintable() else repr(target.host)
    if target.host.startswith("@chroot/"):
        root = Path(target.host.removeprefix("@chroot"))
        if not (root / "bin/sh").exists():
            problems.append(f"HOST {host}: {root} is not a root file system (no /bin/sh)")
    elif target.host.startswith("@") and target.host != "@local":
        problems.append(f"HOST {host}: use @local, @chroot/<path> or [user@]host[:port]")
    elif target.is_ssh:
        problems += _ssh_target_problems(target)
    if target.key is not None:
        try:
            with target.key.open("rb"):
                pass
        except OSError as error:
            problems.append(f"--key {target.key}: cannot read it ({error.strerror})")
    if not _port_ok(target.host):
        problems.append(f"HOST {host}: the port after ':' must be a number")
    return problems


def _ssh_target_problems(target: Target) -> list[str]:
    """An SSH host or user starting with '-' would reach ssh as an option (-oProxyCommand=...)."""
    if not target.host:
        return ["HOST: empty; give [user@]host[:port], @local or @chroot/<path>"]
    name, data = target.inventory() if _port_ok(target.host) else (target.host, {})
    problems = []
    if not is_host(name):
        problems.append(f"HOST {target.host!r}: not an IP address or host name; {HOST_RULE}")
    user = data.get("ssh_user")
    if user is not None and not USER_NAME.fullmatch(user):
        problems.append(f"user {user!r}: not a login name; {USER_RULE}")
    return problems


def _port_ok(host: str) -> bool:
    # The port follows the host name, which follows any `user@`: a ':' in the user is no port.
    name = host.split("@", 1)[-1]
    return name.count(":") != 1 or name.rsplit(":", 1)[1].isdigit()


class _Reporter(BaseStateCallback):
    def __init__(self, steps: dict[str, tuple[int, Step]], total: int, progress: Progress) -> None:
        self.steps, self.total, self.progress = steps, total, progress

    def _report(self, state: State, op_hash: str, status: str) -> None:
        for name in state.get_op_meta(op_hash).names:
            if name in self.steps:
                index, step = self.steps[name]
                self.progress(index, self.total, step, status)

    def operation_start(self, state: State, op_hash: str) -> None:  # type: ignore[override]
        self._report(state, op_hash, "run")

    def operation_host_success(  # type: ignore[override]
        self, state: State, host: Host, op_hash: str, retry_count: int = 0
    ) -> None:
        self._report(state, op_hash, "ok")

    def operation_host_error(  # type: ignore[override]
        self, state: State, host: Host, op_hash: str, retry_count: int = 0, max_retries: int = 0
    ) -> None:
        self._report(state, op_hash, "failed")


@operation()
def apply_step(step: Step) -> Generator[Any, Any, None]:
    """Write the step's file, run its commands, reboot last if it asks to."""
    if step.file is not None:
        path = shlex.quote(step.file.path)
        yield f"mkdir -p {shlex.quote(posixpath.dirname(step.file.path))}"
        if step.file.private:
            yield from _private_upload(step.file.content, step.file.path, step.file.mode)
        else:
            yield FileUploadCommand(BytesIO(step.file.content), step.file.path)
        yield f"chmod {step.file.mode} {path}"
    yield from step.commands
    if step.reboot:
        yield from server.reboot._inner(delay=20, interval=5, reboot_timeout=900)


def _private_upload(content: bytes, path: str, mode: str) -> Iterator[Any]:
    """Upload a file no one but its owner may read, without it ever being readable by others.

    An upload keeps the mode of a file it overwrites but creates a new one world-readable: an
    empty file of `mode` comes first. Through sudo the content lands first in a file of the SSH
    user's, then is copied: that file is put in a 0700 folder of the user's own, removed after.
    """
    folder = f"/tmp/denv-upload-{uuid.uuid4().hex}"  # mkdir fails on one made beforehand
    yield f"install -m {mode} /dev/null {shlex.quote(path)}"
    yield StringCommand("mkdir", "-m", "0700", folder, _sudo=False)
    yield FileUploadCommand(BytesIO(content), path, remote_temp_filename=f"{folder}/upload")
    yield StringCommand("rm", "-rf", folder, _sudo=False)


BOOT_ID = "/proc/sys/kernel/random/boot_id"  # new at every boot
REBOOT_POLL_S = 5.0  # between SSH tries while a node reboots


class NodeSession:
    """One connected node: facts, commands and steps go through pyinfra's host."""

    def __init__(self, state: State, host: Host) -> None:
        self.state, self.host = state, host

    @property
    def can_reboot(self) -> bool:
        """Only SSH nodes: a chroot has no kernel of its own, and @local is the controller."""
        return not self.host.name.startswith("@")

    def facts(self, query: FactQuery) -> NodeFacts:
        facts = self.host.get_fact(NodeProbe, query=query, _sudo=self.state.config.SUDO)
        if not isinstance(facts, NodeFacts):
            raise NodeUnreachable(f"{self.host.name}: reading facts failed")
        return facts

    def run(self, command: str) -> tuple[bool, str]:
        """Run one shell command; (succeeded, stdout and stderr together)."""
        ok, output = self.host.run_shell_command(
            StringCommand(command), _sudo=self.state.config.SUDO
        )
        text = "\n".join(line.line for line in output.combined_lines).strip()
        return bool(ok), text

    def reboot(self, timeout_s: int = 900) -> None:
        """Reboot the node and wait until it answers from its new boot (SSH nodes only)."""
        _, before = self.run(f"cat {BOOT_ID}")
        self.run("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
        self.host.disconnect()

        def back() -> bool:
            self.host.connect(show_errors=False)
            if not self.host.connected:
                return False
            # The old system's sshd may still answer for a moment, or drop the session as it
            # goes: only a new boot id is back.
            try:
                ok, now = self.run(f"cat {BOOT_ID}")
            except (SSHException, OSError, EOFError):
                ok, now = False, ""
            if ok and now and now != before:
                return True
            self.host.disconnect()
            return False

        wait_until(
            back,
            bool,
            timeout_s=timeout_s,
            interval_s=REBOOT_POLL_S,
            timed_out=lambda _: NodeUnreachable(
                f"{self.host.name}: did not come back within {timeout_s} s of a reboot"
            ),
            wait_first=True,
        )

    def apply(self, steps: list[Step], progress: Progress) -> None:
        """Run the steps as pyinfra operations, in order; raises StepFailed on the first failure."""
        if not steps:
            return
        names: dict[str, tuple[int, Step]] = {}
        metas = []
        for index, step in enumerate(steps, 1):
            name = f"{index:03d} {step.area}: {step.title}"
            names[name] = (index, step)
            metas.append((step, add_op(self.state, apply_step, step, name=name)))
        self.state.add_callback_handler(  # type: ignore[no-untyped-call]
            _Reporter(names, len(steps), progress)
        )
        with suppress(PyinfraError):  # the failed operation is found below, with its output
            run_ops(self.state)
        for step, meta in metas:
            result = meta.get(self.host)
            if result is not None and result.is_complete() and result.did_error():
                raise StepFailed(step, (result.stderr or result.stdout).strip()[-2000:])
            if result is None or not result.is_complete():
                raise StepFailed(step, "not run")


# A cloud reports a machine running before its sshd listens (and before its firewall rules
# apply): a deploy of a machine just created tries again while nothing answers on its SSH port,
# every SSH_POLL_S, for up to SSH_WAIT_S (each try also waits up to pyinfra's CONNECT_TIMEOUT,
# 10 s, for an answer). pulumi-command's remote connection waits about as long: 10 dials of 15 s.
SSH_WAIT_S = 300.0
SSH_POLL_S = 5.0


@contextmanager
def connect(target: Target, ssh_wait_s: float = 0.0) -> Iterator[NodeSession]:
    """A connected session to the node; NodeUnreachable when the connection fails.

    With `ssh_wait_s`, a connection that nothing answers (refused, timed out, no route) is tried
    again every SSH_POLL_S until that many seconds have passed; anything that answers (an SSH
    server refusing the key, something that speaks no SSH) fails at once, as without it.
    """
    # pyinfra logs progress and beta notices itself; the CLI reports steps its own way.
    logging.getLogger("pyinfra").setLevel(logging.ERROR)
    name, data = target.inventory()
    inventory = Inventory(([(name, data)], {}))  # type: ignore[no-untyped-call]
    state = State(inventory, Config(SUDO=target.sudo))  # type: ignore[no-untyped-call]
    host = inventory.get_host(name)
    if target.is_ssh:
        # pyinfra accepts a new machine's host key into ~/.ssh/known_hosts but cannot create
        # the folder: on a runner whose user never ran ssh, every connection failed.
        Path("~/.ssh").expanduser().mkdir(mode=0o700, exist_ok=True)
    failure = wait_until(
        lambda: _try_connect(host, target),
        lambda failed: failed is None or failed.answered,
        timeout_s=ssh_wait_s,
        interval_s=SSH_POLL_S,
        timed_out=lambda failed: _waited(failed, ssh_wait_s),
    )
    if failure is not None:
        raise failure
    state.activate_host(host)
    try:
        yield NodeSession(state, host)
    finally:
        host.disconnect()


def _try_connect(host: Host, target: Target) -> CannotConnect | None:
    """One connection attempt: None when connected, else why not."""
    try:
        host.connect(show_errors=False, raise_exceptions=True)
    except ConnectError as error:
        # pyinfra raises it while handling the socket's or paramiko's own error.
        return CannotConnect(
            f"cannot connect to {target.host}: {error.args[0]}",
            answered=not no_answer(error.__context__),
        )
    except PyinfraError as error:  # a key paramiko cannot load; the message names the file only
        return CannotConnect(f"cannot connect to {target.host}: {error}")
    except OSError as error:
        return CannotConnect(
            f"cannot connect to {target.host}: {error}", answered=not no_answer(error)
        )
    return None


def _waited(failed: CannotConnect | None, wait_s: float) -> CannotConnect:
    """The last attempt's error (never None: a connection that succeeded ends the wait), saying
    how long the node's SSH port was waited for."""
    if failed is not None and not wait_s:
        return failed
    return CannotConnect(
        f"{failed}, after waiting {wait_s:.0f} s for its SSH port to answer", answered=False
    )


def no_answer(error: BaseException | None) -> bool:
    """Whether a failed SSH connection got no answer at all from the address (`_NO_ANSWER`):
    not an SSH server refusing our key or showing another host key."""
    if isinstance(error, NoValidConnectionsError):  # every address of the name, each refused
        return bool(error.errors) and all(no_answer(e) for e in error.errors.values())
    if isinstance(error, TimeoutError):
        return True
    return isinstance(error, OSError) and error.errno in _NO_ANSWER


def quiet_progress(index: int, total: int, step: Step, status: str) -> None:
    del index, total, step, status


def prepare_node(
    target: Target,
    spec: NodeDeploySpec,
    dry: bool = False,
    progress: Progress = quiet_progress,
    overlay_config: str | None = None,
    keys: SshKeys | None = None,
    ssh_wait_s: float = 0.0,
) -> list[Step]:
    """Converge the node to `spec`: read facts, plan, run; returns the steps planned.

    With `dry`, facts are read (read-only commands) and nothing is changed. `overlay_config`:
    the node's WireGuard config, its private key filled in (see `plan_node`); `keys`: the SSH
    login's keys to keep; `ssh_wait_s`: how long to wait for a machine just created to answer
    on its SSH port (see `connect`).
    """
    with connect(target, ssh_wait_s) as session:
        facts = session.facts(fact_query(spec) | key_query(keys))
        steps = plan_node(facts, spec, overlay_config, keys)
        if not dry:
            session.apply(steps, progress)
        return steps
