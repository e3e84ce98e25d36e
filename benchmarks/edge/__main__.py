"""Run the package as a module: the edge tier benchmark through the mesh (:mod:`benchmarks.edge.mesh`)."""

from __future__ import annotations

import sys

from benchmarks.edge.mesh import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
