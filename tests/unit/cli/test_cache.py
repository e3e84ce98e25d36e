"""`meshserve cache` argument handling (the calls themselves are covered by the e2e test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.cache import _parser, _request, main
from services.common.pb.meshserve.internal.v1 import cache_pb2


def test_flush_filters_map_to_the_request() -> None:
    args = _parser().parse_args(["--address", "h:1", "flush", "--tenant", "acme", "--kind", "kv", "--model", "m"])
    method, request = _request(args)
    assert method == "Flush"
    assert request == cache_pb2.FlushRequest(tenant="acme", kind=cache_pb2.CACHE_KIND_KV, model_id="m")


def test_warm_takes_prompts() -> None:
    method, request = _request(_parser().parse_args(["warm", "a b", "c", "--max-tokens", "3"]))
    assert method == "Warm" and request == cache_pb2.WarmRequest(prompts=["a b", "c"], max_tokens=3)


def test_missing_address_says_how_to_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MESHSERVE_CACHE_ADDRESS", raising=False)
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(tmp_path / "mesh.json"))  # no `meshserve up` running
    assert main(["stats"]) == 2
    err = capsys.readouterr().err
    assert "--address" in err and "MESHSERVE_CACHE_ADDRESS" in err and "meshserve up" in err


def test_where_maps_to_a_prefix_location_request() -> None:
    from services.cli import cache_where as where
    from services.common.pb.meshserve.internal.v1 import router_admin_pb2
    from services.common.pb.meshserve.v1 import inference_pb2

    args = _parser().parse_args(["where", "Hello there", "--tenant", "acme", "--shareable", "--tier", "edge"])
    assert where.request(args) == router_admin_pb2.PrefixLocationRequest(
        text="Hello there", tenant="acme", shareable_prefix=True, tier=inference_pb2.TIER_EDGE
    )
    chat = where.request(_parser().parse_args(["where", "Hi", "--chat"]))
    assert not chat.text and [(m.role, m.content) for m in chat.messages] == [("user", "Hi")]
    assert chat.tier == inference_pb2.TIER_AUTO
    assert (chat.model, chat.version) == ("", "")  # the default model's primary version
    scoped = where.request(_parser().parse_args(["where", "Hi", "--model", "student", "--version", "v2"]))
    assert (scoped.model, scoped.version) == ("student", "v2")


def test_where_without_a_router_says_how_to_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MESHSERVE_ROUTER_ADDRESS", raising=False)
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(tmp_path / "mesh.json"))
    assert main(["where", "Hello"]) == 2
    err = capsys.readouterr().err
    assert "--router" in err and "MESHSERVE_ROUTER_ADDRESS" in err and "meshserve up" in err


def test_where_hints_at_the_tenant_when_nothing_holds_the_prompt() -> None:
    from services.cli import cache_where as where
    from services.common.pb.meshserve.internal.v1 import router_admin_pb2
    from services.common.pb.meshserve.v1 import inference_pb2

    def reply(
        held: int, redis: int, blocks: int = 3, tier: int = inference_pb2.TIER_CLOUD
    ) -> router_admin_pb2.PrefixLocationResponse:
        return router_admin_pb2.PrefixLocationResponse(
            tier=tier,
            prompt_blocks=blocks,
            redis_blocks=redis,
            replicas=[router_admin_pb2.PrefixHolder(address="h:1", worker_id="cloud-0", cached_blocks=held)],
        )

    bare = _parser().parse_args(["where", "Hello"])
    hint = where.tenant_hint(bare, reply(0, 0))
    assert hint is not None and "--tenant" in hint and "dev" in hint
    assert where.tenant_hint(bare, reply(1, 0)) is None  # something holds it: no hint
    assert where.tenant_hint(bare, reply(0, 2)) is None
    assert where.tenant_hint(bare, reply(0, 0, blocks=0)) is None  # nothing to hold
    assert where.tenant_hint(bare, reply(0, 0, tier=inference_pb2.TIER_EDGE)) is None  # edge keeps none
    assert where.tenant_hint(_parser().parse_args(["where", "Hello", "--tenant", "acme"]), reply(0, 0)) is None
    assert where.tenant_hint(_parser().parse_args(["where", "Hello", "--shareable"]), reply(0, 0)) is None
