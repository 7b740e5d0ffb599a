"""GPU smoke test for a real NVIDIA machine: `python -m denv_agent.smoke`.

Starts the agent on real NVML (one replica per GPU, backed by a local health endpoint), checks
that /healthz lists every GPU with plausible values and that XID event registration succeeded,
prints a table, and exits 0 (all good), 1 (a check failed) or 2 (no usable NVML here).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from denv_agent.config import to_toml
from denv_agent.nvml_api import Nvml, describe_error, real_nvml
from denv_agent.process import AgentProcess

_MAX_PLAUSIBLE_C = 130


def gpu_count(nvml: Nvml) -> int:
    nvml.nvmlInit()
    try:
        return nvml.nvmlDeviceGetCount()
    finally:
        nvml.nvmlShutdown()


def check(doc: dict[str, Any], expected_gpus: int) -> list[str]:
    """Problems in a /healthz document from an agent on real GPUs; empty when all is well."""
    problems: list[str] = []
    if doc["nvml"]["state"] != "ok":
        problems.append(f"nvml {doc['nvml']['state']}: {doc['nvml']['error']}")
    if len(doc["gpus"]) != expected_gpus:
        problems.append(f"/healthz lists {len(doc['gpus'])} gpu(s), nvml counts {expected_gpus}")
    for gpu in doc["gpus"]:
        where = f"gpu {gpu['index']}"
        total, used = gpu.get("memory_total_bytes"), gpu.get("memory_used_bytes")
        utilization, temperature = gpu.get("utilization_pct"), gpu.get("temperature_c")
        if not str(gpu.get("uuid", "")).startswith("GPU-"):
            problems.append(f"{where}: uuid {gpu.get('uuid')!r}")
        if not gpu.get("name"):
            problems.append(f"{where}: no name")
        if temperature is None or not 0 < temperature < _MAX_PLAUSIBLE_C:
            problems.append(f"{where}: temperature {temperature!r}")
        if utilization is None or not 0 <= utilization <= 100:
            problems.append(f"{where}: utilization {utilization!r}")
        if not total or used is None or not 0 <= used <= total:
            problems.append(f"{where}: memory {used!r} of {total!r} bytes")
        if gpu["xid_events"] != "registered":
            problems.append(f"{where}: xid event registration {gpu['xid_events']}")
        problems.extend(f"{where}: {r}" for r in gpu["reasons"] if r.startswith("nvml "))
    return problems


def table(doc: dict[str, Any]) -> str:
    rows = [("gpu", "name", "temp", "util", "memory used", "mig", "xid events", "reasons")]
    for gpu in doc["gpus"]:
        total, used = gpu.get("memory_total_bytes"), gpu.get("memory_used_bytes")
        memory = (
            f"{used / 2**30:.1f}/{total / 2**30:.0f} GiB" if total and used is not None else "?"
        )
        rows.append(
            (
                str(gpu["index"]),
                gpu.get("name") or "?",
                f"{gpu.get('temperature_c')}C",
                f"{gpu.get('utilization_pct')}%",
                memory,
                "on" if gpu.get("mig", {}).get("enabled") else "off",
                gpu["xid_events"],
                "; ".join(gpu["reasons"]) or "-",
            )
        )
    rows.extend((r["id"], "", "", "", "", "", r["reply"], "") for r in doc["replicas"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def _health_endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()


def _healthz(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
        doc: dict[str, Any] = json.loads(response.read())
        return doc


def _settled(doc: dict[str, Any], gpus: int) -> bool:
    """Every replica checked once; NVML failed, or polled every GPU and registered for XIDs."""
    if not all(r["health"] and r["health"]["checks"] for r in doc["replicas"]):
        return False
    state, listed = doc["nvml"]["state"], doc["gpus"]
    return state == "unavailable" or (
        state == "ok"
        and len(listed) == gpus
        and all("polled_age_s" in g and g["xid_events"] != "pending" for g in listed)
    )


def run(gpus: int, timeout_s: float) -> int:
    with tempfile.TemporaryDirectory() as tmp, _health_endpoint() as health_url:
        config = Path(tmp, "agent.toml")
        config.write_text(
            to_toml(
                {
                    "node": "smoke",
                    "state_file": str(Path(tmp, "state.json")),
                    "control_token": secrets.token_hex(16),
                    "listen": {"agent_check": "127.0.0.1:0", "http": "127.0.0.1:0"},
                    "replicas": [
                        {"id": f"smoke.gpu{i}", "health_url": health_url, "gpu": i}
                        for i in range(gpus)
                    ],
                }
            )
        )
        with AgentProcess(config, ready_timeout_s=timeout_s) as agent:
            deadline = time.monotonic() + timeout_s
            doc = _healthz(agent.http_url)
            while not _settled(doc, gpus) and time.monotonic() < deadline:
                time.sleep(0.2)
                doc = _healthz(agent.http_url)
    print(f"driver {doc['nvml']['driver_version']}, {gpus} gpu(s)")
    print(table(doc))
    problems = check(doc, gpus)
    for problem in problems:
        print(f"FAIL {problem}")
    print("smoke: ok" if not problems else f"smoke: {len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m denv_agent.smoke", description="denv-agent smoke test on real GPUs"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the agent")
    args = parser.parse_args(argv)
    try:
        gpus = gpu_count(real_nvml())
    except Exception as e:
        print(
            f"smoke: NVML is not usable here ({describe_error(e)}); "
            "run this on a machine with an NVIDIA GPU and its driver",
            file=sys.stderr,
        )
        return 2
    if gpus == 0:
        print("smoke: NVML sees no GPU on this machine", file=sys.stderr)
        return 2
    return run(gpus, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
