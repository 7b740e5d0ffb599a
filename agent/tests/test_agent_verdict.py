from __future__ import annotations

from pathlib import Path

import pytest
from denv_agent import conditions
from denv_agent.conditions import Condition
from denv_agent.config import AgentConfig
from denv_agent.gpu_health import Faults, GpuReading
from denv_agent.gpu_monitor import GpuView, NvmlStatus
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
