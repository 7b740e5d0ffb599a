"""The endpoint frontend's checks of a request's headers and body: no control character in a
header (matched as hex, in pieces of one buffer), one plain `model` key in a JSON body, the
`model` part of a multipart upload, and why a request that names no pool was not routed.

Pure: regexes and the rules built from them.
"""

from __future__ import annotations

from denv_iac.core.balancer.sections import config_word

# Routing on the `model` field reads the body from one buffer; 64 KiB holds typical chat
# requests whole, so they can also be retried (a request larger than the buffer never is).
BUFSIZE = 65536
_ERROR_BODY_TOO_LARGE = (
    '{"error":{"type":"invalid_request_error","code":"body_too_large_to_route",'
    '"message":"the model field is not within the first 64 KiB of the body:'
    ' send the X-Denv-Pool header to name the pool"}}'
)
_ERROR_CONTROL_BYTE = (
    '{"error":{"type":"invalid_request_error","code":"invalid_header",'
    '"message":"a header holds a control character (NUL, ESC, DEL, ...): send printable text"}}'
)
# HAProxy's regex matching ends at the first NUL byte, so the headers are matched as hex, where
# a byte is two digits from an even offset. The hex converter writes into one buffer of
# tune.bufsize and silently stops when it is full: the headers (at most one buffer) are read
# in pieces whose hex fits.
_HEX_PIECE = BUFSIZE * 3 // 8
# Possessive, so that the match never backtracks: every printable byte (or tab, CR, LF) is
# consumed, and the next byte, if any, is a control character.
_CONTROL_BYTE_HEX = "^(?:[2-689A-F].|7[0-9A-E]|0[9AD])*+(?:0|1|7F)"
_ERROR_NOT_JSON = (
    '{"error":{"type":"invalid_request_error","code":"invalid_json",'
    '"message":"the body is not a JSON object: send JSON, or multipart for audio uploads"}}'
)
_ERROR_AMBIGUOUS_MODEL = (
    '{"error":{"type":"invalid_request_error","code":"ambiguous_model",'
    '"message":"the body has more than one model key, or one spelled with \\\\u escapes:'
    ' send model once, spelled plainly, or send the X-Denv-Pool header"}}'
)
# A key `model` of a JSON body, in every spelling a JSON parser reads as "model": each letter
# plain or as a \u escape (JSON has no other escape for a letter). The quotes are raw, so
# the match is a key, never text inside a string (where a quote is escaped), and the `{` or
# `,` before it keeps a string's closing quote from starting a match. Keys at any depth count:
# a regex cannot tell the top level from a nested object.
_MODEL_KEY = (
    r'[{,][[:space:]]*"(?:m|\\u006[dD])(?:o|\\u006[fF])(?:d|\\u0064)(?:e|\\u0065)'
    r'(?:l|\\u006[cC])"[[:space:]]*:'
)
_MODEL_KEY_TWICE = f"{_MODEL_KEY}[\\s\\S]*?{_MODEL_KEY}"
# The same key with an escape: the balancer's json_query reads it otherwise than a replica.
_MODEL_KEY_ESCAPED = _MODEL_KEY.replace('"(?:m', '"(?=[^"]*\\\\)(?:m', 1)
_ERROR_NO_MODEL_PART = (
    '{"error":{"type":"invalid_request_error","code":"missing_model",'
    '"message":"no model field before the file in the multipart body:'
    ' send the model field first, or the X-Denv-Pool header"}}'
)
# The `model` part of a multipart upload (transcriptions, translations): HAProxy 2.6 has no
# multipart parser, so a regex over the buffered body takes the value of the part named model.
# HAProxy's regex matching ends at the first NUL byte, and audio has NUL bytes: the model part
# has to come before the file, as the openai SDK, httpx, requests and curl -F send it.
_MULTIPART_MODEL = (
    r'^[\s\S]*?\r\n(?i:content-disposition): *form-data; *name="?model"?\r\n'
    r"(?:[^\r\n]+\r\n)*\r\n([^\r\n]*)\r\n[\s\S]*"
)


def header_pieces() -> list[str]:
    """`bytes` converters that cut a header block of up to one buffer into pieces whose hex
    fits the converter's buffer."""
    starts = range(0, BUFSIZE, _HEX_PIECE)
    return [
        f"bytes({start},{_HEX_PIECE})" if start + _HEX_PIECE < BUFSIZE else f"bytes({start})"
        for start in starts
    ]


def control_byte_check() -> list[str]:
    """A control character in a header (all but the tab) is refused, never forwarded."""
    return [
        "# A control character in a header (all but the tab) is refused, never forwarded: a",
        "# replica's parser could cut the header there or read it otherwise. HAProxy's regex",
        "# ends at a NUL, so the headers are matched as hex, a byte per two digits, in pieces.",
        *(
            f"acl control_byte req.hdrs,{piece},hex -m reg {_CONTROL_BYTE_HEX}"
            for piece in header_pieces()
        ),
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_CONTROL_BYTE}' if control_byte",
    ]


def multipart_model(pools_map: str) -> str:
    """The pool named by the `model` part of a multipart body, through the pools map."""
    return f"req.body,regsub('{_MULTIPART_MODEL}','\\1'),map({pools_map})"


def ambiguous_model_check() -> list[str]:
    """A JSON body routed by its model key must have it once, spelled plainly: the balancer
    reads the first model key, a replica's JSON parser the last."""
    return [
        "# The balancer reads the first model key, a replica's JSON parser the last: a body",
        "# routed by its model key must have one, spelled plainly (see docs/balancer.md).",
        f"acl model_key_twice req.body -m reg {config_word(_MODEL_KEY_TWICE)}",
        f"acl model_key_escaped req.body -m reg {config_word(_MODEL_KEY_ESCAPED)}",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_AMBIGUOUS_MODEL}' if !pool_header METH_POST !multipart"
        " model_key_twice || !pool_header METH_POST !multipart model_key_escaped",
    ]


def unrouted_refusals() -> list[str]:
    """Why a request that names no pool was not routed: its model field past the buffer, a body
    that is not JSON, or a multipart form without a model part before the file."""
    return [
        "http-request set-var(txn.body_len) req.body_len if !routed METH_POST",
        "http-request set-var(txn.body_unread) req.body_size,sub(txn.body_len)"
        " if !routed METH_POST",
        "http-request return status 413 content-type application/json"
        f" string '{_ERROR_BODY_TOO_LARGE}' if !routed METH_POST"
        " { var(txn.body_unread) -m int gt 0 }",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_NOT_JSON}' if !routed METH_POST !multipart"
        " !{ req.body -m reg ^[[:space:]]*[{] }",
        "http-request return status 400 content-type application/json"
        f" string '{_ERROR_NO_MODEL_PART}' if !routed METH_POST multipart"
        ' !{ req.body -m sub name=\\"model\\" }',
    ]
