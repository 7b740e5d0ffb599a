"""The multi-language package: the product's components for TypeScript, Go, YAML and others.

`pulumi package add` runs this file to host the components; `python -m components --schema`
prints the schema they are served with (committed as components/schema.json).
"""

import json
import sys
from importlib.metadata import version

import pulumi
from pulumi.provider.experimental import component_provider_host
from pulumi.provider.experimental.component import ComponentProvider

from denv_iac.components import Cluster

PACKAGE = "denv"
# Only components whose args are plain data: the others take the product's typed specs.
COMPONENTS: list[type[pulumi.ComponentResource]] = [Cluster]


def schema() -> str:
    provider = ComponentProvider(COMPONENTS, PACKAGE, None, version("denv-iac"))
    return json.dumps(json.loads(str(provider.schema)), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--schema"]:
        sys.stdout.write(schema())
    else:
        component_provider_host(COMPONENTS, PACKAGE, version=version("denv-iac"))
