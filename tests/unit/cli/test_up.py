"""services/cli/up.py: the log sink that keeps service lines out of the demo answer; `--gateways`."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli.up import MAX_GATEWAYS, HoldingSink, _parser, cli_command, parse_args
from services.common.processes import stdout_sink


def test_lines_wait_until_the_demo_answer_is_written_then_come_in_order() -> None:
    terminal = io.StringIO()
    sink = HoldingSink(stdout_sink(terminal))
    sink("edge-0", "before")
    with sink.holding():
        terminal.write("The capital of France is")
        sink("gateway", "request_done 1")
        terminal.write(" Paris.\n")
        sink("edge-0", "request_done 2")
    sink("cache", "after")
    assert terminal.getvalue().splitlines() == [
        "edge-0        | before",
        "The capital of France is Paris.",
        "gateway       | request_done 1",
        "edge-0        | request_done 2",
        "cache         | after",
    ]


def test_a_long_hold_is_bounded_and_keeps_the_order() -> None:
    lines: list[str] = []
    sink = HoldingSink(lambda name, line: lines.append(line), limit=3)
    with sink.holding():
        for i in range(2):
            sink("gateway", str(i))
        assert lines == []
        sink("gateway", "2")
        assert lines == ["0", "1", "2"]  # the limit released the hold
        sink("gateway", "3")
        assert lines == ["0", "1", "2", "3"]
    assert lines == ["0", "1", "2", "3"]


def test_lines_held_when_the_demo_fails_are_still_written() -> None:
    lines: list[str] = []
    sink = HoldingSink(lambda name, line: lines.append(line))
    with pytest.raises(RuntimeError), sink.holding():
        sink("gateway", "why it failed")
        raise RuntimeError("demo failed")
    assert lines == ["why it failed"]


def test_gateways_defaults_to_one_and_takes_a_replica_count() -> None:
    assert _parser().parse_args([]).gateways == 1
    assert _parser().parse_args(["--gateways", "3"]).gateways == 3


@pytest.mark.parametrize("value", ["0", "-1", str(MAX_GATEWAYS + 1), "two", "1.5"])
def test_a_bad_gateway_count_exits_2_with_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["--gateways", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--gateways" in err[-1] and "Traceback" not in "".join(err)


def _venv(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "proj" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "meshserve"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_banner_command_is_the_venv_script_relative_to_cwd_when_not_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = _venv(tmp_path)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    assert cli_command(cwd=tmp_path / "proj", path="/nonexistent") == ".venv/bin/meshserve"
    assert cli_command(cwd=tmp_path / "elsewhere", path="/nonexistent") == str(bin_dir / "meshserve")
    # On PATH (an activated venv): the bare name works as printed.
    assert cli_command(cwd=tmp_path / "proj", path=str(bin_dir)) == "meshserve"
    # Another `meshserve` first on PATH would run another installation: keep the explicit path.
    other = _venv(tmp_path / "other")
    assert cli_command(cwd=tmp_path / "proj", path=f"{other}:{bin_dir}") == ".venv/bin/meshserve"


def test_banner_command_without_a_script_runs_the_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert cli_command(cwd=tmp_path) == f"{tmp_path / 'python'} -m services.cli"


def test_the_printed_module_form_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr


def test_the_idle_flags_parse_and_stop_needs_min_replicas_zero(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--min-replicas", "0", "--idle-after-s", "2.5", "--stop-after-s", "30"])
    assert (args.min_replicas, args.idle_after_s, args.stop_after_s) == (0, 2.5, 30.0)
    defaults = parse_args([])
    assert (defaults.min_replicas, defaults.idle_after_s, defaults.stop_after_s) == (None, None, None)
    for argv, said in (
        (["--stop-after-s", "30"], "--stop-after-s stops every worker of the model, so it needs --min-replicas 0"),
        (["--min-replicas", "1", "--stop-after-s", "30"], "needs --min-replicas 0"),
        (["--min-replicas", "0", "--stop-after-s", "30", "--no-restart"], "needs the supervisor"),
        (["--min-replicas", "-1"], "give 0 or more"),
        (["--idle-after-s", "0"], "give a number of seconds above 0"),
        (["--idle-after-s", "soon"], "is not a number of seconds"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert said in capsys.readouterr().err
