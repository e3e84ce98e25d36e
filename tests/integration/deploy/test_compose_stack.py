"""The compose deployment, run for real (``make compose-test``; issue 38).

Builds the image (base images pulled, or stand-ins built from Debian's packages where no registry
answers: deploy/standin/build.sh), starts deploy/compose.yaml as it is, with Envoy published on
127.0.0.1 only, waits for every healthcheck, and checks through that port: an OpenAI chat completion
and a streamed one (the official client), ``meshserve chat`` over gRPC on both tiers, a Files + Batches
run; the load cache (written on the first start, used by a recreated cloud worker and a restarted edge
worker); a SIGKILL of an edge worker's process inside its container (restarted by the restart policy,
its streams resumed on the other replica); and that ``down -v`` leaves no container, network or volume.

Skipped unless MESHSERVE_COMPOSE_TEST=1 (scripts/compose_test.sh sets it once an engine answers).
The tests run in order on one stack; timings go to the output (``compose-test: ...``), not asserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import DEV_API_KEY
from tests.integration.deploy.compose_stack import ROOT, Stack, build_settings, free_port, say, serve_wheel

if os.environ.get("MESHSERVE_COMPOSE_TEST") != "1":
    pytest.skip("the compose stack runs under `make compose-test` (MESHSERVE_COMPOSE_TEST=1)", allow_module_level=True)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]
HEALTHY = 10
"""Containers with a healthcheck: redis, redis-state, edge-0, edge-1, cloud-0, gateway x2, cache, batch, envoy."""
LOAD_CACHE = "/home/meshserve/.cache/meshserve/load-cache"
STORY = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper named"
NAMES = ("Tom", "Ada", "Elias", "Mara", "Jon", "Ines")
MAX_TOKENS = 320
"""Long enough that the streams are still going when the kill lands (a few seconds after they start)."""
METRICS = (
    "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9090/metrics', timeout=5).read().decode())"
)
KILL_WORKER = """
import os, signal
me = os.getpid()
for pid in os.listdir('/proc'):
    if not pid.isdigit() or int(pid) in (1, me):
        continue
    try:
        cmdline = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')
    except OSError:
        continue
    if b'services.edge_worker' in cmdline:
        os.kill(int(pid), signal.SIGKILL)
        print(pid)
"""


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    logs = Path(os.environ.get("MESHSERVE_COMPOSE_TEST_LOGS", "/var/tmp/meshserve-compose-test"))
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "compose-test.log"
    log.write_text("")
    say(f"commands and container logs: {log}")
    started = time.monotonic()
    subprocess.run([str(ROOT / "deploy" / "standin" / "build.sh")], check=True, timeout=1800)
    images_s = time.monotonic() - started
    plan = build_settings()
    for note in plan.notes:
        say(note)
    port = free_port()
    env = {**os.environ, **plan.env, "MESHSERVE_HTTP_HOST": "127.0.0.1", "MESHSERVE_HTTP_PORT": str(port)}
    running = Stack(log=log, env=env)
    running.compose_run("down", "-v", "--remove-orphans")  # what an interrupted earlier run left
    t = time.monotonic()
    with serve_wheel(plan.wheel) if plan.wheel else contextlib.nullcontext(None) as url:
        if url:
            env["MESHSERVE_PIP_FIND_LINKS"] = url
        running.compose_run("build", "models", timeout=3600)
    build_s = time.monotonic() - t
    t = time.monotonic()
    running.compose_run("up", "-d", "--no-build", timeout=1500)  # Compose v1 waits for the healthy dependencies
    running.wait_healthy(1500, HEALTHY)
    up_s = time.monotonic() - t
    say(
        f"base images {images_s:.0f} s, image build {build_s:.0f} s, up to all {HEALTHY} healthy {up_s:.0f} s "
        f"(models prepared, workers loaded); Envoy on 127.0.0.1:{port}"
    )
    running.http_port, running.started = port, started
    try:
        yield running
    finally:
        if running.leftovers():
            running.compose_run("logs", "--no-color", check=False)
            running.compose_run("down", "-v", "--remove-orphans", check=False)


def _events(stack: Stack, service: str, event: str) -> list[dict[str, object]]:
    return [e for e in stack.logs(service) if e.get("event") == event]


def test_the_workers_write_their_load_cache_into_its_volume(stack: Stack) -> None:
    for service in ("edge-0", "edge-1", "cloud-0"):
        events = stack.logs(service)
        assert not [e for e in events if str(e.get("event", "")).endswith("_cache_not_written")], service
        mounts = {m["Destination"]: m for m in stack.inspect(stack.container(service))["Mounts"]}
        assert mounts[LOAD_CACHE]["Type"] == "volume" and mounts[LOAD_CACHE]["RW"], mounts
        assert mounts[LOAD_CACHE]["Name"] == f"{stack.project}_load-cache"
    assert _events(stack, "edge-0", "edge_graph_cache") and _events(stack, "edge-1", "edge_graph_cache")
    assert _events(stack, "cloud-0", "cloud_weights_cache")
    listing = stack.exec("cloud-0", ["sh", "-c", f"ls {LOAD_CACHE}/edge {LOAD_CACHE}/cloud"])
    assert re.search(r"\.onnx\b", listing) and re.search(r"\.safetensors\b", listing), listing


def test_a_new_cloud_worker_container_maps_its_weights_from_the_load_cache(stack: Stack) -> None:
    old = stack.container("cloud-0")
    stack.compose_run("rm", "-s", "-f", "cloud-0")
    stack.compose_run("up", "-d", "--no-build", "--no-deps", "cloud-0")
    assert stack.container("cloud-0") != old  # a fresh container: only the volume carried the cache over
    took = stack.wait_healthy(900, HEALTHY)
    (cache,) = _events(stack, "cloud-0", "cloud_weights_cache")
    assert cache["hit"] is True, cache
    say(f"a new cloud-0 container, weights mapped from the load cache: healthy again in {took:.0f} s")


async def test_openai_chat_completion_and_a_streamed_one_through_envoy(stack: Stack) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name one colour of the sky."}]
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=DEV_API_KEY, max_retries=0
    ) as client:
        models = [m.id async for m in client.models.list()]
        assert models
        reply = await client.chat.completions.create(
            model=models[0],
            messages=messages,
            max_tokens=12,
            temperature=0,
        )
        text = reply.choices[0].message.content
        assert text and reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 12
        stream = await client.chat.completions.create(
            model=models[0],
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        deltas, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(deltas) == text and len(deltas) > 1  # greedy: the same answer, in pieces
        assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens


@pytest.mark.parametrize("tier", ["edge", "cloud"])
def test_meshserve_chat_over_grpc_through_envoy(stack: Stack, tier: str) -> None:
    meshserve = Path(sys.executable).parent / "meshserve"
    argv = [str(meshserve), "chat", "--address", f"127.0.0.1:{stack.http_port}", "--tier", tier, "--max-tokens", "16"]
    done = subprocess.run([*argv, "Tell me about the sea"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert f"[{tier} via {tier}-" in done.stderr, done.stderr  # the route line: this tier's worker served it


async def test_a_files_and_batches_run_completes(stack: Stack) -> None:
    lines = [
        json.dumps(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"Name colour number {i}."}], "max_tokens": 6},
            }
        )
        for i in range(3)
    ]
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=DEV_API_KEY, max_retries=0
    ) as client:
        upload = await client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        batch = await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 300
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {batch.status} after 300 s"
            await asyncio.sleep(0.5)  # polls the batch's status: what a client of the Batch API does
            batch = await client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed) == (3, 3)
        assert batch.output_file_id
        output = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["q0", "q1", "q2"]
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["message"]["content"]


def _edge_batch_size(stack: Stack, service: str) -> float:
    text = stack.exec(service, ["python", "-c", METRICS])
    found = re.search(r'^meshserve_batch_size\{[^}]*service="edge_worker"[^}]*\} ([0-9.e+]+)$', text, re.M)
    assert found, f"no meshserve_batch_size of the edge worker in {service}'s metrics"
    return float(found[1])


async def test_a_sigkilled_edge_worker_is_restarted_and_its_streams_resume_on_the_other(stack: Stack) -> None:
    received: dict[int, list[int]] = {i: [] for i in range(len(NAMES))}
    going = asyncio.Event()

    async def stream(i: int, stub: inference_pb2_grpc.InferenceStub) -> pb.Final:
        request = pb.GenerateRequest(
            prompt=f"{STORY} {NAMES[i]}.",
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            routing=pb.RoutingOptions(tier=pb.TIER_EDGE, cache_policy=pb.CACHE_POLICY_BYPASS),
        )
        final = None
        sequence = 0
        async for frame in stub.Generate(request, metadata=(("authorization", f"Bearer {DEV_API_KEY}"),)):
            assert frame.sequence == sequence, "frames are numbered without gaps, across the resume too"
            sequence += 1
            received[i].extend(frame.token_ids)
            if all(len(t) >= 8 for t in received.values()):
                going.set()
            if frame.HasField("final"):
                final = frame.final
        assert final is not None
        return final

    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.http_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        tasks = [asyncio.create_task(stream(i, stub)) for i in range(len(NAMES))]
        await asyncio.wait_for(going.wait(), 120)
        edges = ("edge-0", "edge-1")
        sizes = await asyncio.gather(*(asyncio.to_thread(_edge_batch_size, stack, s) for s in edges))
        loads = dict(zip(edges, sizes, strict=True))
        victim = "edge-0" if loads["edge-0"] > 0 else "edge-1"
        assert loads[victim] > 0, f"no edge worker is generating: {loads}"
        cid = stack.container(victim)
        restarts = stack.inspect(cid)["RestartCount"]
        killed = await asyncio.to_thread(stack.exec, victim, ["python", "-c", KILL_WORKER])
        assert killed.split(), f"no edge worker process found in {victim}"
        finals = await asyncio.wait_for(asyncio.gather(*tasks), 300)

    survivor = "edge-1" if victim == "edge-0" else "edge-0"
    assert all(f.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) for f in finals), finals
    assert all(f.route.worker_id in (victim, survivor) for f in finals)
    resumed = [f for f in finals if f.route.reason == "failover"]
    assert resumed and all(f.route.worker_id == survivor for f in resumed), finals
    assert any(e.get("worker") == victim for e in _events(stack, "gateway", "worker_failed_resuming"))
    for i, final in enumerate(finals):
        assert final.usage.completion_tokens >= len(received[i]) > 8

    t = time.monotonic()
    while stack.inspect(cid)["RestartCount"] == restarts:  # the restart policy brings the same container back
        assert time.monotonic() - t < 120, f"{victim} was not restarted"
        await asyncio.sleep(0.5)  # polls the container's state (docker has no wait-for-restart)
    stack.wait_healthy(600, HEALTHY)
    took = time.monotonic() - t
    assert stack.container(victim) == cid
    last = _events(stack, victim, "edge_graph_cache")[-1]
    assert last["hit"] is True, last  # its second start loaded the edited graph from the load cache
    say(
        f"SIGKILL of {victim}'s worker (sequences generating: {loads}): {len(resumed)} of {len(finals)} streams "
        f"resumed on {survivor} (tokens: {[f.usage.completion_tokens for f in finals]}); "
        f"{victim} restarted and healthy again in {took:.0f} s"
    )


def test_down_v_leaves_no_container_network_or_volume(stack: Stack) -> None:
    stack.compose_run("logs", "--no-color", check=False)  # into the log file, for whoever reads it later
    stack.compose_run("down", "-v", "--remove-orphans")
    assert stack.leftovers() == {}
    say(f"whole run {time.monotonic() - stack.started:.0f} s")
