"""The rows of a device (CUDA, or the CPU when tests run the device code path there): one dense int64 tensor
``[rows, width]`` on the device, filled by the Triton kernel (engine "triton", ``stats.triton_engine``: one
launch per tensor) or by torch ops in bounded chunks (engine "torch"), without ever synchronising with the
host: nothing here calls ``.item()``, ``bool(tensor)``, ``nonzero`` or ``bincount`` (which asks the host for
the max on CUDA)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precprof.stats import blocks as _blocks
from precprof.stats import rows as _rows
from precprof.stats import triton_block, triton_engine
from precprof.stats.layout import (
    _F64_BIAS,
    _F64_EXP_ALL,
    _F64_MANT_MASK,
    _HI,
    _LO,
    _N_KEYS,
    _NO_MIN_BITS,
    N_BINS,
    RowLayout,
    f64_bits,
)

# the torch-op path on a device processes a tensor in chunks of this many values: its scratch (25 bytes per
# value), the temporaries of the magnitude bits (at most 25 more) and the sort of deterministic mode (16 more,
# freed after each chunk) stay under 64 MiB
DEVICE_CHUNK = 1 << 19


class DeviceRows(_rows.Rows):
    """Dense rows on ``device`` (see the module docstring); ``chunk``: values per pass of the torch-op path."""

    def __init__(
        self,
        rows: int,
        device: torch.device,
        chunk: int | None,
        *,
        engine: str,
        layout: RowLayout,
        block_slot: np.ndarray | None = None,
    ) -> None:
        super().__init__(rows, device, engine=engine, layout=layout, block_slot=block_slot)
        self.chunk = DEVICE_CHUNK if chunk is None else chunk
        self._data = layout.empty_rows(rows, device)
        self._empty_row = layout.empty_rows(1, device)
        self._triton: triton_engine.TritonRows | None = None
        # the block what-if in Triton: both orientations of a tensor into its slot in one launch (two with
        # NVFP4), where the rows hold block statistics
        self._triton_blocks: triton_block.TritonBlocks | None = None
        if engine == "triton":
            self._triton = triton_engine.TritonRows(device, layout)
            if len(self._blocks) and triton_block.unavailable(device) is None:
                self._triton_blocks = triton_block.TritonBlocks(device, _blocks.RECIPES)
        self._key_edges = torch.arange(_N_KEYS + 1, dtype=torch.int64, device=device)
        self._pow2_idx = torch.tensor(
            [2 * (j + _F64_BIAS) + 1 for j in layout.underflow_exps], dtype=torch.int64, device=device
        )
        self._fp8_max_bits = torch.tensor(
            [f64_bits(f.max) for f in layout.fp8], dtype=torch.int64, device=device
        )
        self._fp8_uf_exp = torch.tensor(layout.fp8_underflow_exps, dtype=torch.int64, device=device)
        self._fp8_k_cap = torch.tensor(layout.fp8_exponent_caps, dtype=torch.int64, device=device)
        # the last tensor read alone into an empty row: (the tensor, its version then, the row)
        self._last_read: tuple[weakref.ref[torch.Tensor], int, int] | None = None
        self.reset()

    @property
    def buffer_bytes(self) -> int:
        return self._data.numel() * self._data.element_size() + super().buffer_bytes

    @property
    def scratch_bytes(self) -> int:
        held = super().scratch_bytes
        if self._triton is not None:
            held += self._triton.nbytes
        if self._triton_blocks is not None:
            held += self._triton_blocks.nbytes
        return held

    def _add_blocks(self, x: torch.Tensor, slot: int) -> None:
        if self._triton_blocks is None or not self._triton_blocks.add(x.detach(), self._blocks[slot]):
            super()._add_blocks(x, slot)

    def dense(self) -> torch.Tensor:
        """The rows themselves (after this device's pending work, in stream order)."""
        self._order_stream()
        return self._data

    def _counts_copy(self) -> torch.Tensor:
        return self._data.clone()

    def _restore_counts(self, held: torch.Tensor) -> None:
        self._data.copy_(held)

    def reset_counts(self, sl: slice) -> None:
        self._order_stream()
        target = self._data[sl]
        if target.shape[0] == 1:  # one row (an assign into a row written before): one copy, not two kernels
            target.copy_(self._empty_row)
            return
        target.zero_()
        target[:, self.layout.absmin_bits] = _NO_MIN_BITS

    def add(self, x: torch.Tensor, row: int, assign: bool = False) -> None:
        """Add the statistics of ``x`` (floating, on this device) into ``row`` (cleared first with ``assign``):
        one Triton launch, or torch ops in chunks. Never syncs. No ``torch.no_grad()`` around the launch (it
        costs 1.7 us a call): the launch reads ``x``'s memory, which autograd never sees; the torch ops read it
        detached.

        The tensor just read, unchanged since (the same object at the same version, or a view of the same
        memory: ``rows.same_values``), into an empty row, and again into another empty row (a module that
        returns its input: ``nn.Dropout(p=0)``, ``nn.Identity``, or reshapes it, ``nn.Flatten``, after the layer
        that made it; their gradients, which are the same tensor or its view): the second row is a copy of
        the first, one row's copy on the device instead of a second read of the tensor (what the C kernel's
        rows do on the CPU, ``rows_host``). At ``dropout=0.0`` each of nanoGPT's blocks gives 4 tensors so (its
        two dropouts' outputs and their gradients): 2 layers take 44 launches a sampled step instead of 52."""
        if _rows.NO_READ:
            return
        last, self._last_read = self._last_read, None
        empty = assign or not self._written[row]
        if assign and self._written[row]:
            self.reset(slice(row, row + 1))
        self._written[row] = True
        if x.numel() == 0:
            return
        self._order_stream()
        try:
            version: int | None = x._version
        except RuntimeError:  # an inference tensor has no version counter
            version = None
        if (
            last is not None
            and empty
            and version is not None
            and last[1] == version
            and last[2] != row
            and _rows.same_values(last[0](), x)
        ):
            self._data[row].copy_(self._data[last[2]])  # (the first row held that read alone)
            self._last_read = last
            return
        if empty and version is not None:
            self._last_read = (weakref.ref(x), version, row)
        # the launch reads ``x``'s memory as it is: no detached tensor made for it (the torch ops' path's)
        # (the stream ordered on is the launch's: read once)
        if self._triton is not None and self._triton.add(x, self._data, row, self._last_raw_stream):
            return
        self._by_torch_ops(x, row)

    def reset(self, rows: slice | None = None) -> None:
        self._last_read = None
        super().reset(rows)

    def restore(self, held: tuple[Any, ...]) -> None:
        self._last_read = None
        super().restore(held)

    def _by_torch_ops(self, x: torch.Tensor, row: int) -> None:
        """``x`` into ``row`` by torch ops, in chunks (a dtype or layout the Triton kernel does not read)."""
        flat = x.detach().reshape(-1)
        self._accumulate_device(flat, row, self.chunk if self.chunk and self.chunk > 0 else flat.numel())

    def add_many(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], assign: bool = False) -> None:
        """:meth:`add` of each tensor into its row; with the Triton engine the contiguous aligned tensors of a
        dtype go up to 16 a launch (``TritonRows.add_many``: a sampled step's 148 gpt2-small parameters in
        about 10 launches instead of 148). Never syncs."""
        if (
            self._triton is None
            or _rows.NO_READ
            or len(tensors) < 2
            or (assign and len(set(rows)) < len(rows))
        ):
            super().add_many(tensors, rows, assign)  # (a row given twice with ``assign``: the last one wins)
            return
        self._last_read = None
        live, at = [], []
        for t, row in zip(tensors, rows, strict=True):
            if assign and self._written[row]:
                self.reset(slice(row, row + 1))
            self._written[row] = True
            if t.numel():
                live.append(t)
                at.append(row)
        self._order_stream()
        for i in self._triton.add_many(live, self._data, at, self._last_raw_stream):
            self._by_torch_ops(live[i], at[i])

    @torch.no_grad()
    def _accumulate_device(self, flat: torch.Tensor, row: int, chunk: int) -> None:
        """Torch ops in chunks of at most ``chunk`` values: bounded scratch, no host sync."""
        assert self._data is not None
        lay = self.layout
        nw = lay.n_whatif
        r = self._data[row]
        kh = self._keys_hist
        kh.zero_()
        call_max = self._small[nw : nw + 1]
        call_max.zero_()
        n = flat.numel()
        deterministic = torch.are_deterministic_algorithms_enabled()
        for start in range(0, n, chunk):
            a, bits, key = self._keys_of(flat[start : start + chunk])
            if deterministic:
                # index_add_ would sort every value with its index; counting the sorted keys by binary
                # search is deterministic, sync-free and bounded by the chunk
                ordered = torch.sort(key).values
                pos = torch.searchsorted(ordered, self._key_edges)
                kh += pos[1:] - pos[:-1]
            else:
                # bincount asks the host for max(key) on CUDA: a fixed-size index_add_ does not
                kh.index_add_(0, key, self._ones.expand(key.numel()))
            self._extremes_device(a, bits, r, call_max)
        r[lay.numel] += n
        kh2 = kh.view(_F64_EXP_ALL + 1, 2)
        r[lay.zeros] += kh2[0, 1]
        r[lay.nan] += kh2[_F64_EXP_ALL, 0]
        r[lay.inf] += kh2[_F64_EXP_ALL, 1]
        r[lay.pow2_at : lay.pow2_at + nw] += kh[self._pow2_idx]
        all_in_bin = kh2[:, 0] + kh2[:, 1]
        hist = r[lay.hist : lay.hist + N_BINS]
        hist += all_in_bin[_LO : _HI + 1]
        hist[0] += all_in_bin[1:_LO].sum() + kh2[0, 0]
        hist[-1] += all_in_bin[_HI + 1 : _F64_EXP_ALL].sum()
        if not lay.n_fp8:
            return
        # fp8 current scaling of this call, on the device: k = floor(log2(fmax / amax)) from the exponent
        # fields and mantissas of fmax and amax; x*2^k underflows iff |x| <= 2^(j - k), i.e. the keys below
        # exponent field f = j - k + bias, and the exact powers of two at f (none when f <= 0; every finite
        # nonzero value when f >= 2047)
        amax = call_max[0]
        e_a = amax >> 52
        e_f = self._fp8_max_bits >> 52
        k = e_f - e_a - ((amax & _F64_MANT_MASK) > (self._fp8_max_bits & _F64_MANT_MASK)).long()
        k = torch.minimum(k, self._fp8_k_cap)  # an amax under torchao's floor: its scale stops growing
        f = self._fp8_uf_exp - k + _F64_BIAS
        fc = f.clamp(1, _F64_EXP_ALL)
        cum = kh.cumsum(0)
        below = cum[2 * fc - 1] - kh[1]
        on = kh[(2 * fc + 1).clamp(max=_N_KEYS - 1)] * (f < _F64_EXP_ALL).long()
        cs = (below + on) * (f > 0).long()
        r[lay.underflow_cs : lay.underflow_cs + lay.n_fp8] += cs * (amax > 0).long()

    def _extremes_device(
        self, a: torch.Tensor, bits: torch.Tensor, r: torch.Tensor, call_max: torch.Tensor
    ) -> None:
        """Overflow counts, smallest nonzero and largest finite |x| with tensor ops only (no sync)."""
        lay = self.layout
        m = a.numel()
        mask = self._bool[:m]
        tmp = self._i64[:m]
        ov = self._small[: lay.n_whatif]
        for i, (threshold, inclusive) in enumerate(
            zip(lay.overflow_thresholds, lay.overflow_inclusive, strict=True)
        ):
            if inclusive:
                torch.ge(a, threshold, out=mask)
            else:
                torch.gt(a, threshold, out=mask)
            ov[i] = torch.count_nonzero(mask)
        r[lay.overflow : lay.overflow + lay.n_whatif] += ov
        # nan -> 0 and inf -> 0 in place (a is scratch): the extremes are of finite values only
        a.nan_to_num_(nan=0.0, posinf=0.0)
        # smallest nonzero: (bits - 1) & MAX maps 0 to the largest int64 (the "none yet" sentinel). The row
        # keeps bits - 1, so the sentinel never overflows.
        torch.sub(bits, 1, out=tmp)
        tmp.bitwise_and_(_NO_MIN_BITS)
        r[lay.absmin_bits] = torch.minimum(r[lay.absmin_bits], tmp.amin())
        # largest finite: the max of the bit patterns
        mx = bits.amax()
        r[lay.absmax_bits] = torch.maximum(r[lay.absmax_bits], mx)
        torch.maximum(call_max, mx.reshape(1), out=call_max)
