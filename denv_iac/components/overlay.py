"""The overlay's keys as resources: one WireGuard key pair per machine, its private half a secret.

A `pulumi.dynamic` resource makes each key when it is created and keeps it in the stack's state,
encrypted as a secret (`additional_secret_outputs`); only the public half is a plain output. It
has nothing to update: rotating a machine's key is replacing its key resource
(`pulumi up --replace <urn>`), and then only the configs of that machine's peers change, since
no config names its own machine's key (see `denv_iac.core.overlay_plan.render_config`).
"""

import base64
from collections.abc import Mapping
from typing import Any, TypedDict

import pulumi
import pulumi.dynamic
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from denv_iac.components.dynamic_resource import DynamicResource
from denv_iac.components.naming import child_name, resolved
from denv_iac.core.overlay_plan import OverlayMember, OverlayPlan, render_config, wireguard_sources

PRIVATE_KEY = "private_key"


def _base64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def new_key_pair() -> tuple[str, str]:
    """A WireGuard key pair, (private, public), base64 as `wg genkey | wg pubkey` writes them."""
    key = X25519PrivateKey.generate()
    return _base64(key.private_bytes_raw()), _base64(key.public_key().public_bytes_raw())


def wireguard_public_key(private_key: str) -> str:
    """The public half of a base64 WireGuard private key."""
    key = X25519PrivateKey.from_private_bytes(base64.b64decode(private_key, validate=True))
    return _base64(key.public_key().public_bytes_raw())


def key_name(member: OverlayMember) -> str:
    """The member's key resource's name: a node's member name, `<site>-balancer-host` for a
    machine made for the balancer (a ':' in a resource name is hard to type in a URN that
    `pulumi up --replace` takes)."""
    if member.node:
        return member.name
    return f"{member.site}-balancer-host"


# Kept in this module under this name: each key's state holds the provider pickled as
# `denv_iac.components.overlay.WireGuardKeyProvider`, and deleting a key unpickles it from there.
class WireGuardKeyProvider(pulumi.dynamic.ResourceProvider):
    """Create makes the key pair; a changed member name is another machine, so a new key."""

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        private, public = new_key_pair()
        outs = {"member": props["member"], PRIVATE_KEY: private, "public_key": public}
        return pulumi.dynamic.CreateResult(id_=str(props["member"]), outs=outs)

    def diff(
        self, _id: str, olds: dict[str, Any], news: dict[str, Any]
    ) -> pulumi.dynamic.DiffResult:
        moved = olds.get("member") != news.get("member")
        return pulumi.dynamic.DiffResult(
            changes=moved, replaces=["member"] if moved else [], delete_before_replace=False
        )


class WireGuardKey(DynamicResource, module="denv", name="WireGuardKey"):
    """One machine's overlay key pair: `private_key` a secret, `public_key` plain."""

    private_key: pulumi.Output[str]
    public_key: pulumi.Output[str]

    def __init__(
        self,
        name: str,
        member: str,
        opts: pulumi.ResourceOptions,
        provider: WireGuardKeyProvider | None = None,
    ) -> None:
        # The private key's slot is a secret from the start, so a preview shows it masked.
        props = {"member": member, PRIVATE_KEY: pulumi.Output.secret(None), "public_key": None}
        secret = pulumi.ResourceOptions(additional_secret_outputs=[PRIVATE_KEY])
        super().__init__(
            provider or WireGuardKeyProvider(),
            name,
            props,
            pulumi.ResourceOptions.merge(opts, secret),
        )


class Overlay(pulumi.ComponentResource):
    """The overlay of a stack: a key per machine and each machine's rendered config."""

    configs: pulumi.Output[dict[str, str]]
    """Each machine's wg-quick config by member name, its private key a placeholder."""
    public_keys: pulumi.Output[dict[str, str]]
    """Each machine's public key by member name."""

    def __init__(
        self,
        name: str,
        plan: OverlayPlan,
        public_addresses: Mapping[str, pulumi.Input[str]],
        opts: pulumi.ResourceOptions | None = None,
    ) -> None:
        super().__init__("denv:index:Overlay", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        keys = {
            m.name: WireGuardKey(child_name(name, key_name(m)), m.name, child) for m in plan.members
        }
        self.private_keys: dict[str, pulumi.Output[str]] = {
            member: pulumi.Output.secret(key.private_key) for member, key in keys.items()
        }
        self.public_keys = resolved({member: key.public_key for member, key in keys.items()})
        addresses = resolved(
            {m.name: public_addresses.get(m.name, m.public_address) for m in plan.members}
        )

        def render(values: list[dict[str, str]]) -> dict[str, str]:
            public, where = values
            return {m.name: render_config(plan, m.name, public, where) for m in plan.members}

        self.configs = pulumi.Output.all(self.public_keys, addresses).apply(render)
        self._plan, self._public_addresses = plan, addresses
        self.register_outputs({"configs": self.configs, "public_keys": self.public_keys})

    def access(self, member: str) -> "MachineOverlay":
        """What `member`'s deploy needs: its config, its private key, and whom its firewall
        admits WireGuard packets from (see denv_iac.core.overlay_plan.wireguard_sources)."""
        plan = self._plan
        return {
            "overlay_config": self.configs.apply(lambda configs: configs[member]),
            "overlay_private_key": self.private_keys[member],
            "overlay_senders": self._public_addresses.apply(
                lambda public: list(wireguard_sources(plan, member, public))
            ),
        }


class MachineOverlay(TypedDict):
    overlay_config: pulumi.Output[str]  # the private key a placeholder
    overlay_private_key: pulumi.Output[str]  # a secret
    overlay_senders: pulumi.Output[list[str]]
