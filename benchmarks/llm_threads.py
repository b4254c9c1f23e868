"""Local model speed by thread count and spin-waiting, on whatever else the machine is running.

  python -m benchmarks.llm_threads --threads 2 --poll 50    # llama.cpp's defaults on 2 cores
  python -m benchmarks.llm_threads --threads 1 --poll 0     # memstream's default on 2 cores

Loads the model in this process (the same xllamacpp server the adapter uses), runs one fixed prompt with greedy
decoding and prints llama.cpp's own prompt and generation timings as JSON. Run it with and without other work on
the cores (e.g. `python3 -c 'while True: pass' &`) to see why the adapter never lets its threads spin.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import xllamacpp

from services.adapters.llamacpp.weights import ensure_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    parser.add_argument("--models-dir", default="memstream-data/models")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--poll", type=int, default=0, help="llama.cpp busy-wait level, 0 (sleep) to 100 (spin)")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = str(ensure_model(args.model, Path(args.models_dir)))
    params.n_ctx, params.n_parallel, params.verbosity = 2048, 1, -1
    for cpu in (params.cpuparams, params.cpuparams_batch):
        cpu.n_threads, cpu.poll = args.threads, args.poll
    server = xllamacpp.Server(params)
    request = {
        "messages": [{"role": "user", "content": "Write a short story about a cat who learns to swim. " * 8}],
        "max_tokens": args.tokens,
        "temperature": 0,
    }
    started = time.perf_counter()
    out = server.handle_chat_completions(request)
    timings = out.get("timings", {}) if isinstance(out, dict) else {}
    print(
        json.dumps(
            {
                "model": args.model,
                "threads": args.threads,
                "poll": args.poll,
                "seconds": round(time.perf_counter() - started, 1),
                "prompt_tokens_per_s": round(timings.get("prompt_per_second", 0.0), 1),
                "seconds_per_generated_token": round(timings.get("predicted_per_token_ms", 0.0) / 1000, 3),
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
