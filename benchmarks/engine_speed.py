"""What the llama.cpp build in this environment does with this CPU: prompt reading and generation speed.

  python -m benchmarks.engine_speed --model qwen2.5-coder-1.5b-instruct-q4_k_m --models-dir memstream-data/models

Loads the model in this process (the same xllamacpp server the adapter uses, threads never spinning) and measures,
with llama.cpp's own timings and greedy decoding:

* prompt tokens read a second, on a prompt of about 1,000 distinct tokens (memorize's and the answer's prompts are
  mostly read, not written: the first answer token waits for the whole prompt);
* generated tokens a second with 1, 2 and 4 requests decoded together (memorize sends its extraction calls at once).

It also prints the CPU features the build uses (``get_system_info``): the PyPI wheel is built for AVX2; a build
from source (``scripts/native-engine``) uses what the CPU has (AVX-512, VNNI, AMX). Run it in two environments on
one machine to compare the builds; every prompt is distinct, so no KV cache serves one from another.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xllamacpp

from services.adapters.llamacpp.weights import ensure_model

_WORDS = [
    "river",
    "lamp",
    "orange",
    "violin",
    "harbor",
    "maple",
    "ticket",
    "garden",
    "copper",
    "winter",
    "pencil",
    "marble",
    "falcon",
    "meadow",
    "lantern",
    "saddle",
    "cobalt",
    "thunder",
    "velvet",
    "anchor",
]


def _prompt(words: int) -> str:
    """A distinct prompt of about ``words`` words (the tag defeats every cache)."""
    tag = uuid.uuid4().hex
    body = " ".join(_WORDS[(n * 7 + len(tag)) % len(_WORDS)] for n in range(words))
    return f"[{tag}] Summarise these notes in one sentence: {body}"


def _call(server: Any, content: str, max_tokens: int) -> dict[str, float]:
    request = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    out = server.handle_chat_completions(request)
    timings = out.get("timings", {}) if isinstance(out, dict) else {}
    return {k: float(v) for k, v in timings.items() if isinstance(v, int | float)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    parser.add_argument("--models-dir", default="memstream-data/models")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--prompt-words", type=int, default=700)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens a request")
    parser.add_argument("--parallel", type=int, action="append", help="requests at once (repeatable; 1 2 4)")
    args = parser.parse_args()
    widths = args.parallel or [1, 2, 4]
    params = xllamacpp.CommonParams()
    params.model.path = str(ensure_model(args.model, Path(args.models_dir)))
    params.n_parallel, params.verbosity = max(widths), -1
    params.n_ctx = 2048 * params.n_parallel
    for cpu in (params.cpuparams, params.cpuparams_batch):
        cpu.n_threads, cpu.poll = args.threads, 0
    server = xllamacpp.Server(params)
    _call(server, _prompt(20), 4)  # warm-up: first-call allocations are not the engine's speed
    reading = _call(server, _prompt(args.prompt_words), 1)
    result: dict[str, Any] = {
        "build": xllamacpp.get_system_info().strip(),
        "model": args.model,
        "threads": args.threads,
        "prompt_tokens": int(reading.get("prompt_n", 0)),
        "prompt_tokens_per_s": round(reading.get("prompt_per_second", 0.0), 1),
        "generated_tokens_per_s": {},
        "load_average": os.getloadavg()[0],
    }
    for width in widths:
        with ThreadPoolExecutor(width) as pool:
            started = time.perf_counter()
            done = list(pool.map(lambda _: _call(server, _prompt(12), args.tokens), range(width)))
            wall = time.perf_counter() - started
        generated = sum(t.get("predicted_n", 0.0) for t in done)
        result["generated_tokens_per_s"][str(width)] = round(generated / wall, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
