"""denv-iac's dependency on denv-agent, which lives in agent/ and is on no package index.

pip reads no uv workspace, so a build from a checkout (`pip install .`, `pip install
git+file://...`) points at the checkout's own agent/ by a file URL; a build from the sdist (what
`uv build` makes the wheel from) names the version, to be installed beside the agent's wheel.
"""

import sys
import tomllib
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
project = tomllib.loads((HERE / "pyproject.toml").read_text("utf-8"))
agent = HERE / "agent"
# An sdist goes to other machines: it names the version, as the wheel built from it does.
if (agent / "pyproject.toml").is_file() and "sdist" not in sys.argv[1:]:
    requirement = f"denv-agent @ {agent.resolve().as_uri()}"
else:
    requirement = f"denv-agent=={project['project']['version']}"
setup(install_requires=[requirement, *project["tool"]["denv"]["dependencies"]])
