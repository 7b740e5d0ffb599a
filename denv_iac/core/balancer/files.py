"""Where a rendered config's files go: the config's file name, its maps read from elsewhere.

Pure: denv_iac/haproxy/files.py writes them.
"""

from __future__ import annotations

import dataclasses
import posixpath

from denv_iac.core.balancer.model import RenderedConfig

CONFIG_FILE_NAME = "haproxy.cfg"


def relocate_maps(rendered: RenderedConfig, map_dir: str) -> RenderedConfig:
    """The same config reading its map files from `map_dir` instead."""
    config = rendered.haproxy_cfg
    for name in sorted(rendered.files):
        old = posixpath.join(rendered.map_dir, name)
        config = config.replace(f"({old})", f"({posixpath.join(map_dir, name)})")
    return dataclasses.replace(rendered, haproxy_cfg=config, map_dir=map_dir)
