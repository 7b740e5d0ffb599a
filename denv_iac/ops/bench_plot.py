"""`denv bench --plot`: one figure of a run, readable at a glance (PNG, or SVG by suffix).

Top: the histogram of the protocol's figure (time to first token, first audio byte, or
transcript) over completed answers through the endpoint, with p50/p90/p99 marked. Bottom: the
figure of every request against the time it started, with failed requests as red crosses along
the top, so a failover shows up as a column of crosses and a latency step as a shifted cloud.
Both panels stop at 1.5 x p99: one slow outlier (often the first request) would squeeze the
rest, so slower requests are counted in a note and pinned on the top edge instead. Requests
sent straight to the replicas in the same run (`--direct`) are drawn in grey behind them.
"""

from pathlib import Path

# A bare Figure (no pyplot) needs no display and no global backend: savefig renders by format.
from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from denv_iac.ops.loadgen_report import FIGURES, LoadReport, StreamResult

FORMATS = (".png", ".svg")
SIZE_IN = (9.0, 7.0)
DPI = 120  # 1080 x 840 pixels
BINS = 60
TAIL = 1.5
PERCENTILES = ((50, "#2b6cb0"), (90, "#dd6b20"), (99, "#c53030"))
BAR, POINT, ERROR, DIRECT = "#4a90d9", "#2b6cb0", "#c53030", "#718096"


def _firsts(report: LoadReport, via: str = "endpoint") -> list[float]:
    return [r.ttft_ms for r in report.results if r.ok and r.ttft_ms is not None and r.via == via]


def ttft_limit(report: LoadReport) -> float | None:
    """The largest figure shown; None when no answer completed."""
    ttfts = _firsts(report)
    p99 = report.ttft_ms(99)
    if not ttfts or p99 is None:
        return None
    return min(max(ttfts), TAIL * p99)


def headline(report: LoadReport) -> str:
    """`N requests, K ok, F failed; TTFT p50 .. ms, ...`: the figures above the panels, and
    with a direct path `direct p50 .. ms, added .. ms`."""
    through = [r for r in report.results if r.via == "endpoint"]
    ok = sum(1 for r in through if r.ok)
    line = f"{len(through)} requests, {ok} ok, {len(through) - ok} failed"
    if report.ttft_ms(50) is not None:
        line += f"; {FIGURES[report.protocol].short} "
        line += ", ".join(f"p{q} {report.ttft_ms(q):.1f} ms" for q, _ in PERCENTILES)
    direct, added = report.ttft_ms(50, "direct"), report.added_ms(50)
    if direct is not None and added is not None:
        line += f"; direct p50 {direct:.1f} ms, added {added:+.2f} ms"
    return line


def error_legend(report: LoadReport) -> str:
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(report.errors().items()))
    return f"errors: {kinds}" if kinds else "errors: none"


def _beyond(axes: Axes, count: int, limit: float) -> None:
    if count:
        axes.text(
            0.995,
            0.97,
            f"{count} over {limit:.0f} ms",
            transform=axes.transAxes,
            ha="right",
            va="top",
            fontsize=9,
        )


def _histogram(axes: Axes, report: LoadReport, limit: float) -> None:
    ttfts = _firsts(report)
    direct = [t for t in _firsts(report, "direct") if t <= limit]
    if direct:
        axes.hist(
            direct, bins=BINS, range=(0, limit), color=DIRECT, histtype="step", label="direct"
        )
    axes.hist([t for t in ttfts if t <= limit], bins=BINS, range=(0, limit), color=BAR)
    axes.set_xlim(0, limit)
    for row, (q, color) in enumerate(PERCENTILES):
        at = report.ttft_ms(q)
        assert at is not None  # there are completed streams
        axes.axvline(at, color=color, linestyle="--", linewidth=1.2)
        # One label row per percentile: p50 and p90 are often a few pixels apart.
        axes.annotate(
            f"p{q} {at:.1f}",
            (at, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 4 + 12 * row),
            textcoords="offset points",
            ha="center",
            color=color,
            fontsize=9,
        )
    _beyond(axes, sum(1 for t in ttfts if t > limit), limit)
    axes.set_xlabel(f"{FIGURES[report.protocol].short} (ms)")
    axes.set_ylabel("requests")


def _timeline(axes: Axes, report: LoadReport, limit: float | None) -> None:
    everything = sorted(report.results, key=lambda r: (r.started_s, r.request_id))
    ordered: list[StreamResult] = [r for r in everything if r.via == "endpoint"]
    ok = [r for r in ordered if r.ok and r.ttft_ms is not None]
    top = limit if limit is not None else 1.0
    direct = [r for r in everything if r.via == "direct" and r.ok and (r.ttft_ms or 0.0) <= top]
    if direct:
        axes.scatter(
            [r.started_s for r in direct],
            [r.ttft_ms or 0.0 for r in direct],
            s=6,
            color=DIRECT,
            alpha=0.4,
        )
    inside = [r for r in ok if (r.ttft_ms or 0.0) <= top]
    beyond = [r for r in ok if (r.ttft_ms or 0.0) > top]
    axes.scatter(
        [r.started_s for r in inside],
        [r.ttft_ms or 0.0 for r in inside],
        s=6,
        color=POINT,
        alpha=0.6,
    )
    # Slower than the range: pinned on the top edge as hollow dots, and counted.
    axes.scatter(
        [r.started_s for r in beyond],
        [top] * len(beyond),
        s=14,
        facecolors="none",
        edgecolors=POINT,
    )
    _beyond(axes, len(beyond), top)
    p50 = report.ttft_ms(50)
    if p50 is not None:
        axes.axhline(p50, color=PERCENTILES[0][1], linestyle="--", linewidth=1.0)
    # Failed requests have no TTFT worth plotting: a row of crosses above the data, at their start.
    errors = [r for r in ordered if not r.ok]
    axes.scatter([r.started_s for r in errors], [top * 1.04] * len(errors), marker="x", c=ERROR)
    axes.set_ylim(0, top * 1.08)
    axes.set_xlim(0, max([report.wall_s] + [r.started_s for r in everything] + [0.1]))
    axes.set_title(error_legend(report), loc="right", color=ERROR, fontsize=9)
    axes.set_xlabel("request start (s)")
    axes.set_ylabel(f"{FIGURES[report.protocol].short} (ms)")


def render_figure(report: LoadReport, title: str) -> Figure:
    """The whole figure: a title, the headline figures, the histogram and the timeline."""
    figure = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    figure.suptitle(f"{title}\n{headline(report)}", fontsize=11, ha="left", x=0.01)
    histogram, timeline = figure.subplots(2, 1)
    limit = ttft_limit(report)
    if limit is None:
        histogram.set_axis_off()
        histogram.text(0.5, 0.5, "no completed stream", ha="center", va="center")
    else:
        _histogram(histogram, report, limit)
    _timeline(timeline, report, limit)
    return figure


def write_plot(report: LoadReport, title: str, path: Path) -> None:
    """Write the figure to `path` as PNG or SVG, chosen by its suffix (see FORMATS)."""
    if path.suffix not in FORMATS:
        raise ValueError(f"{path}: the plot's format comes from its suffix, one of {FORMATS}")
    # No creation date and no random element ids: the same run gives the same bytes.
    metadata = {"Date": None} if path.suffix == ".svg" else {}
    with rc_context({"svg.hashsalt": "denv-bench"}):
        render_figure(report, title).savefig(path, format=path.suffix[1:], metadata=metadata)
