"""Scheduler settings (environment prefix BATCHLINE_SCHEDULER_)."""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from batchline.settings import CommonSettings


class SchedulerSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHLINE_SCHEDULER_")

    port: int = Field(0, description="Port of the scheduler's control gRPC server (0 = any free port).")
    scheduler_id: str = Field("", description="Id of this scheduler (default: a random one per process).")
    max_batches_per_executor: int = Field(
        2,
        description="Batches an executor may hold at once (one running, one waiting). "
        "While every executor is full, requests keep queueing and form larger batches.",
    )
    registry_refresh_s: float = Field(0.5, description="Seconds between re-reads of the executor registry.")
    queue_scan_limit: int = Field(
        1024, description="Queued requests per model examined each step (the head of the queue in dispatch order)."
    )
    default_execution_ms: float = Field(
        5.0, description="Predicted execution time of a batch before any execution of that model was measured."
    )
    overhead_ms: float = Field(
        2.0, description="Time a batch spends outside the model (Redis, decode, encode), added to predictions."
    )
