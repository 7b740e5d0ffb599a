from __future__ import annotations

import re
from pathlib import Path

import pytest
from denv_agent import cli
from denv_agent.config import ConfigError, load, parse, to_toml
from denv_agent.nvml_api import CLOCKS_EVENT_REASONS
from denv_agent.xid import XidClass

from agent.tests.agent_testkit import TOKEN, config_data

README = Path(__file__).parents[1] / "README.md"


def _parse(tmp_path: Path, **changes: object) -> None:
    data = config_data(
        tmp_path,
        [{"id": "voice.local.node-a.0", "health_url": "http://127.0.0.1:8001/health", "gpu": 0}],
    )
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    parse(to_toml(data))


def test_readme_example_parses_with_the_documented_values(tmp_path: Path) -> None:
    example = re.search(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert example is not None
    config = parse(example[1], base=tmp_path)
    assert config.node == "node-a"
    assert config.state_file == Path("/var/lib/denv-agent/state.json")
    assert [r.id for r in config.replicas] == ["voice.local.node-a.0", "side.local.node-a.1.0"]
    voice, side = config.replicas
    assert voice.probe is not None and voice.probe.ttft_budget_ms == 300
    assert voice.probe.url == "http://127.0.0.1:8001/v1/chat/completions"
    assert side.mig_uuid and side.probe is None
    assert config.listen.agent_check == ("0.0.0.0", 9300)
    assert config.xids.classify(109) is XidClass.RESET_PENDING


def test_defaults_fill_every_optional_table(tmp_path: Path) -> None:
    text = to_toml(
        {
            "node": "n",
            "state_file": "state.json",
            "control_token": TOKEN,
            "replicas": [{"id": "a.b.c.0", "health_url": "http://127.0.0.1:9/h", "gpu": 0}],
        }
    )
    config = parse(text, base=tmp_path)
    assert config.state_file == tmp_path / "state.json"
    assert config.listen.http == ("127.0.0.1", 9301)
    assert config.listen.pods is None  # no pod endpoints off Kubernetes
    assert config.intervals.gpu_poll_s == 1.0
    assert config.thresholds.fail_after == 3
    assert config.xids.classify(79) is XidClass.NODE_FATAL
    assert config.replicas[0].probe is None


MISSING_HEALTH = (
    'agent config: replicas[1].health_url: missing; add health_url = "http://127.0.0.1:8001/health"'
)


def test_missing_health_url_names_the_field_and_the_fix(tmp_path: Path) -> None:
    data = config_data(
        tmp_path,
        [
            {"id": "voice.local.node-a.0", "health_url": "http://127.0.0.1:8001/health", "gpu": 0},
            {"id": "voice.local.node-a.1", "gpu": 1},
        ],
    )
    with pytest.raises(ConfigError) as error:
        parse(to_toml(data))
    assert str(error.value) == MISSING_HEALTH


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"node": None}, "agent config: node: missing; add node ="),
        ({"state_file": None}, "agent config: state_file: missing"),
        ({"control_token": None}, "agent config: control_token: missing"),
        ({"control_token": "short"}, "agent config: control_token: too short (5 characters)"),
        ({"control_token_file": "t"}, "agent config: control_token: set twice"),
        ({"listen": {"http": "nowhere"}}, "agent config: listen.http: 'nowhere' is not host:port"),
        (
            {"listen": {"pods": 9302}},
            'agent config: listen.pods: 9302 is not host:port; write pods = "0.0.0.0:9302"',
        ),
        (
            {"intervals": {"health_s": 0}},
            "agent config: intervals.health_s: 0 is not a number over 0",
        ),
        (
            {"intervals": {"helth_s": 1}},
            "agent config: intervals.helth_s: unknown field; remove it",
        ),
        (
            {"thresholds": {"hot_weight_pct": 0}},
            "thresholds.hot_weight_pct: 0 is not a whole number",
        ),
        ({"thresholds": {"fail_after": True}}, "thresholds.fail_after: True is not a whole number"),
        (
            {"thresholds": {"throttle_reasons": ["hot"]}},
            "thresholds.throttle_reasons: ['hot'] is not",
        ),
        (
            {"xid": {"application": [13], "gpu_fatal": [13]}},
            "xid.gpu_fatal: xid 13 is also in xid.app",
        ),
        ({"xid": {"node_fatal": ["1-x"]}}, "agent config: xid.node_fatal: '1-x' is not an XID"),
        ({"xid": {"fatal": [1]}}, "agent config: xid.fatal: unknown field"),
        ({"simulate": {"gpus": 0}}, "agent config: simulate.gpus: 0 is not a whole number from 1"),
        ({"replicas": []}, "agent config: replicas: must be a non-empty array of tables"),
        ({"surprise": 1}, "agent config: surprise: unknown field"),
    ],
)
def test_bad_fields_give_one_line_naming_the_field(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        _parse(tmp_path, **changes)
    assert str(error.value).startswith("agent config: ")
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert "; " in str(error.value)


@pytest.mark.parametrize(
    ("replica", "message"),
    [
        ({"health_url": "http://x/h"}, "replicas[0].id: missing"),
        ({"id": "bad id", "health_url": "http://x/h", "gpu": 0}, "replicas[0].id: 'bad id' is not"),
        (
            {"id": "a", "health_url": "ftp://x/h", "gpu": 0},
            "replicas[0].health_url: 'ftp://x/h' is not",
        ),
        ({"id": "a", "health_url": "http://x:99999/h", "gpu": 0}, "replicas[0].health_url:"),
        ({"id": "a", "health_url": "http://x/h"}, "replicas[0].gpu: missing; add gpu = 0"),
        ({"id": "a", "health_url": "http://x/h", "gpu": 0, "ttft_budget_ms": 300}, "probe_model"),
        ({"id": "a", "health_url": "http://x/h", "gpu": 0, "probe_model": "m"}, "set without ttft"),
    ],
)
def test_bad_replicas_name_the_replica_field(
    tmp_path: Path, replica: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(to_toml(config_data(tmp_path, [replica])))


KUBE = {"namespace": "denv", "container": "server", "pod_resources_socket": "/k/kubelet.sock"}
POD = {"id": "a", "health_url": "http://x/h", "pod": "voice-0"}


@pytest.mark.parametrize(
    ("replica", "tables", "message"),
    [
        (POD, {}, "replicas[0].pod: set without [kubernetes]; add [kubernetes]"),
        ({**POD, "gpu": 0}, {"kubernetes": KUBE}, "replicas[0].pod: set with gpu or mig_uuid"),
        ({**POD, "mig_uuid": "MIG-1"}, {"kubernetes": KUBE}, "replicas[0].pod: set with gpu"),
        (POD, {"kubernetes": {**KUBE, "namespace": ""}}, "kubernetes.namespace: must be a"),
        (POD, {"kubernetes": {**KUBE, "node": "n"}}, "kubernetes.node: unknown field"),
    ],
)
def test_replicas_by_pod_need_the_kubernetes_table_and_nothing_else(
    tmp_path: Path, replica: dict[str, object], tables: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(to_toml(config_data(tmp_path, [replica], **tables)))


def test_a_replica_by_pod_names_no_gpu(tmp_path: Path) -> None:
    config = parse(to_toml(config_data(tmp_path, [POD], kubernetes=KUBE)))
    ((replica,), kubernetes) = config.replicas, config.kubernetes
    assert (replica.pod, replica.gpu, replica.mig_uuid) == ("voice-0", None, None)
    assert kubernetes is not None and kubernetes.pod_resources_socket == Path("/k/kubelet.sock")


def test_duplicate_replica_ids_are_refused(tmp_path: Path) -> None:
    same = {"id": "a", "health_url": "http://x/h", "gpu": 0}
    with pytest.raises(ConfigError, match=r"replicas\[1\].id: 'a' is used twice"):
        parse(to_toml(config_data(tmp_path, [same, same])))


def test_token_file_and_state_file_are_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    data = config_data(tmp_path, [{"id": "a", "health_url": "http://x/h", "gpu": 0}])
    del data["control_token"]
    data["control_token_file"] = "token"
    data["state_file"] = "run/state.json"
    path = tmp_path / "agent.toml"
    path.write_text(to_toml(data))
    config = load(path)
    assert config.control_token == TOKEN
    assert config.state_file == tmp_path / "run" / "state.json"


def test_unreadable_token_file_says_which(tmp_path: Path) -> None:
    data = config_data(tmp_path, [{"id": "a", "health_url": "http://x/h", "gpu": 0}])
    del data["control_token"]
    data["control_token_file"] = "absent"
    path = tmp_path / "agent.toml"
    path.write_text(to_toml(data))
    with pytest.raises(ConfigError, match="control_token_file: cannot read absent: no such file"):
        load(path)


def test_a_config_that_is_not_utf8_says_so_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(b'control_token = "caf\xe9"\n')
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert str(raised.value) == (
        f"agent config: {path}: is not UTF-8 text (byte 0xe9 at offset 20); save it as UTF-8,"
        " as denv writes it"
    )


def test_xid_overrides_move_an_xid_to_another_class(tmp_path: Path) -> None:
    data = config_data(
        tmp_path,
        [{"id": "a", "health_url": "http://x/h", "gpu": 0}],
        xid={"reset_pending": [109], "node_fatal": ["140-141"]},
    )
    xids = parse(to_toml(data)).xids
    assert xids.classify(109) is XidClass.RESET_PENDING
    assert xids.classify(140) is XidClass.NODE_FATAL
    assert xids.classify(141) is XidClass.NODE_FATAL
    assert xids.classify(79) is XidClass.NODE_FATAL
    assert xids.classify(63) is XidClass.RESET_PENDING


def test_cli_config_error_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(
        to_toml(
            config_data(
                tmp_path,
                [
                    {
                        "id": "voice.local.node-a.0",
                        "health_url": "http://127.0.0.1:8001/health",
                        "gpu": 0,
                    },
                    {"id": "voice.local.node-a.1", "gpu": 1},
                ],
            )
        )
    )
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == MISSING_HEALTH + "\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "not found; pass --config"), ("node = [", "not valid TOML")],
)
def test_cli_unreadable_config_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "agent.toml"
    if content is not None:
        path.write_text(content)
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


BASE = f'node = "node-a"\nstate_file = "state.json"\ncontrol_token = "{TOKEN}"\n'
REPLICA = '[[replicas]]\nid = "a"\nhealth_url = "http://x/h"\ngpu = 0\n'
PAST_DIGITS = "0x" + "f" * 4000  # more than 4300 decimal digits: Python will not write it
REASONS = ", ".join(f'"{name}"' for name in CLOCKS_EVENT_REASONS)
ENGINES = '"auto", "vllm", "sglang", "tgi", "llamacpp"'


NOT_OVER_0 = "is not a number over 0; write"
NOT_REASONS = f"is not a list of clock event reasons; choose from {REASONS}"
LIST_XIDS = 'list XIDs as numbers or ranges like "143-150"'


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [
        (
            "[intervals]\nhealth_s = inf\n",
            "",
            f"intervals.health_s: inf {NOT_OVER_0} health_s = 1.0",
        ),
        (
            "[intervals]\nhealth_s = nan\n",
            "",
            f"intervals.health_s: nan {NOT_OVER_0} health_s = 1.0",
        ),
        (
            f"[intervals]\nhealth_s = {PAST_DIGITS}\n",
            "",
            f"intervals.health_s: a value of over 4300 digits {NOT_OVER_0} health_s = 1.0",
        ),
        (
            "[intervals]\nhealth_s = " + "9" * 400 + "\n",
            "",
            "intervals.health_s: " + "9" * 57 + f"... {NOT_OVER_0} health_s = 1.0",
        ),
        (
            "",
            'ttft_budget_ms = inf\nprobe_model = "m"\n',
            f"replicas[0].ttft_budget_ms: inf {NOT_OVER_0} ttft_budget_ms = 300.0",
        ),
        (
            "[thresholds]\nthrottle_reasons = [[1]]\n",
            "",
            f"thresholds.throttle_reasons: [[1]] {NOT_REASONS}",
        ),
        (
            "[thresholds]\nthrottle_reasons = [{a = 1}]\n",
            "",
            f"thresholds.throttle_reasons: [{{'a': 1}}] {NOT_REASONS}",
        ),
        (
            '[xid]\nnode_fatal = ["1-99999999999"]\n',
            "",
            "xid.node_fatal: '1-99999999999' names 99999999999 XIDs, more than a range may"
            f" (1000); {LIST_XIDS}",
        ),
        (
            '[xid]\nnode_fatal = ["1-\u00b2"]\n',
            "",
            f"xid.node_fatal: '1-\u00b2' is not an XID or a range such as \"143-150\"; {LIST_XIDS}",
        ),
        (
            '[listen]\nhttp = "127.0.0.1:\u00b2"\n',
            "",
            "listen.http: '127.0.0.1:\u00b2' is not host:port; write http = \"127.0.0.1:9301\"",
        ),
        (
            f"[listen]\nhttp = {PAST_DIGITS}\n",
            "",
            "listen.http: a value of over 4300 digits is not host:port;"
            ' write http = "127.0.0.1:9301"',
        ),
        (
            "",
            'health_url = "http://[::1/h"\n',
            "replicas[0].health_url: 'http://[::1/h' is not an http:// URL; write health_url ="
            ' "http://127.0.0.1:8001/health"',
        ),
        (
            "",
            f"engine = {PAST_DIGITS}\n",
            f"replicas[0].engine: a value of over 4300 digits is not an engine; use {ENGINES}",
        ),
        (
            'control_token_file = "t\\u0000"\n',
            "",
            "control_token_file: cannot read t\x00: embedded null byte; write the token there",
        ),
    ],
)
def test_values_python_cannot_take_are_one_line_naming_the_field(
    tmp_path: Path, before: str, after: str, message: str
) -> None:
    path = tmp_path / "agent.toml"
    text = BASE + before + REPLICA + after
    if "control_token_file" in before:
        text = text.replace(f'control_token = "{TOKEN}"\n', "")
    if "health_url" in after:
        text = text.replace('health_url = "http://x/h"\n', "")
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert str(raised.value) == f"agent config: {message}"


def test_an_integer_past_what_python_reads_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(BASE + REPLICA.replace("gpu = 0", "gpu = 1" + "0" * 5000))
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert str(raised.value) == (
        f"agent config: {path}: holds an integer of over 4300 digits; write a number of usual size"
    )


@pytest.mark.parametrize(
    "value", ["[" * 100_000 + "]" * 100_000, "{a = " * 5000 + "1" + "}" * 5000]
)
def test_a_config_nested_too_deeply_names_the_file(tmp_path: Path, value: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f"{BASE}deep = {value}\n{REPLICA}")
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert str(raised.value) == (
        f"agent config: {path}: nested too deeply to read; write it as denv writes it: tables"
        " of values"
    )


def test_cli_a_value_python_cannot_take_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(BASE + "[thresholds]\nthrottle_reasons = [[1]]\n" + REPLICA)
    assert cli.main(["--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        "agent config: thresholds.throttle_reasons: [[1]] is not a list of clock event reasons;"
        f" choose from {REASONS}\n"
    )
