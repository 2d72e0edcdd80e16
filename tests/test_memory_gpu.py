"""precprof.memory on a GPU: allocator peaks per phase from the allocator's own history, every byte of the peak
in one part, the process's peak counters untouched, NVML, no host sync."""

from __future__ import annotations

import gc
import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precprof import _compat
from precprof import tables as T
from precprof.capture.memory_tracker import MemoryTracker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# large enough that what the allocator held before the step and no tensor names (cuBLAS's workspaces: up to
# 32 MiB per thread on Hopper, and backward runs in a thread of its own) stays a small share of the peak:
# activations of 128-512 MiB each at batch 32768
DIM, HID, B = 1024, 4096, 32768


def model_on_gpu() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HID), nn.GELU(), nn.Linear(HID, DIM)).cuda()


def step(
    model: nn.Module, opt: torch.optim.Optimizer, tr: MemoryTracker | None, i: int, *, autocast: bool = False
) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(i)
    x = torch.randn(B, DIM, device="cuda", generator=g)
    if tr is not None:
        tr.begin_step(i, True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    F.mse_loss(out.float(), x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return tr.end_step(i) if tr is not None else []


def total(rows: list[dict[str, Any]], component: str, phase: str | None = None, moment: str = "") -> int:
    return sum(
        r[T.BYTES]
        for r in rows
        if r[T.COMPONENT] == component and r[T.MOMENT] == moment and (phase is None or r[T.PHASE] == phase)
    )


def test_allocator_peaks_are_the_allocators_and_the_parts_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_on_gpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tr = MemoryTracker(model, opt)
    tr.attach()
    step(model, opt, tr, 0)  # the optimizer's states exist from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # this test owns the process: the counter spans exactly one step
    actions: set[str] = set()
    snapshot = _compat.cuda_snapshot

    def seen() -> dict[str, Any]:
        snap = snapshot()
        actions.update(str(e["action"]) for trace in snap["device_traces"] for e in trace)
        return snap

    monkeypatch.setattr(_compat, "cuda_snapshot", seen)
    rows = step(model, opt, tr, 1)
    torch.cuda.synchronize()
    tr.detach()
    assert tr.peak_note == ""
    # the history holds what the replay reads, without a free's completion (_compat.HISTORY_SKIPPED) where torch
    # can leave actions out (skip_actions: 2.11 has it)
    assert {"alloc", "free_requested"} <= actions, actions
    if "skip_actions" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
        assert not actions & set(_compat.HISTORY_SKIPPED), actions
    peaks = {r[T.PHASE]: r[T.BYTES] for r in rows if r[T.COMPONENT] == T.ALLOCATOR_PEAK}
    reserved = {r[T.PHASE]: r[T.BYTES] for r in rows if r[T.COMPONENT] == T.ALLOCATOR_RESERVED_PEAK}
    assert (
        set(peaks) == set(reserved) == {T.PHASE_FORWARD, T.PHASE_BACKWARD, T.PHASE_OPTIMIZER, T.PHASE_OTHER}
    )
    # replayed from the allocator's history (blocks rounded as the allocator rounds them), the step's peak is
    # the allocator's own counter, or below it by what cached blocks handed out unsplit hold beyond their
    # rounded size (under 1 MiB each; the history cannot show it)
    counter = torch.cuda.max_memory_allocated()
    assert 0 <= counter - max(peaks.values()) <= 4 * 2**20, (counter, peaks)
    assert max(reserved.values()) == torch.cuda.max_memory_reserved()
    assert all(reserved[p] >= peaks[p] for p in peaks)
    n = sum(p.numel() for p in model.parameters())
    params = total(rows, T.PARAMETERS)
    assert params == 4 * n
    # at the end of the forward, the parameters and every saved activation are allocated together
    assert peaks[T.PHASE_FORWARD] >= params + total(rows, T.ACTIVATIONS)
    # during the optimizer step: parameters, gradients and the optimizer states
    assert peaks[T.PHASE_OPTIMIZER] >= params + total(rows, T.GRADIENTS) + total(rows, T.OPTIMIZER_STATES)

    # what was allocated at the peak: every byte in one part, at most 10% of it unnamed
    parts: dict[str, int] = {}
    for r in rows:
        if r[T.MOMENT] == T.MOMENT_PEAK:
            parts[r[T.COMPONENT]] = parts.get(r[T.COMPONENT], 0) + r[T.BYTES]
    peak = max(peaks.values())
    cache = parts.pop(T.ALLOCATOR_CACHE, 0)
    assert sum(parts.values()) == peak
    assert peak + cache <= max(reserved.values())
    assert parts.get(T.OTHER_MEMORY, 0) <= 0.10 * peak, parts
    # every tensor here is a multiple of 512 bytes, the allocator's rounding; a cached block the allocator
    # reuses without splitting may hold up to 1 MiB more than its tensor
    on_gpu = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.is_cuda]
    assert sum(t.untyped_storage().nbytes() for t in on_gpu) == 8 * n  # AdamW's moments (its steps: host)
    assert params <= parts[T.PARAMETERS] <= params + len(list(model.parameters())) * 2**20
    assert 8 * n <= parts[T.OPTIMIZER_STATES] <= 8 * n + len(on_gpu) * 2**20
    phase = next(r[T.PHASE] for r in rows if r[T.MOMENT] == T.MOMENT_PEAK)
    assert peaks[phase] == peak


def test_a_users_peak_counters_read_the_same_with_the_tracker() -> None:
    """The process's peak counters are never reset: the user's max_memory_allocated() after profiled steps is
    what the same steps read without precprof (one model, in its steady state: every step allocates alike)."""
    model = model_on_gpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(3):  # warm-up: states, cuBLAS workspaces, the allocator's cache in its steady state
        step(model, opt, None, i)

    def user_peak(tr: MemoryTracker | None) -> tuple[int, int]:
        # what earlier tests left to the garbage collector (an optimizer is a reference cycle in torch itself:
        # an H200 run freed the previous test's model and AdamW states, 96 MiB, between the two measurements)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # the user's own reset, before their measured steps
        for i in range(3, 6):
            step(model, opt, tr, i)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    plain = user_peak(None)
    tr = MemoryTracker(model, opt)
    tr.attach()
    tracked = user_peak(tr)
    tr.detach()
    assert tracked == plain  # to the byte: the tracker allocates nothing on the device and resets nothing


def test_a_program_recording_the_allocator_history_is_left_alone() -> None:
    model = model_on_gpu()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tr = MemoryTracker(model, opt)
    tr.attach()
    torch.cuda.memory._record_memory_history(max_entries=100_000)  # the program's own, e.g. for OOM dumps
    try:
        rows = step(model, opt, tr, 0)
        assert torch._C._cuda_isHistoryEnabled()  # still on
        assert torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]  # and not emptied
    finally:
        torch.cuda.memory._record_memory_history(None)
        tr.detach()
    assert "history itself" in tr.peak_note
    # no replay: no parts at the peak; the phase peaks come from the process's counters, as without a history
    assert not [r for r in rows if r[T.MOMENT] == T.MOMENT_PEAK] and total(rows, T.PARAMETERS) > 0


def test_nvml_rows_when_a_driver_is_there() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception:
        pytest.skip("no NVIDIA driver for NVML")
    model = model_on_gpu()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tr = MemoryTracker(model, opt)
    tr.attach()
    rows = step(model, opt, tr, 0)
    tr.detach()
    used, total_mem = total(rows, T.DEVICE_USED), total(rows, T.DEVICE_TOTAL)
    props = torch.cuda.get_device_properties(0)
    # NVML's total is the board's memory; CUDA reports what is left after the driver's reservation
    assert total_mem >= 0.95 * props.total_memory
    assert torch.cuda.memory_reserved() <= used <= total_mem


def test_sampled_step_never_syncs() -> None:
    """begin_step turns the allocator's history on, phase boundaries read its counters, end_step reads and
    turns it off: all host calls."""
    model = model_on_gpu()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    tr = MemoryTracker(model, opt)
    tr.attach()
    step(model, opt, tr, 0)  # warm-up: lazy inits outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = step(model, opt, tr, 1, autocast=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        tr.detach()
    assert total(rows, T.AUTOCAST_WEIGHT_COPIES) == HID * DIM * 2  # the second Linear's bf16 weight copy
    assert total(rows, T.ALLOCATOR_PEAK) > 0
    # at the peak the copy's block is alive or gone (a cached block reused unsplit holds up to 1 MiB more)
    copies = total(rows, T.AUTOCAST_WEIGHT_COPIES, moment=T.MOMENT_PEAK)
    assert copies == 0 or HID * DIM * 2 <= copies <= HID * DIM * 2 + 2**20


def test_bitwise_identical_training_on_gpu() -> None:
    def run(track: bool) -> list[torch.Tensor]:
        model = model_on_gpu()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tr = MemoryTracker(model, opt)
        if track:
            tr.attach()
        for i in range(3):
            g = torch.Generator(device="cuda").manual_seed(i)
            x = torch.randn(B, DIM, device="cuda", generator=g)
            tr.begin_step(i, track)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            F.mse_loss(out.float(), x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tr.end_step(i)
        tr.detach()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def test_the_counters_read_directly_are_torchs() -> None:
    """``_compat.cuda_memory_counters`` (one C call) reads what ``torch.cuda.memory_stats`` reads."""
    from precprof import _compat

    x = torch.empty(3 << 20, device="cuda")
    index = torch.cuda.current_device()
    direct = _compat.cuda_memory_counters(index)
    public = torch.cuda.memory_stats(index)
    assert direct and all(public[k] == v for k, v in direct.items()), (direct, public)
    assert direct["allocated_bytes.all.current"] >= x.numel() * 4
