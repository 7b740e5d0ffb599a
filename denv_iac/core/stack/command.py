"""A recipe's `command`, with what only the runner of a replica knows put in its place.

A command is an argument vector written once for every site. Two placeholders stand for what
the recipe cannot know: `{port}`, the port the replica must listen on (on a local site a free
port the runner picks; on a node the port the deploy gives the replica's GPU and slice, also in
`$PORT`; on Kubernetes the recipe's `port`), and `{host}`, the address to listen on (on a local
site the site's address; elsewhere every address, 0.0.0.0, which the firewall guards). Each is
replaced wherever it occurs in an argument (`--port={port}` too); no other text is touched, so an
argument that carries JSON passes as written.
"""

from collections.abc import Sequence

PORT_PLACEHOLDER = "{port}"
HOST_PLACEHOLDER = "{host}"
# Where a node's or a pod's replica listens: every address of its machine or pod.
ANY_ADDRESS = "0.0.0.0"


def render_command(command: Sequence[str], *, port: int, host: str) -> tuple[str, ...]:
    """The argument vector to run, with `{port}` and `{host}` replaced."""
    return tuple(
        argument.replace(PORT_PLACEHOLDER, str(port)).replace(HOST_PLACEHOLDER, host)
        for argument in command
    )
