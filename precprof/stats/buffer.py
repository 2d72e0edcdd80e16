"""On-device statistics of one tensor: exponent histogram and exact cast counts, without host syncs.

One call of :meth:`StatsBuffer.accumulate` reads a tensor once per chunk and adds into one row of a
preallocated int64 device buffer:

- an exponent histogram, bin = floor(log2|x|), over fp32's whole exponent range (-149..127; subnormals in
  their true bins: the tensor is widened to fp64, where every fp32/bf16/fp16/fp8 value is normal, so the fp64
  exponent field *is* floor(log2|x|)); fp64 tensors with exponents outside that range fold into the end bins;
- beside each bin, how many values in it are exact powers of two (mantissa 0). With those, the number of
  values ``<= 2^j`` is exact for every j, so every underflow count at every power-of-two scale — and fp8
  per-tensor current scaling — is an exact host-side sum, also for values sitting exactly on a rounding tie;
- zeros, nan and inf (from the same key: fp64 exponent field 0 is only an exact zero; 0x7ff with mantissa 0 is
  inf, with mantissa != 0 nan);
- the counts of finite values that overflow fp16, bf16, fp8_e4m3 and fp8_e5m2 (one compare each: these
  thresholds are not powers of two);
- the largest finite |x| and the smallest nonzero finite |x| (as fp64 bit patterns, which order like the
  values for non-negative numbers).

Everything is computed with tensor ops into device tensors: nothing here calls ``.item()``, ``bool(tensor)``,
``nonzero`` or ``bincount`` on CUDA (which asks the host for the max), so a hook that calls ``accumulate``
never synchronises. :meth:`StatsBuffer.to_host` is the one copy per sampled step.

Counts are of the values as given: for a gradient seen under a loss scale s these are the scaled values
x*s, which is exactly what "x underflows at scale s" means (docs/design.md). :func:`decode` turns a row into the
unscaled histogram (a shift of bins by log2 s, exact for power-of-two scales) and the per-format counts.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precprof import _compat, formats
from precprof.stats import blocks as _blocks
from precprof.stats import magnitude, triton_block, triton_engine
from precprof.stats.engine import _default_kernel_threads, _kernel, resolve_engine
from precprof.stats.layout import (
    _F64_BIAS,
    _F64_EXP_ALL,
    _F64_MANT_MASK,
    _HI,
    _KERNEL_DTYPES,
    _LO,
    _N_KEYS,
    _NO_MIN_BITS,
    DEFAULT_CHUNK,
    LAYOUT,
    N_BINS,
    RowLayout,
    f64_bits,
    merge_rows,
)
from precprof.stats.timing import WorkTimer

# the torch-op path on a device processes a tensor in chunks of this many values: its scratch (25 bytes per
# value), the temporaries of the magnitude bits (at most 25 more) and the sort of deterministic mode (16 more,
# freed after each chunk) stay under 64 MiB
DEVICE_CHUNK = 1 << 19


def _count_le_pow2_keys(keys2: np.ndarray, j: int) -> int:
    """Finite nonzero values with |v| <= 2^j, from a [2048, 2] key histogram (exact)."""
    f = j + _F64_BIAS
    if f <= 0:
        return 0
    if f >= _F64_EXP_ALL:
        return int(keys2[:_F64_EXP_ALL].sum() - keys2[0, 1])
    return int(keys2[:f].sum() - keys2[0, 1] + keys2[f, 1])


def _hist_of_keys(keys2: np.ndarray) -> np.ndarray:
    """The N_BINS exponent histogram of a [2048, 2] key histogram (fp64-only exponents fold into the ends)."""
    all_in_bin = keys2[:, 0] + keys2[:, 1]
    hist = all_in_bin[_LO : _HI + 1].copy()
    hist[0] += all_in_bin[1:_LO].sum() + keys2[0, 0]
    hist[-1] += all_in_bin[_HI + 1 : _F64_EXP_ALL].sum()
    return hist


class DeviceRows:
    """The rows of one device, and the engine that fills them.

    On the CPU (``host_rows``) the counts are a numpy array and the histograms live in a window of exponents
    that grows to what the data uses, so the buffer stays a small fraction of the model's size; the C kernel
    (engine "c") or torch ops (engine "torch") fill them. Elsewhere the rows are one dense int64 tensor on the
    device, filled by the Triton kernel (engine "triton") or torch ops in bounded chunks (engine "torch"),
    without ever synchronising. ``dense()`` gives the same [rows, width] int64 tensor in both cases.
    """

    def __init__(
        self,
        rows: int,
        device: torch.device,
        chunk: int | None,
        *,
        host_rows: bool | None,
        engine: str,
        layout: RowLayout,
        block_slot: np.ndarray | None = None,
    ) -> None:
        self.device = device
        self.rows = rows
        self.layout = lay = layout
        # row -> its slot in the block accumulator (-1: the row never holds block statistics)
        self._block_slot = np.arange(rows, dtype=np.int64) if block_slot is None else block_slot
        n_slots = int(self._block_slot.max()) + 1 if len(self._block_slot) else 0
        self.engine = engine
        # host_rows=False runs the device code path on the CPU too: tests check both paths agree
        self.on_cpu = (device.type == "cpu" and engine != "triton") if host_rows is None else host_rows
        self.use_kernel = engine == "c"  # tests switch it off to compare the C kernel and torch ops
        # threads per kernel call (0: torch.get_num_threads()); decided on first use
        self.kernel_threads: int | None = None
        self._triton: triton_engine.TritonRows | None = None
        self._last_stream: Any = None
        nw = lay.n_whatif
        if self.on_cpu:
            self._counts = np.zeros((rows, lay.counts_width), dtype=np.int64)
            self._hist = np.zeros((rows, 0), dtype=np.int64)
            self._wlo = 0  # bin index (0..N_BINS) of the window's first column
            self._data: torch.Tensor | None = None
            # the C kernel's last call row, and which tensor (object and version) it describes: a tensor
            # accumulated again right away (a module returning its submodule's output, and that output's
            # gradient) is merged from it instead of read again
            self._call = np.zeros(lay.call_len, dtype=np.int64)
            self._cfg = lay.c_config()
            self._ops = lay.merge_ops
            self._call_ptr = self._call.ctypes.data
            self._cfg_ptr = self._cfg.ctypes.data
            self._ops_ptr = self._ops.ctypes.data
            self._counts_ptr = self._counts.ctypes.data
            self._hist_ptr = self._hist.ctypes.data
            self._last: tuple[weakref.ref[torch.Tensor], int] | None = None
            if engine == "c":
                _kernel()  # built (or loaded from the cache) here, when the Profiler attaches, not in a hook
        else:
            self._data = lay.empty_rows(rows, device)
            if engine == "triton":
                self._triton = triton_engine.TritonRows(device, lay)
        if chunk is None:
            chunk = DEFAULT_CHUNK if self.on_cpu else DEVICE_CHUNK
        self.chunk = chunk
        self._scratch_len = 0
        self._f64 = torch.empty(0, dtype=torch.float64, device=device)
        self._i64 = torch.empty(0, dtype=torch.int64, device=device)
        self._key = torch.empty(0, dtype=torch.int64, device=device)
        self._bool = torch.empty(0, dtype=torch.bool, device=device)
        self._ones = torch.ones(1, dtype=torch.int64, device=device)
        # block-format what-if per block slot (stats.blocks): float64 [slots, orientation, recipe, stat] on the
        # device; only the rows that can hold block statistics have a slot
        self._blocks = torch.zeros(
            (n_slots, _blocks.N_ORIENTATIONS, _blocks.N_RECIPES, _blocks.N_STATS),
            dtype=torch.float64,
            device=device,
        )
        # the tensors added to the block accumulator since the last reset: (id, row) -> (tensor, version)
        self._blocks_added: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], int]] = {}
        self._keys_hist = torch.zeros(_N_KEYS, dtype=torch.int64, device=device)
        self._small = torch.empty(nw + 1, dtype=torch.int64, device=device)
        if not self.on_cpu:
            self._key_edges = torch.arange(_N_KEYS + 1, dtype=torch.int64, device=device)
            self._pow2_idx = torch.tensor(
                [2 * (j + _F64_BIAS) + 1 for j in lay.underflow_exps], dtype=torch.int64, device=device
            )
            self._fp8_max_bits = torch.tensor(
                [f64_bits(f.max) for f in lay.fp8], dtype=torch.int64, device=device
            )
            self._fp8_uf_exp = torch.tensor(lay.fp8_underflow_exps, dtype=torch.int64, device=device)
        self.reset()

    # -- sizes
    @property
    def buffer_bytes(self) -> int:
        """Bytes held persistently by the rows."""
        blocks = self._blocks.numel() * self._blocks.element_size()
        if self.on_cpu:
            return int(self._counts.nbytes + self._hist.nbytes) + blocks
        assert self._data is not None
        return self._data.numel() * self._data.element_size() + blocks

    @property
    def scratch_bytes(self) -> int:
        """Bytes of reusable scratch currently held: the torch-op path's chunk buffers (grown to the largest
        chunk seen), the Triton engine's fixed scratch, the C kernel's call row."""
        held = sum(
            t.numel() * t.element_size()
            for t in (self._f64, self._i64, self._key, self._bool, self._keys_hist, self._small)
        )
        if self._triton is not None:
            held += self._triton.nbytes
        return held + (self._call.nbytes if self.on_cpu else 0)

    def dense(self) -> torch.Tensor:
        """Dense rows; on a device the buffer itself, on the CPU a fresh tensor built from counts and window."""
        if not self.on_cpu:
            assert self._data is not None
            self._order_stream()
            return self._data
        out = np.zeros((self.rows, self.layout.width), dtype=np.int64)
        hist = self.layout.hist
        out[:, :hist] = self._counts
        w = self._hist.shape[1]
        out[:, hist + self._wlo : hist + self._wlo + w] = self._hist
        return torch.from_numpy(out)

    def reset(self, rows: slice | None = None) -> None:
        """Zero the counts of all rows (or ``rows``); device op, no sync."""
        sl = rows if rows is not None else slice(None)
        self._blocks_added.clear()
        self._reset_blocks(sl)
        if self.on_cpu:
            self._counts[sl] = 0
            self._counts[sl, self.layout.absmin_bits] = _NO_MIN_BITS
            self._hist[sl] = 0
            return
        assert self._data is not None
        self._order_stream()
        target = self._data[sl]
        target.zero_()
        target[:, self.layout.absmin_bits] = _NO_MIN_BITS

    def _order_stream(self) -> None:
        """Order this call's work after the previous call's when they come from different CUDA streams (a
        gradient hook on FSDP2's reduce-scatter stream, then one on the default stream): the rows and the
        scratch are shared. An event, not a host sync."""
        if self.device.type != "cuda":
            return
        cur = torch.cuda.current_stream(self.device)
        last = self._last_stream
        if last is not None and last != cur:
            event = torch.cuda.Event()
            event.record(last)
            cur.wait_event(event)
        self._last_stream = cur

    def _ensure_scratch(self, n: int) -> None:
        if n <= self._scratch_len:
            return
        dev = self.device
        self._f64 = torch.empty(n, dtype=torch.float64, device=dev)
        self._i64 = torch.empty(n, dtype=torch.int64, device=dev)
        self._key = torch.empty(n, dtype=torch.int64, device=dev)
        self._bool = torch.empty(n, dtype=torch.bool, device=dev)
        self._scratch_len = n

    def _grow_window(self, lo: int, hi: int) -> None:
        """Make the CPU histogram window cover bins lo..hi (inclusive), with a little room to spare."""
        w = self._hist.shape[1]
        if w and self._wlo <= lo and hi < self._wlo + w:
            return
        new_lo = max(0, min(lo - 4, self._wlo if w else lo - 4))
        new_hi = min(N_BINS - 1, max(hi + 4, self._wlo + w - 1 if w else hi + 4))
        grown = np.zeros((self.rows, new_hi - new_lo + 1), dtype=np.int64)
        if w:
            grown[:, self._wlo - new_lo : self._wlo - new_lo + w] = self._hist
        self._hist, self._wlo = grown, new_lo
        self._hist_ptr = grown.ctypes.data

    @torch.no_grad()
    def accumulate(self, x: torch.Tensor, row: int) -> None:
        """Add the statistics of ``x`` (any floating dtype, any shape, on this device) into ``row``."""
        n = x.numel()
        if n == 0:
            return
        if self.on_cpu:
            flat = x.detach().reshape(-1)
            chunk = self.chunk if self.chunk and self.chunk > 0 else n
            self._accumulate_cpu(x, flat, row, chunk)
            return
        self._order_stream()
        assert self._data is not None
        if self._triton is not None and self._triton.add(x.detach(), self._data, row):
            return
        flat = x.detach().reshape(-1)
        chunk = self.chunk if self.chunk and self.chunk > 0 else n
        self._accumulate_device(flat, row, chunk)

    def _keys_of(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """|part| as fp64 in scratch, its bit patterns, and the key of every element.

        The bit patterns come from ``part``'s own bits by integer operations (``stats.magnitude``: the sign bit
        masked off, subnormals converted as integers), so every key lies in [0, 4096) by construction, on
        any device. key = 2 * exponent_field + (mantissa == 0), with shifts and bitwise ops only (integer
        multiply, add and compare-to-bool are several times slower on CPU): subtracting 1 from the bits
        borrows into the exponent exactly when the mantissa is zero, so the lowest bit of
        (bits >> 52) ^ ((bits - 1) >> 52) is that flag. A zero gives key 1 ("exponent 0, mantissa 0"); nan
        4094, inf 4095.
        """
        m = part.numel()
        self._ensure_scratch(m)
        bits = magnitude.abs_bits(part, self._f64[:m].view(torch.int64))
        a = bits.view(torch.float64)
        key = self._key[:m]
        tmp = self._i64[:m]
        torch.sub(bits, 1, out=tmp)
        tmp.bitwise_right_shift_(52)
        torch.bitwise_right_shift(bits, 52, out=key)
        tmp.bitwise_xor_(key).bitwise_and_(1)
        key.bitwise_left_shift_(1).bitwise_or_(tmp)
        return a, bits, key

    # ---------------------------------------------------------------------------------------- CPU path
    def _accumulate_cpu(self, x: torch.Tensor, flat: torch.Tensor, row: int, chunk: int) -> None:
        kernel_code = _KERNEL_DTYPES.get(flat.dtype)
        lib = _kernel() if kernel_code is not None and self.use_kernel else None
        if lib is not None and kernel_code is not None:
            self._kernel_accumulate(lib, x, flat, kernel_code, row)
            return
        self._last = None
        lay = self.layout
        counts = self._counts[row]
        n = flat.numel()
        keys = np.zeros(_N_KEYS, dtype=np.int64)
        call_max = 0.0
        for start in range(0, n, chunk):
            a, _, key = self._keys_of(flat[start : start + chunk])
            chunk_keys = torch.bincount(key, minlength=_N_KEYS).numpy()
            keys += chunk_keys
            call_max = max(call_max, self._extremes_cpu(a, counts, chunk_keys))
        keys2 = keys.reshape(_F64_EXP_ALL + 1, 2)
        counts[lay.numel] += n
        counts[lay.zeros] += keys2[0, 1]
        counts[lay.nan] += keys2[_F64_EXP_ALL, 0]
        counts[lay.inf] += keys2[_F64_EXP_ALL, 1]
        for i, j in enumerate(lay.underflow_exps):
            counts[lay.pow2_at + i] += keys2[j + _F64_BIAS, 1]
        if call_max > 0:
            for i, fmt in enumerate(lay.fp8):
                k = formats.current_scaling_exponent(fmt, call_max)
                counts[lay.underflow_cs + i] += _count_le_pow2_keys(
                    keys2, int(math.log2(fmt.underflow_max)) - k
                )
        hist = _hist_of_keys(keys2)
        nz = np.flatnonzero(hist)
        if len(nz):
            lo, hi = int(nz[0]), int(nz[-1])
            self._grow_window(lo, hi)
            self._hist[row, lo - self._wlo : hi + 1 - self._wlo] += hist[lo : hi + 1]

    def _threads(self) -> int:
        if self.kernel_threads is None:
            self.kernel_threads = _default_kernel_threads()
        return self.kernel_threads or torch.get_num_threads()

    def _kernel_accumulate(self, lib: Any, x: torch.Tensor, flat: torch.Tensor, code: int, row: int) -> None:
        """The C kernel (``precprof.stats.kernel``): one read of the tensor into the call row, then a merge
        into ``row`` with the layout's merge rule; the same numbers as the torch-op path. The same tensor
        (object and in-place version) as the previous call is merged again without reading it."""
        version = _compat.tensor_version(x)
        last = self._last
        width = self.layout.width
        if last is None or version is None or last[0]() is not x or last[1] != version:
            lib.pp_call(
                flat.data_ptr(),
                flat.numel(),
                flat.stride(0) if flat.dim() else 1,
                code,
                self._threads(),
                self._cfg_ptr,
                self._call_ptr,
            )
            if self._call[self.layout.numel] < 0:
                self._last = None
                raise MemoryError("precprof: the CPU statistics kernel could not allocate its scratch")
            self._last = (weakref.ref(x), version) if version is not None else None
        counts_ptr = self._counts_ptr + row * self.layout.counts_width * 8
        while lib.pp_merge(
            self._call_ptr,
            counts_ptr,
            self._hist_ptr + row * self._hist.shape[1] * 8,
            self._wlo,
            self._hist.shape[1],
            self._cfg_ptr,
            self._ops_ptr,
        ):
            self._grow_window(int(self._call[width]), int(self._call[width + 1]))

    def _extremes_cpu(self, a: torch.Tensor, counts: np.ndarray, keys: np.ndarray) -> float:
        """Overflow counts and extremes of one chunk, skipping the passes its key histogram proves needless
        (no value at or above the layout's overflow shortcut: no overflow compare; no zero: a plain min).
        Returns the chunk's largest finite |x|."""
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
            a.nan_to_num_(nan=0.0, posinf=0.0)
        # a holds |x| >= 0 with nan/inf now 0: float reductions (vectorised) give the exact extremes
        mx = float(a.amax())
        if n_zero == 0 and not n_nonfinite:
            mn = float(a.amin())
        elif n_zero + n_nonfinite < a.numel():
            a.masked_fill_(a == 0, math.inf)
            mn = float(a.amin())
        else:
            mn = math.inf
        if mn != math.inf:
            counts[lay.absmin_bits] = min(int(counts[lay.absmin_bits]), f64_bits(mn) - 1)
        counts[lay.absmax_bits] = max(int(counts[lay.absmax_bits]), f64_bits(mx))
        return mx

    # ------------------------------------------------------------------------------------- device path
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

    def to_host(self) -> np.ndarray:
        """Copy the rows to the host: the one synchronising call per sampled step."""
        return self.dense().cpu().numpy()

    @torch.no_grad()
    def _reset_blocks(self, sl: slice) -> None:
        if sl == slice(None):
            self._blocks.zero_()
            return
        slots = self._block_slot[sl]
        slots = slots[slots >= 0]
        # zeroed in runs of consecutive slots, by views: an index tensor would be a host-to-device copy (from
        # pageable memory, a sync) inside the hook that clears an accumulated gradient's row
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        for run in np.split(slots, breaks) if len(slots) else []:
            self._blocks[int(run[0]) : int(run[-1]) + 1].zero_()

    def accumulate_blocks(self, x: torch.Tensor, row: int) -> None:
        """Add the block-format statistics of ``x`` (ndim >= 2, on this device; both orientations, every
        recipe of ``stats.blocks.RECIPES``) into ``row``'s slot of the block accumulator (a row without one
        is left alone). Never syncs. A tensor (object and in-place version) already added into ``row`` since the
        last ``reset`` is not added again: a module output that several linear layers read (q, k and v
        projections) counts once, like its other statistics, so its shares keep their denominator."""
        slot = int(self._block_slot[row])
        if slot < 0:
            return
        version = _compat.tensor_version(x)
        key = (id(x), row)
        if version is not None:
            done = self._blocks_added.get(key)
            if done is not None and done[0]() is x and done[1] == version:
                return
        self._order_stream()
        engine = "torch" if self.engine == "c" and not self.use_kernel else self.engine
        # threads are the C kernel's alone: asking for them loads (and on a machine's first run builds) it, which
        # on an H100 ran the C compiler inside the first sampled step's first block-format hook
        threads = self._threads() if engine == "c" else 0
        self._blocks[slot] += _blocks.tensor_block_stats(x, engine=engine, threads=threads)
        if version is not None:
            self._blocks_added[key] = (weakref.ref(x), version)

    def blocks_dense(self) -> torch.Tensor:
        """The block accumulator, float64 [slots, 2, n_recipes, 5], on this device."""
        self._order_stream()
        return self._blocks


class StatsBuffer:
    """Per-step statistics of ``rows`` tensor slots, on every device the tensors live on.

    Each tensor is read on its own device, by that device's engine (``precprof.stats.engine``), into that
    device's rows (:class:`DeviceRows`, made at the first tensor seen there); no engine ever receives another
    device's pointer. ``to_host``/``dense`` merge the devices' rows with :func:`~precprof.stats.layout.merge_rows`
    at the flush. A tensor on the ``meta`` device has no data: it is skipped and counted in ``skipped``.

    ``device`` is where the rows are merged (the model's device); ``engine`` forces an engine (default:
    ``PRECPROF_STATS_ENGINE``, else "auto"); ``host_rows=False`` runs the device code path on the CPU (tests).
    """

    def __init__(
        self,
        rows: int,
        device: torch.device | str,
        chunk: int | None = None,
        *,
        host_rows: bool | None = None,
        engine: str | None = None,
        layout: RowLayout = LAYOUT,
        block_rows: Sequence[int] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        self.device = _compat.indexed_device(device)
        # the dtypes whose Triton kernels are compiled at attach (``_triton_warm``): the common three and any
        # others given (the model's parameters' dtypes)
        self.dtypes = tuple(
            dict.fromkeys([*triton_engine.DEFAULT_DTYPES, *(dtypes or ())])
        )  # "cuda" keys its rows as the tensors' "cuda:0"
        self.rows = rows
        # the rows that can hold block-format statistics (default: all), each with a slot of the accumulator
        self.block_rows = (
            np.arange(rows, dtype=np.int64)
            if block_rows is None
            else np.unique(np.asarray(block_rows, dtype=np.int64))
        )
        self._block_slot = np.full(rows, -1, dtype=np.int64)
        self._block_slot[self.block_rows] = np.arange(len(self.block_rows))
        self.chunk = chunk
        self.layout = layout
        self.requested = engine
        self._host_rows = host_rows
        self._parts: dict[torch.device, DeviceRows] = {}
        self.skipped = np.zeros(rows, dtype=np.int64)  # meta tensors per row since the last reset
        self.skipped_total = np.zeros(rows, dtype=np.int64)  # over the whole run
        # rows whose block-format statistics were evaluated since the last reset (host-side flags)
        self.blocks_seen = np.zeros(rows, dtype=bool)
        # time spent in the block-format what-if (capture's block budget reads it after each sampled step)
        self.block_timer = WorkTimer()
        if self.device.type != "meta":
            self._part(self.device)  # the model's device: its engine is chosen (and built) at attach

    def _part(self, device: torch.device) -> DeviceRows:
        device = _compat.indexed_device(device)
        part = self._parts.get(device)
        if part is None:
            name = resolve_engine(self.requested, device)
            part = DeviceRows(
                self.rows,
                device,
                self.chunk,
                host_rows=self._host_rows,
                engine=name,
                layout=self.layout,
                block_slot=self._block_slot,
            )
            if name == "triton":
                self._triton_warm(part)
            self._parts[device] = part
        return part

    def _triton_warm(self, part: DeviceRows) -> None:
        """Compile, when the rows are made (the Profiler's attach), every Triton kernel variant a tensor of
        ``self.dtypes`` can launch (the row statistics; the block kernels when rows hold block statistics),
        so that nothing compiles inside a hook (an H100's first sampled step stalled 18.8 s compiling). Launches
        nothing, never syncs; Triton keeps the kernels in its on-disk cache for the next run."""
        assert part._triton is not None
        block_dtypes = [d for d in self.dtypes if d in _BLOCK_DTYPES] if len(self.block_rows) else []
        tasks = 3 * len(self.dtypes) + 2 * len(block_dtypes)
        with triton_engine.parallel_compile(tasks):  # the compiles run side by side, all done at its exit
            kernels = part._triton.warm(self.dtypes, load=False)
            if block_dtypes:
                kernels += triton_block.warm(part.device, block_dtypes, _blocks.RECIPES, load=False)
        triton_engine.load_kernels(kernels)

    @property
    def primary(self) -> DeviceRows | None:
        """The rows of the model's device (else the first device seen)."""
        return self._parts.get(self.device) or next(iter(self._parts.values()), None)

    @property
    def engines(self) -> dict[str, str]:
        """Which engine filled which device's rows."""
        return {str(d): p.engine for d, p in self._parts.items()}

    # the primary rows' switches (tests compare engines through them)
    @property
    def use_kernel(self) -> bool:
        return bool(self.primary and self.primary.use_kernel)

    @use_kernel.setter
    def use_kernel(self, value: bool) -> None:
        for p in self._parts.values():
            p.use_kernel = value and p.engine == "c"

    @property
    def kernel_threads(self) -> int | None:
        return self.primary.kernel_threads if self.primary else None

    @kernel_threads.setter
    def kernel_threads(self, value: int | None) -> None:
        for p in self._parts.values():
            p.kernel_threads = value

    def _threads(self) -> int:
        return self.primary._threads() if self.primary else 1

    @property
    def on_cpu(self) -> bool:
        return bool(self.primary and self.primary.on_cpu)

    # -- sizes
    @property
    def buffer_bytes(self) -> int:
        return sum(p.buffer_bytes for p in self._parts.values())

    @property
    def scratch_bytes(self) -> int:
        return sum(p.scratch_bytes for p in self._parts.values())

    @property
    def data(self) -> torch.Tensor:
        return self.dense()

    def dense(self) -> torch.Tensor:
        """All devices' rows merged, as one [rows, width] int64 tensor on the model's device (syncs when
        the devices differ)."""
        parts = list(self._parts.values())
        primary = self.primary
        if primary is None:
            return self.layout.empty_rows(self.rows)
        out = primary.dense()
        for p in parts:
            if p is not primary:
                out = merge_rows(out, p.dense().to(out.device), self.layout)
        return out

    def to_host(self) -> np.ndarray:
        """All devices' rows merged, on the host: one copy per device, per sampled step."""
        out: np.ndarray | None = None
        for p in self._parts.values():
            rows = p.to_host()
            out = rows if out is None else merge_rows(out, rows, self.layout)
        return out if out is not None else self.layout.empty_rows(self.rows).numpy()

    def reset(self, rows: slice | None = None) -> None:
        """Zero the counts of all rows (or ``rows``) on every device; device ops, no sync."""
        for p in self._parts.values():
            p.reset(rows)
        self.skipped[rows if rows is not None else slice(None)] = 0
        self.blocks_seen[rows if rows is not None else slice(None)] = False

    def blocks_dense(self) -> torch.Tensor:
        """All devices' block accumulators added, float64 [len(block_rows), 2, n_recipes, 5] on the model's
        device, one slot per row of ``block_rows`` (``expand_blocks`` puts them back in rows; syncs when the
        devices differ). Rows not in ``blocks_seen`` hold zeros."""
        primary = self.primary
        if primary is None:
            return torch.zeros(
                (len(self.block_rows), _blocks.N_ORIENTATIONS, _blocks.N_RECIPES, _blocks.N_STATS)
            )
        out = primary.blocks_dense()
        for p in self._parts.values():
            if p is not primary:
                out = out + p.blocks_dense().to(out.device)
        return out

    def blocks_to_host(self) -> np.ndarray:
        """All devices' block accumulators added, on the host (one copy per device), per row: float64 [rows, 2,
        n_recipes, 5], zeros in the rows without a slot."""
        out: np.ndarray | None = None
        for p in self._parts.values():
            b = p.blocks_dense().cpu().numpy()
            out = b if out is None else out + b
        return self.expand_blocks(out)

    def expand_blocks(self, slots: np.ndarray | None) -> np.ndarray:
        """The block accumulator's slots (``blocks_dense`` on the host, reduced over ranks, say) per row."""
        out = np.zeros((self.rows, _blocks.N_ORIENTATIONS, _blocks.N_RECIPES, _blocks.N_STATS))
        if slots is not None:
            out[self.block_rows] = slots
        return out

    @torch.no_grad()
    def accumulate(self, x: torch.Tensor, row: int, *, assign: bool = False, blocks: bool = False) -> bool:
        """Add the statistics of ``x`` (any floating dtype, any shape, any device) into ``row``. Never syncs.

        ``assign=True`` first clears the row (used for accumulated weight gradients, whose last value wins).
        Each call is one tensor for the fp8 current-scaling counts (its own amax and scale). ``blocks=True``
        also adds the block-format what-if of ``x`` (``stats.blocks``; fp32, bf16 or fp16 with ndim >= 2 and
        data; others are not evaluated) and marks the row in ``blocks_seen``. Returns False when ``x`` was
        skipped (a ``meta`` tensor), True when it was read.
        """
        if x.device.type == "meta":
            self.skipped[row] += 1
            self.skipped_total[row] += 1
            return False
        part = self._parts.get(x.device) or self._part(x.device)
        if assign:
            for p in self._parts.values():
                p.reset(slice(row, row + 1))
        part.accumulate(x, row)
        if (
            blocks
            and x.dim() >= 2
            and x.numel() > 0
            and x.dtype in _BLOCK_DTYPES
            and self._block_slot[row] >= 0
        ):
            with self.block_timer.timing(x.device):
                part.accumulate_blocks(x, row)
            self.blocks_seen[row] = True
        return True

    @torch.no_grad()
    def accumulate_blocks(self, x: torch.Tensor, row: int) -> None:
        """Add only the block-format what-if of ``x`` into ``row`` (a tensor whose other statistics were
        accumulated already, e.g. a module's output that a linear layer then reads). Never syncs; a tensor
        that is not fp32/bf16/fp16 with ndim >= 2 and data, or on ``meta``, is not evaluated."""
        if x.device.type == "meta" or not (x.dim() >= 2 and x.numel() > 0 and x.dtype in _BLOCK_DTYPES):
            return
        if self._block_slot[row] < 0:  # a row without a slot holds no block statistics
            return
        part = self._parts.get(x.device) or self._part(x.device)
        with self.block_timer.timing(x.device):
            part.accumulate_blocks(x, row)
        self.blocks_seen[row] = True

    def device_tensors(self) -> list[torch.Tensor]:
        """Each device's rows and block accumulator (``[rows, width]`` int64, ``[slots, 2, recipes, 5]``
        float64), on their devices, not copied: what a sampled step copies to the host together with the rest
        of its data (``stats.transfer.to_host``: one transfer per device). :meth:`from_host` merges the copies."""
        out: list[torch.Tensor] = []
        for p in self._parts.values():
            out += [p.dense(), p.blocks_dense()]
        return out

    def from_host(self, arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The merged rows (as :meth:`to_host`) and the block statistics per row (as :meth:`blocks_to_host`)
        from the host copies of :meth:`device_tensors`, in its order."""
        rows: np.ndarray | None = None
        blocks: np.ndarray | None = None
        for r, b in zip(arrays[0::2], arrays[1::2], strict=True):
            rows = r if rows is None else merge_rows(rows, r, self.layout)
            blocks = b if blocks is None else blocks + b
        if rows is None:
            rows = self.layout.empty_rows(self.rows).numpy()
        return rows, self.expand_blocks(blocks)


_BLOCK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
