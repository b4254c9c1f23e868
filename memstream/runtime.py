"""`memstream up`: the embedded broker (unless one is configured), Faust worker processes and the gateway process,
started in that order, supervised, and stopped in reverse order by PID.

Every child runs in its own session, so a Ctrl-C in the terminal reaches only this process, which then stops the
children gracefully (the workers finish their batch and commit). Every child also dies with this process (Linux
``PR_SET_PDEATHSIG``), so a SIGKILLed `up` leaves no orphan on the ports. A child that exits after start-up is
started again with exponential backoff. `up` reports ready only when the gateway answering /healthz is the one
it started (its PID), and refuses to start when the gateway port is taken. Children log to ``<data_dir>/logs``.
They share a Prometheus multiprocess directory, so the gateway's /metrics shows the workers' metrics too.
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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiokafka.errors import KafkaError
from pydantic import SecretStr

from memstream.broker import BrokerError, EmbeddedBroker, port_free, wait_for_kafka
from memstream.processes import die_with_parent, stop_process
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
    args: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    failures: int = 0  # quick exits in a row: the restart backoff grows with them
    restart_at: float | None = None  # when a dead child is due to be started again

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


#: restart backoff: ``BACKOFF_BASE_S * 2**(quick exits in a row - 1)``, at most ``BACKOFF_MAX_S``
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
#: a child that ran this long before it exited is restarted at once (its earlier exits are forgiven)
STABLE_AFTER_S = 60.0
#: how long a child gets to stop when the broker under it is gone and everything is restarted
RESTART_STOP_TIMEOUT_S = 5.0


def restart_delay(failures: int) -> float:
    return 0.0 if failures <= 0 else min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (failures - 1))


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
        elif isinstance(value, SecretStr):
            text = value.get_secret_value()  # a child needs the secret itself, not its mask
        elif isinstance(value, dict | list | tuple | set):
            text = json.dumps(value, default=str)
        else:
            text = str(value)
        env[f"MEMSTREAM_{name.upper()}"] = text
    return env


def child_env(settings: Settings, bootstrap: str, metrics_dir: Path | None, embedded: bool = False) -> dict[str, str]:
    env = {**os.environ, **settings_env(settings)}
    env["MEMSTREAM_BROKER"] = bootstrap
    if embedded:
        env["MEMSTREAM_KAFKA_IDEMPOTENCE"] = "false"  # Tansu answers InitProducerId with an error
        env["MEMSTREAM_LAG_PROBE_ENDS"] = "true"  # Tansu's end offsets leave out all but a batch's first record
    # a checkout that is not pip-installed still runs: the children import memstream from here
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    return env


@dataclass
class Stack:
    """The processes of `memstream up`. ``start`` fails on any exit before ready; once ready, ``supervise``
    restarts what exited (the embedded broker with everything above it)."""

    settings: Settings
    host: str
    port: int
    workers: int = 1
    startup_timeout_s: float = 120.0
    broker: EmbeddedBroker | None = None
    bootstrap: str = ""
    children: list[Child] = field(default_factory=list)
    broker_failures: int = 0
    _env: dict[str, str] = field(default_factory=dict)
    _metrics_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"

    @property
    def embedded(self) -> bool:
        return not self.settings.broker

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
        await self._refuse_taken_port()
        if self.embedded:
            self.broker = EmbeddedBroker(self.settings.data_dir / "broker")
            self.bootstrap = await self.broker.start()
        else:
            self.bootstrap = self.settings.broker or ""
            await wait_for_kafka(self.bootstrap, settings=self.settings)
        await ensure_topics(self.settings, self.bootstrap)

        metrics_dir = self.settings.data_dir / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)  # stale files would add old processes' counts
        metrics_dir.mkdir(parents=True)
        self._metrics_dir = metrics_dir
        self._spawn_all()
        await self._wait_healthy()

    def _spawn_all(self) -> None:
        self._env = child_env(self.settings, self.bootstrap, self._metrics_dir, self.embedded)
        for n in range(1, self.workers + 1):
            web_port = self.settings.worker_web_port + n - 1
            self._spawn(f"worker-{n}", ["worker", "--bootstrap", self.bootstrap, "--web-port", str(web_port)])
        gateway = ["gateway", "--bootstrap", self.bootstrap, "--host", self.host, "--port", str(self.port)]
        self._spawn("gateway", gateway)

    async def _refuse_taken_port(self) -> None:
        """Never serve next to (or report ready against) a process this `up` did not start."""
        if port_free(self.host, self.port):
            return
        owner = "another process"
        with contextlib.suppress(httpx.HTTPError, ValueError):
            async with httpx.AsyncClient(timeout=2.0) as http:
                body = (await http.get(f"{self.url}/healthz")).json()
            if isinstance(body, dict) and "pid" in body:
                owner = f"a memstream gateway (pid {body['pid']}) that this `up` did not start"
        raise StartupError(
            f"{self.host}:{self.port} is taken by {owner}; stop it, or pick another port (--port, MEMSTREAM_PORT)"
        )

    def _spawn(self, name: str, args: list[str]) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "memstream.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # one prepared libc call between fork and exec
            )
        child = Child(name, list(args), log_path, process)
        self.children.append(child)
        log.info("process_started", name=name, pid=process.pid, log=str(log_path))
        return child

    async def _wait_healthy(self) -> None:
        gateway = next(c for c in self.children if c.name == "gateway")
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                self.check_children()
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    response = await http.get(f"{self.url}/healthz")
                    pid = response.json().get("pid")
                    if pid != gateway.process.pid:
                        raise StartupError(
                            f"{self.url} is answered by pid {pid}, not by the gateway this `up` started "
                            f"(pid {gateway.process.pid}); is another memstream running there?"
                        )
                    if response.status_code == 200:
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
        """Supervise the children until ``stop`` is set."""
        while not stop.is_set():
            await self.supervise()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.2)

    async def supervise(self) -> None:
        """Restart what exited, with backoff. The embedded broker lost every record when it died, so it is
        restarted with everything above it: topics created again, workers joining a new group from the start,
        and the gateway replaying its outbox."""
        now = time.monotonic()
        if self.broker is not None and not self.broker.running():
            await self._restart_broker()
            return
        for child in list(self.children):
            if child.alive():
                continue
            if child.restart_at is None:
                ran_s = now - child.started_at
                child.failures = 1 if ran_s >= STABLE_AFTER_S else child.failures + 1
                delay = restart_delay(child.failures) if ran_s < STABLE_AFTER_S else 0.0
                child.restart_at = now + delay
                log.error(
                    "process_exited",
                    name=child.name,
                    pid=child.process.pid,
                    code=child.process.returncode,
                    ran_s=round(ran_s, 1),
                    restart_in_s=delay,
                    log=str(child.log_path),
                )
            if now >= child.restart_at:
                self._respawn(child)

    def _respawn(self, child: Child) -> None:
        old = child.process.pid
        self.children.remove(child)
        new = self._spawn(child.name, child.args)
        new.failures = child.failures
        log.warning("process_restarted", name=child.name, pid=new.process.pid, previous_pid=old, failures=new.failures)

    async def _restart_broker(self) -> None:
        assert self.broker is not None
        self.broker_failures += 1
        delay = restart_delay(self.broker_failures - 1)
        log.error("process_exited", name="broker", log=str(self.broker.log_path), restart_in_s=delay)
        await asyncio.to_thread(self._stop_children, RESTART_STOP_TIMEOUT_S)
        await asyncio.sleep(delay)
        if self.broker_failures > 2:
            self.broker.port = None  # the old port may be taken by now: any free one will do
        try:
            self.bootstrap = await self.broker.start()
            await ensure_topics(self.settings, self.bootstrap)
        except (BrokerError, KafkaError, OSError) as exc:
            log.error("broker_restart_failed", error=repr(exc))
            self.broker.stop()
            return  # the next supervise() tries again, later
        log.warning("process_restarted", name="broker", pid=self.broker.pid, bootstrap=self.bootstrap)
        self._spawn_all()
        self.broker_failures = 0

    def _stop_children(self, timeout_s: float) -> None:
        # gateway first (no new input), then workers (they finish and commit)
        while self.children:
            child = self.children.pop()
            try:
                stop_process(child.process, timeout_s)
            except Exception:
                log.exception("process_stop_failed", name=child.name, pid=child.process.pid)
                continue
            log.info("process_stopped", name=child.name, pid=child.process.pid, code=child.process.returncode)

    def stop(self, timeout_s: float = 20.0) -> None:
        try:
            self._stop_children(timeout_s)
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
