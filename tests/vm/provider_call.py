"""One call of NodeSetup's dynamic provider, as the engine's provider host makes it.

Run inside the bed's network namespace (`python -m tests.vm.provider_call`): reads
{"method": ..., "args": [...]} as JSON on stdin and prints the result as JSON. Numbers reach the
provider as floats, as the engine's protobuf structs hand them over.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from denv_iac.components.node_setup import NodeSetupProvider


def _as_engine(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _as_engine(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_engine(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def main() -> None:
    call = json.load(sys.stdin)
    provider = NodeSetupProvider()
    args = _as_engine(call["args"])
    method = call["method"]
    if method == "create":
        created = provider.create(*args)
        result: Any = {"id": created.id, "outs": created.outs}
    elif method == "diff":
        diffed = provider.diff(*args)
        result = {"changes": diffed.changes, "replaces": diffed.replaces}
    elif method == "update":
        result = {"outs": provider.update(*args).outs}
    elif method == "delete":
        provider.delete(*args)
        result = None
    else:
        raise SystemExit(f"unknown provider method {method!r}")
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
