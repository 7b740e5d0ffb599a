"""What a health source can say about a replica: a reason and what it does to the reply."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Effect(enum.IntEnum):
    """Ordered so that the strongest effect wins: down > drain > lower weight > note only."""

    NOTE = 0
    WEIGHT = 1
    DRAIN = 2
    DOWN = 3


@dataclass(frozen=True)
class Condition:
    effect: Effect
    reason: str
    weight_pct: int = 100


def down(reason: str) -> Condition:
    return Condition(Effect.DOWN, reason)


def drain(reason: str) -> Condition:
    return Condition(Effect.DRAIN, reason)


def weight(reason: str, weight_pct: int) -> Condition:
    return Condition(Effect.WEIGHT, reason, weight_pct)


def note(reason: str) -> Condition:
    return Condition(Effect.NOTE, reason)
