"""Stopping the processes memstream started, by PID only."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
# loaded up front: between fork and exec the child should only make the call
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies, even by SIGKILL, so no
    child outlives ``memstream up`` (Linux; elsewhere ``None``). The signal is tied to the thread that spawns:
    spawn from the main thread."""
    if _prctl is None:
        return None
    prctl = _prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody would stop this child
            os._exit(1)

    return preexec


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM by PID, SIGKILL if it is still there after ``timeout_s``."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=5)
