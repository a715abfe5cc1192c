"""Planning shared by the scheduler and the gateways: what a batch costs, how a queue is served.

One model of both, so that the gateways' admission control predicts what the
scheduler's plan will do (docs/design/scheduling.md).
"""
from batchline.planning.cost import BatchCost, Cost, FunctionCost
from batchline.planning.rule import BatchingRule
from batchline.planning.simulation import (
    DEADLINE_AWARE, FIFO, POLICIES, Formed, Pending, Played, SimulatedBatch, form_batch, play, units,
)
from batchline.planning.view import queue_tail, queue_tails, resume

__all__ = ["DEADLINE_AWARE", "FIFO", "POLICIES", "BatchCost", "BatchingRule", "Cost", "Formed", "FunctionCost",
           "Pending", "Played", "SimulatedBatch", "form_batch", "play", "queue_tail", "queue_tails", "resume", "units"]
