"""Stopping the processes memstream started, by PID only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


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
