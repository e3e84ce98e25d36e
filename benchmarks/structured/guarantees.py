"""The structured-output guarantees on the real model, both tiers, both front doors: the prompts of
``tests/data/structured_prompts.json`` (50+ of each kind, written once, not tuned to pass) and the check of
each answer, shared by the CI test (tests/e2e/test_structured_guarantees.py) and this benchmark, which
writes the rates to ``docs/benchmarks/structured_guarantees.md`` (docs/structured_output.md quotes them).

The guarantees, per answer (under the served model's default sampling, with ``max_tokens`` 96; stop
strings 40):

* ``json_object``: finished with ``stop`` -> it parses as a JSON object;
* ``json_schema``: finished with ``stop`` -> it validates against its schema (``jsonschema``);
* ``tools`` (``tool_choice: required``): finished with ``tool_calls`` -> every call names a declared
  function and its arguments validate against that function's parameters;
* ``stop``: a stop string that appears in the continuation without it (same seed) truncates the
  answer with it at its first occurrence (and, absent, the answers are the same).

An answer that finishes with ``length`` breaks no guarantee; the share of them is the budget-closing
mask's measure (docs/structured_output.md, *Closing before the budget runs out*: target at most 10 %,
0 invalid). gRPC goes through the gateway (``Inference.Chat``, the tier as a routing hint); HTTP through
Envoy with the official ``openai`` client. Each tier is a mesh of its own (one edge worker, or one cloud
worker) started with deploy/models.yaml, so the defaults are the model's and the HTTP answers come from
that tier.

``python -m benchmarks.structured.guarantees`` (``meshserve bench structured-guarantees``) runs every
prompt through both doors on both tiers and prints one ``TARGET`` line per tier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc

PROMPTS = Path(__file__).resolve().parents[2] / "tests" / "data" / "structured_prompts.json"
KINDS = ("json_object", "json_schema", "tools", "stop")
MAX_TOKENS = 96
"""The budget of the JSON and tool answers (the issue's: the budget-closing target is measured at it)."""
STOP_MAX_TOKENS = 40
"""The budget of the stop-string answers (the issue's example's)."""
TARGET_LENGTH_SHARE = 0.10
TIERS = {"edge": pb.TIER_EDGE, "cloud": pb.TIER_CLOUD}
MESH_ENV = {
    "MESHSERVE_EDGE_WORKER_MAX_ACTIVE_SEQUENCES": "16",  # one batched decode call for the requests in flight
    "MESHSERVE_GPU_WORKER_MAX_ACTIVE_SEQUENCES": "16",
    "MESHSERVE_ROUTER_TTFT_SLO_MS": "0",  # a batch of cases queues; it is not shed
}
"""The meshes' settings: every case in flight decodes at once, and none is refused for its queueing."""
_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_STOP_STRING: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}


def load_prompts(path: Path = PROMPTS) -> dict[str, list[Any]]:
    doc = json.loads(path.read_text())
    return {kind: doc[kind] for kind in KINDS}


@dataclass
class Answer:
    """One answer as a front door delivered it."""

    text: str
    finish: str
    """``stop``, ``length``, ``tool_calls`` (OpenAI's names; gRPC's STOP_STRING is ``stop``)."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(function name, arguments JSON text) per call, in order."""
    budget_closed: bool = False


@dataclass
class Outcome:
    kind: str
    tier: str
    door: str
    index: int
    finish: str
    valid: bool | None
    """The guarantee held (True), was broken (False), or did not apply (None: finished at ``length``)."""
    budget_closed: bool
    detail: str = ""


def check(kind: str, item: Any, answer: Answer, plain: Answer | None = None) -> tuple[bool | None, str]:
    """Whether ``answer`` keeps its guarantee (None: finished at length, no guarantee applies), and why not."""
    if kind == "stop":
        assert plain is not None
        stops = item["stop"]
        found = [i for i in (plain.text.find(s) for s in stops) if i >= 0]
        if found:
            want = plain.text[: min(found)]
            ok = answer.text == want and answer.finish == "stop"
            return ok, "" if ok else f"want {want!r} (stop), got {answer.text!r} ({answer.finish})"
        ok = answer.text == plain.text and answer.finish == plain.finish
        return ok, "" if ok else f"no stop string: want {plain.text!r}, got {answer.text!r}"
    if answer.finish == "length":
        return None, answer.text
    if kind == "tools":
        if answer.finish != "tool_calls" or not answer.calls:
            return False, f"finished {answer.finish} with {len(answer.calls)} calls: {answer.text!r}"
        declared = {t["name"]: t["parameters"] for t in item["tools"]}
        for name, arguments in answer.calls:
            if name not in declared:
                return False, f"call of undeclared {name!r}"
            try:
                jsonschema.validate(json.loads(arguments), declared[name])
            except (ValueError, jsonschema.ValidationError) as exc:
                return False, f"{name}({arguments}): {str(exc).splitlines()[0]}"
        return True, ""
    if answer.finish != "stop":
        return False, f"finished {answer.finish}: {answer.text!r}"
    try:
        value = json.loads(answer.text)
    except ValueError as exc:
        return False, f"does not parse ({exc}): {answer.text!r}"
    if kind == "json_object":
        ok = isinstance(value, dict)
        return ok, "" if ok else f"not an object: {answer.text!r}"
    try:
        jsonschema.validate(value, item["schema"])
    except jsonschema.ValidationError as exc:
        return False, f"{exc.message}: {answer.text!r}"
    return True, ""


def _messages(kind: str, item: Any) -> str:
    return item if kind == "json_object" else item["prompt"]


# -- gRPC through the gateway --------------------------------------------------------------------


def _turn(kind: str, item: Any, tier: str, seed: int, with_stop: bool) -> pb.ChatRequest:
    turn = pb.ChatTurn(
        messages=[pb.ChatMessage(role="user", content=_messages(kind, item))],
        sampling=pb.SamplingParams(max_tokens=STOP_MAX_TOKENS if kind == "stop" else MAX_TOKENS, seed=seed),
        routing=pb.RoutingOptions(tier=TIERS[tier], cache_policy=pb.CACHE_POLICY_BYPASS),  # type: ignore[arg-type]
    )
    sampling = turn.sampling  # the turn's own copy
    if kind == "json_object":
        sampling.structured.json_object = True
    elif kind == "json_schema":
        sampling.structured.json_schema = json.dumps(item["schema"])
    elif kind == "tools":
        for tool in item["tools"]:
            turn.tools.add(
                name=tool["name"], description=tool["description"], parameters_json=json.dumps(tool["parameters"])
            )
        turn.tool_choice.mode = pb.TOOL_CHOICE_REQUIRED
    elif with_stop:
        sampling.stop.extend(item["stop"])
    return pb.ChatRequest(turn=turn)


async def grpc_answer(
    stub: inference_pb2_grpc.InferenceStub,
    api_key: str,
    kind: str,
    item: Any,
    tier: str,
    seed: int,
    with_stop: bool = True,
) -> Answer:
    async def frames() -> AsyncIterator[pb.ChatRequest]:
        yield _turn(kind, item, tier, seed, with_stop)

    text: list[str] = []
    calls: dict[int, list[str]] = {}
    final: pb.Final | None = None
    async for frame in stub.Chat(frames(), metadata=(("authorization", f"Bearer {api_key}"),)):
        text.append(frame.text)
        for d in frame.tool_calls:
            call = calls.setdefault(d.index, ["", ""])
            call[0] = d.name or call[0]
            call[1] += d.arguments
        if frame.HasField("final"):
            final = frame.final
    assert final is not None, "a Chat turn ends with its final frame"
    if final.route.tier != TIERS[tier]:
        raise AssertionError(f"asked for the {tier} tier, served by {pb.Tier.Name(final.route.tier)}")
    return Answer(
        "".join(text),
        _FINISH.get(final.finish_reason, "other"),
        [(n, a) for n, a in (calls[i] for i in sorted(calls))],
        final.usage.budget_closed,
    )


# -- HTTP through Envoy, the official openai client ------------------------------------------------


async def http_answer(client: openai.AsyncOpenAI, kind: str, item: Any, seed: int, with_stop: bool = True) -> Answer:
    kw: dict[str, Any] = {
        "model": "",
        "messages": [{"role": "user", "content": _messages(kind, item)}],
        "max_tokens": STOP_MAX_TOKENS if kind == "stop" else MAX_TOKENS,
        "seed": seed,
    }
    if kind == "json_object":
        kw["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        kw["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": item["schema"], "strict": True},
        }
    elif kind == "tools":
        kw["tools"] = [{"type": "function", "function": t} for t in item["tools"]]
        kw["tool_choice"] = "required"
    elif with_stop:
        kw["stop"] = item["stop"]
    reply = await client.chat.completions.create(**kw)
    choice = reply.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    details = reply.usage.completion_tokens_details if reply.usage else None
    closed = bool(details is not None and (details.model_extra or {}).get("budget_closed"))
    return Answer(choice.message.content or "", choice.finish_reason, calls, closed)


# -- running a tier --------------------------------------------------------------------------------


async def run_tier(
    tier: str,
    gateway: str,
    base_url: str,
    api_key: str,
    prompts: dict[str, list[Any]],
    doors: Sequence[str] = ("grpc", "http"),
    alternate: bool = False,
    concurrency: int = 16,
) -> list[Outcome]:
    """Every case of ``prompts`` on one tier's mesh, through each of ``doors`` (``alternate``: case i through
    ``doors[i % len(doors)]`` only, the CI test's cheaper run), ``concurrency`` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with (
        grpc.aio.insecure_channel(gateway) as channel,
        openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600) as client,
    ):
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def answer(door: str, kind: str, item: Any, seed: int, with_stop: bool = True) -> Answer:
            async with gate:
                if door == "grpc":
                    return await grpc_answer(stub, api_key, kind, item, tier, seed, with_stop)
                return await http_answer(client, kind, item, seed, with_stop)

        async def case(door: str, kind: str, index: int, item: Any) -> Outcome:
            seed = 1000 + index
            got = await answer(door, kind, item, seed)
            plain = await answer(door, kind, item, seed, with_stop=False) if kind == "stop" else None
            valid, detail = check(kind, item, got, plain)
            return Outcome(kind, tier, door, index, got.finish, valid, got.budget_closed, detail)

        jobs: list[Coroutine[Any, Any, Outcome]] = []
        n = 0
        for kind in KINDS:
            for index, item in enumerate(prompts[kind]):
                chosen = [doors[n % len(doors)]] if alternate else list(doors)
                n += 1
                jobs.extend(case(door, kind, index, item) for door in chosen)
        return list(await asyncio.gather(*jobs))


README_CHATS = [("What is the capital of France?", 0), ("Tell me about the sea", 0), ("Hello", 64), ("Hello", 32)]
"""The README's chat prompts (`make run`'s demo, `meshserve chat`'s examples) and their max_tokens (0: the
default, 256)."""
README_COMPLETIONS = [("The capital of France is", 32), ("Hello", 16), ("The sea is", 0)]
"""The README's Generate / completion prompts."""
README_SEED = 7


def most_repeated_sentence(text: str) -> int:
    """How often the answer's most frequent sentence (or line) occurs: a loop repeats one to max_tokens."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if len(s.strip()) > 3]
    return max(Counter(sentences).values(), default=0)


async def readme_answers(tier: str, gateway: str, base_url: str, api_key: str) -> list[dict[str, Any]]:
    """The README's prompts on one tier under the model's defaults (only max_tokens as the README sets it,
    and a seed): chats through gRPC, completions through HTTP."""
    out: list[dict[str, Any]] = []
    routing = pb.RoutingOptions(tier=TIERS[tier], cache_policy=pb.CACHE_POLICY_BYPASS)  # type: ignore[arg-type]
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for prompt, max_tokens in README_CHATS:
            turn = pb.ChatTurn(
                messages=[pb.ChatMessage(role="user", content=prompt)],
                sampling=pb.SamplingParams(max_tokens=max_tokens, seed=README_SEED),
                routing=routing,
            )

            async def frames(turn: pb.ChatTurn = turn) -> AsyncIterator[pb.ChatRequest]:
                yield pb.ChatRequest(turn=turn)

            texts, finish = [], ""
            async for frame in stub.Chat(frames(), metadata=(("authorization", f"Bearer {api_key}"),)):
                texts.append(frame.text)
                if frame.HasField("final"):
                    finish = _FINISH.get(frame.final.finish_reason, "other")
            text = "".join(texts)
            out.append(
                {"door": "grpc chat", "prompt": prompt, "max_tokens": max_tokens, "text": text, "finish": finish}
            )
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600) as client:
        for prompt, max_tokens in README_COMPLETIONS:
            kw: dict[str, Any] = {"max_tokens": max_tokens} if max_tokens else {}
            reply = await client.completions.create(model="", prompt=prompt, seed=README_SEED, **kw)
            choice = reply.choices[0]
            out.append(
                {
                    "door": "http completion",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "text": choice.text,
                    "finish": choice.finish_reason,
                }
            )
    for answer in out:
        answer["most_repeated"] = most_repeated_sentence(answer["text"])
    return out


def rates(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Per tier, door and kind: answers, guarantee held / broken, share finishing at length, budget-closed."""
    rows: list[dict[str, Any]] = []
    keys = sorted({(o.tier, o.door, o.kind) for o in outcomes}, key=lambda k: (k[0], k[1], KINDS.index(k[2])))
    for tier, door, kind in keys:
        group = [o for o in outcomes if (o.tier, o.door, o.kind) == (tier, door, kind)]
        checked = [o for o in group if o.valid is not None]
        rows.append(
            {
                "tier": tier,
                "door": door,
                "kind": kind,
                "answers": len(group),
                "valid": sum(1 for o in checked if o.valid),
                "invalid": sum(1 for o in checked if not o.valid),
                "length": sum(1 for o in group if o.finish == "length"),
                "budget_closed": sum(1 for o in group if o.budget_closed),
            }
        )
    return rows


def targets(outcomes: Sequence[Outcome]) -> list[str]:
    """One TARGET line per tier: 0 invalid answers and at most 10 % at length (JSON and tool answers)."""
    lines = []
    for tier in sorted({o.tier for o in outcomes}):
        shaped = [o for o in outcomes if o.tier == tier and o.kind != "stop"]
        invalid = sum(1 for o in outcomes if o.tier == tier and o.valid is False)
        share = sum(1 for o in shaped if o.finish == "length") / max(1, len(shaped))
        ok = invalid == 0 and share <= TARGET_LENGTH_SHARE
        lines.append(
            f"TARGET structured output, {tier} tier, default sampling, max_tokens {MAX_TOKENS}: {invalid} invalid, "
            f"{100 * share:.1f} % at length (target 0 invalid, <= {100 * TARGET_LENGTH_SHARE:.0f} %): "
            f"{'PASS' if ok else 'FAIL'}"
        )
    return lines


def markdown(
    outcomes: Sequence[Outcome], command: str, seconds: dict[str, float], readme: dict[str, list[dict[str, Any]]]
) -> str:
    lines = [
        "# Structured output: the guarantees on the real model",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; host load average (1 min) "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): every prompt of tests/data/structured_prompts.json "
        "through gRPC (the gateway's Chat) and HTTP (Envoy, the official openai client) on each tier's mesh, "
        f"SmolLM2-135M-Instruct under its default sampling (deploy/models.yaml), seed 1000 + the prompt's index, "
        f"max_tokens {MAX_TOKENS} (stop strings: {STOP_MAX_TOKENS}). "
        + ", ".join(f"{tier}: {s:.0f} s" for tier, s in seconds.items())
        + ".",
        "",
        "`valid`: the guarantee held (parsed / validated / declared calls with valid arguments / truncated at the "
        "first stop string); `invalid`: it did not; `length`: finished at max_tokens (no guarantee applies); "
        "`budget closed`: the mask closed the answer before the budget ran out.",
        "",
        "| tier | door | kind | answers | valid | invalid | at length | budget closed |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rates(outcomes):
        share = f"{r['length']} ({100 * r['length'] / r['answers']:.0f} %)"
        lines.append(
            f"| {r['tier']} | {r['door']} | {r['kind']} | {r['answers']} | {r['valid']} | {r['invalid']} | "
            f"{share} | {r['budget_closed']} |"
        )
    broken = [o for o in outcomes if o.valid is False]
    lines += ["", *targets(outcomes), ""]
    if broken:
        lines += ["Invalid answers:", ""]
        lines += [f"- {o.tier} {o.door} {o.kind} #{o.index}: {o.detail[:300]}" for o in broken]
        lines.append("")
    at_length = [o for o in outcomes if o.finish == "length" and o.kind != "stop"]
    if at_length:
        lines += ["Answers at length (the budget held no valid ending, or the model was mid-way when it ran out):", ""]
        lines += [f"- {o.tier} {o.door} {o.kind} #{o.index}: {o.detail[:200]!r}" for o in at_length]
        lines.append("")
    if readme:
        lines += [
            "## The README's prompts under the default model's defaults",
            "",
            f"Only `max_tokens` as the README sets it (0: the default, 256) and seed {README_SEED}; `repeats`: how "
            "often the answer's most frequent sentence occurs (a loop repeats one until max_tokens).",
            "",
            "| tier | door | prompt | max_tokens | finish | repeats | answer |",
            "|---|---|---|---:|---|---:|---|",
        ]
        for tier, answers in readme.items():
            for a in answers:
                text = a["text"].replace("|", "\\|").replace("\n", " ⏎ ")
                cells = (tier, a["door"], a["prompt"], a["max_tokens"], a["finish"], a["most_repeated"], text)
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


async def run(
    tiers: Sequence[str], doors: Sequence[str], concurrency: int
) -> tuple[list[Outcome], dict[str, float], dict[str, list[dict[str, Any]]]]:
    from services.local.mesh import DEFAULT_MODELS_FILE, DEV_API_KEY, Mesh, MeshConfig

    prompts = load_prompts()
    outcomes: list[Outcome] = []
    seconds: dict[str, float] = {}
    readme: dict[str, list[dict[str, Any]]] = {}
    for tier in tiers:
        config = MeshConfig(
            edge_workers=1 if tier == "edge" else 0,
            cloud_workers=1 if tier == "cloud" else 0,
            envoy=True,
            models_file=str(DEFAULT_MODELS_FILE),
            extra_env=MESH_ENV,
        )
        async with Mesh(config, sink=lambda name, line: None) as mesh:
            began = time.perf_counter()
            outcomes += await run_tier(
                tier, mesh.gateway_address, mesh.http_base_url, DEV_API_KEY, prompts, doors, concurrency=concurrency
            )
            seconds[tier] = time.perf_counter() - began
            readme[tier] = await readme_answers(tier, mesh.gateway_address, mesh.http_base_url, DEV_API_KEY)
    return outcomes, seconds, readme


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench structured-guarantees", description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="edge,cloud", help="comma-separated tiers (default edge,cloud)")
    parser.add_argument("--doors", default="grpc,http", help="comma-separated front doors (default grpc,http)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per tier (default 16)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    outcomes, seconds, readme = asyncio.run(run(args.tiers.split(","), args.doors.split(","), args.concurrency))
    command = "python -m benchmarks.structured.guarantees " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "structured_guarantees",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "command": command.strip(),
        "seconds": seconds,
        "rates": rates(outcomes),
        "outcomes": [asdict(o) for o in outcomes],
        "readme": readme,
    }
    (args.out / "structured_guarantees.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(outcomes, command.strip(), seconds, readme)
    (args.out / "structured_guarantees.md").write_text(text)
    print(text)
    return 0 if all(o.valid is not False for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
