"""XID classes, after NVIDIA's own tooling (the Kubernetes device plugin and health mapping)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class XidClass(enum.StrEnum):
    APPLICATION = "application"
    RESET_PENDING = "reset_pending"
    GPU_FATAL = "gpu_fatal"
    NODE_FATAL = "node_fatal"
    UNKNOWN = "unknown"


# The most XIDs one range may name. The table holds each XID it lists, so "1-99999999999" would
# fill the memory; NVIDIA's XIDs number under 200, and a range past this is a typo.
MAX_RANGE = 1000


def parse_xids(items: Iterable[object]) -> list[int]:
    """XIDs from TOML: integers or inclusive ranges written as "143-150"."""
    xids: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item > 0:
            xids.append(item)
            continue
        if isinstance(item, str):
            low, sep, high = item.partition("-")
            # isdecimal, not isdigit: int() refuses a superscript digit such as "²".
            if sep and low.strip().isdecimal() and high.strip().isdecimal():
                first, last = int(low), int(high)
                if 0 < first <= last < first + MAX_RANGE:
                    xids.extend(range(first, last + 1))
                    continue
                if 0 < first <= last:
                    raise ValueError(
                        f"{item!r} names {last - first + 1} XIDs, more than a range may"
                        f" ({MAX_RANGE})"
                    )
        raise ValueError(f'{item!r} is not an XID or a range such as "143-150"')
    return xids


CONFIGURABLE_CLASSES = (
    XidClass.APPLICATION,
    XidClass.RESET_PENDING,
    XidClass.GPU_FATAL,
    XidClass.NODE_FATAL,
)

DEFAULT_CLASSES: Mapping[XidClass, tuple[int, ...]] = {
    XidClass.APPLICATION: (13, 31, 43, 45, 68, 94),
    XidClass.RESET_PENDING: (63, 92),
    # 109 is disputed: the device plugin skips it, NVIDIA's health mapping asks for a reset.
    # Serving from a GPU that may need a reset costs more than losing its capacity.
    XidClass.GPU_FATAL: tuple(
        parse_xids([46, 48, 62, 64, 74, 95, 109, 110, 119, 120, 136, 140, "143-150", 155, 156, 158])
    ),
    XidClass.NODE_FATAL: (79, 160),
}

_DESCRIPTIONS: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "gpu memory page fault",
    43: "gpu stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ecc error",
    62: "internal micro-controller halt",
    63: "row remap pending",
    64: "row remap recording failure",
    68: "video processor exception",
    74: "nvlink error",
    79: "gpu fell off the bus",
    92: "high single-bit ecc error rate",
    94: "contained ecc error",
    95: "uncontained ecc error",
    109: "context switch timeout",
    110: "security fault",
    119: "gsp rpc timeout",
    120: "gsp error",
    140: "unrecovered ecc error",
}


def describe(xid: int) -> str:
    """The reason text for an XID, e.g. `xid 79 gpu fell off the bus`."""
    text = _DESCRIPTIONS.get(xid)
    return f"xid {xid} {text}" if text else f"xid {xid}"


@dataclass(frozen=True)
class XidTable:
    classes: Mapping[int, XidClass]

    @classmethod
    def default(cls) -> XidTable:
        return cls.with_overrides({})

    @classmethod
    def with_overrides(cls, overrides: Mapping[XidClass, Iterable[int]]) -> XidTable:
        """The default table, each XID in `overrides` moved to the class it is listed under."""
        classes = {xid: klass for klass, xids in DEFAULT_CLASSES.items() for xid in xids}
        for klass, xids in overrides.items():
            classes.update(dict.fromkeys(xids, klass))
        return cls(classes)

    def classify(self, xid: int) -> XidClass:
        return self.classes.get(xid, XidClass.UNKNOWN)
