"""Exec a program that dies with its launcher: ``python -m services.common.child PARENT_PID ARGV...``.

Every child of :class:`services.common.processes.ServiceProcess` (so every service `meshserve up`
starts) is started through this. Before exec'ing ARGV it asks Linux to send it
SIGTERM when the launcher dies (PR_SET_PDEATHSIG survives exec), so a launcher killed even by
SIGKILL leaves no orphan servers behind. Doing this here instead of in a ``preexec_fn`` keeps
Python code out of the window between fork and exec in the (multi-threaded, gRPC-using) launcher.

``python -m services.common.child --standby PARENT_PID PYTHON -m MODULE``: a warm spare of a Python
service (services/common/processes.py, ``ServiceProcess.start_standby``). It imports MODULE (``MODULE.__main__``
for a package, and so everything the service imports: torch, onnxruntime, grpc — seconds of CPU, most
of a worker's restart on a loaded machine), then waits for one JSON line on stdin, ``{"env": {...}}``: the
environment to run with. It then runs MODULE as ``python -m MODULE`` would, in this process. Importing
a service's modules loads no model and reads no setting (services are built in ``__main__.main``), so
the spare's run is the same as a fresh process's. EOF on stdin (the mesh stops) ends it.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    standby = argv[:1] == ["--standby"]
    argv = argv[1:] if standby else argv
    if len(argv) < 2:
        sys.exit("usage: python -m services.common.child [--standby] PARENT_PID PROGRAM [ARGS...]")
    parent = int(argv[0])
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the request took effect
        sys.exit(1)
    if standby:
        wait_and_run(argv[1:])
    os.execvp(argv[1], argv[1:])


def wait_and_run(argv: list[str]) -> None:
    """The ``--standby`` mode (module docstring); ``argv`` is ``[python, "-m", module]``."""
    if len(argv) != 3 or argv[1] != "-m":
        sys.exit(f"--standby runs `python -m MODULE`, not {argv}")
    module = argv[2]
    loaded = importlib.import_module(module)
    if hasattr(loaded, "__path__"):  # a package: `python -m` runs its __main__
        importlib.import_module(f"{module}.__main__")
    line = sys.stdin.readline()
    if not line:  # stopped before it was needed
        sys.exit(0)
    os.environ.clear()
    os.environ.update(json.loads(line)["env"])
    sys.argv = [argv[0]]
    # runpy executes __main__.py itself (its own imports are loaded); its entry as an imported module
    # would make runpy warn that the module is already in sys.modules.
    sys.modules.pop(f"{module}.__main__", None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
