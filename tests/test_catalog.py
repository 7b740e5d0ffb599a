"""The shipped catalog: consistent, every AWS instance type one EC2 really has, and every Hetzner
Cloud server type one the API still offers where it is named."""

import gzip
import json
import re
from datetime import date
from pathlib import Path

import botocore
import pytest

from denv_iac.core.stack.catalog import PROVIDERS, load_catalog, parse_catalog, parse_server_types
from denv_iac.core.stack.site_reader import HETZNER_LOCATIONS


def ec2_instance_types() -> set[str]:
    models = sorted((Path(botocore.__file__).parent / "data" / "ec2").glob("*/service-2.json*"))
    newest = models[-1]
    raw = gzip.decompress(newest.read_bytes()) if newest.suffix == ".gz" else newest.read_bytes()
    return set(json.loads(raw)["shapes"]["InstanceType"]["enum"])


def test_every_aws_offering_is_a_real_instance_type() -> None:
    known = ec2_instance_types()
    offered = set(load_catalog().offerings["aws"])
    assert offered, "the catalog lists no AWS offerings"
    assert offered - known == set()


def test_required_families_are_present() -> None:
    families = {name.split(".")[0] for name in load_catalog().offerings["aws"]}
    assert families >= {"p5", "p5e", "p5en", "p4d", "p4de", "p6-b200", "g6e", "g6", "g5"}


def test_offerings_are_priced_dated_and_name_known_gpus() -> None:
    catalog = load_catalog()
    assert set(catalog.offerings) == set(PROVIDERS)
    for provider, offerings in catalog.offerings.items():
        for offering in offerings.values():
            assert offering.gpu in catalog.gpus, (provider, offering.name)
            assert offering.gpu_count >= 1 and offering.usd_per_gpu_hour > 0
            date.fromisoformat(offering.price_read)
            assert offering.source.strip(), (provider, offering.name)


@pytest.mark.parametrize(
    ("gpu", "profile", "count"),
    [
        ("H100", "1g.10gb", 7),
        ("H100", "7g.80gb", 1),
        ("A100-40GB", "1g.5gb", 7),
        ("H200", "3g.71gb", 2),
        ("A30", "2g.12gb", 2),
        ("B200", "1g.45gb", 4),
        ("H200-NVL", "1g.18gb", 7),
        ("H200-NVL", "3g.71gb", 2),
        ("B300", "1g.34gb", 7),
        ("B300", "2g.67gb", 3),
        ("B300", "7g.269gb", 1),
    ],
)
def test_mig_profiles(gpu: str, profile: str, count: int) -> None:
    assert load_catalog().gpus[gpu].mig_profiles[profile] == count


def test_every_mig_profile_fits_its_gpu() -> None:
    """A profile `<c>g.<m>gb` takes c of 7 compute slices and m GB: neither can exceed the GPU,
    and as many instances as the count says must fit its 7 slices."""
    for gpu in load_catalog().gpus.values():
        for profile, count in gpu.mig_profiles.items():
            match = re.fullmatch(r"(\d)g\.(\d+)gb", profile)
            assert match, (gpu.name, profile)
            compute, memory = int(match[1]), int(match[2])
            assert memory <= gpu.memory_gb and compute * count <= 7, (gpu.name, profile)


@pytest.mark.parametrize(
    "gpu",
    [
        "L4",
        "L40S",
        "A10G",
        "RTX-4000-SFF-ADA",
        "RTX-6000-ADA",
        "RTX-PRO-4000-SFF-BLACKWELL",
        "RTX-PRO-6000-BLACKWELL-MAXQ",
    ],
)
def test_gpus_without_mig(gpu: str) -> None:
    assert not load_catalog().gpus[gpu].has_mig


def test_an_offering_naming_an_unknown_gpu_is_rejected() -> None:
    raw = {
        "gpus": {},
        "offerings": {
            "aws": {
                "x.large": {
                    "gpu": "Z1",
                    "count": 1,
                    "usd_per_gpu_hour": 1,
                    "price_read": "2026-01-01",
                    "source": "https://example.test/prices",
                }
            }
        },
    }
    with pytest.raises(ValueError, match="unknown GPU Z1"):
        parse_catalog(raw)


PRICED = {"gpu": "L4", "count": 1, "usd_per_gpu_hour": 0.8}


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (
            {**PRICED, "source": "https://example.test"},
            "aws/g6.xlarge has no price_read; give the ISO",
        ),
        ({**PRICED, "price_read": "2026-01-01"}, "aws/g6.xlarge has no source; give the page"),
        ({**PRICED, "price_read": "2026-01-01", "source": " "}, "aws/g6.xlarge has no source"),
        ({**PRICED, "price_read": "", "source": "https://example.test"}, "has no price_read"),
    ],
)
def test_an_offering_without_its_price_date_or_source_is_rejected_by_name(
    entry: dict[str, object], error: str
) -> None:
    raw = {"gpus": {"L4": {"memory_gb": 24, "mig": {}}}, "offerings": {"aws": {"g6.xlarge": entry}}}
    with pytest.raises(ValueError, match=error):
        parse_catalog(raw)


def test_hcloud_server_types_are_dated_sourced_and_none_is_removed() -> None:
    types = load_catalog().hcloud_types
    assert types.read and types.source
    assert {"cpx21", "cx22"} <= set(types.removed)
    assert set(types.types) & set(types.removed) == set()


def test_every_hetzner_location_offers_some_server_type_and_only_known_locations_are_named() -> (
    None
):
    types = load_catalog().hcloud_types
    named = {loc for t in types.types.values() for loc in t.locations}
    assert named == set(HETZNER_LOCATIONS)


@pytest.mark.parametrize(
    ("preference", "location", "picked"),
    [
        (("cpx22", "ccx13"), "fsn1", "cpx22"),
        (("cpx22", "ccx13"), "sin", "cpx22"),
        (("cpx22", "ccx13"), "ash", "ccx13"),
        (("cx23",), "hel1", "cx23"),
    ],
)
def test_pick_takes_the_first_type_the_location_offers(
    preference: tuple[str, ...], location: str, picked: str
) -> None:
    assert load_catalog().hcloud_types.pick(preference, location) == picked


def test_pick_says_what_the_location_offers_when_nothing_preferred_is() -> None:
    with pytest.raises(ValueError, match=r"cx23 is offered in ash .*offered there: .*ccx13"):
        load_catalog().hcloud_types.pick(("cx23",), "ash")


def test_a_server_type_both_listed_and_removed_is_rejected() -> None:
    raw = {
        "removed": ["cpx21"],
        "types": {"cpx21": {"vcpus": 3, "memory_gb": 4, "dedicated": False, "locations": ["ash"]}},
    }
    with pytest.raises(ValueError, match="cpx21 is listed and also removed"):
        parse_server_types(raw)
