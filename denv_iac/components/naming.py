"""Stable names, AWS tags and hcloud labels for everything the components create.

Names and tags are derived only from the stack, site, node and role, never from a time or a
random value, so that two runs of the same stack register identical inputs.
"""

import re
from collections.abc import Mapping
from typing import cast

import pulumi

from denv_iac.core.stack.values import machine_name

MANAGED_BY = "denv"
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]")


def child_name(parent: str, *parts: str) -> str:
    """A child resource's name: its parent component's name and what it is, dash-joined."""
    return "-".join((parent, *parts))


def aws_tags(stack: str, site: str, role: str, node: str = "") -> dict[str, str]:
    tags = {
        "denv:managed-by": MANAGED_BY,
        "denv:role": role,
        "denv:site": site,
        "denv:stack": stack,
    }
    if node:
        tags["Name"] = machine_name(stack, site, node)
        tags["denv:node"] = node
    return dict(sorted(tags.items()))


def hcloud_labels(stack: str, site: str, role: str) -> dict[str, str]:
    """hcloud label values allow only letters, digits, '-', '_' and '.' (63 characters)."""
    labels = {"denv-managed-by": MANAGED_BY, "denv-role": role, "denv-site": site}
    labels["denv-stack"] = stack
    return {key: _LABEL_VALUE.sub("-", value)[:63] for key, value in sorted(labels.items())}


# Nebius labels follow the same rules as hcloud's.
nebius_labels = hcloud_labels


def resolved(addresses: Mapping[str, pulumi.Input[str]]) -> pulumi.Output[dict[str, str]]:
    """One Output holding a mapping whose values may each be Outputs."""
    ordered: dict[str, pulumi.Input[str]] = {name: addresses[name] for name in sorted(addresses)}
    # from_input resolves Outputs nested in a mapping; its annotation cannot say so.
    return cast(pulumi.Output[dict[str, str]], pulumi.Output.from_input(ordered))
