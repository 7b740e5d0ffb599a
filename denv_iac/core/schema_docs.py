"""docs/reference.md from the components' Pulumi schema: every input and output, as a table.

The schema is what other languages see, so documenting from it keeps the reference true to the
multi-language package: `python -m denv_iac.cli.schema_docs components/schema.json` (which
reads the file; this module is pure).
"""

from collections.abc import Mapping
from typing import Any

HEADER = (
    "# Component reference\n\n"
    "Generated from `components/schema.json` by `python -m denv_iac.cli.schema_docs "
    "components/schema.json > docs/reference.md`; do not edit by hand. How the components fit "
    "together: [components.md](components.md); the keys inside `sites`, `recipes` and "
    "`balancer`: [stacks.md](stacks.md).\n"
)


def type_name(prop: Mapping[str, Any]) -> str:
    """A schema property's type as a reader writes it: `list[string]`, `map[any]`, a ref name."""
    ref = prop.get("$ref")
    if ref is not None:
        return "any" if ref == "pulumi.json#/Any" else str(ref).rsplit("/", 1)[-1]
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list[{type_name(prop.get('items', {}))}]"
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"map[{type_name(values)}]" if values is not None else "object"
    return str(kind)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip() or "-"


def _table(props: Mapping[str, Any], required: set[str] | None) -> list[str]:
    """Rows of name, type, (required, when inputs) and description."""
    if not props:
        return ["None.", ""]
    columns = ["name", "type", *(["required"] if required is not None else []), "description"]
    rows = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for name in sorted(props):
        prop = props[name]
        cells = [f"`{name}`", f"`{type_name(prop)}`"]
        if required is not None:
            cells.append("yes" if name in required else "no")
        cells.append(_cell(str(prop.get("description", ""))))
        rows.append("| " + " | ".join(cells) + " |")
    return [*rows, ""]


def render_reference(schema: Mapping[str, Any]) -> str:
    """The whole reference page, resources in token order."""
    lines = [HEADER]
    for token in sorted(schema.get("resources", {})):
        resource = schema["resources"][token]
        lines += [f"## {token.rsplit(':', 1)[-1]}", "", f"Type token `{token}`.", ""]
        if resource.get("description"):
            lines += [resource["description"].strip(), ""]
        required = set(resource.get("requiredInputs", ()))
        lines += ["### Inputs", "", *_table(resource.get("inputProperties", {}), required)]
        lines += ["### Outputs", "", *_table(resource.get("properties", {}), None)]
    return "\n".join(lines).rstrip() + "\n"
