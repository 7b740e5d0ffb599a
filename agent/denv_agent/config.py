"""The agent's TOML config: parsed once, validated field by field, frozen."""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from denv_agent.nvml_api import CLOCKS_EVENT_REASONS
from denv_agent.toml_text import to_toml as to_toml  # the one writer, shared with denv-iac
from denv_agent.xid import CONFIGURABLE_CLASSES, XidClass, XidTable, parse_xids

DEFAULT_THROTTLE_REASONS = frozenset({"hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"})
# Replica ids travel as HAProxy's agent-send string, so they must be short and printable.
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_MIN_TOKEN_CHARS = 16


def _shown(value: object) -> str:
    """A value as an error shows it: Python's repr, cut short, since a TOML value may be a long
    array, or an integer of more digits than Python will write (a hexadecimal one of over 4300
    digits, ValueError)."""
    try:
        text = repr(value)
    except ValueError:
        return "a value of over 4300 digits"
    return text if len(text) <= 60 else f"{text[:57]}..."


class ConfigError(Exception):
    """One line naming the field, the problem and the fix."""

    def __init__(self, field_name: str, problem: str, fix: str) -> None:
        super().__init__(f"agent config: {field_name}: {problem}; {fix}")


Address = tuple[str, int]


@dataclass(frozen=True)
class Listen:
    agent_check: Address = ("0.0.0.0", 9300)
    # Local by default: the control endpoint lives here and operators reach it over SSH.
    http: Address = ("127.0.0.1", 9301)
    # On Kubernetes, where each replica pod asks its node's agent: a pod's readiness (warm or
    # not) and its drain before it stops (see pod_api). No listener when unset.
    pods: Address | None = None


@dataclass(frozen=True)
class Intervals:
    gpu_poll_s: float = 1.0
    health_s: float = 1.0
    health_timeout_s: float = 1.0
    probe_s: float = 10.0
    probe_timeout_s: float = 5.0
    # An engine's /metrics is cheap to read: often enough that a stall is seen within a quarter
    # second of outlasting its budget.
    metrics_s: float = 0.25
    nvml_stall_s: float = 30.0
    agent_check_read_timeout_s: float = 0.25


@dataclass(frozen=True)
class Thresholds:
    fail_after: int = 3
    temperature_c: int = 85
    hot_weight_pct: int = 50
    throttle_weight_pct: int = 50
    slow_weight_pct: int = 50
    # Each request queued in the engine takes this off the weight, down to the floor.
    queued_weight_step_pct: int = 10
    queued_weight_floor_pct: int = 20
    throttle_reasons: frozenset[str] = DEFAULT_THROTTLE_REASONS


@dataclass(frozen=True)
class Probe:
    url: str
    model: str
    ttft_budget_ms: float
    interval_s: float
    # The longest silence between the probe's tokens before the replica is drained; None: no check.
    stall_budget_ms: float | None = None


# Engine families whose Prometheus metrics the agent reads (see engine_metrics.ENGINE_NAMES);
# AUTO: whichever of them the metrics show, told by their names at each read.
ENGINES = ("vllm", "sglang", "tgi", "llamacpp")
AUTO = "auto"
DEFAULT_STALL_BUDGET_MS = 1000.0


@dataclass(frozen=True)
class Engine:
    """The engine's own metrics: its queue lowers the weight, a stall takes the replica down."""

    family: str  # one of ENGINES, whose metric names to read, or AUTO
    metrics_url: str
    # Requests running with no token for longer than this: the replica is down.
    stall_budget_ms: float
    # The request the agent sends to see a stalled engine make a token again.
    probe_url: str
    probe_model: str


@dataclass(frozen=True)
class Replica:
    id: str
    health_url: str
    gpu: int | None
    mig_uuid: str | None
    probe: Probe | None
    # On Kubernetes: the replica's pod; the kubelet says which GPU or MIG device it was given.
    pod: str | None = None
    engine: Engine | None = None


@dataclass(frozen=True)
class Kubernetes:
    """One agent per node reads the kubelet's pod-resources API for its replicas' devices."""

    namespace: str
    container: str  # the replica pod's container that holds the GPU
    pod_resources_socket: Path


@dataclass(frozen=True)
class Simulate:
    gpus: int | None = None
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    slow_s: float = 0.0


@dataclass(frozen=True)
class AgentConfig:
    node: str
    state_file: Path
    control_token: str = field(repr=False)
    replicas: tuple[Replica, ...]
    listen: Listen = Listen()
    intervals: Intervals = Intervals()
    thresholds: Thresholds = Thresholds()
    xids: XidTable = field(default_factory=XidTable.default)
    simulate: Simulate = Simulate()
    kubernetes: Kubernetes | None = None


class _Table:
    """Typed reads from one TOML table that remember the field path, for error messages."""

    def __init__(self, data: Mapping[str, object], path: str) -> None:
        self.data = data
        self.path = path
        self.seen: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str) -> object:
        self.seen.add(key)
        return self.data.get(key)

    def string(self, key: str, example: str) -> str:
        value = self.optional_string(key, example)
        if value is None:
            raise ConfigError(self.name(key), "missing", f"add {key} = {example}")
        return value

    def optional_string(self, key: str, example: str) -> str | None:
        value = self.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(
                self.name(key), "must be a non-empty string", f"write {key} = {example}"
            )
        return value

    def number(self, key: str, default: float, *, zero_ok: bool = False) -> float:
        value = self.get(key)
        if value is None:
            return default
        # TOML has inf and nan, and integers past what a float holds: none is a duration.
        number = (
            _float(value)
            if isinstance(value, int | float) and not isinstance(value, bool)
            else math.nan
        )
        if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
            bound = "0 or more" if zero_ok else "over 0"
            raise ConfigError(
                self.name(key),
                f"{_shown(value)} is not a number {bound}",
                f"write {key} = {default}",
            )
        return number

    def integer(self, key: str, default: int, low: int, high: int) -> int:
        value = self.optional_integer(key, low, high, example=default)
        return default if value is None else value

    def optional_integer(self, key: str, low: int, high: int, *, example: int = 0) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(
                self.name(key),
                f"{_shown(value)} is not a whole number from {low} to {high}",
                f"write {key} = {example}",
            )
        return value

    def table(self, key: str) -> _Table:
        value = self.get(key)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(self.name(key), "must be a table", f"write it as [{self.name(key)}]")
        return _Table(value, self.name(key))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            known = ", ".join(sorted(self.seen))
            raise ConfigError(self.name(unknown[0]), "unknown field", f"remove it (known: {known})")


def load(path: Path) -> AgentConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            str(path),
            f"is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})",
            "save it as UTF-8, as denv writes it",
        ) from None
    except FileNotFoundError:
        raise ConfigError(
            str(path), "not found", "pass --config with the agent's config file"
        ) from None
    except OSError as e:
        raise ConfigError(
            str(path), f"cannot read: {e}", "check the file and its permissions"
        ) from None
    return parse(text, base=path.parent, source=str(path))


def parse(text: str, base: Path = Path(), source: str = "config") -> AgentConfig:
    """`base` anchors relative paths; `source` names the text in a syntax error."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(source, f"not valid TOML ({e})", "fix the syntax there") from None
    except ValueError:  # the one other: an integer past the 4300 digits Python reads
        raise ConfigError(
            source, "holds an integer of over 4300 digits", "write a number of usual size"
        ) from None
    except RecursionError:  # arrays or inline tables nested thousands deep
        raise ConfigError(
            source, "nested too deeply to read", "write it as denv writes it: tables of values"
        ) from None
    top = _Table(data, "")
    node = top.string("node", '"node-a"')
    state_file = top.string("state_file", '"/var/lib/denv-agent/state.json"')
    token = _control_token(top, base)
    intervals = _intervals(top.table("intervals"))
    kubernetes = _kubernetes(top, base)
    config = AgentConfig(
        node=node,
        state_file=base / state_file,
        control_token=token,
        listen=_listen(top.table("listen")),
        intervals=intervals,
        thresholds=_thresholds(top.table("thresholds")),
        xids=_xids(top.table("xid")),
        simulate=_simulate(top.table("simulate")),
        kubernetes=kubernetes,
        replicas=_replicas(top, intervals, kubernetes),
    )
    top.done()
    return config


def _control_token(top: _Table, base: Path) -> str:
    token = top.optional_string("control_token", '"<at least 16 random characters>"')
    token_file = top.optional_string("control_token_file", '"/etc/denv/agent.token"')
    if token is not None and token_file is not None:
        raise ConfigError(
            "control_token", "set twice", "keep either control_token or control_token_file"
        )
    if token_file is not None:
        try:
            token = (base / token_file).read_text(encoding="utf-8").strip()
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, or a NUL in the path
            reason = e.strerror.lower() if isinstance(e, OSError) and e.strerror else str(e)
            raise ConfigError(
                "control_token_file", f"cannot read {token_file}: {reason}", "write the token there"
            ) from None
    if token is None:
        raise ConfigError(
            "control_token", "missing", 'add control_token = "..." or control_token_file = "..."'
        )
    if len(token) < _MIN_TOKEN_CHARS:
        raise ConfigError(
            "control_token",
            f"too short ({len(token)} characters)",
            f"use at least {_MIN_TOKEN_CHARS} random characters",
        )
    return token


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past 1.8e308
        return math.inf


def _address(table: _Table, key: str, default: Address) -> Address:
    found = _maybe_address(table, key, default)
    return default if found is None else found


def _maybe_address(table: _Table, key: str, like: Address) -> Address | None:
    value = table.get(key)
    if value is None:
        return None
    example = f'"{like[0]}:{like[1]}"'
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        host = host.strip("[]")
        # isdecimal, not isdigit: int() refuses a superscript digit such as "²".
        if sep and host and port.isdecimal() and int(port) <= 65535:
            return host, int(port)
    raise ConfigError(
        table.name(key), f"{_shown(value)} is not host:port", f"write {key} = {example}"
    )


def _listen(table: _Table) -> Listen:
    listen = Listen(
        agent_check=_address(table, "agent_check", Listen.agent_check),
        http=_address(table, "http", Listen.http),
        pods=_maybe_address(table, "pods", ("0.0.0.0", 9302)),
    )
    table.done()
    return listen


def _intervals(table: _Table) -> Intervals:
    d = Intervals()
    intervals = Intervals(
        gpu_poll_s=table.number("gpu_poll_s", d.gpu_poll_s),
        health_s=table.number("health_s", d.health_s),
        health_timeout_s=table.number("health_timeout_s", d.health_timeout_s),
        probe_s=table.number("probe_s", d.probe_s),
        probe_timeout_s=table.number("probe_timeout_s", d.probe_timeout_s),
        metrics_s=table.number("metrics_s", d.metrics_s),
        nvml_stall_s=table.number("nvml_stall_s", d.nvml_stall_s),
        agent_check_read_timeout_s=table.number(
            "agent_check_read_timeout_s", d.agent_check_read_timeout_s
        ),
    )
    table.done()
    return intervals


def _thresholds(table: _Table) -> Thresholds:
    d = Thresholds()
    reasons = table.get("throttle_reasons")
    if reasons is None:
        reasons = sorted(d.throttle_reasons)
    if not isinstance(reasons, list) or not all(
        isinstance(r, str) and r in CLOCKS_EVENT_REASONS for r in reasons
    ):
        names = ", ".join(f'"{name}"' for name in CLOCKS_EVENT_REASONS)
        raise ConfigError(
            table.name("throttle_reasons"),
            f"{_shown(reasons)} is not a list of clock event reasons",
            f"choose from {names}",
        )
    thresholds = Thresholds(
        fail_after=table.integer("fail_after", d.fail_after, 1, 1000),
        temperature_c=table.integer("temperature_c", d.temperature_c, 1, 200),
        hot_weight_pct=table.integer("hot_weight_pct", d.hot_weight_pct, 1, 100),
        throttle_weight_pct=table.integer("throttle_weight_pct", d.throttle_weight_pct, 1, 100),
        slow_weight_pct=table.integer("slow_weight_pct", d.slow_weight_pct, 1, 100),
        queued_weight_step_pct=table.integer(
            "queued_weight_step_pct", d.queued_weight_step_pct, 0, 100
        ),
        queued_weight_floor_pct=table.integer(
            "queued_weight_floor_pct", d.queued_weight_floor_pct, 1, 100
        ),
        throttle_reasons=frozenset(reasons),
    )
    table.done()
    return thresholds


def _xids(table: _Table) -> XidTable:
    overrides: dict[XidClass, list[int]] = {}
    listed: dict[int, str] = {}
    for klass in CONFIGURABLE_CLASSES:
        value = table.get(klass.value)
        if value is None:
            continue
        name = table.name(klass.value)
        if not isinstance(value, list):
            raise ConfigError(name, "must be a list", f"write {klass.value} = [63, 92]")
        try:
            xids = parse_xids(value)
        except ValueError as e:
            raise ConfigError(
                name, str(e), 'list XIDs as numbers or ranges like "143-150"'
            ) from None
        for xid in xids:
            if xid in listed:
                raise ConfigError(
                    name, f"xid {xid} is also in {listed[xid]}", "list it in one class"
                )
            listed[xid] = name
        overrides[klass] = xids
    table.done()
    return XidTable.with_overrides(overrides)


def _simulate(table: _Table) -> Simulate:
    d = Simulate()
    simulate = Simulate(
        gpus=table.optional_integer("gpus", 1, 64, example=8),
        gpu_name=table.optional_string("gpu_name", f'"{d.gpu_name}"') or d.gpu_name,
        slow_s=table.number("slow_s", d.slow_s, zero_ok=True),
    )
    table.done()
    return simulate


def _kubernetes(top: _Table, base: Path) -> Kubernetes | None:
    if top.get("kubernetes") is None:
        return None
    table = top.table("kubernetes")
    kubernetes = Kubernetes(
        namespace=table.string("namespace", '"denv"'),
        container=table.string("container", '"server"'),
        pod_resources_socket=base
        / table.string("pod_resources_socket", '"/var/lib/kubelet/pod-resources/kubelet.sock"'),
    )
    table.done()
    return kubernetes


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)  # raises on a bracket left open ("http://[::1/")
        parts.port  # noqa: B018 - reading it validates the port
    except ValueError:
        return False
    return parts.scheme == "http" and bool(parts.hostname)


def _http_url(table: _Table, key: str, example: str) -> str | None:
    url = table.optional_string(key, f'"{example}"')
    if url is not None and not _is_http_url(url):
        raise ConfigError(
            table.name(key), f"{_shown(url)} is not an http:// URL", f'write {key} = "{example}"'
        )
    return url


def _replicas(
    top: _Table, intervals: Intervals, kubernetes: Kubernetes | None
) -> tuple[Replica, ...]:
    example = '[[replicas]] with id = "voice.local.node-a.0"'
    items = top.get("replicas")
    if items is None:
        raise ConfigError("replicas", "missing", f"add {example}")
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise ConfigError("replicas", "must be a non-empty array of tables", f"write {example}")
    replicas: list[Replica] = []
    for n, item in enumerate(items):
        replica = _replica(_Table(item, f"replicas[{n}]"), intervals, kubernetes)
        if any(r.id == replica.id for r in replicas):
            raise ConfigError(
                f"replicas[{n}].id", f"{replica.id!r} is used twice", "give each an id"
            )
        replicas.append(replica)
    return tuple(replicas)


def _replica(table: _Table, intervals: Intervals, kubernetes: Kubernetes | None) -> Replica:
    rid = table.string("id", '"voice.local.node-a.0"')
    if not _REPLICA_ID.fullmatch(rid):
        raise ConfigError(
            table.name("id"),
            f"{rid!r} is not a replica id",
            "use letters, digits and . _ : - (at most 128 characters)",
        )
    health_example = "http://127.0.0.1:8001/health"
    health_url = _http_url(table, "health_url", health_example)
    if health_url is None:
        raise ConfigError(
            table.name("health_url"), "missing", f'add health_url = "{health_example}"'
        )
    gpu = table.optional_integer("gpu", 0, 255)
    mig_uuid = table.optional_string("mig_uuid", '"MIG-..."')
    pod = table.optional_string("pod", '"voice-0"')
    if pod is not None and kubernetes is None:
        raise ConfigError(table.name("pod"), "set without [kubernetes]", "add [kubernetes]")
    if pod is not None and (gpu is not None or mig_uuid is not None):
        raise ConfigError(
            table.name("pod"),
            "set with gpu or mig_uuid",
            "keep pod only: the kubelet says which device the pod has",
        )
    if gpu is None and mig_uuid is None and pod is None:
        raise ConfigError(table.name("gpu"), "missing", 'add gpu = 0 (or mig_uuid = "MIG-...")')
    replica = Replica(
        id=rid,
        health_url=health_url,
        gpu=gpu,
        mig_uuid=mig_uuid,
        probe=_probe(table, health_url, intervals),
        pod=pod,
        engine=_engine(table, health_url),
    )
    table.done()
    return replica


def _probe(table: _Table, health_url: str, intervals: Intervals) -> Probe | None:
    """The first-token probe is on when the replica has a TTFT budget."""
    budget = table.get("ttft_budget_ms")
    if budget is None:
        engine = table.get("engine") is not None
        for key in ("probe_url", "probe_model", "probe_interval_s", "stall_budget_ms"):
            if table.get(key) is not None and not (engine and key != "probe_interval_s"):
                raise ConfigError(
                    table.name(key), "set without ttft_budget_ms", "add ttft_budget_ms"
                )
        return None
    budget_ms = table.number("ttft_budget_ms", 300.0)
    model, url = _probe_request(table, health_url)
    return Probe(
        url=url,
        model=model,
        ttft_budget_ms=budget_ms,
        interval_s=table.number("probe_interval_s", intervals.probe_s),
        stall_budget_ms=(
            table.number("stall_budget_ms", 1000.0)
            if table.get("stall_budget_ms") is not None
            else None
        ),
    )


def _probe_request(table: _Table, health_url: str) -> tuple[str, str]:
    """The model and URL of the agent's own streamed request to the replica."""
    model = table.string("probe_model", '"voice" (the model name the server serves)')
    default_url = f"http://{urlsplit(health_url).netloc}/v1/chat/completions"
    return model, _http_url(table, "probe_url", default_url) or default_url


def _engine(table: _Table, health_url: str) -> Engine | None:
    """Reading the engine's metrics is on when the replica names its engine."""
    family = table.get("engine")
    if family is None:
        if table.get("metrics_url") is not None:
            raise ConfigError(
                table.name("metrics_url"), "set without engine", 'add engine = "vllm"'
            )
        return None
    if family not in (AUTO, *ENGINES):
        names = ", ".join(f'"{name}"' for name in (AUTO, *ENGINES))
        raise ConfigError(
            table.name("engine"), f"{_shown(family)} is not an engine", f"use {names}"
        )
    default_metrics = f"http://{urlsplit(health_url).netloc}/metrics"
    model, url = _probe_request(table, health_url)
    return Engine(
        family=str(family),
        metrics_url=_http_url(table, "metrics_url", default_metrics) or default_metrics,
        stall_budget_ms=table.number("stall_budget_ms", DEFAULT_STALL_BUDGET_MS),
        probe_url=url,
        probe_model=model,
    )
