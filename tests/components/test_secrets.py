"""Secret fields: sealed for validation, carried as Pulumi secrets, public keys derived."""

import asyncio
from typing import Any

import pulumi
import pytest
from cryptography.hazmat.primitives import serialization

from denv_iac.components.secrets import public_key_of, seal_secrets, with_secret_fields
from tests.components import stacks
from tests.components.harness import run_program


def _secret_flag(output: pulumi.Output[Any]) -> pulumi.Output[Any]:
    return pulumi.Output.from_input(asyncio.ensure_future(output.is_secret()))


def test_seal_secrets_takes_every_secure_value_out_as_a_secret() -> None:
    args = stacks.multicloud()
    found: dict[tuple[str, str], Any] = {}

    def program() -> dict[str, pulumi.Output[Any]]:
        sites, balancer, _, secrets = seal_secrets(args["sites"], args["balancer"])
        found.update(secrets)
        assert all(site["ssh_private_key"] == {"secure": "sealed"} for site in sites)
        assert balancer["tls_certificate"] == {"secure": "sealed"}
        return {
            f"{owner}/{field}": pulumi.Output.all(value, _secret_flag(value))
            for (owner, field), value in secrets.items()
        }

    run = run_program(program, preview=False)
    assert sorted(found) == sorted(
        [(site, "ssh_private_key") for site in stacks.SSH_KEYS] + [("balancer", "tls_certificate")]
    )
    assert run.outputs["balancer/tls_certificate"] == [stacks.TLS_CERTIFICATE, True]
    assert run.outputs["office/ssh_private_key"] == [stacks.SSH_KEYS["office"], True]


def test_plain_text_where_a_secret_belongs_is_left_for_validation_to_report() -> None:
    sites, _, _, secrets = seal_secrets([{"name": "s", "ssh_private_key": "plain"}, "junk"], {})
    assert sites == [{"name": "s", "ssh_private_key": "plain"}, "junk"]
    assert secrets == {}


def test_with_secret_fields_reads_each_from_the_secret_config() -> None:
    def program() -> dict[str, pulumi.Output[Any]]:
        secret = pulumi.Output.secret({"port": 443, "tls_certificate": "pem-material"})
        sealed = with_secret_fields(
            {"port": 443, "tls_certificate": "pem-material"}, secret, ("tls_certificate",)
        )
        assert sealed["port"] == 443
        value = sealed["tls_certificate"]["secure"]
        return {"value": value, "secret": _secret_flag(value)}

    run = run_program(program, preview=False)
    assert run.outputs == {"secret": True, "value": "pem-material"}


def test_public_key_of_pem_and_openssh_private_keys() -> None:
    public = public_key_of(stacks.SSH_KEYS["aws-use1"])
    assert public.startswith("ssh-ed25519 ")
    key = serialization.load_pem_private_key(stacks.SSH_KEYS["aws-use1"].encode(), None)
    openssh = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()
    assert public_key_of(openssh) == public


def test_a_bad_private_key_is_reported_without_its_contents() -> None:
    with pytest.raises(ValueError) as error:
        public_key_of(
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LW1hdGVyaWFs\n-----END PRIVATE KEY-----"
        )
    assert "ssh_private_key" in str(error.value)
    assert "c2VjcmV0" not in str(error.value)
