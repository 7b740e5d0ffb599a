"""What one node should run: the input of the node deploys, plain validated data."""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from denv_iac.core.agent_config import AgentProbe
from denv_iac.core.drain import DrainPlan
from denv_iac.core.sites import CACHE_MOUNT_POINT
from denv_iac.core.stack.model import (
    AUTO_ENGINE,
    COLD_START_BUDGET_S,
    DRAIN_TIMEOUT_S,
    ENGINES,
    QUIET_CONNECTION_S,
    WIREGUARD_PORT,
)
from denv_iac.core.stack.values import (
    CACHE_ENV,
    DEPLOY_ENV,
    ENV_NAME,
    IMAGE,
    IMAGE_RULE,
    control_character,
)

# systemd unit names and container names both accept these; replica ids become part of both.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_MIG_PROFILE = re.compile(r"^[1-7]g\.[0-9]+gb$")
# The variables model servers read for their caches; the deploy sets them, a replica cannot.


class NodeSpecError(ValueError):
    """A node spec that cannot be deployed; one line per problem, each naming field and fix."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class MigSlice:
    """`instances` MIG instances of `profile` (e.g. 1g.10gb) on GPU `gpu` (nvidia-smi index)."""

    gpu: int
    profile: str
    instances: int = 1


@dataclass(frozen=True)
class CacheDirs:
    """Host folders for weights and compiled kernels, mounted at the same path into replicas."""

    hf_home: str = "/var/lib/denv/cache/huggingface"
    vllm_cache: str = "/var/lib/denv/cache/vllm"
    inductor_cache: str = "/var/lib/denv/cache/torchinductor"

    @classmethod
    def under(cls, root: str) -> CacheDirs:
        """The three folders under `root`, where a site mounts its persistent cache storage."""
        return cls(f"{root}/huggingface", f"{root}/vllm", f"{root}/torchinductor")

    def env(self) -> dict[str, str]:
        return dict(zip(CACHE_ENV, self.paths(), strict=True))

    def paths(self) -> tuple[str, str, str]:
        return (self.hf_home, self.vllm_cache, self.inductor_cache)


@dataclass(frozen=True)
class CacheVolume:
    """A block device for the caches: given a filesystem when it has none, mounted at boot.

    `device` must name this volume and no other, whatever order the kernel finds disks in
    (`/dev/disk/by-id/...`): a blank device is formatted.
    """

    device: str
    mount_point: str = CACHE_MOUNT_POINT


@dataclass(frozen=True)
class AgentSettings:
    """The node agent: which release to install, and extra tables of its TOML config
    (e.g. {"intervals": {"health_s": 0.5}, "thresholds": {"fail_after": 2}})."""

    version: str = "0.1.0"
    # A local wheel to upload and install instead of fetching `denv-agent==version` from the index.
    wheel: str | None = None
    pip_args: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaSpec:
    """One model server on a whole GPU (`mig_profile` None) or on one MIG instance of it."""

    id: str
    image: str
    port: int
    gpu: int
    command: tuple[str, ...] = ()
    mig_profile: str | None = None
    mig_instance: int = 0  # which instance of that profile on that GPU, in nvidia-smi -L order
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    # The agent's checks of this replica beyond its health path, if any: the same type from the
    # stack to the agent's config (denv_iac.core.agent_config.recipe_probe makes it).
    probe: AgentProbe | None = None

    @property
    def unit(self) -> str:
        return f"denv-replica-{self.id}.service"


@dataclass(frozen=True)
class NodeDeploySpec:
    """Everything `prepare_node` needs; the Pulumi layer builds it from placement."""

    node_id: str
    driver_branch: str = "580"
    open_modules: bool = True
    # The machine image ships the driver (AWS Deep Learning AMIs, Lambda Stack, Nebius CUDA
    # images): the branch it has is verified and kept; the pinned one only replaces no driver.
    image_driver: bool = False
    mig: tuple[MigSlice, ...] = ()
    cache: CacheDirs = field(default_factory=CacheDirs)
    cache_volume: CacheVolume | None = None
    agent: AgentSettings = field(default_factory=AgentSettings)
    replicas: tuple[ReplicaSpec, ...] = ()
    balancer_addresses: tuple[str, ...] = ()
    # Who may reach the node's SSH port; none given: the firewall leaves SSH as it finds it.
    admin_cidrs: tuple[str, ...] = ()
    ssh_port: int = 22  # the port sshd listens on, which admin_cidrs guard
    agent_port: int = 9100
    # The node's address on the overlay (denv_iac.core.overlay_plan); "": not on it, so the agent
    # and the replicas listen on every address, guarded by the firewall alone. On it, they listen
    # there only, balancer_addresses are the balancer hosts' overlay addresses, and
    # overlay_senders the public addresses WireGuard packets may come from on overlay_port (UDP).
    listen_address: str = ""
    overlay_port: int = WIREGUARD_PORT
    overlay_senders: tuple[str, ...] = ()
    # Base URL of NVIDIA's CUDA repository (holding cuda-keyring_1.1-1_all.deb); {distro} and
    # {arch} are filled in from the node. A mirror for nodes without access to NVIDIA's CDN.
    nvidia_repo: str = "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/{arch}"
    drain_timeout_s: int = DRAIN_TIMEOUT_S
    ready_timeout_s: int = COLD_START_BUDGET_S
    # After a rolled replica is undrained, how long the balancers take to count it UP again
    # (denv_iac.core.balancer.tiers.rejoin_ms of the stack's timers), waited before the next goes.
    rejoin_s: int = 3
    # A connection with no byte either way for this long is idle, not waited for by a drain
    # (QUIET_CONNECTION_S, or the node's pools' longest silence budget where longer).
    quiet_s: int = QUIET_CONNECTION_S

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise NodeSpecError(problems)

    def drain_plan(self) -> DrainPlan:
        """How a drain of this node's replicas waits: `rejoin_s` to settle (the balancers hear
        the drain within it), then by the quiet window, at most `drain_timeout_s` more."""
        return DrainPlan(self.rejoin_s, self.quiet_s, self.drain_timeout_s)

    def mig_layout(self) -> dict[int, list[str]]:
        """Per GPU index, the MIG profiles to create, one entry per instance."""
        layout: dict[int, list[str]] = {}
        for mig_slice in self.mig:
            layout.setdefault(mig_slice.gpu, []).extend([mig_slice.profile] * mig_slice.instances)
        return layout


def _has_blank(text: str) -> bool:
    return any(character.isspace() for character in text)


def _problems(spec: NodeDeploySpec) -> list[str]:
    problems: list[str] = []
    if not _ID.fullmatch(spec.node_id):
        problems.append(f"node_id {spec.node_id!r}: use letters, digits, '.', '_' or '-'")
    if not spec.driver_branch.isdigit():
        problems.append(f"driver_branch {spec.driver_branch!r}: give the branch number, e.g. '580'")
    for flag in ("open_modules", "image_driver"):
        if not isinstance(getattr(spec, flag), bool):
            problems.append(f"{flag} {getattr(spec, flag)!r}: give true or false")
    for mig_slice in spec.mig:
        if mig_slice.gpu < 0:
            problems.append(f"mig gpu {mig_slice.gpu}: use an nvidia-smi index, 0 or more")
        if not _MIG_PROFILE.fullmatch(mig_slice.profile):
            problems.append(f"mig profile {mig_slice.profile!r}: use a MIG profile such as 1g.10gb")
        if mig_slice.instances < 1:
            problems.append(f"mig {mig_slice.profile} instances: give 1 or more")
    volume = spec.cache_volume
    if volume is not None:
        # Both go into /etc/fstab, whose fields are separated by blanks.
        if not volume.device.startswith("/dev/") or _has_blank(volume.device):
            problems.append(
                f"cache_volume device {volume.device!r}: give a path under /dev/, without blanks"
            )
        mount = volume.mount_point
        if not mount.startswith("/") or mount == "/" or _has_blank(mount):
            problems.append(
                f"cache_volume mount_point {mount!r}: give an absolute path other than /, "
                "without blanks"
            )
    for path in spec.cache.paths():
        if not path.startswith("/"):
            problems.append(f"cache dir {path!r}: give an absolute path")
    problems += _agent_config_problems(spec.agent.config)
    if spec.agent.wheel is not None and not Path(spec.agent.wheel).is_file():
        problems.append(f"agent wheel {spec.agent.wheel!r}: no such file; build it or drop wheel")
    problems += _replica_problems(spec)
    for key in ("balancer_addresses", "admin_cidrs", "overlay_senders"):
        for address in getattr(spec, key):
            try:
                ipaddress.ip_network(address, strict=False)
            except ValueError:
                problems.append(f"{key} {address!r}: give an IP address or CIDR")
    for key in ("agent_port", "ssh_port"):
        if not 1 <= getattr(spec, key) <= 65535:
            problems.append(f"{key} {getattr(spec, key)}: give a TCP port, 1-65535")
    problems += _overlay_problems(spec)
    if spec.ssh_port == spec.agent_port:
        problems.append(f"agent_port {spec.agent_port}: SSH listens there; pick another")
    if spec.drain_timeout_s < 0 or spec.ready_timeout_s < 1 or spec.rejoin_s < 0:
        problems.append(
            "drain_timeout_s / ready_timeout_s / rejoin_s: give seconds, drain and rejoin 0 or "
            "more, ready 1+"
        )
    if spec.quiet_s < 1:
        problems.append(f"quiet_s {spec.quiet_s}: give seconds, 1 or more")
    return problems


def _overlay_problems(spec: NodeDeploySpec) -> list[str]:
    problems = []
    if spec.listen_address:
        try:
            ipaddress.IPv4Address(spec.listen_address)
        except ValueError:
            problems.append(
                f"listen_address {spec.listen_address!r}: give the node's IPv4 overlay address, "
                'or "" when it is not on the overlay'
            )
    if not 1 <= spec.overlay_port <= 65535:
        problems.append(f"overlay_port {spec.overlay_port}: give a UDP port, 1-65535")
    return problems


# TOML bare keys: the agent config writes tables and keys unquoted.
_TOML_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _agent_config_problems(config: Mapping[str, Any]) -> list[str]:
    """Tables of scalar settings only: a key is written bare, a value as a TOML scalar."""
    problems = []
    for table, values in config.items():
        if (
            not isinstance(table, str)
            or not _TOML_KEY.fullmatch(table)
            or not isinstance(values, dict)
        ):
            problems.append(f"agent config {table!r}: give a table name and a mapping of settings")
            continue
        for key, value in values.items():
            # json.dumps writes the value; NaN and Infinity are JSON's words, not TOML's.
            scalar = isinstance(value, str | int | bool) or (
                isinstance(value, float) and math.isfinite(value)
            )
            if not isinstance(key, str) or not _TOML_KEY.fullmatch(key) or not scalar:
                problems.append(
                    f"agent config {table}.{key!r}: use a name of letters, digits, '_' and '-' "
                    "and a string, number or boolean"
                )
    return problems


def _replica_problems(spec: NodeDeploySpec) -> list[str]:
    problems: list[str] = []
    layout = spec.mig_layout()
    ports: dict[int, str] = {spec.agent_port: "the agent", spec.ssh_port: "SSH"}
    seen: set[str] = set()
    for replica in spec.replicas:
        where = f"replica {replica.id!r}"
        if not _ID.fullmatch(replica.id):
            problems.append(f"{where}: id must use letters, digits, '.', '_' or '-'")
        if replica.id in seen:
            problems.append(f"{where}: id used twice; give each replica its own id")
        seen.add(replica.id)
        if not IMAGE.fullmatch(replica.image):
            problems.append(f"{where} image {replica.image!r}: {IMAGE_RULE}")
        if not 1 <= replica.port <= 65535:
            problems.append(f"{where} port {replica.port}: give a TCP port, 1-65535")
        elif replica.port in ports:
            problems.append(f"{where} port {replica.port}: already used by {ports[replica.port]}")
        ports.setdefault(replica.port, where)
        problems += _share_problems(where, replica, layout)
        for name, value in replica.env.items():
            if not ENV_NAME.fullmatch(name) or control_character(value):
                problems.append(f"{where} env {name!r}: use NAME=value without newlines")
            elif name in DEPLOY_ENV:
                problems.append(f"{where} env {name}: set by the deploy; remove it")
        if not replica.health_path.startswith("/") or _has_blank(replica.health_path):
            problems.append(f"{where} health_path: start it with '/', without blanks")
        if replica.probe is not None:
            problems += _probe_problems(where, replica.probe)
    return problems


def _probe_problems(where: str, probe: AgentProbe) -> list[str]:
    problems = []
    if not isinstance(probe.model, str) or not probe.model or _has_blank(probe.model):
        problems.append(f"{where} probe model: the model name the server serves, no blanks")
    for key in ("ttft_budget_ms", "stall_budget_ms"):
        budget = getattr(probe, key)
        required = key == "ttft_budget_ms" and probe.engine is None
        if (budget is not None or required) and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0
        ):
            problems.append(f"{where} probe {key} {budget!r}: milliseconds, a whole number over 0")
    engines = (AUTO_ENGINE, *ENGINES)
    if probe.engine is not None and probe.engine not in engines:
        problems.append(f"{where} probe engine {probe.engine!r}: use one of {', '.join(engines)}")
    return problems


def _share_problems(where: str, replica: ReplicaSpec, layout: dict[int, list[str]]) -> list[str]:
    if replica.mig_profile is None:
        if replica.gpu in layout:
            return [
                f"{where} gpu {replica.gpu}: MIG is on there; give mig_profile and mig_instance"
            ]
        return [] if replica.gpu >= 0 else [f"{where} gpu {replica.gpu}: use an index, 0 or more"]
    count = layout.get(replica.gpu, []).count(replica.mig_profile)
    if replica.mig_instance >= count or replica.mig_instance < 0:
        return [
            f"{where} mig {replica.mig_profile}#{replica.mig_instance}: GPU {replica.gpu} "
            f"has {count} such instance(s) in the mig layout; add them or pick another"
        ]
    return []


def spec_from_json(data: Mapping[str, Any]) -> NodeDeploySpec:
    """Build a spec from its JSON form (the field names above); raises NodeSpecError."""
    try:
        replicas = tuple(
            ReplicaSpec(
                **{
                    **r,
                    "command": tuple(r.get("command", ())),
                    "env": r.get("env", {}),
                    "probe": AgentProbe(**r["probe"]) if r.get("probe") is not None else None,
                }
            )
            for r in data.get("replicas", ())
        )
        agent_data = data.get("agent", {})
        agent = AgentSettings(**{**agent_data, "pip_args": tuple(agent_data.get("pip_args", ()))})
        fields = {
            **data,
            "mig": tuple(MigSlice(**m) for m in data.get("mig", ())),
            "cache": CacheDirs(**data.get("cache", {})),
            "cache_volume": CacheVolume(**data["cache_volume"])
            if data.get("cache_volume")
            else None,
            "agent": agent,
            "replicas": replicas,
            "balancer_addresses": tuple(data.get("balancer_addresses", ())),
            "admin_cidrs": tuple(data.get("admin_cidrs", ())),
            "overlay_senders": tuple(data.get("overlay_senders", ())),
        }
        return NodeDeploySpec(**fields)
    except TypeError as error:
        # The dataclass constructors name the unknown or missing field in their message.
        message = str(error).split("__init__() ", 1)[-1]
        raise NodeSpecError([f"spec: {message}; see docs/node.md for the fields"]) from None


def spec_to_json(spec: NodeDeploySpec) -> dict[str, Any]:
    """The JSON form `spec_from_json` reads: what a NodeSetup keeps in its inputs."""
    data: dict[str, Any] = json.loads(json.dumps(asdict(spec)))
    # Added after the first release: left out when unset, so the state of a stack that does
    # not use them stays as it was and its next preview shows no change.
    for replica in data["replicas"]:
        if replica["probe"] is None:
            del replica["probe"]
    if not data["admin_cidrs"]:
        del data["admin_cidrs"]
    if data["ssh_port"] == NodeDeploySpec.ssh_port:
        del data["ssh_port"]
    if data["quiet_s"] == NodeDeploySpec.quiet_s:
        del data["quiet_s"]
    if not data["listen_address"]:  # off the overlay: neither its address nor its port
        for key in ("listen_address", "overlay_port", "overlay_senders"):
            del data[key]
    return data


def load_spec(path: Path) -> NodeDeploySpec:
    """Read a spec file (JSON); raises NodeSpecError naming the file on unreadable input."""
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise NodeSpecError([f"--spec {path}: cannot read it ({error.strerror})"]) from None
    except json.JSONDecodeError as error:
        raise NodeSpecError(
            [f"--spec {path}: not JSON (line {error.lineno}: {error.msg})"]
        ) from None
    if not isinstance(data, dict):
        raise NodeSpecError([f"--spec {path}: give a JSON object with node_id and the fields"])
    return spec_from_json(data)
