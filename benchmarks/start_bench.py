"""Start-up of `denv --help` and `denv plan --stack local`, as ratios to `python -c pass`.

All three are timed in the same run, so that the ratios compare across machines where the
seconds do not. Each figure is the median of RUNS runs after one unmeasured run (which warms
the file cache and writes the bytecode).
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUNS = 9
ROOT = Path(__file__).resolve().parents[1]
HELP_TARGET_S = 0.3


def _median_s(*args: str | Path) -> float:
    def once() -> float:
        start = time.perf_counter()
        subprocess.run([str(a) for a in args], cwd=ROOT, capture_output=True, check=True)
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(RUNS))


def run() -> dict[str, Any]:
    denv = Path(sys.executable).parent / "denv"
    python_s = _median_s(sys.executable, "-c", "pass")
    help_s = _median_s(denv, "--help")
    version_s = _median_s(denv, "--version")
    plan_s = _median_s(denv, "plan", "--stack", "local", "--stacks-dir", ROOT / "stacks")
    return {
        "runs": RUNS,
        "python_pass_s": round(python_s, 3),
        "help_s": round(help_s, 3),
        "version_s": round(version_s, 3),
        "plan_local_s": round(plan_s, 3),
        "help_ratio": round(help_s / python_s, 1),
        "version_ratio": round(version_s / python_s, 1),
        "plan_local_ratio": round(plan_s / python_s, 1),
        f"help_under_{HELP_TARGET_S}_s": help_s < HELP_TARGET_S,
    }
