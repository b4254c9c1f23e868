"""Model time of extraction calls, design against design, in one run on this machine.

  python -m benchmarks.llm_speed --batches 4 --variant none --variant ngram --variant draft
  python -m benchmarks.llm_speed --batches 4 --variant none:json --variant ngram:compact

A variant is ``SPECULATIVE[:FORMAT[:THREADS]]`` (speculative decoding ``none``, ``ngram``, ``ngram-mod``, ``draft``
with the 0.5B model; output format ``json``, the previous per-message JSON, or ``compact``, the default; threads,
default ``--threads``). Every variant
loads its own engine (the same xllamacpp server the adapter uses) and they take the batches in turn (batch 1 on
every variant, then batch 2, ...), so a change in the machine's load falls on all of them alike. The batches are
the first labelled LoCoMo turns of each conversation, 8 at a time, as memorize would send them; greedy decoding.

Per variant: llama.cpp's own timings summed over the calls (prompt tokens evaluated and served from the KV cache,
completion tokens, drafted and accepted tokens), model seconds per message, and whether the output equals the
first variant's of the same format. The calibration line is this machine's generation speed of the same model
without speculation, a free-form prompt measured in the same run: compare runs on other machines by it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.extraction.gold import LOCOMO, Turn, load, subset
from services.adapters.llamacpp.llm import Engine, EngineConfig
from services.adapters.llamacpp.weights import ensure_model
from services.memorize.extraction import ExtractionInput, ExtractTask, Item

DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
CALIBRATION = "Write a long story about a cat who learns to swim, with many details."


def batches(turns: list[Turn], size: int, count: int) -> list[ExtractionInput]:
    """Consecutive turns of one conversation session, ``size`` at a time, as memorize batches a user's messages."""
    out: list[ExtractionInput] = []
    run: list[Turn] = []
    for turn in turns:
        if run and (turn.sample_id, turn.session) != (run[0].sample_id, run[0].session):
            run = []
        run.append(turn)
        if len(run) == size:
            out.append(ExtractionInput(items=[Item(t.speaker, t.text, t.time) for t in run]))
            run = []
    # one batch of each conversation in turn, so a few batches already span every conversation
    by_sample: dict[str, list[ExtractionInput]] = defaultdict(list)
    for batch, first in zip(out, [b.items[0] for b in out], strict=True):
        by_sample[next(t.sample_id for t in turns if t.text == first.text)].append(batch)
    mixed = [b for group in zip(*by_sample.values(), strict=False) for b in group]
    return mixed[:count]


def request(task: ExtractTask, data: ExtractionInput) -> dict[str, Any]:
    return {
        "messages": [{"role": m.role, "content": m.content} for m in task.messages(data)],
        "max_tokens": task.max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": task.json_schema(data), "strict": True},
        }
        if task.json_schema(data) is not None
        else None,
    }


def calibrate(engine: Engine, tokens: int) -> float:
    done = engine.chat(
        {"messages": [{"role": "user", "content": CALIBRATION}], "max_tokens": tokens, "temperature": 0.0, "seed": 0}
    )
    return float(done.timings.get("predicted_per_second", 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    parser.add_argument("--models-dir", default="memstream-data/models")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--per-sample", type=int, default=15)
    parser.add_argument("--variant", action="append", default=[], help="SPECULATIVE[:FORMAT], repeatable")
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--calibration-tokens", type=int, default=64)
    parser.add_argument("--data", default=str(LOCOMO))
    parser.add_argument("--out", help="write the per-call figures and outputs as JSON")
    args = parser.parse_args()
    variants = args.variant or ["none", "ngram"]
    models = Path(args.models_dir)
    path = ensure_model(args.model, models)
    draft = ensure_model(DRAFT_MODEL, models)
    work = batches(subset(load(Path(args.data)), args.per_sample), args.batch, args.batches)
    engines: dict[str, Engine] = {}
    tasks: dict[str, ExtractTask] = {}
    for variant in variants:
        kind, fmt, threads = ([*variant.split(":"), "", ""])[:3]
        config = EngineConfig(
            path,
            n_ctx=8192,
            n_parallel=1,
            n_threads=int(threads) if threads else args.threads,
            speculative=kind,
            draft_path=draft,
            draft_max=args.draft_max,
        )
        engines[variant] = Engine(config)
        tasks[variant] = ExtractTask(output=fmt or "compact")
    base = (
        engines[variants[0]] if variants[0].startswith("none") else Engine(EngineConfig(path, n_threads=args.threads))
    )
    calibration = [calibrate(base, args.calibration_tokens)]
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for n, data in enumerate(work, start=1):
        for variant in variants:
            started = time.perf_counter()
            done = engines[variant].chat(request(tasks[variant], data))
            wall = time.perf_counter() - started
            rows[variant].append({"batch": n, "wall_s": wall, "text": done.text, **done.timings})
            t = done.timings
            print(
                f"batch {n} {variant:>16}: {wall:6.1f} s  prompt {t.get('prompt_n', 0):>5}"
                f" (+{t.get('cache_n', 0)} cached)"
                f"  out {t.get('predicted_n', 0):>4}  draft {t.get('draft_n', 0)}/{t.get('draft_n_accepted', 0)}",
                flush=True,
            )
    calibration.append(calibrate(base, args.calibration_tokens))
    messages = sum(len(b.items) for b in work)
    first_of_format: dict[str, str] = {}
    summary = []
    for variant in variants:
        fmt = ([*variant.split(":"), ""])[1] or "compact"
        texts = [r["text"] for r in rows[variant]]
        same = first_of_format.setdefault(fmt, variant)
        equal = sum(a == b["text"] for a, b in zip(texts, rows[same], strict=True))
        total = {
            k: sum(float(r.get(k, 0)) for r in rows[variant])
            for k in (
                "wall_s",
                "prompt_n",
                "cache_n",
                "predicted_n",
                "prompt_ms",
                "predicted_ms",
                "draft_n",
                "draft_n_accepted",
            )
        }
        summary.append({"variant": variant, "messages": messages, **total, "same_output_as": same, "equal": equal})
    print(
        f"\nmachine: {platform.machine()} {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
        f"{args.model} at {args.threads} threads generates {calibration[0]:.1f} / {calibration[1]:.1f} tok/s "
        "(plain decoding, before / after)"
    )
    print(
        "| variant | model s / msg | prompt tokens evaluated / msg | served from cache / msg | completion tokens / msg "
        "| drafted / accepted | outputs equal to |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        m = s["messages"]
        print(
            f"| {s['variant']} | {s['wall_s'] / m:.2f} | {s['prompt_n'] / m:.0f} | {s['cache_n'] / m:.0f} "
            f"| {s['predicted_n'] / m:.0f} | {s['draft_n']:.0f} / {s['draft_n_accepted']:.0f} "
            f"| {s['equal']}/{len(work)} of {s['same_output_as']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"calibration": calibration, "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
