"""`denv bench` against a real simulated replica: --plot, --quiet and --json - for scripts."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from denv_iac.cli import main
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.local.replica_sim import ReplicaProcess


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    process = ReplicaProcess(ReplicaSimConfig("voice.t.n0.0", ttft_ms=10, itl_ms=1, tokens=3))
    process.spawn()
    process.wait_ready()
    yield f"http://127.0.0.1:{process.port}"
    process.stop()


def bench(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["bench", *args])
    return result.exit_code, result.output


def test_quiet_prints_one_line_and_the_plot(url: str, tmp_path: Path) -> None:
    plot = tmp_path / "ttft.png"
    code, output = bench(url, "--pool", "voice", "--requests", "12", "--quiet", "--plot", str(plot))
    assert code == 0, output
    assert output.count("\n") == 1 and output.startswith("requests 12 ok 12 errors {}")
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 800


def test_json_to_stdout_is_json_only(url: str) -> None:
    code, output = bench(url, "--pool", "voice", "--requests", "4", "--json", "-")
    assert code == 0 and json.loads(output)["ok"] == 4


def test_plot_must_be_png_or_svg(url: str, tmp_path: Path) -> None:
    code, output = bench(url, "--pool", "voice", "--plot", str(tmp_path / "ttft.jpg"))
    assert code == 2 and "must end in .png or .svg" in output


def test_nothing_served_exits_1(tmp_path: Path) -> None:
    # A port nobody listens on: every request fails to connect, and the plot still renders.
    plot = tmp_path / "down.svg"
    args = ["--pool", "voice", "--requests", "3", "--quiet", "--plot", str(plot)]
    code, output = bench("http://127.0.0.1:9", *args)
    assert code == 1 and '"connect": 3' in output
    assert "no completed stream" in plot.read_text()  # SVG text stays text


def test_a_bad_direct_url_is_named_before_any_load() -> None:
    code, output = bench("http://127.0.0.1:9", "--pool", "voice", "--direct", "127.0.0.1:1")
    assert code == 2 and "--direct: '127.0.0.1:1' is not an http(s) URL" in output
