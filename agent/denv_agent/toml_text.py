"""TOML text from plain data: the one writer the agent and denv-iac share (the agent's config
file, as a node's deploy, the local runner, the Kubernetes ConfigMap and the tests write it).

Every string is a TOML basic string with each character the format forbids escaped, and
anything outside ASCII written as a Unicode escape (`\\uXXXX`, or `\\UXXXXXXXX` beyond the
basic plane), so whatever a field holds reads back as exactly that. Pure: no I/O, standard
library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import PurePath

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def to_toml(data: Mapping[str, object]) -> str:
    """TOML text for a document given as plain data: top-level keys first, then each table
    (`[key]`, a mapping) and array of tables (`[[key]]`, a non-empty list of mappings) in order."""
    lines: list[str] = []
    sections: list[tuple[str, Mapping[str, object]]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            sections.append((f"[{toml_key(key)}]", value))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            sections.extend((f"[[{toml_key(key)}]]", item) for item in value)
        else:
            lines.append(f"{toml_key(key)} = {toml_value(value)}")
    for header, table in sections:
        lines += ["", header, *(f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def toml_key(name: str) -> str:
    """A key: bare where TOML allows it, else quoted."""
    return name if _BARE_KEY.fullmatch(name) else toml_value(name)


def toml_value(value: object) -> str:
    """A TOML value (string, path, integer, finite float, boolean, or an array of them) that
    reads back as `value`; ValueError for what TOML cannot hold, TypeError for what is none of
    these."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r}: TOML has no such number here; use a finite one")
        return repr(value)
    if isinstance(value, str | PurePath):
        return '"' + "".join(_escaped(char) for char in str(value)) + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _escaped(char: str) -> str:
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    if 0x20 <= code < 0x7F:
        return char
    if 0xD800 <= code <= 0xDFFF:
        raise ValueError(f"{char!r}: a lone surrogate is no Unicode character; TOML cannot hold it")
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
