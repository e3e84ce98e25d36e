"""`meshserve up --edge-version / --edge-model`: the router's models file the mesh writes."""

from __future__ import annotations

from pathlib import Path

from services.common.model_paths import DEFAULT_MODEL_ID, ModelPaths
from services.common.settings import load_settings
from services.local.mesh import EXTRA_MODEL_BUILD, MeshConfig, models_file
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
