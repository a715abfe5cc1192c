"""How long the gateway's group commit waits for more requests to join it.

Each commit is one Redis call, and its CPU (redis-py's and the socket's, on
both ends) is the same for one request as for ten. Under load, a commit that
waits a moment for the requests arriving right behind it carries several, and
the queue then grows in clumps, which also wakes the scheduler less often and
gives it larger batches (docs/design/scheduling.md). A request
arriving alone must not wait, so the commit waits only while requests arrive
at least one per window (the recent gaps between them decide) and enough are
in flight in this gateway that it is busy, like PostgreSQL's commit_delay with
commit_siblings: with a few in flight, a wait would add to every request's
latency and save CPU nobody is short of.
"""
from __future__ import annotations


class Linger:
    """The wait before a group commit, from the gaps between recent arrivals (times passed in)."""

    # The weight of the newest gap: about the last 4–8 arrivals count.
    _ALPHA = 0.25

    def __init__(self, max_s: float, min_in_flight: int = 8):
        self.max_s = max_s
        self.min_in_flight = min_in_flight
        self._last: float | None = None
        self._gap: float | None = None  # moving average of the gaps

    def arrived(self, t: float) -> None:
        if self._last is not None:
            # A long idle spell counts as a few windows, not as minutes: the first requests
            # of a burst are soon close enough to wait for each other again.
            gap = min(max(0.0, t - self._last), 4 * self.max_s)
            self._gap = gap if self._gap is None else self._gap + self._ALPHA * (gap - self._gap)
        self._last = t

    def wait_s(self, in_flight: int) -> float:
        """How long to wait now, with `in_flight` requests in the gateway: the whole window while
        another request is expected within it and at least min_in_flight are in flight, else
        nothing. (The gateway waits at most a tenth of the tightest budget.)"""
        if self.max_s <= 0 or in_flight < self.min_in_flight or self._gap is None or self._gap > self.max_s:
            return 0.0
        return self.max_s
