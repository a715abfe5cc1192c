"""When each executor is free: from the batches this scheduler sent it and what it reported.

The scheduler keeps, per executor, the batches it dispatched and has not seen
answered (batch id -> planned start, predicted cost) and when the executor's
last reported run ended; from these it predicts when the executor can start
another batch (scheduler.policy.free_after), and an idle one's rank
(scheduler.policy.rank_free).
"""
from __future__ import annotations

from scheduler.policy import free_after, rank_free


class ExecutorTimeline:
    def __init__(self, default_execution_s: float, max_batches_per_executor: int) -> None:
        self.default_execution_s = default_execution_s
        self.max_batches = max_batches_per_executor
        self.sent: dict[str, dict[str, tuple[float, float]]] = {}  # executor -> batch id -> (start, cost)
        self.idle_at: dict[str, float] = {}    # when each executor is predicted to run out of work
        self.ran_until: dict[str, float] = {}  # when each executor's last reported run ended

    def free_at(self, executor_id: str, held: set[str], now: float) -> float:
        """When the executor is predicted able to start another batch (inf: it holds its maximum).
        `held`: the batch ids its in-flight set holds now (the ones it has not answered)."""
        sent = self.sent.setdefault(executor_id, {})
        for batch_id in list(sent):
            if batch_id not in held:
                del sent[batch_id]  # answered
        for batch_id in held - sent.keys():
            # Sent by an earlier leader: assume it just started.
            sent[batch_id] = (now, self.default_execution_s)
        ran_until = self.ran_until.get(executor_id, float("-inf"))
        t = free_after(now, sent.values(), ran_until)
        self.idle_at[executor_id] = t
        if len(held) >= self.max_batches:
            return float("inf")
        return rank_free(t, ran_until, busy=bool(sent))

    def dispatched(self, executor_id: str, batch_id: str, start: float, finish: float) -> None:
        self.sent.setdefault(executor_id, {})[batch_id] = (start, finish - start)

    def planned(self, executor_id: str, finish: float, now: float) -> None:
        """A batch planned for the executor keeps it busy until `finish` at least."""
        self.idle_at[executor_id] = max(self.idle_at.get(executor_id, now), finish)

    def reported(self, executor_id: str, ran_until_s: float) -> None:
        """The executor's run that ended at `ran_until_s` released the model."""
        if ran_until_s > self.ran_until.get(executor_id, 0.0):
            self.ran_until[executor_id] = ran_until_s

    def forget(self, executor_id: str | None = None) -> None:
        """Forget what was sent to one executor (it is gone), or to all (another scheduler led meanwhile)."""
        if executor_id is None:
            self.sent.clear()
        else:
            self.sent.pop(executor_id, None)
