"""What a block recipe loses on one operand of one linear layer (rules/blocks.py judges it): the layers table's
block columns summed over the sampled steps, and the share of the operand's L2 norm lost to flushing and
saturation, bounded per sampled step and read as the median over them (the measure every what-if is judged by,
``analysis.lost_norm``).

The norm bound of one tensor and recipe: a value the recipe flushes is at most ``u * smax`` (u: the element
format's largest value that rounds to 0, smax: the largest block scale any block of a tensor of largest
magnitude A can get), so the ``flushed`` values (an exact count) carry at most the energy of that many of the
tensor's largest values below it, each at its binade's upper edge (the histogram); a saturated value (one that
rounds past the element max; a value clamped to the max that rounds to it anyway loses only its rounding, and
is not counted) is clamped by at most ``rho`` of itself (rho: how far above the element max a block's scaled
values can reach) and is among the tensor's largest, so the ``saturated`` values lose at most rho^2 times the energy of that many of
its largest values. Both are at most the recorded error sum, sum (x - q)^2, which bounds them again. Divided by
the exact sum x^2: an upper bound, never an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof.analysis import lost_norm
from precprof.analysis.advisor.evidence import _row_index


@dataclass(frozen=True)
class RecipeBounds:
    """What bounds a recipe's losses: log2 of the element format's largest value that rounds to 0 (relative to
    the block scale), the largest block scale as a multiple of the tensor's largest magnitude, or ``scale_floor``
    when that is larger (a scale cannot go below it: tiny tensors get it), and the largest share of a value that
    saturation can clamp off."""

    underflow_log2: float
    scale_max: float
    rho: float
    scale_floor: float = 2.0**-127 * (1 + 2.0**-20)  # E8M0's smallest scale


def _mx_floor(underflow_log2: float, elem_max: float) -> RecipeBounds:
    # scale 2^(floor(log2 amax_block) - emax): at most amax_block / 2^emax; a block's values reach below
    # 2^(emax + 1) once scaled, and are clamped to the element max
    emax = math.floor(math.log2(elem_max))
    return RecipeBounds(underflow_log2, 2.0**-emax, 1.0 - elem_max / 2.0 ** (emax + 1))


_EPS = 2.0**-20  # fp32 arithmetic in the scale computations, with room to spare
# The layers table's block recipes (tables.BLOCK_RECIPES), from precprof.block_formats' rules (a test checks
# them against its recipes): E4M3 flushes at or below 2^-10, E5M2 2^-17, FP6 E2M3 2^-4, FP6 E3M2 2^-5, FP4 E2M1
# 2^-2. rceil: scale 2^ceil(log2(fl(amax / max))) < 2 amax / max, nothing goes above the max beyond fp32's
# rounding of that division (which rounds to the max: nothing saturates). NVFP4: scale p * s, p = amax_tensor /
# 2688, s the E4M3 rounding (within 2^-4) of amax_block / 6 / p, at least 2^-6: at most amax_tensor * max(1/6 *
# (1 + 2^-4), 1 / (2688 * 64)); a block's scaled values reach 6 / (1 - 2^-4), below the tie 7: nothing
# saturates (rho stays a bound all the same). No scale goes below its format's smallest (E8M0 2^-127; NVFP4's
# clamped per-tensor scale times E4M3's 448 at most), however small the tensor. An rceil block at 2^-127 is cast
# unscaled (Transformer Engine's factor of 1, block_formats): all of it flushes, values up to 448 * 2^-127, the
# flush limit of a scale of 448 * 2^-117.
RECIPE_BOUNDS: dict[str, RecipeBounds] = {
    "mxfp8_e4m3": _mx_floor(-10.0, 448.0),
    "mxfp8_e4m3_rceil": RecipeBounds(
        -10.0, 2.0 / 448.0 * (1 + _EPS), 2.0**-21, 448.0 * 2.0**-117 * (1 + _EPS)
    ),
    "mxfp8_e5m2": _mx_floor(-17.0, 57344.0),
    "mxfp6_e2m3": _mx_floor(-4.0, 7.5),
    "mxfp6_e3m2": _mx_floor(-5.0, 28.0),
    "mxfp4": _mx_floor(-2.0, 6.0),
    "nvfp4": RecipeBounds(
        -2.0, max(1.0 / 6.0 * (1 + 2.0**-4), 1.0 / (2688 * 64)) * (1 + _EPS), 2.0**-4 * (1 + _EPS)
    ),
}


@dataclass
class OperandLoss:
    """What one recipe loses on one operand of one layer, summed over the sampled steps; ``lost_norm``: the
    median over those steps of the bound of the share of its L2 norm lost to flushing and saturation."""

    operand: str
    orientation: str
    gemm: str
    nonzero: float  # finite nonzero values of the rows evaluated
    flushed: float
    saturated: float
    poisoned: float
    sum_x2: float
    sum_err2: float
    lost_norm: float = math.nan
    values: float = 0.0  # every value of the rows evaluated, those in nan/inf blocks included

    @property
    def label(self) -> str:
        return f"{self.operand} ({self.gemm})"

    @property
    def flushed_share(self) -> float:
        return self.flushed / self.nonzero if self.nonzero > 0 else 0.0

    @property
    def saturated_share(self) -> float:
        return self.saturated / self.nonzero if self.nonzero > 0 else 0.0

    @property
    def poisoned_share(self) -> float:
        """The share of its values in blocks that held a nan or inf: left out of every other number (1: nothing
        was measured, its SQNR of inf says nothing)."""
        return self.poisoned / self.values if self.values > 0 else 0.0

    @property
    def sqnr_db(self) -> float:
        """10 log10(sum x^2 / sum err^2); inf when nothing was lost (an all-zero operand included); nan when a
        sum is not finite (a tensor the recipe cannot quantise: NVFP4 of values so small that the per-tensor
        scale underflows fp32)."""
        if not (math.isfinite(self.sum_x2) and math.isfinite(self.sum_err2)):
            return math.nan
        if self.sum_err2 <= 0.0:
            return math.inf
        if self.sum_x2 <= 0.0:
            return -math.inf
        return 10.0 * math.log10(self.sum_x2 / self.sum_err2)


@dataclass
class RecipeSummary:
    """A recipe over a layer's operands: the worst SQNR (and its operand), the largest shares."""

    sqnr_db: float
    worst: str
    flushed_share: float
    saturated_share: float
    poisoned: float
    lost_norm: float = math.nan
    poisoned_share: float = 0.0  # the largest over its operands
    measured: bool = True  # some operand had a block without nan/inf


@dataclass
class LayerBlocks:
    """One linear layer: its operands' losses per recipe, where its input came from, and the plan's choice."""

    module: str
    module_type: str
    input_from: str | None
    losses: dict[str, list[OperandLoss]] = field(default_factory=dict)
    choice: str = ""
    why: str = ""  # why the better formats were not chosen
    # the output head (blocks._head_of: the matmul that made the model's output): never planned in FP4
    head: bool = False
    # the lengths its three GEMMs reduce along (in_features, out_features, tokens per call), None where unknown:
    # a block-scaled GEMM needs each a multiple of its blocks
    axes: dict[str, int | None] = field(default_factory=dict)
    # (step, calls, their tokens in all) where its calls had different tokens on a step: its tokens axis is then
    # the largest number dividing each call's, which may be no call's count
    uneven_calls: tuple[int, int, int] | None = None
    # every sampled step's (step, the largest number dividing each call's tokens, calls, their tokens in all):
    # each block size is judged on every step's calls (``_Fp8Shape.step_calls``); empty where the run does not
    # tell, when ``axes``' tokens and ``uneven_calls`` are judged
    step_calls: tuple[tuple[int, int, int, int], ...] = ()
    # its output gradient's blocks were evaluated on steps the loss scaler skipped alone (left out): its backward
    # GEMMs are judged on their other operands
    gradient_skipped: bool = False
    # the embedding whose weight it shares (an output head tied to it): kept in bf16, as FP8 keeps it
    tied_to: str | None = None
    # how its weight is computed (weight_norm, spectral_norm: ``taxonomy.computed_weight_of``), "" where it is
    # held: kept in bf16, as FP8 keeps it, as a block-scaled conversion fails on it
    computed_weight: str = ""
    # its own operands were evaluated (``blocks._turn_came``); a layer kept in bf16 whatever its numbers (tied,
    # computed) has its place in the plan without
    evaluated: bool = True

    def summary(self, recipe: str) -> RecipeSummary | None:
        ops = self.losses.get(recipe) or []
        if not ops:
            return None
        # (an operand every block of which held nan/inf has an SQNR of inf from sums of 0: a measured one first)
        worst = min(
            ops, key=lambda o: (-math.inf if math.isnan(o.sqnr_db) else o.sqnr_db, o.poisoned_share >= 1.0)
        )
        norms = [o.lost_norm for o in ops if not math.isnan(o.lost_norm)]
        return RecipeSummary(
            worst.sqnr_db,
            worst.label,
            max(o.flushed_share for o in ops),
            max(o.saturated_share for o in ops),
            sum(o.poisoned for o in ops),
            max(norms) if norms else math.nan,
            max(o.poisoned_share for o in ops),
            any(o.poisoned_share < 1.0 for o in ops),
        )

    @property
    def operands_evaluated(self) -> int:
        return max((len(v) for v in self.losses.values()), default=0)


def db_text(v: float, floor: float | None = None) -> str:
    """An SQNR as the page and the messages write it: "31.2 dB", "lossless" for inf, "not finite" for nan.
    Beside a rule's ``floor``, as many more digits as show which side of it the value is ("SQNR 17.99 dB", not
    "SQNR 18.0 dB" said to fail "at least 18 dB"); the page's ``report.blocks.db_text`` writes it the same."""
    if math.isnan(v):
        return "not finite"
    if v == math.inf:
        return "lossless"
    digits = 1
    while floor is not None and digits < 4 and (float(f"{v:.{digits}f}") >= floor) != (v >= floor):
        digits += 1
    return f"{v:.{digits}f} dB"


class Columns:
    """The layers table's numeric columns as float arrays, each converted once, when first read; and, from the
    histograms, each row's bound of the norm a recipe loses (``lost_norm``), computed once per recipe and
    orientation for the rows that have block statistics."""

    def __init__(self, layers: pd.DataFrame, hist: pd.DataFrame | None = None) -> None:
        self.layers = layers
        self.hist = hist
        self._done: dict[str, np.ndarray] = {}
        self._hist_rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def get(self, name: str) -> np.ndarray | None:
        got = self._done.get(name)
        if got is None and name in self.layers:
            col = pd.to_numeric(self.layers[name], errors="coerce")
            got = self._done[name] = col.to_numpy(dtype=float, na_value=np.nan)
        return got

    def _histogram_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(exponent, count, index of the layers row) of the histogram rows of layers rows with block
        statistics; no rows without a histograms table."""
        if self._hist_rows is not None:
            return self._hist_rows
        empty = (np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
        h = self.hist
        cols = [c for c in T.BLOCK_COLUMNS if c in self.layers and c.endswith("_flushed")]
        if h is None or h.empty or not cols:
            self._hist_rows = empty
            return empty
        has = np.zeros(len(self.layers), dtype=bool)
        for c in cols:
            has |= ~np.isnan(self.get(c))  # type: ignore[arg-type]
        rows = np.flatnonzero(has)
        at = _row_index(h, self.layers.iloc[rows])  # each histogram row's position among ``rows``
        ok = at >= 0
        self._hist_rows = (
            h[T.EXPONENT].to_numpy(dtype=float)[ok],
            h[T.COUNT].to_numpy(dtype=float)[ok],
            rows[at[ok]],
        )
        return self._hist_rows

    def lost_norm(self, recipe: str, orientation: str) -> np.ndarray:
        """Per layers row: the bound of the share of the tensor's L2 norm ``recipe`` loses to flushing and
        saturation along ``orientation`` (nan where the recipe was not evaluated or the tensor has no energy).
        Without a histogram of the row, each flushed value is taken at the limit and each saturated one at the
        tensor's largest magnitude."""
        name = f"lost_norm:{recipe}:{orientation}"
        got = self._done.get(name)
        if got is not None:
            return got
        n = len(self.layers)
        nan = np.full(n, math.nan)
        flushed = self.get(T.block_col(recipe, "flushed", orientation))
        saturated = self.get(T.block_col(recipe, "saturated", orientation))
        x2 = self.get(T.block_col(recipe, "sum_x2", orientation))
        err2 = self.get(T.block_col(recipe, "sum_err2", orientation))
        amax = self.get(T.ABSMAX)
        bounds = RECIPE_BOUNDS.get(recipe)
        if (
            flushed is None
            or saturated is None
            or x2 is None
            or err2 is None
            or amax is None
            or bounds is None
        ):
            self._done[name] = nan
            return nan
        e, c, g = self._histogram_rows()
        smax = np.maximum(amax * bounds.scale_max, bounds.scale_floor)
        limit = bounds.underflow_log2 + np.log2(np.where(amax > 0, smax, np.nan))
        with np.errstate(invalid="ignore", divide="ignore"):
            flush_up, _, _ = lost_norm.lost_energy_bound(e, c, g, limit, lost=np.nan_to_num(flushed))
            top_up, _ = lost_norm.top_energy_bound(e, c, g, n, np.nan_to_num(saturated))
        # without the row's histogram: every flushed value is at most the limit, every saturated one at most A
        in_hist = np.bincount(g, minlength=n)[:n] > 0
        f_cnt, s_cnt = np.nan_to_num(flushed), np.nan_to_num(saturated)
        a2 = np.nan_to_num(amax) ** 2
        coarse_flush = f_cnt * np.exp2(2 * np.nan_to_num(limit, nan=-np.inf))
        flush_up = np.where(in_hist, np.minimum(flush_up, coarse_flush), coarse_flush)
        top_up = np.where(in_hist, np.minimum(top_up, s_cnt * a2), s_cnt * a2)
        lost = flush_up + bounds.rho**2 * top_up
        lost = np.minimum(lost, np.where(np.isfinite(err2), err2, np.inf))
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(
                x2 > 0, np.sqrt(np.clip(lost / x2, 0.0, 1.0)), np.where(np.isnan(x2), np.nan, 0.0)
            )
        share = np.where(np.isnan(flushed), np.nan, share)
        self._done[name] = share
        return share


class Rows:
    """Some rows of the layers table, their columns read as float arrays on first use (``losses`` reads a few
    of the 70 block columns per layer; 2,700 selections of pandas columns took half a second on a thousand
    sampled steps)."""

    def __init__(self, columns: Columns, index: np.ndarray) -> None:
        self.columns, self.index, self.n = columns, index, len(index)
        self._cols: dict[str, np.ndarray] = {}

    def col(self, name: str) -> np.ndarray:
        """The column ``name`` of these rows (all nan when the table has no such column)."""
        got = self._cols.get(name)
        if got is None:
            full = self.columns.get(name)
            got = self._cols[name] = full[self.index] if full is not None else np.full(self.n, math.nan)
        return got

    def lost_norm(self, recipe: str, orientation: str) -> np.ndarray:
        return self.columns.lost_norm(recipe, orientation)[self.index]

    def nonzero(self) -> np.ndarray:
        """Finite nonzero values per row, as _nonzero counts them: clipped at 0 row by row (read once: every
        recipe and orientation of these rows reads it)."""
        got = self._cols.get(_NONZERO)
        if got is None:
            got = self._cols[_NONZERO] = np.clip(
                self.col(T.NUMEL) - self.col(T.ZEROS) - self.col(T.NAN) - self.col(T.INF), 0, None
            )
        return got


_NONZERO = " nonzero"  # Rows.nonzero's entry among its columns (no column of the table is named so)


def _median(values: np.ndarray) -> float:
    """``np.median`` of a few values without NaN (nan for none), without its general machinery: called per
    layer, operand and recipe."""
    n = len(values)
    if not n:
        return math.nan
    s = np.sort(values)
    k = n // 2
    return float(s[k]) if n % 2 else float((s[k - 1] + s[k]) / 2)


def losses(rows: Rows, operand: str, orientation: str, gemm: str, recipe: str) -> OperandLoss | None:
    """The recipe's stats summed over ``rows`` where it was evaluated (None where it never was), and the median
    of its per-step norm bound."""
    if not rows.n:
        return None
    sel = ~np.isnan(rows.col(T.block_col(recipe, "flushed", orientation)))
    if not sel.any():
        return None

    def total(stat: str) -> float:
        # a nan sum (block_formats could not quantise the tensor) stays nan: it must not read as no error
        return float(rows.col(T.block_col(recipe, stat, orientation))[sel].sum())

    # finite nonzero values, as _nonzero counts them: clipped at 0 row by row, a row without counts skipped
    nonzero = rows.nonzero()
    norms = rows.lost_norm(recipe, orientation)[sel]
    norms = norms[~np.isnan(norms)]
    return OperandLoss(
        operand,
        orientation,
        gemm,
        float(np.nansum(nonzero[sel])),
        total("flushed"),
        total("saturated"),
        total("poisoned"),
        total("sum_x2"),
        total("sum_err2"),
        _median(norms),
        float(np.nansum(rows.col(T.NUMEL)[sel])),
    )
