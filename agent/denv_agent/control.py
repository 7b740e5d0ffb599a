"""Client for the agent's control endpoint: drain, undrain, clear faults, inject simulated faults.

Used by `denv-agent drain|undrain|clear-faults` and by the local runner, which injects faults
into agents started with `--simulate`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from denv_agent.config import AgentConfig

# Never through a proxy: the agent is local, or reached directly from the balancer's network.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ControlFailed(Exception):
    pass


def control_url(config: AgentConfig) -> str:
    """Where this config's agent serves its control endpoint."""
    host, port = config.listen.http
    if port == 0:
        raise ControlFailed("listen.http has port 0 (picked at start-up); pass --url")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def call(
    base_url: str, token: str, action: str, body: Mapping[str, object], *, timeout_s: float = 5.0
) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/control/{action}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ControlFailed(f"{action}: {message} (http {e.code})") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ControlFailed(f"cannot reach the agent at {base_url}: {reason}") from None


def drain(base_url: str, token: str, replica: str | None = None) -> dict[str, Any]:
    return call(base_url, token, "drain", {"replica": replica})


def undrain(base_url: str, token: str, replica: str | None = None) -> dict[str, Any]:
    return call(base_url, token, "undrain", {"replica": replica})


def clear_faults(base_url: str, token: str, gpu: int | None = None) -> dict[str, Any]:
    return call(base_url, token, "clear", {"gpu": gpu})


def inject_fault(base_url: str, token: str, **fault: object) -> dict[str, Any]:
    """Script a simulated GPU of a `--simulate` agent: `inject_fault(url, token, gpu=0, xid=79)`.

    Faults (combine freely; all but slow_s need gpu): xid=N, lost=True, remap_pending=True,
    remap_failure=True, ecc_uncorrectable=N, throttle=["hw_thermal", ...], temperature_c=N,
    utilization_gpu=N, memory_used=N, mig=True, mig_pending=True, recovery_action="gpu_reset",
    error="NVMLError_Timeout" (with call="nvmlDeviceGetTemperature", default every call; None
    clears), repair=True, slow_s=SECONDS.
    """
    return call(base_url, token, "simulate", fault)
