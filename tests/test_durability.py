"""Nothing accepted is lost, whatever is killed: `memstream up` as a real process (embedded broker, worker,
gateway), the rule-based scripted LLM, real signals. Every wait polls a condition with a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from memstream.runtime import PROJECT_ROOT, settings_env
from services.settings import Settings
from streams.gateway.client import bearer

pytestmark = [pytest.mark.server, pytest.mark.slow]

USERS = ("ana", "ben", "cleo")
TEXTS = ("I live in Lisbon.", "I work as a baker.", "My sister is called Rita.", "I play the cello.")
MEMORIZE_TIMEOUT_S = 240.0
START_TIMEOUT_S = 120.0


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)  # polling interval of a condition with a deadline, not a synchronisation
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children_of(pid: int) -> dict[int, str]:
    """pid -> role ("broker", "worker", "gateway") of the live children of ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != pid or not alive(int(entry.name)):
            continue
        words = [a.decode(errors="replace") for a in argv]
        role = next((w for w in words if w in ("worker", "gateway")), None)
        if role is None and len(words) > 1 and words[1] == "broker":
            role = "broker"
        found[int(entry.name)] = role or " ".join(words)
    return found


class Up:
    """`python -m memstream.cli up` with ``settings``; output in ``log``."""

    def __init__(self, settings: Settings, log: Path, workers: int = 1) -> None:
        self.settings = settings
        self.log = log
        self.workers = workers
        self.process: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, **settings_env(settings)}
        self.env.pop("MEMSTREAM_BROKER", None)  # the embedded broker
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    def start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "memstream.cli", "up", "--workers", str(self.workers)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        return self.process

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> dict[int, str]:
        """Wait for "memstream is up"; return the children by role."""
        process = self.process
        assert process is not None

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"`up` exited with {process.returncode}:\n{self.output()[-3000:]}")
            return f"memstream is up: {self.url}" in self.output()

        wait_for(ready, START_TIMEOUT_S, "memstream up ready")
        children = children_of(process.pid)
        assert sorted(children.values()) == sorted(["broker", "gateway"] + ["worker"] * self.workers), children
        return children

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def up_factory(
    settings: Settings, tmp_path: Path, admin_key_env: Callable[[Settings], AbstractContextManager[str]]
) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []
    key = admin_key_env(settings)  # in MEMSTREAM_API_KEY; with a key there, `up` makes no admin key of its own
    key.__enter__()

    def make(workers: int = 1) -> Up:
        up = Up(settings, tmp_path / f"up-{len(started)}.log", workers)
        started.append(up)
        return up

    try:
        yield make
    finally:
        for up in started:
            up.stop()
        key.__exit__(None, None, None)


def as_admin() -> dict[str, str]:
    return bearer(os.environ["MEMSTREAM_API_KEY"])


def post_messages(url: str, per_user: int, users: Sequence[str] = USERS) -> dict[str, list[str]]:
    """``per_user`` messages of each user, 5 per request, interleaved; every request answered 202."""
    accepted: dict[str, list[str]] = {u: [] for u in users}
    with httpx.Client(base_url=url, timeout=30.0, headers=as_admin()) as http:
        for start in range(0, per_user, 5):
            for user in users:
                batch = [
                    {
                        "user_id": user,
                        "speaker": user.title(),
                        "text": f"{TEXTS[n % len(TEXTS)]} Note {n}.",
                        "event_time": f"2024-03-{1 + n % 28:02d}T10:{n % 60:02d}:00Z",
                    }
                    for n in range(start, min(start + 5, per_user))
                ]
                response = http.post("/v1/messages", json=batch)
                assert response.status_code == 202, response.text
                accepted[user].extend(response.json()["event_ids"])
    return accepted


def running(up_factory: Callable[..., Up], workers: int = 1) -> tuple[Up, subprocess.Popen[bytes], dict[int, str]]:
    """A started and ready `up`, its process and its children by role."""
    up = up_factory(workers=workers)
    process = up.start()
    return up, process, up.wait_ready()


def kill_one(children: dict[int, str], role: str) -> int:
    pid = next(pid for pid, name in children.items() if name == role)
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stats(url: str, user: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=10.0, headers=as_admin()) as http:
        response = http.get(f"/v1/stats/{user}")
        response.raise_for_status()
        return dict(response.json())


def assert_memorized_once(url: str, accepted: dict[str, list[str]]) -> None:
    """Every accepted message is an applied event and one episode of its user, nothing more."""
    for user, ids in accepted.items():

        def done(user: str = user, ids: list[str] = ids) -> bool:
            try:
                return int(stats(url, user)["events"]) >= len(ids)
            except httpx.HTTPError:  # the gateway is (re)starting
                return False

        wait_for(done, MEMORIZE_TIMEOUT_S, f"{user}'s {len(ids)} messages memorized", poll_s=0.5)
        got = stats(url, user)
        assert got["events"] == len(set(ids)) == len(ids)
        assert got["vertices"]["episodic"] == len(ids)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_every_accepted_message_survives_killing_every_process(
    up_factory: Callable[..., Up], sig: signal.Signals
) -> None:
    first, process, children = running(up_factory)
    accepted = post_messages(first.url, per_user=67)  # 201 messages
    # right after the 202s: the worker has memorized few of them, the broker held the rest in RAM
    kill_all([*children, process.pid], sig)
    process.wait(timeout=60)
    wait_for(lambda: not any(alive(p) for p in children), 60, "every process gone")

    second, _, _ = running(up_factory)
    assert_memorized_once(second.url, accepted)


def test_a_killed_worker_is_restarted_and_ingestion_completes(up_factory: Callable[..., Up]) -> None:
    up, process, children = running(up_factory, workers=2)
    accepted = post_messages(up.url, per_user=20)
    worker = kill_one(children, "worker")

    def restarted() -> bool:
        now = children_of(process.pid)
        return worker not in now and list(now.values()).count("worker") == 2

    wait_for(restarted, 60, "the killed worker restarted")
    assert "process_restarted" in up.output()
    assert_memorized_once(up.url, accepted)
    assert process.poll() is None  # `up` kept running


def test_sigkill_of_up_leaves_no_child_alive(up_factory: Callable[..., Up]) -> None:
    _, process, children = running(up_factory, workers=2)
    process.kill()
    process.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in children), 30, f"children {sorted(children)} gone")
    # and the port is free again: a new `up` starts
    running(up_factory)


def test_a_foreign_process_on_the_gateway_port_makes_up_fail_clearly(
    up_factory: Callable[..., Up], settings: Settings
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind((settings.host, settings.port))
        squatter.listen()
        up = up_factory()
        process = up.start()
        process.wait(timeout=60)
    assert process.returncode != 0
    output = up.output()
    assert "memstream is up" not in output
    assert f"{settings.host}:{settings.port} is taken by another process" in output


def test_a_killed_embedded_broker_is_restarted_with_everything_above_it(up_factory: Callable[..., Up]) -> None:
    up, process, children = running(up_factory)
    accepted = post_messages(up.url, per_user=20)
    kill_one(children, "broker")  # every record it held in RAM is gone

    def restarted() -> bool:
        now = children_of(process.pid)
        return not set(now) & set(children) and sorted(now.values()) == ["broker", "gateway", "worker"]

    wait_for(restarted, 90, "broker, worker and gateway started again")
    assert_memorized_once(up.url, accepted)  # the gateway replayed its outbox into the new broker
    assert process.poll() is None


def test_a_killed_gateway_is_restarted_and_accepts_again(up_factory: Callable[..., Up]) -> None:
    up, _, children = running(up_factory)
    accepted = post_messages(up.url, per_user=5)
    gateway = kill_one(children, "gateway")

    def serving_again() -> bool:
        try:
            body = httpx.get(f"{up.url}/healthz", timeout=2.0).json()
        except httpx.HTTPError:
            return False
        return body.get("status") == "ok" and body.get("pid") not in (None, gateway)

    wait_for(serving_again, 60, "a new gateway serving")
    more = post_messages(up.url, per_user=10)  # the first 5 again (the same event ids), and 5 new
    assert all(more[u][:5] == accepted[u] for u in USERS)
    assert_memorized_once(up.url, more)
