"""Every private torch API precprof touches, in one place, each with the fallback for a torch without it.

When torch changes one of these, this is the one file to update; every function degrades to "unknown"
(None, empty) rather than failing, except where the fallback is stated.
"""

from __future__ import annotations

from typing import Any

import torch

# ------------------------------------------------------------------------------------------- GradScaler


def scaler_enabled(scaler: Any) -> bool:
    """Whether a GradScaler scales at all (``GradScaler(enabled=False)`` passes everything through)."""
    return bool(getattr(scaler, "_enabled", True))


def scaler_scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The scaler's current scale as its device tensor (reading it does not sync); None before the first
    ``scale()`` call or for a disabled scaler."""
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) and scaler_enabled(scaler) else None


def scaler_found_inf(scaler: Any) -> list[torch.Tensor]:
    """The found-inf flags ``unscale_`` left per optimizer and device (what ``step()`` skips on), before
    ``update()`` clears them."""
    found: list[torch.Tensor] = []
    for state in getattr(scaler, "_per_optimizer_states", {}).values():
        found.extend(state.get("found_inf_per_device", {}).values())
    return found


class LowPrecisionGradScaler(torch.amp.GradScaler):
    """A GradScaler that accepts fp16 gradients (fp16-pure): they are unscaled in place, in fp16.

    torch's GradScaler refuses fp16 gradients because unscaling them in fp16 flushes values below 2^-24 to
    zero; in the pure mode that loss is part of what is being measured, as in apex's pure-fp16 (O3) mode.
    """

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


# ------------------------------------------------------------------------------------------- autograd


def tensor_version(x: torch.Tensor) -> int | None:
    """The in-place version counter of ``x``; None for inference tensors, which have none."""
    try:
        return int(x._version)
    except RuntimeError:
        return None


_NO_QUERY = object()


def top_saved_tensors_hooks() -> Any:
    """The (pack, unpack) pair on top of autograd's saved-tensor hook stack, None when the stack is empty, or
    ``NO_QUERY`` on a torch that cannot tell (then the caller assumes its own pair is on top)."""
    fn = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    return fn(False) if fn is not None else _NO_QUERY


NO_QUERY = _NO_QUERY

# ------------------------------------------------------------------------------------------- FSDP


def fsdp_root_uses_orig_params(root: Any) -> bool:
    """FSDP1: whether the root was wrapped with ``use_orig_params=True``."""
    return bool(getattr(root, "_use_orig_params", False))


def fsdp2_policy(module: Any) -> tuple[Any, Any]:
    """FSDP2 (``fully_shard``): the module's MixedPrecisionPolicy and its parameter group (either None when
    this torch keeps them elsewhere)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if get_state is not None else None
    return getattr(state, "_mp_policy", None), getattr(state, "_fsdp_param_group", None)


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` as a tensor on it reports it: an accelerator with its index (``cuda`` -> ``cuda:N``, N the
    current device), the CPU without one (``cpu:0`` -> ``cpu``). State kept per device and keyed by this matches
    the tensors' own ``.device``, so ``cuda`` and ``cuda:0`` never make two entries."""
    d = torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.index is not None or d.type == "meta":
        return d
    current = getattr(getattr(torch, d.type, None), "current_device", None)
    if callable(current):
        try:
            return torch.device(d.type, int(current()))
        except Exception:  # no such device here: leave the name as it is
            return d
    return d


# ------------------------------------------------------------------------------------------- memory


_CUDA_COUNTERS = (
    ("allocated_bytes", "current"),
    ("allocated_bytes", "peak"),
    ("reserved_bytes", "current"),
    ("reserved_bytes", "peak"),
    ("allocation", "allocated"),
    ("allocation", "freed"),
)


def cuda_memory_counters(index: int) -> dict[str, int]:
    """The CUDA caching allocator's counters of device ``index`` that precprof reads, by torch's flat names
    (``"allocated_bytes.all.current"``, ``...peak``, ``"reserved_bytes.all.current"``, ``...peak``,
    ``"allocation.all.allocated"``, ``...freed``); {} before CUDA is initialised. A host read, no sync.

    One call into torch's C++ (~25 us): ``torch.cuda.memory_stats`` (and ``memory_allocated`` etc., which call
    it) flattens and sorts every counter in Python (~400 us); at the hooks of a sampled gpt2-small step on an
    H100 that was 237 ms of a 670 ms step."""
    fn = getattr(torch._C, "_cuda_memoryStats", None)
    if fn is None:  # a torch without it: the public, slower read
        stats = torch.cuda.memory_stats(index)
        return {f"{g}.all.{k}": int(stats.get(f"{g}.all.{k}", 0)) for g, k in _CUDA_COUNTERS}
    if not torch.cuda.is_initialized():
        return {}
    nested = fn(index)
    return {f"{g}.all.{k}": int(nested.get(g, {}).get("all", {}).get(k, 0)) for g, k in _CUDA_COUNTERS}


def cuda_history_enabled() -> bool:
    """Whether the CUDA caching allocator is recording its history (anyone's ``_record_memory_history``);
    False on a torch that cannot tell."""
    fn = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(fn()) if fn is not None else False


def cuda_record_history(on: bool, max_entries: int) -> None:
    """Turn the CUDA allocator's history of allocations and frees on (every event, no stack traces: the cheap
    setting) or off (which also empties it). A host call: nothing waits for the device."""
    if on:
        torch.cuda.memory._record_memory_history(
            "all", context=None, stacks="python", max_entries=max_entries
        )
    else:
        torch.cuda.memory._record_memory_history(None)


def cuda_snapshot() -> dict[str, Any]:
    """The CUDA allocator's segments, blocks and recorded history (``torch.cuda.memory._snapshot()``); host
    only."""
    snap = torch.cuda.memory._snapshot()
    return snap if isinstance(snap, dict) else {}


def profiler_running() -> bool:
    """Whether a torch.profiler (or autograd profiler) is running in this thread."""
    fn = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return bool(fn()) if fn is not None else False


def profiler_memory_start() -> None:
    """Start torch.profiler for memory events only: CPU activity, ``profile_memory=True``, no shapes, stacks
    or flops. Raises RuntimeError when it cannot (another profiler runs, no Kineto)."""
    from torch._C._profiler import (
        ProfilerActivity,
        ProfilerConfig,
        ProfilerState,
        RecordScope,
        _ExperimentalConfig,
    )

    cfg = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    torch.autograd._prepare_profiler(cfg, activities)
    # only record_function ranges are recorded as ops (the phase markers), not every aten op: a tenth of the
    # events to collect; allocations are reported whatever the scopes
    torch.autograd._enable_profiler(cfg, activities, {RecordScope.USER_SCOPE})  # type: ignore[call-arg]


def profiler_memory_stop(marker: str) -> tuple[list[tuple[int, int, int, str]], list[int]]:
    """Stop what ``profiler_memory_start`` started. Returns the allocator events ((time ns, address, signed
    bytes: > 0 allocated, < 0 freed, device type)) and the start times of ``record_function(marker)`` ranges,
    both unordered."""
    from torch._C._profiler import _EventType

    result = torch.autograd._disable_profiler()
    allocs: list[tuple[int, int, int, str]] = []
    marks: list[int] = []
    stack = list(result.experimental_event_tree())
    while stack:
        e = stack.pop()
        kind = e.typed[0]
        fields: Any = e.typed[1]
        if kind == _EventType.Allocation:
            if fields.alloc_size:
                allocs.append(
                    (int(e.start_time_ns), int(fields.ptr), int(fields.alloc_size), fields.device.type)
                )
        elif kind == _EventType.TorchOp and e.name == marker:
            marks.append(int(e.start_time_ns))
        stack.extend(e.children)
    return allocs, marks
