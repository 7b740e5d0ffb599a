"""What each kind of site means for its machines: node ids, SSH logins, where caches live."""

from denv_iac.core.stack.model import SiteSpec
from denv_iac.core.stack.values import lambda_name

# Sites that create their machines from a provider's image, with the site's SSH key. The
# image ships the NVIDIA driver (the deploy keeps a working one) and logs in as CLOUD_SSH_USER:
# the Deep Learning AMIs, Lambda's images, and the user cloud-init makes on Nebius nodes.
CLOUD_SITE_KINDS = ("aws", "lambda", "nebius")
CLOUD_SSH_USER = "ubuntu"
HCLOUD_SSH_USER = "root"  # Hetzner's images
# Where a site's persistent cache storage is mounted when the site does not say otherwise.
CACHE_MOUNT_POINT = "/var/cache/denv"
LAMBDA_NFS = "/lambda/nfs"  # Lambda mounts each filesystem at /lambda/nfs/<its name>


def node_id(site: str, node: str) -> str:
    return f"{site}.{node}"


def cache_file_system_name(stack: str, site: str) -> str:
    """The name of a Lambda site's cache filesystem; names are unique per Lambda account."""
    return lambda_name(stack, site, "cache")


def cache_mount_point(stack: str, site: str) -> str:
    """Where Lambda mounts the site's cache filesystem on every instance launched with it."""
    return f"{LAMBDA_NFS}/{cache_file_system_name(stack, site)}"


def cache_root(stack: str, site: SiteSpec) -> str | None:
    """Where the site's nodes have storage that outlives them; None: the node's own disk.

    AWS nodes mount their EBS volume there (see NodeSetup's `cache_device`), Nebius nodes the
    site's filesystem (cloud-init), and Lambda mounts the site's filesystem by its name.
    """
    if site.kind == "lambda":
        return cache_mount_point(stack, site.name)
    return CACHE_MOUNT_POINT if site.kind in CLOUD_SITE_KINDS else None


def node_ssh_user(site: SiteSpec, node: str) -> str:
    """Who the deploy logs in as on a GPU node of the site."""
    if site.kind in CLOUD_SITE_KINDS:
        return CLOUD_SSH_USER
    return next(n.ssh_user for n in site.nodes if n.name == node)


def balancer_ssh_user(site: SiteSpec) -> str:
    """Who the deploy logs in as on the site's balancer host (see BalancerHost)."""
    if site.kind == "aws":
        return CLOUD_SSH_USER
    if site.kind == "hetzner":
        return HCLOUD_SSH_USER
    return site.nodes[0].ssh_user
