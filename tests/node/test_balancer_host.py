"""The balancer host plan: install, stage, `haproxy -c`, then live files and a hitless reload."""

from __future__ import annotations

import dataclasses
import hashlib

from denv_iac.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    render_haproxy_config,
)
from denv_iac.node import plan_balancer
from denv_iac.node.balancer_host import CONFIG, STAGING, fact_query
from denv_iac.node.facts import NodeFacts

POOL = BalancerPool(
    "voice",
    (
        BalancerTier(
            1, ("s1",), (BalancerServer("voice.s1.n1.0", "s1", "n1", "10.0.0.5", 8000, 9100),)
        ),
    ),
)
SETTINGS = BalancerSettings(api_key_digests=(hashlib.sha256(b"k").hexdigest(),))
RENDERED = render_haproxy_config([POOL], SETTINGS, "/etc/haproxy/maps")


def test_fresh_host_installs_stages_checks_then_starts() -> None:
    steps = plan_balancer(NodeFacts(systemd=True), RENDERED)
    assert steps[0].title == "install haproxy"
    staged = [s.file.path for s in steps if s.file is not None and s.title.startswith("stage")]
    assert staged == [*sorted(f"{STAGING}/{n}" for n in RENDERED.files), f"{STAGING}/haproxy.cfg"]
    check = next(s for s in steps if "haproxy -c" in s.title)
    # The check comes first in its step: a rejected config never reaches the live paths.
    assert check.commands[0] == f"haproxy -c -q -f {STAGING}/haproxy.cfg"
    assert check.commands[-1] == f"install -m 0644 {STAGING}/live.cfg {CONFIG}"
    assert check.file is not None and check.file.content == RENDERED.haproxy_cfg.encode()
    staged_cfg = next(s for s in steps if s.title == "stage haproxy.cfg").file
    assert staged_cfg is not None and b"/etc/haproxy/maps/" not in staged_cfg.content
    assert steps[-1].commands == ("systemctl enable --now haproxy.service",)


def test_running_host_with_a_changed_config_is_reloaded_and_an_unchanged_one_left_alone() -> None:
    live = {path: "0" * 64 for path in fact_query(RENDERED).files}
    running = NodeFacts(
        systemd=True,
        packages={"haproxy": "2.6.12-1+deb12u1"},
        files=live,
        active_units=frozenset({"haproxy.service"}),
    )
    steps = plan_balancer(running, RENDERED)
    assert steps[-1].commands == ("systemctl reload haproxy.service",)
    in_sync = {
        path: hashlib.sha256(text.encode()).hexdigest()
        for path, text in [
            *((f"{RENDERED.map_dir}/{n}", t) for n, t in RENDERED.files.items()),
            (CONFIG, RENDERED.haproxy_cfg),
        ]
    }
    assert plan_balancer(dataclasses.replace(running, files=in_sync), RENDERED) == []
