"""HAProxy's passive checks on live traffic: `observe layer4` (what the balancer renders) beside
`observe layer7`, both with `error-limit 1 on-error mark-down`, under overload and a zombie.

Each mode runs the same scenarios on a fresh local stack (benchmarks/overload.py's engine-shaped
replicas, open-loop arrivals, half of them turns of conversations):

- `busy`: each engine admits its 4 slots and a queue of 1 and answers 503 past that, as vLLM
  and SGLang do with a bounded queue, while the recipe's `max_concurrency` (6) lets the balancer
  send it more: the engine's 503 is "full", not "broken". At 1.3x and 2x of the pool's capacity:
  which replicas left rotation, and what the clients got.
- `zombie`: benchmarks/overload.py's zombie (health 200, headers, no token) at 0.4x: from its
  first stalled request until HAProxy has it out of rotation, and the turns cut.

Prints one JSON object per mode, scenario and run, and writes them all to
benchmarks/results/observe.json; traffic stays on 127.0.0.1. Usage:
`python -m benchmarks.observe_bench [--runs N]` (about 2 minutes a run).
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.overload import ENGINE, overload_stack, run_levels, run_zombie
from denv_iac.core.balancer import render_haproxy_config
from denv_iac.core.balancer.files import relocate_maps
from denv_iac.haproxy.files import write_config
from denv_iac.local.runner import LocalCluster

RESULTS = Path(__file__).parent / "results" / "observe.json"
RENDERED = "observe layer4"
QUEUE_LIMIT = 1
BUSY_MAX_CONCURRENCY = ENGINE["slots"] + QUEUE_LIMIT + 1


class Layer7Cluster(LocalCluster):
    """A local stack whose HAProxy watches live HTTP answers (`observe layer7`) instead."""

    def _write_balancer_config(self) -> Path:
        maps = str(self.directory / "haproxy")
        rendered = relocate_maps(render_haproxy_config(self._pools, self._settings, maps), maps)
        assert rendered.haproxy_cfg.count(RENDERED) >= 1
        cfg = rendered.haproxy_cfg.replace(RENDERED, "observe layer7")
        return write_config(type(rendered)(cfg, rendered.files, rendered.map_dir), Path(maps))


def busy_stack() -> dict[str, Any]:
    stack = overload_stack(False)
    (recipe,) = stack["denv:recipes"]
    recipe["max_concurrency"] = BUSY_MAX_CONCURRENCY
    recipe["simulate"] = {**ENGINE, "queue_limit": QUEUE_LIMIT}
    return stack


MODES: dict[str, type[LocalCluster]] = {"layer4": LocalCluster, "layer7": Layer7Cluster}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=8.0)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for _ in range(args.runs):
        for mode, cluster_type in MODES.items():
            levels = run_levels(
                (1.3, 2.0), args.duration_s, stack=busy_stack(), cluster_type=cluster_type
            )
            zombie = run_zombie(max(args.duration_s, 9.0), cluster_type=cluster_type)
            for row in [*map(asdict, levels), asdict(zombie)]:
                rows.append({"mode": mode, **row})
                print(json.dumps(rows[-1]), flush=True)
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
