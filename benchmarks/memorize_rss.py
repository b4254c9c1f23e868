"""Resident memory of the memorize and QA services in one process, without broker or worker around them.

Memorizes ``--rounds`` × 300 chat messages of 5 users (one message per user per call, as interleaved users arrive)
into the embedded store with the rule-based scripted LLM and the in-process MiniLM embedder, answering a question
every 25 messages, and prints the process's RSS after each round. A service that holds on to what it processed
grows by round; one that does not levels off once its caches (SQLite pages, the embedder's arenas) are warm.

    python benchmarks/memorize_rss.py --rounds 10 [--trim]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import logging
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schemas.events import ChatMessage, Query
from services.container import build_services
from services.settings import Settings

USERS = [f"u{i}" for i in range(5)]
PLACES = ["Cusco", "Lisbon", "Oslo", "Kyoto", "Quito", "Accra"]
PER_ROUND = 300


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


def store_mb(data: Path) -> float:
    return sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) / 1e6


async def run(rounds: int, trim: bool) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            data_dir=data,
            llm="scripted",
            scripted_llm="services.llm.scripted:rule_based_llm",
            qa_engine="simple",
        )
        services = await build_services(settings)
        n = 0
        start = datetime(2024, 1, 1, tzinfo=UTC)
        try:
            for _ in range(rounds):
                for _ in range(PER_ROUND // len(USERS)):
                    batch = []
                    for user in USERS:
                        n += 1
                        text = f"I went to {PLACES[n % 6]} with friend number {n} and we ate dish {n * 7}."
                        batch.append(
                            ChatMessage(
                                event_id=f"e{n}",
                                user_id=user,
                                event_time=start + timedelta(minutes=n),
                                speaker=user,
                                text=text,
                            )
                        )
                    await services.memorize.memorize(batch, "memstream.chat")
                    if n % 25 == 0:
                        question = f"What did I do in {PLACES[n % 6]}?"
                        query = Query(
                            event_id=f"q{n}", user_id=USERS[n % 5], event_time=datetime.now(UTC), question=question
                        )
                        await services.qa.answer(query)
                gc.collect()
                if trim:
                    ctypes.CDLL("libc.so.6").malloc_trim(0)
                size = await asyncio.to_thread(store_mb, data)
                print(f"after {n} messages: RSS {rss_mb():.1f} MB, store files {size:.1f} MB", flush=True)
        finally:
            await services.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--trim", action="store_true", help="malloc_trim after each round (tells heap from leak)")
    args = parser.parse_args()
    asyncio.run(run(args.rounds, args.trim))


if __name__ == "__main__":
    main()
