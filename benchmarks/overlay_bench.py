"""TTFT added by the WireGuard overlay on the data path (through wireguard-go vs the plain link).

Two network namespaces joined by a veth pair: HAProxy in one, a simulated replica that answers at
once in the other. The same stack's data plane runs twice in one lab, its replica on the link's
address and on its overlay address, and streams alternate between the two paths so that drift
and noise hit both alike. Figures: p50/p90 TTFT each way, the added milliseconds (target: under
0.5 ms at p50 on loopback-class links) and the p50 ratio. wireguard-go is the userspace
implementation, slower than the kernel's: the figures bound what a kernel overlay adds.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lab.overlay import measure_ttft, plain_and_overlay, unavailable_reason

PAIRS = 400


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run() -> dict[str, float]:
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the overlay lab cannot run here: {reason}")
    with (
        tempfile.TemporaryDirectory(prefix="denv-overlay-bench-") as workdir,
        plain_and_overlay(Path(workdir)) as lab,
    ):
        measure_ttft(lab, 20)  # warm up: handshakes, connections, caches
        times = measure_ttft(lab, PAIRS)
    plain, tunnel = times["plain"], times["overlay"]
    p50_plain, p50_tunnel = statistics.median(plain), statistics.median(tunnel)
    figures = {
        "ttft_plain_p50_ms": p50_plain * 1000,
        "ttft_overlay_p50_ms": p50_tunnel * 1000,
        "ttft_added_p50_ms": (p50_tunnel - p50_plain) * 1000,
        "ttft_added_p90_ms": (_percentile(tunnel, 0.9) - _percentile(plain, 0.9)) * 1000,
        "ttft_overlay_ratio": p50_tunnel / p50_plain,
    }
    return {key: round(value, 3) for key, value in figures.items()}


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key:28} {value}")
