"""deploy/compose.yaml declares what plain ``meshserve up`` starts: the same services, commands and
environment, the router inside the gateway's process (``--split-router``'s own router process is tested
at the end of this module).

The launcher's side is recorded from its real code (:mod:`tests.unit.deploy.up_capture`); the compose
side is the file as docker compose reads it. Loopback ``127.0.0.1:<port>`` addresses in the
launcher's environment are translated to ``<service>:<container port>`` before comparing, so
``MESHSERVE_ROUTER_EDGE_WORKERS=127.0.0.1:41001,127.0.0.1:41002`` must appear in compose as
``edge-0:50061,edge-1:50061``; the gateway's embedded router port becomes ``gateway:<its ROUTER_PORT>``.
Differences that containers need are listed in ``CONTAINER_ONLY`` and ``REPLICATED_ROUTERS`` and
checked too.
"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from services.common.config import DEFAULT_INTERNAL_TOKEN, ServiceSettings
from services.controlplane.frontdoor import FrontDoor
from services.local.mesh import DEFAULT_MODELS_FILE, STATE_REDIS
from tests.unit.deploy import commands, compose_model
from tests.unit.deploy.up_capture import Captured, capture_up

ONE_SHOT_OR_OPTIONAL = {"models", "prometheus", "grafana"}
"""Compose services `meshserve up` has no counterpart of: the model-preparation step (`meshserve up`
expects prepared models, `make run` prepares them) and the `observe` profile."""
FRONT_DOOR = "envoy"
REPLICAS = {"gateway": 2}
"""Scaled on purpose in compose (stateless; Envoy balances them); everything else runs once, as in `up`."""
CONTAINER_ONLY = {"HOST", "PORT", "INTERNAL_TOKEN"}
"""Per-service settings compose adds: listen on all interfaces, fixed ports, the internal credential
from $MESHSERVE_INTERNAL_TOKEN (default: the same built-in token `up` uses)."""
WORKERS = {"edge-0", "edge-1", "cloud-0"}
REPLICATED_ROUTERS = {"ROUTER_RESOLVE": "true"}
"""What compose adds to each worker: `up` lists every gateway's router port; in compose `gateway` is one
DNS name for both replicas, which the worker re-resolves each heartbeat interval and heartbeats all."""
COMMON_ONLY = {"MESHSERVE_MODELS_DIR": "/models"}
FILES = {str(DEFAULT_MODELS_FILE): "/etc/meshserve/models.yaml"}
"""Files of the repository `up` names by path, and where compose bind-mounts them."""
REDIS = {"redis", STATE_REDIS}
"""Third-party images: the cache Redis and the state Redis (no meshserve settings, no gRPC health)."""
"""The models volume (``up`` uses ~/.cache/meshserve/models)."""


@pytest.fixture(scope="module")
async def up() -> Captured:
    return await capture_up()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return compose_model.load()


def _prefix(child_env: dict[str, str]) -> str:
    """``MESHSERVE_<SERVICE>_`` of a child, from the metrics port variable every service gets."""
    (key,) = [k for k in child_env if k.endswith("_METRICS_PORT")]
    return key.removesuffix("METRICS_PORT")


EMBEDDED_ROUTER = "MESHSERVE_ROUTER_"


def _prefixes(child_env: dict[str, str]) -> list[str]:
    """Every settings prefix a child reads: its own, and the router's when the router runs inside it."""
    own = _prefix(child_env)
    return [own, EMBEDDED_ROUTER] if child_env.get(own + "EMBED_ROUTER") == "true" else [own]


def _embedded_router(child: Any) -> str | None:
    """The loopback address of the router inside this child (a gateway under plain `up`), if any."""
    env = child.env_delta()
    if child.name in REDIS or len(_prefixes(env)) == 1:
        return None
    return f"127.0.0.1:{env[EMBEDDED_ROUTER + 'PORT']}"


def _translator(up: Captured, compose: dict[str, Any]):  # type: ignore[no-untyped-def]
    addresses = {f"127.0.0.1:{up.redis_port}": "redis:6379", f"127.0.0.1:{up.state_redis_port}": "redis-state:6379"}
    for name, child in up.children.items():
        if name in REDIS:
            continue
        env = compose_model.service_env(compose["services"][name])
        addresses[child.address] = f"{name}:{env[_prefix(child.env_delta()) + 'PORT']}"
        if (router := _embedded_router(child)) is not None:
            addresses[router] = f"{name}:{env[EMBEDDED_ROUTER + 'PORT']}"
    pattern = re.compile(r"127\.0\.0\.1:\d+")

    def translate(value: str) -> str:
        def sub(m: re.Match[str]) -> str:
            assert m[0] in addresses, f"{m[0]} is no service `meshserve up` started"
            return addresses[m[0]]

        if value in FILES:
            return FILES[value]
        return pattern.sub(sub, value)

    return translate


def test_same_services(up: Captured, compose: dict[str, Any]) -> None:
    assert up.front_door is not None, "`meshserve up` starts the front door by default"
    declared = set(compose["services"]) - ONE_SHOT_OR_OPTIONAL
    assert declared == set(up.children) | {FRONT_DOOR}
    for name, service in compose["services"].items():
        replicas = service.get("deploy", {}).get("replicas", 1)
        assert replicas == REPLICAS.get(name, 1), name
    assert up.config.edge_workers == len([n for n in up.children if n.startswith("edge-")])


def _launched(argv: list[str]) -> tuple[str, argparse.Namespace | None]:
    """(service module, torchrun arguments if launched through torchrun) of a child `up` started."""
    launcher = None
    if "torch.distributed.run" in argv or Path(argv[0]).name == "torchrun":
        import torch.distributed.run as torchrun

        start = argv.index("torch.distributed.run") + 1 if "torch.distributed.run" in argv else 1
        launcher = torchrun.get_args_parser().parse_args(argv[start:])
        if launcher.module:
            return launcher.training_script, launcher
        argv = [launcher.training_script, *launcher.training_script_args]
    if "serve" in argv:
        return commands.parse(["meshserve", *argv[argv.index("serve") :]]).module, launcher
    return argv[argv.index("-m") + 1], launcher


def test_same_commands(up: Captured, compose: dict[str, Any]) -> None:
    for name, child in up.children.items():
        if name in REDIS:
            continue
        module, launcher = _launched(child.argv)
        parsed = commands.parse(compose_model.command(compose["services"][name]))
        assert parsed.module == module, name
        if launcher is not None:  # the same TP degree by default
            assert parsed.torchrun is not None, f"`up` runs {name} under torchrun; compose must too"
            assert str(parsed.torchrun.nproc_per_node) == str(launcher.nproc_per_node), name


def test_command_comparison_understands_torchrun() -> None:
    python = "/venv/bin/python"
    assert _launched([python, "-m", "services.gpu_worker"]) == ("services.gpu_worker", None)
    tp = ["--nproc-per-node=3"]
    module, launcher = _launched([python, "-m", "torch.distributed.run", *tp, "-m", "services.gpu_worker"])
    assert module == "services.gpu_worker" and launcher is not None and launcher.nproc_per_node == "3"
    module, launcher = _launched(["torchrun", *tp, "--no-python", "meshserve", "serve", "gpu-worker"])
    assert module == "services.gpu_worker" and launcher is not None


def test_same_environment(up: Captured, compose: dict[str, Any]) -> None:
    translate = _translator(up, compose)
    for name, child in up.children.items():
        if name in REDIS:
            continue
        launched = child.env_delta()
        declared = compose_model.service_env(compose["services"][name])
        prefix = _prefix(launched)
        prefixes = _prefixes(launched)
        for key, value in launched.items():
            assert key in declared, f"{name}: compose lacks {key} (`meshserve up` sets it to {value!r})"
            if key == prefix + "METRICS_PORT":
                assert int(declared[key]) > 0, f"{name}: a fixed metrics port for scraping"
            elif key == EMBEDDED_ROUTER + "PORT":  # `up` picks a free one
                assert int(declared[key]) > 0, f"{name}: a fixed port for the workers' heartbeats"
            else:
                assert declared[key] == translate(value), f"{name}: {key}"
        for key in set(declared) - set(launched):
            if child.env.get(key) == declared[key]:
                continue  # inherited by `up`'s child with the same value (e.g. PYTHONUNBUFFERED=1)
            if key in COMMON_ONLY:
                assert declared[key] == COMMON_ONLY[key]
                continue
            if name in WORKERS and key.removeprefix(prefix) in REPLICATED_ROUTERS:
                assert declared[key] == REPLICATED_ROUTERS[key.removeprefix(prefix)], f"{name}: {key}"
                continue
            fields = [key.removeprefix(p) for p in prefixes if key.startswith(p)]
            assert fields and fields[0] in CONTAINER_ONLY, f"{name}: {key} is set only in compose"
        for p in prefixes:
            assert declared[p + "HOST"] == "0.0.0.0", f"{name}: {p}HOST"
            assert declared[p + "INTERNAL_TOKEN"] == DEFAULT_INTERNAL_TOKEN  # ${MESHSERVE_INTERNAL_TOKEN:-...}
        assert EMBEDDED_ROUTER + "METRICS_PORT" not in declared, f"{name}: the process serves one /metrics port"
    for worker in WORKERS:  # every worker heartbeats every gateway replica's router
        declared = compose_model.service_env(compose["services"][worker])
        prefix = _prefix(up.children[worker].env_delta())
        assert declared[prefix + "ROUTER_ADDRESS"] == "gateway:50052"


def _redis_flags(argv: list[str]) -> dict[str, str]:
    pairs = dict(zip(argv[1::2], argv[2::2], strict=False))
    return {k: v for k, v in pairs.items() if k not in ("--port", "--bind", "--dir")}


def test_redis_runs_with_the_launchers_memory_policy(up: Captured, compose: dict[str, Any]) -> None:
    launched = up.children["redis"].argv
    declared = compose_model.command(compose["services"]["redis"])
    assert declared[0] == "redis-server" and launched[0].endswith("redis-server")
    assert _redis_flags(declared) == _redis_flags(launched)
    assert _redis_flags(declared)["--maxmemory-policy"] == "allkeys-lru"
    assert _redis_flags(declared)["--appendonly"] == "no"  # a cache: nothing on disk


def test_the_state_redis_runs_with_the_launchers_persistence(up: Captured, compose: dict[str, Any]) -> None:
    """Keys, files, batches and stored responses live in a Redis of their own that keeps an append-only
    file on a volume and never evicts, in compose as under `meshserve up`."""
    launched = up.children[STATE_REDIS].argv
    service = compose["services"][STATE_REDIS]
    declared = compose_model.command(service)
    assert declared[0] == "redis-server" and launched[0].endswith("redis-server")
    assert _redis_flags(declared) == _redis_flags(launched)
    flags = _redis_flags(declared)
    assert (flags["--appendonly"], flags["--appendfsync"], flags["--maxmemory-policy"]) == (
        "yes",
        "always",
        "noeviction",
    )
    assert "--maxmemory" not in flags  # noeviction with no limit: writes never fail for memory
    (volume,) = service["volumes"]
    name, _, target = volume.partition(":")
    assert (
        target == declared[declared.index("--dir") + 1] and name in compose["volumes"]
    )  # the AOF survives the container
    assert up.config.state_dir and launched[launched.index("--dir") + 1] == up.config.state_dir
    assert service["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]
    # Who gets which Redis: durable state to the state Redis, caches and rate limits to the cache Redis.
    state, cache = f"127.0.0.1:{up.state_redis_port}", f"127.0.0.1:{up.redis_port}"
    gateway = up.children["gateway"].env_delta()
    assert state in gateway["MESHSERVE_GATEWAY_STATE_REDIS_URL"] and cache in gateway["MESHSERVE_GATEWAY_REDIS_URL"]
    assert state in up.children["batch"].env_delta()["MESHSERVE_BATCH_REDIS_URL"]
    assert up.front_door is not None and state in up.front_door["env"]["MESHSERVE_GATEWAY_HTTP_REDIS_URL"]
    assert cache in gateway["MESHSERVE_ROUTER_REDIS_URL"]
    assert cache in up.children["cloud-0"].env_delta()["MESHSERVE_GPU_WORKER_REDIS_URL"]
    assert cache in up.children["cache"].env_delta()["MESHSERVE_CACHE_REDIS_URL"]
    envoy = compose_model.service_env(compose["services"][FRONT_DOOR])
    assert envoy["MESHSERVE_GATEWAY_HTTP_REDIS_URL"] == "redis://redis-state:6379/0"
    for name in ("gateway", "batch", FRONT_DOOR):  # compose starts them once their state is there
        assert compose["services"][name]["depends_on"][STATE_REDIS] == {"condition": "service_healthy"}, name


async def test_a_given_redis_holds_the_state_too_unless_a_state_redis_is_given() -> None:
    """`--redis-url` alone: one Redis for everything (as before the state Redis); `--state-redis-url`
    names the state Redis; neither: both are started."""
    shared = await capture_up(["--redis-url", "redis://127.0.0.1:6390/3"])
    assert set(shared.children) & REDIS == set()
    env = shared.children["gateway"].env_delta()
    assert env["MESHSERVE_GATEWAY_STATE_REDIS_URL"] == env["MESHSERVE_GATEWAY_REDIS_URL"] == "redis://127.0.0.1:6390/3"
    assert shared.children["batch"].env_delta()["MESHSERVE_BATCH_REDIS_URL"] == "redis://127.0.0.1:6390/3"
    split = await capture_up(
        ["--redis-url", "redis://127.0.0.1:6390/3", "--state-redis-url", "redis://127.0.0.1:6391/0"]
    )
    env = split.children["gateway"].env_delta()
    assert env["MESHSERVE_GATEWAY_STATE_REDIS_URL"] == "redis://127.0.0.1:6391/0"
    assert env["MESHSERVE_GATEWAY_REDIS_URL"] == "redis://127.0.0.1:6390/3"
    assert split.front_door is not None
    assert split.front_door["env"]["MESHSERVE_GATEWAY_HTTP_REDIS_URL"] == "redis://127.0.0.1:6391/0"


def test_front_door_fronts_the_gateways(up: Captured, compose: dict[str, Any]) -> None:
    assert up.front_door is not None
    translate = _translator(up, compose)
    parsed = commands.parse(compose_model.command(compose["services"][FRONT_DOOR]))
    assert parsed.subcommand == "frontdoor"
    assert parsed.args.gateways == translate(",".join(up.front_door["gateways"]))
    assert parsed.args.http_port == up.front_door["http_port"]
    assert (parsed.args.tls_cert, parsed.args.tls_key) == (up.front_door["tls_cert"], up.front_door["tls_key"])
    default_adapters = inspect.signature(FrontDoor).parameters["adapters"].default
    assert parsed.args.adapters == up.front_door.get("adapters", default_adapters)
    published = f"127.0.0.1:{parsed.args.http_port}:{parsed.args.http_port}"  # the host's loopback, as `up`
    assert compose["services"][FRONT_DOOR]["ports"] == [published]


def test_start_order_is_the_launchers(up: Captured, compose: dict[str, Any]) -> None:
    """A service given another's address waits for it as `up` does: healthy, or just started.

    `up` waits for a dependency's gRPC health (service_healthy) or only for its service_started line
    (service_started) before spawning the service that is given its address.
    A gateway's health is its embedded router's (SERVING once a worker registered), so `up` waiting for
    that router's port to serve counts as waiting for the gateway to be healthy.
    """
    translate = _translator(up, compose)
    services = compose["services"]
    conditions = {"serving": "service_healthy", "started": "service_started"}

    def awaited(dependency: str, child: str) -> str | None:
        router = _embedded_router(up.children[dependency])
        states = [up.awaited_before_spawn(d, child) for d in (dependency, router) if d is not None]
        return "serving" if "serving" in states else "started" if "started" in states else None

    for name, child in up.children.items():
        if name in REDIS:
            continue
        given = translate(" ".join(child.env_delta().values()))
        needs = {other for other in up.children if re.search(rf"\b{other}:\d+", given)} - {name}
        depends = services[name].get("depends_on", {})
        for dependency in needs:
            waited = awaited(dependency, name)
            assert waited is not None, f"`up` starts {name} before {dependency}, whose address it is given"
            assert depends.get(dependency) == {"condition": conditions[waited]}, f"{name} -> {dependency}"
        for dependency, condition in depends.items():  # and compose waits for nothing `up` does not
            if dependency not in ONE_SHOT_OR_OPTIONAL:
                waited = awaited(dependency, name)
                assert waited is not None and condition == {"condition": conditions[waited]}, f"{name} -> {dependency}"
    healthy = {"condition": "service_healthy"}
    assert services[FRONT_DOOR]["depends_on"] == {"gateway": healthy, STATE_REDIS: healthy}  # stored responses


def test_healthchecks_ask_each_service_over_grpc_health(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name in ONE_SHOT_OR_OPTIONAL or name in REDIS:
            continue
        check = commands.parse(service["healthcheck"]["test"][1:])
        assert service["healthcheck"]["test"][0] == "CMD"
        assert check.subcommand == "health"
        if name == FRONT_DOOR:
            port = commands.parse(compose_model.command(service)).args.http_port
        else:
            env = compose_model.service_env(service)
            ports = {k: v for k, v in env.items() if re.fullmatch(r"MESHSERVE_[A-Z_]+(?<!METRICS)_PORT", k)}
            if len(ports) > 1:  # a gateway with its router inside: its public port is the one asked
                ports = {k: v for k, v in ports.items() if not k.startswith(EMBEDDED_ROUTER)}
            (port,) = [int(v) for v in ports.values()]
        assert check.args.address == f"127.0.0.1:{port}", name


def test_stop_grace_outlasts_the_drain(compose: dict[str, Any]) -> None:
    """SIGKILL must not cut the drain short: stop_grace_period > shutdown_grace_s."""
    default_grace = ServiceSettings.model_fields["shutdown_grace_s"].default
    for name, service in compose["services"].items():
        if name in ONE_SHOT_OR_OPTIONAL or name in REDIS:
            continue
        env = compose_model.service_env(service)
        grace = max([float(v) for k, v in env.items() if k.endswith("_SHUTDOWN_GRACE_S")] or [default_grace])
        stop = service["stop_grace_period"]
        assert stop.endswith("s") and float(stop[:-1]) >= grace + 5, name
        launcher = commands.parse(compose_model.command(service)).torchrun
        if launcher is not None:  # torchrun SIGKILLs its ranks after --shutdown-timeout
            assert grace + 5 <= launcher.shutdown_timeout <= float(stop[:-1]) - 5, name


@pytest.mark.parametrize("flags", [[], ["--embed-router"]], ids=["default", "embed-router"])
async def test_embedded_router_starts_no_router_and_points_the_workers_at_the_gateways_router(flags: list[str]) -> None:
    embedded = await capture_up(flags)
    assert "router" not in embedded.children
    gateway = embedded.children["gateway"].env
    assert gateway["MESHSERVE_GATEWAY_EMBED_ROUTER"] == "true"
    router_address = f"127.0.0.1:{gateway['MESHSERVE_ROUTER_PORT']}"
    assert gateway["MESHSERVE_ROUTER_REDIS_URL"] == gateway["MESHSERVE_GATEWAY_REDIS_URL"]
    for worker in ("edge-0", "edge-1"):
        assert embedded.children[worker].env["MESHSERVE_EDGE_WORKER_ROUTER_ADDRESS"] == router_address
    assert embedded.children["cloud-0"].env["MESHSERVE_GPU_WORKER_ROUTER_ADDRESS"] == router_address
    assert embedded.children["cache"].env["MESHSERVE_CACHE_ROUTER_ADDRESS"] == router_address
    # The gateway (with its router) starts first; the workers register with it; the cache admin and
    # the front door wait until the router serves (a worker has registered).
    assert embedded.awaited_before_spawn("gateway", "edge-0") == "started"
    assert embedded.awaited_before_spawn(router_address, "cache") == "serving"


async def test_split_router_starts_the_router_first_and_the_gateway_after_it() -> None:
    split = await capture_up(["--split-router"])
    router = split.children["router"].env
    gateway = split.children["gateway"].env
    assert gateway["MESHSERVE_GATEWAY_EMBED_ROUTER"] == "false"
    assert gateway["MESHSERVE_GATEWAY_ROUTER_ADDRESS"].startswith("127.0.0.1:")
    assert "MESHSERVE_ROUTER_REDIS_URL" in router
    assert split.awaited_before_spawn("router", "edge-0") == "started"


def test_split_and_embed_router_flags_exclude_each_other() -> None:
    from services.cli.up import _parser

    with pytest.raises(SystemExit):
        _parser().parse_args(["--split-router", "--embed-router"])


async def test_the_router_stops_after_the_workers_so_it_hears_them_leave() -> None:
    # Split: the gateway stops first (no new calls; its streams drain), then the workers, then the router.
    split = (await capture_up(["--split-router"])).stop_order()
    assert split.index("gateway") < split.index("edge-0") < split.index("router")
    assert split.index("cloud-0") < split.index("router") and set(split[-2:]) == REDIS
    # Embedded: the gateway carries the router, so it stops after the workers.
    embedded = (await capture_up()).stop_order()
    assert "router" not in embedded
    for worker in ("edge-0", "edge-1", "cloud-0"):
        assert embedded.index("cache") < embedded.index(worker) < embedded.index("gateway")
    assert set(embedded[-2:]) == REDIS


@pytest.mark.parametrize("split", [False, True], ids=["embedded", "split"])
async def test_gateway_replicas_share_the_workers_and_stand_behind_the_front_door(split: bool) -> None:
    flags = ["--gateways", "3", *(["--split-router"] if split else [])]
    mesh = await capture_up(flags)
    names = ["gateway", "gateway-1", "gateway-2"]
    envs = [mesh.children[n].env for n in names]
    assert [env["MESHSERVE_GATEWAY_PORT"] for env in envs] == ["50051", "0", "0"]  # --port is the first one's
    assert mesh.front_door is not None and mesh.front_door["gateways"] == [mesh.children[n].address for n in names]
    worker_routers = mesh.children["edge-0"].env["MESHSERVE_EDGE_WORKER_ROUTER_ADDRESS"]
    if split:  # one router process for every gateway
        assert {env["MESHSERVE_GATEWAY_ROUTER_ADDRESS"] for env in envs} == {mesh.children["router"].address}
        assert worker_routers == mesh.children["router"].address
    else:  # a router in each gateway, each on a port of its own; every worker heartbeats to all
        routers = [f"127.0.0.1:{env['MESHSERVE_ROUTER_PORT']}" for env in envs]
        assert len(set(routers)) == 3 and worker_routers == ",".join(routers)
        assert mesh.children["cloud-0"].env["MESHSERVE_GPU_WORKER_ROUTER_ADDRESS"] == worker_routers
        for router in routers:  # the cache admin waits until every router has heard a worker
            assert mesh.awaited_before_spawn(router, "cache") == "serving"
    stops = mesh.stop_order()
    for name in names:
        if split:
            assert stops.index(name) < stops.index("edge-0") < stops.index("router")
        else:
            assert stops.index("edge-0") < stops.index(name)
