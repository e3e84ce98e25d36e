"""deploy/k8s: both overlays build offline and every resource validates against the Kubernetes schemas.

Schemas come from the pinned PyPI package kubernetes-validate (strict mode: unknown fields fail).
Beyond the schemas: commands are meshserve entry points, every setting is a real settings field,
probes ask the port the service listens on, the drain fits in terminationGracePeriodSeconds, HPAs
scale on metrics the services export (through the prometheus-adapter rules), selectors match pods,
and the GPU overlay gives each TP rank one GPU. KEDA's ScaledObjects (overlays/scale-from-zero)
validate against KEDA's own CRD schema, vendored in deploy/k8s/crds (strict as well), query series the
services export, and every worker workload has exactly one autoscaler (an HPA or a ScaledObject).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.common.config import ServiceSettings
from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from tests.unit.deploy import commands, exported_metrics, kustomize, settings_check

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"
OVERLAYS = ["cpu", "gpu", "versions", "scale-from-zero"]
CRDS = {"ScaledObject": K8S / "crds" / "keda.sh_scaledobjects.yaml"}
"""Kinds of the resources that are not Kubernetes' own -> the CRD their schema comes from."""


@pytest.fixture(scope="module", params=OVERLAYS)
def built(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return kustomize.build(K8S / "overlays" / request.param)


def _find(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


THIRD_PARTY = {"redis-state"}
"""Workloads of other images than meshserve's (no meshserve command, settings or gRPC health)."""


def _workloads(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """meshserve's workloads (see ``THIRD_PARTY``)."""
    return [r for r in resources if kustomize.containers(r) and r["metadata"]["name"] not in THIRD_PARTY]


def _container_env(resources: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (ConfigMaps, then env with $(VAR) and
    Secret values; downward-API fields stay placeholders)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_find(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = _find(resources, "Secret", ref["name"])["stringData"][ref["key"]]
        else:
            env[var["name"]] = "<" + json.dumps(var["valueFrom"], sort_keys=True) + ">"
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg)


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema with unknown fields refused, as kubernetes_validate's strict mode (and the API
    server's strict field validation) does: every object schema that lists properties and neither
    allows more nor preserves unknown fields gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_validator(kind: str) -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(CRDS[kind].read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"]["enum"] = [f"{crd['spec']['group']}/{version['name']}"]
    schema["properties"]["kind"]["enum"] = [crd["spec"]["names"]["kind"]]
    schema["properties"]["metadata"] = {  # ObjectMeta, as far as manifests use it
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "required": ["name"],
        "additionalProperties": False,
    }
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def validate(resource: dict[str, Any]) -> None:
    """Against Kubernetes 1.33's schema, or the vendored CRD's for a custom resource (both strict)."""
    if resource["kind"] in CRDS:
        _crd_validator(resource["kind"]).validate(resource)
    else:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_every_resource_validates_against_the_kubernetes_schema(built: list[dict[str, Any]]) -> None:
    kinds = {r["kind"] for r in built}
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds
    assert {"ConfigMap", "Secret", "Namespace"} <= kinds
    for resource in built:
        validate(resource)
        if resource["kind"] != "Namespace":
            assert resource["metadata"]["namespace"] == "meshserve"


def test_the_schema_validation_catches_mistakes(built: list[dict[str, Any]]) -> None:
    deployment = json.loads(json.dumps(_find(built, "Deployment", "gateway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = json.loads(json.dumps(_find(built, "Deployment", "gateway")))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_deployments_and_the_tp_statefulset(built: list[dict[str, Any]]) -> None:
    for name in ("gateway", "cache", "batch", "edge-worker", "frontdoor"):
        _find(built, "Deployment", name)
    assert not [r for r in built if r["metadata"]["name"] == "router"]  # it runs inside the gateways
    tp = _find(built, "StatefulSet", "gpu-worker")
    service = _find(built, "Service", tp["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: stable per-group DNS
    (container,) = tp["spec"]["template"]["spec"]["containers"]
    launcher = commands.parse([_expand(a, _container_env(built, container)) for a in container["command"]]).torchrun
    assert launcher is not None and launcher.no_python


def test_every_command_is_a_meshserve_entry_point(built: list[dict[str, Any]]) -> None:
    served = set()
    for workload in _workloads(built):
        for container in kustomize.containers(workload):
            env = _container_env(built, container)
            parsed = commands.parse([_expand(a, env) for a in container["command"]])
            if parsed.subcommand == "serve":
                served.add(parsed.args.service)
    assert served == {"gateway", "cache", "batch", "edge-worker", "gpu-worker"}


def test_every_setting_is_a_field_of_its_service(built: list[dict[str, Any]]) -> None:
    for workload in _workloads(built):
        for container in kustomize.containers(workload):
            for key in _container_env(built, container):
                settings_check.check(key, workload["metadata"]["name"])


def _embeds_router(env: dict[str, str]) -> bool:
    return env.get("MESHSERVE_GATEWAY_EMBED_ROUTER") == "true"


def _port(env: dict[str, str]) -> int | None:
    """The port a container serves its callers on (a gateway's, not the internal port of its router)."""
    ports = [
        int(v)
        for k, v in env.items()
        if re.fullmatch(r"MESHSERVE_[A-Z_]+(?<!METRICS)(?<!STREAM)_PORT", k)
        and not (_embeds_router(env) and k.startswith("MESHSERVE_ROUTER_"))
    ]
    return ports[0] if len(ports) == 1 else None


def test_probes_ask_grpc_health_on_the_serving_port(built: list[dict[str, Any]]) -> None:
    for workload in _workloads(built):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            env = _container_env(built, container)
            parsed = commands.parse([_expand(a, env) for a in container["command"]])
            port = parsed.args.http_port if parsed.subcommand == "frontdoor" else _port(env)
            assert port is not None, container["name"]
            assert container["readinessProbe"]["grpc"]["port"] == port, container["name"]
            liveness = container["livenessProbe"]
            assert (liveness.get("grpc") or liveness.get("tcpSocket"))["port"] == port
            assert env.get(next(iter(k for k in env if k.endswith("_HOST")), ""), "0.0.0.0") == "0.0.0.0"
            if parsed.subcommand == "serve" and parsed.args.service.endswith("worker"):
                assert container["startupProbe"]["grpc"]["port"] == port  # model load before liveness
                stream = next(int(v) for k, v in env.items() if k.endswith("_WORKER_STREAM_PORT"))
                declared = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert declared["stream"] == stream != port  # the router's request streams (docs/router.md)


def test_drain_fits_in_the_termination_grace_period(built: list[dict[str, Any]]) -> None:
    """preStop (endpoints drop the pod) + shutdown_grace_s (streams finish) + 5 s <= the grace period.

    Under torchrun, its --shutdown-timeout (how long it lets the ranks exit before SIGKILL) must cover
    the drain, and the grace period must cover it."""
    default = ServiceSettings.model_fields["shutdown_grace_s"].default
    for workload in _workloads(built):
        spec = workload["spec"]["template"]["spec"]
        for container in spec["containers"]:
            env = _container_env(built, container)
            grace = max([float(v) for k, v in env.items() if k.endswith("_SHUTDOWN_GRACE_S")] or [default])
            pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            readiness = container["readinessProbe"]
            assert readiness["periodSeconds"] * readiness["failureThreshold"] <= pre_stop + grace
            stop = grace
            launcher = commands.parse([_expand(a, env) for a in container["command"]]).torchrun
            if launcher is not None:  # torchrun SIGKILLs its ranks after --shutdown-timeout
                assert launcher.shutdown_timeout >= grace + 5, workload["metadata"]["name"]
                stop = launcher.shutdown_timeout
            assert spec["terminationGracePeriodSeconds"] >= pre_stop + stop + 5, workload["metadata"]["name"]


def test_selectors_match_pods(built: list[dict[str, Any]]) -> None:
    every = [r for r in built if kustomize.containers(r)]
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in every]

    def matches(selector: dict[str, str]) -> int:
        return sum(all(labels.get(k) == v for k, v in selector.items()) for labels in pods)

    for workload in every:
        assert matches(workload["spec"]["selector"]["matchLabels"]) == 1
    for resource in built:
        if resource["kind"] == "Service":
            assert matches(resource["spec"]["selector"]) == 1, resource["metadata"]["name"]
        if resource["kind"] == "PodDisruptionBudget":
            assert matches(resource["spec"]["selector"]["matchLabels"]) == 1, resource["metadata"]["name"]
    covered = {
        r["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        for r in built
        if r["kind"] == "PodDisruptionBudget"
    }
    assert covered >= {"gateway", "edge-worker", "gpu-worker", "frontdoor"}


def test_referenced_configmaps_and_secrets_exist(built: list[dict[str, Any]]) -> None:
    names = {(r["kind"], r["metadata"]["name"]) for r in built}
    for workload in _workloads(built):
        spec = workload["spec"]["template"]["spec"]
        for container in kustomize.containers(workload):
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = _find(built, "Secret", ref["name"])
                    assert ref["key"] in secret["stringData"]
        for volume in spec.get("volumes", []):
            if "secret" in volume and not volume["secret"].get("optional"):
                assert ("Secret", volume["secret"]["secretName"]) in names
    secret = _find(built, "Secret", "meshserve-secrets")["stringData"]
    assert secret["redis-url"].startswith(("redis+sentinel://", "redis+cluster://"))
    assert secret["state-redis-url"] == "redis://redis-state:6379/0"  # redis-state.yaml's Service


def test_hpas_scale_on_exported_metrics_through_the_adapter_rules(built: list[dict[str, Any]]) -> None:
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    series = exported_metrics.all_series()
    provided = {}
    for rule in rules:
        (queried,) = re.findall(r"^(\w+)\{", rule["seriesQuery"])
        assert queried in series, f"adapter rule reads {queried}, which no service exports"
        assert re.fullmatch(rule["name"]["matches"], queried)
        provided[rule["name"]["as"]] = queried
    workloads = {(w["kind"], w["metadata"]["name"]) for w in _workloads(built)}
    hpas = [r for r in built if r["kind"] == "HorizontalPodAutoscaler"]
    assert "gateway" in {h["metadata"]["name"] for h in hpas}
    if not [r for r in built if r["kind"] == "ScaledObject"]:  # without KEDA the workers have HPAs
        assert {h["metadata"]["name"] for h in hpas} >= {"edge-worker", "gpu-worker"}
    custom = set()
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) in workloads
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":
                custom.add(metric["pods"]["metric"]["name"])
                assert metric["pods"]["metric"]["name"] in provided
    if {h["metadata"]["name"] for h in hpas} >= {"edge-worker", "gpu-worker"}:
        assert {"meshserve_queue_depth", "meshserve_time_to_first_token_seconds_p90"} <= custom


def test_gpu_overlay_gives_each_tp_rank_a_gpu() -> None:
    built = kustomize.build(K8S / "overlays" / "gpu")
    tp = _find(built, "StatefulSet", "gpu-worker")
    (container,) = tp["spec"]["template"]["spec"]["containers"]
    env = _container_env(built, container)
    tp_size = int(env["MESHSERVE_TP_SIZE"])
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == tp_size
    assert env["MESHSERVE_GPU_WORKER_DEVICE"] == "cuda"
    assert container["image"] == "meshserve:cuda"
    config = json.loads((model_paths(DEFAULT_MODEL_ID).hf_dir / "config.json").read_text())
    assert config["num_attention_heads"] % tp_size == 0 and config["num_key_value_heads"] % tp_size == 0
    others = [c["image"] for w in _workloads(built) if w is not tp for c in kustomize.containers(w)]
    assert set(others) == {"meshserve:cpu"}
    cpu = kustomize.build(K8S / "overlays" / "cpu")
    images = {c["image"] for w in _workloads(cpu) for c in kustomize.containers(w)}
    assert images == {"meshserve:cpu"}


def test_the_builder_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(kustomize.KustomizeError, match="configMapGenerator"):
        kustomize.build(tmp_path)
    strategic_merge = {
        "resources": [str(K8S / "overlays" / "cpu")],
        "patches": [{"target": {"kind": "Deployment", "name": "gateway"}, "patch": "spec: {replicas: 3}"}],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(strategic_merge))
    with pytest.raises(kustomize.KustomizeError, match="JSON 6902"):
        kustomize.build(tmp_path)


def _gateway_container(built: list[dict[str, Any]]) -> dict[str, Any]:
    (gateway,) = _find(built, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    return gateway


def _service_of_router(built: list[dict[str, Any]], address: str) -> dict[str, Any]:
    """The Service an address names; it must select the gateway pods and map the routers' port."""
    gateway_pods = _find(built, "Deployment", "gateway")["spec"]["template"]["metadata"]["labels"]
    router_port = int(_container_env(built, _gateway_container(built))["MESHSERVE_ROUTER_PORT"])
    host, _, port = address.rpartition(":")
    service = _find(built, "Service", host)
    assert all(gateway_pods.get(k) == v for k, v in service["spec"]["selector"].items()), address
    assert int(port) == router_port, address
    (mapped,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    assert mapped["targetPort"] == router_port  # headless: the DNS answer is a pod IP, called on this port
    return service


def test_the_router_runs_inside_every_gateway_pod(built: list[dict[str, Any]]) -> None:
    gateway = _gateway_container(built)
    env = _container_env(built, gateway)
    assert _embeds_router(env)
    assert "MESHSERVE_GATEWAY_ROUTER_ADDRESS" not in env  # no router Deployment to call
    declared = {p["containerPort"] for p in gateway["ports"]}
    assert {int(env["MESHSERVE_GATEWAY_PORT"]), int(env["MESHSERVE_ROUTER_PORT"])} <= declared
    assert "MESHSERVE_ROUTER_METRICS_PORT" not in env  # one process, one /metrics port (the gateway's)
    # Its health follows its workers (SERVING while one is healthy): ready = can route; liveness must
    # not restart it for their outage.
    assert gateway["readinessProbe"]["grpc"]["port"] == _port(env)
    assert gateway["livenessProbe"]["tcpSocket"]["port"] == _port(env)
    # The router tokenizes: the pod prepares the models like the workers do.
    init = _find(built, "Deployment", "gateway")["spec"]["template"]["spec"]["initContainers"]
    prepare = commands.parse(init[0]["command"])
    assert (prepare.subcommand, prepare.args.models_command) == ("models", "prepare")
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in gateway["volumeMounts"]


def test_workers_reach_the_routers_before_the_gateways_are_ready(built: list[dict[str, Any]]) -> None:
    """A gateway turns ready only once a worker registered with its router, so heartbeats go to a
    Service that lists not-ready gateway pods too; the cache admin service (Cache.Warm) uses the one
    that lists only ready pods."""
    for workload in ("edge-worker", "gpu-worker"):
        kind = "StatefulSet" if workload == "gpu-worker" else "Deployment"
        (container,) = _find(built, kind, workload)["spec"]["template"]["spec"]["containers"]
        env = _container_env(built, container)
        (address,) = [v for k, v in env.items() if k.endswith("_WORKER_ROUTER_ADDRESS")]
        assert _service_of_router(built, address)["spec"].get("publishNotReadyAddresses") is True
        (advertised,) = [v for k, v in env.items() if k.endswith("_ADVERTISE_ADDRESS")]
        assert "status.podIP" in advertised and advertised.endswith(f":{_port(env)}")
    (cache,) = _find(built, "Deployment", "cache")["spec"]["template"]["spec"]["containers"]
    address = _container_env(built, cache)["MESHSERVE_CACHE_ROUTER_ADDRESS"]
    assert not _service_of_router(built, address)["spec"].get("publishNotReadyAddresses")


def test_every_worker_registers_with_every_gateway_replica(built: list[dict[str, Any]]) -> None:
    """Several gateways, each with its router: workers resolve the headless registry Service (all
    gateway pods, by DNS) each heartbeat round and heartbeat every address, so no router sees only
    part of the workers."""
    assert _find(built, "Deployment", "gateway")["spec"]["replicas"] >= 2
    for workload in ("edge-worker", "gpu-worker"):
        kind = "StatefulSet" if workload == "gpu-worker" else "Deployment"
        (container,) = _find(built, kind, workload)["spec"]["template"]["spec"]["containers"]
        env = _container_env(built, container)
        (resolve,) = [v for k, v in env.items() if k.endswith("_WORKER_ROUTER_RESOLVE")]
        assert resolve == "true"
        (address,) = [v for k, v in env.items() if k.endswith("_WORKER_ROUTER_ADDRESS")]
        assert _service_of_router(built, address)["spec"]["clusterIP"] == "None"  # DNS lists every pod


K8S_OF_COMPOSE = {
    "gateway": "gateway",  # with its router (router-config)
    "cache": "cache",
    "batch": "batch",
    "edge-0": "edge-worker",
    "cloud-0": "gpu-worker",
}
PER_ENVIRONMENT = {"ROUTER_ADDRESS", "REDIS_URL", "STATE_REDIS_URL", "WORKER_ID"}
"""Settings whose value is where/who in each environment (addresses, identity): set in both, not equal.
Kubernetes also sets more (advertise addresses, drain times sized to its grace periods)."""


def test_kubernetes_sets_what_compose_and_up_set(built: list[dict[str, Any]]) -> None:
    from tests.unit.deploy import compose_model

    compose = compose_model.load()["services"]
    for service, workload in K8S_OF_COMPOSE.items():
        (container,) = [
            c
            for w in _workloads(built)
            if w["metadata"]["name"] == workload
            for c in w["spec"]["template"]["spec"]["containers"]
        ]
        k8s_env = _container_env(built, container)
        for key, value in compose_model.service_env(compose[service]).items():
            assert key in k8s_env, f"{workload}: compose sets {key}, Kubernetes does not"
            field = re.sub(r"^MESHSERVE_(GATEWAY|ROUTER|CACHE|BATCH|EDGE_WORKER|GPU_WORKER)_", "", key)
            if field not in PER_ENVIRONMENT and key != "MESHSERVE_MODELS_DIR":
                assert k8s_env[key] == value, f"{workload}: {key}"


def test_the_versions_overlay_adds_a_pool_its_models_file_names(tmp_path: Path) -> None:
    from services.common.config import load_settings
    from services.router.config import RouterSettings

    built = kustomize.build(K8S / "overlays" / "versions")
    gateway = _find(built, "Deployment", "gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in gateway["containers"][0]["env"]}
    mount = next(m for m in gateway["containers"][0]["volumeMounts"] if m["name"] == "models-file")
    volume = next(v for v in gateway["volumes"] if v["name"] == "models-file")
    config = _find(built, "ConfigMap", volume["configMap"]["name"])
    (key,) = config["data"]
    assert env["MESHSERVE_ROUTER_MODELS_FILE"] == mount["mountPath"] and mount["subPath"] == key
    path = tmp_path / key
    path.write_text(config["data"][key])
    specs, _, by_model = load_settings(RouterSettings, models_file=str(path), models_dir=str(tmp_path)).served_models()
    worker = _find(built, "Deployment", "edge-int8")["spec"]["template"]["spec"]["containers"][0]
    worker_env = {e["name"]: e.get("value") for e in worker["env"]}
    assert (
        by_model
        and {v.name: v.build_id for v in specs[0].versions}["int8"] == worker_env["MESHSERVE_EDGE_WORKER_MODEL_VERSION"]
    )
    assert specs[0].rollout.weights == {"prepared": 100, "int8": 0}


def test_the_models_files_of_kubernetes_are_the_repositorys() -> None:
    """The base's ConfigMap holds deploy/models.yaml (the default model's generation defaults); the versions
    overlay's holds deploy/models.versions.yaml."""
    for overlay, name in (("cpu", "models.yaml"), ("versions", "models.versions.yaml")):
        config = _find(kustomize.build(K8S / "overlays" / overlay), "ConfigMap", "meshserve-models")
        assert yaml.safe_load(config["data"]["models.yaml"]) == yaml.safe_load((K8S.parent / name).read_text())


DURABLE_STATE = {
    ("gateway", "MESHSERVE_GATEWAY_STATE_REDIS_URL"),  # API keys, files, batches
    ("batch", "MESHSERVE_BATCH_REDIS_URL"),  # files, batches, the work stream
    ("frontdoor", "MESHSERVE_GATEWAY_HTTP_REDIS_URL"),  # stored /v1/responses
}


def test_the_state_redis_keeps_an_append_only_file_on_a_volume_and_never_evicts(built: list[dict[str, Any]]) -> None:
    """The state Redis runs as `meshserve up` runs it (the launcher's own flags), its data on a
    persistent volume; the durable state's settings name it and the caches' settings do not."""
    from services.local.redis_server import STATE_REDIS_ARGS

    redis = _find(built, "StatefulSet", "redis-state")
    assert redis["spec"]["replicas"] == 1
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    argv = container["command"]
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    data = flags.pop("--dir")
    assert argv[0] == "redis-server" and flags == dict(zip(STATE_REDIS_ARGS[::2], STATE_REDIS_ARGS[1::2], strict=True))
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": data} in container["volumeMounts"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    service = _find(built, "Service", redis["spec"]["serviceName"])
    assert [p["port"] for p in service["spec"]["ports"]] == [6379]
    state_url = f"redis://{service['metadata']['name']}:6379/0"
    seen = set()
    for workload in _workloads(built):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            env = _container_env(built, container)
            for key, value in env.items():
                if key.endswith("REDIS_URL"):
                    durable = (workload["metadata"]["name"], key) in DURABLE_STATE
                    assert (value == state_url) == durable, f"{workload['metadata']['name']}: {key}"
                    seen.add((workload["metadata"]["name"], key))
    assert DURABLE_STATE <= seen


def test_workers_keep_their_load_cache_where_compose_does(
    built: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker container mounts an emptyDir at its default load-cache directory (the image user's
    ~/.cache/meshserve/load-cache, as compose's load-cache volume): written by the uid-10001 user (the
    pod's fsGroup), kept across restarts of the container, so a restarted worker loads from it."""
    from services.common.config import default_load_cache_dir
    from tests.unit.deploy import compose_model

    monkeypatch.setenv("HOME", "/home/meshserve")
    path = str(default_load_cache_dir("edge").parent)
    compose = compose_model.load()["services"]["edge-0"]["volumes"]
    assert f"load-cache:{path}" in compose
    workers = 0
    for workload in _workloads(built):
        spec = workload["spec"]["template"]["spec"]
        for container in spec["containers"]:
            argv = [*container.get("command", []), *container.get("args", [])]
            if not any(a in ("edge-worker", "gpu-worker") for a in argv):
                continue
            workers += 1
            name = workload["metadata"]["name"]
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
            (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            assert "emptyDir" in volume and not mount.get("readOnly"), name
            assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"] == 10001, name
            assert not [k for k in _container_env(built, container) if "LOAD_CACHE" in k], name
    assert workers >= 2


WORKERS = {("Deployment", "edge-worker"), ("StatefulSet", "gpu-worker")}
"""The worker workloads every overlay autoscales (the versions overlay's edge-int8 pool has a fixed size)."""
AUTOSCALERS = {"HorizontalPodAutoscaler", "ScaledObject"}


def test_every_worker_workload_has_exactly_one_autoscaler(built: list[dict[str, Any]]) -> None:
    """KEDA makes an HPA of its own for each ScaledObject: a workload with an HPA of ours as well would
    have two controllers fighting over its replicas."""
    owners: dict[tuple[str, str], list[str]] = {}
    for scaler in (r for r in built if r["kind"] in AUTOSCALERS):
        ref = scaler["spec"]["scaleTargetRef"]
        owners.setdefault((ref["kind"], ref["name"]), []).append(f"{scaler['kind']}/{scaler['metadata']['name']}")
    workloads = {(w["kind"], w["metadata"]["name"]) for w in _workloads(built)}
    assert set(owners) <= workloads, "an autoscaler targets no workload of the overlay"
    assert all(len(found) == 1 for found in owners.values()), owners
    assert WORKERS <= set(owners)


def _scaled_objects(overlay: str = "scale-from-zero") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    built = kustomize.build(K8S / "overlays" / overlay)
    return built, [r for r in built if r["kind"] == "ScaledObject"]


PROMETHEUS_SCALER_FIELDS = {
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}
"""The trigger metadata KEDA's prometheus scaler reads (pkg/scalers/prometheus_scaler.go); the CRD
types trigger metadata only as a map of strings."""


def test_the_scale_from_zero_overlay_scales_each_worker_from_zero_on_the_held_gauge() -> None:
    built, scaled = _scaled_objects()
    assert {(s["spec"]["scaleTargetRef"]["kind"], s["spec"]["scaleTargetRef"]["name"]) for s in scaled} == WORKERS
    assert not [h for h in built if h["kind"] == "HorizontalPodAutoscaler" and h["metadata"]["name"] != "gateway"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["prometheus"]
    prometheus = f"{adapter['url']}:{adapter['port']}"  # the Prometheus prometheus-adapter reads
    series = exported_metrics.all_series()
    for scaled_object in scaled:
        spec = scaled_object["spec"]
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
        assert spec["cooldownPeriod"] > 0 and spec["pollingInterval"] <= 15  # a held request waits for the poll
        triggers = {t["name"]: t for t in spec["triggers"]}
        for trigger in triggers.values():
            assert trigger["type"] == "prometheus"
            assert set(trigger["metadata"]) <= PROMETHEUS_SCALER_FIELDS
            assert trigger["metadata"]["serverAddress"] == prometheus
            for name in re.findall(r"\b(meshserve_\w+)\{", trigger["metadata"]["query"]):
                assert name in series, f"{scaled_object['metadata']['name']}: {name} is exported by no service"
            assert 'namespace="meshserve"' in trigger["metadata"]["query"]
            float(trigger["metadata"]["threshold"])
        held = triggers["held"]["metadata"]
        assert (
            held["query"] == f'sum(meshserve_router_held_requests{{namespace="meshserve",model="{DEFAULT_MODEL_ID}"}})'
        )
        assert float(held["activationThreshold"]) == 0  # one held request activates it from 0
        recent = triggers["recent"]["metadata"]
        assert "meshserve_router_idle_seconds" in recent["query"] and DEFAULT_MODEL_ID in recent["query"]
    metrics = exported_metrics.exported()
    assert set(metrics["meshserve_router_held_requests"].labels) == {"model", "version"}
    assert set(metrics["meshserve_router_idle_seconds"].labels) == {"model", "version"}


def test_the_routers_of_the_scale_from_zero_overlay_hold_for_a_model_with_no_replica() -> None:
    """The gateways' routers: min_replicas 0 (a request for a model with no worker is held, not
    refused) and a wake deadline long enough for a pod's start; the other overlays keep one replica."""
    from services.common.config import load_settings
    from services.router.config import RouterSettings

    built, _ = _scaled_objects()
    gateway = _find(built, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    env = _container_env(built, gateway)
    settings = load_settings(
        RouterSettings,
        idle_min_replicas=env["MESHSERVE_ROUTER_IDLE_MIN_REPLICAS"],
        wake_deadline_s=env["MESHSERVE_ROUTER_WAKE_DEADLINE_S"],
    )
    assert settings.idle_min_replicas == 0 and settings.wake_deadline_s >= 120
    cpu = kustomize.build(K8S / "overlays" / "cpu")
    cpu_env = _container_env(cpu, _find(cpu, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0])
    assert "MESHSERVE_ROUTER_IDLE_MIN_REPLICAS" not in cpu_env


def test_the_vendored_crd_is_kedas_scaled_object_and_its_schema_catches_mistakes() -> None:
    crd = yaml.safe_load(CRDS["ScaledObject"].read_text())
    assert crd["kind"] == "CustomResourceDefinition" and crd["metadata"]["name"] == "scaledobjects.keda.sh"
    _, scaled = _scaled_objects()
    good = scaled[0]
    validate(good)

    def broken(edit: Any) -> dict[str, Any]:
        copy = json.loads(json.dumps(good))
        edit(copy)
        return copy

    mistakes = [
        broken(lambda r: r["spec"].update(minReplicas=0)),  # the HPA's field name, unknown to KEDA
        broken(lambda r: r["spec"].update(minReplicaCount="0")),  # a string
        broken(lambda r: r["spec"].pop("triggers")),
        broken(lambda r: r["spec"]["triggers"][0].pop("type")),
        broken(lambda r: r["spec"]["triggers"][0]["metadata"].update(threshold=1)),  # metadata values are strings
        broken(lambda r: r["spec"]["scaleTargetRef"].pop("name")),
        broken(lambda r: r["spec"]["advanced"]["horizontalPodAutoscalerConfig"].update(behaviour={})),
        broken(lambda r: r.update(apiVersion="keda.sh/v1")),
        broken(lambda r: r["metadata"].update(nmae="x")),
    ]
    for mistake in mistakes:
        with pytest.raises(jsonschema.ValidationError):
            validate(mistake)
