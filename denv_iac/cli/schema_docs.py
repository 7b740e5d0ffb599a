"""`python -m denv_iac.cli.schema_docs SCHEMA.json`: docs/reference.md on stdout, rendered by
the pure denv_iac/core/schema_docs.py from the components' Pulumi schema."""

import json
import sys
from pathlib import Path

from denv_iac.core.schema_docs import render_reference


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m denv_iac.cli.schema_docs SCHEMA.json", file=sys.stderr)
        return 2
    try:
        schema = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        print(f"error: {argv[0]}: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render_reference(schema))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
