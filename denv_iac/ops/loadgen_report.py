"""What a load run measured: each request's result, and the report over them (percentiles of
each protocol's figure, its rate, errors, and what the endpoint adds over the direct path); the
protocols' names and how their figures are called.
"""

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

Protocol = Literal["chat", "speech", "transcription", "realtime"]
PROTOCOLS: tuple[Protocol, ...] = ("chat", "speech", "transcription", "realtime")


@dataclass(frozen=True)
class Figure:
    """How a protocol's figures are named: in a summary (`{key}_p50_ms`), for people (and in a
    plot, `short`), the unit counted per answer (`{units}_per_s`) and the gap between two of
    them (`{gap}_mean_ms`)."""

    key: str
    label: str
    short: str
    units: str
    gap: str


FIGURES: dict[Protocol, Figure] = {
    "chat": Figure("ttft", "time to first token", "TTFT", "tokens", "itl"),
    "speech": Figure(
        "first_audio", "time to first audio byte", "first audio", "audio_bytes", "chunk_gap"
    ),
    "transcription": Figure("transcript", "time to transcript", "transcript", "transcripts", "gap"),
    "realtime": Figure(
        "first_audio", "time to first audio byte", "first audio", "audio_deltas", "delta_gap"
    ),
}
Via = Literal["endpoint", "direct"]


@dataclass(frozen=True)
class StreamResult:
    request_id: str
    started_s: float  # since the run started
    status: int  # 0 when no HTTP response arrived
    # "" for a completed answer; else aborted (cut off), closed (a realtime session closed by
    # its peer mid-turn), connect, no_response, timeout, http_<status>, bad_answer, no_audio
    # (a realtime turn that ended without an audio delta)
    error: str
    replica: str
    # The protocol's figure (FIGURES): first token, first audio byte, or the whole transcript.
    ttft_ms: float | None
    total_ms: float
    tokens: int  # tokens, audio bytes (speech), audio deltas (realtime), 1 per transcript
    gaps_ms: tuple[float, ...] = ()
    via: Via = "endpoint"

    @property
    def ok(self) -> bool:
        return not self.error


QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class LoadReport:
    results: list[StreamResult] = field(default_factory=list)
    wall_s: float = 0.0
    protocol: Protocol = "chat"
    pool: str = ""

    def errors(self, via: Via = "endpoint") -> Counter[str]:
        return Counter(r.error for r in self.results if r.error and r.via == via)

    def has_direct(self) -> bool:
        return any(r.via == "direct" for r in self.results)

    def ttft_ms(self, q: float, via: Via = "endpoint") -> float | None:
        """Percentile `q` of the protocol's figure over the completed answers, to 0.01 ms."""
        firsts = [
            r.ttft_ms for r in self.results if r.ok and r.ttft_ms is not None and r.via == via
        ]
        value = percentile(firsts, q)
        return None if value is None else round(value, 2)

    def added_ms(self, q: float) -> float | None:
        """What the endpoint adds to percentile `q` over the direct path of the same run."""
        through, direct = self.ttft_ms(q), self.ttft_ms(q, "direct")
        return None if through is None or direct is None else round(through - direct, 2)

    def ratio(self, q: float) -> float | None:
        through, direct = self.ttft_ms(q), self.ttft_ms(q, "direct")
        return None if through is None or not direct else round(through / direct, 3)

    def summary(self) -> dict[str, object]:
        """The endpoint's figures; with a direct path, the direct ones and the difference too."""
        mine = [r for r in self.results if r.via == "endpoint"]
        gaps = [g for r in mine if r.ok for g in r.gaps_ms]
        tokens = sum(r.tokens for r in mine if r.ok)
        figure = FIGURES[self.protocol]
        figures: dict[str, object] = {
            "protocol": self.protocol,
            "requests": len(mine),
            "ok": sum(1 for r in mine if r.ok),
            "errors": dict(sorted(self.errors().items())),
            **{f"{figure.key}_p{q}_ms": self.ttft_ms(q) for q in QUANTILES},
            f"{figure.gap}_mean_ms": round(statistics.fmean(gaps), 2) if gaps else None,
            f"{figure.units}_per_s": round(tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "replicas": dict(
                sorted(Counter(r.replica for r in mine if r.ok and r.replica).items())
            ),
        }
        if self.has_direct():
            direct = [r for r in self.results if r.via == "direct"]
            figures["direct"] = {
                "requests": len(direct),
                "ok": sum(1 for r in direct if r.ok),
                "errors": dict(sorted(self.errors("direct").items())),
                **{f"{figure.key}_p{q}_ms": self.ttft_ms(q, "direct") for q in QUANTILES},
            }
            figures |= {f"added_p{q}_ms": self.added_ms(q) for q in QUANTILES}
            figures["ratio_p50"] = self.ratio(50)
        return figures
