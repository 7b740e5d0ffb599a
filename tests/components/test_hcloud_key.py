"""A Hetzner balancer host's SSH key: Hetzner Cloud refuses a second key of one fingerprint
(uniqueness_error), so a key the project holds already, or another site of the stack uploads,
is named on the site (`hcloud_ssh_key`) and used, and an `up` that would upload it again is
refused at preview in one line naming the field and the fix."""

import copy
from typing import Any

import pulumi
import pytest

from denv_iac.components.balancer_host import hcloud_fingerprint
from denv_iac.components.secrets import public_key_of
from tests.components import stacks
from tests.components.harness import Run, cluster_outputs, run_program

SSH_KEY = "hcloud:index/sshKey:SshKey"
SERVER = "hcloud:index/server:Server"
FSN_KEY = public_key_of(stacks.SSH_KEYS["hetzner-fsn"])
OWN_NAME = "prod-balancer-hetzner-fsn-key"  # the name the stack uploads the site's key under


def _project_key(name: str, public_key: str) -> dict[str, Any]:
    return {
        "fingerprint": hcloud_fingerprint(public_key),
        "id": 4711,
        "labels": {},
        "name": name,
        "publicKey": public_key,
    }


def _two_hetzner_balancers(**second: Any) -> Any:
    """multicloud with a second Hetzner balancer site, in hel1, holding the same key."""
    args = stacks.multicloud()
    fsn = next(s for s in args["sites"] if s["name"] == "hetzner-fsn")
    gex = {"name": "gex-3", "address": "203.0.113.23", "server_model": "GEX130"}
    hel = {**copy.deepcopy(fsn), "name": "hetzner-hel", "location": "hel1", "nodes": [gex]}
    args["sites"] = [*args["sites"], {**hel, **second}]
    args["balancer"]["sites"] = ["hetzner-fsn", "hetzner-hel", "aws-use1"]
    return args


def _run(args: Any, preview: bool, keys: list[dict[str, Any]] | None = None) -> Run:
    return run_program(lambda: cluster_outputs(args), preview=preview, hcloud_keys=keys or [])


def _refusal(args: Any, preview: bool, keys: list[dict[str, Any]] | None = None) -> str:
    with pytest.raises(pulumi.RunError) as raised:
        _run(args, preview, keys)
    message = str(raised.value)
    assert "\n" not in message
    return message


PREVIEWS = pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])


def test_the_fingerprint_is_md5_of_the_key_as_hetzner_gives_it() -> None:
    # As `ssh-keygen -l -E md5` gives it for the same public key.
    assert hcloud_fingerprint(FSN_KEY) == "ff:88:9a:a9:60:fd:36:c4:a0:5a:d1:7d:72:18:26:b5"


@PREVIEWS
def test_a_key_the_project_holds_already_is_refused_naming_the_field(preview: bool) -> None:
    message = _refusal(stacks.multicloud(), preview, [_project_key("team", FSN_KEY)])
    assert message.startswith("sites: hetzner-fsn.hcloud_ssh_key: ")
    assert "as team" in message and "set hcloud_ssh_key: team on the site" in message


@PREVIEWS
def test_the_stacks_own_key_from_an_earlier_up_is_no_refusal(preview: bool) -> None:
    run = _run(stacks.multicloud(), preview, [_project_key(OWN_NAME, FSN_KEY)])
    (key,) = run.of_type(SSH_KEY)
    assert key.inputs["name"] == OWN_NAME


@PREVIEWS
def test_a_key_the_site_names_is_used_and_none_uploaded(preview: bool) -> None:
    args = stacks.multicloud()
    fsn = next(s for s in args["sites"] if s["name"] == "hetzner-fsn")
    fsn["hcloud_ssh_key"] = "team"
    run = _run(args, preview, [_project_key("team", FSN_KEY)])
    assert run.of_type(SSH_KEY) == []
    (server,) = run.of_type(SERVER)
    assert server.inputs["sshKeys"] == ["team"]


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ([], "no SSH key team in the Hetzner Cloud project"),
        (
            [_project_key("team", public_key_of(stacks.SSH_KEYS["office"]))],
            "is not the public half of the site's ssh_private_key",
        ),
    ],
    ids=["absent", "another-key"],
)
def test_a_named_key_that_is_not_the_sites_is_refused(
    keys: list[dict[str, Any]], says: str
) -> None:
    args = stacks.multicloud()
    next(s for s in args["sites"] if s["name"] == "hetzner-fsn")["hcloud_ssh_key"] = "team"
    message = _refusal(args, False, keys)
    assert message.startswith("sites: hetzner-fsn.hcloud_ssh_key: ") and says in message


@PREVIEWS
def test_two_hetzner_balancer_sites_sharing_a_key_do_not_upload_it_twice(preview: bool) -> None:
    message = _refusal(_two_hetzner_balancers(), preview)
    assert message.startswith("sites: hetzner-hel.hcloud_ssh_key: site hetzner-fsn uploads")
    assert f"set hcloud_ssh_key: {OWN_NAME} on the site" in message

    run = _run(_two_hetzner_balancers(hcloud_ssh_key=OWN_NAME), preview)
    (key,) = run.of_type(SSH_KEY)
    servers = {s.name: s for s in run.of_type(SERVER)}
    hel = servers["prod-balancer-hetzner-hel-vm"]
    assert hel.inputs["sshKeys"] == [OWN_NAME]
    assert key.urn in hel.dependencies  # made once, before the server that uses it


def test_a_site_naming_another_sites_key_must_hold_that_key() -> None:
    args = _two_hetzner_balancers(
        hcloud_ssh_key=OWN_NAME, ssh_private_key={"secure": stacks.SSH_KEYS["office"]}
    )
    message = _refusal(args, False)
    assert message.startswith("sites: hetzner-hel.hcloud_ssh_key: ")
    assert "site hetzner-fsn's SSH key" in message
