from __future__ import annotations

import pytest
from denv_agent.xid import DEFAULT_CLASSES, XidClass, XidTable, describe, parse_xids

GPU_FATAL = [46, 48, 62, 64, 74, 95, 109, 110, 119, 120, 136, 140, *range(143, 151), 155, 156, 158]
EXPECTED = (
    [(x, XidClass.APPLICATION) for x in (13, 31, 43, 45, 68, 94)]
    + [(x, XidClass.RESET_PENDING) for x in (63, 92)]
    + [(x, XidClass.GPU_FATAL) for x in GPU_FATAL]
    + [(x, XidClass.NODE_FATAL) for x in (79, 160)]
)


@pytest.mark.parametrize(("xid", "klass"), EXPECTED)
def test_default_table_follows_nvidia_classification(xid: int, klass: XidClass) -> None:
    assert XidTable.default().classify(xid) is klass


def test_default_table_lists_exactly_the_documented_xids() -> None:
    listed = sorted(x for xids in DEFAULT_CLASSES.values() for x in xids)
    assert listed == sorted(x for x, _ in EXPECTED)


@pytest.mark.parametrize("xid", [1, 8, 999, 154])
def test_unlisted_xids_are_unknown(xid: int) -> None:
    assert XidTable.default().classify(xid) is XidClass.UNKNOWN


def test_descriptions_read_as_reasons() -> None:
    assert describe(79) == "xid 79 gpu fell off the bus"
    assert describe(63) == "xid 63 row remap pending"
    assert describe(146) == "xid 146"


def test_ranges_and_numbers_parse() -> None:
    assert parse_xids([1, "3-5", " 7 - 8 "]) == [1, 3, 4, 5, 7, 8]


@pytest.mark.parametrize("bad", ["5-3", "x", 0, -1, True, 1.5, "1-"])
def test_bad_xid_items_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="is not an XID"):
        parse_xids([bad])


def test_overrides_move_without_touching_the_rest() -> None:
    table = XidTable.with_overrides({XidClass.APPLICATION: [109, 1]})
    assert table.classify(109) is XidClass.APPLICATION
    assert table.classify(1) is XidClass.APPLICATION
    assert table.classify(48) is XidClass.GPU_FATAL
