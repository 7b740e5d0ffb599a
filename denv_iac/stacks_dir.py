"""The project's `stacks/` folder: finding it, reading `Pulumi.<stack>.yaml` and its placement
lock, writing the lock. The formats are the pure core's (denv_iac/core/stack/stackfile.py)."""

from pathlib import Path
from typing import Any

from denv_iac.core.stack.model import StackSpec
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.core.stack.stackfile import (
    lock_path,
    parse_lock,
    parse_yaml,
    render_lock,
    stack_config,
    stack_path,
)


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
    return stack_config(document, path.name)


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
    return parse_lock(path.read_bytes(), path.name)


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
        path.write_text(render_lock(replica_ids), encoding="utf-8")
    except OSError as error:
        raise StackError(
            [
                f"--lock: cannot write {path.name} ({error.strerror}); make {stacks_dir.name}/ "
                "writable"
            ]
        ) from None
    return path
