"""The gateway's observability routes: per-query traces (JSON and live SSE), the memory-graph neighbourhood of an
answer's evidence, the trace web page, and the log context of every request.

``install(app, ...)`` mounts them; the trace feed and the consumer-lag sensor run for the app's lifetime.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Query
from fastapi.responses import FileResponse, JSONResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.logging import get_logger
from services.observability import metrics
from services.observability.context import log_context
from services.observability.settings import ObservabilitySettings
from services.observability.traces import TextPiece, Trace, TraceStore
from services.qa.stages import Stage
from services.settings import Settings
from streams.gateway import inputs
from streams.gateway.auth import Principal, Reader
from streams.gateway.graph import MAX_IDS, LazyStores, Neighbourhood, neighbourhood, split_ids
from streams.lag import LagSensor
from streams.topics import TopicNames
from streams.trace_feed import TraceFeed

log = get_logger(__name__)

STATIC_DIR = Path(__file__).with_name("static")


class LogContextMiddleware:
    """Binds a request id (the client's ``X-Request-ID`` or a new one), method and path to every log line of a
    request, and returns the id in the response's ``X-Request-ID``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")[:64]
        request_id = given if given.isprintable() and given else uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode("latin-1")))
            await send(message)

        with log_context(request_id=request_id, method=scope.get("method"), path=scope.get("path")):
            await self.app(scope, receive, send_with_id)


def _not_found(what: str) -> JSONResponse:
    return JSONResponse(status_code=404, content={"detail": what})


def _check_user(user_id: str) -> JSONResponse | None:
    try:
        inputs.check_user_id(user_id)
    except inputs.InvalidInput as exc:
        return JSONResponse(status_code=422, content={"detail": str(exc)})
    return None


def _visible(owner: str | None, principal: Principal, user_id: str | None) -> bool:
    """A query's trace is shown to credentials acting for its user (and that user, when one is asked for)."""
    return principal.covers(owner) and (user_id is None or owner == user_id)


def observability_router(
    store: TraceStore, feed: TraceFeed | None, lag: LagSensor | None, graph: LazyStores, obs: ObservabilitySettings
) -> APIRouter:
    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        if feed is not None:
            await feed.start()
        if lag is not None:
            await lag.start()
        try:
            yield
        finally:
            if lag is not None:
                await lag.stop()
            if feed is not None:
                await feed.stop()
            await graph.close()

    router = APIRouter(lifespan=lifespan)

    @router.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @router.get("/v1/stages")
    async def stages() -> list[dict[str, Any]]:
        """The 13 QA stages, by number."""
        return [{"stage": int(s), "name": s.label} for s in Stage]

    @router.get("/v1/traces/{query_id}", response_model=Trace)
    async def get_trace(principal: Reader, query_id: str, user_id: str | None = None) -> Any:
        """The query's trace so far (404 until its first event arrived, and for another user's query);
        ``user_id`` restricts to that user."""
        if user_id is not None:
            principal.check_user(user_id)
        with log_context(query_id=query_id, user_id=user_id):
            trace = store.get(query_id)
            if trace is None or not _visible(trace.user_id, principal, user_id):
                return _not_found(f"no trace for query {query_id}")
            return trace

    @router.get("/v1/traces/{query_id}/stream", response_class=EventSourceResponse)
    async def stream_trace(
        principal: Reader,
        query_id: str,
        user_id: str | None = None,
        last_event_id: str | None = Header(default=None),
    ) -> AsyncIterable[ServerSentEvent]:
        """Server-sent events while the query is answered: ``query``, ``stage`` (one per stage run), ``text`` (the
        answer as the model writes it: ``delta``, whole ``text``, ``reset``), ``answer``,
        then ``end`` with the whole trace (``forgotten`` instead, when the memory it drew on is forgotten meanwhile).
        Subscribing late replays what happened so far; ``Last-Event-ID`` resumes after that event."""
        if user_id is not None:
            principal.check_user(user_id)
        after = int(last_event_id) if last_event_id and last_event_id.isdigit() else 0
        deadline = asyncio.get_running_loop().time() + obs.stream_max_s
        outcome = "disconnected"
        text = ""
        with log_context(query_id=query_id, user_id=user_id):
            log.info("trace_stream_opened", after=after)
            try:
                async for update in store.follow(query_id, after, obs.stream_heartbeat_s):
                    owner = store.user_of(query_id)
                    if owner is not None and not _visible(owner, principal, user_id):
                        outcome = "forbidden"  # another user's query: say no more than that it is not theirs
                        yield ServerSentEvent(event="unavailable", data={"query_id": query_id})
                        return
                    if update is None:
                        if asyncio.get_running_loop().time() > deadline:
                            outcome = "timeout"
                            yield ServerSentEvent(event="timeout", data={"query_id": query_id})
                            return
                        yield ServerSentEvent(comment="keep-alive")
                        continue
                    data: Any = update.data
                    if isinstance(data, TextPiece):  # the answer as far as it is written
                        text = data.applied(text)
                        data = {"delta": data.delta, "text": text, "reset": data.reset}
                    yield ServerSentEvent(event=update.kind, id=str(update.seq), data=data)
                trace = store.get(query_id)
                if trace is None:  # forgotten while followed: nothing of it is shown any more
                    outcome = "forgotten"
                    yield ServerSentEvent(event="forgotten", data={"query_id": query_id})
                    return
                outcome = "answered"
                yield ServerSentEvent(event="end", data=trace)
            finally:
                metrics.TRACE_STREAMS.labels(outcome).inc()
                log.info("trace_stream_closed", outcome=outcome)

    @router.get("/v1/graph/{user_id}/neighbourhood", response_model=Neighbourhood)
    async def get_neighbourhood(
        principal: Reader,
        user_id: str,
        ids: Annotated[list[str], Query(description="vertex or edge ids, repeated or comma-separated")],
        per_vertex: Annotated[int, Query(ge=1, le=50, description="neighbours shown per vertex")] = 8,
        as_of: Annotated[
            datetime | None, Query(description="show what held then, as the question asked (default: now)")
        ] = None,
    ) -> Any:
        """The user's memory graph around some of its vertices or edges (e.g. an answer's evidence)."""
        if (invalid := _check_user(user_id)) is not None:
            return invalid
        principal.check_user(user_id)
        wanted = split_ids(ids)
        if len(wanted) > MAX_IDS:
            return JSONResponse(status_code=422, content={"detail": f"at most {MAX_IDS} ids"})
        with log_context(user_id=user_id):
            if as_of is not None and as_of.tzinfo is None:
                as_of = as_of.replace(tzinfo=UTC)  # a naive time is UTC, as everywhere in memstream
            return await neighbourhood((await graph()).graph, user_id, wanted, per_vertex, as_of)

    return router


def install(app: FastAPI, settings: Settings, bootstrap: str, obs: ObservabilitySettings | None = None) -> None:
    """Mount the observability routes, the trace page and the request log context on the gateway ``app``."""
    obs = obs or ObservabilitySettings()
    topics = TopicNames.from_settings(settings)
    store = TraceStore(obs.trace_capacity)
    feed = TraceFeed(bootstrap, topics, store, settings) if obs.traces else None
    consumed = [topics.chat, topics.documents, topics.queries]  # what the worker group reads
    lag = (
        LagSensor(bootstrap, settings.consumer_group, consumed, obs.lag_interval_s, settings=settings)
        if obs.lag_interval_s
        else None
    )
    app.state.traces = store
    app.state.trace_feed = feed
    app.state.lag_sensor = lag
    app.add_middleware(LogContextMiddleware)
    app.include_router(observability_router(store, feed, lag, LazyStores(settings), obs))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
