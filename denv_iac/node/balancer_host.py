"""The balancer host: HAProxy installed, config, maps and certificate put, checked, made live."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from denv_iac.core.balancer.client_secrets import key_map
from denv_iac.core.balancer.files import CONFIG_FILE_NAME, relocate_maps
from denv_iac.core.balancer.model import (
    CLIENT_SECRET_KEY_PATH,
    GATEWAY_CA_PATH,
    GATEWAY_CLIENT_PATH,
    STATS_SOCKET,
    TLS_CERT_PATH,
    RenderedConfig,
)
from denv_iac.node import firewall, ssh_keys, wireguard
from denv_iac.node.deploy import Progress, Target, connect, quiet_progress
from denv_iac.node.facts import FactQuery, NodeFacts
from denv_iac.node.firewall import BalancerAccess
from denv_iac.node.ssh_keys import SshKeys
from denv_iac.node.steps import (
    APT_UPDATE,
    UNIT_DIR,
    FileContent,
    Step,
    apt_install,
    cloud_init_wait,
    text_file,
    with_package_index,
)

CONFIG = "/etc/haproxy/haproxy.cfg"
STAGING = "/etc/haproxy/denv-staged"
UNIT = "haproxy.service"
RUN_DIR = posixpath.dirname(STATS_SOCKET)
# systemd makes the stats socket's folder at each start (and removes it at stop): /run is a
# tmpfs, so a folder made once by the deploy would be gone after a reboot.
DROP_IN = text_file(
    f"{UNIT_DIR}/{UNIT}.d/denv.conf",
    "# Written by denv-iac: the folder of HAProxy's stats socket.\n"
    f"[Service]\nRuntimeDirectory={posixpath.relpath(RUN_DIR, '/run')}\n",
)


@dataclass(frozen=True)
class GatewayCredentials:
    """What the balancer needs to reach Kubernetes gateways over mutual TLS."""

    ca: str  # the stack's gateway CA certificate (PEM)
    client: str  # the balancer's client certificate and key (PEM), a secret

    def __repr__(self) -> str:
        return "GatewayCredentials(ca=..., client=[secret])"


def _live_files(rendered: RenderedConfig) -> dict[str, str]:
    files = {posixpath.join(rendered.map_dir, name): text for name, text in rendered.files.items()}
    files[CONFIG] = rendered.haproxy_cfg
    return files


def _certificate_file(path: str, pem: str) -> FileContent:
    # Root's only: the private key is in it. HAProxy reads it as root, before dropping privileges.
    return text_file(path, pem if pem.endswith("\n") else pem + "\n", "0600")


def fact_query(rendered: RenderedConfig) -> FactQuery:
    paths = [
        *_live_files(rendered),
        TLS_CERT_PATH,
        GATEWAY_CA_PATH,
        GATEWAY_CLIENT_PATH,
        CLIENT_SECRET_KEY_PATH,
    ]
    paths.append(DROP_IN.path)
    return FactQuery(files=tuple(sorted(paths)), units=(UNIT,))


def _private_files(
    certificate: str | None, gateway: GatewayCredentials | None, client_secret_key: str | None
) -> dict[str, tuple[str, str]]:
    """Live path -> (what it is, content) of each file HAProxy reads keys or CAs from."""
    files = {}
    if client_secret_key is not None:
        files[CLIENT_SECRET_KEY_PATH] = ("client secret key", key_map(client_secret_key))
    if certificate is not None:
        files[TLS_CERT_PATH] = ("TLS certificate", certificate)
    if gateway is not None:
        files[GATEWAY_CA_PATH] = ("gateway CA", gateway.ca)
        files[GATEWAY_CLIENT_PATH] = ("gateway client certificate", gateway.client)
    return files


def plan_balancer(
    facts: NodeFacts,
    rendered: RenderedConfig,
    certificate: str | None = None,
    gateway: GatewayCredentials | None = None,
    client_secret_key: str | None = None,
) -> list[Step]:
    """Steps that put `rendered` live; [] when the node serves exactly it already.

    `certificate` is the endpoint's PEM (certificate and key), a secret: it lands 0600 at
    TLS_CERT_PATH, where the config's `ssl crt` reads it, and is never shown in a step.
    `gateway` (the gateway CA, and the client certificate and key, a secret) lands the same way
    at GATEWAY_CA_PATH and GATEWAY_CLIENT_PATH, where the gateways' server lines read them.
    `client_secret_key` (a secret) lands the same way at CLIENT_SECRET_KEY_PATH, as the map
    file the config reads to sign and check realtime client secrets.
    The new files are staged and checked with `haproxy -c` first: a config HAProxy rejects
    never replaces the live one, and the running HAProxy keeps serving the old one. HAProxy
    is restarted when its unit changed or it may serve another config (the package's own, just
    installed, starts at once), else reloaded without dropping a stream.
    """
    steps: list[Step] = []
    if "haproxy" not in facts.packages:
        commands = (APT_UPDATE, apt_install("haproxy"))
        steps.append(Step("balancer", "install haproxy", commands))
    live = {path: text_file(path, text) for path, text in _live_files(rendered).items()}
    private = _private_files(certificate, gateway, client_secret_key)
    for path, (_, pem) in private.items():
        live[path] = _certificate_file(path, pem)
    files_live = all(facts.files.get(path) == file.sha256 for path, file in live.items())
    unit_ready = facts.files.get(DROP_IN.path) == DROP_IN.sha256
    # Ours is what serves only if the unit runs and was restarted with our drop-in: the drop-in
    # is written by the step that restarts it, after our config is in place.
    ours_serving = facts.systemd and UNIT in facts.active_units and unit_ready
    if files_live and unit_ready and (ours_serving or not facts.systemd):
        return steps
    if not files_live:
        steps += _put_live(rendered, private)
    if not facts.systemd:
        if not unit_ready:  # no service manager to tell: the unit reads it when systemd starts
            steps.append(Step("balancer", "HAProxy's runtime directory", file=DROP_IN))
    elif ours_serving:
        # Master-worker reload: new workers take new connections, old ones finish their streams.
        steps.append(Step("balancer", "reload HAProxy (hitless)", (f"systemctl reload {UNIT}",)))
    else:
        steps.append(
            Step(
                "balancer",
                "restart HAProxy with its runtime directory and the config put live",
                (
                    "systemctl daemon-reload",
                    f"systemctl enable {UNIT}",
                    f"systemctl restart {UNIT}",
                ),
                file=DROP_IN,
            )
        )
    return steps


def _put_live(rendered: RenderedConfig, private: dict[str, tuple[str, str]]) -> list[Step]:
    """Stage the files, check the staged config, then install each at its live path."""
    staged = relocate_maps(rendered, STAGING)
    staged_config = staged.haproxy_cfg
    steps = [
        Step("balancer", f"stage map {name}", file=text_file(f"{STAGING}/{name}", text))
        for name, text in sorted(staged.files.items())
    ]
    config_path = posixpath.join(STAGING, CONFIG_FILE_NAME)
    check = f"haproxy -c -q -f {config_path}"
    install = [
        f"install -D -m 0644 {STAGING}/{name} {posixpath.join(rendered.map_dir, name)}"
        for name in sorted(rendered.files)
    ]
    staged_private = []
    for live_path, (what, pem) in private.items():
        # `haproxy -c` loads certificates and CAs too: the staged config reads the staged ones.
        staged_path = f"{STAGING}/{posixpath.basename(live_path)}"
        # A path is a word of its own (`ssl crt PATH`) or a map's argument (`map(PATH)`).
        staged_config = re.sub(
            f"(?<=[ (]){re.escape(live_path)}(?=[\\s)])", staged_path, staged_config
        )
        steps.append(
            Step("balancer", f"stage the {what}", file=_certificate_file(staged_path, pem))
        )
        staged_private.append(staged_path)
        install += [
            f"install -D -m 0600 -o root -g root {staged_path} {live_path}",
            f"rm -f {staged_path}",
        ]
    if staged_private:
        # One copy of each key on the host, whether the config is put live or rejected.
        check += f" || {{ rm -f {' '.join(staged_private)}; false; }}"
    steps.append(Step("balancer", "stage haproxy.cfg", file=text_file(config_path, staged_config)))
    # The live config refers to the live paths; only its staged twin was checked.
    config_file = text_file(f"{STAGING}/live.cfg", rendered.haproxy_cfg)
    steps.append(
        Step(
            "balancer",
            "check the staged config (haproxy -c), then put it live",
            (
                check,
                *install,
                f"install -m 0644 {config_file.path} {CONFIG}",
            ),
            file=config_file,
        )
    )
    return steps


def plan_host(
    facts: NodeFacts,
    rendered: RenderedConfig,
    access: BalancerAccess,
    certificate: str | None = None,
    gateway: GatewayCredentials | None = None,
    overlay_config: str | None = None,
    keys: SshKeys | None = None,
    client_secret_key: str | None = None,
) -> list[Step]:
    """A balancer host's steps: a wait for cloud-init's first boot when it still runs, the SSH
    login's keys (`keys`, when given), its firewall, then its overlay interface (when it is on
    the overlay), then HAProxy, which reaches the nodes through that interface."""
    steps = ssh_keys.plan(facts, keys) + firewall.plan_balancer_host(facts, access)
    steps += wireguard.plan(facts, overlay_config)
    # cloud-init's first boot installs packages and writes files too: it finishes first.
    return (
        cloud_init_wait(facts.cloud_init)
        + with_package_index(steps)
        + plan_balancer(facts, rendered, certificate, gateway, client_secret_key)
    )


def prepare_balancer(
    target: Target,
    rendered: RenderedConfig,
    access: BalancerAccess,
    certificate: str | None = None,
    gateway: GatewayCredentials | None = None,
    dry: bool = False,
    progress: Progress = quiet_progress,
    overlay_config: str | None = None,
    keys: SshKeys | None = None,
    client_secret_key: str | None = None,
    ssh_wait_s: float = 0.0,
) -> list[Step]:
    """Converge a balancer host to `rendered` (and its TLS `certificate`, a secret PEM, and the
    `gateway` credentials) behind its firewall; returns the steps planned (run unless `dry`).
    The firewall comes first: the stats port never listens unguarded. `overlay_config`: the
    host's WireGuard config, its private key filled in (a secret), when it is on the overlay.
    `client_secret_key`: the key that signs realtime client secrets (a secret), when on.
    `ssh_wait_s`: how long to wait for a machine just created to answer on its SSH port."""
    with connect(target, ssh_wait_s) as session:
        query = fact_query(rendered) | firewall.balancer_fact_query() | wireguard.fact_query()
        facts = session.facts(query | ssh_keys.fact_query(keys))
        steps = plan_host(
            facts, rendered, access, certificate, gateway, overlay_config, keys, client_secret_key
        )
        if not dry:
            session.apply(steps, progress)
        return steps
