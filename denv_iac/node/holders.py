"""What keeps NVML and the GPU devices open, by unit name: the one place these names are set.

A GPU reset (`nvidia-smi -r`), unloading the kernel modules and a MIG mode change all fail
while any process holds the device; these daemons do, for as long as they run.
"""

from __future__ import annotations

AGENT = "denv-agent.service"  # the node agent polls NVML (agent.py writes its unit)
PERSISTENCED = "nvidia-persistenced.service"
FABRICMANAGER = "nvidia-fabricmanager.service"
# DCGM's host engine: `nvidia-dcgm` since DCGM 2 (datacenter-gpu-manager), `dcgm` before.
DCGM = ("nvidia-dcgm.service", "dcgm.service")
DCGM_EXPORTER = "dcgm-exporter.service"
