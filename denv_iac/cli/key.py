"""`denv key`: API keys for the endpoint, of which only the digests go into stack config."""

import hashlib
import sys

import click

from denv_iac.cli.console import fail


@click.group()
def key() -> None:
    """API keys for the endpoint (only their digests go into stack config)."""


@key.command()
def digest() -> None:
    """Read an API key on standard input and print its SHA-256 digest for api_key_digests."""
    # Bytes, not text: a key is whatever its owner typed, in any encoding, and is hashed as is.
    # One key, one line: a trailing newline (echo's) is not part of it, and a second line is
    # refused rather than silently left out of the digest.
    lines = sys.stdin.buffer.read().strip().splitlines()
    if len(lines) > 1:
        fail(
            [
                f"stdin: {len(lines)} lines given, and a key is one line; pipe one key at a "
                'time, e.g. `printf %s "$KEY" | denv key digest`'
            ]
        )
    secret = lines[0].strip() if lines else b""
    if not secret:
        fail(['stdin: no API key given; pipe one in, e.g. `printf %s "$KEY" | denv key digest`'])
    click.echo(hashlib.sha256(secret).hexdigest())
