"""A sampled step's rows, decoded into the columns of the ``layers`` and ``histograms`` tables (arrays, not
frames: building frames in the training loop would cost milliseconds per sampled step; ``tables()`` joins
them), and the block-format accumulator into the layers table's ``BLOCK_COLUMNS``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from precprof import stats as st
from precprof import tables as T
from precprof.capture.records import RowInfo, RowTable
from precprof.formats import FP8_FORMATS, WHATIF_FORMATS


def layer_columns(
    step: int,
    rows: RowTable,
    active: Sequence[RowInfo],
    data: np.ndarray,
    scale: float,
    order: dict[str, int],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The layers columns of the ``active`` rows of ``data`` (the step's host rows; ``rows`` says what each
    took) and their histogram columns (None when every histogram is empty). Gradient rows are unscaled by
    ``scale``, the loss scale in effect during the step's backward."""
    scales = np.array([scale if r.tensor in T.GRADIENT_KINDS else 1.0 for r in active])
    d = st.decode_rows(data[[r.index for r in active]], scales)
    cols: dict[str, Any] = {
        T.STEP: np.full(len(active), step, dtype=np.int64),
        T.ORDER: np.array([order.get(r.module, -1) for r in active], dtype=np.int64),
        T.MODULE: [r.module for r in active],
        T.MODULE_TYPE: [r.module_type for r in active],
        T.TENSOR: [r.tensor for r in active],
        T.PARAM: [r.param for r in active],
        T.DTYPE: ["|".join(rows.dtypes(r.index)) for r in active],
        T.CALLS: np.array([rows.calls[r.index] for r in active], dtype=np.int64),
        T.NUMEL: d["numel"],
        T.ZEROS: d["zeros"],
        T.NAN: d["nan"],
        T.INF: d["inf"],
        T.ABSMAX: d["absmax"],
        T.ABSMIN: d["absmin"],
        T.SCALE: scales,
        T.LOST_UPDATE_BF16: np.full(len(active), math.nan),
        T.LOST_UPDATE_FP16: np.full(len(active), math.nan),
    }
    for f in WHATIF_FORMATS:
        cols[T.underflow_col(f)] = d["underflow"][f]
        cols[T.overflow_col(f)] = d["overflow"][f]
    for f in FP8_FORMATS:
        cols[T.underflow_cs_col(f)] = d["underflow_cs"][f]
    r_idx, bins = np.nonzero(d["hist"])
    if not len(r_idx):
        return cols, None
    hist = {
        T.STEP: np.full(len(r_idx), step, dtype=np.int64),
        T.MODULE: np.array(cols[T.MODULE], dtype=object)[r_idx],
        T.TENSOR: np.array(cols[T.TENSOR], dtype=object)[r_idx],
        T.PARAM: np.array(cols[T.PARAM], dtype=object)[r_idx],
        T.EXPONENT: st.EXP_MIN + bins - d["shift"][r_idx],
        T.COUNT: d["hist"][r_idx, bins],
    }
    return cols, hist


# the float64 sums of a block statistic scale with the square of the values (sum_x2, sum_err2)
_SQUARED_STATS = frozenset({"sum_x2", "sum_err2"})


def block_columns(
    active: Sequence[RowInfo], blocks: np.ndarray, seen: np.ndarray, scale: float
) -> dict[str, np.ndarray]:
    """The ``T.BLOCK_COLUMNS`` of the ``active`` rows from the step's block accumulator (float64 [rows,
    orientation, recipe, stat], ``StatsBuffer.blocks_to_host``) and ``seen`` (rows evaluated; the others are
    NaN). Gradient rows were evaluated as they arrived, at loss scale ``scale``: their counts are those of the
    scaled values (what the low-precision GEMM reads), their sums are unscaled by ``scale**2`` like every
    other column."""
    idx = np.array([r.index for r in active], dtype=np.int64)
    sub = blocks[idx].astype(np.float64, copy=True)  # [active, 2, recipes, stats]
    grad = np.array([r.tensor in T.GRADIENT_KINDS for r in active], dtype=bool)
    squared = np.array([s in _SQUARED_STATS for s in T.BLOCK_STATS])
    if 0 < scale < math.inf and scale != 1.0:
        sub[grad] /= np.where(squared, scale * scale, 1.0)
    sub[~seen[idx]] = math.nan
    out: dict[str, np.ndarray] = {}
    for o, orient in enumerate(T.BLOCK_ORIENTATIONS):
        for r, recipe in enumerate(T.BLOCK_RECIPES):
            for s, stat in enumerate(T.BLOCK_STATS):
                out[T.block_col(recipe, stat, orient)] = sub[:, o, r, s]
    return out
