"""Ingest throughput: messages/s through broker -> Faust memorize agent -> store, and LLM calls per message.

The LLM is the zero-latency rule-based scripted LLM (``--llm-delay`` adds a simulated model latency), so this
measures the pipeline, the embedder and the store, not a model. Messages are LoCoMo turns, spread over ``--users``
users (each user replays the conversations under its own id).

  python benchmarks/ingest.py --messages 1000 --users 10            # through the embedded broker and a worker
  python benchmarks/ingest.py --mode service --messages 1000        # MemorizeService alone, batching on and off

Prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from memstream.broker import free_port, free_port_block
from memstream.runtime import Stack
from schemas.events import ChatMessage, MemoryUpdate
from services.container import build_services
from services.ingest import load_conversation
from services.llm.scripted import rule_based_llm
from services.settings import Settings
from streams.codec import encode
from streams.topics import TopicNames

SCRIPTED = "services.llm.scripted:rule_based_llm"


def load_messages(data_dir: Path, count: int, users: int) -> list[ChatMessage]:
    base = load_conversation(data_dir / "locomo" / "locomo_dev7.json", "u0")
    out: list[ChatMessage] = []
    per_user = -(-count // users)
    for u in range(users):
        for m in base[:per_user]:
            # each user's text is its own, so no LLM-cache hit across users flatters the calls per message
            text = f"{m.text} (from user {u})"
            out.append(m.model_copy(update={"user_id": f"user{u}", "event_id": f"{m.event_id}-u{u}", "text": text}))
    # interleave users, as a chat platform would deliver them
    out.sort(key=lambda m: (m.event_id.rsplit("-u", 1)[0], m.user_id))
    return out[:count]


def settings_for(data_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "llm": "scripted",
        "scripted_llm": SCRIPTED,
        "qa_engine": "simple",
        "partitions": 4,
        "broker_session_timeout_s": 6.0,
        "port": free_port(),
        "worker_web_port": free_port_block(8),  # workers use it and the ports after it
        "log_json": True,
        "log_level": "WARNING",
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


async def run_service(messages: list[ChatMessage], batch: int, chunk: int, **overrides: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = settings_for(Path(tmp), batch_max_messages=batch, **overrides)
        llm = rule_based_llm()
        services = await build_services(settings, llm=llm)
        try:
            await services.embedder.embed(["warm up"])  # the model's load (or a table's distillation) is not memorize
            started = time.perf_counter()
            for i in range(0, len(messages), chunk):
                await services.memorize.memorize(messages[i : i + chunk])
            elapsed = time.perf_counter() - started
        finally:
            await services.close()
    return {
        "batch_max_messages": batch,
        "messages": len(messages),
        "seconds": round(elapsed, 2),
        "messages_per_s": round(len(messages) / elapsed, 1),
        "llm_calls": len(llm.calls),
        "llm_calls_per_message": round(len(llm.calls) / len(messages), 3),
        # extraction apart from the checks after it (resolve, its check, entity confirmation)
        "llm_calls_per_message_by_task": {
            task: round(n / len(messages), 3) for task, n in sorted(Counter(c.task for c in llm.calls).items())
        },
    }


async def run_pipeline(messages: list[ChatMessage], workers: int, llm_delay: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MEMSTREAM_BENCH_DELAY"] = str(llm_delay)
        settings = settings_for(Path(tmp), batch_wait_s=0.2)
        stack = Stack(settings, settings.host, settings.port, workers=workers, startup_timeout_s=90)
        await stack.start()
        try:
            topics = TopicNames.from_settings(settings)
            producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all", linger_ms=5)
            consumer = AIOKafkaConsumer(
                topics.memory_updates, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest", group_id=None
            )
            await producer.start()
            await consumer.start()
            try:
                started = time.perf_counter()
                for m in messages:
                    await producer.send(topics.chat, encode(m), key=m.user_id.encode())
                await producer.flush()
                produced = time.perf_counter() - started
                wanted = {m.event_id for m in messages}
                done: set[str] = set()
                counted: set[str] = set()  # announcements are at-least-once: a repeat has the same change set id
                llm_calls = 0
                deadline = time.monotonic() + max(120.0, len(messages) * 0.5)
                while not wanted <= done:
                    stack.check_children()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"only {len(done & wanted)}/{len(wanted)} memorized before the deadline")
                    for batch in (await consumer.getmany(timeout_ms=500)).values():
                        for record in batch:
                            update = MemoryUpdate.model_validate_json(record.value or b"")
                            done.update(update.source_event_ids)
                            if update.change_set_id not in counted:
                                counted.add(update.change_set_id)
                                llm_calls += update.llm_calls
                elapsed = time.perf_counter() - started
            finally:
                await producer.stop()
                await consumer.stop()
        finally:
            stack.stop()
    return {
        "mode": "pipeline",
        "workers": workers,
        "messages": len(messages),
        "produce_seconds": round(produced, 2),
        "seconds": round(elapsed, 2),
        "messages_per_s": round(len(messages) / elapsed, 1),
        "llm_calls": llm_calls,
        "llm_calls_per_message": round(llm_calls / len(messages), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["pipeline", "service"], default="pipeline")
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--llm-delay", type=float, default=0.0)
    parser.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    args = parser.parse_args()
    messages = load_messages(args.data_dir, args.messages, args.users)
    if args.mode == "service":
        results = {
            "mode": "service",
            "batching_on": asyncio.run(run_service(messages, batch=8, chunk=64)),
            "batching_off": asyncio.run(run_service(messages, batch=1, chunk=64)),
        }
    else:
        results = asyncio.run(run_pipeline(messages, args.workers, args.llm_delay))
    # calls per message depend on how many users' batches are open at once: say it beside the figure
    results["users_interleaved"] = len({m.user_id for m in messages})
    users_of: dict[str, set[str]] = {}
    for m in messages:
        users_of.setdefault(m.text, set()).add(m.user_id)
    # 0 by construction (each user's text is its own): no LLM-cache hit across users can flatter the figure
    results["texts_shared_across_users"] = sum(len(u) > 1 for u in users_of.values())
    sys.stdout.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
