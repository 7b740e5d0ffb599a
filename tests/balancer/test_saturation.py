"""Per-pool saturation from `show stat` rows: slots in use, queued, spilled, shed."""

import pytest

from denv_iac.core.balancer.saturation import PoolSaturation, pool_saturation
from denv_iac.core.balancer.tiers import TierBackend, parse_tier_backend


def _row(proxy: str, name: str, status: str = "UP", **fields: int) -> dict[str, str]:
    """A `show stat` row; fields left out are empty, as HAProxy leaves them."""
    row = {"pxname": proxy, "svname": name, "status": status}
    return row | {field: str(value) for field, value in fields.items()}


_server = _row


def _backend(proxy: str, **fields: int) -> dict[str, str]:
    return _row(proxy, "BACKEND", "UP", **fields)


A, B, C = "voice.home.n0.0", "voice.home.n1.0", "voice.far.n2.0"
IDLE = PoolSaturation("voice", 0, 0, 0, 0, 0)

CASES = [
    pytest.param(
        [
            _backend("voice.tier10", stot=5),
            _server("voice.tier10", A, scur=0, slim=2),
            _server("voice.tier10", B, scur=0, slim=2),
        ],
        {"voice": PoolSaturation("voice", 0, 4, 0, 0, 0)},
        id="idle: every slot free",
    ),
    pytest.param(
        [
            _backend("voice.tier10", qcur=2, scur=4, stot=9, hrsp_5xx=3),
            _server("voice.tier10", A, scur=2, slim=2, qcur=1, hrsp_5xx=1),
            _server("voice.tier10", B, scur=1, slim=2),
            # A speech stream takes a slot of the same replica.
            _backend("voice.tier10.speech", scur=1, stot=1),
            _server("voice.tier10.speech", B, scur=1, slim=2),
        ],
        # 2 queued with no replica assigned, 1 for replica A; 3 own 5xx less A's 1.
        {"voice": PoolSaturation("voice", 4, 4, 3, 0, 2)},
        id="full: queued in the backend and at a replica, the balancer's own 5xx",
    ),
    pytest.param(
        [
            _backend("voice.tier10", stot=20),
            _server("voice.tier10", A, scur=1, slim=1),
            _backend("voice.tier20", stot=6),
            _server("voice.tier20", C, scur=1, slim=1),
            _backend("voice.tier20.speech", stot=1),
            _server("voice.tier20.speech", C),
            # A realtime session is no slot: neither counted in use nor shed.
            _backend("voice.tier20.realtime", scur=1, stot=2, hrsp_5xx=4),
            _server("voice.tier20.realtime", C, scur=1),
        ],
        {"voice": PoolSaturation("voice", 2, 2, 0, 9, 0)},
        id="spilled: every request sent to a later tier",
    ),
    pytest.param(
        [
            _backend("voice.tier10", stot=3),
            _server("voice.tier10", A, status="DOWN", scur=0, slim=4),
            _server("voice.tier10", B, status="DRAIN", scur=1, slim=4),
            _server("voice.tier10", C, status="UP 1/2", scur=2, slim=4),
        ],
        # A draining replica still holds its streams, but takes no new one.
        {"voice": PoolSaturation("voice", 3, 4, 0, 0, 0)},
        id="only replicas in rotation count as slots",
    ),
    pytest.param(
        [
            _row("denv.endpoint", "FRONTEND", scur=9, hrsp_5xx=9),
            _backend("denv.no-healthy-replica", stot=4, hrsp_5xx=4),
            _row("denv.prometheus", "FRONTEND", scur=1),
            _backend("llm-8b.tier1", stot=2),
            _server("llm-8b.tier1", "llm-8b.s.n.0", scur=1, slim=32),
            _backend("voice.tier2", stot=1),
            _server("voice.tier2", C, slim=2),
        ],
        {
            "llm-8b": PoolSaturation("llm-8b", 1, 32, 0, 0, 0),
            "voice": PoolSaturation("voice", 0, 2, 0, 0, 0),
        },
        id="other proxies left out; a pool's first tier is its lowest in the balancer",
    ),
    pytest.param(
        [_backend("voice.tier10"), _server("voice.tier10", A)],
        {"voice": IDLE},
        id="no maxconn, empty fields: zero",
    ),
]


@pytest.mark.parametrize(("rows", "expected"), CASES)
def test_pool_saturation(rows: list[dict[str, str]], expected: dict[str, PoolSaturation]) -> None:
    assert pool_saturation(rows) == expected


@pytest.mark.parametrize(
    ("saturation", "saturated"),
    [
        (PoolSaturation("p", 3, 4, 0, 10, 10), False),
        (PoolSaturation("p", 4, 4, 0, 0, 0), True),
        (PoolSaturation("p", 1, 4, 2, 0, 0), True),
        (IDLE, False),
    ],
)
def test_saturated_is_now_not_since_start(saturation: PoolSaturation, saturated: bool) -> None:
    assert saturation.saturated is saturated


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("voice.tier10", TierBackend("voice", 10, "")),
        ("voice.tier10.speech", TierBackend("voice", 10, ".speech")),
        ("llm.8b.tier2.realtime", TierBackend("llm.8b", 2, ".realtime")),
        ("a.tier.b.tier3", TierBackend("a.tier.b", 3, "")),
        ("denv.no-healthy-replica", None),
        ("denv.endpoint", None),
        ("voice.tierx", None),
        (".tier1", None),
    ],
)
def test_parse_tier_backend(name: str, backend: TierBackend | None) -> None:
    assert parse_tier_backend(name) == backend


def test_only_slot_taking_backends_are_bounded() -> None:
    backends = [parse_tier_backend(f"p.tier1{twin}") for twin in ("", ".speech", ".realtime")]
    assert [backend and backend.bounded for backend in backends] == [True, True, False]
