"""The formats of `stacks/Pulumi.<stack>.yaml` and its placement lock: names, paths, parsing.

Pure: denv_iac/stacks_dir.py finds, reads and writes the files.
"""

import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

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


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping.

    PyYAML keeps the last one silently: a second `denv:recipes` drops the whole first list.
    """


class _DuplicateKey(yaml.YAMLError):
    pass


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
            raise _DuplicateKey(f"line {line}: a mapping key must be a plain value")
        if key in seen:
            raise _DuplicateKey(
                f"line {line}: key {key!r} is given twice in one mapping (first on line "
                f"{seen[key]}); keep one"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _refuse_duplicates)


def parse_yaml(data: bytes, name: str) -> Any:
    """A YAML document from untrusted bytes; StackError with one line for any problem."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise StackError(
            [
                f"{name}: byte 0x{data[error.start]:02x} at offset {error.start} is not UTF-8; "
                "save the file as UTF-8"
            ]
        ) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no Python objects
    except _DuplicateKey as error:
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


def parse_lock(text: str | bytes, file_name: str) -> list[str]:
    """Replica ids of a placement lock's text (or its bytes, as the file holds them); StackError
    when it is not a lock, bytes that are not UTF-8 included."""
    try:
        ids = json.loads(text)["replicas"]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise StackError(
            [f"{file_name}: not a placement lock; delete it and run `denv plan --lock` again"]
        ) from None
    return ids


def render_lock(replica_ids: list[str]) -> str:
    """A placement lock's text: the replica ids, sorted, so that the file diffs cleanly."""
    return json.dumps({"replicas": sorted(replica_ids)}, indent=2) + "\n"
