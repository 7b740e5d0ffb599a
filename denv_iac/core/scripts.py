"""Programs shipped as files of the package (`denv_iac/data/scripts/`), not kept in strings: the
linters read them (`make lint`: shellcheck and ruff), and each is read here, the one place
their placeholders are filled."""

from __future__ import annotations

import re
from importlib import resources

# A placeholder in a script: @NAME@, upper-case letters, digits and underscores.
_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")


def script(name: str, **values: str) -> str:
    """The text of data/scripts/`name`, each @KEY@ replaced by `values[KEY]` (see `fill`)."""
    text = resources.files("denv_iac").joinpath("data", "scripts", name).read_text()
    return fill(name, text, values)


def fill(name: str, text: str, values: dict[str, str]) -> str:
    """`text` with each @KEY@ replaced by `values[KEY]`. Every placeholder must be given and
    every value used: a script never ships with one left open."""
    found = set(_PLACEHOLDER.findall(text))
    if found != set(values):
        raise ValueError(
            f"script {name}: placeholders {sorted(found)}, values given {sorted(values)}"
        )
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
