"""The config-driven program: one Cluster from the stack's `denv:` config."""

from pathlib import Path

import pulumi

from denv_iac.components import Cluster
from denv_iac.components.secrets import (
    BALANCER_SECRET_FIELDS,
    with_secret_fields,
    with_secret_recipes,
    with_secret_sites,
)
from denv_iac.stacks_dir import declared_recipes, load_lock

config = pulumi.Config("denv")
stack = pulumi.get_stack()
# Sites and the balancer hold keys: their structure is read plainly (it decides what exists),
# every secret field from the secret read, so none ever leaves Pulumi's secret handling.
sites = with_secret_sites(config.require_object("sites"), config.require_secret_object("sites"))
balancer = with_secret_fields(
    config.require_object("balancer"),
    config.require_secret_object("balancer"),
    BALANCER_SECRET_FIELDS,
)
# A recipe's `secure:` env values likewise; the stack file says which ones they are.
recipes = with_secret_recipes(
    config.require_object("recipes"),
    config.require_secret_object("recipes"),
    declared_recipes(Path(__file__).parent, stack),
)
cluster = Cluster(
    stack,
    {
        "sites": sites,
        "recipes": recipes,
        "balancer": balancer,
        "previous": load_lock(Path(__file__).parent, stack),
    },
)
pulumi.export("endpoint", cluster.endpoint)
pulumi.export("replicas", cluster.replica_ids)
