"""The one endpoint: HAProxy config rendered from placed pools, and its check."""

from denv_iac.balancer.check import HaproxyConfigCheckError, check_haproxy_config
from denv_iac.balancer.haproxy import render_haproxy_config
from denv_iac.balancer.model import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    RenderedConfig,
)
from denv_iac.balancer.validation import BalancerConfigError
from denv_iac.spec.model import KeyScope

__all__ = [
    "BalancerConfigError",
    "BalancerPool",
    "BalancerServer",
    "BalancerSettings",
    "BalancerTier",
    "HaproxyConfigCheckError",
    "KeyScope",
    "RenderedConfig",
    "check_haproxy_config",
    "render_haproxy_config",
]
