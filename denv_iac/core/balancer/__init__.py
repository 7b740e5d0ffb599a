"""The one endpoint: HAProxy config rendered from placed pools (checked and run by
denv_iac/haproxy/)."""

from denv_iac.core.balancer.haproxy import render_haproxy_config
from denv_iac.core.balancer.model import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    RenderedConfig,
)
from denv_iac.core.balancer.validation import BalancerConfigError
from denv_iac.core.stack.model import KeyScope

__all__ = [
    "BalancerConfigError",
    "BalancerPool",
    "BalancerServer",
    "BalancerSettings",
    "BalancerTier",
    "KeyScope",
    "RenderedConfig",
    "render_haproxy_config",
]
