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
x*s, which is exactly what "x underflows at scale s" means (DESIGN.md). :func:`decode` turns a row into the
unscaled histogram (a shift of bins by log2 s, exact for power-of-two scales) and the per-format counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from precprof import formats

# ------------------------------------------------------------------------------------------- layout
EXP_MIN = formats.FP32_MIN_EXPONENT  # -149
EXP_MAX = formats.FP32_MAX_EXPONENT  # 127
N_BINS = EXP_MAX - EXP_MIN + 1  # 277

_F64_BIAS = 1023
_F64_MANT_MASK = (1 << 52) - 1
_F64_EXP_ALL = 2047
# key = 2 * fp64_exponent_field + (mantissa == 0): 4096 keys
_N_KEYS = 4096

# overflow thresholds, in the order of formats.WHATIF_FORMATS; e4m3 is strict (> 464)
_OVERFLOW = [(formats.get(f).overflow_min, formats.get(f).overflow_inclusive) for f in formats.WHATIF_FORMATS]

# row layout (int64 columns)
COL_NUMEL = 0
COL_ZEROS = 1
COL_NAN = 2
COL_INF = 3
COL_OVERFLOW = 4  # 4 columns, WHATIF_FORMATS order; counts of v >= T (or > T) including inf
COL_ABSMAX_BITS = 8
COL_ABSMIN_BITS = 9  # smallest nonzero |x| bits minus 1; _NO_MIN_BITS when none
COL_HIST = 10  # N_BINS columns: all finite nonzero values per bin
COL_POW2 = COL_HIST + N_BINS  # N_BINS columns: of those, exact powers of two
ROW_WIDTH = COL_POW2 + N_BINS

_INF_BITS = 0x7FF0000000000000
_NO_MIN_BITS = 0x7FFFFFFFFFFFFFFF  # sentinel "no nonzero finite value yet"

DEFAULT_CHUNK = 1 << 18
_LO = _F64_BIAS + EXP_MIN  # fp64 exponent field of fp32's smallest subnormal
_HI = _F64_BIAS + EXP_MAX


def _fold_keys(kh2: np.ndarray, row: np.ndarray) -> None:
    """Add a [2048, 2] key histogram (exponent field, mantissa == 0) into a host row (see the device path)."""
    row[COL_ZEROS] += kh2[0, 1]
    row[COL_NAN] += kh2[_F64_EXP_ALL, 0]
    row[COL_INF] += kh2[_F64_EXP_ALL, 1]
    all_in_bin = kh2[:, 0] + kh2[:, 1]
    hist = row[COL_HIST : COL_HIST + N_BINS]
    hist += all_in_bin[_LO : _HI + 1]
    row[COL_POW2 : COL_POW2 + N_BINS] += kh2[_LO : _HI + 1, 1]
    hist[0] += all_in_bin[1:_LO].sum() + kh2[0, 0]
    hist[-1] += all_in_bin[_HI + 1 : _F64_EXP_ALL].sum()


def _to_f64_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float64).view(np.int64))


def _from_f64_bits(bits: int) -> float:
    return float(np.array(bits, dtype=np.int64).view(np.float64))


class StatsBuffer:
    """Per-step device buffer of ``rows`` rows; each row accumulates the statistics of one tensor slot.

    ``chunk`` bounds the scratch memory (about 25 bytes per element of a chunk) on CPU, where reusing
    buffers avoids the page faults of fresh temporaries; on CUDA whole tensors are processed at once (fewer
    kernel launches) unless ``chunk`` is given explicitly.
    """

    def __init__(self, rows: int, device: torch.device | str, chunk: int | None = None) -> None:
        self.device = torch.device(device)
        self.rows = rows
        self.data = torch.zeros((rows, ROW_WIDTH), dtype=torch.int64, device=self.device)
        if chunk is None:
            chunk = DEFAULT_CHUNK if self.device.type == "cpu" else 0
        self.chunk = chunk
        self._scratch_len = 0
        self._f64 = torch.empty(0, dtype=torch.float64, device=self.device)
        self._i64 = torch.empty(0, dtype=torch.int64, device=self.device)
        self._key = torch.empty(0, dtype=torch.int64, device=self.device)
        self._bool = torch.empty(0, dtype=torch.bool, device=self.device)
        self._ones = torch.ones(1, dtype=torch.int64, device=self.device)
        self._keys_hist = torch.zeros(_N_KEYS, dtype=torch.int64, device=self.device)
        self._small = torch.empty(8, dtype=torch.int64, device=self.device)
        self.reset()

    # -- sizes
    @property
    def buffer_bytes(self) -> int:
        """Bytes held persistently by the row buffer."""
        return self.data.numel() * self.data.element_size()

    @property
    def scratch_bytes(self) -> int:
        """Bytes of reusable scratch currently held (grows to the largest chunk seen)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self._f64, self._i64, self._key, self._bool, self._keys_hist)
        )

    def reset(self, rows: slice | None = None) -> None:
        """Zero the counts of all rows (or ``rows``); device op, no sync."""
        target = self.data if rows is None else self.data[rows]
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

    @torch.no_grad()
    def accumulate(self, x: torch.Tensor, row: int, *, assign: bool = False) -> None:
        """Add the statistics of ``x`` (any floating dtype, any shape) into ``row``. Never syncs.

        ``assign=True`` first clears the row (used for accumulated weight gradients, whose last value wins).
        """
        if assign:
            self.reset(slice(row, row + 1))
        flat = x.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            return
        r = self.data[row]
        chunk = self.chunk if self.chunk and self.chunk > 0 else n
        for start in range(0, n, chunk):
            part = flat[start : start + chunk]
            self._accumulate_chunk(part, r)
        # numel is host knowledge; keep it on the device row so that one copy carries everything
        r[COL_NUMEL] += n

    def _accumulate_chunk(self, part: torch.Tensor, r: torch.Tensor) -> None:
        m = part.numel()
        self._ensure_scratch(m)
        a = self._f64[:m]
        a.copy_(part)  # exact widening: every fp32/bf16/fp16/fp8 value is a normal fp64
        a.abs_()
        bits = a.view(torch.int64)
        key = self._key[:m]
        mant0 = self._bool[:m]
        tmp = self._i64[:m]
        # key = 2 * exponent_field + (mantissa == 0), with shifts and bitwise ops only (integer multiply,
        # add and compare-to-bool are several times slower on CPU): subtracting 1 from the bits borrows into
        # the exponent exactly when the mantissa is zero, so the lowest bit of
        # (bits >> 52) ^ ((bits - 1) >> 52) is that flag. A zero gives key 1 ("exponent 0, mantissa 0").
        torch.sub(bits, 1, out=tmp)
        tmp.bitwise_right_shift_(52)
        torch.bitwise_right_shift(bits, 52, out=key)
        tmp.bitwise_xor_(key).bitwise_and_(1)
        key.bitwise_left_shift_(1).bitwise_or_(tmp)
        kh = self._keys_hist
        if a.device.type == "cpu":
            # the key histogram is host memory here: fold it into the row with numpy (tiny arrays), and let
            # it decide which of the remaining passes are needed
            keys = torch.bincount(key, minlength=_N_KEYS).numpy()
            _fold_keys(keys.reshape(_F64_EXP_ALL + 1, 2), r.numpy())
            self._extremes_cpu(a, bits, tmp, mant0, r, keys)
            return
        # bincount asks the host for max(key) on CUDA: a fixed-size index_add_ does not
        kh.zero_()
        kh.index_add_(0, key, self._ones.expand(m))
        kh2 = kh.view(_F64_EXP_ALL + 1, 2)  # [exponent field, (mantissa != 0, mantissa == 0)]
        # zeros: exponent field 0 with mantissa 0 (fp64 has no subnormals coming from narrower formats,
        # and an fp64 subnormal input lands in bin EXP_MIN below)
        r[COL_ZEROS] += kh2[0, 1]
        r[COL_NAN] += kh2[_F64_EXP_ALL, 0]
        r[COL_INF] += kh2[_F64_EXP_ALL, 1]
        all_in_bin = kh2[:, 0] + kh2[:, 1]
        hist = r[COL_HIST : COL_HIST + N_BINS]
        pow2 = r[COL_POW2 : COL_POW2 + N_BINS]
        hist += all_in_bin[_LO : _HI + 1]
        pow2 += kh2[_LO : _HI + 1, 1]
        # fp64-only exponents outside fp32's range fold into the end bins (fp64 subnormals: field 0, mant != 0)
        hist[0] += all_in_bin[1:_LO].sum() + kh2[0, 0]
        hist[-1] += all_in_bin[_HI + 1 : _F64_EXP_ALL].sum()
        self._extremes_device(a, bits, tmp, mant0, r)

    def _extremes_device(
        self, a: torch.Tensor, bits: torch.Tensor, tmp: torch.Tensor, mask: torch.Tensor, r: torch.Tensor
    ) -> None:
        """Overflow counts, smallest nonzero and largest finite |x| with tensor ops only (no sync)."""
        # overflow: one compare per format (inf included; the host subtracts inf)
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
        r[COL_ABSMAX_BITS] = torch.maximum(r[COL_ABSMAX_BITS], bits.amax())

    def _extremes_cpu(
        self,
        a: torch.Tensor,
        bits: torch.Tensor,
        tmp: torch.Tensor,
        mask: torch.Tensor,
        r: torch.Tensor,
        keys: np.ndarray,
    ) -> None:
        """The same results as ``_extremes_device``, with fewer passes: on the CPU the key histogram is
        already host memory, so it tells which passes can be skipped (no value >= 256: no overflow compare;
        no zero: a plain min; no nan/inf: a plain max)."""
        n_nonfinite = int(keys[2 * _F64_EXP_ALL] + keys[2 * _F64_EXP_ALL + 1])
        n_big = int(keys[2 * (_F64_BIAS + 8) : 2 * _F64_EXP_ALL].sum())  # finite values >= 2^8
        if n_big or n_nonfinite:
            torch.ge(a, 256.0, out=mask)  # every overflow threshold is above 256; inf is included
            big = a[mask]
            ov = [
                int((big >= t).sum()) if inclusive else int((big > t).sum()) for t, inclusive in _OVERFLOW
            ]
            r.numpy()[COL_OVERFLOW : COL_OVERFLOW + 4] += np.array(ov, dtype=np.int64)
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
        row = r.numpy()
        if mn != math.inf:
            row[COL_ABSMIN_BITS] = min(int(row[COL_ABSMIN_BITS]), _to_f64_bits(mn) - 1)
        row[COL_ABSMAX_BITS] = max(int(row[COL_ABSMAX_BITS]), _to_f64_bits(mx))

    def to_host(self) -> np.ndarray:
        """Copy all rows to the host: the one synchronising call per sampled step."""
        return self.data.cpu().numpy()


# ------------------------------------------------------------------------------------------- decoding
@dataclass
class RowStats:
    """Host-side statistics of one row, unscaled where noted."""

    numel: int
    zeros: int
    nan: int
    inf: int
    absmax: float  # unscaled; 0.0 when no finite value
    absmin: float  # unscaled; nan when no nonzero finite value
    hist: np.ndarray  # counts per unscaled exponent, index i <-> exponent exponents[i]
    exponents: np.ndarray
    underflow: dict[str, int]  # at the scale in effect
    overflow: dict[str, int]  # at the scale in effect (finite values only)
    underflow_cs: dict[str, int]  # fp8 formats under per-tensor current scaling


def _count_le_pow2(hist: np.ndarray, pow2: np.ndarray, j: int) -> int:
    """Number of finite nonzero values with |v| <= 2^j (raw exponent coordinates)."""
    idx = j - EXP_MIN
    if idx < 0:
        return 0
    if idx >= N_BINS:
        return int(hist.sum())
    return int(hist[:idx].sum() + pow2[idx])


def decode(row: np.ndarray, scale: float = 1.0) -> RowStats:
    """Turn one buffer row into counts and the unscaled histogram.

    ``scale`` is the loss scale the values carried (1 in the forward pass). The histogram is shifted by
    log2(scale) when it is a power of two (exact); otherwise it is left in raw bins, shifted by the rounded
    log2 (documented approximation for non-power-of-two static scales).
    """
    hist = row[COL_HIST : COL_HIST + N_BINS].astype(np.int64)
    pow2 = row[COL_POW2 : COL_POW2 + N_BINS].astype(np.int64)
    zeros = int(row[COL_ZEROS])
    nan = int(row[COL_NAN])
    inf = int(row[COL_INF])
    underflow: dict[str, int] = {}
    overflow: dict[str, int] = {}
    for i, name in enumerate(formats.WHATIF_FORMATS):
        fmt = formats.get(name)
        j = int(math.log2(fmt.underflow_max))
        underflow[name] = _count_le_pow2(hist, pow2, j)
        overflow[name] = int(row[COL_OVERFLOW + i]) - inf
    absmax_bits = int(row[COL_ABSMAX_BITS])
    absmin_bits = int(row[COL_ABSMIN_BITS]) + 1 if int(row[COL_ABSMIN_BITS]) != _NO_MIN_BITS else 0
    raw_absmax = _from_f64_bits(absmax_bits) if absmax_bits > 0 else 0.0
    raw_absmin = _from_f64_bits(absmin_bits) if 0 < absmin_bits < _INF_BITS else math.nan
    # fp8 current scaling: s = 2^k, k = floor(log2(fmax / amax)); x*s underflows iff |x| <= 2^(j - k)
    underflow_cs: dict[str, int] = {}
    for name in formats.FP8_FORMATS:
        fmt = formats.get(name)
        if raw_absmax > 0:
            k = formats.current_scaling_exponent(fmt, raw_absmax)
            j = int(math.log2(fmt.underflow_max)) - k
            underflow_cs[name] = _count_le_pow2(hist, pow2, j)
        else:
            underflow_cs[name] = 0
    shift = 0
    if scale > 0 and math.isfinite(scale):
        shift = round(math.log2(scale))
    exponents = np.arange(EXP_MIN, EXP_MAX + 1, dtype=np.int64) - shift
    return RowStats(
        numel=int(row[COL_NUMEL]),
        zeros=zeros,
        nan=nan,
        inf=inf,
        absmax=raw_absmax / scale if scale else raw_absmax,
        absmin=raw_absmin / scale if scale else raw_absmin,
        hist=hist,
        exponents=exponents,
        underflow=underflow,
        overflow=overflow,
        underflow_cs=underflow_cs,
    )


def is_power_of_two(value: float) -> bool:
    """True for 2^k (k any integer), the scales whose histogram shift is exact."""
    if not (value > 0 and math.isfinite(value)):
        return False
    m, _ = math.frexp(value)
    return m == 0.5


def tensor_stats(x: torch.Tensor, scale: float = 1.0) -> RowStats:
    """Statistics of one tensor (convenience for tests and notebooks; syncs once)."""
    buf = StatsBuffer(1, x.device)
    buf.accumulate(x, 0)
    return decode(buf.to_host()[0], scale)
