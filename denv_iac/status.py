"""`denv status`: what is warm where, and healthy, read from the balancer itself."""

from collections.abc import Mapping
from dataclasses import dataclass

from denv_iac.spec.model import StackSpec


@dataclass(frozen=True)
class ReplicaStatus:
    id: str
    pool: str
    backend: str
    state: str  # UP, DOWN, DRAIN, MAINT, ... as HAProxy reports it
    weight: int
    streams: int
    reason: str  # the agent's or the health check's last word

    @property
    def healthy(self) -> bool:
        return self.state.startswith("UP")


@dataclass(frozen=True)
class PoolStatus:
    pool: str
    healthy: int
    min_warm: int

    @property
    def ok(self) -> bool:
        return self.healthy >= self.min_warm


def replica_statuses(rows: Mapping[str, Mapping[str, str]]) -> list[ReplicaStatus]:
    """From `show stat` rows by server name (replica ids are server names)."""
    statuses = []
    for name, row in sorted(rows.items()):
        reason = row.get("last_agt") or row.get("last_chk") or ""
        statuses.append(
            ReplicaStatus(
                id=name,
                pool=name.split(".", 1)[0],
                backend=row.get("pxname", ""),
                state=row.get("status", "?"),
                weight=int(row.get("weight") or 0),
                streams=int(row.get("scur") or 0),
                reason=reason.strip(),
            )
        )
    return statuses


def pool_statuses(stack: StackSpec, replicas: list[ReplicaStatus]) -> list[PoolStatus]:
    return [
        PoolStatus(r.name, sum(1 for s in replicas if s.pool == r.name and s.healthy), r.min_warm)
        for r in stack.recipes
    ]
