"""The programs the package ships as files (denv_iac/data/scripts/), read by one function."""

import shutil
import subprocess
from importlib import resources

import pytest

from denv_iac.core.kube_manifests import pods
from denv_iac.core.scripts import fill, script
from denv_iac.node import mig, replicas, steps

SCRIPTS = resources.files("denv_iac").joinpath("data", "scripts")
NAMES = sorted(p.name for p in SCRIPTS.iterdir())


def test_each_shipped_script_is_what_its_module_renders() -> None:
    used = {
        "busy_connections.awk": steps._BUSY_AWK,
        "mig_restore.sh": mig._RESTORE_SCRIPT,
        "replica_run.sh": replicas._LAUNCHER_SCRIPT,
        "pod_ready.py": pods.READY_HOOK,
        "pod_stop.py": pods.STOP_HOOK,
    }
    assert sorted(used) == NAMES
    for name, text in used.items():
        assert text == SCRIPTS.joinpath(name).read_text(), name


def test_a_placeholder_is_filled_and_none_is_left_open() -> None:
    assert fill("x.sh", "sleep @SETTLE_S@; echo $@ @x@\n", {"SETTLE_S": "3"}) == (
        "sleep 3; echo $@ @x@\n"
    )
    with pytest.raises(ValueError, match="placeholders \\['SETTLE_S'\\], values given \\[\\]"):
        fill("x.sh", "sleep @SETTLE_S@", {})
    with pytest.raises(ValueError, match="placeholders \\[\\], values given \\['PORT'\\]"):
        script("mig_restore.sh", PORT="1")


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith(".sh")])
def test_the_shell_scripts_parse_and_pass_shellcheck(name: str) -> None:
    path = str(SCRIPTS.joinpath(name))
    subprocess.run(["sh", "-n", path], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/system-packages.txt lists it)")
    subprocess.run(["shellcheck", path], check=True)
