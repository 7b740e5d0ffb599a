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
    source: (
        str  # where it was read: the provider's price page or document, named so it can be re-read
    )

    @property
    def usd_per_hour(self) -> float:
        return self.usd_per_gpu_hour * self.gpu_count


@dataclass(frozen=True)
class ServerType:
    """A Hetzner Cloud server type that can be ordered, and the locations that offer it."""

    name: str
    vcpus: int
    memory_gb: int
    dedicated: bool
    locations: tuple[str, ...]


@dataclass(frozen=True)
class ServerTypes:
    """Hetzner Cloud server types as read on a date from a named source."""

    types: dict[str, ServerType]
    removed: tuple[str, ...] = ()  # names the API no longer accepts
    read: str = ""
    source: str = ""

    def offered_at(self, location: str) -> tuple[str, ...]:
        return tuple(name for name, t in self.types.items() if location in t.locations)

    def pick(self, preference: tuple[str, ...], location: str) -> str:
        """The first preferred type offered at location; a clear error when none is."""
        offered = self.offered_at(location)
        for name in preference:
            if name in offered:
                return name
        raise ValueError(
            f"no Hetzner Cloud server type of {', '.join(preference)} is offered in "
            f"{location} (catalog read {self.read}); offered there: "
            f"{', '.join(offered) or 'none'}; choose another location"
        )


@dataclass(frozen=True)
class Catalog:
    gpus: dict[str, GpuModel]
    offerings: dict[str, dict[str, Offering]]  # provider -> name -> offering
    hcloud_types: ServerTypes = ServerTypes({})

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
                _required(o, "price_read", provider, name),
                _required(o, "source", provider, name),
            )
    return Catalog(gpus, offerings, parse_server_types(raw.get("hcloud_server_types", {})))


def _required(entry: dict[str, Any], field: str, provider: str, name: str) -> str:
    """A list price is only as good as when and where it was read: both are required."""
    value = entry.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"catalog: offering {provider}/{name} has no {field}; give {_REQUIRED_HINTS[field]}"
        )
    return value


_REQUIRED_HINTS = {
    "price_read": "the ISO date its list price was read",
    "source": "the page or document its list price was read from",
}


def parse_server_types(raw: dict[str, Any]) -> ServerTypes:
    removed = tuple(raw.get("removed", ()))
    types: dict[str, ServerType] = {}
    for name, t in raw.get("types", {}).items():
        if name in removed:
            raise ValueError(f"catalog: hcloud server type {name} is listed and also removed")
        types[name] = ServerType(
            name, int(t["vcpus"]), int(t["memory_gb"]), bool(t["dedicated"]), tuple(t["locations"])
        )
    return ServerTypes(types, removed, raw.get("read", ""), raw.get("source", ""))


@cache
def load_catalog() -> Catalog:
    text = resources.files("denv_iac").joinpath("data/catalog.json").read_text(encoding="utf-8")
    return parse_catalog(json.loads(text))
