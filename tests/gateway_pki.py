"""A stack's gateway CA and certificates on disk, for tests that run or check HAProxy configs."""

from dataclasses import dataclass
from pathlib import Path

from denv_iac.components.gateway_tls import CLIENT_NAME, Authority, issue, new_authority
from denv_iac.core.kube_manifests.gateway import GATEWAY_TLS_CA, GATEWAY_TLS_DIR, GATEWAY_TLS_PEM
from denv_iac.core.stack.gateway_link import gateway_tls_name


@dataclass(frozen=True)
class GatewayPki:
    authority: Authority
    folder: Path  # holds the gateway's files under their in-pod names, and the balancer's
    ca: Path
    gateway_pem: Path
    client_pem: Path


def write_pki(folder: Path, site: str) -> GatewayPki:
    """The CA, `site`'s gateway certificate (named as the balancer verifies it) and the client's."""
    folder.mkdir(parents=True, exist_ok=True)
    authority = new_authority("test")
    ca = folder / GATEWAY_TLS_CA
    ca.write_text(authority.certificate)
    gateway_pem = folder / GATEWAY_TLS_PEM
    gateway_pem.write_text(issue(authority, gateway_tls_name(site), server=True))
    client_pem = folder / "client.pem"
    client_pem.write_text(issue(authority, CLIENT_NAME, server=False))
    return GatewayPki(authority, folder, ca, gateway_pem, client_pem)


def reading_tls_from(config: str, folder: Path) -> str:
    """A gateway config that reads its certificate and CA from `folder` instead of the pod's."""
    return config.replace(f"{GATEWAY_TLS_DIR}/", f"{folder}/")
