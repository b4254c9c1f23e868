"""How soon an answer starts to show, with the real stack and the configured model (default: the local
Qwen2.5-Coder-1.5B): `memstream up`'s processes (embedded broker, a worker, the gateway), the demo conversation
memorized, then each question asked and its answer stream read over SSE as a client reads it.

Per question: seconds from the POST to the first text piece, to the answer event, and the answer's LLM calls;
then this machine's generated tokens/s with the same model on its own (after the stack stopped), so a run on
another machine compares.

    python -m benchmarks.answer_stream [--data-dir DIR] [--question "..."]...

Prints a table to stderr and a JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.llm_speed import calibrate
from memstream.runtime import Stack
from services.adapters.llamacpp.llm import Engine, EngineConfig
from services.ingest.sample import demo_messages
from services.llm.factory import local_model_path
from services.settings import Settings
from streams.gateway.keys import create_key

USER = "bench"
QUESTIONS = [
    "Where does Anna work now?",
    "What is the name of Anna's cat?",
    "Where did Anna work before her new job?",
    "Which race is Ben training for?",
    "In which city does Ben live?",
]


async def memorize(http: httpx.AsyncClient, timeout_s: float) -> float:
    started = time.monotonic()
    body = [m.model_dump(mode="json", exclude={"ingest_time"}) for m in demo_messages(USER)]
    (await http.post("/v1/messages", json=body)).raise_for_status()
    while (await http.get(f"/v1/stats/{USER}")).json().get("events", 0) < len(body):
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the demo was not memorized within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)  # poll interval of a deadline wait
    return time.monotonic() - started


async def ask(http: httpx.AsyncClient, question: str) -> dict[str, Any]:
    started = time.monotonic()
    asked = await http.post("/v1/questions", json={"user_id": USER, "question": question})
    asked.raise_for_status()
    query_id = asked.json()["query_id"]
    first: float | None = None
    pieces = 0
    event = ""
    async with http.stream("GET", f"/v1/questions/{query_id}/stream", timeout=1800) as response:
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "text":
                pieces += 1
                first = first if first is not None else time.monotonic() - started
            elif line.startswith("data:") and event == "answer":
                answer = json.loads(line[5:])
                break
    return {
        "question": question,
        "first_text_s": None if first is None else round(first, 2),
        "answer_s": round(time.monotonic() - started, 2),
        "pieces": pieces,
        "llm_calls": answer["llm_calls"],
        "status": answer["status"],
        "answer": answer["answer"],
    }


async def run(settings: Settings, questions: list[str], memorize_timeout_s: float) -> dict[str, Any]:
    key = create_key(settings, ["*"], ["admin"], label="benchmark")
    stack = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=600)
    await stack.start()
    try:
        headers = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=stack.url, headers=headers, timeout=60) as http:
            memorize_s = await memorize(http, memorize_timeout_s)
            results = [await ask(http, q) for q in questions]
    finally:
        stack.stop()
    return {"memorize_s": round(memorize_s, 1), "questions": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, help="default: a new temporary folder (the model is linked in)")
    parser.add_argument("--question", action="append", help="repeatable (default: five about the demo)")
    parser.add_argument("--memorize-timeout", type=float, default=1800.0)
    parser.add_argument("--calibration-tokens", type=int, default=64)
    args = parser.parse_args()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="memstream-answer-stream-"))
    settings = Settings(data_dir=data_dir)
    model = local_model_path(Settings())  # assembled once in the usual place, then shared
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    linked = data_dir / "models" / model.name
    if not linked.exists():
        linked.symlink_to(model)
    result = asyncio.run(run(settings, args.question or QUESTIONS, args.memorize_timeout))
    engine = Engine(EngineConfig(model, n_ctx=2048, n_threads=os.cpu_count()))
    result["calibration_tok_s"] = round(calibrate(engine, args.calibration_tokens), 1)
    result["model"] = settings.llm_model
    firsts = [q["first_text_s"] for q in result["questions"] if q["first_text_s"] is not None]
    result["first_text_s_median"] = statistics.median(firsts) if firsts else None
    result["answer_s_median"] = statistics.median(q["answer_s"] for q in result["questions"])
    for q in result["questions"]:
        sys.stderr.write(
            f"{q['first_text_s']!s:>7} s first text  {q['answer_s']:7.1f} s answer  {q['llm_calls']} calls  "
            f"{q['pieces']:3d} pieces  {q['status']:<9} {q['question']} -> {q['answer'][:70]}\n"
        )
    sys.stderr.write(
        f"memorized the demo in {result['memorize_s']} s; median first text {result['first_text_s_median']} s, "
        f"answer {result['answer_s_median']} s; calibration {result['calibration_tok_s']} tok/s\n"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
