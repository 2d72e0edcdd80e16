"""A sampled step's rows, kept as the copy brought them and decoded into the columns of the ``layers`` and
``histograms`` tables when those are read (arrays, not frames: ``tables()`` joins them), the block-format
accumulator into the layers table's ``BLOCK_COLUMNS``."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from precprof import stats as st
from precprof import tables as T
from precprof.capture import records
from precprof.capture.records import RowTable
from precprof.formats import FP8_FORMATS, WHATIF_FORMATS

# the float64 sums of a block statistic scale with the square of the values (sum_x2, sum_err2)
_SQUARED_STATS = frozenset({"sum_x2", "sum_err2"})


class HeldRows(NamedTuple):
    """A sampled step's rows on the host: ``counts`` [rows, COL_HIST], the histogram columns from bin ``wlo``
    on (``window``, [rows, w]; the bins outside it are zeros), and the block accumulator's ``slots`` ([slots, 2,
    recipes, stats]; ``StatsBuffer.block_slot`` says each row's). The CPU's rows are held so; a dense copy is
    its first ``COL_HIST`` columns, the rest from bin 0."""

    counts: np.ndarray
    window: np.ndarray
    wlo: int
    slots: np.ndarray


class StepRows:
    """A sampled step's rows as its copy brought them, kept compact, and decoded into the columns of the layers
    and histograms tables only when those are read (``decode``: by ``tables()``, the stream writer's thread or
    the live dashboards). Decoding costs a sampled step more than keeping its numbers does, and the compact form
    is smaller than the decoded one: the active rows' counts, the histogram bins any row uses (tens of the
    277), and the block statistics of the rows evaluated this step.

    ``active``: the indices of the rows that took data; ``held``: the step's host rows (``rows`` says what
    each took); ``slot_of`` / ``seen``: each row's slot of the block accumulator and which rows were evaluated;
    gradient rows are unscaled by ``scale``, the loss scale in effect during the step's backward."""

    def __init__(
        self,
        step: int,
        rows: RowTable,
        active: np.ndarray,
        held: HeldRows,
        scale: float,
        order: dict[str, int],
        slot_of: np.ndarray,
        seen: np.ndarray,
    ) -> None:
        self.step, self.scale, self.order = step, scale, order
        self.fixed = rows.columns()  # made once per row table: shared, never copied
        self.active = active
        self.calls = np.asarray(rows.calls, dtype=np.int64)[active]
        self.dtype_bits = np.asarray(rows.dtype_bits, dtype=np.int64)[active]
        wlo = held.wlo
        # the bins any row uses (counts are >= 0; a row that took no data holds zeros, and could only widen
        # the range): read over every row in place, not over a copy of the active ones
        used = np.flatnonzero(np.bitwise_or.reduce(held.window, axis=0))
        self.lo, self.hi = (wlo + int(used[0]), wlo + int(used[-1]) + 1) if len(used) else (0, 0)
        # the active rows' counts, and their nonzero bins (a row's values span a few of the bins all rows use):
        # copies (the CPU's rows are handed over as held, and reset after this), never views
        self.counts = held.counts[active]
        window = (
            held.window[active, self.lo - wlo : self.hi - wlo].ravel() if len(used) else np.zeros(0, np.int64)
        )
        # positions in the [active, hi - lo] window, row by row (nonzero of a mask: 5x faster than of int64)
        self.bin_at = np.flatnonzero(window != 0)
        self.bin_counts = window[self.bin_at]
        # positions in ``active`` of the rows with block numbers
        self.evaluated = np.flatnonzero(seen[active])
        self.block_values = held.slots[slot_of[active[self.evaluated]]]

    @property
    def nbytes(self) -> int:
        kept = (self.active, self.calls, self.dtype_bits, self.counts, self.bin_at, self.bin_counts)
        return sum(int(a.nbytes) for a in (*kept, self.evaluated, self.block_values))

    def decode(self, arrow: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The layers columns of the active rows (their block columns included) and their histogram columns
        (None when every histogram is empty). ``arrow``: the text columns as Arrow strings, taken from the
        row table's texts made into Arrow once (the stream's tables: a list of Python strings per column and
        step took a third of the time of making them)."""
        n, w = len(self.active), self.hi - self.lo
        # the counts, then the bins lo..hi alone (every other bin is zero): not the rows' whole width
        window = np.zeros(n * w, dtype=np.int64)
        window[self.bin_at] = self.bin_counts
        data = np.empty((n, st.COL_HIST + w), dtype=np.int64)
        data[:, : st.COL_HIST] = self.counts
        data[:, st.COL_HIST :] = window.reshape(n, w)
        cols, hist = self._layer_columns(data, arrow)
        cols.update(self._block_columns())
        return cols, hist

    def _layer_columns(self, data: np.ndarray, arrow: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        fixed, active, step = self.fixed, self.active, self.step
        text = _arrow_texts(fixed) if arrow else _list_texts(fixed)
        n = len(active)
        scales = np.where(fixed["gradient"][active], self.scale, 1.0)
        d = st.decode_rows(data, scales, first_bin=self.lo)
        modules = fixed["module"][active]
        # per row the same few dtype texts: each distinct one made once
        bits, which = np.unique(self.dtype_bits, return_inverse=True)
        texts = np.array([records.dtype_text_of(int(b)) for b in bits], dtype=object)
        which = which.reshape(-1)
        order = self.order
        cols: dict[str, Any] = {
            T.STEP: np.full(n, step, dtype=np.int64),
            T.ORDER: np.array([order.get(m, -1) for m in modules], dtype=np.int64),
            T.MODULE: text("module", active),
            T.MODULE_TYPE: text("module_type", active),
            T.TENSOR: text("tensor", active),
            T.PARAM: text("param", active),
            T.DTYPE: pa.array(texts, pa.string()).take(which) if arrow else texts[which].tolist(),
            T.CALLS: self.calls,
            T.NUMEL: d["numel"],
            T.ZEROS: d["zeros"],
            T.NAN: d["nan"],
            T.INF: d["inf"],
            T.ABSMAX: d["absmax"],
            T.ABSMIN: d["absmin"],
            T.SCALE: scales,
            T.LOST_UPDATE_BF16: np.full(n, math.nan),
            T.LOST_UPDATE_FP16: np.full(n, math.nan),
        }
        for f in WHATIF_FORMATS:
            cols[T.underflow_col(f)] = d["underflow"][f]
            cols[T.overflow_col(f)] = d["overflow"][f]
        for f in FP8_FORMATS:
            cols[T.underflow_cs_col(f)] = d["underflow_cs"][f]
        # the nonzero bins: where the copy found them (row by row, in the window of the bins any row uses)
        if not len(self.bin_at):
            return cols, None
        r_idx, bins = np.divmod(self.bin_at, self.hi - self.lo)
        bins += self.lo
        at = active[r_idx]
        hist = {
            T.STEP: np.full(len(r_idx), step, dtype=np.int64),
            T.MODULE: text("module", at, False),
            T.TENSOR: text("tensor", at, False),
            T.PARAM: text("param", at, False),
            T.EXPONENT: st.EXP_MIN + bins - d["shift"][r_idx],
            T.COUNT: self.bin_counts.copy(),  # the hist columns outlive this step's rows, not shared
        }
        return cols, hist

    def _block_columns(self) -> dict[str, np.ndarray]:
        """The ``T.BLOCK_COLUMNS``: NaN but for the rows evaluated this step. Gradient rows were evaluated as
        they arrived, at the loss scale: their counts are those of the scaled values (what the low-precision
        GEMM reads), their sums are unscaled by ``scale**2`` like every other column."""
        sub = np.full(
            (len(self.active), *self.block_values.shape[1:]), math.nan
        )  # [active, 2, recipes, stats]
        if len(self.evaluated):
            values = self.block_values.astype(np.float64, copy=True)
            scale = self.scale
            if 0 < scale < math.inf and scale != 1.0:
                squared = np.array([s in _SQUARED_STATS for s in T.BLOCK_STATS])
                grad = self.fixed["gradient"][self.active[self.evaluated]]
                values[grad] /= np.where(squared, scale * scale, 1.0)
            sub[self.evaluated] = values
        out: dict[str, np.ndarray] = {}
        for o, orient in enumerate(T.BLOCK_ORIENTATIONS):
            for r, recipe in enumerate(T.BLOCK_RECIPES):
                for k, stat in enumerate(T.BLOCK_STATS):
                    out[T.block_col(recipe, stat, orient)] = sub[:, o, r, k]
        return out


_TEXTS = ("module", "module_type", "tensor", "param")
# per row table (its ``columns()``, made once and replaced when rows are added): its texts as Arrow strings
_ARROW_TEXTS: dict[int, tuple[np.ndarray, dict[str, pa.Array]]] = {}


def _list_texts(fixed: dict[str, np.ndarray]) -> Any:
    return lambda name, at, listed=True: fixed[name][at].tolist() if listed else fixed[name][at]


def _arrow_texts(fixed: dict[str, np.ndarray]) -> Any:
    """``fixed``'s text columns as Arrow strings, made once per row table and taken at ``at`` per step."""
    key = fixed["module"]
    held = _ARROW_TEXTS.get(id(key))
    if held is None or held[0] is not key:  # two threads may both make it: the same arrays
        if len(_ARROW_TEXTS) >= 8:
            _ARROW_TEXTS.clear()
        held = _ARROW_TEXTS[id(key)] = (key, {k: pa.array(fixed[k], pa.string()) for k in _TEXTS})
    made = held[1]
    return lambda name, at, listed=True: made[name].take(at)
