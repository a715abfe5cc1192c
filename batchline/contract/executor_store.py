"""The executor role's store: its registration and heartbeat, its work list, a batch's payloads
and its answers, what it publishes for the others (warm-up reports, tokenizers), and the reads
that say whether it may release a model version. Recovery of its own batches is inherited."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import redis.exceptions

from batchline.contract import calls, scripts
from batchline.contract import keys as k
from batchline.contract.calls import FinishedBatch
from batchline.contract.keys import ModelKey
from batchline.contract.recovery import RecoveryStore
from batchline.contract.slots import Rounds, get_many
from batchline.contract.waits import as_outage


class ExecutorStore(RecoveryStore):
    def __init__(self, client: Any, blocking: Any = None) -> None:
        super().__init__(client, blocking)
        self._work_link = self.wait_link()  # take_work's own connection, where one can be had

    async def register(self, executor_id: str, info: bytes, ttl_ms: int) -> None:
        """Write the registration (ExecutorInfo) with its heartbeat TTL."""
        # MULTI/EXEC: a connection lost part-way must not leave the set written without its expiry.
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(k.executor(executor_id), info, px=ttl_ms)
            pipe.sadd(k.EXECUTORS, executor_id)
            pipe.expire(k.EXECUTORS, k.REGISTRY_TTL)
            await pipe.execute()

    async def deregister(self, executor_id: str) -> None:
        """Drop the registration, leaving the id in the executor set: a batch the scheduler sent
        after the last hand-back is recovered like a dead executor's, at once."""
        await self.client.delete(k.executor(executor_id))

    async def publish_tokenizers(self, tokenizers: Mapping[str, bytes]) -> None:
        """tokenizer.json blobs by their SHA-256, where the gateways read them."""
        if tokenizers:
            async with self.client.pipeline(transaction=False) as pipe:
                for sha, blob in tokenizers.items():
                    pipe.set(k.tokenizer(sha), blob, ex=k.TOKENIZER_TTL)
                await pipe.execute()

    async def publish_reports(self, reports: Sequence[bytes]) -> None:
        """ExecutionReports (warm-up runs) for the scheduler's latency profiles."""
        if reports:
            async with self.client.pipeline(transaction=True) as pipe:  # (never without its expiry)
                pipe.rpush(k.REPORTS, *reports)
                pipe.ltrim(k.REPORTS, -k.REPORTS_CAP, -1)
                pipe.expire(k.REPORTS, k.QUEUE_TTL)
                await pipe.execute()

    async def waiting_work(self, executor_id: str) -> int:
        """How many batches wait in the executor's work list."""
        return int(await self.client.llen(k.work(executor_id)))

    async def take_work(self, executor_id: str, timeout_s: int) -> bytes | None:
        """The next Batch sent to the executor, waiting up to `timeout_s` (on the blocking client)."""
        try:
            if self._work_link is not None:
                item = await self._work_link.wait(timeout_s + self._work_link.timeout, "BLPOP", k.work(executor_id),
                                                  timeout_s)
            else:
                item = await self.blocking.blpop([k.work(executor_id)], timeout=timeout_s)
        except redis.exceptions.ResponseError as exc:
            raise as_outage(exc) from exc
        return None if item is None else item[1]

    async def fetch(self, model: ModelKey, request_ids: Sequence[str],
                    gateway_ids: Sequence[str]) -> tuple[list[bytes | None], list[bytes | None]]:
        """A batch's payloads (None: answered or abandoned) and its gateways' heartbeats (None:
        gone), in one read."""
        names = [k.payload(model, r) for r in request_ids] + [k.gateway(g) for g in gateway_ids]
        found = await get_many(self.hot, names)
        return found[: len(request_ids)], found[len(request_ids):]

    async def batch_done(self, done: FinishedBatch) -> None:
        """A finished batch's answers, report and statistics, in one write (contract.batch_done)."""
        await calls.batch_done(self.hot, done)

    async def send_replies(self, replies: Mapping[str, Sequence[bytes]]) -> None:
        """Push Replies to their gateways (per gateway id) ahead of the batch's own write: a
        decoupled model's responses, forwarded to the client as they arrive."""
        async with self.client.pipeline(transaction=False) as pipe:
            for gateway_id, blobs in replies.items():
                calls.push_with_ttl(pipe, k.reply(gateway_id), k.REPLY_TTL, blobs)
            await pipe.execute()

    async def generated_tokens(self, model: ModelKey, request_ids: Sequence[str]) -> list[bytes | None]:
        """Each generation request's output token ids sent so far (int64 bytes; None: none yet)."""
        return await get_many(self.client, [k.generated(model, r) for r in request_ids])

    async def stream_tokens(self, model: ModelKey, replies: Mapping[str, Sequence[bytes]],
                            sent: Mapping[str, bytes], gateways: Mapping[str, str] | None = None,
                            record_ttl_s: Mapping[str, int] | None = None) -> dict[str, bool]:
        """Push generation responses to their gateways (per gateway id), then record each request's
        tokens sent so far (`sent`, per request id); whether each request is still awaited (its
        payload is there: not answered, abandoned or cancelled; and, for a request given in
        `gateways`, request id -> gateway id, that gateway's heartbeat too). The record follows the
        push, so it never holds a token its client was not sent; it lives `record_ttl_s` (per request
        id; REPLY_TTL where none is given)."""
        ids = list(sent)
        watched = [r for r in ids if gateways and r in gateways]
        # In rounds: on a cluster a pipeline's shards run at once, and a record landed without its
        # push would have a takeover skip tokens the client never got.
        rounds = Rounds(self.client)
        pipe = rounds.next()
        for gateway_id, blobs in replies.items():
            calls.push_with_ttl(pipe, k.reply(gateway_id), k.REPLY_TTL, blobs)
        pipe = rounds.next()
        for request_id in ids:
            pipe.set(k.generated(model, request_id), sent[request_id],
                     ex=(record_ttl_s or {}).get(request_id, k.REPLY_TTL))
        for request_id in ids:
            pipe.exists(k.payload(model, request_id))
        for request_id in watched:
            pipe.exists(k.gateway(gateways[request_id]))  # type: ignore[index]
        found = await rounds.execute()
        alive = dict(zip(watched, found[len(found) - len(watched):]))
        payloads = found[len(found) - len(watched) - len(ids):len(found) - len(watched)]
        return {r: bool(n) and bool(alive.get(r, 1)) for r, n in zip(ids, payloads)}

    async def sequence_states(self, model: ModelKey, sequence_keys: Sequence[str],
                              idle_ms: int = 0) -> list[bytes | None]:
        """Each sequence's saved state (a SequenceState; None: none, or it expired); with `idle_ms`,
        its expiry pushed that far off, so that it does not expire while this step runs."""
        async with self.client.pipeline(transaction=False) as pipe:
            for key in sequence_keys:
                pipe.hget(k.sequence(model, key), "state")
                if idle_ms:
                    pipe.pexpire(k.sequence(model, key), idle_ms)
            found = await pipe.execute()
        return list(found[::2] if idle_ms else found)

    async def save_sequence_states(self, model: ModelKey, writes: Sequence[tuple[str, str, int, int, bytes]],
                                   ttl_ms: int) -> list[int]:
        """Save (sequence key, request id, steps read, steps after, SequenceState) each, unless
        another run moved its step count on meanwhile or the request is over (answered by another
        run, or given up); per write 1 when saved, 2 when another run of that request saved it,
        0 when not saved otherwise (scripts.SAVE_SEQUENCES_LUA)."""
        if not writes:
            return []
        args: list = [ttl_ms]
        for _, request_id, expected, after, blob in writes:
            args += (expected, after, blob, request_id)
        names = [k.sequence(model, key) for key, _, _, _, _ in writes]
        names += [k.payload(model, request_id) for _, request_id, _, _, _ in writes]
        saved = await self.client.eval(scripts.SAVE_SEQUENCES_LUA, len(names), *names, *args)
        return [int(n) for n in saved]

    async def still_dispatched(self, batches: Sequence[FinishedBatch]) -> list[bool]:
        """Whether Redis still holds each batch's key (its answers never reached this primary)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for done in batches:
                pipe.exists(k.batch(done.model, done.batch.batch_id))
            return [bool(n) for n in await pipe.execute()]

    async def control_calls(self) -> dict[str, tuple[str, int]]:
        """The latest repository call per model name: (action, sequence number)."""
        raw = await self.client.hgetall(k.CONTROL)
        return {name.decode(): k.parse_control(v) for name, v in raw.items()}

    async def control_override(self, name: str) -> bytes | None:
        """The ModelOverride of the latest load call of `name`, if it had one."""
        return await self.client.get(k.override(name))

    async def queued_for(self, model: ModelKey, executor_ids: Sequence[str]) -> tuple[int, list[list[bytes]]]:
        """The model's queue depth and each executor's work list (Batch blobs), read in the order a
        request moves (queue, then work list)."""
        rounds = Rounds(self.client, atomic=True)  # (keys of several slots: atomic on one Redis only)
        pipe = rounds.next()
        pipe.zcard(k.queue(model))
        for eid in executor_ids:
            pipe.lrange(k.work(eid), 0, -1)
        depth, *works = await rounds.execute()
        return int(depth), works
