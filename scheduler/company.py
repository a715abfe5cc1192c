"""How much company a queued request can expect: pure, with time passed in.

Waiting for company (max_queue_delay) pays when others arrive meanwhile: a
batch of ten costs the mesh little more than a batch of one (a scheduler step,
an executor's fetch and reply, Redis calls). It is pure loss when nobody else
can come: a client that sends one request at a time sends its next only once
this one is answered, and four such clients send nothing more once four
requests wait. An arrival rate cannot tell these apart from a busy open
stream; the rate of arrivals *while a given number of requests wait* can. So
the scheduler measures, per queue and per number of requests left waiting
after a step, the arrivals until the next step and the time between, and the
batching policy waits only while that rate expects one more arrival before
the wait is up (scheduler.policy.plan's `company`).

Both counts fade (time constant `tau`), so a number of waiting requests that
stopped being seen, or stopped bringing company, is tried again after a while:
until `min_exposure_s` of waiting has been seen with that many queued, the
rate is unknown and the policy waits, as Triton does. Under load the counts
need no waiting to fill: requests queue behind a busy executor and arrivals
join them anyway.
"""
from __future__ import annotations

import math


class CompanyRate:
    """Arrivals per second seen while n requests waited in a queue, per n."""

    def __init__(self, tau: float = 1.0, min_exposure_s: float = 0.002):
        self.tau = tau
        self.min_exposure_s = min_exposure_s
        self._seen: dict[int, tuple[float, float, float]] = {}  # n -> (arrivals, seconds, as of)

    def _faded(self, n: int, now: float) -> tuple[float, float]:
        arrivals, seconds, at = self._seen.get(n, (0.0, 0.0, now))
        f = math.exp(-max(0.0, now - at) / self.tau)
        return arrivals * f, seconds * f

    def observe(self, waiting: int, arrivals: int, seconds: float, now: float) -> None:
        """`arrivals` came in the `seconds` up to `now` during which `waiting` requests were queued."""
        if waiting < 1 or seconds <= 0:
            return
        a, s = self._faded(waiting, now)
        self._seen[waiting] = (a + arrivals, s + seconds, now)

    def rate(self, waiting: int, now: float) -> float | None:
        """Arrivals per second to expect while `waiting` requests are queued (None: not known yet)."""
        a, s = self._faded(waiting, now)
        return a / s if s >= self.min_exposure_s else None
