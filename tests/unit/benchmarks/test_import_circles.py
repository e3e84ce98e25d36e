"""No import circles among the benchmarks either (scripts/import_graph.py's reading of imports: every
import statement counts, a lazy one inside a function included)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph_for_benchmarks", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_import_no_circle() -> None:
    ig = _checker()
    modules: dict[str, Path] = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    assert "benchmarks.gateway.hops" in modules and "benchmarks.gateway.relay_ab" in modules
    graph = {name: ig.imports_of(name, path, modules) for name, path in modules.items()}
    assert ig.cycles(graph) == []
