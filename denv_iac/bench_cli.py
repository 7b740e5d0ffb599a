"""`denv bench`: time to first token through an endpoint, the figure voice needs."""

import asyncio
import json
import os
import sys
from pathlib import Path

import click
from rich.table import Table

from denv_iac.console import wide_console
from denv_iac.loadgen import run_load


@click.command()
@click.argument("url")
@click.option("--pool", required=True, help="The pool (OpenAI model name) to load.")
@click.option("--concurrency", type=click.IntRange(1, 1024), default=8, show_default=True)
@click.option("--duration", type=click.FloatRange(0.1, 3600), help="Seconds of load.")
@click.option("--requests", type=click.IntRange(1, 10_000_000), help="Number of requests.")
@click.option(
    "--session-turns",
    type=click.IntRange(0, 1000),
    default=0,
    help="Turns per sticky conversation (X-Denv-Session); 0 for none.",
)
@click.option(
    "--api-key-env",
    default="DENV_API_KEY",
    show_default=True,
    help="Environment variable holding the endpoint's API key, if it needs one.",
)
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Write the summary as JSON to FILE ('-' for standard output).",
)
def bench(
    url: str,
    pool: str,
    concurrency: int,
    duration: float | None,
    requests: int | None,
    session_turns: int,
    api_key_env: str,
    json_file: str | None,
) -> None:
    """Streamed completions against URL; TTFT p50/p90/p99, inter-token gap, errors by kind."""
    if not url.startswith(("http://", "https://")):
        click.echo(
            f"error: URL: {url!r} is not an http(s) URL; e.g. http://127.0.0.1:8080", err=True
        )
        sys.exit(2)
    if duration is None and requests is None:
        duration = 10.0
    report = asyncio.run(
        run_load(
            url.rstrip("/"),
            pool,
            concurrency=concurrency,
            duration_s=duration,
            requests=requests,
            session_turns=session_turns,
            api_key=os.environ.get(api_key_env),
        )
    )
    summary = report.summary()
    if json_file == "-":
        click.echo(json.dumps(summary, indent=2))
        return
    table = Table(title=f"{url} pool {pool}, concurrency {concurrency}", title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    wide_console().print(table)
    if json_file:
        Path(json_file).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if summary["ok"] == 0:
        sys.exit(1)
