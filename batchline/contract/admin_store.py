"""The operator's store, over a synchronous client: what `batchline status` shows and what
`batchline up` waits for (a gateway's heartbeat, the executors registered)."""
from __future__ import annotations

from typing import Any

from batchline.contract import keys as k
from batchline.contract.keys import ModelKey


class AdminStore:
    def __init__(self, client: Any) -> None:
        self.client = client

    def close(self) -> None:
        self.client.close()

    def ping(self) -> None:
        self.client.ping()

    def leader(self) -> str | None:
        """The scheduler holding the lease, if any."""
        held = self.client.get(k.LEADER)
        return held.decode() if held else None

    def executor_ids(self) -> list[str]:
        """Every executor id ever seen (its registration may have lapsed), sorted."""
        return sorted(e.decode() for e in self.client.smembers(k.EXECUTORS))

    def registration(self, executor_id: str) -> bytes | None:
        """The executor's ExecutorInfo; None when its heartbeat lapsed."""
        return self.client.get(k.executor(executor_id))

    def live_executors(self) -> list[str]:
        """The executors whose heartbeat is live."""
        return [e for e in self.executor_ids() if self.client.exists(k.executor(e))]

    def gateways(self) -> list[tuple[str, float]]:
        """(gateway id, when its heartbeat expires, epoch ms) of every gateway in the live set."""
        return [(gid.decode(), expires) for gid, expires in self.client.zrange(k.GATEWAYS, 0, -1, withscores=True)]

    def gateway_address(self, gateway_id: str) -> str | None:
        """The address the gateway's heartbeat gives; None when it has none."""
        address = self.client.get(k.gateway(gateway_id))
        return address.decode() if address is not None else None

    def demand(self) -> bytes | None:
        """The MeshDemand the leader scheduler published last; None when none is live."""
        return self.client.get(k.DEMAND)

    def queued_models(self) -> set[ModelKey]:
        """The models whose queues hold requests, served or not (Redis drops an empty sorted set).
        A cluster client scans every primary."""
        every = k.queue(("*", "*"))
        prefix = every.removesuffix(k.model_tag(("*", "*")))
        return {k.parse_model_tag(key.decode()[len(prefix):]) for key in self.client.scan_iter(match=every, count=1000)}

    def depths(self, model: ModelKey) -> tuple[int, dict[int, int]]:
        """The model's queue depth, and how many wait at each priority level in use."""
        key = k.queue(model)
        depth = self.client.zcard(key)
        by_level: dict[int, int] = {}
        if depth:
            # The levels in use lie between the first entry's and the last's (the queue is priority-major).
            first, last = (self.client.zrange(key, i, i, withscores=True) for i in (0, -1))
            if first and last:  # else it emptied since the ZCARD
                levels = range(k.priority_of(first[0][1]), k.priority_of(last[0][1]) + 1)
                with self.client.pipeline(transaction=False) as pipe:
                    for level in levels:
                        pipe.zcount(key, *k.priority_scores(level))
                    by_level = {level: n for level, n in zip(levels, pipe.execute()) if n}
        return int(depth), by_level
