"""What wakes the scheduling loop, and what it leaves asleep.

A blocking pop (BLMPOP) wakes the loop when a gateway enqueues (a token on the
queue's notify list) or an executor reports (or its batches are handed back).
It leaves alone the tokens of queues that wait for a busy executor (blocked):
their requests wait for that executor's report or a timer, and arrivals
cannot change that, so each token read would be a wasted wake-up (at small
models' rates, about one per request); the next step drops them. Timers (a
batch's delay or deadline) are kept by the loop itself, because Redis honours
blocking timeouts only to its cron tick (100 ms by default).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from batchline import contract
from batchline.contract.scheduler_store import SchedulerStore
from batchline.redis_client import REDIS_ERRORS, WAIT_RETRY_S

log = logging.getLogger(__name__)

# Items one pop takes from a list at most.
DRAIN = 10_000
# How soon an arrival noticed during a step, after the step had read its queue, gets a look.
NOTICE_RECHECK_S = 0.002


class Wakeups:
    def __init__(self, store: SchedulerStore, scheduler_id: str, leads: Callable[[], bool]) -> None:
        self.store = store
        self.scheduler_id = scheduler_id
        self.leads = leads  # whether this scheduler holds the lease now
        self.event = asyncio.Event()
        self.key = contract.scheduler_wake(scheduler_id)  # its own list: a step interrupts the wait through it
        self.notify: dict[str, str] = {}  # each registered queue's notify list -> the queue
        self.blocked: set[str] = set()    # queues waiting for an executor, not for company
        self.listening: set[str] = set()  # the lists the wait under way listens to
        self.reports: list[bytes] = []    # execution reports popped, for the next step
        self._stepping = False            # a step is under way: its verdicts on `blocked` are not in yet
        self._arrived_during_step: set[str] = set()   # blocked queues whose arrivals were noticed during the step

    def wake(self) -> None:
        self.event.set()

    def after_outage(self) -> None:
        """Redis is back, or answers from a new primary: the reports and arrival notices written
        meanwhile may be lost, so no queue is known to wait for a busy executor; look at once."""
        self.blocked.clear()
        self.event.set()

    def take_reports(self) -> list[bytes]:
        reports, self.reports = self.reports, []
        return reports

    def keys(self) -> list[str]:
        """What the blocking wait listens to: a standby, only its own list (it leaves the shared ones
        to the leader); the leader, reports and the notify lists of the queues not blocked too."""
        if not self.leads():
            return [self.key]
        return [contract.REPORTS, *(n for n, q in self.notify.items() if q not in self.blocked), self.key]

    async def listen(self) -> None:
        """The blocking wait, for as long as the scheduler runs (its own task)."""
        pop = self.store.list_pop()
        while True:
            keys = self.keys()
            self.listening = set(keys)
            try:
                item = await pop(keys, DRAIN)
            except REDIS_ERRORS as exc:
                log.warning("waiting for events failed: %s", exc)
                await asyncio.sleep(WAIT_RETRY_S)
                continue
            except Exception:  # the wait must outlive what Redis answers
                log.exception("waiting for events failed")
                await asyncio.sleep(WAIT_RETRY_S)
                continue
            if item is not None:
                self._heard(item[0].decode(), item[1])

    def _heard(self, key: str, values: list[bytes]) -> None:
        if key == contract.REPORTS:
            self.reports.extend(values)
            self.event.set()
        elif key != self.key:
            queue = self.notify.get(key, key)
            if queue not in self.blocked:
                self.event.set()
            elif self._stepping:
                # Blocked since the wait began. A queue whose requests wait for a busy executor
                # needs no new look before that executor reports or its timer fires. But the step
                # under way may have read the queue before this arrival, woken by the report that
                # frees the executor: if it no longer counts the queue as waiting, look again.
                self._arrived_during_step.add(queue)

    async def relisten(self) -> None:
        """Interrupt the blocking wait when it should listen to a list it does not (a queue no
        longer blocked, a model registered, the lease taken), or to fewer shared lists (the
        lease lost). A wait that listens to more than it needs is left alone: it ends at the
        next report, and a token it reads for a blocked queue is ignored."""
        want = set(self.keys())
        if not want <= self.listening or (not self.leads() and want != self.listening):
            await self.store.wake(self.scheduler_id)

    def step_begins(self) -> None:
        self.event.clear()
        self._stepping = True

    def step_ended(self, wake_at: float | None) -> float | None:
        """When to look again (epoch s), given the step's own answer: soon, if an arrival was
        noticed during the step at a queue it then found no longer blocked."""
        self._stepping = False
        if self._arrived_during_step - self.blocked:
            # Looked at shortly, not at once: under load the next arrival's notice wakes the loop
            # sooner anyway, and a step per arrival would cost more than it saves.
            recheck = time.time() + NOTICE_RECHECK_S
            wake_at = recheck if wake_at is None else min(wake_at, recheck)
        self._arrived_during_step.clear()
        return wake_at
