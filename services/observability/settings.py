"""Settings of the observability parts, from the environment (prefix ``MEMSTREAM_OBS_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ObservabilitySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEMSTREAM_OBS_", env_file=".env", extra="ignore")

    traces: bool = Field(default=True, description="assemble traces from the stage topic (the trace routes need it)")
    trace_capacity: int = Field(default=2_000, ge=1, description="traces the gateway keeps, most recent first")
    lag_interval_s: float = Field(default=5.0, ge=0.0, description="consumer lag sampling period; 0: off")
    stream_heartbeat_s: float = Field(default=15.0, gt=0.0, description="SSE keep-alive period")
    stream_max_s: float = Field(default=900.0, gt=0.0, description="longest a trace stream stays open")
    cancel_grace_s: float = Field(
        default=10.0,
        ge=0.0,
        description="an answer stream that disconnects cancels its query after this long without another reader",
    )
