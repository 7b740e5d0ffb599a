"""The gateway CA resource's provider, called as the engine calls it: create, diff, update."""

from typing import Any

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from denv_iac.components.gateway_tls import SECRET_OUTPUTS, GatewayTlsProvider
from denv_iac.core.stack.gateway_link import gateway_tls_name


def _certificate(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def _issued_by(pem: str, ca: str) -> bool:
    try:
        _certificate(pem).verify_directly_issued_by(_certificate(ca))
    except (ValueError, TypeError):
        return False
    return True


def _create(sites: list[str]) -> dict[str, Any]:
    result = GatewayTlsProvider().create({"stack": "prod", "sites": sites})
    assert result.outs is not None and result.id == "prod.gateway-tls"
    return dict(result.outs)


def test_create_makes_a_ca_that_signs_one_server_certificate_per_site_and_the_client() -> None:
    outs = _create(["k8s-a", "k8s-b"])
    ca = outs["ca_certificate"]
    assert _certificate(ca).extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert sorted(outs["gateway_pems"]) == ["k8s-a", "k8s-b"]
    for site, pem in outs["gateway_pems"].items():
        assert _issued_by(pem, ca) and "PRIVATE KEY" in pem
        names = _certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
        assert names.value.get_values_for_type(x509.DNSName) == [gateway_tls_name(site)]
        usage = _certificate(pem).extensions.get_extension_for_class(x509.ExtendedKeyUsage)
        assert list(usage.value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    client = outs["client_pem"]
    assert _issued_by(client, ca) and "PRIVATE KEY" in client
    usage = _certificate(client).extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert list(usage.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # Every output holding a key is one the resource declares secret.
    holding_keys = {k for k, v in outs.items() if "PRIVATE KEY" in str(v)}
    assert holding_keys == set(SECRET_OUTPUTS)


def test_a_site_added_is_an_update_that_leaves_the_ca_the_client_and_other_sites_alone() -> None:
    olds = _create(["k8s-a"])
    news = {"stack": "prod", "sites": ["k8s-a", "k8s-b"]}
    diff = GatewayTlsProvider().diff("prod.gateway-tls", olds, news)
    assert diff.changes and not diff.replaces
    outs = GatewayTlsProvider().update("prod.gateway-tls", olds, news).outs
    assert outs is not None
    for key in ("ca_certificate", "ca_key", "client_pem"):
        assert outs[key] == olds[key]
    assert outs["gateway_pems"]["k8s-a"] == olds["gateway_pems"]["k8s-a"]
    assert _issued_by(outs["gateway_pems"]["k8s-b"], olds["ca_certificate"])
    removed = GatewayTlsProvider().update("prod.gateway-tls", outs, {**news, "sites": ["k8s-b"]})
    assert removed.outs is not None and list(removed.outs["gateway_pems"]) == ["k8s-b"]


def test_the_same_sites_are_no_change_and_another_stack_a_new_ca() -> None:
    olds = _create(["k8s-a"])
    same = GatewayTlsProvider().diff(
        "prod.gateway-tls", olds, {"stack": "prod", "sites": ["k8s-a"]}
    )
    assert not same.changes
    other = GatewayTlsProvider().diff(
        "prod.gateway-tls", olds, {"stack": "dev", "sites": ["k8s-a"]}
    )
    assert other.changes and other.replaces == ["stack"]
