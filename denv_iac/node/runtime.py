"""The container runtime: Docker with NVIDIA's container toolkit registered as a runtime."""

from __future__ import annotations

from denv_iac.node.driver import service_steps
from denv_iac.node.facts import NodeFacts
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import Step, apt_install

ENGINE_PACKAGE = "docker.io"
ENGINE_UNIT = "docker.service"
TOOLKIT_PACKAGE = "nvidia-container-toolkit"


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    del spec  # one runtime for every node today; the signature matches the other areas
    steps: list[Step] = []
    missing = [p for p in (ENGINE_PACKAGE, TOOLKIT_PACKAGE) if p not in facts.packages]
    if missing:
        steps.append(
            Step("runtime", f"install {' '.join(missing)}", (apt_install(*missing),), uses_apt=True)
        )
    configure = not facts.runtime_configured
    if configure:
        steps.append(
            Step(
                "runtime",
                "register the nvidia runtime with Docker",
                ("nvidia-ctk runtime configure --runtime=docker",),
            )
        )
    steps += service_steps(facts, "runtime", ENGINE_UNIT, "Docker engine", changed=configure)
    return steps
