"""Exec a program that dies with its launcher: ``python -m services.local.child PARENT_PID ARGV...``.

`meshserve up` starts every service through this. Before exec'ing ARGV it asks Linux to send it
SIGTERM when the launcher dies (PR_SET_PDEATHSIG survives exec), so a launcher killed even by
SIGKILL leaves no orphan servers behind. Doing this here instead of in a ``preexec_fn`` keeps
Python code out of the window between fork and exec in the (multi-threaded, gRPC-using) launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m services.local.child PARENT_PID PROGRAM [ARGS...]")
    parent = int(argv[0])
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the request took effect
        sys.exit(1)
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
