"""The cache volume: planned from facts, idempotent, and its format guard run for real."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from denv_iac.node import CacheVolume, NodeDeploySpec, NodeSpecError, plan_node, spec_from_json
from denv_iac.node.cache import fstab_line
from denv_iac.node.cache import plan as plan_cache
from denv_iac.node.facts import FactQuery, parse_facts, probe_script
from denv_iac.node.plan import fact_query

from .fixtures import node_facts

DEVICE = "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"
VOLUME = CacheVolume(DEVICE)
SPEC = NodeDeploySpec(node_id="aws-use1.node-0", cache_volume=VOLUME)


def titles(spec: NodeDeploySpec, **facts: object) -> list[str]:
    return [step.title for step in plan_cache(node_facts(**facts), spec)]


def test_a_blank_volume_is_formatted_put_in_fstab_and_mounted() -> None:
    assert titles(SPEC, block_devices={DEVICE: ""}) == [
        f"give {DEVICE} a filesystem if blank",
        "mount /var/cache/denv at boot (/etc/fstab)",
        "mount the cache volume at /var/cache/denv",
    ]


def test_the_format_command_checks_again_on_the_node() -> None:
    (step, *_) = plan_cache(node_facts(), SPEC)  # not attached yet: waited for, bounded
    wait, mkfs = step.commands
    assert f"until [ -b {DEVICE} ]" in wait and "not attached after 300 s" in wait
    assert mkfs == f"blkid -p {DEVICE} >/dev/null || mkfs.ext4 -q -L denv-cache {DEVICE}"


def test_a_volume_with_caches_is_never_formatted_only_mounted() -> None:
    facts = {"block_devices": {DEVICE: "ext4"}, "fstab_lines": frozenset({fstab_line(VOLUME)})}
    assert titles(SPEC, **facts) == ["mount the cache volume at /var/cache/denv"]


def test_a_converged_node_plans_nothing_for_its_cache() -> None:
    facts = node_facts(
        block_devices={DEVICE: "ext4"},
        fstab_lines=frozenset({fstab_line(VOLUME)}),
        mounted=frozenset({"/var/cache/denv"}),
    )
    assert plan_cache(facts, SPEC) == []


def test_without_a_booted_system_only_fstab_is_written() -> None:
    facts = {"systemd": False, "block_devices": {DEVICE: "ext4"}}
    assert titles(SPEC, **facts) == ["mount /var/cache/denv at boot (/etc/fstab)"]


def test_no_volume_no_steps_and_nothing_probed() -> None:
    spec = dataclasses.replace(SPEC, cache_volume=None)
    assert plan_cache(node_facts(), spec) == []
    query = fact_query(spec)
    assert (query.devices, query.mounts, query.fstab_lines) == ((), (), ())


def test_the_volume_is_set_up_before_the_replicas_make_their_cache_dirs() -> None:
    steps = [f"{s.area}: {s.title}" for s in plan_node(node_facts(driver="580.95.05"), SPEC)]
    cache = steps.index("cache: mount the cache volume at /var/cache/denv")
    assert cache < steps.index("replicas: create the weights and compile cache dirs")


def test_the_probe_asks_about_the_device_the_mount_and_the_fstab_line() -> None:
    query = fact_query(SPEC)
    assert query.devices == (DEVICE,) and query.mounts == ("/var/cache/denv",)
    assert query.fstab_lines == (f"{DEVICE} /var/cache/denv auto defaults,nofail 0 2",)


def test_parse_devices_mounts_and_fstab_lines() -> None:
    facts = parse_facts(
        [
            f"blockdev\t{DEVICE}\text4",
            "blockdev\t/dev/vdb",
            "mounted\t/var/cache/denv",
            f"fstab\t{fstab_line(VOLUME)}",
        ]
    )
    assert facts.block_devices == {DEVICE: "ext4", "/dev/vdb": ""}
    assert facts.mounted == {"/var/cache/denv"} and facts.fstab_lines == {fstab_line(VOLUME)}


@pytest.mark.parametrize(
    ("volume", "field"),
    [
        ({"device": "sdf"}, "cache_volume device 'sdf'"),
        ({"device": "/dev/sd f"}, "cache_volume device '/dev/sd f'"),
        ({"device": "/dev/sdf", "mount_point": "/"}, "cache_volume mount_point '/'"),
        ({"device": "/dev/sdf", "mount_point": "cache"}, "cache_volume mount_point 'cache'"),
    ],
)
def test_a_bad_volume_is_refused_naming_the_field(volume: dict[str, str], field: str) -> None:
    with pytest.raises(NodeSpecError) as refused:
        spec_from_json({"node_id": "n", "cache_volume": volume})
    assert [p for p in refused.value.problems if p.startswith(field)]


def test_the_volume_round_trips_through_json() -> None:
    spec = spec_from_json({"node_id": "n", "cache_volume": {"device": DEVICE}})
    assert spec.cache_volume == VOLUME


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[str]:
    """A blank 16 MiB loop device, detached afterwards."""
    if shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("losetup and mkfs.ext4 are needed")
    image = tmp_path / "volume.img"
    image.write_bytes(b"\0" * (16 << 20))
    made = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"no loop device here: {made.stderr.strip()}")
    device = made.stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "--detach", device], check=True)


def _probe(device: str) -> dict[str, str]:
    script = probe_script(FactQuery(devices=(device,), mounts=("/proc", "/nonexistent")))
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    facts = parse_facts(out.stdout.splitlines())
    assert facts.mounted == {"/proc"}
    return dict(facts.block_devices)


def _uuid(device: str) -> str:
    found = subprocess.run(["blkid", "-o", "value", "-s", "UUID", device], capture_output=True)
    return found.stdout.decode().strip()


def test_the_format_step_formats_a_blank_device_once_and_never_again(loop_device: str) -> None:
    volume = CacheVolume(loop_device)
    spec = dataclasses.replace(SPEC, cache_volume=volume)
    assert _probe(loop_device) == {loop_device: ""}
    (step, *_) = plan_cache(parse_facts([f"blockdev\t{loop_device}\t"]), spec)

    def run() -> str:
        for command in step.commands:
            subprocess.run(["sh", "-c", command], check=True, capture_output=True)
        return _uuid(loop_device)

    formatted = run()
    assert formatted, "the blank device was not formatted"
    assert run() == formatted  # found a filesystem: left as it was, caches and all
    assert _probe(loop_device) == {loop_device: "ext4"}
