"""The SSH login's authorized keys: the stack's current key in, keys it rotated away from out.

A machine's provider reads its SSH keys only when it creates the machine (Lambda, EC2 and hcloud
alike): changing the key there would replace the machine, a billed GPU and its warm caches. The
stack's key is therefore kept on running machines here, by the deploy that already logs in with
it: a rotated key is added to the login's authorized_keys, and the key it replaces is removed.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from denv_iac.node.facts import FactQuery, NodeFacts
from denv_iac.node.steps import Step


@dataclass(frozen=True)
class SshKeys:
    """The login the deploy comes in as, the public key it must accept, the ones to remove."""

    user: str
    key: str  # an OpenSSH public key line: type, base64 blob, optional comment
    retired: tuple[str, ...] = ()  # public keys the stack used before

    def entry(self, public_key: str) -> str:
        """`user:blob`, as the fact probe reports a key found in the login's authorized_keys."""
        return f"{self.user}:{key_blob(public_key)}"


def key_blob(public_key: str) -> str:
    """The base64 part of an OpenSSH public key, what identifies it whatever its comment."""
    fields = public_key.split()
    return fields[1] if len(fields) > 1 else public_key.strip()


def fact_query(keys: SshKeys | None) -> FactQuery:
    if keys is None:
        return FactQuery()
    return FactQuery(ssh_keys=tuple(keys.entry(k) for k in (keys.key, *keys.retired)))


def _file(user: str) -> str:
    """Shell words that set `f` to the login's authorized_keys, made 0600 and its own."""
    quoted = shlex.quote(user)
    return (
        f'h=$(getent passwd {quoted} | cut -d: -f6) && [ -n "$h" ] && '
        f'install -d -m 0700 -o {quoted} -g "$(id -gn {quoted})" "$h/.ssh" && '
        f'f="$h/.ssh/authorized_keys" && touch "$f" && '
        f'chown {quoted}: "$f" && chmod 0600 "$f"'
    )


def plan(facts: NodeFacts, keys: SshKeys | None) -> list[Step]:
    """Authorize the stack's key where it is missing; remove retired keys still there."""
    if keys is None:
        return []
    current = key_blob(keys.key)
    add = keys.entry(keys.key) not in facts.ssh_keys
    remove = sorted(
        {
            key_blob(k)
            for k in keys.retired
            if keys.entry(k) in facts.ssh_keys and key_blob(k) != current
        }
    )
    if not add and not remove:
        return []
    commands = [_file(keys.user)]
    if add:
        commands.append(f'printf "%s\\n" {shlex.quote(keys.key.strip())} >> "$f"')
    for blob in remove:
        # Rewritten in place (cat, not mv): the file keeps its owner, mode and inode.
        commands.append(
            f'{{ grep -vF -- {shlex.quote(blob)} "$f" || true; }} > "$f.denv" && '
            f'cat "$f.denv" > "$f" && rm -f "$f.denv"'
        )
    what = " and ".join(
        part
        for part in (
            "authorize the stack's key" if add else "",
            f"remove {len(remove)} retired key(s)" if remove else "",
        )
        if part
    )
    return [Step("ssh", f"{what} for {keys.user}", (" && ".join(commands),))]
