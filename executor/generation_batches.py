"""A batch of a generative model on an executor: its requests join the engine's running batch, and
the batch's write follows when the last of them has ended.

The scheduler sends a generative model's requests one a batch (its ModelInfo has no batch
dimension), and the executor runs each batch as a task of its own beside its workers, so that
a request joins the engine at its next step whatever else runs. Until the batch's write the
batch is in the executor's in-flight set, so that when the executor dies the scheduler's
recovery hands it to another one, which continues each request from the tokens already sent.
A request whose gateway's heartbeat is gone is not started, and one that is running ends at its
next write once it is (nobody waits for its tokens; batchline/heartbeats.py says when that reading
is sound).
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from batchline.clock import now_us
from batchline.contract.executor_store import ExecutorStore
from batchline.errors import Internal, status_value
from batchline.heartbeats import HeartbeatTrust
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS
from executor import outcome
from executor.awaited import awaited
from executor.generation_requests import serve
from executor.generation_serving import GenerationModel
from executor.outcome import Timing
from executor.running import Member


async def run_batch(store: ExecutorStore, executor_id: str, batch: pb.Batch, model: GenerationModel,
                    written: outcome.Written, heartbeats: HeartbeatTrust | None = None) -> None:
    """Serve the batch's requests and write it. The caller counts it in `model` (begin/end) from
    when it takes it, so that a version released meanwhile waits for it."""
    heartbeats = heartbeats or HeartbeatTrust()
    start_us, t0 = now_us(), time.perf_counter_ns()
    key = (batch.model_name, batch.model_version)
    ids = [m.request_id for m in batch.members]
    gateways = sorted({m.gateway_id for m in batch.members})
    payloads, beats = await store.fetch(key, ids, gateways)
    sent = await store.generated_tokens(key, ids)
    fetched_ns = time.perf_counter_ns()
    entries = list(batch.members)
    live = [(entries[i], payloads[i], sent[i]) for i in awaited(batch, entries, payloads, gateways, beats, heartbeats)]
    results = await asyncio.gather(*(serve(store, model, entry, blob, made, heartbeats)
                                     for entry, blob, made in live), return_exceptions=True)
    ran_ns = time.perf_counter_ns()
    members: list[Member] = []
    replies: dict[str, list[bytes]] = defaultdict(list)
    for (entry, _, _), reply in zip(live, results):
        if isinstance(reply, REDIS_ERRORS):
            raise reply  # nothing can be written now: the batch is left to recovery, which hands it back
        if isinstance(reply, BaseException):
            error = Internal(f"generation failed on executor {executor_id}: {reply}")
            reply = pb.Reply(request_id=entry.request_id, code=status_value(error), message=str(error))
        if reply is None:
            continue
        member = Member(entry)
        if reply.code:
            member.error = Internal(reply.message)
        else:
            member.outputs = {}
        members.append(member)
        replies[entry.gateway_id].append(reply.SerializeToString())
    timing = Timing(start_us, fetched_ns - t0, ran_ns - fetched_ns, time.perf_counter_ns() - ran_ns)
    await outcome.write(store, executor_id, batch, model, members, replies, timing, written,  # type: ignore[arg-type]
                        generated=True)
