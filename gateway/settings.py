"""Gateway settings (environment prefix BATCHLINE_GATEWAY_)."""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from batchline.settings import CommonSettings


class GatewaySettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHLINE_GATEWAY_")

    port: int = Field(8001, description="Port of the KServe v2 gRPC endpoint (8001 is where Triton clients look; 0 = any free port).")
    gateway_id: str = Field("", description="Id of this gateway, the address of its reply list (default: a random one per process).")
    max_message_bytes: int = Field(
        64 * 1024 * 1024,
        description="Largest gRPC message accepted or sent; a larger request is refused with RESOURCE_EXHAUSTED.",
    )
    registry_refresh_s: float = Field(0.5, description="Seconds between re-reads of the executor registry (served models).")
    heartbeat_interval_s: float = Field(1.0, description="Seconds between registrations of this gateway in Redis.")
