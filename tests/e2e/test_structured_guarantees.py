"""The structured-output guarantees on the real model, both tiers, both front doors, over the checked-in
prompts (tests/data/structured_prompts.json, 50+ of each kind), and the README's prompts under the default
model's generation defaults (deploy/models.yaml).

Each tier is a mesh of its own (one edge worker, or one cloud worker) with Envoy and the models file, so the
defaults are the model's and HTTP requests reach that tier. The checks are the benchmark's
(benchmarks/structured/guarantees.py, ``check``), which also writes the rates to docs/benchmarks/; here every
prompt runs once per tier, through gRPC (the gateway's Chat) and HTTP (Envoy, the official ``openai``
client) in turn, all at once (16 in flight), so the run stays within a few minutes on a 2-core host.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import openai
import pytest

from benchmarks.structured.guarantees import MESH_ENV, load_prompts, rates, readme_answers, run_tier
from services.local.mesh import DEFAULT_MODELS_FILE, Mesh, MeshConfig
from tests.e2e.conftest import API_KEY, _sink
from tests.helpers import RedisServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["edge", "cloud"])
async def tier_mesh(request: pytest.FixtureRequest, redis_srv: RedisServer) -> AsyncIterator[tuple[str, Mesh]]:
    tier = request.param
    config = MeshConfig(
        edge_workers=1 if tier == "edge" else 0,
        cloud_workers=1 if tier == "cloud" else 0,
        redis_url=redis_srv.url,
        envoy=True,
        models_file=str(DEFAULT_MODELS_FILE),
        extra_env=MESH_ENV,
    )
    async with Mesh(config, sink=_sink) as mesh:
        yield tier, mesh


async def test_every_guarantee_holds_on_every_prompt(tier_mesh: tuple[str, Mesh]) -> None:
    tier, mesh = tier_mesh
    began = time.perf_counter()
    outcomes = await run_tier(tier, mesh.gateway_address, mesh.http_base_url, API_KEY, load_prompts(), alternate=True)
    took = time.perf_counter() - began
    for row in rates(outcomes):
        print(tier, row)
    print(f"{tier}: {len(outcomes)} cases in {took:.0f} s")
    broken = [f"{o.kind} #{o.index} ({o.door}): {o.detail[:300]}" for o in outcomes if o.valid is False]
    assert not broken, "\n".join(broken)
    for kind in ("json_object", "json_schema", "tools", "stop"):
        doors = {o.door for o in outcomes if o.kind == kind}
        assert doors == {"grpc", "http"}, kind  # every kind through both front doors
        assert len([o for o in outcomes if o.kind == kind]) >= 50
    shaped = [o for o in outcomes if o.kind != "stop"]
    assert sum(o.finish == "length" for o in shaped) <= 0.10 * len(shaped)  # the budget-closing target
    assert any(o.budget_closed for o in shaped)


# -- the README's prompts under the default model's defaults ------------------------------------------


async def test_the_readme_prompts_read_well_under_the_defaults(tier_mesh: tuple[str, Mesh]) -> None:
    """No sentence repeated to max_tokens: what the old mesh-wide chat penalty was for, now the model's
    defaults (deploy/models.yaml: temperature 0.2, top_p 0.9, repetition_penalty 1.1). Seeded, so a run is
    reproducible; no other sampling field is set. GET /v1/models shows those defaults."""
    tier, mesh = tier_mesh
    answers = await readme_answers(tier, mesh.gateway_address, mesh.http_base_url, API_KEY)
    for a in answers:
        print(tier, a)
        assert a["most_repeated"] < 3, f"{tier}: {a['prompt']!r}: {a['text']!r}"
    france = next(a for a in answers if "France" in a["prompt"])
    assert "Paris" in france["text"], france
    async with openai.AsyncOpenAI(base_url=mesh.http_base_url, api_key=API_KEY, max_retries=0) as client:
        (model,) = [m async for m in client.models.list()]
    assert (model.model_extra or {})["generation_defaults"] == {
        "temperature": 0.2,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
    }
