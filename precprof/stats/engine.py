"""Which engine computes a tensor's statistics on which device, and how many threads the C kernel uses.

``auto`` (the default) takes the Triton kernel on CUDA when ``triton`` imports, the compiled C kernel on the
CPU when it builds and loads, and torch ops otherwise. ``PRECPROF_STATS_ENGINE=auto|triton|c|torch`` forces
one: a forced engine that cannot run on a device the model uses is a one-line error at attach, never a
silent substitute. ``precprof env`` and summary.json's capture block say which engine ran where.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from precprof.errors import UserError
from precprof.stats import kernel as _cpu_kernel
from precprof.stats import triton_engine

ENGINES = ("auto", "triton", "c", "torch")
ENGINE_ENV = "PRECPROF_STATS_ENGINE"

_kernel_state: dict[str, Any] = {}
# Threads per kernel call: PRECPROF_CPU_KERNEL_THREADS, else torch.get_num_threads() when the kernel's
# OpenMP regions run in torch's own pool, else 1 (see _cpu_kernel.shares_torch_threads). Measured on
# gpt-mini (2 cores): a sampled step's statistics take 50 ms on torch's two threads, 83 ms on one, and
# 150 ms on two threads of a separate pool that compete with torch's spinning workers.
_KERNEL_THREADS_ENV = os.environ.get("PRECPROF_CPU_KERNEL_THREADS")


def requested_engine() -> str:
    """The engine ``PRECPROF_STATS_ENGINE`` asks for ("auto" when unset)."""
    value = os.environ.get(ENGINE_ENV, "auto").strip().lower() or "auto"
    if value not in ENGINES:
        raise UserError(f"{ENGINE_ENV}={value!r} is not an engine; use one of {', '.join(ENGINES)}")
    return value


def resolve_engine(requested: str | None, device: torch.device) -> str:
    """The engine that computes the statistics of tensors on ``device``: "triton", "c" or "torch"."""
    want = requested if requested is not None else requested_engine()
    if want not in ENGINES:
        raise UserError(f"unknown statistics engine {want!r}; use one of {', '.join(ENGINES)}")
    if want == "auto":
        if device.type == "cpu":
            return "c" if _kernel() is not None else "torch"
        if device.type == "cuda" and triton_engine.unavailable(device) is None:
            return "triton"
        return "torch"
    if want == "c":
        if device.type != "cpu":
            raise UserError(
                f"{ENGINE_ENV}=c computes on the CPU only, and the model has tensors on {device}; "
                "use auto, triton or torch"
            )
        if _kernel() is None:
            raise UserError(
                f"{ENGINE_ENV}=c, but the C kernel is not available here ({_cpu_kernel.status()['reason']}); "
                "use auto or torch"
            )
    if want == "triton":
        why = triton_engine.unavailable(device)
        if (
            why is not None
            and device.type == "cpu"
            and not triton_engine.interpreting()
            and not _triton_there()
        ):
            why = f"triton is not installed (pip install triton), and {why}"  # both fixes, not one after the other
        if why is not None:
            raise UserError(f"{ENGINE_ENV}=triton cannot run on {device}: {why}; use auto or torch")
    return want


def _triton_there() -> bool:
    """Whether a triton package is installed (found, not imported: importing it fixes its interpreter mode)."""
    return importlib.util.find_spec("triton") is not None


def _default_kernel_threads() -> int:
    if _KERNEL_THREADS_ENV is not None:
        return max(0, int(_KERNEL_THREADS_ENV))
    if "threads" not in _kernel_state:
        lib = _kernel()
        _kernel_state["threads"] = 0 if lib is not None and _cpu_kernel.shares_torch_threads(lib) else 1
    return int(_kernel_state["threads"])


def engine_status(devices: list[torch.device] | None = None) -> dict[str, Any]:
    """Which statistics engine runs where, and why (``precprof env``, summary.json's capture block).

    ``cpu``: the engine on the CPU; ``cuda``: on CUDA devices ("not available" without one); ``requested``:
    what ``PRECPROF_STATS_ENGINE`` asked for; the C kernel's build status; ``triton``: why Triton is not
    used on CUDA, when it is not.
    """
    try:
        want = requested_engine()
    except UserError as e:
        return {"requested": os.environ.get(ENGINE_ENV), "error": str(e)}
    info: dict[str, Any] = {"requested": want}
    for dev in devices or [torch.device("cpu")] + (
        [torch.device("cuda")] if torch.cuda.is_available() else []
    ):
        try:
            info[dev.type] = resolve_engine(want, dev)
        except UserError as e:
            info[dev.type] = f"unusable: {e}"
    if "cuda" not in info:
        info["cuda"] = "not available (no CUDA device)"
    info.update(_cpu_kernel.status())
    if info.get("cpu") == "c":
        info["threads"] = _default_kernel_threads() or f"torch's pool ({torch.get_num_threads()})"
    why = triton_engine.unavailable(torch.device("cuda")) if torch.cuda.is_available() else None
    if why:
        info["triton"] = why
    return info


def _kernel() -> Any:
    """The compiled CPU kernel when it builds and loads, else None (it takes the row layout per call)."""
    if "lib" not in _kernel_state:
        _kernel_state["lib"] = _cpu_kernel.load()
    return _kernel_state["lib"]
