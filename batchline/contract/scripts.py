"""The Redis contract's Lua scripts: each write that must be atomic, or one round trip.

Callers do not pack these scripts' arguments themselves: batchline.contract.calls
does, from typed arguments.
"""
from __future__ import annotations

# Moves queue members into a dispatched batch atomically, so that a request is
# either still queued or in exactly one batch, whatever crashes. Members that
# vanished meanwhile (their gateway gave up and removed them) are not taken;
# the executor skips them too, as their payloads are gone. The Batch goes
# both to the executor's work list (what it runs) and under the batch key
# (what recovery re-dispatches if that executor dies). Returns how many
# members were taken; with none, nothing is dispatched.
#
# KEYS: queue, batch key, work list, inflight set
# ARGV: batch_id, batch ttl ms, work ttl s, Batch bytes, member bytes...
DISPATCH_LUA = """
local n = 0
for i = 5, #ARGV do
  n = n + redis.call('ZREM', KEYS[1], ARGV[i])
end
if n > 0 then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[2])
  redis.call('RPUSH', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  redis.call('SADD', KEYS[4], ARGV[1])
  redis.call('EXPIRE', KEYS[4], ARGV[3])
end
return n
"""


# The scheduler lease: renewed only by its holder, so a scheduler that lost
# it (paused past the TTL) cannot extend another's.
# KEYS: leader key; ARGV: scheduler id, ttl ms. Returns 1 when held.
LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# Appends to a list and sets its expiry in one command: a list must never be left without one
# (e.g. a reply list whose gateway died, written by a connection lost between two commands).
# KEYS: the list; ARGV: ttl s, then the values. One RPUSH per value, not unpack(): Lua's stack caps
# unpack at 7,999 values, and a scheduler back from an outage can shed more than that at once.
PUSH_WITH_TTL_LUA = """
for i = 2, #ARGV do
  redis.call('RPUSH', KEYS[1], ARGV[i])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""

# Adds to a hash field and sets the hash's expiry in one command, for the same reason.
# KEYS: the hash; ARGV: ttl s, field, increment.
COUNT_WITH_TTL_LUA = """
redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""

# Gives the lease up at shutdown so a standby takes over at once.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A gateway's group commit in one command: what its requests write and what its
# abandoned requests leave (redis-py spends more CPU per command than Redis does
# running all of them, and the gateway's CPU is what small models are bound by).
# Each write queues its payload and queue entry unless the queue holds max_size
# (> 0) entries already; every queue written to is refreshed and announced once,
# on its own notify list.
# KEYS: the gateway's heartbeat key, then per write its payload key, queue and
#       notify list, then per abandoned request its queue and payload key.
# ARGV: writes, abandoned, gateway address, heartbeat ttl ms, queue ttl s, then
#       per write payload, payload ttl ms, score, member, max size, then per
#       abandoned request its member.
# Returns per write 1 when queued, 0 when its queue was full.
ENQUEUE_LUA = """
local writes, abandoned = tonumber(ARGV[1]), tonumber(ARGV[2])
local queued, seen, queues = {}, {}, {}
local k, a = 2, 6
for i = 1, writes do
  local queue, cap = KEYS[k + 1], tonumber(ARGV[a + 4])
  if cap > 0 and redis.call('ZCARD', queue) >= cap then
    queued[i] = 0
  else
    redis.call('SET', KEYS[k], ARGV[a], 'PX', ARGV[a + 1])
    redis.call('ZADD', queue, ARGV[a + 2], ARGV[a + 3])
    queued[i] = 1
  end
  if not seen[queue] then
    seen[queue] = true
    queues[#queues + 1] = k + 1
  end
  k, a = k + 3, a + 5
end
for i = 1, abandoned do
  redis.call('ZREM', KEYS[k], ARGV[a])
  redis.call('DEL', KEYS[k + 1])
  k, a = k + 2, a + 1
end
if writes > 0 then
  -- Executors skip requests of a gateway without a heartbeat key: make sure it
  -- exists with every write (a restarted Redis starts without it).
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
  for _, q in ipairs(queues) do
    local queue, notify = KEYS[q], KEYS[q + 1]
    redis.call('EXPIRE', queue, ARGV[5])
    -- One token is as good as many: whoever reads the list takes all it holds.
    if redis.call('LLEN', notify) == 0 then
      redis.call('RPUSH', notify, 1)
      redis.call('EXPIRE', notify, ARGV[5])
    end
  end
end
return queued
"""

# An executor's whole write for a finished batch, in one command: the replies to
# each gateway, the batch's payloads and batch key gone, the batch off the in-flight
# set, its execution report for the scheduler, and the model's statistics counters
# (a batch updates ~16).
# KEYS: REPORTS, in-flight set, stats key, batch key, then each gateway's reply
#       list, then the batch's payload keys.
# ARGV: gateways, payloads, batch id, report, reports cap, queue ttl s, reply ttl s,
#       stats ttl s, last inference ms (0: none succeeded), then per gateway the
#       number of its replies and the replies, then statistics field, increment pairs.
BATCH_DONE_LUA = """
local gateways, payloads = tonumber(ARGV[1]), tonumber(ARGV[2])
local a = 10
-- One call per element, not unpack(): Lua's stack caps unpack at a few thousand values.
for i = 1, gateways do
  local n = tonumber(ARGV[a])
  for j = a + 1, a + n do
    redis.call('RPUSH', KEYS[4 + i], ARGV[j])
  end
  redis.call('EXPIRE', KEYS[4 + i], ARGV[7])
  a = a + n + 1
end
redis.call('DEL', KEYS[4])
for i = 5 + gateways, 4 + gateways + payloads do
  redis.call('DEL', KEYS[i])
end
redis.call('SREM', KEYS[2], ARGV[3])
redis.call('RPUSH', KEYS[1], ARGV[4])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[5]), -1)
redis.call('EXPIRE', KEYS[1], ARGV[6])
if a < #ARGV then
  for i = a, #ARGV, 2 do
    redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1])
  end
  if ARGV[9] ~= '0' then
    redis.call('HSET', KEYS[3], 'last_inference_ms', ARGV[9])
  end
  redis.call('EXPIRE', KEYS[3], ARGV[8])
end
return 1
"""

# A tenant's request-rate cap, one token bucket for every gateway: refilled at ARGV[1] tokens a
# second up to ARGV[2], on Redis's clock (gateways' clocks may disagree). Takes one token if it
# can. Returns {1, 0} when taken, else {0, ms until one is there}. The bucket expires once it
# would be full again, so an idle tenant leaves nothing behind.
# KEYS: the bucket; ARGV: rate per second, burst.
TAKE_TOKEN_LUA = """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, at = tonumber(state[1]) or burst, tonumber(state[2]) or now
tokens = math.min(burst, tokens + (now - at) * rate / 1000)
local taken = 0
if tokens >= 1 then
  tokens, taken = tokens - 1, 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) * 1000 / rate) + 1000)
if taken == 1 then
  return {1, 0}
end
return {0, math.ceil((1 - tokens) * 1000 / rate)}
"""
