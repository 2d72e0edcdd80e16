"""The statistics row, written once: which int64 column holds what, derived from ``formats``, and the decoding
of many rows at once (``decode_rows``). Free of torch: the stream's writer process (``precprof.stream_child``)
decodes a sampled step's rows with it; ``precprof.stats.layout`` adds the merge of rows and the C kernel's
dtypes.

A row holds counts (numel, zeros, nan, inf, overflow per what-if format, values on each format's underflow
boundary, fp8 current-scaling underflow), the largest and smallest nonzero |x| as fp64 bits, and the exponent
histogram over fp32's range. :class:`RowLayout` derives the column offsets from the what-if formats and the
fp8 formats (how many, which thresholds), and every engine takes its offsets from it: the torch-op path
(``buffer``), the C kernel (the ``config`` array it is passed), the Triton kernel (``triton_engine``), the
distributed reducer and the decoding. ``precprof.stats.layout.merge_rows`` is the one merge (sum; max for absmax;
min for absmin), and :attr:`RowLayout.merge_ops` is the same rule as data for the C kernel.

The overflow shortcut: an engine may skip the overflow compares of values below ``overflow_shortcut``, the
largest power of two not above any format's overflow threshold. It is derived here from the thresholds, so a
format with a small maximum (FP4 E2M1, max 6: threshold 7, shortcut 4) lowers it instead of being miscounted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from precprof import formats

if TYPE_CHECKING:
    import torch

EXP_MIN = formats.FP32_MIN_EXPONENT  # -149
EXP_MAX = formats.FP32_MAX_EXPONENT  # 127
N_BINS = EXP_MAX - EXP_MIN + 1  # 277

_F64_BIAS = 1023
_F64_MANT_MASK = (1 << 52) - 1
_F64_EXP_ALL = 2047
# key = 2 * fp64_exponent_field + (mantissa == 0): 4096 keys
_N_KEYS = 4096
_LO = _F64_BIAS + EXP_MIN  # fp64 exponent field of fp32's smallest subnormal
_HI = _F64_BIAS + EXP_MAX

_INF_BITS = 0x7FF0000000000000
_NO_MIN_BITS = 0x7FFFFFFFFFFFFFFF  # sentinel "no nonzero finite value yet"

# merge rules per column (``RowLayout.merge_ops``; the C kernel reads them too)
MERGE_SUM, MERGE_MAX, MERGE_MIN = 0, 1, 2

DEFAULT_CHUNK = 1 << 18
# the C kernel's layout limits (kernel.c MAX_FORMATS)
_C_MAX_FORMATS = 16


def f64_bits(value: float) -> int:
    """The fp64 bit pattern of ``value`` as a Python int."""
    return int(np.array(value, dtype=np.float64).view(np.int64))


def f64_value(bits: int) -> float:
    """The fp64 value of the bit pattern ``bits`` (the inverse of ``f64_bits``)."""
    return float(np.array(bits, dtype=np.int64).view(np.float64))


def f32_bits(value: float) -> int:
    """The fp32 bit pattern of ``value`` (which must be exactly representable in fp32)."""
    a = np.array(value, dtype=np.float32)
    assert float(a) == value, f"{value!r} is not an fp32 value"
    return int(a.view(np.int32))


def _smallest_f32_at_least(value: float) -> float:
    """The smallest fp32 value >= ``value`` (a finite positive threshold)."""
    v = np.float32(value)
    if float(v) < value:
        v = np.nextafter(v, np.float32(np.inf))
    return float(v)


@dataclass(frozen=True)
class RowLayout:
    """Column offsets of a statistics row for the given what-if and fp8 (current-scaling) formats."""

    whatif: tuple[formats.NumberFormat, ...]
    fp8: tuple[formats.NumberFormat, ...]
    numel: int = field(init=False)
    zeros: int = field(init=False)
    nan: int = field(init=False)
    inf: int = field(init=False)
    overflow: int = field(init=False)  # len(whatif) columns: counts of v >= T (or > T) including inf
    absmax_bits: int = field(init=False)
    absmin_bits: int = field(init=False)  # smallest nonzero |x| bits minus 1; _NO_MIN_BITS when none
    underflow_cs: int = field(init=False)  # len(fp8) columns: underflow under per-call current scaling
    pow2_at: int = field(init=False)  # len(whatif) columns: values exactly equal to underflow_max
    hist: int = field(init=False)  # N_BINS columns: finite nonzero values per exponent bin
    width: int = field(init=False)

    def __post_init__(self) -> None:
        n_w, n_f = len(self.whatif), len(self.fp8)
        if not 0 < n_w <= _C_MAX_FORMATS or n_f > _C_MAX_FORMATS:
            raise ValueError(f"a row holds 1..{_C_MAX_FORMATS} what-if formats, got {n_w}")
        offsets = {}
        col = 0
        for name, width in (
            ("numel", 1),
            ("zeros", 1),
            ("nan", 1),
            ("inf", 1),
            ("overflow", n_w),
            ("absmax_bits", 1),
            ("absmin_bits", 1),
            ("underflow_cs", n_f),
            ("pow2_at", n_w),
            ("hist", N_BINS),
        ):
            offsets[name] = col
            col += width
        offsets["width"] = col
        for name, value in offsets.items():
            object.__setattr__(self, name, value)
        for f in self.whatif + self.fp8:
            j = math.log2(f.underflow_max)
            if j != int(j) or not EXP_MIN - 1 <= j <= EXP_MAX:
                raise ValueError(f"{f.name}: underflow_max must be a power of two within fp32's range")
        # the shortcut must hold for every threshold, strict (> T) or not (>= T)
        assert all(self.overflow_shortcut <= t for t in self.overflow_thresholds)

    @classmethod
    def of(cls, whatif: tuple[str, ...], fp8: tuple[str, ...]) -> RowLayout:
        return cls(tuple(formats.get(n) for n in whatif), tuple(formats.get(n) for n in fp8))

    # -- derived constants
    @property
    def n_whatif(self) -> int:
        return len(self.whatif)

    @property
    def n_fp8(self) -> int:
        return len(self.fp8)

    @property
    def counts_width(self) -> int:
        """The columns before the histogram."""
        return self.hist

    @property
    def call_len(self) -> int:
        """A C-kernel call row: a row, then its first and last nonzero histogram bin."""
        return self.width + 2

    @property
    def overflow_thresholds(self) -> tuple[float, ...]:
        return tuple(f.overflow_min for f in self.whatif)

    @property
    def overflow_inclusive(self) -> tuple[bool, ...]:
        return tuple(f.overflow_inclusive for f in self.whatif)

    @property
    def overflow_shortcut_exp(self) -> int:
        """floor(log2) of the smallest overflow threshold: |x| < 2^this overflows no format."""
        return min(EXP_MAX, math.floor(math.log2(min(self.overflow_thresholds))))

    @property
    def overflow_shortcut(self) -> float:
        return 2.0**self.overflow_shortcut_exp

    @property
    def underflow_exps(self) -> tuple[int, ...]:
        """j with underflow_max = 2^j, per what-if format."""
        return tuple(int(math.log2(f.underflow_max)) for f in self.whatif)

    @property
    def fp8_underflow_exps(self) -> tuple[int, ...]:
        return tuple(int(math.log2(f.underflow_max)) for f in self.fp8)

    @property
    def fp8_exponent_caps(self) -> tuple[int, ...]:
        """Per fp8 format, the largest current-scaling exponent k: that of an amax at torchao's floor
        (``formats.current_scaling_exponent_cap``); a tensor of smaller amax is scaled by 2^cap, not more."""
        return tuple(formats.current_scaling_exponent_cap(f) for f in self.fp8)

    @property
    def overflow_f32_lo_bits(self) -> tuple[int, ...]:
        """Per what-if format, the fp32 bit pattern of the smallest fp32 |x| that overflows: for values held
        in fp32 or narrower, ``bits(|x|) >= lo`` (and not nan) is the overflow test, inclusive or strict."""
        out = []
        for t, inclusive in zip(self.overflow_thresholds, self.overflow_inclusive, strict=True):
            lo = _smallest_f32_at_least(t)
            if not inclusive and lo == t:
                lo = float(np.nextafter(np.float32(lo), np.float32(np.inf)))
            out.append(f32_bits(lo))
        return tuple(out)

    @property
    def overflow_f64_lo_bits(self) -> tuple[int, ...]:
        """The same in fp64 bit patterns (fp64 tensors)."""
        out = []
        for t, inclusive in zip(self.overflow_thresholds, self.overflow_inclusive, strict=True):
            lo = t if inclusive else float(np.nextafter(t, math.inf))
            out.append(f64_bits(lo))
        return tuple(out)

    @property
    def merge_ops(self) -> np.ndarray:
        """Per column of a row, how two rows combine: MERGE_SUM, MERGE_MAX (absmax) or MERGE_MIN (absmin)."""
        ops = np.full(self.width, MERGE_SUM, dtype=np.int64)
        ops[self.absmax_bits] = MERGE_MAX
        ops[self.absmin_bits] = MERGE_MIN
        return ops

    def empty_rows(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``rows`` empty rows: zeros, and the absmin sentinel (a tensor: the engines' buffers)."""
        import torch  # this module is torch-free: the stream's writer process decodes rows with it

        out = torch.zeros((rows, self.width), dtype=torch.int64, device=device)
        out[:, self.absmin_bits] = _NO_MIN_BITS
        return out

    def c_config(self) -> np.ndarray:
        """Everything the C kernel needs, as one int64 array (kernel.c ``cfg_t``, read by ``pp_config``)."""
        n_w, n_f = self.n_whatif, self.n_fp8
        sc = self.overflow_shortcut
        head = [
            self.numel,
            self.zeros,
            self.nan,
            self.inf,
            self.overflow,
            self.absmax_bits,
            self.absmin_bits,
            self.underflow_cs,
            self.pow2_at,
            self.hist,
            self.width,
            n_w,
            n_f,
            EXP_MIN,
            EXP_MAX,
            # the shortcut as fp64, fp32, bf16 and fp16 bits (fp16: at most 2^15, its largest power of two)
            f64_bits(sc),
            f32_bits(sc),
            f32_bits(sc) >> 16,
            int(np.array(min(sc, 2.0**15), dtype=np.float16).view(np.int16)),
        ]
        per_format = []
        for t, inc, j in zip(
            self.overflow_thresholds, self.overflow_inclusive, self.underflow_exps, strict=True
        ):
            per_format += [f64_bits(t), int(inc), j]
        per_fp8 = []
        for f, j, cap in zip(self.fp8, self.fp8_underflow_exps, self.fp8_exponent_caps, strict=True):
            per_fp8 += [f64_bits(f.max), j, cap]
        return np.array(head + per_format + per_fp8, dtype=np.int64)


# The layout of every table precprof writes.
LAYOUT = RowLayout.of(formats.WHATIF_FORMATS, formats.FP8_FORMATS)

COL_NUMEL = LAYOUT.numel
COL_ZEROS = LAYOUT.zeros
COL_NAN = LAYOUT.nan
COL_INF = LAYOUT.inf
COL_OVERFLOW = LAYOUT.overflow
COL_ABSMAX_BITS = LAYOUT.absmax_bits
COL_ABSMIN_BITS = LAYOUT.absmin_bits
COL_UNDERFLOW_CS = LAYOUT.underflow_cs
COL_POW2_AT = LAYOUT.pow2_at
COL_HIST = LAYOUT.hist
ROW_WIDTH = LAYOUT.width
N_WHATIF = LAYOUT.n_whatif
N_FP8 = LAYOUT.n_fp8


def decode_rows(rows: np.ndarray, scales: np.ndarray, first_bin: int = 0) -> dict[str, Any]:
    """:func:`decode` of many rows at once (vectorised; the same numbers, row by row).

    ``rows``: [rows, ROW_WIDTH]; with ``first_bin``, [rows, COL_HIST + k], the histogram's bins ``first_bin`` to
    ``first_bin + k`` alone (every other bin zero: a sampled step's rows hold tens of the N_BINS).

    Returns arrays over rows: ``numel``, ``zeros``, ``nan``, ``inf``, ``absmax``, ``absmin`` (unscaled),
    ``underflow`` / ``overflow`` / ``underflow_cs`` (dicts of arrays by format), ``hist`` (the raw bins from
    ``hist_first`` on, a view of ``rows``), ``hist_used`` (the bins ``lo:hi`` that hold every nonzero one) and
    ``shift`` (per row: exponent of bin i is ``EXP_MIN + i - shift``).
    """
    rows = np.asarray(rows, dtype=np.int64)
    rows = rows.reshape(-1, rows.shape[-1] if rows.ndim == 2 else ROW_WIDTH)
    scales = np.asarray(scales, dtype=np.float64).reshape(-1)
    hist = rows[:, COL_HIST : COL_HIST + N_BINS - first_bin]
    inf = rows[:, COL_INF]
    # the bins any row uses: tens of the N_BINS, the sums below run over those alone
    used = np.flatnonzero(hist.any(axis=0)) + first_bin
    lo, hi = (int(used[0]), int(used[-1]) + 1) if len(used) else (0, 0)
    underflow, overflow = {}, {}
    # values <= 2^j: the bins below j, and 2^j itself; one running sum over the used bins serves every format
    running = np.cumsum(hist[:, lo - first_bin : hi - first_bin], axis=1) if hi > lo else None
    for i, name in enumerate(formats.WHATIF_FORMATS):
        idx = min(max(LAYOUT.underflow_exps[i] - EXP_MIN, 0), hi)
        below = (
            running[:, idx - lo - 1] if running is not None and idx > lo else np.zeros(len(rows), np.int64)
        )
        underflow[name] = below + rows[:, COL_POW2_AT + i]
        overflow[name] = rows[:, COL_OVERFLOW + i] - inf
    max_bits = rows[:, COL_ABSMAX_BITS]
    # NaN where a row holds no finite value (``decode``'s rule: every value nan or inf, or none at all)
    finite = rows[:, COL_NUMEL] - rows[:, COL_NAN] - inf > 0
    raw_absmax = np.where(finite, np.where(max_bits > 0, max_bits.view(np.float64), 0.0), math.nan)
    min_field = rows[:, COL_ABSMIN_BITS]
    min_bits = np.where(min_field != _NO_MIN_BITS, min_field + 1, 0)
    raw_absmin = np.where((min_bits > 0) & (min_bits < _INF_BITS), min_bits.view(np.float64), math.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        divide = scales != 0
        absmax = np.where(divide, raw_absmax / np.where(divide, scales, 1.0), raw_absmax)
        absmin = np.where(divide, raw_absmin / np.where(divide, scales, 1.0), raw_absmin)
        usable = (scales > 0) & np.isfinite(scales)
        shift = np.where(usable, np.round(np.log2(np.where(usable, scales, 1.0))), 0).astype(np.int64)
    # the per-row columns are copies: callers keep them per sampled step, and a view would keep the whole
    # [rows, ROW_WIDTH] array alive with them
    return {
        "numel": rows[:, COL_NUMEL].copy(),
        "zeros": rows[:, COL_ZEROS].copy(),
        "nan": rows[:, COL_NAN].copy(),
        "inf": inf.copy(),
        "absmax": absmax,
        "absmin": absmin,
        "underflow": underflow,
        "overflow": overflow,
        "underflow_cs": {
            name: rows[:, COL_UNDERFLOW_CS + i].copy() for i, name in enumerate(formats.FP8_FORMATS)
        },
        "hist": hist,
        "hist_first": first_bin,
        "hist_used": (lo, hi),
        "shift": shift,
    }
