"""Check the layering of services/: import circles, upward imports, settings read outside settings,
services importing the CLI or the launcher, a service's lower part importing its upper part.

Five checks over the source (generated code in services/common/pb left out), read with ``ast``,
nothing imported:

- **cycles**: groups of modules that import each other, directly or through others. Every import
  statement counts, also one inside a function or under ``if TYPE_CHECKING:``: a lazy import hides a
  circle from the interpreter, not from the reader.
- **upward imports**: a module of the ground floor (``services.common``: shared domain types,
  settings, logging) importing a module of any other package of services/.
- **environment reads**: a named variable read from the environment (``os.environ.get("X")``,
  ``os.environ["X"]``, ``"X" in os.environ``, ``os.getenv("X")``) outside the settings module
  (``services.common.config``), where every setting is parsed, typed and documented. Copying the
  whole environment for a child process (``dict(os.environ)``) reads no setting and is not reported.
- **top floors**: the two floors above the services, top first: ``services.cli`` (the ``meshserve``
  command) and ``services.local`` (the launcher of the local mesh). A module imports a top floor only
  from inside it or from a floor above it: ``services.cli`` only from ``services.cli``,
  ``services.local`` only from ``services.local`` and ``services.cli``.
- **parts of a service**: inside one service, a lower part never imports an upper one
  (``LOWER_PARTS``): the router's load balancer (``services.router.balancer``) never imports its
  front end (``services.router.frontend``), which calls it.

An edge goes to the module an import names: ``from services.a import b`` names ``services.a.b`` when
that is a module, else ``services.a`` (``b`` is defined there). The packages above a module (whose
``__init__`` Python runs first) are not counted, or every package would form a circle with the
modules its ``__init__`` re-exports.

Usage: ``python scripts/import_graph.py [--root DIR] [--allow-upward GLOB]...``; prints what it
found and exits 1 when anything is, 0 when the tree is clean. ``tests/unit/test_import_graph.py``
runs the same checks over the real tree.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "services"
GROUND_FLOOR = "services.common"
SETTINGS_MODULES = frozenset({"services.common.config"})
"""Where named environment variables may be read."""
GENERATED = ("services/common/pb",)
TOP_FLOORS = ("services.cli", "services.local")
"""The floors above the services, top first: each is imported only from inside it or a floor above it."""
LOWER_PARTS = (("services.router.balancer", "services.router.frontend"),)
"""(lower, upper) parts of one service: no module of ``lower`` imports a module of ``upper``."""


@dataclass(frozen=True)
class Found:
    """One import or environment read: in ``module`` at ``line``, of ``target`` (a module or a variable)."""

    module: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} -> {self.target}"


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of services/ under ``root``, dotted name -> file (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or any(rel.as_posix().startswith(g + "/") for g in GENERATED):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    # ``from a import b``: the module a.b where b is one, else a name defined in a
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def imports_of(module: str, path: Path, known: Iterable[str]) -> list[Found]:
    """The modules of ``known`` that ``module`` imports, anywhere in its file, with the line of each."""
    names = set(known)
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: dict[str, Found] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for name in _imported_names(node, module, is_package, names):
                if name in names and name != module:
                    previous = found.get(name)
                    if previous is None or node.lineno < previous.line:
                        found[name] = Found(module, node.lineno, name)
    return sorted(found.values(), key=lambda f: (f.line, f.target))


def build_graph(root: Path) -> dict[str, list[Found]]:
    """module -> the imports of other modules of services/ it makes."""
    modules = find_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: Mapping[str, Iterable[Found]]) -> list[list[str]]:
    """The import circles: strongly connected groups of two or more modules, each sorted, in name order."""
    edges = {m: sorted({f.target for f in found if f.target in graph}) for m, found in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        # Tarjan's algorithm without recursion: (node, its next edge to follow).
        work = [(start, 0)]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, i = work[-1]
            if i < len(edges[node]):
                work[-1] = (node, i + 1)
                nxt = edges[node][i]
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(
    graph: Mapping[str, Iterable[Found]], floor: str = GROUND_FLOOR, allow: Iterable[str] = ()
) -> list[Found]:
    """Imports by a module of ``floor`` of a module outside it; ``allow``: globs of importing modules
    to leave out (``services.worker.*``)."""
    allowed = list(allow)
    return [
        found
        for module, imports in sorted(graph.items())
        if _within(module, floor) and not any(fnmatch.fnmatchcase(module, glob) for glob in allowed)
        for found in imports
        if not _within(found.target, floor)
    ]


def top_floor_imports(graph: Mapping[str, Iterable[Found]], floors: Sequence[str] = TOP_FLOORS) -> list[Found]:
    """Imports of a module of one of ``floors`` (top first) by a module that is neither in that floor
    nor in one above it: a service importing the CLI or the launcher, or the launcher the CLI."""
    return [
        found
        for module, imports in sorted(graph.items())
        for found in imports
        for i, floor in enumerate(floors)
        if _within(found.target, floor) and not any(_within(module, above) for above in floors[: i + 1])
    ]


def _is_environ(node: ast.expr) -> bool:
    """``os.environ``, or ``environ`` (``from os import environ``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _constant_name(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def env_reads_of(module: str, path: Path) -> list[Found]:
    """The named environment variables ``module`` reads: ``os.environ.get("X")`` / ``["X"]`` /
    ``.setdefault("X")`` / ``.pop("X")``, ``"X" in os.environ`` and ``os.getenv("X")``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Found] = []
    for node in ast.walk(tree):
        name: str | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if func.attr in ("get", "setdefault", "pop") and _is_environ(func.value):
                name = _constant_name(node.args[0])
            elif func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os":
                name = _constant_name(node.args[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv" and node.args:
            name = _constant_name(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            name = _constant_name(node.slice)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn):
            if _is_environ(node.comparators[0]):
                name = _constant_name(node.left)
        if name is not None:
            found.append(Found(module, node.lineno, name))
    return sorted(found, key=lambda f: (f.line, f.target))


def env_reads(root: Path, settings_modules: Iterable[str] = SETTINGS_MODULES) -> list[Found]:
    """Named environment reads of services/ outside ``settings_modules``."""
    allowed = set(settings_modules)
    return [
        found
        for module, path in find_modules(root).items()
        if module not in allowed
        for found in env_reads_of(module, path)
    ]


def part_imports(graph: Mapping[str, Iterable[Found]], parts: Sequence[tuple[str, str]] = LOWER_PARTS) -> list[Found]:
    """Imports of a module of an upper part by a module of the lower part below it (``parts``)."""
    return [
        found
        for module, imports in sorted(graph.items())
        for found in imports
        for lower, upper in parts
        if _within(module, lower) and _within(found.target, upper)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="repository root")
    parser.add_argument(
        "--allow-upward",
        action="append",
        default=[],
        metavar="GLOB",
        help="importing modules of services.common whose upward imports are known (repeatable)",
    )
    args = parser.parse_args(argv)
    graph = build_graph(args.root)
    circles = cycles(graph)
    upward = upward_imports(graph, allow=args.allow_upward)
    reads = env_reads(args.root)
    from_below = top_floor_imports(graph)
    upper_parts = part_imports(graph)
    print(f"modules: {len(graph)}")
    print(f"import circles: {len(circles)}")
    for group in circles:
        print("  " + " <-> ".join(group))
    print(f"upward imports from {GROUND_FLOOR}: {len(upward)}")
    for found in upward:
        print(f"  {found}")
    print(f"named environment reads outside {', '.join(sorted(SETTINGS_MODULES))}: {len(reads)}")
    for found in reads:
        print(f"  {found}")
    print(f"imports of {' or '.join(TOP_FLOORS)} from a floor below: {len(from_below)}")
    for found in from_below:
        print(f"  {found}")
    print(f"imports of a service's upper part from its lower part: {len(upper_parts)}")
    for found in upper_parts:
        print(f"  {found}")
    return 1 if circles or upward or reads or from_below or upper_parts else 0


if __name__ == "__main__":
    sys.exit(main())
