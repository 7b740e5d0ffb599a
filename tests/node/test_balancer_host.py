"""The balancer host plan: install, stage, `haproxy -c`, then live files and a hitless reload."""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import re

import pytest
from pyinfra.api.command import FileUploadCommand, StringCommand

from denv_iac.core.balancer import (
    BalancerPool,
    BalancerServer,
    BalancerSettings,
    BalancerTier,
    RenderedConfig,
    render_haproxy_config,
)
from denv_iac.core.balancer.client_secrets import key_map
from denv_iac.core.balancer.model import CLIENT_SECRET_KEY_PATH, TLS_CERT_PATH
from denv_iac.node import plan_balancer
from denv_iac.node.balancer_host import (
    CONFIG,
    DROP_IN,
    STAGING,
    fact_query,
    plan_host,
)
from denv_iac.node.deploy import apply_step
from denv_iac.node.facts import NodeFacts
from denv_iac.node.firewall import BalancerAccess
from denv_iac.node.steps import Step, text_file

POOL = BalancerPool(
    "voice",
    (
        BalancerTier(
            1, ("s1",), (BalancerServer("voice.s1.n1.0", "s1", "n1", "10.0.0.5", 8000, 9100),)
        ),
    ),
)
SETTINGS = BalancerSettings(api_key_digests=(hashlib.sha256(b"k").hexdigest(),))
RENDERED = render_haproxy_config([POOL], SETTINGS, "/etc/haproxy/maps")


def test_fresh_host_installs_stages_checks_then_restarts_with_its_runtime_directory() -> None:
    steps = plan_balancer(NodeFacts(systemd=True), RENDERED)
    assert steps[0].title == "install haproxy"
    staged = [s.file.path for s in steps if s.file is not None and s.title.startswith("stage")]
    assert staged == [*sorted(f"{STAGING}/{n}" for n in RENDERED.files), f"{STAGING}/haproxy.cfg"]
    check = next(s for s in steps if "haproxy -c" in s.title)
    # The check comes first in its step: a rejected config never reaches the live paths.
    assert check.commands[0] == f"haproxy -c -q -f {STAGING}/haproxy.cfg"
    assert check.commands[-1] == f"install -m 0644 {STAGING}/live.cfg {CONFIG}"
    assert check.file is not None and check.file.content == RENDERED.haproxy_cfg.encode()
    staged_cfg = next(s for s in steps if s.title == "stage haproxy.cfg").file
    assert staged_cfg is not None and b"/etc/haproxy/maps/" not in staged_cfg.content
    # The package starts HAProxy with its own config as it installs: `enable --now` left that
    # one serving. A restart puts ours live, with the stats socket's folder made by systemd.
    last = steps[-1]
    assert last.commands[-1] == "systemctl restart haproxy.service"
    assert last.file == DROP_IN and last.commands[0] == "systemctl daemon-reload"


def test_the_units_runtime_directory_is_the_stats_sockets_folder() -> None:
    (socket,) = re.findall(r"stats socket (\S+)", RENDERED.haproxy_cfg)
    runtime = re.findall(r"^RuntimeDirectory=(\S+)$", DROP_IN.content.decode(), re.M)
    assert runtime == [posixpath.relpath(posixpath.dirname(socket), "/run")] == ["denv"]


PEM = "-----BEGIN CERTIFICATE-----\nMIIBcert\n-----END CERTIFICATE-----\n"
PEM += "-----BEGIN PRIVATE KEY-----\nMIIEsecretkeymaterial\n-----END PRIVATE KEY-----\n"
TLS = render_haproxy_config(
    [POOL], dataclasses.replace(SETTINGS, tls_cert_path=TLS_CERT_PATH), "/etc/haproxy/denv"
)


def test_the_certificate_lands_0600_where_the_config_reads_it_before_the_check() -> None:
    steps = plan_balancer(NodeFacts(systemd=True), TLS, PEM)
    assert f"ssl crt {TLS_CERT_PATH}" in TLS.haproxy_cfg
    staged = next(s for s in steps if s.title == "stage the TLS certificate")
    assert staged.file is not None and staged.file.mode == "0600"
    assert staged.file.content == PEM.encode()
    check = next(s for s in steps if "haproxy -c" in s.title)
    assert steps.index(staged) < steps.index(check)
    # The staged config is checked with the staged certificate: `haproxy -c` loads it.
    config = next(s.file for s in steps if s.title == "stage haproxy.cfg")
    assert config is not None
    assert f"ssl crt {staged.file.path}".encode() in config.content
    assert TLS_CERT_PATH.encode() not in config.content
    installed = [c for c in check.commands if c.endswith(f" {TLS_CERT_PATH}")]
    assert installed == [f"install -D -m 0600 -o root -g root {staged.file.path} {TLS_CERT_PATH}"]
    assert check.commands.index(installed[0]) < check.commands.index(check.commands[-1])
    # Rejected or put live, the staged copy goes: one copy of the key on the host.
    assert check.commands[0] == (
        f"haproxy -c -q -f {STAGING}/haproxy.cfg || {{ rm -f {staged.file.path}; false; }}"
    )
    assert check.commands[check.commands.index(installed[0]) + 1] == f"rm -f {staged.file.path}"


def test_the_certificate_never_shows_in_a_title_a_description_or_a_repr() -> None:
    steps = plan_balancer(NodeFacts(systemd=True), TLS, PEM)
    shown = "\n".join(
        [repr(steps), *(line for s in steps for line in s.describe()), *(s.title for s in steps)]
    )
    assert "secretkeymaterial" not in shown and "MIIBcert" not in shown
    assert f"write {STAGING}/tls.pem (mode 0600)" in shown


def _hashes(
    rendered: RenderedConfig, pem: str | None = None, drop_in: bool = True
) -> dict[str, str]:
    files = {f"{rendered.map_dir}/{n}": t for n, t in rendered.files.items()}
    files[CONFIG] = rendered.haproxy_cfg
    if pem is not None:
        files[TLS_CERT_PATH] = pem
    if drop_in:
        files[DROP_IN.path] = DROP_IN.content.decode()
    return {path: hashlib.sha256(text.encode()).hexdigest() for path, text in files.items()}


INSTALLED = {"haproxy": "2.6.12-1+deb12u1"}
ACTIVE = frozenset({"haproxy.service"})


@pytest.mark.parametrize(
    ("facts", "pem", "staged", "last"),
    [
        # The package's own config live (a deploy before the drop-in, or HAProxy installed by
        # hand): restart, so ours serves and systemd makes the socket's folder.
        (NodeFacts(systemd=True, packages=INSTALLED, active_units=ACTIVE), None, True, "restart"),
        (
            NodeFacts(
                systemd=True,
                packages=INSTALLED,
                files=_hashes(TLS, drop_in=False),
                active_units=ACTIVE,
            ),
            None,
            False,
            "restart",
        ),
        # Ours serving, the config changed: a hitless reload.
        (
            NodeFacts(
                systemd=True, packages=INSTALLED, files=_hashes(RENDERED), active_units=ACTIVE
            ),
            None,
            True,
            "reload",
        ),
        # Only the certificate changed: staged, checked and reloaded (HAProxy reads it at load).
        (
            NodeFacts(
                systemd=True, packages=INSTALLED, files=_hashes(TLS, "old"), active_units=ACTIVE
            ),
            PEM,
            True,
            "reload",
        ),
        # Ours in place but HAProxy stopped (it failed, or someone stopped it): started again.
        (
            NodeFacts(systemd=True, packages=INSTALLED, files=_hashes(TLS, PEM)),
            PEM,
            False,
            "restart",
        ),
        (
            NodeFacts(
                systemd=True, packages=INSTALLED, files=_hashes(TLS, PEM), active_units=ACTIVE
            ),
            PEM,
            False,
            None,
        ),
    ],
    ids=[
        "stock-config",
        "no-drop-in",
        "config-changed",
        "certificate-changed",
        "stopped",
        "in-sync",
    ],
)
def test_haproxy_is_restarted_or_reloaded_as_the_facts_say(
    facts: NodeFacts, pem: str | None, staged: bool, last: str | None
) -> None:
    steps = plan_balancer(facts, TLS, pem)
    assert any(s.title.startswith("stage") for s in steps) == staged
    if last is None:
        assert steps == []
    else:
        assert steps[-1].commands[-1] == f"systemctl {last} haproxy.service"
        assert (steps[-1].file == DROP_IN) == (last == "restart")


def test_the_facts_read_every_file_the_plan_compares() -> None:
    # A path left out would read as missing: the plan would restage and restart every run.
    assert set(_hashes(TLS, PEM)) <= set(fact_query(TLS).files)


def test_a_private_file_is_never_readable_by_others_on_its_way_even_through_sudo() -> None:
    (staged,) = [s for s in plan_balancer(NodeFacts(), TLS, PEM) if s.title.endswith("certificate")]
    assert staged.file is not None
    path = staged.file.path
    made, folder, upload, removed, chmod = list(apply_step._inner(staged))[1:]
    # An upload creates a new file world-readable (the login's umask) until the chmod after it.
    assert made == f"install -m 0600 /dev/null {path}"
    # Through sudo it lands first as the SSH user's file, then is copied: in a folder of its own.
    assert isinstance(folder, StringCommand) and folder.connector_arguments == {"_sudo": False}
    mkdir = folder.get_raw_value()
    assert mkdir.startswith("mkdir -m 0700 /tmp/denv-upload-")
    assert isinstance(upload, FileUploadCommand) and upload.dest == path
    assert upload.remote_temp_filename == mkdir.split()[-1] + "/upload"
    assert isinstance(removed, StringCommand) and removed.connector_arguments == {"_sudo": False}
    assert removed.get_raw_value() == f"rm -rf {mkdir.split()[-1]}"
    assert chmod == f"chmod 0600 {path}"
    plain = Step("balancer", "stage haproxy.cfg", file=text_file(CONFIG, "global\n"))
    commands = list(apply_step._inner(plain))
    assert len(commands) == 3 and isinstance(commands[1], FileUploadCommand)
    assert commands[1].remote_temp_filename is None


OVERLAY_CONFIG = (
    "[Interface]\nAddress = 10.99.0.9/16\nListenPort = 51820\n"
    "PrivateKey = yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=\n"
)
ON_OVERLAY = BalancerAccess((), 8405, 51820, ("198.18.0.1",))


def test_a_host_on_the_overlay_brings_it_up_behind_its_firewall_before_haproxy() -> None:
    facts = NodeFacts(systemd=True, packages={"nftables": "1.0.9"})
    steps = plan_host(facts, RENDERED, ON_OVERLAY, overlay_config=OVERLAY_CONFIG)
    areas = [step.area for step in steps]
    assert steps[0].title == "refresh the package index"  # before wireguard-tools
    last_firewall = max(i for i, a in enumerate(areas) if a == "firewall")
    assert last_firewall < areas.index("overlay") < areas.index("balancer")
    assert [s.title for s in steps if s.area == "overlay"] == [
        "install wireguard-tools",
        "write the denv0 config",
        "bring denv0 up",
    ]
    # Off the overlay: no interface, no refresh of its own, HAProxy as before.
    off = plan_host(facts, RENDERED, BalancerAccess((), 8405))
    assert "overlay" not in {s.area for s in off} and off == plan_balancer(facts, RENDERED)


def test_the_client_secret_key_lands_0600_and_the_staged_config_checks_the_staged_copy() -> None:
    signing_key = "client-secret-signing-key-0123456789-abcdef"
    settings = dataclasses.replace(SETTINGS, client_secret_key_file=CLIENT_SECRET_KEY_PATH)
    rendered = render_haproxy_config([POOL], settings, "/etc/haproxy/maps")
    steps = plan_balancer(NodeFacts(systemd=True), rendered, client_secret_key=signing_key)
    (staged,) = [s for s in steps if s.title == "stage the client secret key"]
    assert staged.file is not None and staged.file.mode == "0600"
    assert staged.file.content == key_map(signing_key).encode()
    staged_cfg = next(s for s in steps if s.title == "stage haproxy.cfg").file
    assert staged_cfg is not None
    assert f"map({staged.file.path})".encode() in staged_cfg.content
    assert f"map({CLIENT_SECRET_KEY_PATH})".encode() not in staged_cfg.content
    check = next(s for s in steps if "haproxy -c" in s.title)
    install = f"install -D -m 0600 -o root -g root {staged.file.path} {CLIENT_SECRET_KEY_PATH}"
    assert install in check.commands
    shown = "\n".join([repr(steps), *(line for s in steps for line in s.describe())])
    assert signing_key not in shown and key_map(signing_key).split()[1] not in shown
    # Put live, nothing is staged again.
    live = {**_hashes(rendered), CLIENT_SECRET_KEY_PATH: _sha(key_map(signing_key))}
    facts = NodeFacts(systemd=True, packages=INSTALLED, files=live, active_units=ACTIVE)
    assert plan_balancer(facts, rendered, client_secret_key=signing_key) == []
    assert CLIENT_SECRET_KEY_PATH in fact_query(rendered).files


def test_a_short_client_secret_key_is_refused_in_one_line_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^balancer\.client_secret_key: shorter than 32"):
        key_map("short")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
