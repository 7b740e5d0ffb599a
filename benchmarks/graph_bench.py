"""The offline resource graph (`denv plan --resources`) at 10 sites x 100 replicas and at
100 sites x 1,000 replicas: time per registration, and how the whole grows with the input.

The placement benchmark's stack: joined sites, so that every node with a replica gets a
NodeSetup, a dynamic resource (501 of them at the large size; see
`denv_iac.components.dynamic_resource` for why that many once broke `pulumi.dynamic`).
"""

import time

from benchmarks.placement_bench import synthetic_config
from denv_iac.components.preview import preview_stack
from denv_iac.core.stack.reader import read_stack


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
