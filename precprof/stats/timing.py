"""Time spent in one kind of work (the block-format what-if), without a host sync where it runs.

On the CPU the work runs in the calling thread, so ``time.perf_counter`` around it is its time. On a CUDA
device the calls only queue kernels: a pair of CUDA events is recorded around each call on the current stream
(no sync), and the elapsed times are read at the sampled step's host copy, when the device has done the work.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class WorkTimer:
    """Seconds spent inside :meth:`timing` since the last :meth:`read_s`, on the host or the device, and how
    many calls took them."""

    def __init__(self) -> None:
        self._host_s = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._calls = 0
        self.last_calls = 0  # the calls timed before the last :meth:`read_s`

    @contextlib.contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        """Time the work in the ``with`` block, queued on ``device``'s current stream. Never syncs."""
        self._calls += 1
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host_s += time.perf_counter() - t0

    def call(self, device: torch.device, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` timed as :meth:`timing` times its block; on the CPU without a generator's cost (a few
        microseconds per call, on the hot path of every block-format evaluation)."""
        if device.type == "cuda":
            with self.timing(device):
                return fn(*args)
        self._calls += 1
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._host_s += time.perf_counter() - t0

    def add_host_s(self, seconds: float) -> None:
        """Add host seconds its caller timed itself around one call."""
        self._host_s += seconds
        self._calls += 1

    def read_s(self) -> float:
        """The seconds timed since the last read, and start again. Call after the device finished the work (the
        sampled step's copy to the host): reading a CUDA event pair waits for its second event."""
        total = self._host_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3
        self._host_s = 0.0
        self._events.clear()
        self.last_calls, self._calls = self._calls, 0
        return total
