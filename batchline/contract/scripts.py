"""The Redis contract's Lua scripts: each write that must be atomic, or one round trip.

Callers do not pack these scripts' arguments themselves: batchline.contract.calls
does, from typed arguments.
"""
from __future__ import annotations

# Hands a dispatched batch to its executor: its work list, and the model in the set of those it
# was sent batches of (where recovery finds its in-flight sets). In the executor's slot.
# KEYS[w], KEYS[w + 1]: work list, served set; ARGV: Batch bytes, work ttl s, model tag.
_HAND_OVER_FN = """
local function hand_over(w, batch, ttl, tag)
  redis.call('RPUSH', KEYS[w], batch)
  redis.call('EXPIRE', KEYS[w], ttl)
  redis.call('SADD', KEYS[w + 1], tag)
  redis.call('EXPIRE', KEYS[w + 1], ttl)
end
"""

# Moves queue members into a dispatched batch atomically, so that a request is
# either still queued or in exactly one batch, whatever crashes. With the
# executor's keys (one Redis), all of them or none: a member gone meanwhile was
# cancelled, or taken by another scheduler's batch around a lease change, and
# the Batch carries every member, so an executor would run such a one twice;
# those still queued go in the next step's plan. On a cluster (below) members
# that vanished are not taken, and the executor skips those whose payloads are
# gone. The Batch goes
# under the batch key and into the model's in-flight set of its executor (what
# recovery re-dispatches if that executor dies) and, given their keys, to the
# executor (hand_over). Returns how many members were taken; with none,
# nothing is dispatched.
#
# On a Redis Cluster the executor's keys are in another slot: this script runs without them
# (3 keys) and HAND_OVER_LUA beside it, in either order. A batch handed over whose members
# were not taken finds their payloads gone or runs them once more (the gateway keeps the first
# answer); a batch taken but never handed over is in the in-flight set, which the executor's
# sweep of batches it holds but does not run hands back.
#
# KEYS: queue, batch key, in-flight set[, work list, served set]
# ARGV: batch_id, batch ttl ms, work ttl s, Batch bytes, model tag, member bytes...
DISPATCH_LUA = _HAND_OVER_FN + """
if #KEYS == 5 then
  for i = 6, #ARGV do
    if not redis.call('ZSCORE', KEYS[1], ARGV[i]) then
      return 0
    end
  end
end
local n = 0
for i = 6, #ARGV do
  n = n + redis.call('ZREM', KEYS[1], ARGV[i])
end
if n > 0 then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[2])
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  if #KEYS == 5 then
    hand_over(4, ARGV[4], ARGV[3], ARGV[5])
  end
end
return n
"""

# The executor's half of a dispatch on a Redis Cluster. KEYS: work list, served set.
# ARGV: Batch bytes, work ttl s, model tag.
HAND_OVER_LUA = _HAND_OVER_FN + """
hand_over(1, ARGV[1], ARGV[2], ARGV[3])
return 1
"""


# Hands one dispatched batch back to its queue, by whoever takes it off the executor's in-flight
# set: two parties handing back the same batch (the scheduler for an executor it thinks dead, the
# executor's own sweep) requeue its members once, and never after the batch is answered or once
# its members were dispatched again. Members whose payload is gone (answered, abandoned) stay out.
# All keys are in the model's slot.
# KEYS: in-flight set, batch key, queue, then each member's payload key.
# ARGV: batch id, queue ttl s, then per member its score and QueueEntry bytes.
# Returns how many members went back (-1: another party had handed the batch back or answered it).
HAND_BACK_LUA = """
redis.call('DEL', KEYS[2])
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then
  return -1
end
local n = 0
for i = 4, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    local a = 3 + (i - 4) * 2
    redis.call('ZADD', KEYS[3], ARGV[a], ARGV[a + 1])
    n = n + 1
  end
end
if n > 0 then
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
return n
"""


# A scheduler's shed: each request still queued is taken out, its payload dropped and its answer
# pushed to its gateway; one no longer queued (dispatched meanwhile by another scheduler, around a
# lease change, or answered) is left alone, payload and all, and not answered. On one Redis only
# (the reply lists are other slots): on a cluster calls.shed writes the steps apart.
# KEYS: queue, stats hash, per member its payload key, then the reply lists.
# ARGV: members, reply lists, reply ttl s, stats ttl s, then per member its bytes, the index of its
# reply list (1-based) and its Reply. Returns how many were shed.
SHED_LUA = """
local n = tonumber(ARGV[1])
local shed, a = 0, 5
for i = 1, n do
  if redis.call('ZREM', KEYS[1], ARGV[a]) == 1 then
    local list = KEYS[2 + n + tonumber(ARGV[a + 1])]
    redis.call('DEL', KEYS[2 + i])
    redis.call('RPUSH', list, ARGV[a + 2])
    redis.call('EXPIRE', list, ARGV[3])
    shed = shed + 1
  end
  a = a + 3
end
if shed > 0 then
  redis.call('HINCRBY', KEYS[2], 'fail_count', shed)
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return shed
"""


# On a cluster, the part of a shed in the model's hash slot (the reply lists are in the gateways'):
# each member out of its queue and its payload dropped only if it was still queued, the failures
# counted. KEYS: queue, stats, each member's payload key; ARGV: stats ttl, members. Returns the
# 1-based places of the members shed, whose answers the caller then sends.
SHED_QUEUED_LUA = """
local shed = {}
for i = 2, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('DEL', KEYS[1 + i])
    shed[#shed + 1] = i - 1
  end
end
if #shed > 0 then
  redis.call('HINCRBY', KEYS[2], 'fail_count', #shed)
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return shed
"""


# A gateway takes back a request nobody waits for: out of its queue and its payload dropped, if it
# was still queued; else it was dispatched, and its payload stays, so that its run (or its
# executor's refusal past its deadline) answers it: a sequence's next request waits for that answer.
# KEYS: queue, payload key; ARGV: member. Returns 1 when it was still queued.
WITHDRAW_LUA = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
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

# Scripts with no answer of their own return 1, not nil: redis-py's cluster pipeline, after a
# connection error on any node, sends again every command whose result is empty, and a hand-over,
# push or count run twice is a batch run twice or a count doubled.
# Appends to a list and sets its expiry in one command: a list must never be left without one
# (e.g. a reply list whose gateway died, written by a connection lost between two commands).
# KEYS: the list; ARGV: ttl s, then the values. One RPUSH per value, not unpack(): Lua's stack caps
# unpack at 7,999 values, and a scheduler back from an outage can shed more than that at once.
PUSH_WITH_TTL_LUA = """
for i = 2, #ARGV do
  redis.call('RPUSH', KEYS[1], ARGV[i])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# Adds to a hash field and sets the hash's expiry in one command, for the same reason.
# KEYS: the hash; ARGV: ttl s, field, increment.
COUNT_WITH_TTL_LUA = """
redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# Adds to a counter and sets its expiry in one command, for the same reason.
# KEYS: the counter; ARGV: ttl s, increment.
INCR_WITH_TTL_LUA = """
redis.call('INCRBY', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# A repository call's sequence number: the next one, the counter never left without its expiry.
# KEYS: the counter; ARGV: ttl s. Returns the number.
NEXT_CALL_LUA = """
local seq = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return seq
"""

# Records a repository call unless a later one of the same model is recorded already: two calls
# racing (a load and an unload) land as their numbers say, not as their writes arrive.
# KEYS: the calls hash, the counter; ARGV: model name, "action:seq", seq, ttl s. Returns 1 when recorded.
RECORD_CALL_LUA = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  local at = tonumber(string.match(current, ':(%d+)$'))
  if at and at > tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""

# Gives the lease up at shutdown so a standby takes over at once.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A group commit's announcement: the gateway's heartbeat key (executors skip requests of a
# gateway without one, and a restarted Redis starts without it), and a wake-up token on the
# notify list of each queue written to (one token is as good as many: whoever reads the list
# takes all it holds). KEYS[first]: the heartbeat key, then the notify lists.
_ANNOUNCE_FN = """
local function announce(first, address, ttl_ms, queue_ttl)
  redis.call('SET', KEYS[first], address, 'PX', ttl_ms)
  for i = first + 1, #KEYS do
    if redis.call('LLEN', KEYS[i]) == 0 then
      redis.call('RPUSH', KEYS[i], 1)
      redis.call('EXPIRE', KEYS[i], queue_ttl)
    end
  end
end
"""

# A gateway's group commit in one command: what its requests write and what its
# abandoned requests leave (redis-py spends more CPU per command than Redis does
# running all of them, and the gateway's CPU is what small models are bound by).
# Each write queues its payload and queue entry unless the queue holds max_size
# (> 0) entries already; every queue written to is refreshed; with `announce`,
# the commit is announced (_ANNOUNCE_FN) too. On a Redis Cluster this runs once
# per model, without announcing, and ANNOUNCE_LUA after it in the shared slot.
# KEYS: per write its payload key and queue, then per abandoned request its queue
#       and payload key, then (announce) the heartbeat key and the notify lists.
# ARGV: writes, abandoned, announce (1/0), gateway address, heartbeat ttl ms, queue
#       ttl s, then per write payload, payload ttl ms, score, member, max size, then
#       per abandoned request its member.
# Returns per write 1 when queued, 0 when its queue was full.
ENQUEUE_LUA = _ANNOUNCE_FN + """
local writes, abandoned = tonumber(ARGV[1]), tonumber(ARGV[2])
local queued, seen = {}, {}
local k, a = 1, 7
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
    redis.call('EXPIRE', queue, ARGV[6])
  end
  k, a = k + 2, a + 5
end
for i = 1, abandoned do
  redis.call('ZREM', KEYS[k], ARGV[a])
  redis.call('DEL', KEYS[k + 1])
  k, a = k + 2, a + 1
end
if ARGV[3] == '1' and writes > 0 then
  announce(k, ARGV[4], ARGV[5], ARGV[6])
end
return queued
"""

# A group commit's announcement on its own, in the shared slot (Redis Cluster).
# KEYS: the heartbeat key, the notify lists; ARGV: gateway address, heartbeat ttl ms, queue ttl s.
ANNOUNCE_LUA = _ANNOUNCE_FN + """
announce(1, ARGV[1], ARGV[2], ARGV[3])
return 1
"""

# A scheduling step's read in one command: the arrivals' tokens dropped (first, so that the read
# sees every request whose token it drops), up to `drain` reports taken, each queue's head and
# depth, each in-flight set. One script rather than a pipeline of a dozen commands: a client
# spends more CPU per command than Redis spends running them. Not on a Redis Cluster (the keys
# span slots): there the store pipelines the commands.
# KEYS: the notify lists, the reports list, the queues, the in-flight sets.
# ARGV: notify lists, queues, drain, scan limit.
# Returns {reports, {head per queue}, {depth per queue}, {members per in-flight set}}.
SCAN_LUA = """
local notices, queues = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, notices do
  redis.call('DEL', KEYS[i])
end
local reports = redis.call('LPOP', KEYS[notices + 1], ARGV[3]) or {}
local heads, depths, inflight = {}, {}, {}
local q = notices + 1
for i = 1, queues do
  heads[i] = redis.call('ZRANGE', KEYS[q + i], 0, tonumber(ARGV[4]) - 1)
  depths[i] = redis.call('ZCARD', KEYS[q + i])
end
for i = q + queues + 1, #KEYS do
  inflight[#inflight + 1] = redis.call('SMEMBERS', KEYS[i])
end
return {reports, heads, depths, inflight}
"""

# An execution report for the scheduler, the list capped and never left without its expiry.
# KEYS[r]: the reports list; ARGV: report, cap, ttl s.
_REPORT_FN = """
local function report(r, blob, cap, ttl)
  redis.call('RPUSH', KEYS[r], blob)
  redis.call('LTRIM', KEYS[r], -tonumber(cap), -1)
  redis.call('EXPIRE', KEYS[r], ttl)
end
"""

REPORT_LUA = _REPORT_FN + """
report(1, ARGV[1], ARGV[2], ARGV[3])
return 1
"""

# An executor's write for a finished batch, in one command: the replies to each
# gateway, the batch's payloads and batch key gone, the batch off the in-flight set,
# its execution report for the scheduler, and the model's statistics counters (a
# batch updates ~16). On a Redis Cluster the replies (PUSH_WITH_TTL_LUA per gateway)
# go first, then this script without replies or report (the model's slot), then the
# report (REPORT_LUA): a crash in between re-runs the batch, and the gateway keeps the
# first answer.
# KEYS: in-flight set, stats key, batch key, the keys that go with the batch (its payloads;
#       a generation batch's records of tokens sent too), then (with a report) the
#       reports list and each gateway's reply list.
# ARGV: gateways, the number of keys that go, batch id, report ('' for none), reports cap, queue ttl s,
#       reply ttl s, stats ttl s, last inference ms (0: none succeeded), then per
#       gateway the number of its replies and the replies, then statistics field,
#       increment pairs.
BATCH_DONE_LUA = _REPORT_FN + """
local gateways, payloads = tonumber(ARGV[1]), tonumber(ARGV[2])
local a = 10
-- One call per element, not unpack(): Lua's stack caps unpack at a few thousand values.
for i = 1, gateways do
  local key, n = KEYS[4 + payloads + i], tonumber(ARGV[a])
  for j = a + 1, a + n do
    redis.call('RPUSH', key, ARGV[j])
  end
  redis.call('EXPIRE', key, ARGV[7])
  a = a + n + 1
end
redis.call('DEL', KEYS[3])
for i = 4, 3 + payloads do
  redis.call('DEL', KEYS[i])
end
redis.call('SREM', KEYS[1], ARGV[3])
if ARGV[4] ~= '' then
  report(4 + payloads, ARGV[4], ARGV[5], ARGV[6])
end
if a < #ARGV then
  for i = a, #ARGV, 2 do
    redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
  end
  if ARGV[9] ~= '0' then
    redis.call('HSET', KEYS[2], 'last_inference_ms', ARGV[9])
  end
  redis.call('EXPIRE', KEYS[2], ARGV[8])
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

# Save sequences' states after a step, each only if its step count is still the one the step
# read and its request is still awaited (its payload there): a stale run, of a batch handed to
# another executor while this one was only slow, must not overwrite a later step's state, however
# many steps later (the other run's answer deleted the payload), nor a given-up request's step
# land after its gateway moved the sequence on. The request id saved beside the state tells a
# stale run of the very request that saved it (its other run's answer is on its way).
# KEYS: each sequence's hash, then each request's payload key (as many); ARGV: TTL ms, then per
# sequence: the steps expected, the steps after, the state, the request id.
# Returns, per sequence, 1 when saved; 2 when not, another run of the same request having saved
# it; 0 when not otherwise (the count had moved on, or the request is over).
SAVE_SEQUENCES_LUA = """
local saved = {}
local n = #KEYS / 2
for i = 1, n do
  local a = 2 + (i - 1) * 4
  local steps = redis.call('HGET', KEYS[i], 'steps') or '0'
  if steps == ARGV[a] and redis.call('EXISTS', KEYS[n + i]) == 1 then
    redis.call('HSET', KEYS[i], 'steps', ARGV[a + 1], 'state', ARGV[a + 2], 'rid', ARGV[a + 3])
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    saved[i] = 1
  elseif redis.call('HGET', KEYS[i], 'rid') == ARGV[a + 3] then
    saved[i] = 2
  else
    saved[i] = 0
  end
end
return saved
"""
