"""`denv bench --plot`: a PNG (or SVG) with the run's figures and errors, readable at a glance."""

import dataclasses
import random
from pathlib import Path

import pytest
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from PIL import Image

from denv_iac.ops.bench_plot import BAR, DIRECT, DPI, ERROR, SIZE_IN, render_figure, write_plot
from denv_iac.ops.loadgen_report import LoadReport, StreamResult


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


def texts(figure: Figure) -> list[str]:
    found = [t.get_text() for t in figure.texts]
    if figure.get_suptitle():
        found.append(figure.get_suptitle())
    for axes in figure.axes:
        found += [t.get_text() for t in axes.texts]
        found += [axes.get_title(loc) for loc in ("left", "center", "right")]
    return [t for t in found if t]


def points(figure: Figure, color_hex: str | None = None) -> int:
    """How many markers the timeline draws (of one face colour, when given)."""
    total = 0
    for collection in figure.axes[1].collections:
        assert isinstance(collection, PathCollection)
        count = len(collection.get_offsets())
        if color_hex is None or (count and _hex(collection.get_facecolor()[0]) == color_hex):
            total += count
    return total


def _hex(rgba: object) -> str:
    r, g, b = (round(float(c) * 255) for c in list(rgba)[:3])  # type: ignore[call-overload]
    return f"#{r:02x}{g:02x}{b:02x}"


def test_figure_carries_the_run_s_figures_and_marks_every_request() -> None:
    report = synthetic_report()
    figure = render_figure(report, "http://127.0.0.1:8080 pool voice")
    words = "\n".join(texts(figure))
    assert "http://127.0.0.1:8080 pool voice" in words
    assert "400 requests, 395 ok, 5 failed; TTFT p50 " in words
    assert f"p90 {report.ttft_ms(90):.1f}" in words
    assert "errors: aborted 4, connect 1" in words
    assert points(figure) == 400  # every request: a dot when it completed, a cross when not
    assert points(figure, ERROR) == 5


def test_png_is_the_promised_size_and_shows_bars_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "ttft.png"
    write_plot(synthetic_report(), "t", path)
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (round(SIZE_IN[0] * DPI), round(SIZE_IN[1] * DPI))
        colors = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 20) or []}
    # Antialiasing blends edges, but the inside of a histogram bar and of a cross is exact.
    assert _rgb(BAR) in colors and _rgb(ERROR) in colors
    assert len(colors) > 50  # text, ticks and points: not a blank canvas


def _rgb(color_hex: str) -> tuple[int, int, int]:
    return tuple(int(color_hex[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def test_same_report_same_svg_bytes(tmp_path: Path) -> None:
    report = synthetic_report()
    shuffled = LoadReport(random.Random(1).sample(report.results, len(report.results)), 10.0)
    write_plot(report, "t", tmp_path / "a.svg")
    write_plot(shuffled, "t", tmp_path / "b.svg")
    assert (tmp_path / "a.svg").read_bytes() == (tmp_path / "b.svg").read_bytes()


def test_a_slow_outlier_is_counted_not_allowed_to_squeeze_the_rest() -> None:
    report = synthetic_report()
    report.results.append(StreamResult("slow", 0.05, 200, "", "x", 4000.0, 4100.0, 16))
    figure = render_figure(report, "t")
    limit = 1.5 * (report.ttft_ms(99) or 0)
    assert texts(figure).count(f"1 over {limit:.0f} ms") == 2  # histogram and timeline
    assert figure.axes[0].get_xlim()[1] < 100


def test_a_run_where_nothing_completed_still_plots(tmp_path: Path) -> None:
    failed = [StreamResult(f"r{i}", i * 0.1, 0, "connect", "", None, 1.0, 0) for i in range(5)]
    report = LoadReport(failed, wall_s=0.5)
    assert "no completed stream" in texts(render_figure(report, "down <&> out"))
    write_plot(report, "down <&> out", tmp_path / "down.png")
    assert (tmp_path / "down.png").stat().st_size > 1000


def test_a_voice_run_names_its_figure_and_draws_the_direct_path_behind() -> None:
    report = synthetic_report()
    direct = [
        dataclasses.replace(r, via="direct", ttft_ms=(r.ttft_ms or 0) - 0.5)
        for r in report.results
        if r.ok
    ]
    voice = LoadReport([*report.results, *direct], 10.0, "realtime")
    figure = render_figure(voice, "t")
    words = "\n".join(texts(figure))
    assert "400 requests, 395 ok, 5 failed; first audio p50 " in words
    assert "added +0.50 ms" in words
    assert figure.axes[0].get_xlabel() == "first audio (ms)"
    assert points(figure, DIRECT) == len(direct) == 395


def test_an_unknown_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one of"):
        write_plot(synthetic_report(), "t", tmp_path / "plot.jpg")
