"""`denv bench --plot`: one self-contained SVG of a run, readable at a glance.

Top: the TTFT histogram of completed streams, with p50/p90/p99 marked. Bottom: TTFT of every
request against the time it started, with failed requests as red crosses along the top, so a
failover shows up as a column of crosses and a latency step as a shifted cloud. The same report
always gives the same bytes (fixed sizes, fixed number formats, no timestamps), so plots can be
diffed and kept next to benchmark results.
"""

import math
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from denv_iac.loadgen import LoadReport, StreamResult

WIDTH = 900
PANEL_HEIGHT = 260
LEFT, RIGHT, TOP = 70, 30, 95  # TOP leaves room for the title and the percentile labels
GAP = 70  # between the panels: room for the first panel's axis label
BINS = 60
X_TICKS = 8  # horizontal axes have room for more ticks, so less empty range past the data
TAIL = 1.5  # both panels stop at TAIL x p99; slower requests are counted (and pinned on top)
PERCENTILES = ((50, "#2b6cb0"), (90, "#dd6b20"), (99, "#c53030"))
BAR, POINT, ERROR, GRID, INK = "#4a90d9", "#2b6cb0", "#c53030", "#e2e8f0", "#1a202c"


def nice_ticks(upper: float, count: int = 5) -> list[float]:
    """0 up to at least `upper` in `count`-ish steps of 1, 2, 2.5 or 5 times a power of ten."""
    if upper <= 0:
        return [0.0, 1.0]
    raw = upper / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(math.ceil(upper / step - 1e-9) + 1)]


def _number(value: float) -> str:
    return f"{value:.0f}" if value == round(value) else f"{value:.1f}"


@dataclass(frozen=True)
class _Panel:
    """A plot area: data ranges [0, x_max] x [0, y_max] onto a pixel box."""

    top: float
    x_max: float
    y_max: float
    left: float = LEFT
    width: float = WIDTH - LEFT - RIGHT
    height: float = PANEL_HEIGHT

    def x(self, value: float) -> float:
        return self.left + self.width * value / self.x_max

    def y(self, value: float) -> float:
        return self.top + self.height * (1 - value / self.y_max)

    @property
    def bottom(self) -> float:
        return self.top + self.height


def _text(
    x: float, y: float, text: str, anchor: str = "start", size: int = 12, **extra: str
) -> str:
    attrs = "".join(f" {k.replace('_', '-')}={quoteattr(v)}" for k, v in extra.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{attrs}>'
        f"{escape(text)}</text>"
    )


def _line(x1: float, y1: float, x2: float, y2: float, color: str, dash: str = "") -> str:
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}"{dashed}/>'
    )


def _axes(
    panel: _Panel, x_ticks: list[float], y_ticks: list[float], x_label: str, y_label: str
) -> list[str]:
    parts = []
    for tick in y_ticks:
        y = panel.y(tick)
        parts.append(_line(panel.left, y, panel.left + panel.width, y, GRID))
        parts.append(_text(panel.left - 6, y + 4, _number(tick), "end", 11))
    for tick in x_ticks:
        x = panel.x(tick)
        parts.append(_line(x, panel.bottom, x, panel.bottom + 4, INK))
        parts.append(_text(x, panel.bottom + 17, _number(tick), "middle", 11))
    parts.append(_line(panel.left, panel.bottom, panel.left + panel.width, panel.bottom, INK))
    parts.append(_line(panel.left, panel.top, panel.left, panel.bottom, INK))
    parts.append(_text(panel.left + panel.width / 2, panel.bottom + 34, x_label, "middle"))
    middle = panel.top + panel.height / 2
    parts.append(_text(18, middle, y_label, "middle", transform=f"rotate(-90 18 {middle:.1f})"))
    return parts


def _ttft_range(report: LoadReport, ttfts: list[float]) -> float:
    """Upper TTFT shown: one slow outlier (often the first request) would squeeze the rest."""
    p99 = report.ttft_ms(99)
    return max([*ttfts, 1.0]) if p99 is None else min(max(ttfts), TAIL * p99)


def _beyond_note(panel: _Panel, beyond: int, limit: float) -> str:
    return _text(
        panel.left + panel.width, panel.top + 14, f"{beyond} over {_number(limit)} ms", "end", 11
    )


def _histogram(report: LoadReport, ttfts: list[float], top: float) -> list[str]:
    x_ticks = nice_ticks(_ttft_range(report, ttfts), X_TICKS)
    width = x_ticks[-1] / BINS
    counts = [0] * BINS
    beyond = 0
    for value in ttfts:
        if value > x_ticks[-1]:
            beyond += 1
        else:
            counts[min(BINS - 1, int(value / width))] += 1
    y_ticks = nice_ticks(max(counts), 4)
    panel = _Panel(top, x_ticks[-1], y_ticks[-1])
    parts = _axes(panel, x_ticks, y_ticks, "TTFT (ms)", "requests")
    for i, count in enumerate(counts):
        if count:
            x, y = panel.x(i * width), panel.y(count)
            w = panel.x((i + 1) * width) - x
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w - 1, 1):.1f}" '
                f'height="{panel.bottom - y:.1f}" fill="{BAR}"/>'
            )
    for row, (q, color) in enumerate(PERCENTILES):
        at = report.ttft_ms(q)
        assert at is not None  # there are completed streams
        x = panel.x(at)
        parts.append(_line(x, panel.top, x, panel.bottom, color, "5 3"))
        # One label row per percentile: p50 and p90 are often a few pixels apart.
        label_y = panel.top - 6 - 13 * row
        parts.append(_text(x, label_y, f"p{q} {at:.1f}", "middle", 11, fill=color))
    if beyond:
        parts.append(_beyond_note(panel, beyond, x_ticks[-1]))
    return parts


def _cross(x: float, y: float, size: float = 4) -> str:
    return (
        f'<path d="M{x - size:.1f} {y - size:.1f}L{x + size:.1f} {y + size:.1f}'
        f'M{x - size:.1f} {y + size:.1f}L{x + size:.1f} {y - size:.1f}" '
        f'stroke="{ERROR}" stroke-width="1.5"/>'
    )


def _timeline(report: LoadReport, ordered: list[StreamResult], top: float) -> list[str]:
    ok = [r for r in ordered if r.ok and r.ttft_ms is not None]
    end = max([report.wall_s] + [r.started_s for r in ordered])
    x_ticks = nice_ticks(end, X_TICKS)
    y_ticks = nice_ticks(_ttft_range(report, [r.ttft_ms or 0.0 for r in ok]), 4)
    panel = _Panel(top, x_ticks[-1], y_ticks[-1])
    parts = _axes(panel, x_ticks, y_ticks, "request start (s)", "TTFT (ms)")
    p50 = report.ttft_ms(50)
    if p50 is not None:
        y = panel.y(p50)
        color = PERCENTILES[0][1]
        parts.append(_line(panel.left, y, panel.left + panel.width, y, color, "5 3"))
        parts.append(_text(panel.left + 4, y - 4, f"p50 {p50:.1f}", size=11, fill=color))
    beyond = 0
    for r in ok:
        assert r.ttft_ms is not None
        if r.ttft_ms > panel.y_max:
            # Slower than the range: pinned on the top edge as a hollow dot, and counted.
            beyond += 1
            paint = f'fill="none" stroke="{POINT}"'
        else:
            paint = f'fill="{POINT}" fill-opacity="0.6"'
        y = panel.y(min(r.ttft_ms, panel.y_max))
        parts.append(f'<circle cx="{panel.x(r.started_s):.1f}" cy="{y:.1f}" r="2" {paint}/>')
    if beyond:
        parts.append(_beyond_note(panel, beyond, panel.y_max))
    # Failed requests have no TTFT worth plotting: a row of crosses above the plot, at their start.
    errors = [r for r in ordered if not r.ok]
    for r in errors:
        parts.append(_cross(panel.x(r.started_s), panel.top - 10))
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(report.errors().items()))
    legend = f"errors: {kinds}" if kinds else "errors: none"
    parts.append(_text(panel.left + panel.width, panel.top - 22, legend, "end", 11, fill=ERROR))
    return parts


def render_svg(report: LoadReport, title: str) -> str:
    """The whole figure as an SVG document."""
    ordered = sorted(report.results, key=lambda r: (r.started_s, r.request_id))
    ttfts = [r.ttft_ms for r in ordered if r.ok and r.ttft_ms is not None]
    second = TOP + PANEL_HEIGHT + GAP
    height = second + PANEL_HEIGHT + 50
    ok = len(ttfts)
    figures = f"{len(ordered)} requests, {ok} ok, {len(ordered) - ok} failed"
    if ttfts:
        percentiles = ", ".join(f"p{q} {report.ttft_ms(q):.1f} ms" for q, _ in PERCENTILES)
        figures += f"; TTFT {percentiles}"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" fill="{INK}">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        _text(LEFT, 24, title, size=15, font_weight="bold"),
        _text(LEFT, 44, figures),
    ]
    if ttfts:
        parts += _histogram(report, ttfts, TOP)
    else:
        parts.append(_text(WIDTH / 2, TOP + PANEL_HEIGHT / 2, "no completed stream", "middle"))
    parts += _timeline(report, ordered, second)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
