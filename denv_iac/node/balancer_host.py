"""The balancer host: HAProxy installed, config and maps put, checked, reloaded hitlessly."""

from __future__ import annotations

import posixpath

from denv_iac.balancer.files import CONFIG_FILE_NAME, relocate_maps
from denv_iac.balancer.model import RenderedConfig
from denv_iac.node import firewall
from denv_iac.node.deploy import Progress, Target, connect, quiet_progress
from denv_iac.node.facts import FactQuery, NodeFacts
from denv_iac.node.firewall import BalancerAccess
from denv_iac.node.steps import APT_UPDATE, Step, apt_install, text_file

CONFIG = "/etc/haproxy/haproxy.cfg"
STAGING = "/etc/haproxy/denv-staged"
UNIT = "haproxy.service"


def _live_files(rendered: RenderedConfig) -> dict[str, str]:
    files = {posixpath.join(rendered.map_dir, name): text for name, text in rendered.files.items()}
    files[CONFIG] = rendered.haproxy_cfg
    return files


def fact_query(rendered: RenderedConfig) -> FactQuery:
    return FactQuery(files=tuple(sorted(_live_files(rendered))), units=(UNIT,))


def plan_balancer(facts: NodeFacts, rendered: RenderedConfig) -> list[Step]:
    """Steps that put `rendered` live; [] when the node serves exactly it already.

    The new files are staged and checked with `haproxy -c` first: a config HAProxy rejects
    never replaces the live one, and the running HAProxy keeps serving the old one.
    """
    steps: list[Step] = []
    if "haproxy" not in facts.packages:
        commands = (APT_UPDATE, apt_install("haproxy"))
        steps.append(Step("balancer", "install haproxy", commands))
    live = _live_files(rendered)
    if all(facts.files.get(path) == text_file(path, text).sha256 for path, text in live.items()):
        return steps
    staged = relocate_maps(rendered, STAGING)
    staged_config = posixpath.join(STAGING, CONFIG_FILE_NAME)
    for name, text in sorted(staged.files.items()):
        steps.append(
            Step("balancer", f"stage map {name}", file=text_file(f"{STAGING}/{name}", text))
        )
    steps.append(
        Step("balancer", "stage haproxy.cfg", file=text_file(staged_config, staged.haproxy_cfg))
    )
    install = [
        f"install -D -m 0644 {STAGING}/{name} {posixpath.join(rendered.map_dir, name)}"
        for name in sorted(rendered.files)
    ]
    # The live config refers to the live map paths; only its staged twin was checked.
    config_file = text_file(f"{STAGING}/live.cfg", rendered.haproxy_cfg)
    steps.append(
        Step(
            "balancer",
            "check the staged config (haproxy -c), then put it live",
            (
                f"haproxy -c -q -f {staged_config}",
                *install,
                f"install -m 0644 {config_file.path} {CONFIG}",
            ),
            file=config_file,
        )
    )
    if facts.systemd and UNIT in facts.active_units:
        # Master-worker reload: new workers take new connections, old ones finish their streams.
        steps.append(Step("balancer", "reload HAProxy (hitless)", (f"systemctl reload {UNIT}",)))
    elif facts.systemd:
        steps.append(Step("balancer", "start HAProxy", (f"systemctl enable --now {UNIT}",)))
    return steps


def prepare_balancer(
    target: Target,
    rendered: RenderedConfig,
    access: BalancerAccess,
    dry: bool = False,
    progress: Progress = quiet_progress,
) -> list[Step]:
    """Converge a balancer host to `rendered` behind its firewall; returns the steps planned
    (run unless `dry`). The firewall comes first: the stats port never listens unguarded."""
    with connect(target) as session:
        facts = session.facts(fact_query(rendered) | firewall.balancer_fact_query())
        steps = firewall.plan_balancer_host(facts, access) + plan_balancer(facts, rendered)
        if not dry:
            session.apply(steps, progress)
        return steps
