"""`meshserve models prepare` draws progress bars on a terminal only (a log gets no bar lines)."""

from __future__ import annotations

import io
import os

import pytest

from services.cli.prepare import show_progress_bars


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "quiet", "shown"), [(_Tty(), False, True), (_Tty(), True, False)])
def test_bars_on_a_terminal_unless_quiet(stream: io.StringIO, quiet: bool, shown: bool) -> None:
    assert show_progress_bars(quiet, stream) is shown


def test_no_bars_into_a_file_or_pipe_and_none_from_the_hub() -> None:
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        assert show_progress_bars(False, pipe) is False
    os.close(read)
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    try:
        assert are_progress_bars_disabled()
    finally:
        enable_progress_bars()
