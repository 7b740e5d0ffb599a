"""A Kubernetes gateway never cuts what the endpoint still holds: its idle timers are the
endpoint's, from the stack's balancer settings (`gateway_idle_timers` in
denv_iac/core/balancer/gateway.py)."""

import dataclasses
import re
from typing import Any

import pytest

from denv_iac.core.balancer.gateway import GatewayRoute, render_gateway_config
from denv_iac.core.balancer.haproxy import render_haproxy_config
from denv_iac.core.balancer.model import BalancerSettings
from denv_iac.core.dataplane import balancer_pools
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.kube_manifests.gateway import gateway_site
from denv_iac.core.kube_manifests.site import site_manifests
from denv_iac.core.placement import PlacedReplica, place_replicas
from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.reader import read_stack
from tests.stacks import EDGE, kube_site

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
# Timers that bound how long a stream or session may go without a byte.
_IDLE = re.compile(
    r"^\s*(?:http-request set-timeout server|timeout (?:client|server|tunnel)) (\S+)"
)


def _ms(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)?", value).groups()  # type: ignore[union-attr]
    return int(number) * _UNITS_MS[unit or "ms"]


def _timer(config: str, section: str, name: str) -> int:
    """A `timeout <name>` of one section (the first line of it)."""
    body = config.split(f"\n{section}\n")[1].split("\n\n")[0]
    (value,) = re.findall(rf"^\s*timeout {name} (\S+)$", body, re.M)
    return _ms(value)


def _idle_timers(config: str) -> list[int]:
    return [_ms(m.group(1)) for line in config.splitlines() if (m := _IDLE.match(line))]


def _stack(timers: dict[str, int]) -> StackSpec:
    sites = [kube_site("k8s-a", 2), kube_site("k8s-b", 2, namespace="gpu"), EDGE]
    recipe = {"name": "voice", "min_warm": 3, "spare": 1, "sites": ["k8s-a", "k8s-b"]}
    config = {
        "denv:sites": sites,
        "denv:recipes": [{**recipe, "image": "vllm/vllm-openai:v0.11.0"}],
        "denv:balancer": {"sites": ["edge"], "timers": timers},
    }
    return read_stack("prod", config)


def _locate(replica: PlacedReplica) -> tuple[str, int, int]:
    return "192.0.2.1", 8000, 9100


def _endpoint(stack: StackSpec, settings: BalancerSettings) -> str:
    pools = balancer_pools(stack, place_replicas(stack), _locate)
    return render_haproxy_config(pools, settings, "/etc/haproxy/denv").haproxy_cfg


def _assert_gateway_holds_what_the_endpoint_holds(endpoint: str, gateway: str) -> None:
    # Before a connection is relayed: the endpoint's client timer.
    for name in ("client", "server"):
        assert _timer(gateway, "defaults", name) == _timer(endpoint, "defaults", "client")
    # Once relayed, TCP mode keeps `timeout tunnel` alone: the endpoint's longest idle timer,
    # so that no stream or realtime session is cut here while the endpoint still holds it.
    assert _timer(gateway, "defaults", "tunnel") == max(_idle_timers(endpoint))


TIMERS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "slow checks": {
        "connect_timeout_ms": 400,
        "check_timeout_ms": 2000,
        "check_inter_ms": 5000,
        "agent_inter_ms": 1000,
    },
    "fast checks": {"connect_timeout_ms": 20, "check_timeout_ms": 50, "check_inter_ms": 100},
}


@pytest.mark.parametrize("timers", TIMERS.values(), ids=TIMERS.keys())
def test_each_gateway_holds_every_stream_as_long_as_the_endpoint(timers: dict[str, Any]) -> None:
    stack = _stack(timers)
    endpoint = _endpoint(stack, balancer_settings(stack))
    placed = place_replicas(stack).replicas
    assert _timer(endpoint, "defaults", "connect") == timers.get("connect_timeout_ms", 80)
    for site in ("k8s-a", "k8s-b"):
        manifests = site_manifests(stack, stack.site(site), placed)
        assert manifests.routes, site
        gateway = manifests.gateway_config["data"]["haproxy.cfg"]
        _assert_gateway_holds_what_the_endpoint_holds(endpoint, gateway)
        # The gateway's connect is to a pod in its own cluster, not the endpoint's to a site.
        assert _timer(gateway, "defaults", "connect") == 500


@pytest.mark.parametrize(
    "stream_idle_s, tunnel_s",
    [(300, 600), (900, 600), (120, 3600), (45, 45)],
    ids=["as shipped", "long streams", "long sessions", "equal"],
)
def test_the_gateway_takes_the_settings_idle_timers(stream_idle_s: int, tunnel_s: int) -> None:
    stack = _stack({})
    settings = dataclasses.replace(
        balancer_settings(stack),
        stream_idle_timeout_s=stream_idle_s,
        realtime_tunnel_timeout_s=tunnel_s,
    )
    route = GatewayRoute("voice.k8s-a.node-0.0", "node-0", 8000, 10000, "voice-0", 8000)
    gateway = render_gateway_config(gateway_site(stack.site("k8s-a"), False), [route], settings)
    endpoint = _endpoint(stack, settings)
    _assert_gateway_holds_what_the_endpoint_holds(endpoint, gateway)
    assert _timer(gateway, "defaults", "tunnel") == 1000 * max(stream_idle_s, tunnel_s)
