"""The gateway's count of the requests it received, per model: what the scheduler's demand
forecast reads (scheduler/demand.py). Every valid request counts, those admission refuses and
those a full queue turns away included: they are demand the mesh did not serve. A tenant over
its max_rate is not counted: more executors would not serve it.

Counted in memory and added to Redis every FLUSH_S in one pipeline, so that counting costs a
request nothing and Redis one round trip per gateway per FLUSH_S at most.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter

from batchline.contract.gateway_store import GatewayStore
from batchline.contract.keys import ModelKey
from batchline.redis_client import REDIS_ERRORS

log = logging.getLogger(__name__)

# A quarter of the forecaster's one-second step: each step sees every gateway's counts of it, within
# a quarter of a second.
FLUSH_S = 0.25


class Arrivals:
    def __init__(self, store: GatewayStore) -> None:
        self.store = store
        self.pending: Counter[ModelKey] = Counter()

    def count(self, key: ModelKey) -> None:
        self.pending[key] += 1

    async def flush(self) -> None:
        if not self.pending:
            return
        counts, self.pending = dict(self.pending), Counter()
        try:
            await self.store.add_arrivals(counts)
        except REDIS_ERRORS as exc:
            self.pending.update(counts)  # counted at the next flush, late rather than never
            log.debug("arrival counts not written: %s", exc)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()
