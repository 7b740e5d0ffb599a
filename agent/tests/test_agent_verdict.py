from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from denv_agent import conditions
from denv_agent.conditions import Condition
from denv_agent.config import AgentConfig
from denv_agent.gpu_health import Faults, GpuReading
from denv_agent.gpu_monitor import GpuView, NvmlStatus
from denv_agent.pod_resources import Assigned
from denv_agent.replica_health import ReplicaReading
from denv_agent.state import Drains
from denv_agent.verdict import clean_reason, compose, decide

from agent.tests.agent_testkit import make_config

OK = ReplicaReading(checks=1, ever_ok=True)
NO_FAULTS = Faults()
NO_DRAINS = Drains()


@pytest.mark.parametrize(
    ("found", "reply"),
    [
        ([], "up ready 100%"),
        ([conditions.note("hello")], "up ready 100%"),
        ([conditions.weight("hot", 50), conditions.weight("slow", 30)], "up ready 30%"),
        ([conditions.weight("odd", 0)], "up ready 1%"),
        ([conditions.weight("hot", 50), conditions.drain("operator")], "drain #operator"),
        ([conditions.drain("operator"), conditions.down("gpu lost")], "down #gpu lost"),
        ([conditions.down("first"), conditions.down("second")], "down #first"),
    ],
)
def test_down_beats_drain_beats_up_and_up_is_never_zero(found: list[Condition], reply: str) -> None:
    assert decide(found).reply == reply


def test_reasons_keep_every_finding_strongest_first() -> None:
    verdict = decide([conditions.note("n"), conditions.weight("w", 50), conditions.down("d")])
    assert verdict.reasons == ("d", "w", "n")


def test_reasons_are_made_safe_for_haproxy() -> None:
    assert clean_reason("Bad\nThing # here\x00 ") == "bad thing here"
    assert len(clean_reason("x" * 500)) == 100


def _config(tmp_path: Path, *replicas: dict[str, object]) -> AgentConfig:
    return make_config(tmp_path, list(replicas))


def _view(
    *readings: GpuReading, state: str = "ok", faults: Faults = NO_FAULTS, count: int | None = None
) -> GpuView:
    return GpuView(
        nvml=NvmlStatus(state, gpu_count=len(readings) if count is None else count),
        readings={r.index: r for r in readings},
        faults=faults,
        xid_events={},
        stalled_s={},
    )


def _replies(config: AgentConfig, view: GpuView, drains: Drains = NO_DRAINS) -> dict[str, str]:
    readings = {r.id: OK for r in config.replicas}
    snap = compose(config, view, readings, drains)
    return {rid: v.reply for rid, v in snap.verdicts.items()}


WHOLE = [{"id": f"r{i}", "health_url": "http://x/h", "gpu": i} for i in range(2)]


def test_gpu_faults_hit_only_that_gpus_replicas_node_faults_hit_all(tmp_path: Path) -> None:
    config = _config(tmp_path, *WHOLE)
    gpus = (GpuReading(0, polled_at=1.0), GpuReading(1, polled_at=1.0))
    gpu_fault = Faults(gpus={1: (conditions.down("xid 48 double-bit ecc error"),)})
    assert _replies(config, _view(*gpus, faults=gpu_fault)) == {
        "r0": "up ready 100%",
        "r1": "down #xid 48 double-bit ecc error",
    }
    node_fault = Faults(node=(conditions.down("xid 79 gpu fell off the bus"),))
    assert set(_replies(config, _view(*gpus, faults=node_fault)).values()) == {
        "down #xid 79 gpu fell off the bus"
    }


def test_nvml_unavailable_takes_every_replica_down(tmp_path: Path) -> None:
    config = _config(tmp_path, *WHOLE)
    assert set(_replies(config, _view(state="unavailable", count=0)).values()) == {
        "down #nvml unavailable"
    }
    assert set(_replies(config, _view(state="initializing", count=0)).values()) == {"up ready 100%"}


def test_a_gpu_nvml_does_not_see_is_down(tmp_path: Path) -> None:
    config = _config(tmp_path, *WHOLE)
    assert _replies(config, _view(GpuReading(0, polled_at=1.0)))["r1"] == "down #gpu 1 not found"


def test_readings_turn_into_weights_and_drains(tmp_path: Path) -> None:
    config = _config(tmp_path, *WHOLE)
    hot = GpuReading(0, polled_at=1.0, temperature_c=90, throttle=("hw_thermal",))
    remap = GpuReading(1, polled_at=1.0, remap_pending=True)
    assert _replies(config, _view(hot, remap)) == {
        "r0": "up ready 50%",
        "r1": "drain #pending row remap",
    }


MIG = {"id": "m", "health_url": "http://x/h", "mig_uuid": "MIG-1"}


@pytest.mark.parametrize(
    ("replica", "reading", "reply"),
    [
        (
            WHOLE[0],
            GpuReading(0, polled_at=1.0, mig_current=True),
            "down #mig enabled on gpu 0, not as configured",
        ),
        (
            WHOLE[0],
            GpuReading(0, polled_at=1.0, mig_current=False, mig_pending=True),
            "drain #mig mode change pending on gpu 0",
        ),
        (
            MIG,
            GpuReading(0, polled_at=1.0, mig_current=True, mig_devices=("MIG-1",)),
            "up ready 100%",
        ),
        (
            MIG,
            GpuReading(0, polled_at=1.0, mig_current=True, mig_devices=("MIG-2",)),
            "down #mig instance missing",
        ),
        (
            {**MIG, "gpu": 0},
            GpuReading(0, polled_at=1.0, mig_current=False),
            "down #mig disabled on gpu 0, not as configured",
        ),
        (
            {**MIG, "gpu": 0},
            GpuReading(
                0, polled_at=1.0, mig_current=True, mig_pending=False, mig_devices=("MIG-1",)
            ),
            "drain #mig mode change pending on gpu 0",
        ),
    ],
)
def test_mig_layout_is_checked_against_the_replicas(
    tmp_path: Path, replica: dict[str, object], reading: GpuReading, reply: str
) -> None:
    config = _config(tmp_path, replica)
    assert _replies(config, _view(reading)) == {replica["id"]: reply}


def test_mig_replica_found_on_its_gpu_shares_that_gpus_faults(tmp_path: Path) -> None:
    config = _config(tmp_path, MIG)
    readings = (
        GpuReading(0, polled_at=1.0, mig_current=False),
        GpuReading(1, polled_at=1.0, mig_current=True, mig_devices=("MIG-1",)),
    )
    faults = Faults(gpus={1: (conditions.drain("xid 63 row remap pending"),)})
    snap = compose(config, _view(*readings, faults=faults), {"m": OK}, Drains())
    assert (
        snap.verdicts["m"].gpu == 1
        and snap.verdicts["m"].reply == "drain #xid 63 row remap pending"
    )


def test_drains_node_replica_and_unreadable_state(tmp_path: Path) -> None:
    config = _config(tmp_path, *WHOLE)
    view = _view(GpuReading(0, polled_at=1.0), GpuReading(1, polled_at=1.0))
    assert _replies(config, view, Drains(replicas=frozenset({"r1"}))) == {
        "r0": "up ready 100%",
        "r1": "drain #operator",
    }
    assert set(_replies(config, view, Drains(node=True)).values()) == {"drain #operator"}
    unreadable = Drains(unreadable="state file unreadable")
    assert set(_replies(config, view, unreadable).values()) == {"drain #state file unreadable"}


KUBE = {"namespace": "denv", "container": "server", "pod_resources_socket": "/k/kubelet.sock"}
UUIDS = [f"GPU-{i}" for i in range(8)]
EIGHT = tuple(GpuReading(i, uuid=UUIDS[i], polled_at=1.0) for i in range(8))
PODS = [
    {"id": f"voice.k8s.node-{i}.0", "health_url": "http://x/h", "pod": f"voice-{i}"}
    for i in range(10)
]


def _pod_replies(
    replicas: list[dict[str, object]], view: GpuView, pods: dict[str, Assigned], tmp_path: Path
) -> dict[str, str]:
    config = make_config(tmp_path, replicas, kubernetes=KUBE)
    snap = compose(config, view, {r.id: OK for r in config.replicas}, NO_DRAINS, pods)
    return {rid: v.reply for rid, v in snap.verdicts.items()}


def test_on_an_8_gpu_node_each_pods_verdict_follows_the_gpu_the_kubelet_gave_it(
    tmp_path: Path,
) -> None:
    # Pods 0-7 on this node, GPU i to pod 7 - i; pods 8 and 9 run elsewhere.
    pods = {f"voice.k8s.node-{i}.0": Assigned(gpus=frozenset({UUIDS[7 - i]})) for i in range(8)}
    fault = Faults(gpus={6: (conditions.down("xid 48 double-bit ecc error"),)})
    hot = replace(EIGHT[2], temperature_c=90)
    view = _view(*EIGHT[:2], hot, *EIGHT[3:], faults=fault)
    assert _pod_replies(PODS, view, pods, tmp_path) == {
        "voice.k8s.node-0.0": "up ready 100%",
        "voice.k8s.node-1.0": "down #xid 48 double-bit ecc error",  # GPU 6
        "voice.k8s.node-2.0": "up ready 100%",
        "voice.k8s.node-3.0": "up ready 100%",
        "voice.k8s.node-4.0": "up ready 100%",
        "voice.k8s.node-5.0": "up ready 50%",  # GPU 2, hot
        "voice.k8s.node-6.0": "up ready 100%",
        "voice.k8s.node-7.0": "up ready 100%",
    }


SLICES = [
    {"id": "side.0", "health_url": "http://x/h", "pod": "side-0"},
    {"id": "side.1", "health_url": "http://x/h", "pod": "side-1"},
    {"id": "voice.0", "health_url": "http://x/h", "pod": "voice-0"},
]


@pytest.mark.parametrize(
    ("pods", "readings", "replies"),
    [
        (  # two slices of GPU 0; a whole GPU 1
            {
                "side.0": Assigned(mig_devices=frozenset({"MIG-a"})),
                "side.1": Assigned(mig_devices=frozenset({"MIG-b"})),
                "voice.0": Assigned(gpus=frozenset({"GPU-1"})),
            },
            (
                GpuReading(
                    0, uuid="GPU-0", polled_at=1.0, mig_current=True, mig_devices=("MIG-a", "MIG-b")
                ),
                GpuReading(1, uuid="GPU-1", polled_at=1.0, mig_current=False, temperature_c=90),
            ),
            {"side.0": "up ready 100%", "side.1": "up ready 100%", "voice.0": "up ready 50%"},
        ),
        (  # slice b is gone from GPU 0; voice's GPU is not on this node's list
            {
                "side.0": Assigned(mig_devices=frozenset({"MIG-a"})),
                "side.1": Assigned(mig_devices=frozenset({"MIG-b"})),
                "voice.0": Assigned(gpus=frozenset({"GPU-9"})),
            },
            (
                GpuReading(
                    0, uuid="GPU-0", polled_at=1.0, mig_current=True, mig_devices=("MIG-a",)
                ),
                GpuReading(1, uuid="GPU-1", polled_at=1.0, mig_current=False),
            ),
            {
                "side.0": "up ready 100%",
                "side.1": "down #mig instance missing",
                "voice.0": "down #gpu gpu-9 not found",
            },
        ),
        (  # a pod holding no GPU device, and one that is not on this node
            {"side.0": Assigned(), "voice.0": Assigned(gpus=frozenset({"GPU-0"}))},
            (GpuReading(0, uuid="GPU-0", polled_at=1.0, mig_current=True, mig_devices=("MIG-a",)),),
            {
                "side.0": "down #pod side-0 holds 0 gpu devices, not 1",
                "voice.0": "down #mig enabled on gpu 0, not as configured",
            },
        ),
    ],
    ids=["slices and a whole GPU", "slice gone, unknown GPU", "no device, MIG mismatch"],
)
def test_on_a_mig_node_each_pods_verdict_follows_its_slice(
    pods: dict[str, Assigned],
    readings: tuple[GpuReading, ...],
    replies: dict[str, str],
    tmp_path: Path,
) -> None:
    assert _pod_replies(SLICES, _view(*readings), pods, tmp_path) == replies
