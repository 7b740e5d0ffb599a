"""`make bench`: run each benchmark present, print its figures, write results/NAME.json.

`python -m benchmarks overload_bench dataplane_bench` runs only those named.
"""

import importlib
import json
import sys
from pathlib import Path

MODULES = (
    "start_bench",
    "placement_bench",
    "graph_bench",
    "agent_bench",
    "dataplane_bench",
    "tail_bench",
    "voice_bench",
    "voice_to_voice",
    "overlay_bench",
    "overload_bench",
)
RESULTS = Path(__file__).parent / "results"


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        print(f"no benchmark {', '.join(unknown)}; pick from {', '.join(MODULES)}", file=sys.stderr)
        return 2
    failed = []
    RESULTS.mkdir(exist_ok=True)
    for name in names or MODULES:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"benchmarks.{name}":
                raise
            continue
        print(f"== {name}", flush=True)
        try:
            figures = module.run()
        except Exception as error:  # one failing benchmark must not hide the others' figures
            print(f"{name} failed: {error}", file=sys.stderr)
            failed.append(name)
            continue
        for key, value in figures.items():
            print(f"  {key:32} {value}")
        out = RESULTS / f"{name.removesuffix('_bench')}.json"
        out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
