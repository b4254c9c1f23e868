"""Overhead of tracing and metrics on ingest: the ingest pipeline run as `memstream up` runs it (embedded broker,
a Faust worker process, the gateway process), with observability on and off, alternately.

on:  Prometheus metrics (multiprocess files, as under `memstream up`), JSON logs at INFO with the ids bound, the
     gateway's trace feed and consumer-lag sensor (1 s period).
off: every prometheus-client metric a no-op, log context binding a no-op, logs at WARNING, no trace feed, no lag
     sensor. The switch is a ``sitecustomize`` module put on the children's PYTHONPATH, so the very same code runs.

Measured per run: throughput (messages/s from the first produce to the last memory update) and the CPU seconds
the worker and gateway processes spent in that window, per message.

On a machine shared with other work those whole-pipeline runs vary far more than 5% from run to run, so
``--mode service`` measures the same instrumentation in one process, switching it on and off every chunk of
messages (ABBA order) around the memorize handler and service, with metrics in multiprocess mode as under
`memstream up` and JSON logs written to a file: the CPU time per message of the two halves differs only by the
instrumentation, whatever the rest of the machine does.

  python benchmarks/overhead.py --messages 300 --users 10 --repeat 3     # the pipeline, `memstream up` style
  python benchmarks/overhead.py --mode service --messages 800 --chunk 16  # in-process, interleaved

Prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import load_messages, settings_for

from memstream.runtime import Stack
from schemas.events import ChatMessage, MemoryUpdate
from streams.codec import encode
from streams.gateway.client import bearer
from streams.gateway.keys import create_key
from streams.topics import TopicNames

SITECUSTOMIZE = '''
import os

if os.environ.get("MEMSTREAM_BENCH_OBSERVABILITY") == "off":
    import prometheus_client
    import structlog.contextvars as contextvars

    class _Off:
        """A metric that records nothing."""

        def __init__(self, *args, **kwargs):
            pass

        def labels(self, *args, **kwargs):
            return self

        def inc(self, *args, **kwargs):
            pass

        dec = set = observe = inc

    prometheus_client.Counter = prometheus_client.Gauge = prometheus_client.Histogram = _Off
    prometheus_client.Summary = _Off
    contextvars.bind_contextvars = lambda **values: {}
    contextvars.clear_contextvars = lambda: None
    contextvars.get_contextvars = lambda: {}
    contextvars.merge_contextvars = lambda logger, name, event_dict: event_dict
'''


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def configure(mode: str, hook_dir: Path) -> None:
    """Environment the stack's children inherit for ``mode``."""
    os.environ["MEMSTREAM_BENCH_OBSERVABILITY"] = mode
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook_dir), os.environ.get("MEMSTREAM_BENCH_PYTHONPATH", "")])
    os.environ["MEMSTREAM_OBS_TRACES"] = "true" if mode == "on" else "false"
    os.environ["MEMSTREAM_OBS_LAG_INTERVAL_S"] = "1" if mode == "on" else "0"


async def run_once(mode: str, messages: list[ChatMessage], hook_dir: Path) -> dict[str, Any]:
    configure(mode, hook_dir)
    with tempfile.TemporaryDirectory() as tmp:
        settings = settings_for(Path(tmp), batch_wait_s=0.2, log_level="INFO" if mode == "on" else "WARNING")
        stack = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=90)
        await stack.start()
        try:
            topics = TopicNames.from_settings(settings)
            producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all", linger_ms=5)
            consumer = AIOKafkaConsumer(
                topics.memory_updates, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest", group_id=None
            )
            await producer.start()
            await consumer.start()
            pids = {child.name: child.process.pid for child in stack.children}
            try:
                cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                started = time.perf_counter()
                for m in messages:
                    await producer.send(topics.chat, encode(m), key=m.user_id.encode())
                await producer.flush()
                wanted = {m.event_id for m in messages}
                done: set[str] = set()
                deadline = time.monotonic() + max(120.0, len(messages) * 0.5)
                while not wanted <= done:
                    stack.check_children()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"only {len(done & wanted)}/{len(wanted)} memorized before the deadline")
                    for batch in (await consumer.getmany(timeout_ms=500)).values():
                        for record in batch:
                            done.update(MemoryUpdate.model_validate_json(record.value or b"").source_event_ids)
                elapsed = time.perf_counter() - started
                cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
                # proof of the switch: what the pipeline's metrics say it memorized (0 when off)
                metrics_key = create_key(settings, ["*"], ["metrics"], label="benchmark")
                async with httpx.AsyncClient(timeout=10, headers=bearer(metrics_key)) as http:
                    exported = (await http.get(f"{stack.url}/metrics")).text
                counted = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in exported.splitlines()
                    if line.startswith("memstream_memorize_events_total{")
                )
            finally:
                await producer.stop()
                await consumer.stop()
        finally:
            await asyncio.to_thread(stack.stop)
    return {
        "mode": mode,
        "seconds": round(elapsed, 2),
        "messages_per_s": round(len(messages) / elapsed, 2),
        "cpu_ms_per_message": round(sum(cpu.values()) * 1000 / len(messages), 2),
        "gateway_cpu_ms_per_message": round(cpu["gateway"] * 1000 / len(messages), 3),
        "metrics_counted_events": counted,
        "load_average": round(os.getloadavg()[0], 2),
    }


def summarise(runs: list[dict[str, Any]], messages: int) -> dict[str, Any]:
    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    on_rate, off_rate = median("on", "messages_per_s"), median("off", "messages_per_s")
    on_cpu, off_cpu = median("on", "cpu_ms_per_message"), median("off", "cpu_ms_per_message")
    on_gateway, off_gateway = median("on", "gateway_cpu_ms_per_message"), median("off", "gateway_cpu_ms_per_message")
    return {
        "messages": messages,
        "runs": runs,
        "median_messages_per_s": {"on": on_rate, "off": off_rate},
        "median_cpu_ms_per_message": {"on": on_cpu, "off": off_cpu},
        "median_gateway_cpu_ms_per_message": {"on": on_gateway, "off": off_gateway},
        "throughput_overhead_pct": round((1 - on_rate / off_rate) * 100, 2),
        "cpu_overhead_pct": round((on_cpu / off_cpu - 1) * 100, 2),
    }


class _NullPublisher:
    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        return None


class Switch:
    """Turns prometheus-client recording, the log context and INFO logging off and on again, in this process."""

    def __init__(self) -> None:
        import prometheus_client.metrics as pm
        import structlog.contextvars as cv

        self.pm, self.cv = pm, cv
        self.methods = {
            (pm.Counter, "inc"): pm.Counter.inc,
            (pm.Gauge, "set"): pm.Gauge.set,
            (pm.Gauge, "inc"): pm.Gauge.inc,
            (pm.Histogram, "observe"): pm.Histogram.observe,
            (pm.MetricWrapperBase, "labels"): pm.MetricWrapperBase.labels,
        }
        self.context = {
            name: getattr(cv, name) for name in ("bind_contextvars", "get_contextvars", "clear_contextvars")
        }

    def set(self, on: bool) -> None:
        from services.logging import configure_logging

        for (cls, name), original in self.methods.items():
            setattr(cls, name, original if on else _noop_method(name))
        for name, original in self.context.items():
            setattr(self.cv, name, original if on else _NOOP_CONTEXT[name])
        configure_logging("INFO" if on else "WARNING", json=True)


def _noop_method(name: str) -> Any:
    if name == "labels":
        return lambda self, *args, **kwargs: self
    return lambda self, *args, **kwargs: None


_NOOP_CONTEXT: dict[str, Any] = {
    "bind_contextvars": lambda **values: {},
    "get_contextvars": lambda: {},
    "clear_contextvars": lambda: None,
}


class Accounting:
    """Times every instrumentation call directly: metric updates, log-context binding, log lines (rendering and
    writing). Wrapping adds two clock reads per call, so the total is an upper bound of what they cost."""

    def __init__(self, switch: Switch) -> None:
        import logging

        import structlog._base

        self.seconds = 0.0
        self.calls = 0
        self.targets: list[tuple[Any, str]] = [*switch.methods, *((switch.cv, n) for n in switch.context)]
        self.targets += [(structlog._base.BoundLoggerBase, "_proxy_to_logger"), (logging.Handler, "handle")]
        self.originals = {target: getattr(*target) for target in self.targets}

    def __enter__(self) -> Accounting:
        for (owner, name), original in self.originals.items():
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, name), original in self.originals.items():
            setattr(owner, name, original)

    def _timed(self, original: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        return timed


async def run_service(messages: list[ChatMessage], chunk: int) -> dict[str, Any]:
    """80% of the messages in chunks alternating on/off (ABBA), the rest with every instrumentation call timed."""
    from services.container import build_services
    from services.llm.scripted import rule_based_llm
    from streams.handlers import MemorizeHandler, Record

    switch = Switch()
    with tempfile.TemporaryDirectory() as tmp:
        settings = settings_for(Path(tmp))
        topics = TopicNames.from_settings(settings)
        services = await build_services(settings, llm=rule_based_llm())
        handler = MemorizeHandler(services.memorize, _NullPublisher(), topics)

        async def handle(part: list[ChatMessage]) -> float:
            records = [Record(topics.chat, m.user_id.encode(), encode(m)) for m in part]
            started = time.process_time()
            await handler.handle(records)
            return (time.process_time() - started) * 1000 / len(part)

        chunks = [messages[i : i + chunk] for i in range(0, len(messages), chunk)]
        split = 1 + (len(chunks) - 1) * 4 // 5 // 4 * 4  # warm-up chunk, then whole ABBA groups
        groups: list[tuple[float, float]] = []
        try:
            switch.set(True)
            await handle(chunks[0])  # warm-up: model load, first queries
            for n in range(1, split, 4):
                on = [await _switched(switch, True, handle, chunks[n])]
                off = [await _switched(switch, False, handle, chunks[n + 1])]
                off.append(await _switched(switch, False, handle, chunks[n + 2]))
                on.append(await _switched(switch, True, handle, chunks[n + 3]))
                groups.append((statistics.fmean(on), statistics.fmean(off)))
            switch.set(True)
            accounted = 0
            cpu_accounted = 0.0
            with Accounting(switch) as accounting:
                for part in chunks[split:]:
                    cpu_accounted += await handle(part) * len(part)
                    accounted += len(part)
        finally:
            switch.set(True)
            await services.close()
    diffs = [on - off for on, off in groups]
    off_mean = statistics.fmean(off for _, off in groups)
    on_mean = statistics.fmean(on for on, _ in groups)
    half_width = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    instrumentation_ms = accounting.seconds * 1000 / accounted
    return {
        "mode": "service",
        "chunk": chunk,
        "ab_groups": len(groups),
        "ab_messages_per_mode": len(groups) * 2 * chunk,
        "cpu_ms_per_message": {"on": round(on_mean, 2), "off": round(off_mean, 2)},
        "cpu_overhead_pct": round(statistics.fmean(diffs) / off_mean * 100, 2),
        "cpu_overhead_pct_95ci": round(half_width / off_mean * 100, 2),
        "accounted_messages": accounted,
        "instrumentation_calls_per_message": round(accounting.calls / accounted, 1),
        "instrumentation_ms_per_message": round(instrumentation_ms, 3),
        "instrumentation_share_pct": round(instrumentation_ms / (cpu_accounted / accounted) * 100, 3),
        "metrics_counted_events": _counted_events(),  # warm-up, "on" and accounted chunks: proof of the switch
        "load_average": round(os.getloadavg()[0], 2),
    }


async def _switched(switch: Switch, on: bool, handle: Any, part: list[ChatMessage]) -> float:
    switch.set(on)
    result: float = await handle(part)
    return result


def _counted_events() -> float:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "memstream_memorize_events_total"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["pipeline", "service"], default="pipeline")
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=16, help="service mode: messages per on/off switch")
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode, alternating on and off")
    parser.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    args = parser.parse_args()
    messages = load_messages(args.data_dir, args.messages, args.users)
    if args.mode == "service":
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            # metrics in multiprocess files, as under `memstream up`: prometheus-client reads the variable when it
            # is imported, so start again with it set
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="memstream-metrics-")
            os.execv(sys.executable, [sys.executable, *sys.argv])
        log = Path(tempfile.mkdtemp()) / "service.log"
        with log.open("w") as sink:
            saved, sys.stderr = sys.stderr, sink  # the JSON log lines are written, to a file, as in production
            try:
                result = asyncio.run(run_service(messages, args.chunk))
            finally:
                sys.stderr = saved
        result["log_lines"] = sum(1 for _ in log.open())
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    os.environ.setdefault("MEMSTREAM_BENCH_PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    runs = []
    with tempfile.TemporaryDirectory() as hooks:
        (Path(hooks) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for n in range(args.repeat):
            # ABBA order, so a drift in the machine's load affects both modes alike
            for mode in ("off", "on") if n % 2 == 0 else ("on", "off"):
                run = asyncio.run(run_once(mode, messages, Path(hooks)))
                sys.stderr.write(json.dumps(run) + "\n")
                runs.append(run)
    sys.stdout.write(json.dumps(summarise(runs, len(messages))) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
