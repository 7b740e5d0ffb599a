"""Reading a stack's `denv:sites`: each site by its kind (local, joined and Hetzner machines and
their nodes, cloud sites of AWS, Lambda and Nebius, Kubernetes clusters), with its region,
admin CIDR blocks and credentials.
"""

import ipaddress
import re
from typing import Any

from denv_iac.core.stack.catalog import Catalog
from denv_iac.core.stack.fields import (
    SECRET_HOW,
    Fields,
    Problems,
)
from denv_iac.core.stack.model import (
    MIG_STRATEGIES,
    SITE_KINDS,
    NodeSpec,
    Secret,
    SiteSpec,
)
from denv_iac.core.stack.values import (
    HOST_RULE,
    USER_NAME,
    USER_RULE,
    is_host,
    nebius_image_family,
)

ROBOT_FIELDS = ("robot_user", "robot_password")
# How each provider writes its region names, so that a typo fails here, not in the provider's API.
REGION_FORMATS = {
    "aws": (re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d$"), "us-east-1"),
    "lambda": (re.compile(r"^[a-z]+(-[a-z]+)+-\d$"), "us-east-1"),
    "nebius": (re.compile(r"^[a-z]{2}-[a-z]+\d$"), "eu-north1"),
}
HETZNER_LOCATIONS = ("fsn1", "nbg1", "hel1", "ash", "hil", "sin")


def _read_node(problems: Problems, path: str, raw: object, kind: str, catalog: Catalog) -> NodeSpec:
    f = Fields(problems, path, raw)
    name = f.name()
    address = f.text("address", "" if kind == "local" else None, example="203.0.113.10")
    if address and not is_host(address):
        f.problem("address", f'"{address}" is not an IP address or host name; {HOST_RULE}')
    ssh_user = "root" if kind == "local" else f.text("ssh_user", "root")
    if ssh_user and not USER_NAME.fullmatch(ssh_user):
        f.problem("ssh_user", f'"{ssh_user}" is not a login name; {USER_RULE}')
    if kind == "hetzner":
        if f.flag("behind_nat", False):
            f.problem("behind_nat", "a Hetzner box has a public address; remove behind_nat")
        model = f.text("server_model", example="GEX130")
        offering = catalog.offering("hetzner", model) if model else None
        if model and offering is None:
            f.problem(
                "server_model",
                f'"{model}" is unknown; use one of {catalog.offering_names("hetzner")}',
            )
        f.finish()
        if offering is None:
            return NodeSpec(name, "", 0, address, ssh_user)
        return NodeSpec(name, offering.gpu, offering.gpu_count, address, ssh_user, model)
    gpu = _gpu_model(f, "gpu", catalog)
    count = f.integer("gpus", None, 1, 16)
    # Only a joined machine can sit behind NAT: every other kind has a public address.
    behind_nat = f.flag("behind_nat", False) if kind == "joined" else False
    f.finish()
    return NodeSpec(name, gpu, count, address, ssh_user, behind_nat=behind_nat)


def _gpu_model(f: Fields, key: str, catalog: Catalog) -> str:
    gpu = f.text(key, example="H100")
    if gpu and catalog.gpu(gpu) is None:
        f.problem(key, f'GPU model "{gpu}" is unknown; use one of {catalog.gpu_names()}')
        return ""
    return gpu


def read_site(problems: Problems, path: str, raw: object, catalog: Catalog) -> SiteSpec:
    f = Fields(problems, path, raw)
    name = f.name()
    kind = f.choice("kind", SITE_KINDS)
    price = f.number("price_per_gpu_hour")
    cache_size_gb = f.integer("cache_size_gb", 500, 10, 65536)
    round_trip = f.number("round_trip_ms")
    if round_trip is not None and round_trip > ROUND_TRIP_LIMIT_MS:
        f.problem(
            "round_trip_ms",
            f"{round_trip:g} is past {ROUND_TRIP_LIMIT_MS} ms, more than any link on Earth;"
            " give the round trip in milliseconds, as `denv status` shows it",
        )
    if round_trip is None and kind == "local":
        round_trip = 0.0  # the balancer's own machine
    common: dict[str, Any] = {
        "price_per_gpu_hour": price,
        "cache_size_gb": cache_size_gb,
        "round_trip_ms": round_trip,
    }
    site = SiteSpec(name, kind or "local", **common)
    if kind in ("local", "joined", "hetzner"):
        nodes = tuple(_read_node(problems, p, n, kind, catalog) for p, n in f.items("nodes"))
        extra: dict[str, Any] = {"nodes": nodes}
        if kind != "local":
            extra["ssh_private_key"] = f.secret("ssh_private_key", required=True, how=SECRET_HOW)
            extra["admin_cidrs"] = _cidrs(f)
        if kind == "hetzner":
            extra["region"] = f.choice("location", HETZNER_LOCATIONS, "fsn1")
            extra.update(_robot_credentials(f))
            extra["hcloud_ssh_key"] = f.text("hcloud_ssh_key", "")
        site = SiteSpec(name, kind, **common, **extra)
    elif kind in ("aws", "lambda", "nebius"):
        site = _read_cloud_site(f, name, kind, catalog, common)
    elif kind == "kubernetes":
        site = SiteSpec(
            name,
            kind,
            **common,
            kubeconfig=f.secret("kubeconfig", required=True, how=SECRET_HOW),
            namespace=_namespace(f),
            gpu=_gpu_model(f, "gpu", catalog),
            gpus_per_node=f.integer("gpus_per_node", None, 1, 16),
            max_nodes=f.integer("max_nodes", None, 1, 1000),
            mig_strategy=f.choice("mig_strategy", MIG_STRATEGIES, ""),
        )
    if kind:  # with the kind unknown, which keys belong is unknown too
        f.finish()
    return site


# A round trip longer than this is a unit mistake (seconds for milliseconds), not a link.
ROUND_TRIP_LIMIT_MS = 2000


def _robot_credentials(f: Fields) -> dict[str, Secret | None]:
    """The Robot webservice user of a Hetzner site: both secrets, or neither."""
    found = {key: f.secret(key, required=False, how=SECRET_HOW) for key in ROBOT_FIELDS}
    given = [key for key in ROBOT_FIELDS if f.has(key)]
    if len(given) == 1:
        (missing,) = set(ROBOT_FIELDS) - set(given)
        f.problem(
            missing,
            f"missing; {given[0]} is set, and the Robot firewall needs both: "
            f"set {missing} too, or remove {given[0]}",
        )
    return found


# Namespaces Kubernetes itself runs in: a site creates and owns its namespace, and deleting the
# stack would delete it.
SYSTEM_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")


def _namespace(f: Fields) -> str:
    namespace = f.name("namespace") if f.has("namespace") else "denv"
    if namespace in SYSTEM_NAMESPACES:
        f.problem(
            "namespace",
            f'"{namespace}" belongs to Kubernetes; the site creates and owns its namespace, so '
            "give one of its own, e.g. denv",
        )
    return namespace


def _read_cloud_site(
    f: Fields, name: str, kind: str, catalog: Catalog, common: dict[str, Any]
) -> SiteSpec:
    region = _region(f, kind)
    if kind == "nebius":
        platform = f.text("platform", example="gpu-h100-sxm")
        preset = f.text("preset", example="1gpu-16vcpu-200gb")
        given, offering_name, key = bool(platform and preset), f"{platform}/{preset}", "preset"
    else:
        offering_name, key = f.text("instance_type", example="p5.48xlarge"), "instance_type"
        given = bool(offering_name)
    offering = catalog.offering(kind, offering_name)
    if given and offering is None:
        f.problem(
            key,
            f'"{offering_name}" is not a GPU offering we know on {kind}; '
            f"use one of {catalog.offering_names(kind)}",
        )
    extra: dict[str, Any] = {
        "region": region,
        "offering": offering_name,
        "max_nodes": f.integer("max_nodes", None, 1, 1000),
        "gpu": offering.gpu if offering else "",
        "gpus_per_node": offering.gpu_count if offering else 0,
        "admin_cidrs": _cidrs(f),
        "ssh_private_key": f.secret("ssh_private_key", required=True, how=SECRET_HOW),
    }
    if kind == "aws":
        extra["subnet_id"] = f.text("subnet_id", "")
        extra["image"] = f.text(
            "ami_parameter",
            "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
        )
    if kind == "lambda":
        extra["api_key"] = f.secret("api_key", required=True, how=SECRET_HOW)
    if kind == "nebius":
        extra["project_id"] = f.text("project_id", example="project-e00example")
        extra["subnet_id"] = f.text("subnet_id", example="vpcsubnet-e00example")
        gpu = offering.gpu if offering else ""
        extra["image"] = f.text("image_family", nebius_image_family(gpu))
    return SiteSpec(name, kind, **common, **extra)


def _region(f: Fields, kind: str) -> str:
    pattern, example = REGION_FORMATS[kind]
    region = f.text("region", example=example)
    if region and not pattern.fullmatch(region):
        f.problem("region", f'"{region}" is not a region name on {kind}; write it like {example}')
    return region


def _cidrs(f: Fields) -> tuple[str, ...]:
    cidrs = f.text_list("admin_cidrs")
    # Each block becomes firewall rules named after it: one block twice would be one name twice.
    seen: dict[ipaddress.IPv4Network | ipaddress.IPv6Network, int] = {}
    for index, cidr in enumerate(cidrs):
        try:
            network = ipaddress.ip_network(cidr)
        except ValueError:
            f.problem("admin_cidrs", f'"{cidr}" is not a CIDR block; write it like 198.51.100.0/24')
            continue
        if network in seen:
            first = seen[network]
            f.problem(
                f"admin_cidrs[{index}]",
                f'"{cidr}" is the block of admin_cidrs[{first}] ("{cidrs[first]}"); list each '
                "block once",
            )
        seen.setdefault(network, index)
    return cidrs
