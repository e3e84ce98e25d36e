"""A real mesh for fuzzing (Redis, 1 edge worker, router, cache, gateway, Envoy + HTTP adapter), the
properties every case must hold, case counting and the long run's report.

Scale: every fuzz test runs ``base * MESHSERVE_FUZZ_SCALE`` examples (default scale 1: the CI sample of
a few hundred cases); ``make fuzz`` sets a scale that makes >= 10,000 cases and writes the counts to
``MESHSERVE_FUZZ_REPORT`` (JSON). The CI sample is derandomized (the same cases every run); a scaled
run draws new ones and prints a reproduction blob for any failure.

The mesh is configured so that a valid case is cheap, not so that cases are easy: the gateway accepts
at most 16 tokens and 256 prompt characters (larger values still reach their validation branch), and
the router's and the edge worker's default ``max_tokens`` (what a 0 becomes) are 6: the worker's own
default (256 tokens) made each internal Generate case that left max_tokens at 0 take seconds.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from hypothesis import HealthCheck, settings

from services.common.processes import wait_for_health
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

SCALE = float(os.environ.get("MESHSERVE_FUZZ_SCALE", "1"))
MAX_TOKENS_LIMIT = 16
MAX_PROMPT_CHARS = 256
HEALTH_WAIT_S = 30.0
TRACEBACK_MARKERS = ("Traceback (most recent call last)", 'File "/', "site-packages/")

CASES: dict[str, Counter[str]] = defaultdict(Counter)
"""Per test: outcome (gRPC status name or HTTP status) -> cases."""
SERVICE_ERRORS: list[str] = []
"""Log lines of the mesh at level error/critical or with a traceback, since the mesh started."""


def examples(base: int) -> settings:
    """Hypothesis settings for a fuzz test of ``base`` cases at scale 1."""
    return settings(
        max_examples=max(1, int(base * SCALE)),
        deadline=None,
        database=None,
        derandomize=SCALE == 1,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def record(test: str, outcome: str) -> None:
    CASES[test][outcome] += 1


def assert_no_traceback(text: str, where: str) -> None:
    for marker in TRACEBACK_MARKERS:
        assert marker not in text, f"{where} leaks a traceback: {text[:500]!r}"


def _sink(name: str, line: str) -> None:
    lowered = line.lower()
    starts = '"level": "error"' in lowered or '"level": "critical"' in lowered or "traceback" in lowered
    # A plain-text traceback arrives one line at a time: keep the lines that follow it too.
    if starts or (SERVICE_ERRORS and SERVICE_ERRORS[-1].startswith(name) and not line.startswith("{")):
        SERVICE_ERRORS.append(f"{name} | {line}")
        sys.stderr.write(f"{name} | {line}\n")


@pytest.fixture(scope="package")
async def fuzz_mesh() -> AsyncIterator[Mesh]:
    # Its own redis-server: the fuzz load must not spend the rate-limit budget other tests' meshes share.
    env = {
        "MESHSERVE_GATEWAY_MAX_TOKENS_LIMIT": str(MAX_TOKENS_LIMIT),
        "MESHSERVE_GATEWAY_MAX_PROMPT_CHARS": str(MAX_PROMPT_CHARS),
        "MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE": "100000",
        "MESHSERVE_ROUTER_DEFAULT_MAX_TOKENS": "6",
        "MESHSERVE_EDGE_WORKER_DEFAULT_MAX_TOKENS": "6",
    }
    config = MeshConfig(edge_workers=1, cloud_workers=0, envoy=True, extra_env=env)
    async with Mesh(config, sink=_sink) as running:
        yield running


@pytest.fixture(scope="package")
async def gateway_channel(fuzz_mesh: Mesh) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(fuzz_mesh.gateway_address) as channel:
        yield channel


AUTH = (("authorization", f"Bearer {DEV_API_KEY}"),)


async def assert_mesh_healthy(mesh: Mesh) -> None:
    """Every process alive, every gRPC service SERVING, the HTTP adapter answering through Envoy."""
    for name, proc in mesh.processes.items():
        assert proc.proc is not None and proc.proc.returncode is None, f"{name} exited ({proc.proc})"
        try:  # Watch until SERVING: a worker still finishing the last case may answer late, not never
            await wait_for_health(proc.address, HEALTH_WAIT_S)
        except TimeoutError:
            raise AssertionError(f"{name} is not SERVING {HEALTH_WAIT_S:.0f} s after the cases") from None
    async with aiohttp.ClientSession() as session:
        async with session.get(mesh.http_base_url.removesuffix("/v1") + "/healthz") as response:
            assert response.status == 200, f"the HTTP adapter behind Envoy answers {response.status}"


@pytest.fixture(autouse=True)
async def healthy_after(request: pytest.FixtureRequest, fuzz_mesh: Mesh) -> AsyncIterator[None]:
    """After each fuzz test: the mesh is healthy and logged no error and no traceback."""
    SERVICE_ERRORS.clear()
    yield
    await assert_mesh_healthy(fuzz_mesh)
    assert not SERVICE_ERRORS, "the mesh logged errors while fuzzed:\n" + "\n".join(SERVICE_ERRORS[:60])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not CASES:
        return
    total = sum(sum(c.values()) for c in CASES.values())
    terminalreporter.write_line(f"fuzz: {total} cases (scale {SCALE:g})")
    for test, outcomes in sorted(CASES.items()):
        terminalreporter.write_line(f"  {test}: {sum(outcomes.values())} {dict(sorted(outcomes.items()))}")
    path = os.environ.get("MESHSERVE_FUZZ_REPORT")
    if path:
        report = {"scale": SCALE, "total_cases": total, "tests": {t: dict(c) for t, c in sorted(CASES.items())}}
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
