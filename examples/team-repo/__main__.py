"""A team's own program: its log bucket, and a GPU endpoint from denv-iac's Cluster."""

import pulumi
import pulumi_aws as aws

from denv_iac.components import Cluster
from denv_iac.components.secrets import (
    BALANCER_SECRET_FIELDS,
    with_secret_fields,
    with_secret_recipes,
    with_secret_sites,
)

config = pulumi.Config("gpu")
# The structure is read plainly (it decides what exists); every key from the secret read.
sites = with_secret_sites(config.require_object("sites"), config.require_secret_object("sites"))
balancer = with_secret_fields(
    config.require_object("balancer"),
    config.require_secret_object("balancer"),
    BALANCER_SECRET_FIELDS,
)

# Every env value of a recipe is taken as a secret: this program does not say which are.
recipes = with_secret_recipes(
    config.require_object("recipes"), config.require_secret_object("recipes")
)

logs = aws.s3.Bucket("voice-logs", force_destroy=False, tags={"team": "voice"})
cluster = Cluster(
    "voice",
    {"sites": sites, "recipes": recipes, "balancer": balancer},
)

pulumi.export("endpoint", cluster.endpoint)
pulumi.export("logs_bucket", logs.bucket)
