"""`meshserve cache import|export` argument handling and output (the calls themselves: the integration
test tests/integration/cli/test_cache_kv.py, with real workers, routers and Redis)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from services.cli import cache_kv
from services.cli.cache import _parser, main
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.tokenizer import Tokenizer


@pytest.mark.parametrize("action", cache_kv.ACTIONS)
def test_text_prompts_go_as_text_for_the_workers_tokenizer(action: str) -> None:
    args = _parser().parse_args([action, "You are kind.", "--worker", "h:1", "--tenant", "acme", "--shareable"])
    assert (args.action, args.worker, args.timeout, args.json) == (action, "h:1", cache_kv.DEFAULT_TIMEOUT_S, False)
    assert cache_kv.request(args) == worker_pb2.KvPrefixRequest(
        prompt_text="You are kind.", tenant="acme", shareable_prefix=True
    )


def test_chat_prompts_are_templated_here_and_sent_as_token_ids() -> None:
    request = cache_kv.request(_parser().parse_args(["import", "Hi there", "--chat", "--worker", "h:1"]))
    want = Tokenizer(model_paths().hf_dir).apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert not request.prompt_text and list(request.prompt_token_ids) == want
    assert len(want) > len(Tokenizer(model_paths().hf_dir).encode("Hi there"))  # the template's tokens are in


def test_chat_without_a_tokenizer_says_where_it_looked(tmp_path: Path) -> None:
    args = _parser().parse_args(["export", "Hi", "--chat", "--tokenizer-dir", str(tmp_path), "--worker", "h:1"])
    with pytest.raises(cache_kv.UsageError, match=r"no tokenizer at .*tokenizer\.json"):
        cache_kv.request(args)


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "--internal-token", "secret", "import", "p", "--worker", "h:1"],
        ["import", "p", "--worker", "h:1", "--json", "--internal-token", "secret"],
    ],
)
def test_json_and_the_token_are_taken_before_or_after_the_action(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    assert (args.json, args.internal_token) == (True, "secret")


def test_the_token_defaults_to_the_environment_then_the_dev_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHSERVE_INTERNAL_TOKEN", raising=False)
    assert _parser().parse_args(["export", "p"]).internal_token == DEFAULT_INTERNAL_TOKEN
    monkeypatch.setenv("MESHSERVE_INTERNAL_TOKEN", "from-env")
    assert _parser().parse_args(["export", "p"]).internal_token == "from-env"


def test_the_worker_given_is_used_without_asking_a_router() -> None:
    args = _parser().parse_args(["import", "p", "--worker", "10.0.0.7:7201", "--router", "127.0.0.1:1"])
    assert asyncio.run(cache_kv.find_worker(args)) == "10.0.0.7:7201"


def test_without_worker_or_router_it_says_how_to_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MESHSERVE_ROUTER_ADDRESS", raising=False)
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(tmp_path / "mesh.json"))  # no `meshserve up` running
    assert main(["import", "Hello"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("meshserve cache import: no cloud worker address") and "--worker" in err


def test_an_unreachable_router_is_one_line_that_asks_for_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "Hello", "--router", "127.0.0.1:1", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "cannot list the cloud workers of router 127.0.0.1:1 (UNAVAILABLE" in err and "pass --worker" in err


def test_import_lines() -> None:
    reply = worker_pb2.KvImportResponse(block_tokens=16, prompt_tokens=50, blocks=3, blocks_held=1, blocks_imported=2)
    assert cache_kv.render("h:1", reply) == (
        "h:1: 50 prompt tokens, 3 full blocks of 16: 1 already held, 2 imported now from Redis (3 of 3 held)"
    )
    one = worker_pb2.KvImportResponse(block_tokens=16, prompt_tokens=25, blocks=1, blocks_imported=1)
    assert cache_kv.render("h:1", one).startswith("h:1: 25 prompt tokens, 1 full block of 16: ")
    down = worker_pb2.KvImportResponse(block_tokens=16, prompt_tokens=50, blocks=3, redis_unavailable=True)
    assert cache_kv.render("h:1", down).endswith("(0 of 3 held); Redis was unavailable, nothing was read from it")


def test_export_lines() -> None:
    reply = worker_pb2.KvExportResponse(
        block_tokens=16, prompt_tokens=50, blocks=3, blocks_written=2, blocks_not_held=1
    )
    assert cache_kv.render("h:1", reply) == "h:1: 50 prompt tokens, 3 full blocks of 16: 2 written to Redis, 1 not held"
    refused = worker_pb2.KvExportResponse(block_tokens=16, prompt_tokens=50, blocks=3, blocks_written=1)
    assert cache_kv.render("h:1", refused).endswith(
        "1 written to Redis, 0 not held (2 held but refused by Redis: over its byte budget, or too large)"
    )


def test_json_names_the_worker_and_keeps_zero_fields() -> None:
    reply = worker_pb2.KvExportResponse(block_tokens=16, prompt_tokens=20, blocks=1, blocks_written=1)
    data = json.loads(cache_kv.render("h:1", reply, as_json=True))
    assert data == {
        "worker": "h:1",
        "blockTokens": 16,
        "promptTokens": 20,
        "blocks": 1,
        "blocksWritten": 1,
        "blocksNotHeld": 0,
    }


def test_the_timeout_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit) as exit_:
            _parser().parse_args(["import", "p", "--worker", "h:1", "--timeout", bad])
        assert exit_.value.code == 2 and "not a positive number of seconds" in capsys.readouterr().err


def test_a_worker_that_never_answers_is_one_line_after_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does) but never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        assert main(["import", "Hello", "--worker", address, "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert (
        err == f"meshserve cache import: worker {address}: DEADLINE_EXCEEDED: Deadline Exceeded (no answer in 0.5 s)\n"
    )
