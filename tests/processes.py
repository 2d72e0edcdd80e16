"""Processes a test starts and waits on: each is killed when its test ends, passed or failed.

A test that fails while a ``precprof train --steps 100000`` it started still runs (a ``communicate`` that timed
out) left the training running after pytest moved on; three such runs took a core from the rest of a CI run,
which then took 15 minutes instead of 10.
"""

from __future__ import annotations

import subprocess
from typing import Any

_STARTED: list[subprocess.Popen[Any]] = []


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kwargs)``, killed at the end of the test that started it if still running."""
    proc: subprocess.Popen[Any] = subprocess.Popen(args, **kwargs)
    _STARTED.append(proc)
    return proc


def reap() -> list[int]:
    """Kill every process ``popen`` started that is still running; their pids."""
    killed = []
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
            killed.append(proc.pid)
    return killed
