"""Extraction quality and cost on the labelled LoCoMo turns, through the real memorize service and a real model.

  python -m benchmarks.extraction.run                          # the whole set, default local model and design
  python -m benchmarks.extraction.run --per-sample 16 --batch 4 --no-example --no-resolve   # a variant, on the subset
  python -m benchmarks.extraction.run --llm ollama --model qwen2.5:7b-instruct
  python -m benchmarks.extraction.run --cache C --cache-only   # re-score what C holds: code checks changed, no model

Each conversation is memorized as its own user, all at once, its turns handed to memorize as a worker takes a
backlog (up to ``TAKE_BATCHES`` batches of ``--batch`` a call: their extraction calls decoded together, up to the
engine's slots, ``+llm_max_concurrency=N`` on a variant). ``seconds_per_message`` is the wall time; the model seconds
sum calls that overlap (and their waits for a slot). Prints per-variant scores (see ``score.py``) and cost per
message; ``--out`` writes the JSON with every miss, unmatched thesis, junk entity and judge verdict. No LLM cache
unless ``--cache`` is given: costs are of real calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.extraction.gold import LOCOMO, load, subset
from benchmarks.extraction.score import score
from services.adapters.llamacpp.llm import unload_all
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ApplyResult, ChangeSet
from services.llm.factory import build_embedder, build_llm
from services.memorize.extraction import ExtractTask
from services.memorize.service import MemorizeOutcome, MemorizeService, MemoryEvent
from services.ports import LLM, LLMRequest, LLMResponse, VectorItem
from services.settings import Settings


class CacheOnly(LLM):
    """An LLM that is never reached: with ``--cache-only`` only cached outputs run through memorize, so changes to
    the code that checks them are measured in seconds. Uncached batches fail as unavailable and are not scored."""

    def __init__(self, model: str) -> None:
        self.model = model

    async def complete(self, request: LLMRequest) -> LLMResponse:
        raise ConnectionError("not in the cache (--cache-only)")


class RecordingStore(SqliteMemoryStore):
    """The embedded store, keeping every change set it applied for the scorer."""

    def __init__(self, path: Path, dim: int) -> None:
        super().__init__(path, dim=dim)
        self.applied: list[ChangeSet] = []

    async def apply(self, change_set: ChangeSet, vectors: Sequence[VectorItem]) -> ApplyResult:
        self.applied.append(change_set)
        return await super().apply(change_set, vectors)


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """``compact`` or ``compact+resolve_by_meaning=false+entity_candidates=0``: the extraction output design, then
    settings of the variant (validated by ``Settings``)."""
    output, *pairs = spec.split("+")
    if output not in ("compact", "json", "lines"):
        raise argparse.ArgumentTypeError(f"output design {output!r}: compact, json or lines")
    extras = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
    unknown = set(extras) - set(Settings.model_fields)
    if unknown or len(extras) != len(pairs):
        raise argparse.ArgumentTypeError(f"{spec!r}: settings are name=value, known names ({sorted(unknown)})")
    return output, extras


async def run(args: argparse.Namespace, output: str, extras: dict[str, str] | None = None) -> dict[str, Any]:
    """One design variant (extraction ``output`` and setting ``extras``) over the turns: memorize, score, cost."""
    turns = load(Path(args.data))
    if args.samples:
        turns = [t for t in turns if t.sample_id in args.samples]
    if args.per_sample:
        turns = subset(turns, args.per_sample)
    overrides: dict[str, Any] = {
        "batch_max_messages": args.batch,
        "batch_token_budget": 100_000,
        "invalidation_candidates": 0 if args.no_resolve else 2,
        "llm": args.llm,
        "extraction_output": output,
        "llm_speculative": args.speculative,
    }
    overrides.update(extras or {})
    if args.threads:
        overrides["llm_threads"] = args.threads
    if args.model:
        overrides["llm_model"] = args.model
    if args.cache_only:
        overrides["llm_retries"] = 0
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(args.data_dir or tmp), **overrides)
        embedder = build_embedder(settings)
        store = RecordingStore(Path(tmp) / "memory.sqlite3", embedder.dim)
        cache = SqliteMemoryStore(Path(args.cache), dim=embedder.dim) if args.cache else None
        inner = CacheOnly(settings.llm_model) if args.cache_only else None
        llm = build_llm(settings, cache=cache, inner=inner)
        service = MemorizeService(
            store.stores(),
            llm,
            embedder,
            settings,
            extract_task=ExtractTask.from_settings(settings, example=not args.no_example, output=output),
        )
        # this machine's speed, measured beside each variant on its own engine: compare runs on other machines by it
        speed = None if args.cache_only or args.llm != "local" else await generation_speed(settings)
        rejected_before = _rejected()  # the counters are the process's: a second variant counts from here
        ingest = datetime.now(UTC)
        started = time.perf_counter()
        dead = 0
        failed: set[str] = set()

        def on_step(chunk: list[MemoryEvent], outcome: MemorizeOutcome) -> None:
            nonlocal dead
            dead += len(outcome.dead_letters)
            failed.update(i for letter in outcome.dead_letters for i in letter.failed_event_ids)
            if args.verbose:
                print(f"{chunk[-1].user_id} +{len(chunk)} dead={dead}", flush=True)

        # as a worker would with a backlog: each conversation its own user, all at once, and up to TAKE_BATCHES
        # batches of one a call (extracted side by side, written in order)
        messages = [t.message(f"{args.tag}-{t.sample_id}", ingest) for t in turns]
        await service.memorize_backlog(messages, on_step)
        seconds = time.perf_counter() - started
        usage = {task: vars(u) for task, u in llm.by_task.items()}
        judge = llm
        no_judge = args.no_judge or args.cache_only
        if not no_judge and args.judge_model and args.judge_model != llm.model:
            # one judge for every model compared, so their scores differ by what they extracted, not who judged
            judge = build_llm(settings.model_copy(update={"llm_model": args.judge_model}), cache=cache)
        if args.cache_only:
            turns = [t for t in turns if t.event_id not in failed]  # only what was extracted is scored
        result = await score(turns, store.applied, embedder, judge=None if no_judge else judge)
        messages = len(turns)
        extract = llm.by_task.get("extract")
        summary = {
            "variant": {
                "batch": args.batch,
                "example": not args.no_example,
                "output": output,
                "settings": extras or {},
                "speculative": args.speculative,
                "resolve": not args.no_resolve,
                "llm": args.llm,
                "model": llm.model,
                "judge": None if no_judge else args.judge_model,
                "cache_only": args.cache_only,
            },
            "messages": messages,
            **result.summary(),
            "dead_letters": dead,
            "extract_calls_per_message": round(extract.calls / messages, 3) if extract else 0,
            "calls_per_message": round(
                sum(u.calls - u.cached for t, u in llm.by_task.items() if t != "judge") / messages, 3
            ),
            "rejected_calls": {k: v - rejected_before.get(k, 0) for k, v in _rejected().items()},
            "prompt_tokens_per_message": round(
                sum(u.tokens_in for t, u in llm.by_task.items() if t != "judge") / messages
            ),
            "completion_tokens_per_message": round(
                sum(u.tokens_out for t, u in llm.by_task.items() if t != "judge") / messages
            ),
            "prompt_tokens_evaluated_per_message": round(
                sum(u.tokens_in - u.prompt_reused for t, u in llm.by_task.items() if t != "judge") / messages
            ),
            "model_seconds_per_message": round(
                sum(u.seconds for t, u in llm.by_task.items() if t != "judge") / messages, 2
            ),
            "seconds_per_message": round(seconds / messages, 2),
            "generated_tokens_per_s": speed,
            "usage": usage,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        }
        details = {
            "misses": result.misses,
            "unmatched": result.unmatched,
            "junk": result.junk,
            "judgements": result.judgements,
            "theses": [v.name for cs in store.applied for v in cs.vertices if v.kind.value == "thesis"],
        }
        await llm.close()
        await store.close()
        if cache is not None:
            await cache.close()
    if args.out:
        await asyncio.to_thread(Path(args.out).write_text, json.dumps({"summary": summary, **details}, indent=1))
    return summary


def _rejected() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.name == "memstream_llm_rejected_outputs":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[f"{s.labels['task']}:{s.labels['reason']}"] = s.value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(LOCOMO), help="LoCoMo JSON (the gold files name its samples)")
    parser.add_argument("--samples", nargs="*", help="only these sample ids")
    parser.add_argument("--per-sample", type=int, default=0, help="first N labelled turns of each conversation")
    parser.add_argument("--batch", type=int, default=8, help="messages per extraction call")
    parser.add_argument("--no-example", action="store_true", help="extraction prompt without its worked example")
    parser.add_argument("--no-resolve", action="store_true", help="skip the duplicate/contradiction call")
    parser.add_argument("--no-judge", action="store_true", help="embedding matching only")
    parser.add_argument(
        "--judge-model", default=Settings.model_fields["llm_model"].default, help="local model that judges matches"
    )
    parser.add_argument("--llm", default="local", choices=["local", "ollama"])
    parser.add_argument("--model", help="MEMSTREAM_LLM_MODEL for this run")
    parser.add_argument("--data-dir", help="where local model files are assembled (default: a temp folder)")
    parser.add_argument("--cache", help="sqlite file for an LLM cache (reruns cost nothing; costs then undercount)")
    parser.add_argument("--cache-only", action="store_true", help="never call the model: score the cached batches")
    parser.add_argument("--tag", default="bench", help="user id prefix")
    parser.add_argument(
        "--output",
        action="append",
        type=variant,
        help="extraction output design (compact, json, lines), with settings of its own after '+' "
        "(compact+resolve_by_meaning=false); repeat to compare variants side by side in one run (default: compact)",
    )
    parser.add_argument("--speculative", default="none", help="MEMSTREAM_LLM_SPECULATIVE for this run")
    parser.add_argument("--threads", type=int, help="MEMSTREAM_LLM_THREADS for this run")
    parser.add_argument("--out", help="write the full JSON here")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    outputs = args.output or [("compact", {})]
    out = args.out
    for n, (output, extras) in enumerate(outputs):
        if out and len(outputs) > 1:
            args.out = f"{Path(out).with_suffix('')}-{n}-{output}.json"
        # every variant starts from a cold engine: the KV and RAM prompt caches of the one before would flatter it
        unload_all()
        summary = asyncio.run(run(args, output, extras))
        print(json.dumps({k: v for k, v in summary.items() if k != "usage"}), flush=True)


async def generation_speed(settings: Settings) -> float:
    """Generated tokens/s of the run's model on the run's engine, with a free-form prompt (the calibration)."""
    from benchmarks.llm_speed import calibrate
    from services.adapters.llamacpp import LlamaCppLLM
    from services.llm.factory import build_adapter

    adapter = build_adapter(settings)
    assert isinstance(adapter, LlamaCppLLM)
    engine = await adapter.load()
    return round(await asyncio.to_thread(calibrate, engine, 64), 1)


if __name__ == "__main__":
    main()
