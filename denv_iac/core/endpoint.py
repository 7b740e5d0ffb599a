"""The one endpoint as the stack asks for it: HAProxy's settings and the URL clients call.

Every runner of the balancer starts from `balancer_settings`: the Pulumi components, the
offline checks and the local runner (which changes only where it listens and keeps its files).
"""

from dataclasses import asdict

from denv_iac.core.balancer.model import (
    CLIENT_SECRET_KEY_PATH,
    GATEWAY_CA_PATH,
    GATEWAY_CLIENT_PATH,
    TLS_CERT_PATH,
    BalancerSettings,
)
from denv_iac.core.stack.exposure import metrics_on_loopback
from denv_iac.core.stack.gateway_link import gateway_tls_on
from denv_iac.core.stack.model import StackSpec

_DEFAULT_PORT = {"http": 80, "https": 443}
LOOPBACK = "127.0.0.1"


def balancer_settings(stack: StackSpec) -> BalancerSettings:
    """The settings of the config every balancer host serves, timers included."""
    spec = stack.balancer
    gateway_tls = gateway_tls_on(stack)
    return BalancerSettings(
        port=spec.port,
        **asdict(spec.timers),  # BalancerSettings names each timer as the stack does
        tls_cert_path=TLS_CERT_PATH if spec.tls_certificate else None,
        client_secret_key_file=CLIENT_SECRET_KEY_PATH if spec.client_secret_key else None,
        api_key_digests=spec.api_key_digests,
        key_scopes=spec.key_scopes,
        prometheus_port=spec.prometheus_port,
        prometheus_address=LOOPBACK if metrics_on_loopback(stack) else None,
        gateway_ca_file=GATEWAY_CA_PATH if gateway_tls else None,
        gateway_client_cert=GATEWAY_CLIENT_PATH if gateway_tls else None,
    )


def endpoint_url(stack: StackSpec, host: str) -> str:
    """The URL clients call: the DNS name when the stack has one, else the first host."""
    spec = stack.balancer
    scheme = "https" if spec.tls_certificate else "http"
    name = spec.dns.name if spec.dns else host
    port = "" if _DEFAULT_PORT[scheme] == spec.port else f":{spec.port}"
    return f"{scheme}://{name}{port}"
