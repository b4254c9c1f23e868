"""Stopping a background consumer loop: cancel its task, then close its consumer."""

from __future__ import annotations

import asyncio
import contextlib

from aiokafka import AIOKafkaConsumer


async def stop_consumer_loop(task: asyncio.Task[None] | None, consumer: AIOKafkaConsumer | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if consumer is not None:
        await consumer.stop()
