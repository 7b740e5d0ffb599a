"""`denv bench`: the latency voice needs through an endpoint (time to first token, to first audio
byte, to transcript), optionally against the replicas called directly in the same run."""

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from denv_iac.cli.console import (
    API_KEY_ENV,
    fail,
    output_file_problems,
    wide_console,
    write_output,
)
from denv_iac.ops.loadgen import run_load
from denv_iac.ops.loadgen_arrivals import open_loop_problems
from denv_iac.ops.loadgen_report import FIGURES, PROTOCOLS, QUANTILES, LoadReport, Protocol

TICK_S = 0.2


async def _with_progress(
    load: Coroutine[Any, Any, LoadReport], what: str, duration_s: float | None
) -> LoadReport:
    """Run the load under a progress line on stderr (a bar when the run has a duration)."""
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if duration_s is not None:
        columns.append(BarColumn())
    progress = Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    start = time.perf_counter()
    with progress:
        task = progress.add_task(what, total=duration_s)
        job = asyncio.ensure_future(load)
        while not job.done():
            await asyncio.wait({job}, timeout=TICK_S)
            progress.update(task, completed=time.perf_counter() - start)
    return job.result()


def _url_problems(url: str) -> list[str]:
    example = "e.g. http://127.0.0.1:8080"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        return [f"URL: {url!r} is not a valid URL ({error}); {example}"]
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return [f"URL: {url!r} is not an http(s) URL with a host; {example}"]
    return []


def _summary_line(protocol: Protocol, summary: dict[str, object]) -> str:
    line = (
        f"requests {summary['requests']} ok {summary['ok']} errors {json.dumps(summary['errors'])}"
    )
    key = FIGURES[protocol].key
    line += "".join(f" {key}_p{q}_ms {summary[f'{key}_p{q}_ms']}" for q in QUANTILES)
    if "direct" in summary:
        line += f" added_p50_ms {summary['added_p50_ms']} ratio_p50 {summary['ratio_p50']}"
    return line


def _loop_problems(
    concurrency: int | None, rate: float | None, session_share: float, session_turns: int
) -> list[str]:
    """The closed or open loop's options, one line each: the open loop's from loadgen's own
    check, renamed to the flags."""
    if rate is None:
        if session_share:
            return ["--session-share: applies to an open loop; add --rate, e.g. --rate 5"]
        return []
    if concurrency is not None:
        return ["--concurrency: a closed loop's; with --rate the arrivals set the load, drop one"]
    flags = {"rate:": "--rate:", "session share:": "--session-share:"}
    problems = []
    for problem in open_loop_problems(rate, session_share, session_turns):
        for name, flag in flags.items():
            problem = problem.replace(name, flag, 1) if problem.startswith(name) else problem
        problems.append(problem.replace("(session turns)", "(--session-turns)"))
    return problems


@click.command()
@click.argument("url")
@click.option("--pool", required=True, help="The pool (OpenAI model name) to load.")
@click.option(
    "--protocol",
    type=click.Choice(PROTOCOLS),
    default="chat",
    show_default=True,
    help="chat: streamed completions (time to first token); speech: streamed /v1/audio/speech"
    " (first audio byte); transcription: a 1 s upload (whole transcript); realtime: turns of a"
    " /v1/realtime WebSocket session (first audio delta).",
)
@click.option(
    "--direct",
    "direct_urls",
    multiple=True,
    help="A replica's URL (repeatable): each worker also sends every request straight to one,"
    " alternating with the endpoint, and the figures show what the endpoint adds.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1024),
    help="Workers of a closed loop, each sending its next request when one ends.  [default: 8]",
)
@click.option(
    "--rate",
    type=float,
    help="Open loop instead: Poisson arrivals at this many requests/s, each sent at its time"
    " whatever the answers before it are doing.",
)
@click.option(
    "--session-share",
    type=float,
    default=0.0,
    help="With --rate: the share (0 to 1) of arrivals that are turns of conversations of"
    " --session-turns turns (X-Denv-Session); the rest are requests of their own.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="With --rate: the arrivals' seed."
)
@click.option("--duration", type=click.FloatRange(0.1, 3600), help="Seconds of load.")
@click.option("--requests", type=click.IntRange(1, 10_000_000), help="Number of requests.")
@click.option(
    "--session-turns",
    type=click.IntRange(0, 1000),
    default=0,
    help="Turns per sticky conversation (X-Denv-Session); 0 for none.",
)
@API_KEY_ENV
@click.option(
    "--json", "json_file", help="Write the summary as JSON to FILE ('-' for standard output)."
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(path_type=Path),
    help="Write a figure to FILE.png (or .svg): the latency histogram and each request over time.",
)
@click.option("--quiet", is_flag=True, help="No progress line and no table: one summary line.")
def bench(
    url: str,
    pool: str,
    protocol: Protocol,
    direct_urls: tuple[str, ...],
    concurrency: int | None,
    rate: float | None,
    session_share: float,
    seed: int,
    duration: float | None,
    requests: int | None,
    session_turns: int,
    api_key_env: str,
    json_file: str | None,
    plot_file: Path | None,
    quiet: bool,
) -> None:
    """Load URL with one protocol; its latency p50/p90/p99, gaps, errors by kind."""
    problems = _url_problems(url)
    if not pool.strip():
        problems.append("--pool: empty; name the pool (the model) to load, e.g. --pool voice")
    for direct in direct_urls:
        problems += [p.replace("URL:", "--direct:", 1) for p in _url_problems(direct)]
    if duration is not None and not math.isfinite(duration):
        problems.append(f"--duration: {duration} is not a number of seconds; e.g. --duration 30")
    problems += _loop_problems(concurrency, rate, session_share, session_turns)
    if plot_file is not None:
        # Only a run with a plot pays for importing matplotlib (seconds on a busy machine).
        from denv_iac.ops.bench_plot import FORMATS

        if plot_file.suffix not in FORMATS:
            problems.append(
                f"--plot: {plot_file} must end in {' or '.join(FORMATS)}; e.g. --plot ttft.png"
            )
    # Checked before the load runs: a typo in a path must not cost the whole run's figures.
    problems += output_file_problems("--json", json_file)
    problems += output_file_problems("--plot", None if plot_file is None else str(plot_file))
    if problems:
        fail(problems)
    if duration is None and requests is None:
        duration = 10.0
    if rate is None:
        what = f"{url} pool {pool}, {protocol}, concurrency {concurrency or 8}"
    else:
        what = f"{url} pool {pool}, {protocol}, {rate:g} requests/s"
        if session_share:
            what += f" ({session_share:.0%} in conversations)"
    if direct_urls:
        what += f", direct {' '.join(direct_urls)}"
    load = run_load(
        url.rstrip("/"),
        pool,
        protocol=protocol,
        direct_urls=tuple(u.rstrip("/") for u in direct_urls),
        concurrency=concurrency or 8,
        rate=rate,
        session_share=session_share,
        seed=seed,
        duration_s=duration,
        requests=requests,
        session_turns=session_turns,
        api_key=os.environ.get(api_key_env),
    )
    to_stdout = json_file == "-"
    report = asyncio.run(load if quiet or to_stdout else _with_progress(load, what, duration))
    summary = report.summary()
    if plot_file is not None:
        from denv_iac.ops.bench_plot import write_plot

        write_plot(report, what, plot_file)
    if to_stdout:
        click.echo(json.dumps(summary, indent=2))
    elif json_file:
        write_output("--json", json_file, json.dumps(summary, indent=2) + "\n")
    if quiet and not to_stdout:
        click.echo(_summary_line(protocol, summary))
    elif not to_stdout:
        table = Table(title=what, title_justify="left")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for key, value in summary.items():
            table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
        wide_console().print(table)
    if summary["ok"] == 0:
        sys.exit(1)
