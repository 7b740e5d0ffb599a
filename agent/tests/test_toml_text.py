"""The one TOML writer (denv_agent.toml_text), read back by the standard library's reader:
every value type it writes, strings of any Unicode character (beyond the basic plane too),
keys that must be quoted."""

import math
import tomllib
from pathlib import PurePosixPath

import pytest
from denv_agent.config import to_toml as config_to_toml
from denv_agent.toml_text import to_toml, toml_value
from hypothesis import given, settings
from hypothesis import strategies as st

# Any Unicode scalar value: every plane, control characters and DEL included; a lone surrogate
# is no character (refused below).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
SCALARS = st.one_of(
    TEXT,
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
TABLE = st.dictionaries(TEXT, VALUES, max_size=4)


@settings(max_examples=300, deadline=None)
@given(
    top=TABLE,
    tables=st.dictionaries(TEXT, TABLE, max_size=3),
    rows=st.lists(TABLE.filter(bool), max_size=3),
)
def test_any_document_reads_back_as_written(
    top: dict[str, object], tables: dict[str, dict[str, object]], rows: list[dict[str, object]]
) -> None:
    data: dict[str, object] = {**top, **tables}
    if rows:
        data["rows"] = rows
    text = to_toml(data)
    assert text.isascii()
    assert tomllib.loads(text) == data


@pytest.mark.parametrize(
    "value",
    [
        "voice 🎙️ 𝄞 \U0010ffff",  # beyond the basic plane: \U escapes, never surrogate pairs
        "modèle-ü ß 中文 \u2028 \ufeff",
        'quotes " \' """ and \\ backslashes \\u0041',
        "nul\x00 bell\x07 tab\t newline\n return\r esc\x1b del\x7f",
        "",
        0,
        -(2**63),
        2**63 - 1,
        0.5,
        -0.0,
        1e300,
        5e-324,
        True,
        False,
        ["a", 1, 2.5, False, ["🎙", []]],
    ],
)
def test_each_value_type_reads_back(value: object) -> None:
    parsed = tomllib.loads(to_toml({"value": value, "🎙 key": value, "table": {"x": value}}))
    assert parsed == {"value": value, "🎙 key": value, "table": {"x": value}}
    if isinstance(value, float):
        assert math.copysign(1, parsed["value"]) == math.copysign(1, value)


def test_a_path_is_written_as_its_string() -> None:
    assert tomllib.loads(to_toml({"p": PurePosixPath("/var/lib/ü")})) == {"p": "/var/lib/ü"}


def test_the_agents_config_writer_is_the_shared_one() -> None:
    # It wrote strings with JSON's escapes: an astral character became a surrogate pair, which
    # TOML refuses.
    assert config_to_toml is to_toml
    assert tomllib.loads(config_to_toml({"node": "🎙"})) == {"node": "🎙"}
    assert toml_value("🎙") == '"\\U0001f399"'


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("\ud800", ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (None, TypeError),
        ({"nested": 1}, TypeError),
    ],
)
def test_what_toml_cannot_hold_is_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        to_toml({"table": {"k": value}})
