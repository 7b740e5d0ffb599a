"""The node agent: its own virtual environment, its config file and its systemd unit."""

from __future__ import annotations

import posixpath
import shlex

from denv_iac.core.agent_config import AgentConfig, AgentReplica, agent_config_toml
from denv_iac.node import wireguard
from denv_iac.node.agent_wheel import agent_wheel
from denv_iac.node.driver import service_steps
from denv_iac.node.facts import AGENT_VENV, NodeFacts
from denv_iac.node.holders import AGENT
from denv_iac.node.spec import NodeDeploySpec, NodeSpecError
from denv_iac.node.steps import UNIT_DIR, FileContent, Step, text_file, unit_path

UNIT = AGENT  # its name is set with the other NVML holders
CONFIG = "/etc/denv/agent.toml"  # the agent's default, so `denv-agent drain` needs no flag
TOKEN = "/etc/denv/agent.token"
STATE_FILE = "/var/lib/denv-agent/state.json"  # operator drains survive restarts here
COMMAND_LINK = "/usr/local/bin/denv-agent"  # what repair and operators call: `denv-agent drain`
AGENT_BIN = f"{AGENT_VENV}/bin/denv-agent"
DIST_DIR = "/opt/denv/dist"


def config(spec: NodeDeploySpec) -> FileContent:
    """The agent's TOML config (the format `denv-agent --config` reads; see agent/README.md)."""
    replicas = tuple(
        AgentReplica(
            id=replica.id,
            health_url=f"http://127.0.0.1:{replica.port}{replica.health_path}",
            gpu=replica.gpu,
            probe=replica.probe,
            metrics_url=(
                None
                if replica.probe is None
                else f"http://127.0.0.1:{replica.port}{replica.probe.metrics_path}"
            ),
        )
        for replica in spec.replicas
    )
    tables = {
        table: dict(sorted(values.items()))
        for table, values in sorted(spec.agent.config.items())
        if isinstance(values, dict)
    }
    text = agent_config_toml(
        AgentConfig(
            node=spec.node_id,
            state_file=STATE_FILE,
            control_token_file=TOKEN,
            # HAProxy polls agent-check from the balancers (the host firewall admits only
            # them), over the overlay when the node is on it; the control endpoint stays local,
            # reached over SSH.
            agent_check=f"{spec.listen_address or '0.0.0.0'}:{spec.agent_port}",
            http=f"127.0.0.1:{spec.agent_port + 1}",
            replicas=replicas,
            tables=tables,
        )
    )
    return text_file(CONFIG, text)


def unit(spec: NodeDeploySpec) -> FileContent:
    needs_wg = wireguard.unit_dependencies(spec)
    return text_file(
        unit_path(UNIT),
        f"""[Unit]
Description=denv node agent (GPU and replica health for the balancer)
After=network-online.target
Wants=network-online.target
{needs_wg}# Restart=always for good: systemd's default start limit (5 starts in 10 s) would leave a
# crash-looping unit stopped for ever, and nothing else brings it back.
StartLimitIntervalSec=0

[Service]
ExecStart={AGENT_BIN} --config {CONFIG}
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
""",
    )


def files(spec: NodeDeploySpec) -> list[FileContent]:
    return [config(spec), unit(spec)]


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    steps: list[Step] = []
    if AGENT_VENV not in facts.dirs:
        steps.append(Step("agent", f"create {AGENT_VENV}", (f"python3 -m venv {AGENT_VENV}",)))
    installed = facts.agent_version == spec.agent.version
    if not installed:
        steps += _install(spec)
    if facts.links.get(COMMAND_LINK) != AGENT_BIN:
        steps.append(
            Step(
                "agent",
                f"put denv-agent on PATH ({COMMAND_LINK})",
                (f"ln -sfn {AGENT_BIN} {COMMAND_LINK}",),
            )
        )
    if TOKEN not in facts.files:
        # Random per node and never leaves it: the control endpoint is local to the node.
        steps.append(
            Step(
                "agent",
                f"create the control token {TOKEN}",
                (
                    f"umask 077 && mkdir -p /etc/denv /var/lib/denv-agent && od -An -N24 -tx1 "
                    f"/dev/urandom | tr -d ' \\n' > {TOKEN}",
                ),
            )
        )
    changed = not installed
    unit_changed = False
    for content in files(spec):
        if facts.files.get(content.path) != content.sha256:
            changed = True
            unit_changed |= content.path.startswith(UNIT_DIR)
            steps.append(Step("agent", f"write {content.path}", file=content))
    if facts.systemd and unit_changed:
        steps.append(Step("agent", "reload systemd units", ("systemctl daemon-reload",)))
    steps += service_steps(facts, "agent", UNIT, "agent", changed=changed, unit_dir=UNIT_DIR)
    return steps


def _install(spec: NodeDeploySpec) -> list[Step]:
    """Upload the agent's wheel and install it: the one given, else the agent installed here."""
    pip = " ".join(
        [f"{AGENT_VENV}/bin/pip", "install", "-q", *map(shlex.quote, spec.agent.pip_args)]
    )
    if spec.agent.wheel is None:
        name, data = agent_wheel()
        here = name.split("-")[1]
        if here != spec.agent.version:
            raise NodeSpecError(
                [
                    f"agent.version {spec.agent.version}: the denv-agent here is {here}; "
                    f"set agent.version to {here}, or give agent.wheel of {spec.agent.version}"
                ]
            )
    else:
        name = posixpath.basename(spec.agent.wheel)
        with open(spec.agent.wheel, "rb") as wheel:
            data = wheel.read()
    content = FileContent(posixpath.join(DIST_DIR, name), data)
    return [
        Step(
            "agent",
            f"install denv-agent {spec.agent.version} from {name}",
            (f"{pip} --force-reinstall {shlex.quote(content.path)}",),
            file=content,
        )
    ]
