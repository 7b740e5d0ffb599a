"""Lambda Cloud's REST client and the dynamic providers over it, against an in-memory Lambda."""

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from denv_iac.components.lambda_cloud import (
    API_KEY,
    LambdaFileSystemProvider,
    LambdaInstanceProvider,
    LambdaSshKeyProvider,
    lambda_name,
)
from denv_iac.lambda_api import LambdaApiError, LambdaClient, Retry

KEY = "test-lambda-api-key-0123456789abcdef"
FAST = Retry(attempts=3, backoff_s=0.0, launch_wait_s=60.0, poll_s=5.0)
NOT_FOUND = {"code": "global/object-does-not-exist", "message": "Specified instance not found."}


def _error(status: int, code: str, message: str, suggestion: str = "") -> httpx.Response:
    error = {"code": code, "message": message} | ({"suggestion": suggestion} if suggestion else {})
    return httpx.Response(status, json={"error": error})


@dataclass
class FakeLambda:
    """Lambda's API as far as the providers use it: instances boot after `boot_polls` reads."""

    boot_polls: int = 1
    throttled: int = 0  # answer this many requests with 429 first
    failure: httpx.Response | None = None  # answer launches with this
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    file_systems: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    ids: "itertools.count[int]" = field(default_factory=itertools.count)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/api/v1")
        self.requests.append((request.method, path))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return _error(401, "global/invalid-api-key", "API key was invalid, expired, or deleted")
        if self.throttled:
            self.throttled -= 1
            return httpx.Response(429, json={"error": {"code": "global/too-many-requests"}})
        if self.failure is not None and path == "/instance-operations/launch":
            return self.failure
        body = json.loads(request.content) if request.content else {}
        route = getattr(
            self, "_" + request.method.lower() + path.replace("/", "_").replace("-", "_"), None
        )
        if route is not None:
            answer = route(body)
            if isinstance(answer, httpx.Response):
                return answer
            return httpx.Response(200, json={"data": answer})
        kind, _, item = path.rpartition("/")
        return self._item(request.method, kind, item, body)

    def _id(self) -> str:
        return f"id{next(self.ids)}"

    def _get_instances(self, _: Any) -> list[dict[str, Any]]:
        return list(self.instances.values())

    def _post_instance_operations_launch(self, body: dict[str, Any]) -> dict[str, Any]:
        instance_id = self._id()
        self.instances[instance_id] = {
            "id": instance_id,
            "name": body["name"],
            "status": "booting",
            "region": {"name": body["region_name"], "description": "Virginia, USA"},
            "instance_type": {"name": body["instance_type_name"]},
            "ssh_key_names": body["ssh_key_names"],
            "file_system_names": body["file_system_names"],
            "polls": 0,
        }
        return {"instance_ids": [instance_id]}

    def _post_instance_operations_terminate(self, body: dict[str, Any]) -> Any:
        if any(i not in self.instances for i in body["instance_ids"]):
            return httpx.Response(404, json={"error": NOT_FOUND})
        for instance_id in body["instance_ids"]:
            self.instances[instance_id]["status"] = "terminated"
        return {"terminated_instances": body["instance_ids"]}

    def _get_ssh_keys(self, _: Any) -> list[dict[str, Any]]:
        return list(self.keys.values())

    def _post_ssh_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        key = {"id": self._id(), **body}
        self.keys[key["id"]] = key
        return key

    def _get_file_systems(self, _: Any) -> list[dict[str, Any]]:
        return list(self.file_systems.values())

    def _post_filesystems(self, body: dict[str, Any]) -> dict[str, Any]:
        fs_id = self._id()
        fs = {
            "id": fs_id,
            "name": body["name"],
            "region": {"name": body["region"]},
            "mount_point": f"/lambda/nfs/{body['name']}",
            "is_in_use": False,
        }
        self.file_systems[fs_id] = fs
        return fs

    def _item(self, method: str, kind: str, item: str, body: dict[str, Any]) -> httpx.Response:
        store = {"/instances": self.instances, "/ssh-keys": self.keys}.get(kind, self.file_systems)
        if item not in store:
            return httpx.Response(404, json={"error": NOT_FOUND})
        if method == "DELETE":
            del store[item]
            return httpx.Response(200, json={"data": {"deleted_ids": [item]}})
        instance = store[item]
        if method == "POST":
            instance["name"] = body["name"]
        instance["polls"] += 1
        if instance["status"] == "booting" and instance["polls"] > self.boot_polls:
            instance |= {"status": "active", "ip": f"192.0.2.{len(self.instances)}"}
        return httpx.Response(200, json={"data": instance})

    def launches(self) -> int:
        return self.requests.count(("POST", "/instance-operations/launch"))


@pytest.fixture
def fake() -> FakeLambda:
    return FakeLambda()


def _client(fake: FakeLambda, sleeps: list[float] | None = None) -> LambdaClient:
    clock = itertools.count(step=5).__next__
    record: Callable[[float], None] = (sleeps if sleeps is not None else []).append
    return LambdaClient(
        KEY, transport=fake.transport(), retry=FAST, sleep=record, clock=lambda: float(clock())
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
    return LambdaInstanceProvider(fake.transport(), FAST)


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
        client.wait_active(client.launch(name="n", region="r", instance_type="t", ssh_key_names=[]))
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
        client.launch(name="n", region="r", instance_type="t", ssh_key_names=[])
    assert str(error.value) == line
    assert KEY not in str(error.value) and "\n" not in str(error.value)


def test_a_wrong_key_is_reported_without_the_key() -> None:
    client = LambdaClient("wrong-key-" + KEY, transport=FakeLambda().transport(), retry=FAST)
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
    assert str(error.value) == "Lambda Cloud list SSH keys: HTTP 429 Too Many Requests"


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
    )
    with client:
        assert client.list_file_systems() == []
    assert sleeps == [7.0, 4.0]


def test_a_lost_connection_is_retried_for_reads_only() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    sleeps: list[float] = []
    client = LambdaClient(
        KEY, transport=httpx.MockTransport(refuse), retry=FAST, sleep=sleeps.append
    )
    with client, pytest.raises(LambdaApiError) as error:
        client.list_instances()
    assert str(error.value) == "Lambda Cloud list instances: ConnectError: connection refused"
    assert len(sleeps) == FAST.attempts - 1
    sleeps.clear()
    client = LambdaClient(
        KEY, transport=httpx.MockTransport(refuse), retry=FAST, sleep=sleeps.append
    )
    with client, pytest.raises(LambdaApiError):
        client.terminate("id0")
    assert sleeps == []  # a terminate may have reached Lambda: never sent twice


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
        ({"ssh_key_names": ["other"]}, ["ssh_key_names"], True),
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
    keys = LambdaSshKeyProvider(fake.transport(), FAST)
    key_props = {API_KEY: KEY, "name": "prod-lambda-use1", "public_key": "ssh-ed25519 AAAA"}
    key = keys.create(key_props)
    assert key.outs == key_props and keys.create(key_props).id == key.id
    assert keys.read(key.id, key_props).id == key.id
    file_systems = LambdaFileSystemProvider(fake.transport(), FAST)
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
