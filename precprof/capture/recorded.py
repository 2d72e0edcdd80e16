"""What the Profiler has copied to the host: the step rows, and per sampled step the layer, histogram and memory
rows, kept as columns (arrays and lists) and joined into the four tables only when they are read.

Each flush of the Profiler (``Recorded.take``) is one ``Flush``. Without a stream the flushes are kept in
memory for the whole run; with one (``Profiler(out=...)``) each flush goes to the stream writer
(``precprof.capture.stream``) and leaves host memory once written, so the recording's memory stays bounded
whatever the run's length, and ``tables()`` reads the run directory's parts back."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from precprof import tables as T
from precprof.capture.columns import StepRows
from precprof.capture.records import HostFloats, _join_columns, _joined, _PendingStep


@dataclass
class Flush:
    """The rows one flush copied to the host: the steps since the last flush and, after a sampled step, its
    layer and histogram columns and memory rows."""

    step_rows: list[dict[str, Any]] = field(default_factory=list)
    # columns, or a sampled step's rows not decoded yet (``columns.StepRows``): ``decoded`` decodes them
    layer_parts: list[dict[str, Any] | StepRows] = field(default_factory=list)
    hist_parts: list[dict[str, Any]] = field(default_factory=list)
    memory_rows: list[dict[str, Any]] = field(default_factory=list)
    # ``decoded`` may run on two threads at once: the stream writer's and the live dashboards'
    _decoding: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # ``arrow()``'s tables, made once (on the training thread, before the flush is queued: see ``take``)
    _arrow: dict[str, pa.Table] | None = field(default=None, repr=False, compare=False)

    @property
    def empty(self) -> bool:
        return not (self.step_rows or self.layer_parts or self.hist_parts or self.memory_rows)

    def extend(self, other: Flush) -> None:
        self.step_rows += other.step_rows
        self.layer_parts += other.layer_parts
        self.hist_parts += other.hist_parts
        self.memory_rows += other.memory_rows
        self._arrow = None

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
        the Arrow tables made of them for the stream."""
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


class Recorded:
    """The host side of a recording: it receives host copies (the Profiler makes the one transfer of a
    sampled step) and touches no device.

    ``sink``: a stream writer (``precprof.capture.stream.StreamWriter``) that each flush is handed to; None
    keeps every flush in memory. ``keep=False`` without a sink keeps only the steps rows (a rank that does not
    write the run directory: its layer, histogram and memory rows are never saved)."""

    def __init__(self, sink: Any = None, keep: bool = True) -> None:
        self.sink = sink
        self._keep = keep and sink is None
        self.kept = Flush()
        self.new = Flush()
        self.steps_recorded = 0
        self.sampled_steps = 0
        self._last_sampled: int | None = None

    @staticmethod
    def step_floats(pending: list[_PendingStep]) -> HostFloats:
        """The pending steps' loss, scale, found-inf and grad norm, stacked on the device for the copy."""
        return HostFloats([v for p in pending for v in (p.loss, p.scale, p.found_inf, p.grad_norm)])

    def add_steps(self, pending: list[_PendingStep], values: list[float]) -> float:
        """Steps table rows for ``pending``, ``values`` being :meth:`step_floats`'s on the host. Returns the
        loss scale of the last one (1.0 when there is none)."""
        if not pending:
            return 1.0
        for i, p in enumerate(pending):
            loss, scale, found, grad_norm = values[4 * i : 4 * i + 4]
            found = 0.0 if p.found_inf is None else found
            self.new.step_rows.append(
                {
                    T.STEP: p.step,
                    T.LOSS: loss,
                    T.LOSS_SCALE: scale,
                    T.SKIPPED: bool(found > 0 or math.isnan(found)),
                    T.GRAD_NORM: grad_norm,
                    T.TIME_S: p.time_s,
                    T.SAMPLED: p.sampled,
                    T.SAMPLE_REASON: p.reason,
                    T.TOKENS: float(p.tokens) if p.tokens is not None else math.nan,
                }
            )
        self.steps_recorded += len(pending)
        return values[-3]

    def add_layers(
        self, step: int, cols: dict[str, Any] | StepRows, hist: dict[str, Any] | None = None
    ) -> None:
        """Layer rows of a sampled step (columns, or its rows to decode when read), and their histogram rows."""
        if step != self._last_sampled:
            self.sampled_steps += 1
            self._last_sampled = step
        self.new.layer_parts.append(cols)
        if hist is not None:
            self.new.hist_parts.append(hist)

    def add_memory(self, rows: list[dict[str, Any]]) -> None:
        self.new.memory_rows.extend(rows)

    @property
    def host_bytes(self) -> int:
        """Host memory the recording holds now (``Flush.nbytes``): kept rows, rows not yet handed on, and the
        flushes queued for (or kept by) the stream writer."""
        held = self.sink.held() if self.sink is not None else []
        return sum(f.nbytes for f in (self.kept, self.new, *held))

    def take(self) -> Flush:
        """The rows added since the last call: handed to the stream (or kept in memory); returned for the live
        dashboards."""
        new, self.new = self.new, Flush()
        if self.sink is not None:
            # decoded into Arrow here, not on the writer's thread: there these few milliseconds of Python took
            # the interpreter lock from the training's every op for the flush's whole write, and a sampled step
            # of 800 small tensors on 2 CPU cores took 12 ms longer instead of 4. A failure here never ends the
            # training: the writer's thread meets it again, records it and keeps the flush in memory
            with contextlib.suppress(Exception):
                new.arrow()
            self.sink.put(new)
        elif self._keep:
            self.kept.extend(new)
        else:
            self.kept.step_rows += new.step_rows
        return new

    def tables(self) -> dict[str, pd.DataFrame]:
        """The four tables (see precprof/tables.py for the schema): with a stream, the run directory's parts
        (every segment of a resumed run) after the writer drained, and any flush it could not write."""
        if self.sink is None:
            self.kept.decoded()  # in place: the next call reads the columns
            whole = Flush()
            whole.extend(self.kept)
            whole.extend(self.new)
            return whole.frames()
        self.sink.drain()
        base = T.read_run(self.sink.run_dir).tables
        extra = Flush()
        for f in self.sink.unwritten:
            extra.extend(f)
        extra.extend(self.new)
        if extra.empty:
            return base
        more = extra.frames()
        return {
            name: T.frame(name, pd.concat([base[name], more[name]], ignore_index=True))
            if not more[name].empty
            else base[name]
            for name in T.TABLES
        }
