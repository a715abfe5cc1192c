"""The Redis contract: key layout, message schema and expiry.

Redis is the only state the services share, so everything a restarted
service needs lives here, and every key expires so that nothing leaks when
a service dies (the TTLs below bound how long anything can outlive its use).

Keys (all under the ``bl:`` prefix; messages are protobufs from
``protos/batchline/protocol/internal.proto``):

============================  ===========  ==================================================
key                           type         holds
============================  ===========  ==================================================
bl:q:{model}:{version}        sorted set   QueueEntry, scored priority-major, deadline-minor
bl:req:{request_id}           string       the ModelInferRequest (tensors); TTL = budget + grace
bl:batch:{batch_id}           string       Batch while dispatched; TTL = latest deadline + grace
bl:work:{executor_id}         list         Batch messages waiting for that executor
bl:inflight:{executor_id}     set          batch ids dispatched to it and not yet answered
bl:reply:{gateway_id}         list         Reply messages for that gateway's waiting clients
bl:exec:{executor_id}         string       ExecutorInfo; TTL = heartbeat TTL (presence)
bl:executors                  set          executor ids ever seen (members pruned when stale)
bl:gateway:{gateway_id}       string       the gateway's address; TTL = heartbeat TTL
bl:gateways                   sorted set   gateway ids scored by their last heartbeat (ms): how many are live
bl:notify:{model}:{version}   list         a wake-up token for the scheduler: arrivals in that queue (one at most)
bl:reports                    list         ExecutionReport messages for the scheduler (capped; rows 0: batches handed back)
bl:stats:{model}:{version}    hash         Triton-style statistics counters
bl:leader                     string       id of the scheduler holding the lease; TTL = lease
bl:load:{model}:{version}     string       ModelLoad, the scheduler's view for admission; short TTL
bl:profile-units:{m}:{v}:{k}  string       latency-profile samples (units, seconds) as float32 pairs
============================  ===========  ==================================================
"""
from __future__ import annotations

PREFIX = "bl:"

EXECUTORS = PREFIX + "executors"
REPORTS = PREFIX + "reports"
LEADER = PREFIX + "leader"
GATEWAYS = PREFIX + "gateways"

# Ordering within a queue: priority level first (1 is highest), then the
# earliest deadline. deadline_ms is ~1.8e12, so a 1e13 stride keeps both exact
# in a double (the score type) for hundreds of priority levels.
_PRIORITY_STRIDE = 10**13

# The longest latency budget a request can have (the gateway caps longer ones).
MAX_BUDGET_S = 24 * 3_600

# Expiries, in seconds unless the name says ms.
PAYLOAD_GRACE_MS = 5_000        # a payload outlives its deadline by this much
# An idle queue (no arrival refreshed it) disappears after this: longer than any budget, so that
# the entries of requests still waiting (say, for executors that are down) do not go with it.
QUEUE_TTL = MAX_BUDGET_S + 3_600
REPLY_TTL = 60                  # a gateway that died leaves its replies this long
GATEWAYS_TTL = 60               # the gateway set, once the last gateway is gone
WORK_TTL = 3_600
STATS_TTL = 7 * 24 * 3_600
REGISTRY_TTL = 24 * 3_600
LOAD_TTL_MS = 2_000             # admission ignores a load view older than this
PROFILE_TTL = 7 * 24 * 3_600
SCHEDULER_WAKE_TTL_MS = 10_000  # a scheduler's own wake list, should it die before reading it
REPORTS_CAP = 100_000


def scheduler_wake(scheduler_id: str) -> str:
    """A list only this scheduler waits on: it pushes to it to stop its own blocking wait early."""
    return f"{PREFIX}scheduler:{scheduler_id}:wake"


def queue(model: str, version: str) -> str:
    return f"{PREFIX}q:{model}:{version}"


def notify(model: str, version: str) -> str:
    """Wake-up tokens for arrivals in one queue: one list per queue, so that the scheduler can
    leave alone those of a queue that waits for a busy executor (it wakes for that executor's report)."""
    return f"{PREFIX}notify:{model}:{version}"


def payload(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}"


def batch(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}"


def work(executor_id: str) -> str:
    return f"{PREFIX}work:{executor_id}"


def inflight(executor_id: str) -> str:
    return f"{PREFIX}inflight:{executor_id}"


def reply(gateway_id: str) -> str:
    return f"{PREFIX}reply:{gateway_id}"


def executor(executor_id: str) -> str:
    return f"{PREFIX}exec:{executor_id}"


def gateway(gateway_id: str) -> str:
    return f"{PREFIX}gateway:{gateway_id}"


def stats(model: str, version: str) -> str:
    return f"{PREFIX}stats:{model}:{version}"


def load(model: str, version: str) -> str:
    return f"{PREFIX}load:{model}:{version}"


def profile(model: str, version: str, kind: str) -> str:
    # Not "profile:": samples saved under that name counted rows, whatever the sequence length.
    return f"{PREFIX}profile-units:{model}:{version}:{kind}"


def queue_score(priority: int, deadline_us: int) -> int:
    return priority * _PRIORITY_STRIDE + deadline_us // 1000


def payload_ttl_ms(deadline_us: int, now_us: int) -> int:
    return max(1, (deadline_us - now_us) // 1000) + PAYLOAD_GRACE_MS


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
