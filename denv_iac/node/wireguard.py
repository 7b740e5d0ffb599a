"""The WireGuard overlay on a machine: wireguard-tools, its config (0600), wg-quick@denv0 up.

The config comes whole from the overlay (`denv_iac.core.overlay_plan.render_config`, its private key
filled in by `with_private_key` only on its way here), so this area only makes the machine match
it. A changed config is applied with `systemctl reload`, which runs `wg syncconf`: only the peers
that differ change and every other session stays up. Only a changed address of the machine
itself needs the interface restarted, which syncconf cannot do.
"""

from __future__ import annotations

import posixpath
import re
import shlex

from denv_iac.core.overlay_plan import CONFIG_PATH, INTERFACE
from denv_iac.node.facts import FactQuery, NodeFacts
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import (
    PACKAGE_UNIT_DIR,
    FileContent,
    Step,
    apt_install,
    wants_link,
)

PACKAGE = "wireguard-tools"  # wg and wg-quick, and the wg-quick@ unit; the kernel has WireGuard
UNIT = f"wg-quick@{INTERFACE}.service"
TEMPLATE = posixpath.join(PACKAGE_UNIT_DIR, "wg-quick@.service")
AREA = "overlay"
_ADDRESS = re.compile(r"^Address = (\S+)$", re.MULTILINE)
_MTU = re.compile(r"^MTU = (\d+)$", re.MULTILINE)


def unit_dependencies(spec: NodeDeploySpec) -> str:
    """[Unit] lines of a service that binds the node's overlay address: it starts once the
    interface is up (at boot too, where both are enabled), and stops and restarts with it, so
    it never runs bound to an address the machine no longer has."""
    if not spec.listen_address:
        return ""
    return f"After={UNIT}\nRequires={UNIT}\n"


def fact_query() -> FactQuery:
    return FactQuery(files=(CONFIG_PATH,), links=(wants_link(UNIT),), units=(UNIT,))


def config_file(config: str) -> FileContent:
    """The config as written: its private key makes it readable by root only."""
    return FileContent(CONFIG_PATH, config.encode(), "0600")


def plan(facts: NodeFacts, config: str | None) -> list[Step]:
    """Steps that bring the machine's overlay interface to `config`; [] when it is there (or
    when the machine is not on the overlay: None)."""
    if config is None:
        return []
    steps = []
    if PACKAGE not in facts.packages:
        steps.append(Step(AREA, f"install {PACKAGE}", (apt_install(PACKAGE),), uses_apt=True))
    file = config_file(config)
    changed = facts.files.get(CONFIG_PATH) != file.sha256
    if changed:
        steps.append(Step(AREA, f"write the {INTERFACE} config", file=file))
    enabled = wants_link(UNIT) in facts.links
    if not facts.systemd:
        # Without systemd running (a chroot, an image being built) enabling is all there is.
        if not enabled:
            link = f"mkdir -p {posixpath.dirname(wants_link(UNIT))} && "
            link += f"ln -sfn {TEMPLATE} {wants_link(UNIT)}"
            steps.append(Step(AREA, f"enable {UNIT} (not started: no systemd)", (link,)))
        return steps
    if UNIT not in facts.active_units:
        steps.append(Step(AREA, f"bring {INTERFACE} up", (f"systemctl enable --now {UNIT}",)))
    elif changed:
        steps.append(Step(AREA, f"apply the changed peers to {INTERFACE}", _apply(config)))
    elif not enabled:
        steps.append(Step(AREA, f"enable {UNIT} at boot", (f"systemctl enable {UNIT}",)))
    return steps


def removal_steps(facts: NodeFacts) -> list[Step]:
    """A machine leaving the stack: its interface goes down and its config, which holds its
    private key, is removed; [] when neither is there. wireguard-tools stays, like the driver."""
    up = UNIT in facts.active_units or wants_link(UNIT) in facts.links
    if CONFIG_PATH not in facts.files and not up:
        return []
    stop = (f"systemctl disable --now {UNIT}",) if facts.systemd else ()
    remove = f"rm -f {CONFIG_PATH} {wants_link(UNIT)}"
    return [Step(AREA, f"take {INTERFACE} down and remove its key", (*stop, remove))]


def _apply(config: str) -> tuple[str, ...]:
    """Reload (syncconf: only the changed peers); restart only when the address moved."""
    found = _ADDRESS.search(config)
    if found is None:
        raise ValueError(f"the {INTERFACE} config has no Address line")
    address = shlex.quote(f"inet {found.group(1)} ")
    same_address = f"ip -4 -o address show dev {INTERFACE} | grep -qF {address}"
    commands = [
        f"systemctl enable {UNIT}",
        f"systemctl reload {UNIT}",
        f"{same_address} || systemctl restart {UNIT}",
    ]
    mtu = _MTU.search(config)
    if mtu is not None:
        # wg-quick sets the MTU at `up` only and syncconf ignores it: set in place, no session
        # dropped (an interface up from before the config had one keeps its own otherwise).
        commands.append(f"ip link set dev {INTERFACE} mtu {mtu.group(1)}")
    return tuple(commands)
