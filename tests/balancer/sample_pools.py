"""A small representative placement: a voice pool across three sites, and an LLM on a slice."""

from __future__ import annotations

import dataclasses
import hashlib

from denv_iac.core.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    KeyScope,
)
from denv_iac.core.balancer.api_surface import models_list

MAP_DIR = "/etc/denv/maps"
API_KEY = "sk-denv-example"
LLM_KEY = "sk-denv-llm-only"
LLM_KEY_DIGEST = hashlib.sha256(LLM_KEY.encode()).hexdigest()


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
# The same with a key that may use the LLM alone, at most 20 requests a second.
SCOPED_SETTINGS = dataclasses.replace(
    SETTINGS,
    api_key_digests=(*SETTINGS.api_key_digests, LLM_KEY_DIGEST),
    key_scopes=(KeyScope(LLM_KEY_DIGEST, ("llm-8b",), 20),),
)


def aliases_filling(pool_names: tuple[str, ...], size: int) -> tuple[str, ...]:
    """Aliases that make the model list of `GET /v1/models` exactly `size` bytes long."""
    aliases: list[str] = []
    while (left := size - len(models_list([*pool_names, *aliases]))) > 0:
        # An entry costs its name and 45 bytes of JSON around it; names are 12 to 128 long.
        cost = left if left <= 173 else min(157, left - 100)
        aliases.append(f"alias-{len(aliases):05d}-".ljust(cost - 45, "x"))
    assert len(models_list([*pool_names, *aliases])) == size
    return tuple(aliases)
