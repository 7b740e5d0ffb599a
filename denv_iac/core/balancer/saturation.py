"""How full each pool is, from HAProxy's own stats rows (`show stat`, or the stats page's CSV).

Pure. The four figures, per pool, over its tier backends and their twins:

- slots in use / slots: requests on a replica now (`scur` of the servers of the tier backends
  and their speech twins) against what the pool's replicas in rotation admit (`slim`, the
  recipe's max_concurrency as each tier server's maxconn, of the servers that are UP).
- queued: requests waiting for a free slot now (`qcur` of the backends, the requests queued
  with no replica assigned, plus `qcur` of their servers, those queued for one replica).
- spilled: requests sent to a tier after the pool's first since the balancer started (`stot`
  of the later tiers' backends): the first tier was full, or had no replica left.
- shed: requests the balancer answered itself with a 5xx since it started: a backend's
  `hrsp_5xx` less its servers' (the replicas' own answers). Under load nearly all are the
  503 pool_full of a request that waited out its share of the first-token budget in the
  queue; the rest are the rarer 502/503/504 given once every retry on another replica failed.

The Prometheus rules (denv_iac/ops/alerts.py) derive the same figures from the exporter's
names for these fields.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from denv_iac.core.balancer.tiers import TierBackend, parse_tier_backend


@dataclass(frozen=True)
class PoolSaturation:
    pool: str
    slots_in_use: int
    slots: int
    queued: int
    spilled: int  # since the balancer (its current worker) started
    shed: int  # since the balancer (its current worker) started

    @property
    def saturated(self) -> bool:
        """Whether it turns requests away from the first tier or from the pool right now:
        requests wait for a slot, or none is free."""
        return self.queued > 0 or (self.slots > 0 and self.slots_in_use >= self.slots)


def _count(row: Mapping[str, str], field: str) -> int:
    value = row.get(field) or ""
    return int(value) if value.isdigit() else 0


def _add(tally: Counter[str], backend: TierBackend, row: Mapping[str, str]) -> None:
    """Count one row of a pool's backend into its pool's tally."""
    kind = row.get("svname")
    if kind == "BACKEND":
        tally[f"sessions.{backend.priority}"] += _count(row, "stot")
    if not backend.bounded or kind == "FRONTEND":
        return
    tally["queued"] += _count(row, "qcur")
    if kind == "BACKEND":
        tally["shed"] += _count(row, "hrsp_5xx")
        return
    tally["slots_in_use"] += _count(row, "scur")
    tally["shed"] -= _count(row, "hrsp_5xx")  # the replica's own answers
    if backend.twin == "" and row.get("status", "").startswith("UP"):
        tally["slots"] += _count(row, "slim")


def pool_saturation(rows: Iterable[Mapping[str, str]]) -> dict[str, PoolSaturation]:
    """Per pool, by name: slots in use and in rotation, queued, spilled and shed.

    `rows` are every row of `show stat` (frontends, backends and servers); rows of proxies
    that are no pool's tier backend are left out. A pool's first tier is the lowest-numbered
    tier it has in the balancer.
    """
    tallies: dict[str, Counter[str]] = {}
    for row in rows:
        backend = parse_tier_backend(row.get("pxname", ""))
        if backend is not None:
            _add(tallies.setdefault(backend.pool, Counter()), backend, row)
    result = {}
    for pool, tally in sorted(tallies.items()):
        by_tier = {
            int(key.removeprefix("sessions.")): n
            for key, n in tally.items()
            if key.startswith("sessions.")
        }
        first = min(by_tier, default=0)
        result[pool] = PoolSaturation(
            pool=pool,
            slots_in_use=tally["slots_in_use"],
            slots=tally["slots"],
            queued=tally["queued"],
            spilled=sum(n for tier, n in by_tier.items() if tier != first),
            shed=max(tally["shed"], 0),
        )
    return result
