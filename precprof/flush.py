"""What a flush of the Profiler holds on the host, and how it becomes the stream's tables: a sampled step's rows
as its copy brought them (``StepRows``, decoded into the columns of the ``layers`` and ``histograms`` tables
only when those are read), the steps and memory rows, and ``Flush``, which holds one flush of them and makes
its Arrow tables.

Free of torch, so that the stream's writer process (``precprof.stream_child``) decodes and writes a flush the
training process hands it pickled: the training's thread keeps only the copy and the hand-over."""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa

from precprof import tables as T
from precprof.formats import FP8_FORMATS, WHATIF_FORMATS
from precprof.rowlayout import COL_HIST, EXP_MIN, decode_rows

if TYPE_CHECKING:
    from precprof.capture.records import RowTable

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
    and histograms tables only when those are read (``decode``: by ``tables()``, the stream's writer process
    or thread, or the live dashboards). Decoding costs a sampled step more than keeping its numbers does, and
    the compact form is smaller than the decoded one: the active rows' counts, the histogram bins any row uses
    (tens of the 277), and the block statistics of the rows evaluated this step.

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
        self.numel_gcd = np.asarray(rows.numel_gcd, dtype=np.int64)[active]
        self.dtype_names = rows.known_dtypes  # what the bits say, for a decoder in another process
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
        kept = (
            self.active,
            self.calls,
            self.dtype_bits,
            self.numel_gcd,
            self.counts,
            self.bin_at,
            self.bin_counts,
        )
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
        data = np.empty((n, COL_HIST + w), dtype=np.int64)
        data[:, :COL_HIST] = self.counts
        data[:, COL_HIST:] = window.reshape(n, w)
        cols, hist = self._layer_columns(data, arrow)
        cols.update(self._block_columns())
        return cols, hist

    def _layer_columns(self, data: np.ndarray, arrow: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        fixed, active, step = self.fixed, self.active, self.step
        text = _arrow_texts(fixed) if arrow else _list_texts(fixed)
        n = len(active)
        scales = np.where(fixed["gradient"][active], self.scale, 1.0)
        d = decode_rows(data, scales, first_bin=self.lo)
        modules = fixed["module"][active]
        # per row the same few dtype texts: each distinct one made once
        bits, which = np.unique(self.dtype_bits, return_inverse=True)
        names = self.dtype_names
        texts = np.array(
            ["|".join(n for i, n in enumerate(names) if int(b) >> i & 1) for b in bits], dtype=object
        )
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
            T.LOST_UPDATE_HELD: np.full(n, math.nan),
            T.NUMEL_GCD: np.where(self.numel_gcd > 0, self.numel_gcd, math.nan),  # (0: not recorded)
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
            T.EXPONENT: EXP_MIN + bins - d["shift"][r_idx],
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


@dataclass
class Flush:
    """The rows one flush copied to the host: the steps since the last flush and, after a sampled step, its
    layer and histogram columns and memory rows."""

    step_rows: list[dict[str, Any]] = field(default_factory=list)
    # columns, or a sampled step's rows not decoded yet (``StepRows``): ``decoded`` decodes them
    layer_parts: list[dict[str, Any] | StepRows] = field(default_factory=list)
    hist_parts: list[dict[str, Any]] = field(default_factory=list)
    memory_rows: list[dict[str, Any]] = field(default_factory=list)
    # ``decoded`` may run on two threads at once: the stream writer's (where the thread writes) and the live
    # dashboards'
    _decoding: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # ``arrow()``'s tables, made once (by the writer process; where the thread writes, on the training thread
    # before the flush is queued: ``StreamWriter.put``)
    _arrow: dict[str, pa.Table] | None = field(default=None, repr=False, compare=False)
    # the flush pickled for the stream's writer process, and the shared objects it refers to by key
    # (``precprof.stream_child.Wire.encode``, on the training thread, before the flush is queued)
    _wire: tuple[bytes, dict[int, Any]] | None = field(default=None, repr=False, compare=False)

    @property
    def empty(self) -> bool:
        return not (self.step_rows or self.layer_parts or self.hist_parts or self.memory_rows)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for the stream's writer process: the rows, not the lock nor tables made of them."""
        return {
            "step_rows": self.step_rows,
            "layer_parts": self.layer_parts,
            "hist_parts": self.hist_parts,
            "memory_rows": self.memory_rows,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def extend(self, other: Flush) -> None:
        self.step_rows += other.step_rows
        self.layer_parts += other.layer_parts
        self.hist_parts += other.hist_parts
        self.memory_rows += other.memory_rows
        self._arrow = self._wire = None

    def decoded(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The layer and histogram columns, every sampled step's rows decoded (once: each is replaced by its
        columns, its histogram columns appended in step order)."""
        with self._decoding:
            for i, part in enumerate(self.layer_parts):
                if isinstance(part, StepRows):
                    cols, hist = part.decode()
                    self.layer_parts[i] = cols
                    if hist is not None:
                        self.hist_parts.append(hist)
        return self.layer_parts, self.hist_parts  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Host bytes these rows hold: arrays' buffers, and each list, dict and scalar of the row lists (Python
        object sizes, ``sys.getsizeof``; strings shared between rows counted each time: an upper bound), and
        the Arrow tables or the pickle made of them for the stream."""
        total = 0
        for part in (*self.layer_parts, *self.hist_parts):
            if isinstance(part, StepRows):
                total += part.nbytes
                continue
            total += sys.getsizeof(part)
            for v in part.values():
                total += int(v.nbytes) if isinstance(v, np.ndarray) else _list_bytes(v)
        for rows in (self.step_rows, self.memory_rows):
            total += sys.getsizeof(rows)
            for row in rows:
                total += sys.getsizeof(row) + sum(sys.getsizeof(v) for v in row.values())
        if self._arrow is not None:
            total += sum(int(t.nbytes) for t in self._arrow.values())
        if self._wire is not None:
            total += len(self._wire[0])
        return total

    def frames(self) -> dict[str, pd.DataFrame]:
        """The four tables of these rows (see precprof/tables.py for the schema)."""
        layer_parts, hist_parts = self.decoded()
        return {
            "layers": T.frame("layers", _join_columns(layer_parts)) if layer_parts else T.empty("layers"),
            "histograms": T.frame("histograms", _join_columns(hist_parts))
            if hist_parts
            else T.empty("histograms"),
            "steps": T.frame("steps", self.step_rows) if self.step_rows else T.empty("steps"),
            "memory": T.frame("memory", self.memory_rows) if self.memory_rows else T.empty("memory"),
        }

    def arrow(self) -> dict[str, pa.Table]:
        """The tables these rows have, as the stream writes them (:func:`precprof.tables.to_arrow` of
        :meth:`frames`' frames): the layer and histogram columns straight to Arrow, no frame on the way. Made
        once (again after ``extend``)."""
        if self._arrow is None:
            self._arrow = self._make_arrow()
        return self._arrow

    def _make_arrow(self) -> dict[str, pa.Table]:
        # decoded for the tables only: the flush keeps its compact rows (held beside the tables while queued)
        with self._decoding:
            parts, hist_parts = list(self.layer_parts), list(self.hist_parts)
        layer_parts = []
        for part in parts:
            if isinstance(part, StepRows):
                part, hist = part.decode(arrow=True)
                if hist is not None:
                    hist_parts.append(hist)
            layer_parts.append(part)
        out: dict[str, pa.Table] = {}
        if layer_parts:
            out["layers"] = T.arrow_of_columns("layers", _joined(layer_parts))
        if hist_parts:
            out["histograms"] = T.arrow_of_columns("histograms", _joined(hist_parts))
        for name, rows in (("steps", self.step_rows), ("memory", self.memory_rows)):
            if not rows and name != "steps":
                continue
            cols = _row_columns(rows)
            if cols is not None:
                out[name] = T.arrow_of_columns(name, cols)
            else:  # rows of other keys, or a number column with gaps: pandas' own inference, as before
                out[name] = T.to_arrow(name, T.frame(name, rows) if rows else T.empty(name))
        return out


def _row_columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray] | None:
    """Rows as columns typed as a pandas frame of them types them (the union of their keys, in order; texts
    with gaps as None, numbers with gaps as float NaN), so that ``arrow_of_columns`` of them is ``to_arrow`` of
    the frame, without the frame. None for no rows, and for a column of other values (a flag with gaps, a mix)."""
    if not rows:
        return None
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cols: dict[str, np.ndarray] = {}
    for k in keys:
        values = [r.get(k) for r in rows]
        present = [v for v in values if v is not None]
        whole = len(present) == len(values)
        if all(isinstance(v, str) for v in present):
            cols[k] = np.array(values, dtype=object)
        elif all(
            isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in present
        ):
            cols[k] = (
                np.asarray(values) if whole else np.array([math.nan if v is None else v for v in values])
            )
        elif whole and all(isinstance(v, (bool, np.bool_)) for v in present):
            cols[k] = np.asarray(values, dtype=bool)
        else:
            return None
    return cols


def _list_bytes(v: Any) -> int:
    if isinstance(v, (list, tuple)):
        return sys.getsizeof(v) + sum(sys.getsizeof(x) for x in v)
    return sys.getsizeof(v)


def _join_columns(parts: list[dict[str, Any]]) -> pd.DataFrame:
    """One frame from column dicts (arrays or lists, equal keys within a part), in order; a column missing
    from a part is NaN there."""
    return pd.DataFrame(_joined(parts))


def _joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`_join_columns`' columns before any frame: one part's as they are (arrays, lists or Arrow arrays),
    several parts' concatenated (Arrow arrays where a part has one, e.g. ``StepRows.decode(arrow=True)``'s
    texts; else NumPy arrays)."""
    if len(parts) == 1:
        return dict(parts[0])
    names: list[str] = []
    for part in parts:
        names.extend(c for c in part if c not in names)
    sizes = [len(next(iter(part.values()))) for part in parts]
    out: dict[str, Any] = {}
    for c in names:
        values = [part.get(c) for part in parts]
        typ = next((v.type for v in values if isinstance(v, pa.Array)), None)
        if typ is not None:
            out[c] = pa.concat_arrays(
                [
                    v
                    if isinstance(v, pa.Array)
                    else pa.nulls(n, typ)
                    if v is None
                    else pa.array(np.asarray(v, dtype=object), typ, from_pandas=True)
                    for n, v in zip(sizes, values, strict=True)
                ]
            )
            continue
        arrays = [None if v is None else np.asarray(v) for v in values]
        if any(a is not None and a.dtype.kind in "OUS" for a in arrays):  # text: missing is None, not "nan"
            arrays = [None if v is None else np.asarray(v, dtype=object) for v in values]
            fill: Any = None
        else:
            fill = math.nan
        out[c] = np.concatenate(
            [np.full(n, fill) if a is None else a for n, a in zip(sizes, arrays, strict=True)]
        )
    return out
