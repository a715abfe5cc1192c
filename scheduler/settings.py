"""Scheduler settings (environment prefix BATCHLINE_SCHEDULER_)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from batchline.settings import CommonSettings
from scheduler.demand import TARGET_UTILISATION, DemandSettings


class SchedulerSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHLINE_SCHEDULER_")

    metrics_port: int = Field(
        8003, description="Port of the Prometheus endpoint (http://HOST:PORT/metrics); 0 = any free port, -1 = none."
    )
    port: int = Field(0, description="Port of the scheduler's control gRPC server (0 = any free port).")
    scheduler_id: str = Field("", description="Id of this scheduler (default: a random one per process).")
    policy: Literal["deadline", "fifo"] = Field(
        "deadline",
        description="deadline: earliest-deadline-first batching that dispatches by each batch's slack, sheds what "
        "cannot make its deadline and publishes the load view gateways use for admission control. fifo: "
        "Triton-style max-queue-delay batching in arrival order (the baseline; no admission control).",
    )
    length_aware_batching: bool = Field(
        True, description="deadline policy, models with [padding]: a batch takes requests of similar lengths from the "
        "next few batches' worth of the queue (the head always, a request that cannot wait always), rather than the "
        "head's prefix padded to its longest member."
    )
    even_lanes_batching: bool = Field(
        True, description="deadline policy, models of several lanes (instance_count, or executors): a batch takes "
        "no more of what is queued than its even share, the fewest rows that let the other lanes, each starting "
        "when it is free, run the rest and finish no later; rather than everything queued while it ran."
    )
    max_batches_per_executor: int = Field(
        2,
        description="Batches an executor may hold at once (one running, one fetched ahead). A batch is only sent "
        "when its executor is predicted free within dispatch_lead_ms; meanwhile requests queue and batch up.",
    )
    dispatch_lead_ms: float = Field(
        3.0,
        description="How long before an executor is predicted free its next batch is sent, so that fetching "
        "the batch overlaps the end of the previous run.",
    )
    lease_ttl_s: float = Field(
        3.0,
        description="Leader lease in Redis: only the holder dispatches; a standby scheduler takes over this long "
        "after the leader dies (at once when it stops cleanly).",
    )
    profile_save_s: float = Field(
        5.0, description="Seconds between saves of the latency profiles to Redis (a restarted scheduler loads them)."
    )
    registry_refresh_s: float = Field(0.5, description="Seconds between re-reads of the executor registry.")
    queue_scan_limit: int = Field(
        1024, description="Queued requests per model examined each step (the head of the queue in dispatch order)."
    )
    default_execution_ms: float = Field(
        5.0, description="Predicted execution time of a batch before any run of that model was measured "
        "(executors seed the profile with warm-up runs at load, so this rarely applies)."
    )
    margin_quantile: float = Field(
        0.99, gt=0, lt=1,
        description="Quantile of the latency profile's residuals (per batch size class) added to its predictions for "
                    "dispatch timing and the "
        "gateways' admission estimates (shedding, and refusing a request too slow even alone, go by the typical "
        "run): higher sends batches earlier and admits less, so fewer "
        "runs slowed by a busy host overrun their deadlines (0.9 let 5 to 23 in 100 admitted requests miss 200 ms "
        "budgets at 2x overload on a shared 2-core host; docs/design/scheduling.md).",
    )
    overhead_ms: float = Field(
        2.0, description="Time a batch spends outside what executors measure (the Redis hops between "
        "services), added to predictions."
    )
    forecast_step_s: float = Field(
        1.0, gt=0, description="Seconds between measurements of each model's arrival rate (requests the gateways "
        "received, refused included) and forecasts of it, for the autoscalers (docs/guides/scaling.md)."
    )
    forecast_horizon_s: float = Field(
        0.0, ge=0, description="How far ahead the arrival rate is forecast; 0 = the executors' measured "
        "start-to-serving time (10 s until one has reported it)."
    )
    target_utilisation: float = Field(
        TARGET_UTILISATION, gt=0, le=1, description="Share of one executor's capacity within a model's default "
        "budget that the forecast demand may fill: executors wanted = forecast / (capacity x this), never below "
        "what finishes the queue within one budget."
    )
    demand_period_s: float = Field(
        0.0, ge=0, description="A known period of the demand (e.g. 86400 for a daily cycle), which the forecast "
        "then learns a seasonal term for; 0 = none."
    )

    def demand(self) -> DemandSettings:
        return DemandSettings(self.forecast_step_s, self.forecast_horizon_s, self.target_utilisation,
                              self.demand_period_s)
