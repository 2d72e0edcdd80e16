"""From rows to numbers: one row (``decode``), unscaled by the loss scale in effect (a shift of the histogram,
exact for powers of two); a sampled step's rows at once is ``precprof.rowlayout.decode_rows`` (free of torch:
the stream's writer process decodes with it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from precprof import formats
from precprof.stats.buffer import StatsBuffer
from precprof.stats.layout import (
    _INF_BITS,
    _NO_MIN_BITS,
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
    EXP_MAX,
    EXP_MIN,
    LAYOUT,
    N_BINS,
    f64_value,
)


@dataclass
class RowStats:
    """Host-side statistics of one row, unscaled where noted."""

    numel: int
    zeros: int
    nan: int
    inf: int
    absmax: float  # unscaled; nan when no finite value (all nan/inf, or empty)
    absmin: float  # unscaled; nan when no nonzero finite value
    hist: np.ndarray  # counts per unscaled exponent, index i <-> exponent exponents[i]
    exponents: np.ndarray
    underflow: dict[str, int]  # at the scale in effect
    overflow: dict[str, int]  # at the scale in effect (finite values only)
    underflow_cs: dict[str, int]  # fp8 formats under per-tensor current scaling (summed over calls)


def decode(row: np.ndarray, scale: float = 1.0) -> RowStats:
    """Turn one buffer row into counts and the unscaled histogram.

    ``scale`` is the loss scale the values carried (1 in the forward pass). The histogram is shifted by
    log2(scale) when it is a power of two (exact); otherwise by the rounded log2, so a value may land one bin
    off (the exact bin needs the value's mantissa against the scale's, which only the row's kernel saw; the
    README's ``histograms`` table and ``capture.histogram_shift_exact`` say so).
    """
    hist = row[COL_HIST : COL_HIST + N_BINS].astype(np.int64)
    zeros = int(row[COL_ZEROS])
    nan = int(row[COL_NAN])
    inf = int(row[COL_INF])
    underflow: dict[str, int] = {}
    overflow: dict[str, int] = {}
    for i, name in enumerate(formats.WHATIF_FORMATS):
        idx = LAYOUT.underflow_exps[i] - EXP_MIN  # values <= 2^j: every bin below j, and exactly 2^j
        underflow[name] = int(hist[: max(idx, 0)].sum() + row[COL_POW2_AT + i])
        overflow[name] = int(row[COL_OVERFLOW + i]) - inf
    absmax_bits = int(row[COL_ABSMAX_BITS])
    absmin_bits = int(row[COL_ABSMIN_BITS]) + 1 if int(row[COL_ABSMIN_BITS]) != _NO_MIN_BITS else 0
    # the largest finite |x|: none in a row without a finite value (every value nan or inf, over every call
    # merged into it), NaN as absmin's, not 0.0, which reads as a tensor of zeros; decided from the counts, so
    # a call with finite values merged beside one without keeps its largest
    finite = int(row[COL_NUMEL]) - nan - inf > 0
    raw_absmax = (f64_value(absmax_bits) if absmax_bits > 0 else 0.0) if finite else math.nan
    raw_absmin = f64_value(absmin_bits) if 0 < absmin_bits < _INF_BITS else math.nan
    # fp8 current scaling (each accumulated tensor scaled by its own 2^floor(log2(fmax / max(amax, 1e-12))))
    underflow_cs = {name: int(row[COL_UNDERFLOW_CS + i]) for i, name in enumerate(formats.FP8_FORMATS)}
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
