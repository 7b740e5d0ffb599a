"""Short-lived client secrets for realtime sessions opened by browsers and phone apps.

A browser's WebSocket cannot send an Authorization header, so an app must not hold the endpoint
key. Its server, which holds the key, asks the balancer for a client secret
(`POST /v1/realtime/client_secrets`, as OpenAI's realtime API); the app opens the session with
the WebSocket subprotocols `realtime` and `openai-insecure-api-key.<secret>`, as the OpenAI SDKs
do in a browser. The secret names one pool and an expiry, and carries an HMAC-SHA256 of both
under the balancer's client secret key, so HAProxy checks it without state:

    ek_<pool>.<expires_at, unix seconds>.<hex HMAC-SHA256 of "<pool>.<expires_at>">

Pure: formats and constants; the HAProxy rules that mint and check it are in key_checks.py.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

CLIENT_SECRETS_PATH = "/v1/realtime/client_secrets"
# The subprotocol that carries a key in a browser, as OpenAI's SDKs send it.
SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"
SECRET_PREFIX = "ek_"
# A client secret only opens a session; the session then lasts as long as the call. A minute
# is enough to connect; ten minutes at most, so a leaked one is soon worthless.
DEFAULT_TTL_S = 60
MIN_TTL_S = 10
MAX_TTL_S = 600
# The balancer's HMAC key: the stack's secret, at least this long.
MIN_KEY_CHARS = 32
# The map file's one entry: HAProxy's hmac converter takes its key base64, from a variable.
KEY_MAP_ENTRY = "key"


def key_map(key: str) -> str:
    """The key file HAProxy reads: one map entry holding the key's bytes, base64."""
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(
            f"balancer.client_secret_key: shorter than {MIN_KEY_CHARS} characters; set 32 or"
            " more random ones (e.g. from `openssl rand -base64 32`)"
        )
    return f"{KEY_MAP_ENTRY} {base64.b64encode(key.encode()).decode()}\n"


def signature(key: str, pool: str, expires_at: int) -> str:
    """The hex HMAC-SHA256 that the balancer puts in a secret for `pool` until `expires_at`."""
    return hmac.new(key.encode(), f"{pool}.{expires_at}".encode(), hashlib.sha256).hexdigest()


def client_secret(key: str, pool: str, expires_at: int) -> str:
    """The secret the balancer mints for `pool`, valid until `expires_at` (unix seconds)."""
    return f"{SECRET_PREFIX}{pool}.{expires_at}.{signature(key, pool, expires_at)}"


def subprotocols(secret: str) -> list[str]:
    """What a client offers when opening a realtime session with `secret`."""
    return [REALTIME_SUBPROTOCOL, f"{SUBPROTOCOL_KEY_PREFIX}{secret}"]
