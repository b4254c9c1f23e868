"""Pipeline overhead: memorize's messages/s with a zero-latency scripted LLM, the embedded store and the real MiniLM
embedder, 20 interleaved users with texts of their own; today's tree and a pinned commit side by side in one run.

  python benchmarks/pipeline_overhead.py --messages 400 --users 20 --baseline bf1cd16
  python benchmarks/pipeline_overhead.py --embedder minilm --embedder static    # the two embedders, this tree

The baseline commit is unpacked (``git archive``) into a temporary folder and the same measurement runs there in a
subprocess, so both figures share the machine's load at the time. Reports messages/s, texts embedded per message and
embedder calls (what reached the model: cache hits excluded), LLM calls per message, and the load average.
Prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def measure(messages: int, users: int, data_dir: Path, embedder: str = "minilm") -> dict[str, Any]:
    """One run in this process, on whatever tree ``services`` is imported from."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ingest  # the benchmark's own message set and service runner

    from services.llm.factory import build_embedder
    from services.settings import Settings

    texts_embedded: list[int] = []
    kind = type(build_embedder(Settings(_env_file=None, embedder=embedder)))  # type: ignore[call-arg]
    inner = kind.embed

    async def counted(self: Any, texts: Any) -> list[list[float]]:
        texts_embedded.append(len(texts))
        return await inner(self, texts)

    kind.embed = counted  # type: ignore[method-assign]
    batch = ingest.load_messages(data_dir, messages, users)
    overrides = {"embedder": embedder} if embedder != "minilm" else {}  # a baseline tree may not know the setting
    result = asyncio.run(ingest.run_service(batch, batch=8, chunk=64, **overrides))
    texts_embedded.pop(0)  # the warm-up
    return {
        "embedder": embedder,
        "messages": result["messages"],
        "seconds": result["seconds"],
        "messages_per_s": result["messages_per_s"],
        "llm_calls_per_message": result["llm_calls_per_message"],
        "texts_embedded_per_message": round(sum(texts_embedded) / len(batch), 2),
        "embedder_calls": len(texts_embedded),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def baseline(commit: str, messages: int, users: int, data_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": tmp}
        args = [sys.executable, str(Path(__file__).resolve()), "--only-here"]
        args += ["--messages", str(messages), "--users", str(users), "--data-dir", str(data_dir)]
        out = subprocess.run(args, cwd=tmp, env=env, check=True, capture_output=True, text=True)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--baseline", default=None, help="a commit to measure beside this tree, in the same run")
    parser.add_argument("--only-here", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument(
        "--embedder", action="append", choices=["minilm", "static"], help="this tree with each (default: minilm)"
    )
    args = parser.parse_args()
    if args.only_here:
        sys.stdout.write(json.dumps(measure(args.messages, args.users, args.data_dir)) + "\n")
        return 0
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    if args.baseline:
        measured = baseline(args.baseline, args.messages, args.users, args.data_dir)
        results["baseline"] = {"commit": args.baseline, **measured}
    for embedder in args.embedder or ["minilm"]:
        key = "this_tree" if embedder == "minilm" else f"this_tree_{embedder}"
        results[key] = measure(args.messages, args.users, args.data_dir, embedder)
    sys.stdout.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
