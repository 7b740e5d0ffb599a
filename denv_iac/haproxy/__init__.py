"""The installed HAProxy on this machine: a config written to disk, checked with `haproxy -c`,
run master-worker, and read through its stats socket. The config itself is rendered by the pure
core (denv_iac/core/balancer/)."""

from denv_iac.haproxy.check import HaproxyConfigCheckError, check_haproxy_config
from denv_iac.haproxy.files import write_config
from denv_iac.haproxy.runtime import (
    HaproxyProcess,
    HaproxyStartError,
    server_stats,
    stats_command,
    stats_rows,
)

__all__ = [
    "HaproxyConfigCheckError",
    "HaproxyProcess",
    "HaproxyStartError",
    "check_haproxy_config",
    "server_stats",
    "stats_command",
    "stats_rows",
    "write_config",
]
