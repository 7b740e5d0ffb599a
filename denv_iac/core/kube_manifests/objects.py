"""What every object of a kubernetes site is made of: the object's frame and metadata, the
labels that say whose it is and the selectors made of them, and the pieces more than one kind
of object shares (a ConfigMap, a disruption budget, an HTTP probe, the GPU nodes' affinity)."""

from typing import Any

from denv_iac.core.stack.model import SiteSpec

Manifest = dict[str, Any]
SERVER_CONTAINER = "server"
# What GPU feature discovery labels nodes with (`nvidia.com/gpu.product`): the driver's product
# name with spaces as dashes. Each catalog model lists exactly the cards with its memory and MIG
# profiles, since replicas are placed and sliced by those: an H100 NVL (94 GB, 1g.12gb slices)
# is not an H100 (80 GB, 1g.10gb), nor an H200 NVL an H200 SXM (the catalog's H200 offerings).
# Every catalog model has its entry: a model without one would let pods land on any GPU.
GPU_PRODUCTS = {
    "A10": ("NVIDIA-A10",),
    "A10G": ("NVIDIA-A10G",),
    "A30": ("NVIDIA-A30",),
    "A100-40GB": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
    "A100-80GB": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "B200": ("NVIDIA-B200",),
    "B300": ("NVIDIA-B300-SXM6-AC",),
    "H100": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"),
    "H200": ("NVIDIA-H200",),
    "H200-NVL": ("NVIDIA-H200-NVL",),
    "L4": ("NVIDIA-L4",),
    "L40S": ("NVIDIA-L40S",),
    "RTX-4000-SFF-ADA": ("NVIDIA-RTX-4000-SFF-Ada-Generation",),
    "RTX-6000-ADA": ("NVIDIA-RTX-6000-Ada-Generation",),
    "RTX-PRO-4000-SFF-BLACKWELL": ("NVIDIA-RTX-PRO-4000-Blackwell-SFF-Edition",),
    "RTX-PRO-6000-BLACKWELL-MAXQ": ("NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition",),
}


def kube_object(api_version: str, kind: str, metadata: Manifest, **body: Any) -> Manifest:
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **body}


def site_labels(stack: str, site: SiteSpec, **extra: str) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/managed-by": "denv",
        "app.kubernetes.io/part-of": "denv",
        "denv/stack": stack,
        "denv/site": site.name,
        **{f"denv/{key}": value for key, value in extra.items()},
    }
    return dict(sorted(labels.items()))


def replica_labels(stack: str, site: SiteSpec, pool: str) -> dict[str, str]:
    return site_labels(stack, site, role="replica", pool=pool)


def gateway_labels(stack: str, site: SiteSpec) -> dict[str, str]:
    return site_labels(stack, site, role="gateway")


def agent_labels(stack: str, site: SiteSpec) -> dict[str, str]:
    return site_labels(stack, site, role="agent")


def replica_pods(site: SiteSpec) -> dict[str, str]:
    """Every replica pod of the site, whatever its pool."""
    return {"denv/site": site.name, "denv/role": "replica"}


def pod_selector(labels: dict[str, str]) -> dict[str, str]:
    """What selects pods: everything but the descriptive labels."""
    return {k: v for k, v in labels.items() if k.startswith("denv/")}


def object_meta(site: SiteSpec, name: str, labels: dict[str, str]) -> Manifest:
    return {"name": name, "namespace": site.namespace, "labels": labels}


def config_map(stack: str, site: SiteSpec, name: str, role: str, data: dict[str, str]) -> Manifest:
    return kube_object(
        "v1", "ConfigMap", object_meta(site, name, site_labels(stack, site, role=role)), data=data
    )


def disruption_budget(
    stack: str, site: SiteSpec, name: str, labels: dict[str, str], least: int
) -> Manifest:
    return kube_object(
        "policy/v1",
        "PodDisruptionBudget",
        object_meta(site, name, labels),
        spec={"minAvailable": least, "selector": {"matchLabels": pod_selector(labels)}},
    )


def http_probe(path: str, port: str, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def gpu_node_affinity(site: SiteSpec) -> Manifest:
    products = list(GPU_PRODUCTS[site.gpu])
    term = {"key": "nvidia.com/gpu.product", "operator": "In", "values": products}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [term]}]
            }
        }
    }
