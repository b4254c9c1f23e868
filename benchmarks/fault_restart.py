"""The issue-9 scenario at scale: ``--users`` users post ``--per-user`` messages each through `memstream up`
(embedded broker, rule-based scripted LLM), every process gets ``--signal`` right after the last 202, then
`memstream up` again on the same data directory; counts what was accepted, memorized before the kill, memorized
in the end, lost and duplicated. Uses the fault tests' helpers (tests/test_durability.py).

  python benchmarks/fault_restart.py --users 20 --per-user 100 --signal KILL
  python benchmarks/fault_restart.py --users 20 --per-user 100 --signal TERM

Prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streams.gateway.keys import create_key  # noqa: E402
from tests.conftest import make_settings  # noqa: E402
from tests.test_durability import Up, alive, kill_all, post_messages, stats, wait_for  # noqa: E402


def memorized(url: str, users: list[str]) -> dict[str, dict[str, int]]:
    out = {}
    for user in users:
        got = stats(url, user)
        out[user] = {"events": int(got["events"]), "episodes": int(got["vertices"]["episodic"])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--per-user", type=int, default=100)
    parser.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for memory after the restart")
    args = parser.parse_args()
    sig = signal.Signals[f"SIG{args.signal}"]
    users = [f"user{n:02d}" for n in range(args.users)]
    work = Path(tempfile.mkdtemp(prefix="fault-restart-"))
    (work / "data").mkdir()
    settings = make_settings(work / "data")
    os.environ["MEMSTREAM_API_KEY"] = create_key(settings, ["*"], ["admin"], label="benchmark")  # the helpers send it

    first = Up(settings, work / "up-1.log")
    first.start()
    children = first.wait_ready()
    accepted = post_messages(first.url, args.per_user, users)
    total = sum(len(ids) for ids in accepted.values())
    before = sum(m["events"] for m in memorized(first.url, users).values())
    assert first.process is not None
    kill_all([*children, first.process.pid], sig)
    first.process.wait(timeout=120)
    wait_for(lambda: not any(alive(p) for p in children), 120, "every process gone")

    second = Up(settings, work / "up-2.log")
    second.start()
    try:
        second.wait_ready()
        started = time.monotonic()

        def done() -> bool:
            try:
                return sum(m["events"] for m in memorized(second.url, users).values()) >= total
            except httpx.HTTPError:
                return False

        try:
            wait_for(done, args.timeout, "everything memorized", poll_s=1.0)
        except AssertionError as exc:
            print(exc)
        took = time.monotonic() - started
        after = memorized(second.url, users)
    finally:
        second.stop()
    events = sum(m["events"] for m in after.values())
    episodes = sum(m["episodes"] for m in after.values())
    summary = {
        "signal": args.signal,
        "accepted": total,
        "memorized_before_the_kill": before,
        "memorized_after_restart": events,
        "episodes": episodes,
        "lost": total - events,
        "duplicated": episodes - events,
        "restart_to_all_memorized_s": round(took, 1),
        "logs": str(work),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
