"""The batching rule's settings: one value that the scheduler plans by and the gateways admit by.

`form_batch` and `play` (batchline.planning.simulation) read a model's
settings from this value alone. The scheduler builds it from the model's
config (`of_model`) and publishes the part of it that varies by step in each
load view (`load_fields`); a gateway rebuilds the same value from the model's
config and that view (`of_load`), so both sides play the queue by one rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchline.protocol import internal_pb2 as pb


@dataclass(frozen=True, slots=True)
class BatchingRule:
    max_batch_size: int                        # rows per batch; 0: the model has no batch dim (one request a batch)
    preferred_batch_sizes: tuple[int, ...] = ()
    # The most rows of a batch headed by an over-share request (batchline.contract.OVER_SHARE; 0: no cap).
    over_share_rows: int = 0
    # Batch requests of similar lengths together (simulation._by_length); the deadline-aware policy only.
    length_aware: bool = False
    # False: the FIFO policy, whose batches no deadline cuts.
    deadline_aware: bool = True
    # A request still arriving (Pending.queued False) joins no batch that leaves less than this many
    # seconds after it arrives, unless it would be alone in it: it would not be queued in time.
    join_lead: float = 0.0
    # Spread what is queued over the model's lanes (simulation._even_share); the deadline-aware policy only.
    even_lanes: bool = False

    @classmethod
    def of_model(cls, info: pb.ModelInfo, *, deadline_aware: bool = True, length_aware: bool = False,
                 even_lanes: bool = False) -> BatchingRule:
        """The rule for a model of config `info`; `length_aware` asks for length-aware batching, which
        applies to a model with padded inputs under the deadline-aware policy, `even_lanes` for
        batches evened over the lanes, which applies under the deadline-aware policy."""
        return cls(info.max_batch_size, tuple(info.preferred_batch_sizes), 0,
                   length_aware and deadline_aware and bool(info.padded_inputs), deadline_aware,
                   even_lanes=even_lanes and deadline_aware)

    @classmethod
    def of_load(cls, info: pb.ModelInfo, load: pb.ModelLoad, join_lead: float = 0.0) -> BatchingRule:
        """The rule a scheduler played by in the load view `load` of a model of config `info`
        (load views are published under the deadline-aware policy only)."""
        return cls(info.max_batch_size, tuple(info.preferred_batch_sizes), load.over_share_rows, load.length_aware,
                   True, join_lead, load.even_lanes)

    def load_fields(self) -> dict[str, Any]:
        """The pb.ModelLoad fields that carry this rule to the gateways (`of_load` reads them back)."""
        return {"over_share_rows": self.over_share_rows, "length_aware": self.length_aware,
                "even_lanes": self.even_lanes}
