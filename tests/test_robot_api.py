"""The Robot firewall of GEX boxes: its rules as a stateless filter, and the dynamic provider's
create, diff, update, read and delete called for real against a fake Robot webservice that
checks every request against the documented firewall fields (robot.hetzner.com/doc/webservice,
"Firewall": POST /firewall/{server-number} with status, whitelist_hos, filter_ipv6 and at most
10 rules per direction, rules[input][n][...] and rules[output][n][...]; a rule name of letters,
spaces and . - + _ @ only, as the community.hrobot firewall module documents it). The fake
filters as Robot does since its 2023 change: both directions, a firewall without output rules
discarding everything the box sends. It answers as Robot documents its passing failures (and as
hrobot-rs and community.hrobot read them): `403 RATE_LIMIT_EXCEEDED` with `max_request` and
`interval` in the error, `409 FIREWALL_IN_PROCESS` to a POST while an earlier change is still
being applied; and it can drop requests unanswered, as a network does.
"""

import base64
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest

from denv_iac.components.hetzner_robot import PASSWORD, USER, RobotFirewallProvider
from denv_iac.core.ingress import IngressRule, OverlayAccess, ssh_rules, wireguard_rules
from denv_iac.core.robot_firewall import (
    OUTPUT_RULES,
    REPLY_RULES,
    RULE_NAME,
    robot_problems,
    robot_rules,
    rule_name,
)
from denv_iac.robot_api import RULE_FIELDS, RobotApiError, RobotClient

LOGIN, SECRET = "#ws+denvTEST", "robot-password-material"
BOX, NUMBER = "203.0.113.21", 2187654
BALANCER = "198.51.100.7"
ADMIN = "192.0.2.0/24"

PROTOCOLS = {"tcp", "udp", "gre", "icmp", "ipip", "ah", "esp"}
PORTS = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")
RULE_KEY = re.compile(r"rules\[(input|output)\]\[(\d+)\]\[(\w+)\]")
# Robot's rule-name characters, written out here apart from the product's own pattern.
DOCUMENTED_NAME = re.compile(r"[a-zA-Z .+_@-]*")


def _error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"status": status, "code": code, "message": message}}
    )


def check_rule(n: int, rule: dict[str, str]) -> None:
    """One input rule as the webservice documents it."""
    assert set(rule) <= set(RULE_FIELDS), rule
    assert rule.get("action") in ("accept", "discard"), rule
    version = rule.get("ip_version")
    assert version in (None, "ipv4", "ipv6"), rule
    if "protocol" in rule:
        assert rule["protocol"] in PROTOCOLS, rule
    if "tcp_flags" in rule:
        assert rule.get("protocol") == "tcp", f"rule {n}: tcp_flags only with tcp"
    for key in ("src_ip", "dst_ip"):
        if key in rule:
            network = ipaddress.ip_network(rule[key])
            assert version == f"ipv{network.version}", f"rule {n}: {key} and ip_version differ"
    for key in ("src_port", "dst_port"):
        if key in rule:
            match = PORTS.fullmatch(rule[key])
            assert match, f"rule {n}: {key} {rule[key]!r}"
            low, high = int(match[1]), int(match[2] or match[1])
            assert 0 < low <= high <= 65535, rule
            assert rule.get("protocol") in ("tcp", "udp"), f"rule {n}: ports need tcp or udp"
    assert DOCUMENTED_NAME.fullmatch(rule.get("name", "")), f"rule {n}: name {rule.get('name')!r}"


@dataclass
class FakeRobot:
    """Robot's webservice for one account, as far as the firewall provider uses it."""

    servers: dict[int, str] = field(default_factory=lambda: {NUMBER: BOX, 1000001: "192.0.2.99"})
    firewalls: dict[int, dict[str, Any]] = field(default_factory=dict)
    process_reads: int = 1  # a change reads `in process` this many times, then applied
    pending: dict[int, int] = field(default_factory=dict)
    posts: list[dict[str, str]] = field(default_factory=list)
    rate_limited: int = 0  # the next this many requests are over the account's rate limit
    limit_interval: int = 3600  # the rate limit's interval, in seconds
    dropped: dict[str, int] = field(default_factory=dict)  # method -> requests left unanswered

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.host == "robot-ws.your-server.de"
        expected = "Basic " + base64.b64encode(f"{LOGIN}:{SECRET}".encode()).decode()
        if request.headers.get("Authorization") != expected:
            return _error(401, "UNAUTHORIZED", "Unauthorized")
        if self.dropped.get(request.method):
            self.dropped[request.method] -= 1
            raise httpx.ConnectError("Connection reset by peer", request=request)
        if self.rate_limited:
            self.rate_limited -= 1
            error = {
                "status": 403,
                "code": "RATE_LIMIT_EXCEEDED",
                "message": "Rate limit exceeded",
                "max_request": 200,
                "interval": self.limit_interval,
            }
            return httpx.Response(403, json={"error": error})
        path = request.url.path
        if request.method == "GET" and path == "/server":
            return httpx.Response(
                200,
                json=[
                    {"server": {"server_ip": ip, "server_number": n, "product": "GEX44"}}
                    for n, ip in self.servers.items()
                ],
            )
        match = re.fullmatch(r"/firewall/(\d+)", path)
        assert match, f"{request.method} {path} is not a call the provider makes"
        number = int(match[1])
        if number not in self.servers:
            return _error(404, "SERVER_NOT_FOUND", "Server not found")
        if request.method == "POST" and self.pending.get(number, 0) > 1:
            self.pending[number] -= 1  # the switch gets on with the earlier change meanwhile
            return _error(409, "FIREWALL_IN_PROCESS", "The firewall is currently in process")
        if request.method == "POST":
            content_type = request.headers["Content-Type"]
            assert content_type == "application/x-www-form-urlencoded", content_type
            self._post(number, dict(parse_qsl(request.content.decode(), keep_blank_values=True)))
        else:
            assert request.method == "GET", request.method
        return httpx.Response(200, json={"firewall": self._read(number)})

    def _post(self, number: int, body: dict[str, str]) -> None:
        self.posts.append(dict(body))
        status = body.pop("status")
        assert status in ("active", "disabled")
        flags = {key: body.pop(key) for key in ("whitelist_hos", "filter_ipv6")}
        assert set(flags.values()) <= {"true", "false"}, flags
        rules: dict[str, dict[int, dict[str, str]]] = {"input": {}, "output": {}}
        for key, value in body.items():
            found = RULE_KEY.fullmatch(key)
            assert found, f"{key} is not a documented field"
            rules[found[1]].setdefault(int(found[2]), {})[found[3]] = value
        for direction, given in rules.items():
            assert sorted(given) == list(range(len(given))), "rules are numbered from 0, in order"
            assert len(given) <= 10, f"{len(given)} {direction} rules; Robot takes at most 10"
            for n, rule in given.items():
                check_rule(n, rule)
        self.firewalls[number] = {
            "status": status,
            "whitelist_hos": flags["whitelist_hos"] == "true",
            "filter_ipv6": flags["filter_ipv6"] == "true",
            **{direction: [given[n] for n in sorted(given)] for direction, given in rules.items()},
        }
        self.pending[number] = self.process_reads + 1

    def _read(self, number: int) -> dict[str, Any]:
        firewall = self.firewalls.get(
            number,
            {
                "status": "disabled",
                "whitelist_hos": True,
                "filter_ipv6": False,
                "input": [],
                "output": [],
            },
        )
        left = self.pending.get(number, 0)
        self.pending[number] = max(0, left - 1)
        full = {
            direction: [{**dict.fromkeys(RULE_FIELDS), **rule} for rule in firewall[direction]]
            for direction in ("input", "output")
        }
        return {
            "server_ip": self.servers[number],
            "server_number": number,
            "status": "in process" if left > 1 else firewall["status"],
            "whitelist_hos": firewall["whitelist_hos"],
            "filter_ipv6": firewall["filter_ipv6"],
            "port": "main",
            "rules": full,
        }

    def carries(self, number: int, direction: str, packet: "Packet") -> bool:
        """Whether the box's switch port lets `packet` through: all of it with the firewall
        disabled; else the direction's rules decide, and none (no output rules) discards."""
        firewall = self.firewalls.get(number)
        if firewall is None or firewall["status"] != "active":
            return True
        return _accepted(firewall[direction], packet)


SSH = IngressRule("ssh-admin", "ssh from admins", 22, 22, ADMIN)
SITE_RULES = [
    SSH,
    IngressRule("ssh-v6", "ssh from admins", 22, 22, "2001:db8::/48"),
    IngressRule("agent-from-edge", "agent", 9100, 9100, "edge", from_machine=True),
    IngressRule("voice-from-edge", "voice", 8000, 8127, "edge", from_machine=True),
    IngressRule("side-from-edge", "side", 8128, 8255, "edge", from_machine=True),
]
WIREGUARD = 51820
# The overlay on: the balancer reaches replicas and agent through the tunnel.
OVERLAY_RULES = [*SITE_RULES[:2], *wireguard_rules(OverlayAccess(WIREGUARD, ("edge",)))]
SSH_EXPECTED = {
    "name": "ssh from admins",
    "ip_version": "ipv4",
    "protocol": "tcp",
    "src_ip": ADMIN,
    "dst_port": "22",
}
EXPECTED = [
    SSH_EXPECTED,
    *(
        {
            "name": "balancer edge",
            "ip_version": "ipv4",
            "protocol": "tcp",
            "src_ip": f"{BALANCER}/32",
            "dst_port": ports,
        }
        for ports in ("8000-8255", "9100")
    ),
]


def test_rules_open_ssh_to_admins_and_each_balancers_ports_merged_then_the_replies() -> None:
    rules = robot_rules(SITE_RULES, {"edge": BALANCER})
    assert rules == [*({**rule, "action": "accept"} for rule in EXPECTED), *REPLY_RULES]
    for n, rule in enumerate(rules):
        check_rule(n, rule)


def test_with_the_overlay_a_balancer_gets_wireguards_udp_port_only() -> None:
    rules = robot_rules(OVERLAY_RULES, {"edge": BALANCER})
    wireguard = {
        "name": "balancer edge",
        "ip_version": "ipv4",
        "protocol": "udp",
        "src_ip": f"{BALANCER}/32",
        "dst_port": str(WIREGUARD),
    }
    expected = [{**r, "action": "accept"} for r in (SSH_EXPECTED, wireguard)]
    # 51820 is among the ephemeral ports the replies open to anyone: shut to others first.
    others = {
        "name": "udp others",
        "ip_version": "ipv4",
        "protocol": "udp",
        "dst_port": str(WIREGUARD),
        "action": "discard",
    }
    assert rules == [*expected, others, *REPLY_RULES]
    for n, rule in enumerate(rules):
        check_rule(n, rule)


@dataclass(frozen=True)
class Packet:
    source: str
    protocol: str
    port: int  # the destination port
    ack: bool = False  # a reply, or later in a connection; a new connection's SYN has none
    destination: str = BOX
    source_port: int = 40000


def _in(address: str, rule: dict[str, str], key: str) -> bool:
    return key not in rule or ipaddress.ip_address(address) in ipaddress.ip_network(rule[key])


def _port_in(port: int, rule: dict[str, str], key: str) -> bool:
    low, _, high = rule.get(key, "0-65535").partition("-")
    return int(low) <= port <= int(high or low)


def _accepted(rules: list[dict[str, str]], packet: Packet) -> bool:
    """Robot's stateless filter: the first rule that matches decides; nothing matching: discard."""
    for rule in rules:
        if rule.get("protocol", packet.protocol) != packet.protocol:
            continue
        if not (_in(packet.source, rule, "src_ip") and _in(packet.destination, rule, "dst_ip")):
            continue
        if not (
            _port_in(packet.port, rule, "dst_port")
            and _port_in(packet.source_port, rule, "src_port")
        ):
            continue
        if rule.get("tcp_flags") == "ack" and not packet.ack:
            continue
        return rule["action"] == "accept"
    return False


@pytest.mark.parametrize(
    "packet, accepted",
    [
        (Packet(BALANCER, "tcp", 8000), True),  # a balancer opens a replica connection
        (Packet(BALANCER, "tcp", 8255), True),
        (Packet(BALANCER, "tcp", 9100), True),  # and an agent check
        (Packet(BALANCER, "tcp", 22), False),  # but no SSH
        (Packet("192.0.2.10", "tcp", 22), True),  # an admin's SSH
        (Packet("192.0.2.10", "tcp", 8000), False),
        (Packet("203.0.113.99", "tcp", 8000), False),  # anyone else: nothing
        (Packet("203.0.113.99", "tcp", 22), False),
        (Packet("203.0.113.99", "tcp", 9100), False),
        # The node's own traffic: replies come back to its ephemeral ports.
        (Packet("151.101.2.132", "tcp", 41000, ack=True), True),  # a mirror's answer
        (Packet("151.101.2.132", "tcp", 41000), False),  # a SYN there is not a reply
        (Packet("9.9.9.9", "udp", 53000), True),  # a resolver's answer
        (Packet("9.9.9.9", "udp", 53), False),
        (Packet("203.0.113.99", "icmp", 0), True),  # fragmentation needed, unreachable
    ],
)
def test_the_stateless_firewall_lets_in_what_it_should_and_nothing_else(
    packet: Packet, accepted: bool
) -> None:
    assert _accepted(robot_rules(SITE_RULES, {"edge": BALANCER}), packet) is accepted


@pytest.mark.parametrize(
    ("overlay", "discards"),
    [
        (OverlayAccess(WIREGUARD, ("edge",)), [str(WIREGUARD)]),
        (OverlayAccess(4500, ("edge",)), []),  # below the ephemeral ports: nothing to shut
        (OverlayAccess(WIREGUARD, ("edge",), anywhere=True), []),  # open to all anyway
    ],
)
def test_only_a_udp_port_the_replies_would_open_to_anyone_is_shut_to_others(
    overlay: OverlayAccess, discards: list[str]
) -> None:
    rules = robot_rules([SSH, *wireguard_rules(overlay)], {"edge": BALANCER})
    assert [r["dst_port"] for r in rules if r["action"] == "discard"] == discards
    # SSH and one WireGuard rule (an IPv6 source is left to the node's nftables), then these.
    assert len(rules) == 2 + len(discards) + len(REPLY_RULES)


@pytest.mark.parametrize(
    "packet, accepted",
    [
        (Packet(BALANCER, "udp", WIREGUARD), True),  # the tunnel, either side dialling
        (Packet(BALANCER, "tcp", 8000), False),  # replica and agent ports: only in the tunnel
        (Packet(BALANCER, "tcp", 9100), False),
        (Packet(BALANCER, "tcp", 22), False),
        (Packet("203.0.113.99", "udp", WIREGUARD), False),  # WireGuard from anyone else
        (Packet("203.0.113.99", "tcp", 8000), False),
        (Packet("192.0.2.10", "tcp", 22), True),  # an admin's SSH, as before
        (Packet("192.0.2.10", "udp", WIREGUARD), False),
        (Packet("9.9.9.9", "udp", 53000), True),  # replies to the node's own traffic
    ],
)
def test_with_the_overlay_the_firewall_lets_in_the_tunnel_and_ssh_only(
    packet: Packet, accepted: bool
) -> None:
    assert _accepted(robot_rules(OVERLAY_RULES, {"edge": BALANCER}), packet) is accepted


ADMINS = [IngressRule(f"ssh-{i}", "ssh", 22, 22, f"192.0.2.{i * 8}/29") for i in range(7)]


@pytest.mark.parametrize(
    ("rows", "overlay", "count", "fix"),
    [
        (
            [*ADMINS, *SITE_RULES[2:]],
            False,
            12,
            "balancer host and port range); list fewer admin_cidrs or balancer sites (or turn "
            "balancer.overlay back on: one rule per balancer host)",
        ),
        (
            [*ADMINS, *OVERLAY_RULES[2:]],
            True,
            12,
            "balancer host and WireGuard rule); list fewer admin_cidrs or balancer sites",
        ),
    ],
)
def test_more_than_ten_rules_is_one_line_naming_the_site_and_the_fix(
    rows: list[IngressRule], overlay: bool, count: int, fix: str
) -> None:
    rules = robot_rules(rows, {"edge": BALANCER})
    assert len(rules) == count
    (problem,) = robot_problems("gex", rules, overlay)
    assert problem.startswith("sites: gex: the Robot firewall takes at most 10 input rules and")
    assert f"needs {count} " in problem and problem.endswith(fix) and "\n" not in problem


@pytest.mark.parametrize("rows", [SITE_RULES, [*ADMINS[:4], *OVERLAY_RULES]])
def test_up_to_ten_rules_is_no_problem(rows: list[IngressRule]) -> None:
    rules = robot_rules(rows, {"edge": BALANCER})
    assert len(rules) <= 10
    assert robot_problems("gex", rules, rows is not SITE_RULES) == []


def _props(rules: list[dict[str, str]] | None = None, **extra: Any) -> dict[str, Any]:
    rules = robot_rules(SITE_RULES, {"edge": BALANCER}) if rules is None else rules
    return {
        USER: LOGIN,
        PASSWORD: SECRET,
        "address": BOX,
        "rules": rules,
        "output_rules": list(OUTPUT_RULES),
        **extra,
    }


def _provider(robot: FakeRobot, sleeps: list[float]) -> RobotFirewallProvider:
    return RobotFirewallProvider(robot.transport(), sleeps.append)


def test_create_finds_the_box_by_address_sets_its_rules_and_waits_for_the_switch() -> None:
    robot, sleeps = FakeRobot(process_reads=2), []
    result = _provider(robot, sleeps).create(_props())
    assert result.id == str(NUMBER)
    assert result.outs["server_number"] == NUMBER
    (post,) = robot.posts
    assert post["status"] == "active" and post["filter_ipv6"] == "false"
    firewall = robot.firewalls[NUMBER]
    assert firewall["input"] == _props()["rules"]
    assert firewall["output"] == list(OUTPUT_RULES) and firewall["output"]
    assert len(sleeps) == 2  # two reads `in process`, then active
    assert 1000001 not in robot.firewalls


def test_the_webservice_takes_the_overlays_udp_rule() -> None:
    robot, sleeps = FakeRobot(process_reads=0), []
    rules = robot_rules(OVERLAY_RULES, {"edge": BALANCER})
    _provider(robot, sleeps).create(_props(rules))
    (post,) = robot.posts
    assert post["rules[input][1][protocol]"] == "udp"
    assert post["rules[input][1][dst_port]"] == str(WIREGUARD)
    assert robot.firewalls[NUMBER]["input"] == rules


def test_diff_update_read_and_delete_as_the_engine_calls_them() -> None:
    robot, sleeps = FakeRobot(process_reads=0), []
    provider = _provider(robot, sleeps)
    created = provider.create(_props())
    olds, number = created.outs, created.id
    moved = robot_rules(SITE_RULES, {"edge": "198.51.100.8"})
    cases = {
        "same": (_props(), False, []),
        "balancer moved": (_props(moved), True, []),
        "new password": (_props(**{PASSWORD: "rotated"}), True, []),
        "another box": (_props(address="192.0.2.99"), True, ["address"]),
    }
    for name, (news, changes, replaces) in cases.items():
        diff = provider.diff(number, olds, news)
        assert (diff.changes, diff.replaces) == (changes, replaces), name
    # Only the password: nothing to tell Robot, the state keeps the new one.
    rotated = provider.update(number, olds, {**olds, PASSWORD: SECRET})
    assert len(robot.posts) == 1 and rotated.outs[PASSWORD] == SECRET
    provider.update(number, olds, _props(moved))
    assert len(robot.posts) == 2
    assert robot.firewalls[NUMBER]["input"][1]["src_ip"] == "198.51.100.8/32"
    read = provider.read(number, _props(moved))
    assert read.id == number and read.outs["rules"] == moved
    assert read.outs["output_rules"] == list(OUTPUT_RULES)
    provider.delete(number, _props(moved))
    assert robot.posts[-1] == {
        "status": "disabled",
        "whitelist_hos": "true",
        "filter_ipv6": "false",
    }
    assert provider.read(number, _props(moved)).outs["rules"] == []
    assert provider.read("1000002", _props()).id == ""  # not a server of the account (any more)


@pytest.mark.parametrize(
    "props, message",
    [
        (
            _props(address="203.0.113.250"),
            "Hetzner Robot list servers: no server of this account has the address 203.0.113.250",
        ),
        (
            _props(**{PASSWORD: "wrong-password-material"}),
            "Hetzner Robot list servers: Unauthorized",
        ),
    ],
)
def test_a_failure_is_one_line_without_the_credentials(props: dict[str, Any], message: str) -> None:
    robot = FakeRobot()
    with pytest.raises(RobotApiError) as raised:
        _provider(robot, []).create(props)
    text = str(raised.value)
    assert text.startswith(message) and "\n" not in text
    assert SECRET not in text and "wrong-password" not in text and LOGIN not in text
    assert robot.posts == []


def test_a_change_that_stays_in_process_gives_up_with_one_line() -> None:
    robot = FakeRobot(process_reads=100)
    client = RobotClient(LOGIN, SECRET, transport=robot.transport(), sleep=lambda _: None)
    with pytest.raises(
        RobotApiError, match="set firewall: still in process after 300 s; run again"
    ):
        client.set_firewall(
            NUMBER,
            status="active",
            whitelist_hos=True,
            filter_ipv6=False,
            rules=[],
            output_rules=OUTPUT_RULES,
        )


def _set(client: RobotClient) -> None:
    client.set_firewall(
        NUMBER, status="active", whitelist_hos=True, filter_ipv6=False, rules=[], output_rules=[]
    )


def _list(client: RobotClient) -> None:
    assert client.server_number(BOX) == NUMBER


PASSING = {
    "rate limited, waited out at the interval Robot gives": (
        FakeRobot(rate_limited=2, limit_interval=60),
        _list,
        [60.0, 60.0],
        None,
    ),
    "rate limited for longer than the call may wait": (
        FakeRobot(rate_limited=1, limit_interval=3600),
        _list,
        [],
        "Hetzner Robot list servers: Rate limit exceeded (at most 200 requests per 3600 s); "
        "run again in 3600 s",
    ),
    "a POST while another change is in process, tried again once applied": (
        FakeRobot(process_reads=0, pending={NUMBER: 3}),
        _set,
        [10.0, 10.0],
        None,
    ),
    "a change of someone else's in process for longer than the call may wait": (
        FakeRobot(pending={NUMBER: 100}),
        _set,
        [10.0] * 30,
        "Hetzner Robot set firewall: The firewall is currently in process after waiting 300 s; "
        "run again in 10 s",
    ),
    "a GET unanswered twice": (FakeRobot(dropped={"GET": 2}), _list, [5.0, 5.0], None),
    "a GET never answered": (
        FakeRobot(dropped={"GET": 100}),
        _list,
        [5.0, 5.0, 5.0],
        "Hetzner Robot list servers: no answer (ConnectError) 4 times",
    ),
    "a POST unanswered is not sent again": (
        FakeRobot(dropped={"POST": 1}),
        _set,
        [],
        "Hetzner Robot set firewall: no answer (ConnectError)",
    ),
}


@pytest.mark.parametrize(("robot", "call", "sleeps", "error"), PASSING.values(), ids=PASSING)
def test_what_passes_is_waited_out_as_robot_says_and_bounded(
    robot: FakeRobot,
    call: Callable[[RobotClient], None],
    sleeps: list[float],
    error: str | None,
) -> None:
    slept: list[float] = []
    client = RobotClient(LOGIN, SECRET, transport=robot.transport(), sleep=slept.append)
    if error is None:
        call(client)
    else:
        with pytest.raises(RobotApiError) as raised:
            call(client)
        assert str(raised.value) == error
    assert slept == sleeps


ADMIN_HOST, MIRROR, RESOLVER = "192.0.2.10", "151.101.2.132", "9.9.9.9"
# What a node's deploy and its life need through the switch port, each exchange packet by
# packet: (direction seen from the box, packet).
EXCHANGES = {
    "the admin's SSH (the deploy)": [
        ("input", Packet(ADMIN_HOST, "tcp", 22, source_port=50123)),
        ("output", Packet(BOX, "tcp", 50123, True, ADMIN_HOST, 22)),
    ],
    "apt or an image pull over HTTPS": [
        ("output", Packet(BOX, "tcp", 443, False, MIRROR, 41000)),
        ("input", Packet(MIRROR, "tcp", 41000, True, BOX, 443)),
    ],
    "DNS": [
        ("output", Packet(BOX, "udp", 53, False, RESOLVER, 53000)),
        ("input", Packet(RESOLVER, "udp", 53000, False, BOX, 53)),
    ],
    "NTP": [
        ("output", Packet(BOX, "udp", 123, False, "162.159.200.1", 51000)),
        ("input", Packet("162.159.200.1", "udp", 51000, False, BOX, 123)),
    ],
    "WireGuard with a balancer host": [
        ("input", Packet(BALANCER, "udp", WIREGUARD, source_port=WIREGUARD)),
        ("output", Packet(BOX, "udp", WIREGUARD, False, BALANCER, WIREGUARD)),
    ],
}


@pytest.mark.parametrize("exchange", EXCHANGES.values(), ids=EXCHANGES.keys())
def test_once_set_the_firewall_carries_the_nodes_own_traffic_both_ways(
    exchange: list[tuple[str, Packet]],
) -> None:
    robot = FakeRobot(process_reads=0)
    rules = robot_rules(OVERLAY_RULES, {"edge": BALANCER})
    _provider(robot, []).create(_props(rules))
    dropped = [(d, p) for d, p in exchange if not robot.carries(NUMBER, d, p)]
    assert dropped == [], "the switch port discards these"


def test_the_fake_discards_all_the_box_sends_when_a_firewall_has_no_output_rules() -> None:
    robot = FakeRobot(process_reads=0)
    client = RobotClient(LOGIN, SECRET, transport=robot.transport(), sleep=lambda _: None)
    rules = robot_rules(SITE_RULES, {"edge": BALANCER})
    client.set_firewall(
        NUMBER, status="active", whitelist_hos=True, filter_ipv6=False, rules=rules, output_rules=[]
    )
    ssh_in, ssh_out = EXCHANGES["the admin's SSH (the deploy)"]
    assert robot.carries(NUMBER, *ssh_in) and not robot.carries(NUMBER, *ssh_out)


def test_a_firewall_set_before_output_rules_gets_them_on_the_next_up() -> None:
    robot = FakeRobot(process_reads=0)
    provider = _provider(robot, [])
    olds = {**provider.create(_props()).outs, "server_number": NUMBER}
    del olds["output_rules"]  # the state an earlier release wrote
    assert provider.diff(str(NUMBER), olds, _props()).changes is True
    provider.update(str(NUMBER), olds, _props())
    assert robot.firewalls[NUMBER]["output"] == list(OUTPUT_RULES)
    assert robot.posts[-1]["rules[output][0][action]"] == "accept"


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("SSH from admin 198.51.100.0/24", "SSH from admin"),
        ("balancer eu-west-1", "balancer eu-west"),
        ("balancer fsn1-dc14", "balancer fsn dc"),
        ("WireGuard from anywhere: a peer behind NAT", "WireGuard from anywhere a peer behind"),
        ("x" * 45, "x" * 40),
        ("balancer ops@edge+b_2", "balancer ops@edge+b"),
        ("42", ""),
    ],
)
def test_a_rule_name_keeps_to_robots_characters(text: str, name: str) -> None:
    assert rule_name(text) == name
    assert DOCUMENTED_NAME.fullmatch(name) and RULE_NAME.fullmatch(name)


def test_the_generated_names_of_a_sites_rules_are_names_robot_takes() -> None:
    rows = [
        *ssh_rules(("198.51.100.0/24", "203.0.113.7/32")),
        *wireguard_rules(OverlayAccess(WIREGUARD, ("eu-west-1",), anywhere=True)),
        IngressRule("agent-from-eu-west-1", "agent", 9100, 9100, "eu-west-1", from_machine=True),
    ]
    rules = robot_rules(rows, {"eu-west-1": "198.51.100.77"})
    assert [rule["name"] for rule in rules[:4]] == [
        "SSH from admin",
        "SSH from admin",
        "WireGuard from anywhere a peer behind",
        "balancer eu-west",
    ]
    for n, rule in enumerate([*rules, *OUTPUT_RULES]):
        check_rule(n, rule)


@pytest.mark.parametrize("direction", ["input", "output"])
def test_a_rule_name_robot_refuses_is_one_line_before_any_request(direction: str) -> None:
    robot = FakeRobot()
    client = RobotClient(LOGIN, SECRET, transport=robot.transport(), sleep=lambda _: None)
    given = {"input": [], "output": list(OUTPUT_RULES)}
    given[direction] = [{"name": "ssh from 10.0.0.0/8", "action": "accept"}]
    with pytest.raises(ValueError) as raised:
        client.set_firewall(
            NUMBER,
            status="active",
            whitelist_hos=True,
            filter_ipv6=False,
            rules=given["input"],
            output_rules=given["output"],
        )
    assert str(raised.value) == (
        f"rules[{direction}][0][name]: 'ssh from 10.0.0.0/8' holds characters Robot refuses in "
        "a rule name; use letters, spaces and . - + _ @ only (no digits)"
    )
    assert robot.posts == []
