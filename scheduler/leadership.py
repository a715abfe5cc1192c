"""The scheduling lease: only its holder dispatches, so a standby scheduler (or one started by
mistake) cannot double-dispatch. Held in Redis with a TTL and renewed a third of it apart, so
that a holder that stops is replaced within one TTL and a live one never lets it lapse."""
from __future__ import annotations

import time

from batchline.contract.scheduler_store import SchedulerStore

# Renewals per TTL: the lease survives two missed renewals (a slow step, a Redis hiccup).
RENEWALS_PER_TTL = 3


class Lease:
    def __init__(self, store: SchedulerStore, holder_id: str, ttl_s: float) -> None:
        self.holder_id = holder_id
        self.ttl_s = ttl_s
        self.held = False
        self.attempted_at = 0.0  # time.monotonic() of the last attempt to take or renew it
        self.store = store

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / RENEWALS_PER_TTL

    async def hold(self) -> bool:
        """Take or renew the lease when a renewal is due; True while this holder has it."""
        now = time.monotonic()
        if now - self.attempted_at < self.renew_every_s:
            return self.held
        self.held = await self.store.take_lease(self.holder_id, int(self.ttl_s * 1000))
        self.attempted_at = now
        return self.held

    async def release(self) -> None:
        """Give it up at once (a clean stop), so that a standby need not wait out the TTL."""
        if self.held:
            await self.store.release_lease(self.holder_id)
        self.held = False
