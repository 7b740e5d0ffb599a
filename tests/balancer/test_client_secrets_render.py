"""Realtime client secrets in the rendered config: the rules appear only when asked for, carry
no key material, pass `haproxy -c`, and read the secrets the balancer mints."""

from __future__ import annotations

import base64
import dataclasses
import re
from pathlib import Path

import pytest

from denv_iac.core.balancer import BalancerConfigError, BalancerSettings, render_haproxy_config
from denv_iac.core.balancer import client_secrets as ek
from denv_iac.core.balancer.key_checks import CLIENT_SECRET_OFFERED
from denv_iac.haproxy import check_haproxy_config

from .sample_pools import MAP_DIR, POOLS, SCOPED_SETTINGS

KEY = "a-signing-key-of-at-least-thirty-two-characters"
MAC = ek.signature(KEY, "voice", 1_800_000_000)
SECRET = ek.client_secret(KEY, "voice", 1_800_000_000)
KEY_FILE = "/etc/haproxy/denv/client-secret.map"
WITH_SECRETS = dataclasses.replace(
    SCOPED_SETTINGS, tls_cert_path=None, client_secret_key_file=KEY_FILE
)


# The Sec-WebSocket-Protocol a client sends -> (pool, expiry, mac) read from it, or None.
OFFERED = {
    f"realtime, openai-insecure-api-key.{SECRET}": ("voice", "1800000000", MAC),
    f"openai-insecure-api-key.{SECRET},realtime": ("voice", "1800000000", MAC),
    f"openai-insecure-api-key.{SECRET}": ("voice", "1800000000", MAC),
    f"realtime, openai-insecure-api-key.ek_llm-8b.1.{MAC}, x": ("llm-8b", "1", MAC),
    f"realtime, openai-insecure-api-key.ek_pool.v2.1.{MAC}": ("pool.v2", "1", MAC),
    "realtime": None,
    "realtime, openai-insecure-api-key.sk-denv-example": None,  # a key, not a secret
    f"realtime, openai-insecure-api-key.{SECRET}0": None,  # a mac one digit long
    f"realtime, openai-insecure-api-key.{SECRET[:-1]}": None,
    f"realtime, openai-insecure-api-key.{SECRET.upper()}": None,
    f"realtime, xopenai-insecure-api-key.{SECRET}": None,
    f"realtime, openai-insecure-api-key.ek_voice.soon.{MAC}": None,
}


@pytest.mark.parametrize("header", sorted(OFFERED))
def test_the_offered_subprotocols_give_pool_expiry_and_mac(header: str) -> None:
    found = re.match(CLIENT_SECRET_OFFERED, header)
    assert (found.groups() if found else None) == OFFERED[header]


@pytest.mark.parametrize(
    ("settings", "present"),
    [(WITH_SECRETS, True), (dataclasses.replace(WITH_SECRETS, client_secret_key_file=None), False)],
)
def test_the_rules_are_rendered_only_with_a_key_file(
    settings: BalancerSettings, present: bool
) -> None:
    rendered = render_haproxy_config(POOLS, settings, MAP_DIR)
    config = rendered.haproxy_cfg
    assert (f"map({KEY_FILE})" in config) is present
    assert (f"path {ek.CLIENT_SECRETS_PATH}" in config) is present
    assert ("hmac(sha256,txn.ek_key)" in config) is present
    # The key file is the host's, never a rendered file; the subprotocol is stripped either way.
    assert all(not name.startswith("client-secret") for name in rendered.files)
    assert "set-header Sec-WebSocket-Protocol realtime if" in config


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (
            BalancerSettings(client_secret_key_file=KEY_FILE),
            "settings.client_secret_key_file",
        ),
        (
            dataclasses.replace(WITH_SECRETS, client_secret_key_file="/etc/key file"),
            "settings.client_secret_key_file",
        ),
    ],
)
def test_bad_client_secret_settings_name_the_field(settings: BalancerSettings, field: str) -> None:
    with pytest.raises(BalancerConfigError) as error:
        render_haproxy_config(POOLS, settings, MAP_DIR)
    assert error.value.field == field
    assert "\n" not in str(error.value)


@pytest.mark.needs_haproxy
def test_the_client_secret_rules_pass_haproxy_check(tmp_path: Path) -> None:
    key_file = tmp_path / "client-secret.map"
    key_file.write_text(ek.key_map(KEY))
    settings = dataclasses.replace(WITH_SECRETS, client_secret_key_file=str(key_file))
    check_haproxy_config(render_haproxy_config(POOLS, settings, MAP_DIR), tmp_path)


def test_the_key_file_holds_the_key_base64_under_one_entry() -> None:
    entry, value = ek.key_map(KEY).split()
    assert entry == ek.KEY_MAP_ENTRY
    assert base64.b64decode(value) == KEY.encode()
    assert ek.key_map(KEY).endswith("\n") and KEY not in ek.key_map(KEY)


def test_a_client_offers_realtime_and_the_secret() -> None:
    assert ek.subprotocols(SECRET) == ["realtime", f"openai-insecure-api-key.{SECRET}"]
