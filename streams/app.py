"""The Faust app: two thin agents over the handlers.

Settings chosen for the embedded Tansu broker, and fine on Apache Kafka too:
- at-least-once (Tansu has no idempotent producer and no transactions, so no ``exactly_once``); effects are
  idempotent instead (the store skips events it already applied);
- no Faust tables and ``consumer_auto_offset_reset="earliest"``: Tansu's "latest" offsets are wrong, so nothing
  may depend on table recovery or on seeking to the end; a new group starts at the beginning of each topic;
- a short ``broker_session_timeout``: Tansu completes a group join only after half the session timeout;
- no leader topic and no topic declaration: the topics are created up front (``streams.topics.ensure_topics``);
- the web server off and, in case something binds it anyway, on loopback and on a port of its own per worker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import faust

from services.container import Services
from services.memorize.service import TAKE_BATCHES
from services.settings import Settings
from streams.cancels import Cancellations
from streams.handlers import MemorizeHandler, QAHandler, Record
from streams.holdback import Holdback
from streams.kafka_security import kafka_ssl_context, sasl_credentials
from streams.topics import TopicNames


class FaustPublisher:
    """Publishes through the worker's own producer and waits for the broker's ack."""

    def __init__(self, app: faust.App) -> None:
        self.app = app

    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        producer = await self.app.maybe_start_producer()
        await producer.send_and_wait(topic, key, value, partition=None, timestamp=None, headers=None)


def faust_credentials(settings: Settings) -> faust.types.auth.CredentialsT | None:
    """The worker's Kafka security, the same as every aiokafka client's (``streams.kafka_security``): SASL (with
    TLS for SASL_SSL), TLS alone (SSL, with a client certificate for mTLS), or None for PLAINTEXT."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return None
    context = kafka_ssl_context(settings)
    credentials = sasl_credentials(settings)
    if credentials is None:
        return faust.SSLCredentials(context)
    username, password = credentials
    return faust.SASLCredentials(
        username=username, password=password, ssl_context=context, mechanism=settings.kafka_sasl_mechanism
    )


def faust_options(settings: Settings, bootstrap: str, web_port: int | None = None) -> dict[str, Any]:
    session = settings.broker_session_timeout_s
    return {
        "broker_credentials": faust_credentials(settings),
        "broker": ";".join(f"kafka://{server.strip()}" for server in bootstrap.split(",")),
        "datadir": str(settings.data_dir / "faust"),
        "processing_guarantee": "at_least_once",
        "consumer_auto_offset_reset": "earliest",
        "broker_session_timeout": session,
        "broker_heartbeat_interval": max(0.5, session / 6),
        "broker_rebalance_timeout": max(30.0, session * 3),
        "broker_commit_interval": 1.0,
        "producer_acks": -1,
        "topic_partitions": settings.partitions,
        "topic_replication_factor": settings.replication_factor,
        "topic_allow_declare": False,
        "topic_disable_leader": True,
        "store": "memory://",
        "key_serializer": "raw",
        "value_serializer": "raw",
        "web_enabled": False,
        "web_bind": "127.0.0.1",
        "web_host": "127.0.0.1",
        "web_port": web_port or settings.worker_web_port,
        "autodiscover": False,
    }


def create_app(
    settings: Settings,
    bootstrap: str,
    services: Services,
    web_port: int | None = None,
    cancels: Cancellations | None = None,
) -> faust.App:
    """``cancels``: the queries cancelled, fed from the query-control topic (``streams.cancels.CancelFeed``)."""
    topics = TopicNames.from_settings(settings)
    app = faust.App(settings.consumer_group, **faust_options(settings, bootstrap, web_port))
    publisher = FaustPublisher(app)
    memorize_handler = MemorizeHandler(services.memorize, publisher, topics, services.forget)
    qa_handler = QAHandler(services.qa, publisher, topics, cancels)

    memory_events = app.topic(topics.chat, topics.documents, key_serializer="raw", value_serializer="raw")
    queries = app.topic(topics.queries, key_serializer="raw", value_serializer="raw")
    batch_wait = max(settings.batch_wait_s, 0.01)  # take() with no timeout could hold a partial batch forever
    # The memorize service packs each user's events into extraction calls of batch_max_messages; the agent takes
    # several users' worth at once, or interleaved users would leave one message per call.
    take_max = settings.batch_max_messages * TAKE_BATCHES

    @app.agent(memory_events, name="memorize")
    async def memorize(stream: faust.StreamT[Any]) -> None:
        # noack_take: events are acked by hand, only after the store write committed and the updates were
        # published, so a crash before that replays the batch instead of losing it. A user's partial batch is
        # held (unacked) over the next takes until it fills or waited its time; the next take is already being
        # read while a batch is processed, and is not cancelled to wait for the held one.
        holdback: Holdback[Any] = Holdback(settings.batch_max_messages, settings.batch_max_hold_s, take_max * 4)
        takes = cast(faust.Stream[Any], stream).noack_take(take_max, within=batch_wait).__aiter__()
        next_take: asyncio.Future[Any] = asyncio.ensure_future(takes.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({next_take}, timeout=holdback.wait_s(time.monotonic()))
                if next_take in done:
                    try:
                        events = next_take.result()
                    except StopAsyncIteration:
                        break
                    for event in events:
                        holdback.add(event.message.key, event, time.monotonic())
                    next_take = asyncio.ensure_future(takes.__anext__())
                ready = holdback.release(time.monotonic())
                if not ready:
                    continue
                await memorize_handler.handle([Record(e.message.topic, e.message.key, e.message.value) for e in ready])
                for event in ready:
                    await stream.ack(event)
        finally:
            next_take.cancel()  # the worker is stopping: the pending read goes with it
        rest = holdback.release(float("inf"))  # the stream ended: nothing held is left unprocessed
        if rest:
            await memorize_handler.handle([Record(e.message.topic, e.message.key, e.message.value) for e in rest])
            for event in rest:
                await stream.ack(event)

    @app.agent(queries, name="qa", concurrency=settings.llm_max_concurrency)
    async def qa(stream: faust.StreamT[Any]) -> None:
        # events() acks each query after the body ran, i.e. after the answer was published
        async for event in stream.events():
            await qa_handler.handle(Record(event.message.topic, event.message.key, event.message.value))

    return app
