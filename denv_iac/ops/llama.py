"""The real CPU engine as the tests and the reliability table run it: stacks/Pulumi.local-llama.yaml
(two llama.cpp servers, two slots each) started from a checkout, with llama-server and its
model put in place by scripts/llama_server.py, and the engine's own process taken apart as faults
do it (a frozen decode loop, the whole process stopped or killed)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from denv_iac.core.stack.model import StackSpec
from denv_iac.stacks_dir import find_stacks_dir, load_stack

STACK = "local-llama"
BUILD_SCRIPT = Path("scripts") / "llama_server.py"
# Linux ptrace requests: stop one thread of a process, leaving its others running.
_PTRACE_SEIZE, _PTRACE_INTERRUPT, _PTRACE_DETACH = 0x4206, 0x4207, 17
_WALL = 0x40000000


@dataclass(frozen=True)
class LlamaEngine:
    project: Path  # the checkout whose .venv holds the links the stack names
    server: Path
    model: Path

    def stack(self) -> StackSpec:
        return load_stack(self.project / "stacks", STACK)


def build_engine(start: Path | None = None) -> LlamaEngine:
    """Build (once) and link llama-server and the model into the checkout's .venv; its progress
    goes to stderr (minutes, the first time); RuntimeError in one line when it fails."""
    project = find_stacks_dir(start).parent
    answer = subprocess.run(
        [sys.executable, str(project / BUILD_SCRIPT)],
        cwd=project,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if answer.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with status {answer.returncode}; see above")
    paths = json.loads(answer.stdout.strip().splitlines()[-1])
    return LlamaEngine(project, Path(paths["server"]), Path(paths["model"]))


class DecodeLoopFreeze:
    """llama-server decodes in its main thread and answers HTTP in others: stopping that one
    thread (ptrace, as a debugger does) is an engine wedged while its API still answers
    `/health`. Its metrics, served from the decode loop, stop answering too."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.ptrace.argtypes = [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2
        self._libc.ptrace.restype = ctypes.c_long

    def _ptrace(self, request: int) -> None:
        if self._libc.ptrace(request, self.pid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"ptrace {request:#x} of {self.pid}")

    def freeze(self) -> None:
        self._ptrace(_PTRACE_SEIZE)
        self._ptrace(_PTRACE_INTERRUPT)
        os.waitpid(self.pid, _WALL)  # stopped

    def thaw(self) -> None:
        self._ptrace(_PTRACE_DETACH)

    def __enter__(self) -> DecodeLoopFreeze:
        self.freeze()
        return self

    def __exit__(self, *_: object) -> None:
        self.thaw()
