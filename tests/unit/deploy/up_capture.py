"""What ``meshserve up`` starts, recorded without starting anything.

:func:`capture_up` runs the real launcher code path: ``services.cli.up.run_up`` with ``meshserve up``'s
default arguments builds the :class:`MeshConfig`, and the real :meth:`Mesh.start` builds every child's
argv and environment. Only the process layer is replaced: children, Redis and the front door are
stand-ins that record what they were given and report themselves started and healthy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
import tempfile
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import services.cli.up as up
import services.local.mesh as mesh
import services.local.redis_server as redis_server


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    inherited: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    """The launcher's own environment when it started this child."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env_delta(self) -> dict[str, str]:
        """The variables the launcher set or changed (what the child gets beyond the caller's env)."""
        return {k: v for k, v in self.env.items() if self.inherited.get(k) != v}


@dataclass
class Captured:
    config: mesh.MeshConfig
    children: dict[str, Child] = field(default_factory=dict)
    front_door: dict[str, Any] | None = None
    events: list[tuple[str, str]] = field(default_factory=list)
    """(event, child) in launch order: spawn, started (its service_started line), serving (gRPC health),
    then stop, in the order the launcher stops them."""

    def awaited_before_spawn(self, dependency: str, child: str) -> str | None:
        """How far the launcher let ``dependency`` get before spawning ``child``: serving, started or None."""
        before = self.events[: self.events.index(("spawn", child))]
        for state in ("serving", "started"):
            if (state, dependency) in before:
                return state
        return None

    def stop_order(self) -> list[str]:
        return [name for event, name in self.events if event == "stop"]

    @property
    def redis_port(self) -> int:
        argv = self.children["redis"].argv
        return int(argv[argv.index("--port") + 1])

    @property
    def state_redis_port(self) -> int:
        argv = self.children[mesh.STATE_REDIS].argv
        return int(argv[argv.index("--port") + 1])


class _Stop(Exception):
    pass


async def capture_up(argv: list[str] | None = None) -> Captured:
    real_mesh = mesh.Mesh
    configs: list[mesh.MeshConfig] = []

    class ConfigProbe(real_mesh):  # type: ignore[misc, valid-type]
        async def start(self) -> mesh.Mesh:
            configs.append(self.config)
            raise _Stop

    loop = asyncio.get_running_loop()
    state = tempfile.TemporaryDirectory(prefix="meshserve-capture-")  # the state Redis's dir: not ~/.cache
    try:
        with (
            mock.patch.dict(os.environ, {"MESHSERVE_STATE_FILE": f"{state.name}/mesh.json"}),
            mock.patch.object(up, "Mesh", ConfigProbe),
            mock.patch.object(up, "busy_port", return_value=None),  # a mesh running beside the tests is no matter
            mock.patch("builtins.print"),
        ):
            await up.run_up(up._parser().parse_args(argv or []))
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    captured = Captured(configs[0])
    ports = itertools.count(41000)

    class RecordingProcess:
        def __init__(self, name: str, argv: list[str], env: dict[str, str], sink: object) -> None:
            self.child = Child(name, list(argv), dict(env), next(ports))
            self.port: int = self.child.port
            self.metrics_port = None
            self.proc = None  # no OS process: nothing to put under SCHED_BATCH
            captured.children[name] = self.child

        @property
        def address(self) -> str:
            return self.child.address

        async def spawn(self) -> None:
            captured.events.append(("spawn", self.child.name))

        async def wait_started(self, timeout_s: float) -> None:
            captured.events.append(("started", self.child.name))

        async def wait_serving(self, timeout_s: float) -> None:
            captured.events.append(("serving", self.child.name))

        async def stop(self, timeout_s: float = 15.0) -> None:
            captured.events.append(("stop", self.child.name))

    class RecordingFrontDoor:
        def __init__(self, gateways: list[str], sink: object, **kwargs: Any) -> None:
            captured.front_door = {"gateways": list(gateways), **kwargs}

        async def start(self) -> RecordingFrontDoor:
            return self

        async def stop(self) -> None:
            pass

    def redis_ready(url: str, timeout_s: float) -> None:  # wait_redis: PING answered
        port = url.split(":")[2].split("/")[0]
        (name,) = [n for n, c in captured.children.items() if "--port" in c.argv and port in c.argv]
        captured.events.append(("serving", name))

    async def health(address: str, timeout_s: float) -> None:  # the embedded router's own port
        captured.events.append(("serving", address))

    with (
        mock.patch.object(mesh, "wait_for_health", health),
        mock.patch.object(mesh, "ServiceProcess", RecordingProcess),
        mock.patch.object(redis_server, "ServiceProcess", RecordingProcess),  # Redis (spawn_redis)
        mock.patch.object(redis_server, "wait_redis", mock.AsyncMock(side_effect=redis_ready)),
        mock.patch.object(mesh, "FrontDoor", RecordingFrontDoor),
    ):
        # No supervision: the recorded children are no OS processes to watch (the topology is the same).
        running = real_mesh(dataclasses.replace(captured.config, supervise=False), sink=lambda name, line: None)
        try:
            await running.start()
            await running.stop()
        finally:
            state.cleanup()
    return captured
