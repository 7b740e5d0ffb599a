"""What each placed node of a stack runs: the node deploys' input, built from the stack."""

from denv_iac.core.agent_config import recipe_probe
from denv_iac.core.balancer.tiers import rejoin_s
from denv_iac.core.drain import drain_plan
from denv_iac.core.endpoint import balancer_settings
from denv_iac.core.overlay_plan import plan_overlay
from denv_iac.core.placement import Placement
from denv_iac.core.plan import imageless_problems
from denv_iac.core.sites import CLOUD_SITE_KINDS, cache_root, node_id
from denv_iac.core.stack.model import (
    COLD_START_BUDGET_S,
    SSH_SITE_KINDS,
    StackSpec,
)
from denv_iac.core.stack.ports import replica_port
from denv_iac.core.stack.reader import StackError
from denv_iac.node.spec import (
    CacheDirs,
    MigSlice,
    NodeDeploySpec,
    NodeSpecError,
    ReplicaSpec,
)


def node_deploy_specs(stack: StackSpec, placement: Placement) -> dict[str, NodeDeploySpec]:
    """What each placed node on an SSH site runs, by node id; StackError if one cannot run it.

    The replicas' weights and compile caches go under the site's `cache_root`. The balancer
    addresses are left out: they are known only once the hosts exist.
    """
    recipes = {recipe.name: recipe for recipe in stack.recipes}
    problems = imageless_problems(stack, placement)
    if problems:
        raise StackError(problems)
    overlay = plan_overlay(stack, placement)
    specs = {}
    for node in placement.nodes:
        if stack.site(node.site).kind not in SSH_SITE_KINDS:
            continue
        replicas = tuple(
            ReplicaSpec(
                id=r.id,
                image=recipes[r.pool].image,
                port=replica_port(recipes[r.pool], r),
                gpu=r.gpu,
                command=recipes[r.pool].command,
                mig_profile=r.share if recipes[r.pool].is_mig else None,
                mig_instance=r.slice or 0,
                env=dict(recipes[r.pool].env),
                health_path=recipes[r.pool].health_path,
                probe=recipe_probe(recipes[r.pool]),
            )
            for r in placement.replicas
            if (r.site, r.node) == (node.site, node.name)
        )
        mig = tuple(
            MigSlice(m.gpu, m.profile, m.instances)
            for m in placement.mig_layouts
            if (m.site, m.node) == (node.site, node.name)
        )
        # A rolled replica's drain and warm-up bounds: its recipe's (the longest of the node's).
        here = (node.site, node.name)
        pools = [recipes[r.pool] for r in placement.replicas if (r.site, r.node) == here]
        ready_s = max((p.cold_start_budget_s for p in pools), default=COLD_START_BUDGET_S)
        # The drain's bound and quiet window (denv_iac.core.drain); its settle time is rejoin_s.
        rejoin = rejoin_s(balancer_settings(stack))
        drain = drain_plan(pools, rejoin)
        name = node_id(node.site, node.name)
        site = stack.site(node.site)
        root = cache_root(stack.name, site)
        try:
            specs[name] = NodeDeploySpec(
                node_id=name,
                image_driver=site.kind in CLOUD_SITE_KINDS,
                mig=mig,
                cache=CacheDirs() if root is None else CacheDirs.under(root),
                replicas=replicas,
                admin_cidrs=site.admin_cidrs,
                listen_address=overlay.address_of(node.site, node.name) if overlay.on else "",
                overlay_port=stack.balancer.overlay.port,
                drain_timeout_s=drain.bound_s,
                ready_timeout_s=ready_s,
                rejoin_s=rejoin,
                quiet_s=drain.quiet_s,
            )
        except NodeSpecError as error:
            where = f"sites: {node.site}.{node.name}"
            raise StackError([f"{where}: {p}" for p in error.problems]) from None
    return specs
