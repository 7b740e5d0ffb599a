"""Placement time at 10 sites x 100 replicas and 100 sites x 1,000 replicas, and how it grows."""

import statistics
import time
from typing import Any

from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.reader import read_stack

NODES_PER_SITE = 5
GPUS_PER_NODE = 8
REPLICAS_PER_POOL = 20
SITES_PER_POOL = 10
# A stack file's `secure:` value: ciphertext, an unknown secret offline.
CIPHERTEXT = {"secure": "v1:YmVuY2htYXJrLWtleQ=="}


def synthetic_config(sites: int, replicas: int) -> dict[str, Any]:
    """A stack's `denv:` config: `sites` joined sites of 5 nodes x 8 H100s; pools of 20
    replicas, each over 10 neighbouring sites, every fourth on MIG slices."""
    names = [f"site-{i:03d}" for i in range(sites)]
    return {
        "denv:sites": [
            {
                "name": name,
                "kind": "joined",
                "admin_cidrs": ["198.51.100.0/24"],
                "ssh_private_key": CIPHERTEXT,
                "nodes": [
                    {
                        "name": f"n{j}",
                        "address": f"10.{i // 250}.{i % 250}.{j + 1}",
                        "gpu": "H100",
                        "gpus": GPUS_PER_NODE,
                    }
                    for j in range(NODES_PER_SITE)
                ],
            }
            for i, name in enumerate(names)
        ],
        "denv:recipes": [
            {
                "name": f"pool-{p:03d}",
                "gpu": "whole" if p % 4 else "1g.10gb",
                "image": "ghcr.io/acme/voice:1.4",
                "min_warm": REPLICAS_PER_POOL - 2,
                "spare": 2,
                "sites": [[names[(p + k) % sites]] for k in range(min(SITES_PER_POOL, sites))],
            }
            for p in range(replicas // REPLICAS_PER_POOL)
        ],
        "denv:balancer": {"sites": [names[0]]},
    }


def synthetic_stack(sites: int, replicas: int) -> StackSpec:
    return read_stack("bench", synthetic_config(sites, replicas))


def time_placement(stack: StackSpec, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        placement = place_replicas(stack)
        samples.append(time.perf_counter() - start)
    assert len(placement.replicas) == sum(r.replicas_wanted for r in stack.recipes)
    return statistics.median(samples)


def run() -> dict[str, float]:
    small = time_placement(synthetic_stack(10, 100), rounds=21)
    large = time_placement(synthetic_stack(100, 1000), rounds=7)
    return {
        "placement_10x100_ms": round(small * 1000, 2),
        "placement_100x1000_ms": round(large * 1000, 2),
        "growth_ratio_for_10x_input": round(large / small, 1),
        "target_100x1000_ms": 1000.0,
    }


if __name__ == "__main__":
    print(run())
