"""A small typed client for Hetzner Robot's webservice: the stateless firewall of dedicated servers.

GEX boxes are dedicated servers, ordered and managed through Robot, not Hetzner Cloud; their
firewall filters on the switch port, before the node. As the webservice documents it
(robot.hetzner.com/doc/webservice, "Firewall"): HTTP basic auth with a webservice user, JSON
answers, form-encoded POSTs; `GET /server` lists the account's servers (`server_ip`,
`server_number`); `GET /firewall/{server-number}` reads one firewall and
`POST /firewall/{server-number}` sets it whole: `status` (active or disabled), `whitelist_hos`,
`filter_ipv6` and at most 10 rules per direction, `rules[input][n][field]` and
`rules[output][n][field]`, applied in order, the first that matches deciding; anything no rule
accepts is discarded, in either direction: since Hetzner's 2023 change a firewall without output
rules discards everything the server sends. A rule name holds letters, spaces and `. - + _ @`
only. A change is applied to the switch in about 30 s, during which the firewall reads
`in process`. A failure is `{"error": {"status", "code", "message"}}` and becomes one
`RobotApiError` line, never the credentials. No Pulumi here.

Some failures pass, and are waited out within the call's wait (`wait_s`, counted in pauses):
`403 RATE_LIMIT_EXCEEDED`, whose error also gives `max_request` and `interval` (at most that many
requests per that many seconds), is tried again after `interval`, or fails at once saying when
to run again where `interval` exceeds what is left of the wait; `409 FIREWALL_IN_PROCESS` (a
change is being applied to the switch) is tried again every `poll_s`; a GET that got no answer
(a transport error) is tried again TRANSPORT_RETRIES times, RETRY_S apart. A POST without an
answer is not repeated: whether Robot took it is unknown, and the next `up` reads the firewall.
"""

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from denv_iac.core.polling import SleptClock, poll_until
from denv_iac.core.robot_firewall import rule_problems

API_URL = "https://robot-ws.your-server.de"
RULE_FIELDS = (
    "name",
    "ip_version",
    "dst_ip",
    "dst_port",
    "src_ip",
    "src_port",
    "protocol",
    "tcp_flags",
    "action",
)
IN_PROCESS = "in process"
WAIT_S = 300.0  # how long a change may stay `in process` before the call gives up
POLL_S = 10.0
RATE_LIMITED = "RATE_LIMIT_EXCEEDED"  # 403, with `max_request` and `interval` (seconds)
FIREWALL_BUSY = "FIREWALL_IN_PROCESS"  # 409: an earlier change is still being applied
TRANSPORT_RETRIES = 3
RETRY_S = 5.0


class RobotApiError(Exception):
    """One line: the operation, and what Robot said went wrong."""

    def __init__(
        self,
        operation: str,
        message: str,
        status: int = 0,
        code: str = "",
        retry_s: float | None = None,
    ) -> None:
        super().__init__(f"Hetzner Robot {operation}: {message}")
        self.operation, self.message = operation, message
        self.status = status
        self.code = code
        self.retry_s = retry_s  # when asking again may succeed: after this long; else None


Rule = Mapping[str, str]


@dataclass(frozen=True)
class Firewall:
    server_number: int
    status: str  # active, disabled, or `in process` while the switch is configured
    whitelist_hos: bool
    filter_ipv6: bool
    input_rules: tuple[dict[str, str], ...]
    output_rules: tuple[dict[str, str], ...] = ()


def form(
    status: str,
    whitelist_hos: bool,
    filter_ipv6: bool,
    rules: Sequence[Rule],
    output_rules: Sequence[Rule],
) -> dict[str, str]:
    """The POST body: the firewall as a whole, rules numbered in order per direction, empty
    fields left out. A rule Robot would refuse is one ValueError line before any request."""
    body = {
        "status": status,
        "whitelist_hos": "true" if whitelist_hos else "false",
        "filter_ipv6": "true" if filter_ipv6 else "false",
    }
    for direction, given in (("input", rules), ("output", output_rules)):
        problems = rule_problems(direction, given)
        if problems:
            raise ValueError("; ".join(problems))
        for n, rule in enumerate(given):
            unknown = set(rule) - set(RULE_FIELDS)
            if unknown:
                where = f"rules[{direction}][{n}]"
                raise ValueError(f"{where}: fields {sorted(unknown)} are not Robot's")
            body.update({f"rules[{direction}][{n}][{k}]": str(v) for k, v in rule.items() if v})
    return body


class RobotClient:
    def __init__(
        self,
        user: str,
        password: str,
        *,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        wait_s: float = WAIT_S,
        poll_s: float = POLL_S,
    ) -> None:
        self._http = httpx.Client(
            base_url=API_URL, auth=(user, password), transport=transport, timeout=60.0
        )
        self._sleep, self._wait_s, self._poll_s = sleep, wait_s, poll_s

    def __enter__(self) -> "RobotClient":
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    def server_number(self, address: str) -> int:
        """The number of the account's server whose main IPv4 address this is."""
        for item in self._call("list servers", "GET", "/server"):
            server = item["server"]
            if server.get("server_ip") == address:
                return int(server["server_number"])
        raise RobotApiError(
            "list servers",
            f"no server of this account has the address {address}; check the node's address "
            "and that the webservice user belongs to the account that ordered it",
        )

    def firewall(self, number: int) -> Firewall:
        return _firewall(self._call("read firewall", "GET", f"/firewall/{number}"))

    def set_firewall(
        self,
        number: int,
        *,
        status: str,
        whitelist_hos: bool,
        filter_ipv6: bool,
        rules: Sequence[Rule],
        output_rules: Sequence[Rule],
    ) -> Firewall:
        """Set the whole firewall, both directions, then wait until the switch has it."""
        body = form(status, whitelist_hos, filter_ipv6, rules, output_rules)
        answers = [_firewall(self._call("set firewall", "POST", f"/firewall/{number}", data=body))]
        # The set's own answer first, then a read after each pause; the wait counts the pauses.
        slept = SleptClock(self._sleep)
        return poll_until(
            lambda: answers.pop() if answers else self.firewall(number),
            lambda answer: answer.status != IN_PROCESS,
            timeout_s=self._wait_s,
            interval_s=self._poll_s,
            clock=slept.clock,
            sleep=slept.sleep,
            timed_out=lambda _: RobotApiError(
                "set firewall", f"still {IN_PROCESS} after {self._wait_s:.0f} s; run again"
            ),
        )

    def _call(
        self, operation: str, method: str, path: str, data: Mapping[str, str] | None = None
    ) -> Any:
        """The answer's body. What passes (see the module's notes) is waited out within the
        call's wait; past it, or past the tries, the last failure is raised, saying so."""
        slept = SleptClock(self._sleep)
        unanswered = 0
        while True:
            try:
                return self._call_once(operation, method, path, data)
            except RobotApiError as error:
                if error.retry_s is None:
                    raise
                if not error.code:  # no answer, to a GET
                    unanswered += 1
                    if unanswered > TRANSPORT_RETRIES:
                        message = f"{error.message} {unanswered} times"
                        raise RobotApiError(operation, message) from None
                elif error.retry_s > self._wait_s - slept.clock():
                    waited = f" after waiting {slept.slept_s:.0f} s" if slept.slept_s else ""
                    message = f"{error.message}{waited}; run again in {error.retry_s:.0f} s"
                    raise RobotApiError(operation, message, error.status, error.code) from None
                slept.sleep(error.retry_s)

    def _call_once(
        self, operation: str, method: str, path: str, data: Mapping[str, str] | None
    ) -> Any:
        try:
            response = self._http.request(method, path, data=data)
        except httpx.HTTPError as e:
            # Asking again is safe for a GET only: a POST may have been taken.
            again = method == "GET" and isinstance(e, httpx.TransportError)
            message = f"no answer ({type(e).__name__})"
            raise RobotApiError(operation, message, retry_s=RETRY_S if again else None) from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.is_success and body is not None:
            return body
        error = body.get("error", {}) if isinstance(body, dict) else {}
        message = str(error.get("message") or f"HTTP {response.status_code}")
        code = str(error.get("code", ""))
        retry_s: float | None = None
        if response.status_code == 403 and code == RATE_LIMITED:
            interval = error.get("interval")
            if isinstance(interval, int | float) and interval > 0:
                retry_s = float(interval)
                message += f" (at most {error.get('max_request')} requests per {interval:.0f} s)"
        elif response.status_code == 409 and code == FIREWALL_BUSY:
            retry_s = self._poll_s
        raise RobotApiError(operation, message, response.status_code, code, retry_s)


def _firewall(body: Any) -> Firewall:
    firewall = body["firewall"]
    rules = firewall.get("rules") or {}
    return Firewall(
        server_number=int(firewall["server_number"]),
        status=str(firewall["status"]),
        whitelist_hos=bool(firewall["whitelist_hos"]),
        filter_ipv6=bool(firewall.get("filter_ipv6", False)),
        input_rules=_rules(rules.get("input")),
        output_rules=_rules(rules.get("output")),
    )


def _rules(given: Any) -> tuple[dict[str, str], ...]:
    return tuple(
        {k: str(v) for k, v in rule.items() if k in RULE_FIELDS and v is not None}
        for rule in given or []
    )
