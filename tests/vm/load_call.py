"""Streamed chat completions through the balancer's endpoint until told to stop, as the product's
load generator (denv_iac.ops.loadgen) sends them: each request with its own X-Request-Id.

Run inside the bed's network namespace (`python -m tests.vm.load_call CALL OUT`): CALL is a JSON
file {"url", "pool", "api_key", "load", "stop_file", "max_s"}, `load` the workers of each
protocol ({"chat": 4, "realtime": 2}: a realtime worker holds one session a round); each
protocol's load runs in rounds of ROUND_S, side by side, until `stop_file` exists or `max_s` has
passed, and every request's StreamResult goes to OUT as JSON, `started_s` counted from the start.
The endpoint's certificate is checked against SSL_CERT_FILE (the test's CA).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_report import Protocol

ROUND_S = 5.0
TIMEOUT_S = 30.0


async def load(call: dict[str, Any]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    await asyncio.gather(
        *(
            rounds(call, protocol, int(workers), t0, results)
            for protocol, workers in call["load"].items()
        )
    )
    return results


async def rounds(
    call: dict[str, Any], protocol: Protocol, workers: int, t0: float, results: list[dict[str, Any]]
) -> None:
    stop = Path(call["stop_file"])
    while not stop.exists() and time.monotonic() - t0 < float(call["max_s"]):
        offset = time.monotonic() - t0
        report = await run_load(
            call["url"],
            call["pool"],
            protocol=protocol,
            concurrency=workers,
            duration_s=ROUND_S,
            api_key=call["api_key"],
            timeout_s=TIMEOUT_S,
        )
        for result in report.results:
            row = dataclasses.asdict(result)
            row["started_s"] = result.started_s + offset
            results.append(row)


def main() -> None:
    call = json.loads(Path(sys.argv[1]).read_text())
    results = asyncio.run(load(call))
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
