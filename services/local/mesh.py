"""`meshserve up`: the whole mesh as local processes, health-gated, one merged log, clean stop.

Topology (defaults): two redis-servers (unless a Redis URL is given): the cache Redis (response
cache, KV prefix blocks, rate-limit buckets; ``--maxmemory`` and ``allkeys-lru``, no persistence, see
docs/cache.md) and the state Redis (API keys, files, batches, stored responses: an append-only file,
``noeviction``; :data:`~services.local.redis_server.STATE_REDIS_ARGS`), router, 2 edge workers, 1 cloud
worker, cache admin, gateway, one batch runner.
Every service binds port 0 on loopback; its ``service_started`` log line tells us
the port, and we wait on its gRPC health before starting what depends on it. The router starts
first with no static worker list: the workers are given its address and register themselves by
heartbeat (docs/router.md), so a worker that dies is dropped from routing after the heartbeat TTL.
Ctrl-C (SIGINT) or SIGTERM stops everything, letting in-flight streams drain.

With ``MeshConfig(supervise=True)`` (what ``meshserve up`` runs) a child that exits on its own is
started again (services/local/supervise.py: exponential backoff, crash loops reported): the gateways,
the cache service, the split router, both Redis (the state Redis replays its append-only file), Envoy
and its HTTP adapters on the ports they had, so
clients and Envoy reconnect; workers on fresh ports, registering again by heartbeat.

:class:`Mesh` is also what the end-to-end tests and the benchmarks start, so they run exactly the
topology users get.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from services.common.model_paths import DEFAULT_MODEL_ID, ModelPaths, model_paths
from services.common.processes import LogSink, ServiceProcess, free_port, stdout_sink, wait_for_health, yield_on_wakeup
from services.controlplane.frontdoor import FrontDoor
from services.local.redis_server import STATE_REDIS_ARGS, cache_redis_args, spawn_redis, wait_redis
from services.local.scaler import Scaler, SupervisedWorkers, WorkerMap, sink_logger, stop_policies
from services.local.scaler import run as scaler_run
from services.local.supervise import RestartPolicy, Supervisor

DEV_API_KEY = "msk-local-dev-key"
"""API key of the local mesh's ``dev`` tenant (override with MESHSERVE_API_KEY)."""


STATE_REDIS = "redis-state"
"""The process name of the state Redis (``meshserve status``, the merged log)."""


def api_key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class MeshConfig:
    """What to start. Ports are 0 (picked by the OS) unless given."""

    edge_workers: int = 2
    cloud_workers: int = 1
    gateways: int = 1
    """Gateway replicas. The first listens on ``gateway_port``, the others on free ports; Envoy
    (``envoy``) balances over all of them, and their rate limits are one budget (in Redis). With the
    router embedded each has its own router and every worker heartbeats to all of them."""
    gateway_port: int = 0
    redis_url: str = ""
    """Use this Redis as the cache Redis instead of starting one ("" = start redis-server on a free port)."""
    redis_maxmemory: str = "512mb"
    """``--maxmemory`` of the cache Redis we start (allkeys-lru evicts above it); the soak uses a small one."""
    state_redis_url: str | None = None
    """The Redis of the mesh's durable state: API keys, files, batches and stored /v1/responses (the
    gateways' MESHSERVE_GATEWAY_STATE_REDIS_URL, the batch runners' and the HTTP adapters' Redis).
    None: a redis-server of its own (:data:`~services.local.redis_server.STATE_REDIS_ARGS`: append-only
    file, ``noeviction``) when the mesh starts its cache Redis (``redis_url`` ""), else ``redis_url``
    itself (one Redis for both, as a deployment with a single Redis); "": start one in any case; a URL:
    use that Redis."""
    state_dir: str = ""
    """Data directory of the state Redis the mesh starts (its append-only file); "" = a temporary one,
    removed at stop. ``meshserve up`` keeps it beside its state file, so batches and keys outlive the
    mesh. One mesh at a time may use a directory (a lock file in it says so)."""
    redis_batch: bool = True
    """Run the Redis we start under SCHED_BATCH, so that a command does not make it preempt the
    gateway that sent it (:func:`services.common.processes.yield_on_wakeup`)."""
    api_key: str = DEV_API_KEY
    edge_threads: int = 1
    cloud_threads: int = 2
    cloud_tp: int = 1
    """Ranks of each cloud worker's tensor-parallel group; above 1 the worker is started by torchrun
    (``cloud_threads`` is split between the ranks). Must divide the model's attention and KV heads."""
    edge_max_prompt_tokens: int = 128
    start_timeout_s: float = 240.0
    extra_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every service (e.g. MESHSERVE_MODELS_DIR)."""
    envoy: bool = False
    """Start the front door too: Envoy + the OpenAI-compatible HTTP adapter (services/controlplane)."""
    http_port: int = 0
    """Envoy's public port (HTTP/1.1 OpenAI API and gRPC on one port); 0 = a free port."""
    tls_cert: str = ""
    """PEM certificate for Envoy's listener; with ``tls_key`` the front door speaks only TLS."""
    tls_key: str = ""
    batch_runners: int = 1
    """Batch runners (``services.batch``): they run the lines of /v1/batches batches in free capacity."""
    embed_router: bool = True
    """Run the router inside the gateway's process (the default; MESHSERVE_GATEWAY_EMBED_ROUTER,
    docs/gateway.md): no router process, the gateway starts first and the workers register with its
    router port. One gRPC hop fewer per request, and about half the CPU per request of the gateway and
    router processes together (docs/benchmarks/hops.md). ``False`` runs the router as its own process
    (``meshserve up --split-router``), as the compose and Kubernetes deployments do."""
    edge_versions: dict[str, str] = field(default_factory=dict)
    """More versions of the default model, name -> an onnxruntime-genai directory prepared offline (the
    INT8 draft build, an INT4 export without bias correction, ...): one more edge worker each,
    reporting the name as its build. With these or ``edge_models`` the router gets a models file
    (:func:`models_file`, docs/router.md): all traffic stays on the prepared build until
    `meshserve models rollout` moves some."""
    models_file: str = ""
    """The router's models file (:data:`DEFAULT_MODELS_FILE`: the default model's generation defaults, from
    its model card; docs/router.md): `meshserve up` passes it. "" serves the default model with its
    checkpoint's generation defaults only (the tests' meshes: greedy unless a request says otherwise).
    With ``edge_versions`` or ``edge_models`` the mesh writes its own file, which keeps this file's
    ``generation`` of the default model."""
    edge_models: dict[str, str] = field(default_factory=dict)
    """More model ids, id -> an onnxruntime-genai directory (its tokenizer.json and chat template are the
    model's, e.g. the distilled student's ``edge-int4``): one more edge worker each."""
    supervise: bool = False
    """Restart a child that exits on its own (``meshserve up``; services/local/supervise.py). Off for
    tests that kill a service to watch the mesh without it."""
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    min_replicas: int | None = None
    """The default model's idle policy (``idle:`` in the models file, docs/deploy.md *Scale from zero*):
    replicas kept awake; 0 lets every one sleep (and, with ``stop_after_s``, stop). None: the models
    file's (or the router's default, 1)."""
    idle_after_s: float | None = None
    """Seconds without a request after which the default model's workers sleep (None: the models file's)."""
    stop_after_s: float | None = None
    """Seconds without a request after which the local scaler (services/local/scaler.py, with
    ``supervise``) stops the default model's worker processes; needs ``min_replicas`` 0. A held request
    starts one again."""
    scale_interval_s: float = 0.5
    """How often the local scaler reads the routers' metrics."""
    warm_spares: bool = True
    """With ``supervise``: each Python service (workers, gateways, cache, batch runners, HTTP adapters; not
    a cloud worker under torchrun) keeps a warm spare, a process that has done its imports (torch,
    onnxruntime, grpc: most of a restart on a loaded machine) and waits; a restart runs the service in
    it (services/common/child.py). Costs one idle process per service (~80-400 MB each)."""

    def __post_init__(self) -> None:
        if self.min_replicas is not None and self.min_replicas < 0:
            raise ValueError(f"min_replicas is {self.min_replicas}; give 0 or more")
        for name in ("idle_after_s", "stop_after_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} is {value}; give a number of seconds above 0")
        if self.stop_after_s is not None and self.min_replicas != 0:
            raise ValueError(
                "stop_after_s stops every worker of the model, which needs min_replicas 0 "
                f"(it is {self.min_replicas}); pass --min-replicas 0 with --stop-after-s"
            )

    def idle_policy(self) -> dict[str, object]:
        """The ``idle:`` entry these fields give the default model ({} when none is set)."""
        fields = {"min_replicas": self.min_replicas, "idle_after_s": self.idle_after_s}
        return {k: v for k, v in {**fields, "stop_after_s": self.stop_after_s}.items() if v is not None}


class Mesh:
    """A running local mesh. Use ``async with Mesh(config) as mesh:`` or start()/stop()."""

    def __init__(self, config: MeshConfig | None = None, sink: LogSink | None = None) -> None:
        self.config = config or MeshConfig()
        self.sink = sink or stdout_sink()
        self.processes: dict[str, ServiceProcess] = {}
        self.redis_url = self.config.redis_url
        self.state_redis_url = self.config.state_redis_url or ""
        """The state Redis's URL (set by :meth:`start` when the mesh starts one or shares ``redis_url``)."""
        self.state_dir = ""
        """The data directory of the state Redis the mesh started ("" when it uses one given)."""
        self._redis: ServiceProcess | None = None
        self._state_redis: ServiceProcess | None = None
        self._state_lock: IO[str] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._state_tmp: tempfile.TemporaryDirectory[str] | None = None
        self.front_door: FrontDoor | None = None
        self._router_ports: list[int] = []  # the embedded routers' internal ports (``embed_router``)
        self._models_tmp: tempfile.TemporaryDirectory[str] | None = None  # the router's models file
        self._port_env: dict[str, str] = {}  # process name -> the setting of its gRPC port
        self.supervisor: Supervisor | None = None
        """Restarts crashed children once the mesh is up (``MeshConfig.supervise``)."""
        self.on_change: Callable[[], object] | None = None
        """Called after a supervised child exited or came back (``meshserve up`` rewrites its state file)."""
        self.models: dict[str, Any] = {}
        """The routers' models file as read (its ``idle:`` policies drive the local scaler); {} for none."""
        self.scaler: Scaler | None = None
        """Stops idle models' workers and starts one for a held request (``supervise`` and a stop policy)."""
        self._scaling: asyncio.Task[None] | None = None

    @property
    def gateway_address(self) -> str:
        return self.processes["gateway"].address

    @property
    def gateway_addresses(self) -> list[str]:
        """Every gateway replica's address, the first one's (``gateway_address``) first."""
        return [self.processes[n].address for n in self._gateway_names()]

    def _gateway_names(self) -> list[str]:
        """The gateway replicas' process names ("gateway", "gateway-1", ...), in start order."""
        return [n for n in self.processes if n == "gateway" or n.startswith("gateway-")]

    @property
    def router_process(self) -> ServiceProcess:
        """The process the router runs in: its own, or the gateway's (``embed_router``)."""
        return self.processes.get("router") or self.processes["gateway"]

    @property
    def router_address(self) -> str:
        return self.router_addresses[0]

    @property
    def router_addresses(self) -> list[str]:
        """Every router's internal address: the router process's, or each gateway's own (embedded)."""
        if "router" not in self.processes:  # embedded in the gateways
            return [f"127.0.0.1:{port}" for port in self._router_ports]
        return [self.processes["router"].address]

    @property
    def http_base_url(self) -> str:
        """OpenAI base URL of the front door (``MeshConfig(envoy=True)`` only)."""
        if self.front_door is None:
            raise RuntimeError("the front door is not running; start the mesh with MeshConfig(envoy=True)")
        return self.front_door.base_url

    @property
    def redis_processes(self) -> dict[str, ServiceProcess]:
        """The Redis servers the mesh started, by process name ("redis", :data:`STATE_REDIS`)."""
        return {p.name: p for p in (self._redis, self._state_redis) if p is not None}

    @property
    def cache_address(self) -> str:
        return self.processes["cache"].address

    def metrics_urls(self) -> dict[str, str]:
        """Every service's Prometheus /metrics URL, the front door's HTTP adapters included."""
        adapters = self.front_door.adapters if self.front_door is not None else []
        procs = [*self.processes.items(), *((a.name, a) for a in adapters)]
        return {n: f"http://127.0.0.1:{p.metrics_port}/metrics" for n, p in procs if p.metrics_port}

    def metrics_endpoints(self) -> str:
        """`name=http://host:port/metrics` for every service that serves metrics."""
        return " ".join(f"{name}={url}" for name, url in self.metrics_urls().items())

    def describe(self) -> dict[str, object]:
        """Addresses of the running services, which `meshserve up` records in its state file
        (services/local/state.py) for `meshserve status`, `meshserve cache` and `meshserve keys`."""
        metrics = self.metrics_urls()
        return {
            "gateway": self.gateway_address,
            "gateways": self.gateway_addresses,
            "router": self.router_address,
            "cache": self.cache_address,
            "redis": self.redis_url,
            "state_redis": self.state_redis_url,
            **({"state_dir": self.state_dir} if self.state_dir else {}),
            "metrics": metrics,
            **({"services": self.supervisor.snapshot()} if self.supervisor is not None else {}),
            **({"scale_events": self.scaler.events[-20:]} if self.scaler is not None else {}),
        }

    def workers(self, tier: str) -> list[ServiceProcess]:
        """Worker processes of a tier ("edge" or "cloud"), in start order."""
        return [p for n, p in self.processes.items() if n.startswith(f"{tier}-")]

    def _env(self, **values: str | int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.extra_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update({k: str(v) for k, v in values.items()})
        return env

    def _service(
        self,
        name: str,
        module: str,
        *,
        launcher: Sequence[str] = (),
        settings: Mapping[str, str | int] | None = None,
        **env: str | int,
    ) -> ServiceProcess:
        # Every service serves Prometheus /metrics on a free loopback port (logged in service_started).
        prefix = "MESHSERVE_" + module.rsplit(".", 1)[-1].upper()
        env = {f"{prefix}_METRICS_PORT": 0, **(settings or {}), **env}
        proc = ServiceProcess(name, [sys.executable, "-m", *launcher, module], self._env(**env), self.sink)
        self.processes[name] = proc
        self._port_env[name] = f"{prefix}_PORT"
        return proc

    async def _start_redis(self) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed; run `make setup` or pass --redis-url")
        self._tmp = tempfile.TemporaryDirectory(prefix="meshserve-redis-")
        self._redis, self.redis_url = await spawn_redis(
            self._tmp.name,
            self.sink,
            self._env(),
            args=cache_redis_args(self.config.redis_maxmemory),
            batch=self.config.redis_batch,
        )

    async def _start_state_redis(self) -> None:
        """The state Redis: its append-only file in ``state_dir`` (replayed when it holds one)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed; run `make setup` or pass --state-redis-url")
        directory = self.config.state_dir
        if not directory:
            self._state_tmp = tempfile.TemporaryDirectory(prefix="meshserve-state-")
            directory = self._state_tmp.name
        self._state_lock = lock_dir(Path(directory))
        self.state_dir = directory
        self._state_redis, self.state_redis_url = await spawn_redis(
            directory, self.sink, self._env(), args=STATE_REDIS_ARGS, batch=self.config.redis_batch, name=STATE_REDIS
        )

    async def start_redis(self) -> None:
        """The first step of :meth:`start`: start the cache and the state Redis as configured (or take
        the URLs given); sets ``redis_url`` and ``state_redis_url``. :meth:`stop` stops them."""
        cfg = self.config
        if not self.redis_url:
            await self._start_redis()
        if cfg.state_redis_url == "" or (cfg.state_redis_url is None and not cfg.redis_url):
            await self._start_state_redis()
        elif cfg.state_redis_url is None:  # a Redis was given: one Redis for the cache and the state
            self.state_redis_url = self.redis_url

    async def start(self) -> Mesh:
        cfg = self.config
        timeout = cfg.start_timeout_s
        try:
            await self.start_redis()
            router_env: dict[str, str | int] = {
                "MESHSERVE_ROUTER_REDIS_URL": self.redis_url,
                "MESHSERVE_ROUTER_EDGE_MAX_PROMPT_TOKENS": cfg.edge_max_prompt_tokens,
            }
            if cfg.edge_versions or cfg.edge_models or cfg.idle_policy():
                self._models_tmp = tempfile.TemporaryDirectory(prefix="meshserve-models-")
                path = Path(self._models_tmp.name) / "models.yaml"
                models_dir = cfg.extra_env.get("MESHSERVE_MODELS_DIR")
                path.write_text(models_file(cfg, model_paths(models_dir=Path(models_dir) if models_dir else None)))
                router_env["MESHSERVE_ROUTER_MODELS_FILE"] = str(path)
            elif cfg.models_file:
                router_env["MESHSERVE_ROUTER_MODELS_FILE"] = cfg.models_file
            if models_path := router_env.get("MESHSERVE_ROUTER_MODELS_FILE"):
                self.models = read_models(str(models_path))
            gateway_env: dict[str, str | int] = {
                "MESHSERVE_GATEWAY_API_KEYS": f"dev:{api_key_hash(cfg.api_key)}",
                "MESHSERVE_GATEWAY_REDIS_URL": self.redis_url,  # rate limits
                "MESHSERVE_GATEWAY_STATE_REDIS_URL": self.state_redis_url,  # keys (`meshserve keys`), files, batches
            }
            names = ["gateway", *(f"gateway-{i}" for i in range(1, cfg.gateways))]
            ports = [cfg.gateway_port, *([0] * (cfg.gateways - 1))]
            gateways: list[ServiceProcess] = []
            if cfg.embed_router:  # first: the workers register with their routers (on ports chosen here)
                for name, port in zip(names, ports, strict=True):
                    self._router_ports.append(free_port())
                    settings = {
                        **gateway_env,
                        **router_env,
                        "MESHSERVE_GATEWAY_PORT": port,
                        "MESHSERVE_ROUTER_PORT": self._router_ports[-1],
                        "MESHSERVE_GATEWAY_EMBED_ROUTER": "true",
                    }
                    gateways.append(self._service(name, "services.gateway", settings=settings))
                await asyncio.gather(*(g.spawn() for g in gateways))
                await asyncio.gather(*(g.wait_started(timeout) for g in gateways))
            else:
                router = self._service("router", "services.router", settings=router_env)
                await router.spawn()  # first: the workers register with it (it serves once one has)
                await router.wait_started(timeout)
            router_address = self.router_address
            routers = ",".join(self.router_addresses)  # a worker heartbeats to every one
            workers = [
                self._service(
                    f"edge-{i}",
                    "services.edge_worker",
                    MESHSERVE_EDGE_WORKER_WORKER_ID=f"edge-{i}",
                    MESHSERVE_EDGE_WORKER_THREADS=cfg.edge_threads,
                    MESHSERVE_EDGE_WORKER_ROUTER_ADDRESS=routers,
                )
                for i in range(cfg.edge_workers)
            ] + [
                self._service(
                    f"cloud-{i}",
                    "services.gpu_worker",
                    launcher=torchrun_launcher(cfg.cloud_tp),
                    MESHSERVE_GPU_WORKER_WORKER_ID=f"cloud-{i}",
                    MESHSERVE_GPU_WORKER_THREADS=max(1, cfg.cloud_threads // cfg.cloud_tp),
                    MESHSERVE_GPU_WORKER_ROUTER_ADDRESS=routers,
                    MESHSERVE_GPU_WORKER_REDIS_URL=self.redis_url,  # shared KV prefix cache
                    settings=tp_env(cfg.cloud_tp),
                )
                for i in range(cfg.cloud_workers)
            ]
            workers += [  # more versions of the default model, more model ids: one edge worker each
                self._service(
                    f"edge-{kind}-{name}",
                    "services.edge_worker",
                    MESHSERVE_EDGE_WORKER_WORKER_ID=f"edge-{kind}-{name}",
                    MESHSERVE_EDGE_WORKER_THREADS=cfg.edge_threads,
                    MESHSERVE_EDGE_WORKER_ROUTER_ADDRESS=routers,
                    MESHSERVE_EDGE_WORKER_MODEL_DIR=directory,
                    MESHSERVE_EDGE_WORKER_MODEL_ID=DEFAULT_MODEL_ID if kind == "version" else name,
                    MESHSERVE_EDGE_WORKER_MODEL_VERSION=name if kind == "version" else EXTRA_MODEL_BUILD,
                )
                for kind, extra in (("version", cfg.edge_versions), ("model", cfg.edge_models))
                for name, directory in extra.items()
            ]
            await asyncio.gather(*(w.spawn() for w in workers))
            await asyncio.gather(*(w.wait_started(timeout) for w in workers))
            await asyncio.gather(*(w.wait_serving(timeout) for w in workers))
            if cfg.embed_router:  # SERVING once a worker has registered
                try:
                    await asyncio.gather(*(wait_for_health(r, timeout) for r in self.router_addresses))
                except TimeoutError:
                    raise TimeoutError(
                        f"no worker registered with the gateway's router within {timeout:.0f} s; see their logs"
                    ) from None
            else:
                await router.wait_serving(timeout)
            cache = self._service(  # cache admin service (`meshserve cache stats|flush|warm`)
                "cache",
                "services.cache",
                MESHSERVE_CACHE_REDIS_URL=self.redis_url,
                MESHSERVE_CACHE_ROUTER_ADDRESS=router_address,
            )
            await cache.spawn()
            await cache.wait_started(timeout)
            await cache.wait_serving(timeout)
            if not cfg.embed_router:
                for name, port in zip(names, ports, strict=True):
                    settings = {
                        **gateway_env,
                        "MESHSERVE_GATEWAY_PORT": port,
                        "MESHSERVE_GATEWAY_ROUTER_ADDRESS": router_address,
                        "MESHSERVE_GATEWAY_EMBED_ROUTER": "false",
                    }
                    gateways.append(self._service(name, "services.gateway", settings=settings))
                await asyncio.gather(*(g.spawn() for g in gateways))
                await asyncio.gather(*(g.wait_started(timeout) for g in gateways))
            await asyncio.gather(*(g.wait_serving(timeout) for g in gateways))
            runners = [  # each names itself in the consumer group by host and pid
                self._service(
                    name,
                    "services.batch",
                    MESHSERVE_BATCH_REDIS_URL=self.state_redis_url,  # files, batches, the work stream
                    MESHSERVE_BATCH_ROUTER_ADDRESSES=routers,
                )
                for name in ["batch", *(f"batch-{i}" for i in range(1, cfg.batch_runners))]
            ]
            await asyncio.gather(*(r.spawn() for r in runners))
            await asyncio.gather(*(r.wait_started(timeout) for r in runners))
            if cfg.envoy:  # last: Envoy only takes traffic once everything behind it serves
                self.front_door = FrontDoor(
                    self.gateway_addresses,
                    self.sink,
                    http_port=cfg.http_port,
                    tls_cert=cfg.tls_cert,
                    tls_key=cfg.tls_key,
                    # the adapters keep the stored /v1/responses in the mesh's state Redis
                    env={"MESHSERVE_GATEWAY_HTTP_REDIS_URL": self.state_redis_url, **cfg.extra_env},
                    timeout_s=timeout,
                )
                await self.front_door.start()
            if cfg.supervise:
                self._supervise()
                self._scale()
        except BaseException:
            await self.stop()
            raise
        return self

    def _supervise(self) -> None:
        """Watch every child (services/local/supervise.py). A restarted child gets the command and
        environment it started with; all but the workers keep their gRPC port (pinned here)."""
        sup = self.supervisor = Supervisor(self.sink, self.config.restart_policy, on_change=self._changed)
        timeout = self.config.restart_policy.ready_timeout_s
        spares = self.config.warm_spares  # for the `python -m` services (ServiceProcess.can_stand_by)

        async def serving(proc: ServiceProcess) -> None:
            await proc.wait_started(timeout)
            await proc.wait_serving(timeout)

        def pin(setting: str) -> Callable[[ServiceProcess], None]:
            def keep_port(proc: ServiceProcess) -> None:
                if proc.port:
                    proc.env[setting] = str(proc.port)

            return keep_port

        for name, proc in self.processes.items():
            worker = name.startswith(("edge-", "cloud-"))
            sup.watch(proc, serving, None if worker else pin(self._port_env[name]), standby=spares)
        batch = self.config.redis_batch

        def answering(url: str) -> Callable[[ServiceProcess], Awaitable[None]]:
            async def ready(proc: ServiceProcess) -> None:
                await wait_redis(url, timeout)  # the state Redis answers once it has replayed its AOF
                if batch and proc.proc is not None:
                    yield_on_wakeup(proc.proc.pid)

            return ready

        for redis, url in ((self._redis, self.redis_url), (self._state_redis, self.state_redis_url)):
            if redis is not None:
                sup.watch(redis, answering(url))  # its command line holds its port (and its data dir)
        if self.front_door is not None:
            envoy = self.front_door.envoy

            async def envoy_ready(proc: ServiceProcess) -> None:
                await envoy.wait_ready(timeout)

            async def adapter_ready(proc: ServiceProcess) -> None:
                await proc.wait_started(timeout)

            sup.watch(envoy.process, envoy_ready)  # its bootstrap holds its ports
            for adapter in self.front_door.adapters:
                sup.watch(adapter, adapter_ready, pin("MESHSERVE_GATEWAY_HTTP_PORT"), standby=spares)

    def workers_by_version(self) -> WorkerMap:
        """Model id -> version -> the names of the worker processes serving it, in start order (edge
        first). The versions are those of the models file the mesh writes (:func:`models_file`); with
        no extra version or model the default model's workers are under None (the file asked for
        names its versions, not which worker runs which)."""
        split = bool(self.config.edge_versions or self.config.edge_models)
        out: dict[str, dict[str | None, list[str]]] = {}
        version: str | None
        for name in self.processes:
            if name.startswith("edge-model-"):
                model, version = name.removeprefix("edge-model-"), EXTRA_MODEL_BUILD
            elif name.startswith("edge-version-"):
                model, version = DEFAULT_MODEL_ID, name.removeprefix("edge-version-")
            elif name.startswith(("edge-", "cloud-")):
                model, version = DEFAULT_MODEL_ID, PREPARED_VERSION if split else None
            else:
                continue
            out.setdefault(model, {}).setdefault(version, []).append(name)
        return out

    def router_metrics_urls(self) -> list[str]:
        """The /metrics URLs of every router (the router process's, or each gateway's with its router)."""
        names = ["router"] if "router" in self.processes else self._gateway_names()
        urls = self.metrics_urls()
        return [urls[n] for n in names if n in urls]

    def _scale(self) -> None:
        """Start the local scaler (services/local/scaler.py) when a model has a stop policy."""
        assert self.supervisor is not None
        policies = stop_policies(self.models, self.workers_by_version())
        if not policies:
            return
        self.scaler = Scaler(
            policies, SupervisedWorkers(self.supervisor), log=sink_logger(self.sink), on_change=self._changed
        )
        self._scaling = asyncio.create_task(
            scaler_run(self.scaler, self.router_metrics_urls, self.config.scale_interval_s), name="local-scaler"
        )

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def stop(self) -> None:
        """Stop in order: front door, gateways, cache, workers (in parallel; each finishes its streams
        and tells the router it leaves), router, the cache Redis, the state Redis. With the router in
        the gateways' processes the gateways stop after the workers instead: their routers must be
        there to hear them leave (new requests meanwhile get UNAVAILABLE: no worker left), and their
        streams finish first.
        Scaling and supervision end first: nothing stopped here is restarted."""
        if self._scaling is not None:
            self._scaling.cancel()
            await asyncio.gather(self._scaling, return_exceptions=True)
            self._scaling = None
        if self.supervisor is not None:
            await self.supervisor.close()
        if self.front_door is not None:
            await self.front_door.stop()
            self.front_door = None
        gateways = self._gateway_names()
        embedded = self.config.embed_router
        runners = [n for n in self.processes if n == "batch" or n.startswith("batch-")]
        first = [*runners, "cache"] if embedded else [*runners, *gateways, "cache"]
        await asyncio.gather(*(self.processes[n].stop() for n in first if n in self.processes))
        last = ["router", *gateways] if embedded else ["router"]
        await asyncio.gather(*(p.stop() for n, p in self.processes.items() if n not in (*first, *last)))
        await asyncio.gather(*(self.processes[n].stop() for n in last if n in self.processes))
        if self._redis is not None:
            await self._redis.stop()
            self._redis = None
        if self._state_redis is not None:  # SIGTERM: it flushes its append-only file before it exits
            await self._state_redis.stop()
            self._state_redis = None
        if self._state_lock is not None:
            self._state_lock.close()  # releases the lock
            self._state_lock = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._state_tmp is not None:
            self._state_tmp.cleanup()
            self._state_tmp = None
        if self._models_tmp is not None:
            self._models_tmp.cleanup()
            self._models_tmp = None

    async def __aenter__(self) -> Mesh:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def lock_dir(directory: Path) -> IO[str]:
    """Hold an exclusive lock on ``directory`` (a ``meshserve.lock`` file in it) while the returned file
    is open: two Redis replaying and appending to one append-only file would corrupt it. RuntimeError
    when another mesh holds it. Makes ``directory`` when missing."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = (directory / "meshserve.lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RuntimeError(
            f"the state directory {directory} is in use by another mesh; stop that one (`meshserve status` "
            "shows it) or pass --state-dir with another directory"
        ) from None
    return handle


def torchrun_launcher(ranks: int) -> list[str]:
    """``python -m`` arguments that start a module as a TP group of ``ranks`` (none for one rank).

    The same launch as deploy/'s ``torchrun --standalone --nnodes=1 --nproc-per-node=N
    --shutdown-timeout=S --no-python meshserve serve gpu-worker`` (``serve`` execs the module);
    the shutdown timeout lets rank 0 drain before torchrun kills the ranks.
    """
    if ranks <= 1:
        return []
    return [
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={ranks}",
        "--shutdown-timeout=15",
        "-m",
    ]


def tp_env(ranks: int) -> dict[str, str]:
    """Keep a local TP group's gloo traffic on loopback (Linux names it ``lo``)."""
    return {"GLOO_SOCKET_IFNAME": "lo"} if ranks > 1 and sys.platform == "linux" else {}


__all__ = ["DEV_API_KEY", "Mesh", "MeshConfig", "ServiceProcess", "wait_for_health"]


DEFAULT_MODELS_FILE = Path(__file__).resolve().parents[2] / "deploy" / "models.yaml"
"""The models file `meshserve up` gives its routers: the default model with the generation defaults its
model card recommends, where an operator sees and changes them (``meshserve up --models-file``)."""

EXTRA_MODEL_BUILD = "1"
"""The build id an extra model id's worker reports (``MeshConfig.edge_models``)."""

PREPARED_VERSION = "prepared"
"""The default model's version that its own workers (edge-N, cloud-N) serve in the models file the mesh
writes with extra versions or models."""


def models_file(cfg: MeshConfig, default: ModelPaths) -> str:
    """The router's models file (YAML) for ``cfg``. With extra versions or models: the default model with
    its prepared build as ``prepared`` (all the weight) and each extra version; each extra model id
    with its directory as its tokenizer; the default model keeps the ``generation`` and ``idle`` of the
    file asked for (``cfg.models_file``). Without: the file asked for as it is (or the default model
    alone). Either way the idle flags (:meth:`MeshConfig.idle_policy`) set the default model's ``idle``
    over the file's."""
    given = read_models(cfg.models_file) if cfg.models_file else {}
    if cfg.edge_versions or cfg.edge_models:
        versions = [{"name": PREPARED_VERSION, "build": default.version()}] + [{"name": n} for n in cfg.edge_versions]
        weights = {"weights": {PREPARED_VERSION: 100}}
        entry: dict[str, Any] = {"id": DEFAULT_MODEL_ID, "versions": versions, "rollout": weights}
        for spec in given.get("models", ()):  # the default model's defaults and idle policy stay the file's
            if spec.get("id") == DEFAULT_MODEL_ID:
                entry.update({k: spec[k] for k in ("generation", "idle") if spec.get(k)})
        models: list[dict[str, Any]] = [entry]
        models += [
            {"id": model_id, "tokenizer_dir": directory, "versions": [{"name": EXTRA_MODEL_BUILD}]}
            for model_id, directory in cfg.edge_models.items()
        ]
        content: dict[str, Any] = {"default": DEFAULT_MODEL_ID, "models": models}
    else:
        content = given or {"default": DEFAULT_MODEL_ID, "models": [{"id": DEFAULT_MODEL_ID}]}
        models = content.setdefault("models", [])
        entry = next((m for m in models if m.get("id") == DEFAULT_MODEL_ID), {})
        if not entry:
            entry = {"id": DEFAULT_MODEL_ID}
            models.append(entry)
    if policy := cfg.idle_policy():
        entry["idle"] = {**(entry.get("idle") or {}), **policy}
    return yaml.safe_dump(content, sort_keys=False)


def read_models(path: str) -> dict[str, Any]:
    """A models file's content ({} when empty)."""
    content = yaml.safe_load(Path(path).read_text())
    return content if isinstance(content, dict) else {}
