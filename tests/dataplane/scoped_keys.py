"""Two pools and keys of different scopes, shared by the tests of keys and client secrets."""

from __future__ import annotations

import hashlib

from benchmarks.lab.dataplane import PoolLayout

FULL_KEY = "sk-denv-every-pool"
SIDE_KEY = "sk-denv-side-only"  # may use the side pool alone
POOLS = (
    PoolLayout("voice", ((10, ("home",)),), models=("tts-voice",)),
    PoolLayout("side", ((10, ("elsewhere",)),), session_affinity=False),
)
REPLICAS = {"voice": "voice.home.n0.0", "side": "side.elsewhere.n1.0"}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
