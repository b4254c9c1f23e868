"""The HTTP gateway: validates events where they enter and produces them keyed by ``user_id``; serves answers
from the answers topic, per-user stats from the store, dead letters (list and replay), health and Prometheus
metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from pydantic import BaseModel

from schemas.events import DeadLetter, Event, QueryCancel
from services.backends import BackendUnavailable
from services.domain import Stats
from services.logging import get_logger
from services.observability.context import bind
from services.observability.settings import ObservabilitySettings
from services.settings import Settings
from streams.codec import encode, user_key
from streams.gateway import inputs, uploads
from streams.gateway.answers import AnswerBook, AnswerFeed
from streams.gateway.auth import (
    Asker,
    Authenticator,
    AuthMiddleware,
    Principal,
    Reader,
    Writer,
    keys_router,
    metrics_access,
    rate_limiter,
    scoped_parse,
)
from streams.gateway.connectors.base import Post, Question, VersionBook, connector_router
from streams.gateway.connectors.imports import import_router
from streams.gateway.connectors.registry import configured, configured_repliers
from streams.gateway.connectors.replies import SlackReplier, Thread, answer_back
from streams.gateway.connectors.slack import SLACK_USER_ID
from streams.gateway.dead_letters import DeadLetterBook, DeadLetterFeed, dead_letter_router
from streams.gateway.forget import (
    Forgets,
    MemoryUpdatesFeed,
    Purger,
    forget_router,
    outbox_event_id,
)
from streams.gateway.graph import LazyStores
from streams.gateway.limits import BodyLimitMiddleware
from streams.gateway.observability import install as install_observability
from streams.gateway.questions import AnswerStreams, question_router
from streams.kafka_security import kafka_client_options
from streams.outbox import Outbox, OutboxRecord, OutboxRelay
from streams.readiness import wait_for_kafka
from streams.topics import TopicNames, ensure_topics

log = get_logger(__name__)

GATEWAY_EVENTS = Counter("memstream_gateway_events_total", "Events accepted by the gateway", ["kind"])

StatsReader = Callable[[str], Awaitable[Stats]]
AppliedReader = Callable[[str, Sequence[str]], Awaitable[set[str]]]
#: how long the start-up outbox replay waits for the dead-letter backlog (dead events are not replayed)
DEAD_LETTERS_BACKLOG_WAIT_S = 60.0
#: how long the start waits for the forgets announced so far before it reads answers and dead letters back
FORGETS_BACKLOG_WAIT_S = 60.0
#: how long a new memory event waits for the start-up replay before it is published anyway
REPLAY_WAIT_S = 10.0


class StoreStats:
    """Reads per-user stats and applied event ids from the configured store, opened on first use."""

    def __init__(self, settings: Settings) -> None:
        self._stores = LazyStores(settings)

    async def __call__(self, user_id: str) -> Stats:
        return await (await self._stores()).graph.stats(user_id)

    async def applied(self, user_id: str, event_ids: Sequence[str]) -> set[str]:
        """Events memory applied *and* announced. An event whose change set's memory update is still pending
        (the worker wrote it, then the broker died before the publish was acked) stays in the outbox: its
        replay makes memorize publish the pending update, which nothing else would after a broker restart."""
        stores = await self._stores()
        seen = await stores.graph.seen_events(user_id, event_ids)
        if seen:
            for pending in await stores.announcements.pending_announcements(user_id, sorted(seen)):
                seen.difference_update(pending.event_ids)
        return seen

    async def close(self) -> None:
        await self._stores.close()


class Accepted(BaseModel):
    accepted: int
    event_ids: list[str]


class QueryAccepted(BaseModel):
    query_id: str


def create_app(
    settings: Settings,
    bootstrap: str | None = None,
    stats_reader: StatsReader | None = None,
    answers_capacity: int = 10_000,
    dead_letters_capacity: int = 50_000,
    applied_reader: AppliedReader | None = None,
) -> FastAPI:
    """The gateway app. ``bootstrap`` defaults to ``settings.broker``; ``stats_reader`` and ``applied_reader``
    (which accepted events memory holds, to prune the outbox) to the configured store."""
    servers = bootstrap or settings.broker
    if not servers:
        raise ValueError("the gateway needs a broker: set MEMSTREAM_BROKER or pass bootstrap")
    topics = TopicNames.from_settings(settings)
    book = AnswerBook(answers_capacity)
    feed = AnswerFeed(servers, topics.answers, book, settings)
    dead_letters = DeadLetterBook(dead_letters_capacity)
    dead_letter_feed = DeadLetterFeed(servers, topics.dead_letters, dead_letters, settings)
    store = StoreStats(settings) if stats_reader is None or applied_reader is None else None
    read_stats: StatsReader = stats_reader or store  # type: ignore[assignment]
    read_applied: AppliedReader = applied_reader or store.applied  # type: ignore[union-attr]
    producer_box: list[AIOKafkaProducer] = []
    memory_topics = {topics.chat, topics.documents}
    outbox = Outbox(settings.outbox_path)
    versions = VersionBook(settings.connector_versions_path)
    repliers = configured_repliers(settings)
    replying: set[asyncio.Task[None]] = set()

    async def publish_records(records: Sequence[OutboxRecord]) -> None:
        producer = producer_box[0]
        futures = [await producer.send(r.topic, r.value, key=user_key(r.user_id)) for r in records]
        await asyncio.gather(*futures)

    relay = OutboxRelay(outbox, publish_records, read_applied, settings.outbox_check_interval_s)

    async def dead_lettered(letter: DeadLetter) -> None:
        """A dead-lettered event is not replayed from the outbox (it would fail again, forever)."""
        if letter.user_id and letter.source_topic in memory_topics:
            try:
                await outbox.mark_dead(letter.user_id, letter.failed_event_ids, letter.reason)
            except sqlite3.Error as exc:  # left pending: replayed once at the next start, then dead again
                log.error("outbox_mark_dead_failed", dead_letter=letter.event_id, error=repr(exc))

    dead_letter_feed.listeners.append(dead_lettered)

    # forgetting: the erasures announced on the memory-updates topic purge the gateway's own copies
    forgets = Forgets(topics)
    purger = Purger(forgets, book, dead_letters, outbox)
    forget_feed = MemoryUpdatesFeed(servers, topics.memory_updates, purger, settings)

    def nudge_lag() -> None:
        """The backlog display samples now: records were published, or memory written (a backlog drained)."""
        lag = getattr(app.state, "lag_sensor", None)
        if lag is not None:
            lag.nudge()

    forget_feed.on_update.append(nudge_lag)

    async def dead_letters_known() -> None:
        if not await dead_letter_feed.wait_loaded(DEAD_LETTERS_BACKLOG_WAIT_S):
            log.warning("outbox_replay_without_dead_letters", waited_s=DEAD_LETTERS_BACKLOG_WAIT_S)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await outbox.open()
        await wait_for_kafka(servers, settings=settings)
        await ensure_topics(settings, servers)
        # acks=all: every in-sync replica has the record; idempotent: a retried send is not written twice
        producer = AIOKafkaProducer(
            bootstrap_servers=servers,
            acks="all",
            enable_idempotence=settings.kafka_idempotence,
            linger_ms=5,
            client_id="memstream-gateway",
            **kafka_client_options(settings),
        )
        await producer.start()
        producer_box.append(producer)
        # the erasures first: answers, traces and dead letters read back from their topics are then checked
        # against every forget already applied, so a restart never shows a forgotten copy, even for a moment
        await forget_feed.start()
        await forget_feed.wait_loaded(FORGETS_BACKLOG_WAIT_S)
        await feed.start()
        await dead_letter_feed.start()
        await relay.start(ready=dead_letters_known)  # what an earlier run acknowledged goes out again first
        log.info("gateway_ready", broker=servers, outbox=str(outbox.path))
        try:
            yield
        finally:
            await relay.stop()
            await forget_feed.stop()
            await dead_letter_feed.stop()
            await feed.stop()
            await producer.stop()
            for task in list(replying):
                task.cancel()
            for replier in repliers.values():
                await replier.close()
            await outbox.close()
            versions.close()
            if store is not None:
                await store.close()

    app = FastAPI(title="memstream gateway", version="1", lifespan=lifespan)
    app.state.answers = book
    app.state.topics = topics
    app.state.dead_letters = dead_letters
    app.state.forgets = forgets
    app.state.max_body_bytes = settings.max_body_bytes
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    # outside the body limit: a request without a credential is refused before its body is read
    authenticator = Authenticator(settings)
    app.add_middleware(AuthMiddleware, authenticator=authenticator)
    limiter = rate_limiter(settings)

    async def produce(topic: str, events: Sequence[Any]) -> None:
        records = [OutboxRecord(topic, e.user_id, outbox_event_id(topic, e), encode(e)) for e in events]
        if topic in memory_topics:
            # durable before acknowledged: on disk first (the embedded broker keeps records in RAM only)
            await outbox.add(records)
            # what an earlier run accepted goes out first, so each user's events keep their order
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(relay.replayed.wait(), REPLAY_WAIT_S)
        try:
            await publish_records(records)  # the broker acknowledged every record before we answer 202
        except BaseException:
            if topic in memory_topics:
                relay.publish_failed(records)  # on disk already: the relay publishes them later
            raise
        nudge_lag()  # the backlog shows at once, not at the next sampling period

    @app.exception_handler(KafkaError)
    async def broker_unavailable(request: Request, exc: KafkaError) -> JSONResponse:
        log.error("produce_failed", path=request.url.path, error=repr(exc))
        return JSONResponse(status_code=503, content={"detail": f"the broker did not accept the events: {exc!r}"})

    @app.exception_handler(BackendUnavailable)
    async def store_unavailable(request: Request, exc: BackendUnavailable) -> JSONResponse:
        log.error("store_unavailable", path=request.url.path, backend=exc.backend, error=str(exc)[:300])
        return JSONResponse(
            status_code=503,
            content={"detail": f"the memory store ({exc.backend}) cannot be reached now; try again shortly"},
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(sqlite3.Error)
    async def outbox_unavailable(request: Request, exc: sqlite3.Error) -> JSONResponse:
        log.error("outbox_write_failed", path=request.url.path, error=repr(exc))
        return JSONResponse(status_code=503, content={"detail": f"the events could not be stored durably: {exc!r}"})

    async def accept(
        request: Request, route: str, parse: Callable[[Any], Sequence[Event]], topic: str, kind: str
    ) -> Any:
        try:
            events = parse(await inputs.json_body(request))
        except inputs.InvalidInput as exc:
            return inputs.invalid_response(route, exc)
        await produce(topic, events)
        GATEWAY_EVENTS.labels(kind=kind).inc(len(events))
        return Accepted(accepted=len(events), event_ids=[e.event_id for e in events])

    @app.post("/v1/messages", status_code=202, response_model=Accepted)
    async def post_messages(request: Request, principal: Writer) -> Any:
        parse = scoped_parse(inputs.chat_messages, principal, limiter, "write")
        return await accept(request, "messages", parse, topics.chat, "chat_message")

    @app.post("/v1/documents", status_code=202, response_model=Accepted)
    async def post_documents(
        request: Request,
        principal: Writer,
        user_id: str | None = None,
        document_id: str | None = None,
        title: str | None = None,
    ) -> Any:
        """JSON document events, or a file as it is (``Content-Type`` text/markdown, text/html, application/pdf,
        text/plain; ``user_id``, ``document_id``, ``title`` as query parameters), cut into overlapping parts."""
        media = (request.headers.get("content-type") or "").partition(";")[0].strip().lower()
        if media in uploads.MEDIA_TYPES:
            try:
                parts = await uploads.parts(request, media, user_id, document_id, title, settings)
                events = scoped_parse(lambda _body: parts, principal, limiter, "write")(None)
            except inputs.InvalidInput as exc:
                return inputs.invalid_response("documents", exc)
            await produce(topics.documents, events)
            GATEWAY_EVENTS.labels(kind="document").inc(len(events))
            return Accepted(accepted=len(events), event_ids=[e.event_id for e in events])
        parse = scoped_parse(inputs.documents, principal, limiter, "write")
        return await accept(request, "documents", parse, topics.documents, "document")

    @app.post("/v1/questions", status_code=202, response_model=QueryAccepted)
    async def post_question(request: Request, principal: Asker) -> Any:
        try:
            (query,) = scoped_parse(lambda body: [inputs.query(body)], principal, limiter, "question")(
                await inputs.json_body(request)
            )
        except inputs.InvalidInput as exc:
            return inputs.invalid_response("questions", exc)
        bind(query_id=query.query_id, user_id=query.user_id, event_id=query.event_id)
        await produce(topics.queries, [query])
        GATEWAY_EVENTS.labels(kind="query").inc()
        return QueryAccepted(query_id=query.query_id)

    @app.get("/v1/answers/{query_id}")
    async def get_answer(principal: Reader, query_id: str, wait: float = Query(0.0, ge=0.0, le=30.0)) -> Any:
        """The answer event; 404 until it is ready (and for another user's). ``wait`` long-polls that long."""
        answer = book.get(query_id) if wait <= 0 else await book.wait_for(query_id, wait)
        if answer is None or not principal.covers(answer.user_id):
            return JSONResponse(status_code=404, content={"detail": f"no answer yet for query {query_id}"})
        return JSONResponse(content=answer.model_dump(mode="json"))

    @app.get("/v1/stats/{user_id}", response_model=Stats)
    async def get_stats(user_id: str, principal: Reader) -> Any:
        try:
            inputs.check_user_id(user_id)
        except inputs.InvalidInput as exc:
            return inputs.invalid_response("stats", exc)
        principal.check_user(user_id)
        return await read_stats(user_id)

    @app.get("/healthz")
    async def healthz() -> Any:
        healthy = bool(producer_box) and feed.running and dead_letter_feed.running and forget_feed.running
        body = {
            "status": "ok" if healthy else "degraded",
            "pid": os.getpid(),  # `memstream up` checks that the gateway answering is the one it started
            "broker": servers,
            "answers_cached": len(book),
            "dead_letters": len(dead_letters),
        }
        return JSONResponse(status_code=200 if healthy else 503, content=body)

    @app.get("/metrics")
    async def metrics(_: Principal | None = Depends(metrics_access(settings))) -> Response:  # noqa: B008
        registry: CollectorRegistry | None = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # `memstream up` runs workers and gateway as processes sharing one metrics directory
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        data = generate_latest(registry) if registry is not None else generate_latest()
        return Response(content=data, media_type=CONTENT_TYPE_LATEST)

    # operators: list dead letters, replay them onto their source topics
    app.include_router(dead_letter_router(dead_letters, dead_letter_feed, topics, produce))
    # writers: forget a message, document, conversation or user; follow the forget
    app.include_router(forget_router(forgets, produce, limiter))
    # admins: make, list and revoke API keys
    app.include_router(keys_router(authenticator.keys))

    # traces (JSON and SSE), the graph neighbourhood, the web page at /, the request log context, the lag sensor
    obs = ObservabilitySettings()
    install_observability(app, settings, servers, obs)
    purger.traces = app.state.traces

    async def send_cancel(cancel: QueryCancel) -> None:
        await produce(topics.query_control, [cancel])

    # answers as they are written (SSE, WebSocket) and questions taken back, over the traces' view of the topics
    streams = AnswerStreams(app.state.traces, send_cancel, obs, live=app.state.trace_feed is not None)
    app.include_router(question_router(streams))

    async def ask_from_platform(platform: str, question: Question) -> bool:
        """A question to the bot: asked of memory, answered back in its thread as the answer streams."""
        replier = repliers.get(platform)
        if replier is None:
            return False
        query = question.query()
        await produce(topics.queries, [query])
        GATEWAY_EVENTS.labels(kind="query").inc()
        where = Thread(question.channel, question.thread)
        task = asyncio.create_task(answer_back(streams, replier, query, where), name=f"reply-{query.query_id}")
        replying.add(task)
        task.add_done_callback(replying.discard)
        return True

    async def speaker_names(platform: str, post: Post) -> Post:
        """A Slack message that names its author by id only: the name from Slack, when a bot token lets us ask."""
        replier = repliers.get(platform)
        if not isinstance(replier, SlackReplier) or not SLACK_USER_ID.fullmatch(post.speaker):
            return post
        name = await replier.name_of(post.speaker)
        return dataclasses.replace(post, speaker=name) if name else post

    # Slack, Telegram and signed webhooks: messages in, edits and deletions as memory operations, questions to
    # the bot answered back where they were asked; platform exports through /v1/imports
    connectors = connector_router(
        configured(settings, authenticator.keys.place_user),
        produce,
        topics.chat,
        versions,
        forgets.sent,
        settings.max_body_bytes,
        ask_from_platform,
        speaker_names,
    )
    app.include_router(connectors)
    app.include_router(import_router(produce, topics.chat, versions, forgets.sent))
    forgets.guard(book, dead_letter_feed, app.state.traces)
    return app
