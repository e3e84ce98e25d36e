"""Our own byte accounting: Lua scripts that write entries and keep a per-scope byte ledger.

Each scope (keys.Scope: one kind x model version x tenant salt, one hash tag, one slot) has an index
zset (entry key -> expiry in ms), a sizes hash (entry key -> value bytes) and a used-bytes counter.
``PUT`` drops expired members, evicts the entries that expire soonest until the new entries fit the
scope's budget, writes them with their TTL and updates the ledger, atomically, in one round trip.
An entry evicted by Redis itself (maxmemory) stays counted until its expiry: the ledger errs on the
side of using less than the budget, never more. Every loop in the scripts is bounded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from redis.exceptions import NoScriptError

from services.cache.connection import AnyRedis

PUT = """
local ix, sz, used = KEYS[1], KEYS[2], KEYS[3]
local ttl, now, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local total = tonumber(redis.call('GET', used) or '0')
local expired = redis.call('ZRANGEBYSCORE', ix, '-inf', now, 'LIMIT', 0, 1024)
for _, m in ipairs(expired) do
  total = total - tonumber(redis.call('HGET', sz, m) or '0')
  redis.call('HDEL', sz, m)
  redis.call('ZREM', ix, m)
end
local incoming = 0
for i = 4, #KEYS do
  local old = redis.call('HGET', sz, KEYS[i])
  if old then
    total = total - tonumber(old)
    redis.call('HDEL', sz, KEYS[i])
    redis.call('ZREM', ix, KEYS[i])
  end
  incoming = incoming + #ARGV[i]
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
local stored = 0
for i = 4, #KEYS do
  local n = #ARGV[i]
  if total + n > budget then break end
  redis.call('SET', KEYS[i], ARGV[i], 'EX', ttl)
  redis.call('ZADD', ix, now + ttl * 1000, KEYS[i])
  redis.call('HSET', sz, KEYS[i], n)
  total = total + n
  stored = stored + 1
end
if total < 0 then total = 0 end
redis.call('SET', used, total, 'EX', ttl + 60)
redis.call('EXPIRE', ix, ttl + 60)
redis.call('EXPIRE', sz, ttl + 60)
return {stored, evicted}
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


put_script = Script(PUT)
prefix_len_script = Script(PREFIX_LEN)
