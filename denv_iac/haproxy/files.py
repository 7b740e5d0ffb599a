"""Put a rendered config and its map files on disk."""

from __future__ import annotations

from pathlib import Path

from denv_iac.core.balancer.files import CONFIG_FILE_NAME
from denv_iac.core.balancer.model import RenderedConfig


def write_config(rendered: RenderedConfig, directory: Path) -> Path:
    """Write haproxy.cfg and the map files into `directory`; returns the config's path.

    The map files land next to the config, so `directory` should be the map_dir rendered with
    (see denv_iac.core.balancer.files.relocate_maps).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in sorted(rendered.files.items()):
        (directory / name).write_text(content)
    config_path = directory / CONFIG_FILE_NAME
    config_path.write_text(rendered.haproxy_cfg)
    return config_path
