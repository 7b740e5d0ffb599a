"""Lambda Cloud's published OpenAPI spec, pinned, and checks of requests and responses against it.

tests/data/lambda-openapi-1.8.3.json is Lambda Cloud API spec version 1.8.3 ("Lambda Cloud API",
servers https://cloud.lambda.ai/ and the deprecated https://cloud.lambdalabs.com/), as published
by Lambda at https://cloud.lambda.ai/api/v1/docs; the copy was taken unchanged from
github.com/alexandervaneck/lambda-ai-cloud-api-client (openapi-1.8.3.json, MIT-licensed repo).
"""

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SPEC_PATH = Path(__file__).parent / "data" / "lambda-openapi-1.8.3.json"


@cache
def spec() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SPEC_PATH.read_text(encoding="utf-8"))
    return loaded


def operation(method: str, path: str) -> dict[str, Any]:
    """The spec's operation for a concrete path such as /api/v1/instances/id0."""
    # Fixed paths first: /firewall-rulesets/global is not the ruleset of id "global".
    for template, ops in sorted(spec()["paths"].items(), key=lambda item: "{" in item[0]):
        pattern = "^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$"
        if re.match(pattern, path) and method.lower() in ops:
            op: dict[str, Any] = ops[method.lower()]
            return op
    raise AssertionError(f"{method} {path} is no operation of Lambda's API spec")


def _check(schema: dict[str, Any], value: Any, what: str) -> None:
    root = {**schema, "components": spec()["components"]}
    try:
        jsonschema.validate(value, root)
    except jsonschema.ValidationError as error:
        raise AssertionError(f"{what} breaks Lambda's spec: {error.message}") from None


def check_request(method: str, path: str, body: Any) -> None:
    op = operation(method, path)
    content = op.get("requestBody", {}).get("content", {}).get("application/json")
    if content is None:
        assert body in (None, {}), f"{method} {path} takes no body in Lambda's spec"
        return
    _check(content["schema"], body, f"request {method} {path}")


def check_response(method: str, path: str, status: int, body: Any) -> None:
    responses = operation(method, path)["responses"]
    assert str(status) in responses or status == 429, f"{method} {path} never answers {status}"
    if status == 429:
        return  # the spec names the limits in its description, with no schema for the answer
    schema = responses[str(status)]["content"]["application/json"]["schema"]
    _check(schema, body, f"response {status} to {method} {path}")
