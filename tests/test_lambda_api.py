"""Lambda Cloud's REST client and the dynamic providers over it, against an in-memory Lambda."""

import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from denv_iac.components.lambda_cloud import (
    API_KEY,
    LambdaFileSystemProvider,
    LambdaFirewallRulesetProvider,
    LambdaInstanceProvider,
    LambdaSshKeyProvider,
    firewall_rules,
    lambda_name,
)
from denv_iac.core.ingress import IngressRule
from denv_iac.lambda_api import (
    API_URL,
    LAUNCH_INTERVAL_S,
    REQUEST_INTERVAL_S,
    LambdaApiError,
    LambdaClient,
    Pacer,
    Retry,
)
from tests.lambda_spec import check_request, check_response

KEY = "test-lambda-api-key-0123456789abcdef"
FAST = Retry(attempts=3, backoff_s=0.0, launch_wait_s=60.0, poll_s=5.0, gone_wait_s=60.0)
NOT_FOUND = {"code": "global/object-does-not-exist", "message": "Specified instance not found."}
IN_USE = {
    "code": "filesystems/filesystem-in-use",
    "message": "Filesystem is in use",
    "suggestion": "Terminate the instances using it first",
}
QUICK = Retry(attempts=3, backoff_s=0.0, launch_wait_s=60.0, poll_s=0.0, gone_wait_s=60.0)
UNPACED = Pacer(0.0, 0.0)
ACTIONS = {a: {"available": True} for a in ("migrate", "rebuild", "restart", "cold_reboot")}
INTERNAL = ("polls", "gone_after")


def _error(status: int, code: str, message: str, suggestion: str = "") -> httpx.Response:
    error = {"code": code, "message": message} | ({"suggestion": suggestion} if suggestion else {})
    return httpx.Response(status, json={"error": error})


@dataclass
class FakeLambda:
    """Lambda's API as far as the providers use it, shaped and paced as spec 1.8.3 says.

    Every request and every answer is checked against the pinned spec. Instances boot after
    `boot_polls` reads and, once terminated, stay `terminating` (holding their filesystems) for
    `gone_polls` more requests. Requests closer than `interval_s` (launches closer than
    `launch_interval_s`) are refused with 429, as Lambda's published limits say.
    """

    boot_polls: int = 1
    gone_polls: int = 0
    throttled: int = 0  # answer this many requests with 429 first
    failure: httpx.Response | None = None  # answer launches with this
    launch_then_fail: httpx.Response | None = None  # start the instance, then answer this
    interval_s: float = 0.0
    launch_interval_s: float = 0.0
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    file_systems: dict[str, dict[str, Any]] = field(default_factory=dict)
    rulesets: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    ids: "itertools.count[int]" = field(default_factory=itertools.count)
    last: float = float("-inf")
    last_launch: float = float("-inf")
    lock: threading.Lock = field(default_factory=threading.Lock)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            return self._handle(request)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.host == "cloud.lambda.ai", "the deprecated host is no longer used"
        path = request.url.path.removeprefix("/api/v1")
        body = json.loads(request.content) if request.content else None
        check_request(request.method, request.url.path, body)
        self.requests.append((request.method, path))
        if self._too_soon(path == "/instance-operations/launch"):
            return _error(429, "global/too-many-requests", "Too many requests")
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return _error(401, "global/invalid-api-key", "API key was invalid, expired, or deleted")
        if self.throttled:
            self.throttled -= 1
            return _error(429, "global/too-many-requests", "Too many requests")
        if self.failure is not None and path == "/instance-operations/launch":
            return self.failure
        route = getattr(
            self, "_" + request.method.lower() + path.replace("/", "_").replace("-", "_"), None
        )
        if route is not None:
            answer = route(body or {})
            response = answer if isinstance(answer, httpx.Response) else _data(answer)
        else:
            kind, _, item = path.rpartition("/")
            response = self._item(request.method, kind, item, body or {})
        check_response(request.method, request.url.path, response.status_code, response.json())
        if self.launch_then_fail is not None and path == "/instance-operations/launch":
            return self.launch_then_fail
        return response

    def _too_soon(self, launch: bool) -> bool:
        now = time.monotonic()
        refused = now - self.last < self.interval_s or (
            launch and now - self.last_launch < self.launch_interval_s
        )
        if not refused:
            self.last = now
            if launch:
                self.last_launch = now
        return refused

    def _id(self) -> str:
        return f"id{next(self.ids)}"

    def _shown(self, instance: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in instance.items() if k not in INTERNAL}

    def _get_instances(self, _: Any) -> list[dict[str, Any]]:
        return [self._shown(i) for i in self.instances.values()]

    def _post_instance_operations_launch(self, body: dict[str, Any]) -> dict[str, Any]:
        instance_id = self._id()
        self.instances[instance_id] = {
            "id": instance_id,
            "name": body["name"],
            "status": "booting",
            "region": {"name": body["region_name"], "description": "Virginia, USA"},
            "instance_type": {
                "name": body["instance_type_name"],
                "description": "1x H100 (80 GB PCIe)",
                "gpu_description": "H100 (80 GB PCIe)",
                "price_cents_per_hour": 249,
                "specs": {"vcpus": 26, "memory_gib": 200, "storage_gib": 1024, "gpus": 1},
            },
            "ssh_key_names": body["ssh_key_names"],
            "file_system_names": body.get("file_system_names", []),
            "actions": ACTIONS | {"terminate": {"available": True}},
            "polls": 0,
        }
        for entry in body.get("firewall_rulesets", []):
            if entry["id"] not in self.rulesets:
                return _error(400, "global/invalid-parameters", "Unknown firewall ruleset")
            self.rulesets[entry["id"]]["instance_ids"].append(instance_id)
        return {"instance_ids": [instance_id]}

    def _post_instance_operations_terminate(self, body: dict[str, Any]) -> Any:
        if any(i not in self.instances for i in body["instance_ids"]):
            return httpx.Response(404, json={"error": NOT_FOUND})
        for instance_id in body["instance_ids"]:
            instance = self.instances[instance_id]
            instance["status"] = "terminating"
            instance["gone_after"] = len(self.requests) + self.gone_polls
            self._settle(instance)
        return {
            "terminated_instances": [self._shown(self.instances[i]) for i in body["instance_ids"]]
        }

    def _settle(self, instance: dict[str, Any]) -> None:
        if instance["status"] == "terminating" and len(self.requests) >= instance["gone_after"]:
            instance["status"] = "terminated"

    def _get_ssh_keys(self, _: Any) -> list[dict[str, Any]]:
        return list(self.keys.values())

    def _post_ssh_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        key = {"id": self._id(), **body}
        self.keys[key["id"]] = key
        return key

    def _get_file_systems(self, _: Any) -> list[dict[str, Any]]:
        return [fs | {"is_in_use": self._in_use(fs)} for fs in self.file_systems.values()]

    def _in_use(self, fs: dict[str, Any]) -> bool:
        for instance in self.instances.values():
            self._settle(instance)
        return any(
            fs["name"] in i["file_system_names"] and i["status"] not in ("terminated", "preempted")
            for i in self.instances.values()
        )

    def _post_filesystems(self, body: dict[str, Any]) -> dict[str, Any]:
        fs_id = self._id()
        fs = {
            "id": fs_id,
            "name": body["name"],
            "region": {"name": body["region"], "description": "Virginia, USA"},
            "mount_point": f"/lambda/nfs/{body['name']}",
            "created": "2026-12-01T00:00:00Z",
            "created_by": {"id": "u1", "email": "ops@example.com", "status": "active"},
            "is_in_use": False,
        }
        self.file_systems[fs_id] = fs
        return fs

    def _get_firewall_rulesets(self, _: Any) -> list[dict[str, Any]]:
        return list(self.rulesets.values())

    def _post_firewall_rulesets(self, body: dict[str, Any]) -> dict[str, Any]:
        ruleset = {
            "id": self._id(),
            "name": body["name"],
            "region": {"name": body["region"], "description": "Virginia, USA"},
            "rules": body["rules"],
            "created": "2026-12-01T00:00:00Z",
            "instance_ids": [],
        }
        self.rulesets[ruleset["id"]] = ruleset
        return ruleset

    def _ruleset_item(self, method: str, item: str, body: dict[str, Any]) -> httpx.Response:
        if item not in self.rulesets:
            return httpx.Response(404, json={"error": NOT_FOUND})
        ruleset = self.rulesets[item]
        if method == "PATCH":
            ruleset |= {k: body[k] for k in ("name", "rules") if k in body}
            return _data(ruleset)
        held = [
            i
            for i in ruleset["instance_ids"]
            if i in self.instances and self.instances[i]["status"] != "terminated"
        ]
        if held:
            in_use = {
                "code": "firewall-rulesets/firewall-ruleset-in-use",
                "message": "Firewall ruleset is in use by one or more instances.",
                "suggestion": "Terminate the instances that use the ruleset before deleting it.",
            }
            return httpx.Response(400, json={"error": in_use})
        del self.rulesets[item]
        return _data({})

    def _item(self, method: str, kind: str, item: str, body: dict[str, Any]) -> httpx.Response:
        if kind == "/firewall-rulesets":
            return self._ruleset_item(method, item, body)
        store = {"/instances": self.instances, "/ssh-keys": self.keys}.get(kind, self.file_systems)
        if item not in store and kind == "/ssh-keys":  # the spec's answer to an unknown key
            return _error(400, "global/invalid-parameters", "Invalid SSH key id")
        if item not in store:
            return httpx.Response(404, json={"error": NOT_FOUND})
        if method == "DELETE":
            if kind == "/filesystems" and self._in_use(store[item]):
                return httpx.Response(400, json={"error": IN_USE})
            del store[item]
            return _data({} if kind == "/ssh-keys" else {"deleted_ids": [item]})
        instance = store[item]
        if method == "POST":
            instance["name"] = body["name"]
        instance["polls"] += 1
        self._settle(instance)
        if instance["status"] == "booting" and instance["polls"] > self.boot_polls:
            instance |= {"status": "active", "ip": f"192.0.2.{len(self.instances)}"}
        return _data(self._shown(instance))

    def launches(self) -> int:
        return self.requests.count(("POST", "/instance-operations/launch"))


def _data(payload: Any) -> httpx.Response:
    return httpx.Response(200, json={"data": payload})


@pytest.fixture
def fake() -> FakeLambda:
    return FakeLambda()


def _client(fake: FakeLambda, sleeps: list[float] | None = None) -> LambdaClient:
    clock = itertools.count(step=5).__next__
    record: Callable[[float], None] = (sleeps if sleeps is not None else []).append
    return LambdaClient(
        KEY,
        transport=fake.transport(),
        retry=FAST,
        sleep=record,
        clock=lambda: float(clock()),
        pacer=UNPACED,
    )


def _props(**extra: Any) -> dict[str, Any]:
    return {
        API_KEY: KEY,
        "name": "prod-lambda-use1-node-0",
        "region": "us-east-1",
        "instance_type": "gpu_1x_h100_pcie",
        "ssh_key_names": ["prod-lambda-use1"],
        "file_system_names": ["prod-lambda-use1-cache"],
        "__provider": "serialized",
    } | extra


def _instances(fake: FakeLambda) -> LambdaInstanceProvider:
    return LambdaInstanceProvider(fake.transport(), QUICK, UNPACED)


def test_launch_waits_until_the_instance_is_active_with_an_address(fake: FakeLambda) -> None:
    fake.boot_polls = 3
    sleeps: list[float] = []
    with _client(fake, sleeps) as client:
        instance_id = client.launch(
            name="n", region="us-east-1", instance_type="gpu_1x_h100_pcie", ssh_key_names=["k"]
        )
        instance = client.wait_active(instance_id)
    assert (instance.status, instance.ip, instance.region) == ("active", "192.0.2.1", "us-east-1")
    assert sleeps == [5.0] * 3  # one poll interval per booting answer
    launched = fake.instances[instance_id]
    assert (launched["ssh_key_names"], launched["file_system_names"]) == (["k"], [])


def test_a_launch_that_never_boots_fails_after_the_bounded_wait(fake: FakeLambda) -> None:
    fake.boot_polls = 1000
    with _client(fake) as client, pytest.raises(LambdaApiError) as error:
        client.wait_active(
            client.launch(
                name="n", region="us-east-1", instance_type="gpu_1x_h100_pcie", ssh_key_names=["k"]
            )
        )
    assert str(error.value) == (
        "Lambda Cloud launch n: instance id0 still booting after 60 s; "
        "check the Lambda Cloud console"
    )


@pytest.mark.parametrize(
    ("response", "line"),
    [
        (
            _error(
                400,
                "instance-operations/launch/insufficient-capacity",
                "Not enough capacity to fulfill launch request.",
                "Choose an instance type with more availability, or try again later.",
            ),
            "Lambda Cloud launch n: Not enough capacity to fulfill launch request (Choose an "
            "instance type with more availability, or try again later)",
        ),
        (
            httpx.Response(403, text="<html>denied</html>"),
            "Lambda Cloud launch n: HTTP 403 Forbidden",
        ),
    ],
    ids=["lambda-error", "not-json"],
)
def test_an_api_error_is_one_line_naming_the_operation_never_the_key(
    fake: FakeLambda, response: httpx.Response, line: str
) -> None:
    fake.failure = response
    with _client(fake) as client, pytest.raises(LambdaApiError) as error:
        client.launch(
            name="n", region="us-east-1", instance_type="gpu_1x_h100_pcie", ssh_key_names=["k"]
        )
    assert str(error.value) == line
    assert KEY not in str(error.value) and "\n" not in str(error.value)


def test_a_wrong_key_is_reported_without_the_key() -> None:
    client = LambdaClient(
        "wrong-key-" + KEY, transport=FakeLambda().transport(), retry=FAST, pacer=UNPACED
    )
    with client, pytest.raises(LambdaApiError) as error:
        client.list_instances()
    assert str(error.value) == (
        "Lambda Cloud list instances: API key was invalid, expired, or deleted"
    )
    assert error.value.status == 401


def test_throttling_is_retried_with_backoff_then_reported(fake: FakeLambda) -> None:
    fake.throttled = 2
    sleeps: list[float] = []
    with _client(fake, sleeps) as client:
        assert client.list_ssh_keys() == []
    assert sleeps == [0.0, 0.0] and len(fake.requests) == 3
    fake.throttled = 3  # one more than the attempts allowed
    with _client(fake) as client, pytest.raises(LambdaApiError) as error:
        client.list_ssh_keys()
    assert str(error.value) == "Lambda Cloud list SSH keys: Too many requests"


def test_retry_after_and_exponential_backoff_set_the_wait() -> None:
    responses = iter(
        [
            httpx.Response(503, headers={"Retry-After": "7"}),
            httpx.Response(502),
            httpx.Response(200, json={"data": []}),
        ]
    )
    sleeps: list[float] = []
    client = LambdaClient(
        KEY,
        transport=httpx.MockTransport(lambda _: next(responses)),
        retry=Retry(attempts=3, backoff_s=2.0),
        sleep=sleeps.append,
        pacer=UNPACED,
    )
    with client:
        assert client.list_file_systems() == []
    assert sleeps == [7.0, 4.0]


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, text="<html>Sign in to the network</html>"),
        httpx.Response(200, json=["not", "an", "envelope"]),
        httpx.Response(200, content=b'{"data": ['),
    ],
    ids=["html", "json-list", "truncated"],
)
def test_an_answer_that_is_not_lambdas_json_is_one_line(answer: httpx.Response) -> None:
    client = LambdaClient(
        KEY, transport=httpx.MockTransport(lambda _: answer), retry=FAST, pacer=UNPACED
    )
    with client, pytest.raises(LambdaApiError) as error:
        client.list_instances()
    message = str(error.value)
    assert message.startswith("Lambda Cloud list instances: HTTP 200 answered with ")
    assert "not Lambda's JSON" in message and "\n" not in message


def test_a_lost_connection_is_retried_for_reads_only() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    sleeps: list[float] = []
    client = LambdaClient(
        KEY, transport=httpx.MockTransport(refuse), retry=FAST, sleep=sleeps.append, pacer=UNPACED
    )
    with client, pytest.raises(LambdaApiError) as error:
        client.list_instances()
    assert str(error.value) == "Lambda Cloud list instances: ConnectError: connection refused"
    assert len(sleeps) == FAST.attempts - 1
    sleeps.clear()
    client = LambdaClient(
        KEY, transport=httpx.MockTransport(refuse), retry=FAST, sleep=sleeps.append, pacer=UNPACED
    )
    with client, pytest.raises(LambdaApiError):
        client.add_ssh_key("k", "ssh-ed25519 AAAA")
    assert sleeps == []  # a create may have reached Lambda: never sent twice


@pytest.mark.parametrize(
    ("parts", "name"),
    [
        (("prod", "lambda-use1", "node-0"), "prod-lambda-use1-node-0"),
        (("7x", "site"), "denv-7x-site"),
        (("stack.v2", "site"), "stack-v2-site"),
        (("a" * 59, "cache"), "a" * 59),
    ],
)
def test_lambda_names_are_letters_digits_and_dashes_from_a_letter(
    parts: tuple[str, ...], name: str
) -> None:
    assert lambda_name(*parts) == name


# The dynamic providers, as the engine calls them.


def test_instance_create_launches_once_and_keeps_the_key_only_in_state(fake: FakeLambda) -> None:
    provider = _instances(fake)
    created = provider.create(_props())
    assert created.id == "id0" and created.outs is not None
    assert created.outs == {k: v for k, v in _props(ip="192.0.2.1").items() if k != "__provider"}
    # a create retried after an interrupted `up` finds its instance instead of launching again
    assert provider.create(_props()).id == "id0"
    assert fake.launches() == 1


def test_instance_read_follows_the_live_instance_and_notices_it_gone(fake: FakeLambda) -> None:
    provider = _instances(fake)
    created = provider.create(_props())
    read = provider.read(created.id, _props(ip="192.0.2.1"))
    assert read.id == created.id and read.outs is not None and read.outs["ip"] == "192.0.2.1"
    fake.instances[created.id]["status"] = "terminated"
    assert provider.read(created.id, _props()).id == ""
    del fake.instances[created.id]
    assert provider.read(created.id, _props()).id == ""


@pytest.mark.parametrize(
    ("change", "replaces", "changes"),
    [
        ({}, [], False),
        ({"__provider": "another-library-version"}, [], False),
        ({"instance_type": "gpu_8x_h100_sxm5"}, ["instance_type"], True),
        ({"region": "us-west-1"}, ["region"], True),
        # A rotated key is recorded in place: a rotation never relaunches a machine, and a
        # later replacement launches with the key recorded (tests/components/test_key_rotation.py).
        ({"ssh_key_names": ["other"]}, [], True),
        ({"file_system_names": []}, ["file_system_names"], True),
        ({"name": "renamed"}, [], True),
        ({API_KEY: "rotated"}, [], True),
    ],
)
def test_instance_diff_replaces_only_for_what_is_fixed_at_launch(
    change: dict[str, Any], replaces: list[str], changes: bool
) -> None:
    diff = LambdaInstanceProvider().diff("id0", _props(ip="192.0.2.1"), _props(**change))
    assert (diff.replaces, diff.changes, diff.delete_before_replace) == (replaces, changes, False)


def test_instance_rename_is_an_update_in_place(fake: FakeLambda) -> None:
    provider = _instances(fake)
    created = provider.create(_props())
    updated = provider.update(created.id, _props(ip="192.0.2.1"), _props(name="renamed"))
    assert updated.outs is not None and updated.outs["name"] == "renamed"
    assert fake.instances[created.id]["name"] == "renamed" and fake.launches() == 1


def test_instance_delete_terminates_and_an_instance_already_gone_is_deleted(
    fake: FakeLambda,
) -> None:
    provider = _instances(fake)
    created = provider.create(_props())
    provider.delete(created.id, _props())
    assert fake.instances[created.id]["status"] == "terminated"
    del fake.instances[created.id]
    provider.delete(created.id, _props())  # Lambda answers 404: nothing left to do


def test_ssh_key_and_filesystem_are_created_adopted_and_deleted_idempotently(
    fake: FakeLambda,
) -> None:
    keys = LambdaSshKeyProvider(fake.transport(), QUICK, UNPACED)
    key_props = {API_KEY: KEY, "name": "prod-lambda-use1", "public_key": "ssh-ed25519 AAAA"}
    key = keys.create(key_props)
    assert key.outs == key_props and keys.create(key_props).id == key.id
    assert keys.read(key.id, key_props).id == key.id
    file_systems = LambdaFileSystemProvider(fake.transport(), QUICK, UNPACED)
    fs_props = {API_KEY: KEY, "name": "prod-lambda-use1-cache", "region": "us-east-1"}
    fs = file_systems.create(fs_props)
    assert fs.outs == fs_props | {"mount_point": "/lambda/nfs/prod-lambda-use1-cache"}
    # the cache outlives a destroyed stack's state: a new one adopts it, caches and all
    assert file_systems.create(fs_props).id == fs.id
    assert list(fake.file_systems) == [fs.id]
    for provider, made, props in ((keys, key, key_props), (file_systems, fs, fs_props)):
        provider.delete(made.id, props)
        provider.delete(made.id, props)
        assert provider.read(made.id, props).id == ""
    assert fake.keys == {} and fake.file_systems == {}


@pytest.mark.parametrize(
    ("provider", "change"),
    [
        (LambdaSshKeyProvider(), {"public_key": "ssh-ed25519 BBBB"}),
        (LambdaFileSystemProvider(), {"region": "us-west-1"}),
    ],
)
def test_unique_names_are_freed_before_a_replacement_takes_them(
    provider: LambdaSshKeyProvider | LambdaFileSystemProvider, change: dict[str, str]
) -> None:
    olds = {API_KEY: KEY, "name": "n", "public_key": "ssh-ed25519 AAAA", "region": "us-east-1"}
    diff = provider.diff("id0", olds, olds | change)
    assert diff.replaces == list(change) and diff.delete_before_replace is True


def test_a_rotated_key_of_its_own_name_is_made_before_the_old_one_is_deleted() -> None:
    # The site's key is named with a digest of the key: a rotated one can exist beside the old,
    # so the instances launched with the old one never see a moment without a key.
    olds = {API_KEY: KEY, "name": "site-aaaa", "public_key": "ssh-ed25519 AAAA"}
    news = {API_KEY: KEY, "name": "site-bbbb", "public_key": "ssh-ed25519 BBBB"}
    diff = LambdaSshKeyProvider().diff("id0", olds, news)
    assert diff.replaces == ["name", "public_key"] and diff.delete_before_replace is False


# Spec 1.8.3 and the published limits: what the client must do on a real account.


def test_the_client_speaks_to_the_current_host() -> None:
    assert API_URL == "https://cloud.lambda.ai/api/v1"


def test_the_spec_check_refuses_a_launch_lambda_would_refuse() -> None:
    body = {"region_name": "us-east-1", "instance_type_name": "gpu_1x_h100_pcie"}
    with pytest.raises(AssertionError, match="ssh_key_names"):
        check_request("POST", "/api/v1/instance-operations/launch", body)
    with pytest.raises(AssertionError, match="is not one of"):
        check_request("POST", "/api/v1/filesystems", {"name": "c", "region": "mars-1"})


@pytest.mark.parametrize(
    ("answer", "started"),
    [
        (httpx.Response(502, text="Bad Gateway"), True),
        (httpx.Response(504, text="Gateway Timeout"), True),
        (httpx.Response(500, json={"error": {"code": "global/unknown", "message": "boom"}}), True),
    ],
    ids=["502", "504", "500"],
)
def test_a_launch_whose_answer_is_lost_is_never_sent_again_and_its_instance_is_adopted(
    fake: FakeLambda, answer: httpx.Response, started: bool
) -> None:
    fake.launch_then_fail = answer
    provider = _instances(fake)
    created = provider.create(_props())
    assert fake.launches() == 1 and len(fake.instances) == 1
    assert created.id == next(iter(fake.instances))
    assert created.outs is not None and created.outs["ip"].startswith("192.0.2.")


def test_a_lost_launch_that_started_nothing_fails_clearly_and_bills_nothing(
    fake: FakeLambda,
) -> None:
    fake.failure = httpx.Response(502, text="Bad Gateway")
    with pytest.raises(LambdaApiError) as error:
        _instances(fake).create(_props())
    assert str(error.value) == (
        "Lambda Cloud launch prod-lambda-use1-node-0: HTTP 502 Bad Gateway; no instance named "
        "prod-lambda-use1-node-0 was started, so none is billed: run pulumi up again"
    )
    assert fake.launches() == 1 and fake.instances == {}


def test_a_launch_that_times_out_is_not_sent_again() -> None:
    fake = FakeLambda()

    def timeout_after_launch(request: httpx.Request) -> httpx.Response:
        response = fake.handle(request)
        if request.url.path.endswith("/launch"):
            raise httpx.ReadTimeout("timed out", request=request)
        return response

    client = LambdaClient(
        KEY, transport=httpx.MockTransport(timeout_after_launch), retry=FAST, pacer=UNPACED
    )
    with client:
        instance_id = client.launch(
            name="n", region="us-east-1", instance_type="gpu_1x_h100_pcie", ssh_key_names=["k"]
        )
    assert fake.launches() == 1 and list(fake.instances) == [instance_id]


def test_a_preempted_instance_ends_the_wait_at_once(fake: FakeLambda) -> None:
    fake.boot_polls = 1000
    sleeps: list[float] = []
    with _client(fake, sleeps) as client:
        instance_id = client.launch(
            name="n", region="us-east-1", instance_type="gpu_1x_h100_pcie", ssh_key_names=["k"]
        )
        fake.instances[instance_id]["status"] = "preempted"
        with pytest.raises(LambdaApiError, match="went preempted while booting"):
            client.wait_active(instance_id)
    assert sleeps == []  # no bounded 30-minute wait on an instance that is gone


def test_a_preempted_instance_leaves_the_state_and_is_launched_anew(fake: FakeLambda) -> None:
    provider = _instances(fake)
    created = provider.create(_props())
    fake.instances[created.id]["status"] = "preempted"
    assert provider.read(created.id, _props(ip="192.0.2.1")).id == ""
    again = provider.create(_props())  # the next `up`: a new instance, not the dead one
    assert again.id != created.id and fake.launches() == 2


def test_the_filesystem_is_deleted_once_the_terminated_instance_is_gone(fake: FakeLambda) -> None:
    fake.gone_polls = 3  # terminate is asynchronous: the instance holds the filesystem a while
    fs_props = {API_KEY: KEY, "name": "prod-lambda-use1-cache", "region": "us-east-1"}
    file_systems = LambdaFileSystemProvider(fake.transport(), QUICK, UNPACED)
    fs = file_systems.create(fs_props)
    instances = _instances(fake)
    created = instances.create(_props())
    instances.delete(created.id, _props())  # as the engine does: instances first
    assert fake.instances[created.id]["status"] == "terminated"
    file_systems.delete(fs.id, fs_props)
    assert fake.file_systems == {}


def test_a_filesystem_still_in_use_is_waited_for_then_deleted(fake: FakeLambda) -> None:
    fake.gone_polls = 2
    sleeps: list[float] = []
    with _client(fake, sleeps) as client:
        fs = client.create_file_system("c", "us-east-1")
        instance_id = client.launch(
            name="n",
            region="us-east-1",
            instance_type="gpu_1x_h100_pcie",
            ssh_key_names=["k"],
            file_system_names=["c"],
        )
        client.terminate(instance_id)
        client.delete_file_system(fs.id)  # refused while the instance is still terminating
    assert fake.file_systems == {} and sleeps == [FAST.poll_s]


@pytest.mark.parametrize(
    ("calls", "starts"),
    [
        ((False, False, False), [0.0, 1.0, 2.0]),
        ((True, False, True), [0.0, 1.0, 12.0]),
        ((True, True, False, False), [0.0, 12.0, 13.0, 14.0]),
    ],
)
def test_the_pacer_keeps_the_published_limits(calls: tuple[bool, ...], starts: list[float]) -> None:
    now = [0.0]
    pacer = Pacer(clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    times = []
    for launch in calls:
        pacer.wait(launch)
        times.append(now[0])
    assert (REQUEST_INTERVAL_S, LAUNCH_INTERVAL_S) == (1.0, 12.0)
    assert times == starts


def test_four_concurrent_creates_succeed_within_the_rate_limits() -> None:
    # The published limits scaled down 20 times (the pacer keeps a margin for thread jitter),
    # so the test takes seconds, not a minute.
    fake = FakeLambda(interval_s=REQUEST_INTERVAL_S / 20, launch_interval_s=LAUNCH_INTERVAL_S / 20)
    pacer = Pacer(fake.interval_s + 0.02, fake.launch_interval_s + 0.02)
    errors: list[BaseException] = []

    def create(index: int) -> None:
        provider = LambdaInstanceProvider(fake.transport(), QUICK, pacer)  # one per resource
        try:
            provider.create(_props(name=f"prod-lambda-use1-node-{index}"))
        except BaseException as error:  # reported below, in the test thread
            errors.append(error)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert fake.launches() == 4 and len(fake.instances) == 4


RULES = [
    {
        "protocol": "tcp",
        "port_range": [9100, 9100],
        "source_network": "198.51.100.7/32",
        "description": "agent-check from balancer hetzner-fsn",
    }
]


@pytest.mark.parametrize(
    ("rule", "rendered"),
    [
        (
            IngressRule("agent-from-b", "agent-check from balancer b", 9100, 9100, "b", True),
            [
                {
                    "protocol": "tcp",
                    "port_range": [9100, 9100],
                    "source_network": "198.51.100.7/32",
                    "description": "agent-check from balancer b",
                }
            ],
        ),
        (
            IngressRule("voice-from-b", "voice replicas from balancer b", 8000, 8007, "b", True),
            [
                {
                    "protocol": "tcp",
                    "port_range": [8000, 8007],
                    "source_network": "198.51.100.7/32",
                    "description": "voice replicas from balancer b",
                }
            ],
        ),
        (
            IngressRule("ssh", "SSH from admin 203.0.113.0/24", 22, 22, "203.0.113.0/24"),
            [
                {
                    "protocol": "tcp",
                    "port_range": [22, 22],
                    "source_network": "203.0.113.0/24",
                    "description": "SSH from admin 203.0.113.0/24",
                }
            ],
        ),
        (IngressRule("ssh6", "SSH from admin 2001:db8::/32", 22, 22, "2001:db8::/32"), []),
        (IngressRule("agent-from-v6", "agent-check from balancer c", 9100, 9100, "c", True), []),
        (
            IngressRule("wireguard-from-b", "WireGuard from b", 51820, 51820, "b", True, "udp"),
            [
                {
                    "protocol": "udp",
                    "port_range": [51820, 51820],
                    "source_network": "198.51.100.7/32",
                    "description": "WireGuard from b",
                }
            ],
        ),
        (
            IngressRule(
                "wireguard-v4", "WireGuard from anywhere", 51820, 51820, "0.0.0.0/0", False, "udp"
            ),
            [
                {
                    "protocol": "udp",
                    "port_range": [51820, 51820],
                    "source_network": "0.0.0.0/0",
                    "description": "WireGuard from anywhere",
                }
            ],
        ),
        (IngressRule("wireguard-v6", "WireGuard", 51820, 51820, "::/0", False, "udp"), []),
    ],
    ids=[
        "agent",
        "replicas",
        "ssh",
        "ipv6-admin",
        "ipv6-balancer",
        "wireguard",
        "wireguard-anywhere",
        "wireguard-ipv6",
    ],
)
def test_firewall_rules_open_ports_to_balancers_and_ssh_to_admins_in_ipv4(
    rule: IngressRule, rendered: list[dict[str, Any]]
) -> None:
    rules = firewall_rules([rule], {"b": "198.51.100.7", "c": "2001:db8::7"})
    assert rules == rendered
    body = {"name": "n", "region": "us-east-1", "rules": rules}
    check_request("POST", "/api/v1/firewall-rulesets", body)  # the shape Lambda takes


@pytest.mark.parametrize(
    "change",
    [{"protocol": "UDP"}, {"protocol": "wireguard"}, {"port_range": [51820]}],
    ids=["upper-case", "no-such-protocol", "one-port"],
)
def test_the_spec_check_refuses_rule_shapes_lambda_does_not_take(change: dict[str, Any]) -> None:
    """What the rules above pass is a real check: a UDP rule in another shape fails it."""
    rule = IngressRule("wireguard-from-b", "WireGuard from b", 51820, 51820, "b", True, "udp")
    (rendered,) = firewall_rules([rule], {"b": "198.51.100.7"})
    body = {"name": "n", "region": "us-east-1", "rules": [rendered | change]}
    with pytest.raises(AssertionError, match="breaks Lambda's spec"):
        check_request("POST", "/api/v1/firewall-rulesets", body)


def test_the_ruleset_is_attached_at_launch_patched_in_place_and_deleted_after_its_instances(
    fake: FakeLambda,
) -> None:
    fake.gone_polls = 2
    rulesets = LambdaFirewallRulesetProvider(fake.transport(), QUICK, UNPACED)
    fw_props = {API_KEY: KEY, "name": "prod-lambda-use1", "region": "us-east-1", "rules": RULES}
    as_engine_sends = fw_props | {"rules": [RULES[0] | {"port_range": [9100.0, 9100.0]}]}
    ruleset = rulesets.create(as_engine_sends)
    assert fake.rulesets[ruleset.id]["rules"] == RULES  # integers on the wire, as the spec says
    assert rulesets.create(fw_props).id == ruleset.id  # adopted by name and region
    instances = _instances(fake)
    created = instances.create(_props(firewall_rulesets=[ruleset.id]))
    assert fake.rulesets[ruleset.id]["instance_ids"] == [created.id]
    moved = [RULES[0] | {"source_network": "198.51.100.8/32"}]
    rulesets.update(ruleset.id, fw_props, fw_props | {"rules": moved})
    assert fake.rulesets[ruleset.id]["rules"] == moved and len(fake.rulesets) == 1
    assert rulesets.diff(ruleset.id, fw_props, fw_props | {"rules": moved}).replaces == []
    instances.delete(created.id, _props())
    rulesets.delete(ruleset.id, fw_props)
    assert fake.rulesets == {}


def test_an_instance_launched_before_its_site_had_a_ruleset_is_not_replaced_for_one() -> None:
    olds = {k: v for k, v in _props(ip="192.0.2.1").items()}
    diff = LambdaInstanceProvider().diff("id0", olds, _props(firewall_rulesets=["fw0"]))
    assert (diff.changes, diff.replaces) == (False, [])
