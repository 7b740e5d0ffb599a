"""Replica units: one container per replica on its GPU or MIG instance, caches mounted."""

from __future__ import annotations

import shlex

from denv_iac.core.scripts import script
from denv_iac.core.stack.command import ANY_ADDRESS, render_command
from denv_iac.core.stack.model import SERVER_STOP_S
from denv_iac.node import mig, wireguard
from denv_iac.node.facts import NodeFacts
from denv_iac.node.holders import AGENT
from denv_iac.node.spec import NodeDeploySpec, ReplicaSpec
from denv_iac.node.steps import (
    FileContent,
    Step,
    before_deadline,
    enable_link,
    set_deadline,
    systemd_quote,
    text_file,
    unit_path,
    wait_streams_command,
    wants_link,
)

LAUNCHER = "/opt/denv/bin/denv-replica-run"
ENV_DIR = "/etc/denv/replicas"

# The UUID is looked up when the unit starts, not when it is written: MIG instances get new
# UUIDs each time they are created (after a reset, a reboot or a layout change).
_LAUNCHER_SCRIPT = script("replica_run.sh")  # data/scripts/replica_run.sh


# The port a replica must listen on, in its env: with host networking, every replica on a node
# shares the host's ports, and each one's port comes from its GPU and slice, which only the
# deploy knows. Set last, so a recipe's own env cannot move it off the port the balancer uses.
PORT_ENV = "PORT"


def env_file(spec: NodeDeploySpec, replica: ReplicaSpec) -> FileContent:
    values = {**replica.env, **spec.cache.env(), PORT_ENV: str(replica.port)}
    text = "".join(f"{name}={value}\n" for name, value in sorted(values.items()))
    return FileContent(f"{ENV_DIR}/{replica.id}.env", text.encode(), "0600")  # may hold tokens


def unit(spec: NodeDeploySpec, replica: ReplicaSpec) -> FileContent:
    name = f"denv-{replica.id}"
    mounts = [arg for path in spec.cache.paths() for arg in ("-v", f"{path}:{path}")]
    argv = [
        LAUNCHER,
        str(replica.gpu),
        replica.mig_profile or "-",
        str(replica.mig_instance),
        "/usr/bin/docker",
        "run",
        "--rm",
        "--name",
        name,
        "--runtime=nvidia",
        *_network(spec, replica),
        "--env-file",
        env_file(spec, replica).path,
        *mounts,
        replica.image,
        *render_command(replica.command, port=replica.port, host=ANY_ADDRESS),
    ]
    # A MIG instance exists only once the boot unit has recreated it: without it the replica
    # would crash-loop on a device that is not there.
    mig_unit = f" {mig.UNIT}" if replica.mig_profile else ""
    needs_wg = wireguard.unit_dependencies(spec)
    return text_file(
        unit_path(replica.unit),
        f"""[Unit]
Description=denv replica {replica.id}
After=docker.service {AGENT}{mig_unit}
Requires=docker.service{mig_unit}
{needs_wg}# Restart=always for good: systemd's default start limit (5 starts in 10 s) would leave a
# crash-looping unit stopped for ever, and nothing else brings it back.
StartLimitIntervalSec=0

[Service]
ExecStartPre=-/usr/bin/docker rm -f {name}
ExecStart={" ".join(map(systemd_quote, argv))}
ExecStop=/usr/bin/docker stop -t {SERVER_STOP_S} {name}
Restart=always
RestartSec=2
TimeoutStartSec=0

[Install]
WantedBy=multi-user.target
""",
    )


def _network(spec: NodeDeploySpec, replica: ReplicaSpec) -> list[str]:
    """The host's network, where the server listens as it chooses (the firewall guards it);
    on the overlay, Docker's bridge with the port published on the overlay address only, and
    on loopback for the agent's health checks and probes."""
    if not spec.listen_address:
        return ["--network=host"]
    port = replica.port
    return ["-p", f"{spec.listen_address}:{port}:{port}", "-p", f"127.0.0.1:{port}:{port}"]


def files(spec: NodeDeploySpec) -> list[FileContent]:
    result = [FileContent(LAUNCHER, _LAUNCHER_SCRIPT.encode(), "0755")]
    for replica in spec.replicas:
        result += [env_file(spec, replica), unit(spec, replica)]
    return result


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    steps: list[Step] = []
    missing = [path for path in spec.cache.paths() if path not in facts.dirs]
    if missing:
        quoted = " ".join(map(shlex.quote, missing))
        steps.append(
            Step(
                "replicas",
                "create the weights and compile cache dirs",
                (f"mkdir -p -m 0755 {quoted}",),
            )
        )
    steps += stale_steps(facts, spec)
    launcher = files(spec)[0]
    launcher_changed = facts.files.get(LAUNCHER) != launcher.sha256
    if launcher_changed:
        steps.append(Step("replicas", f"write {LAUNCHER}", file=launcher))
    for replica in spec.replicas:
        steps += _replica(facts, spec, replica, launcher_changed)
    return steps


def _replica(
    facts: NodeFacts, spec: NodeDeploySpec, replica: ReplicaSpec, launcher_changed: bool
) -> list[Step]:
    steps = []
    changed = launcher_changed
    for content in (env_file(spec, replica), unit(spec, replica)):
        if facts.files.get(content.path) != content.sha256:
            changed = True
            steps.append(Step("replicas", f"{replica.id}: write {content.path}", file=content))
    enabled = wants_link(replica.unit) in facts.links
    if not facts.systemd:
        if not enabled:
            steps.append(
                Step(
                    "replicas",
                    f"{replica.id}: enable (not started: no systemd)",
                    (enable_link(replica.unit),),
                )
            )
        return steps
    if changed and replica.unit in facts.active_units:
        steps.append(
            Step(
                "replicas",
                f"{replica.id}: roll (drain, restart, warm, undrain)",
                (
                    "systemctl daemon-reload",
                    f"systemctl enable {replica.unit}",
                    roll_command(spec, replica),
                ),
            )
        )
    elif changed:
        steps.append(
            Step(
                "replicas",
                f"{replica.id}: (re)start",
                (
                    "systemctl daemon-reload",
                    f"systemctl enable {replica.unit}",
                    f"systemctl restart {replica.unit}",
                ),
            )
        )
    elif not enabled or replica.unit not in facts.active_units:
        steps.append(
            Step("replicas", f"{replica.id}: start", (f"systemctl enable --now {replica.unit}",))
        )
    return steps


def roll_command(spec: NodeDeploySpec, replica: ReplicaSpec) -> str:
    """Shell: restart a serving replica without cutting a call or leaving it cold: the agent
    drains it (the balancers send it nothing new) -> its connections end, at most
    `drain_timeout_s` (those left are cut and counted) -> restart -> health answers within
    `ready_timeout_s` -> undrain -> `rejoin_s`, until the balancers count it UP. A replica
    that never answers stays drained, and the command fails with one line naming it, so that
    `pulumi up` stops before the pool's next node (denv_iac.core.rollout.rollout_after) with the
    pool's other replicas serving the old version."""
    health = shlex.quote(f"http://127.0.0.1:{replica.port}{replica.health_path}")
    who = shlex.quote(replica.id)
    never_warm = shlex.quote(
        f"replica {replica.id} never became healthy within ready_timeout_s "
        f"{spec.ready_timeout_s} s after its restart: left drained, the rollout stopped, the "
        "pool's other replicas serve the old version"
    )
    wait = wait_streams_command([replica.port], spec.drain_plan())
    return (
        f"denv-agent drain --replica {who} >/dev/null || echo {who}: no agent drained it; "
        f"{wait}; "
        f"systemctl restart {replica.unit}; "
        f"{set_deadline('ready', spec.ready_timeout_s)}; "
        f"until curl -fsS -o /dev/null --max-time 5 {health}; do "
        f"{before_deadline('ready')} || {{ echo {never_warm} >&2; exit 1; }}; sleep 2; done; "
        f"denv-agent undrain --replica {who} >/dev/null; sleep {spec.rejoin_s}; echo {who} rolled"
    )


def stale_steps(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    """Units of replicas placed elsewhere now: stop them and remove their files."""
    wanted = {replica.unit for replica in spec.replicas}
    steps = []
    for name in sorted(facts.replica_units - wanted):
        replica_id = name.removeprefix("denv-replica-").removesuffix(".service")
        stop = (f"systemctl disable --now {name}",) if facts.systemd else ()
        steps.append(
            Step(
                "replicas",
                f"{replica_id}: remove (no longer placed here)",
                (
                    *stop,
                    f"rm -f {unit_path(name)} {wants_link(name)} {ENV_DIR}/{replica_id}.env",
                ),
            )
        )
    return steps
