"""services/local/up.py: the log sink that keeps service lines out of the demo answer; `--gateways`."""

from __future__ import annotations

import io

import pytest

from services.local.processes import stdout_sink
from services.local.up import MAX_GATEWAYS, HoldingSink, _parser


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
