"""What the durable acknowledgement costs: the latency of ``POST /v1/messages`` (one message, answered 202) with
the gateway's outbox (SQLite WAL, synchronous=FULL: one fsync per group commit) and without it (the outbox's
``add`` a no-op, everything else the same), one client in a row and 8 concurrent clients.

The gateway runs as its own process (``memstream gateway``, as under `memstream up`) against the embedded broker;
no worker runs, so only the accept path is measured. The data directory (and so the outbox file) is
``--data-dir``: put it on the disk you want to measure, not on a tmpfs.

  python benchmarks/ack_latency.py --posts 2000 --concurrency 8

Prints one line per run and a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memstream.broker import EmbeddedBroker, free_port  # noqa: E402
from memstream.runtime import child_env  # noqa: E402
from services.settings import Settings  # noqa: E402
from streams.gateway.client import bearer  # noqa: E402
from streams.gateway.keys import create_key  # noqa: E402


def serve(bootstrap: str, port: int, outbox: bool) -> None:
    """The gateway process; without the outbox, ``Outbox.add`` returns at once."""
    from streams.gateway.server import serve_gateway
    from streams.outbox import Outbox

    if not outbox:

        async def no_add(self: Outbox, records: Any) -> None:
            return None

        Outbox.add = no_add  # type: ignore[method-assign]
    asyncio.run(serve_gateway(Settings(), bootstrap, "127.0.0.1", port))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def load(url: str, posts: int, concurrency: int, tag: str, key: str) -> dict[str, Any]:
    latencies: list[float] = []
    counter = iter(range(posts))

    async def client(n: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30.0, headers=bearer(key)) as http:
            for i in counter:
                body = {"user_id": f"u{i % 20}", "speaker": "Ana", "text": f"{tag} message {i} from client {n}."}
                start = time.perf_counter()
                response = await http.post("/v1/messages", json=body)
                latencies.append(time.perf_counter() - start)
                if response.status_code != 202:
                    raise RuntimeError(f"{response.status_code}: {response.text}")

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(concurrency)))
    wall = time.perf_counter() - started
    return {
        "posts": posts,
        "concurrency": concurrency,
        "p50_ms": round(1000 * statistics.median(latencies), 2),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2),
        "mean_ms": round(1000 * statistics.fmean(latencies), 2),
        "posts_per_s": round(posts / wall, 1),
    }


async def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {process.returncode}")
            try:
                if (await http.get(f"{url}/healthz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the gateway did not become healthy")


def start_gateway(bootstrap: str, port: int, outbox: bool, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, __file__, "--serve", bootstrap, "--port", str(port)]
    if not outbox:
        command.append("--no-outbox")
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for outbox in (False, True) * args.repeat:
        data_dir = Path(tempfile.mkdtemp(prefix="ack-latency-", dir=args.data_dir))
        # the accept path is measured, not the rate limit
        settings = Settings(
            _env_file=None, data_dir=data_dir, llm="scripted", kafka_idempotence=False, rate_writes_per_min=0
        )
        key = create_key(settings, ["*"], ["write"], label="benchmark")
        async with EmbeddedBroker(data_dir / "broker") as broker:
            port = free_port()
            env = child_env(settings, broker.bootstrap, None, embedded=True)
            process = start_gateway(broker.bootstrap, port, outbox, env, data_dir / "gateway.log")
            try:
                url = f"http://127.0.0.1:{port}"
                await wait_healthy(url, process)
                for concurrency in (1, args.concurrency):
                    result = {"outbox": outbox, **await load(url, args.posts, concurrency, f"c{concurrency}", key)}
                    print(json.dumps(result), flush=True)
                    results.append(result)
            finally:
                process.terminate()
                process.wait(timeout=30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--posts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each mode, alternating")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the data directories go (a real disk)")
    parser.add_argument("--serve", metavar="BOOTSTRAP", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-outbox", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, not args.no_outbox)
        return
    results = asyncio.run(run(args))
    summary = {"machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}", "runs": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
