"""HAProxy's stats CSV (`show stat`, or the stats page's `;csv`) as rows, and its server rows.

Pure: the text comes from the stats socket (denv_iac/haproxy/runtime.py) or the stats page.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping

from denv_iac.core.balancer.tiers import TWIN_SUFFIXES


def parse_stats_rows(text: str) -> list[dict[str, str]]:
    """Every row of HAProxy's stats CSV (`show stat`, or the stats page's `;csv`).

    KeyError when the text is not that CSV (no `svname` column).
    """
    reader = csv.DictReader(io.StringIO(text.removeprefix("# ")))
    if "svname" not in (reader.fieldnames or ()):
        raise KeyError("svname")
    return list(reader)


def server_rows(rows: Iterable[Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """The server rows of `rows` by name. The rows of a tier's twins (`<tier>.realtime`,
    `<tier>.speech`) are left out: they track the tier's servers, state and all."""
    return {
        row["svname"]: dict(row)
        for row in rows
        if row["svname"] not in ("FRONTEND", "BACKEND")
        and not row["pxname"].endswith(TWIN_SUFFIXES)
    }


def parse_stats_csv(text: str) -> dict[str, dict[str, str]]:
    """Server rows of HAProxy's stats CSV (`show stat`, or the stats page's `;csv`) by name.

    KeyError when the text is not that CSV (no `svname` column).
    """
    return server_rows(parse_stats_rows(text))
