"""The answer-stream routes over a real HTTP server (uvicorn on loopback) with real clients: server-sent events read
with httpx as they come, the WebSocket with the ``websockets`` client, API keys through the gateway's own
authentication. The trace store is fed by hand, as the trace feed feeds it from the topics; cancels are recorded
instead of produced (the broker path is in ``test_answer_stream_stack.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import websockets
from fastapi import FastAPI
from websockets.exceptions import InvalidStatus

from schemas.events import Answer, AnswerStatus, AnswerText, Query, QueryCancel
from services.observability.settings import ObservabilitySettings
from services.observability.traces import TraceStore
from streams.gateway.auth import Authenticator, AuthMiddleware
from streams.gateway.questions import AnswerStreams, question_router
from tests.conftest import free_port, make_settings

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


class Server:
    """The question routes behind the gateway's authentication, served by uvicorn in this event loop."""

    def __init__(self, tmp_path: Path, key_factory: Callable[..., str], grace_s: float = 0.0) -> None:
        self.settings = make_settings(tmp_path)
        self.ana_key = key_factory(self.settings, users=["ana"], scopes=["read", "ask"])
        self.ana_reader = key_factory(self.settings, users=["ana"], scopes=["read"])
        self.ben_key = key_factory(self.settings, users=["ben"], scopes=["read", "ask"])
        self.store = TraceStore()
        self.cancels: list[QueryCancel] = []
        obs = ObservabilitySettings(_env_file=None, cancel_grace_s=grace_s, stream_heartbeat_s=0.2)
        app = FastAPI()
        app.add_middleware(AuthMiddleware, authenticator=Authenticator(self.settings))
        self.streams = AnswerStreams(self.store, self.record_cancel, obs)
        app.include_router(question_router(self.streams))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None))

    async def record_cancel(self, cancel: QueryCancel) -> None:
        self.cancels.append(cancel)

    def ask(self, query_id: str = "q1", user_id: str = "ana") -> Query:
        query = Query(event_id=query_id, user_id=user_id, event_time=T0, question="Where does Ana work?")
        self.store.add_query(query)
        return query

    def write(self, query: Query, seq: int, text: str) -> None:
        event_id = f"txt_{query.query_id}_{seq}"
        self.store.add_text(
            AnswerText(
                event_id=event_id, user_id=query.user_id, event_time=T0, query_id=query.query_id, seq=seq, text=text
            )
        )

    def answer(self, query: Query, text: str) -> None:
        self.store.add_answer(Answer.to(query, answer=text, status=AnswerStatus.ANSWERED))


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, key_factory: Callable[..., str], grace_s: float = 0.0) -> AsyncIterator[Server]:
    server = Server(tmp_path, key_factory, grace_s)
    task = asyncio.create_task(server.server.serve())
    await until(lambda: server.server.started, "the server started")
    try:
        yield server
    finally:
        server.server.should_exit = True
        await asyncio.wait_for(task, 10)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.02)


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    event, data = "message", ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif not line and data:
            yield event, json.loads(data)
            event, data = "message", ""


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_sse_gives_the_text_as_it_is_written_then_the_answer(tmp_path: Path, key_factory: Any) -> None:
    async with serving(tmp_path, key_factory) as server:
        query = server.ask()
        got: list[tuple[str, dict[str, Any]]] = []
        http = httpx.AsyncClient(base_url=server.url, headers=auth(server.ana_key), timeout=10)
        async with http, http.stream("GET", "/v1/questions/q1/stream") as response:
            assert response.status_code == 200
            server.write(query, 1, "Ana")
            async for event, data in sse_events(response):
                got.append((event, data))
                if len(got) == 1:  # the reader has the first piece before the rest is written
                    server.write(query, 2, "Ana works")
                    server.write(query, 3, "She")  # a retried call starts again
                    server.answer(query, "She works at St. Mary's.")
        assert [e for e, _ in got] == ["text", "text", "text", "answer"]
        assert [d["delta"] for _, d in got[:3]] == ["Ana", " works", "She"]
        assert [d["text"] for _, d in got[:3]] == ["Ana", "Ana works", "She"]
        assert [d["reset"] for _, d in got[:3]] == [False, False, True]
        assert got[-1][1]["answer"] == "She works at St. Mary's." and got[-1][1]["status"] == "answered"
        assert server.cancels == []  # answered: leaving afterwards cancels nothing


async def test_an_sse_reader_that_leaves_before_the_answer_cancels_the_question(
    tmp_path: Path, key_factory: Any
) -> None:
    async with serving(tmp_path, key_factory) as server:
        query = server.ask()
        http = httpx.AsyncClient(base_url=server.url, headers=auth(server.ana_key), timeout=10)
        async with http, http.stream("GET", "/v1/questions/q1/stream") as response:
            server.write(query, 1, "Ana")
            async for event, _ in sse_events(response):
                assert event == "text"
                break  # the client goes away mid-answer
        await until(lambda: bool(server.cancels), "a cancel sent")
        (cancel,) = server.cancels
        assert (cancel.query_id, cancel.user_id, cancel.reason) == ("q1", "ana", "disconnected")


async def test_a_reader_without_the_ask_scope_or_opting_out_cancels_nothing_by_leaving(
    tmp_path: Path, key_factory: Any
) -> None:
    async with serving(tmp_path, key_factory) as server:
        query = server.ask()
        server.write(query, 1, "Ana")
        for key, params in ((server.ana_reader, {}), (server.ana_key, {"cancel_on_disconnect": "false"})):
            http = httpx.AsyncClient(base_url=server.url, headers=auth(key), timeout=10)
            async with http, http.stream("GET", "/v1/questions/q1/stream", params=params) as response:
                async for event, _ in sse_events(response):
                    assert event == "text"
                    break
            # the server saw the reader go; a cancel would have been scheduled then
            await until(lambda: not server.streams.readers, "the reader gone")
            assert not server.streams._pending and server.cancels == []


async def test_the_websocket_streams_the_answer_and_takes_a_cancel(tmp_path: Path, key_factory: Any) -> None:
    async with serving(tmp_path, key_factory) as server:
        query = server.ask()
        # a browser cannot set headers on a WebSocket: the key travels as a subprotocol, never in the URL
        url = f"ws://127.0.0.1:{server.port}/v1/questions/q1/ws"
        async with websockets.connect(url, subprotocols=["memstream", f"bearer.{server.ana_key}"]) as socket:  # type: ignore[list-item]
            assert socket.subprotocol == "memstream"
            server.write(query, 1, "Ana")
            first = json.loads(await asyncio.wait_for(socket.recv(), 10))
            assert first == {"type": "text", "delta": "Ana", "text": "Ana", "reset": False}
            await socket.send("not json")
            error = json.loads(await asyncio.wait_for(socket.recv(), 10))
            assert error["type"] == "error"
            await socket.send(json.dumps({"type": "cancel"}))
            await until(lambda: bool(server.cancels), "the cancel sent")
            server.write(query, 2, "Ana works")
            second = json.loads(await asyncio.wait_for(socket.recv(), 10))
            assert second["text"] == "Ana works"
            server.store.add_answer(
                Answer.to(query, answer="", status=AnswerStatus.CANCELLED, error="cancelled: deleted")
            )
            last = json.loads(await asyncio.wait_for(socket.recv(), 10))
            assert last["type"] == "answer" and last["status"] == "cancelled"
        assert [c.reason for c in server.cancels] == ["deleted"]


async def test_the_websocket_with_a_header_key_and_a_client_that_leaves(tmp_path: Path, key_factory: Any) -> None:
    async with serving(tmp_path, key_factory) as server:
        query = server.ask()
        url = f"ws://127.0.0.1:{server.port}/v1/questions/q1/ws"
        async with websockets.connect(url, additional_headers=auth(server.ana_key)) as socket:
            server.write(query, 1, "Ana")
            assert json.loads(await asyncio.wait_for(socket.recv(), 10))["text"] == "Ana"
        await until(lambda: bool(server.cancels), "a cancel sent")
        assert server.cancels[0].reason == "disconnected"


async def test_the_websocket_refuses_a_missing_or_wrong_credential(tmp_path: Path, key_factory: Any) -> None:
    async with serving(tmp_path, key_factory) as server:
        url = f"ws://127.0.0.1:{server.port}/v1/questions/q1/ws"
        for headers in ({}, auth("msk_not_a_key")):
            with pytest.raises(InvalidStatus) as refused:
                async with websockets.connect(url, additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 403


async def test_another_users_question_is_neither_shown_nor_cancelled(tmp_path: Path, key_factory: Any) -> None:
    async with serving(tmp_path, key_factory) as server:
        query = server.ask()
        server.write(query, 1, "Ana works at St. Mary's")
        async with httpx.AsyncClient(base_url=server.url, headers=auth(server.ben_key), timeout=10) as http:
            async with http.stream("GET", "/v1/questions/q1/stream") as response:
                events = [(e, d) async for e, d in sse_events(response)]
            assert events == [("unavailable", {"query_id": "q1"})]
            deleted = await http.delete("/v1/questions/q1")
            assert deleted.status_code == 404
        url = f"ws://127.0.0.1:{server.port}/v1/questions/q1/ws"
        async with websockets.connect(url, additional_headers=auth(server.ben_key)) as socket:
            await socket.send(json.dumps({"type": "cancel"}))
            message = json.loads(await asyncio.wait_for(socket.recv(), 10))
            assert message == {"type": "unavailable", "query_id": "q1"}
        assert server.cancels == []


async def test_delete_cancels_an_own_unanswered_question_only(tmp_path: Path, key_factory: Any) -> None:
    async with serving(tmp_path, key_factory) as server:
        query = server.ask()
        async with httpx.AsyncClient(base_url=server.url, headers=auth(server.ana_key), timeout=10) as http:
            assert (await http.delete("/v1/questions/unknown")).status_code == 404
            deleted = await http.delete("/v1/questions/q1")
            assert deleted.status_code == 202 and deleted.json() == {"query_id": "q1", "status": "cancelling"}
            assert [(c.query_id, c.reason) for c in server.cancels] == [("q1", "deleted")]
            server.answer(query, "Ana works.")
            assert (await http.delete("/v1/questions/q1")).status_code == 409
        async with httpx.AsyncClient(base_url=server.url, headers=auth(server.ana_reader), timeout=10) as http:
            assert (await http.delete("/v1/questions/q1")).status_code == 403  # cancelling is asking's business
