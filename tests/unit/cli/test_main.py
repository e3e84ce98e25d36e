"""The `meshserve` command line: parsing and lazy delegation of `up` / `bench`."""

from __future__ import annotations

import sys
import types

import pytest

from services import cli


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("models", "chat", "up", "bench"))


def test_up_and_bench_get_their_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, list[str]]] = []
    up = types.ModuleType("services.cli.up")
    up.main = lambda argv: seen.append(("up", argv)) or 0  # type: ignore[attr-defined]
    bench = types.ModuleType("benchmarks.mesh.run")
    bench.main = lambda argv: seen.append(("bench", argv)) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "services.cli.up", up)
    monkeypatch.setitem(sys.modules, "benchmarks.mesh.run", bench)
    assert cli.main(["up", "--port", "0", "--help"]) == 0
    assert cli.main(["bench", "--quick"]) == 3
    assert seen == [("up", ["--port", "0", "--help"]), ("bench", ["--quick"])]


def test_missing_delegate_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli._DELEGATED, "bench", ("meshserve_no_such_module", "main"))
    assert cli.main(["bench"]) == 2
    assert "not available" in capsys.readouterr().err


def test_chat_requires_a_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["chat"])
    assert exit_.value.code == 2


def test_chat_with_no_mesh_up_says_how_to_start_one(capsys: pytest.CaptureFixture[str]) -> None:
    from services.common.processes import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert cli.main(["chat", "--address", address, "--max-tokens", "1", "Hello"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshserve chat: UNAVAILABLE: ") and err.count("\n") == 0
    assert err.endswith(f"nothing answers at {address}: start the mesh (`meshserve up`) or pass --address")
