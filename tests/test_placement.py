"""Placement: survival of any one failure domain, determinism and stability."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from denv_iac.core.placement import Placement, PlacementError, place_replicas
from denv_iac.core.stack.model import BalancerSpec, NodeSpec, RecipeSpec, SiteSpec, StackSpec
from denv_iac.core.stack.reader import read_stack
from tests.stacks import local_site, valid_config

GPUS = ("H100", "A100-40GB", "L40S")
SHARES = {
    "H100": ("whole", "1g.10gb", "3g.40gb"),
    "A100-40GB": ("whole", "1g.5gb"),
    "L40S": ("whole",),
}


def stack_of(sites: list[SiteSpec], recipes: list[RecipeSpec]) -> StackSpec:
    return StackSpec("t", tuple(sites), tuple(recipes), BalancerSpec(sites=(sites[0].name,)))


@st.composite
def sites_strategy(draw: st.DrawFn, prefix: str = "s") -> list[SiteSpec]:
    sites = []
    for i in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            nodes = tuple(
                NodeSpec(f"n{j}", draw(st.sampled_from(GPUS)), draw(st.integers(1, 4)))
                for j in range(draw(st.integers(1, 4)))
            )
            sites.append(SiteSpec(f"{prefix}{i}", "local", nodes=nodes))
        else:
            sites.append(
                SiteSpec(
                    f"{prefix}{i}",
                    "aws",
                    offering="p5.48xlarge",
                    gpu="H100",
                    gpus_per_node=draw(st.integers(1, 8)),
                    max_nodes=draw(st.integers(1, 3)),
                )
            )
    return sites


@st.composite
def recipes_strategy(draw: st.DrawFn, sites: list[SiteSpec], first: int = 0) -> list[RecipeSpec]:
    recipes = []
    for i in range(draw(st.integers(1, 3))):
        gpu = draw(st.sampled_from(GPUS))
        share = draw(st.sampled_from(SHARES[gpu]))
        names = [s.name for s in sites]
        chosen = draw(
            st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True)
        )
        recipes.append(
            RecipeSpec(
                name=f"p{first + i}",
                share=share,
                gpu_models=(gpu,),
                tiers=tuple((n,) for n in chosen),
                min_warm=draw(st.integers(1, 3)),
                spare=draw(st.integers(1, 2)),
                survive=draw(st.sampled_from(("node", "site"))),
            )
        )
    return recipes


@st.composite
def stacks(draw: st.DrawFn) -> StackSpec:
    sites = draw(sites_strategy())
    return stack_of(sites, draw(recipes_strategy(sites)))


def try_place(stack: StackSpec, previous: tuple[str, ...] = ()) -> Placement | None:
    try:
        return place_replicas(stack, previous)
    except PlacementError:
        return None


def ids(placement: Placement) -> set[str]:
    return {r.id for r in placement.replicas}


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(stacks())
def test_any_one_domain_lost_leaves_min_warm(stack: StackSpec) -> None:
    placement = try_place(stack)
    if placement is None:
        return
    for recipe in stack.recipes:
        replicas = placement.replicas_of(recipe.name)
        assert len(replicas) == recipe.min_warm + recipe.spare
        domains = Counter(
            r.site if recipe.survive == "site" else (r.site, r.node) for r in replicas
        )
        for lost in domains.values():
            assert len(replicas) - lost >= recipe.min_warm
        assert all(r.site in recipe.sites for r in replicas)


@PROPERTY
@given(stacks())
def test_no_gpu_or_slice_is_shared(stack: StackSpec) -> None:
    placement = try_place(stack)
    if placement is None:
        return
    slots = [(r.site, r.node, r.gpu, r.slice) for r in placement.replicas]
    assert len(slots) == len(set(slots))
    whole = {(r.site, r.node, r.gpu) for r in placement.replicas if r.slice is None}
    sliced = {(r.site, r.node, r.gpu): r.share for r in placement.replicas if r.slice is not None}
    assert not whole & set(sliced)
    for r in placement.replicas:
        if r.slice is not None:
            assert sliced[(r.site, r.node, r.gpu)] == r.share  # one profile per GPU


@PROPERTY
@given(stacks())
def test_two_runs_are_identical(stack: StackSpec) -> None:
    assert try_place(stack) == try_place(stack)


@PROPERTY
@given(st.data())
def test_appending_a_site_or_pool_never_moves_a_replica(data: st.DataObject) -> None:
    stack = data.draw(stacks())
    before = try_place(stack)
    if before is None:
        return
    extra = data.draw(sites_strategy(prefix="x"))
    recipes = [
        RecipeSpec(**{**r.__dict__, "tiers": r.tiers + tuple((s.name,) for s in extra)})
        for r in stack.recipes
    ]
    grown = stack_of(
        list(stack.sites) + extra,
        recipes + data.draw(recipes_strategy(list(stack.sites) + extra, first=10)),
    )
    after = try_place(grown)
    if after is not None:
        assert ids(before) <= ids(after)


@PROPERTY
@given(st.data())
def test_raising_min_warm_of_the_last_pool_never_moves_a_replica(data: st.DataObject) -> None:
    stack = data.draw(stacks())
    before = try_place(stack)
    if before is None:
        return
    last = stack.recipes[-1]
    raised = RecipeSpec(**{**last.__dict__, "min_warm": last.min_warm + 1})
    after = try_place(stack_of(list(stack.sites), [*stack.recipes[:-1], raised]))
    if after is not None:
        assert ids(before) <= ids(after)


@PROPERTY
@given(st.data())
def test_with_the_previous_placement_no_change_moves_a_replica(data: st.DataObject) -> None:
    """Nodes added anywhere, sites inserted first, any min_warm raised: pinned ids all stay."""
    stack = data.draw(stacks())
    before = try_place(stack)
    if before is None:
        return
    sites = [
        SiteSpec(**{**s.__dict__, "nodes": (NodeSpec("new", "H100", 4), *s.nodes)})
        if s.nodes
        else s
        for s in stack.sites
    ]
    extra = data.draw(sites_strategy(prefix="x"))
    recipes = [
        RecipeSpec(
            **{
                **r.__dict__,
                "min_warm": r.min_warm + data.draw(st.integers(0, 1)),
                "tiers": tuple((s.name,) for s in extra) + r.tiers,
            }
        )
        for r in stack.recipes
    ]
    after = try_place(stack_of(extra + sites, recipes), tuple(sorted(ids(before))))
    if after is not None:
        assert ids(before) <= ids(after)


def test_local_example_spreads_each_pool_over_both_nodes() -> None:
    config = {
        "denv:sites": [local_site("local", nodes=2, gpus=2)],
        "denv:recipes": [
            {"name": "voice", "min_warm": 1, "spare": 1, "sites": ["local"]},
            {"name": "side", "gpu": "1g.10gb", "min_warm": 1, "spare": 1, "sites": ["local"]},
        ],
        "denv:balancer": {"sites": ["local"]},
    }
    placement = place_replicas(read_stack("local", config))
    assert [r.id for r in placement.replicas] == [
        "voice.local.n0.0",
        "voice.local.n1.0",
        "side.local.n0.1.0",
        "side.local.n1.1.0",
    ]
    assert [(m.node, m.gpu, m.profile, m.instances) for m in placement.mig_layouts] == [
        ("n0", 1, "1g.10gb", 7),
        ("n1", 1, "1g.10gb", 7),
    ]


def test_cloud_sites_create_only_the_nodes_they_need() -> None:
    placement = place_replicas(read_stack("t", valid_config()))
    created = [(n.site, n.name, n.replicas) for n in placement.nodes if n.create]
    assert created == []  # the local site holds voice and side; nothing spills to the clouds
    config = valid_config()
    config["denv:sites"][1]["max_nodes"] = 3
    config["denv:recipes"][0].update(sites=["aws-use1"], min_warm=2)
    placement = place_replicas(read_stack("t", config))
    assert [r.id for r in placement.replicas_of("voice")] == [
        "voice.aws-use1.node-0.0",
        "voice.aws-use1.node-1.0",
        "voice.aws-use1.node-2.0",
    ]
    created = [(n.site, n.name, n.gpu_count, n.replicas) for n in placement.nodes if n.create]
    assert created == [("aws-use1", f"node-{i}", 8, 1) for i in range(3)]


SHORTFALLS = [
    (
        {"min_warm": 2, "survive": "site", "sites": ["a"]},
        "recipes[0].min_warm: voice needs 3 GPUs on >= 3 sites (at most 1 per site) to survive a "
        "site loss; its sites have 4 usable GPUs, all on a; add capacity to its sites, list more "
        "sites, or lower min_warm",
    ),
    ({"min_warm": 1, "sites": ["a"], "spare": 1, "gpu_models": ["H100"]}, None),
    (
        {"min_warm": 3, "sites": ["a"]},
        "recipes[0].min_warm: voice needs 4 GPUs on >= 4 nodes (at most 1 per node) to survive a "
        "node loss; its sites have 4 usable GPUs, on 2 nodes; add capacity to its sites, list more "
        "sites, or lower min_warm",
    ),
    (
        {"min_warm": 9, "spare": 0, "sites": ["a"]},
        "recipes[0].min_warm: voice needs 9 GPUs; its sites have 4 usable GPUs; add "
        "capacity to its sites, list more sites, or lower min_warm",
    ),
]


@pytest.mark.parametrize(("recipe", "expected"), SHORTFALLS)
def test_shortfall_names_what_is_missing(recipe: dict[str, object], expected: str | None) -> None:
    config = {
        "denv:sites": [local_site("a", nodes=2, gpus=2)],
        "denv:recipes": [{"name": "voice", **recipe}],
        "denv:balancer": {"sites": ["a"]},
    }
    stack = read_stack("t", config)
    if expected is None:
        assert len(place_replicas(stack).replicas) == 2
        return
    with pytest.raises(PlacementError) as raised:
        place_replicas(stack)
    assert raised.value.problems == [expected]
