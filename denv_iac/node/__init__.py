"""Node deploys: prepare a GPU node (driver, runtime, MIG, agent, replicas, firewall), repair it,
and put a balancer host's HAProxy config live. Decisions are pure (plan_node, plan_balancer);
pyinfra runs them."""

from denv_iac.core.agent_config import AgentProbe
from denv_iac.core.sites import CACHE_MOUNT_POINT
from denv_iac.node.balancer_host import plan_balancer, prepare_balancer
from denv_iac.node.deploy import NodeUnreachable, StepFailed, Target, prepare_node
from denv_iac.node.driver import UnsupportedNode
from denv_iac.node.facts import GpuInfo, MigDevice, NodeFacts, parse_facts
from denv_iac.node.plan import fact_query, plan_node
from denv_iac.node.repair import RepairLevel, RepairReport, StepReport, repair_node
from denv_iac.node.spec import (
    AgentSettings,
    CacheDirs,
    CacheVolume,
    MigSlice,
    NodeDeploySpec,
    NodeSpecError,
    ReplicaSpec,
    load_spec,
    spec_from_json,
)
from denv_iac.node.steps import FileContent, Step

__all__ = [
    "CACHE_MOUNT_POINT",
    "AgentProbe",
    "AgentSettings",
    "CacheDirs",
    "CacheVolume",
    "FileContent",
    "GpuInfo",
    "MigDevice",
    "MigSlice",
    "NodeDeploySpec",
    "NodeFacts",
    "NodeSpecError",
    "NodeUnreachable",
    "RepairLevel",
    "RepairReport",
    "ReplicaSpec",
    "Step",
    "StepFailed",
    "StepReport",
    "Target",
    "UnsupportedNode",
    "fact_query",
    "load_spec",
    "parse_facts",
    "plan_balancer",
    "plan_node",
    "prepare_balancer",
    "prepare_node",
    "repair_node",
    "spec_from_json",
]
