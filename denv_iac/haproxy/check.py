"""Ask the installed HAProxy whether a rendered config is valid (`haproxy -c`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from denv_iac.core.balancer.files import relocate_maps
from denv_iac.core.balancer.model import RenderedConfig
from denv_iac.haproxy.files import write_config

# Warnings about the machine the check runs on, not about the config: the server-state file is
# saved (`show servers state`) before each reload, so before the first one it is absent; replica
# host names resolve on the balancer's network, not necessarily on a build machine.
_MACHINE_WARNINGS = re.compile(r"global server state file|could not resolve address")


class HaproxyConfigCheckError(RuntimeError):
    """HAProxy rejected the config, or warned about it; the message is HAProxy's own."""


def check_haproxy_config(
    rendered: RenderedConfig, workdir: str | Path, haproxy_bin: str = "haproxy"
) -> None:
    """Write the config and its map files into `workdir` and run `haproxy -c` on them.

    The map files are placed in `workdir`, and the copy of the config checked there points at
    them, so a config meant for another machine's map directory can be checked here.
    Any warning fails the check too.
    """
    directory = Path(workdir)
    config_path = write_config(relocate_maps(rendered, str(directory)), directory)
    try:
        result = subprocess.run(
            [haproxy_bin, "-c", "-f", str(config_path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except FileNotFoundError:
        raise HaproxyConfigCheckError(
            f"{haproxy_bin!r} not found: install HAProxy 2.6 or newer (apt-get install haproxy)"
        ) from None
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if ("[ALERT]" in line or "[WARNING]" in line) and not _MACHINE_WARNINGS.search(line)
    ]
    if result.returncode != 0 or problems:
        raise HaproxyConfigCheckError(
            "\n".join(problems) or f"haproxy -c exited with status {result.returncode}"
        )
