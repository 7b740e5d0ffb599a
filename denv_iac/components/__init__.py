"""The Pulumi layer: components over the pure spec, placement and balancer modules.

Importing this package imports Pulumi and the provider SDKs; `import denv_iac` does not.
"""

from denv_iac.components.aws import AwsSite, AwsSiteArgs
from denv_iac.components.balancer import GlobalBalancer, GlobalBalancerArgs
from denv_iac.components.balancer_host import BalancerHost, BalancerHostArgs
from denv_iac.components.cluster import Cluster, ClusterArgs, validate_cluster
from denv_iac.components.joined import ExistingNodesArgs, HetznerSite, JoinedSite, LocalSite
from denv_iac.components.kubernetes import KubernetesSite, KubernetesSiteArgs
from denv_iac.components.lambda_cloud import LambdaSite, LambdaSiteArgs
from denv_iac.components.nebius import NebiusSite, NebiusSiteArgs
from denv_iac.components.node_setup import NodeSetup, NodeSetupArgs
from denv_iac.components.pool import ReplicaEndpoint, ReplicaEndpointArgs, WarmPool, WarmPoolArgs

__all__ = [
    "AwsSite",
    "AwsSiteArgs",
    "BalancerHost",
    "BalancerHostArgs",
    "Cluster",
    "ClusterArgs",
    "ExistingNodesArgs",
    "GlobalBalancer",
    "GlobalBalancerArgs",
    "HetznerSite",
    "JoinedSite",
    "KubernetesSite",
    "KubernetesSiteArgs",
    "LambdaSite",
    "LambdaSiteArgs",
    "LocalSite",
    "NebiusSite",
    "NebiusSiteArgs",
    "NodeSetup",
    "NodeSetupArgs",
    "ReplicaEndpoint",
    "ReplicaEndpointArgs",
    "WarmPool",
    "WarmPoolArgs",
    "validate_cluster",
]
