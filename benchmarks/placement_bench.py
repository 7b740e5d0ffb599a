"""Placement time at 10 sites x 100 replicas and 100 sites x 1,000 replicas, and how it grows."""

import statistics
import time

from denv_iac.placement import place_replicas
from denv_iac.spec.model import BalancerSpec, NodeSpec, RecipeSpec, SiteSpec, StackSpec

REPLICAS_PER_POOL = 20
SITES_PER_POOL = 10


def synthetic_stack(sites: int, replicas: int) -> StackSpec:
    """`sites` sites of 5 nodes x 8 H100s; pools of 20 replicas, each over 10 neighbouring sites."""
    site_specs = tuple(
        SiteSpec(
            f"site-{i:03d}",
            "joined",
            nodes=tuple(NodeSpec(f"n{j}", "H100", 8, f"192.0.2.{j + 1}") for j in range(5)),
        )
        for i in range(sites)
    )
    recipes = tuple(
        RecipeSpec(
            name=f"pool-{p:03d}",
            share="whole" if p % 4 else "1g.10gb",
            tiers=tuple(
                (site_specs[(p + k) % sites].name,) for k in range(min(SITES_PER_POOL, sites))
            ),
            min_warm=REPLICAS_PER_POOL - 2,
            spare=2,
        )
        for p in range(replicas // REPLICAS_PER_POOL)
    )
    return StackSpec("bench", site_specs, recipes, BalancerSpec(sites=(site_specs[0].name,)))


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
