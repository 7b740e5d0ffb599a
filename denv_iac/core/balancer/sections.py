"""How denv-iac writes every HAProxy config it renders (the endpoint's and each Kubernetes
gateway's): sections, the header, addresses, quoted config words and the text agent checks
send."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

INDENT = "    "
LOG_STDOUT = "log stdout format raw local0"
# Every TLS hop of a stack (balancer to gateway) speaks TLS 1.3 alone.
TLS_MIN_VERSION = "ssl-min-ver TLSv1.3"


def section(title: str, comments: Iterable[str], lines: Iterable[str]) -> str:
    """`title` and its indented `lines` (an empty one stays empty), after `comments`."""
    body = [f"# {comment}" for comment in comments]
    body.append(title)
    body.extend(f"{INDENT}{line}" if line else "" for line in lines)
    return "\n".join(body) + "\n"


def header(subject: str, change: str) -> list[str]:
    """The comments that open a rendered config: what it configures, and what to change instead
    of editing it."""
    return [
        f"HAProxy configuration of the denv {subject}, rendered by denv-iac.",
        f"Change {change} and render again; edits here are overwritten.",
    ]


def host_port(address: str, port: int) -> str:
    """An address and port as a `bind` or `server` line takes them: IPv6 in brackets."""
    try:
        is_v6 = ipaddress.ip_address(address).version == 6
    except ValueError:
        is_v6 = False
    return f"[{address}]:{port}" if is_v6 else f"{address}:{port}"


def duration(seconds: int) -> str:
    """A timer of whole seconds as HAProxy reads it: in minutes when it is whole minutes."""
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def agent_send(replica_id: str) -> str:
    """What an agent check sends, as a quoted config string: the replica id and a newline."""
    return f'"{replica_id}\\n"'


def config_word(text: str) -> str:
    """One config word in double quotes: a backslash, a quote or a `$` stays literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'"{escaped}"'
