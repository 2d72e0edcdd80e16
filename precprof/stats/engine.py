"""Which engine computes a tensor's statistics on the CPU: the compiled C kernel when it builds, loads and
agrees with the row layout, else the torch-op path; and how many threads the kernel uses."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from precprof.stats import kernel as _cpu_kernel
from precprof.stats.layout import (
    _KERNEL_LAYOUT,
)

_kernel_state: dict[str, Any] = {}
# Threads per kernel call: PRECPROF_CPU_KERNEL_THREADS, else torch.get_num_threads() when the kernel's
# OpenMP regions run in torch's own pool, else 1 (see _cpu_kernel.shares_torch_threads). Measured on
# gpt-mini (2 cores): a sampled step's statistics take 50 ms on torch's two threads, 83 ms on one, and
# 150 ms on two threads of a separate pool that compete with torch's spinning workers.
_KERNEL_THREADS_ENV = os.environ.get("PRECPROF_CPU_KERNEL_THREADS")


def _default_kernel_threads() -> int:
    if _KERNEL_THREADS_ENV is not None:
        return max(0, int(_KERNEL_THREADS_ENV))
    if "threads" not in _kernel_state:
        lib = _kernel()
        _kernel_state["threads"] = 0 if lib is not None and _cpu_kernel.shares_torch_threads(lib) else 1
    return int(_kernel_state["threads"])


def engine_status() -> dict[str, Any]:
    """Which statistics engine runs on the CPU, and why (``precprof env``, summary.json's capture block)."""
    info: dict[str, Any] = {"cpu": "c" if _kernel() is not None else "torch", **_cpu_kernel.status()}
    if info["cpu"] == "c":
        info["threads"] = _default_kernel_threads() or f"torch's pool ({torch.get_num_threads()})"
    return info


def _kernel() -> Any:
    """The compiled CPU kernel when it loads and agrees with this module's row layout, else None."""
    if "lib" not in _kernel_state:
        lib = _cpu_kernel.load()
        if lib is not None:
            layout = np.zeros(len(_KERNEL_LAYOUT), dtype=np.int64)
            lib.pp_layout(layout.ctypes.data)
            if tuple(int(v) for v in layout) != _KERNEL_LAYOUT:
                lib = None
        _kernel_state["lib"] = lib
    return _kernel_state["lib"]
