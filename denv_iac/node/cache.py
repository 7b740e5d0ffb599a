"""The cache volume: a block device given a filesystem when blank, mounted for the caches.

A cloud node's weights and compile caches belong on a volume that outlives the machine (an EBS
volume on AWS), so that a replacement attached to it starts warm. Formatting is guarded twice:
it is planned only when the probe found no filesystem, and its command probes again on the node,
so a volume that holds caches is never formatted.
"""

from __future__ import annotations

import shlex

from denv_iac.node.facts import NodeFacts
from denv_iac.node.spec import CacheVolume, NodeDeploySpec
from denv_iac.node.steps import Step

FSTAB = "/etc/fstab"
LABEL = "denv-cache"
ATTACH_WAIT_S = 300  # a volume attaches after its instance boots: wait for it, bounded


def fstab_line(volume: CacheVolume) -> str:
    # nofail: a missing volume must not keep the node from booting (it then serves cold).
    return f"{volume.device} {volume.mount_point} auto defaults,nofail 0 2"


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    volume = spec.cache_volume
    if volume is None:
        return []
    device, mount_point = shlex.quote(volume.device), shlex.quote(volume.mount_point)
    steps = []
    if not facts.block_devices.get(volume.device):
        # The device is quoted in the message too: inside "..." the shell would still expand $().
        late = shlex.quote(f"{volume.device} not attached after {ATTACH_WAIT_S} s")
        wait = (
            f"i=0; until [ -b {device} ]; do "
            f'[ "$i" -lt {ATTACH_WAIT_S} ] || {{ echo {late}; exit 1; }}; i=$((i+1)); sleep 1; done'
        )
        # blkid -p probes the device itself (no cache) and exits non-zero only when it finds no
        # signature on it: no filesystem, and no partition table either.
        mkfs = f"blkid -p {device} >/dev/null || mkfs.ext4 -q -L {LABEL} {device}"
        steps.append(Step("cache", f"give {volume.device} a filesystem if blank", (wait, mkfs)))
    line = fstab_line(volume)
    if line not in facts.fstab_lines:
        append = f"grep -qxF -- {shlex.quote(line)} {FSTAB} || echo {shlex.quote(line)} >> {FSTAB}"
        steps.append(Step("cache", f"mount {volume.mount_point} at boot ({FSTAB})", (append,)))
    # Without a booted system of its own (a chroot, an image being built) the fstab line is
    # what there is to do: the volume mounts when the machine boots.
    if facts.systemd and volume.mount_point not in facts.mounted:
        commands = (f"mkdir -p {mount_point}", f"mount {mount_point}")
        steps.append(Step("cache", f"mount the cache volume at {volume.mount_point}", commands))
    return steps
