"""A gateway's heartbeat: its address under its id while it lives (executors skip the requests of
a gateway without one), and its entry in the set of live gateways, from which each gateway learns
how many share the refusals it spaces (gateway/admission.py: retry_spacing_s)."""
from __future__ import annotations

import time

from redis.asyncio import Redis

from batchline import contract

# Heartbeat TTL, in heartbeat intervals: a gateway is gone after missing this many beats.
TTL_BEATS = 3


def heartbeat_ttl_ms(interval_s: float) -> int:
    return int(interval_s * 1000 * TTL_BEATS)


async def beat(redis: Redis, gateway_id: str, address: str, ttl_ms: int) -> int:
    """Renew the heartbeat; how many gateways are live, this one included.

    Each gateway scores itself in the set by when its heartbeat expires, so that gateways
    with different heartbeat intervals prune only those that are really gone.
    """
    now_ms = int(time.time() * 1000)
    async with redis.pipeline(transaction=True) as pipe:  # (never seen without its TTL)
        pipe.set(contract.gateway(gateway_id), address, px=ttl_ms)
        pipe.zadd(contract.GATEWAYS, {gateway_id: now_ms + ttl_ms})
        pipe.zremrangebyscore(contract.GATEWAYS, "-inf", now_ms)
        pipe.zcard(contract.GATEWAYS)
        pipe.expire(contract.GATEWAYS, contract.GATEWAYS_TTL)
        results = await pipe.execute()
    return max(1, int(results[3]))


async def leave(redis: Redis, gateway_id: str) -> None:
    """Remove the heartbeat at a clean stop: the other gateways count one fewer at once."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.delete(contract.gateway(gateway_id))
        pipe.zrem(contract.GATEWAYS, gateway_id)
        await pipe.execute()


async def serves(redis: Redis, address: str) -> bool:
    """Whether a live gateway of this mesh (this Redis) serves `address`."""
    ids = await redis.zrangebyscore(contract.GATEWAYS, int(time.time() * 1000), "+inf")
    async with redis.pipeline(transaction=False) as pipe:  # each heartbeat in its own slot on a cluster
        for gateway_id in ids:
            pipe.get(contract.gateway(gateway_id.decode()))
        addresses = await pipe.execute() if ids else []
    return any(a is not None and a.decode() == address for a in addresses)
