"""The CPU's rows: counts as a numpy array, exponent histograms in a window of bins that grows to what the
data uses (so the buffer stays a small fraction of the model's size), filled by the C kernel (engine "c",
``stats.kernel``) or torch ops (engine "torch").

``HostRows.add`` is the hot path of a sampled step on the CPU: a few attribute reads and one call into the
kernel, which reads the tensor and merges its statistics into the row (``pp_add``); ``add_many`` reads a list
of tensors (the step's parameters) in one call. A tensor added again right away, unchanged (a module returning
its submodule's output, or a view of it, and that output's gradient: ``rows.same_values``) is merged from the
kernel's last call instead of read again.
"""

from __future__ import annotations

import ctypes
import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precprof import formats
from precprof.stats import blocks as _blocks
from precprof.stats import kernel as _cpu_kernel
from precprof.stats import rows as _rows
from precprof.stats.engine import _kernel
from precprof.stats.layout import (
    _F64_BIAS,
    _F64_EXP_ALL,
    _HI,
    _KERNEL_DTYPES,
    _LO,
    _N_KEYS,
    _NO_MIN_BITS,
    DEFAULT_CHUNK,
    N_BINS,
    RowLayout,
    f64_bits,
    f64_value,
)

# pp_add's context (kernel.c CTX_*): config, call row, merge rule, threads, counts, counts width, window, wlo, w,
# then pp_add_at's arguments (data, n, stride, dtype, row, flags), then the first and last bin used since the reset
_CTX_THREADS, _CTX_WINDOW, _CTX_WLO, _CTX_W, _CTX_ARGS, _CTX_USED = 3, 6, 7, 8, 9, 15
# pp_block_at's arguments: data, rows, last, dtype, orientations (both, added into out), recipes, config,
# threads, out
_BLOCK_ARGS = 9


def _count_le_pow2_keys(keys2: np.ndarray, j: int) -> int:
    """Finite nonzero values with |v| <= 2^j, from a [2048, 2] key histogram (exact)."""
    f = j + _F64_BIAS
    if f <= 0:
        return 0
    if f >= _F64_EXP_ALL:
        return int(keys2[:_F64_EXP_ALL].sum() - keys2[0, 1])
    return int(keys2[:f].sum() - keys2[0, 1] + keys2[f, 1])


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def _many_key(tensors: Sequence[torch.Tensor], rows: Sequence[int]) -> tuple[Any, ...] | None:
    """What ``add_many`` reads, without reading it: the rows, and per tensor its object, data pointer, size,
    dtype and contiguity (None for a wrapper subclass)."""
    if not set(map(type, tensors)) <= _PLAIN:
        return None
    return (  # C-level maps: a sampled step's parameters are hundreds of tensors
        tuple(rows),
        tuple(map(id, tensors)),
        tuple(map(torch.Tensor.data_ptr, tensors)),
        tuple(map(torch.Tensor.numel, tensors)),
        tuple(map(_dtype_of, tensors)),
        tuple(map(torch.Tensor.is_contiguous, tensors)),
    )


_dtype_of = operator.attrgetter("dtype")
_INF_BITS = f64_bits(math.inf)


def _hist_of_keys(keys2: np.ndarray) -> np.ndarray:
    """The N_BINS exponent histogram of a [2048, 2] key histogram (fp64-only exponents fold into the ends)."""
    all_in_bin = keys2[:, 0] + keys2[:, 1]
    hist = all_in_bin[_LO : _HI + 1].copy()
    hist[0] += all_in_bin[1:_LO].sum() + keys2[0, 0]
    hist[-1] += all_in_bin[_HI + 1 : _F64_EXP_ALL].sum()
    return hist


class HostRows(_rows.Rows):
    """The rows of the CPU (see the module docstring); ``chunk``: values per pass of the torch-op path."""

    on_cpu = True

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
        self.chunk = DEFAULT_CHUNK if chunk is None else chunk
        self._counts = np.zeros((rows, layout.counts_width), dtype=np.int64)
        self._hist = np.zeros((rows, 0), dtype=np.int64)
        self._wlo = 0  # bin index (0..N_BINS) of the window's first column
        # the C kernel's last call row, and which tensor (object and version) it describes
        self._call = np.zeros(layout.call_len, dtype=np.int64)
        self._cfg = layout.c_config()
        self._ops = layout.merge_ops
        self._lib: Any = _kernel() if engine == "c" else None  # built or loaded now (attach), not in a hook
        self._ctx = np.array(
            [
                self._cfg.ctypes.data,
                self._call.ctypes.data,
                self._ops.ctypes.data,
                1,
                self._counts.ctypes.data,
                layout.counts_width,
                self._hist.ctypes.data,
                0,
                0,
                *[0] * (_CTX_USED - _CTX_ARGS),
                N_BINS,  # no bin used yet
                -1,
            ],
            dtype=np.int64,
        )
        self._ctx_ptr = self._ctx.ctypes.data
        # pp_add_at's arguments, as a ctypes view of the context (its item writes cost a third of numpy's)
        self._args = (ctypes.c_int64 * (_CTX_USED - _CTX_ARGS)).from_address(self._ctx_ptr + 8 * _CTX_ARGS)
        self._add_at: Any = self._lib.pp_add_at if self._lib is not None else None
        self._last: tuple[weakref.ref[torch.Tensor], int] | None = None
        # add_many's last tensors (``_many_key``) and the arrays the kernel read them from, with their addresses,
        # per ``assign`` (the step's parameters, and their gradients)
        self._many: dict[bool, tuple[tuple[Any, ...] | None, tuple[list[np.ndarray], list[int]]]] = {}
        # pp_block_at's arguments (``accumulate_blocks``): the fixed ones now, the tensor's per call
        self._block_args = (ctypes.c_int64 * _BLOCK_ARGS)()
        self._block_at: Any = None
        if self._lib is not None:
            self._block_at = self._lib.pp_block_at
            self._block_args[4], self._block_args[5] = 3 | 4, _blocks.N_RECIPES
            self._block_args[6] = _cpu_kernel._recipe_config(_blocks.RECIPES)[1]
        self._block_args_ptr = ctypes.addressof(self._block_args)
        self._slot_bytes = self._blocks[0].numel() * 8 if len(self._blocks) else 0
        # accumulate_blocks_many's last tensors (``_many_key``) and the arrays the kernel read them from
        self._blocks_many_key: tuple[Any, ...] | None = None
        self._blocks_many: tuple[list[np.ndarray], list[int], np.ndarray] = ([], [], np.zeros(0, np.int64))
        self.reset()

    # -- sizes
    @property
    def buffer_bytes(self) -> int:
        return int(self._counts.nbytes + self._hist.nbytes) + super().buffer_bytes

    @property
    def scratch_bytes(self) -> int:
        return super().scratch_bytes + self._call.nbytes

    def dense(self) -> torch.Tensor:
        """A fresh [rows, width] int64 tensor built from the counts and the window."""
        out = np.zeros((self.rows, self.layout.width), dtype=np.int64)
        hist = self.layout.hist
        out[:, :hist] = self._counts
        w = self._hist.shape[1]
        out[:, hist + self._wlo : hist + self._wlo + w] = self._hist
        return torch.from_numpy(out)

    def windowed(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The counts ([rows, hist]) and the histogram bins used since the rows were reset ([rows, w]), as held
        (views, not copies), and the first of those bins: :meth:`dense` without its columns of zeros, for a
        sampled step's copy, which copies what it keeps (``precprof.flush.StepRows``: the rows that took data)
        before the rows are reset."""
        lo, hi = self._used_bins()
        if lo > hi:
            return self._counts, self._hist[:, :0], self._wlo
        return self._counts, self._hist[:, lo - self._wlo : hi + 1 - self._wlo], lo

    def _used_bins(self) -> tuple[int, int]:
        """The first and last histogram bin any add used since the rows were reset (first > last: none)."""
        ctx = self._ctx
        return int(ctx[_CTX_USED]), int(ctx[_CTX_USED + 1])

    def _use_bins(self, lo: int, hi: int) -> None:
        ctx = self._ctx
        ctx[_CTX_USED], ctx[_CTX_USED + 1] = min(int(ctx[_CTX_USED]), lo), max(int(ctx[_CTX_USED + 1]), hi)

    def reset_counts(self, sl: slice) -> None:
        self._counts[sl] = 0
        self._counts[sl, self.layout.absmin_bits] = _NO_MIN_BITS
        if sl != slice(None):
            self._hist[sl] = 0
            return
        # every row: the bins any add used alone (the rest are zeros; the window spans every bin the run ever
        # used, 2 MB to clear for 900 rows of 277 bins)
        lo, hi = self._used_bins()
        if lo <= hi:
            self._hist[:, lo - self._wlo : hi + 1 - self._wlo] = 0
        self._ctx[_CTX_USED], self._ctx[_CTX_USED + 1] = N_BINS, -1

    def _counts_copy(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The counts and the histogram bins used since the reset (the window may grow after: bins, not columns)."""
        lo, hi = self._used_bins()
        used = self._hist[:, lo - self._wlo : hi + 1 - self._wlo] if lo <= hi else self._hist[:, :0]
        return self._counts.copy(), used.copy(), lo, hi

    def _restore_counts(self, held: tuple[np.ndarray, np.ndarray, int, int]) -> None:
        counts, used, lo, hi = held
        self.reset_counts(slice(None))
        self._counts[:] = counts
        if lo <= hi:
            self._hist[:, lo - self._wlo : hi + 1 - self._wlo] = used
            self._use_bins(lo, hi)
        self._last = None

    def _grow_window(self, lo: int, hi: int) -> None:
        """Make the histogram window cover bins lo..hi (inclusive), with a little room to spare."""
        w = self._hist.shape[1]
        if w and self._wlo <= lo and hi < self._wlo + w:
            return
        new_lo = max(0, min(lo - 4, self._wlo if w else lo - 4))
        new_hi = min(N_BINS - 1, max(hi + 4, self._wlo + w - 1 if w else hi + 4))
        grown = np.zeros((self.rows, new_hi - new_lo + 1), dtype=np.int64)
        if w:
            grown[:, self._wlo - new_lo : self._wlo - new_lo + w] = self._hist
        self._hist, self._wlo = grown, new_lo
        ctx = self._ctx
        ctx[_CTX_WINDOW], ctx[_CTX_WLO], ctx[_CTX_W] = grown.ctypes.data, new_lo, grown.shape[1]

    def _merge_call(self, row: int) -> None:
        """Merge the call row into ``row``, growing the window to its bins."""
        width = self.layout.width
        lo, hi = int(self._call[width]), int(self._call[width + 1])
        self._grow_window(lo, hi)
        ctx = self._ctx
        rc = self._lib.pp_merge(
            self._call.ctypes.data,
            self._counts.ctypes.data + row * self.layout.counts_width * 8,
            int(ctx[_CTX_WINDOW]) + row * int(ctx[_CTX_W]) * 8,
            int(ctx[_CTX_WLO]),
            int(ctx[_CTX_W]),
            self._cfg.ctypes.data,
            self._ops.ctypes.data,
        )
        assert rc == 0, "the window was grown to the call's bins"
        if lo >= 0:
            self._use_bins(lo, hi)

    # -- the hot path
    def add(self, x: torch.Tensor, row: int, assign: bool = False) -> None:
        """Add the statistics of ``x`` (floating, on the CPU; it may require grad: only its data is read) into
        ``row``; ``assign`` clears the row first. Never allocates on the kernel's path (but to flatten a
        tensor no single stride reads)."""
        if _rows.NO_READ:
            return
        code = _KERNEL_DTYPES.get(x.dtype)
        if code is None or not self.use_kernel or self._lib is None:
            if assign:
                self.reset(slice(row, row + 1))
            self._add_torch(x.detach(), row)
            return
        n = x.numel()
        flags = 1 if assign else 0
        if assign and self._block_slot[row] >= 0:
            self._reset_blocks(slice(row, row + 1))
        if n == 0:
            if assign:
                self.reset_counts(slice(row, row + 1))
            return
        try:
            version = x._version
        except RuntimeError:  # an inference tensor has no version counter: always read
            version = None
        last = self._last
        args = self._args
        args[1], args[3], args[4] = n, code, row
        if (
            last is not None
            and version is not None
            and last[1] == version
            and _rows.same_values(last[0](), x)
        ):
            args[0], args[2], args[5] = 0, 1, flags | 2  # merged, not read again
            rc = self._add_at(self._ctx_ptr)
        else:
            if n >= 65536:  # the kernel splits such a tensor over threads
                self._ctx[_CTX_THREADS] = self._threads()
            if x.is_contiguous():
                args[0], args[2] = x.data_ptr(), 1
            else:
                flat = x.detach().reshape(-1)  # a view where one stride reads it, else a copy
                args[0], args[2] = flat.data_ptr(), flat.stride(0)
            args[5] = flags
            self._last = None
            rc = self._add_at(self._ctx_ptr)
            if version is not None:
                self._last = (weakref.ref(x), version)
        if rc:
            self._kernel_failed(rc, row)

    def accumulate_blocks(self, x: torch.Tensor, row: int) -> None:
        """:meth:`Rows.accumulate_blocks`, by the C kernel adding into the row's slot itself, its arguments in one
        array (``pp_block_at``): the what-if of a small tensor cost about 10 us of Python around 10 us of
        kernel through the general path (``stats.blocks.add_tensor_block_stats``), which the other engines and
        dtypes take."""
        code = _cpu_kernel._BLOCK_DTYPES.get(x.dtype)
        if code is None or self._block_at is None or not self.use_kernel or x.dim() == 0:
            super().accumulate_blocks(x, row)
            return
        slot, version = self._blocks_due(x, row)
        if slot < 0:
            return
        n = x.numel()
        if n:
            flat = x if x.is_contiguous() else x.detach().contiguous()
            args = self._block_args
            last = x.shape[-1]
            if not args[7]:
                args[7] = self._threads()
            args[0], args[1], args[2], args[3] = flat.data_ptr(), n // last, last, code
            args[8] = self._blocks.data_ptr() + slot * self._slot_bytes
            if self._block_at(self._block_args_ptr):
                raise MemoryError("precprof: the C block kernel could not allocate its scratch")
        self._blocks_done(x, row, version)

    def accumulate_blocks_many(self, tensors: Sequence[torch.Tensor], rows: Sequence[int]) -> None:
        """:meth:`accumulate_blocks` of each tensor into its row, those the kernel reads in place in one call
        (``pp_block_many``; the step's weights, whose arrays are kept while the same tensors sit on the same
        memory, as ``add_many``'s). Each tensor is added once per call, whatever was added before: a weight is
        read once a step."""
        if self._block_at is None or not self.use_kernel:
            super().accumulate_blocks_many(tensors, rows)
            return
        key = _many_key(tensors, rows)
        if key is None or key != self._blocks_many_key:
            ptrs, lines, lasts, codes, outs, at = [], [], [], [], [], []
            for t, r in zip(tensors, rows, strict=True):
                code = _cpu_kernel._BLOCK_DTYPES.get(t.dtype)
                slot = int(self._block_slot[r])
                if slot < 0 or not t.numel():
                    continue
                if code is None or t.dim() == 0 or not t.is_contiguous():
                    self.accumulate_blocks(t, r)
                    continue
                last = t.shape[-1]
                ptrs.append(t.data_ptr())
                lines.append(t.numel() // last)
                lasts.append(last)
                codes.append(code)
                outs.append(self._blocks.data_ptr() + slot * self._slot_bytes)
                at.append(r)
            arrays = [np.asarray(v, dtype=np.int64) for v in (ptrs, lines, lasts, codes, outs)]
            self._blocks_many = (arrays, [a.ctypes.data for a in arrays], np.asarray(at, dtype=np.int64))
            # kept where every tensor was read in place: the arrays then say all there is to read
            self._blocks_many_key = key if len(at) == len(tensors) else None
        _, addresses, read = self._blocks_many
        if not len(read):
            return
        self._written[read] = True
        args = self._block_args
        if not args[7]:
            args[7] = self._threads()
        rc = int(self._lib.pp_block_many(self._block_args_ptr, len(read), *addresses))
        if rc:
            raise MemoryError("precprof: the C block kernel could not allocate its scratch")

    def add_many(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], assign: bool = False) -> None:
        """:meth:`add` of each tensor into its row, the kernel's dtypes in one call (the others one by one);
        ``assign`` clears each row first (a step's weight gradients: the last accumulation wins)."""
        if _rows.NO_READ or not tensors:
            return
        if not self.use_kernel or self._lib is None:
            for t, r in zip(tensors, rows, strict=True):
                self.add(t, r, assign)
            return
        if assign:
            for r in rows:
                if self._block_slot[r] >= 0:
                    self._reset_blocks(slice(r, r + 1))
        # the same tensors as last time (the step's parameters, step after step): the same arrays (one set per
        # ``assign``: the parameters and their gradients alternate)
        key = _many_key(tensors, rows)
        held_key, held = self._many.get(assign, (None, None))
        if key is not None and key == held_key and held is not None:
            self._add_many_arrays(held, assign)
            return
        keep = []  # flattened copies stay alive until the kernel has read them
        if key is not None and all(key[5]) and 0 not in key[3] and set(key[4]) <= _KERNEL_DTYPES.keys():
            # plain contiguous tensors of the kernel's dtypes, all with values (the usual case): the columns are
            # the key's own
            codes = [_KERNEL_DTYPES[d] for d in key[4]]
            columns: tuple[Sequence[int], ...] = (key[2], key[3], [1] * len(codes), codes, key[0])
        else:
            ptrs, ns, strides, codes, at = [], [], [], [], []
            for t, r in zip(tensors, rows, strict=True):
                code = _KERNEL_DTYPES.get(t.dtype)
                n = t.numel()
                if code is None or n == 0:
                    self.add(t, r, assign)  # (an empty tensor: an assigning add clears its row)
                    continue
                if not t.is_contiguous():
                    t = t.detach().reshape(-1)
                    keep.append(t)
                ptrs.append(t.data_ptr())
                ns.append(n)
                strides.append(t.stride(0) if t.dim() == 1 and not t.is_contiguous() else 1)
                codes.append(code)
                at.append(r)
            columns = (ptrs, ns, strides, codes, at)
        if not columns[0]:
            return
        arrays = [np.asarray(v, dtype=np.int64) for v in columns]
        made = (arrays, [a.ctypes.data for a in arrays])
        # kept for the next call only where every tensor was read in place (no flattened copy, every dtype the
        # kernel's: the arrays then say all there is to read)
        keyed = key is not None and not keep and len(columns[0]) == len(tensors)
        self._many[assign] = (key if keyed else None, made)
        self._add_many_arrays(made, assign)
        del keep

    def _add_many_arrays(self, held: tuple[list[np.ndarray], list[int]], assign: bool = False) -> None:
        arrays, addresses = held
        self._ctx[_CTX_THREADS] = self._threads()
        k, start = len(arrays[0]), 0
        self._last = None
        while start < k:
            done = int(self._lib.pp_add_many(self._ctx_ptr, k, *addresses, start, 1 if assign else 0))
            if done >= k:
                break
            if done < 0:
                self._kernel_failed(-1, int(arrays[4][-1 - done]))
            self._merge_call(int(arrays[4][done]))
            start = done + 1

    def _kernel_failed(self, rc: int, row: int) -> None:
        if rc == 1:  # the call's bins fall outside the window
            self._merge_call(row)
            return
        self._last = None
        if rc == -2:
            raise ValueError("precprof: the C kernel cannot hold this row layout")
        raise MemoryError("precprof: the CPU statistics kernel could not allocate its scratch")

    # -- the torch-op path
    def _add_torch(self, x: torch.Tensor, row: int) -> None:
        """Torch ops in chunks of ``chunk`` values: the reference the C kernel is tested against."""
        self._last = None
        lay = self.layout
        counts = self._counts[row]
        flat = x.reshape(-1)
        n = flat.numel()
        if n == 0:
            return
        chunk = self.chunk if self.chunk and self.chunk > 0 else n
        keys = np.zeros(_N_KEYS, dtype=np.int64)
        call_max = 0  # fp64 bits
        for start in range(0, n, chunk):
            a, bits, key = self._keys_of(flat[start : start + chunk])
            chunk_keys = torch.bincount(key, minlength=_N_KEYS).numpy()
            keys += chunk_keys
            call_max = max(call_max, self._extremes(a, bits, counts, chunk_keys))
        keys2 = keys.reshape(_F64_EXP_ALL + 1, 2)
        counts[lay.numel] += n
        counts[lay.zeros] += keys2[0, 1]
        counts[lay.nan] += keys2[_F64_EXP_ALL, 0]
        counts[lay.inf] += keys2[_F64_EXP_ALL, 1]
        for i, j in enumerate(lay.underflow_exps):
            counts[lay.pow2_at + i] += keys2[j + _F64_BIAS, 1]
        if call_max > 0:
            for i, fmt in enumerate(lay.fp8):
                k = formats.current_scaling_exponent(fmt, f64_value(call_max))
                counts[lay.underflow_cs + i] += _count_le_pow2_keys(
                    keys2, int(math.log2(fmt.underflow_max)) - k
                )
        hist = _hist_of_keys(keys2)
        nz = np.flatnonzero(hist)
        if len(nz):
            lo, hi = int(nz[0]), int(nz[-1])
            self._grow_window(lo, hi)
            self._hist[row, lo - self._wlo : hi + 1 - self._wlo] += hist[lo : hi + 1]
            self._use_bins(lo, hi)

    def _extremes(self, a: torch.Tensor, bits: torch.Tensor, counts: np.ndarray, keys: np.ndarray) -> int:
        """Overflow counts and extremes of one chunk, skipping the passes its key histogram proves needless
        (no value at or above the layout's overflow shortcut: no overflow compare; no zero: a plain min).
        ``a`` is |x| as fp64, ``bits`` the same memory as int64. The extremes are reduced over the bits (a
        non-negative double is ordered as its bits): a float compare or reduction reads an fp64 subnormal as 0
        under the thread's denormals-are-zero mode (``torch.set_flush_denormal(True)``). Returns the chunk's
        largest finite |x| as fp64 bits (0: none)."""
        lay = self.layout
        n_nonfinite = int(keys[2 * _F64_EXP_ALL] + keys[2 * _F64_EXP_ALL + 1])
        # finite values >= 2^shortcut_exp: keys from that exponent field up
        n_big = int(keys[2 * (_F64_BIAS + lay.overflow_shortcut_exp) : 2 * _F64_EXP_ALL].sum())
        if n_big or n_nonfinite:
            mask = self._bool[: a.numel()]
            torch.ge(a, lay.overflow_shortcut, out=mask)  # no threshold is below the shortcut; inf included
            big = a[mask]
            for i, (t, inclusive) in enumerate(
                zip(lay.overflow_thresholds, lay.overflow_inclusive, strict=True)
            ):
                counts[lay.overflow + i] += int((big >= t).sum()) if inclusive else int((big > t).sum())
        n_zero = int(keys[1])
        if n_nonfinite:
            bits.masked_fill_(bits >= _INF_BITS, 0)
        # bits holds those of |x| with nan/inf now 0: integer reductions (vectorised) give the exact extremes
        mx = int(bits.amax())
        if n_zero == 0 and not n_nonfinite:
            counts[lay.absmin_bits] = min(int(counts[lay.absmin_bits]), int(bits.amin()) - 1)
        elif n_zero + n_nonfinite < bits.numel():
            bits.masked_fill_(bits == 0, _INF_BITS)
            counts[lay.absmin_bits] = min(int(counts[lay.absmin_bits]), int(bits.amin()) - 1)
        counts[lay.absmax_bits] = max(int(counts[lay.absmax_bits]), mx)
        return mx
