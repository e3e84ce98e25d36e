"""`meshserve cache` argument handling (the calls themselves are covered by the e2e test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cache.cli import _parser, _request, main
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
