"""What differs on a Redis Cluster, as mechanism: telling one apart, reads of many slots, and
writes that must land in order.

One Redis runs each of the contract's writes as one script. A Redis Cluster runs a script only
when every key it names hashes to one slot, and runs a pipeline's commands for different shards
at the same time, in no set order. So there batchline.contract.calls splits each write into one
script per slot, in `Rounds` where order matters (what makes a request recoverable lands before
what announces it). The key layout that makes the slots is in batchline.contract.keys.
"""
from __future__ import annotations

from typing import Any, Sequence

import redis.asyncio.cluster as aiocluster
import redis.cluster

# What a cluster client retries itself (a node gone, the cluster down a moment), sent again.
RETRYABLE = aiocluster.RedisCluster.ERRORS_ALLOW_RETRY

_CLUSTER_TYPES = (redis.cluster.RedisCluster, redis.cluster.ClusterPipeline,
                  aiocluster.RedisCluster, aiocluster.ClusterPipeline)


_BY_TYPE: dict[type, bool] = {}


def on_cluster(client: Any) -> bool:
    """Whether `client` (a client or a pipeline) talks to a Redis Cluster."""
    # By type, remembered: isinstance against redis-py's classes takes microseconds, and this is
    # asked for every write.
    kind = type(client)
    found = _BY_TYPE.get(kind)
    if found is None:
        found = _BY_TYPE[kind] = issubclass(kind, _CLUSTER_TYPES)
    return found


def get_many(client: Any, names: Sequence[str]) -> Any:
    """MGET of keys of any slots: one command on one Redis, one per slot on a cluster."""
    return client.mget_nonatomic(names) if on_cluster(client) else client.mget(names)


class Rounds:
    """Commands that must land in the order of their rounds, in as few round trips as the server
    allows: on one Redis a single pipeline (MULTI/EXEC when `atomic`), whose commands run in
    order; on a cluster a pipeline per round, each run once the one before has answered.
    `next()` is the pipeline for the next round's commands."""

    def __init__(self, client: Any, atomic: bool = False) -> None:
        self.client = client
        self.atomic = atomic and not on_cluster(client)
        self._pipes: list = []

    def next(self) -> Any:
        if not self._pipes or on_cluster(self.client):
            self._pipes.append(self.client.pipeline(transaction=self.atomic))
        return self._pipes[-1]

    async def execute(self) -> list:
        results: list = []
        for pipe in self._pipes:
            results += await pipe.execute() if len(pipe) else []
        return results
