"""Mutual TLS between the balancer and Kubernetes gateways: a private CA per stack, as a resource.

A `pulumi.dynamic` resource makes, on create, the stack's own CA, the balancer's client
certificate and one server certificate per Kubernetes site's gateway (named
`spec.gateway_link.gateway_tls_name`), all ECDSA P-256. Every private key is a secret output from
the first registration (`additional_secret_outputs`), so no preview, log or snapshot shows one;
the certificates are plain. A site added or removed is an update that issues or drops only that
site's certificate: the CA and the client certificate stay, so nothing else changes. Rotating
everything is replacing the resource (`pulumi up --replace <urn>`).

The gateway accepts a client only with a certificate of this CA for client authentication, and
the balancer accepts a gateway only with a certificate of this CA for server authentication and
the site's name: a gateway's key, taken from one cluster, can neither pass for the balancer nor
for another site's gateway.
"""

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi.dynamic
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from denv_iac.components.dynamic_resource import DynamicResource
from denv_iac.core.stack.gateway_link import gateway_tls_name

# Replaced, not renewed: long enough that no stack meets the end of it.
VALID_FOR = datetime.timedelta(days=3650)
CLIENT_NAME = "denv-balancer"
SECRET_OUTPUTS = ["ca_key", "client_pem", "gateway_pems"]


@dataclass(frozen=True)
class Authority:
    """The stack's CA: its certificate (PEM) and private key (PEM, a secret)."""

    certificate: str
    key: str


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode("ascii")


def _cert_pem(certificate: x509.Certificate) -> str:
    return certificate.public_bytes(serialization.Encoding.PEM).decode("ascii")


def _builder(subject: str, issuer: x509.Name, public: Any) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little behind
        .not_valid_after(now + VALID_FOR)
    )


def new_authority(stack: str) -> Authority:
    """A CA that signs only end certificates (path length 0)."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"denv {stack} gateway CA")])
    certificate = (
        _builder(f"denv {stack} gateway CA", name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Authority(_cert_pem(certificate), _key_pem(key))


def issue(authority: Authority, name: str, server: bool) -> str:
    """A certificate for `name` and its key, in one PEM as HAProxy's `crt` reads it.

    A server certificate names `name` as its DNS name and serves only server authentication; a
    client certificate serves only client authentication.
    """
    ca_key = serialization.load_pem_private_key(authority.key.encode(), None)
    ca = x509.load_pem_x509_certificate(authority.certificate.encode())
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the gateway CA's key is not an EC key")
    key = _key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(name, ca.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), False)
    certificate = builder.sign(ca_key, hashes.SHA256())
    return _cert_pem(certificate) + _key_pem(key)


def gateway_pems(
    authority: Authority, sites: Sequence[str], kept: Mapping[str, str]
) -> dict[str, str]:
    """Each site's gateway certificate and key: the one in `kept` if any, else a new one."""
    return {
        site: kept.get(site) or issue(authority, gateway_tls_name(site), server=True)
        for site in sites
    }


class GatewayTlsProvider(pulumi.dynamic.ResourceProvider):
    """Create makes the CA and every certificate; a changed site list updates only its own."""

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        stack, sites = str(props["stack"]), [str(s) for s in props["sites"]]
        authority = new_authority(stack)
        outs = {
            "stack": stack,
            "sites": sites,
            "ca_certificate": authority.certificate,
            "ca_key": authority.key,
            "client_pem": issue(authority, CLIENT_NAME, server=False),
            "gateway_pems": gateway_pems(authority, sites, {}),
        }
        return pulumi.dynamic.CreateResult(id_=f"{stack}.gateway-tls", outs=outs)

    def diff(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.DiffResult:
        replaces = ["stack"] if olds.get("stack") != news.get("stack") else []
        changed = bool(replaces) or list(olds.get("sites") or []) != list(news["sites"])
        return pulumi.dynamic.DiffResult(
            changes=changed, replaces=replaces, delete_before_replace=False
        )

    def update(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.UpdateResult:
        authority = Authority(str(olds["ca_certificate"]), str(olds["ca_key"]))
        sites = [str(s) for s in news["sites"]]
        kept = {str(k): str(v) for k, v in (olds.get("gateway_pems") or {}).items()}
        outs = {key: olds[key] for key in ("stack", "ca_certificate", "ca_key", "client_pem")} | {
            "sites": sites,
            "gateway_pems": gateway_pems(authority, sites, kept),
        }
        return pulumi.dynamic.UpdateResult(outs=outs)


class GatewayTls(DynamicResource, module="denv", name="GatewayTls"):
    """The stack's gateway CA and certificates; every private key a secret output."""

    ca_certificate: pulumi.Output[str]
    client_pem: pulumi.Output[str]
    """The balancer's client certificate and key, one PEM (secret)."""
    gateway_pems: pulumi.Output[dict[str, str]]
    """Each Kubernetes site's gateway certificate and key, one PEM each, by site (secret)."""

    def __init__(
        self,
        name: str,
        stack: str,
        sites: Sequence[str],
        opts: pulumi.ResourceOptions,
        provider: GatewayTlsProvider | None = None,
    ) -> None:
        # The keys' slots are secrets from the start, so a preview shows them masked.
        props: dict[str, Any] = {
            "stack": stack,
            "sites": list(sites),
            "ca_certificate": None,
            **{key: pulumi.Output.secret(None) for key in SECRET_OUTPUTS},
        }
        secret = pulumi.ResourceOptions(additional_secret_outputs=SECRET_OUTPUTS)
        super().__init__(
            provider or GatewayTlsProvider(),
            name,
            props,
            pulumi.ResourceOptions.merge(opts, secret),
        )
