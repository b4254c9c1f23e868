"""The trace page at / end to end in headless Chromium (Debian's ``chromium``, driven over the DevTools protocol):
a user asks, the 13 stages of the planning pipeline arrive live, the plan changes, then the answer, its evidence
and their memory-graph neighbourhood show.

The worker runs the real PAI-2 planning pipeline; its LLM is ``planning_llm`` below, a scripted reader that answers
each task from what the prompt shows (a very literal model). The screenshot goes to the test's tmp dir; set
``MEMSTREAM_UI_SCREENSHOT=docs/ui-screenshot.png`` to refresh the one kept in docs/.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiokafka import AIOKafkaProducer

from memstream.runtime import Stack
from schemas.events import Answer, AnswerStatus, ChatMessage, EvidenceTriplet, StageEvent, StageStatus
from services.llm.scripted import MEMORIZE_RULES, ScriptedLLM
from services.ports import LLMRequest
from services.settings import Settings
from streams.codec import encode
from streams.gateway.client import GatewayClient
from streams.topics import TopicNames

pytestmark = [pytest.mark.server, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1440,1000",
    "--hide-scrollbars",
]

CONVERSATION = [
    ("Anna", "I work as a nurse at St. Mary's hospital in Boston."),
    ("Ben", "Congrats! I'm still in Munich, training for the Berlin marathon."),
    ("Anna", "I also adopted a cat called Miso last week."),
    ("Anna", "My sister Clara visits me on Fridays."),
    ("Ben", "Clara told me Miso hates the vet."),
]
# two sub-questions: the first needs two steps and a plan revision (the owner's name replaces "the owner of
# Miso"), the second is not in the memory (its plan runs out: stage 12)
QUESTION = "Where does the owner of Miso work, and what is the name of Ben's dog?"
PLANS = {"Where does the owner of Miso work?": ["Who adopted the cat Miso?", "Where does the owner of Miso work?"]}

# -- the worker's LLM (MEMSTREAM_SCRIPTED_LLM points here) --------------------------------------------------------

_STOP = {"who", "what", "where", "does", "the", "and", "did", "name", "is", "of", "a"}


def _prompt(request: LLMRequest, label: str) -> str:
    """The task's own input: the last user message with ``label`` (a retry appends feedback after it)."""
    return next(m.content for m in reversed(request.messages) if m.role == "user" and f"{label}:" in m.content)


def _line(text: str, label: str) -> str:
    return next(row[len(label) + 2 :] for row in text.splitlines() if row.startswith(f"{label}: "))


def _block(text: str, label: str) -> list[str]:
    rows = text.splitlines()
    out = []
    for row in rows[rows.index(f"{label}:") + 1 :]:
        if not (match := re.match(r"^(?:- |\d+\. )(.*)$", row)):
            break
        out.append(match.group(1))
    return out


def _answers(findings: list[str]) -> list[str]:
    return [f.split(" -> ", 1)[1] for f in findings if " -> " in f and not f.endswith("-> not found")]


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.casefold()) if w not in _STOP and len(w) > 2}


def _clue_answer(request: LLMRequest) -> dict[str, str]:
    text = _prompt(request, "Memory")
    question = _words(_line(text, "Question"))
    scored = sorted(((len(question & _words(m)), m) for m in _block(text, "Memory")), reverse=True)
    if not scored or scored[0][0] < 2:
        return {"evidence": "", "answer": ""}
    return {"evidence": scored[0][1], "answer": scored[0][1]}


def _clue_query(request: LLMRequest) -> dict[str, list[str]]:
    text = _prompt(request, "Matches")
    step = _line(text, "Step")
    queries = []
    for row in _block(text, "Matches"):
        query = step
        for pair in row.split("; "):
            entity, vertex = pair.split(" -> ")
            query = query.replace(entity, vertex)
        queries.append(query)
    return {"queries": queries}


def _sufficiency(request: LLMRequest) -> dict[str, object]:
    text = _prompt(request, "Findings")
    found = _answers(_block(text, "Findings"))
    needed = len(PLANS.get(_line(text, "Question"), [None]))
    return {"sufficient": len(found) >= needed, "answer": found[-1] if len(found) >= needed else ""}


def _enhance(request: LLMRequest) -> dict[str, list[str]]:
    text = _prompt(request, "Remaining")
    owners = [m.group(1) for a in _answers(_block(text, "Done")) if (m := re.search(r"([A-Z]\w+): ", a))]
    steps = _block(text, "Remaining")
    if owners:
        steps = [re.sub(r"the owner of \w+", owners[0], step) for step in steps]
    return {"steps": steps}


def planning_llm() -> ScriptedLLM:
    return ScriptedLLM(
        {
            **MEMORIZE_RULES,
            "decompose": lambda r: {
                "sub_questions": [p.strip() + "?" for p in _split(_line(_prompt(r, "Question"), "Question"))]
            },
            "plan": lambda r: {"steps": PLANS.get(q := _line(_prompt(r, "Question"), "Question"), [q])},
            "ner": lambda r: {"entities": re.findall(r"\b[A-Z][\w'-]+", _line(_prompt(r, "Step"), "Step"))[1:]},
            "clue_query": _clue_query,
            "clue_answer": _clue_answer,
            "step_answer": lambda r: {"found": True, "answer": _answers(_block(_prompt(r, "Findings"), "Findings"))[0]},
            "sufficiency": _sufficiency,
            "enhance": _enhance,
            "combine": lambda r: {
                "found": True,
                "answer": " ".join(_answers(_block(_prompt(r, "Answers"), "Answers"))),
            },
        },
        model="scripted-reader",
        stream=True,  # answers are written a few characters at a time, as a model decodes
        piece_chars=4,
        piece_delay_s=0.05,
    )


def _split(question: str) -> list[str]:
    """'X, and Y?' -> ['X', 'Y'] with Y's first letter capitalised."""
    parts = [p.strip(" ?") for p in question.split(", and ")]
    return [p[0].upper() + p[1:] for p in parts]


class Browser:
    """A headless Chromium and a DevTools-protocol session on its first page."""

    def __init__(self, profile: Path) -> None:
        self.profile = profile
        self.process: asyncio.subprocess.Process | None = None
        self.events: list[dict[str, Any]] = []
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._reader: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        assert CHROMIUM is not None
        self.profile.mkdir(parents=True, exist_ok=True)
        with (self.profile.parent / "chromium.log").open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                CHROMIUM,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={self.profile}",
                "about:blank",
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        port_file = self.profile / "DevToolsActivePort"  # written once the DevTools server listens
        deadline = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.process.returncode is None, "chromium exited; see chromium.log"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            await asyncio.sleep(0.05)  # poll interval of a deadline wait
        port = int(port_file.read_text().split()[0])
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:
            pages = [t for t in await response.json() if t["type"] == "page"]
        self._ws = await self._http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            data = json.loads(message.data)
            future = self._pending.pop(data["id"], None) if "id" in data else None
            if future is None:
                self.events.append(data)
            elif "error" in data:
                future.set_exception(RuntimeError(f"DevTools error: {data['error']}"))
            else:
                future.set_result(data.get("result", {}))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self._ws.send_json({"id": self._next_id, "method": method, "params": params})
        return await asyncio.wait_for(future, 30)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (value := await self.evaluate(expression)):
            assert time.monotonic() < deadline, f"page: {what} not within {timeout_s}s"
            await asyncio.sleep(0.1)  # poll interval of a deadline wait
        return value

    async def open(self, url: str, key: str | None = None) -> None:
        """Load ``url`` with an API key in the tab's sessionStorage, as if typed (default: the stack's admin key)."""
        key = key or os.environ["MEMSTREAM_API_KEY"]
        source = f"sessionStorage.setItem('memstream.key', {json.dumps(key)});"
        await self.send("Page.addScriptToEvaluateOnNewDocument", source=source)
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && window.memstreamReady === true", "page loaded")

    async def screenshot(self) -> bytes:
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        return base64.b64decode(result["data"])

    def errors(self) -> list[str]:
        """JavaScript exceptions, console errors and failed loads the page reported."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(json.dumps(params["args"])[:500])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(params["entry"]["text"][:500])
        return found

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self.process is not None and self.process.returncode is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                os.kill(self.process.pid, signal.SIGKILL)
                await self.process.wait()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Stack]:
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: run scripts/install-test-tools.sh")
    settings = settings_factory(
        tmp_path_factory.mktemp("ui"),
        batch_wait_s=0.1,
        qa_engine="planning",
        scripted_llm="tests.test_web_ui:planning_llm",
        qa_max_steps=3,
    )
    running = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
    asyncio.run(running.start())
    try:
        with admin_key_env(settings):
            start = datetime(2024, 3, 2, 10, 0, tzinfo=UTC)
            messages = [
                ChatMessage(
                    event_id=f"ui-{n}",
                    user_id="alice",
                    event_time=start + timedelta(minutes=n),
                    speaker=speaker,
                    text=text,
                )
                for n, (speaker, text) in enumerate(CONVERSATION)
            ]
            with GatewayClient(running.url) as client:
                client.post_messages(messages)
                deadline = time.monotonic() + 60
                while client.stats("alice")["events"] < len(messages):
                    running.check_children()
                    assert time.monotonic() < deadline, "conversation not memorized in time"
                    time.sleep(0.1)  # poll interval of a deadline wait
            yield running
    finally:
        running.stop()


def run_page(stack: Stack, tmp_path: Path, script: Callable[[Browser], Any]) -> Any:
    async def main() -> Any:
        browser = Browser(tmp_path / "profile")
        try:
            await browser.start()
            return await script(browser)
        finally:
            await browser.close()

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_asking_on_the_page_shows_live_stages_plan_changes_answer_evidence_and_graph(
    stack: Stack, tmp_path: Path
) -> None:
    async def script(browser: Browser) -> dict[str, Any]:
        await browser.open(f"{stack.url}/?user=alice")
        assert await browser.evaluate("document.querySelectorAll('#stages .stage').length") == 13
        await browser.evaluate(
            f"document.querySelector('#question').value = {json.dumps(QUESTION)};"
            "document.querySelector('#ask').click(); true"
        )
        await browser.wait_for("document.querySelector('#answer').dataset.status", "the answer", timeout_s=90)
        await browser.wait_for("Number(document.querySelector('#graph').dataset.nodes || 0) > 0", "the graph")
        await browser.wait_for("window.memstreamEvents.some(e => e.kind === 'end')", "the end of the stream")
        state = await browser.evaluate(
            """(() => {
                const subs = [...document.querySelectorAll('#plan .subq')];
                return {
                    status: document.querySelector('#status').dataset.state,
                    answer: document.querySelector('#answer .text').textContent,
                    evidence: [...document.querySelectorAll('#evidence li')].map(li => li.textContent),
                    seenStages: [...document.querySelectorAll('.stage.seen')].map(li => li.dataset.name),
                    timeline: document.querySelectorAll('#timeline li').length,
                    subQuestions: subs.map(s => s.querySelector('.title').textContent),
                    badges: subs.map(s => s.querySelector('.badge').textContent),
                    revisions: subs.map(s => [...s.querySelectorAll('.revision')]
                        .map(r => [...r.querySelectorAll('li')].map(li => li.firstChild.textContent))),
                    graphNodes: Number(document.querySelector('#graph').dataset.nodes),
                    focusNodes: document.querySelectorAll('#graph circle.focus').length,
                    graphEdges: document.querySelectorAll('#graph line').length,
                    labels: [...document.querySelectorAll('#graph text')].map(t => t.textContent),
                    events: window.memstreamEvents.map(e => e.kind),
                    streamed: window.memstreamEvents.filter(e => e.kind === 'text').map(e => e.chars),
                    url: location.search,
                };
            })()"""
        )
        state["png"] = await browser.screenshot()
        state["errors"] = browser.errors()
        return state

    state = run_page(stack, tmp_path, script)
    png = state["png"]
    (tmp_path / "ui-screenshot.png").write_bytes(png)  # kept for a look when an assertion below fails
    if target := os.environ.get("MEMSTREAM_UI_SCREENSHOT"):
        Path(target).write_bytes(png)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert state["errors"] == []

    # every stage of the planning pipeline ran, and the page showed each run as it arrived, before the answer
    assert len(state["seenStages"]) == 13
    events = state["events"]
    assert state["timeline"] == events.count("stage") > 13
    assert events.index("stage") < events.index("answer") < events.index("end")
    # the answer's text showed as it was written, growing, before the answer event
    assert events.index("text") < events.index("answer") and len(state["streamed"]) >= 3
    assert state["streamed"] == sorted(state["streamed"])
    # the plan: the first sub-question's plan revised with the name found, the second running out of steps
    assert state["subQuestions"] == ["Where does the owner of Miso work?", "What is the name of Ben's dog?"]
    assert state["badges"] == ["answered", "no answer (plan exhausted)"]
    first, second = state["revisions"]
    assert first == [PLANS[QUESTION.split(",")[0] + "?"], ["Who adopted the cat Miso?", "Where does Anna work?"]]
    assert second == [["What is the name of Ben's dog?"]]
    # the answer, its evidence, and the graph they came from
    assert state["status"] == "answered" and "St. Mary's hospital" in state["answer"]
    assert any("St. Mary's hospital" in e for e in state["evidence"])
    assert state["graphNodes"] > state["focusNodes"] >= 2 and state["graphEdges"] >= 1
    assert "Anna" in state["labels"]
    assert "query=" in state["url"]  # the trace can be reopened from the address bar


def test_the_page_does_not_show_another_users_trace(
    stack: Stack, tmp_path: Path, key_factory: Callable[..., str]
) -> None:
    with GatewayClient(stack.url) as client:
        query_id = client.ask("alice", "Where does Anna work now?")
        client.wait_answer(query_id, 30)
    mallory = key_factory(stack.settings, ["mallory"], ["ask", "read"])

    async def script(browser: Browser) -> dict[str, Any]:
        await browser.open(f"{stack.url}/?user=mallory&query={query_id}", key=mallory)
        await browser.wait_for("document.querySelector('#status').dataset.state === 'error'", "the refusal")
        return await browser.evaluate(
            """(() => ({
                answer: document.querySelector('#answer').textContent,
                timeline: document.querySelectorAll('#timeline li').length,
                events: window.memstreamEvents.map(e => e.kind),
            }))()"""
        )

    state = run_page(stack, tmp_path, script)
    assert "St. Mary" not in state["answer"] and state["timeline"] == 0
    assert "stage" not in state["events"] and "answer" not in state["events"]


def planning_trace(query_id: str) -> tuple[list[StageEvent], Answer]:
    """The stage events of a planning-QA run (as services/qa/planning.py emits them) and its answer."""
    t0 = datetime.now(UTC)
    rows: list[tuple[int, str, str | None, str | None, str | None, dict[str, object]]] = [
        (1, "decompose", None, None, None, {"sub_questions": ["Where does Anna work?", "Who is Miso?"]}),
        (2, "plan", "sq1", None, None, {"steps": ["Who employs Anna?", "Where is that employer?"]}),
        (11, "next_step", "sq1", "sq1.s1", None, {"step": "Who employs Anna?"}),
        (3, "ner", "sq1", "sq1.s1", None, {"entities": ["Anna"]}),
        (4, "match", "sq1", "sq1.s1", None, {"matches": {"Anna": ["Anna"]}}),
        (5, "clue_queries", "sq1", "sq1.s1", None, {"clue_queries": ["Who employs Anna?"]}),
        (6, "traversal", "sq1", "sq1.s1", "sq1.s1.c1", {}),
        (7, "filter", "sq1", "sq1.s1", "sq1.s1.c1", {"retrieved": 4}),
        (8, "summarise", "sq1", "sq1.s1", "sq1.s1.c1", {"answer": "St. Mary's hospital"}),
        (8, "summarise", "sq1", "sq1.s1", None, {"answer": "St. Mary's hospital"}),
        (9, "sufficiency", "sq1", "sq1.s1", None, {"sufficient": False}),
        (10, "enhance", "sq1", "sq1.s1", None, {"changed": True, "steps": ["Where is St. Mary's hospital?"]}),
        (11, "next_step", "sq1", "sq1.s3", None, {"step": "Where is St. Mary's hospital?"}),
        (8, "summarise", "sq1", "sq1.s3", None, {"answer": "Boston"}),
        (9, "sufficiency", "sq1", "sq1.s3", None, {"sufficient": True}),
        (2, "plan", "sq2", None, None, {"steps": ["Who is Miso?"]}),
        (11, "next_step", "sq2", "sq2.s1", None, {"step": "Who is Miso?"}),
        (12, "no_answer", "sq2", None, None, {"reason": "step limit"}),
        (13, "combine", None, None, None, {}),
    ]
    events = [
        StageEvent(
            event_id=f"{query_id}-st{n}",
            user_id="alice",
            event_time=t0,
            query_id=query_id,
            trace_id="tr-plan",
            stage=stage,
            stage_name=name,
            sub_question_id=sq,
            step_id=step,
            clue_query_id=clue,
            started_at=t0 + timedelta(milliseconds=20 * n),
            duration_ms=15.0,
            llm_calls=1 if stage in (1, 2, 3, 9, 10, 13) else 0,
            triplets=4 if stage == 6 else 0,
            status=StageStatus.OK,
            detail=detail,
        )
        for n, (stage, name, sq, step, clue, detail) in enumerate(rows)
    ]
    answer = Answer(
        event_id=f"ans_{query_id}",
        user_id="alice",
        event_time=t0,
        query_id=query_id,
        trace_id="tr-plan",
        question="Where does Anna work, and who is Miso?",
        answer="At St. Mary's hospital in Boston.",
        status=AnswerStatus.ANSWERED,
        evidence=[EvidenceTriplet(id="r_none", text="Anna works at St. Mary's hospital")],
    )
    return events, answer


def test_the_page_shows_a_planning_trace_with_its_plan_revisions(stack: Stack, tmp_path: Path) -> None:
    events, answer = planning_trace("q-plan-1")

    async def publish() -> None:
        topics = TopicNames.from_settings(stack.settings)
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
        await producer.start()
        try:
            for event in events:
                await producer.send_and_wait(topics.stages, encode(event), key=b"alice")
            await producer.send_and_wait(topics.answers, encode(answer), key=b"alice")
        finally:
            await producer.stop()

    asyncio.run(publish())  # no query on the queries topic: the worker must not answer this one itself

    async def script(browser: Browser) -> dict[str, Any]:
        await browser.open(f"{stack.url}/?user=alice&query=q-plan-1")
        await browser.wait_for("window.memstreamEvents.some(e => e.kind === 'end')", "the end of the stream")
        state = await browser.evaluate(
            """(() => {
                const subs = [...document.querySelectorAll('#plan .subq')];
                return {
                    titles: subs.map(s => s.querySelector('.title').textContent),
                    badges: subs.map(s => s.querySelector('.badge').textContent),
                    revisions: subs.map(s => s.querySelectorAll('.revision').length),
                    latest: [...subs[0].querySelectorAll('.revision.latest li')]
                        .map(li => [li.className, li.firstChild.textContent]),
                    stepAnswers: [...subs[0].querySelectorAll('.step-answer')].map(e => e.textContent),
                    seen: document.querySelectorAll('.stage.seen').length,
                    timeline: document.querySelectorAll('#timeline li').length,
                    answer: document.querySelector('#answer .text').textContent,
                };
            })()"""
        )
        state["errors"] = browser.errors()
        (tmp_path / "ui-planning.png").write_bytes(await browser.screenshot())
        return state

    state = run_page(stack, tmp_path, script)
    assert state["errors"] == []
    assert state["titles"] == ["Where does Anna work?", "Who is Miso?"]
    assert state["badges"] == ["answered", "no answer (step limit)"]
    assert state["revisions"] == [2, 1]  # the first plan was revised once
    assert state["latest"] == [["done", "Who employs Anna?"], ["done", "Where is St. Mary's hospital?"]]
    assert state["stepAnswers"] == ["→ St. Mary's hospital", "→ Boston"]  # on the steps, as searched
    assert state["seen"] == 13 and state["timeline"] == len(events)
    assert state["answer"] == "At St. Mary's hospital in Boston."
