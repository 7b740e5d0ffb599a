"""Run examples/team-repo under the product's Pulumi mocks and print what it registered, as JSON.

tests/test_install.py runs this with the interpreter of a fresh environment holding only the
built wheels and their dependencies, so that every import here comes from that environment.
Arguments: the team repo's folder; the SSH private key that stands for its `secure:` values.
"""

import json
import runpy
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pulumi
import yaml

import denv_iac
from denv_iac.components.preview import run_program


def _decrypted(value: Any, secret: str) -> Any:
    """Stack config as the engine hands it to a program: each `secure:` value decrypted."""
    if isinstance(value, dict):
        if set(value) == {"secure"}:
            return secret
        return {k: _decrypted(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [_decrypted(v, secret) for v in value]
    return value


def main() -> None:
    team, secret = Path(sys.argv[1]), Path(sys.argv[2]).read_text("utf-8")
    config = yaml.safe_load((team / "Pulumi.prod.yaml").read_text("utf-8"))["config"]
    plain = {k: _decrypted(v, secret) for k, v in config.items()}
    pulumi.runtime.set_all_config(
        {k: v if isinstance(v, str) else json.dumps(v) for k, v in plain.items()},
        secret_keys=["gpu:sites"],
    )

    def program() -> dict[str, pulumi.Output[Any]]:
        namespace = runpy.run_path(str(team / "__main__.py"))
        return {"endpoint": namespace["cluster"].endpoint}

    run = run_program(program, preview=False)
    report = {
        "denv_iac": denv_iac.__file__,
        "types": Counter(r.type for r in run.registrations),
        "endpoint": run.outputs["endpoint"],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
