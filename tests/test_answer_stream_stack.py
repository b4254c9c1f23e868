"""Answers streamed and questions cancelled through the whole stack: the embedded broker, a worker and the gateway
as processes, the rule-based scripted LLM writing its answers a few characters at a time (``streaming_llm``), the
gateway's SSE stream read as it comes, `memstream ask` as a user runs it, DELETE and a client that goes away."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

import pytest

from memstream.runtime import PROJECT_ROOT, Stack
from schemas.events import ChatMessage
from services.llm.scripted import ScriptedLLM, rule_based_llm
from services.settings import Settings
from streams.gateway.client import GatewayClient

pytestmark = [pytest.mark.server, pytest.mark.slow]

QUESTION = "Where does Anna work now?"


def streaming_llm() -> ScriptedLLM:
    """The rule-based scripted LLM, decoding answers 3 characters every 0.1 s (memorize calls do not stream)."""
    llm = rule_based_llm()
    llm.stream, llm.piece_chars, llm.piece_delay_s = True, 3, 0.1
    return llm


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Stack]:
    settings = settings_factory(
        tmp_path_factory.mktemp("answer-stream"), scripted_llm="tests.test_answer_stream_stack:streaming_llm"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMSTREAM_OBS_CANCEL_GRACE_S", "0")  # the children inherit it: a leaver cancels at once
        running = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
        asyncio.run(running.start())
    try:
        with admin_key_env(settings), GatewayClient(running.url) as client:
            now = datetime.now(UTC)
            text = "I just started my new job as a nurse at St. Mary's hospital."
            client.post_messages(
                [ChatMessage(event_id="as-1", user_id="alice", event_time=now, speaker="Anna", text=text)]
            )
            deadline = time.monotonic() + 60
            while client.stats("alice")["events"] < 1:
                running.check_children()
                assert time.monotonic() < deadline, "not memorized within 60 s"
                time.sleep(0.1)  # poll interval of a deadline wait
            yield running
    finally:
        running.stop()


def texts_then_answer(client: GatewayClient, query_id: str) -> list[tuple[str, Any, float]]:
    return [(event, data, time.monotonic()) for event, data in client.answer_events(query_id, 60)]


def test_the_answer_streams_in_pieces_before_the_answer_event(stack: Stack) -> None:
    with GatewayClient(stack.url) as client:
        query_id = client.ask("alice", QUESTION)
        events = texts_then_answer(client, query_id)
        kinds = [e for e, _, _ in events]
        assert kinds[-1] == "answer" and set(kinds[:-1]) == {"text"} and len(kinds) >= 4
        texts = [d["text"] for e, d, _ in events if e == "text"]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
        answer = events[-1][1]
        assert answer["status"] == "answered" and "St. Mary's hospital" in answer["answer"]
        assert texts[-1] == answer["answer"]
        assert events[-1][2] - events[0][2] > 0.5  # the first piece came well before the answer
        assert client.wait_answer(query_id, 5)["answer"] == answer["answer"]  # the answers topic has it whole


def test_memstream_ask_prints_the_answer_once_as_it_is_written(stack: Stack) -> None:
    env = {**os.environ, "MEMSTREAM_URL": stack.url, "PYTHONPATH": str(PROJECT_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "memstream.cli", "ask", QUESTION, "--user", "alice", "--url", stack.url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("St. Mary's hospital") == 1, done.stdout


def test_delete_stops_the_answering_and_the_answer_says_cancelled(stack: Stack) -> None:
    with GatewayClient(stack.url) as client:
        query_id = client.ask("alice", "Where does Anna work these days?")  # not asked before: no cached answer
        stream = client.answer_events(query_id, 60)
        event, _first = next(stream)
        assert event == "text"
        assert client.cancel(query_id) == {"query_id": query_id, "status": "cancelling"}
        rest = list(stream)
        answer = rest[-1][1]
        assert rest[-1][0] == "answer" and answer["status"] == "cancelled" and answer["error"] == "cancelled: deleted"
        trace = client._check(client._request("GET", f"/v1/traces/{query_id}"))
        assert trace["status"] == "cancelled"
        assert "St. Mary's hospital" not in trace["answer_text"]  # the model stopped before it got there
        metrics = client.metrics_text()
    assert _value(metrics, 'memstream_qa_cancelled_total{reason="deleted",when="answering"}') >= 1
    assert _value(metrics, 'memstream_gateway_cancels_total{reason="deleted"}') >= 1


def test_a_client_that_goes_away_cancels_its_question(stack: Stack) -> None:
    with GatewayClient(stack.url) as client:
        query_id = client.ask("alice", "Where does Anna work at the moment?")  # not asked before
        stream = client.answer_events(query_id, 60)
        event, _ = next(stream)
        assert event == "text"
        stream.close()  # the connection closes mid-answer
        answer = client.wait_answer(query_id, 30)
        assert answer["status"] == "cancelled" and answer["error"] == "cancelled: disconnected"


def _value(metrics: str, sample: str) -> float:
    found = re.search(rf"^{re.escape(sample)} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
