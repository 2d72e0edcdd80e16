"""precprof.memory on a GPU: allocator peaks per phase, NVML, no host sync, components inside the peaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precprof import tables as T
from precprof.capture.memory_tracker import MemoryTracker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DIM, HID, B = 512, 2048, 64


def model_on_gpu() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HID), nn.GELU(), nn.Linear(HID, DIM)).cuda()


def step(
    model: nn.Module, opt: torch.optim.Optimizer, tr: MemoryTracker, i: int, *, autocast: bool = False
) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(i)
    x = torch.randn(B, DIM, device="cuda", generator=g)
    tr.begin_step(i, True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    F.mse_loss(out.float(), x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return tr.end_step(i)


def total(rows: list[dict[str, Any]], component: str, phase: str | None = None) -> int:
    return sum(
        r[T.BYTES] for r in rows if r[T.COMPONENT] == component and (phase is None or r[T.PHASE] == phase)
    )


def test_allocator_peaks_per_phase_hold_the_components() -> None:
    model = model_on_gpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tr = MemoryTracker(model, opt, reset_peaks=True)  # exact per-phase peaks (the built-in loop's setting)
    tr.attach()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rows = step(model, opt, tr, 0)
    tr.detach()
    peaks = {r[T.PHASE]: r[T.BYTES] for r in rows if r[T.COMPONENT] == T.ALLOCATOR_PEAK}
    assert set(peaks) == {T.PHASE_FORWARD, T.PHASE_BACKWARD, T.PHASE_OPTIMIZER, T.PHASE_OTHER}
    params = total(rows, T.PARAMETERS)
    n = sum(p.numel() for p in model.parameters())
    assert params == 4 * n
    # at the end of the forward, the parameters and every saved activation are allocated together
    assert peaks[T.PHASE_FORWARD] >= params + total(rows, T.ACTIVATIONS)
    # during the optimizer step: parameters, gradients and the (new) optimizer states
    assert peaks[T.PHASE_OPTIMIZER] >= params + total(rows, T.GRADIENTS) + total(rows, T.OPTIMIZER_STATES)
    reserved = {r[T.PHASE]: r[T.BYTES] for r in rows if r[T.COMPONENT] == T.ALLOCATOR_RESERVED_PEAK}
    assert all(reserved[p] >= peaks[p] for p in peaks)


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
    assert total(rows, T.ALLOCATOR_PEAK) + total(rows, T.ALLOCATOR_SEEN_MAX) > 0


def test_the_users_peak_counter_is_untouched() -> None:
    """A loop's own torch.cuda.max_memory_allocated() reads the same with and without the tracker."""

    def peak(track: bool) -> int:
        model = model_on_gpu()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tr = MemoryTracker(model, opt)
        if track:
            tr.attach()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for i in range(2):
            step(model, opt, tr, i)
        tr.detach()
        torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated()
        del model, opt
        torch.cuda.empty_cache()
        return out

    assert peak(True) == peak(False)


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
