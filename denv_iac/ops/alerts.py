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

from denv_iac.core.balancer.tiers import BOUNDED_TWIN_SUFFIXES, TWIN_SUFFIXES
from denv_iac.core.dataplane import tier_priority
from denv_iac.core.stack.model import RecipeSpec, StackSpec

AGENT_JOB = "denv-agent"
BALANCER_JOB = "denv-balancer"
# Long enough that a restart under supervision (seconds) does not page anyone.
FOR = "30s"
# A pool that sheds or spills this long is short of capacity, not riding out a burst.
SATURATION_FOR = "1m"
# Per pool and balancer, recorded from HAProxy's exporter (see denv_iac/core/balancer/saturation.py
# for what each figure means): the same figures `denv status` shows.
SLOTS_IN_USE = "denv:pool_slots_in_use"
SLOTS = "denv:pool_slots"
QUEUED = "denv:pool_queued"
SPILLED_RATE = "denv:pool_spilled:rate1m"
SHED_RATE = "denv:pool_shed:rate1m"


def _proxies(pool: str, tiers: str = "[0-9]+", twins: tuple[str, ...] = ()) -> str:
    """PromQL regex (anchored by `=~`) for backends `POOL.tierN` and, when named, their twins."""
    regex = re.escape(pool) + f"\\.tier{tiers}"
    if twins:
        regex += "(" + "|".join(re.escape(twin) for twin in twins) + ")?"
    return regex.replace("\\", "\\\\")


def _tiers_of(pool: str) -> str:
    """PromQL regex (anchored by `=~`) for the backends of one pool's tiers: `POOL.tierN`."""
    return _proxies(pool)


def _saturation_rules(recipe: RecipeSpec, labels: dict[str, str]) -> list[dict[str, object]]:
    """Recording rules: a pool's slots in use and in rotation, queued, spilled and shed."""
    tiers = _proxies(recipe.name)
    bounded = _proxies(recipe.name, twins=BOUNDED_TWIN_SUFFIXES)
    by = "sum by (instance)"
    up = f'haproxy_server_status{{proxy=~"{tiers}",state="UP"}} == 1'
    shed = " - ".join(
        f'{by} (rate(haproxy_{kind}_http_responses_total{{proxy=~"{bounded}",code="5xx"}}[1m]))'
        for kind in ("backend", "server")
    )
    rules = [
        (SLOTS_IN_USE, f'{by} (haproxy_server_current_sessions{{proxy=~"{bounded}"}})'),
        (
            SLOTS,
            f'{by} (haproxy_server_limit_sessions{{proxy=~"{tiers}"}}'
            f" and on (instance, proxy, server) {up})",
        ),
        (
            QUEUED,
            f'{by} (haproxy_backend_current_queue{{proxy=~"{bounded}"}})'
            f' + {by} (haproxy_server_current_queue{{proxy=~"{bounded}"}})',
        ),
        (SHED_RATE, shed),
    ]
    if len(recipe.tiers) > 1:
        later = "(" + "|".join(str(tier_priority(i)) for i in range(1, len(recipe.tiers))) + ")"
        spilled = _proxies(recipe.name, later, TWIN_SUFFIXES)
        rules.append(
            (SPILLED_RATE, f'{by} (rate(haproxy_backend_sessions_total{{proxy=~"{spilled}"}}[1m]))')
        )
    pool_labels = {"stack": labels["stack"], "pool": recipe.name}
    return [{"record": name, "expr": expr, "labels": dict(pool_labels)} for name, expr in rules]


def _saturation_alerts(labels: dict[str, str]) -> list[dict[str, object]]:
    """A pool that sheds load or spills to a later tier for a minute: add capacity."""
    where = f'{{stack="{labels["stack"]}"}}'
    add = "add capacity (min_warm or spare, or max_concurrency if its replicas take more)"
    return [
        {
            "alert": "DenvPoolShedding",
            "expr": f"{SHED_RATE}{where} > 0",
            "for": SATURATION_FOR,
            "labels": dict(labels),
            "annotations": {
                "summary": 'pool {{ $labels.pool }} sheds {{ printf "%.1f" $value }} requests/s at'
                " balancer {{ $labels.instance }}: every slot of every allowed tier is taken"
                f" past the first-token budget, and its clients get 503 pool_full; {add}",
            },
        },
        {
            "alert": "DenvPoolSpilling",
            "expr": f"{SPILLED_RATE}{where} > 0",
            "for": SATURATION_FOR,
            "labels": {**labels, "severity": "warning"},
            "annotations": {
                "summary": 'pool {{ $labels.pool }} sends {{ printf "%.1f" $value }} requests/s to'
                " a later tier at balancer {{ $labels.instance }}: its first tier is full (or"
                f" empty), so those requests pay the farther tier's latency; {add}",
            },
        },
    ]


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
    for recipe in stack.pools:
        # The balancer that sees the fewest healthy replicas decides: its clients get those.
        # A canary serves in the pool's tiers but is no part of its min_warm.
        canary = stack.canary_pool(recipe.name)
        own = "" if canary is None else f',server!~"{canary.name}[.].*"'
        healthy = (
            "min(sum by (instance) (haproxy_server_status"
            f'{{proxy=~"{_tiers_of(recipe.name)}"{own},state="UP"}}))'
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
    for recipe in stack.pools:
        rules += _saturation_rules(recipe, labels)
    rules += _saturation_alerts(labels)
    document = {"groups": [{"name": f"denv-{stack.name}", "rules": rules}]}
    header = (
        f"# Alerting rules of stack {stack.name}, rendered by denv-iac (`denv alerts`).\n"
        f"# Scrape each balancer's prometheus_port as job {BALANCER_JOB} and each node agent's\n"
        f"# HTTP port as job {AGENT_JOB}.\n"
    )
    return header + yaml.safe_dump(document, sort_keys=False, width=1000)
