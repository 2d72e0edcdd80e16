"""What the Profiler has copied to the host: the step rows, and per sampled step the layer, histogram and memory
rows, kept as columns (arrays and lists) and joined into the four tables only when they are read.

Each flush of the Profiler (``Recorded.take``) is one ``Flush``. Without a stream the flushes are kept in
memory for the whole run; with one (``Profiler(out=...)``) each flush goes to the stream writer
(``precprof.capture.stream``) and leaves host memory once written, so the recording's memory stays bounded
whatever the run's length, and ``tables()`` reads the run directory's parts back."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from precprof import tables as T
from precprof._notice import notice
from precprof.capture.records import HostFloats, _PendingStep
from precprof.flush import Flush, StepRows

# the values :meth:`Recorded.step_floats` holds per step
_N = 5


def _places(mask: float) -> str:
    """The places k whose bit 2^k ``mask`` holds, comma-separated ("0,2"); "" for none (nan: none known)."""
    if not mask > 0:
        return ""
    bits, k = int(mask), 0
    out = []
    while bits:
        if bits & 1:
            out.append(str(k))
        bits, k = bits >> 1, k + 1
    return ",".join(out)


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
        # the sample reason of the step a detach cut off, sampled (the sampler counts a step's reason as it ends)
        self.cut_off_reason = ""
        # per table: the file a save into the stream's run directory wrote it whole to (its identity), and how
        # many of the flushes the stream could not write that save held (``saving``)
        self._saved_whole: dict[str, tuple[tuple[int, int, int], int]] = {}
        self._stop_said = False  # whether the stream's stop was said (``_say_stopped``)

    @staticmethod
    def step_floats(pending: list[_PendingStep]) -> HostFloats:
        """The pending steps' loss, scale, found-inf and grad norm, stacked on the device for the copy."""
        return HostFloats(
            [v for p in pending for v in (p.loss, p.scale, p.found_inf, p.grad_norm, p.skipped_each)]
        )

    def add_steps(self, pending: list[_PendingStep], values: list[float]) -> float:
        """Steps table rows for ``pending``, ``values`` being :meth:`step_floats`'s on the host. Returns the
        loss scale of the last one (1.0 when there is none)."""
        if not pending:
            return 1.0
        for i, p in enumerate(pending):
            loss, scale, found, grad_norm, each = values[_N * i : _N * i + _N]
            found = 0.0 if p.found_inf is None else found
            if p.cut_off and p.sampled:
                self.cut_off_reason = p.reason
            self.new.step_rows.append(
                {
                    T.STEP: p.step,
                    T.LOSS: loss,
                    T.LOSS_SCALE: scale,
                    T.SKIPPED: bool(found > 0 or math.isnan(found)),
                    T.SKIPPED_OPTIMIZERS: _places(each) if p.skipped_each is not None else "",
                    T.GRAD_NORM: grad_norm,
                    T.TIME_S: p.time_s,
                    T.SAMPLED: p.sampled,
                    T.SAMPLE_REASON: p.reason,
                    T.CUT_OFF: p.cut_off,
                    T.COMPILED: p.compiled,
                    T.NO_LOSS: p.loss is None,
                    T.TOKENS: float(p.tokens) if p.tokens is not None else math.nan,
                }
            )
        self.steps_recorded += len(pending)
        return values[1 - _N]

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

    def make_room(self) -> float:
        """Wait until the stream takes the next flush at once (``StreamWriter.make_room``; no wait without one);
        the seconds waited."""
        return self.sink.make_room() if self.sink is not None else 0.0

    def take(self) -> Flush:
        """The rows added since the last call: handed to the stream (or kept in memory); returned for the live
        dashboards."""
        new, self.new = self.new, Flush()
        if self.sink is not None:
            self.sink.put(new)
            if self.sink.error is not None and not self._stop_said:
                self._say_stopped()
        elif self._keep:
            self.kept.extend(new)
        else:
            self.kept.step_rows += new.step_rows
        return new

    def close_stream(self) -> None:
        """End the stream's writing (``StreamWriter.close``: what is queued is written first); a stop of the
        stream that no flush said yet (it met its failure writing the last ones) is said now."""
        if self.sink is not None:
            self.sink.close()
            if self.sink.error is not None and not self._stop_said:
                self._say_stopped()

    def _say_stopped(self) -> None:
        """Say, once, on the training's thread, that the stream stopped writing (a full disk, its folder
        removed): the steps from then on are held in memory, and those it wrote are lost where its folder is
        gone. Silent, a run whose folder was removed mid-run was saved with the steps after it alone."""
        self._stop_said = True
        sink = self.sink
        written, error = sink.steps_written, " ".join(str(sink.error).split())
        after = f" after step {written[-1][1]}" if written else ""
        if not sink.parts_gone():
            notice(
                f"precprof: the stream of {sink.run_dir} stopped writing{after} ({error}): the steps from then on "
                "are kept in memory until the run is saved"
            )
            return
        where = sink.run_dir if not Path(sink.run_dir).is_dir() else sink.segment.path
        notice(
            f"precprof: the stream stopped writing{after}: {where} was removed while the run recorded into it "
            f"({error}); steps {spans(s for lo, hi in written for s in range(lo, hi + 1))}, written there, are "
            "lost. The steps from then on are kept in memory and saved with the run, which says it is incomplete"
        )

    def lost(self, steps: pd.DataFrame) -> str | None:
        """The run's incomplete cause where steps the stream wrote are not in ``steps`` (the steps table a
        save writes: its folder was removed while the run recorded); None when every one is."""
        sink = self.sink
        if sink is None or not sink.steps_written:
            return None
        have = set(steps[T.STEP].dropna().astype(int)) if T.STEP in steps else set()
        gone = [s for lo, hi in sink.steps_written for s in range(lo, hi + 1) if s not in have]
        if not gone:
            return None
        why = f"; the stream stopped: {' '.join(str(sink.error).split())}" if sink.error else ""
        return (
            f"steps {spans(gone)} were lost: the stream wrote them to {sink.run_dir}, which no longer holds them "
            f"(removed while the run recorded{why})"
        )

    def tables(self) -> dict[str, pd.DataFrame]:
        """The four tables (see precprof/tables.py for the schema): with a stream, the run directory's parts
        (every segment of a resumed run) after the writer drained, and any flush it could not write; a table
        that a save wrote whole there is read from its file, with the flushes that save did not hold."""
        if self.sink is None:
            self.kept.decoded()  # in place: the next call reads the columns
            whole = Flush()
            whole.extend(self.kept)
            whole.extend(self.new)
            return whole.frames()
        self.sink.drain()
        base = T.read_run(self.sink.run_dir).tables
        held = {name: self._held_by_file(name) for name in T.TABLES}
        out = dict(base)
        for start in sorted(set(held.values())):
            extra = Flush()
            for f in self.sink.unwritten[start:]:
                extra.extend(f)
            extra.extend(self.new)
            if extra.empty:
                continue
            more = extra.frames()
            for name in (n for n in T.TABLES if held[n] == start and not more[n].empty):
                out[name] = T.frame(name, pd.concat([base[name], more[name]], ignore_index=True))
        return out

    @contextlib.contextmanager
    def saving(self, run_dir: Path) -> Iterator[None]:
        """Around a save into ``run_dir``: where it is the stream's, each table the save writes whole holds the
        flushes the stream could not write so far, and ``tables()`` then reads them from that file only (added
        again from memory, every step of a save that did not fit whole was there twice)."""
        sink = self.sink
        if sink is None or run_dir.resolve() != Path(sink.run_dir).resolve():
            yield
            return
        sink.drain()
        held = len(sink.unwritten)
        before = {name: self._file_id(name) for name in T.TABLES}
        try:
            yield
        finally:  # (a Ctrl-C while the report rendered is raised after the tables were written)
            for name, was in before.items():
                now = self._file_id(name)
                if now is not None and now != was:
                    self._saved_whole[name] = (now, held)

    def _held_by_file(self, name: str) -> int:
        """How many of the flushes the stream could not write the run directory's file of table ``name`` holds:
        those of the save that wrote it, 0 for no file of this recording's saves."""
        saved = self._saved_whole.get(name)
        return saved[1] if saved is not None and self._file_id(name) == saved[0] else 0

    def _file_id(self, name: str) -> tuple[int, int, int] | None:
        """The stream's run directory's file of table ``name``, told apart from any other (a save writes each
        to a new file, renamed into place); None when there is none."""
        assert self.sink is not None
        try:
            st = os.stat(Path(self.sink.run_dir) / T.TABLE_FILES[name])
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns


def spans(steps: Iterator[int] | list[int]) -> str:
    """Ascending step numbers as ranges: "0-8, 12, 14-15"."""
    out: list[list[int]] = []
    for step in steps:
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in out)
