"""Placed replicas become balancer pools: one tier per preference level, never an unlisted site."""

from pathlib import Path

from denv_iac.core.balancer import BalancerSettings, render_haproxy_config
from denv_iac.core.dataplane import balancer_pools
from denv_iac.core.placement import PlacedReplica, place_replicas
from denv_iac.core.stack.reader import read_stack
from denv_iac.haproxy import check_haproxy_config
from tests.stacks import local_site


def locate(replica: PlacedReplica) -> tuple[str, int, int]:
    return "127.0.0.1", 9000 + replica.gpu, 9300


CONFIG = {
    "denv:sites": [local_site("home-a", 2, 2), local_site("home-b", 2, 2), local_site("far", 2, 2)],
    "denv:recipes": [
        {"name": "voice", "min_warm": 3, "spare": 1, "sites": [["home-a", "home-b"], "far"]},
        {"name": "side", "min_warm": 1, "spare": 1, "sites": ["far"], "session_affinity": False},
    ],
    "denv:balancer": {"sites": ["home-a"]},
}


def test_tiers_follow_the_recipe_and_skip_empty_ones() -> None:
    stack = read_stack("t", CONFIG)
    pools = {p.name: p for p in balancer_pools(stack, place_replicas(stack), locate)}
    voice = pools["voice"]
    assert [(t.priority, t.sites) for t in voice.tiers] == [(10, ("home-a", "home-b"))]
    assert sorted(s.replica_id for s in voice.tiers[0].servers) == [
        "voice.home-a.n0.0",
        "voice.home-a.n1.0",
        "voice.home-b.n0.0",
        "voice.home-b.n1.0",
    ]
    side = pools["side"]
    assert not side.session_affinity
    assert {s.site for t in side.tiers for s in t.servers} == {"far"}


def test_rendered_config_passes_haproxy_check(tmp_path: Path) -> None:
    stack = read_stack("t", CONFIG)
    pools = balancer_pools(stack, place_replicas(stack), locate)
    settings = BalancerSettings(stats_socket=str(tmp_path / "s.sock"), state_file=None)
    rendered = render_haproxy_config(pools, settings, str(tmp_path))
    check_haproxy_config(rendered, tmp_path)
    assert "voice.home-b.n1.0" in rendered.haproxy_cfg


def test_a_recipes_model_names_reach_the_pools_map_and_the_model_list(tmp_path: Path) -> None:
    config = dict(CONFIG)
    voice, side = CONFIG["denv:recipes"]  # type: ignore[misc]
    config["denv:recipes"] = [{**voice, "models": ["openai/whisper-large-v3", "voice"]}, side]
    stack = read_stack("t", config)
    pools = {p.name: p for p in balancer_pools(stack, place_replicas(stack), locate)}
    assert pools["voice"].models == ("openai/whisper-large-v3",)
    assert pools["side"].models == ()
    settings = BalancerSettings(stats_socket=str(tmp_path / "s.sock"), state_file=None)
    rendered = render_haproxy_config(tuple(pools.values()), settings, str(tmp_path))
    check_haproxy_config(rendered, tmp_path)
    assert rendered.files["pools.map"].splitlines()[1:] == [
        "openai/whisper-large-v3 voice",
        "side side",
        "voice voice",
    ]
    assert '"id":"openai/whisper-large-v3"' in rendered.haproxy_cfg
