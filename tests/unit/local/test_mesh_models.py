"""`meshserve up --edge-version / --edge-model / --min-replicas --idle-after-s --stop-after-s`: the router's
models file the mesh writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import load_settings
from services.common.model_paths import DEFAULT_MODEL_ID, ModelPaths
from services.local.mesh import DEFAULT_MODELS_FILE, EXTRA_MODEL_BUILD, PREPARED_VERSION, Mesh, MeshConfig, models_file
from services.local.scaler import StopPolicy, stop_policies
from services.router.config import RouterSettings


def test_the_models_file_keeps_traffic_on_the_prepared_build_and_adds_each_extra(tmp_path: Path) -> None:
    prepared = ModelPaths(tmp_path / DEFAULT_MODEL_ID)
    prepared.root.mkdir()
    prepared.manifest.write_text('{"version": "abc123"}')
    cfg = MeshConfig(edge_versions={"int8": "/m/draft-int8"}, edge_models={"student": str(tmp_path / "student")})
    path = tmp_path / "models.yaml"
    path.write_text(models_file(cfg, prepared))
    specs, default, by_model = load_settings(
        RouterSettings, models_file=str(path), models_dir=str(tmp_path)
    ).served_models()
    assert (default, by_model) == (DEFAULT_MODEL_ID, True)
    assert [(v.name, v.build_id) for v in specs[0].versions] == [("prepared", "abc123"), ("int8", "int8")]
    assert specs[0].rollout.weights == {"prepared": 100}
    assert specs[1].id == "student" and specs[1].tokenizer_dir == tmp_path / "student"
    assert [v.build_id for v in specs[1].versions] == [EXTRA_MODEL_BUILD]


def _served(text: str, tmp_path: Path) -> list:  # type: ignore[type-arg]
    path = tmp_path / "generated.yaml"
    path.write_text(text)
    specs, _, _ = load_settings(RouterSettings, models_file=str(path), models_dir=str(tmp_path)).served_models()
    return specs


def test_the_idle_flags_are_the_default_models_idle_policy_of_the_file_it_writes(tmp_path: Path) -> None:
    prepared = ModelPaths(tmp_path / DEFAULT_MODEL_ID)
    cfg = MeshConfig(models_file=str(DEFAULT_MODELS_FILE), min_replicas=0, idle_after_s=5.0, stop_after_s=20.0)
    text = models_file(cfg, prepared)
    content = yaml.safe_load(text)
    given = yaml.safe_load(DEFAULT_MODELS_FILE.read_text())
    (entry,) = content["models"]
    assert entry["idle"] == {"min_replicas": 0, "idle_after_s": 5.0, "stop_after_s": 20.0}
    assert entry["generation"] == given["models"][0]["generation"]  # the rest of the file as it was
    (spec,) = _served(text, tmp_path)
    assert spec.idle is not None and (spec.idle.min_replicas, spec.idle.stop_after_s) == (0, 20.0)
    alone = yaml.safe_load(models_file(MeshConfig(min_replicas=0, idle_after_s=3.0), prepared))
    assert alone == {
        "default": DEFAULT_MODEL_ID,
        "models": [{"id": DEFAULT_MODEL_ID, "idle": {"min_replicas": 0, "idle_after_s": 3.0}}],
    }


def test_a_given_models_files_idle_entries_are_kept_and_the_flags_set_only_theirs(tmp_path: Path) -> None:
    given = tmp_path / "mine.yaml"
    given.write_text(
        yaml.safe_dump(
            {
                "default": DEFAULT_MODEL_ID,
                "models": [
                    {"id": DEFAULT_MODEL_ID, "idle": {"min_replicas": 0, "idle_after_s": 60, "stop_after_s": 600}},
                    {"id": "student", "tokenizer_dir": str(tmp_path), "idle": {"min_replicas": 0, "idle_after_s": 9}},
                ],
            }
        )
    )
    prepared = ModelPaths(tmp_path / DEFAULT_MODEL_ID)
    prepared.root.mkdir()
    prepared.manifest.write_text('{"version": "abc123"}')
    content = yaml.safe_load(models_file(MeshConfig(models_file=str(given), idle_after_s=30.0), prepared))
    assert content["models"][0]["idle"] == {"min_replicas": 0, "idle_after_s": 30.0, "stop_after_s": 600}
    assert content["models"][1]["idle"] == {"min_replicas": 0, "idle_after_s": 9}
    with_versions = MeshConfig(models_file=str(given), edge_versions={"int8": "/m/draft-int8"})
    entry = yaml.safe_load(models_file(with_versions, prepared))["models"][0]
    assert entry["idle"] == {"min_replicas": 0, "idle_after_s": 60, "stop_after_s": 600}  # kept with versions too
    assert [v["name"] for v in entry["versions"]] == ["prepared", "int8"]


def test_stop_after_s_needs_min_replicas_zero() -> None:
    with pytest.raises(ValueError, match="needs min_replicas 0"):
        MeshConfig(stop_after_s=10.0)
    with pytest.raises(ValueError, match="needs min_replicas 0"):
        MeshConfig(min_replicas=1, stop_after_s=10.0)
    with pytest.raises(ValueError, match="above 0"):
        MeshConfig(min_replicas=0, idle_after_s=0.0)
    assert MeshConfig().idle_policy() == {}


def test_the_scaler_pools_each_version_with_the_workers_that_serve_it(tmp_path: Path) -> None:
    prepared = ModelPaths(tmp_path / DEFAULT_MODEL_ID)
    names = ["edge-0", "edge-1", "cloud-0", "edge-version-int8", "edge-model-student", "router", "gateway"]
    split = Mesh(MeshConfig(edge_versions={"int8": "/m/int8"}, edge_models={"student": "/m/student"}))
    split.processes = dict.fromkeys(names)  # type: ignore[assignment]
    assert split.workers_by_version() == {
        DEFAULT_MODEL_ID: {PREPARED_VERSION: ["edge-0", "edge-1", "cloud-0"], "int8": ["edge-version-int8"]},
        "student": {EXTRA_MODEL_BUILD: ["edge-model-student"]},
    }
    cfg = MeshConfig(edge_versions={"int8": "/m/int8"}, min_replicas=0, idle_after_s=2.0, stop_after_s=9.0)
    models = yaml.safe_load(models_file(cfg, prepared))
    assert stop_policies(models, split.workers_by_version()) == [
        StopPolicy(DEFAULT_MODEL_ID, 9.0, ("edge-0", "edge-1", "cloud-0"), PREPARED_VERSION),
        StopPolicy(DEFAULT_MODEL_ID, 9.0, ("edge-version-int8",), "int8"),
    ]
    whole = Mesh(MeshConfig())
    whole.processes = dict.fromkeys(names[:3])  # type: ignore[assignment]
    assert whole.workers_by_version() == {DEFAULT_MODEL_ID: {None: ["edge-0", "edge-1", "cloud-0"]}}
