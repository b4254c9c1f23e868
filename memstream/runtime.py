"""`memstream up`: the embedded broker (unless one is configured), Faust worker processes and the gateway process,
started in that order, watched, and stopped in reverse order by PID.

Every child runs in its own session, so a Ctrl-C in the terminal reaches only this process, which then stops the
children gracefully (the workers finish their batch and commit). Children log to ``<data_dir>/logs``. They share a
Prometheus multiprocess directory, so the gateway's /metrics shows the workers' metrics too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from memstream.broker import BrokerError, EmbeddedBroker, wait_for_kafka
from memstream.processes import stop_process
from services.logging import get_logger
from services.settings import Settings
from streams.topics import ensure_topics

log = get_logger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as MEMSTREAM_* variables, so child processes run with exactly what `up` resolved."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, Path):
            text = str(value.resolve())
        elif isinstance(value, dict | list | tuple | set):
            text = json.dumps(value, default=str)
        else:
            text = str(value)
        env[f"MEMSTREAM_{name.upper()}"] = text
    return env


def child_env(settings: Settings, bootstrap: str, metrics_dir: Path | None) -> dict[str, str]:
    env = {**os.environ, **settings_env(settings)}
    env["MEMSTREAM_BROKER"] = bootstrap
    # a checkout that is not pip-installed still runs: the children import memstream from here
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    return env


@dataclass
class Stack:
    settings: Settings
    host: str
    port: int
    workers: int = 1
    startup_timeout_s: float = 120.0
    broker: EmbeddedBroker | None = None
    bootstrap: str = ""
    children: list[Child] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"

    async def start(self) -> str:
        """Start everything; return the gateway URL once /healthz answers. Stops what started on failure."""
        try:
            await self._start()
        except BaseException:
            self.stop()
            raise
        return self.url

    async def _start(self) -> None:
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.settings.broker:
            self.bootstrap = self.settings.broker
            await wait_for_kafka(self.bootstrap)
        else:
            self.broker = EmbeddedBroker(self.settings.data_dir / "broker")
            self.bootstrap = await self.broker.start()
        await ensure_topics(self.settings, self.bootstrap)

        metrics_dir = self.settings.data_dir / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)  # stale files would add old processes' counts
        metrics_dir.mkdir(parents=True)
        env = child_env(self.settings, self.bootstrap, metrics_dir)
        for n in range(1, self.workers + 1):
            web_port = self.settings.worker_web_port + n - 1
            self._spawn(f"worker-{n}", ["worker", "--bootstrap", self.bootstrap, "--web-port", str(web_port)], env)
        self._spawn(
            "gateway", ["gateway", "--bootstrap", self.bootstrap, "--host", self.host, "--port", str(self.port)], env
        )
        await self._wait_healthy()

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str]) -> None:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "memstream.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.children.append(Child(name, process, log_path))
        log.info("process_started", name=name, pid=process.pid, log=str(log_path))

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                self.check_children()
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/healthz")).status_code == 200:
                        return
                await asyncio.sleep(0.2)
        raise StartupError(f"the gateway did not become healthy at {self.url} within {self.startup_timeout_s:.0f}s")

    def check_children(self) -> None:
        """Raise ``StartupError`` naming the first child that exited, with the end of its log."""
        if self.broker is not None and not self.broker.running():
            raise StartupError(f"the embedded broker exited; see {self.broker.log_path}")
        for child in self.children:
            if not child.alive():
                raise StartupError(
                    f"{child.name} exited with code {child.process.returncode}; end of {child.log_path}:\n"
                    f"{child.log_tail()}"
                )

    async def run_until_stopped(self, stop: asyncio.Event) -> None:
        """Watch the children until ``stop`` is set; raise if one of them dies."""
        while not stop.is_set():
            self.check_children()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)

    def stop(self, timeout_s: float = 20.0) -> None:
        # gateway first (no new input), then workers (they finish and commit), then the broker, whatever fails
        try:
            while self.children:
                child = self.children.pop()
                try:
                    stop_process(child.process, timeout_s)
                except Exception:
                    log.exception("process_stop_failed", name=child.name, pid=child.process.pid)
                    continue
                log.info("process_stopped", name=child.name, pid=child.process.pid, code=child.process.returncode)
        finally:
            broker, self.broker = self.broker, None
            if broker is not None:
                broker.stop()


async def up(
    settings: Settings,
    host: str,
    port: int,
    workers: int = 1,
    on_ready: Callable[[str], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Run the stack until SIGINT/SIGTERM. ``on_ready(url)`` runs once the gateway is healthy (print, demo...)."""
    stack = Stack(settings, host, port, workers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task: asyncio.Task[None] | None = None
    try:
        url = await stack.start()
        if on_ready is not None:
            task = asyncio.create_task(on_ready(url))
        await stack.run_until_stopped(stop)
    except BrokerError as exc:
        raise StartupError(str(exc)) from exc
    finally:
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.to_thread(stack.stop)
