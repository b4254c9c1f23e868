"""Contradiction verdicts with a real model: how often would ``resolve`` end a thesis that still holds, and what does
the second look (``resolve_check``) change?

A small hand-labelled set of new/known pairs of the kind memorize judges (the same subject, the same relation or
near in meaning): ``holds`` pairs, where both statements are true together (most pairs in conversation: several
trips, hobbies, feelings, things looked forward to), and ``ends`` pairs, where the new one makes the known one no
longer true (a new job, home or partner, a changed number, a cancelled plan). The labels are a reader's; the pairs
were written for this probe (a few in the style of the LoCoMo pairs the default model got wrong, none copied from
the prompts' examples). Pairs go to the model ``--group`` at a time, as a batch's pairs do.

  python -m benchmarks.resolve_probe [--llm ollama --model qwen2.5:7b-instruct] [--cache FILE]

Prints a table to stderr and a JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.adapters.sqlite import SqliteMemoryStore
from services.llm.factory import build_llm
from services.llm.scope import llm_scope
from services.llm.task import run_task
from services.logging import configure_logging
from services.memorize.resolve import Pair, ResolveTask
from services.memorize.resolve_check import CheckTask
from services.settings import Settings

KNOWN_AT = datetime(2023, 3, 4, tzinfo=UTC)
NEW_AT = datetime(2023, 7, 12, tzinfo=UTC)

#: (new, known, gold): "holds" both stay true, "ends" the known one is no longer true
PAIRS: list[tuple[str, str, str]] = [
    ("Maya is looking forward to the school play.", "Maya is looking forward to her sister's wedding.", "holds"),
    ("Maya went to a grief support group.", "Maya is interested in becoming a nurse.", "holds"),
    ("Maya went camping with her kids.", "Maya went to a pottery workshop.", "holds"),
    ("Maya feels grateful for her friends.", "Maya feels stressed about work.", "holds"),
    ("Maya is painting a sunset.", "Maya is learning to play the guitar.", "holds"),
    ("Maya plans to visit Lisbon in the fall.", "Maya visited Madrid last year.", "holds"),
    ("Maya likes science fiction books.", "Maya likes baking bread.", "holds"),
    ("Maya joined a running club.", "Maya volunteers at an animal shelter.", "holds"),
    ("Maya adopted a cat named Biscuit.", "Maya has a dog named Rufus.", "holds"),
    ("Maya is proud of her daughter.", "Maya is worried about her daughter's grades.", "holds"),
    ("Maya shared her story at a community event.", "Maya went to a pride parade.", "holds"),
    ("Maya's son started swimming lessons.", "Maya's son plays soccer.", "holds"),
    ("Tom bought a new bike.", "Tom bought a camera.", "holds"),
    ("Tom is reading a book about habits.", "Tom is reading a novel by Le Guin.", "holds"),
    ("Tom is excited about his trip to Japan.", "Tom is excited about his new project.", "holds"),
    ("Tom went hiking in the Alps.", "Tom went hiking in Norway.", "holds"),
    ("Tom enjoys cooking Thai food.", "Tom enjoys cooking for his family.", "holds"),
    ("Tom met his friend Ali for coffee.", "Tom met his friend Jo at the gym.", "holds"),
    ("Tom is training for a marathon.", "Tom is training his new puppy.", "holds"),
    ("Tom thinks the new album is great.", "Tom thinks the band's concert was too loud.", "holds"),
    ("Tom's mother gave him a watch.", "Tom's mother taught him to knit.", "holds"),
    ("Tom wants to open a bakery.", "Tom wants to learn French.", "holds"),
    ("Tom took his kids to the zoo.", "Tom took his kids to the beach.", "holds"),
    ("Tom has been married for five years.", "Tom has two children.", "holds"),
    ("Maya works at Riverside Clinic.", "Maya works at the city library.", "ends"),
    ("Maya lives in Denver.", "Maya lives in Austin.", "ends"),
    ("Maya broke up with her boyfriend Sam.", "Maya is dating Sam.", "ends"),
    ("Maya's trip to Lisbon was cancelled.", "Maya will travel to Lisbon in September.", "ends"),
    ("Maya is now a vegetarian.", "Maya eats meat every day.", "ends"),
    ("Maya sold her car.", "Maya drives a blue Honda.", "ends"),
    ("Tom quit his job at the bank.", "Tom works at the bank.", "ends"),
    ("Tom has three children.", "Tom has two children.", "ends"),
    ("Tom moved to Chicago.", "Tom lives in Boston.", "ends"),
    ("Tom is divorced.", "Tom is married to Lisa.", "ends"),
    ("Tom stopped playing the piano.", "Tom plays the piano every evening.", "ends"),
    ("Tom's dog Max died.", "Tom walks his dog Max every morning.", "ends"),
]


def _pairs() -> list[Pair]:
    return [Pair(new, NEW_AT, known, KNOWN_AT, known_prediction=" will " in known) for new, known, _ in PAIRS]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        overrides: dict[str, Any] = {"data_dir": Path(args.data_dir or tmp)}
        if args.llm:
            overrides["llm"] = args.llm
        if args.model:
            overrides["llm_model"] = args.model
        settings = Settings(**overrides)
        cache = await SqliteMemoryStore.open(Path(args.cache), dim=384) if args.cache else None
        llm = build_llm(settings, cache=cache)
        pairs = _pairs()
        resolved: list[str] = []
        checked: list[bool] = []
        trusted: list[bool] = []
        try:
            with llm_scope("resolve-probe"):
                for start in range(0, len(pairs), args.group):
                    group = pairs[start : start + args.group]
                    resolved += (await run_task(llm, ResolveTask(), group)).value
                    check = (await run_task(llm, CheckTask(), group)).value
                    checked += check.not_both
                    trusted += [check.trusted] * len(group)
        finally:
            await llm.close()
            if cache is not None:
                await cache.close()
    rows = []
    for (new, known, gold), verdict, not_both, trust in zip(PAIRS, resolved, checked, trusted, strict=True):
        rows.append(
            {
                "new": new,
                "known": known,
                "gold": gold,
                "resolve": verdict,
                "check_not_both": not_both,
                "check_trusted": trust,
                "ends": verdict in ("updates", "refutes"),
            }
        )
    summary: dict[str, Any] = {"benchmark": "resolve_probe", "model": llm.model, "pairs": len(rows)}
    for gold in ("holds", "ends"):
        mine = [r for r in rows if r["gold"] == gold]
        summary[gold] = {
            "pairs": len(mine),
            "ended_by_resolve": sum(r["ends"] for r in mine),
            "ended_by_resolve_and_check": sum(r["ends"] and r["check_not_both"] and r["check_trusted"] for r in mine),
            "check_alone_not_both": sum(r["check_not_both"] for r in mine),
            "check_controls_failed": sum(not r["check_trusted"] for r in mine),
        }
    for r in rows:
        acted = r["ends"] and r["check_not_both"] and r["check_trusted"]
        mark = "END " if acted else ("end?" if r["ends"] else "    ")
        print(f"{r['gold']:<5} {r['resolve']:<10} check={'not_both' if r['check_not_both'] else 'both':<8} "
              f"{'' if r['check_trusted'] else '(controls failed) '}"
              f"{mark} {r['new']} | {r['known']}", file=sys.stderr)  # fmt: skip
    summary["rows"] = rows
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm", default=None, help="local, ollama (default: MEMSTREAM_LLM)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--group", type=int, default=6, help="pairs per call, as in a batch")
    parser.add_argument("--cache", default=None, help="LLM cache file (reruns cost nothing)")
    parser.add_argument("--data-dir", default=None, help="MEMSTREAM_DATA_DIR (where the local model is assembled)")
    args = parser.parse_args()
    configure_logging("WARNING", json=False)
    summary = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}), file=sys.stderr)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
