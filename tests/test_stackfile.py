"""The stack file's and the placement lock's formats, pure: text in, a value or one line out."""

import pytest

from denv_iac.core.stack.reader import StackError
from denv_iac.core.stack.stackfile import parse_lock, render_lock, stack_config

LOCK = "Pulumi.s.placement.json"
FIX = "delete it and run `denv plan --lock` again"


def test_a_lock_reads_back_the_ids_it_was_written_with_sorted() -> None:
    text = render_lock(["voice.b.n0.0", "voice.a.n1.0"])
    assert text == '{\n  "replicas": [\n    "voice.a.n1.0",\n    "voice.b.n0.0"\n  ]\n}\n'
    assert parse_lock(text.encode(), LOCK) == ["voice.a.n1.0", "voice.b.n0.0"]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"", "line 1 column 1: not JSON (Expecting value)"),
        (b"not json", "line 1 column 1: not JSON (Expecting value)"),
        (b'{"replicas": [\n  "a",\n  "b"\n', "line 4 column 1: not JSON (Expecting ',' delimiter)"),
        (b'\xff\xfe{"replicas": []}', ": byte 0xff at offset 0 is not UTF-8"),  # saved as UTF-16
        (b'{"replicas": ["caf\xe9"]}', ": byte 0xe9 at offset 18 is not UTF-8"),
        (b"[" * 100_000, ": nested too deeply to be one denv writes"),
        (b"1" * 5000, ": holds a number too long to read"),
        (b"[]", ': a list, not a placement lock (an object with "replicas")'),
        (b"null", ': empty, not a placement lock (an object with "replicas")'),
        (b'{"ids": []}', ': no "replicas" key, so not a placement lock'),
        (b'{"replicas": "voice.a.n0.0"}', ": replicas is a string, not a list of replica ids"),
        (b'{"replicas": {"a": 1}}', ": replicas is a mapping, not a list of replica ids"),
        (b'{"replicas": ["a", 1]}', ": replicas[1] is a number, not a replica id"),
        (b'{"replicas": [["a"]]}', ": replicas[0] is a list, not a replica id"),
        (
            b'{"replicas": ["a", "b", "a"]}',
            ': replicas[2] "a" is listed twice (first as replicas[0])',
        ),
        (
            b'{"replicas": ["a\\nb", "a\\nb"]}',
            ': replicas[1] "a\\nb" is listed twice (first as replicas[0])',
        ),
    ],
)
def test_what_is_not_a_lock_is_refused_in_one_line(data: bytes, problem: str) -> None:
    with pytest.raises(StackError) as error:
        parse_lock(data, LOCK)
    separator = "" if problem.startswith(":") else " "
    assert error.value.problems == [f"{LOCK}{separator}{problem}; {FIX}"]


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
