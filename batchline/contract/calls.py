"""The Redis contract's calls: each script and multi-key write, from typed arguments.

Every function takes a Redis client or a pipeline (sync or asyncio: they
return what its `eval` returns, to await with an asyncio client) and builds the
keys and the script's arguments in the order the script reads them, so that
no caller packs them by position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from batchline.contract import keys as k
from batchline.contract import scripts
from batchline.protocol import internal_pb2 as pb

ModelKey = tuple[str, str]


@dataclass(slots=True)
class QueueWrite:
    """One request's share of a gateway's group commit."""
    request_id: str
    model: ModelKey
    payload: bytes        # the ModelInferRequest
    payload_ttl_ms: int
    member: bytes         # its QueueEntry
    score: int            # keys.queue_score
    max_queue_size: int   # 0: unbounded


@dataclass(slots=True)
class Abandoned:
    """A request its gateway gave up on: its queue entry and payload go."""
    request_id: str
    model: ModelKey
    member: bytes


def enqueue(client, gateway_id: str, address: str, heartbeat_ttl_ms: int,
            writes: Sequence[QueueWrite], abandoned: Sequence[Abandoned] = ()) -> Any:
    """A gateway's group commit in one command (scripts.ENQUEUE_LUA): its result holds, per write,
    1 when queued and 0 when its queue was full."""
    keys: list = [k.gateway(gateway_id)]
    args: list = [len(writes), len(abandoned), address, heartbeat_ttl_ms, k.QUEUE_TTL]
    for w in writes:
        keys += (k.payload(w.request_id), k.queue(*w.model), k.notify(*w.model))
        args += (w.payload, w.payload_ttl_ms, w.score, w.member, w.max_queue_size)
    for a in abandoned:
        keys += (k.queue(*a.model), k.payload(a.request_id))
        args.append(a.member)
    return client.eval(scripts.ENQUEUE_LUA, len(keys), *keys, *args)


def dispatch(client, batch: pb.Batch, members: Sequence[bytes], batch_ttl_ms: int) -> Any:
    """Move `members` from their queue into `batch`, for its executor (scripts.DISPATCH_LUA): its
    result is how many were still queued (0: nothing was dispatched)."""
    model = (batch.model_name, batch.model_version)
    keys = [k.queue(*model), k.batch(batch.batch_id), k.work(batch.executor_id), k.inflight(batch.executor_id)]
    args = [batch.batch_id, batch_ttl_ms, k.WORK_TTL, batch.SerializeToString(), *members]
    return client.eval(scripts.DISPATCH_LUA, len(keys), *keys, *args)


def push_with_ttl(client, key: str, ttl_s: int, values: Sequence[bytes]) -> Any:
    """Append `values` to the list `key` and set its expiry in one command."""
    return client.eval(scripts.PUSH_WITH_TTL_LUA, 1, key, ttl_s, *values)


def count(client, model: ModelKey, field: str, increment: int) -> Any:
    """Add to one of a model's statistics counters and set the hash's expiry in one command."""
    return client.eval(scripts.COUNT_WITH_TTL_LUA, 1, k.stats(*model), k.STATS_TTL, field, increment)


def shed(client, model: ModelKey, members: Sequence[bytes], request_ids: Sequence[str],
         replies: Mapping[str, Sequence[pb.Reply]]) -> None:
    """Queue on a pipeline the removal of requests the scheduler sheds, their answers (`replies`
    per gateway id) and the model's failure count."""
    client.zrem(k.queue(*model), *members)
    client.delete(*(k.payload(r) for r in request_ids))
    for gateway_id, answers in replies.items():
        push_with_ttl(client, k.reply(gateway_id), k.REPLY_TTL, [a.SerializeToString() for a in answers])
    count(client, model, "fail_count", len(members))


def batch_done(client, batch: pb.Batch, report: pb.ExecutionReport, replies: Mapping[str, Sequence[bytes]],
               stats: Sequence[str | int], last_inference_ms: int) -> Any:
    """An executor's whole write for a finished batch in one command (scripts.BATCH_DONE_LUA):
    `replies` per gateway id, `stats` as field, increment pairs, `last_inference_ms` 0 when
    nothing in it succeeded."""
    model = (batch.model_name, batch.model_version)
    keys = [k.REPORTS, k.inflight(report.executor_id), k.stats(*model), k.batch(batch.batch_id),
            *(k.reply(g) for g in replies), *(k.payload(m.request_id) for m in batch.members)]
    args: list = [len(replies), len(batch.members), batch.batch_id, report.SerializeToString(), k.REPORTS_CAP,
                  k.QUEUE_TTL, k.REPLY_TTL, k.STATS_TTL, last_inference_ms]
    for items in replies.values():
        args += (len(items), *items)
    args += stats
    return client.eval(scripts.BATCH_DONE_LUA, len(keys), *keys, *args)


def take_lease(client, holder_id: str, ttl_ms: int) -> Any:
    """Take the scheduling lease, or renew it if `holder_id` holds it: its result is 1 when held."""
    return client.eval(scripts.LEASE_LUA, 1, k.LEADER, holder_id, ttl_ms)


def release_lease(client, holder_id: str) -> Any:
    """Give the lease up, if `holder_id` holds it."""
    return client.eval(scripts.RELEASE_LUA, 1, k.LEADER, holder_id)


def take_token(client, tenant: str, rate_per_s: float, burst: float) -> Any:
    """Take one request's token from the tenant's bucket (scripts.TAKE_TOKEN_LUA): its result is
    [1, 0] when taken, else [0, milliseconds until a token is there]."""
    return client.eval(scripts.TAKE_TOKEN_LUA, 1, k.rate(tenant), rate_per_s, burst)
