"""Our Envoy configuration under the real Envoy binary, in its strictest validation mode.

``--mode validate`` parses and builds the whole bootstrap without serving; ``--reject-unknown-dynamic-fields``
refuses unknown fields in dynamic config too, and the runtime flag
``envoy.features.fail_on_any_deprecated_feature`` turns any deprecated field into a fatal error. The
clusters the control plane writes as CDS (which validate mode does not load from disk) are inlined as
static clusters, so they get the same checks. Then Envoy serves the real bootstrap for a moment and
its log must hold no warning at all (deprecations, "no global downstream connection limit", ...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import yaml

from services.common.processes import free_port
from services.controlplane.envoy import Envoy, EnvoyConfig, envoy_binary, render_bootstrap
from services.controlplane.xds import GRPC_CLUSTER, HTTP_CLUSTER, FileXds

STRICT_RUNTIME = {"envoy.features.fail_on_any_deprecated_feature": True}


def _config(tmp_path: Path) -> EnvoyConfig:
    xds = FileXds(tmp_path)
    xds.endpoints[GRPC_CLUSTER] = ["127.0.0.1:1"]
    xds.endpoints[HTTP_CLUSTER] = ["127.0.0.1:2"]
    xds.write_all()
    return EnvoyConfig(tmp_path, free_port(), free_port(), free_port())


def _strict_bootstrap(config: EnvoyConfig) -> dict[str, Any]:
    doc = render_bootstrap(config)
    cds = yaml.safe_load((config.xds_dir / "cds.yaml").read_text())
    doc["static_resources"]["clusters"] = [{k: v for k, v in c.items() if k != "@type"} for c in cds["resources"]]
    doc["layered_runtime"] = {"layers": [{"name": "strict", "static_layer": STRICT_RUNTIME}]}
    return doc


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    argv = [envoy_binary(), "--mode", "validate", "-c", str(path), "--reject-unknown-dynamic-fields"]
    argv += ["--disable-hot-restart", "--log-level", "warning"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_bootstrap_passes_strict_validation_without_deprecation(tmp_path: Path) -> None:
    path = tmp_path / "strict.yaml"
    path.write_text(yaml.safe_dump(_strict_bootstrap(_config(tmp_path))))
    result = _validate(path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "OK" in out, out
    assert "deprecated" not in out.lower(), out
    assert "[warning]" not in out, out


def test_strict_validation_would_catch_a_deprecated_field(tmp_path: Path) -> None:
    """The check above is not vacuous: the field this config used before fails the same run."""
    doc = _strict_bootstrap(_config(tmp_path))
    manager = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["local_reply_config"]["mappers"][0]["body_format_override"] = {"text_format": "%LOCAL_REPLY_BODY%"}
    path = tmp_path / "deprecated.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = _validate(path)
    assert result.returncode != 0
    assert "SubstitutionFormatString.text_format" in result.stdout + result.stderr


def test_bootstrap_sets_a_downstream_connection_limit(tmp_path: Path) -> None:
    doc = render_bootstrap(EnvoyConfig(tmp_path, 1, 2, 3, max_connections=123))
    monitors = doc["overload_manager"]["resource_monitors"]
    limit = next(m for m in monitors if m["name"].endswith("global_downstream_max_connections"))
    assert limit["typed_config"]["max_active_downstream_connections"] == 123


async def test_envoy_serves_our_config_without_a_warning(tmp_path: Path) -> None:
    lines: list[str] = []
    envoy = Envoy(_config(tmp_path), lambda _name, line: lines.append(line), log_level="warning")
    try:
        await envoy.start()  # ready: the bootstrap and the CDS/EDS files are loaded
    finally:
        await envoy.stop()
    warnings = [line for line in lines if "[warning]" in line and "caught ENVOY_SIGTERM" not in line]
    assert not warnings, "\n".join(warnings)


async def test_connections_past_the_limit_are_closed_on_accept(tmp_path: Path) -> None:
    config = dataclasses.replace(_config(tmp_path), max_connections=2)
    envoy = Envoy(config, lambda _name, _line: None, log_level="warning")
    held: list[asyncio.StreamWriter] = []
    try:
        await envoy.start()
        for _ in range(2):
            _reader, writer = await asyncio.open_connection("127.0.0.1", config.listen_port)
            held.append(writer)
        reader, writer = await asyncio.open_connection("127.0.0.1", config.listen_port)
        held.append(writer)
        # Envoy accepts the third connection and closes it at once: EOF (or a reset), no HTTP answer.
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""
        except ConnectionResetError:
            pass
        _, stats = await envoy._admin("/stats?filter=downstream_global_cx_overflow")
        assert "downstream_global_cx_overflow: 1" in stats, stats
    finally:
        for writer in held:
            writer.close()
        await envoy.stop()
