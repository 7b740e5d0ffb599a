"""The endpoint's API surface and its own answers: the paths it forwards, by method; the model
list it answers; the request id it keeps; and the JSON bodies of its refusals and of HAProxy's
own error pages, with the Retry-After every 503 carries.

Pure: constants and the text of answers, shared by the frontend and the tier backends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from denv_iac.core.balancer.model import BalancerPool
from denv_iac.core.balancer.validation import BalancerConfigError


def error_unknown_pool(served: Iterable[str]) -> str:
    """The 404 of a pool not served (to the key that asks): it names those that are."""
    return (
        '{"error":{"type":"invalid_request_error","code":"model_not_found",'
        '"message":"unknown pool: set the model field or the X-Denv-Pool header to a served pool:'
        f' {", ".join(sorted(served))}"}}}}'
    )


ERROR_NO_SUCH_ENDPOINT = (
    '{"error":{"type":"invalid_request_error","code":"not_found",'
    '"message":"no such endpoint: the endpoint serves POST /v1/chat/completions, /v1/completions,'
    ' /v1/embeddings, /v1/audio/*, GET /v1/realtime, /v1/models and /health"}}'
)
# The endpoint's API surface, decided here alone: what it forwards to a pool's replicas, by
# method. Everything else is answered by the balancer and never forwarded: a replica's own
# control, metrics and admin paths are not the public's.
# What a route is decides its silence budget (see _silence_budget), never a body field a
# client may leave out: a JSON answer comes whole unless its body asks for a stream; speech
# always streams; a transcription comes whole, at the end; a realtime session is a tunnel.
JSON_ANSWER_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
SPEECH_PATH = "/v1/audio/speech"
TRANSCRIPTION_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
REALTIME_PATH = "/v1/realtime"
API_ROUTES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("POST", (*JSON_ANSWER_PATHS, SPEECH_PATH, *TRANSCRIPTION_PATHS)),
    ("GET", (REALTIME_PATH,)),
)


MODELS_PATH = "/v1/models"
# HAProxy builds a `return` answer in one buffer of tune.bufsize, less the room it keeps for
# header rewrites (tune.maxrewrite, 1 KiB): a longer body came back empty with a 200, or as a
# 500. The model list stays below this, leaving room for the answer's own headers.
MODELS_LIST_LIMIT = 60 * 1024
REQUEST_ID_HEADER = "X-Request-Id"
# A client's own request id is kept when it is one header of at most this many characters, each
# a letter, a digit or one of . _ : / + = -; any other is replaced by a fresh one, as a missing
# one is made. It goes into a log line, the replica's log and every answer: a long or odd one
# would bloat or break them.
REQUEST_ID_MAX = 128
REQUEST_ID_PATTERN = f"^[A-Za-z0-9._:/+=-]{{1,{REQUEST_ID_MAX}}}$"
# Every 503 of the endpoint tells the client when to try again; the OpenAI SDKs and most HTTP
# clients honour it. One second: a voice turn frees a slot within about that.
RETRY_AFTER_S = 1
RETRY_AFTER_HEADER = f"hdr Retry-After {RETRY_AFTER_S}"
# The code of HAProxy's own 503: a tier backend sets it to pool_full when a request has to wait
# for a free slot, so a 503 after that wait (timeout queue) says the pool was full.
UNAVAILABLE_CODE = "txn.unavailable"
POOL_FULL = "pool_full"
NO_HEALTHY_REPLICA = "no_healthy_replica"
# HAProxy's own error pages, as JSON like every other answer of the endpoint; bodies with %[
# are lf-strings, filled in when sent.
HAPROXY_ERRORS = {
    502: '{"error":{"type":"service_unavailable","code":"bad_gateway",'
    '"message":"the replica failed before its answer started; retry"}}',
    503: '{"error":{"type":"service_unavailable",'
    f'"code":"%[var({UNAVAILABLE_CODE},{NO_HEALTHY_REPLICA})]",'
    '"message":"no replica could take the request in time; retry after Retry-After seconds"}}',
    504: '{"error":{"type":"timeout","code":"replica_timeout",'
    '"message":"the replica did not answer in time; retry"}}',
}
# lf-string: the pool name is validated to JSON-safe characters before it gets here.
ERROR_NO_REPLICA = (
    f'{{"error":{{"type":"service_unavailable","code":"{NO_HEALTHY_REPLICA}",'
    '"message":"no healthy replica in any allowed site of pool %[var(txn.pool)]"}}'
)


def pool_models_list(pools: Sequence[BalancerPool]) -> str:
    """OpenAI's `GET /v1/models` answer: each pool and its aliases (names are JSON-safe,
    validated)."""
    return models_list({name for pool in pools for name in (pool.name, *pool.models)})


def models_list(names: Iterable[str]) -> str:
    """OpenAI's model list of these names, as the endpoint answers `GET /v1/models`."""
    models = ",".join(
        f'{{"id":"{name}","object":"model","owned_by":"denv"}}' for name in sorted(set(names))
    )
    return f'{{"object":"list","data":[{models}]}}'


def models_list_problem(names: Iterable[str]) -> str | None:
    """Why the endpoint could not answer `GET /v1/models` whole with these model names, as one
    line naming the field and the fix; None when it can. `denv plan` and the renderer both
    refuse on it."""
    error = models_list_error(names)
    return None if error is None else str(error)


def models_list_error(names: Iterable[str]) -> BalancerConfigError | None:
    size = len(models_list(names).encode())
    if size <= MODELS_LIST_LIMIT:
        return None
    return BalancerConfigError(
        "recipes[].models",
        f"the model list the endpoint answers on {MODELS_PATH} would be {size} bytes,"
        f" over HAProxy's limit of {MODELS_LIST_LIMIT} (one buffer)",
        "give fewer aliases or shorter names",
    )
