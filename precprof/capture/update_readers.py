"""What reads a device group's weight-update samples in place (``capture/updates.py``), by the parameters' and
gradients' addresses, instead of the torch path's view of each parameter, concatenation and 40-odd ops:

- on the CPU, where the C statistics kernel is in use, the C kernel (``HostSamples``: ``pp_upd_gather``,
  ``pp_upd_nonzero``, ``pp_upd_classify``; one call in each optimizer hook);
- on a CUDA device, where the Triton engine is in use, two Triton launches (``stats.triton_updates``), once
  their compile is loaded (the torch path until then: nothing compiles in a hook).

Both take the same arithmetic as the torch path, and return False from a method when a member cannot be read
in place this step (a non-contiguous weight or gradient, a gradient of another dtype, a wrapper subclass): the
group then takes the torch path for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from precprof.capture import update_sizes
from precprof.capture.records import _ParamSlot
from precprof.errors import UserError
from precprof.stats import engine as _engine
from precprof.stats import kernel as _cpu_kernel
from precprof.stats import triton_updates

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # (``updates`` reads these two too)
_PLAIN_SET = frozenset(_PLAIN)
_HOST_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kernel.c's pp_upd_* dtype codes


def engine(device: torch.device, members: list[_ParamSlot]) -> str:
    """The statistics engine of ``device`` whose reader a group of ``members`` there uses: "c", "triton" or
    "torch". "torch" too where the engine asked for cannot run there (the statistics say so at attach; the
    samples need no engine), and for Triton where the members are of two dtypes or of one its kernels do not
    read: a group that can never launch them does not ask again whether they are loaded at every sampled step."""
    try:
        name = _engine.resolve_engine(None, device)
    except UserError:
        return "torch"
    if name == "triton":
        dtypes = {ps.tensor.dtype for ps in members}
        if len(dtypes) != 1 or not dtypes <= set(triton_updates.DTYPES):
            return "torch"
    return name


def reader(device: torch.device, members: list[_ParamSlot], name: str) -> Any:
    """The in-place reader of a group of ``members`` on ``device`` under engine ``name``; None for the torch
    path (no C kernel; the Triton kernels not loaded yet, or the members of more than one dtype)."""
    if name == "c" and device.type == "cpu":
        lib = _cpu_kernel.load()
        return HostSamples(lib, members) if lib is not None else None
    if name == "triton":
        dtypes = {ps.tensor.dtype for ps in members}
        if len(dtypes) == 1 and triton_updates.ready(device, next(iter(dtypes))):
            return triton_updates.TritonSamples(device, dtypes.pop(), members)
    return None


class HostSamples:
    """A CPU group's samples through the C kernel (``pp_upd_gather``, ``pp_upd_nonzero``,
    ``pp_upd_classify``): the parameters' data and gradients read in place by pointer, while every member is
    a plain contiguous fp32, bf16 or fp16 tensor (and every gradient present is contiguous); False from a
    method sends the group down the torch path for the step."""

    def __init__(self, lib: Any, members: list[_ParamSlot]) -> None:
        self.lib = lib
        self.k = len(members)
        self.strides = np.array([ps.sample_stride for ps in members], dtype=np.int64)
        self.lens = np.array([ps.sample_len for ps in members], dtype=np.int64)
        self.dtypes = np.zeros(self.k, dtype=np.int64)
        self.ptrs = np.zeros(self.k, dtype=np.int64)
        self.grad_ptrs = np.zeros(self.k, dtype=np.int64)
        total = int(self.lens.sum())
        self.before = np.zeros(total, dtype=np.float32)
        self.after = np.zeros(total, dtype=np.float32)
        self.starts = np.concatenate(([0], np.cumsum(self.lens)[:-1])).astype(np.int64)  # each member's first
        self.intended = np.zeros(total, dtype=np.uint8)
        self._held: list[int] | None = None  # the members' data pointers the arrays were made for
        self._param_dtypes: list[torch.dtype] = []

    def _params(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Point at the members' data now; False when one cannot be read in place."""
        try:
            ptrs = list(map(torch.Tensor.data_ptr, tensors))
        except (RuntimeError, TypeError):  # a wrapper without storage of its own
            return False
        if ptrs == self._held:
            return True
        self._held = None
        codes = [_HOST_DTYPES.get(t.dtype, -1) for t in tensors]
        if -1 in codes or not all(type(t) in _PLAIN and t.is_contiguous() for t in tensors):
            return False
        self.ptrs[:] = ptrs
        self.dtypes[:] = codes
        self._param_dtypes = [t.dtype for t in tensors]
        self._held = ptrs
        return True

    def read_before(self, tensors: Sequence[torch.Tensor]) -> bool:
        """The samples and whether each one's gradient is nonzero, before the optimizer step."""
        if not self._params(tensors):
            return False
        maybe = [t.grad for t in tensors]
        gp = self.grad_ptrs
        at = [i for i, g in enumerate(maybe) if g is not None]  # (``None in`` would compare tensors)
        grads = [g for g in maybe if g is not None] if len(at) < self.k else cast(list[torch.Tensor], maybe)
        if len(at) < self.k:
            gp[:] = 0
        # read with its parameter's dtype code: a gradient of another dtype (set through ``.data``) takes the
        # torch path, as does one not laid out as its parameter (its shape and device are its parameter's)
        dtypes = self._param_dtypes if len(at) == self.k else [self._param_dtypes[i] for i in at]
        if not (
            set(map(type, grads)) <= _PLAIN_SET
            and [g.dtype for g in grads] == dtypes
            and all(map(torch.Tensor.is_contiguous, grads))
        ):
            return False
        if len(at) == self.k:
            gp[:] = list(map(torch.Tensor.data_ptr, grads))
        elif at:
            gp[at] = list(map(torch.Tensor.data_ptr, grads))
        lib, args = self.lib, (self.k, self.ptrs.ctypes.data, self.strides.ctypes.data, self.lens.ctypes.data)
        lib.pp_upd_gather(*args, self.dtypes.ctypes.data, self.before.ctypes.data)
        lib.pp_upd_nonzero(
            self.k, gp.ctypes.data, *args[2:], self.dtypes.ctypes.data, self.intended.ctypes.data
        )
        return True

    def set_intent(self, nonzero: torch.Tensor) -> None:
        """The intent read again (``optimizer.step(closure)``), from the torch path's ``grad_nonzero``."""
        self.intended[:] = nonzero.cpu().numpy()

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`read_before` read, for the torch path: the samples (fp32) and the intent (bool)."""
        return torch.from_numpy(self.before.copy()), torch.from_numpy(self.intended.astype(bool))

    def classify(
        self, tensors: Sequence[torch.Tensor], counts: torch.Tensor, sizes: torch.Tensor, held_bf16: bool
    ) -> bool:
        """Add the step's updates into ``counts`` ([members, 5] int64, contiguous, on the CPU) and their sizes
        into ``sizes``; False when a member can no longer be read in place."""
        if not self._params(tensors):
            return False
        self.lib.pp_upd_classify(
            self.k,
            self.ptrs.ctypes.data,
            self.strides.ctypes.data,
            self.lens.ctypes.data,
            self.dtypes.ctypes.data,
            self.before.ctypes.data,
            self.intended.ctypes.data,
            int(held_bf16),
            counts.data_ptr(),
        )
        # the sizes, the samples read again by the same pointers
        args = (self.k, self.ptrs.ctypes.data, self.strides.ctypes.data, self.lens.ctypes.data)
        self.lib.pp_upd_gather(*args, self.dtypes.ctypes.data, self.after.ctypes.data)
        update_sizes.add_host(sizes, self.starts, self.before, self.after)
        return True
