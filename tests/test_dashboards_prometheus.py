"""The dashboards against a real Prometheus (Debian's ``prometheus`` package, see scripts/install-test-tools.sh)
scraping a running pipeline that has ingested and answered, failures included: every query of every panel must
return data. The fast tests check the dashboard files themselves.

The worker's scripted LLM (``troubled_llm`` below) fails on purpose where the error panels need it: invalid
extraction output for a message saying POISON, a crash for EXPLODE, invalid answer output for GARBLE, and one
transport error (then success) for FLAKY.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY

from memstream.broker import free_port
from memstream.runtime import Stack
from schemas.events import ChatMessage
from services.llm.scripted import MEMORIZE_RULES, ScriptedLLM, rule_answer, rule_extract
from services.ports import LLMRequest
from services.settings import Settings
from streams.gateway.client import GatewayClient, bearer
from streams.topics import TopicNames

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
PROMETHEUS = shutil.which("prometheus")
BUILT_IN = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}

# -- the scripted LLM the worker loads (MEMSTREAM_SCRIPTED_LLM points here) ----------------------------------------

_flaky_seen: set[str] = set()


def _question(request: LLMRequest) -> str:
    return next(m.content for m in reversed(request.messages) if "QUESTION:" in m.content).rsplit("QUESTION:", 1)[1]


def _extract(request: LLMRequest) -> str | dict[str, Any]:
    if any("POISON" in m.content for m in request.messages):  # retries too: the feedback follows the input
        return "this is not JSON"
    return rule_extract(request)


def _answer(request: LLMRequest) -> str | dict[str, Any]:
    question = _question(request)
    if "EXPLODE" in question:
        raise RuntimeError("the model crashed")
    if "GARBLE" in question:
        return "garbled output"
    if "SLOW" in question:  # a long answer, written slowly: its asker cancels it halfway
        return {"answer": "Anna works " + "and works " * 300, "found": True}
    if "FLAKY" in question and question not in _flaky_seen:
        _flaky_seen.add(question)
        raise ConnectionError("model server unreachable")  # transient: the retry layer tries again
    return rule_answer(request)


def troubled_llm() -> ScriptedLLM:
    rules = {**MEMORIZE_RULES, "extract": _extract, "answer": _answer}
    # answers stream, a few characters every 20 ms (the first-text panel); memorize calls do not stream
    return ScriptedLLM(rules, model="scripted-troubled", stream=True, piece_chars=8, piece_delay_s=0.02)


# -- dashboards as files -


def load_build() -> Any:
    spec = importlib.util.spec_from_file_location("dashboards_build", DASHBOARDS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL with Grafana's variables filled in) for every target of every panel."""
    out = []
    for name, board in dashboards().items():
        values = dict(BUILT_IN)
        for variable in board["templating"]["list"]:
            if variable["type"] != "datasource":
                values[f"${{{variable['name']}}}"] = values[f"${variable['name']}"] = variable["current"]["value"]
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for key in sorted(values, key=len, reverse=True):
                    expr = expr.replace(key, values[key])
                out.append((name, panel["title"], expr))
    return out


def test_the_dashboard_files_are_what_build_py_writes() -> None:
    rendered = load_build().render()
    assert sorted(rendered) == sorted(dashboards()), "dashboards/: run python dashboards/build.py"
    for name, text in rendered.items():
        assert (DASHBOARDS / name).read_text() == text, f"{name} differs: run python dashboards/build.py"


def test_the_five_dashboards_are_well_formed_grafana_json() -> None:
    boards = dashboards()
    titles = {board["title"] for board in boards.values()}
    assert titles == {
        "memstream · Ingestion",
        "memstream · QA stages",
        "memstream · LLM usage and cost",
        "memstream · Kafka lag",
        "memstream · Errors and dead letters",
    }
    assert len({board["uid"] for board in boards.values()}) == len(boards)
    for name, board in boards.items():
        assert board["templating"]["list"][0] == {**board["templating"]["list"][0], "type": "datasource"}
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)) >= 5, name
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, (name, panel["title"])
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], (name, panel["title"])


def test_every_metric_a_dashboard_reads_is_one_memstream_exports() -> None:
    # importing the modules that define metrics registers them
    import services.llm.layers
    import services.metrics
    import services.observability.metrics  # noqa: F401
    import streams.gateway.app  # noqa: F401  (the gateway's own counters)

    exported = set()
    for family in REGISTRY.collect():
        exported |= {family.name, *(s.name for s in family.samples)}
        if family.type == "counter":
            exported.add(f"{family.name}_total")
        if family.type == "histogram":
            exported |= {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    for name, title, expr in panel_queries():
        for metric in re.findall(r"\bmemstream_[a-z_]+", expr):
            assert metric in exported, f"{name} / {title}: {metric} is not a memstream metric"


def test_the_prometheus_configuration_is_valid(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: run scripts/install-test-tools.sh")
    # promtool checks that the scrape's key file exists: the operator writes it beside the configuration
    shutil.copy(DASHBOARDS / "prometheus.yml", tmp_path / "prometheus.yml")
    (tmp_path / "memstream-metrics.key").write_text("msk_example_secret\n")
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


# -- a real Prometheus scraping a real pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Stack]:
    settings = settings_factory(
        tmp_path_factory.mktemp("prom"),
        batch_wait_s=0.1,
        scripted_llm="tests.test_dashboards_prometheus:troubled_llm",
        extraction_attempts=2,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMSTREAM_OBS_LAG_INTERVAL_S", "1")
        running = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
        asyncio.run(running.start())
    try:
        with admin_key_env(settings):
            yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if PROMETHEUS is None:
        pytest.fail("prometheus is not installed: run scripts/install-test-tools.sh")
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"{stack.host}:{stack.port}"]
    (folder / "memstream-metrics.key").write_text(os.environ["MEMSTREAM_API_KEY"])  # /metrics needs a credential
    config["scrape_configs"][0]["authorization"]["credentials_file"] = str(folder / "memstream-metrics.key")
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (folder / "prometheus.log").open("wb") as out:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (folder / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.1)  # poll interval of a deadline wait
        yield url
    finally:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def query(prometheus: str, expr: str) -> list[float]:
    body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    data = body["data"]
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    return [float(sample["value"][1]) for sample in data["result"]]


def wait_until(condition: Callable[[], bool], what: str, stack: Stack, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        stack.check_children()
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.2)  # poll interval of a deadline wait


def as_admin() -> dict[str, str]:
    """The stack's admin key (``admin_key_env`` put it in the environment)."""
    return bearer(os.environ["MEMSTREAM_API_KEY"])


def wave(stack: Stack, n: int) -> None:
    """Ingest (with a poison message, garbage on the topic and an invalid request), then ask (with failures)."""
    now = datetime.now(UTC)

    def message(user: str, text: str, k: int) -> ChatMessage:
        return ChatMessage(event_id=f"w{n}-{user}-{k}", user_id=user, event_time=now, speaker="Anna", text=text)

    with GatewayClient(stack.url) as client:
        client.post_messages(
            [
                message("alice", f"I work as a nurse at St. Mary's hospital (wave {n}).", 1),
                message("alice", f"My cat Miso turned {n} this year.", 2),
                message("alice", "POISON this one cannot be extracted.", 3),
                message("bob", f"I moved to Oslo in wave {n}.", 1),
            ]
        )
        asyncio.run(send_garbage(stack))
        invalid = httpx.post(f"{stack.url}/v1/messages", json=[{"user_id": "alice"}], headers=as_admin())
        assert invalid.status_code == 422
        wait_until(lambda: client.stats("alice")["events"] >= 2 * n, "memorized", stack)

        stream_trace(stack, "alice", "Where does Anna work?")
        asked = [
            client.ask("alice", "Where does Anna work?"),  # the same prompt again: a cache hit
            client.ask("mallory", "Where does Anna work?"),
            client.ask("alice", f"FLAKY {n}: where does Anna work?"),
            client.ask("alice", f"GARBLE {n}"),
            client.ask("alice", f"EXPLODE {n}"),
        ]
        statuses = [client.wait_answer(q, 60)["status"] for q in asked]
        slow = client.ask("alice", f"SLOW {n}: where does Anna work?")
        event, _ = next(client.answer_events(slow, 60))  # the first piece is out: the model is writing
        assert event == "text"
        client.cancel(slow)  # the cancel panel
        statuses.append(client.wait_answer(slow, 60)["status"])
    assert statuses == ["answered", "no_answer", "answered", "error", "error", "cancelled"]


def stream_trace(stack: Stack, user: str, question: str) -> None:
    """Ask while following the trace stream to its end (the trace-stream panel counts these)."""
    with httpx.Client(base_url=stack.url, timeout=60, headers=as_admin()) as http:
        query_id = http.post("/v1/questions", json={"user_id": user, "question": question}).json()["query_id"]
        with http.stream("GET", f"/v1/traces/{query_id}/stream", params={"user_id": user}) as response:
            for line in response.iter_lines():
                if line == "event: end":
                    break


async def send_garbage(stack: Stack) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
    await producer.start()
    try:
        topic = TopicNames.from_settings(stack.settings).chat
        await producer.send_and_wait(topic, b"\x00 not an event", key=b"alice")
    finally:
        await producer.stop()


@pytest.mark.server
@pytest.mark.slow
def test_every_panel_query_returns_data_from_a_running_pipeline(stack: Stack, prometheus: str) -> None:
    wave(stack, 1)
    # Wave 1's series must be in Prometheus before wave 2 adds to them: rates and quantiles need an increase.
    exported = httpx.get(f"{stack.url}/metrics", timeout=10, headers=as_admin()).text
    answers = sum(float(v) for v in re.findall(r"^memstream_qa_answers_total\{[^}]*\} (\S+)$", exported, re.M))
    assert answers >= 5
    wait_until(lambda: sum(query(prometheus, "memstream_qa_answers_total")) >= answers, "wave 1 scraped", stack)
    wave(stack, 2)

    queries = panel_queries()
    missing: list[str] = []

    def all_have_data() -> bool:
        missing.clear()
        for name, title, expr in queries:
            values = query(prometheus, expr)
            if not values or not all(math.isfinite(v) for v in values):
                missing.append(f"{name} / {title}: {expr} -> {values}")
        return not missing

    deadline = time.monotonic() + 60
    while not all_have_data():
        stack.check_children()
        assert time.monotonic() < deadline, "panels without data:\n" + "\n".join(missing)
        time.sleep(0.5)  # poll interval of a deadline wait
    targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert [t["health"] for t in targets] == ["up"]
    assert len(queries) >= 30
