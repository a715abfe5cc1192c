"""Executor settings (environment prefix BATCHLINE_EXECUTOR_)."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from batchline.settings import CommonSettings, ModelControlMode

DEFAULT_PROVIDERS = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


class ExecutorSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHLINE_EXECUTOR_")

    model_repository: str = Field(
        "model_repository",
        description="Model repository: <repo>/<model>/<version>/model.onnx plus <repo>/<model>/config.toml."
    )
    models: list[str] = Field(
        default_factory=list, description="Only load these models (default: every model in the repository)."
    )
    model_control_mode: ModelControlMode = Field(
        "none", description="none: serve what the repository holds at start (a model that fails to load stops the "
        "executor); poll: also re-scan it every repository_poll_s, loading new or changed versions and releasing "
        "removed ones; explicit: serve only the models named by load_model and by RepositoryModelLoad / "
        "RepositoryModelUnload calls to a gateway. In poll and explicit mode a model that fails to load is "
        "reported (RepositoryIndex) and the others serve."
    )
    repository_poll_s: float = Field(5.0, description="poll mode: seconds between scans of the repository.", gt=0)
    load_model: list[str] = Field(
        default_factory=list, description="explicit mode: models to load at start (repeat the flag, or list several), "
        "unless a RepositoryModelUnload since has unloaded them."
    )
    metrics_port: int = Field(
        8004, description="Port of the Prometheus endpoint (http://HOST:PORT/metrics); 0 = any free port, -1 = none."
    )
    port: int = Field(0, description="Port of the executor's control gRPC server (0 = any free port).")
    executor_id: str = Field(
        "", description="Stable id of this executor (default: a random one per process). A model with "
        "instance_count n runs on n lanes, registered as ID, ID#1, ... ID#n-1, so '#' is not allowed in it."
    )
    providers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PROVIDERS),
        description="ONNX Runtime execution providers in order of preference; those the host lacks are skipped.",
    )
    trt_engine_cache_dir: str = Field(
        "", description="TensorRT engine cache directory, a folder per model and version in it (default: "
        "<repo>/<model>/<version>/trt_cache)."
    )
    intra_op_threads: int = Field(
        0, description="ONNX Runtime intra-op threads of every run (0 = cpu_cores / the model's instance_count, or "
        "ONNX Runtime's default when neither is set)."
    )
    cpu_cores: int = Field(
        0, description="Cores the model runs share (0 = the cores this process may run on): a model with "
        "instance_count N runs each batch on cpu_cores / N intra-op threads. Set it to a container's CPU limit, "
        "which neither ONNX Runtime nor the affinity mask sees."
    )
    allow_spinning: bool = Field(
        False,
        description="Let ONNX Runtime's worker threads busy-wait for work between runs (its own default). Off here: "
        "spinning takes cores from the gateway and scheduler on a shared host; "
        "turn it on for a dedicated executor host.",
    )
    concurrent_batches: int = Field(
        2, description="Batches in progress at once on each lane (a model instance): one computes while the next "
        "is fetched and the last is answered."
    )
    nice: int = Field(
        0,
        description="Raise this process's nice value by this much at start. On a host shared with the gateway "
        "(batchline up sets 5), model runs then yield the CPU to request ingress and admission control.",
    )
    generation_cache_mb: float = Field(
        64.0, description="Key/value cache of each generative model (config.toml [generation]) on this executor, in "
        "MiB: it holds as many sequences at once as it has room for at the model's max_context (the scheduler "
        "places no more on it).", gt=0,
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Seconds between registrations in Redis.")
    heartbeat_ttl_s: float = Field(
        3.0, gt=0, description="Seconds without a heartbeat after which the executor is considered dead; more "
        "than heartbeat_interval_s (else a live executor looks dead between beats and its batches run again "
        "elsewhere)."
    )
    drain_timeout_s: float = Field(
        30.0,
        description="On SIGTERM: seconds to finish the batches already sent to this executor before handing the "
        "rest back to their queues.",
    )
    warmup: bool = Field(True, description="Run each model at load (once, then timed at batch sizes 1, 2, 4, ... "
        "up to its maximum) so the first request does not pay for it and the scheduler's latency profile starts "
        "from measurements.")

    @model_validator(mode="after")
    def _beats_within_their_ttl(self) -> "ExecutorSettings":
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s ({self.heartbeat_ttl_s:g}) must be more than heartbeat_interval_s "
                             f"({self.heartbeat_interval_s:g}): between two beats the executor would look dead, and "
                             "its batches would be handed back and run again")
        return self

    @field_validator("executor_id")
    @classmethod
    def _no_lane_separator(cls, value: str) -> str:
        # Executor "a" with two lanes registers "a" and "a#1": an executor named "a#1" would share its work list.
        if "#" in value:
            raise ValueError(f"executor_id {value!r} contains '#', which separates an executor's id "
                             "from its lane number")
        return value
