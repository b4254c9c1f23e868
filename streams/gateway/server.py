"""Serve the gateway with uvicorn (it handles SIGINT/SIGTERM and shuts the app down cleanly)."""

from __future__ import annotations

import uvicorn

from services.settings import Settings
from streams.gateway.app import create_app


async def serve_gateway(
    settings: Settings, bootstrap: str | None = None, host: str | None = None, port: int | None = None
) -> None:
    app = create_app(settings, bootstrap)
    config = uvicorn.Config(
        app,
        host=host or settings.host,
        port=port or settings.port,
        log_config=None,  # keep our structlog/logging setup
        access_log=False,
        lifespan="on",
    )
    await uvicorn.Server(config).serve()
