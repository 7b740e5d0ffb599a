"""Finding and reading `stacks/Pulumi.<stack>.yaml` and its placement lock."""

import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from denv_iac.spec.model import StackSpec
from denv_iac.spec.reader import StackError, read_stack


def find_stacks_dir(start: Path | None = None) -> Path:
    """The `stacks/` folder of the project containing `start` (default: the working directory)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "Pulumi.yaml").is_file() and (folder / "stacks").is_dir():
            return folder / "stacks"
    raise StackError(
        [
            "stacks: no Pulumi.yaml with a stacks/ folder here or above; run from the project or "
            "pass --stacks-dir"
        ]
    )


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


def available_stacks(stacks_dir: Path) -> list[str]:
    names = (
        p.name.removeprefix("Pulumi.").removesuffix(".yaml")
        for p in stacks_dir.glob("Pulumi.*.yaml")
    )
    return sorted(names)


def load_stack_config(stacks_dir: Path, name: str) -> dict[str, Any]:
    path = stack_path(stacks_dir, name)
    if not path.is_file():
        known = ", ".join(available_stacks(stacks_dir)) or "none"
        raise StackError([f"--stack: no {path.name} in {stacks_dir.name}/; stacks here: {known}"])
    try:
        document = parse_yaml(path.read_bytes(), path.name)
    except OSError as error:
        raise StackError([f"{path.name}: cannot read it ({error.strerror})"]) from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise StackError([f"{path.name}: expected a mapping with a config: key"])
    config = document.get("config", {})
    if not isinstance(config, dict):
        raise StackError([f"{path.name}: config: must be a mapping of keys to values"])
    return config


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


def load_stack(stacks_dir: Path, name: str) -> StackSpec:
    return read_stack(name, load_stack_config(stacks_dir, name))


def declared_recipes(stacks_dir: Path, name: str) -> Any:
    """`denv:recipes` as the stack file writes it, `secure:` markers kept; None without one.

    A program is handed its config decrypted; only the file still says which values were secure.
    """
    if not stack_path(stacks_dir, name).is_file():
        return None
    try:
        return load_stack_config(stacks_dir, name).get("denv:recipes")
    except StackError:
        return None


def load_lock(stacks_dir: Path, name: str) -> list[str]:
    """Replica ids of the last locked placement; pinned so that edits never move them."""
    path = lock_path(stacks_dir, name)
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids = data["replicas"]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise StackError(
            [f"{path.name}: not a placement lock; delete it and run `denv plan --lock` again"]
        ) from None
    return ids


def check_lock_writable(stacks_dir: Path, name: str) -> None:
    """StackError when `--lock` could not write the lock: something not a file is in its place.

    Checked before the plan, so that a refused lock leaves nothing written."""
    path = lock_path(stacks_dir, name)
    if path.exists() and not path.is_file():
        raise StackError(
            [
                f"--lock: {path.name} in {stacks_dir.name}/ is not a file; move it away so the "
                "placement lock can be written there"
            ]
        )


def write_lock(stacks_dir: Path, name: str, replica_ids: list[str]) -> Path:
    path = lock_path(stacks_dir, name)
    check_lock_writable(stacks_dir, name)
    try:
        path.write_text(
            json.dumps({"replicas": sorted(replica_ids)}, indent=2) + "\n", encoding="utf-8"
        )
    except OSError as error:
        raise StackError(
            [
                f"--lock: cannot write {path.name} ({error.strerror}); make {stacks_dir.name}/ "
                "writable"
            ]
        ) from None
    return path
