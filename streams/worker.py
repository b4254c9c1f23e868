"""Run one Faust worker in the current event loop, with the services it needs built first."""

from __future__ import annotations

import asyncio

import faust

from memstream.broker import wait_for_kafka
from services.container import build_services
from services.logging import get_logger
from services.ports import LLM
from services.settings import Settings
from streams.app import create_app
from streams.topics import ensure_topics

log = get_logger(__name__)


class _Worker(faust.Worker):
    """faust's worker without a terminal spinner, and with signal handling only when it owns the process."""

    def __init__(self, app: faust.App, handle_signals: bool) -> None:
        super().__init__(
            app,
            loop=asyncio.get_running_loop(),
            override_logging=False,  # structlog + logging are configured by memstream
            redirect_stdouts=False,
            daemon=False,
            quiet=True,
        )
        self.spinner = None
        self._handle_signals = handle_signals

    def install_signal_handlers(self) -> None:
        if self._handle_signals:
            super().install_signal_handlers()


async def run_worker(
    settings: Settings,
    bootstrap: str | None = None,
    *,
    llm: LLM | None = None,
    web_port: int | None = None,
    stop: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Consume until SIGINT/SIGTERM, or until ``stop`` is set when given (then signals are left alone)."""
    servers = bootstrap or settings.broker
    if not servers:
        raise ValueError("the worker needs a broker: set MEMSTREAM_BROKER or pass bootstrap")
    await wait_for_kafka(servers)
    await ensure_topics(settings, servers)
    services = await build_services(settings, llm)
    try:
        app = create_app(settings, servers, services, web_port)
        worker = _Worker(app, handle_signals=stop is None)
        await worker.start()
        log.info("worker_started", broker=servers, group=settings.consumer_group)
        if ready is not None:
            ready.set()
        try:
            if stop is not None:
                await stop.wait()
            else:
                await worker.wait_until_stopped()
        finally:
            await worker.stop()
    finally:
        await services.close()
        log.info("worker_stopped")
