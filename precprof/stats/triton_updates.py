"""The weight-update samples of a CUDA device group in two Triton launches (``capture/updates.py``'s arithmetic).

The torch path reads a group's samples with one strided view per parameter, one concatenation and one cast, the
gradients' samples the same way, and classifies the updates in some 40 more ops: 245 dispatcher ops a sampled
step for GPT-2 small's 148 parameters, 148 of them the gradients' views made in Python every step, and on an
H200 the optimizer's range 4.9 ms longer on the device (bench/results/README_h200_2026-12-04.md). Here the parameters and their gradients
are read by their addresses from a table (one int64 column per member: parameter, gradient or 0, stride, sample
length, where its samples begin), one program per member:

- ``_read`` (the optimizer's pre-hook): each member's strided sample as fp32 into ``before`` and whether its
  gradient there is nonzero into ``intended``;
- ``_classify`` (its post-hook): the samples read again, the update ``after - before`` classified (no update,
  lost in bf16, lost in fp16, lost in the weight as held) and added into the group's counts, and its size into
  the group's sizes (``capture/update_sizes.py``), each program its own member's rows (no atomics).

bf16 is rounded to nearest even by bit arithmetic: Triton's interpreter truncates ``.to(tl.bfloat16)``, where a
GPU rounds; fp16 by ``.to(tl.float16, fp_downcast_rounding="rtne")``, which both round alike. No sync: the table
goes to the device from pinned memory, without waiting. Compiled with the row kernels (``StatsBuffer``'s warm, and
``triton_ahead``'s other process); a group uses these kernels only once they are loaded (``ready``), the torch
path until then.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from precprof.stats import triton_launch
from precprof.stats.triton_engine import interpreting, triton_missing

# the dtypes a member may have (one per group and launch): fp32, bf16, fp16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 256  # a program's values a block (the default sample, 256 a parameter: one block a member)
NUM_WARPS = 2
# the table's rows (``triton_update_kernels``' PARAM ... START)
PARAM, GRAD, STRIDE, LEN, START = range(5)
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# (device, dtype) whose kernels are compiled and loaded (``loaded``); per device, why its compile failed
_READY: set[tuple[torch.device, torch.dtype]] = set()
_ERRORS: dict[torch.device, str] = {}
_READY_LOCK = threading.Lock()


def _kernels() -> Any:
    # imports triton (seconds): only where a group runs these kernels or a Triton engine compiles them
    from precprof.stats import triton_update_kernels

    return triton_update_kernels


def _example_args(device: torch.device) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Arguments of the two kernels for a compile (never launched): their dtypes and alignment are a group's."""
    table = torch.zeros((5, 1), dtype=torch.int64, device=device)
    before = torch.zeros(1, dtype=torch.float32, device=device)
    intended = torch.zeros(1, dtype=torch.uint8, device=device)
    counts = torch.zeros((1, 5), dtype=torch.int64, device=device)
    sizes = torch.zeros((1, 6), dtype=torch.float64, device=device)
    return (table, 1, before, intended), (table, 1, before, intended, counts, sizes)


def compile_kernels(device: torch.device, dtypes: Iterable[torch.dtype]) -> list[Any]:
    """Compile (without launching) both kernels for each of ``dtypes`` a group can have, for ``device``'s target;
    Triton's compiled kernels (futures under ``triton_compile.parallel_compile``). None in the interpreter."""
    if interpreting() or triton_missing() is not None:
        return []
    kernels = _kernels()
    read_args, classify_args = _example_args(device)
    out = []
    for dtype in sorted(set(dtypes) & set(DTYPES), key=str):
        const = {"DT": kernels.tl_dtype(dtype), "BLOCK": BLOCK, "num_warps": NUM_WARPS}
        out.append(kernels._read.run(*read_args, grid=(1,), warmup=True, **const))
        out.append(kernels._classify.run(*classify_args, grid=(1,), warmup=True, **const))
    return out


def warm(device: torch.device, dtypes: Iterable[torch.dtype]) -> list[Any] | None:
    """``compile_kernels`` for the Profiler's warm-up, which compiles the row kernels beside: a failure here
    (another Triton's language) leaves the samples to torch ops (None; ``status`` says why) and the row
    kernels' compile alone."""
    try:
        return compile_kernels(device, dtypes)
    except Exception as e:  # (the samples keep their torch path)
        _ERRORS[device] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return None


def load(device: torch.device, dtypes: Iterable[torch.dtype], kernels: list[Any] | None) -> None:
    """Load ``warm``'s kernels (their compiles done) and mark them ready; a failure is kept (``status``)."""
    if kernels is None:
        return
    try:
        triton_launch.load_kernels(kernels)
    except Exception as e:  # (as in ``warm``)
        _ERRORS[device] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return
    _ERRORS.pop(device, None)
    loaded(device, dtypes)


def status(device: torch.device) -> str:
    """How a group's samples on ``device`` are read by these kernels, in words (the summary's launches)."""
    if interpreting():
        return "two Triton launches a step (the interpreter)"
    if device in _ERRORS:
        return f"torch ops (the Triton kernels did not compile: {_ERRORS[device]})"
    if any(d == device for d, _ in _READY):
        return "two Triton launches a step"
    return "torch ops until the Triton kernels are loaded"


def loaded(device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
    """``compile_kernels(device, dtypes)``'s kernels are compiled and loaded: groups of these dtypes use them."""
    with _READY_LOCK:
        _READY.update((device, d) for d in dtypes if d in DTYPES)


def ready(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a group of ``dtype`` on ``device`` can launch the kernels without a compile (in the interpreter:
    whenever Triton is there, as nothing compiles)."""
    if dtype not in DTYPES or triton_missing() is not None:
        return False
    return interpreting() or (device, dtype) in _READY


class TritonSamples:
    """A device group's samples by the two kernels, as ``capture.update_readers.HostSamples`` by the C kernel: while
    every member is a plain contiguous tensor of the group's one dtype on its device (and every gradient present
    one too), else a method returns False and the group takes the torch path for the step. ``before`` and
    ``intended`` are the members' samples concatenated, on the device."""

    def __init__(self, device: torch.device, dtype: torch.dtype, members: Sequence[Any]) -> None:
        self.device = device
        self.dtype = dtype
        self.k = k = len(members)
        lens = [ps.sample_len for ps in members]
        host = self._table_host = torch.zeros((5, k), dtype=torch.int64)
        host[STRIDE] = torch.tensor([ps.sample_stride for ps in members], dtype=torch.int64)
        host[LEN] = torch.tensor(lens, dtype=torch.int64)
        host[START] = torch.tensor([0, *itertools.accumulate(lens[:-1])], dtype=torch.int64)
        self.table = host.to(device)
        self.before = torch.zeros(sum(lens), dtype=torch.float32, device=device)
        self.intended = torch.zeros(sum(lens), dtype=torch.uint8, device=device)
        self._sent: tuple[list[int], list[int]] | None = None  # the addresses the device's table holds
        self._grads: list[int] = [0] * k
        self._kernels = _kernels()
        self._const = {"DT": self._kernels.tl_dtype(dtype), "BLOCK": BLOCK, "num_warps": NUM_WARPS}

    def _plain(self, tensors: Sequence[torch.Tensor]) -> bool:
        return all(
            type(t) in _PLAIN
            and t.dtype == self.dtype
            and t.device == self.device
            and t.layout is torch.strided
            and t.is_contiguous()
            for t in tensors
        )

    def _send(self, params: list[int], grads: list[int]) -> None:
        """The device's table to hold these addresses: one copy from pinned memory, not waited for (none when
        it holds them already)."""
        if self._sent == (params, grads):
            return
        host = self._table_host
        host[PARAM] = torch.tensor(params, dtype=torch.int64)
        host[GRAD] = torch.tensor(grads, dtype=torch.int64)
        if self.device.type == "cuda":
            self.table.copy_(host.pin_memory(), non_blocking=True)
        else:
            self.table.copy_(host)
        self._sent = (params, grads)

    def read_before(self, tensors: Sequence[torch.Tensor]) -> bool:
        """The samples and whether each one's gradient is nonzero, before the optimizer step (one launch)."""
        if not self._plain(tensors):
            return False
        maybe = [t.grad for t in tensors]
        if not self._plain([g for g in maybe if g is not None]):
            return False
        self._grads = [0 if g is None else g.data_ptr() for g in maybe]
        self._send(list(map(torch.Tensor.data_ptr, tensors)), self._grads)
        self._kernels._read[(self.k,)](self.table, self.k, self.before, self.intended, **self._const)
        return True

    def set_intent(self, nonzero: torch.Tensor) -> None:
        """The intent read again (``optimizer.step(closure)``), from the torch path's ``grad_nonzero``."""
        self.intended.copy_(nonzero)

    def classify(
        self, tensors: Sequence[torch.Tensor], counts: torch.Tensor, sizes: torch.Tensor, held_bf16: bool
    ) -> bool:
        """Add the step's updates into ``counts`` ([members, 5] int64) and their sizes into ``sizes`` ([members,
        6] float64), the samples read again now (one launch); False when a member can no longer be read in place
        (``held`` then gives the torch path what was read before the step). ``held_bf16`` is the group's dtype
        being bf16, which the kernel is compiled for."""
        if not self._plain(tensors):
            return False
        self._send(list(map(torch.Tensor.data_ptr, tensors)), self._grads)
        args = (self.table, self.k, self.before, self.intended, counts, sizes)
        self._kernels._classify[(self.k,)](*args, **self._const)
        return True

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`read_before` read, for the torch path: the samples (fp32) and the intent (bool)."""
        return self.before.clone(), self.intended.bool()
