"""NodeSetup: the deploy's inputs per node, the provider's create/diff/update/delete, a real run."""

import dataclasses
import errno
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import pulumi
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from paramiko import AuthenticationException, SSHException
from paramiko.ssh_exception import NoValidConnectionsError

from denv_iac.components.aws import ebs_device
from denv_iac.components.cluster import validate_cluster
from denv_iac.components.node_setup import (
    DeployRunner,
    NodeSetup,
    NodeSetupProvider,
    deploy_balancer,
    deploy_node,
)
from denv_iac.components.overlay import new_key_pair
from denv_iac.components.preview import SECRET_MARK, SECRET_SIG, shown
from denv_iac.components.secrets import public_key_of
from denv_iac.core.balancer import RenderedConfig
from denv_iac.core.balancer.model import CLIENT_SECRET_KEY_PATH, TLS_CERT_PATH
from denv_iac.core.overlay_plan import CONFIG_PATH, PRIVATE_KEY_PLACEHOLDER
from denv_iac.core.placement import place_replicas
from denv_iac.core.stack.reader import StackError, read_stack
from denv_iac.local.processes import free_port
from denv_iac.node import (
    CacheVolume,
    MigSlice,
    NodeDeploySpec,
    ReplicaSpec,
    Step,
    Target,
)
from denv_iac.node.balancer_host import GatewayCredentials
from denv_iac.node.deploy import SSH_WAIT_S, CannotConnect, NodeUnreachable, no_answer
from denv_iac.node.firewall import BalancerAccess
from denv_iac.node.from_stack import node_deploy_specs
from denv_iac.node.spec import spec_to_json
from denv_iac.node.ssh_keys import SshKeys
from denv_iac.node.steps import wants_link
from denv_iac.node.wireguard import UNIT as OVERLAY_UNIT
from tests.components import stacks
from tests.components.harness import cluster_outputs, plain_strings, run_program, waits_for
from tests.components.test_lambda import lambda_stack
from tests.components.test_nebius import nebius_stack
from tests.node import test_chroot_deploy as chroot

KEY = stacks.SSH_KEYS["office"]
SPEC = NodeDeploySpec(
    node_id="office.rack-1",
    mig=(MigSlice(0, "1g.10gb", 2),),
    replicas=(
        ReplicaSpec(
            "side.office.rack-1.0.0", "ghcr.io/acme/side:2", 8000, 0, ("serve",), "1g.10gb"
        ),
    ),
)
NODE = {
    "host": "192.0.2.10",
    "ssh_user": "root",
    "ssh_private_key": KEY,
    "node": spec_to_json(SPEC),
    "balancer_addresses": ["203.0.113.9", "198.18.0.1"],
}
BALANCER = {
    "host": "203.0.113.9",
    "ssh_user": "ubuntu",
    "ssh_private_key": KEY,
    "balancer": {
        "haproxy_config": "global\n",
        "map_files": {"pools.map": "voice voice\n"},
        "map_dir": "/etc/haproxy/denv",
    },
}
DEPLOYMENT = "pulumi-python:dynamic/denv:NodeDeployment"
# What the balancer host's login is asked to accept: the stack's key, nothing retired.
BALANCER_KEYS = SshKeys("ubuntu", public_key_of(KEY))


@dataclasses.dataclass
class KeyFile:
    path: Path
    mode: int
    text: str


class Recorder:
    """A deploy runner that records what it was asked to do and the key file it was given."""

    def __init__(self, steps: int = 2, fail: bool = False, accepts: str | None = None) -> None:
        self.calls: list[tuple[str, Target, Any]] = []
        self.extras: list[tuple[Any, ...]] = []  # what a call got after `what`
        self.keys: list[KeyFile] = []
        self.steps, self.fail = steps, fail
        self.accepts = accepts  # the one private key the machine lets in (None: any)

    def _record(self, kind: str) -> Callable[..., list[Step]]:
        def run(target: Target, what: Any, *extra: Any) -> list[Step]:
            self.calls.append((kind, target, what))
            self.extras.append(extra)
            if target.key is not None:
                mode = stat.S_IMODE(target.key.stat().st_mode)
                self.keys.append(KeyFile(target.key, mode, target.key.read_text()))
                if self.accepts is not None and target.key.read_text().strip() != self.accepts:
                    raise CannotConnect(f"cannot connect to {target.host}: auth failed")
            if self.fail:
                raise RuntimeError("replicas: start failed")
            return [Step(kind, f"step {n}") for n in range(self.steps)]

        return run

    def runner(self) -> DeployRunner:
        return DeployRunner(self._record("node"), self._record("balancer"), self._record("stop"))


def test_create_runs_the_node_deploy_with_the_key_in_a_0600_file_removed_after() -> None:
    recorder = Recorder()
    result = NodeSetupProvider(recorder.runner()).create(dict(NODE))
    ((kind, target, spec),) = recorder.calls
    assert kind == "node"
    assert (target.host, target.user, target.sudo) == ("192.0.2.10", "root", False)
    assert spec == dataclasses.replace(SPEC, balancer_addresses=("198.18.0.1", "203.0.113.9"))
    (key,) = recorder.keys
    assert key.mode == 0o600 and key.text.strip() == KEY.strip()
    assert not key.path.exists() and not key.path.parent.exists()
    assert result.id == "office.rack-1"
    assert result.outs is not None and result.outs["applied"] == ["node: step 0", "node: step 1"]


def test_a_cache_device_reaches_the_deploy_as_the_nodes_cache_volume() -> None:
    recorder = Recorder()
    device = "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"
    NodeSetupProvider(recorder.runner()).create({**NODE, "cache_device": device})
    NodeSetupProvider(recorder.runner()).create({**NODE, "cache_device": ""})
    (_, _, with_volume), (_, _, without) = recorder.calls
    assert with_volume.cache_volume == CacheVolume(device, "/var/cache/denv")
    assert without.cache_volume is None


def test_a_cache_volume_in_the_node_spec_is_kept_when_no_device_is_given() -> None:
    recorder = Recorder()
    own = CacheVolume("/dev/disk/by-label/models", "/srv/models")
    NodeSetupProvider(recorder.runner()).create(
        {**NODE, "node": spec_to_json(dataclasses.replace(SPEC, cache_volume=own))}
    )
    ((_, _, spec),) = recorder.calls
    assert spec.cache_volume == own


def test_every_node_and_balancer_host_deploy_gets_its_sites_admin_cidrs() -> None:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=False)
    deploys = {r.name: r.inputs for r in run.of_type(DEPLOYMENT)}
    nodes = {name: d["node"]["admin_cidrs"] for name, d in deploys.items() if "node" in d}
    # Joined and Hetzner machines too: their host firewall is the only guard of their SSH.
    for site in ("office", "hetzner-fsn", "aws-use1"):
        assert any(name.startswith(f"prod-{site}-") for name in nodes), site
    assert all(cidrs == [stacks.ADMIN] for cidrs in nodes.values()), nodes
    hosts = [d["balancer_firewall"] for d in deploys.values() if "balancer" in d]
    assert hosts == [{"admin_cidrs": [stacks.ADMIN], "stats_port": 8405}] * 2


def test_aws_nodes_mount_their_ebs_cache_volume_where_their_caches_are() -> None:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=False)
    volumes = {r.name: r.urn for r in run.of_type("aws:ebs/volume:Volume")}
    deploys = {r.name: r.inputs for r in run.of_type(DEPLOYMENT)}
    assert volumes
    for volume in volumes:  # the mocks give each volume the id "<name>-id"
        node = volume.removesuffix("-cache")
        deploy = deploys[f"{node}-setup-deploy"]
        serial = f"{volume}-id".replace("-", "")
        assert deploy["cache_device"] == f"/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_{serial}"
        assert deploy["node"]["cache"]["hf_home"] == "/var/cache/denv/huggingface"
    joined = [d for name, d in deploys.items() if name.startswith("prod-office-")]
    assert joined and all("cache_device" not in d for d in joined)


def test_an_ebs_volume_shows_by_its_id_on_a_nitro_instance() -> None:
    assert ebs_device("vol-0123456789abcdef0") == (
        "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"
    )


def test_the_key_file_is_removed_when_the_deploy_fails() -> None:
    recorder = Recorder(fail=True)
    with pytest.raises(RuntimeError, match="start failed"):
        NodeSetupProvider(recorder.runner()).create(dict(NODE))
    assert not recorder.keys[0].path.exists()


def test_a_balancer_host_gets_its_rendered_config_through_sudo() -> None:
    recorder = Recorder(steps=1)
    result = NodeSetupProvider(recorder.runner()).create(dict(BALANCER))
    ((kind, target, rendered),) = recorder.calls
    assert kind == "balancer" and target.sudo and target.user == "ubuntu"
    assert rendered == RenderedConfig(
        "global\n", {"pools.map": "voice voice\n"}, "/etc/haproxy/denv"
    )
    assert result.id == "balancer.203.0.113.9"
    assert result.outs is not None and result.outs["applied"] == ["balancer: step 0"]
    # A stack from before the balancer host's firewall: no admins, so nothing is guarded.
    assert recorder.extras == [(BalancerAccess((), 0), None, None, None, None, BALANCER_KEYS)]


def test_a_balancer_host_gets_its_sites_admin_cidrs_and_stats_port_for_its_firewall() -> None:
    recorder = Recorder(steps=1)
    given = {"admin_cidrs": ["198.51.100.0/24"], "stats_port": 8405.0}  # as the engine hands it
    NodeSetupProvider(recorder.runner()).create({**BALANCER, "balancer_firewall": given})
    access = BalancerAccess(("198.51.100.0/24",), 8405)
    assert recorder.extras == [(access, None, None, None, None, BALANCER_KEYS)]


@pytest.mark.parametrize("preview", [False, True], ids=["up", "preview"])
def test_each_balancer_host_gets_the_tls_certificate_as_a_secret_input_of_its_deploy(
    preview: bool,
) -> None:
    run = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=preview)
    balancers = {
        r.name: r.inputs for r in run.of_type(DEPLOYMENT) if r.name.startswith("prod-balancer-")
    }
    assert sorted(balancers) == [
        "prod-balancer-aws-use1-setup-deploy",
        "prod-balancer-hetzner-fsn-setup-deploy",
    ]
    for inputs in balancers.values():
        assert shown(inputs)["tls_certificate"] == "[secret]"
        material = stacks.TLS_CERTIFICATE.splitlines()[1]
        assert not any(material in s for s in plain_strings(inputs))
        if not preview:
            assert inputs["tls_certificate"][SECRET_SIG] == SECRET_MARK
            assert inputs["tls_certificate"]["value"] == stacks.TLS_CERTIFICATE
    # The config reads it where the deploy installs it.
    assert f"ssl crt {TLS_CERT_PATH}" in run.outputs["haproxy_config"]


def test_each_balancer_host_gets_the_client_secret_key_as_a_secret_input_of_its_deploy() -> None:
    signing_key = "CLIENT-SECRET-SIGNING-KEY-MATERIAL-0123456789"
    args = stacks.multicloud()
    args["balancer"]["client_secret_key"] = {"secure": signing_key}
    run = run_program(lambda: cluster_outputs(args), preview=False)
    balancers = [r.inputs for r in run.of_type(DEPLOYMENT) if r.name.startswith("prod-balancer-")]
    assert len(balancers) == 2
    for inputs in balancers:
        assert shown(inputs)["client_secret_key"] == "[secret]"
        assert not any(signing_key in s for s in plain_strings(inputs))
        assert inputs["client_secret_key"][SECRET_SIG] == SECRET_MARK
        assert inputs["client_secret_key"]["value"] == signing_key
    # The config reads it where the deploy installs it, and never holds it.
    assert f"map({CLIENT_SECRET_KEY_PATH})" in run.outputs["haproxy_config"]
    assert signing_key not in run.outputs["haproxy_config"]


def test_the_provider_hands_the_certificate_to_the_deploy_and_a_new_one_reruns_it() -> None:
    recorder = Recorder(steps=1)
    provider = NodeSetupProvider(recorder.runner())
    with_tls = {**BALANCER, "tls_certificate": stacks.TLS_CERTIFICATE}
    result = provider.create(dict(with_tls))
    assert recorder.extras == [
        (BalancerAccess((), 0), stacks.TLS_CERTIFICATE, None, None, None, BALANCER_KEYS)
    ]
    assert result.outs is not None and result.outs["applied"] == ["balancer: step 0"]
    renewed = {**with_tls, "tls_certificate": stacks.TLS_CERTIFICATE + "\nrenewed"}
    assert provider.diff("balancer.203.0.113.9", with_tls, renewed).changes
    assert not provider.diff("balancer.203.0.113.9", with_tls, dict(with_tls)).changes


def test_the_provider_hands_the_client_secret_key_to_the_deploy_and_a_new_one_reruns_it() -> None:
    recorder = Recorder(steps=1)
    provider = NodeSetupProvider(recorder.runner())
    with_key = {**BALANCER, "client_secret_key": "SIGNING-KEY-" * 4}
    provider.create(dict(with_key))
    access = BalancerAccess((), 0)
    assert recorder.extras == [(access, None, None, "SIGNING-KEY-" * 4, None, BALANCER_KEYS)]
    rotated = {**BALANCER, "client_secret_key": "ROTATED-KEY-" * 4}
    assert provider.diff("balancer.203.0.113.9", with_key, rotated).changes
    assert not provider.diff("balancer.203.0.113.9", with_key, dict(with_key)).changes


def test_the_provider_hands_the_gateway_credentials_to_the_deploy_and_new_ones_rerun_it() -> None:
    recorder = Recorder(steps=1)
    provider = NodeSetupProvider(recorder.runner())
    files = {"ca": "CA-CERTIFICATE", "client": "CLIENT-CERTIFICATE-AND-KEY"}
    with_gateway = {**BALANCER, "gateway_tls": files}
    provider.create(dict(with_gateway))
    gateway = GatewayCredentials("CA-CERTIFICATE", files["client"])
    assert recorder.extras == [(BalancerAccess((), 0), None, gateway, None, None, BALANCER_KEYS)]
    # The key never shows in what a log of the call would print.
    assert "CLIENT" not in repr(recorder.extras)
    renewed = {**BALANCER, "gateway_tls": {**files, "client": "RENEWED"}}
    assert provider.diff("balancer.203.0.113.9", with_gateway, renewed).changes
    assert not provider.diff("balancer.203.0.113.9", with_gateway, dict(with_gateway)).changes


def test_node_admin_cidrs_reach_the_deploy_and_are_left_out_of_the_state_when_unset() -> None:
    # A stack without them: no new input, no diff (sshd on 22 likewise).
    assert {"admin_cidrs", "ssh_port"}.isdisjoint(spec_to_json(SPEC))
    assert spec_to_json(dataclasses.replace(SPEC, ssh_port=2222))["ssh_port"] == 2222
    recorder = Recorder()
    NodeSetupProvider(recorder.runner()).create(_changed_node(admin_cidrs=("198.51.100.0/24",)))
    assert recorder.calls[0][2].admin_cidrs == ("198.51.100.0/24",)


def _changed_node(**fields: Any) -> dict[str, Any]:
    return {**NODE, "node": spec_to_json(dataclasses.replace(SPEC, **fields))}


@pytest.mark.parametrize(
    ("news", "replaces"),
    [
        ({**NODE, "host": "192.0.2.99"}, ["host"]),
        (_changed_node(driver_branch="590"), []),
        (_changed_node(mig=(MigSlice(0, "1g.10gb", 3),)), []),
        (_changed_node(replicas=()), []),
        (
            _changed_node(
                replicas=(dataclasses.replace(SPEC.replicas[0], image="ghcr.io/acme/side:3"),)
            ),
            [],
        ),
        (_changed_node(replicas=(dataclasses.replace(SPEC.replicas[0], port=8001),)), []),
        (_changed_node(replicas=(dataclasses.replace(SPEC.replicas[0], command=("x",)),)), []),
        ({**NODE, "balancer_addresses": ["203.0.113.9"]}, []),
        ({**NODE, "cache_device": "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol1"}, []),
        ({**NODE, "ssh_private_key": stacks.SSH_KEYS["aws-use1"]}, []),
        (
            {**BALANCER, "balancer": {**BALANCER["balancer"], "haproxy_config": "global\n#2\n"}},
            [],
        ),
        (_changed_node(admin_cidrs=("198.51.100.0/24",)), []),
        (
            {
                **BALANCER,
                "balancer_firewall": {"admin_cidrs": ["198.51.100.0/24"], "stats_port": 1},
            },
            [],
        ),
    ],
    ids=[
        "host",
        "driver-branch",
        "mig-layout",
        "replica-removed",
        "replica-image",
        "replica-port",
        "replica-command",
        "balancer-addresses",
        "cache-device",
        "ssh-key",
        "haproxy-config",
        "node-admin-cidrs",
        "balancer-admin-cidrs",
    ],
)
def test_diff_replaces_on_another_host_and_updates_in_place_otherwise(
    news: dict[str, Any], replaces: list[str]
) -> None:
    olds = BALANCER if "balancer" in news else NODE
    result = NodeSetupProvider().diff("id", {**olds, "applied": ["x"]}, news)
    assert (result.changes, result.replaces) == (True, replaces)
    assert result.delete_before_replace is False


def test_diff_of_the_same_inputs_changes_nothing_whatever_the_last_run_applied() -> None:
    result = NodeSetupProvider().diff("id", {**NODE, "applied": ["node: step 0"]}, dict(NODE))
    assert (result.changes, result.replaces) == (False, [])


def test_update_reruns_the_deploy_and_delete_stops_the_replicas_only() -> None:
    recorder = Recorder(steps=0)
    provider = NodeSetupProvider(recorder.runner())
    news = _changed_node(driver_branch="590")
    outs = provider.update("office.rack-1", dict(NODE), news).outs
    assert outs is not None and outs["applied"] == []
    assert outs["node"]["driver_branch"] == "590"
    provider.delete("office.rack-1", outs)
    provider.delete("balancer.203.0.113.9", dict(BALANCER))
    assert [(kind, spec.driver_branch) for kind, _, spec in recorder.calls] == [
        ("node", "590"),
        ("stop", "590"),
    ]


@pytest.mark.parametrize("kind", ["node", "balancer"])
def test_a_rotated_key_logs_in_with_the_old_one_once_and_the_deploy_installs_the_new(
    kind: str,
) -> None:
    rotated = stacks.SSH_KEYS["aws-use1"]
    olds = dict(NODE if kind == "node" else BALANCER)
    news = {**olds, "ssh_private_key": rotated}
    user = str(olds["ssh_user"])
    provider = NodeSetupProvider((machine := Recorder(accepts=KEY.strip())).runner())
    # A key change reruns the deploy in place: the machine stays.
    diff = provider.diff("id", olds, news)
    assert diff.changes and diff.replaces == []
    outs = provider.update("id", olds, news).outs
    # The new key first (refused: the machine has only the old one), then the old one ...
    assert [key.text.strip() for key in machine.keys] == [rotated.strip(), KEY.strip()]
    # ... and the deploy run through it puts the new key in and takes the old one out.
    expected = SshKeys(user, public_key_of(rotated), (public_key_of(KEY),))
    assert machine.extras[-1][-1] == expected
    assert outs is not None and outs["ssh_private_key"] == rotated
    # Once the machine takes the new key, the next deploy logs in with it alone.
    landed = Recorder(accepts=rotated.strip())
    NodeSetupProvider(landed.runner()).update("id", outs, dict(news))
    assert [key.text.strip() for key in landed.keys] == [rotated.strip()]
    assert landed.extras[-1][-1] == SshKeys(user, public_key_of(rotated))


def test_a_machine_that_takes_neither_key_fails_the_deploy_naming_it() -> None:
    machine = Recorder(accepts="another key")
    news = {**NODE, "ssh_private_key": stacks.SSH_KEYS["aws-use1"]}
    with pytest.raises(NodeUnreachable, match=r"192\.0\.2\.10"):
        NodeSetupProvider(machine.runner()).update("id", dict(NODE), news)
    assert len(machine.keys) == 2 and not any(key.path.exists() for key in machine.keys)


def test_a_rotated_key_is_not_retried_with_the_old_one_where_nothing_answers() -> None:
    # The deploy waited for the machine's SSH port already: another key gets in no better.
    class Silent(Recorder):
        def runner(self) -> DeployRunner:
            def node(target: Target, *_: Any) -> list[Step]:
                self.keys.append(KeyFile(Path(), 0, ""))
                raise CannotConnect("cannot connect to 192.0.2.10: refused", answered=False)

            return DeployRunner(node=node)

    machine = Silent()
    news = {**NODE, "ssh_private_key": stacks.SSH_KEYS["aws-use1"]}
    with pytest.raises(CannotConnect, match="refused"):
        NodeSetupProvider(machine.runner()).update("id", dict(NODE), news)
    assert len(machine.keys) == 1


@pytest.mark.parametrize(
    ("deploy", "prepare"),
    [(deploy_node, "prepare_node"), (deploy_balancer, "prepare_balancer")],
)
def test_the_providers_deploys_wait_for_a_new_machines_ssh(
    deploy: Callable[..., list[Step]], prepare: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []

    def record(*_: Any, ssh_wait_s: float = 0.0, **__: Any) -> list[Step]:
        waits.append(ssh_wait_s)
        return []

    monkeypatch.setattr(f"denv_iac.components.node_setup.{prepare}", record)
    deploy(*[None] * 8 if prepare == "prepare_balancer" else [None] * 4)
    assert waits == [SSH_WAIT_S] and SSH_WAIT_S >= 150  # pulumi-command's: 10 dials of 15 s


def test_a_machine_lost_after_the_login_is_not_retried_with_the_old_key() -> None:
    # A reboot that never came back is no refused key: the deploy ran, and its error stands.
    class Lost(Recorder):
        def runner(self) -> DeployRunner:
            def node(target: Target, *_: Any) -> list[Step]:
                self.keys.append(KeyFile(Path(), 0, ""))
                raise NodeUnreachable("192.0.2.10: did not come back within 900 s of a reboot")

            return DeployRunner(node=node)

    machine = Lost()
    news = {**NODE, "ssh_private_key": stacks.SSH_KEYS["aws-use1"]}
    with pytest.raises(NodeUnreachable, match="did not come back"):
        NodeSetupProvider(machine.runner()).update("id", dict(NODE), news)
    assert len(machine.keys) == 1


def _delete_within(props: dict[str, Any], bound_s: float = 60.0) -> BaseException | None:
    """The real provider's delete (real SSH, an OpenSSH key paramiko loads), in a thread given
    `bound_s`; what it raised."""
    key = Ed25519PrivateKey.generate().private_bytes(
        Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()
    )
    props = {**props, "ssh_private_key": key.decode()}
    raised: list[BaseException] = []

    def delete() -> None:
        try:
            NodeSetupProvider().delete("office.rack-1", props)
        except Exception as error:  # handed to the test
            raised.append(error)

    thread = threading.Thread(target=delete, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"delete still connecting after {bound_s:.0f} s"
    return raised[0] if raised else None


def test_delete_of_a_cloud_node_whose_machine_is_gone_succeeds_with_a_warning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in the provider's own process, which has no engine to log to: the warning goes to
    # stderr (an earlier test's mocks may have left one set in this process).
    monkeypatch.setattr(pulumi.log, "get_engine", lambda: None)
    port = free_port()
    props = {**NODE, "host": f"127.0.0.1:{port}", "deleted_by": "aws"}
    assert _delete_within(props) is None
    warning = capsys.readouterr().err
    assert "node office.rack-1: cannot connect to 127.0.0.1" in warning, warning
    assert "forgotten: its aws machine is deleted by its provider in this same update" in warning
    assert "PRIVATE KEY" not in warning


def test_delete_of_a_joined_node_where_nothing_answers_fails_naming_the_host_and_the_fix() -> None:
    """No provider deletes a joined or Hetzner machine: one that does not answer may still
    serve, so its removal fails and the node stays in the state until the user says."""
    port = free_port()
    raised = _delete_within({**NODE, "host": f"127.0.0.1:{port}"})
    assert isinstance(raised, NodeUnreachable) and not raised.answered, raised
    message = str(raised)
    assert "\n" not in message and "PRIVATE KEY" not in message
    assert message.startswith("node office.rack-1: cannot connect to 127.0.0.1"), message
    assert "no provider deletes this machine" in message
    assert "admin_cidrs" in message and "DENV_FORGET_NODES=office.rack-1" in message


def _unreached(error: NodeUnreachable) -> DeployRunner:
    """A deploy runner whose removal meets `error` on connecting."""

    def stop(*_: Any) -> list[Step]:
        raise error

    return DeployRunner(stop=stop)


TIMED_OUT = CannotConnect("cannot connect to 192.0.2.10: timed out", answered=False)
NO_ROUTE = CannotConnect("cannot connect to 192.0.2.10: No route to host", answered=False)
REFUSED_KEY = CannotConnect("cannot connect to 192.0.2.10: Authentication failed.")


@pytest.mark.parametrize("error", [TIMED_OUT, NO_ROUTE], ids=["timeout", "no-route"])
@pytest.mark.parametrize("forget", [None, "", "office.rack-2", "office.rack"])
def test_delete_of_a_silent_joined_node_fails_unless_the_user_names_it(
    error: NodeUnreachable, forget: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A firewall that drops SSH (the deployer's address left admin_cidrs) times out.
    if forget is not None:
        monkeypatch.setenv("DENV_FORGET_NODES", forget)
    else:
        monkeypatch.delenv("DENV_FORGET_NODES", raising=False)
    with pytest.raises(NodeUnreachable) as raised:
        NodeSetupProvider(_unreached(error)).delete("office.rack-1", dict(NODE))
    assert str(raised.value).startswith(f"node office.rack-1: {error}; nothing answers")
    assert "DENV_FORGET_NODES=office.rack-1 to forget it" in str(raised.value)


@pytest.mark.parametrize("error", [TIMED_OUT, REFUSED_KEY], ids=["timeout", "answered"])
@pytest.mark.parametrize(
    "forget", ["office.rack-1", "office.rack-2,office.rack-1", " office.rack-2  office.rack-1 "]
)
@pytest.mark.parametrize("deleted_by", [None, "lambda"])
def test_delete_forgets_a_node_the_user_names_whatever_kept_it_out(
    error: NodeUnreachable,
    forget: str,
    deleted_by: str | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(pulumi.log, "get_engine", lambda: None)
    monkeypatch.setenv("DENV_FORGET_NODES", forget)
    props = dict(NODE) if deleted_by is None else {**NODE, "deleted_by": deleted_by}
    NodeSetupProvider(_unreached(error)).delete("office.rack-1", props)
    warning = capsys.readouterr().err
    assert f"node office.rack-1: {error}; forgotten: DENV_FORGET_NODES names it" in warning


def test_delete_of_a_cloud_node_whose_ssh_server_refuses_it_fails_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A live machine whose access changed: its provider is not deleting it away from anyone.
    monkeypatch.delenv("DENV_FORGET_NODES", raising=False)
    with pytest.raises(NodeUnreachable) as raised:
        NodeSetupProvider(_unreached(REFUSED_KEY)).delete(
            "aws-use1.node-0", {**NODE, "deleted_by": "aws"}
        )
    assert raised.value.answered
    assert str(raised.value) == (
        "node aws-use1.node-0: cannot connect to 192.0.2.10: Authentication failed.; no sign "
        "that the machine is gone; fix the SSH access from here (key, host key, network) and "
        "run again, or run with DENV_FORGET_NODES=aws-use1.node-0 to forget it"
    )


def test_which_provider_deletes_a_nodes_machine_stays_in_the_state_for_its_removal() -> None:
    provider = NodeSetupProvider(Recorder().runner())
    created = provider.create({**NODE, "deleted_by": "nebius"}).outs
    assert created is not None and created["deleted_by"] == "nebius"
    # Not a reason to re-run the deploy.
    assert not provider.diff("id", created, {**created, "deleted_by": "aws"}).changes
    updated = provider.update("id", created, {**created, "node": _changed_node()["node"]}).outs
    assert updated is not None and updated["deleted_by"] == "nebius"
    assert "deleted_by" not in (provider.create(dict(NODE)).outs or {})


@pytest.mark.parametrize(
    ("stack", "expected"),
    [
        (stacks.multicloud, {"aws-use1": "aws", "hetzner-fsn": None, "office": None}),
        (lambda_stack, {"lambda-use1": "lambda", "hetzner-fsn": None}),
        (nebius_stack, {"nebius-eun1": "nebius", "hetzner-fsn": None}),
    ],
    ids=["multicloud", "lambda", "nebius"],
)
def test_only_nodes_whose_machine_a_provider_deletes_say_so(
    stack: Callable[[], Any], expected: dict[str, str | None]
) -> None:
    run = run_program(lambda: cluster_outputs(stack()), preview=False)
    deleted_by: dict[str, set[str | None]] = {}
    for deployment in run.of_type(DEPLOYMENT):
        if "node" in deployment.inputs:
            site = deployment.inputs["node"]["node_id"].split(".")[0]
            deleted_by.setdefault(site, set()).add(deployment.inputs.get("deleted_by"))
    assert deleted_by == {site: {kind} for site, kind in expected.items()}


def test_delete_fails_when_something_answers_but_lets_no_deploy_in() -> None:
    """An SSH port that answers (here: a listener that hangs up at once, as no SSH server
    would) is a live machine: delete fails and the resource stays in the state."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def hang_up() -> None:
            with suppress(OSError):
                while True:
                    connection, _ = server.accept()
                    connection.close()

        threading.Thread(target=hang_up, daemon=True).start()
        raised = _delete_within({**NODE, "host": f"127.0.0.1:{port}"})
    assert isinstance(raised, NodeUnreachable) and raised.answered, raised
    assert str(raised).startswith("node office.rack-1: cannot connect to 127.0.0.1"), raised
    assert str(raised).endswith("or run with DENV_FORGET_NODES=office.rack-1 to forget it")


@pytest.mark.parametrize(
    ("error", "gone"),
    [
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
        (TimeoutError("timed out"), True),
        (OSError(errno.EHOSTUNREACH, "no route to host"), True),
        (OSError(errno.EHOSTDOWN, "host is down"), True),
        (OSError(errno.ETIMEDOUT, "timed out"), True),
        (OSError(errno.ENETUNREACH, "network is unreachable"), False),  # the deployer's own
        (NoValidConnectionsError({("192.0.2.1", 22): ConnectionRefusedError(111, "r")}), True),
        (
            NoValidConnectionsError(
                {
                    ("192.0.2.1", 22): ConnectionRefusedError(111, "r"),
                    ("2001:db8::1", 22, 0, 0): OSError(errno.ENETUNREACH, "u"),
                }
            ),
            False,
        ),
        (AuthenticationException("Authentication failed."), False),
        (SSHException("Error reading SSH protocol banner"), False),
        (EOFError(), False),
        (None, False),
    ],
)
def test_only_an_address_where_nothing_answers_counts_as_gone(
    error: BaseException | None, gone: bool
) -> None:
    assert no_answer(error) is gone


def test_node_setup_registers_the_deployment_with_its_key_a_secret() -> None:
    def program() -> dict[str, Any]:
        setup = NodeSetup(
            "rack-1-setup",
            {
                "host": "192.0.2.10",
                "ssh_user": "root",
                "ssh_private_key": KEY,
                "node": SPEC,
                "balancer_addresses": ["203.0.113.9"],
            },
        )
        return {"applied": setup.applied}

    run = run_program(program, preview=False)
    assert [(r.type, r.name) for r in run.registrations] == [
        ("denv:index:NodeSetup", "rack-1-setup"),
        (DEPLOYMENT, "rack-1-setup-deploy"),
    ]
    inputs = run.named("rack-1-setup-deploy").inputs
    recorder = Recorder()
    # As the engine hands them over: numbers as floats, the secret decrypted.
    NodeSetupProvider(recorder.runner()).create({**inputs, "ssh_private_key": KEY})
    assert recorder.calls[0][2] == dataclasses.replace(SPEC, balancer_addresses=("203.0.113.9",))
    assert (inputs["host"], inputs["balancer_addresses"]) == ("192.0.2.10", ["203.0.113.9"])
    assert KEY not in plain_strings(inputs)
    assert inputs["ssh_private_key"]["value"] == KEY  # a secret: the engine stores it encrypted


def test_node_setup_takes_a_node_or_a_balancer_host() -> None:
    with pytest.raises(ValueError, match="either node or balancer"):
        NodeSetup("bad", {"host": "192.0.2.10", "ssh_user": "root", "ssh_private_key": KEY})


def test_node_specs_place_replicas_on_their_gpu_or_mig_instance_with_recipe_ports() -> None:
    stack, placement, _ = validate_cluster("prod", stacks.multicloud())
    specs = node_deploy_specs(stack, placement)
    assert sorted(specs) == [
        "aws-use1.node-0",
        "aws-use1.node-1",
        "aws-use1.node-2",
        "hetzner-fsn.gex-1",
        "hetzner-fsn.gex-2",
        "office.rack-1",
        "office.rack-2",
    ]
    voice = specs["aws-use1.node-0"]
    assert [(r.id, r.image, r.port, r.gpu, r.mig_profile) for r in voice.replicas] == [
        ("voice.aws-use1.node-0.0", "vllm/vllm-openai:v0.11.0", 8000, 0, None)
    ]
    side = specs["office.rack-1"]
    assert side.mig == (MigSlice(0, "1g.10gb", 7),)
    assert [(r.id, r.port, r.mig_profile, r.mig_instance) for r in side.replicas] == [
        ("side.office.rack-1.0.0", 8000, "1g.10gb", 0)
    ]
    assert specs["office.rack-2"].balancer_addresses == ()  # added once the hosts exist
    # Each node's SSH is guarded by its site's admin_cidrs: joined and Hetzner as the others.
    assert {name: s.admin_cidrs for name, s in specs.items()} == dict.fromkeys(
        specs, (stacks.ADMIN,)
    )


def test_a_recipe_without_an_image_on_an_ssh_site_is_one_line_naming_the_field() -> None:
    args = stacks.multicloud()
    del args["recipes"][0]["image"]
    expected = (
        "recipes: voice: give an image; its replicas run in containers on aws-use1, "
        "reached over SSH"
    )
    # Refused with the rest of the stack's checks, before any node spec is built ...
    with pytest.raises(StackError) as error:
        validate_cluster("prod", args)
    assert str(error.value) == expected
    # ... and by the node specs themselves, for a caller that placed the stack on its own.
    stack = read_stack(
        "prod", {f"denv:{key}": args[key] for key in ("sites", "recipes", "balancer")}
    )
    with pytest.raises(StackError) as error:
        node_deploy_specs(stack, place_replicas(stack))
    assert str(error.value) == expected


root = chroot.root
spec = chroot.spec


def _needs_chroot(test: Callable[..., None]) -> Callable[..., None]:
    for mark in chroot.pytestmark:
        test = mark(test)
    return test


@_needs_chroot
def test_create_then_update_through_chroot_converges_and_the_second_run_applies_nothing(
    root: Path, spec: NodeDeploySpec
) -> None:
    provider = NodeSetupProvider()
    # wireguard-tools comes from the distribution's repository, before cuda-keyring's is added:
    # here the stand-ins' offline one.
    sources = root / "etc/apt/sources.list.d/distribution.list"
    sources.write_text(f"deb [trusted=yes] file:{chroot.standin.REPO_IN_ROOT} ./\n")
    # On the overlay, as a Cluster's NodeSetup is: the key filled in only in the file written.
    on_overlay = dataclasses.replace(spec, listen_address="10.99.4.7")
    private_key, _ = new_key_pair()
    config = f"[Interface]\nAddress = 10.99.4.7/16\nPrivateKey = {PRIVATE_KEY_PLACEHOLDER}\n"
    props = {
        "host": f"@chroot{root}",
        "ssh_user": "root",
        "ssh_private_key": "",
        "node": spec_to_json(on_overlay),
        "balancer_addresses": ["10.99.0.9"],
        "overlay_config": config,
        "overlay_private_key": private_key,
        "overlay_senders": ["203.0.113.10"],
    }
    started = time.monotonic()
    created = provider.create(props)
    first = time.monotonic() - started
    assert created.outs is not None
    assert "driver: pin branch 580 and install nvidia-open" in created.outs["applied"]
    assert provider.diff(created.id, created.outs, props).changes is False
    started = time.monotonic()
    updated = provider.update(created.id, created.outs, props)
    print(
        f"\ncreate: {len(created.outs['applied'])} steps in {first:.1f} s; "
        f"update: 0 steps in {time.monotonic() - started:.1f} s"
    )
    assert updated.outs is not None and updated.outs["applied"] == []
    units = [root / "etc/systemd/system" / r.unit for r in spec.replicas]
    assert all(unit.is_file() for unit in units)
    assert (root / "etc/denv/firewall.nft").is_file()
    written = root / CONFIG_PATH.lstrip("/")
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert written.read_text() == config.replace(PRIVATE_KEY_PLACEHOLDER, private_key)
    assert (root / wants_link(OVERLAY_UNIT).lstrip("/")).is_symlink()
    assert 'agent_check = "10.99.4.7:9100"' in (root / "etc/denv/agent.toml").read_text()
    assert private_key not in str(created.outs["applied"])
    provider.delete(created.id, updated.outs)
    assert not any(unit.exists() for unit in units)
    assert not (root / "etc/denv/firewall.nft").exists()  # nor the firewall that guarded them
    assert not (root / "etc/systemd/system/denv-firewall.service").exists()
    assert "nvidia-open" in chroot.versions(root)  # the driver stays
    assert os.path.isfile(root / "etc/denv/agent.toml")


@pytest.mark.parametrize(
    ("stack", "instance_type", "cache_root"),
    [
        # Lambda mounts a filesystem at /lambda/nfs/<name>; cloud-init mounts Nebius's.
        (
            lambda_stack,
            "pulumi-python:dynamic/lambda:Instance",
            "/lambda/nfs/prod-lambda-use1-cache",
        ),
        (nebius_stack, "nebius:index/computeV1Instance:ComputeV1Instance", "/var/cache/denv"),
    ],
    ids=["lambda", "nebius"],
)
def test_nodes_a_cloud_creates_are_set_up_as_ubuntu_keeping_the_images_driver(
    stack: Callable[[], dict[str, Any]], instance_type: str, cache_root: str
) -> None:
    run = run_program(lambda: cluster_outputs(stack()), preview=False)
    instances = {r.name: r.urn for r in run.of_type(instance_type)}
    assert instances
    deploys = {r.name: r for r in run.of_type(DEPLOYMENT)}
    for name in instances:
        deploy = deploys[f"{name}-setup-deploy"]
        assert deploy.inputs["ssh_user"] == "ubuntu"
        assert deploy.inputs["node"]["image_driver"] is True
        assert deploy.inputs["host"].startswith("198.18.")  # the instance's address, once known
        # Weights and compile caches on the site's shared filesystem: a replacement finds them.
        assert deploy.inputs["node"]["cache"] == {
            "hf_home": f"{cache_root}/huggingface",
            "vllm_cache": f"{cache_root}/vllm",
            "inductor_cache": f"{cache_root}/torchinductor",
        }


def _deployments_hosting(run: Any, stack: Any) -> dict[str, dict[str, str]]:
    """Pool -> node id -> the URN of the NodeDeployment of each node hosting it."""
    urns = {r.name: r.urn for r in run.of_type(DEPLOYMENT)}
    hosting: dict[str, dict[str, str]] = {}
    for replica in place_replicas(stack).replicas:
        name = f"prod-{replica.site}-{replica.node}-setup-deploy"
        if name in urns:
            hosting.setdefault(replica.pool, {})[f"{replica.site}.{replica.node}"] = urns[name]
    return hosting


def test_a_pools_node_deploys_run_one_after_another_across_sites() -> None:
    args = stacks.multicloud()
    args["sites"][0]["max_nodes"] = 2  # voice's third replica goes to the other region
    run = run_program(lambda: cluster_outputs(args), preview=False)
    stack, _, _ = validate_cluster("prod", args)
    hosting = _deployments_hosting(run, stack)
    assert set(hosting) == {"voice", "side", "assist"}
    for pool, nodes in hosting.items():
        urns = list(nodes.values())
        assert len(urns) >= 2, pool
        # Any two deploys of a pool are ordered: the engine never runs them at once.
        for i, a in enumerate(urns):
            for b in urns[i + 1 :]:
                assert waits_for(run, a, b) or waits_for(run, b, a), (pool, a, b)
    # Voice spans two AWS regions: its chain crosses from one site to the other.
    voice = list(hosting["voice"].items())
    sites = [node.split(".")[0] for node, _ in voice]
    assert sites[0] == "aws-use1" and sites[-1] == "aws-usw2"
    # Pools that share no node are not ordered against each other.
    (side, *_), (assist, *_) = hosting["side"].values(), hosting["assist"].values()
    assert not waits_for(run, side, assist) and not waits_for(run, assist, side)


def test_an_unchanged_recipe_diffs_to_nothing_and_a_new_image_to_an_update() -> None:
    args = stacks.multicloud()
    first = run_program(lambda: cluster_outputs(args), preview=False)
    again = run_program(lambda: cluster_outputs(stacks.multicloud()), preview=False)
    args["recipes"][1]["image"] = "ghcr.io/acme/side:3"
    changed = run_program(lambda: cluster_outputs(args), preview=False)
    provider = NodeSetupProvider()

    def diffs(run: Any) -> dict[str, bool]:
        olds = {r.name: r.inputs for r in first.of_type(DEPLOYMENT)}
        return {
            r.name: provider.diff("id", {**olds[r.name], "applied": ["x"]}, r.inputs).changes
            for r in run.of_type(DEPLOYMENT)
        }

    # A second `up` of the same stack applies nothing on any node.
    assert diffs(again) and not any(diffs(again).values())
    # A new image for side re-runs the deploy of side's nodes only.
    assert {name for name, changes in diffs(changed).items() if changes} == {
        "prod-office-rack-1-setup-deploy",
        "prod-office-rack-2-setup-deploy",
    }
