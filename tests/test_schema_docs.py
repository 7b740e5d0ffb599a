"""docs/reference.md is generated from the components' schema, and kept in step with it."""

from denv_iac.core.schema_docs import render_reference, type_name

SCHEMA = {
    "resources": {
        "denv:index:WarmPool": {
            "description": "A recipe placed onto sites.",
            "inputProperties": {
                "recipe": {"type": "string", "description": "The recipe's name."},
                "replicas": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": {"$ref": "pulumi.json#/Any"},
                    },
                },
            },
            "requiredInputs": ["recipe"],
            "properties": {"replicas": {"type": "array", "items": {"type": "string"}}},
        },
        "denv:index:Cluster": {"inputProperties": {}, "properties": {}},
    }
}


def test_types_read_as_a_person_writes_them() -> None:
    assert type_name({"type": "string"}) == "string"
    assert type_name({"type": "array", "items": {"type": "integer"}}) == "list[integer]"
    assert type_name({"type": "object", "additionalProperties": {"$ref": "pulumi.json#/Any"}}) == (
        "map[any]"
    )
    assert type_name({"$ref": "#/types/denv:index:Replica"}) == "denv:index:Replica"
    assert type_name({}) == "any"


def test_every_resource_input_and_output_is_a_row() -> None:
    page = render_reference(SCHEMA)
    assert page.index("## Cluster") < page.index("## WarmPool")  # token order
    assert "| `recipe` | `string` | yes | The recipe's name. |" in page
    assert "| `replicas` | `list[map[any]]` | no | - |" in page
    assert "| `replicas` | `list[string]` | - |" in page
    assert page.count("None.") == 2  # Cluster here has no inputs and no outputs
