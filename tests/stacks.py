"""Stack configs shared by the spec, placement and plan tests."""

import copy
from typing import Any

SECRET = {"secure": "v1:dGVzdC1jaXBoZXJ0ZXh0"}


def valid_config() -> dict[str, Any]:
    """A stack touching every site kind; tests mutate a fresh copy."""
    return copy.deepcopy(
        {
            "aws:region": "us-east-1",
            "denv:sites": [
                {
                    "name": "local",
                    "kind": "local",
                    "nodes": [
                        {"name": "node-a", "gpu": "H100", "gpus": 2},
                        {"name": "node-b", "gpu": "H100", "gpus": 2},
                    ],
                },
                {
                    "name": "aws-use1",
                    "kind": "aws",
                    "region": "us-east-1",
                    "instance_type": "p5.48xlarge",
                    "max_nodes": 2,
                    "admin_cidrs": ["198.51.100.0/24"],
                    "ssh_private_key": SECRET,
                },
                {
                    "name": "lambda-use1",
                    "kind": "lambda",
                    "region": "us-east-1",
                    "instance_type": "gpu_1x_h100_pcie",
                    "max_nodes": 2,
                    "api_key": SECRET,
                    "ssh_private_key": SECRET,
                },
                {
                    "name": "nebius-eun1",
                    "kind": "nebius",
                    "region": "eu-north1",
                    "project_id": "project-e00x",
                    "subnet_id": "vpcsubnet-e00x",
                    "platform": "gpu-h100-sxm",
                    "preset": "1gpu-16vcpu-200gb",
                    "max_nodes": 2,
                    "ssh_private_key": SECRET,
                },
                {
                    "name": "hetzner-fsn",
                    "kind": "hetzner",
                    "ssh_private_key": SECRET,
                    "nodes": [
                        {"name": "gex-1", "address": "203.0.113.21", "server_model": "GEX44"}
                    ],
                },
                {
                    "name": "office",
                    "kind": "joined",
                    "ssh_private_key": SECRET,
                    "nodes": [
                        {"name": "rack-1", "address": "192.0.2.10", "gpu": "L40S", "gpus": 2}
                    ],
                },
                {
                    "name": "k8s",
                    "kind": "kubernetes",
                    "kubeconfig": SECRET,
                    "gpu": "A100-80GB",
                    "gpus_per_node": 4,
                    "max_nodes": 2,
                },
            ],
            "denv:recipes": [
                {
                    "name": "voice",
                    "gpu": "whole",
                    "min_warm": 1,
                    "spare": 1,
                    "sites": [["local", "aws-use1"], "lambda-use1"],
                },
                {"name": "side", "gpu": "1g.10gb", "min_warm": 1, "spare": 1, "sites": ["local"]},
                {"name": "rtx", "min_warm": 1, "spare": 0, "sites": ["office", "hetzner-fsn"]},
            ],
            "denv:balancer": {"sites": ["local"], "port": 8080},
        }
    )


def local_site(name: str, nodes: int, gpus: int, gpu: str = "H100") -> dict[str, Any]:
    return {
        "name": name,
        "kind": "local",
        "nodes": [{"name": f"n{i}", "gpu": gpu, "gpus": gpus} for i in range(nodes)],
    }


def kube_site(name: str = "k8s", max_nodes: int = 1, **extra: Any) -> dict[str, Any]:
    """A Kubernetes site of H100 planning nodes of 8 GPUs, its kubeconfig a sealed secret."""
    return {
        "name": name,
        "kind": "kubernetes",
        "kubeconfig": {"secure": "sealed"},
        "gpu": "H100",
        "gpus_per_node": 8,
        "max_nodes": max_nodes,
        **extra,
    }


# The balancer of a stack whose GPUs are on Kubernetes: a machine of a site of its own.
EDGE: dict[str, Any] = {
    "name": "edge",
    "kind": "local",
    "nodes": [{"name": "lb", "gpu": "L4", "gpus": 1}],
}
