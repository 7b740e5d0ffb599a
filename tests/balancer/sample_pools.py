"""A small representative placement: a voice pool across three sites, and an LLM on a slice."""

from __future__ import annotations

import hashlib

from denv_iac.balancer import BalancerPool, BalancerServer, BalancerSettings, BalancerTier

MAP_DIR = "/etc/denv/maps"
API_KEY = "sk-denv-example"


def server(replica_id: str, address: str, port: int = 8000) -> BalancerServer:
    _pool, site, node, *_gpu = replica_id.split(".")
    return BalancerServer(replica_id, site, node, address, port, agent_port=9100)


VOICE = BalancerPool(
    "voice",
    (
        BalancerTier(
            1,
            ("lambda-use1", "aws-use1"),
            (
                server("voice.lambda-use1.node-0.0", "10.1.0.5"),
                server("voice.aws-use1.node-0.1", "10.0.0.7"),
                server("voice.aws-use1.node-0.0", "10.0.0.7", port=8001),
            ),
        ),
        BalancerTier(
            2,
            ("nebius-eun1",),
            (server("voice.nebius-eun1.node-0.0", "10.2.0.9"),),
            connect_timeout_ms=250,
        ),
    ),
)
LLM = BalancerPool(
    "llm-8b",
    (
        BalancerTier(
            1, ("hetzner-fsn1",), (server("llm-8b.hetzner-fsn1.gex-1.0.1g.10gb", "gex-1.lan"),)
        ),
    ),
    session_affinity=False,
)
POOLS = (VOICE, LLM)
SETTINGS = BalancerSettings(
    tls_cert_path="/etc/denv/tls/endpoint.pem",
    api_key_digests=(hashlib.sha256(API_KEY.encode()).hexdigest(),),
    state_file="/var/lib/denv/haproxy.state",
)
