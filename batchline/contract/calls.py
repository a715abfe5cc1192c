"""The Redis contract's calls: each script and multi-key write, from typed arguments.

Every function takes a Redis client or a pipeline (sync or asyncio: they
return what its `eval` returns, to await with an asyncio client) and builds the
keys and the script's arguments in the order the script reads them, so that
no caller packs them by position.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from batchline.contract import keys as k
from batchline.contract import scripts, slots
from batchline.contract.keys import ModelKey
from batchline.protocol import internal_pb2 as pb

log = logging.getLogger(__name__)


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


def enqueue(client: Any, gateway_id: str, address: str, heartbeat_ttl_ms: int,
            writes: Sequence[QueueWrite], abandoned: Sequence[Abandoned] = ()) -> Any:
    """A gateway's group commit (scripts.ENQUEUE_LUA): its result holds, per write, 1 when queued
    and 0 when its queue was full. One command on one Redis; on a cluster, one per model, then
    the announcement (an asyncio client's), and in the place of each write a shard refused, its
    error."""
    if slots.on_cluster(client):
        return _enqueue_by_model(client, gateway_id, address, heartbeat_ttl_ms, writes, abandoned)
    return client.eval(scripts.ENQUEUE_LUA,
                       *enqueue_on_one_redis(gateway_id, address, heartbeat_ttl_ms, writes, abandoned))


def enqueue_on_one_redis(gateway_id: str, address: str, heartbeat_ttl_ms: int, writes: Sequence[QueueWrite],
                         abandoned: Sequence[Abandoned] = ()) -> list:
    """The group commit's script arguments on one Redis: the number of keys, the keys, the arguments."""
    keys, args = _enqueue_keys_args(writes, abandoned, announce=True)
    keys.append(k.gateway(gateway_id))
    keys += (k.notify(m) for m in dict.fromkeys(w.model for w in writes))
    args[3:5] = (address, heartbeat_ttl_ms)
    return [len(keys), *keys, *args]


def _enqueue_keys_args(writes: Sequence[QueueWrite], abandoned: Sequence[Abandoned],
                       announce: bool) -> tuple[list, list]:
    keys: list = []
    args: list = [len(writes), len(abandoned), int(announce), "", 0, k.QUEUE_TTL]
    for w in writes:
        keys += (k.payload(w.model, w.request_id), k.queue(w.model))
        args += (w.payload, w.payload_ttl_ms, w.score, w.member, w.max_queue_size)
    for a in abandoned:
        keys += (k.queue(a.model), k.payload(a.model, a.request_id))
        args.append(a.member)
    return keys, args


async def _enqueue_by_model(client: Any, gateway_id: str, address: str, heartbeat_ttl_ms: int,
                            writes: Sequence[QueueWrite], abandoned: Sequence[Abandoned]) -> list[int | Exception]:
    """The group commit on a cluster: each model's writes in its slot, then, once they have landed,
    the announcement in the shared slot (a token before its entry would wake the scheduler too
    early, and the entry would then wait for a timer).

    A shard that refuses (out of its own memory, a key of another type) or cannot be reached fails
    the writes in its slots alone: their places hold its error. The models' scripts go in one
    pipeline; those it could not deliver (a shard that went away: the pipeline then fails whole)
    go again each on its own, with the client's retries. An announcement that fails leaves the
    writes queued: the scheduler's tick finds them."""
    groups: dict[ModelKey, tuple[list[int], list[QueueWrite], list[Abandoned]]] = {}
    for i, w in enumerate(writes):
        indexes, ws, _ = groups.setdefault(w.model, ([], [], []))
        indexes.append(i)
        ws.append(w)
    for a in abandoned:
        groups.setdefault(a.model, ([], [], []))[2].append(a)
    scripts_of = [_enqueue_keys_args(ws, gone, announce=False) for _, ws, gone in groups.values()]
    pipe = client.pipeline(transaction=False)
    for keys, args in scripts_of:
        pipe.eval(scripts.ENQUEUE_LUA, len(keys), *keys, *args)
    try:
        results: list[Any] = await pipe.execute(raise_on_error=False)
    except slots.RETRYABLE as exc:
        results = [exc] * len(scripts_of)
    again = [i for i, r in enumerate(results) if isinstance(r, slots.RETRYABLE)]
    if again:
        retried = await asyncio.gather(*(client.eval(scripts.ENQUEUE_LUA, len(scripts_of[i][0]), *scripts_of[i][0],
                                                     *scripts_of[i][1]) for i in again), return_exceptions=True)
        for i, r in zip(again, retried):
            results[i] = r
    queued: list[int | Exception] = [0] * len(writes)
    landed = []
    for model, (indexes, _, gone), flags in zip(groups, groups.values(), results):
        if isinstance(flags, BaseException):
            if not isinstance(flags, Exception):
                raise flags  # cancelled
            if not indexes:
                log.warning("removing %d abandoned requests of %s:%s failed (their keys expire): %s",
                            len(gone), *model, flags)
            for i in indexes:
                queued[i] = flags
            continue
        if indexes:
            landed.append(model)
        for i, flag in zip(indexes, flags):
            queued[i] = flag
    if landed:
        notify = [k.notify(m) for m in landed]
        try:
            await client.eval(scripts.ANNOUNCE_LUA, 1 + len(notify), k.gateway(gateway_id), *notify,
                              address, heartbeat_ttl_ms, k.QUEUE_TTL)
        except Exception as exc:  # noqa: BLE001 - the writes landed: they are served without it
            log.warning("the group commit's announcement failed, its requests wait for the scheduler's tick: %s",
                        exc)
    return queued


def dispatch(client: Any, batch: pb.Batch, members: Sequence[bytes], batch_ttl_ms: int,
             blob: bytes | None = None) -> Any:
    """Move `members` from their queue into `batch`, for its executor (scripts.DISPATCH_LUA): its
    result is how many were still queued (0: nothing was dispatched). On a cluster, two commands
    (the model's half, then the executor's, scripts.HAND_OVER_LUA): the first one's result is the
    dispatch's. `blob`: the Batch as stored and handed over (its encoding, when not given), whose
    members may be in it only."""
    model = (batch.model_name, batch.model_version)
    blob = blob if blob is not None else batch.SerializeToString()
    keys = [k.queue(model), k.batch(model, batch.batch_id), k.inflight(model, batch.executor_id)]
    args = [batch.batch_id, batch_ttl_ms, k.WORK_TTL, blob, k.model_tag(model), *members]
    hand_over = [k.work(batch.executor_id), k.served(batch.executor_id)]
    if slots.on_cluster(client):
        result = client.eval(scripts.DISPATCH_LUA, len(keys), *keys, *args)
        client.eval(scripts.HAND_OVER_LUA, 2, *hand_over, blob, k.WORK_TTL, k.model_tag(model))
        return result
    return client.eval(scripts.DISPATCH_LUA, len(keys) + 2, *keys, *hand_over, *args)


def push_with_ttl(client: Any, key: str, ttl_s: int, values: Sequence[bytes]) -> Any:
    """Append `values` to the list `key` and set its expiry in one command."""
    return client.eval(scripts.PUSH_WITH_TTL_LUA, 1, key, ttl_s, *values)


def count(client: Any, model: ModelKey, field: str, increment: int) -> Any:
    """Add to one of a model's statistics counters and set the hash's expiry in one command."""
    return client.eval(scripts.COUNT_WITH_TTL_LUA, 1, k.stats(model), k.STATS_TTL, field, increment)


def incr_with_ttl(client: Any, key: str, increment: int, ttl_s: int) -> Any:
    """Add to a counter and set its expiry in one command."""
    return client.eval(scripts.INCR_WITH_TTL_LUA, 1, key, ttl_s, increment)


def withdraw(client: Any, model: ModelKey, request_id: str, member: bytes) -> Any:
    """Take a request out of its queue, and its payload with it, only if it was still queued
    (scripts.WITHDRAW_LUA): its result is 1 when it was."""
    return client.eval(scripts.WITHDRAW_LUA, 2, k.queue(model), k.payload(model, request_id), member)


def next_call(client: Any) -> Any:
    """The next repository call's sequence number (scripts.NEXT_CALL_LUA)."""
    return client.eval(scripts.NEXT_CALL_LUA, 1, k.CONTROL_SEQ, k.CONTROL_TTL)


def record_call(client: Any, name: str, action: str, seq: int) -> Any:
    """Record repository call `seq` of model `name`, unless a later one is there (scripts.RECORD_CALL_LUA)."""
    return client.eval(scripts.RECORD_CALL_LUA, 2, k.CONTROL, k.CONTROL_SEQ, name, k.control_record(action, seq),
                       seq, k.CONTROL_TTL)


def report(client: Any, blob: bytes) -> Any:
    """Append an execution report for the scheduler (scripts.REPORT_LUA)."""
    return client.eval(scripts.REPORT_LUA, 1, k.REPORTS, blob, k.REPORTS_CAP, k.QUEUE_TTL)


def shed(client: Any, model: ModelKey, members: Sequence[bytes], request_ids: Sequence[str],
         replies: Mapping[str, Sequence[pb.Reply]]) -> None:
    """Queue on a pipeline the removal of requests the scheduler sheds, their answers (`replies`
    per gateway id) and the model's failure count, for only those still queued (one dispatched
    meanwhile keeps its payload, and its run answers it). On one Redis one script
    (scripts.SHED_LUA), whose result is how many it shed; on a cluster the model's part
    (scripts.SHED_QUEUED_LUA), whose result says which, and `shed_answers` the answers to send."""
    if not slots.on_cluster(client):
        where = {r.request_id: (gateway_id, r) for gateway_id, answers in replies.items() for r in answers}
        lists = {g: i for i, g in enumerate(replies, 1)}  # each gateway's reply list, by its place in KEYS
        keys = [k.queue(model), k.stats(model), *(k.payload(model, r) for r in request_ids),
                *(k.reply(g) for g in lists)]
        args: list = [len(members), len(lists), k.REPLY_TTL, k.STATS_TTL]
        for member, request_id in zip(members, request_ids):
            gateway_id, reply = where[request_id]
            args += (member, lists[gateway_id], reply.SerializeToString())
        client.eval(scripts.SHED_LUA, len(keys), *keys, *args)
        return
    keys = [k.queue(model), k.stats(model), *(k.payload(model, r) for r in request_ids)]
    client.eval(scripts.SHED_QUEUED_LUA, len(keys), *keys, k.STATS_TTL, *members)


def shed_answers(result: Sequence[int], request_ids: Sequence[str],
                 replies: Mapping[str, Sequence[pb.Reply]]) -> dict[str, list[bytes]]:
    """On a cluster, the answers to send after SHED_QUEUED_LUA's `result` (the places of the
    members it shed, in `request_ids`' order), per gateway id."""
    taken = {request_ids[int(i) - 1] for i in result}
    out = {g: [r.SerializeToString() for r in answers if r.request_id in taken] for g, answers in replies.items()}
    return {g: answers for g, answers in out.items() if answers}


@dataclass(slots=True)
class FinishedBatch:
    """An executor's whole write for a finished batch (batch_done's arguments)."""
    batch: pb.Batch
    report: pb.ExecutionReport
    replies: Mapping[str, Sequence[bytes]]  # the Reply messages, per gateway id
    stats: Sequence[str | int]              # statistics counters: field, increment pairs
    last_inference_ms: int                  # 0 when nothing in it succeeded
    generated: bool = False                 # a generation batch: its members' records of tokens sent go too

    @property
    def model(self) -> ModelKey:
        return self.batch.model_name, self.batch.model_version

    @property
    def reply_bytes(self) -> int:
        return sum(len(r) for items in self.replies.values() for r in items)


def batch_done(client: Any, done: FinishedBatch) -> Any:
    """An executor's whole write for a finished batch (scripts.BATCH_DONE_LUA). One command on one
    Redis; on a cluster, the replies, then the rest (an asyncio client's)."""
    batch, replies, stats, model = done.batch, done.replies, done.stats, done.model
    # Deleted with the batch: its payloads, and a generation batch's records of the tokens sent
    # (k.generated, in the payloads' slot), which only a takeover of an unfinished batch reads.
    gone = [k.payload(model, m.request_id) for m in batch.members]
    if done.generated:
        gone += [k.generated(model, m.request_id) for m in batch.members]
    keys = [k.inflight(model, done.report.executor_id), k.stats(model), k.batch(model, batch.batch_id), *gone]
    args: list = [0, len(gone), batch.batch_id, "", k.REPORTS_CAP,
                  k.QUEUE_TTL, k.REPLY_TTL, k.STATS_TTL, done.last_inference_ms]
    if slots.on_cluster(client):
        return _batch_done_in_rounds(client, keys, [*args, *stats], done.report.SerializeToString(), replies)
    keys += [k.REPORTS, *(k.reply(g) for g in replies)]
    args[0], args[3] = len(replies), done.report.SerializeToString()
    for items in replies.values():
        args += (len(items), *items)
    args += stats
    return client.eval(scripts.BATCH_DONE_LUA, len(keys), *keys, *args)


async def _batch_done_in_rounds(client: Any, keys: list, args: list, blob: bytes,
                                replies: Mapping[str, Sequence[bytes]]) -> int:
    """batch_done on a cluster: the replies (each gateway's slot) land before the payloads go, so
    that a crash in between re-runs the batch rather than lose its answers; the report after the
    batch is off the executor's in-flight set, so that the scheduler it wakes sees the executor free."""
    rounds = slots.Rounds(client)
    if replies:
        pipe = rounds.next()
        for gateway_id, items in replies.items():
            push_with_ttl(pipe, k.reply(gateway_id), k.REPLY_TTL, items)
    pipe = rounds.next()
    pipe.eval(scripts.BATCH_DONE_LUA, len(keys), *keys, *args)
    report(rounds.next(), blob)
    await rounds.execute()
    return 1


def take_lease(client: Any, holder_id: str, ttl_ms: int) -> Any:
    """Take the scheduling lease, or renew it if `holder_id` holds it: its result is 1 when held."""
    return client.eval(scripts.LEASE_LUA, 1, k.LEADER, holder_id, ttl_ms)


def release_lease(client: Any, holder_id: str) -> Any:
    """Give the lease up, if `holder_id` holds it."""
    return client.eval(scripts.RELEASE_LUA, 1, k.LEADER, holder_id)


def take_token(client: Any, tenant: str, rate_per_s: float, burst: float) -> Any:
    """Take one request's token from the tenant's bucket (scripts.TAKE_TOKEN_LUA): its result is
    [1, 0] when taken, else [0, milliseconds until a token is there]."""
    return client.eval(scripts.TAKE_TOKEN_LUA, 1, k.rate(tenant), rate_per_s, burst)


def hand_back(client: Any, executor_id: str, batch: pb.Batch) -> Any:
    """Requeue a dispatched batch's live members, if this call is the one that takes the batch off
    the executor's in-flight set (scripts.HAND_BACK_LUA): its result is how many went back, -1
    when another party had handed it back or it was answered."""
    model = (batch.model_name, batch.model_version)
    keys = [k.inflight(model, executor_id), k.batch(model, batch.batch_id), k.queue(model)]
    keys += (k.payload(model, e.request_id) for e in batch.members)
    args: list = [batch.batch_id, k.QUEUE_TTL]
    for e in batch.members:
        args += (k.queue_score(e.priority, e.deadline_us), e.SerializeToString())
    return client.eval(scripts.HAND_BACK_LUA, len(keys), *keys, *args)
