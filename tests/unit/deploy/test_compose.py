"""deploy/compose.yaml (and the GPU override) against the Compose specification's JSON schema, offline.

The schema is shipped in deploy/schemas/compose-spec.json (the compose_spec.json of the PyPI wheel
docker-compose 1.29.2, Apache-2.0), so no network is needed. Durations are format-checked too.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.common.config import default_load_cache_dir
from tests.unit.deploy import commands, compose_model, settings_check

SCHEMA = json.loads((compose_model.DEPLOY / "schemas" / "compose-spec.json").read_text())
_DURATION = re.compile(r"^(\d+(\.\d+)?(us|ms|s|m|h))+$")
_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("duration")
def _is_duration(value: object) -> bool:
    return not isinstance(value, str) or bool(_DURATION.match(value))


def _errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft201909Validator(SCHEMA, format_checker=_FORMATS)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize(
    "files",
    [
        (compose_model.COMPOSE,),
        (compose_model.COMPOSE, compose_model.COMPOSE_GPU),
        (compose_model.COMPOSE, compose_model.COMPOSE_VERSIONS),
    ],
    ids=["cpu", "cpu+gpu-override", "cpu+versions-override"],
)
def test_compose_files_match_the_compose_spec(files: tuple[Any, ...]) -> None:
    assert _errors(compose_model.load(*files, env={"MESHSERVE_TP_SIZE": "3"})) == []


def test_the_schema_catches_mistakes() -> None:
    """The validation is real: typical slips are reported."""
    doc = compose_model.load()
    broken = copy.deepcopy(doc)
    broken["services"]["gateway"]["healthcheck"]["interval"] = "5 seconds"
    broken["services"]["cache"]["depends_on"]["gateway"]["condition"] = "service_ready"
    broken["services"]["cache"]["enviroment"] = {"A": "1"}
    errors = _errors(broken)
    assert any(e.startswith("services/gateway/healthcheck/interval") for e in errors), errors
    assert any(e.startswith("services/cache/depends_on") for e in errors), errors
    assert any("enviroment" in e for e in errors), errors


def test_every_container_command_is_a_meshserve_entry_point() -> None:
    doc = compose_model.load(compose_model.COMPOSE, compose_model.COMPOSE_GPU)
    checked = 0
    for name, service in doc["services"].items():
        if not compose_model.is_meshserve(service):  # third-party images (redis, prometheus, grafana)
            continue
        parsed = commands.parse(compose_model.command(service))
        if parsed.subcommand == "serve":
            assert parsed.module.startswith("services.")
        checked += 1
        if "healthcheck" in service:
            assert commands.parse(service["healthcheck"]["test"][1:]).subcommand == "health", name
    assert checked == 8  # models, edge-0, edge-1, cloud-0, gateway (router inside), cache, batch, envoy


def test_the_gpu_override_reserves_one_gpu_per_tp_rank() -> None:
    env = {"MESHSERVE_TP_SIZE": "3"}
    doc = compose_model.load(compose_model.COMPOSE, compose_model.COMPOSE_GPU, env=env)
    cloud = doc["services"]["cloud-0"]
    launcher = commands.parse(compose_model.command(cloud)).torchrun
    assert launcher is not None and launcher.nproc_per_node == "3"
    (device,) = cloud["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and int(device["count"]) == 3
    assert cloud["build"]["target"] == "cuda"
    assert cloud["environment"]["MESHSERVE_GPU_WORKER_DEVICE"] == "cuda"
    assert doc["services"]["edge-0"]["build"]["target"] == "cpu"  # only the TP group needs CUDA


def test_unknown_commands_are_refused() -> None:
    with pytest.raises(commands.NotAnEntryPoint):
        commands.parse(["meshserve", "serve", "edge"])
    with pytest.raises(commands.NotAnEntryPoint):
        commands.parse(["meshserve", "launch", "router"])
    with pytest.raises(commands.NotAnEntryPoint):
        commands.parse(["python", "-m", "services.router"])
    with pytest.raises(commands.NotAnEntryPoint):
        commands.parse(["torchrun", "--nproc-per-node=2", "meshserve", "serve", "gpu-worker"])  # no --no-python


def test_models_volume_is_prepared_before_any_model_reader_starts() -> None:
    doc = compose_model.load()
    services = doc["services"]
    prepare = commands.parse(compose_model.command(services["models"]))
    assert (prepare.subcommand, prepare.args.models_command) == ("models", "prepare")
    assert "models:/models" in services["models"]["volumes"]
    assert doc["volumes"] == {"models": None, "load-cache": None, "redis-state": None}
    for name in ("edge-0", "edge-1", "cloud-0", "gateway"):  # the gateway's router reads the tokenizer
        assert services[name]["depends_on"]["models"] == {"condition": "service_completed_successfully"}
        assert "models:/models:ro" in services[name]["volumes"]


def test_every_setting_is_a_field_of_its_service() -> None:
    for override in (compose_model.COMPOSE_GPU, compose_model.COMPOSE_VERSIONS):
        doc = compose_model.load(compose_model.COMPOSE, override)
        for name, service in doc["services"].items():
            if compose_model.is_meshserve(service):
                for key in compose_model.service_env(service):
                    settings_check.check(key, name)


def test_the_versions_override_adds_a_pool_the_models_file_names(tmp_path: Any) -> None:
    from services.common.config import load_settings
    from services.router.config import RouterSettings

    doc = compose_model.load(compose_model.COMPOSE, compose_model.COMPOSE_VERSIONS)
    services = doc["services"]
    worker = compose_model.service_env(services["edge-int8"])
    source, target, mode = next(v for v in services["gateway"]["volumes"] if v.startswith("./")).split(":")
    assert compose_model.service_env(services["gateway"])["MESHSERVE_ROUTER_MODELS_FILE"] == target and mode == "ro"
    assert "models:/models:ro" in services["gateway"]["volumes"]  # the override's list keeps the base's mount
    assert "configs" not in doc  # Compose v1 ignores configs outside a swarm: a bind mount works in both
    assert "build" not in services["edge-int8"] and services["edge-int8"]["image"] == services["edge-0"]["image"]
    assert services["edge-int8"]["volumes"] == services["edge-0"]["volumes"]  # models, and the load cache
    models_file = compose_model.DEPLOY / source
    assert services["edge-int8"]["depends_on"]["models"] == {"condition": "service_completed_successfully"}
    specs, default, by_model = load_settings(
        RouterSettings, models_file=str(models_file), models_dir=str(tmp_path)
    ).served_models()
    builds = {v.name: v.build_id for v in specs[0].versions}
    assert by_model and default == specs[0].id == "smollm2-135m-instruct"
    assert builds["int8"] == worker["MESHSERVE_EDGE_WORKER_MODEL_VERSION"]
    assert worker["MESHSERVE_EDGE_WORKER_MODEL_DIR"].endswith("/smollm2-135m-instruct/draft-int8")
    assert specs[0].rollout.weights == {"prepared": 100, "int8": 0}


DURABLE_STATE = {
    "MESHSERVE_GATEWAY_STATE_REDIS_URL",  # API keys, files, batches
    "MESHSERVE_BATCH_REDIS_URL",  # files, batches, the work stream
    "MESHSERVE_GATEWAY_HTTP_REDIS_URL",  # stored /v1/responses
}
"""The Redis settings that name durable state; every other one is a cache (response cache, KV prefix
blocks, rate-limit buckets)."""


def test_durable_state_lives_in_the_persistent_redis_and_caches_in_the_evicting_one() -> None:
    services = compose_model.load()["services"]
    state = compose_model.command(services["redis-state"])
    flags = dict(zip(state[1::2], state[2::2], strict=False))
    assert (flags["--appendonly"], flags["--appendfsync"], flags["--maxmemory-policy"]) == (
        "yes",
        "always",
        "noeviction",
    )
    assert f"redis-state:{flags['--dir']}" in services["redis-state"]["volumes"]
    cache = compose_model.command(services["redis"])
    assert dict(zip(cache[1::2], cache[2::2], strict=False))["--maxmemory-policy"] == "allkeys-lru"
    seen = set()
    for name, service in services.items():
        for key, value in compose_model.service_env(service).items() if compose_model.is_meshserve(service) else ():
            if key.endswith("REDIS_URL"):
                want = "redis-state" if key in DURABLE_STATE else "redis"
                assert value == f"redis://{want}:6379/0", f"{name}: {key}"
                assert service["depends_on"][want] == {"condition": "service_healthy"}, f"{name} waits for {want}"
                seen.add(key)
    assert DURABLE_STATE <= seen


def _dockerfile_args() -> dict[str, str]:
    text = re.sub(r"\\\n", " ", (compose_model.DEPLOY / "Dockerfile").read_text())
    found = re.findall(r"^ARG ([A-Z_]+)=(.*)$", text, re.M)
    return {name: value.strip() for name, value in found}


def test_build_args_are_the_dockerfiles_and_default_to_its_defaults() -> None:
    """Every build arg compose passes is one the Dockerfile declares, settable through MESHSERVE_<ARG>
    in the environment, and left unset gives the Dockerfile's own default (a mirror changes only what
    it sets). MESHSERVE_TORCH_CPU_INDEX_URL set empty means pip's own index (``-``, not ``:-``)."""
    raw = yaml.safe_load(compose_model.COMPOSE.read_text())
    args = raw["x-image"]["build"]["args"]
    declared = _dockerfile_args()
    assert set(args) == set(declared) - {"TORCH_VERSION"}  # the torch pin is pyproject's, not a setting
    for name, value in args.items():
        assert value.startswith(f"${{MESHSERVE_{name}"), f"{name} comes from MESHSERVE_{name}"
    unset = compose_model.load()["services"]["models"]["build"]
    assert unset["args"] == {k: v for k, v in declared.items() if k in args}
    assert unset["network"] == "default"
    mirror = {"MESHSERVE_TORCH_CPU_INDEX_URL": "", "MESHSERVE_PIP_FIND_LINKS": "http://127.0.0.1:1/"}
    given = compose_model.load(env={**mirror, "MESHSERVE_PYTHON_IMAGE": "local/python:3.11"})["services"]
    for name, service in given.items():
        if "build" in service:
            assert service["build"]["args"]["TORCH_CPU_INDEX_URL"] == "", name
            assert service["build"]["args"]["PIP_FIND_LINKS"] == "http://127.0.0.1:1/", name
            assert service["build"]["args"]["PYTHON_IMAGE"] == "local/python:3.11", name
    gpu = compose_model.load(compose_model.COMPOSE, compose_model.COMPOSE_GPU, env=mirror)["services"]["cloud-0"]
    assert gpu["build"]["target"] == "cuda" and gpu["build"]["args"]["PIP_FIND_LINKS"] == "http://127.0.0.1:1/"


def test_the_redis_image_is_settable() -> None:
    for name in ("redis", "redis-state"):
        assert compose_model.load()["services"][name]["image"] == "redis:7.4-alpine"
        local = compose_model.load(env={"MESHSERVE_REDIS_IMAGE": "mirror/redis:7.4"})
        assert local["services"][name]["image"] == "mirror/redis:7.4"


def test_the_workers_keep_their_load_cache_in_a_volume_at_their_default_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mounted where the workers look by default (the image user's ~/.cache/meshserve/load-cache), so no
    setting is needed, and kept across restarts and new containers (issue 38: it was /load-cache)."""
    monkeypatch.setenv("HOME", "/home/meshserve")  # the image's user
    doc = compose_model.load()
    target = default_load_cache_dir("edge").parent
    assert target == default_load_cache_dir("cloud").parent == Path("/home/meshserve/.cache/meshserve/load-cache")
    for name in ("edge-0", "edge-1", "cloud-0"):
        service = doc["services"][name]
        assert f"load-cache:{target}" in service["volumes"], name
        assert "models:/models:ro" in service["volumes"], name
        env = compose_model.service_env(service)
        assert not [k for k in env if "LOAD_CACHE" in k], f"{name}: the default directory is the mounted one"
    readers = [
        n for n, s in doc["services"].items() if any(str(v).startswith("load-cache:") for v in s.get("volumes", []))
    ]
    assert sorted(readers) == ["cloud-0", "edge-0", "edge-1"]


def test_ports_are_published_on_loopback_unless_asked() -> None:
    doc = compose_model.load()
    assert doc["services"]["envoy"]["ports"] == ["127.0.0.1:8080:8080"]
    wide = compose_model.load(env={"MESHSERVE_HTTP_HOST": "0.0.0.0", "MESHSERVE_HTTP_PORT": "9000"})
    assert wide["services"]["envoy"]["ports"] == ["0.0.0.0:9000:8080"]
    for name, service in doc["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
