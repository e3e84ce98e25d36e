"""Stop strings over streamed text: release text only when it cannot be the start of a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feeds text deltas; holds back any suffix that could begin a stop string.

    ``feed`` returns ``(text_to_send, stopped)``. Once stopped, the text before the stop string has
    been returned and nothing after it ever is. Because the longest possible stop prefix is always
    held back, a stop string split across tokens (or across deltas) is still found.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return buf[:cut], True
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def pass_through(self, text: str) -> str:
        """``text`` (after any held text) released unmatched: stop strings are not looked for yet
        (``min_tokens`` not reached). A stop string that begins here and ends later is not found, as
        vLLM only looks for stop strings in the text that comes after ``min_tokens``."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held + text

    def flush(self) -> str:
        """The held-back text, released at the end of a generation that did not stop on a string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
