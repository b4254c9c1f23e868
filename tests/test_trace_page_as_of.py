"""The trace page shows the memory graph as the question saw it: a question asked with an ``as_of`` sends it, and
the neighbourhood request for its evidence carries it; a trace followed from its link takes it from the query.

The page's script runs under Node with the few browser objects it touches stubbed (tests/test_web_ui.py drives the
whole page in Chromium against a running stack); the stubbed ``fetch`` records every request and answers it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

APP = Path(__file__).parents[1] / "streams" / "gateway" / "static" / "app.js"
NODE = shutil.which("node")

HARNESS = r"""
const vm = require("vm");
const fs = require("fs");
const [appPath, scenario] = process.argv.slice(2);
const requests = [];
class Element {
  constructor() {
    this.value = ""; this.dataset = {}; this.textContent = ""; this.disabled = false; this.children = [];
    this.classList = { add() {}, remove() {}, replace() {}, contains: () => false };
  }
  setAttribute() {} addEventListener() {} append() {} replaceChildren() {} scrollIntoView() {}
  querySelector() { return new Element(); } querySelectorAll() { return []; }
  get lastElementChild() { return null; }
}
const elements = new Map();
const document = {
  querySelector: (s) => { if (!elements.has(s)) elements.set(s, new Element()); return elements.get(s); },
  querySelectorAll: () => [], createElement: () => new Element(), createElementNS: () => new Element(),
};
const sse = (events) => events.map(([name, data]) => `event: ${name}\ndata: ${JSON.stringify(data)}\n\n`).join("");
const query = { query_id: "q1", user_id: "ada", question: "Where?", as_of: "2024-03-01T09:02:30Z" };
async function fetch(path, options = {}) {
  requests.push({ path, body: options.body || null });
  if (path === "/v1/stages") return new Response("[]");
  if (path === "/v1/questions") return new Response(JSON.stringify({ query_id: "q1" }), { status: 202 });
  if (path.includes("/stream")) {
    return new Response(scenario === "followed" ? sse([["query", query]]) : "", { status: 200 });
  }
  return new Response(JSON.stringify({ nodes: [], edges: [] }));
}
const context = vm.createContext({
  document, fetch, Response, URLSearchParams, TextDecoderStream, console, setTimeout, AbortController,
  sessionStorage: { getItem: () => "", setItem() {} },
  location: { search: "" }, history: { replaceState() {} }, performance: { now: () => 0 },
  window: {},
});
vm.runInContext(fs.readFileSync(appPath, "utf8"), context);
const answer = { status: "ok", answer: "Siemens", llm_calls: 1, duration_ms: 1, evidence: [{ id: "r_1", text: "t" }] };
const settle = () => new Promise((resolve) => setTimeout(resolve, 0));
(async () => {
  if (scenario === "asked") {
    document.querySelector("#user").value = "ada";
    document.querySelector("#question").value = "Where did Ada work then?";
    document.querySelector("#as-of").value = "2024-03-01T09:02:30";
    await vm.runInContext("ask({ preventDefault() {} })", context);
  } else if (scenario === "now") {
    document.querySelector("#user").value = "ada";
    document.querySelector("#question").value = "Where does Ada work?";
    await vm.runInContext("ask({ preventDefault() {} })", context);
  } else {
    vm.runInContext('follow("q1", "ada")', context);
  }
  for (let i = 0; i < 20; i++) await settle(); // the stream is read and closed
  context.answer = answer;
  vm.runInContext("onAnswer(answer)", context);
  for (let i = 0; i < 5; i++) await settle();
  console.log(JSON.stringify({ requests, shown: document.querySelector("#graph-as-of").textContent }));
})();
"""


def run_page(tmp_path: Path, scenario: str) -> dict[str, Any]:
    assert NODE is not None
    harness = tmp_path / "harness.js"
    harness.write_text(HARNESS)
    done = subprocess.run(
        [NODE, str(harness), str(APP), scenario], capture_output=True, text=True, timeout=60, check=True
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def graph_request(result: dict[str, Any]) -> str:
    [path] = [r["path"] for r in result["requests"] if "/neighbourhood" in r["path"]]
    return str(path)


pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def test_a_question_asked_as_of_a_time_sends_it_and_its_graph_shows_that_time(tmp_path: Path) -> None:
    result = run_page(tmp_path, "asked")
    [asked] = [json.loads(r["body"]) for r in result["requests"] if r["path"] == "/v1/questions"]
    assert asked == {"user_id": "ada", "question": "Where did Ada work then?", "as_of": "2024-03-01T09:02:30.000Z"}
    assert "as_of=2024-03-01T09%3A02%3A30.000Z" in graph_request(result)
    assert result["shown"] == "as it held at 2024-03-01T09:02:30.000Z"


def test_a_question_without_as_of_shows_the_graph_as_it_holds_now(tmp_path: Path) -> None:
    result = run_page(tmp_path, "now")
    [asked] = [json.loads(r["body"]) for r in result["requests"] if r["path"] == "/v1/questions"]
    assert "as_of" not in asked and "as_of" not in graph_request(result)
    assert result["shown"] == "as it holds now"


def test_a_trace_followed_from_its_link_takes_the_as_of_of_its_query(tmp_path: Path) -> None:
    result = run_page(tmp_path, "followed")
    assert "as_of=2024-03-01T09%3A02%3A30Z" in graph_request(result)


def test_a_trace_carries_the_as_of_of_its_question() -> None:
    """What the page takes when it joins a trace at its end (``onEnd``): the question's own as_of."""
    from datetime import UTC, datetime

    from schemas.events import Query
    from services.observability.traces import TraceStore

    then = datetime(2024, 3, 1, 9, 2, 30, tzinfo=UTC)
    store = TraceStore()
    store.add_query(Query(event_id="q1", user_id="ada", event_time=then, question="Where?", as_of=then))
    store.add_query(Query(event_id="q2", user_id="ada", event_time=then, question="Where?"))
    asked, now = store.get("q1"), store.get("q2")
    assert asked is not None and asked.as_of == then
    assert now is not None and now.as_of is None
