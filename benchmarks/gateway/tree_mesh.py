"""One benchmark mesh (instant worker, router, gateways) run from a given source tree: the launcher of
the A/B modes of :mod:`benchmarks.gateway.hops` and :mod:`benchmarks.gateway.relay`, and of
:mod:`benchmarks.gateway.vs_litellm`.

A mesh here is redis-server, one worker process over the synthetic engine of
:mod:`benchmarks.gateway.instant_worker`, and, per ``layouts``: ``split`` = ``router`` + ``gateway`` (the
router in its own process) and ``embedded`` = ``gateway_embedded`` (the router inside the gateway's
process, ``meshserve up``'s default layout). Rate limits stay on but high enough never to reject.

**Another tree** (``tree`` not None, e.g. ``git worktree add /tmp/before 04ec40b``): its services run
its own code, as ``python -P -m services.<name>`` with ``PYTHONPATH`` = the tree (``-P``: the
current directory, this tree, stays off the path). The launcher relies only on what stays put while
the code is reorganised: the ``services.router`` / ``services.gateway`` module names, their
``MESHSERVE_*`` settings and the ``service_started`` log line. Its worker is that tree's own instant
worker, found wherever that tree keeps it (``benchmarks/**/instant_worker.py``); a tree without one
gets this tree's worker process (same wire protocol assumed; the report says so). Each mesh has its
own Redis, so two trees never share keys whose layout may differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from services.common.processes import ServiceProcess
from services.local.mesh import DEV_API_KEY, api_key_hash
from services.local.redis_server import spawn_redis

LAYOUTS = ("split", "embedded")
WORKER_MODULE = "benchmarks.gateway.instant_worker"


def _sink(_name: str, _line: str) -> None:
    pass


@dataclass
class TreeMesh:
    """The processes of one mesh; ``procs`` in start order (stop in reverse)."""

    tree: Path | None
    redis_url: str
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def pids(self) -> dict[str, int]:
        return {name: p.proc.pid for name, p in self.procs.items() if p.proc is not None}

    async def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            await proc.stop()


def check_tree(tree: Path, what: str) -> Path:
    """``tree`` resolved; SystemExit (naming ``what``, the option) unless it is a meshserve source tree."""
    root = tree.resolve()
    if not (root / "services" / "gateway").is_dir():
        raise SystemExit(f"{what}: {root} has no services/gateway; give the root of a meshserve checkout")
    return root


def describe(tree: Path | None) -> dict[str, str]:
    """A tree (this one for None) for the report: ``path``, ``commit`` (short, ``+changes`` when its
    tracked files differ from it) and ``services``: the git tree id of its committed services/ folder,
    with ``+changes`` likewise; two sides with the same ``services`` ran the same service code (A/A)."""
    path = Path.cwd() if tree is None else tree

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    dirty = "+changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    services = git("rev-parse", "--short", "HEAD:services") or "?"
    services_dirty = "+changes" if git("status", "--porcelain", "--untracked-files=no", "--", "services") else ""
    return {"path": str(path), "commit": commit + dirty, "services": services + services_dirty}


def same_services(a: dict[str, str], b: dict[str, str]) -> bool:
    """Both trees ran the same service code: same committed services/ tree, neither with changes to it."""
    return a["services"] == b["services"] and "?" not in a["services"] and "+changes" not in a["services"]


def tree_text(t: dict[str, str]) -> str:
    return f"`{t['path']}` @ {t['commit']} (services/ tree {t['services']})"


def worker_module(tree: Path) -> str | None:
    """The dotted name of ``tree``'s instant worker module (wherever its benchmarks keep it), or None."""
    found = sorted((tree / "benchmarks").rglob("instant_worker.py"))
    if not found:
        return None
    return ".".join(found[0].relative_to(tree).with_suffix("").parts)


def command(module: str, tree: Path | None) -> list[str]:
    """argv running ``module`` from ``tree`` (None: this tree)."""
    if tree is None:
        return [sys.executable, "-m", module]
    return [sys.executable, "-P", "-m", module]


def tree_env(env: dict[str, str], tree: Path | None) -> dict[str, str]:
    return env if tree is None else env | {"PYTHONPATH": str(tree)}


async def _start(proc: ServiceProcess, timeout_s: float, health: bool = True) -> ServiceProcess:
    await proc.spawn()
    await proc.wait_started(timeout_s)
    if health:
        await proc.wait_serving(timeout_s)
    return proc


async def start_mesh(
    tmp: str,
    tree: Path | None = None,
    *,
    layouts: Collection[str] = LAYOUTS,
    worker_settings: dict[str, str] | None = None,
    gateway_settings: dict[str, str] | None = None,
    suffix: str = "",
    sink: Callable[[str, str], None] = _sink,
    timeout_s: float = 120.0,
    worker_argv: list[str] | None = None,
) -> TreeMesh:
    """Start one mesh from ``tree``; process names get ``suffix`` (two meshes side by side).
    ``worker_argv``: the worker's command instead of the tree's instant worker (run with the tree's code)."""
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise ValueError(f"unknown layouts {sorted(unknown)}; use {', '.join(LAYOUTS)}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code_env = tree_env(env, tree)
    redis, redis_url = await spawn_redis(tmp, sink, env)  # as `meshserve up` runs it
    mesh = TreeMesh(tree, redis_url, {f"redis{suffix}": redis})
    try:
        module = WORKER_MODULE if tree is None else worker_module(tree)
        worker_tree = tree
        if module is None:
            module, worker_tree = WORKER_MODULE, None
            mesh.notes.append(f"{tree} has no benchmarks/**/instant_worker.py: its mesh ran this tree's worker")
        worker_env = tree_env(env, worker_tree) | {
            "MESHSERVE_INSTANT_WORKER_WORKER_ID": f"instant{suffix}",
            **(worker_settings or {}),
        }
        if worker_argv is not None:
            worker_env = tree_env(worker_env, tree)
        argv = worker_argv if worker_argv is not None else command(module, worker_tree)
        worker = ServiceProcess(f"worker{suffix}", argv, worker_env, sink)
        mesh.procs[f"worker{suffix}"] = await _start(worker, timeout_s)
        router_env = {"MESHSERVE_ROUTER_EDGE_WORKERS": worker.address, "MESHSERVE_ROUTER_REDIS_URL": redis_url}
        gateway_env = {
            "MESHSERVE_GATEWAY_API_KEYS": f"dev:{api_key_hash(DEV_API_KEY)}",
            "MESHSERVE_GATEWAY_REDIS_URL": redis_url,
            "MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE": "100000000",
            "MESHSERVE_GATEWAY_TOKENS_PER_MINUTE": "1000000000",
            **(gateway_settings or {}),
        }
        gateway_argv = command("services.gateway", tree)
        if "split" in layouts:
            router_argv = command("services.router", tree)
            router = ServiceProcess(f"router{suffix}", router_argv, code_env | router_env, sink)
            mesh.procs[f"router{suffix}"] = await _start(router, timeout_s)
            split_env = code_env | gateway_env | {"MESHSERVE_GATEWAY_ROUTER_ADDRESS": router.address}
            gateway = ServiceProcess(f"gateway{suffix}", gateway_argv, split_env, sink)
            mesh.procs[f"gateway{suffix}"] = await _start(gateway, timeout_s)
        if "embedded" in layouts:
            embedded_env = (
                code_env
                | gateway_env
                | router_env
                | {"MESHSERVE_GATEWAY_EMBED_ROUTER": "true", "MESHSERVE_ROUTER_PORT": "0"}
            )
            embedded = ServiceProcess(f"gateway_embedded{suffix}", gateway_argv, embedded_env, sink)
            mesh.procs[f"gateway_embedded{suffix}"] = await _start(embedded, timeout_s)
    except BaseException:
        await mesh.stop()
        raise
    return mesh
