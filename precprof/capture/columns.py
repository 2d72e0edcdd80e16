"""A sampled step's rows, decoded into the columns of the ``layers`` and ``histograms`` tables (arrays, not
frames: building frames in the training loop would cost milliseconds per sampled step; ``tables()`` joins
them), and the block-format accumulator into the layers table's ``BLOCK_COLUMNS``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from precprof import stats as st
from precprof import tables as T
from precprof.capture import records
from precprof.capture.records import RowTable
from precprof.formats import FP8_FORMATS, WHATIF_FORMATS


def layer_columns(
    step: int,
    rows: RowTable,
    active: np.ndarray,
    data: np.ndarray,
    scale: float,
    order: dict[str, int],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The layers columns of the ``active`` rows (their indices) of ``data`` (the step's host rows; ``rows`` says
    what each took) and their histogram columns (None when every histogram is empty). Gradient rows are unscaled
    by ``scale``, the loss scale in effect during the step's backward."""
    fixed = rows.columns()
    n = len(active)
    # every row decoded and the active ones picked from the decoded columns: copying the active rows out of
    # ``data`` (hundreds of rows of ~300 int64) cost more than decoding the few inactive ones
    every = n == len(data)

    def pick(a: np.ndarray) -> np.ndarray:
        return a if every else a[active]

    d = st.decode_rows(data, np.where(fixed["gradient"], scale, 1.0))
    scales = pick(np.where(fixed["gradient"], scale, 1.0))
    modules = fixed["module"][active]
    # per row the same few dtype texts: each distinct one made once
    bits, which = np.unique(np.asarray(rows.dtype_bits, dtype=np.int64)[active], return_inverse=True)
    texts = np.array([records.dtype_text_of(int(b)) for b in bits], dtype=object)
    cols: dict[str, Any] = {
        T.STEP: np.full(n, step, dtype=np.int64),
        T.ORDER: np.array([order.get(m, -1) for m in modules], dtype=np.int64),
        T.MODULE: modules.tolist(),
        T.MODULE_TYPE: fixed["module_type"][active].tolist(),
        T.TENSOR: fixed["tensor"][active].tolist(),
        T.PARAM: fixed["param"][active].tolist(),
        T.DTYPE: texts[which.reshape(-1)].tolist(),
        T.CALLS: np.asarray(rows.calls, dtype=np.int64)[active],
        T.NUMEL: pick(d["numel"]),
        T.ZEROS: pick(d["zeros"]),
        T.NAN: pick(d["nan"]),
        T.INF: pick(d["inf"]),
        T.ABSMAX: pick(d["absmax"]),
        T.ABSMIN: pick(d["absmin"]),
        T.SCALE: scales,
        T.LOST_UPDATE_BF16: np.full(n, math.nan),
        T.LOST_UPDATE_FP16: np.full(n, math.nan),
    }
    for f in WHATIF_FORMATS:
        cols[T.underflow_col(f)] = pick(d["underflow"][f])
        cols[T.overflow_col(f)] = pick(d["overflow"][f])
    for f in FP8_FORMATS:
        cols[T.underflow_cs_col(f)] = pick(d["underflow_cs"][f])
    # the nonzero bins, looked for only between the first and the last column any row uses (a row's values
    # span tens of the 277 bins): the same (row, bin) pairs in the same order, at a third of the cost
    lo, hi = d["hist_used"]
    if hi <= lo:
        return cols, None
    at, bins = np.nonzero(d["hist"][:, lo:hi])
    if not every:  # the active rows' bins alone
        keep = np.zeros(len(data), dtype=bool)
        keep[active] = True
        keep = keep[at]
        at, bins = at[keep], bins[keep]
        if not len(at):
            return cols, None
    bins += lo
    hist = {
        T.STEP: np.full(len(at), step, dtype=np.int64),
        T.MODULE: fixed["module"][at],
        T.TENSOR: fixed["tensor"][at],
        T.PARAM: fixed["param"][at],
        T.EXPONENT: st.EXP_MIN + bins - d["shift"][at],
        T.COUNT: d["hist"][at, bins],
    }
    return cols, hist


# the float64 sums of a block statistic scale with the square of the values (sum_x2, sum_err2)
_SQUARED_STATS = frozenset({"sum_x2", "sum_err2"})


def block_columns(
    rows: RowTable, active: np.ndarray, blocks: np.ndarray, seen: np.ndarray, scale: float
) -> dict[str, np.ndarray]:
    """The ``T.BLOCK_COLUMNS`` of the ``active`` rows (their indices) from the step's block accumulator (float64
    [rows, orientation, recipe, stat], ``StatsBuffer.blocks_to_host``) and ``seen`` (rows evaluated; the others
    are NaN). Gradient rows were evaluated as they arrived, at loss scale ``scale``: their counts are those of
    the scaled values (what the low-precision GEMM reads), their sums are unscaled by ``scale**2`` like every
    other column."""
    # NaN but for the rows evaluated this step (a few of the layers, in turn): only those are copied
    sub = np.full((len(active), *blocks.shape[1:]), math.nan)  # [active, 2, recipes, stats]
    evaluated = np.flatnonzero(seen[active])
    if len(evaluated):
        values = blocks[active[evaluated]].astype(np.float64, copy=True)
        if 0 < scale < math.inf and scale != 1.0:
            squared = np.array([s in _SQUARED_STATS for s in T.BLOCK_STATS])
            grad = rows.columns()["gradient"][active[evaluated]]
            values[grad] /= np.where(squared, scale * scale, 1.0)
        sub[evaluated] = values
    out: dict[str, np.ndarray] = {}
    for o, orient in enumerate(T.BLOCK_ORIENTATIONS):
        for r, recipe in enumerate(T.BLOCK_RECIPES):
            for s, stat in enumerate(T.BLOCK_STATS):
                out[T.block_col(recipe, stat, orient)] = sub[:, o, r, s]
    return out
