"""Run one Faust worker in the current event loop, with the services it needs built first."""

from __future__ import annotations

import asyncio
import signal

import faust

from services.container import build_services
from services.logging import get_logger
from services.ports import LLM, BlockingEmbedder
from services.settings import Settings
from streams.app import create_app
from streams.cancels import CancelFeed, Cancellations
from streams.readiness import wait_for_kafka
from streams.topics import TopicNames, ensure_topics

log = get_logger(__name__)
STOP_TIMEOUT_S = 8.0


class _Worker(faust.Worker):
    """faust's worker without a terminal spinner and without its own signal handling (``run_worker`` has it)."""

    def __init__(self, app: faust.App) -> None:
        super().__init__(
            app,
            loop=asyncio.get_running_loop(),
            override_logging=False,  # structlog + logging are configured by memstream
            redirect_stdouts=False,
            daemon=False,
            quiet=True,
        )
        self.spinner = None

    def install_signal_handlers(self) -> None:
        return None


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
    await wait_for_kafka(servers, settings=settings)
    await ensure_topics(settings, servers)
    services = await build_services(settings, llm)
    cancel_feed: CancelFeed | None = None
    try:  # from here on, whatever fails closes the stores the services opened
        if isinstance(services.embedder, BlockingEmbedder):
            # an in-process embedder loaded (a static table distilled, the first time) before events are taken,
            # not inside the first batch; a served one (Ollama) keeps its own outage handling
            await services.embedder.embed(["warm up"])
        cancels = Cancellations()
        cancel_feed = CancelFeed(servers, TopicNames.from_settings(settings).query_control, cancels, settings)
        await cancel_feed.start()
        app = create_app(settings, servers, services, web_port, cancels)
        if stop is None:
            # our own signal handling: faust's stops the loop from inside and left workers hanging at exit
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        worker = _Worker(app)
        await worker.start()
        log.info("worker_started", broker=servers, group=settings.consumer_group)
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            # Offsets are committed only after store writes, so cutting a stuck shutdown short loses nothing: at
            # worst the next owner of a partition replays events, which memorize recognises and skips.
            try:
                await asyncio.wait_for(worker.stop(), timeout=STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("worker_stop_timeout", timeout_s=STOP_TIMEOUT_S)
    finally:
        if cancel_feed is not None:
            await cancel_feed.stop()
        await services.close()
        log.info("worker_stopped")
