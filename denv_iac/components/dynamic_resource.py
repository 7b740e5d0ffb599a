"""The base of this package's dynamic resources: it leaves the pickle module as it found it.

`pulumi.dynamic` serializes each resource's provider with dill, after patching the pure-Python
pickler (`pickle._Pickler`) to write dicts sorted. It never undoes two of those patches, and one
of them wraps the previous one: every dynamic resource a program registers adds a stack frame to
each later pickling of a dict. About a thousand registrations in one process (a NodeSetup per
machine of a large fleet, or a long test session) end in `RecursionError` (pulumi 3.x; reported
upstream as pulumi/pulumi#17803). Restoring the two methods after each registration keeps the
depth constant; each serialization still patches them for itself, so it stays deterministic.
"""

import pickle
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pulumi
import pulumi.dynamic as dynamic

# The methods `pulumi.dynamic.serialize_provider` replaces on the class and leaves replaced.
_PATCHED = ("_batch_setitems", "save_dict")


@contextmanager
def pickler_restored() -> Iterator[None]:
    """Put back the pure-Python pickler's methods that the block replaced."""
    pickler: Any = pickle._Pickler
    saved = {name: pickler.__dict__[name] for name in _PATCHED}
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(pickler, name, method)


class DynamicResource(dynamic.Resource):
    """A `pulumi.dynamic.Resource` whose registration leaves no patch behind in `pickle`."""

    def __init__(
        self,
        provider: dynamic.ResourceProvider,
        name: str,
        props: dict[str, Any],
        opts: pulumi.ResourceOptions | None = None,
    ) -> None:
        with pickler_restored():
            super().__init__(provider, name, props, opts)


def whole_numbers(value: Any) -> Any:
    """Inputs or state as the engine hands them to a dynamic provider: every number a float, so
    whole ones are ints again, in mappings and lists at any depth."""
    if isinstance(value, Mapping):
        return {key: whole_numbers(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [whole_numbers(item) for item in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
