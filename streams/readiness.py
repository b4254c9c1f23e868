"""Is the broker there? The probe the gateway and the workers run before they start (and ``memstream up``)."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaClient
from aiokafka.errors import KafkaError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from services.settings import Settings
from streams.kafka_security import kafka_client_options


class BrokerError(RuntimeError):
    """The broker did not start or did not answer in time."""


async def wait_for_kafka(bootstrap: str, timeout_s: float = 20.0, settings: Settings | None = None) -> None:
    """Return once a Kafka client can fetch cluster metadata from ``bootstrap``; ``BrokerError`` after the deadline.
    ``settings``: the Kafka security to connect with (unset: the process's own settings)."""
    security = kafka_client_options(settings)

    host, _, port = bootstrap.split(",")[0].rpartition(":")

    async def probe() -> None:
        # A bare TCP connect first: aiokafka logs every refused connection as an error.
        _, writer = await asyncio.open_connection(host, int(port))
        writer.close()
        client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=2000, **security)
        try:
            await client.bootstrap()
        finally:
            await client.close()

    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_fixed(0.05),
            retry=retry_if_exception_type((KafkaError, OSError)),
            reraise=True,
        ):
            with attempt:
                await probe()
    except (KafkaError, OSError) as exc:
        raise BrokerError(f"no Kafka broker answered at {bootstrap} within {timeout_s:.0f}s: {exc}") from exc
