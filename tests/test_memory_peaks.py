"""precprof never changes the peak-memory counters a user reads.

On an H100 the memory tracker reset ``torch.cuda``'s peak counters at every phase boundary, and a user's own
``torch.cuda.max_memory_allocated()`` after a profiled step read 2.9 GB where the same loop without precprof read
11.3 GB (Lightning's and the Trainer's memory logs read the same counter). Here the CUDA allocator's counters
are a stand-in that the test's own hooks drive (allocations in forward, a larger temporary in backward, frees),
with ``reset_peak_memory_stats`` behaving as the caching allocator's: the peak drops to what is allocated now.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T

MIB = 1 << 20


class FakeAllocator:
    """torch.cuda's memory counters for one device, driven by the test."""

    def __init__(self) -> None:
        self.allocated = 100 * MIB  # the model and optimizer already there
        self.peak = self.allocated
        self.reserved = self.peak_reserved = 128 * MIB
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset(device: Any = None) -> None:
            self.resets += 1
            self.peak, self.peak_reserved = self.allocated, self.reserved

        for name, fn in {
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak,
            "memory_reserved": lambda device=None: self.reserved,
            "max_memory_reserved": lambda device=None: self.peak_reserved,
            "reset_peak_memory_stats": reset,
            "is_initialized": lambda: True,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        # what torch.cuda's readers call underneath (precprof reads it directly: one C call per hook)
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", self.nested_stats, raising=False)

    def nested_stats(self, index: int) -> dict[str, Any]:
        return {
            "allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.reserved, "peak": self.peak_reserved}},
        }


def _model(fake: FakeAllocator) -> nn.Module:
    """Two layers whose forward allocates 20 and 30 MiB of activations and whose backward makes a 50 MiB
    temporary before freeing everything: the step peaks in backward at 100 + 50 + 50 = 200 MiB."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer, size in zip(model, (20 * MIB, 30 * MIB), strict=True):
        layer.register_forward_hook(lambda m, a, o, size=size: fake.alloc(size))
    first = model[0].weight

    def backward_temporary(g: torch.Tensor) -> None:
        fake.alloc(50 * MIB)
        fake.free(50 * MIB + 50 * MIB)  # the temporary and the activations

    first.register_hook(backward_temporary)
    return model


def _train(model: nn.Module, fake: FakeAllocator, prof: precprof.Profiler | None, steps: int) -> list[int]:
    """The user's loop; after each step it reads the process's peak, as its logging would."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if prof is not None:
        prof.optimizers = [opt]
    seen = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        if prof is not None:
            prof.step()
        seen.append(torch.cuda.max_memory_allocated())
    return seen


def _profiled(fake: FakeAllocator, **kw: Any) -> tuple[list[int], precprof.Profiler]:
    model = _model(fake)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # every sampled step measures memory: the steps after the first hold lower bounds only, checked here
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False, memory_every=1, **kw)
    with prof:
        assert prof._tracker is not None
        prof._tracker._cuda = torch.device("cuda", 0)  # the stand-in plays this model's CUDA device
        prof._tracker.begin_step(prof.current_step, True)  # armed again, as attach() arms a CUDA model's
        seen = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            prof.step()
            seen.append(torch.cuda.max_memory_allocated())
    return seen, prof


def test_a_profiled_loop_reads_the_same_peak_as_an_unprofiled_one(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = FakeAllocator()
    plain.install(monkeypatch)
    want = _train(_model(plain), plain, None, 3)
    assert want == [200 * MIB] * 3
    fake = FakeAllocator()
    fake.install(monkeypatch)
    seen, prof = _profiled(fake)
    assert fake.resets == 0
    assert seen == want  # it read 2.9 GB instead of 11.3 GB on the H100

    mem = prof.tables()["memory"]
    peaks = mem[mem[T.COMPONENT] == T.ALLOCATOR_PEAK]
    # step 0: the process's peak grew in forward (to 150 MiB) and in backward (to 200 MiB): exact there
    first = dict(zip(peaks[peaks[T.STEP] == 0][T.PHASE], peaks[peaks[T.STEP] == 0][T.BYTES], strict=True))
    assert first == {T.PHASE_FORWARD: 150 * MIB, T.PHASE_BACKWARD: 200 * MIB}
    # later steps stay below the earlier peak: their phases have lower bounds only, from the hooks
    later = mem[(mem[T.STEP] == 2) & (mem[T.COMPONENT] == T.ALLOCATOR_SEEN_MAX)]
    bounds = dict(zip(later[T.PHASE], later[T.BYTES], strict=True))
    assert bounds[T.PHASE_FORWARD] == 150 * MIB  # read at the second layer's forward end: the true peak
    assert 100 * MIB <= bounds[T.PHASE_BACKWARD] <= 200 * MIB
    assert peaks[peaks[T.STEP] == 2].empty


def test_the_built_in_loop_may_reset_for_exact_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch)
    _, prof = _profiled(fake, reset_peak_memory=True)
    assert fake.resets > 0
    mem = prof.tables()["memory"]
    peaks = mem[(mem[T.COMPONENT] == T.ALLOCATOR_PEAK) & (mem[T.STEP] == 2)]
    got = dict(zip(peaks[T.PHASE], peaks[T.BYTES], strict=True))
    assert got[T.PHASE_FORWARD] == 150 * MIB and got[T.PHASE_BACKWARD] == 200 * MIB
    assert (mem[T.COMPONENT] != T.ALLOCATOR_SEEN_MAX).all()


def test_precprof_train_turns_exact_phases_on() -> None:
    from precprof.training import TrainConfig
    from precprof.training.loop import _prepare

    setup = _prepare(TrainConfig(model="gpt-nano", steps=1, progress=False, report=False), None)
    assert setup.prof_kwargs["reset_peak_memory"] is True
