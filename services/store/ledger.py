"""Our own byte accounting: Lua scripts that write entries and keep a per-scope byte ledger.

Each scope (keys.Scope: one kind x model version x tenant salt, one hash tag, one slot) has an index
zset (entry key -> expiry in ms), a sizes hash (entry key -> value bytes) and a used-bytes counter.
A put is one pipeline, one round trip: a native ``SET key value EX ttl`` per entry (the bulk bytes
never pass through Lua, which would copy them twice), then ``ACCOUNT`` with only the sizes.
``ACCOUNT`` drops expired members, admits the longest leading run of new entries that fits the
scope's budget (the rest are unlinked at once: for a KV chain a gap would be useless), evicts the
entries that expire soonest until the admitted ones fit, and records them. The budget holds after
every put; while one put's pipeline runs it may be exceeded by that put's bytes.
An entry evicted by Redis itself (maxmemory) stays counted until its expiry: the ledger errs on the
side of using less than the budget, never more. Every loop in the scripts is bounded.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from redis.exceptions import NoScriptError

from services.store.connection import AnyRedis
from services.store.keys import scope_of

ACCOUNT = """
local ix, sz, used = KEYS[1], KEYS[2], KEYS[3]
local ttl, now, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local total = tonumber(redis.call('GET', used) or '0')
local expired = redis.call('ZRANGEBYSCORE', ix, '-inf', now, 'LIMIT', 0, 1024)
for _, m in ipairs(expired) do
  total = total - tonumber(redis.call('HGET', sz, m) or '0')
  redis.call('HDEL', sz, m)
  redis.call('ZREM', ix, m)
end
for i = 4, #KEYS do
  local old = redis.call('HGET', sz, KEYS[i])
  if old then
    total = total - tonumber(old)
    redis.call('HDEL', sz, KEYS[i])
    redis.call('ZREM', ix, KEYS[i])
  end
end
local admitted, incoming = 0, 0
for i = 4, #KEYS do
  local n = tonumber(ARGV[i])
  if incoming + n > budget then break end
  incoming = incoming + n
  admitted = admitted + 1
end
for i = 4 + admitted, #KEYS do
  redis.call('UNLINK', KEYS[i])
end
local evicted = 0
while total + incoming > budget and evicted < 100000 do
  local v = redis.call('ZRANGE', ix, 0, 0)
  if #v == 0 then break end
  total = total - tonumber(redis.call('HGET', sz, v[1]) or '0')
  redis.call('HDEL', sz, v[1])
  redis.call('ZREM', ix, v[1])
  redis.call('UNLINK', v[1])
  evicted = evicted + 1
end
for i = 4, 3 + admitted do
  redis.call('ZADD', ix, now + ttl * 1000, KEYS[i])
  redis.call('HSET', sz, KEYS[i], ARGV[i])
end
total = total + incoming
if total < 0 then total = 0 end
redis.call('SET', used, total, 'EX', ttl + 60)
redis.call('EXPIRE', ix, ttl + 60)
redis.call('EXPIRE', sz, ttl + 60)
return {admitted, evicted}
"""

PREFIX_LEN = """
local n = 0
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then break end
  n = n + 1
end
return n
"""


class Script:
    """A Lua script run by EVALSHA, falling back to EVAL once per node that does not know it yet."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: AnyRedis, keys: Sequence[str], args: Sequence[bytes | str | int]) -> object:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)  # type: ignore[misc]


account_script = Script(ACCOUNT)


async def put_entries(
    client: AnyRedis, keys: Sequence[str], values: Sequence[bytes | memoryview], ttl_s: int, budget: int
) -> tuple[int, int]:
    """SET ``keys`` to ``values`` with the TTL and account for them in their scope's ledger.

    All keys must belong to one scope. Returns (entries kept, other entries evicted). One round trip
    (two the first time a Redis node sees the script).
    """
    ledger = scope_of(keys[0])
    sizes = [len(v) for v in values]
    args: list[bytes | str | int] = [ttl_s, int(time.time() * 1000), budget, *sizes]
    pipe = client.pipeline(transaction=False)
    for key, value in zip(keys, values, strict=True):
        pipe.set(key, value, ex=ttl_s)  # type: ignore[arg-type]
    # execute_command, not pipe.evalsha: redis-py blocks the latter in cluster pipelines although all
    # our keys share one slot
    pipe.execute_command("EVALSHA", account_script.sha, 3 + len(keys), *ledger, *keys, *args)
    results = await pipe.execute(raise_on_error=False)
    for r in results[:-1]:
        if isinstance(r, Exception):
            raise r
    last = results[-1]
    if isinstance(last, NoScriptError):
        last = await client.eval(account_script.source, 3 + len(keys), *ledger, *keys, *args)  # type: ignore[misc]
    elif isinstance(last, Exception):
        raise last
    return int(last[0]), int(last[1])


prefix_len_script = Script(PREFIX_LEN)
