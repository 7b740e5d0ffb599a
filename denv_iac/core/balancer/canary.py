"""The weights that give a canary its share of a tier's new sessions.

HAProxy picks a new session's replica by a consistent hash on `X-Denv-Session` (round robin when
a request has none), both weighted: each server holds points on the ring in proportion to its
weight, so the canary's replicas take `canary * w_c / (canary * w_c + stable * w_s)` of new
sessions. Weights are whole numbers from 1 to 256, so the share is rounded; the stable replicas
keep their usual weight whenever the rounded share stays within SHARE_SLACK of the stack's, so
that bringing a canary in moves no session between stable replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from denv_iac.core.balancer.model import SERVER_WEIGHT

MAX_WEIGHT = 256  # HAProxy's largest server weight
# How far the share the weights give may stray from the stack's before the stable replicas'
# weight moves off SERVER_WEIGHT to get closer.
SHARE_SLACK = 0.005


@dataclass(frozen=True)
class CanaryWeights:
    stable: int
    canary: int

    def share(self, stable_count: int, canary_count: int) -> float:
        """The fraction of a tier's new sessions its canary replicas take with these weights."""
        canary = canary_count * self.canary
        total = canary + stable_count * self.stable
        return canary / total if total else 0.0


def canary_weights(stable_count: int, canary_count: int, share: float) -> CanaryWeights:
    """The server weights of a tier with `stable_count` replicas of the recipe's version and
    `canary_count` of its canary, for the canary to take `share` of new sessions."""
    if stable_count == 0 or canary_count == 0:
        return CanaryWeights(SERVER_WEIGHT, SERVER_WEIGHT)
    ratio = share * stable_count / ((1 - share) * canary_count)  # w_canary / w_stable

    def weights(stable: int) -> CanaryWeights:
        return CanaryWeights(stable, min(max(round(stable * ratio), 1), MAX_WEIGHT))

    usual = weights(SERVER_WEIGHT)
    if abs(usual.share(stable_count, canary_count) - share) <= SHARE_SLACK:
        return usual
    return min(
        (weights(stable) for stable in range(1, MAX_WEIGHT + 1)),
        key=lambda w: (abs(w.share(stable_count, canary_count) - share), abs(w.stable - 100)),
    )
