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
from typing import Any

import numpy as np
import torch

from precprof import _compat, formats
from precprof.stats.engine import _default_kernel_threads, _kernel
from precprof.stats.layout import (
    _CALL_LEN,
    _F64_BIAS,
    _F64_EXP_ALL,
    _F64_MANT_MASK,
    _FP8,
    _HI,
    _KERNEL_CONSTANTS,
    _KERNEL_DTYPES,
    _LO,
    _N_KEYS,
    _NO_MIN_BITS,
    _OVERFLOW,
    _UNDERFLOW_EXP,
    COL_ABSMAX_BITS,
    COL_ABSMIN_BITS,
    COL_HIST,
    COL_INF,
    COL_NAN,
    COL_NUMEL,
    COL_OVERFLOW,
    COL_POW2_AT,
    COL_UNDERFLOW_CS,
    COL_ZEROS,
    DEFAULT_CHUNK,
    N_BINS,
    ROW_WIDTH,
)


def _to_f64_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float64).view(np.int64))


def _from_f64_bits(bits: int) -> float:
    return float(np.array(bits, dtype=np.int64).view(np.float64))


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


class StatsBuffer:
    """Per-step buffer of ``rows`` rows; each row accumulates the statistics of one tensor slot.

    On CUDA (any non-CPU device) the rows are one dense int64 device tensor and everything is tensor ops:
    ``accumulate`` never synchronises. On the CPU, where "device" memory is host memory, the counts are a
    numpy array and the histograms live in a window of exponents that grows to what the data uses, so the
    buffer stays a small fraction of the model's size; the one-pass key histogram is folded on the host.
    ``dense()`` gives the same [rows, ROW_WIDTH] int64 tensor in both cases.

    ``chunk`` bounds the scratch memory (about 33 bytes per element of a chunk) on CPU, where reusing
    buffers avoids the page faults of fresh temporaries; on CUDA whole tensors are processed at once (fewer
    kernel launches) unless ``chunk`` is given explicitly.
    """

    def __init__(
        self,
        rows: int,
        device: torch.device | str,
        chunk: int | None = None,
        *,
        host_rows: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.rows = rows
        # host_rows=False runs the device (CUDA) code path on the CPU too: tests check both paths agree
        self.on_cpu = self.device.type == "cpu" if host_rows is None else host_rows
        self.use_kernel = True  # the compiled one-pass CPU kernel when it can be built (tests compare both)
        # threads per kernel call (0: torch.get_num_threads()); decided on first use
        self.kernel_threads: int | None = None
        if self.on_cpu:
            self._counts = np.zeros((rows, COL_HIST), dtype=np.int64)
            self._hist = np.zeros((rows, 0), dtype=np.int64)
            self._wlo = 0  # bin index (0..N_BINS) of the window's first column
            self._data: torch.Tensor | None = None
            # the C kernel's last call row, and which tensor (object and version) it describes: a tensor
            # accumulated again right away (a module returning its submodule's output, and that output's
            # gradient) is merged from it instead of read again
            self._call = np.zeros(_CALL_LEN, dtype=np.int64)
            self._call_ptr = self._call.ctypes.data
            self._counts_ptr = self._counts.ctypes.data
            self._hist_ptr = self._hist.ctypes.data
            self._last: tuple[weakref.ref[torch.Tensor], int] | None = None
            _kernel()  # built (or loaded from the cache) here, when the Profiler attaches, not in a hook
        else:
            self._data = torch.zeros((rows, ROW_WIDTH), dtype=torch.int64, device=self.device)
        if chunk is None:
            chunk = DEFAULT_CHUNK if self.on_cpu else 0
        self.chunk = chunk
        self._scratch_len = 0
        self._f64 = torch.empty(0, dtype=torch.float64, device=self.device)
        self._i64 = torch.empty(0, dtype=torch.int64, device=self.device)
        self._key = torch.empty(0, dtype=torch.int64, device=self.device)
        self._bool = torch.empty(0, dtype=torch.bool, device=self.device)
        self._ones = torch.ones(1, dtype=torch.int64, device=self.device)
        self._keys_hist = torch.zeros(_N_KEYS, dtype=torch.int64, device=self.device)
        self._small = torch.empty(8, dtype=torch.int64, device=self.device)
        if not self.on_cpu:
            self._pow2_idx = torch.tensor(
                [2 * (j + _F64_BIAS) + 1 for j in _UNDERFLOW_EXP], dtype=torch.int64, device=self.device
            )
            self._fp8_max_bits = torch.tensor(
                [_to_f64_bits(f.max) for f in _FP8], dtype=torch.int64, device=self.device
            )
            self._fp8_uf_exp = torch.tensor(
                [int(math.log2(f.underflow_max)) for f in _FP8], dtype=torch.int64, device=self.device
            )
        self.reset()

    # -- sizes
    @property
    def buffer_bytes(self) -> int:
        """Bytes held persistently by the rows."""
        if self.on_cpu:
            return int(self._counts.nbytes + self._hist.nbytes)
        assert self._data is not None
        return self._data.numel() * self._data.element_size()

    @property
    def scratch_bytes(self) -> int:
        """Bytes of reusable scratch currently held (grows to the largest chunk seen; on CPU with the C kernel,
        its call row)."""
        held = sum(
            t.numel() * t.element_size()
            for t in (self._f64, self._i64, self._key, self._bool, self._keys_hist)
        )
        return held + (self._call.nbytes if self.on_cpu else 0)

    @property
    def data(self) -> torch.Tensor:
        """The rows as a dense [rows, ROW_WIDTH] int64 tensor on the buffer's device (see ``dense``)."""
        return self.dense()

    def dense(self) -> torch.Tensor:
        """Dense rows; on CUDA the buffer itself, on the CPU a fresh tensor built from counts and window."""
        if not self.on_cpu:
            assert self._data is not None
            return self._data
        out = np.zeros((self.rows, ROW_WIDTH), dtype=np.int64)
        out[:, :COL_HIST] = self._counts
        w = self._hist.shape[1]
        out[:, COL_HIST + self._wlo : COL_HIST + self._wlo + w] = self._hist
        return torch.from_numpy(out)

    def reset(self, rows: slice | None = None) -> None:
        """Zero the counts of all rows (or ``rows``); device op, no sync."""
        sl = rows if rows is not None else slice(None)
        if self.on_cpu:
            self._counts[sl] = 0
            self._counts[sl, COL_ABSMIN_BITS] = _NO_MIN_BITS
            self._hist[sl] = 0
            return
        assert self._data is not None
        target = self._data[sl]
        target.zero_()
        target[:, COL_ABSMIN_BITS] = _NO_MIN_BITS

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
    def accumulate(self, x: torch.Tensor, row: int, *, assign: bool = False) -> None:
        """Add the statistics of ``x`` (any floating dtype, any shape) into ``row``. Never syncs on CUDA.

        ``assign=True`` first clears the row (used for accumulated weight gradients, whose last value wins).
        Each call is one tensor for the fp8 current-scaling counts (its own amax and scale).
        """
        if assign:
            self.reset(slice(row, row + 1))
        flat = x.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            return
        chunk = self.chunk if self.chunk and self.chunk > 0 else n
        if self.on_cpu:
            self._accumulate_cpu(x, flat, row, chunk)
        else:
            self._accumulate_device(flat, row, chunk)

    def _keys_of(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """|part| widened to fp64 in scratch, its bit patterns, and the key of every element.

        key = 2 * exponent_field + (mantissa == 0), with shifts and bitwise ops only (integer multiply, add
        and compare-to-bool are several times slower on CPU): subtracting 1 from the bits borrows into the
        exponent exactly when the mantissa is zero, so the lowest bit of (bits >> 52) ^ ((bits - 1) >> 52)
        is that flag. A zero gives key 1 ("exponent 0, mantissa 0"); nan 4094, inf 4095.
        """
        m = part.numel()
        self._ensure_scratch(m)
        a = self._f64[:m]
        a.copy_(part)  # exact widening: every fp32/bf16/fp16/fp8 value is a normal fp64
        a.abs_()
        bits = a.view(torch.int64)
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
        counts[COL_NUMEL] += n
        counts[COL_ZEROS] += keys2[0, 1]
        counts[COL_NAN] += keys2[_F64_EXP_ALL, 0]
        counts[COL_INF] += keys2[_F64_EXP_ALL, 1]
        for i, j in enumerate(_UNDERFLOW_EXP):
            counts[COL_POW2_AT + i] += keys2[j + _F64_BIAS, 1]
        if call_max > 0:
            for i, fmt in enumerate(_FP8):
                k = formats.current_scaling_exponent(fmt, call_max)
                counts[COL_UNDERFLOW_CS + i] += _count_le_pow2_keys(
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
        into ``row``; the same numbers as the torch-op path. The same tensor (object and in-place version)
        as the previous call is merged again without reading it."""
        version = _compat.tensor_version(x)
        last = self._last
        if last is None or version is None or last[0]() is not x or last[1] != version:
            lib.pp_call(
                flat.data_ptr(),
                flat.numel(),
                flat.stride(0) if flat.dim() else 1,
                code,
                self._threads(),
                *_KERNEL_CONSTANTS,
                self._call_ptr,
            )
            if self._call[COL_NUMEL] < 0:
                self._last = None
                raise MemoryError("precprof: the CPU statistics kernel could not allocate its scratch")
            self._last = (weakref.ref(x), version) if version is not None else None
        counts_ptr = self._counts_ptr + row * COL_HIST * 8
        while lib.pp_merge(
            self._call_ptr,
            counts_ptr,
            self._hist_ptr + row * self._hist.shape[1] * 8,
            self._wlo,
            self._hist.shape[1],
        ):
            self._grow_window(int(self._call[ROW_WIDTH]), int(self._call[ROW_WIDTH + 1]))

    def _extremes_cpu(self, a: torch.Tensor, counts: np.ndarray, keys: np.ndarray) -> float:
        """Overflow counts and extremes of one chunk, skipping the passes its key histogram proves needless
        (no value >= 256: no overflow compare; no zero: a plain min). Returns the chunk's largest finite |x|."""
        n_nonfinite = int(keys[2 * _F64_EXP_ALL] + keys[2 * _F64_EXP_ALL + 1])
        n_big = int(keys[2 * (_F64_BIAS + 8) : 2 * _F64_EXP_ALL].sum())  # finite values >= 2^8
        if n_big or n_nonfinite:
            mask = self._bool[: a.numel()]
            torch.ge(a, 256.0, out=mask)  # every overflow threshold is above 256; inf is included
            big = a[mask]
            for i, (t, inclusive) in enumerate(_OVERFLOW):
                counts[COL_OVERFLOW + i] += int((big >= t).sum()) if inclusive else int((big > t).sum())
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
            counts[COL_ABSMIN_BITS] = min(int(counts[COL_ABSMIN_BITS]), _to_f64_bits(mn) - 1)
        counts[COL_ABSMAX_BITS] = max(int(counts[COL_ABSMAX_BITS]), _to_f64_bits(mx))
        return mx

    # ------------------------------------------------------------------------------------- device path
    def _accumulate_device(self, flat: torch.Tensor, row: int, chunk: int) -> None:
        assert self._data is not None
        r = self._data[row]
        kh = self._keys_hist
        kh.zero_()
        call_max = self._small[4:5]
        call_max.zero_()
        n = flat.numel()
        for start in range(0, n, chunk):
            a, bits, key = self._keys_of(flat[start : start + chunk])
            # bincount asks the host for max(key) on CUDA: a fixed-size index_add_ does not
            kh.index_add_(0, key, self._ones.expand(key.numel()))
            self._extremes_device(a, bits, r, call_max)
        r[COL_NUMEL] += n
        kh2 = kh.view(_F64_EXP_ALL + 1, 2)
        r[COL_ZEROS] += kh2[0, 1]
        r[COL_NAN] += kh2[_F64_EXP_ALL, 0]
        r[COL_INF] += kh2[_F64_EXP_ALL, 1]
        r[COL_POW2_AT : COL_POW2_AT + 4] += kh[self._pow2_idx]
        all_in_bin = kh2[:, 0] + kh2[:, 1]
        hist = r[COL_HIST : COL_HIST + N_BINS]
        hist += all_in_bin[_LO : _HI + 1]
        hist[0] += all_in_bin[1:_LO].sum() + kh2[0, 0]
        hist[-1] += all_in_bin[_HI + 1 : _F64_EXP_ALL].sum()
        # fp8 current scaling of this call, on the device: k = floor(log2(fmax / amax)) from the exponent
        # fields and mantissas of fmax and amax; x*2^k underflows iff |x| <= 2^(j - k)
        amax = call_max[0]
        e_a = amax >> 52
        e_f = self._fp8_max_bits >> 52
        k = e_f - e_a - ((amax & _F64_MANT_MASK) > (self._fp8_max_bits & _F64_MANT_MASK)).long()
        f = (self._fp8_uf_exp - k + _F64_BIAS).clamp(1, _F64_EXP_ALL - 1)
        cum = kh.cumsum(0)
        cs = cum[2 * f - 1] - kh[1] + kh[2 * f + 1]
        r[COL_UNDERFLOW_CS : COL_UNDERFLOW_CS + 2] += cs * (amax > 0).long()

    def _extremes_device(
        self, a: torch.Tensor, bits: torch.Tensor, r: torch.Tensor, call_max: torch.Tensor
    ) -> None:
        """Overflow counts, smallest nonzero and largest finite |x| with tensor ops only (no sync)."""
        m = a.numel()
        mask = self._bool[:m]
        tmp = self._i64[:m]
        ov = self._small[:4]
        for i, (threshold, inclusive) in enumerate(_OVERFLOW):
            if inclusive:
                torch.ge(a, threshold, out=mask)
            else:
                torch.gt(a, threshold, out=mask)
            ov[i] = torch.count_nonzero(mask)
        r[COL_OVERFLOW : COL_OVERFLOW + 4] += ov
        # smallest nonzero: (bits - 1) & MAX maps 0 to the largest int64 (the "none yet" sentinel); nan/inf
        # bits exceed every finite one. The row keeps bits - 1, so the sentinel never overflows.
        torch.sub(bits, 1, out=tmp)
        tmp.bitwise_and_(_NO_MIN_BITS)
        r[COL_ABSMIN_BITS] = torch.minimum(r[COL_ABSMIN_BITS], tmp.amin())
        # largest finite: nan -> 0 and inf -> 0 in place (a is scratch), then the max of the bit patterns
        a.nan_to_num_(nan=0.0, posinf=0.0)
        mx = bits.amax()
        r[COL_ABSMAX_BITS] = torch.maximum(r[COL_ABSMAX_BITS], mx)
        torch.maximum(call_max, mx.reshape(1), out=call_max)

    def to_host(self) -> np.ndarray:
        """Copy all rows to the host: the one synchronising call per sampled step."""
        return self.dense().cpu().numpy()
