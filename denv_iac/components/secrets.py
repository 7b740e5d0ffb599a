"""Secret fields of the stack config: sealed for validation, kept as Pulumi secrets for use.

`read_stack` checks that every secret field holds `{secure: ...}`; the value inside is the
ciphertext in a stack file and the decrypted material at run time. Components never see it as
plain data: it is taken out, wrapped with `pulumi.Output.secret`, and validation sees a seal.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import pulumi
from cryptography.hazmat.primitives import serialization

from denv_iac.core.stack.fields import is_empty_secret
from denv_iac.core.stack.site_reader import ROBOT_FIELDS

SITE_SECRET_FIELDS = ("ssh_private_key", "api_key", "kubeconfig", *ROBOT_FIELDS)
BALANCER_SECRET_FIELDS = ("tls_certificate", "client_secret_key")
_SEAL = "sealed"

# (site name, "balancer" or recipe_owner(recipe), field) -> the secret's value
SecretValues = dict[tuple[str, str], pulumi.Output[str]]


def recipe_owner(recipe: str) -> str:
    """The owner of a recipe's secrets in SecretValues; its fields are `env_field(name)`."""
    return f"recipes.{recipe}"


def env_field(variable: str) -> str:
    return f"env.{variable}"


def recipe_env_secrets(secrets: SecretValues, recipe: str) -> dict[str, pulumi.Output[str]]:
    """A recipe's `secure:` env values by variable name, each a secret Output."""
    owner, prefix = recipe_owner(recipe), env_field("")
    return {
        field.removeprefix(prefix): value
        for (who, field), value in secrets.items()
        if who == owner and field.startswith(prefix)
    }


def _seal(value: Mapping[str, Any]) -> dict[str, Any]:
    # An empty secret stays as given, for read_stack to refuse as `denv plan` does.
    return dict(value) if is_empty_secret(value) else {"secure": _SEAL}


def _take(owner: str, raw: Mapping[str, Any], fields: tuple[str, ...], found: SecretValues) -> Any:
    sealed = dict(raw)
    for field in fields:
        value = raw.get(field)
        if isinstance(value, Mapping) and set(value) == {"secure"}:
            found[(owner, field)] = pulumi.Output.secret(value["secure"])
            sealed[field] = _seal(value)
    return sealed


def _take_env(recipe: Any, found: SecretValues) -> Any:
    env = recipe.get("env") if isinstance(recipe, Mapping) else None
    if not isinstance(env, Mapping):
        return recipe
    sealed = dict(env)
    for variable, value in env.items():
        if isinstance(value, Mapping) and set(value) == {"secure"}:
            owner = recipe_owner(str(recipe.get("name", "")))
            found[(owner, env_field(str(variable)))] = pulumi.Output.secret(value["secure"])
            sealed[variable] = _seal(value)
    return {**recipe, "env": sealed}


def seal_secrets(
    sites: Sequence[Any], balancer: Mapping[str, Any], recipes: Sequence[Any] = ()
) -> tuple[list[Any], dict[str, Any], list[Any], SecretValues]:
    """The config with every `{secure: value}` sealed, and those values as secrets.

    Anything that is not a mapping is passed through untouched for `read_stack` to report.
    """
    found: SecretValues = {}
    sealed_recipes = [_take_env(recipe, found) for recipe in recipes]
    sealed_sites = [
        _take(str(site.get("name", "")), site, SITE_SECRET_FIELDS, found)
        if isinstance(site, Mapping)
        else site
        for site in sites
    ]
    sealed_balancer = (
        _take("balancer", balancer, BALANCER_SECRET_FIELDS, found)
        if isinstance(balancer, Mapping)
        else balancer
    )
    return sealed_sites, sealed_balancer, sealed_recipes, found


def with_secret_fields(plain: Any, secret: pulumi.Output[Any], fields: tuple[str, ...]) -> Any:
    """A config mapping whose secret fields are taken from the secret read of the same key.

    A stack program needs the structure at once (it decides how many resources exist), so it
    reads the key plainly; every secret field is replaced by its value from the secret read,
    which stays a secret Output. Anything but a mapping is left for `read_stack` to report.
    """
    if not isinstance(plain, Mapping):
        return plain
    sealed = dict(plain)
    for field in fields:
        if field in sealed:
            sealed[field] = {"secure": secret.apply(_secret_field(field))}
    return sealed


def with_secret_sites(plain: Any, secret: pulumi.Output[Any]) -> Any:
    """`with_secret_fields` for each site of the `denv:sites` list."""
    if not isinstance(plain, list):
        return plain
    return [
        with_secret_fields(site, secret.apply(_item(index)), SITE_SECRET_FIELDS)
        for index, site in enumerate(plain)
    ]


def with_secret_recipes(plain: Any, secret: pulumi.Output[Any], declared: Any = None) -> Any:
    """The `denv:recipes` list with each `secure:` env value taken from the secret read.

    Pulumi hands a program its structured config decrypted, so a `secure:` env value reads as
    plain text and only the stack file still says which values were secure: `declared` is the
    recipes list as written there. Without it every env value is taken as a secret, so none
    can leak, at the cost of previews that hide the plain ones too.
    """
    if not isinstance(plain, list):
        return plain
    recipes = []
    for index, recipe in enumerate(plain):
        env = recipe.get("env") if isinstance(recipe, Mapping) else None
        if not isinstance(env, Mapping):
            recipes.append(recipe)
            continue
        secure = _secure_names(env) | (
            _secure_names(_env_at(declared, index)) if declared is not None else set(env)
        )
        secret_env = secret.apply(_item(index)).apply(_field("env"))
        sealed = {
            variable: {"secure": secret_env.apply(_secret_field(variable))}
            if variable in secure
            else value
            for variable, value in env.items()
        }
        recipes.append({**recipe, "env": sealed})
    return [_seal_canary_env(recipe, declared, index) for index, recipe in enumerate(recipes)]


def _seal_canary_env(recipe: Any, declared: Any, index: int) -> Any:
    """A canary holds no secret of its own (read_stack refuses one, naming it), so a `secure:`
    value of its env, decrypted here by Pulumi, is sealed: never seen as plain text."""
    canary = recipe.get("canary") if isinstance(recipe, Mapping) else None
    if not isinstance(canary, Mapping) or not isinstance(canary.get("env"), Mapping):
        return recipe
    env = canary["env"]
    written = _env_at(declared, index, "canary") if declared is not None else None
    secure = _secure_names(written) if declared is not None else set(env)
    sealed = {name: {"secure": _SEAL} if name in secure else v for name, v in env.items()}
    return {**recipe, "canary": {**canary, "env": sealed}}


def _env_at(recipes: Any, index: int, block: str = "") -> Any:
    """The env of recipe `index` as written, or of its `block` (`canary`) when named."""
    if isinstance(recipes, list) and index < len(recipes) and isinstance(recipes[index], Mapping):
        owner = recipes[index].get(block) if block else recipes[index]
        return owner.get("env") if isinstance(owner, Mapping) else None
    return None


def _secure_names(env: Any) -> set[str]:
    if not isinstance(env, Mapping):
        return set()
    return {
        str(name)
        for name, value in env.items()
        if isinstance(value, Mapping) and set(value) == {"secure"}
    }


def _field(key: str) -> Any:
    def pick(raw: Any) -> Any:
        return raw[key]

    return pick


def _item(index: int) -> Any:
    def pick(items: Any) -> Any:
        return items[index]

    return pick


def _secret_field(field: str) -> Any:
    def pick(raw: Any) -> str:
        value = raw[field]
        # The decrypted value at run time; `{secure: ...}` where config is given as in the file.
        return str(value["secure"] if isinstance(value, Mapping) else value)

    return pick


def public_key_of(private_key: str) -> str:
    """The OpenSSH public key of a private key (OpenSSH or PEM format, no passphrase)."""
    data = private_key.encode()
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key: Any = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        # The key itself must never reach an error message.
        raise ValueError(
            "ssh_private_key: not an unencrypted OpenSSH or PEM private key; set it with "
            "'pulumi config set --secret' from the key file"
        ) from None
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return str(public.decode())


def public_key_output(private_key: pulumi.Output[str]) -> pulumi.Output[str]:
    """The public half of a secret SSH key, as a plain Output.

    The public half is no secret; leaving it marked would hide it in every preview.
    """
    return pulumi.Output.unsecret(private_key.apply(public_key_of))
