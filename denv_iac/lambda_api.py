"""A small typed client for Lambda Cloud's REST API: instances, SSH keys, filesystems.

Lambda has no Pulumi or Terraform provider of record; the dynamic providers of LambdaSite call
this client. Every response is `{"data": ...}` on success and `{"error": {"code", "message",
"suggestion"}}` on failure; a failure becomes one `LambdaApiError` line naming the operation and
Lambda's message, never the API key. No Pulumi here.
"""

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpx

from denv_iac.core.polling import poll_until

# Spec 1.8.3 names cloud.lambda.ai the production server (cloud.lambdalabs.com is deprecated).
API_URL = "https://cloud.lambda.ai/api/v1"
NOT_FOUND_CODE = "global/object-does-not-exist"
FILESYSTEM_IN_USE_CODE = "filesystems/filesystem-in-use"
RULESET_IN_USE_CODE = "firewall-rulesets/firewall-ruleset-in-use"
THROTTLED = 429  # the request was refused, not done: always safe to send again
UNCERTAIN_STATUSES = frozenset({500, 502, 503, 504})  # it may have been done
# Statuses of an instance that will never serve again: preemption ends an instance too.
GONE_STATUSES = frozenset({"terminating", "terminated", "preempted"})
# Published limits: about one request a second overall; launches one per 12 s.
REQUEST_INTERVAL_S = 1.0
LAUNCH_INTERVAL_S = 12.0
LAUNCH_PATH = "/instance-operations/launch"
T = TypeVar("T")


class LambdaApiError(Exception):
    """One line: the operation, and what Lambda said went wrong."""

    def __init__(self, operation: str, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(f"Lambda Cloud {operation}: {message}")
        self.operation = operation
        self.status = status
        self.code = code

    @property
    def not_found(self) -> bool:
        return self.status == 404 or self.code == NOT_FOUND_CODE

    @property
    def uncertain(self) -> bool:
        """Lambda may have done what was asked: a server error or a lost connection."""
        return self.status == 0 or self.status in UNCERTAIN_STATUSES


class Pacer:
    """Spaces requests to Lambda's published limits, for every client of this process.

    The engine runs a dynamic provider's creates on concurrent threads, each with its own client:
    one shared pacer keeps them all together at one request a second and one launch per 12 s.
    A caller reserves its slot under the lock and sleeps outside it.
    """

    def __init__(
        self,
        interval_s: float = REQUEST_INTERVAL_S,
        launch_interval_s: float = LAUNCH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.interval_s, self.launch_interval_s = interval_s, launch_interval_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._next = float("-inf")
        self._next_launch = float("-inf")

    def slot(self, launch: bool) -> float:
        """Reserve the next free time for a request (a launch waits for its own limit too)."""
        with self._lock:
            now = self._clock()
            at = max(now, self._next, self._next_launch if launch else now)
            self._next = at + self.interval_s
            if launch:
                self._next_launch = at + self.launch_interval_s
            return at - now

    def wait(self, launch: bool) -> None:
        delay = self.slot(launch)
        if delay > 0:
            self._sleep(delay)


PACER = Pacer()  # one per process: every client shares it unless a test passes its own


@dataclass(frozen=True)
class Instance:
    id: str
    name: str
    status: str  # booting, active, unhealthy, terminating, terminated, preempted
    ip: str  # empty until the instance has booted
    region: str
    instance_type: str
    ssh_key_names: tuple[str, ...]
    file_system_names: tuple[str, ...]


@dataclass(frozen=True)
class SshKey:
    id: str
    name: str
    public_key: str


@dataclass(frozen=True)
class FileSystem:
    id: str
    name: str
    region: str
    mount_point: str
    is_in_use: bool


@dataclass(frozen=True)
class FirewallRuleset:
    id: str
    name: str
    region: str
    rules: tuple[Mapping[str, Any], ...]  # spec FirewallRule objects
    instance_ids: tuple[str, ...]


@dataclass(frozen=True)
class Retry:
    """How hard to try: bounded attempts with exponential backoff, and the launch wait."""

    attempts: int = 5
    backoff_s: float = 2.0
    timeout_s: float = 30.0
    launch_wait_s: float = 1800.0  # a cold GPU VM can take many minutes to boot
    poll_s: float = 10.0
    gone_wait_s: float = 600.0  # terminate is asynchronous: how long to wait for it


DEFAULT_RETRY = Retry()


def _region_name(raw: Any) -> str:
    return str(raw.get("name", "")) if isinstance(raw, Mapping) else str(raw or "")


def _instance(raw: Mapping[str, Any]) -> Instance:
    return Instance(
        id=str(raw["id"]),
        name=str(raw.get("name") or ""),
        status=str(raw.get("status", "")),
        ip=str(raw.get("ip") or ""),
        region=_region_name(raw.get("region")),
        instance_type=_region_name(raw.get("instance_type")),
        ssh_key_names=tuple(raw.get("ssh_key_names") or ()),
        file_system_names=tuple(raw.get("file_system_names") or ()),
    )


def _ssh_key(raw: Mapping[str, Any]) -> SshKey:
    return SshKey(str(raw["id"]), str(raw["name"]), str(raw.get("public_key", "")))


def _file_system(raw: Mapping[str, Any]) -> FileSystem:
    return FileSystem(
        id=str(raw["id"]),
        name=str(raw["name"]),
        region=_region_name(raw.get("region")),
        mount_point=str(raw.get("mount_point", "")),
        is_in_use=bool(raw.get("is_in_use", False)),
    )


def _ruleset(raw: Mapping[str, Any]) -> FirewallRuleset:
    return FirewallRuleset(
        id=str(raw["id"]),
        name=str(raw["name"]),
        region=_region_name(raw.get("region")),
        rules=tuple(raw.get("rules") or ()),
        instance_ids=tuple(raw.get("instance_ids") or ()),
    )


def error_message(response: httpx.Response) -> tuple[str, str]:
    """Lambda's error message (with its suggestion) and code, from any error response."""
    try:
        error = response.json().get("error", {})
    except ValueError:
        error = {}
    if not isinstance(error, Mapping) or not error.get("message"):
        return f"HTTP {response.status_code} {response.reason_phrase}".strip(), ""
    message = str(error["message"]).rstrip(".")
    if error.get("suggestion"):
        message += f" ({str(error['suggestion']).rstrip('.')})"
    return message, str(error.get("code", ""))


def _data(operation: str, response: httpx.Response) -> Any:
    """The `data` of a success; an answer that is not Lambda's JSON envelope (a proxy's or a
    captive portal's page, a truncated body) is a one-line error, not a decoding traceback."""
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, Mapping):
        kind = response.headers.get("Content-Type", "no content type")
        raise LambdaApiError(
            operation,
            f"HTTP {response.status_code} answered with {kind}, not Lambda's JSON"
            " (is a proxy in the way? check HTTPS_PROXY and the API URL)",
            # No status: the request may have been done, so a launch looks for what exists.
        )
    return answer.get("data")


class LambdaClient:
    """Lambda Cloud's API with one API key; `transport` lets tests stand in for Lambda."""

    def __init__(
        self,
        api_key: str,
        *,
        transport: httpx.BaseTransport | None = None,
        retry: Retry = DEFAULT_RETRY,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        base_url: str = API_URL,
        pacer: Pacer = PACER,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url,
            # The key travels only in this header; httpx never puts headers in its errors.
            headers={"Authorization": f"Bearer {api_key}", "Accept": "application/json"},
            transport=transport,
            timeout=retry.timeout_s,
        )
        self._retry, self._sleep, self._clock, self._pacer = retry, sleep, clock, pacer

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "LambdaClient":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(
        self,
        operation: str,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        idempotent: bool = True,
    ) -> Any:
        """The `data` of a response, after bounded retries.

        A throttled request (429) was not done and is always sent again. A server error or a lost
        connection may hide a done request: only an idempotent one (a read, a delete, a
        terminate, a rename) is sent again; a create is not, its caller looks for what exists.
        """
        for attempt in range(1, self._retry.attempts + 1):
            last = attempt == self._retry.attempts
            self._pacer.wait(launch=path == LAUNCH_PATH)
            try:
                response = self._http.request(method, path, json=body)
            except httpx.TransportError as error:
                if not idempotent or last:
                    raise LambdaApiError(operation, f"{type(error).__name__}: {error}") from None
                self._sleep(self._backoff(attempt))
                continue
            retry = response.status_code == THROTTLED or (
                idempotent and response.status_code in UNCERTAIN_STATUSES
            )
            if retry and not last:
                self._sleep(self._delay(response, attempt))
                continue
            if response.is_error:
                message, code = error_message(response)
                raise LambdaApiError(operation, message, response.status_code, code)
            return _data(operation, response)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _backoff(self, attempt: int) -> float:
        return self._retry.backoff_s * 2.0 ** (attempt - 1)

    def _delay(self, response: httpx.Response, attempt: int) -> float:
        """The backoff, or longer when Lambda says how long to wait."""
        try:
            return max(self._backoff(attempt), float(response.headers.get("Retry-After", 0)))
        except ValueError:
            return self._backoff(attempt)

    # Instances

    def list_instances(self) -> list[Instance]:
        return [_instance(raw) for raw in self._call("list instances", "GET", "/instances")]

    def instances_named(self, name: str) -> list[Instance]:
        """The live instances of that name (a gone or preempted one does not count)."""
        return [
            i for i in self.list_instances() if i.name == name and i.status not in GONE_STATUSES
        ]

    def get_instance(self, instance_id: str) -> Instance:
        raw = self._call(f"get instance {instance_id}", "GET", f"/instances/{instance_id}")
        return _instance(raw)

    def launch(
        self,
        *,
        name: str,
        region: str,
        instance_type: str,
        ssh_key_names: Sequence[str],
        file_system_names: Sequence[str] = (),
        firewall_ruleset_ids: Sequence[str] = (),
    ) -> str:
        """The id of one new instance (it is still booting: see `wait_active`).

        A launch is never sent twice: a second one would start a second billed instance. When
        Lambda's answer is lost (a server error, a timeout), the instance of that name is adopted
        if one was started, and otherwise the error says so.
        """
        body: dict[str, Any] = {
            "region_name": region,
            "instance_type_name": instance_type,
            "ssh_key_names": list(ssh_key_names),
            "file_system_names": list(file_system_names),
            "name": name,
        }
        if firewall_ruleset_ids:
            body["firewall_rulesets"] = [{"id": i} for i in firewall_ruleset_ids]
        operation = f"launch {name}"
        try:
            data = self._call(operation, "POST", LAUNCH_PATH, body, idempotent=False)
        except LambdaApiError as error:
            if not error.uncertain:
                raise
            return self._adopt_after_lost_launch(operation, name, error)
        return str(data["instance_ids"][0])

    def _adopt_after_lost_launch(self, operation: str, name: str, error: LambdaApiError) -> str:
        cause = str(error).removeprefix(f"Lambda Cloud {operation}: ")
        found = self.instances_named(name)
        if len(found) == 1:
            return found[0].id
        if found:
            ids = ", ".join(sorted(i.id for i in found))
            raise LambdaApiError(
                operation,
                f"{cause}; {len(found)} instances named {name} now exist ({ids}): terminate "
                "all but one in the Lambda Cloud console, then run pulumi up again",
                error.status,
                error.code,
            )
        raise LambdaApiError(
            operation,
            f"{cause}; no instance named {name} was started, so none is billed: run pulumi up "
            "again",
            error.status,
            error.code,
        )

    def rename(self, instance_id: str, name: str) -> Instance:
        raw = self._call(
            f"rename instance {instance_id}", "POST", f"/instances/{instance_id}", {"name": name}
        )
        return _instance(raw)

    def terminate(self, instance_id: str) -> None:
        """Terminate an instance; one that is already gone counts as terminated."""
        try:
            self._call(
                f"terminate instance {instance_id}",
                "POST",
                "/instance-operations/terminate",
                {"instance_ids": [instance_id]},
            )
        except LambdaApiError as error:
            if not error.not_found:
                raise

    def _poll(
        self,
        probe: Callable[[], T],
        done: Callable[[T], bool],
        wait_s: float,
        timed_out: Callable[[T], Exception],
    ) -> T:
        """Ask `probe` every poll interval until its answer is `done`, for at most `wait_s`."""
        return poll_until(
            probe,
            done,
            timeout_s=wait_s,
            interval_s=self._retry.poll_s,
            clock=self._clock,
            sleep=self._sleep,
            timed_out=timed_out,
        )

    def wait_active(self, instance_id: str) -> Instance:
        """The instance once it is active with an address; an error if it dies or takes too long."""

        def booting() -> Instance:
            instance = self.get_instance(instance_id)
            if instance.status in GONE_STATUSES:
                raise LambdaApiError(
                    f"launch {instance.name or instance_id}",
                    f"instance {instance_id} went {instance.status} while booting",
                )
            return instance

        wait_s = self._retry.launch_wait_s
        return self._poll(
            booting,
            lambda instance: instance.status == "active" and bool(instance.ip),
            wait_s,
            lambda instance: LambdaApiError(
                f"launch {instance.name or instance_id}",
                f"instance {instance_id} still {instance.status or 'pending'} after "
                f"{wait_s:.0f} s; check the Lambda Cloud console",
            ),
        )

    def wait_gone(self, instance_id: str) -> None:
        """Return once the instance is terminated (or unknown): its filesystems are then free."""

        def status() -> str | None:
            """The instance's status; None once Lambda no longer knows it."""
            try:
                return self.get_instance(instance_id).status
            except LambdaApiError as error:
                if error.not_found:
                    return None
                raise

        wait_s = self._retry.gone_wait_s
        self._poll(
            status,
            lambda now: now in (None, "terminated", "preempted"),
            wait_s,
            lambda now: LambdaApiError(
                f"terminate instance {instance_id}",
                f"still {now} after {wait_s:.0f} s; check the Lambda Cloud console, then run "
                "pulumi destroy again",
            ),
        )

    # SSH keys

    def list_ssh_keys(self) -> list[SshKey]:
        return [_ssh_key(raw) for raw in self._call("list SSH keys", "GET", "/ssh-keys")]

    def add_ssh_key(self, name: str, public_key: str) -> SshKey:
        body = {"name": name, "public_key": public_key}
        raw = self._call(f"add SSH key {name}", "POST", "/ssh-keys", body, idempotent=False)
        return _ssh_key(raw)

    def delete_ssh_key(self, key_id: str) -> None:
        """Delete an SSH key; one that is already gone counts as deleted.

        Spec 1.8.3 answers an unknown key id with 400 invalid-parameters, not 404: the key list
        tells whether it is gone.
        """
        try:
            self._call(f"delete SSH key {key_id}", "DELETE", f"/ssh-keys/{key_id}")
        except LambdaApiError as error:
            if error.not_found:
                return
            if error.status == 400 and all(k.id != key_id for k in self.list_ssh_keys()):
                return
            raise

    # Filesystems (regional; they attach to an instance only at launch)

    def list_file_systems(self) -> list[FileSystem]:
        return [_file_system(raw) for raw in self._call("list filesystems", "GET", "/file-systems")]

    def create_file_system(self, name: str, region: str) -> FileSystem:
        body = {"name": name, "region": region}
        operation = f"create filesystem {name}"
        raw = self._call(operation, "POST", "/filesystems", body, idempotent=False)
        return _file_system(raw)

    def delete_file_system(self, file_system_id: str) -> None:
        """Delete a filesystem; one that is already gone counts as deleted.

        An instance that was terminated a moment ago may still hold it: Lambda answers
        filesystem-in-use until the instance is gone, so that answer is waited out (bounded).
        """
        self._delete_once_free(
            f"delete filesystem {file_system_id}",
            f"/filesystems/{file_system_id}",
            FILESYSTEM_IN_USE_CODE,
        )

    # Firewall rulesets (regional; attached to an instance at launch, their rules patched later)

    def list_firewall_rulesets(self) -> list[FirewallRuleset]:
        raw = self._call("list firewall rulesets", "GET", "/firewall-rulesets")
        return [_ruleset(r) for r in raw]

    def create_firewall_ruleset(
        self, name: str, region: str, rules: Sequence[Mapping[str, Any]]
    ) -> FirewallRuleset:
        body = {"name": name, "region": region, "rules": list(rules)}
        operation = f"create firewall ruleset {name}"
        return _ruleset(self._call(operation, "POST", "/firewall-rulesets", body, idempotent=False))

    def update_firewall_ruleset(
        self, ruleset_id: str, name: str, rules: Sequence[Mapping[str, Any]]
    ) -> FirewallRuleset:
        body = {"name": name, "rules": list(rules)}
        operation = f"update firewall ruleset {ruleset_id}"
        return _ruleset(self._call(operation, "PATCH", f"/firewall-rulesets/{ruleset_id}", body))

    def delete_firewall_ruleset(self, ruleset_id: str) -> None:
        """Delete a ruleset, once no terminating instance holds it; one already gone is deleted."""
        self._delete_once_free(
            f"delete firewall ruleset {ruleset_id}",
            f"/firewall-rulesets/{ruleset_id}",
            RULESET_IN_USE_CODE,
        )

    def _delete_once_free(self, operation: str, path: str, in_use_code: str) -> None:
        """DELETE `path`, waiting out (bounded) the answer that a terminating instance still
        holds it; one already gone counts as deleted."""

        def delete() -> LambdaApiError | None:
            """None once it is deleted or gone; Lambda's answer while something still holds it."""
            try:
                self._call(operation, "DELETE", path)
            except LambdaApiError as error:
                if error.not_found:
                    return None
                if error.code != in_use_code:
                    raise
                return error
            return None

        # Past the wait, Lambda's last answer (still in use) is the error: it is never None there.
        wait_s = self._retry.gone_wait_s
        self._poll(delete, lambda held: held is None, wait_s, lambda held: cast(Exception, held))
