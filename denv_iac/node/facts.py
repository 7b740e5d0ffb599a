"""What a node is: read in one round trip by a shell probe, parsed into plain data."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pyinfra.api.facts import FactBase

AGENT_VENV = "/opt/denv/agent"
DOCKER_DAEMON_JSON = "/etc/docker/daemon.json"
# PCI class codes: 0x0300 VGA and 0x0302 3D controllers are GPUs; NVSwitches show up as bridges.
_GPU_CLASSES = ("0x0300", "0x0302")
_NVSWITCH_CLASS = "0x0680"
_MIG_LINE = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+\d+:\s+\(UUID:\s*([^)]+)\)")
_GPU_LINE = re.compile(r"^GPU\s+(\d+):")
_AGENT_DIST = re.compile(r"/denv_agent-([^/]+)\.dist-info$")


@dataclass(frozen=True)
class MigDevice:
    profile: str
    uuid: str


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    bus_id: str
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()


@dataclass(frozen=True)
class NodeFacts:
    """The node as read; fields not read (no nvidia-smi, no systemd) keep their empty defaults."""

    os_id: str = ""
    os_version: str = ""
    kernel: str = ""
    arch: str = ""
    systemd: bool = False  # PID 1 is systemd: services can be started (not so in a chroot)
    pci_gpus: tuple[str, ...] = ()
    pci_gpu_ids: frozenset[str] = frozenset()  # the GPUs' PCI device IDs (0x2901: B200)
    nvswitches: int = 0
    packages: Mapping[str, str] = field(default_factory=dict)  # installed name -> version
    smi_present: bool = False
    smi_ok: bool = False
    smi_error: str = ""
    driver_version: str = ""
    gpus: tuple[GpuInfo, ...] = ()
    files: Mapping[str, str] = field(default_factory=dict)  # path -> sha256
    links: Mapping[str, str] = field(default_factory=dict)  # path -> target
    dirs: frozenset[str] = frozenset()
    active_units: frozenset[str] = frozenset()
    replica_units: frozenset[str] = frozenset()  # denv-replica-*.service files present
    block_devices: Mapping[str, str] = field(default_factory=dict)  # present -> fs type or ""
    mounted: frozenset[str] = frozenset()  # the asked-about paths that are mount points
    fstab_lines: frozenset[str] = frozenset()  # the asked-about lines /etc/fstab holds
    runtime_configured: bool = False  # the container engine knows the nvidia runtime
    docker_cli: bool = False  # a docker command on PATH, whichever package (if any) brought it
    # The loaded kernel module's version (/sys/module/nvidia/version): the running driver,
    # also where no package says (a driver from NVIDIA's .run installer) or NVML fails.
    module_version: str = ""
    agent_version: str | None = None
    # The SSH connection the deploy came in on, as the node sees it: where from, to which port.
    ssh_client: str = ""
    ssh_port: int = 0
    # The asked-about `user:blob` keys found in that user's authorized_keys.
    ssh_keys: frozenset[str] = frozenset()
    cloud_init: str | None = None  # what `cloud-init status` says; None: no cloud-init

    @property
    def driver_branch(self) -> str:
        return self.driver_version.split(".", 1)[0] if self.driver_version else ""

    def gpu(self, index: int) -> GpuInfo | None:
        return next((gpu for gpu in self.gpus if gpu.index == index), None)


@dataclass(frozen=True)
class FactQuery:
    """The paths and units a plan compares against; everything else the probe always reads."""

    files: tuple[str, ...] = ()
    links: tuple[str, ...] = ()
    dirs: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    mounts: tuple[str, ...] = ()
    fstab_lines: tuple[str, ...] = ()
    ssh_keys: tuple[str, ...] = ()  # `user:blob`: is the key in that login's authorized_keys?

    def __or__(self, other: FactQuery) -> FactQuery:
        """Both queries' paths and units, for plans of two areas read in one round trip."""
        return FactQuery(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )


def probe_script(query: FactQuery) -> str:
    """A POSIX shell script printing one tab-separated `kind value...` line per fact."""

    def words(items: Iterable[str]) -> str:
        return " ".join(shlex.quote(item) for item in items) or "''"

    return f"""
T=$(printf '\\t')
if [ -r /etc/os-release ]; then . /etc/os-release; fi
printf 'os\\t%s\\t%s\\n' "${{ID:-}}" "${{VERSION_ID:-}}"
printf 'kernel\\t%s\\n' "$(uname -r)"
printf 'arch\\t%s\\n' "$(dpkg --print-architecture 2>/dev/null)"
if [ -d /run/systemd/system ]; then echo systemd; fi
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat "$d/vendor" 2>/dev/null)" = 0x10de ]; then
    printf 'pci\\t%s\\t%s\\t%s\\n' "${{d##*/}}" "$(cat "$d/class")" \\
      "$(cat "$d/device" 2>/dev/null)"
  fi
done
dpkg-query -W -f='pkg\\t${{db:Status-Abbrev}}\\t${{Package}}\\t${{Version}}\\n' 2>/dev/null
if command -v nvidia-smi >/dev/null 2>&1; then
  q=index,uuid,name,pci.bus_id,driver_version,mig.mode.current
  out=$(nvidia-smi --query-gpu=$q --format=csv,noheader 2>&1)
  rc=$?
  printf 'smi_rc\\t%s\\n' "$rc"
  printf '%s\\n' "$out" | sed "s/^/smi$T/"
  if [ "$rc" -eq 0 ]; then nvidia-smi -L 2>/dev/null | sed "s/^/smil$T/"; fi
fi
for f in {words(query.files)}; do
  if [ -f "$f" ]; then printf 'file\\t%s\\t%s\\n' "$f" "$(sha256sum < "$f" | cut -d' ' -f1)"; fi
done
for l in {words(query.links)}; do
  if [ -L "$l" ]; then printf 'link\\t%s\\t%s\\n' "$l" "$(readlink "$l")"; fi
done
for d in {words(query.dirs)}; do if [ -d "$d" ]; then printf 'dir\\t%s\\n' "$d"; fi; done
for b in {words(query.devices)}; do
  if [ -b "$b" ]; then printf 'blockdev\\t%s\\t%s\\n' "$b" "$(blkid -o value -s TYPE "$b")"; fi
done
for m in {words(query.mounts)}; do
  if mountpoint -q "$m" 2>/dev/null; then printf 'mounted\\t%s\\n' "$m"; fi
done
for l in {words(query.fstab_lines)}; do
  if grep -qxF -- "$l" /etc/fstab 2>/dev/null; then printf 'fstab\\t%s\\n' "$l"; fi
done
for k in {words(query.ssh_keys)}; do
  h=$(getent passwd "${{k%%:*}}" | cut -d: -f6)
  if [ -n "$h" ] && grep -qsF -- "${{k#*:}}" "$h/.ssh/authorized_keys"; then
    printf 'sshkey\t%s\n' "$k"
  fi
done
for u in /etc/systemd/system/denv-replica-*.service; do
  if [ -f "$u" ]; then printf 'replica_unit\\t%s\\n' "${{u##*/}}"; fi
done
if [ -d /run/systemd/system ]; then
  for u in {words(query.units)}; do
    if systemctl is-active --quiet "$u"; then printf 'active\\t%s\\n' "$u"; fi
  done
fi
if grep -qs '"nvidia"' {DOCKER_DAEMON_JSON}; then echo runtime; fi
if command -v docker >/dev/null 2>&1; then echo docker_cli; fi
if command -v cloud-init >/dev/null 2>&1; then
  printf 'cloud_init\t%s\n' "$(cloud-init status 2>/dev/null | sed -n 's/^status: //p')"
fi
if [ -r /sys/module/nvidia/version ]; then
  printf 'module\\t%s\\n' "$(cat /sys/module/nvidia/version)"
fi
for m in {AGENT_VENV}/lib/python3*/site-packages/denv_agent-*.dist-info; do
  if [ -d "$m" ]; then printf 'agent\\t%s\\n' "$m"; fi
done
# The login this probe came through (sudo drops SSH_CONNECTION from the environment, so the
# nearest process above that still has it says): the host firewall must not shut it out.
p=$$
while [ "${{p:-0}}" -gt 1 ]; do
  c=$(tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | sed -n 's/^SSH_CONNECTION=//p')
  if [ -n "$c" ]; then printf 'ssh\\t%s\\n' "$c"; break; fi
  p=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$p/status 2>/dev/null)
done
true
"""


def parse_facts(lines: Iterable[str]) -> NodeFacts:
    """NodeFacts from the probe's output lines."""
    values: dict[str, str] = {}
    flags: set[str] = set()
    pci: list[tuple[str, str, str]] = []
    packages: dict[str, str] = {}
    smi_lines: list[str] = []
    smil_lines: list[str] = []
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    dirs: set[str] = set()
    active: set[str] = set()
    replica_units: set[str] = set()
    block_devices: dict[str, str] = {}
    mounted: set[str] = set()
    fstab_lines: set[str] = set()
    ssh_keys: set[str] = set()
    for line in lines:
        kind, _, rest = line.rstrip("\n").partition("\t")
        parts = rest.split("\t")
        if kind in ("systemd", "runtime", "docker_cli"):
            flags.add(kind)
        elif kind == "os" and len(parts) == 2:
            values["os_id"], values["os_version"] = parts
        elif kind in ("kernel", "arch", "smi_rc", "agent", "ssh", "module", "cloud_init"):
            values[kind] = rest
        elif kind == "pci" and len(parts) in (2, 3):
            pci.append((parts[0], parts[1], parts[2] if len(parts) == 3 else ""))
        elif kind == "pkg" and len(parts) == 3 and parts[0].startswith("ii"):
            packages[parts[1]] = parts[2]
        elif kind == "smi":
            smi_lines.append(rest)
        elif kind == "smil":
            smil_lines.append(rest)
        elif kind == "file" and len(parts) == 2:
            files[parts[0]] = parts[1]
        elif kind == "link" and len(parts) == 2:
            links[parts[0]] = parts[1]
        elif kind == "dir":
            dirs.add(rest)
        elif kind == "active":
            active.add(rest)
        elif kind == "replica_unit":
            replica_units.add(rest)
        elif kind == "blockdev" and parts[0]:
            # A blank device has no type: its line may come without the trailing field.
            block_devices[parts[0]] = parts[1] if len(parts) > 1 else ""
        elif kind == "mounted":
            mounted.add(rest)
        elif kind == "fstab":
            fstab_lines.add(rest)
        elif kind == "sshkey":
            ssh_keys.add(rest)
    smi_ok = values.get("smi_rc") == "0"
    gpus = _parse_gpus(smi_lines, smil_lines) if smi_ok else ()
    agent = _AGENT_DIST.search(values.get("agent", ""))
    ssh_client, ssh_port = _ssh_connection(values.get("ssh", ""))
    return NodeFacts(
        os_id=values.get("os_id", ""),
        os_version=values.get("os_version", ""),
        kernel=values.get("kernel", ""),
        arch=values.get("arch", ""),
        systemd="systemd" in flags,
        pci_gpus=tuple(addr for addr, cls, _ in pci if cls[:6] in _GPU_CLASSES),
        pci_gpu_ids=frozenset(dev for _, cls, dev in pci if cls[:6] in _GPU_CLASSES and dev),
        nvswitches=sum(1 for _, cls, _ in pci if cls[:6] == _NVSWITCH_CLASS),
        packages=packages,
        smi_present="smi_rc" in values,
        smi_ok=smi_ok,
        smi_error="" if smi_ok else " ".join(smi_lines).strip(),
        driver_version=next((g[4] for g in map(_csv, smi_lines) if len(g) == 6), "")
        if smi_ok
        else "",
        gpus=gpus,
        files=files,
        links=links,
        dirs=frozenset(dirs),
        active_units=frozenset(active),
        replica_units=frozenset(replica_units),
        block_devices=block_devices,
        mounted=frozenset(mounted),
        fstab_lines=frozenset(fstab_lines),
        runtime_configured="runtime" in flags,
        docker_cli="docker_cli" in flags,
        module_version=values.get("module", "").strip(),
        agent_version=agent.group(1) if agent else None,
        ssh_client=ssh_client,
        ssh_port=ssh_port,
        ssh_keys=frozenset(ssh_keys),
        cloud_init=values.get("cloud_init"),
    )


def _ssh_connection(value: str) -> tuple[str, int]:
    """SSH_CONNECTION (client address, client port, server address, server port): the client's
    address and the server's port; ("", 0) for anything else."""
    fields = value.split()
    if len(fields) != 4 or not fields[3].isdigit():
        return "", 0
    try:
        ipaddress.ip_address(fields[0])
    except ValueError:
        return "", 0
    return fields[0], int(fields[3])


def _csv(line: str) -> list[str]:
    return [cell.strip() for cell in line.split(",")]


def _parse_gpus(smi_lines: list[str], smil_lines: list[str]) -> tuple[GpuInfo, ...]:
    mig: dict[int, list[MigDevice]] = {}
    current: int | None = None
    for line in smil_lines:
        gpu_match = _GPU_LINE.match(line)
        if gpu_match:
            current = int(gpu_match.group(1))
            continue
        mig_match = _MIG_LINE.match(line)
        if mig_match and current is not None:
            mig.setdefault(current, []).append(MigDevice(mig_match.group(1), mig_match.group(2)))
    gpus = []
    for cells in map(_csv, smi_lines):
        if len(cells) != 6 or not cells[0].isdigit():
            continue
        index = int(cells[0])
        gpus.append(
            GpuInfo(
                index=index,
                uuid=cells[1],
                name=cells[2],
                bus_id=cells[3],
                mig_enabled=cells[5] == "Enabled",
                mig_devices=tuple(mig.get(index, ())),
            )
        )
    return tuple(sorted(gpus, key=lambda gpu: gpu.index))


class NodeProbe(FactBase[NodeFacts]):
    """pyinfra fact: the whole node, read by probe_script in one command."""

    def command(self, query: FactQuery) -> str:
        return probe_script(query)

    def process(self, output: Iterable[str]) -> NodeFacts:
        return parse_facts(output)
