"""Run a module as ``__main__`` under cProfile, timing the main thread's CPU (not wall) time.

``python -m benchmarks.profiled OUT.prof services.router`` — used by ``benchmarks.gateway.hops --profile``.
CPU time of the event-loop thread (``time.thread_time``), so a profile taken on a busy machine is not
inflated by the time the process waited for a core; grpc's own C threads are not included.
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out, module = sys.argv[1], sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    profile = cProfile.Profile(time.thread_time)
    try:
        profile.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        profile.dump_stats(out)


if __name__ == "__main__":
    main()
