"""The scheduler's load views, as the gateway reads them for admission control (one MGET per read).

They are read when a request finds them older than LOAD_AGE_SHARE of its budget, at most every
load_refresh_s and at least every IDLE_REFRESH_S: with 200 ms budgets that is every 20 ms as long
as requests arrive; with budgets of seconds, or none arriving, every 0.5 s (reading at 50 Hz
regardless cost the gateway a third of its CPU when serving minilm at 128 tokens).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from batchline.contract.gateway_store import GatewayStore

from batchline.contract.keys import ModelKey
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS

log = logging.getLogger(__name__)

# A request wants the views no older than this share of its budget: the error a stale view
# brings to admission is its age, which only matters relative to the budget.
LOAD_AGE_SHARE = 0.1
# The views are read at least this often, even when no request asks.
IDLE_REFRESH_S = 0.5

class LoadViews:
    def __init__(self, store: GatewayStore, models: Callable[[], list[ModelKey]], refresh_s: float) -> None:
        self.store = store
        self.models = models        # the models to read views of (the registry's, now)
        self.refresh_s = refresh_s  # the shortest time between two reads
        self.loads: dict[ModelKey, pb.ModelLoad] = {}
        self._read_at = 0.0         # time.monotonic() of the last read
        self._stale = asyncio.Event()  # a request wants fresher views than these

    def get(self, key: ModelKey, budget_s: float) -> pb.ModelLoad | None:
        """The view of a model for a request with `budget_s`; one too old for it asks for a new
        read (this request goes by the view as it is, those behind it get a fresher one)."""
        if time.monotonic() - self._read_at > budget_s * LOAD_AGE_SHARE:
            self._stale.set()
        return self.loads.get(key)

    async def keep_fresh(self) -> None:
        """Read the views whenever they are asked for or due, for as long as the gateway runs."""
        while True:
            try:
                await asyncio.wait_for(self._stale.wait(), IDLE_REFRESH_S)
            except asyncio.TimeoutError:
                pass
            self._stale.clear()
            keys = self.models()
            if keys:
                try:
                    blobs = await self.store.loads(keys)
                    self.loads = {k: pb.ModelLoad.FromString(b) for k, b in zip(keys, blobs) if b}
                except REDIS_ERRORS:
                    self.loads = {}
                except Exception:  # admit without views rather than on stale ones forever
                    log.exception("reading the load views failed")
                    self.loads = {}
                self._read_at = time.monotonic()
            await asyncio.sleep(self.refresh_s)
