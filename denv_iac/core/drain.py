"""The drain rule, in one place: how a replica taken out of rotation waits for its calls.

A drain is heard by the balancers at their next agent check, so the wait starts after a settle
time; then it waits until no connection to the replica's port carries work, at most a bound,
past which what is left is cut. A connection that moved no byte either way for the quiet window
carries no work (a balancer's connection kept for reuse: QUIET_CONNECTION_S), and is not waited
for: it closes with the replica. Nodes render the plan as shell (`ss`), pods as their preStop
(python3 reading the kernel's socket table), and a local roll takes its bound from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from denv_iac.core.stack.model import DRAIN_TIMEOUT_S, QUIET_CONNECTION_S, RecipeSpec


@dataclass(frozen=True)
class DrainPlan:
    """How one drain waits: `settle_s` for the balancers to hear it, then until no connection
    is busy (queued bytes either way, or a byte sent or received within `quiet_s`), at most
    `bound_s` from the start."""

    settle_s: float
    quiet_s: int
    bound_s: int


def quiet_window_s(recipes: Iterable[RecipeSpec]) -> int:
    """The quiet window for replicas of `recipes`: QUIET_CONNECTION_S, or longer than any live
    stream of theirs may stay silent (its first token or stall budget)."""
    silence_ms = max(
        (max(r.first_token_timeout_ms, r.stall_timeout_ms) for r in recipes), default=0
    )
    return max(QUIET_CONNECTION_S, math.ceil(silence_ms / 1000))


def drain_plan(recipes: Iterable[RecipeSpec], settle_s: float) -> DrainPlan:
    """The drain of a replica (a pod) or of a node's replicas (their longest bound, their longest
    silence): `settle_s` is how long the balancers take to hear the drain, never past the bound."""
    recipes = tuple(recipes)
    bound = max((r.drain_timeout_s for r in recipes), default=DRAIN_TIMEOUT_S)
    return DrainPlan(min(bound, settle_s), quiet_window_s(recipes), bound)
