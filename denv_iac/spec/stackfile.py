"""Finding and reading `stacks/Pulumi.<stack>.yaml` and its placement lock."""

import json
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


def stack_path(stacks_dir: Path, name: str) -> Path:
    return stacks_dir / f"Pulumi.{name}.yaml"


def lock_path(stacks_dir: Path, name: str) -> Path:
    return stacks_dir / f"Pulumi.{name}.placement.json"


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
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise StackError([f"{path.name}{where}: {problem}; fix the YAML syntax"]) from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise StackError([f"{path.name}: expected a mapping with a config: key"])
    config = document.get("config", {})
    if not isinstance(config, dict):
        raise StackError([f"{path.name}: config: must be a mapping of keys to values"])
    return config


def load_stack(stacks_dir: Path, name: str) -> StackSpec:
    return read_stack(name, load_stack_config(stacks_dir, name))


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


def write_lock(stacks_dir: Path, name: str, replica_ids: list[str]) -> Path:
    path = lock_path(stacks_dir, name)
    path.write_text(
        json.dumps({"replicas": sorted(replica_ids)}, indent=2) + "\n", encoding="utf-8"
    )
    return path
