"""Soak: `memstream up` (embedded Tansu broker, Faust worker(s), gateway; the rule-based scripted LLM) under
``--minutes`` of steady chat ingest from ``--users`` users, each also asking a few questions a minute, all through
the gateway with one API key per user. Meanwhile the resident memory (RSS) of every process is sampled every
``--sample-s`` seconds. At the end it waits until every accepted message is memorized, then reports:

* messages accepted (202) and memorized (applied events and episodes per user, from ``/v1/stats``);
* questions asked, answered (an answer event within ``--answer-timeout``), found, failed; answer latency p50/p99
  (POST of the question to the answer, long-polled);
* ingest-to-queryable p50/p99, polled: the 202 of a user's k-th message to the first poll of ``/v1/stats`` that
  counts k applied events of that user (resolution ``--poll-s``); and the workers' own histogram from
  ``/metrics`` (ingest time to memory committed, interpolated within its buckets);
* RSS first/last/max per process and its slope over the second half of the run (least squares, MB/min).

It fails (exit 1) when a post was refused, a question went unanswered (or answered with another user's memory),
an accepted message was not memorized exactly once, a process was restarted, or a process's RSS grew by more than
``--max-growth-mb`` over the second half (the fitted slope times that half's length).

  nice -n 5 python benchmarks/soak.py --minutes 10 --users 5 --rate 2 --questions-per-min 3

Prints a Markdown table to stderr and the JSON report as the last line of stdout. Loopback only; stops what it
started by PID. Uses the fault tests' helpers (tests/test_durability.py) and crash_soak's messages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.crash_soak import PLACES, make_messages  # noqa: E402
from streams.gateway.client import bearer  # noqa: E402
from streams.gateway.keys import create_key  # noqa: E402
from tests.conftest import make_settings  # noqa: E402
from tests.test_durability import Up, alive, children_of, wait_for  # noqa: E402

SPEAKER = re.compile(r"\bUser\d+\b")


@dataclass(frozen=True)
class Options:
    minutes: float = 10.0
    users: int = 5
    rate: float = 2.0  # messages per second, all users together
    questions_per_min: float = 3.0  # per user
    workers: int = 1
    sample_s: float = 10.0
    poll_s: float = 0.5
    answer_timeout_s: float = 60.0
    drain_timeout_s: float = 300.0
    max_growth_mb: float = 64.0
    seed: int = 1


@dataclass
class Tally:
    """What the load saw, filled by the concurrent tasks (one event loop, no locks needed)."""

    accepted: dict[str, list[float]]  # user -> monotonic time of each 202, in order
    texts: dict[str, list[str]]  # user -> the texts accepted
    memorized_at: dict[str, list[float]]  # user -> when the k-th applied event was first seen
    refused: list[str] = field(default_factory=list)
    asked: int = 0
    latencies: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    unanswered: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    own: int = 0  # answers that quote the asker's own memory (its speaker name): the leak check can see names
    examples: list[dict[str, str]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def summary(values: list[float], digits: int = 3) -> dict[str, float | int]:
    if len(values) < 2:
        return {"n": len(values), **({"max": round(values[0], digits)} if values else {})}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "n": len(values),
        "p50": round(cuts[49], digits),
        "p99": round(cuts[98], digits),
        "max": round(max(values), digits),
    }


def histogram_summary(metrics_text: str, name: str) -> dict[str, float | int]:
    """p50/p99 of a Prometheus histogram, interpolated within its buckets (as ``histogram_quantile`` does)."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    out: dict[str, float | int] = {"n": int(total)}
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        if not total:
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for upper in bounds:
            if buckets[upper] >= rank:
                if upper == float("inf"):
                    out[label] = lower  # beyond the last finite bucket: its bound is all that is known
                else:
                    share = (rank - below) / max(buckets[upper] - below, 1e-9)
                    out[label] = round(lower + (upper - lower) * share, 3)
                break
            lower, below = upper, buckets[upper]
    return out


async def ingest(
    http: httpx.AsyncClient,
    user: str,
    bodies: list[dict[str, Any]],
    start: float,
    interval: float,
    until: float,
    tally: Tally,
) -> None:
    """One message of ``user`` every ``interval`` seconds until ``until``, each waited for (202)."""
    due = start
    for body in bodies:
        if due >= until:
            return
        await asyncio.sleep(max(0.0, due - time.monotonic()))  # the load's pace, not a synchronisation
        try:
            response = await http.post("/v1/messages", json=[body])
        except httpx.HTTPError as exc:
            tally.refused.append(f"{user}: {exc!r}")
        else:
            if response.status_code == 202:
                tally.accepted[user].append(time.monotonic())
                tally.texts[user].append(body["text"])
            else:
                tally.refused.append(f"{user}: {response.status_code} {response.text[:200]}")
        due = max(due + interval, time.monotonic())  # late: no burst to catch up


async def ask(http: httpx.AsyncClient, user: str, question: str, timeout_s: float, tally: Tally) -> None:
    began = time.monotonic()
    tally.asked += 1
    try:
        response = await http.post("/v1/questions", json={"user_id": user, "question": question})
        if response.status_code != 202:
            tally.unanswered.append(f"{user}: POST {response.status_code} {response.text[:200]}")
            return
        query_id = response.json()["query_id"]
        while (left := began + timeout_s - time.monotonic()) > 0:
            got = await http.get(f"/v1/answers/{query_id}", params={"wait": min(10.0, max(0.1, left))})
            if got.status_code == 404:
                continue
            if got.status_code != 200:
                tally.unanswered.append(f"{user}: GET answer {got.status_code} {got.text[:200]}")
                return
            answer = got.json()
            tally.latencies.append(time.monotonic() - began)
            status = str(answer.get("status"))
            tally.statuses[status] = tally.statuses.get(status, 0) + 1
            if status == "error":
                tally.unanswered.append(f"{user}: {query_id} answered with an error: {answer.get('error')}")
            text = str(answer.get("answer", ""))
            names = set(SPEAKER.findall(text))
            tally.own += user.title() in names
            if len(tally.examples) < 3:
                tally.examples.append({"user": user, "question": question, "status": status, "answer": text[:300]})
            if others := names - {user.title()}:
                tally.leaks.append(f"{user}: {query_id} mentions {sorted(others)}")
            return
        tally.unanswered.append(f"{user}: no answer for {query_id} within {timeout_s:.0f}s")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        tally.unanswered.append(f"{user}: {exc!r}")


async def questions(
    http: httpx.AsyncClient, user: str, interval: float, until: float, opts: Options, rng: random.Random, tally: Tally
) -> None:
    """About one question every ``interval`` seconds (jittered), on a place the user wrote about; each runs
    beside the next, so a slow answer does not slow the asking."""
    asked: list[asyncio.Task[None]] = []
    due = time.monotonic() + rng.uniform(0.2, 1.0) * interval
    while due < until:
        await asyncio.sleep(max(0.0, due - time.monotonic()))  # the load's pace, not a synchronisation
        told = rng.choice(tally.texts[user]) if tally.texts[user] else ""
        place = next((p for p in PLACES if f" in {p} " in told), rng.choice(PLACES))
        asked.append(asyncio.create_task(ask(http, user, f"What did I do in {place}?", opts.answer_timeout_s, tally)))
        due += interval * rng.uniform(0.5, 1.5)
    await asyncio.gather(*asked)


async def watch_memorized(
    admin: httpx.AsyncClient, users: list[str], tally: Tally, poll_s: float, done: asyncio.Event, deadline: list[float]
) -> None:
    """Polls every user's applied-event count; stops when the load is done and everything accepted is applied,
    or at ``deadline[0]`` (moved once the load is done)."""
    while time.monotonic() < deadline[0]:
        for user in users:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                response = await admin.get(f"/v1/stats/{user}")
                if response.status_code == 200:
                    seen = min(int(response.json()["events"]), len(tally.accepted[user]))
                    now = time.monotonic()
                    while len(tally.memorized_at[user]) < seen:
                        tally.memorized_at[user].append(now)
        if done.is_set() and all(len(tally.memorized_at[u]) >= len(tally.accepted[u]) for u in users):
            return
        await asyncio.sleep(poll_s)  # polling interval of a condition with a deadline


async def sample(up_pid: int, start: float, until: float, every_s: float, tally: Tally) -> None:
    """RSS of `up` and each of its children, and the load average, every ``every_s`` seconds."""
    due = start
    while due <= until:
        await asyncio.sleep(max(0.0, due - time.monotonic()))  # the sampling period
        procs = {up_pid: "up", **children_of(up_pid)}
        rss = {f"{role} (pid {pid})": rss_mb(pid) for pid, role in procs.items()}
        tally.samples.append(
            {
                "t_s": round(time.monotonic() - start, 1),
                "load1": os.getloadavg()[0],
                "rss_mb": {k: round(v, 1) for k, v in rss.items() if v is not None},
            }
        )
        due += every_s


def rss_report(samples: list[dict[str, Any]], second_half_from: float) -> dict[str, dict[str, float]]:
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for name, mb in s["rss_mb"].items():
            series.setdefault(name, []).append((s["t_s"], mb))
    out = {}
    for name, points in series.items():
        mbs = [mb for _, mb in points]
        late = [(t, mb) for t, mb in points if t >= second_half_from]
        entry = {"first_mb": mbs[0], "last_mb": mbs[-1], "max_mb": max(mbs), "samples": len(points)}
        if len(late) >= 2 and late[-1][0] > late[0][0]:
            slope_s = statistics.linear_regression([t for t, _ in late], [mb for _, mb in late]).slope
            entry["slope_mb_per_min"] = round(60 * slope_s, 2)
            entry["second_half_growth_mb"] = round(slope_s * (late[-1][0] - late[0][0]), 1)
        out[name] = entry
    return out


async def warm_up(admin: httpx.AsyncClient, timeout_s: float) -> None:
    """One message memorized and one question answered before the clock starts: start-up (the embedder's model
    loading, first connections) is not what a soak measures."""
    user = "warmup"
    response = await admin.post("/v1/messages", json=[{"user_id": user, "speaker": "Warmup", "text": "I met Ivan."}])
    response.raise_for_status()
    deadline = time.monotonic() + timeout_s
    while int((await admin.get(f"/v1/stats/{user}")).json()["events"]) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm-up message was not memorized within {timeout_s:.0f}s")
        await asyncio.sleep(0.5)  # polling interval of a condition with a deadline
    tally = Tally({user: []}, {user: []}, {user: []})
    await ask(admin, user, "Whom did I meet?", timeout_s, tally)
    if tally.unanswered:
        raise RuntimeError(f"the warm-up question failed: {tally.unanswered[0]}")


async def drive(url: str, up_pid: int, keys: dict[str, str], admin_key: str, opts: Options) -> dict[str, Any]:
    users = sorted(keys)
    rng = random.Random(opts.seed)
    per_user = int(opts.minutes * 60 * opts.rate / len(users)) + 2
    messages = make_messages(per_user * len(users), len(users), opts.seed)
    bodies = {
        u: [m.model_dump(mode="json", exclude={"ingest_time"}) for m in messages if m.user_id == u] for u in users
    }
    tally = Tally({u: [] for u in users}, {u: [] for u in users}, {u: [] for u in users})
    interval = len(users) / opts.rate
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=50)
    async with contextlib.AsyncExitStack() as stack:
        admin = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=30.0, headers=bearer(admin_key), limits=limits)
        )
        await warm_up(admin, opts.answer_timeout_s + opts.drain_timeout_s)
        start = time.monotonic()
        until = start + opts.minutes * 60
        deadline = [until + opts.answer_timeout_s + opts.drain_timeout_s]
        clients = {
            u: await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=30.0, headers=bearer(keys[u]), limits=limits)
            )
            for u in users
        }
        watcher = asyncio.create_task(watch_memorized(admin, users, tally, opts.poll_s, done, deadline))
        sampler = asyncio.create_task(sample(up_pid, start, until, opts.sample_s, tally))
        load = [
            *(
                ingest(clients[u], u, bodies[u], start + n * interval / len(users), interval, until, tally)
                for n, u in enumerate(users)
            ),
            *(
                questions(clients[u], u, 60.0 / opts.questions_per_min, until, opts, random.Random(rng.random()), tally)
                for u in users
            ),
        ]
        await asyncio.gather(*load)
        load_s = time.monotonic() - start
        await sampler
        done.set()
        drain_from = time.monotonic()
        deadline[0] = drain_from + opts.drain_timeout_s
        await watcher
        drain_s = time.monotonic() - drain_from
        stats = {u: (await admin.get(f"/v1/stats/{u}")).json() for u in users}
        metrics_text = (await admin.get("/metrics")).text

    accepted = sum(len(v) for v in tally.accepted.values())
    events = sum(int(s["events"]) for s in stats.values())
    episodes = sum(int(s["vertices"].get("episodic", 0)) for s in stats.values())
    to_queryable = [m - a for u in users for a, m in zip(tally.accepted[u], tally.memorized_at[u], strict=False)]
    loads = [s["load1"] for s in tally.samples]
    return {
        "benchmark": "soak",
        "options": opts.__dict__,
        "machine": {
            "cpus": os.cpu_count(),
            "load1_min": min(loads),
            "load1_mean": round(statistics.fmean(loads), 2),
            "load1_max": max(loads),
        },
        "load_s": round(load_s, 1),
        "drain_s": round(drain_s, 1),
        "messages": {
            "accepted": accepted,
            "refused": len(tally.refused),
            "memorized": events,
            "episodes": episodes,
            "not_memorized": {
                u: len(tally.accepted[u]) - int(stats[u]["events"])
                for u in users
                if int(stats[u]["events"]) != len(tally.accepted[u])
            },
            "rate_per_s": round(accepted / (until - start), 2),
        },
        "questions": {
            "asked": tally.asked,
            "answered": sum(n for status, n in tally.statuses.items() if status != "error"),
            "statuses": tally.statuses,
            "failed": len(tally.unanswered),
            "other_users_memory": len(tally.leaks),
            "quoting_own_memory": tally.own,
            "examples": tally.examples,
        },
        "answer_latency_s": summary(tally.latencies),
        "ingest_to_queryable_s": {
            "polled": summary(to_queryable),
            "metrics": histogram_summary(metrics_text, "memstream_ingest_to_queryable_seconds"),
        },
        "rss": rss_report(tally.samples, (until - start) / 2),
        "samples": tally.samples,
        "problems": {"refused": tally.refused[:20], "unanswered": tally.unanswered[:20], "leaks": tally.leaks[:20]},
    }


def failures(report: dict[str, Any], opts: Options) -> list[str]:
    out = []
    m, q = report["messages"], report["questions"]
    if m["refused"]:
        out.append(f"{m['refused']} posts refused: {report['problems']['refused'][:3]}")
    if m["not_memorized"] or m["memorized"] != m["accepted"]:
        out.append(f"{m['accepted']} accepted, {m['memorized']} memorized: {m['not_memorized']}")
    if m["episodes"] != m["memorized"]:
        out.append(f"{m['episodes']} episodes for {m['memorized']} applied events (duplicates?)")
    if q["failed"] or q["answered"] != q["asked"]:
        out.append(f"{q['failed']} of {q['asked']} questions failed: {report['problems']['unanswered'][:3]}")
    if q["other_users_memory"]:
        out.append(f"answers with another user's memory: {report['problems']['leaks'][:3]}")
    roles: dict[str, int] = {}
    for name in report["rss"]:
        role = name.split(" ")[0]
        roles[role] = roles.get(role, 0) + 1
    expected = {"up": 1, "broker": 1, "gateway": 1, "worker": opts.workers}
    if roles != expected:
        out.append(f"processes seen {roles}, expected {expected}: a process was restarted or missing")
    for name, r in report["rss"].items():
        if r.get("second_half_growth_mb", 0.0) > opts.max_growth_mb:
            out.append(
                f"{name}: RSS grew {r['second_half_growth_mb']} MB over the second half (> {opts.max_growth_mb})"
            )
    return out


def markdown(report: dict[str, Any]) -> str:
    m, q, a = report["messages"], report["questions"], report["answer_latency_s"]
    polled, hist = report["ingest_to_queryable_s"]["polled"], report["ingest_to_queryable_s"]["metrics"]
    o, mach = report["options"], report["machine"]
    lines = [
        f"Soak: {o['minutes']} min, {o['users']} users, {o['rate']} msg/s, {o['questions_per_min']} questions/min "
        f"per user, {o['workers']} worker(s); {mach['cpus']} cores, load average (1 min) "
        f"{mach['load1_min']:.1f}–{mach['load1_max']:.1f}, mean {mach['load1_mean']:.1f}",
        "",
        "| measure | value |",
        "|---|---|",
        f"| messages accepted (202) / memorized / episodes | {m['accepted']} / {m['memorized']} / {m['episodes']} |",
        f"| posts refused | {m['refused']} |",
        f"| ingest rate | {m['rate_per_s']} msg/s |",
        f"| drain after the load (to all memorized) | {report['drain_s']} s |",
        f"| questions asked / answered / failed | {q['asked']} / {q['answered']} / {q['failed']} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(q['statuses'].items()))}) |",
        f"| answer latency p50 / p99 / max | {a.get('p50', '–')} / {a.get('p99', '–')} / {a.get('max', '–')} s |",
        f"| ingest → queryable, polled ({o['poll_s']} s) p50 / p99 / max | {polled.get('p50', '–')} / "
        f"{polled.get('p99', '–')} / {polled.get('max', '–')} s |",
        f"| ingest → committed, workers' histogram p50 / p99 (n, with the warm-up message) | "
        f"{hist.get('p50', '–')} / {hist.get('p99', '–')} s "
        f"({hist['n']}) |",
        "",
        "| process | RSS first MB | last MB | max MB | slope, second half (MB/min) |",
        "|---|---|---|---|---|",
    ]
    for name, r in sorted(report["rss"].items()):
        lines.append(
            f"| {name} | {r['first_mb']} | {r['last_mb']} | {r['max_mb']} | {r.get('slope_mb_per_min', '–')} |"
        )
    return "\n".join(lines)


def keys_for(settings: Any, users: list[str]) -> tuple[dict[str, str], str]:
    """One key per user (write, ask, read, for that user alone) and an admin key for stats and metrics."""
    keys = {u: create_key(settings, [u], ["write", "ask", "read"], label=f"soak {u}") for u in users}
    return keys, create_key(settings, ["*"], ["admin"], label="soak admin")


def stop(up: Up, children: dict[int, str]) -> None:
    """SIGTERM to `up` (it stops its children in order); then any child still there is killed, by PID."""
    up.stop()
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not any(alive(p) for p in children), 30, "children gone", poll_s=0.2)
    for pid in children:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run(opts: Options, work: Path) -> dict[str, Any]:
    """The whole soak in ``work`` (data directory and logs); the report."""
    (work / "data").mkdir(parents=True, exist_ok=True)
    settings = make_settings(work / "data", partitions=max(2, opts.workers))
    users = [f"user{n}" for n in range(opts.users)]
    keys, admin_key = keys_for(settings, users)
    up = Up(settings, work / "up.log", workers=opts.workers)
    up.env["MEMSTREAM_API_KEY"] = admin_key  # `up` makes no admin key of its own
    up.start()
    assert up.process is not None
    children: dict[int, str] = {}
    try:
        children = up.wait_ready()
        report = asyncio.run(drive(up.url, up.process.pid, keys, admin_key, opts))
        children |= children_of(up.process.pid)
    finally:
        stop(up, children)
    report["logs"] = str(work)
    report["failures"] = failures(report, opts)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Options()
    parser.add_argument("--minutes", type=float, default=defaults.minutes)
    parser.add_argument("--users", type=int, default=defaults.users)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="messages per second, all users")
    parser.add_argument("--questions-per-min", type=float, default=defaults.questions_per_min, help="per user")
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--sample-s", type=float, default=defaults.sample_s, help="RSS sampling period")
    parser.add_argument("--poll-s", type=float, default=defaults.poll_s, help="memorized-count polling period")
    parser.add_argument("--answer-timeout", type=float, default=defaults.answer_timeout_s)
    parser.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s)
    parser.add_argument("--max-growth-mb", type=float, default=defaults.max_growth_mb)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--work-dir", type=Path, default=None, help="data and logs here (default: a new tmp dir)")
    args = parser.parse_args()
    opts = Options(
        minutes=args.minutes,
        users=args.users,
        rate=args.rate,
        questions_per_min=args.questions_per_min,
        workers=args.workers,
        sample_s=args.sample_s,
        poll_s=args.poll_s,
        answer_timeout_s=args.answer_timeout,
        drain_timeout_s=args.drain_timeout,
        max_growth_mb=args.max_growth_mb,
        seed=args.seed,
    )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="soak-"))
    report = run(opts, work)
    print(markdown(report), file=sys.stderr)
    print(json.dumps(report))
    if report["failures"]:
        print("FAILED: " + "; ".join(report["failures"]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
