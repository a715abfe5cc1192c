"""The Redis contract's key layout, expiries and queue order.

Keys (all under the ``bl:`` prefix; messages are protobufs from
``protos/batchline/protocol/internal.proto``). The part in braces is the key's hash tag: on a
Redis Cluster, keys with the same tag live in one hash slot, which is what lets each script and
each blocking wait name keys of one slot only (docs/design/redis-cluster.md). M is
``m:<model>:<version>``, X ``x:<executor_id>``, G ``g:<gateway_id>``; a tenant's bucket and a
tokenizer and a load call's override have a tag of their own (``t:<tenant>``, ``k:<sha256>``, ``o:<model>``); S, the
shared slot, holds
what is small and read by everyone (wake-ups, reports, registrations, the lease).

=====================================  ===========  ==================================================
key                                    type         holds
=====================================  ===========  ==================================================
bl:q:{M}                               sorted set   QueueEntry, scored priority-major, deadline-minor
bl:req:{M}:<request_id>                string       the ModelInferRequest (tensors); TTL = budget + grace
bl:gen:{M}:<request_id>                string       the output token ids a generation request was sent so far
                                                    (int64): where a takeover continues from; TTL = the payload's
                                                    (REPLY_TTL at least)
bl:batch:{M}:<batch_id>                string       Batch while dispatched; TTL = latest deadline + grace
bl:inflight:{M}:<executor_id>          set          ids of that model's batches dispatched to the executor, not yet
                                                    answered
bl:seq:{M}:<sequence key>              hash         a sequence's state: steps (count), state (SequenceState), rid (the
                                                    request that saved it); the key has its tenant and id; TTL = its
                                                    idle timeout
bl:stats:{M}                           hash         Triton-style statistics counters
bl:load:{M}                            string       ModelLoad, the scheduler's view for admission; short TTL
bl:arrivals:{M}                        string       requests the gateways received for it, refused included (INCRBY)
bl:profile-units:{M}:<kind>            string       latency-profile samples (units, seconds) as float32 pairs
bl:work:{X}                            list         Batch messages waiting for that executor
bl:served:{X}                          set          the models (M) batches were ever sent to it for: where its in-flight
                                                    sets are
bl:reply:{G}                           list         Reply messages for that gateway's waiting clients
bl:notify:{s}:<model>:<version>        list         a wake-up token for the scheduler: arrivals in that queue (one at
                                                    most)
bl:reports:{s}                         list         ExecutionReport messages for the scheduler (capped; rows 0: batches
                                                    handed back)
bl:scheduler:{s}:<scheduler_id>:wake   list         a scheduler's own wake list (it interrupts its blocking wait with
                                                    it)
bl:leader:{s}                          string       id of the scheduler holding the lease; TTL = lease
bl:exec:{s}:<executor_id>              string       ExecutorInfo; TTL = heartbeat TTL (presence)
bl:executors:{s}                       set          executor ids ever seen (members pruned when stale)
bl:gateway:{s}:<gateway_id>            string       the gateway's address; TTL = heartbeat TTL
bl:demand:{s}                          string       MeshDemand: the executors the mesh wants (leader scheduler); TTL
bl:gateways:{s}                        sorted set   gateway ids scored by when their heartbeat expires (ms): how many
                                                    are live
bl:control:{s}:models                  hash         model name -> "load:<seq>" | "unload:<seq>": the latest repository
                                                    call
bl:control:{s}:seq                     string       the sequence number of the latest repository call (INCR)
bl:override:{o:<model>}               string       ModelOverride: a load call's config and files; TTL = CONTROL_TTL
bl:rate:{t:<tenant>}                   hash         a tenant's token bucket (max_rate): tokens, as of (ms); TTL = refill
                                                    time
bl:tokenizer:{k:<sha256>}              string       a model's tokenizer.json, for the gateways to tokenize its text
                                                    input
=====================================  ===========  ==================================================
"""
from __future__ import annotations

PREFIX = "bl:"

# A model version, (name, version): what every per-model key and map is keyed by.
ModelKey = tuple[str, str]

# The shared slot's tag.
SHARED = "{s}"

EXECUTORS = f"{PREFIX}executors:{SHARED}"
REPORTS = f"{PREFIX}reports:{SHARED}"
LEADER = f"{PREFIX}leader:{SHARED}"
GATEWAYS = f"{PREFIX}gateways:{SHARED}"
CONTROL = f"{PREFIX}control:{SHARED}:models"
CONTROL_SEQ = f"{PREFIX}control:{SHARED}:seq"
DEMAND = f"{PREFIX}demand:{SHARED}"

# Ordering within a queue: priority level first (1 is highest), then the
# earliest deadline. deadline_ms is ~1.8e12, so a 1e13 stride keeps both exact
# in a double (the score type) for hundreds of priority levels (MAX_PRIORITY_LEVELS).
_PRIORITY_STRIDE = 10**13
# The most priority levels a queue's score keeps apart.
MAX_PRIORITY_LEVELS = 900
# A request of a tenant over its weighted share queues this many levels below the level it asked
# for (gateway/fairness.py): below every level a client may ask for, since clients ask for 1 to
# CLIENT_PRIORITY_LEVELS (a model without priority_levels accepts them all). A batch whose head is
# that low may be capped (ModelLoad.over_share_rows) so that the tenants within their shares,
# queued above it, wait little for the executor it takes.
OVER_SHARE = MAX_PRIORITY_LEVELS // 2
CLIENT_PRIORITY_LEVELS = OVER_SHARE

# The longest latency budget a request can have (the gateway caps longer ones).
MAX_BUDGET_S = 24 * 3_600

# Expiries, in seconds unless the name says ms.
PAYLOAD_GRACE_MS = 5_000        # a payload outlives its deadline by this much
# An idle queue (no arrival refreshed it) disappears after this: longer than any budget, so that
# the entries of requests still waiting (say, for executors that are down) do not go with it.
QUEUE_TTL = MAX_BUDGET_S + 3_600
REPLY_TTL = 60                  # a gateway that died leaves its replies this long
GATEWAYS_TTL = 60               # the gateway set, once the last gateway is gone
# An executor's work list, served set and in-flight sets: they must outlive the longest batch
# (a budget), or recovery could not find a dead executor's batches to hand back.
WORK_TTL = MAX_BUDGET_S + 3_600
STATS_TTL = 7 * 24 * 3_600
REGISTRY_TTL = 24 * 3_600
LOAD_TTL_MS = 2_000             # admission ignores a load view older than this
PROFILE_TTL = 7 * 24 * 3_600
SCHEDULER_WAKE_TTL_MS = 10_000  # a scheduler's own wake list, should it die before reading it
REPORTS_CAP = 100_000
CONTROL_TTL = 30 * 24 * 3_600    # the repository calls are remembered this long after the last one
TOKENIZER_TTL = 7 * 24 * 3_600   # refreshed whenever an executor loads the model
ARRIVALS_TTL = 3_600             # an arrival count nobody added to for this long starts again from 0
DEMAND_TTL_MS = 10_000           # an autoscaler ignores the demand of a scheduler gone this long

# A model version being released still takes the batches of what was queued for it this long
# (and until its queue is empty or another executor serves it): longer than the gateways and
# the scheduler take to see it leave the registry (their registry_refresh_s, 0.5 s by default).
UNLOAD_GRACE_S = 2.0


def control_record(action: str, seq: int) -> str:
    return f"{action}:{seq}"


def override(name: str) -> str:
    """A load call's config and files: a tag of their own, as they may be large."""
    return f"{PREFIX}override:{{o:{name}}}"


def parse_control(record: bytes | str) -> tuple[str, int]:
    """(action, sequence number) of a bl:control:{s}:models value."""
    text = record.decode() if isinstance(record, bytes) else record
    action, _, seq = text.partition(":")
    return action, int(seq)



def model_tag(model: ModelKey) -> str:
    """The hash tag of a model version's keys: its queue, payloads, batches and in-flight sets
    share one slot, so that dispatch (queue -> batch) is one script."""
    return f"{{m:{model[0]}:{model[1]}}}"


def parse_model_tag(tag: bytes | str) -> ModelKey:
    """(model, version) of a model_tag (as bl:served:{X} holds them)."""
    text = tag.decode() if isinstance(tag, bytes) else tag
    name, _, version = text[3:-1].rpartition(":")
    return name, version


def scheduler_wake(scheduler_id: str) -> str:
    """A list only this scheduler waits on: it pushes to it to stop its own blocking wait early."""
    return f"{PREFIX}scheduler:{SHARED}:{scheduler_id}:wake"


def queue(model: ModelKey) -> str:
    return f"{PREFIX}q:{model_tag(model)}"


def notify(model: ModelKey) -> str:
    """Wake-up tokens for arrivals in one queue: one list per queue, so that the scheduler can
    leave alone those of a queue that waits for a busy executor (it wakes for that executor's
    report). In the shared slot, with the reports: the scheduler waits on all of them at once."""
    return f"{PREFIX}notify:{SHARED}:{model[0]}:{model[1]}"


def payload(model: ModelKey, request_id: str) -> str:
    return f"{PREFIX}req:{model_tag(model)}:{request_id}"


def generated(model: ModelKey, request_id: str) -> str:
    """The output token ids a generation request has been sent so far (int64, in order): where an
    executor that takes the request over after a failure continues from. In the payload's slot."""
    return f"{PREFIX}gen:{model_tag(model)}:{request_id}"


def batch(model: ModelKey, batch_id: str) -> str:
    return f"{PREFIX}batch:{model_tag(model)}:{batch_id}"


def inflight(model: ModelKey, executor_id: str) -> str:
    """The model's batches dispatched to `executor_id` and not yet answered: in the model's slot, so
    that dispatch and clean-up write them with the queue and the batch key."""
    return f"{PREFIX}inflight:{model_tag(model)}:{executor_id}"


def work(executor_id: str) -> str:
    return f"{PREFIX}work:{{x:{executor_id}}}"


def served(executor_id: str) -> str:
    """The models batches were sent to `executor_id` for (their model_tag): where recovery looks
    for its in-flight sets once its registration is gone."""
    return f"{PREFIX}served:{{x:{executor_id}}}"


def reply(gateway_id: str) -> str:
    return f"{PREFIX}reply:{{g:{gateway_id}}}"


def executor(executor_id: str) -> str:
    return f"{PREFIX}exec:{SHARED}:{executor_id}"


def gateway(gateway_id: str) -> str:
    return f"{PREFIX}gateway:{SHARED}:{gateway_id}"


def sequence(model: ModelKey, sequence_key: str) -> str:
    """A sequence's state (`sequence_key`: batchline.sequences.sequence_key, its tenant's and its id):
    in the model's slot, so that a batch's sequences are read and written in one command."""
    return f"{PREFIX}seq:{model_tag(model)}:{sequence_key}"


def stats(model: ModelKey) -> str:
    return f"{PREFIX}stats:{model_tag(model)}"


def arrivals(model: ModelKey) -> str:
    return f"{PREFIX}arrivals:{model_tag(model)}"


def load(model: ModelKey) -> str:
    return f"{PREFIX}load:{model_tag(model)}"


def tokenizer(sha256: str) -> str:
    return f"{PREFIX}tokenizer:{{k:{sha256}}}"


def rate(tenant: str) -> str:
    """A tenant's token bucket, shared by every gateway."""
    return f"{PREFIX}rate:{{t:{tenant}}}"


def profile(model: ModelKey, kind: str) -> str:
    # Samples are in units (rows × length); a name of its own keeps row-counted samples from being read as units.
    return f"{PREFIX}profile-units:{model_tag(model)}:{kind}"


def queue_score(priority: int, deadline_us: int) -> int:
    return priority * _PRIORITY_STRIDE + deadline_us // 1000


def priority_scores(priority: int) -> tuple[int, int]:
    """The lowest and highest score of a queue entry at `priority` (for ZCOUNT, ZRANGEBYSCORE)."""
    return priority * _PRIORITY_STRIDE, (priority + 1) * _PRIORITY_STRIDE - 1


def priority_of(score: float) -> int:
    """The priority level of a queue entry's score."""
    return int(score // _PRIORITY_STRIDE)


def payload_ttl_ms(deadline_us: int, now_us: int) -> int:
    return max(1, (deadline_us - now_us) // 1000) + PAYLOAD_GRACE_MS


# A model's statistics hash (stats()) counts, per batch size n, under these fields.
def batch_stat(rows: int, what: str) -> str:
    """The statistics field of `what` (count, compute_input_ns, ...) for batches of `rows`."""
    return f"batch:{rows}:{what}"


def batch_sizes(stats: dict[str, int]) -> list[int]:
    """The batch sizes a statistics hash has counters for, ascending."""
    return sorted({int(k.split(":")[1]) for k in stats if k.startswith("batch:")})
