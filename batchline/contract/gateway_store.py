"""The gateway role's store: its heartbeat and the live gateways, the group commit, a tenant's
token bucket, reading its replies, the scheduler's load views, the tokenizers, the statistics of
the models served and the model repository's calls."""
from __future__ import annotations

import time
from typing import Awaitable, Callable, Sequence

from batchline.contract import calls
from batchline.contract import keys as k
from batchline.contract import scripts
from batchline.contract.calls import Abandoned, QueueWrite
from batchline.contract.keys import ModelKey
from batchline.contract.link import Link
from batchline.contract.slots import get_many
from batchline.contract.store import Store


class GatewayStore(Store):
    async def beat(self, gateway_id: str, address: str, ttl_ms: int) -> int:
        """Renew the heartbeat; how many gateways are live, this one included.

        Each gateway scores itself in the set by when its heartbeat expires, so that gateways
        with different heartbeat intervals prune only those that are really gone.
        """
        now_ms = int(time.time() * 1000)
        async with self.client.pipeline(transaction=True) as pipe:  # (never seen without its TTL)
            pipe.set(k.gateway(gateway_id), address, px=ttl_ms)
            pipe.zadd(k.GATEWAYS, {gateway_id: now_ms + ttl_ms})
            pipe.zremrangebyscore(k.GATEWAYS, "-inf", now_ms)
            pipe.zcard(k.GATEWAYS)
            pipe.expire(k.GATEWAYS, k.GATEWAYS_TTL)
            results = await pipe.execute()
        return max(1, int(results[3]))

    async def leave(self, gateway_id: str) -> None:
        """Remove the heartbeat at a clean stop: the other gateways count one fewer at once."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(k.gateway(gateway_id))
            pipe.zrem(k.GATEWAYS, gateway_id)
            await pipe.execute()

    async def serves(self, address: str) -> bool:
        """Whether a live gateway of this mesh (this Redis) serves `address`."""
        ids = await self.client.zrangebyscore(k.GATEWAYS, int(time.time() * 1000), "+inf")
        async with self.client.pipeline(transaction=False) as pipe:  # each heartbeat in its own slot on a cluster
            for gateway_id in ids:
                pipe.get(k.gateway(gateway_id.decode()))
            addresses = await pipe.execute() if ids else []
        return any(a is not None and a.decode() == address for a in addresses)

    async def withdraw(self, model: ModelKey, request_id: str, member: bytes) -> bool:
        """Take a request out of its queue and drop its payload, if it was still queued; whether it
        was (else it was dispatched: its payload stays, and its executor answers it)."""
        return bool(await calls.withdraw(self.hot, model, request_id, member))

    async def enqueue(self, gateway_id: str, address: str, heartbeat_ttl_ms: int, writes: Sequence[QueueWrite],
                      abandoned: Sequence[Abandoned] = ()) -> list[int | Exception]:
        """The group commit (contract.enqueue): per write, 1 when queued, 0 when its queue was full,
        or (on a cluster) the error of the shard that refused it."""
        return list(await calls.enqueue(self.hot, gateway_id, address, heartbeat_ttl_ms, writes, abandoned))

    def enqueue_now(self, gateway_id: str, address: str, heartbeat_ttl_ms: int,
                    writes: Sequence[QueueWrite]) -> Awaitable[list[int]] | None:
        """`enqueue`, sent to Redis before this returns, on a connection to one plain Redis that is
        open already (the Link's); None, with nothing sent, elsewhere: then `enqueue`."""
        if not isinstance(self.hot, Link) or not self.hot.is_open():
            return None  # (checked before the arguments are built: a growing outbox waits for a reconnect)
        return self.hot.eval_now(scripts.ENQUEUE_LUA, *calls.enqueue_on_one_redis(gateway_id, address,
                                                                                 heartbeat_ttl_ms, writes))

    async def add_arrivals(self, counts: dict[ModelKey, int]) -> None:
        """Add to each model's count of requests received (the scheduler's demand forecast reads them)."""
        # Each count and its expiry in one command (calls.count_with_ttl's script): a gateway killed
        # between the two must not leave a count that never expires.
        async with self.client.pipeline(transaction=False) as pipe:
            for model, n in counts.items():
                calls.incr_with_ttl(pipe, k.arrivals(model), n, k.ARRIVALS_TTL)
            await pipe.execute()

    async def take_token(self, tenant: str, rate_per_s: float, burst: float) -> tuple[bool, int]:
        """(taken, milliseconds until a token is there) from the tenant's bucket."""
        taken, wait_ms = await calls.take_token(self.hot, tenant, rate_per_s, burst)
        return bool(taken), int(wait_ms)

    async def pop_replies(self, gateway_id: str, count: int) -> list[bytes]:
        """Up to `count` replies waiting in the gateway's list, without waiting."""
        return list(await self.hot.lpop(k.reply(gateway_id), count) or [])

    async def loads(self, models: Sequence[ModelKey]) -> list[bytes | None]:
        """The scheduler's load view (ModelLoad) of each model; None where it has none."""
        return list(await get_many(self.client, [k.load(m) for m in models]))

    async def tokenizer(self, sha256: str) -> bytes | None:
        return await self.client.get(k.tokenizer(sha256))

    async def statistics(self, models: Sequence[ModelKey]) -> list[dict[str, int]]:
        """Each model's statistics counters."""
        async with self.client.pipeline(transaction=False) as pipe:
            for m in models:
                pipe.hgetall(k.stats(m))
            raw = await pipe.execute()
        return [{name.decode(): int(v) for name, v in h.items()} for h in raw]

    async def control_call(self, name: str, action: str, override: Callable[[int], bytes] | None = None) -> int:
        """Record a repository call (load or unload `name`) for the executors; its sequence number.

        `override` makes a load's ModelOverride for its sequence number; written before the call,
        so that an executor that sees the call finds it. Any other call drops the model's override.
        """
        seq = int(await calls.next_call(self.client))
        if override is not None:
            await self.client.set(k.override(name), override(seq), ex=k.CONTROL_TTL)
        else:
            await self.client.delete(k.override(name))
        await calls.record_call(self.client, name, action, seq)
        return seq
