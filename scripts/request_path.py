"""Count the source files a public ``Generate`` request crosses on its way to a produced token.

Starts, as real processes, a gateway with the router embedded (``python -m services.gateway`` with
``MESHSERVE_GATEWAY_EMBED_ROUTER=1``), a real ``redis-server`` and one worker (the real edge worker on
the prepared model), each wrapped by a profiler hook (``sys.setprofile`` + ``threading.setprofile``,
installed before the service's first import so every Python thread has it). The hook records nothing
until the process gets SIGUSR1 and stops at SIGUSR2, when it writes the code objects it saw. After a
few warm-up requests and one idle window of the same length (the noise: what runs with no request in
flight), recording is switched on in both processes, ONE greedy ``Generate`` (max_tokens=1, a fresh
short prompt, so the response cache misses) goes through the gateway, and recording is switched off
as soon as its first token frame arrives. Only files under the measured tree's ``services/`` count.

Works on any tree that has ``python -m services.gateway``, ``python -m services.edge_worker``, their
``MESHSERVE_*`` settings and the ``service_started`` log line (the layout before the redesign too):

    python scripts/request_path.py --tree /work/before --out /tmp/before_path.md
    python scripts/request_path.py --tree .

The driver itself imports only grpc and the measured tree's generated pb stubs. Writes a Markdown
report and a JSON one beside it (same stem). Needs ``redis-server`` on PATH and a prepared model
(``meshserve models prepare``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

API_KEY = "request-path-key"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "request_path.md"

INFRASTRUCTURE_NAMES = frozenset(
    {
        "logging.py",
        "metrics.py",
        "tracing.py",
        "tracing_interceptor.py",
        "interceptors.py",
        "errors.py",
        "config.py",  # a package's settings
    }
)
"""Cross-cutting infrastructure, by file name in any package (plus everything under services/common/pb/)."""

# Runs inside each launched process (``python -c BOOTSTRAP module``) before the service's first import.
BOOTSTRAP = r"""
import json, os, runpy, signal, sys, threading, time
_out = os.environ["REQUEST_PATH_RECORD"]
_codes = {}  # code object -> when it was first called in the window (CLOCK_MONOTONIC, shared by processes)
_state = [False]
_now = time.monotonic

def _hook(frame, event, arg):
    if _state[0] and event == "call" and frame.f_code not in _codes:
        _codes[frame.f_code] = _now()

def _start(signum, frame):
    _codes.clear()
    _state[0] = True
    with open(_out + ".on", "w") as f:
        f.write("on")

def _stop(signum, frame):
    _state[0] = False
    seen = [(c.co_filename, c.co_qualname, t) for c, t in _codes.items()]
    with open(_out + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(_out + ".tmp", _out)

signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)
threading.setprofile(_hook)
sys.setprofile(_hook)
module = sys.argv[1]
sys.argv = [module]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@dataclass
class Recorded:
    """Files (relative to the tree) and the functions called in each, in one recording window;
    ``late``: files whose first call came after ``cutoff`` (the client had its first token by then)."""

    functions: dict[str, list[str]] = field(default_factory=dict)
    late: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, tree: Path, rows: list[list[Any]], cutoff: float = float("inf")) -> Recorded:
        """``rows``: [filename, qualname, first call time] per function called in the window."""
        root = str(tree.resolve() / "services") + os.sep
        functions: dict[str, set[str]] = {}
        first: dict[str, float] = {}
        for filename, qualname, when in rows:
            path = os.path.realpath(filename)
            if path.startswith(root):
                rel = os.path.relpath(path, tree.resolve())
                functions.setdefault(rel, set()).add(qualname)
                first[rel] = min(first.get(rel, when), when)
        on_time = {f: sorted(q) for f, q in sorted(functions.items()) if first[f] <= cutoff}
        late = {f: sorted(q) for f, q in sorted(functions.items()) if first[f] > cutoff}
        return cls(on_time, late)

    @property
    def files(self) -> set[str]:
        return set(self.functions)


def is_infrastructure(path: str) -> bool:
    return path.startswith("services/common/pb/") or Path(path).name in INFRASTRUCTURE_NAMES


def package_of(path: str) -> str:
    if path.startswith("services/common/pb/"):
        return "services/common/pb"
    return str(Path(path).parent)


def by_package(files: set[str]) -> dict[str, list[str]]:
    packages: dict[str, list[str]] = {}
    for path in sorted(files):
        packages.setdefault(package_of(path), []).append(Path(path).name)
    return packages


def summarize(
    tree: str, commit: str, sides: dict[str, Recorded], idle: dict[str, Recorded], command: str = ""
) -> dict[str, Any]:
    """The report's content: per side and together, all files and the files less infrastructure."""
    union = set().union(*(r.files for r in sides.values()))
    noise = set().union(*(r.files for r in idle.values()))
    core = {f for f in union if not is_infrastructure(f)}
    return {
        "tree": tree,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command,
        "total_files": len(union),
        "files_excluding_infrastructure": len(core),
        "sides": {
            name: {
                "files": len(rec.files),
                "files_excluding_infrastructure": len([f for f in rec.files if not is_infrastructure(f)]),
                "by_package": by_package(rec.files),
                "functions": rec.functions,
                "after_first_token": rec.late,
            }
            for name, rec in sides.items()
        },
        "all_by_package": by_package(union),
        "core_by_package": by_package(core),
        "infrastructure": sorted(union - core),
        "after_first_token_files": sorted(set().union(*(r.late for r in sides.values())) - union),
        "idle_window_files": sorted(noise),
        "request_files_also_seen_idle": sorted(union & noise),
    }


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Request path: `{report['tree']}` ({report['commit']})",
        "",
        "Files under `services/` with a Python function called between switching recording on and the",
        "first token frame of ONE public `Generate` (greedy, max_tokens=1), gateway with the router",
        "embedded + one edge worker, real processes (`scripts/request_path.py`).",
        f"Measured {report['date']}" + (f" with `{report['command']}`." if report["command"] else "."),
        "",
        f"- **Total files (both processes, each file once): {report['total_files']}**",
        f"- **Files excluding cross-cutting infrastructure: {report['files_excluding_infrastructure']}**"
        " (logging, metrics, tracing, interceptors, errors, settings/config, generated pb code)",
        "",
    ]
    for name, side in report["sides"].items():
        core = side["files_excluding_infrastructure"]
        lines.append(f"## {name} process: {side['files']} files ({core} excluding infrastructure)")
        lines.append("")
        for package, files in side["by_package"].items():
            lines.append(f"- `{package}/`: {', '.join(files)}")
        lines.append("")
    lines.append("## Excluded as infrastructure")
    lines.append("")
    lines.append(", ".join(f"`{f}`" for f in report["infrastructure"]) or "(none)")
    lines.append("")
    lines.append("## Noise check")
    lines.append("")
    if report["after_first_token_files"]:
        lines.append(
            "Not counted: first called only after the client had the first token frame (work after the token, "
            "still inside the window): " + ", ".join(f"`{f}`" for f in report["after_first_token_files"]) + "."
        )
        lines.append("")
    lines.append(
        "An idle window of the same length with no request in flight touched: "
        + (", ".join(f"`{f}`" for f in report["idle_window_files"]) or "no file")
        + "."
    )
    if report["request_files_also_seen_idle"]:
        lines.append(
            "Files of the request window also seen idle (may be background work, not the request): "
            + ", ".join(f"`{f}`" for f in report["request_files_also_seen_idle"])
            + "."
        )
    for extra in report.get("notes", []):
        lines.append("")
        lines.append(extra)
    lines.append("")
    lines.append("## Functions called, per file")
    for name, side in report["sides"].items():
        lines.append("")
        lines.append(f"### {name} process")
        lines.append("")
        for path, functions in side["functions"].items():
            lines.append(f"- `{path}`: {', '.join(f'`{q}`' for q in functions)}")
    lines.append("")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """One launched process: its stdout drained by a thread (the tail kept for errors), its port from
    its first ``service_started`` line."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], cwd: Path, record: Path | None) -> None:
        self.name = name
        self.record = record
        self.tail: deque[str] = deque(maxlen=40)
        self.port: int | None = None
        self._started = threading.Event()
        self.proc = subprocess.Popen(
            command,
            cwd=cwd,  # `python -c` puts the working directory first on sys.path: it must be the tree
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            if self.port is None and '"service_started"' in line:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self.port = int(json.loads(line)["port"])
                    self._started.set()

    def wait_started(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while not self._started.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start; its last lines:\n" + "\n".join(self.tail))
        assert self.port is not None
        return self.port

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def wait_file(path: Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout_s:.0f} s: the recording hook did not answer")
        time.sleep(0.002)


class Recorders:
    """Switches recording on and off in every wrapped process and collects what each saw."""

    def __init__(self, services: list[Service], tree: Path) -> None:
        self.services = [s for s in services if s.record is not None]
        self.tree = tree

    def on(self) -> None:
        for s in self.services:
            assert s.record is not None
            for stale in (s.record, Path(f"{s.record}.on")):
                stale.unlink(missing_ok=True)
            s.signal(signal.SIGUSR1)
        for s in self.services:
            wait_file(Path(f"{s.record}.on"))

    def off(self, cutoff: float = float("inf")) -> dict[str, Recorded]:
        """Recording off; files first touched after ``cutoff`` (time.monotonic()) go to ``late``."""
        for s in self.services:
            s.signal(signal.SIGUSR2)
        seen = {}
        for s in self.services:
            assert s.record is not None
            wait_file(s.record)
            seen[s.name] = Recorded.from_rows(self.tree, json.loads(s.record.read_text()), cutoff)
        return seen


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("redis-server did not start; is it installed (`make setup`)?")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def load_stubs(tree: Path) -> tuple[ModuleType, ModuleType]:
    """The measured tree's generated Inference stubs (only the pb package is imported from it)."""
    sys.path.insert(0, str(tree))
    from services.common.pb.meshserve.v1 import inference_pb2, inference_pb2_grpc

    if not Path(inference_pb2.__file__ or "").resolve().is_relative_to(tree):
        raise RuntimeError(f"imported stubs from {inference_pb2.__file__}, not from {tree}; unset PYTHONPATH")
    return inference_pb2, inference_pb2_grpc


def git_commit(tree: Path) -> str:
    result = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = result.stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain"], capture_output=True, text=True).stdout
    return commit + ("+uncommitted" if dirty.strip() else "")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import grpc

    tree = Path(args.tree).resolve()
    pb, pb_grpc = load_stubs(tree)
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        # heartbeats and probes far apart, so background work stays out of the recording windows
        "MESHSERVE_ROUTER_HEARTBEAT_TTL_S": "600",
        "MESHSERVE_ROUTER_HEALTH_INTERVAL_S": "600",
        "MESHSERVE_EDGE_WORKER_HEARTBEAT_INTERVAL_S": "60",
        "MESHSERVE_EDGE_WORKER_THREADS": str(args.threads),
    }
    router_port = free_port()
    with tempfile.TemporaryDirectory(prefix="request-path-") as tmp, redis_server(Path(tmp)) as redis_url:
        gateway_env = env | {
            "MESHSERVE_GATEWAY_EMBED_ROUTER": "1",
            "MESHSERVE_GATEWAY_API_KEYS": f"dev:{hashlib.sha256(API_KEY.encode()).hexdigest()}",
            "MESHSERVE_GATEWAY_REDIS_URL": redis_url,
            "MESHSERVE_ROUTER_PORT": str(router_port),
            "MESHSERVE_ROUTER_REDIS_URL": redis_url,
            "REQUEST_PATH_RECORD": f"{tmp}/gateway.json",
        }
        worker_env = env | {
            "MESHSERVE_EDGE_WORKER_WORKER_ID": "edge-0",
            "MESHSERVE_EDGE_WORKER_ROUTER_ADDRESS": f"127.0.0.1:{router_port}",
            "REQUEST_PATH_RECORD": f"{tmp}/worker.json",
        }
        wrapped = [sys.executable, "-c", BOOTSTRAP]
        services: list[Service] = []
        try:
            gateway = Service("gateway", [*wrapped, "services.gateway"], gateway_env, tree, Path(f"{tmp}/gateway.json"))
            services.append(gateway)
            gateway_port = gateway.wait_started(120)
            worker = Service("worker", [*wrapped, "services.edge_worker"], worker_env, tree, Path(f"{tmp}/worker.json"))
            services.append(worker)
            worker.wait_started(300)
            with grpc.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
                stub = pb_grpc.InferenceStub(channel)
                metadata = (("x-api-key", API_KEY),)
                deadline = time.monotonic() + 120
                while True:  # until the worker's registration has reached the embedded router
                    with contextlib.suppress(grpc.RpcError):
                        reply = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=5)
                        if reply.models and pb.TIER_EDGE in reply.models[0].tiers:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError("the worker never registered with the embedded router")
                    time.sleep(0.2)

                def request() -> Any:
                    return pb.GenerateRequest(
                        prompt=f"Name a colour. ({uuid.uuid4().hex[:8]})",  # fresh: the response cache misses
                        sampling=pb.SamplingParams(max_tokens=1, temperature=0.0),
                    )

                durations = []
                for _ in range(args.warmup):
                    began = time.monotonic()
                    frames = list(stub.Generate(request(), metadata=metadata, timeout=60))
                    durations.append(time.monotonic() - began)
                    if not any(f.token_ids for f in frames):
                        raise RuntimeError(f"a warm-up request produced no token: {frames}")
                recorders = Recorders(services, tree)
                time.sleep(0.5)  # let the warm-ups' trailing work (cache writes, accounting) finish
                recorders.on()
                time.sleep(max(durations))
                idle = recorders.off()
                trials = []
                for _ in range(args.trials):
                    time.sleep(0.5)
                    recorders.on()
                    call = stub.Generate(request(), metadata=metadata, timeout=60)
                    first = next(f for f in call if f.token_ids)
                    trials.append(recorders.off(cutoff=time.monotonic()))
                    list(call)  # drain the rest of the stream outside the window
                    if not first.token_ids:
                        raise RuntimeError("the measured request produced no token")
        finally:
            for s in reversed(services):
                s.stop()
    command = f"python scripts/request_path.py --tree {args.tree}"
    report = summarize(str(tree), git_commit(tree), trials[0], idle, command)
    if not report["total_files"]:
        raise RuntimeError(f"no file under {tree}/services was recorded: did the services import from elsewhere?")
    other = [summarize(str(tree), "", t, idle) for t in trials[1:]]
    report["trials"] = [report["total_files"], *(o["total_files"] for o in other)]
    report["trials_excluding_infrastructure"] = [
        report["files_excluding_infrastructure"],
        *(o["files_excluding_infrastructure"] for o in other),
    ]
    first_files = set().union(*(r.files for r in trials[0].values()))
    differ = sorted(set().union(*(set().union(*(r.files for r in t.values())) ^ first_files for t in trials[1:])))
    report["files_differing_between_trials"] = differ
    report["notes"] = [
        f"Reported: the first of {args.trials} measured requests (each in its own window, after "
        f"{args.warmup} warm-ups). Totals per request: {report['trials']} "
        f"(excluding infrastructure: {report['trials_excluding_infrastructure']})."
        + (f" Files not in every request: {', '.join(f'`{f}`' for f in differ)}." if differ else "")
    ]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(DEFAULT_OUT.parent.parent.parent), help="the checkout to measure")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown report; the JSON one gets .json")
    parser.add_argument("--warmup", type=int, default=3, help="requests before the measured ones")
    parser.add_argument("--trials", type=int, default=3, help="measured requests (the first is reported)")
    parser.add_argument("--threads", type=int, default=1, help="the edge worker's onnxruntime threads")
    args = parser.parse_args()
    report = measure(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    _earlier_runs().write(out.with_suffix(".md"), render_markdown(report))
    print(render_markdown(report))


def _earlier_runs() -> ModuleType:
    """benchmarks/earlier_runs.py of this checkout (keeps the report's *Earlier runs* section), loaded by
    its path: the driver imports no package of a tree."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "earlier_runs.py"
    spec = importlib.util.spec_from_file_location("request_path_earlier_runs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
