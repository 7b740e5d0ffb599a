"""The offline resource graph (`denv plan --resources`) at 10 sites x 100 replicas and at
100 sites x 1,000 replicas: time per registration, and how the whole grows with the input.

Joined sites, so that every node gets a NodeSetup: the large stack registers a thousand dynamic
resources in one process, the load under which `pulumi.dynamic` used to exhaust the stack
(see `denv_iac.components.dynamic_resource`).
"""

import time
from typing import Any

from denv_iac.preview import preview_stack
from denv_iac.spec.reader import read_stack

NODES_PER_SITE = 5
GPUS_PER_NODE = 8
REPLICAS_PER_POOL = 20
SITES_PER_POOL = 10
# A stack file's `secure:` value: ciphertext, an unknown secret offline.
CIPHERTEXT = {"secure": "v1:YmVuY2htYXJrLWtleQ=="}


def synthetic_config(sites: int, replicas: int) -> dict[str, Any]:
    """`sites` joined sites of 5 nodes x 8 H100s; pools of 20 replicas over 10 sites each."""
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
                "gpu": "whole",
                "image": "ghcr.io/acme/voice:1.4",
                "min_warm": REPLICAS_PER_POOL - 2,
                "spare": 2,
                "sites": [[names[(p + k) % sites]] for k in range(min(SITES_PER_POOL, sites))],
            }
            for p in range(replicas // REPLICAS_PER_POOL)
        ],
        "denv:balancer": {"sites": [names[0]]},
    }


def time_graph(sites: int, replicas: int) -> tuple[float, int]:
    """Seconds for one preview of the whole graph, and how many resources it registered."""
    config = synthetic_config(sites, replicas)
    start = time.perf_counter()
    resources = preview_stack(read_stack("bench", config), config)
    return time.perf_counter() - start, len(resources)


def run() -> dict[str, float]:
    time_graph(2, 20)  # the first preview imports the provider SDKs: not part of the figures
    small_s, small_n = time_graph(10, 100)
    large_s, large_n = time_graph(100, 1000)
    return {
        "graph_10x100_s": round(small_s, 2),
        "graph_10x100_resources": small_n,
        "graph_100x1000_s": round(large_s, 2),
        "graph_100x1000_resources": large_n,
        "ms_per_registration_100x1000": round(large_s / large_n * 1000, 2),
        # Linear growth: seconds per resource, large over small (1.0 is perfectly linear).
        "per_resource_growth_ratio": round((large_s / large_n) / (small_s / small_n), 2),
        "target_100x1000_s": 30.0,
    }


if __name__ == "__main__":
    print(run())
