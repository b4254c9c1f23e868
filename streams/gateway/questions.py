"""Answers as they are written, and questions taken back.

- ``GET /v1/questions/{id}/stream``: server-sent events, ``text`` (``delta``, the whole ``text`` so far, ``reset``
  when a retried call starts again) while the model writes, then ``answer`` (the answer event) and the end;
- ``WS /v1/questions/{id}/ws``: the same as JSON messages (``{"type": "text", ...}``, ``{"type": "answer", ...}``);
  the client may send ``{"type": "cancel"}``;
- ``DELETE /v1/questions/{id}``: cancel an unanswered question of one's own users.

A reader that goes away before the answer cancels the question once no other reader of its answer is left for
``cancel_grace_s`` (a reconnect within that time keeps it running): its LLM work stops at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Header, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from prometheus_client import Counter

from schemas.events import Answer, QueryCancel
from services.logging import get_logger
from services.observability.context import log_context
from services.observability.settings import ObservabilitySettings
from services.observability.traces import TextPiece, TraceStore
from streams.gateway.auth import Action, Asker, Principal, Reader

log = get_logger(__name__)

ANSWER_STREAMS = Counter(
    "memstream_gateway_answer_streams_total",
    "Answer streams closed, by transport and outcome",
    ["transport", "outcome"],
)
CANCELS = Counter("memstream_gateway_cancels_total", "Question cancellations sent to the workers", ["reason"])

Cancel = Callable[[QueryCancel], Awaitable[None]]
NOT_LIVE = "answer streams need the trace feed, which is off (MEMSTREAM_OBS_TRACES=false)"
Reason = Literal["deleted", "disconnected"]


@dataclass(frozen=True)
class Message:
    """One thing an answer stream tells its reader: ``text``, ``answer``, ``wait`` (nothing new: keep alive), or
    the end without an answer: ``timeout``, ``unavailable`` (not the reader's), ``forgotten``."""

    kind: str
    data: dict[str, Any]
    seq: int | None = None


class AnswerStreams:
    """Follows questions' answers in the trace store; counts each question's readers and cancels an abandoned one."""

    def __init__(self, traces: TraceStore, cancel: Cancel, obs: ObservabilitySettings, live: bool = True) -> None:
        """``live``: the trace feed fills ``traces`` (off with ``MEMSTREAM_OBS_TRACES=false``: nothing streams)."""
        self.live = live
        self.traces = traces
        self.cancel = cancel
        self.obs = obs
        self.readers: dict[str, int] = {}
        self._pending: set[asyncio.Task[None]] = set()

    def owner_visible(self, query_id: str, principal: Principal) -> str | None:
        owner = self.traces.user_of(query_id)
        return owner if owner is not None and principal.covers(owner) else None

    async def follow(self, query_id: str, principal: Principal, after: int = 0) -> AsyncIterator[Message]:
        """The answer's messages from update ``after`` on, until the answer (or the stream's end)."""
        deadline = asyncio.get_running_loop().time() + self.obs.stream_max_s
        text = ""
        async for update in self.traces.follow(query_id, after, self.obs.stream_heartbeat_s):
            owner = self.traces.user_of(query_id)
            if owner is not None and not principal.covers(owner):
                yield Message("unavailable", {"query_id": query_id})  # not theirs: no more than that
                return
            if update is None:
                if asyncio.get_running_loop().time() > deadline:
                    yield Message("timeout", {"query_id": query_id})
                    return
                yield Message("wait", {})
                continue
            if isinstance(update.data, TextPiece):
                text = update.data.applied(text)
                data = {"delta": update.data.delta, "text": text, "reset": update.data.reset}
                yield Message("text", data, update.seq)
            elif isinstance(update.data, Answer):
                yield Message("answer", update.data.model_dump(mode="json"), update.seq)
                return
        yield Message("forgotten", {"query_id": query_id})  # removed while followed: its memory was forgotten

    @contextlib.asynccontextmanager
    async def reading(self, query_id: str, principal: Principal, cancel_on_disconnect: bool) -> AsyncIterator[None]:
        """One reader of the answer for the block's duration; leaving before the answer may cancel the question."""
        self.readers[query_id] = self.readers.get(query_id, 0) + 1
        try:
            yield
        finally:
            self.readers[query_id] -= 1
            if not self.readers[query_id]:
                del self.readers[query_id]
            mine = self.owner_visible(query_id, principal) is not None
            if cancel_on_disconnect and mine and principal.can(Action.ASK) and self.unanswered(query_id):
                task = asyncio.get_running_loop().create_task(self._cancel_if_abandoned(query_id))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    def unanswered(self, query_id: str) -> bool:
        return self.traces.answered(query_id) is False

    async def _cancel_if_abandoned(self, query_id: str) -> None:
        await asyncio.sleep(self.obs.cancel_grace_s)  # a reader that reconnects within the grace keeps it going
        if self.readers.get(query_id) or not self.unanswered(query_id):
            return
        await self.send_cancel(query_id, "disconnected")

    async def send_cancel(self, query_id: str, reason: Reason) -> bool:
        owner = self.traces.user_of(query_id)
        if owner is None:
            return False
        try:
            await self.cancel(QueryCancel.of(query_id, owner, reason))
        except Exception as exc:  # the broker is away: the answering runs on; said, not hidden
            log.error("cancel_failed", query_id=query_id, reason=reason, error=repr(exc))
            return False
        CANCELS.labels(reason=reason).inc()
        log.info("question_cancelled", query_id=query_id, reason=reason)
        return True

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()


def _sse(message: Message) -> ServerSentEvent:
    if message.kind == "wait":
        return ServerSentEvent(comment="keep-alive")
    return ServerSentEvent(event=message.kind, id=None if message.seq is None else str(message.seq), data=message.data)


def question_router(streams: AnswerStreams) -> APIRouter:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await streams.close()

    router = APIRouter(lifespan=lifespan)

    @router.get("/v1/questions/{query_id}/stream", response_class=EventSourceResponse)
    async def stream_answer(
        principal: Reader,
        query_id: str,
        cancel_on_disconnect: bool = True,
        last_event_id: str | None = Header(default=None),
    ) -> AsyncIterator[ServerSentEvent]:
        """Server-sent events of the answer as it is written: ``text`` events, then ``answer``; leaving before the
        answer cancels the question (unless ``cancel_on_disconnect=false``). ``Last-Event-ID`` resumes."""
        if not streams.live:
            yield ServerSentEvent(event="unavailable", data={"query_id": query_id, "detail": NOT_LIVE})
            return
        after = int(last_event_id) if last_event_id and last_event_id.isdigit() else 0
        outcome = "disconnected"
        with log_context(query_id=query_id):
            async with streams.reading(query_id, principal, cancel_on_disconnect):
                try:
                    async for message in streams.follow(query_id, principal, after):
                        yield _sse(message)
                        if message.kind not in ("text", "wait"):
                            outcome = message.kind
                finally:
                    ANSWER_STREAMS.labels(transport="sse", outcome=outcome).inc()

    @router.websocket("/v1/questions/{query_id}/ws")
    async def socket_answer(websocket: WebSocket, query_id: str, cancel_on_disconnect: bool = True) -> None:
        """The answer as it is written, as JSON messages; ``{"type": "cancel"}`` from the client cancels it."""
        principal: Principal | None = websocket.scope.get("state", {}).get("principal")
        if principal is None or not principal.can(Action.READ):
            await websocket.close(code=1008, reason="this credential lacks the 'read' scope")
            return
        offered = websocket.scope.get("subprotocols") or []
        await websocket.accept(subprotocol="memstream" if "memstream" in offered else None)
        if not streams.live:
            await websocket.send_json({"type": "unavailable", "query_id": query_id, "detail": NOT_LIVE})
            await websocket.close()
            return
        outcome = "disconnected"
        with log_context(query_id=query_id):
            async with streams.reading(query_id, principal, cancel_on_disconnect):
                listener = asyncio.create_task(_client_messages(websocket, streams, query_id, principal))
                messages = streams.follow(query_id, principal).__aiter__()
                try:
                    while True:
                        following = asyncio.ensure_future(messages.__anext__())
                        await asyncio.wait({following, listener}, return_when=asyncio.FIRST_COMPLETED)
                        if not following.done():  # the client went away while nothing new came
                            following.cancel()
                            break
                        try:
                            message = following.result()
                        except StopAsyncIteration:
                            break
                        if message.kind == "wait":
                            continue
                        await websocket.send_json({"type": message.kind, **message.data})
                        if message.kind != "text":
                            outcome = message.kind
                            await websocket.close()
                            break
                except WebSocketDisconnect:
                    pass
                finally:
                    listener.cancel()
                    ANSWER_STREAMS.labels(transport="websocket", outcome=outcome).inc()

    @router.delete("/v1/questions/{query_id}", status_code=202)
    async def cancel_question(principal: Asker, query_id: str) -> Any:
        """Cancel a question still being answered (one of the credential's users'): its LLM work stops at the
        next token and its answer event says ``cancelled``. 404 for an unknown or another user's question, 409
        once answered."""
        owner = streams.owner_visible(query_id, principal)
        if owner is None:
            return JSONResponse(status_code=404, content={"detail": f"no question {query_id} known here"})
        if not streams.unanswered(query_id):
            return JSONResponse(status_code=409, content={"detail": f"question {query_id} is answered already"})
        if not await streams.send_cancel(query_id, "deleted"):
            return JSONResponse(status_code=503, content={"detail": "the cancel could not be sent; try again"})
        return {"query_id": query_id, "status": "cancelling"}

    return router


async def _client_messages(websocket: WebSocket, streams: AnswerStreams, query_id: str, principal: Principal) -> None:
    """Reads the client's messages until it goes: ``{"type": "cancel"}`` cancels the question."""
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            try:
                message = await websocket.receive_json()
            except ValueError:  # not JSON: said to the client, the stream goes on
                await websocket.send_json({"type": "error", "detail": 'send JSON, e.g. {"type": "cancel"}'})
                continue
            if not (isinstance(message, dict) and message.get("type") == "cancel"):
                continue
            if principal.can(Action.ASK) and streams.owner_visible(query_id, principal) is not None:
                await streams.send_cancel(query_id, "deleted")
