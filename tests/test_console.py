"""Progress of long work: a line per finished step in a log, nothing at all when quiet."""

import pytest

from denv_iac.cli.console import StepProgress


def test_each_finished_step_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    with StepProgress("joining box-1") as bar:
        bar.started(1, 2, "driver: install")
        bar.finished(1, 2, "driver: install", "ok")
        bar.started(2, 2, "agent: start")
        bar.finished(2, 2, "agent: start", "failed")
        bar.finished(3, None, "verify through NVML", "ok")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "[1/2] driver: install ... ok",
        "[2/2] agent: start ... failed",
        "verify through NVML ... ok",
    ]


def test_quiet_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with StepProgress("joining box-1", quiet=True) as bar:
        bar.started(1, 1, "driver: install")
        bar.finished(1, 1, "driver: install", "ok")
    assert capsys.readouterr() == ("", "")
