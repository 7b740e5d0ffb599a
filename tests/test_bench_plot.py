"""`denv bench --plot`: a valid, deterministic SVG with the run's figures, errors marked."""

import math
import random
import xml.etree.ElementTree as ET

from hypothesis import given
from hypothesis import strategies as st

from denv_iac.bench_plot import nice_ticks, render_svg
from denv_iac.loadgen import LoadReport, StreamResult

SVG = "{http://www.w3.org/2000/svg}"


def synthetic_report(seed: int = 7, requests: int = 400) -> LoadReport:
    """A 10 s run at ~40 ms TTFT with a failover at 6 s: aborted streams, then slower TTFT."""
    rng = random.Random(seed)
    results = []
    for i in range(requests):
        started = i * 10 / requests
        error = "aborted" if 6.0 <= started < 6.1 else ("connect" if i == 300 else "")
        ttft = None if error == "connect" else rng.gauss(40 if started < 6 else 55, 4)
        results.append(
            StreamResult(f"r{i:04d}", started, 200, error, "voice.local.n0.0", ttft, 120.0, 16)
        )
    return LoadReport(results, wall_s=10.0)


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def test_plot_is_valid_svg_with_the_figures() -> None:
    report = synthetic_report()
    root = parse(render_svg(report, "http://127.0.0.1:8080 pool voice"))
    words = texts(root)
    assert "http://127.0.0.1:8080 pool voice" in words
    assert f"p90 {report.ttft_ms(90):.1f}" in words
    assert any(w.startswith("400 requests, ") and "p50" in w for w in words)
    assert "errors: aborted 4, connect 1" in words
    crosses = [p for p in root.iter(f"{SVG}path") if p.get("stroke") == "#c53030"]
    assert len(crosses) == sum(1 for r in report.results if not r.ok)
    points = list(root.iter(f"{SVG}circle"))
    assert len(points) == sum(1 for r in report.results if r.ok)
    assert sum(1 for _ in root.iter(f"{SVG}rect")) > 5  # background and histogram bars


def test_same_report_same_bytes() -> None:
    report = synthetic_report()
    shuffled = LoadReport(random.Random(1).sample(report.results, len(report.results)), 10.0)
    assert render_svg(report, "t") == render_svg(shuffled, "t")


def test_a_slow_outlier_is_counted_not_allowed_to_squeeze_the_rest() -> None:
    report = synthetic_report()
    report.results.append(StreamResult("slow", 0.05, 200, "", "x", 4000.0, 4100.0, 16))
    root = parse(render_svg(report, "t"))
    assert texts(root).count("1 over 100 ms") == 2  # histogram and timeline
    hollow = [c for c in root.iter(f"{SVG}circle") if c.get("fill") == "none"]
    assert len(hollow) == 1


def test_a_run_where_nothing_completed_still_plots() -> None:
    failed = [StreamResult(f"r{i}", i * 0.1, 0, "connect", "", None, 1.0, 0) for i in range(5)]
    root = parse(render_svg(LoadReport(failed, wall_s=0.5), "down <&> out"))
    assert "no completed stream" in texts(root) and "down <&> out" in texts(root)


@given(st.floats(min_value=1e-3, max_value=1e6, allow_nan=False))
def test_ticks_cover_the_range_in_round_steps(upper: float) -> None:
    ticks = nice_ticks(upper)
    assert ticks[0] == 0 and ticks[-1] >= upper * (1 - 1e-9) and 2 <= len(ticks) <= 12
    step = ticks[1]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1, 2, 2.5, 5, 10)
