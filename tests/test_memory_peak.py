"""The allocator's peak of a sampled step (capture.peak): the process's peak counters are never reset, and what
was allocated at the peak adds up, part by part, against hand counts and an independent count of live storages.

CUDA is stood in for by ``FakeCudaAllocator`` (this machine has no GPU; tests/test_memory_gpu.py runs the real
allocator); the CPU runs the real thing: torch.profiler's memory events.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from precprof import _compat
from precprof import tables as T
from precprof.analysis.advisor import recommend
from precprof.analysis.memory_projection import project
from precprof.capture import Profiler
from precprof.capture.memory_tracker import MemoryTracker
from precprof.capture.peak import (
    ALLOC,
    FREE,
    SEGMENT_ALLOC,
    TAKEN_OVER,
    CudaHistory,
    Events,
    Label,
    block_bytes,
    replay,
)
from precprof.models import build_model

KIB = 1024


# ---------------------------------------------------------------------------------------- a fake CUDA
class FakeCudaAllocator:
    """Stands in for ``torch.cuda``'s memory API: the caching allocator's accounting (blocks rounded up to 512
    bytes, 2 MiB segments reserved as needed and never released, freed addresses reused for blocks of the same
    size), its counters (current and peak allocated and reserved, cumulative allocations and frees), the peak
    reset, and its history (``_record_memory_history``, ``_snapshot``, ``_cuda_isHistoryEnabled``).
    ``malloc``/``free`` are what a program's tensors would do on the device."""

    SEGMENT = 2 << 20

    def __init__(self) -> None:
        self.allocated = self.peak = self.reserved = self.peak_reserved = 0
        self.n_alloc = self.n_free = 0
        self.blocks: dict[int, int] = {}
        self.requested: dict[int, int] = {}
        self.cached: dict[int, list[int]] = {}  # size -> freed addresses
        self.next_addr = 1 << 32
        self.history = False
        self.skipped: tuple[str, ...] = ()  # the actions the history was told to leave out (skip_actions)
        self.trace: list[
            tuple[str, int, int]
        ] = []  # (action, address, bytes): dicts when read, as torch makes
        self.resets: list[Any] = []

    def _record(self, action: str, addr: int, size: int) -> None:
        if self.history and action not in self.skipped:
            self.trace.append((action, addr, size))

    def malloc(self, nbytes: int) -> int:
        size = -(-nbytes // 512) * 512
        while self.allocated + size > self.reserved:
            self.reserved += self.SEGMENT
            self._record("segment_alloc", 1 << 40 | self.reserved, self.SEGMENT)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if self.cached.get(size):
            addr = self.cached[size].pop()
        else:
            addr, self.next_addr = self.next_addr, self.next_addr + size
        self.blocks[addr] = size
        self.requested[addr] = nbytes
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        self.n_alloc += 1
        self._record(
            "alloc", addr, nbytes
        )  # the history records the size asked for, the counters the block's
        return addr

    def free(self, addr: int) -> None:
        size = self.blocks.pop(addr)
        nbytes = self.requested.pop(addr)
        self.allocated -= size
        self.n_free += 1
        self.cached.setdefault(size, []).append(addr)
        self._record("free_requested", addr, nbytes)
        self._record("free_completed", addr, nbytes)

    # torch.cuda's API
    def memory_allocated(self, device: Any = None) -> int:
        return self.allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak

    def memory_reserved(self, device: Any = None) -> int:
        return self.reserved

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.resets.append(device)
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak_reserved,
            "allocation.all.allocated": self.n_alloc,
            "allocation.all.freed": self.n_free,
        }

    def nested_stats(self, index: int) -> dict[str, Any]:
        """``torch._C._cuda_memoryStats``: the counters above, nested as the allocator gives them."""
        flat = self.memory_stats(index)
        out: dict[str, Any] = {}
        for key, value in flat.items():
            group, pool, name = key.split(".")
            out.setdefault(group, {}).setdefault(pool, {})[name] = value
        return out

    def record_memory_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        self.history = enabled not in (None, False)
        self.skipped = tuple(kwargs.get("skip_actions") or ()) if self.history else ()
        if not self.history:
            self.trace.clear()

    def snapshot(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        blocks = [{"address": a, "size": s, "state": "active_allocated"} for a, s in self.blocks.items()]
        seg = {"device": 0, "address": 1 << 40, "total_size": self.reserved, "blocks": blocks}
        trace = [{"action": a, "addr": addr, "size": n, "stream": 0} for a, addr, n in self.trace]
        return {"segments": [seg], "device_traces": [trace]}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
            "reset_peak_memory_stats",
            "memory_stats",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        # what torch.cuda's readers call underneath (precprof reads it directly: one C call per hook)
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", self.nested_stats, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record_memory_history)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.history, raising=False)


# What the simulated step keeps on the device (bytes, multiples of 512): the model and optimizer, the batch,
# what forward saves and returns, a forward temporary, backward's gradient of the output and workspace, the
# parameters' gradients, the optimizer's states (made by its first step) and a temporary of its own.
PARAMS, BATCH, SAVED, OUT = 8 * KIB, 4 * KIB, 64 * KIB, 16 * KIB
FWD_TMP, GRAD_OUT, WORKSPACE, PGRADS = 32 * KIB, 16 * KIB, 128 * KIB, 8 * KIB
STATES, OPT_TMP = 16 * KIB, 8 * KIB


class _DeviceOp(torch.autograd.Function):
    """Forward and backward of a layer, as the device allocator sees them (through the fake)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dev: FakeCudaAllocator, kept: dict[str, int]) -> torch.Tensor:
        ctx.dev, ctx.kept = dev, kept
        kept["SAVED"] = dev.malloc(SAVED)  # saved for backward
        dev.free(dev.malloc(FWD_TMP))  # a temporary
        kept["OUT"] = dev.malloc(OUT)  # the output
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        dev, kept = ctx.dev, ctx.kept
        grad = dev.malloc(GRAD_OUT)
        dev.free(dev.malloc(WORKSPACE))  # a workspace
        kept["PGRADS"] = dev.malloc(PGRADS)  # the parameters' gradients, until zero_grad
        dev.free(grad)
        dev.free(kept.pop("SAVED"))
        return g * 2, None, None


class DeviceModel(nn.Module):
    def __init__(self, dev: FakeCudaAllocator) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.dev = dev
        self.kept: dict[str, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeviceOp.apply(self.lin(x), self.dev, self.kept)


class DeviceSGD(torch.optim.SGD):
    """SGD whose step and zero_grad allocate and free on the fake device like a real optimizer's would."""

    def __init__(self, params: Any, dev: FakeCudaAllocator, kept: dict[str, int]) -> None:
        super().__init__(params, lr=0.1)
        self.dev, self.kept = dev, kept

    def step(self, closure: Any = None) -> Any:
        if "STATES" not in self.kept:
            self.kept["STATES"] = self.dev.malloc(STATES)  # states, made by the first step
        self.dev.free(self.dev.malloc(OPT_TMP))
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if "PGRADS" in self.kept:
            self.dev.free(self.kept.pop("PGRADS"))
        super().zero_grad(set_to_none)


def device_loop(
    dev: FakeCudaAllocator, steps: int, tracker: bool
) -> tuple[int, list[dict[str, Any]], MemoryTracker | None]:
    """A user's loop on the (fake) device; returns what the user's own max_memory_allocated() reads after it."""
    torch.manual_seed(0)
    model = DeviceModel(dev)
    opt = DeviceSGD(model.parameters(), dev, model.kept)
    dev.malloc(PARAMS)  # the parameters, on the device before the loop
    tr = MemoryTracker(model, opt) if tracker else None
    if tr is not None:
        tr.attach()
        tr._cuda = torch.device("cuda", 0)  # what attach() reads from a model on cuda:0
    rows: list[dict[str, Any]] = []
    for step in range(steps):
        if tr is not None:
            tr.begin_step(step, True)
        x = dev.malloc(BATCH)
        out = model(torch.ones(2, 4))
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        dev.free(model.kept.pop("OUT"))
        dev.free(x)
        if tr is not None:
            rows += tr.end_step(step)
    if tr is not None:
        tr.detach()
    return dev.max_memory_allocated(), rows, tr


def test_a_profiled_loop_reads_the_peak_an_unprofiled_one_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """precprof must not change what the process's counters say: a user's max_memory_allocated() after a
    profiled loop is what it is without precprof, and the peak counters are never reset."""
    plain = FakeCudaAllocator()
    plain.install(monkeypatch)
    expected, _, _ = device_loop(plain, 3, tracker=False)
    dev = FakeCudaAllocator()
    dev.install(monkeypatch)
    user_peak, rows, tr = device_loop(dev, 3, tracker=True)
    assert dev.resets == []
    # the highest is in backward, once the states exist
    assert user_peak == expected == PARAMS + STATES + BATCH + SAVED + OUT + GRAD_OUT + WORKSPACE
    assert not dev.history and not dev.trace  # the allocator's history is off again, and empty
    assert tr is not None and tr.peak_note == ""

    # each phase's peak as the allocator saw it, by hand: the model and states (from step 1), the batch, ...
    last = [r for r in rows if r[T.STEP] == 2]
    peaks = {r[T.PHASE]: r[T.BYTES] for r in last if r[T.COMPONENT] == T.ALLOCATOR_PEAK}
    base = PARAMS + STATES
    assert peaks == {
        T.PHASE_FORWARD: base + BATCH + SAVED + FWD_TMP,
        T.PHASE_BACKWARD: base + BATCH + SAVED + OUT + GRAD_OUT + WORKSPACE,
        T.PHASE_OPTIMIZER: base + BATCH + OUT + PGRADS + OPT_TMP,
        T.PHASE_OTHER: base + BATCH + OUT + PGRADS,  # after the optimizer step, before zero_grad
    }
    step0 = {r[T.PHASE]: r[T.BYTES] for r in rows if r[T.STEP] == 0 and r[T.COMPONENT] == T.ALLOCATOR_PEAK}
    # the states are made during the first step
    assert step0[T.PHASE_OPTIMIZER] == PARAMS + BATCH + OUT + PGRADS + STATES + OPT_TMP
    reserved = {r[T.PHASE]: r[T.BYTES] for r in last if r[T.COMPONENT] == T.ALLOCATOR_RESERVED_PEAK}
    assert reserved[T.PHASE_BACKWARD] == dev.reserved == FakeCudaAllocator.SEGMENT

    # at the peak (in backward) every byte is in one part: nothing the tracker saw lives on this fake device,
    # so what the step allocated is temporaries of the phase that allocated it, what was there before is other
    at_peak = [r for r in last if r[T.MOMENT] == T.MOMENT_PEAK]
    assert {r[T.PHASE] for r in at_peak} == {T.PHASE_BACKWARD}
    parts = {(r[T.COMPONENT], r[T.MODULE]): r[T.BYTES] for r in at_peak}
    assert parts == {
        (T.OTHER_MEMORY, ""): PARAMS + STATES,
        (T.TEMPORARIES, T.PHASE_OTHER): BATCH,
        (T.TEMPORARIES, T.PHASE_FORWARD): SAVED + OUT,
        (T.TEMPORARIES, T.PHASE_BACKWARD): GRAD_OUT + WORKSPACE,
        (T.ALLOCATOR_CACHE, ""): FakeCudaAllocator.SEGMENT - peaks[T.PHASE_BACKWARD],
    }
    assert sum(parts.values()) - parts[(T.ALLOCATOR_CACHE, "")] == peaks[T.PHASE_BACKWARD]


def test_the_history_leaves_out_the_actions_the_replay_does_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The history is recorded without a free's completion (``_compat.HISTORY_SKIPPED``): a third fewer entries
    to convert and read, the same peaks as a torch that records every action (before ``skip_actions``)."""
    assert "free_completed" in _compat.HISTORY_SKIPPED and "free_requested" not in _compat.HISTORY_SKIPPED

    def run(old_torch: bool) -> tuple[list[set[str]], list[dict[str, Any]]]:
        dev = FakeCudaAllocator()
        dev.install(monkeypatch)
        if old_torch:  # an older torch's signature: no skip_actions

            def record(
                enabled: Any = "all", context: Any = "all", stacks: str = "all", max_entries: int = 0
            ) -> None:
                dev.record_memory_history(enabled)

            monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
        actions: list[set[str]] = []

        def snapshot(*args: Any, **kwargs: Any) -> dict[str, Any]:
            snap = dev.snapshot()
            actions.append({e["action"] for e in snap["device_traces"][0]})
            return snap

        monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot)
        _, rows, tr = device_loop(dev, 3, tracker=True)
        assert tr is not None and tr.peak_note == ""
        return actions, rows

    actions, rows = run(old_torch=False)
    assert len(actions) == 3
    assert all(
        {"alloc", "free_requested"} <= a <= {"alloc", "free_requested", "segment_alloc"} for a in actions
    )
    old_actions, old_rows = run(old_torch=True)
    assert all("free_completed" in a for a in old_actions)
    assert old_rows == rows  # every row, the peaks and the parts at the peak among them


def test_a_program_that_records_the_allocator_history_itself_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev = FakeCudaAllocator()
    dev.install(monkeypatch)
    dev.record_memory_history("all")  # the program's own recording, e.g. for an out-of-memory snapshot
    _, rows, tr = device_loop(dev, 1, tracker=True)
    assert dev.history and dev.trace  # still on, with everything it recorded
    assert dev.resets == []
    assert not any(r[T.MOMENT] == T.MOMENT_PEAK for r in rows)  # no replay: no parts at the peak
    assert tr is not None and "history itself" in tr.peak_note
    # the phase peaks fall back to the process's counters, read, never reset: the step's highest phase peak
    # is the counter's value (it grew in this first step)
    counted = [r for r in rows if r[T.COMPONENT] in (T.ALLOCATOR_PEAK, T.ALLOCATOR_SEEN_MAX)]
    assert counted and max(r[T.BYTES] for r in counted) == dev.max_memory_allocated()
    assert any(r[T.COMPONENT] == T.PARAMETERS for r in rows)  # the components are still measured


def test_the_history_counts_each_block_as_the_allocator_counts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator's history records the bytes asked for (a loss: 4 bytes), its counters the block's (512):
    replayed, the step's allocations reach the counter's peak to the byte (on an H100 the replayed peak was
    988 bytes short of max_memory_allocated() before the sizes were rounded)."""
    assert [block_bytes(n) for n in (1, 4, 511, 512, 513, 1000, 1 << 20, (1 << 20) + 1)] == [
        512,
        512,
        512,
        512,
        1024,
        1024,
        1 << 20,
        (1 << 20) + 512,
    ]
    dev = FakeCudaAllocator()
    dev.install(monkeypatch)
    held = dev.malloc(3000)  # before the step: 3072 bytes
    history = CudaHistory(torch.device("cuda", 0))
    assert history.start() is None
    loss = dev.malloc(4)
    tmp = dev.malloc(1000)
    dev.free(tmp)
    grad = dev.malloc(513)
    dev.free(loss)
    events, note = history.stop()
    assert note == "" and events is not None
    assert events.start == {held: 3072}
    assert [(k, s) for k, s in zip(events.kinds, events.sizes, strict=True)] == [
        (ALLOC, 512),
        (ALLOC, 1024),
        (FREE, 1024),
        (ALLOC, 1024),
        (FREE, 512),
    ]
    live = running = sum(events.start.values())
    for k, s in zip(events.kinds, events.sizes, strict=True):
        running += s if k == ALLOC else -s if k == FREE else 0
        live = max(live, running)
    assert live == dev.max_memory_allocated() == 3072 + 512 + 1024
    assert running == dev.memory_allocated()
    dev.free(grad)
    dev.free(held)


def test_the_snapshot_is_read_with_the_garbage_collector_held_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator's snapshot is a dict per event, made at the step's end and let go once read: read with the
    collector running, their numbers set off collections (a full one, which walks every object of the process,
    cost an H200's gpt2-small step at 1 in 10 about 250 ms once); held off, none runs, and the collector is left
    as the program had it (on, or off)."""
    dev = FakeCudaAllocator()
    dev.install(monkeypatch)

    def step_end(pause: bool) -> tuple[list[int], Events | None]:
        history = CudaHistory(torch.device("cuda", 0))
        assert history.start() is None
        for _ in range(5000):
            dev.free(dev.malloc(1000))
        started: list[int] = []

        def seen(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started.append(info["generation"])

        gc.callbacks.append(seen)
        try:
            if pause:
                events, note = history.stop()
            else:
                with monkeypatch.context() as m:
                    m.setattr(_compat, "gc_paused", contextlib.nullcontext)
                    events, note = history.stop()
        finally:
            gc.callbacks.remove(seen)
        assert note == ""
        return started, events

    assert gc.isenabled()
    started, events = step_end(pause=True)
    assert started == [] and gc.isenabled()
    assert events is not None and (events.kinds.count(ALLOC), events.kinds.count(FREE)) == (5000, 5000)
    started, _ = step_end(pause=False)
    assert started  # the test tells: without the pause the same snapshot sets collections off
    gc.disable()
    try:
        step_end(pause=True)
        assert not gc.isenabled()  # the program's own setting, kept
    finally:
        gc.enable()


# ------------------------------------------------------------------------------------------ the replay
def test_replay_names_a_reused_address_by_the_allocation_that_holds_it() -> None:
    """An address seen as a saved activation in forward, freed, then reused by a temporary in backward: at a
    backward peak the block is the temporary. And a label seen after the peak names a block only if the block
    lives on until then."""
    ev = Events(start={100: 1000})
    #            0: alloc 200 (saved)  1: alloc 300   | 2: free 200  3: alloc 200 (reused)  4: alloc 400  5: free 400
    ev.kinds = [ALLOC, ALLOC, FREE, ALLOC, ALLOC, FREE, SEGMENT_ALLOC]
    ev.ptrs = [200, 300, 200, 200, 400, 400, 900]
    ev.sizes = [50, 60, 50, 70, 80, 80, 4096]
    ev.reserved_start = 2048
    ev.marks = [2]  # segment 0 (forward): events 0-1; segment 1 (backward): 2-6
    labels = {
        100: [Label(T.PARAMETERS, "", "float32", 1 << 30)],
        200: [Label(T.ACTIVATIONS, "fc", "float32", 0)],
        300: [Label(T.OUTPUTS, "", "float32", 0)],
        400: [Label(T.GRADIENTS, "", "float32", 1)],  # seen in backward, but freed before backward ended
    }
    peak = replay(ev, [T.PHASE_FORWARD, T.PHASE_BACKWARD], lambda k: labels.get(k, []))
    assert peak.allocated == 1000 + 60 + 70 + 80 and peak.phase == T.PHASE_BACKWARD
    assert peak.phase_peaks == {T.PHASE_FORWARD: (1110, 2048), T.PHASE_BACKWARD: (1210, 2048 + 4096)}
    assert peak.parts == {
        (T.PARAMETERS, "", "float32"): 1000,
        (T.OUTPUTS, "", "float32"): 60,
        (T.TEMPORARIES, T.PHASE_BACKWARD, ""): 70 + 80,  # not the activation once at 200, nor a gradient
        (T.ALLOCATOR_CACHE, "", ""): 2048 - 1210,  # the segment came after the peak
    }


# --------------------------------------------------------------------------------- the CPU, for real
def test_the_parts_of_an_mlps_peak_by_hand() -> None:
    """An fp32 MLP under SGD with momentum, its second step: the peak comes at the end of backward, when the
    first layer's weight gradient is made. Then the parameters, the momentum buffers and the gradients take 4N
    bytes each; the first layer's input is still saved for that gradient, the output is still held by the
    loop, and the gradient of the hidden layer is in flight."""
    bsz, d_in, d_hid, d_out = 64, 256, 1024, 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_hid), nn.ReLU(), nn.Linear(d_hid, d_out))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    tr = MemoryTracker(model, opt, peak=True)
    tr.attach()
    for step in range(2):
        tr.begin_step(step, True)
        x = torch.randn(bsz, d_in)
        out = model(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows = tr.end_step(step)
    tr.detach()
    parts = {(r[T.COMPONENT], r[T.MODULE]): r[T.BYTES] for r in rows if r[T.MOMENT] == T.MOMENT_PEAK}
    assert {r[T.PHASE] for r in rows if r[T.MOMENT] == T.MOMENT_PEAK} == {T.PHASE_BACKWARD}
    assert parts == {
        (T.PARAMETERS, ""): 4 * n,
        (T.OPTIMIZER_STATES, ""): 4 * n,  # momentum buffers
        (T.GRADIENTS, ""): 4 * n,
        (T.ACTIVATIONS, "0"): bsz * d_in * 4,  # x, saved by the first Linear for its weight gradient
        (T.OUTPUTS, ""): bsz * d_out * 4,
        # the hidden layer's gradient, and two scalars: the loss and the gradient backward was seeded with
        (T.TEMPORARIES, T.PHASE_BACKWARD): bsz * d_hid * 4 + 2 * 4,
    }
    assert sum(parts.values()) == step_peak(rows, 1)


class LiveStorages(TorchDispatchMode):
    """An independent count of the peak: every storage an op returns is counted from the op until the storage
    is freed (``weakref.finalize``), starting from the storages alive when the step begins. It sees what ops
    return, not an op's internal scratch."""

    def __init__(self, alive: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        for t in alive:
            self._add(t.untyped_storage())
        self.peak = self.total

    @property
    def total(self) -> int:
        return sum(self.live.values())

    def _add(self, st: torch.UntypedStorage) -> None:
        ptr, n = st.data_ptr(), st.nbytes()
        if ptr and n and ptr not in self.live:
            self.live[ptr] = n
            weakref.finalize(st, self.live.pop, ptr, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.device.type == "cpu":
                self._add(t.untyped_storage())
        self.peak = max(self.peak, self.total)
        return out


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)


def persistent(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *model.buffers(), *states, *grads]


def at_peak(rows: list[dict[str, Any]], step: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        if r[T.STEP] == step and r[T.MOMENT] == T.MOMENT_PEAK:
            out[r[T.COMPONENT]] = out.get(r[T.COMPONENT], 0) + r[T.BYTES]
    return out


def step_peak(rows: list[dict[str, Any]], step: int) -> int:
    return max(r[T.BYTES] for r in rows if r[T.STEP] == step and r[T.COMPONENT] == T.ALLOCATOR_PEAK)


@pytest.mark.parametrize("name", ["gpt-nano", "mlp", "cnn-bn"])
def test_the_peak_adds_up_on_the_built_in_models(name: str) -> None:
    """The built-in loop's step, on the CPU: the parts at the peak add up to the allocator's peak, at most 10%
    of it is "other", the peak matches an independent count of live storages, and the model's and optimizer's
    parts are their measured sizes."""
    torch.manual_seed(0)
    model = build_model(name, {}, vocab_size=64, seq_len=32).module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    peaks = []
    with Profiler(model, opt, sample_every=1, memory_peak=True) as prof:
        for _ in range(2):
            with LiveStorages(persistent(model, opt)) as live:
                x, y = (torch.randint(0, 64, (4, 32), generator=g) for _ in range(2))
                out = model(x)
                with prof.memory_scope():
                    loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step(loss=loss.detach())
            peaks.append(live.peak)
    rows = prof.tables()["memory"].to_dict("records")
    for step in (0, 1):
        parts = at_peak(rows, step)
        peak = step_peak(rows, step)
        assert sum(parts.values()) == peak
        assert parts.get(T.OTHER_MEMORY, 0) <= 0.10 * peak
        # the independent count sees the same peak, give or take what ops allocate internally
        assert abs(peak - peaks[step]) <= 0.05 * peaks[step], (name, step, peak, peaks[step])
    comps: dict[str, int] = {}
    for r in rows:
        if r[T.STEP] == 1 and r[T.MOMENT] == "" and r[T.DTYPE] != "":
            comps[r[T.COMPONENT]] = comps.get(r[T.COMPONENT], 0) + r[T.BYTES]
    parts = at_peak(rows, 1)
    n = sum(p.numel() for p in model.parameters())
    assert parts[T.PARAMETERS] == comps[T.PARAMETERS] == 4 * n
    assert parts[T.OPTIMIZER_STATES] == comps[T.OPTIMIZER_STATES]  # Adam's moments, 8 bytes per element
    assert parts[T.PROFILER_BUFFERS] > 0
    phase = next(r[T.PHASE] for r in rows if r[T.STEP] == 1 and r[T.MOMENT] == T.MOMENT_PEAK)
    if phase in (T.PHASE_FORWARD, T.PHASE_BACKWARD):  # the graph holds what forward saved
        assert 0 < parts[T.ACTIVATIONS] <= comps[T.ACTIVATIONS]
    else:  # after backward the graph has let its saved tensors go
        assert parts.get(T.ACTIVATIONS, 0) == 0 and parts[T.GRADIENTS] == comps[T.GRADIENTS]


def test_the_parts_of_the_peak_are_never_counted_twice_downstream() -> None:
    """The parts of the peak repeat components (parameters, states) at that moment: the projection, the
    advisor and the distributed totals read each component's own rows only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # on bf16 parameters: bf16 moments
    with Profiler(model, opt, sample_every=1, memory_peak=True) as prof:
        for _ in range(2):
            model(torch.randn(16, 32, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    tabs = prof.tables()
    mem = tabs["memory"]
    last = mem[mem[T.STEP] == mem[T.STEP].max()]
    at_peak = last[last[T.MOMENT] == T.MOMENT_PEAK]
    assert (at_peak[T.COMPONENT] == T.OPTIMIZER_STATES).any()
    states = last[(last[T.COMPONENT] == T.OPTIMIZER_STATES) & (last[T.MOMENT] == "")]
    low = int(states.loc[states[T.DTYPE] == "bfloat16", T.BYTES].sum())
    assert low == 2 * 2 * sum(p.numel() for p in model.parameters())  # exp_avg and exp_avg_sq, 2 bytes each

    assert project(mem, {}) == project(T.memory_at(mem), {})
    finding = recommend(tabs, summary=prof.summary()).finding("low_precision_optimizer_states")
    assert finding is not None
    assert finding.numbers["low_precision_bytes"] == low and finding.numbers["bytes"] == int(
        states[T.BYTES].sum()
    )


def test_a_cpu_loop_gets_the_peak_only_when_it_asks() -> None:
    """On the CPU the peak needs torch.profiler, which a program's own profiler could collide with: off by
    default in a user's loop, and the tracker says so; a program's running torch.profiler is left alone."""
    model = nn.Sequential(nn.Linear(8, 8))
    for peak, note in ((None, "memory_peak=True"), (False, "memory_peak=False")):
        tr = MemoryTracker(model, peak=peak)
        tr.attach()
        tr.begin_step(0, True)
        model(torch.randn(2, 8)).sum().backward()
        rows = tr.end_step(0)
        tr.detach()
        assert note in tr.peak_note and tr.model_facts()["peak_note"] == tr.peak_note
        assert not any(r[T.MOMENT] == T.MOMENT_PEAK or r[T.COMPONENT] == T.ALLOCATOR_PEAK for r in rows)
    tr = MemoryTracker(model, peak=True)
    tr.attach()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as user_prof:
        tr.begin_step(0, True)
        model(torch.randn(2, 8)).sum().backward()
        rows = tr.end_step(0)
    tr.detach()
    assert "torch.profiler is running" in tr.peak_note
    assert not any(r[T.MOMENT] == T.MOMENT_PEAK for r in rows)
    assert any(e.name == "aten::addmm" for e in user_prof.events())  # the program's profile is whole


def test_a_programs_profiler_started_while_precprof_reads_the_peak_keeps_its_events() -> None:
    """The usual "profile steps 2 to 4" pattern in a loop measured with ``memory_peak=True``: the program's
    ``torch.profiler.profile`` opened while precprof's memory profiler ran (started at the ``prof.step()``
    before), joined its session, and precprof's stop at the next ``prof.step()`` ended it: the program's
    profile came back with one kind of event (no ``my_step``, no ``aten::addmm``), and nothing said so. The
    session is left to the program's profiler: its events are whole, and the steps it overlaps have no peak,
    with why; the others have theirs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    notes = []
    with Profiler(model, optimizer=opt, sample_every=1, memory_peak=True) as prof:

        def step() -> None:
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
            notes.append(prof._tracker.peak_note if prof._tracker is not None else None)

        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as user_prof:
            for _ in range(3):
                with torch.profiler.record_function("my_step"):
                    step()
        step()
        step()
    names = [e.name for e in user_prof.events()]
    assert names.count("my_step") == 3 and names.count("aten::addmm") == 6
    memory = prof.tables()["memory"]
    peaked = set(memory.loc[memory[T.COMPONENT] == T.ALLOCATOR_PEAK, T.STEP])
    # step 1 began before the program's profiler, steps 2 to 4 (begun at a prof.step() inside it) after
    assert peaked == {0, 5}
    assert TAKEN_OVER in notes  # the step the program's profiler began in says why it has no peak


_USER_LOOP_WITH_PEAK = """
import os, torch, precprof
from torch import nn
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with precprof.Profiler(model, optimizer=opt, memory_peak=True, sample_every=1) as prof:
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        prof.step(loss=loss)
assert prof.tables()["memory"]["phase"].ne("").any(), "no peak measured"
print("KINETO_LOG_LEVEL" in os.environ)
"""


def test_a_users_loop_measuring_the_cpu_peak_prints_nothing_of_kinetos() -> None:
    """``Profiler(memory_peak=True)`` in a loop's own process printed two Kineto lines per sampled step
    (``USDT ... profiler_start``, ``profiler_stop``); `precprof train` quiets them through its environment,
    which a user's process does not have. They stay off, and the environment the program reads is unchanged."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    res = subprocess.run(
        [sys.executable, "-c", _USER_LOOP_WITH_PEAK], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert "USDT" not in res.stderr and "profiler_start" not in res.stderr, res.stderr
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("closure", [False, True])
def test_a_closure_steps_optimizer_phase_begins_after_its_backward(closure: bool) -> None:
    """``optimizer.step(closure)`` (Lightning's automatic optimization) runs the forward and backward inside
    the step, after its pre-hook: the optimizer phase began there, so the optimizer's own allocations (AdamW's
    states and temporaries, this step's peak) were labelled "in backward". It begins once the closure ran: the
    closure's step has the phases of the same step without one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with Profiler(model, optimizer=opt, sample_every=1, memory_peak=True) as prof:
        for _ in range(2):
            if closure:
                opt.step(forward_backward)
            else:
                forward_backward()
                opt.step()
            prof.step()
    memory = prof.tables()["memory"]
    peaks = memory[(memory[T.COMPONENT] == T.ALLOCATOR_PEAK) & (memory[T.STEP] == 1)]
    assert set(peaks[T.PHASE]) >= {T.PHASE_FORWARD, T.PHASE_BACKWARD, T.PHASE_OPTIMIZER}
    at_peak = T.memory_at(memory[memory[T.STEP] == 1], T.MOMENT_PEAK)
    assert set(at_peak[T.PHASE]) == {T.PHASE_OPTIMIZER}
    assert T.OPTIMIZER_STATES in set(at_peak[T.COMPONENT])


@pytest.mark.parametrize("evaluate", [False, True])
def test_an_evaluation_between_steps_is_not_the_steps_peak(evaluate: bool) -> None:
    """The Trainer evaluates between ``prof.step()`` and the next step: its batch of 256 was the next step's peak
    (6.7 MiB where training peaked at 0.85 MiB), and the memory verdict was taken from it. Inside
    ``prof.not_training()`` it is a phase of its own, not the step's: the step's peak and its parts are those of
    the same step without the evaluation."""

    def run(evaluate: bool) -> pd.DataFrame:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with Profiler(model, optimizer=opt, sample_every=1, memory_peak=True) as prof:
            for _ in range(3):
                if evaluate:
                    with prof.not_training(), torch.no_grad():
                        model(torch.randn(4096, 64)).sum()  # 2 MiB of hidden activations at once
                model(torch.randn(16, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step()
        memory = prof.tables()["memory"]
        return memory[memory[T.STEP] == 1].reset_index(drop=True)  # (the second step measured)

    got, plain = run(evaluate), run(False)
    cols = [T.COMPONENT, T.MODULE, T.DTYPE, T.PHASE, T.MOMENT]
    peaks = got[got[T.COMPONENT] == T.ALLOCATOR_PEAK]
    assert T.PHASE_OUTSIDE not in set(got[T.PHASE]) and len(peaks) == 4
    at_peak = T.memory_at(got, T.MOMENT_PEAK).set_index(cols)[T.BYTES]
    want = T.memory_at(plain, T.MOMENT_PEAK).set_index(cols)[T.BYTES]
    assert at_peak.drop(
        index=[k for k in at_peak.index if k[0] == T.PROFILER_BUFFERS], errors="ignore"
    ).to_dict() == (
        want.drop(index=[k for k in want.index if k[0] == T.PROFILER_BUFFERS], errors="ignore").to_dict()
    )
    assert int(at_peak.sum()) < 2 * 2**20  # the evaluation's 2 MiB are not in it


def test_an_evaluation_in_eval_mode_before_the_training_forward_is_not_the_steps_peak() -> None:
    """A validation at the step's start, ``model.eval()`` with grad on and no ``not_training()``: its forward was
    taken for the step's training forward, its 2 MiB of hidden activations the step's forward peak and its saved
    tensors counted with the training's. The model in train mode before any backward makes it an evaluation: its
    time is a phase of its own, and the step's peak, its parts and its activations are the plain step's."""

    def run(evaluate: bool) -> pd.DataFrame:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with Profiler(model, optimizer=opt, sample_every=1, memory_peak=True) as prof:
            for _ in range(3):
                if evaluate:
                    model.eval()
                    model(
                        torch.randn(4096, 64)
                    ).sum()  # 2 MiB of hidden activations at once, saved for nothing
                    model.train()
                model(torch.randn(16, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step()
        memory = prof.tables()["memory"]
        return memory[memory[T.STEP] == 1].reset_index(drop=True)  # (the second step measured)

    got, plain = run(True), run(False)
    cols = [T.COMPONENT, T.MODULE, T.DTYPE, T.PHASE, T.MOMENT]
    assert T.PHASE_OUTSIDE not in set(got[T.PHASE])
    mine = got[got[T.COMPONENT] != T.PROFILER_BUFFERS].set_index(cols)[T.BYTES]
    want = plain[plain[T.COMPONENT] != T.PROFILER_BUFFERS].set_index(cols)[T.BYTES]
    peaks = [T.ALLOCATOR_PEAK, T.ALLOCATOR_RESERVED_PEAK]
    assert mine.drop(index=peaks, level=0, errors="ignore").to_dict() == (
        want.drop(index=peaks, level=0, errors="ignore").to_dict()
    )
    forward_peak = got[(got[T.COMPONENT] == T.ALLOCATOR_PEAK) & (got[T.PHASE] == T.PHASE_FORWARD)][T.BYTES]
    assert int(forward_peak.iloc[0]) < 2**20  # the evaluation's 2 MiB are not in the step's forward
