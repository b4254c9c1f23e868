"""Observability: traces assembled from stage events (all 13 stages, nested as the planning pipeline runs them),
streamed live over SSE, log lines carrying the ids of the work they belong to, and consumer lag.

The unit tests feed the trace store by hand; the stack tests run the real thing (embedded broker, a worker and the
gateway as processes, the rule-based scripted LLM) once for the module.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from memstream.broker import EmbeddedBroker
from memstream.runtime import Stack
from schemas.events import Answer, AnswerStatus, EvidenceTriplet, Query, StageEvent, StageStatus
from services.logging import configure_logging, get_logger
from services.observability.context import bind, log_context
from services.observability.traces import TraceStore, Update
from services.settings import Settings
from streams.gateway.client import GatewayClient, bearer
from streams.lag import LagSensor
from streams.topics import ensure_topics

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
QID = "q-trace-1"
TRACE = "tr-1"


class Events:
    """Stage events as the planning pipeline emits them: one clock, one sequence, ids of its sq<n>/.s<n>/.c<n>."""

    def __init__(self, query_id: str = QID, trace_id: str = TRACE) -> None:
        self.query_id = query_id
        self.trace_id = trace_id
        self.items: list[StageEvent] = []
        self.clock_ms = 0.0

    def __call__(
        self,
        stage: int,
        name: str,
        sq: str | None = None,
        step_id: str | None = None,
        clue: str | None = None,
        ms: float = 10.0,
        llm: int = 0,
        triplets: int = 0,
        vertices: int = 0,
        status: StageStatus = StageStatus.OK,
        **detail: object,
    ) -> StageEvent:
        event = StageEvent(
            event_id=f"{self.trace_id}:{len(self.items) + 1}",
            user_id="alice",
            event_time=T0,
            query_id=self.query_id,
            trace_id=self.trace_id,
            stage=stage,
            stage_name=name,
            sub_question_id=sq,
            step_id=step_id,
            clue_query_id=clue,
            started_at=T0 + timedelta(milliseconds=self.clock_ms),
            duration_ms=ms,
            llm_calls=llm,
            tokens_in=100 * llm,
            tokens_out=20 * llm,
            vertices=vertices,
            triplets=triplets,
            status=status,
            detail=detail,
        )
        self.clock_ms += ms + 1
        self.items.append(event)
        return event


def planning_run() -> list[StageEvent]:
    """Two sub-questions: the first needs a plan revision to be answered, the second hits the step limit."""
    e = Events()
    e(1, "decompose", llm=1, sub_questions=["Where does Anna work?", "Where does Ben live?"])
    e(2, "plan", "sq1", llm=1, steps=["Who employs Anna?", "What is Anna's workplace?"])
    e(11, "next_step", "sq1", "sq1.s1", step="Who employs Anna?")
    e(3, "ner", "sq1", "sq1.s1", llm=1, entities=["Anna"])
    e(4, "match", "sq1", "sq1.s1", vertices=2, matches={"Anna": ["Anna"]})
    e(5, "clue_queries", "sq1", "sq1.s1", llm=1, clue_queries=["Who employs Anna?", "Who employs Anna Smith?"])
    e(6, "traversal", "sq1", "sq1.s1", "sq1.s1.c1", triplets=5, vertices=1)
    e(7, "filter", "sq1", "sq1.s1", "sq1.s1.c1", triplets=3, retrieved=5)
    e(8, "summarise", "sq1", "sq1.s1", "sq1.s1.c1", llm=1, answer="St. Mary's hospital")
    e(6, "traversal", "sq1", "sq1.s1", "sq1.s1.c2", status=StageStatus.EMPTY)
    e(7, "filter", "sq1", "sq1.s1", "sq1.s1.c2", status=StageStatus.EMPTY, retrieved=0)
    e(8, "summarise", "sq1", "sq1.s1", "sq1.s1.c2", status=StageStatus.EMPTY)
    e(8, "summarise", "sq1", "sq1.s1", clues_answered=1, answer="St. Mary's hospital")
    e(9, "sufficiency", "sq1", "sq1.s1", llm=1, sufficient=False)
    e(10, "enhance", "sq1", "sq1.s1", llm=1, changed=True, steps=["Is St. Mary's hospital Anna's workplace?"])
    e(11, "next_step", "sq1", "sq1.s3", step="Is St. Mary's hospital Anna's workplace?")
    e(8, "summarise", "sq1", "sq1.s3", answer="yes, as a nurse")
    e(9, "sufficiency", "sq1", "sq1.s3", llm=1, sufficient=True)
    e(2, "plan", "sq2", llm=1, steps=["Where does Ben live?"])
    e(11, "next_step", "sq2", "sq2.s1", step="Where does Ben live?")
    e(10, "enhance", "sq2", "sq2.s1", status=StageStatus.SKIPPED)
    e(12, "no_answer", "sq2", reason="step limit", steps_done=1)
    e(13, "combine", llm=1)
    return e.items


def query(query_id: str = QID, user_id: str = "alice") -> Query:
    return Query(event_id=query_id, user_id=user_id, event_time=T0, question="Where do Anna and Ben work and live?")


def answer(query_id: str = QID, trace_id: str = TRACE, status: AnswerStatus = AnswerStatus.ANSWERED) -> Answer:
    return Answer(
        event_id=f"ans_{query_id}",
        user_id="alice",
        event_time=T0,
        query_id=query_id,
        trace_id=trace_id,
        question="Where do Anna and Ben work and live?",
        answer="Anna works at St. Mary's hospital.",
        status=status,
        evidence=[EvidenceTriplet(id="r_1", text="Anna works at St. Mary's hospital")],
    )


# -- trace assembly -------------------------------------------------------------------------------------------------


def test_a_trace_nests_sub_questions_plan_steps_and_clue_queries() -> None:
    store = TraceStore()
    store.add_query(query())
    events = planning_run()
    for event in events:
        store.add_stage(event)
    trace = store.get(QID)
    assert trace is not None and trace.status == "running" and trace.trace_id == TRACE
    assert trace.question == "Where do Anna and Ben work and live?" and trace.user_id == "alice"
    assert {r.stage for r in trace.timeline} == set(range(1, 14))
    assert [r.seq for r in trace.timeline] == list(range(1, len(events) + 1))
    assert [r.stage_name for r in trace.stages] == ["decompose", "combine"]  # the query-level stages

    sq1, sq2 = trace.sub_questions
    assert (sq1.id, sq1.text, sq2.id, sq2.text) == ("sq1", "Where does Anna work?", "sq2", "Where does Ben live?")
    # the plan as made, then as revised after the first step
    assert [p.revision for p in sq1.plans] == [0, 1]
    assert sq1.plans[0].remaining == ["Who employs Anna?", "What is Anna's workplace?"] and sq1.plans[0].done == []
    assert sq1.plans[1].done == ["Who employs Anna?"]
    assert sq1.plans[1].remaining == ["Is St. Mary's hospital Anna's workplace?"]
    assert sq1.sufficient is True and sq2.no_answer_reason == "step limit"
    assert len(sq2.plans) == 1  # a skipped enhance changes nothing

    s1, s3 = sq1.steps
    assert (s1.id, s1.text, s1.entities, s1.answer) == ("sq1.s1", "Who employs Anna?", ["Anna"], "St. Mary's hospital")
    assert s3.text == "Is St. Mary's hospital Anna's workplace?" and s3.answer == "yes, as a nurse"
    c1, c2 = s1.clue_queries
    assert (c1.id, c1.text, c1.retrieved, c1.kept, c1.answer) == (
        "sq1.s1.c1",
        "Who employs Anna?",
        5,
        3,
        "St. Mary's hospital",
    )
    assert (c2.text, c2.retrieved, c2.kept, c2.answer) == ("Who employs Anna Smith?", 0, 0, None)
    assert [r.stage for r in c1.stages] == [6, 7, 8]
    # the step's own stages, its clue-queries' stages are theirs
    assert [r.stage for r in s1.stages] == [11, 3, 4, 5, 8, 9, 10]

    # timings: each node spans its own and its children's stages
    first, last = events[0], events[-1]
    assert trace.started_at == first.started_at
    assert trace.ended_at == last.started_at + timedelta(milliseconds=last.duration_ms)
    assert s1.started_at is not None and c1.started_at is not None
    assert sq1.started_at == events[1].started_at and s1.started_at < c1.started_at
    assert c1.ended_at is not None and s1.ended_at is not None and c1.ended_at <= s1.ended_at
    assert c1.duration_ms == pytest.approx(10 + 1 + 10 + 1 + 10)
    # LLM usage adds up the tree and per stage
    assert trace.llm.calls == sum(e.llm_calls for e in events) == 10
    assert sq1.llm.calls == 7 and s1.llm.calls == 5 and c1.llm.calls == 1
    assert trace.llm.tokens_in == 1000 and trace.llm_by_stage["summarise"].calls == 1

    store.add_answer(answer())
    done = store.get(QID)
    assert done is not None and done.status == "answered" and done.complete
    assert [e.id for e in done.final_evidence] == ["r_1"]


def test_the_minimal_qa_stages_stay_at_query_level() -> None:
    store = TraceStore()
    e = Events()
    store.add_stage(e(6, "traversal", vertices=4))
    store.add_stage(e(13, "combine", llm=1))
    trace = store.get(QID)
    assert trace is not None and trace.sub_questions == []
    assert [r.stage_name for r in trace.stages] == ["traversal", "combine"]
    assert trace.user_id == "alice" and trace.question is None


def test_redelivered_events_count_once_and_a_rerun_query_shows_its_answered_run() -> None:
    store = TraceStore()
    first, rerun = Events(trace_id="tr-a"), Events(trace_id="tr-b")
    events = [first(6, "traversal"), first(13, "combine", llm=1)]
    for event in [*events, *events]:
        store.add_stage(event)
    trace = store.get(QID)
    assert trace is not None and len(trace.timeline) == 2
    store.add_stage(rerun(6, "traversal"))
    store.add_stage(rerun(13, "combine", llm=2))
    assert (trace := store.get(QID)) is not None and trace.trace_id == "tr-b"  # the latest run, until answered
    store.add_answer(answer(trace_id="tr-a"))
    trace = store.get(QID)
    assert trace is not None and trace.trace_id == "tr-a" and trace.llm.calls == 1


def test_the_store_keeps_the_most_recent_traces() -> None:
    store = TraceStore(capacity=2)
    for n in range(3):
        store.add_query(query(f"q{n}"))
    assert len(store) == 2 and store.get("q0") is None and store.get("q2") is not None


async def test_a_follower_gets_each_update_as_it_arrives_and_stops_after_the_answer() -> None:
    store = TraceStore()
    events = planning_run()[:3]
    got: list[Update] = []
    arrived = asyncio.Event()

    async def follow() -> None:
        async for update in store.follow(QID, heartbeat_s=5):
            assert update is not None
            got.append(update)
            arrived.set()

    follower = asyncio.create_task(follow())  # subscribes before the query exists
    for n, event in enumerate(events, 1):
        arrived.clear()
        store.add_stage(event)
        await asyncio.wait_for(arrived.wait(), 5)
        assert [u.seq for u in got] == list(range(1, n + 1))  # each one delivered before the next was added
    store.add_answer(answer())
    await asyncio.wait_for(follower, 5)
    assert [u.kind for u in got] == ["stage", "stage", "stage", "answer"]

    # a late subscriber replays everything; Last-Event-ID style resumption skips what it saw
    late = [u async for u in store.follow(QID) if u is not None]
    assert [u.seq for u in late] == [1, 2, 3, 4]
    resumed = [u async for u in store.follow(QID, after=2) if u is not None]
    assert [u.seq for u in resumed] == [3, 4]


async def test_a_follower_without_news_gets_heartbeats() -> None:
    stream = TraceStore().follow("nobody", heartbeat_s=0.01)
    assert await asyncio.wait_for(anext(stream), 5) is None
    await stream.aclose()


# -- log context ------------------------------------------------------------------------------------------------------


def test_log_lines_carry_the_bound_ids_and_stdlib_records_are_json_too(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []  # pytest's capture handler would otherwise keep configure_logging from installing its own
    try:
        configure_logging("INFO", json=True)
        with log_context(query_id="q1", user_id="alice", event_id="q1"):
            bind(trace_id="tr-9")
            get_logger("test").info("inside", n=1)
            logging.getLogger("aiokafka").warning("library says %s", "hi")
        get_logger("test").info("outside")
    finally:
        root.handlers = saved
        configure_logging("INFO", json=True)
    lines = [json.loads(line) for line in err.getvalue().splitlines()]
    inside, library, outside = lines
    assert inside["event"] == "inside" and inside["n"] == 1
    for line in (inside, library):
        assert (line["query_id"], line["user_id"], line["event_id"], line["trace_id"]) == ("q1", "alice", "q1", "tr-9")
    assert library["logger"] == "aiokafka" and library["event"] == "library says hi" and library["level"] == "warning"
    assert "trace_id" not in outside and "query_id" not in outside
    assert structlog.contextvars.get_contextvars() == {}


# -- consumer lag (real broker) -


@pytest.mark.server
async def test_lag_is_what_the_group_has_not_committed(broker: EmbeddedBroker, settings: Settings) -> None:
    from prometheus_client import REGISTRY

    await ensure_topics(settings, broker.bootstrap)
    topic = settings.topic("chat")
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
    await producer.start()
    try:
        partitions = [(await producer.send_and_wait(topic, b"x", partition=0)).partition for _ in range(5)]
        await producer.send_and_wait(topic, b"y", partition=1)
    finally:
        await producer.stop()
    assert partitions == [0] * 5
    sensor = LagSensor(broker.bootstrap, "lag-test-group", [topic], interval_s=3600)
    await sensor.start()
    try:
        assert await sensor.sample() == {TopicPartition(topic, 0): 5, TopicPartition(topic, 1): 1}
        # the group commits 3 of partition 0 (a consumer with manual assignment commits without joining)
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id="lag-test-group")
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            await consumer.commit({TopicPartition(topic, 0): 3})
        finally:
            await consumer.stop()
        assert await sensor.sample() == {TopicPartition(topic, 0): 2, TopicPartition(topic, 1): 1}
        assert REGISTRY.get_sample_value("memstream_consumer_lag", {"topic": topic, "partition": "0"}) == 2
    finally:
        await sensor.stop()


# -- the running stack -------------------------------------------------------------------------------------------------

CONVERSATION = [
    ("Anna", "I just started my new job as a nurse at St. Mary's hospital."),
    ("Ben", "I'm still in Munich, training for the Berlin marathon."),
]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Stack]:
    settings = settings_factory(tmp_path_factory.mktemp("obs"), batch_wait_s=0.1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMSTREAM_OBS_LAG_INTERVAL_S", "0.5")  # the children inherit it
        running = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
        asyncio.run(running.start())
    try:
        with admin_key_env(settings):
            with GatewayClient(running.url) as client:
                now = datetime.now(UTC)
                client.post_messages(
                    [_message(f"obs-{n}", speaker, text, now) for n, (speaker, text) in enumerate(CONVERSATION)]
                )
                wait_until(lambda: client.stats("alice")["events"] == len(CONVERSATION), "memorized", running)
            yield running
    finally:
        running.stop()


def _message(event_id: str, speaker: str, text: str, when: datetime) -> Any:
    from schemas.events import ChatMessage

    return ChatMessage(event_id=event_id, user_id="alice", event_time=when, speaker=speaker, text=text)


def as_admin() -> dict[str, str]:
    """The stack's admin key (``admin_key_env`` put it in the environment)."""
    return bearer(os.environ["MEMSTREAM_API_KEY"])


def wait_until(condition: Callable[[], bool], what: str, stack: Stack, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        stack.check_children()
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.1)  # poll interval of a deadline wait


@pytest.fixture(scope="module")
def streamed(stack: Stack) -> dict[str, Any]:
    """One question asked while its trace stream is already open: the SSE events as they came, with times."""

    async def run() -> dict[str, Any]:
        events: list[dict[str, Any]] = []
        async with httpx.AsyncClient(base_url=stack.url, timeout=30, headers=as_admin()) as http:
            # the server makes the query id; the stream, opened at once, replays what happened before it
            asked = await http.post("/v1/questions", json={"user_id": "alice", "question": "Where does Anna work now?"})
            assert asked.status_code == 202
            query_id = asked.json()["query_id"]
            url = f"/v1/traces/{query_id}/stream"
            async with http.stream("GET", url, params={"user_id": "alice"}) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                current: dict[str, Any] = {}
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        current["event"] = line[7:]
                    elif line.startswith("data: "):
                        current["data"] = json.loads(line[6:])
                    elif line.startswith("id: "):
                        current["id"] = int(line[4:])
                    elif not line and current:
                        events.append({**current, "at": time.monotonic()})
                        if current.get("event") == "end":
                            break
                        current = {}
        return {"events": events, "query_id": query_id}

    return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.server
@pytest.mark.slow
def test_a_question_streams_its_stages_live_then_its_answer(streamed: dict[str, Any]) -> None:
    events = streamed["events"]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "query" and kinds[-2:] == ["answer", "end"]
    stages = [e["data"] for e in events if e["event"] == "stage"]
    # whatever QA engine runs, it retrieves (6) and combines (13); the planning one adds the other stages
    assert {"traversal", "combine"} <= {s["stage_name"] for s in stages}
    assert all(s["trace_id"] == stages[0]["trace_id"] for s in stages)
    assert [e["id"] for e in events[:-1]] == list(range(1, len(events)))  # ids for Last-Event-ID
    answer = events[-2]["data"]
    assert answer["status"] == "answered" and "St. Mary's hospital" in answer["answer"]
    trace = events[-1]["data"]
    assert trace["status"] == "answered" and len(trace["timeline"]) == len(stages)


@pytest.mark.server
@pytest.mark.slow
def test_traces_and_graph_neighbourhoods_are_scoped_to_their_user(stack: Stack, streamed: dict[str, Any]) -> None:
    query_id = streamed["query_id"]
    with httpx.Client(base_url=stack.url, timeout=30, headers=as_admin()) as http:
        trace = http.get(f"/v1/traces/{query_id}").json()
        assert trace["query_id"] == query_id and trace["user_id"] == "alice" and trace["question"]
        assert trace["trace_id"] == trace["timeline"][0]["trace_id"]
        assert http.get(f"/v1/traces/{query_id}", params={"user_id": "alice"}).status_code == 200
        assert http.get(f"/v1/traces/{query_id}", params={"user_id": "mallory"}).status_code == 404
        assert http.get("/v1/traces/no-such-query").status_code == 404

        evidence = [e["id"] for e in trace["final_evidence"]]
        assert evidence
        mine = http.get("/v1/graph/alice/neighbourhood", params={"ids": ",".join(evidence)}).json()
        assert set(mine["found"]) == set(evidence)
        focus = {n["id"] for n in mine["nodes"] if n["focus"]}
        assert set(evidence) & {n["id"] for n in mine["nodes"]} or focus
        assert len(mine["nodes"]) > len(focus)  # the neighbourhood, not just the evidence
        names = " ".join(n["name"] for n in mine["nodes"])
        assert "St. Mary's hospital" in names
        ids = {n["id"] for n in mine["nodes"]}
        assert all(e["source"] in ids and e["target"] in ids for e in mine["edges"])

        theirs = http.get("/v1/graph/mallory/neighbourhood", params=[("ids", i) for i in evidence]).json()
        assert theirs == {"user_id": "mallory", "found": [], "nodes": [], "edges": []}
        assert http.get("/v1/graph/not a user!/neighbourhood", params={"ids": "x"}).status_code == 422
        stages = http.get("/v1/stages").json()
        assert [s["stage"] for s in stages] == list(range(1, 14)) and stages[0]["name"] == "decompose"


@pytest.mark.server
@pytest.mark.slow
def test_worker_and_gateway_write_json_logs_with_the_ids_bound(stack: Stack, streamed: dict[str, Any]) -> None:
    def lines(name: str) -> list[dict[str, Any]]:
        text = (stack.log_dir / f"{name}.log").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is JSON

    worker = lines("worker-1")
    trace_id = streamed["events"][-1]["data"]["trace_id"]
    # the LLM layer logs without knowing the query: the ids come from the bound context
    query_id = streamed["query_id"]
    calls = [line for line in worker if line["event"] == "llm_call" and line.get("query_id") == query_id]
    assert calls and all((c["user_id"], c["event_id"], c["trace_id"]) == ("alice", query_id, trace_id) for c in calls)
    memorized = {e for line in worker if line["event"] == "memorized" for e in line.get("event_ids", [])}
    assert {"obs-0", "obs-1"} <= memorized
    assert any(line.get("logger", "").startswith("faust") for line in worker)  # library records are JSON too

    gateway = lines("gateway")
    opened = [line for line in gateway if line["event"] == "trace_stream_opened"]
    assert opened and opened[0]["query_id"] == query_id and opened[0]["path"].endswith("/stream")
    assert len(opened[0]["request_id"]) == 32


@pytest.mark.server
@pytest.mark.slow
def test_metrics_cover_lag_qa_and_traces(stack: Stack, streamed: dict[str, Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, list[Any]]:
        text = httpx.get(f"{stack.url}/metrics", timeout=10, headers=as_admin()).text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    wait_until(lambda: "memstream_consumer_lag" in samples(), "lag sampled", stack)
    found = samples()
    lag = {(s.labels["topic"], s.labels["partition"]): s.value for s in found["memstream_consumer_lag"]}
    topics = stack.settings
    assert {(topics.topic(t), str(p)) for t in ("chat", "documents", "queries") for p in range(2)} <= set(lag)
    answered = [s for s in found["memstream_qa_answers"] if s.name.endswith("_total")]
    assert any(s.labels["status"] == "answered" and s.value >= 1 for s in answered)
    assert any(s.labels["stage_name"] == "combine" for s in found["memstream_trace_stage_events"])
    assert any(s.name.endswith("_count") and s.value >= 1 for s in found["memstream_ingest_to_queryable_seconds"])
    streams = [s for s in found["memstream_trace_streams"] if s.name.endswith("_total")]
    assert any(s.labels["outcome"] == "answered" for s in streams)
