"""What every role's store shares: the clients it holds, and the reads every role makes of the
server itself (is it up, which process is it) and of the registry (who serves what).

A role's store (gateway_store, scheduler_store, executor_store, recovery, admin_store) owns every
Redis command that role issues; the services hold a store, never a client.
"""
from __future__ import annotations

from typing import Any, Sequence

from batchline.contract import keys as k
from batchline.contract.keys import ModelKey
from batchline.contract import slots
from batchline.contract.link import Link, hot
from batchline.contract.waits import ListPop


class Store:
    """`client` for commands that answer at once; `blocking`, where the role waits (a blocking pop
    holds its connection), a client of its own. `hot`: what the calls on every request's path go
    through (batchline.contract.link), the same Redis as `client`."""

    def __init__(self, client: Any, blocking: Any = None) -> None:
        self.client = client
        self.blocking = blocking
        self.hot = hot(client)
        self._links: list[Link] = [self.hot] if isinstance(self.hot, Link) else []

    async def aclose(self) -> None:
        for link in self._links:
            await link.aclose()
        await self.client.aclose()
        if self.blocking is not None:
            await self.blocking.aclose()

    def wait_link(self) -> Link | None:
        """A Link of its own for one blocking wait, if the blocking client's Redis is one plain Redis."""
        link = Link.of(self.blocking)
        if link is not None:
            self._links.append(link)
        return link

    async def ping(self) -> None:
        await self.client.ping()

    async def run_id(self) -> str | None:
        """The serving Redis's run id; on a cluster every primary's, joined: it changes when a shard's
        primary is replaced (its replica promoted) as when a lone Redis restarts."""
        if slots.on_cluster(self.client):
            infos = await self.client.info("server", target_nodes=self.client.PRIMARIES)
            return ",".join(sorted(str(info.get("run_id")) for info in infos.values()))
        return (await self.client.info("server")).get("run_id")

    async def payloads_held(self, requests: Sequence[tuple[str, ModelKey]]) -> list[bool]:
        """Whether Redis holds each (request id, model)'s payload: the request is still awaited (not
        answered, nor given up)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for request_id, model in requests:
                pipe.exists(k.payload(model, request_id))
            return [bool(n) for n in await pipe.execute()]

    def list_pop(self) -> ListPop:
        """A blocking pop over this store's blocking client."""
        return ListPop(self.blocking, self.wait_link())

    async def registrations(self) -> list[tuple[str, bytes | None]]:
        """Every executor id ever seen, sorted, with its ExecutorInfo (None: its heartbeat lapsed)."""
        ids = sorted(m.decode() for m in await self.client.smembers(k.EXECUTORS))
        if not ids:
            return []
        return list(zip(ids, await self.client.mget([k.executor(i) for i in ids])))
