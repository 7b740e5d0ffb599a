"""The container runtime: Docker with NVIDIA's container toolkit registered as a runtime."""

from __future__ import annotations

from denv_iac.node.driver import service_steps
from denv_iac.node.facts import NodeFacts
from denv_iac.node.spec import NodeDeploySpec
from denv_iac.node.steps import Step, apt_install

ENGINE_PACKAGE = "docker.io"
# Packages that bring a Docker engine: Debian's and Ubuntu's, and Docker's own (Docker CE).
# docker.io conflicts with docker-ce and containerd.io: installing it over Docker CE would
# remove the node's working engine.
ENGINE_PACKAGES = (ENGINE_PACKAGE, "docker-ce")
ENGINE_UNIT = "docker.service"
TOOLKIT_PACKAGE = "nvidia-container-toolkit"


def has_engine(facts: NodeFacts) -> bool:
    """A Docker engine is there: from a package, or a docker command whose daemon runs
    (an engine installed from Docker's static binaries has no package)."""
    if any(package in facts.packages for package in ENGINE_PACKAGES):
        return True
    return facts.docker_cli and ENGINE_UNIT in facts.active_units


def plan(facts: NodeFacts, spec: NodeDeploySpec) -> list[Step]:
    del spec  # one runtime for every node today; the signature matches the other areas
    steps: list[Step] = []
    missing = [] if has_engine(facts) else [ENGINE_PACKAGE]
    missing += [TOOLKIT_PACKAGE] if TOOLKIT_PACKAGE not in facts.packages else []
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
