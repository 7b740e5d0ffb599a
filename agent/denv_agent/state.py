"""Operator drains, persisted so that a drain survives an agent restart."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("denv_agent")


@dataclass(frozen=True)
class Drains:
    node: bool = False
    replicas: frozenset[str] = field(default_factory=frozenset)
    # Set when the state file exists but cannot be read: the node stays drained until an
    # operator undrains it, since the lost file may have held a drain.
    unreadable: str | None = None
    # Replicas whose pods are stopping (Kubernetes' preStop asked): kept in memory only, since
    # each ends by itself when its server stops (Agent.stop_pod).
    stopping: frozenset[str] = field(default_factory=frozenset)

    def drained(self, replica_id: str) -> bool:
        return (
            self.node
            or self.unreadable is not None
            or replica_id in self.replicas
            or replica_id in self.stopping
        )


class DrainStore:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> Drains:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            replicas = data["drained_replicas"]
            if (
                not isinstance(data["node_drained"], bool)
                or not isinstance(replicas, list)  # a mapping's keys would pass as ids
                or not all(isinstance(r, str) for r in replicas)
            ):
                raise ValueError("unexpected content")
            return Drains(node=data["node_drained"], replicas=frozenset(replicas))
        except (FileNotFoundError, NotADirectoryError):
            return Drains()  # no file could be there, so no drain was lost
        # RecursionError: JSON nested thousands deep, more than its reader recurses.
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            log.error("state file %s unreadable (%s): draining every replica", self.path, e)
            return Drains(unreadable="state file unreadable")

    def save(self, drains: Drains) -> None:
        """Write atomically: a crash mid-write leaves the old file or the new one, never half."""
        data = {"node_drained": drains.node, "drained_replicas": sorted(drains.replicas)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
