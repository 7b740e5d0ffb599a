"""The GPU and provider-offering catalog shipped with the package (data/catalog.json)."""

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

PROVIDERS = ("aws", "lambda", "nebius", "hetzner")


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_gb: int
    mig_profiles: dict[str, int]  # profile -> instances per GPU; empty when the GPU has no MIG

    @property
    def has_mig(self) -> bool:
        return bool(self.mig_profiles)


@dataclass(frozen=True)
class Offering:
    provider: str
    name: str  # instance type, Nebius "platform/preset", or Hetzner server model
    gpu: str
    gpu_count: int
    usd_per_gpu_hour: float
    price_read: str  # ISO date the list price was read

    @property
    def usd_per_hour(self) -> float:
        return self.usd_per_gpu_hour * self.gpu_count


@dataclass(frozen=True)
class Catalog:
    gpus: dict[str, GpuModel]
    offerings: dict[str, dict[str, Offering]]  # provider -> name -> offering

    def gpu(self, name: str) -> GpuModel | None:
        return self.gpus.get(name)

    def offering(self, provider: str, name: str) -> Offering | None:
        return self.offerings.get(provider, {}).get(name)

    def gpu_names(self) -> str:
        return ", ".join(sorted(self.gpus))

    def offering_names(self, provider: str) -> str:
        return ", ".join(sorted(self.offerings.get(provider, {})))


def parse_catalog(raw: dict[str, Any]) -> Catalog:
    gpus = {
        name: GpuModel(name, int(g["memory_gb"]), {p: int(n) for p, n in g["mig"].items()})
        for name, g in raw["gpus"].items()
    }
    offerings: dict[str, dict[str, Offering]] = {}
    for provider, entries in raw["offerings"].items():
        offerings[provider] = {}
        for name, o in entries.items():
            if o["gpu"] not in gpus:
                raise ValueError(
                    f"catalog: offering {provider}/{name} names unknown GPU {o['gpu']}"
                )
            offerings[provider][name] = Offering(
                provider,
                name,
                o["gpu"],
                int(o["count"]),
                float(o["usd_per_gpu_hour"]),
                o["price_read"],
            )
    return Catalog(gpus, offerings)


@cache
def load_catalog() -> Catalog:
    text = resources.files("denv_iac").joinpath("data/catalog.json").read_text(encoding="utf-8")
    return parse_catalog(json.loads(text))
