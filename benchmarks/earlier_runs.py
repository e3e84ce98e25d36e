"""The *Earlier runs* section of a benchmark's report, kept when the benchmark rewrites the report.

docs/benchmarks holds one current report per benchmark; a report may end with a short table of the
runs before it (one row each, with the git commit that holds the run's full report), under the
heading :data:`HEADING`. A benchmark that writes its report through :func:`write` keeps that section
from the file it replaces, so a new run does not drop the history. Adding the replaced run's own row
is left to whoever commits the new report (only they know whether its numbers matter).
"""

from __future__ import annotations

from pathlib import Path

HEADING = "## Earlier runs"


def section(text: str) -> str | None:
    """The *Earlier runs* section of ``text`` (its heading up to the next ``## `` heading or the end), or None."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        if line.strip() == HEADING:
            end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
            return "\n".join(lines[start:end]).rstrip() + "\n"
    return None


def carry(previous: str | None, text: str) -> str:
    """``text`` with the *Earlier runs* section of ``previous`` appended, unless ``text`` has its own."""
    kept = section(previous) if previous else None
    if kept is None or section(text) is not None:
        return text
    return text.rstrip("\n") + "\n\n" + kept


def write(path: Path, text: str) -> None:
    """Write the report ``text`` to ``path``, keeping the *Earlier runs* section of the report it replaces."""
    previous = path.read_text() if path.exists() else None
    path.write_text(carry(previous, text))
