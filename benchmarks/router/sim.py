"""Discrete-event simulation of a tier of replicas with prefix KV caches, driven by the real policy.

The replica choice is made by the router's own code (:class:`CacheAware` or
:class:`RoundRobin` from services/router/balancer/policies/); only the replicas are modelled:

- each replica runs ``slots`` sequences at once, later ones wait FIFO;
- each holds an LRU cache of ``cache_blocks`` prefix blocks (``block`` tokens, chained hashes as
  the router computes them); a sequence reuses the longest cached prefix of its prompt;
- TTFT = queue wait + uncached prompt tokens x ``prefill_s_per_token``; the sequence then holds its
  slot for ``output`` x ``decode_s_per_token``; on finish its prompt + output blocks are cached.

Workload: multi-turn conversations, each under one of a few shared system prompts; every turn's
prompt is system prompt + the whole conversation so far (as a chat template renders it).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from benchmarks.stats import percentile
from services.router.balancer.blocks import block_hashes
from services.router.balancer.policies.base import Candidate, ReplicaPolicy
from services.router.balancer.policies.cache_aware import CacheAware
from services.router.balancer.policies.round_robin import RoundRobin


@dataclass
class SimConfig:
    replicas: int = 4
    slots: int = 4
    block: int = 16
    cache_blocks: int = 1024
    system_prompts: int = 6
    system_tokens: tuple[int, int] = (300, 700)
    conversations: int = 240
    turns: int = 4
    user_tokens: tuple[int, int] = (20, 80)
    output_tokens: int = 48
    prefill_s_per_token: float = 0.0008
    decode_s_per_token: float = 0.01
    arrival_rate: float = 5.0  # new conversations per second
    think_s: float = 1.0
    seed: int = 7


@dataclass
class _Replica:
    name: str
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    running: int = 0
    waiting: deque[tuple[float, int, list[bytes], int]] = field(default_factory=deque)

    @property
    def load(self) -> int:
        return self.running + len(self.waiting)


def simulate(policy: str, cfg: SimConfig) -> dict[str, float]:
    rng = random.Random(cfg.seed)
    systems = [
        [rng.randrange(3, 40000) for _ in range(rng.randrange(*cfg.system_tokens))] for _ in range(cfg.system_prompts)
    ]
    replicas = [_Replica(f"r{i}") for i in range(cfg.replicas)]
    by_name = {r.name: r for r in replicas}
    selector: ReplicaPolicy = RoundRobin() if policy == "round_robin" else CacheAware(rng=random.Random(cfg.seed))
    events: list[tuple[float, int, str, int, int, str]] = []  # time, order, kind, conv, turn, replica
    order = 0

    def push(t: float, kind: str, conv: int, turn: int, name: str = "") -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, conv, turn, name))

    t = 0.0
    history: dict[int, list[int]] = {}
    for conv in range(cfg.conversations):
        t += rng.expovariate(cfg.arrival_rate)
        history[conv] = list(systems[rng.randrange(len(systems))])
        push(t, "arrive", conv, 0)
    ttfts: list[float] = []
    prompt_total = cached_total = 0

    def start(r: _Replica, now: float, arrived: float, conv: int, blocks: list[bytes], turn: int) -> None:
        nonlocal prompt_total, cached_total
        cached = 0
        for b in blocks:
            if b not in r.cache:
                break
            r.cache.move_to_end(b)
            cached += 1
        prompt = len(history[conv])
        uncached = prompt - cached * cfg.block
        prompt_total += prompt
        cached_total += cached * cfg.block
        first = now + uncached * cfg.prefill_s_per_token
        ttfts.append(first - arrived)
        r.running += 1
        push(first + cfg.output_tokens * cfg.decode_s_per_token, "finish", conv, turn, r.name)

    while events:
        now, _, kind, conv, turn, name = heapq.heappop(events)
        if kind == "arrive":
            history[conv] += [rng.randrange(3, 40000) for _ in range(rng.randrange(*cfg.user_tokens))]
            blocks = block_hashes(history[conv], cfg.block)
            name = selector.select([Candidate(r.name, r.load) for r in replicas], blocks, group="edge").name
            r = by_name[name]
            if r.running < cfg.slots:
                start(r, now, now, conv, blocks, turn)
            else:
                r.waiting.append((now, conv, blocks, turn))
        else:
            r = by_name[name]
            r.running -= 1
            history[conv] += [rng.randrange(3, 40000) for _ in range(cfg.output_tokens)]
            for b in block_hashes(history[conv], cfg.block):
                r.cache[b] = None
                r.cache.move_to_end(b)
            while len(r.cache) > cfg.cache_blocks:
                r.cache.popitem(last=False)
            if r.waiting:
                arrived, wconv, wblocks, wturn = r.waiting.popleft()
                start(r, now, arrived, wconv, wblocks, wturn)
            if turn + 1 < cfg.turns:
                push(now + rng.expovariate(1 / cfg.think_s), "arrive", conv, turn + 1)
    ms = [x * 1000 for x in ttfts]
    return {
        "requests": len(ttfts),
        "prefix_hit_rate": cached_total / prompt_total,
        "ttft_ms_mean": sum(ms) / len(ms),
        "ttft_ms_p50": percentile(ms, 50),
        "ttft_ms_p99": percentile(ms, 99),
    }
