"""The compose deployment as a user runs it: base images, the image build, `up`, health, logs, `down -v`.

Used by test_compose_stack.py (``make compose-test``, which installs and starts the engine first:
scripts/compose_test.sh). Everything it runs goes through the Compose command the user has
(``$MESHSERVE_COMPOSE``: Debian's ``docker-compose`` 1.29 or the ``docker compose`` v2 plugin) and the
``docker`` CLI; what it decides it prints (``compose-test: ...``), and every command's output goes to
one log file, whose tail is shown when a command fails.

How the image is built here (:func:`build_settings`): MESHSERVE_* build settings the caller set are
used as they are. Otherwise torch comes from a local ``torch-<pin>+cpu-cp311`` wheel when one is found
(``$MESHSERVE_TORCH_WHEEL``, or the find-links directories of pip's configuration), served on
127.0.0.1 as find-links to a build on the host's network, else from the PyTorch CPU index (the
Dockerfile's default); and the CA certificates the host added (``/usr/local/share/ca-certificates``,
a TLS proxy's or a mirror's) are given to pip in the build.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import os
import shlex
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
WHEEL_PORT = 37917
"""Fixed, so the build's find-links URL (a build arg) and with it the torch layer's cache key stay the
same from run to run (a port taken by something else: a free one, and that layer is rebuilt)."""
PROJECT = "meshserve-compose-test"
CA_DIR = Path("/usr/local/share/ca-certificates")


def say(message: str) -> None:
    print(f"compose-test: {message}", flush=True)


def torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("torch==")]
    return str(pin).removeprefix("torch==")


def _pip_find_links() -> list[Path]:
    """The local directories in pip's find-links (its environment and configuration files)."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["python3", "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30
        ).stdout
        for line in out.splitlines():
            key, _, value = line.partition("=")
            if key.endswith("find-links"):
                values += value.strip().strip("'\"").split()
    return [Path(v.removeprefix("file://")) for v in values if not v.startswith(("http://", "https://"))]


def local_torch_wheel() -> Path | None:
    """The torch CPU wheel of the pinned version for the image's Python (cp311), if this host has one."""
    given = os.environ.get("MESHSERVE_TORCH_WHEEL")
    if given:
        return Path(given)
    pattern = f"torch-{torch_pin()}+cpu-cp311-cp311-*linux*x86_64.whl"
    for directory in _pip_find_links():
        found = sorted(directory.glob(pattern)) if directory.is_dir() else []
        if found:
            return found[-1]
    return None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away mid-download (pip retries): not this test's business


@contextlib.contextmanager
def serve_wheel(wheel: Path) -> Iterator[str]:
    """Serve ``wheel`` alone on 127.0.0.1 (a one-link page: what pip's find-links reads); yields the URL."""
    link = wheel.name.replace("+", "%2B")

    class OnlyTheWheel(_Quiet):
        def send_head(self) -> Any:
            if self.path == "/":
                body = f'<html><body><a href="{link}">{wheel.name}</a></body></html>'.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                return io.BytesIO(body)
            if self.path not in (f"/{link}", f"/{wheel.name}"):
                self.send_error(404)
                return None
            return super().send_head()

    factory = functools.partial(OnlyTheWheel, directory=str(wheel.parent))
    try:
        server = _Server(("127.0.0.1", WHEEL_PORT), factory)
    except OSError:
        say(f"port {WHEEL_PORT} is taken: serving the wheel on a free port (the torch layer is rebuilt)")
        server = _Server(("127.0.0.1", 0), factory)
    thread = threading.Thread(target=server.serve_forever, name="wheel-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


BUILD_VARIABLES = (
    "MESHSERVE_PYTHON_IMAGE",
    "MESHSERVE_PIP_INDEX_URL",
    "MESHSERVE_PIP_EXTRA_INDEX_URL",
    "MESHSERVE_PIP_FIND_LINKS",
    "MESHSERVE_PIP_TRUSTED_HOST",
    "MESHSERVE_PIP_CA_CERT",
    "MESHSERVE_TORCH_CPU_INDEX_URL",
    "MESHSERVE_BUILD_NETWORK",
)


@dataclass
class BuildPlan:
    env: dict[str, str]
    wheel: Path | None = None
    notes: list[str] = field(default_factory=list)


def build_settings() -> BuildPlan:
    """The build's MESHSERVE_* settings for this host (module docstring), and a line saying each."""
    given = {k: os.environ[k] for k in BUILD_VARIABLES if k in os.environ}
    if given:
        return BuildPlan({}, None, [f"build settings as given: {', '.join(sorted(given))}"])
    plan = BuildPlan({})
    wheel = local_torch_wheel()
    if wheel is not None:
        plan.wheel = wheel
        plan.env.update({"MESHSERVE_TORCH_CPU_INDEX_URL": "", "MESHSERVE_BUILD_NETWORK": "host"})
        plan.notes.append(
            f"torch: the local wheel {wheel}, served on 127.0.0.1 as pip's find-links (build on the host network)"
        )
    else:
        plan.notes.append("torch: the PyTorch CPU index (the Dockerfile's default; no local wheel found)")
    cas = sorted(CA_DIR.glob("*.crt")) if CA_DIR.is_dir() else []
    if cas:
        plan.env["MESHSERVE_PIP_CA_CERT"] = "".join(p.read_text() for p in cas).rstrip("\n")
        plan.notes.append(f"pip in the build trusts the host's added CAs too: {', '.join(p.name for p in cas)}")
    return plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CommandFailed(AssertionError):
    pass


@dataclass
class Stack:
    """One compose project of deploy/compose.yaml."""

    log: Path
    env: dict[str, str]
    compose: list[str] = field(
        default_factory=lambda: shlex.split(os.environ.get("MESHSERVE_COMPOSE") or "docker-compose")
    )
    project: str = PROJECT
    http_port: int = 0
    """Envoy's port published on 127.0.0.1."""
    started: float = 0.0
    """time.monotonic() when the run began."""

    def run(self, *args: str, check: bool = True, timeout: float = 600, capture: bool = False) -> str:
        """``args`` (a docker or compose command line); output to the log (or returned with ``capture``)."""
        with self.log.open("a") as log:
            log.write(f"\n$ {shlex.join(args)}\n")
            log.flush()
            proc = subprocess.run(
                args,
                env=self.env,
                cwd=ROOT,
                stdout=subprocess.PIPE if capture else log,
                stderr=log,
                text=True,
                timeout=timeout,
            )
        if check and proc.returncode != 0:
            tail = "\n".join(self.log.read_text().splitlines()[-25:])
            raise CommandFailed(f"`{shlex.join(args)}` exited {proc.returncode}; log {self.log}:\n{tail}")
        return proc.stdout or ""

    def compose_run(self, *args: str, **kwargs: Any) -> str:
        return self.run(*self.compose, "-p", self.project, "-f", str(COMPOSE_FILE), *args, **kwargs)

    def containers(self, service: str | None = None, *, all_states: bool = True) -> list[str]:
        """Container ids of the project (or of one service), by compose's labels."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = self.run("docker", "ps", "-q", "--no-trunc", *(["-a"] if all_states else []), *filters, capture=True)
        return out.split()

    def container(self, service: str) -> str:
        (cid,) = self.containers(service)
        return cid

    def inspect(self, cid: str) -> dict[str, Any]:
        (doc,) = json.loads(self.run("docker", "inspect", cid, capture=True))
        return dict(doc)

    def state(self) -> dict[str, str]:
        """Each container's name: its health (healthy, starting, unhealthy), or its state without a healthcheck."""
        out: dict[str, str] = {}
        ids = self.containers()
        for doc in json.loads(self.run("docker", "inspect", *ids, capture=True)) if ids else []:
            s = doc["State"]
            health = str((s.get("Health") or {}).get("Status") or "")
            running = s["Status"] == "running" and health
            out[doc["Name"].lstrip("/")] = health if running else f"{s['Status']}:{s['ExitCode']}"
        return out

    def wait_healthy(self, timeout_s: float, expect: int) -> float:
        """Until ``expect`` containers are healthy and every other one exited 0 (the models job); seconds taken."""
        start = time.monotonic()
        last: dict[str, str] = {}
        while time.monotonic() - start < timeout_s:
            last = self.state()
            healthy = [n for n, s in last.items() if s == "healthy"]
            bad = {n: s for n, s in last.items() if s not in ("healthy", "starting", "exited:0")}
            running_bad = {n: s for n, s in bad.items() if s != "unhealthy"}
            if running_bad:  # a container that exited with an error (restarting ones show as running)
                raise AssertionError(f"containers failed: {running_bad}; logs in {self.log}")
            if len(healthy) == expect and not bad:
                return time.monotonic() - start
            time.sleep(1)  # polls the containers' health: the healthchecks are what is waited on
        raise AssertionError(f"not healthy after {timeout_s:.0f} s: {last}; logs in {self.log}")

    def logs(self, service: str) -> list[dict[str, Any]]:
        """The JSON log events (structlog) of a service's containers, oldest first (all their starts)."""
        events: list[dict[str, Any]] = []
        for cid in self.containers(service):
            proc = subprocess.run(["docker", "logs", cid], capture_output=True, text=True, timeout=60)
            for line in (proc.stdout + proc.stderr).splitlines():
                with contextlib.suppress(ValueError):
                    doc = json.loads(line[line.index("{") :]) if "{" in line else None
                    if isinstance(doc, dict) and "event" in doc:
                        events.append(doc)
        return events

    def exec(self, service: str, argv: Sequence[str]) -> str:
        return self.run("docker", "exec", self.container(service), *argv, capture=True)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of the project still there."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {
            "containers": self.run("docker", "ps", "-aq", "--filter", label, capture=True).split(),
            "networks": self.run("docker", "network", "ls", "-q", "--filter", label, capture=True).split(),
            "volumes": self.run("docker", "volume", "ls", "-q", "--filter", label, capture=True).split(),
        }
        prefix = f"{self.project}_"  # by name too, in case a Compose version labels less
        names = self.run("docker", "volume", "ls", "--format", "{{.Name}}", capture=True).split()
        found["volumes"] += [n for n in names if n.startswith(prefix) and n not in found["volumes"]]
        names = self.run("docker", "network", "ls", "--format", "{{.Name}}", capture=True).split()
        found["networks"] += [n for n in names if n.startswith(prefix)]
        return {k: v for k, v in found.items() if v}
