"""Per-tensor current scaling, the FP8 recipe every FP8 what-if assumes: each tensor is multiplied by
2^k, k = floor(log2(fmax / max(amax, 1e-12))) (torchao's tensorwise recipe with ``round_scales_to_power_of_2=True``,
whose amax floor of 1e-12 stops the scale growing for a tensor smaller than that; Transformer Engine's
current-scaling recipe with power-of-two scales, which has no floor; ``formats.current_scaling_exponent``), before
the cast. Both recipes' default scales, torchao's fmax / max(amax, 1e-12) and Transformer Engine's fmax / amax, are
at least 2^k: they flush no value this one keeps, so the counts and the lost norm here bound theirs from above.
Pure host-side numpy: the exponent of many tensors at once, and the window of log2 magnitudes a format keeps for
each.

Under this scaling nothing overflows (amax * 2^k <= fmax by construction) and a value x underflows iff
|x| * 2^k <= underflow_max, i.e. |x| <= 2^(log2(underflow_max) - k): the window slides with each tensor's own
largest value. It is the same for scaled gradients: a power-of-two loss scale s changes amax and every value by
s, so the unscaled histograms and the unscaled amax give the same k - log2(s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from precprof import formats
from precprof import tables as T
from precprof.formats import NumberFormat

# the scale every FP8 figure assumes, and whose recipes it is, in words (the FP8 finding's, the heatmaps' notes)
SCALE_WORDS = (
    f"2^floor(log2(fmax/max(amax, {formats.FP8_AMAX_FLOOR:g}))) per tensor: torchao's tensorwise recipe with "
    f"round_scales_to_power_of_2, {formats.FP8_AMAX_FLOOR:g} being its floor on amax; Transformer Engine's "
    "current-scaling recipe with power_2_scale, which has no floor and scales a tensor under it by more; their "
    f"default scales, fmax/max(amax, {formats.FP8_AMAX_FLOOR:g}) and fmax/amax, flush at most what this one does"
)


def exponents(fmt: NumberFormat, amax: np.ndarray) -> np.ndarray:
    """k = floor(log2(fmt.max / max(amax, 1e-12))) for each amax, exactly (float64 in, float64 out; nan where
    amax is not finite and positive). Exact: with amax = m_a 2^e_a and fmax = m_f 2^e_f (m in [0.5, 1)),
    amax 2^k <= fmax iff k <= e_f - e_a, less one when m_a > m_f; an amax under torchao's floor gets the floor's
    k (the scalar ``formats.current_scaling_exponent``)."""
    a = np.asarray(amax, dtype=float)
    ok = np.isfinite(a) & (a > 0)
    m_a, e_a = np.frexp(np.where(ok, np.maximum(a, formats.FP8_AMAX_FLOOR), 1.0))
    m_f, e_f = math.frexp(fmt.max)
    k = (e_f - e_a - (m_a > m_f)).astype(float)
    return np.where(ok, k, np.nan)


def under_floor(amax: np.ndarray) -> np.ndarray:
    """Whether each amax is under torchao's floor (``formats.FP8_AMAX_FLOOR``): such a tensor is scaled by
    less than its own amax would set, and flushes more (every value, for a gradient of 1e-23 in e5m2)."""
    a = np.asarray(amax, dtype=float)
    return np.isfinite(a) & (a > 0) & (a < formats.FP8_AMAX_FLOOR)


def underflow_limit_log2(fmt: NumberFormat, amax: np.ndarray) -> np.ndarray:
    """log2 of the largest unscaled magnitude that underflows ``fmt`` under current scaling of a tensor whose
    largest magnitude is ``amax``: values at or below 2^limit become 0 (an integer: underflow_max is a power of
    two for every format)."""
    return math.log2(fmt.underflow_max) - exponents(fmt, amax)


@dataclass(frozen=True)
class TensorWindow:
    """The log2 window a format keeps of one tensor under current scaling, in unscaled units: values at or below
    2^lo vanish, those below 2^normal_lo are subnormal (fewer significant bits), 2^hi is where the format would
    overflow (no value of the tensor reaches it: its largest lands at or below the format's max)."""

    lo: float
    normal_lo: float
    hi: float


def windows(fmt: str, amax: np.ndarray) -> list[TensorWindow | None]:
    """The window of ``fmt`` ("fp8_e4m3", "fp8_e5m2") for tensors of largest magnitude ``amax`` (None where
    amax is 0 or not finite: no scale)."""
    f = formats.get(fmt)
    k = exponents(f, np.asarray(amax, dtype=float))
    lo0, nlo0, hi0 = math.log2(f.underflow_max), math.log2(f.smallest_normal), math.log2(f.overflow_min)
    return [None if math.isnan(v) else TensorWindow(lo0 - v, nlo0 - v, hi0 - v) for v in k.tolist()]


def row_windows(
    layers: pd.DataFrame,
    kind: str,
    rows: Sequence[tuple[str, str]],
    fmts: Sequence[str] = formats.FP8_FORMATS,
) -> dict[str, list[TensorWindow | None]]:
    """Per format, the window each (module, param) row of tensor ``kind`` gets under current scaling, at the
    row's largest magnitude over the sampled steps (the step whose scale flushes the most: the window the
    verdict's worst step assumes). None for a row without a finite nonzero absmax. What the report's heatmaps
    draw per row instead of a window at scale 1, which no FP8 recipe uses."""
    sel = layers.loc[layers[T.TENSOR] == kind, [T.MODULE, T.PARAM, T.ABSMAX]]
    amax_of: dict[tuple[str, str], float] = {}
    if not sel.empty:
        a = pd.to_numeric(sel[T.ABSMAX], errors="coerce")
        g = a.groupby([T.texts(sel[T.MODULE]).astype(object), T.texts(sel[T.PARAM]).astype(object)]).max()
        amax_of = {(str(m), str(p)): float(v) for (m, p), v in g.items()}
    amax = np.array([amax_of.get((str(m), str(p)), math.nan) for m, p in rows], dtype=float)
    return {f: windows(f, amax) for f in fmts}
