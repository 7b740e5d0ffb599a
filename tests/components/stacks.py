"""Cluster args for the component tests: a voice-multicloud-like stack on the built site kinds."""

import copy
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from denv_iac.components import ClusterArgs


def _private_key(seed: int) -> str:
    key = Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


SSH_KEYS = {
    site: _private_key(seed)
    for seed, site in enumerate(("aws-use1", "aws-usw2", "hetzner-fsn", "office"), start=1)
}
TLS_CERTIFICATE = "-----BEGIN CERTIFICATE-----\nTEST-TLS-MATERIAL\n-----END CERTIFICATE-----"
ADMIN = "198.51.100.0/24"
DIGEST = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
SECRETS = (*SSH_KEYS.values(), TLS_CERTIFICATE)


def _secure(value: str) -> dict[str, str]:
    return {"secure": value}


def aws_site(name: str, region: str, key_of: str = "") -> dict[str, Any]:
    return {
        "name": name,
        "kind": "aws",
        "region": region,
        "instance_type": "p5.4xlarge",
        "max_nodes": 4,
        "admin_cidrs": [ADMIN],
        "ssh_private_key": _secure(SSH_KEYS[key_of or name]),
    }


def multicloud() -> ClusterArgs:
    """Voice on two AWS regions, a side model on owned A100s, a mid model on Hetzner GEX."""
    return copy.deepcopy(
        ClusterArgs(
            sites=[
                aws_site("aws-use1", "us-east-1"),
                aws_site("aws-usw2", "us-west-2"),
                {
                    "name": "hetzner-fsn",
                    "kind": "hetzner",
                    "location": "fsn1",
                    "admin_cidrs": [ADMIN],
                    "ssh_private_key": _secure(SSH_KEYS["hetzner-fsn"]),
                    "nodes": [
                        {"name": "gex-1", "address": "203.0.113.21", "server_model": "GEX130"},
                        {"name": "gex-2", "address": "203.0.113.22", "server_model": "GEX130"},
                    ],
                },
                {
                    "name": "office",
                    "kind": "joined",
                    "admin_cidrs": [ADMIN],
                    "ssh_private_key": _secure(SSH_KEYS["office"]),
                    "nodes": [
                        {"name": "rack-1", "address": "192.0.2.10", "gpu": "A100-80GB", "gpus": 2},
                        {"name": "rack-2", "address": "192.0.2.11", "gpu": "A100-80GB", "gpus": 2},
                    ],
                },
            ],
            recipes=[
                {
                    "name": "voice",
                    "gpu": "whole",
                    "gpu_models": ["H100"],
                    "min_warm": 2,
                    "spare": 1,
                    "sites": ["aws-use1", "aws-usw2"],
                    "image": "vllm/vllm-openai:v0.11.0",
                },
                {
                    "name": "side",
                    "gpu": "1g.10gb",
                    "min_warm": 1,
                    "spare": 1,
                    "sites": ["office"],
                    "image": "ghcr.io/acme/side:2",
                },
                {
                    "name": "assist",
                    "gpu": "whole",
                    "min_warm": 1,
                    "spare": 1,
                    "sites": ["hetzner-fsn"],
                    "image": "vllm/vllm-openai:v0.11.0",
                },
            ],
            balancer={
                "sites": ["hetzner-fsn", "aws-use1"],
                "port": 443,
                "api_key_digests": [DIGEST],
                "tls_certificate": _secure(TLS_CERTIFICATE),
            },
        )
    )


def local() -> ClusterArgs:
    return ClusterArgs(
        sites=[
            {
                "name": "local",
                "kind": "local",
                "nodes": [
                    {"name": "node-a", "gpu": "H100", "gpus": 2},
                    {"name": "node-b", "gpu": "H100", "gpus": 2},
                ],
            }
        ],
        recipes=[
            {"name": "voice", "gpu": "whole", "min_warm": 1, "spare": 1, "sites": ["local"]},
            {"name": "side", "gpu": "1g.10gb", "min_warm": 1, "spare": 1, "sites": ["local"]},
        ],
        balancer={"sites": ["local"], "port": 8080},
    )
