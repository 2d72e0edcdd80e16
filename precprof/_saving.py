"""Writing a run directory on a disk that may fill up (or turn read-only): what fits is kept, in the order of
its worth, and the run says what was not saved and where the rest is.

What is worth most is what cannot be had again: the configuration (summary.json), then the rows. What can be
had again goes first: report.html (``precprof report`` renders it from the tables and the summary), then the
recommendation's bulkiest parts (the advisor computes them again). So:

- the tables are written smallest and most read first (``TABLE_ORDER``: steps, memory, histograms, layers),
  each atomically; one that does not fit does not stop a smaller one after it;
- when a table is missing and the run streamed (``precprof.parts``), the stream stays and holds that table's
  first steps; the tables saved whole beside it are read in place of their parts (``tables.read_run``); an
  empty stream is removed;
- summary.json is written whole if it fits; else without report.html (which claimed the status the summary
  was about to have), then without its bulkiest parts (``BULKY``), then with its essentials (``ESSENTIAL``:
  the configuration, the machine, the versions, the final numbers), then with the configuration alone; and if
  none fits, the tables are removed, largest first, until one does;
- the summary's ``incomplete_reason`` says what was not saved, what was, and what was left out of the summary.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from precprof import parts
from precprof import tables as T

TABLE_ORDER: tuple[str, ...] = ("steps", "memory", "histograms", "layers")
# (section, key): left out of summary.json first when it does not fit, in this order (the largest first)
BULKY: tuple[tuple[str, str | None], ...] = (
    (T.SUMMARY_RECOMMENDATION, "block_what_if"),
    (T.SUMMARY_WEIGHT_UPDATES, "layers"),
    (T.SUMMARY_MEMORY, None),
    (T.SUMMARY_CAPTURE, "modules"),
    (T.SUMMARY_CAPTURE, "gemm_inputs"),
    (T.SUMMARY_RECOMMENDATION, "findings"),
)
ESSENTIAL: tuple[str, ...] = (
    T.SUMMARY_VERSION,
    T.SUMMARY_STATUS,
    T.SUMMARY_INCOMPLETE_REASON,
    T.SUMMARY_TRAINING_FINISHED,
    T.SUMMARY_CONFIG,
    T.SUMMARY_HARDWARE,
    T.SUMMARY_VERSIONS,
    T.SUMMARY_MODEL,
    T.SUMMARY_FINAL,
    T.SUMMARY_ERRORS,
)
MINIMAL: tuple[str, ...] = (
    T.SUMMARY_VERSION,
    T.SUMMARY_STATUS,
    T.SUMMARY_INCOMPLETE_REASON,
    T.SUMMARY_TRAINING_FINISHED,
    T.SUMMARY_CONFIG,
)


def why(e: OSError) -> str:
    """An OSError as the run's cause quotes it: ``[Errno 28] No space left on device``."""
    if e.errno:  # Arrow's own text wraps the system's ("Error writing bytes to file. Detail: [errno 28] ...")
        return f"[Errno {e.errno}] {os.strerror(e.errno)}"
    return f"{type(e).__name__}: {e}"


@dataclass
class Saving:
    """What was written to ``run_dir`` and what was not, and the first failure's cause."""

    run_dir: Path
    saved: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    failure: str | None = None  # what failed first, with its cause: "the tables could not be written ..."
    streamed: str | None = None  # what the stream keeps when it stays the run's record
    tables_ok: bool = True
    summary_error: OSError | None = None  # why summary.json could not be written (None once it was)
    left_out: list[str] = field(default_factory=list)  # what the summary written leaves out

    def _fail(self, what: str, e: OSError) -> None:
        if self.failure is None:
            self.failure = f"{what} ({why(e)})"

    def write_tables(self, tables: Mapping[str, pd.DataFrame]) -> None:
        """Write the tables in ``TABLE_ORDER`` (each atomically; a failure is noted, never raised), then retire
        the stream when all are written, or keep it as the run's record when it holds rows."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._fail(f"the tables could not be written to {self.run_dir}", e)
        failed = []
        for name in sorted(
            tables, key=lambda n: TABLE_ORDER.index(n) if n in TABLE_ORDER else len(TABLE_ORDER)
        ):
            try:
                T.write_tables(self.run_dir, {name: tables[name]})
                self.saved.append(T.TABLE_FILES[name])
            except OSError as e:
                self._fail(f"the tables could not be written to {self.run_dir}", e)
                failed.append(name)
        if not failed:
            try:
                parts.retire(self.run_dir)  # the stream's rows are in the tables now
            except OSError as e:
                self._fail(f"the stream could not be replaced by the tables in {self.run_dir}", e)
                self.tables_ok = False
            return
        self.tables_ok = False
        kept = _streamed_steps(self.run_dir, tables.get("steps"))
        if kept is not None:  # the stream holds the failed tables' first steps; those saved whole are read
            self.streamed = f"{', '.join(T.TABLE_FILES[n] for n in failed)}: {kept}"  # beside it (read_run)
        else:  # nothing streamed (a disk with less room than the stream leaves free): the tables are the record
            self.lost += [T.TABLE_FILES[n] for n in failed]
            with contextlib.suppress(OSError):
                parts.remove(self.run_dir)

    def report_failed(self, name: str, e: OSError) -> None:
        self._fail(f"{name} could not be written", e)
        self.lost.append(name)

    def reason(self, left_out: list[str]) -> str | None:
        """The run's incomplete cause for what was saved so far (None when everything was)."""
        if self.failure is None and not left_out:
            return None
        text = self.failure or "summary.json did not fit whole"
        said = []
        if self.lost:
            said.append(f"not saved: {', '.join(self.lost)}")
        if self.saved and (self.lost or self.streamed):
            said.append(f"saved: {', '.join(self.saved)}")
        if self.streamed is not None:
            said.append(self.streamed)
        text += f": {'; '.join(said)}" if said else ""
        if left_out:
            text += f"; left out of summary.json (no room): {', '.join(left_out)}"
        return text

    def drop_report(self, report: Path, e: OSError | None) -> bool:
        """Remove the report written, for the room of summary.json, which could not be written beside it
        (``e``); whether it was there. The run is incomplete then, with that cause: the report is not saved
        (a run that saved all but its page had said "complete", and its warning "not saved whole: None")."""
        if report.name not in self.saved:
            return False
        with contextlib.suppress(OSError):
            report.unlink()
        self.saved.remove(report.name)
        self.lost.append(report.name)
        if self.failure is None:
            cause = why(e) if e is not None else "no room"
            self.failure = f"{report.name} was removed to make room for summary.json ({cause})"
        return True

    def free_room(self) -> Iterator[str]:
        """Remove the tables written, largest first, one per step, for summary.json's room: yields each one's
        name once it is gone."""
        for name in reversed(TABLE_ORDER):
            fname = T.TABLE_FILES[name]
            if fname not in self.saved:
                continue
            try:
                (self.run_dir / fname).unlink()
            except OSError:
                continue
            self.saved.remove(fname)
            self.lost.append(fname)
            yield fname


def summary_levels(full: Mapping[str, Any]) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """``full`` and then smaller versions of it, each with what it leaves out: the ``BULKY`` parts one by one,
    then the ``ESSENTIAL`` sections, then ``MINIMAL``."""

    def copy(doc: Mapping[str, Any]) -> dict[str, Any]:  # sections copied too: each level is its own
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}

    current = copy(full)
    left: list[str] = []
    yield copy(current), []
    for section, key in BULKY:
        if key is None and section in current:
            del current[section]
        elif key is not None and isinstance(current.get(section), dict) and key in current[section]:
            del current[section][key]
        else:
            continue
        left.append(section if key is None else f"{section}.{key}")
        yield copy(current), list(left)
    for keep in (ESSENTIAL, MINIMAL):
        gone = [k for k in current if k not in keep]
        if gone:
            left += gone
            current = {k: v for k, v in current.items() if k in keep}
            yield copy(current), list(left)


def _streamed_steps(run_dir: Path, steps: pd.DataFrame | None) -> str | None:
    """What a run's stream keeps, as the reason says it ("the stream keeps steps 0-23 of 0-59 ..."), None
    when it holds no committed step."""
    if not parts.has_stream(run_dir):
        return None
    try:
        read = parts.read_stream(run_dir, ("steps",), T.STEP)
    except OSError:
        return None
    table = parts.concat(read.tables["steps"])
    if table is None or not table.num_rows:
        return None
    got = table.column(T.STEP).to_pylist()
    first, last = min(got), max(got)
    text = f"stream/ keeps steps {first}-{last} of them (precprof report {run_dir} reads it)"
    if steps is not None and not steps.empty and T.STEP in steps:
        end = int(steps[T.STEP].max())
        if end > last:
            text += f", steps {last + 1}-{end} were not saved"
    return text
