"""The formats of `stacks/Pulumi.<stack>.yaml` and its placement lock: names, paths, parsing.

Pure: denv_iac/stacks_dir.py finds, reads and writes the files.
"""

import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from denv_iac.core.stack.fields import describe
from denv_iac.core.stack.reader import StackError

# Pulumi's own rule for stack names; no '/' and no leading '.', so a name never leaves its folder.
STACK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_stack_name(name: str) -> str:
    """The name, when it names a stack; StackError otherwise (it becomes a file or folder name)."""
    if not STACK_NAME.fullmatch(name):
        raise StackError(
            [
                f"--stack: {name!r} is not a stack name; use letters, digits, '.', '_' and '-', "
                "starting with a letter or digit"
            ]
        )
    return name


def stack_path(stacks_dir: Path, name: str) -> Path:
    return stacks_dir / f"Pulumi.{check_stack_name(name)}.yaml"


def lock_path(stacks_dir: Path, name: str) -> Path:
    return stacks_dir / f"Pulumi.{check_stack_name(name)}.placement.json"


class _Refused(yaml.YAMLError):
    """A problem PyYAML does not report itself: a key given twice (it keeps the last), or a
    value its constructors fail on with a Python error. The message starts with the line."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping, and says on which line a value
    cannot be read as its tag.

    PyYAML keeps the last of two keys silently: a second `denv:recipes` drops the whole first
    list. And it reads a tagged value with Python's own conversions, which raise ValueError
    (`2001-02-30`, an integer of over 4300 digits), TypeError, KeyError or AttributeError (a
    `!!map` of a list, a `!!bool` or `!!timestamp` of anything else), none of them a YAMLError.
    """

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise _Refused(_unreadable(node)) from error


MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """Keys written twice in one mapping are refused. A merge key (`<<: *base`) is YAML's way
    to reuse a mapping and override some of its keys: the keys it brings in are not written in
    this mapping, and the ones written here win, as YAML 1.1 says."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, Hashable):
            raise _Refused(f"line {line}: a mapping key must be a plain value")
        if key in seen:
            raise _Refused(
                f"line {line}: key {key!r} is given twice in one mapping (first on line "
                f"{seen[key]}); keep one"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


# YAML's own tags are written `!!name`; PyYAML spells them out.
YAML_TAG_PREFIX = "tag:yaml.org,2002:"


def _refuse_tag(loader: _StrictLoader, node: yaml.Node) -> Any:
    """A tag no constructor is registered for (`!!python/object`, `!Ref`): SafeLoader refuses
    it too, but in words about constructors; the stack takes plain values only."""
    tag = node.tag.replace(YAML_TAG_PREFIX, "!!", 1)
    raise _Refused(
        f"line {node.start_mark.line + 1}: the tag {tag} is not one a stack file takes; remove"
        " it and write a plain value"
    )


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _refuse_duplicates)
_StrictLoader.add_constructor(None, _refuse_tag)


def _unreadable(node: yaml.Node) -> str:
    """A value that cannot be read as its tag, as one line: its start, quoted as JSON would
    (a block scalar's line breaks included), and the tag, explicit or as YAML resolved it."""
    tag = node.tag.replace(YAML_TAG_PREFIX, "!!", 1)
    if isinstance(node, yaml.ScalarNode):
        text = str(node.value)
        shown = json.dumps(text[:40]) + ("..." if len(text) > 40 else "")
    else:
        shown = "a sequence" if isinstance(node, yaml.SequenceNode) else "a mapping"
    return (
        f"line {node.start_mark.line + 1}: {shown} cannot be read as {tag}; write a value of"
        " that type, or quote it if it is text"
    )


def _utf8(data: bytes, name: str, fix: str) -> str:
    """The text of a file's bytes; StackError naming the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise StackError(
            [f"{name}: byte 0x{data[error.start]:02x} at offset {error.start} is not UTF-8; {fix}"]
        ) from None


def parse_json(data: bytes, name: str, fix: str) -> Any:
    """A JSON document from untrusted bytes; StackError with one line, ending in `fix`, for any
    problem. The files denv writes itself are JSON: what is wrong with one is said the same way
    whichever it is, and `fix` says how to get a good one back."""
    text = _utf8(data, name, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise StackError(
            [f"{name} line {error.lineno} column {error.colno}: not JSON ({error.msg}); {fix}"]
        ) from None
    except ValueError:  # the one other: an integer past Python's 4300 digits
        raise StackError([f"{name}: holds a number too long to read; {fix}"]) from None
    except RecursionError:
        raise StackError([f"{name}: nested too deeply to be one denv writes; {fix}"]) from None


def parse_yaml(data: bytes, name: str) -> Any:
    """A YAML document from untrusted bytes; StackError with one line for any problem."""
    text = _utf8(data, name, "save the file as UTF-8")
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no Python objects
    except _Refused as error:
        raise StackError([f"{name} {error}"]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise StackError([f"{name}{where}: {problem}; fix the YAML syntax"]) from None
    except RecursionError:
        raise StackError([f"{name}: nested too deeply; flatten the YAML"]) from None


def stack_config(document: Any, file_name: str) -> dict[str, Any]:
    """The `config:` mapping of a parsed stack file; StackError when the file has another shape."""
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise StackError([f"{file_name}: expected a mapping with a config: key"])
    config = document.get("config", {})
    if not isinstance(config, dict):
        raise StackError([f"{file_name}: config: must be a mapping of keys to values"])
    return config


# How a placement lock that cannot be read is replaced: it is denv's own, made by the plan.
LOCK_FIX = "delete it and run `denv plan --lock` again"


def parse_lock(data: bytes, file_name: str) -> list[str]:
    """Replica ids of a placement lock's bytes, as the file holds them; StackError with one line
    saying what is wrong when it is not a lock."""
    document = parse_json(data, file_name, LOCK_FIX)

    def refuse(problem: str) -> StackError:
        return StackError([f"{file_name}: {problem}; {LOCK_FIX}"])

    if not isinstance(document, dict):
        raise refuse(f'{describe(document)}, not a placement lock (an object with "replicas")')
    if "replicas" not in document:
        raise refuse('no "replicas" key, so not a placement lock')
    ids = document["replicas"]
    if not isinstance(ids, list):
        raise refuse(f"replicas is {describe(ids)}, not a list of replica ids")
    first: dict[str, int] = {}
    for index, replica in enumerate(ids):
        if not isinstance(replica, str):
            raise refuse(f"replicas[{index}] is {describe(replica)}, not a replica id")
        if replica in first:
            # Each id is one replica placed: the plan would pin it twice.
            raise refuse(
                f"replicas[{index}] {json.dumps(replica)} is listed twice (first as"
                f" replicas[{first[replica]}])"
            )
        first[replica] = index
    return ids


def render_lock(replica_ids: list[str]) -> str:
    """A placement lock's text: the replica ids, sorted, so that the file diffs cleanly."""
    return json.dumps({"replicas": sorted(replica_ids)}, indent=2) + "\n"
