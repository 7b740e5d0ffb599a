"""Put a rendered config and its map files on disk."""

from __future__ import annotations

import dataclasses
import posixpath
from pathlib import Path

from denv_iac.balancer.model import RenderedConfig

CONFIG_FILE_NAME = "haproxy.cfg"


def relocate_maps(rendered: RenderedConfig, map_dir: str) -> RenderedConfig:
    """The same config reading its map files from `map_dir` instead."""
    config = rendered.haproxy_cfg
    for name in sorted(rendered.files):
        old = posixpath.join(rendered.map_dir, name)
        config = config.replace(f"({old})", f"({posixpath.join(map_dir, name)})")
    return dataclasses.replace(rendered, haproxy_cfg=config, map_dir=map_dir)


def write_config(rendered: RenderedConfig, directory: Path) -> Path:
    """Write haproxy.cfg and the map files into `directory`; returns the config's path.

    The map files land next to the config, so `directory` should be the map_dir rendered with
    (see relocate_maps).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in sorted(rendered.files.items()):
        (directory / name).write_text(content)
    config_path = directory / CONFIG_FILE_NAME
    config_path.write_text(rendered.haproxy_cfg)
    return config_path
