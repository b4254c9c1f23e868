"""The `memstream` command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import typer
from tqdm import tqdm

from services.logging import configure_logging
from services.settings import Settings

app = typer.Typer(
    name="memstream",
    help="PersonalAI 2.0 graph memory for LLM agents, as a streaming pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

UrlOption = Annotated[
    str | None,
    typer.Option("--url", envvar="MEMSTREAM_URL", help="gateway URL (default: http://MEMSTREAM_HOST:MEMSTREAM_PORT)"),
]

KeyOption = Annotated[
    str | None,
    typer.Option(
        "--key", envvar="MEMSTREAM_API_KEY", help="API key (msk_...) or bearer token; `memstream up` prints one"
    ),
]


class FileFormat(StrEnum):
    AUTO = "auto"
    LOCOMO = "locomo"
    JSONL = "jsonl"
    SLACK_EXPORT = "slack-export"
    TELEGRAM_EXPORT = "telegram-export"


UserOption = Annotated[str, typer.Option("--user", "-u", help="user id (tenant)")]


def _settings() -> Settings:
    settings = Settings()
    configure_logging(settings.log_level, settings.log_json)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the CLI's own output
    return settings


def _url(settings: Settings, url: str | None) -> str:
    return url or f"http://{settings.host}:{settings.port}"


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(message, err=True, fg=typer.colors.RED)
    return typer.Exit(code)


#: how long `up --demo` waits for memorize and for the answer: a small local model on a busy CPU takes minutes a call
DEMO_MEMORIZE_TIMEOUT_S = 1800.0
DEMO_ANSWER_TIMEOUT_S = 1800.0
#: a progress line at least this often while the demo waits
DEMO_PROGRESS_EVERY_S = 15.0
# once memory holds every message, how long the demo waits for the backlog to read 0: a worker commits its offsets
# about a second after it writes memory, and the lag sensor measures them then
DEMO_DRAIN_SHOWN_S = 5.0
REPLAY_HINT = "memstream dead-letters replay --all"


@app.command()
def up(
    port: Annotated[int | None, typer.Option(help="gateway port (default MEMSTREAM_PORT)")] = None,
    host: Annotated[str | None, typer.Option(help="gateway address (default MEMSTREAM_HOST)")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Faust worker processes")] = 1,
    demo: Annotated[bool, typer.Option(help="ingest a short sample chat and ask a question once ready")] = False,
    demo_memorize_timeout: Annotated[
        float,
        typer.Option(
            min=1.0,
            envvar="MEMSTREAM_DEMO_MEMORIZE_TIMEOUT_S",
            help="seconds the demo waits for every sample message to be memorized or dead-lettered",
        ),
    ] = DEMO_MEMORIZE_TIMEOUT_S,
    demo_answer_timeout: Annotated[
        float,
        typer.Option(min=1.0, envvar="MEMSTREAM_DEMO_ANSWER_TIMEOUT_S", help="seconds the demo waits for the answer"),
    ] = DEMO_ANSWER_TIMEOUT_S,
) -> None:
    """Start the broker (embedded unless MEMSTREAM_BROKER is set), the worker(s) and the gateway; Ctrl-C stops."""
    from memstream.runtime import StartupError
    from memstream.runtime import up as run_up
    from streams.gateway.keys import ensure_admin_key, keys_file

    settings = _settings()
    gateway_host, gateway_port = host or settings.host, port or settings.port
    log_dir = settings.data_dir / "logs"
    admin_key = ensure_admin_key(settings)
    if admin_key is not None:
        typer.secho(
            f"admin API key (shown this once; only its hash is kept, in {keys_file(settings)}):\n  {admin_key}\n"
            "  export MEMSTREAM_API_KEY=<it> for the CLI; `memstream keys create` makes keys for users",
            fg=typer.colors.YELLOW,
        )

    async def on_ready(url: str) -> None:
        typer.echo(f"memstream is up: {url}  (logs in {log_dir}; Ctrl-C stops)")
        if demo:
            with _demo_key(settings, admin_key) as key:
                await _demo(
                    url,
                    log_dir,
                    memorize_timeout_s=demo_memorize_timeout,
                    answer_timeout_s=demo_answer_timeout,
                    api_key=key,
                )

    try:
        asyncio.run(run_up(settings, gateway_host, gateway_port, workers, on_ready))
    except StartupError as exc:
        raise _fail(f"memstream up failed: {exc}") from exc
    typer.echo("memstream stopped")


@contextlib.contextmanager
def _demo_key(settings: Settings, admin_key: str | None) -> Iterator[str]:
    """The key the demo uses: the admin key just made, MEMSTREAM_API_KEY, or else a key for the demo user alone,
    revoked when the demo ends."""
    from services.ingest.sample import DEMO_USER
    from streams.gateway.keys import KeyStore

    given = admin_key or os.environ.get("MEMSTREAM_API_KEY")
    if given:
        yield given
        return
    store = KeyStore.of(settings)
    record, key = store.create([DEMO_USER], ["write", "ask", "read", "metrics"], label="demo (revoked after it)")
    try:
        yield key
    finally:
        store.revoke(record.key_id)


async def _demo(
    url: str,
    log_dir: Path | None = None,
    *,
    memorize_timeout_s: float = DEMO_MEMORIZE_TIMEOUT_S,
    answer_timeout_s: float = DEMO_ANSWER_TIMEOUT_S,
    progress_every_s: float = DEMO_PROGRESS_EVERY_S,
    poll_s: float = 2.0,
    echo: Callable[[str], None] = typer.echo,
    transport: httpx.AsyncBaseTransport | None = None,
    api_key: str | None = None,
) -> bool:
    """Send the sample chat, wait until each message is memorized or dead-lettered (``memorize_timeout_s``), show
    what memory holds and what failed, then ask the sample question and wait for the answer (``answer_timeout_s``).
    A progress line comes whenever something changes, and at least every ``progress_every_s``. True if all went
    well."""
    from services.ingest.sample import DEMO_QUESTION, DEMO_USER, demo_messages

    messages = demo_messages()
    logs = f"{log_dir} (worker-*.log: memorize and QA, gateway.log)" if log_dir else "the worker's log"
    from streams.gateway.client import bearer

    async with httpx.AsyncClient(base_url=url, timeout=60.0, transport=transport, headers=bearer(api_key)) as http:
        run = _DemoRun(http, echo, progress_every_s, poll_s)
        before = await run.dead_letter_records(DEMO_USER)
        body = [m.model_dump(mode="json", exclude={"ingest_time"}) for m in messages]
        try:
            (await http.post("/v1/messages", json=body)).raise_for_status()
        except httpx.HTTPError as exc:
            echo(f"demo: could not send the sample chat: {exc!r}; logs: {logs}")
            return False
        run.sent_at = time.time()  # the broker holds them: a backlog measured from now on counts them
        echo(
            f"demo: sent {len(messages)} messages for user {DEMO_USER!r}; memorizing them with the LLM "
            f"(up to {memorize_timeout_s:.0f}s; one call of a small local model on a busy CPU can take minutes; "
            f"logs: {logs})"
        )
        wanted = [m.event_id for m in messages]
        memorized, dead, finished = await run.wait_memorized(DEMO_USER, wanted, before, memorize_timeout_s)
        await run.report_memory(DEMO_USER)
        if not finished:
            pending = len(wanted) - memorized - len(dead)
            echo(
                f"demo: memorize did not finish within {memorize_timeout_s:.0f}s: {pending} of {len(wanted)} "
                "messages still pending (the worker goes on in the background); more time: "
                "--demo-memorize-timeout or MEMSTREAM_DEMO_MEMORIZE_TIMEOUT_S"
            )
        if dead:
            echo(f"demo: {len(dead)} of {len(wanted)} messages were dead-lettered:")
            letters = {v["event_id"]: v for v in dead.values()}.values()
            for letter in sorted(letters, key=lambda v: v["failed_event_ids"]):
                echo(
                    f"demo:   {', '.join(letter['failed_event_ids'])}: {letter['reason']} after "
                    f"{letter['attempts']} attempt(s): {str(letter['error'])[:300]}"
                )
            echo(f"demo: once the cause is fixed, replay them: {REPLAY_HINT} --user {DEMO_USER}")
        if dead or not finished:
            echo(f"demo: logs: {logs}")
        if memorized == 0:
            echo("demo: nothing was memorized, so no question is asked")
            return False
        answered = await run.ask(DEMO_USER, DEMO_QUESTION, answer_timeout_s, logs)
        return answered and finished and not dead


class _DemoRun:
    """The demo's polling of the gateway: stats, dead letters, /metrics, answers and traces."""

    def __init__(
        self, http: httpx.AsyncClient, echo: Callable[[str], None], progress_every_s: float, poll_s: float
    ) -> None:
        self.http = http
        self.echo = echo
        self.progress_every_s = progress_every_s
        self.poll_s = poll_s
        self.loop = asyncio.get_running_loop()
        self.sent_at: float | None = None  # unix time the messages were accepted

    async def _get(self, path: str, **params: Any) -> Any:
        """The JSON of a GET, or None if the gateway did not answer it (a busy machine: try again next poll)."""
        try:
            response = await self.http.get(path, params=params)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    async def _pause(self, deadline: float) -> None:
        await asyncio.sleep(max(0.0, min(self.poll_s, deadline - self.loop.time())))

    async def dead_letter_records(self, user_id: str, wait_s: float = 60.0) -> dict[str, int]:
        """Records seen so far per dead letter of the user, once the gateway has read the topic's backlog: a
        later record of a dead letter is a failure of this run."""
        deadline = self.loop.time() + wait_s
        while True:
            page = await self._get("/v1/dead-letters", user_id=user_id, limit=1000)
            if page is not None and (page.get("complete") or self.loop.time() >= deadline):
                return {d["event_id"]: int(d["records"]) for d in page["dead_letters"]}
            if self.loop.time() >= deadline:
                return {}
            await self._pause(deadline)

    async def _metrics(self) -> str | None:
        try:
            response = await self.http.get("/metrics")
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def llm_summary(self) -> str:
        text = await self._metrics()
        return "LLM calls: unknown" if text is None else _llm_summary(text, self.sent_at)

    async def drain_shown(self) -> bool:
        """The backlog measured after the send reads 0, or there is no lag sensor to wait for."""
        from streams.lag import catch_up_from_metrics, measured_since

        text = await self._metrics()
        if text is None:
            return False
        catch_up = catch_up_from_metrics(text)
        if "backlog" not in catch_up:
            return True
        return catch_up["backlog"] == 0 and measured_since(catch_up, self.sent_at)

    async def wait_memorized(
        self, user_id: str, wanted: Sequence[str], before: dict[str, int], timeout_s: float
    ) -> tuple[int, dict[str, dict[str, Any]], bool]:
        """(messages memorized, failed event id -> its new dead letter, finished) once every message of ``wanted``
        is memorized or dead-lettered, or at the deadline."""
        start = self.loop.time()
        deadline = start + timeout_s
        last_line, last_at = "", start
        memorized, dead = 0, {}
        while True:
            stats = await self._get(f"/v1/stats/{user_id}")
            page = await self._get("/v1/dead-letters", user_id=user_id, status="dead", limit=1000)
            if stats is not None:
                # the demo's user holds only the demo's messages (their ids are fixed, so a rerun adds none)
                memorized = min(int(stats.get("events", 0)), len(wanted))
            if page is not None:
                dead = {
                    event_id: letter
                    for letter in page["dead_letters"]
                    if letter["records"] > before.get(letter["event_id"], 0)
                    for event_id in letter["failed_event_ids"]
                    if event_id in wanted
                }
            done = memorized + len(dead) >= len(wanted)
            if done:  # the last line shows the drain too (within DEMO_DRAIN_SHOWN_S)
                shown_by = min(deadline, self.loop.time() + DEMO_DRAIN_SHOWN_S)
                while self.loop.time() < shown_by and not await self.drain_shown():
                    await self._pause(shown_by)
            now = self.loop.time()
            line = f"memorized {memorized}/{len(wanted)}, dead-lettered {len(dead)}, {await self.llm_summary()}"
            if line != last_line or now - last_at >= self.progress_every_s or done:
                self.echo(f"demo: [{now - start:5.0f}s] {line}")
                last_line, last_at = line, now
            if done:
                return memorized, dead, True
            if now >= deadline:
                return memorized, dead, False
            await self._pause(deadline)

    async def report_memory(self, user_id: str) -> None:
        stats = await self._get(f"/v1/stats/{user_id}")
        if stats is None:
            self.echo("demo: memory: the gateway did not answer /v1/stats")
            return
        vertices = ", ".join(f"{v} {k}" for k, v in sorted(stats.get("vertices", {}).items())) or "no vertices"
        self.echo(
            f"demo: memory of {user_id!r}: {stats.get('events', 0)} events, {stats.get('theses_valid', 0)} valid "
            f"theses, {vertices}, {sum(stats.get('edges', {}).values())} edges"
        )

    async def ask(self, user_id: str, question: str, timeout_s: float, logs: str) -> bool:
        try:
            response = await self.http.post("/v1/questions", json={"user_id": user_id, "question": question})
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self.echo(f"demo: could not ask the question: {exc!r}; logs: {logs}")
            return False
        query_id = response.json()["query_id"]
        self.echo(f"demo: Q: {question}  (answering; up to {timeout_s:.0f}s)")
        start = self.loop.time()
        deadline = start + timeout_s
        last_at = start
        while (left := deadline - self.loop.time()) > 0:
            asked_at = self.loop.time()
            answer = await self._get(f"/v1/answers/{query_id}", wait=min(10.0, max(0.1, left)))
            if answer is not None:
                if answer.get("status") == "error":
                    self.echo(f"demo: answering failed: {answer.get('error')}; logs: {logs}")
                    return False
                self.echo(f"demo: A: {answer['answer']}  ({answer.get('status')})")
                return True
            now = self.loop.time()
            if now - last_at >= self.progress_every_s:
                trace = await self._get(f"/v1/traces/{query_id}")
                stages = len(trace.get("timeline", [])) if trace else 0
                self.echo(
                    f"demo: [{now - start:5.0f}s] waiting for the answer: {stages} QA stage run(s) done, "
                    f"{await self.llm_summary()}"
                )
                last_at = now
            if now - asked_at < self.poll_s:  # a gateway that did not long-poll: do not spin
                await self._pause(deadline)
        self.echo(
            f"demo: no answer within {timeout_s:.0f}s (the worker goes on; later: memstream ask {question!r} "
            f"--user {user_id}); more time: --demo-answer-timeout or MEMSTREAM_DEMO_ANSWER_TIMEOUT_S; logs: {logs}"
        )
        return False


def _llm_summary(metrics_text: str, sent_at: float | None = None) -> str:
    """LLM calls done so far, by outcome, and their mean latency, from the gateway's /metrics; then the memorize
    backlog (``sent_at``: a measure from before the messages were sent says so)."""
    from prometheus_client.parser import text_string_to_metric_families

    outcomes: Counter[str] = Counter()
    seconds, timed = 0.0, 0.0
    rejected: int | None = None
    in_flight = 0
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name == "memstream_llm_calls_total":
                    outcomes[sample.labels.get("outcome", "?")] += int(sample.value)
                elif sample.name == "memstream_llm_in_flight":
                    in_flight += int(sample.value)
                elif sample.name == "memstream_llm_rejected_outputs_total":
                    rejected = (rejected or 0) + int(sample.value)
                elif sample.name == "memstream_llm_latency_seconds_sum":
                    seconds += sample.value
                elif sample.name == "memstream_llm_latency_seconds_count":
                    timed += sample.value
    except ValueError:
        return "LLM calls: unknown"
    failed, cached = outcomes["error"] + outcomes["cancelled"], outcomes["cached"]
    text = f"LLM calls in flight: {in_flight}, done: {sum(outcomes.values())} "
    text += f"({outcomes['ok']} ok, {failed} failed, {cached} cached)"
    if rejected is not None:
        text += f", {rejected} output(s) rejected"
    if timed:
        text += f", {seconds / timed:.1f}s per call"
    from streams.lag import catch_up_from_metrics, catch_up_line

    return f"{text}; {catch_up_line(catch_up_from_metrics(metrics_text), since=sent_at)}"


@app.command()
def worker(
    bootstrap: Annotated[str | None, typer.Option(help="Kafka bootstrap servers (default MEMSTREAM_BROKER)")] = None,
    web_port: Annotated[int | None, typer.Option(help="port for Faust's web server, one per worker")] = None,
) -> None:
    """Run one Faust worker (memorize and QA agents) until SIGINT/SIGTERM."""
    from streams.worker import run_worker

    settings = _settings()
    if not (bootstrap or settings.broker):
        raise _fail("no broker: set MEMSTREAM_BROKER or --bootstrap (or use `memstream up`)")
    asyncio.run(run_worker(settings, bootstrap, web_port=web_port))


@app.command()
def gateway(
    bootstrap: Annotated[str | None, typer.Option(help="Kafka bootstrap servers (default MEMSTREAM_BROKER)")] = None,
    host: Annotated[str | None, typer.Option(help="listen address (default MEMSTREAM_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="listen port (default MEMSTREAM_PORT)")] = None,
) -> None:
    """Run the HTTP gateway."""
    from streams.gateway.server import serve_gateway

    settings = _settings()
    if not (bootstrap or settings.broker):
        raise _fail("no broker: set MEMSTREAM_BROKER or --bootstrap (or use `memstream up`)")
    asyncio.run(serve_gateway(settings, bootstrap, host, port))


@app.command()
def ingest(
    file: Annotated[
        Path,
        typer.Argument(
            exists=True, dir_okay=False, help="LoCoMo JSON or JSONL chat, a Slack export ZIP or a Telegram result.json"
        ),
    ],
    user: UserOption,
    url: UrlOption = None,
    key: KeyOption = None,
    fmt: Annotated[FileFormat, typer.Option("--format", help="file format")] = FileFormat.AUTO,
    sample: Annotated[list[str] | None, typer.Option(help="LoCoMo sample_id to ingest (repeatable)")] = None,
    batch: Annotated[int, typer.Option(min=1, max=1000, help="messages per request")] = 100,
    ids: Annotated[
        bool, typer.Option("--ids", help="print each message's event id (what `memstream forget --message` takes)")
    ] = False,
    slack_team: Annotated[
        str | None, typer.Option(help="Slack export: the workspace's team id, where its messages do not say it")
    ] = None,
) -> None:
    """Stream a conversation file to the gateway, in batches, with a progress bar."""
    from services.ingest import LoaderError, load_conversation
    from streams.gateway.client import GatewayClient, GatewayError

    settings = _settings()
    kind = fmt.value
    if kind == "auto" and file.suffix.lower() == ".zip":
        kind = "slack-export"
    if kind in ("slack-export", "telegram-export"):
        _ingest_export(GatewayClient(_url(settings, url), api_key=key), file, user, kind, slack_team, batch)
        return
    if kind == "auto" and file.suffix.lower() in (".md", ".markdown", ".html", ".htm", ".pdf", ".txt"):
        _ingest_document(GatewayClient(_url(settings, url), api_key=key), file, user, settings)
        return
    try:
        text_formats: dict[str, Literal["auto", "locomo", "jsonl"]] = {"locomo": "locomo", "jsonl": "jsonl"}
        messages = load_conversation(
            file, user, text_formats.get(kind, "auto"), samples=set(sample) if sample else None
        )
    except LoaderError as exc:
        raise _fail(str(exc)) from exc
    if not messages:
        raise _fail(f"{file}: no messages found")
    client = GatewayClient(_url(settings, url), api_key=key)
    with client, tqdm(total=len(messages), unit="msg", desc="ingest") as bar:
        try:
            for start in range(0, len(messages), batch):
                chunk = messages[start : start + batch]
                client.post_messages(chunk)
                bar.update(len(chunk))
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    conversations = ", ".join(dict.fromkeys(m.conversation_id for m in messages))
    typer.echo(f"sent {len(messages)} messages for user {user!r} (conversation {conversations})")
    if ids:
        for m in messages:
            typer.echo(f"{m.event_id}\t{m.speaker}: {m.text[:80]}")


def _ingest_document(client: Any, file: Path, user: str, settings: Settings) -> None:
    """A Markdown, HTML, PDF or text file as overlapping parts of one document, with a progress bar."""
    import hashlib
    from datetime import UTC, datetime

    from services.ingest.documents import SUFFIXES, Unreadable, Upload, document_parts, extract
    from streams.gateway.client import GatewayError

    data = file.read_bytes()
    kind = SUFFIXES[file.suffix.lower()]
    upload = Upload(user, f"doc_{hashlib.sha256(data).hexdigest()[:32]}", file.stem[:200], datetime.now(UTC))
    try:
        parts = document_parts(
            upload, extract(data, kind), settings.document_part_tokens, settings.document_part_overlap_tokens
        )
    except Unreadable as exc:
        raise _fail(f"{file}: {exc}") from exc
    with client, tqdm(total=len(parts), unit="part", desc=f"ingest {kind}") as bar:
        try:
            for start in range(0, len(parts), 20):
                chunk = parts[start : start + 20]
                client.post_documents(chunk)
                bar.update(len(chunk))
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    typer.echo(f"sent {file.name} as document {upload.document_id} in {len(parts)} parts for user {user!r}")


def _ingest_export(client: Any, file: Path, user: str, kind: str, team: str | None, batch: int) -> None:
    """A platform's export through ``/v1/imports``: idempotent with the live connector (see docs/connectors.md)."""
    from services.ingest.exports import ExportError, slack_export, telegram_export
    from streams.gateway.client import GatewayError

    try:
        posts = slack_export(file, team) if kind == "slack-export" else telegram_export(file)
    except ExportError as exc:
        raise _fail(str(exc)) from exc
    if not posts:
        raise _fail(f"{file}: no messages found")
    platform = "slack" if kind == "slack-export" else "telegram"
    totals = {"messages": 0, "forgotten": 0, "already": 0}
    with client, tqdm(total=len(posts), unit="msg", desc=f"import {platform}") as bar:
        try:
            for start in range(0, len(posts), batch):
                chunk = posts[start : start + batch]
                done = client.post_import(platform, user, chunk)
                for name in totals:
                    totals[name] += int(done[name])
                bar.update(len(chunk))
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    typer.echo(
        f"imported {len(posts)} {platform} messages for user {user!r}: {totals['messages']} new, "
        f"{totals['already']} already in memory, {totals['forgotten']} older versions replaced"
    )


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="the question")],
    user: UserOption,
    as_json: Annotated[bool, typer.Option("--json", help="print the whole answer event as JSON")] = False,
    trace: Annotated[bool, typer.Option("--trace", help="print the QA stage events as they arrive")] = False,
    as_of: Annotated[
        str | None, typer.Option("--as-of", help="answer with what was valid then (ISO-8601, e.g. 2023-06-01)")
    ] = None,
    retriever: Annotated[str | None, typer.Option(help="beamsearch, watercircles, astar, flat, tog2, ...")] = None,
    max_clue_queries: Annotated[int | None, typer.Option(min=1, max=8)] = None,
    top_k: Annotated[
        int | None, typer.Option(min=1, max=50, help="memory items shown to the model per retrieval")
    ] = None,
    enhancement: Annotated[bool | None, typer.Option("--enhancement/--no-enhancement")] = None,
    decomposition: Annotated[bool | None, typer.Option("--decomposition/--no-decomposition")] = None,
    episodic: Annotated[bool | None, typer.Option("--episodic/--no-episodic", help="episode text in context")] = None,
    url: UrlOption = None,
    key: KeyOption = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the answer")] = 300.0,
    stream: Annotated[
        bool, typer.Option("--stream/--no-stream", help="print the answer as it is written (Ctrl-C cancels it)")
    ] = True,
) -> None:
    """Ask a question about a user's memory and print the answer as it is written."""
    from streams.gateway.client import GatewayClient, GatewayError

    settings = _settings()
    options = {
        "retriever": retriever,
        "max_clue_queries": max_clue_queries,
        "filter_top_k": top_k,
        "plan_enhancement": enhancement,
        "decomposition": decomposition,
        "episodic_context": episodic,
    }
    fields: dict[str, Any] = {"options": {k: v for k, v in options.items() if v is not None}}
    if as_of is not None:
        fields["as_of"] = as_of if "T" in as_of else f"{as_of}T00:00:00Z"
    printed = ""
    with GatewayClient(_url(settings, url), api_key=key) as client:
        try:
            query_id = client.ask(user, question, **fields)
            if trace:
                _print_trace(client, query_id, user, timeout)
            if stream and not as_json:
                try:
                    printed = _print_streamed(client, query_id, timeout)
                except GatewayError as exc:  # the answer is still waited for below
                    typer.echo(f"(the answer could not stream: {exc}; waiting for it whole)", err=True)
                except KeyboardInterrupt:  # the asker gave up: the model stops at its next token
                    with contextlib.suppress(GatewayError):
                        client.cancel(query_id)
                    typer.echo("\ncancelled", err=True)
                    raise typer.Exit(130) from None
            answer = client.wait_answer(query_id, timeout)
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(answer, indent=2, ensure_ascii=False))
    elif answer.get("status") in ("error", "cancelled"):
        typer.echo(f"{answer['status']}: {answer.get('error')}", err=True)
    elif answer["answer"] != printed:  # not streamed, or revised after the text streamed
        typer.echo(answer["answer"])
    if answer.get("status") in ("error", "cancelled"):
        raise typer.Exit(2)


def _print_streamed(client: Any, query_id: str, timeout: float) -> str:
    """Print the answer's text as the model writes it; returns what stands printed (a line of its own), "" when
    nothing streamed. A retried call that starts again goes on a new line."""
    shown = ""
    for event, data in client.answer_events(query_id, timeout):
        if event != "text":
            break
        if data["reset"] and shown:
            typer.echo("")
        typer.echo(data["delta"], nl=False)  # click flushes: each piece shows as it comes
        shown = data["text"]
    if shown:
        typer.echo("")
    return shown


def _print_trace(client: Any, query_id: str, user: str, timeout: float) -> None:
    for event, data in client.trace_events(query_id, user, timeout):
        if event != "stage":
            continue
        where = " ".join(
            f"{key.split('_')[0]}={data[key]}"
            for key in ("sub_question_id", "step_id", "clue_query_id")
            if data.get(key)
        )
        typer.echo(
            f"[{data.get('stage', '?'):>2}] {data.get('stage_name', '?'):<22} {data.get('status', '?'):<7} "
            f"{float(data.get('duration_ms', 0)):8.1f} ms  llm={data.get('llm_calls', 0)} "
            f"triplets={data.get('triplets', 0)} {where}",
            err=True,
        )


@app.command("eval")
def eval_(
    dataset: Annotated[str, typer.Argument(help="locomo, mine, hotpotqa, musique or 2wiki")],
    data: Annotated[
        Path | None, typer.Option(help="a file of the dataset's format (default: its file in --data-dir)")
    ] = None,
    corpus: Annotated[Path | None, typer.Option(help="2wiki: the passages file")] = None,
    data_dir: Annotated[Path, typer.Option(help="the shared evaluation data")] = Path("../shared/data"),
    results: Annotated[Path | None, typer.Option(help="results folder (default: eval-results/DATASET)")] = None,
    questions: Annotated[
        int | None, typer.Option(min=1, help="answer N sampled questions (documents datasets: memorize only theirs)")
    ] = None,
    per_category: Annotated[
        bool, typer.Option(help="--questions N of each category (question type) instead of N in all")
    ] = False,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    sample: Annotated[list[str] | None, typer.Option(help="LoCoMo sample_id (repeatable)")] = None,
    sessions: Annotated[
        int | None, typer.Option(min=1, help="LoCoMo: the first N sessions and the questions they answer")
    ] = None,
    adversarial: Annotated[bool, typer.Option(help="LoCoMo: include category 5 (gold: no answer)")] = False,
    mode: Annotated[
        list[str] | None, typer.Option(help="memory, flat_rag, full_context, no_retrieval (repeatable; default all)")
    ] = None,
    ablation: Annotated[
        list[str] | None,
        typer.Option(
            help="a variant of memory answered in the same run (repeatable; comma-joined to combine), e.g. "
            "no_enhancement, engine=planning, rounds=2: a misspelt one is refused with the list of all"
        ),
    ] = None,
    retriever: Annotated[list[str] | None, typer.Option(help="retrievers of the LLM-free evaluation")] = None,
    budget: Annotated[int, typer.Option(min=1, help="triplets per retrieval")] = 20,
    llm: Annotated[str | None, typer.Option(help="local, ollama or scripted (default: MEMSTREAM_LLM)")] = None,
    model: Annotated[str | None, typer.Option(help="MEMSTREAM_LLM_MODEL for this run")] = None,
    judge_model: Annotated[str | None, typer.Option(help="judge model (default: the answering model)")] = None,
    engine: Annotated[
        str | None, typer.Option(help="QA engine: fast, planning or simple (default: MEMSTREAM_QA_ENGINE)")
    ] = None,
    batch: Annotated[int, typer.Option(min=1, help="messages per memorize call")] = 8,
    answers: Annotated[bool, typer.Option(help="answer end to end (--no-answers: the LLM-free retrieval only)")] = True,
    judge: Annotated[bool, typer.Option(help="LLM-as-a-judge")] = True,
    cache: Annotated[Path | None, typer.Option(help="LLM cache file (default: in the results folder)")] = None,
    progress: Annotated[bool, typer.Option(help="progress bars")] = True,
    verbose: Annotated[bool, typer.Option(help="log every call (MEMSTREAM_LOG_LEVEL)")] = False,
) -> None:
    """Evaluate memory on a dataset: memorize it, score retrieval and answers, write results and a report."""
    from evaluation.ablations import parse_all
    from evaluation.run import MODES, EvalConfig, evaluate

    settings = _settings()
    if not verbose:  # a log line per LLM call would bury the progress bars
        configure_logging("WARNING", settings.log_json)
    config = EvalConfig(
        dataset=dataset,
        results=results or Path("eval-results") / dataset,
        data_dir=data_dir,
        data=data,
        corpus=corpus,
        questions=questions,
        per_category=per_category,
        seed=seed,
        samples=set(sample) if sample else None,
        sessions=sessions,
        adversarial=adversarial,
        modes=tuple(mode or MODES),
        ablations=tuple(ablation or ()),
        budget=budget,
        llm=llm,
        model=model,
        judge_model=judge_model,
        engine=engine,
        batch=batch,
        answers=answers,
        judge=judge,
        cache=cache,
        progress=progress,
    )
    if retriever:
        config.retrievers = tuple(retriever)
    unknown = set(config.modes) - set(MODES)
    if unknown:
        raise _fail(f"unknown mode(s) {sorted(unknown)}; known: {', '.join(MODES)}")
    try:
        parse_all(config.ablations)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    try:
        outcome = asyncio.run(evaluate(config))
    except (ValueError, FileNotFoundError) as exc:
        raise _fail(str(exc)) from exc
    typer.echo(f"report: {config.results / 'report.md'}")
    typer.echo(json.dumps({"this_run_llm": outcome["run"]["this_run_llm"]["total"]}))


@app.command()
def stats(
    user: UserOption,
    as_json: Annotated[bool, typer.Option("--json", help="print as JSON")] = False,
    url: UrlOption = None,
    key: KeyOption = None,
) -> None:
    """Counts of a user's vertices by kind, edges by kind, valid and invalidated theses; messages waiting for
    memorize and the estimated time to catch up, in all and per worker."""
    from streams.gateway.client import GatewayClient, GatewayError
    from streams.lag import catch_up_from_metrics, catch_up_line

    settings = _settings()
    with GatewayClient(_url(settings, url), api_key=key) as client:
        try:
            result: dict[str, Any] = client.stats(user)
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
        try:  # the worker group's backlog and catch-up estimate, so a user knows when memory is current
            result["memorize"] = catch_up_from_metrics(client.metrics_text())
        except GatewayError as exc:  # the counts stand without it
            result["memorize"] = {"error": str(exc)}
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(f"user {result['user_id']}: {result.get('events', 0)} events memorized")
    typer.echo("vertices: " + ", ".join(f"{k} {v}" for k, v in sorted(result["vertices"].items())))
    typer.echo("edges:    " + ", ".join(f"{k} {v}" for k, v in sorted(result["edges"].items())))
    typer.echo(f"theses:   {result['theses_valid']} valid, {result['theses_invalidated']} invalidated")
    typer.echo(catch_up_line(result["memorize"]))


@app.command()
def forget(
    user: Annotated[str, typer.Argument(help="the user (tenant) whose memory to forget from")],
    message: Annotated[str | None, typer.Option("--message", help="one chat message: its event id")] = None,
    document: Annotated[str | None, typer.Option("--document", help="one document: its document id")] = None,
    conversation: Annotated[str | None, typer.Option("--conversation", help="every message of a conversation")] = None,
    everything: Annotated[bool, typer.Option("--all", help="the user's whole memory")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="with --all: do not ask for confirmation")] = False,
    wait: Annotated[
        float, typer.Option("--wait", min=0.0, help="seconds to wait for the erasure to be done (0: do not wait)")
    ] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the forget's status as JSON")] = False,
    url: UrlOption = None,
    key: KeyOption = None,
) -> None:
    """Forget a message, a document, a conversation or a whole user, and everything memory derived from it alone."""
    from streams.gateway.client import GatewayClient, GatewayError

    chosen: list[tuple[str, str | None]] = [
        (s, t) for s, t in (("message", message), ("document", document), ("conversation", conversation)) if t
    ]
    if everything:
        chosen.append(("user", None))
    if len(chosen) != 1:
        raise _fail("say what to forget: one of --message ID, --document ID, --conversation ID or --all", 2)
    ((scope, target),) = chosen
    if everything and not yes:
        typer.confirm(f"Forget everything memstream holds of user {user!r}? This cannot be undone", abort=True)
    settings = _settings()
    with GatewayClient(_url(settings, url), api_key=key) as client:
        try:
            accepted = client.forget(user, scope, target)
            status = client.wait_forgotten(accepted["forget_id"], wait) if wait > 0 else accepted
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(status, indent=2))
    what = f"{scope} {target}" if target else f"all of user {user}"
    typer.echo(f"forget {accepted['forget_id']} accepted: {what} (on {', '.join(accepted['topics'])})", err=as_json)
    if wait <= 0:
        return
    if status["status"] != "done":
        typer.secho(
            f"still pending after {wait:g}s (done on {', '.join(status['topics_done']) or 'no topic'} yet)",
            err=True,
            fg=typer.colors.YELLOW,
        )
        raise typer.Exit(3)
    typer.echo(
        f"done: the memory of {status['source_events']} event(s) erased, {status['vertices_removed']} vertices and "
        f"{status['edges_removed']} edges removed, {status['theses_restored']} theses valid again, "
        f"{status['cache_entries_removed']} cached model answers dropped",
        err=as_json,
    )


dead_letters_app = typer.Typer(
    name="dead-letters",
    help="Events memstream could not process, kept with the reason: list them, replay them once the cause is fixed.",
    no_args_is_help=True,
)
app.add_typer(dead_letters_app)


class DeadLetterStatus(StrEnum):
    DEAD = "dead"
    REPLAYED = "replayed"


@dead_letters_app.command("list")
def dead_letters_list(
    user: Annotated[str | None, typer.Option("--user", "-u", help="only this user's")] = None,
    reason: Annotated[str | None, typer.Option(help="only this reason, e.g. extraction_failed")] = None,
    status: Annotated[DeadLetterStatus | None, typer.Option(help="only dead, or only replayed")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="at most this many, newest first")] = 100,
    payload: Annotated[bool, typer.Option("--payload", help="with the original event (JSON output)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print as JSON")] = False,
    url: UrlOption = None,
    key: KeyOption = None,
) -> None:
    """Dead letters, newest first: what failed, why, and whether it was replayed."""
    from streams.gateway.client import GatewayClient, GatewayError

    settings = _settings()
    letters: list[dict[str, Any]] = []
    with GatewayClient(_url(settings, url), api_key=key) as client:
        try:
            while True:
                page = client.dead_letters(
                    user_id=user,
                    reason=reason,
                    status=status.value if status else None,
                    limit=min(1000, limit - len(letters)),
                    offset=len(letters),
                    include_payload=payload,
                )
                letters.extend(page["dead_letters"])
                if not page["dead_letters"] or len(letters) >= min(limit, page["total"]):
                    break
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    if not page["complete"]:
        typer.secho("the gateway is still reading the dead-letter topic: the list may be incomplete", err=True)
    if as_json:
        typer.echo(json.dumps({"total": page["total"], "dead_letters": letters}, indent=2, ensure_ascii=False))
        return
    if not letters:
        typer.echo("no dead letters")
        return
    shown = f", the newest {len(letters)} shown" if len(letters) < page["total"] else ""
    typer.echo(f"{page['total']} dead letter(s){shown}")
    for letter in letters:
        replayed = f" at {letter['replayed_at'][:19]}" if letter.get("replayed_at") else ""
        typer.echo(
            f"{letter['dead_lettered_at'][:19]}  {letter['status']}{replayed}  {letter['reason']}  "
            f"user={letter['user_id'] or '?'}  {letter['source_topic']}  {letter['event_id']}  "
            f"events={','.join(letter['failed_event_ids']) or '?'}  attempts={letter['attempts']}"
        )
        typer.echo(f"    {str(letter['error'])[:300]}")


@dead_letters_app.command("replay")
def dead_letters_replay(
    event_ids: Annotated[
        list[str] | None, typer.Argument(help="dead-letter ids (dl_...) or the ids of the events that failed")
    ] = None,
    replay_all: Annotated[
        bool, typer.Option("--all", help="every dead letter not replayed yet (narrowed by --user, --reason)")
    ] = False,
    user: Annotated[str | None, typer.Option("--user", "-u", help="with --all: only this user's")] = None,
    reason: Annotated[str | None, typer.Option(help="with --all: only this reason")] = None,
    url: UrlOption = None,
    key: KeyOption = None,
    wait: Annotated[float, typer.Option(help="seconds to wait for a gateway still reading the topic")] = 60.0,
) -> None:
    """Put dead-lettered events back on their topics, with the same event ids, to be processed again."""
    from streams.gateway.client import GatewayClient, GatewayError

    if bool(event_ids) == replay_all:
        raise _fail("name the dead letters to replay, or give --all", 2)
    if event_ids and (user or reason):
        raise _fail("--user and --reason filter --all; with ids, name the dead letters instead", 2)
    settings = _settings()
    replayed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    with GatewayClient(_url(settings, url), api_key=key) as client:
        deadline = time.monotonic() + wait
        while True:
            try:
                result = client.replay_dead_letters(event_ids, replay_all=replay_all, user_id=user, reason=reason)
            except GatewayError as exc:
                if exc.status_code == 503 and time.monotonic() < deadline:
                    time.sleep(1.0)  # the gateway is still reading the dead-letter topic
                    continue
                raise _fail(str(exc)) from exc
            replayed.extend(result["replayed"])
            skipped = result["skipped"]
            # --all replays at most a page per request: go on while there is more and the last page moved
            if not (replay_all and result["remaining"] and result["replayed"]):
                break
    for event in replayed:
        typer.echo(
            f"replayed {event['event_id']} (user {event['user_id']}, {event['source_topic']}; "
            f"dead letter {', '.join(event['dead_letters'])})"
        )
    for letter in skipped:
        typer.secho(f"skipped {letter['event_id']}: {letter['error']}", err=True, fg=typer.colors.YELLOW)
    if not replayed:
        typer.echo("nothing to replay")
        return
    typer.echo(
        f"{len(replayed)} event(s) back on their topics; a new failure shows up again in `memstream dead-letters list`"
    )


entities_app = typer.Typer(
    name="entities",
    help="The entity merges memorize made (a nickname or variant joined to a known object): undo one.",
    no_args_is_help=True,
)
app.add_typer(entities_app)


@entities_app.command("unmerge")
def entities_unmerge(
    user: Annotated[str, typer.Argument(help="the user (tenant) whose memory merged the name")],
    alias: Annotated[str, typer.Argument(help='the merged name as said, e.g. "Mel"')],
) -> None:
    """Split a merged alias back into its own object, with the facts said with it. Operators: works on the
    configured store (MEMSTREAM_STORE) directly."""
    from services.container import open_stores
    from services.llm.factory import build_embedder
    from services.memorize.unmerge import NotAnAlias, Unmerged, unmerge

    async def run() -> Unmerged:
        settings = _settings()
        embedder = build_embedder(settings)
        stores = await open_stores(settings, embedder.dim)
        try:
            return await unmerge(stores, embedder, user, alias)
        finally:
            await stores.close()
            await embedder.close()

    try:
        done = asyncio.run(run())
    except NotAnAlias as exc:
        raise _fail(str(exc)) from exc
    typer.echo(
        f"{done.alias!r} is its own object again ({done.alias_id}): {done.theses_moved} fact(s) moved from "
        f"{done.canonical_id}" + (", which had nothing else and was removed" if done.canonical_removed else "")
    )


keys_app = typer.Typer(
    name="keys",
    help="API keys (admin): make one for some users and scopes, list them, revoke one.",
    no_args_is_help=True,
)
app.add_typer(keys_app)

LocalOption = Annotated[
    bool,
    typer.Option(
        "--local", help="work on the key file under MEMSTREAM_DATA_DIR directly, not through the gateway (operators)"
    ),
]


def _key_line(record: dict[str, Any]) -> str:
    revoked = f"revoked {str(record['revoked_at'])[:19]}" if record.get("revoked_at") else "active"
    return (
        f"{record['key_id']}  {revoked:<27} users={','.join(record['users'])}  scopes={','.join(record['scopes'])}"
        f"  created {str(record['created_at'])[:19]}  {record.get('label', '')}"
    )


@keys_app.command("create")
def keys_create(
    user: Annotated[list[str], typer.Option("--user", "-u", help='a user the key acts for (repeatable; "*": all)')],
    scope: Annotated[str, typer.Option(help="comma-separated: write, ask, read, metrics, admin")] = "write,ask,read",
    label: Annotated[str, typer.Option(help="a note: whose key, what for")] = "",
    local: LocalOption = False,
    url: UrlOption = None,
    key: KeyOption = None,
) -> None:
    """Make an API key and print it (once: only its hash is kept)."""
    from streams.gateway.client import GatewayClient, GatewayError
    from streams.gateway.keys import KeyRequestError, KeyStore

    settings = _settings()
    scopes = [s.strip() for s in scope.split(",") if s.strip()]
    try:
        if local:
            record, made = KeyStore.of(settings).create(user, scopes, label)
            created: dict[str, Any] = {**record.public(), "key": made}
        else:
            with GatewayClient(_url(settings, url), api_key=key) as client:
                created = client.create_key(user, scopes, label)
    except (GatewayError, KeyRequestError) as exc:
        raise _fail(str(exc)) from exc
    typer.echo(_key_line(created), err=True)
    typer.echo(created["key"])


@keys_app.command("list")
def keys_list(
    as_json: Annotated[bool, typer.Option("--json", help="print as JSON")] = False,
    local: LocalOption = False,
    url: UrlOption = None,
    key: KeyOption = None,
) -> None:
    """Every key: id, users, scopes, when made, whether revoked (never the key itself)."""
    from streams.gateway.client import GatewayClient, GatewayError
    from streams.gateway.keys import KeyStore

    settings = _settings()
    if local:
        records = [k.public() for k in KeyStore.of(settings).keys().values()]
    else:
        with GatewayClient(_url(settings, url), api_key=key) as client:
            try:
                records = client.list_keys()
            except GatewayError as exc:
                raise _fail(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    for record in records:
        typer.echo(_key_line(record))
    if not records:
        typer.echo("no keys")


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (`memstream keys list`)")],
    local: LocalOption = False,
    url: UrlOption = None,
    key: KeyOption = None,
) -> None:
    """Revoke a key: from the next request on it is refused (401) by every gateway reading the key file."""
    from streams.gateway.client import GatewayClient, GatewayError
    from streams.gateway.keys import KeyRequestError, KeyStore

    settings = _settings()
    try:
        if local:
            record = KeyStore.of(settings).revoke(key_id).public()
        else:
            with GatewayClient(_url(settings, url), api_key=key) as client:
                record = client.revoke_key(key_id)
    except (GatewayError, KeyRequestError) as exc:
        raise _fail(str(exc)) from exc
    typer.echo(_key_line(record))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
