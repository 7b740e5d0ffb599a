"""Pulumi's mock engine for the component tests: the product's own, `components.preview`."""

from typing import Any

from denv_iac.components import Cluster
from denv_iac.components.preview import (
    AMI_ID,
    SECRET_MARK,
    SECRET_SIG,
    Run,
    run_program,
)

__all__ = ["AMI_ID", "Run", "cluster_outputs", "plain_strings", "run_program", "waits_for"]


def plain_strings(value: Any) -> list[str]:
    """Every string in serialized inputs, leaving out the insides of secret values."""
    if isinstance(value, dict):
        if value.get(SECRET_SIG) == SECRET_MARK:
            return []
        return [s for k, v in value.items() for s in [str(k), *plain_strings(v)]]
    if isinstance(value, list):
        return [s for item in value for s in plain_strings(item)]
    return [value] if isinstance(value, str) else []


def cluster_outputs(args: Any, name: str = "prod") -> dict[str, Any]:
    """A program building one Cluster; its outputs are what the tests read."""
    cluster = Cluster(name, args)
    return {
        "balancer_addresses": cluster.balancer_addresses,
        "endpoint": cluster.endpoint,
        "haproxy_config": cluster.haproxy_config,
        "replica_ids": cluster.replica_ids,
    }


def waits_for(run: Run, first: str, then: str) -> bool:
    """Whether the resource `then` waits, directly or not, for `first` (URNs): the engine
    never runs them at once, `then` after `first`."""
    waits = {r.urn: set(r.dependencies) for r in run.registrations}
    seen, todo = set(), [then]
    while todo:
        for urn in waits.get(todo.pop(), set()) - seen:
            seen.add(urn)
            todo.append(urn)
    return first in seen
