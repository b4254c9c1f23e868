"""The `memstream` command line."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

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


class FileFormat(StrEnum):
    AUTO = "auto"
    LOCOMO = "locomo"
    JSONL = "jsonl"


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


@app.command()
def up(
    port: Annotated[int | None, typer.Option(help="gateway port (default MEMSTREAM_PORT)")] = None,
    host: Annotated[str | None, typer.Option(help="gateway address (default MEMSTREAM_HOST)")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Faust worker processes")] = 1,
    demo: Annotated[bool, typer.Option(help="ingest a short sample chat and ask a question once ready")] = False,
) -> None:
    """Start the broker (embedded unless MEMSTREAM_BROKER is set), the worker(s) and the gateway; Ctrl-C stops."""
    from memstream.runtime import StartupError
    from memstream.runtime import up as run_up

    settings = _settings()
    gateway_host, gateway_port = host or settings.host, port or settings.port

    async def on_ready(url: str) -> None:
        typer.echo(f"memstream is up: {url}  (logs in {settings.data_dir / 'logs'}; Ctrl-C stops)")
        if demo:
            await _demo(url)

    try:
        asyncio.run(run_up(settings, gateway_host, gateway_port, workers, on_ready))
    except StartupError as exc:
        raise _fail(f"memstream up failed: {exc}") from exc
    typer.echo("memstream stopped")


async def _demo(url: str) -> None:
    from services.ingest.sample import DEMO_QUESTION, DEMO_USER, demo_messages

    messages = demo_messages()
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        body = [m.model_dump(mode="json", exclude={"ingest_time"}) for m in messages]
        (await http.post("/v1/messages", json=body)).raise_for_status()
        typer.echo(f"demo: sent {len(messages)} messages for user {DEMO_USER!r}; memorizing...")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            stats = (await http.get(f"/v1/stats/{DEMO_USER}")).json()
            if stats.get("events", 0) >= len(messages):
                break
            await asyncio.sleep(1.0)
        typer.echo(f"demo: memory {json.dumps(stats)}")
        query_id = (await http.post("/v1/questions", json={"user_id": DEMO_USER, "question": DEMO_QUESTION})).json()
        while time.monotonic() < deadline:
            response = await http.get(f"/v1/answers/{query_id['query_id']}", params={"wait": 10})
            if response.status_code == 200:
                typer.echo(f"demo: Q: {DEMO_QUESTION}\ndemo: A: {response.json()['answer']}")
                return
        typer.echo("demo: no answer in time")


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
    from services.gateway.server import serve_gateway

    settings = _settings()
    if not (bootstrap or settings.broker):
        raise _fail("no broker: set MEMSTREAM_BROKER or --bootstrap (or use `memstream up`)")
    asyncio.run(serve_gateway(settings, bootstrap, host, port))


@app.command()
def ingest(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="LoCoMo JSON or JSONL chat file")],
    user: UserOption,
    url: UrlOption = None,
    fmt: Annotated[FileFormat, typer.Option("--format", help="file format")] = FileFormat.AUTO,
    sample: Annotated[list[str] | None, typer.Option(help="LoCoMo sample_id to ingest (repeatable)")] = None,
    batch: Annotated[int, typer.Option(min=1, max=1000, help="messages per request")] = 100,
) -> None:
    """Stream a conversation file to the gateway, in batches, with a progress bar."""
    from services.gateway.client import GatewayClient, GatewayError
    from services.ingest import LoaderError, load_conversation

    settings = _settings()
    try:
        messages = load_conversation(file, user, fmt.value, samples=set(sample) if sample else None)
    except LoaderError as exc:
        raise _fail(str(exc)) from exc
    if not messages:
        raise _fail(f"{file}: no messages found")
    with GatewayClient(_url(settings, url)) as client, tqdm(total=len(messages), unit="msg", desc="ingest") as bar:
        try:
            for start in range(0, len(messages), batch):
                chunk = messages[start : start + batch]
                client.post_messages(chunk)
                bar.update(len(chunk))
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    typer.echo(f"sent {len(messages)} messages for user {user!r}")


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
    enhancement: Annotated[bool | None, typer.Option("--enhancement/--no-enhancement")] = None,
    decomposition: Annotated[bool | None, typer.Option("--decomposition/--no-decomposition")] = None,
    episodic: Annotated[bool | None, typer.Option("--episodic/--no-episodic", help="episode text in context")] = None,
    url: UrlOption = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the answer")] = 300.0,
) -> None:
    """Ask a question about a user's memory and print the answer."""
    from services.gateway.client import GatewayClient, GatewayError

    settings = _settings()
    options = {
        "retriever": retriever,
        "max_clue_queries": max_clue_queries,
        "plan_enhancement": enhancement,
        "decomposition": decomposition,
        "episodic_context": episodic,
    }
    fields: dict[str, Any] = {"options": {k: v for k, v in options.items() if v is not None}}
    if as_of is not None:
        fields["as_of"] = as_of if "T" in as_of else f"{as_of}T00:00:00Z"
    with GatewayClient(_url(settings, url)) as client:
        try:
            query_id = client.ask(user, question, **fields)
            if trace:
                _print_trace(client, query_id, user, timeout)
            answer = client.wait_answer(query_id, timeout)
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(answer, indent=2, ensure_ascii=False))
    else:
        typer.echo(answer["answer"] if answer.get("status") != "error" else f"error: {answer.get('error')}")
    if answer.get("status") == "error":
        raise typer.Exit(2)


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


@app.command()
def stats(
    user: UserOption,
    as_json: Annotated[bool, typer.Option("--json", help="print as JSON")] = False,
    url: UrlOption = None,
) -> None:
    """Counts of a user's vertices by kind, edges by kind, valid and invalidated theses."""
    from services.gateway.client import GatewayClient, GatewayError

    settings = _settings()
    with GatewayClient(_url(settings, url)) as client:
        try:
            result: dict[str, Any] = client.stats(user)
        except GatewayError as exc:
            raise _fail(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(f"user {result['user_id']}: {result.get('events', 0)} events memorized")
    typer.echo("vertices: " + ", ".join(f"{k} {v}" for k, v in sorted(result["vertices"].items())))
    typer.echo("edges:    " + ", ".join(f"{k} {v}" for k, v in sorted(result["edges"].items())))
    typer.echo(f"theses:   {result['theses_valid']} valid, {result['theses_invalidated']} invalidated")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
