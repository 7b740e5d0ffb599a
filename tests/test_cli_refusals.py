"""Mistaken calls of `denv` end in one line per problem and exit 2: never a traceback.

Each case is run through the real command line; `--strict` turns the warnings into refusals.
"""

import copy
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from denv_iac.cli import main
from denv_iac.core.stack.reader import StackError
from denv_iac.core.stack.stackfile import check_stack_name
from tests.stacks import SECRET

LOCAL_STACK = Path(__file__).resolve().parents[1] / "stacks" / "Pulumi.local.yaml"
WORLD_OPEN: dict[str, Any] = {
    "denv:sites": [
        {
            "name": "office",
            "kind": "joined",
            "ssh_private_key": SECRET,
            "nodes": [{"name": "rack-1", "address": "192.0.2.10", "gpu": "L40S", "gpus": 2}],
        },
        {
            "name": "aws-a",
            "kind": "aws",
            "region": "us-east-1",
            "instance_type": "p5.48xlarge",
            "max_nodes": 2,
            "admin_cidrs": ["0.0.0.0/0", "::/0"],
            "ssh_private_key": SECRET,
        },
        {
            "name": "aws-b",
            "kind": "aws",
            "region": "us-west-2",
            "instance_type": "p5.48xlarge",
            "max_nodes": 2,
            "ssh_private_key": SECRET,
        },
    ],
    "denv:recipes": [
        {
            "name": "voice",
            "image": "vllm/vllm-openai:v0.11.0",
            "min_warm": 1,
            "sites": ["office", "aws-a", "aws-b"],
        }
    ],
    "denv:balancer": {"sites": ["office"]},
}
WARNINGS = [
    "sites[0].admin_cidrs: none given, so the node firewall leaves SSH open to every address "
    "(the balancer's metrics listen on 127.0.0.1 only: reach them over SSH); add the addresses "
    "you administer from, e.g. admin_cidrs: [198.51.100.7/32]",
    "sites[1].admin_cidrs: 0.0.0.0/0, ::/0 opens SSH (and the balancer's metrics) to the whole "
    "internet; list only the addresses you administer from",
    "sites[2].admin_cidrs: none given, so the firewall admits no SSH and the deploy cannot reach "
    "the machines; add your address, e.g. admin_cidrs: [198.51.100.7/32]",
    "balancer: the endpoint takes neither API keys nor TLS, so anyone who finds it can use the "
    "GPUs; add api_key_digests (see `denv key digest`) or a tls_certificate",
]


def denv(*args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin)


def stack_dir(tmp_path: Path, text: str | bytes) -> Path:
    (tmp_path / "Pulumi.s.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    return tmp_path


def plan(folder: Path, *args: str) -> Result:
    return denv("plan", "--stack", "s", "--stacks-dir", str(folder), *args)


def refused(result: Result, *lines: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {line}" for line in lines]


def test_warnings_are_one_line_each_and_exit_0(tmp_path: Path) -> None:
    result = plan(stack_dir(tmp_path, yaml.safe_dump({"config": WORLD_OPEN})))
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [f"warning: {line}" for line in WARNINGS]


def test_strict_makes_the_warnings_refusals(tmp_path: Path) -> None:
    result = plan(stack_dir(tmp_path, yaml.safe_dump({"config": WORLD_OPEN})), "--strict")
    refused(result, *(f"{line} (--strict)" for line in WARNINGS))


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    text = "config:\n  denv:recipes: []\n  denv:sites: []\n  denv:recipes: [{name: v}]\n"
    refused(
        plan(stack_dir(tmp_path, text)),
        "Pulumi.s.yaml line 4: key 'denv:recipes' is given twice in one mapping (first on line "
        "2); keep one",
    )


def test_a_latin1_byte_is_refused(tmp_path: Path) -> None:
    refused(
        plan(stack_dir(tmp_path, b"config:\n  denv:sites: caf\xe9\n")),
        "Pulumi.s.yaml: byte 0xe9 at offset 25 is not UTF-8; save the file as UTF-8",
    )


def test_an_integer_config_key_is_refused(tmp_path: Path) -> None:
    config = yaml.safe_dump({"config": {**WORLD_OPEN, 7: "x"}})
    refused(
        plan(stack_dir(tmp_path, config)),
        "7: config keys are names like denv:sites; quote this one",
    )


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_non_finite_port_is_refused(tmp_path: Path, value: str) -> None:
    config = {**WORLD_OPEN, "denv:balancer": {"sites": ["office"], "port": "PORT"}}
    text = yaml.safe_dump({"config": config}).replace("PORT", value)
    shown = {".nan": "nan", ".inf": "inf", "-.inf": "-inf"}[value]
    refused(
        plan(stack_dir(tmp_path, text)),
        f"balancer.port: expected a whole number, got {shown} (not a finite number)",
    )


def test_plan_json_into_a_missing_folder(tmp_path: Path) -> None:
    folder = stack_dir(tmp_path, yaml.safe_dump({"config": WORLD_OPEN}))
    target = tmp_path / "missing" / "plan.json"
    refused(
        plan(folder, "--json", str(target)),
        f"--json {target}: folder {target.parent} does not exist; create it first",
    )


def test_plan_json_onto_a_folder(tmp_path: Path) -> None:
    folder = stack_dir(tmp_path, yaml.safe_dump({"config": WORLD_OPEN}))
    refused(
        plan(folder, "--json", str(tmp_path)),
        f"--json {tmp_path}: is a folder; give a file name, e.g. --json {tmp_path / 'out'}",
    )


def test_key_digest_of_bytes_that_are_not_utf8() -> None:
    result = denv("key", "digest", stdin=b"caf\xe9\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == "dafd66c0b98965e688be1fc12942c09f0350e6be0685017c3f234e97d0adc92e\n"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://", "URL: 'http://' is not an http(s) URL with a host; e.g. http://127.0.0.1:8080"),
        (
            "http://[::1",
            "URL: 'http://[::1' is not a valid URL (Invalid port: ':1'); e.g. http://127.0.0.1:8080",
        ),
        ("ftp://x", "URL: 'ftp://x' is not an http(s) URL with a host; e.g. http://127.0.0.1:8080"),
    ],
)
def test_bench_refuses_a_url_it_cannot_load(url: str, message: str) -> None:
    refused(denv("bench", url, "--pool", "voice", "--requests", "1"), message)


def test_bench_duration_nan_is_refused() -> None:
    refused(
        denv("bench", "http://127.0.0.1:9", "--pool", "v", "--duration", "nan"),
        "--duration: nan is not a number of seconds; e.g. --duration 30",
    )


def test_bench_json_into_a_missing_folder_is_refused_before_the_load(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "bench.json"
    start = time.monotonic()
    result = denv(
        "bench", "http://127.0.0.1:9", "--pool", "v", "--duration", "3600", "--json", str(target)
    )
    refused(result, f"--json {target}: folder {target.parent} does not exist; create it first")
    assert time.monotonic() - start < 30  # an hour of load would have run first


def test_node_join_with_an_empty_host() -> None:
    refused(
        denv("node", "join", "", "--site", "office", "--dry"),
        "HOST: empty; give [user@]host[:port], @local or @chroot/<path>",
    )


def test_node_join_dry_with_an_ssh_option_as_host_opens_no_ssh() -> None:
    # Refused before any connection: ssh would have taken it as -o ProxyCommand=...
    refused(
        denv("node", "join", "--site", "office", "--dry", "--", "-oProxyCommand=touch /tmp/x"),
        "HOST '-oProxyCommand=touch /tmp/x': not an IP address or host name; write a host name "
        "in letters, digits, '.' and '-', no part starting with '-'",
    )


def _project(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (root / "stacks").mkdir(parents=True)
    (root / "Pulumi.yaml").write_text("name: p\nruntime: python\n")
    monkeypatch.chdir(root)
    return root


def test_local_down_touches_nothing_outside_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path / "a" / "b", monkeypatch)
    outside = project / ".denv" / ".." / ".." / "x" / "state.json"
    outside.parent.mkdir(parents=True)
    outside.write_text("{}")
    refused(
        denv("local", "down", "--stack", "../../x"),
        "--stack: '../../x' is not a stack name; use letters, digits, '.', '_' and '-', starting "
        "with a letter or digit",
    )
    assert outside.read_text() == "{}"


STATE = {
    "stack": "local",
    "endpoint": "http://127.0.0.1:8080",
    "admin_socket": "/p/.denv/local/haproxy.sock",
    "prometheus": "http://127.0.0.1:8405/metrics",
    "haproxy_pid": 4242,
    "control_token": "t" * 32,
    "replicas": [],
    "agents": [],
}
REPLICA = {
    "id": "voice.local.node-a.0",
    "pool": "voice",
    "site": "local",
    "node": "node-a",
    "gpu": 0,
    "address": "127.0.0.1",
    "port": 8001,
    "agent_port": 9300,
    "pid": 4243,
}
AGENT = {"node": "node-a", "agent_port": 9300, "http_port": 9301, "pid": 4244, "config": "a.toml"}


def _state(**fields: object) -> bytes:
    return json.dumps({**STATE, **fields}).encode()


@pytest.mark.parametrize("command", [("local", "down"), ("status",)], ids=["local-down", "status"])
@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"replicas": [', " line 1 column 15: not JSON (Expecting value)"),
        (b"\xff{}", ": byte 0xff at offset 0 is not UTF-8"),
        (b"[" * 100_000, ": nested too deeply to be one denv writes"),
        (b"[]", ": holds a list, not an object of fields"),
        (b"null", ": holds empty, not an object of fields"),
        (b"{}", ": stack is missing"),
        (_state(haproxy_pid="12"), ": haproxy_pid is a string, not a whole number of 0 or more"),
        (_state(haproxy_pid=True), ": haproxy_pid is a boolean, not a whole number of 0 or more"),
        (_state(haproxy_pid=-1), ": haproxy_pid is -1, not a whole number of 0 or more"),
        (_state(haproxy_pid=1.5), ": haproxy_pid is a number, not a whole number of 0 or more"),
        (_state(endpoint=None), ": endpoint is empty, not a string"),
        (_state(endpoint="a\nb"), ": endpoint holds a newline"),
        (_state(replicas={}), ": replicas is a mapping, not a list"),
        (_state(replicas=[1]), ": replicas[0] is a number, not an object of fields"),
        (_state(replicas=[{**REPLICA, "id": 1}]), ": replicas[0].id is a number, not a string"),
        (
            _state(replicas=[{**REPLICA, "group": "yes"}]),
            ": replicas[0].group is a string, not true or false",
        ),
        (
            _state(replicas=[{k: v for k, v in REPLICA.items() if k != "pid"}]),
            ": replicas[0].pid is missing",
        ),
        (
            _state(agents=[{**AGENT, "http_port": [9301]}]),
            ": agents[0].http_port is a list, not a whole number of 0 or more",
        ),
        (
            _state(agents=[{**AGENT, "pi\nd": 1}]),
            ': agents[0]."pi\\nd" is not a field of the run state',
        ),
    ],
)
def test_a_state_file_local_up_did_not_write_says_what_is_wrong_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, ...],
    data: bytes,
    problem: str,
) -> None:
    project = _project(tmp_path, monkeypatch)
    shutil.copy(LOCAL_STACK, project / "stacks" / "Pulumi.local.yaml")
    state = project / ".denv" / "local" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_bytes(data)
    refused(
        denv(*command, "--stack", "local"),
        f"{state.resolve()}{problem}; the file was cut short or edited: stop the stack's"
        " processes by hand (pgrep -f denv) and delete it",
    )
    assert state.exists()


def test_local_up_refuses_a_state_file_it_cannot_read_and_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path, monkeypatch)
    shutil.copy(LOCAL_STACK, project / "stacks" / "Pulumi.local.yaml")
    state = project / ".denv" / "local" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_bytes(_state(haproxy_pid="12"))

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the stack was started")

    monkeypatch.setattr("denv_iac.cli.local.LocalCluster", started)
    refused(
        denv("local", "up", "--stack", "local", "--detach"),
        f"{state.resolve()}: haproxy_pid is a string, not a whole number of 0 or more; the file"
        " was cut short or edited: stop the stack's processes by hand (pgrep -f denv) and"
        " delete it",
    )
    assert state.read_bytes() == _state(haproxy_pid="12")


def test_status_with_a_missing_admin_socket_names_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path, monkeypatch)
    shutil.copy(LOCAL_STACK, project / "stacks" / "Pulumi.local.yaml")
    socket = project / "missing.sock"
    refused(
        denv("status", "--stack", "local", "--admin-socket", str(socket)),
        f"admin socket {socket}: cannot read the balancer's stats (No such file or directory)",
    )


def test_a_digest_of_a_key_anyone_would_try_is_a_warning(tmp_path: Path) -> None:
    test_digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    config = {
        **WORLD_OPEN,
        "denv:balancer": {"sites": ["office"], "api_key_digests": [test_digest]},
    }
    result = plan(stack_dir(tmp_path, yaml.safe_dump({"config": config})))
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[3:] == [
        'warning: balancer.api_key_digests: 9f86d081884c... is the SHA-256 of "test", a key anyone '
        "would try; make one with `openssl rand -hex 32` and list its digest"
    ]


def test_the_example_stacks_plan_without_warnings() -> None:
    stacks = Path(__file__).resolve().parents[1] / "stacks"
    for name in ("local", "k8s", "voice-multicloud"):
        result = denv("plan", "--stack", name, "--stacks-dir", str(stacks), "--strict")
        assert result.exit_code == 0, (name, result.output)


def test_a_stack_name_with_a_trailing_newline_is_refused_in_one_line() -> None:
    # A regular expression's $ matches before a final newline: the name must match whole.
    with pytest.raises(StackError) as raised:
        check_stack_name("voice\n")
    assert raised.value.problems == [
        "--stack: 'voice\\n' is not a stack name; use letters, digits, '.', '_' and '-', starting "
        "with a letter or digit"
    ]


@pytest.mark.parametrize(
    ("address", "warned"),
    [
        ("169.254.169.254", True),
        ("169.254.0.1", True),
        ("fe80::1", True),
        ("192.0.2.10", False),
        ("169.255.0.1", False),
        ("gpu-1.example.com", False),
    ],
)
def test_a_link_local_node_address_is_a_warning(tmp_path: Path, address: str, warned: bool) -> None:
    config = copy.deepcopy(WORLD_OPEN)
    config["denv:sites"][0]["nodes"][0]["address"] = address
    result = plan(stack_dir(tmp_path, yaml.safe_dump({"config": config})))
    assert result.exit_code == 0, result.output
    line = (
        f"warning: sites[0].nodes[0].address: {address} is link-local (where clouds serve "
        "instance metadata), reachable only on its own link; give the machine's routable address"
    )
    assert (line in result.stderr.splitlines()) is warned


@pytest.mark.parametrize(
    ("stdin", "line"),
    [
        (b"key-one\nkey-two\n", "stdin: 2 lines given, and a key is one line"),
        (b"key-one\r\n\r\nkey-two", "stdin: 3 lines given, and a key is one line"),
        (b"\n\n", "stdin: no API key given"),
    ],
)
def test_key_digest_refuses_what_it_would_not_hash_whole(stdin: bytes, line: str) -> None:
    result = denv("key", "digest", stdin=stdin)
    assert result.exit_code == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(f"error: {line}")


@pytest.mark.parametrize("pool", ["", "  "])
def test_bench_refuses_an_empty_pool(pool: str) -> None:
    refused(
        denv("bench", "http://127.0.0.1:9", "--pool", pool, "--requests", "1"),
        "--pool: empty; name the pool (the model) to load, e.g. --pool voice",
    )


def test_a_refused_local_up_leaves_no_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path, monkeypatch)
    shutil.copy(LOCAL_STACK.with_name("Pulumi.k8s.yaml"), project / "stacks" / "Pulumi.k8s.yaml")
    result = denv("local", "up", "--stack", "k8s", "--detach")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "Traceback" not in result.output
    assert not (project / ".denv").exists()


def test_a_refused_local_up_keeps_a_run_folder_it_did_not_make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path, monkeypatch)
    shutil.copy(LOCAL_STACK.with_name("Pulumi.k8s.yaml"), project / "stacks" / "Pulumi.k8s.yaml")
    kept = project / ".denv" / "k8s" / "notes.txt"
    kept.parent.mkdir(parents=True)
    kept.write_text("mine")
    assert denv("local", "up", "--stack", "k8s", "--detach").exit_code == 2
    assert kept.read_text() == "mine"


def test_local_demo_on_a_keyed_stack_without_a_key_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path, monkeypatch)
    config = yaml.safe_load(LOCAL_STACK.read_text())
    config["config"]["denv:balancer"]["api_key_digests"] = ["ab" * 32]
    (project / "stacks" / "Pulumi.local.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.delenv("DEMO_KEY", raising=False)
    refused(
        denv("local", "demo", "--stack", "local", "--api-key-env", "DEMO_KEY"),
        "--api-key-env: DEMO_KEY is not set, and stack local's endpoint answers only keys in "
        "balancer.api_key_digests; export one of those keys as DEMO_KEY",
    )
    assert not (project / ".denv").exists()


@pytest.mark.parametrize(
    ("recipe", "overlay", "line"),
    [
        (
            {"ttft_budget_ms": 1500},
            {},
            "recipes[0].ttft_budget_ms: 1500 is longer than its first_token_timeout_ms (1000),"
            " so the balancer retries a slow replica's requests elsewhere before its agent would"
            " call it slow; make it at most 1000",
        ),
        ({"ttft_budget_ms": 1000}, {}, None),
        (
            {},
            {"cidr": "172.16.0.0/12"},
            "balancer.overlay.cidr: 172.16.0.0/12 overlaps Docker's default bridge"
            " (172.17.0.0/16), so on a node that runs it the overlay's traffic can be routed"
            " into that network; pick a range clear of it, e.g. the default 10.99.0.0/16",
        ),
        ({}, {"cidr": "10.200.0.0/16"}, None),
    ],
)
def test_settings_that_work_against_each_other_are_a_warning(
    tmp_path: Path, recipe: dict[str, object], overlay: dict[str, object], line: str | None
) -> None:
    config = copy.deepcopy(WORLD_OPEN)
    config["denv:recipes"][0].update(recipe)
    config["denv:balancer"]["overlay"] = overlay
    result = plan(stack_dir(tmp_path, yaml.safe_dump({"config": config})))
    assert result.exit_code == 0, result.output
    warned = result.stderr.splitlines()
    assert warned[: len(WARNINGS)] == [f"warning: {w}" for w in WARNINGS]
    assert warned[len(WARNINGS) :] == ([] if line is None else [f"warning: {line}"])


def test_admin_cidrs_of_a_family_the_site_is_not_reached_over_are_a_warning(
    tmp_path: Path,
) -> None:
    config = copy.deepcopy(WORLD_OPEN)
    config["denv:sites"][2]["admin_cidrs"] = ["2001:db8::/32"]
    result = plan(stack_dir(tmp_path, yaml.safe_dump({"config": config})))
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"warning: {line}"
        for line in (
            *(w for w in WARNINGS if not w.startswith("sites[2].")),
            "sites[2].admin_cidrs: 2001:db8::/32 holds no IPv4 block, but aws gives the machines"
            " it creates a public IPv4 address only, so the firewall refuses the deploy's SSH"
            " over IPv4; add the IPv4 addresses you administer from, e.g. 198.51.100.7/32",
        )
    ]


@pytest.mark.parametrize(
    ("lock", "problem"),
    [
        (b'{"replicas": ["caf\xe9"]}', ": byte 0xe9 at offset 18 is not UTF-8"),
        (b"[" * 100_000, ": nested too deeply to be one denv writes"),
        (b'{"replicas": ["a"', " line 1 column 18: not JSON (Expecting ',' delimiter)"),
        (b'{"replicas": ["a", "a"]}', ': replicas[1] "a" is listed twice (first as replicas[0])'),
    ],
)
def test_a_placement_lock_that_cannot_be_read_is_one_line(
    tmp_path: Path, lock: bytes, problem: str
) -> None:
    folder = stack_dir(tmp_path, LOCAL_STACK.read_bytes())  # a stack without warnings
    (folder / "Pulumi.s.placement.json").write_bytes(lock)
    refused(
        plan(folder),
        f"Pulumi.s.placement.json{problem}; delete it and run `denv plan --lock` again",
    )


# Integers YAML reads that Python cannot turn into a float (10**400) or write in digits (over
# 4300 of them, which a hexadecimal value holds in fewer characters).
PAST_FLOAT = "9" * 400
PAST_DIGITS = "0x" + "f" * 4000
PAST_RANGE_RULE = "a number this large is out of range; use a number from"
ENV_RULE = "expected a mapping of names to string values or secure: values"
UNREADABLE = "write a value of that type, or quote it if it is text"
TOO_LARGE = "expected a number >= 0, got a number too large to compute with"


@pytest.mark.parametrize(
    ("old", "new", "line"),
    [
        (
            "kind: local",
            f"kind: local\n      round_trip_ms: {PAST_FLOAT}",
            f"sites[0].round_trip_ms: {TOO_LARGE}",
        ),
        (
            "kind: local",
            f"kind: local\n      price_per_gpu_hour: -{PAST_DIGITS}",
            f"sites[0].price_per_gpu_hour: {TOO_LARGE}",
        ),
        (
            "ttft_ms: 40,",
            f"ttft_ms: 40, itl_growth: {PAST_FLOAT},",
            f"recipes[0].simulate.itl_growth: {TOO_LARGE}",
        ),
        (
            "max_concurrency: 2",
            f"max_concurrency: 2\n      ttft_budget_ms: {PAST_FLOAT}",
            f"recipes[2].ttft_budget_ms: {PAST_RANGE_RULE} 1 to 600000",
        ),
        (
            "max_concurrency: 2",
            f"max_concurrency: 2\n      canary: {{share: {PAST_FLOAT}}}",
            "recipes[2].canary.share: a number this large is out of range; give the fraction of"
            " new sessions it takes, above 0 and below 1 (0.1 = 10 %)",
        ),
        (
            "max_concurrency: 2",
            f"max_concurrency: 2\n      env: {{A: {PAST_DIGITS}}}",
            f"recipes[2].env: {ENV_RULE}",
        ),
        ("port: 8080", f"port: {PAST_DIGITS}", f"balancer.port: {PAST_RANGE_RULE} 1 to 65535"),
        (
            "port: 8080",
            "port: 1" + "0" * 5000,
            f'Pulumi.s.yaml line 46: "1{"0" * 39}"... cannot be read as !!int; {UNREADABLE}',
        ),
        (
            "port: 8080",
            "port: 2001-02-30",
            f'Pulumi.s.yaml line 46: "2001-02-30" cannot be read as !!timestamp; {UNREADABLE}',
        ),
        (
            "port: 8080",
            "port: !!int x",
            f'Pulumi.s.yaml line 46: "x" cannot be read as !!int; {UNREADABLE}',
        ),
        (
            "port: 8080",
            "port: !!bool x",
            f'Pulumi.s.yaml line 46: "x" cannot be read as !!bool; {UNREADABLE}',
        ),
        (
            "port: 8080",
            "port: !!timestamp x",
            f'Pulumi.s.yaml line 46: "x" cannot be read as !!timestamp; {UNREADABLE}',
        ),
        (
            "port: 8080",
            "port: !!map [1]",
            f"Pulumi.s.yaml line 46: a sequence cannot be read as !!map; {UNREADABLE}",
        ),
        (
            "port: 8080",
            "port: !!int |\n      80\n      80",
            f'Pulumi.s.yaml line 46: "80\\n80\\n" cannot be read as !!int; {UNREADABLE}',
        ),
        (
            "port: 8080",
            "port: !!python/object:object {}",
            "Pulumi.s.yaml line 46: the tag !!python/object:object is not one a stack file takes;"
            " remove it and write a plain value",
        ),
        (
            "port: 8080",
            "port: !Ref Port",
            "Pulumi.s.yaml line 46: the tag !Ref is not one a stack file takes; remove it and"
            " write a plain value",
        ),
    ],
)
def test_a_stack_value_python_cannot_convert_is_one_line(
    tmp_path: Path, old: str, new: str, line: str
) -> None:
    text = LOCAL_STACK.read_text()
    assert old in text
    refused(plan(stack_dir(tmp_path, text.replace(old, new, 1))), line)
