"""Prometheus alerting rules for a stack: what must wake someone, in the words `denv status`
uses for it.

Routing fails open when an agent cannot be heard (its replicas stay in rotation on their health
checks alone, their GPU faults unseen), so that state must alert instead. HAProxy's exporter does
not export agent check results; an agent that does not answer is a failed scrape (`up == 0`)
of the `denv-agent` job, a dead balancer of the `denv-balancer` job, and a pool short of its
`min_warm` shows in `haproxy_server_status` of its tiers' backends.
"""

from __future__ import annotations

import re

import yaml

from denv_iac.spec.model import StackSpec

AGENT_JOB = "denv-agent"
BALANCER_JOB = "denv-balancer"
# Long enough that a restart under supervision (seconds) does not page anyone.
FOR = "30s"


def _tiers_of(pool: str) -> str:
    """PromQL regex (anchored by `=~`) for the backends of one pool's tiers: `POOL.tierN`."""
    return re.escape(pool).replace("\\", "\\\\") + "\\\\.tier[0-9]+"


def alert_rules(stack: StackSpec) -> str:
    """The rules file (Prometheus YAML) of `stack`."""
    labels = {"severity": "critical", "stack": stack.name}
    rules: list[dict[str, object]] = [
        {
            "alert": "DenvBalancerDown",
            "expr": f'up{{job="{BALANCER_JOB}"}} == 0',
            "for": FOR,
            "labels": dict(labels),
            "annotations": {
                "summary": "balancer {{ $labels.instance }} is down: its clients must fail over"
                " to another balancer host",
            },
        },
        {
            "alert": "DenvAgentDown",
            "expr": f'up{{job="{AGENT_JOB}"}} == 0',
            "for": FOR,
            "labels": dict(labels),
            "annotations": {
                "summary": "agent {{ $labels.instance }} unreachable: its GPU faults go unseen,"
                " its replicas are routed on health checks alone",
            },
        },
    ]
    for recipe in stack.recipes:
        # The balancer that sees the fewest healthy replicas decides: its clients get those.
        healthy = (
            "min(sum by (instance) (haproxy_server_status"
            f'{{proxy=~"{_tiers_of(recipe.name)}",state="UP"}}))'
        )
        rules.append(
            {
                "alert": "DenvPoolBelowMinWarm",
                "expr": f"({healthy} or vector(0)) < {recipe.min_warm}",
                "for": FOR,
                "labels": {**labels, "pool": recipe.name},
                "annotations": {
                    "summary": f"pool {recipe.name}: {{{{ $value }}}} healthy, below min_warm"
                    f" {recipe.min_warm}",
                },
            }
        )
    document = {"groups": [{"name": f"denv-{stack.name}", "rules": rules}]}
    header = (
        f"# Alerting rules of stack {stack.name}, rendered by denv-iac (`denv alerts`).\n"
        f"# Scrape each balancer's prometheus_port as job {BALANCER_JOB} and each node agent's\n"
        f"# HTTP port as job {AGENT_JOB}.\n"
    )
    return header + yaml.safe_dump(document, sort_keys=False, width=1000)
