"""Gateway settings (environment prefix BATCHLINE_GATEWAY_)."""
from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from batchline.auth import AuthFileError, load
from batchline.settings import CommonSettings, ModelControlMode
from batchline.tls import TlsConfigError, TlsFiles


class GatewaySettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHLINE_GATEWAY_")

    metrics_port: int = Field(
        8002, description="Port of the Prometheus endpoint (http://HOST:PORT/metrics); 0 = any free port, -1 = none."
    )
    port: int = Field(8001, description="Port of the KServe v2 gRPC endpoint (8001 is where Triton clients look; "
                                        "0 = any free port).")
    http_port: int = Field(
        8000, description="Port of the KServe v2 HTTP/REST endpoint, with Triton's binary tensor data extension "
        "(8000 is where Triton's HTTP clients look; 0 = any free port, -1 = none). It shares the gRPC port's "
        "admission, tokens (auth_file) and TLS files.")
    http_max_connections: int = Field(
        0, ge=0, description="REST connections served at once: a request on a connection past them is answered "
        "503 with a retry hint, and that connection closed, so that open connections cannot take the file "
        "descriptors the gRPC port and Redis need. 0 = half the process's open-file limit (RLIMIT_NOFILE).")
    share_port: bool = Field(
        False, description="Let the other gateways of this mesh (the same Redis) serve the same ports (gRPC and "
        "REST), the kernel spreading connections over them (SO_REUSEPORT; `batchline up --gateways N` sets it). "
        "A port already served by anything else fails the start, with or without it.")
    gateway_id: str = Field("", description="Id of this gateway, the address of its reply list (default: "
                                            "a random one per process).")
    max_message_bytes: int = Field(
        64 * 1024 * 1024,
        description="Largest gRPC message accepted or sent; a larger request is refused with RESOURCE_EXHAUSTED "
        "(on the REST port: a larger body, 400).",
    )
    model_control_mode: ModelControlMode = Field(
        "none",
        description="The executors' model control mode. explicit: RepositoryModelLoad and RepositoryModelUnload "
        "are served (an admin's token, when auth_file is set); otherwise they are refused UNAVAILABLE, as Triton does. "
        "RepositoryIndex is served in every mode."
    )
    load_files_max_bytes: int = Field(
        32 * 1024 * 1024,
        description="Most bytes of RepositoryModelLoad's `config` and `file:` parameters together, which reach the "
        "executors through Redis; a larger load is refused with RESOURCE_EXHAUSTED.",
    )
    registry_refresh_s: float = Field(0.5,
                                      description="Seconds between re-reads of the executor registry (served models).")
    heartbeat_interval_s: float = Field(1.0, description="Seconds between registrations of this gateway in Redis.")
    admission_control: bool = Field(
        True,
        description="Refuse at once (RESOURCE_EXHAUSTED, or DEADLINE_EXCEEDED when the budget is below the model's "
        "run time) a request predicted to finish after its budget; needs the scheduler's deadline policy.",
    )
    admission_target: float = Field(
        0.0,
        description="Share of admitted requests admission control aims to answer within their budget. Each "
        "gateway moves, per model, the headroom (starting from admission_headroom) after each answer to a request "
        "it admitted: up a little when it came in time, down more when it did not, so that it settles where this "
        "share comes in time (e.g. 0.99). 0 (the default) = a fixed admission_headroom.",
    )
    admission_headroom: float = Field(
        0.85,
        description="Admit a request when its predicted finish is within this fraction of its budget: where "
        "the learned headroom starts (admission_target), or always when admission_target is 0. The rest is room "
        "for prediction error beyond the profile's margin (the scheduler's margin_quantile) "
        "(docs/design/scheduling.md); 1 admits whatever the plan says can make it.",
    )
    load_refresh_s: float = Field(
        0.02,
        description="Shortest time between reads of the scheduler's per-model load views. A request that finds them "
        "older than a tenth of its budget asks for a read; otherwise they are read every 0.5 s.",
    )
    answer_margin_ms: float = Field(
        10.0,
        description="Time kept back from each request's budget for the answer's way back to the client: the "
        "scheduler and admission control plan to finish this much before the deadline (at most half the budget).",
    )
    commit_linger_ms: float = Field(
        2.0,
        description="Longest wait of a group commit (the one Redis call that queues the requests received "
        "meanwhile) for more requests to join it. It waits only while requests arrive at least one per this "
        "window (on average over the last few) and at least 8 are in flight in this gateway, and at most a "
        "tenth of the tightest waiting budget; under load, fewer and larger commits cost less CPU per request. "
        "0 = never wait.",
    )
    commit_max_group: int = Field(
        16, ge=0,
        description="Most requests in one group commit on one plain Redis. Requests read in one turn of the "
        "event loop (a burst, or the callers of an answered batch sending again at once) go to Redis in groups "
        "of this many as they are read, so the scheduler and the executors start on the first group while the "
        "gateway reads the rest. 0 = no cap: a burst goes whole, once all of it is read. Behind Sentinel, on a "
        "cluster and over TLS, groups are not capped.",
    )
    drain_timeout_s: float = Field(
        30.0, description="On SIGTERM: seconds to wait for admitted requests to be answered before stopping."
    )
    shared_memory_by_reference: bool = Field(
        True,
        description="Hand a request's shared-memory regions by reference to the executors that share this "
        "gateway's /dev/shm: they read its inputs and write its outputs themselves, and the tensors do not cross "
        "Redis (docs/design/shared-memory.md). Off: the gateway always copies them, e.g. where those executors "
        "run as a user that may not open the clients' regions (each request would be tried, then copied).",
    )
    auth_file: str = Field(
        "", description="TOML file of the tokens that may call the gateway, each with its tenant and the models "
        "it may call (docs/guides/security.md); re-read when it changes. Empty: anyone who reaches the port may "
        "call every model.")
    tls_cert_file: str = Field(
        "",
        description="PEM certificate (chain) the gRPC and REST ports serve over TLS, with tls_key_file; re-read when "
        "the file changes (rotation without restart). Empty: plaintext.")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file.")
    tls_client_ca_file: str = Field(
        "", description="PEM CA certificate(s): when set, clients must present a certificate signed by one of "
        "them (mutual TLS). Needs tls_cert_file.")

    @model_validator(mode="after")
    def _files_work(self) -> "GatewaySettings":
        try:
            TlsFiles.of(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
            if self.auth_file:
                load(self.auth_file)
        except (TlsConfigError, AuthFileError) as exc:
            raise ValueError(str(exc)) from None
        return self
