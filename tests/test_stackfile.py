"""The stack file's and the placement lock's formats, pure: text in, a value or one line out."""

import pytest

from denv_iac.core.stack.reader import StackError
from denv_iac.core.stack.stackfile import parse_lock, render_lock, stack_config

LOCK = "Pulumi.s.placement.json"
NOT_A_LOCK = f"{LOCK}: not a placement lock; delete it and run `denv plan --lock` again"


def test_a_lock_reads_back_the_ids_it_was_written_with_sorted() -> None:
    text = render_lock(["voice.b.n0.0", "voice.a.n1.0"])
    assert text == '{\n  "replicas": [\n    "voice.a.n1.0",\n    "voice.b.n0.0"\n  ]\n}\n'
    assert parse_lock(text, LOCK) == ["voice.a.n1.0", "voice.b.n0.0"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        '{"ids": []}',
        '{"replicas": "voice.a.n0.0"}',
        '{"replicas": [1]}',
        b'\xff\xfe{"replicas": []}',  # not UTF-8 (a file saved as UTF-16)
    ],
)
def test_what_is_not_a_lock_is_refused_in_one_line(text: str | bytes) -> None:
    with pytest.raises(StackError) as error:
        parse_lock(text, LOCK)
    assert error.value.problems == [NOT_A_LOCK]


@pytest.mark.parametrize(
    ("document", "config"),
    [
        (None, {}),
        ({}, {}),
        ({"config": {"denv:sites": []}}, {"denv:sites": []}),
        ({"encryptionsalt": "x", "config": {}}, {}),
    ],
)
def test_a_stack_files_config_is_its_config_mapping(document: object, config: object) -> None:
    assert stack_config(document, "Pulumi.s.yaml") == config


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ([1], "Pulumi.s.yaml: expected a mapping with a config: key"),
        ("text", "Pulumi.s.yaml: expected a mapping with a config: key"),
        ({"config": [1]}, "Pulumi.s.yaml: config: must be a mapping of keys to values"),
    ],
)
def test_a_stack_file_of_another_shape_is_refused_in_one_line(
    document: object, problem: str
) -> None:
    with pytest.raises(StackError) as error:
        stack_config(document, "Pulumi.s.yaml")
    assert error.value.problems == [problem]
