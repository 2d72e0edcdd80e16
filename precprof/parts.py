"""The stream of a run directory: each flush of the Profiler as Parquet parts, written while training runs.

Layout (``RUN/stream/``)::

    stream/s000@0/00000000.steps.parquet        segment 0, started at step 0
    stream/s000@0/00000001.layers.parquet       flush 1: a sampled step's layer rows,
    stream/s000@0/00000001.histograms.parquet   its histogram rows,
    stream/s000@0/00000001.memory.parquet       its memory rows,
    stream/s000@0/00000001.steps.parquet        and the steps since the last flush, written last
    stream/s001@250/...                         segment 1: the run resumed from its checkpoint at step 250

What is atomic: every part file is written to a hidden temporary name, fsynced and renamed into place
(``precprof._atomic``), so a kill leaves either the whole file or none. A flush is *committed* when its steps
part exists: it is written after the flush's other parts, so the parts of a flush cut off by a kill (no
steps part) are skipped when read, with a notice. A part that cannot be read (a torn file after a node
failure, a disk error) is skipped with a notice, never a traceback.

Merging: every ``COMPACT_EVERY`` flushes the writer merges the segment's last ones into one part per table
named by the range (``00000000-00000063.layers.parquet``), the merged steps part last, then deletes the
single parts: a thousand flushes are read as a few dozen files instead of four thousand. A merged range
counts once its steps part exists; the single parts it covers are then ignored wherever a kill left them, and
a merge cut off before its steps part is ignored in favour of the single parts, which are still there.

Resume: a segment named ``s<k>@<start>`` supersedes, in every earlier segment, the rows of steps at or after
``start`` (they were recorded after the checkpoint the run restarted from, and are recorded again), so no
step is counted twice.

This module knows files and Arrow tables; the columns are ``precprof.tables``' business.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from precprof import _atomic

STREAM_DIR = "stream"
COMMIT_TABLE = "steps"  # the part written last in each flush: its presence commits the flush
_SEGMENT = re.compile(r"^s(\d{3,})@(-?\d+)$")
_PART = re.compile(r"^(\d{8,})(?:-(\d{8,}))?\.([a-z_]+)\.parquet$")
COMPACT_EVERY = 64  # flushes merged into one part per table
SINGLE_COMPRESSION = "lz4"  # a single flush's parts (the merge writes zstd)


def stream_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / STREAM_DIR


def has_stream(run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``run_dir`` holds parts written while a run trained (it was killed, or is still running)."""
    return stream_dir(run_dir).is_dir()


@dataclass(frozen=True)
class Segment:
    """One attempt at the run: segment ``index`` recorded from step ``start`` on, into ``path``."""

    index: int
    start: int
    path: Path


def segments(run_dir: str | os.PathLike[str]) -> list[Segment]:
    """The segments of a run directory's stream, in order (none without a stream)."""
    root = stream_dir(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _SEGMENT.match(p.name)
        if m and p.is_dir():
            out.append(Segment(int(m.group(1)), int(m.group(2)), p))
    return sorted(out, key=lambda s: s.index)


def new_segment(run_dir: str | os.PathLike[str], start: int) -> Segment:
    """Create the next segment of ``run_dir``'s stream, recording from step ``start`` (mkdir is atomic)."""
    root = stream_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    have = segments(run_dir)
    index = have[-1].index + 1 if have else 0
    path = root / f"s{index:03d}@{start}"
    path.mkdir()
    return Segment(index, start, path)


def part_path(segment: Path, seq: int, table: str, last: int | None = None) -> Path:
    """The part of flush ``seq`` (or of the merged flushes ``seq``..``last``) of ``table``."""
    span = f"{seq:08d}" if last is None else f"{seq:08d}-{last:08d}"
    return segment / f"{span}.{table}.parquet"


def _units(segment: Path, names: Iterable[str]) -> dict[tuple[int, int], dict[str, Path]]:
    """The parts of a segment by (first, last) flush (a single flush: first == last), for tables ``names``."""
    wanted = set(names)
    units: dict[tuple[int, int], dict[str, Path]] = {}
    for p in segment.iterdir():
        m = _PART.match(p.name)
        if m and m.group(3) in wanted:
            first = int(m.group(1))
            last = int(m.group(2)) if m.group(2) is not None else first
            units.setdefault((first, last), {})[m.group(3)] = p
    return units


def _live_units(
    units: dict[tuple[int, int], dict[str, Path]],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(committed units in flush order, single flushes cut off while written): merged ranges with their steps
    part, and the single flushes no such range covers; an unfinished merge and what a merge covers are left
    out, silently (their rows are read from the other files)."""
    ranges = [k for k, v in units.items() if k[0] != k[1] and COMMIT_TABLE in v]
    committed: list[tuple[int, int]] = []
    torn: list[tuple[int, int]] = []
    for k in sorted(units):
        if k[0] != k[1]:
            if k in ranges:
                committed.append(k)
        elif not any(a <= k[0] <= b for a, b in ranges):
            (committed if COMMIT_TABLE in units[k] else torn).append(k)
    return committed, torn


def compact(
    segment: Path,
    first: int,
    last: int,
    names: Iterable[str],
    written: Mapping[int, Mapping[str, pa.Table]] | None = None,
) -> int:
    """Merge the committed single flushes ``first``..``last`` of ``segment`` into one part per table (the steps
    part last), then delete them. Returns the flushes merged (0: none there). A failure leaves the single
    parts as they were: the merge's own files, without their steps part, are never read.

    ``written``: the tables of single flushes as the writer wrote them (by flush), used in place of reading
    their files back (reading 64 flushes' small files took 3/4 of a merge: about 2.5 ms a file)."""
    names = tuple(names)
    units = _units(segment, names)
    singles = sorted(
        k for k, v in units.items() if k[0] == k[1] and first <= k[0] <= last and COMMIT_TABLE in v
    )
    if len(singles) < 2:
        return 0
    lo, hi = singles[0][0], singles[-1][0]
    for name in (*(n for n in names if n != COMMIT_TABLE), COMMIT_TABLE):
        have = written or {}
        tables = [
            have[k[0]][name] if name in have.get(k[0], {}) else pq.read_table(units[k][name])
            for k in singles
            if name in units[k]
        ]
        if not tables:
            continue
        table = concat(tables)
        assert table is not None
        write_part(part_path(segment, lo, name, hi), table)
    for k in singles:
        for path in units[k].values():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return hi - lo + 1


def write_part(path: Path, table: pa.Table, compression: str = "zstd") -> None:
    """Write one part atomically (temporary name, fsync, rename): a kill leaves the whole file or none. No
    dictionary pages and no column statistics (no reader filters on them): a flush's part of 800 layer rows
    takes 2.8 ms instead of 4.3 of the writer's CPU, and is smaller. A single flush's parts, merged soon
    after, are written with ``SINGLE_COMPRESSION``: the three parts of a flush of 800 layer rows take 3.2 ms
    of CPU to write rather than 4.9-6.2 with zstd, and 76 KB rather than 58."""
    _atomic.write_with(
        path,
        lambda tmp: pq.write_table(
            table, tmp, compression=compression, use_dictionary=False, write_statistics=False
        ),
    )


@dataclass
class StreamRead:
    """What was read from a stream: per table the Arrow tables of the committed flushes (rows a later segment
    supersedes removed), and what the reader had to leave out or wants the reader of the report to know."""

    tables: dict[str, list[pa.Table]] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    parts: int = 0


def read_stream(
    run_dir: str | os.PathLike[str],
    names: tuple[str, ...],
    step: str,
    dictionary: Mapping[str, tuple[str, ...]] | None = None,
    columns: Mapping[str, tuple[str, ...]] | None = None,
) -> StreamRead:
    """Read every committed part of ``run_dir``'s stream. ``step`` names the step column, which the
    superseding of resumed segments filters on. Never raises for a damaged part: it is skipped, with a
    notice naming the file. ``dictionary``: per table, the text columns to read as Arrow dictionaries.
    ``columns``: per table, the only columns to read (those a part has), for a reader that needs a few of a
    long run's (a resume's five of the layers table's hundred: 0.1 s against 28 s for 1.2M rows).

    The parts of a table in a segment are read as one Arrow dataset (a thousand flushes in one call, on
    Arrow's threads); only when that fails (a damaged part, parts whose column types differ) are they read
    one by one, to skip exactly the damaged ones and promote the types."""
    run_dir = Path(run_dir)
    out = StreamRead(tables={n: [] for n in names}, segments=segments(run_dir))
    starts = [s.start for s in out.segments]
    for i, seg in enumerate(out.segments):
        cut = min(starts[i + 1 :], default=None)  # rows at or after it were recorded again later
        read = None
        for attempt in range(_READ_ATTEMPTS):
            read = _read_segment(
                seg, run_dir, cut, names, step, dictionary, attempt == _READ_ATTEMPTS - 1, columns
            )
            if read is not None:
                break
        assert read is not None
        tables, notices, n_parts = read
        for name, got in tables.items():
            out.tables[name] += got
        out.notices += notices
        out.parts += n_parts
    return out


# a segment read while its writer merges parts (their files go once merged) is read again
_READ_ATTEMPTS = 5


def _read_segment(
    seg: Segment,
    run_dir: Path,
    cut: int | None,
    names: tuple[str, ...],
    step: str,
    dictionary: Mapping[str, tuple[str, ...]] | None,
    last: bool = False,
    columns: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[dict[str, list[pa.Table]], list[str], int] | None:
    """One segment's committed parts: per table its Arrow tables, the notices, the parts read. None when a
    part went while it was read (merged meanwhile: read the segment again), unless ``last``."""
    tables: dict[str, list[pa.Table]] = {n: [] for n in names}
    notices: list[str] = []
    n_parts = 0
    flushes = _units(seg.path, names)
    committed, torn = _live_units(flushes)
    for seq, _ in torn:
        notices.append(
            f"{seg.path.name}/{seq:08d}: a flush cut off while it was written (no steps part) was skipped"
        )
    # the steps parts first: a flush whose steps part cannot be read has no step for its other rows
    order = [COMMIT_TABLE, *(n for n in names if n != COMMIT_TABLE)] if COMMIT_TABLE in names else names
    for name in order:
        files = [flushes[seq][name] for seq in committed if name in flushes[seq]]
        table, bad = _read_parts(
            files, run_dir, notices, (dictionary or {}).get(name, ()), (columns or {}).get(name)
        )
        if not last and any(not f.exists() for f in bad):
            return None
        if name == COMMIT_TABLE and bad:
            committed = [seq for seq in committed if flushes[seq][COMMIT_TABLE] not in bad]
        n_parts += len(files) - len(bad)
        if table is None:
            continue
        if cut is not None and step in table.column_names:
            table = table.filter(pc.less(table[step], cut))
        if table.num_rows:
            tables[name].append(table)
    return tables, notices, n_parts


def _read_parts(
    files: list[Path],
    run_dir: Path,
    notices: list[str],
    dictionary: tuple[str, ...] = (),
    columns: tuple[str, ...] | None = None,
) -> tuple[pa.Table | None, set[Path]]:
    """The parts ``files`` as one table (None without any), and those that could not be read (each noted).
    ``dictionary``: text columns read as Arrow dictionaries (never materialised as one string per row);
    ``columns``: the only ones to read, of those the parts have (None: all)."""
    if not files:
        return None, set()
    try:
        fmt = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns=list(dictionary)))
        data = ds.dataset([str(f) for f in files], format=fmt)
        have = data.schema.names
        return data.to_table(columns=None if columns is None else [c for c in columns if c in have]), set()
    except (OSError, pa.ArrowException):
        pass  # one by one: which part is damaged, or which types differ
    tables, bad = [], set()
    for f in files:
        try:
            have = pq.read_schema(f).names
            cols = None if columns is None else [c for c in columns if c in have]
            tables.append(pq.read_table(f, columns=cols, read_dictionary=list(dictionary) or None))
        except (OSError, pa.ArrowException) as e:
            msg = " ".join(str(e).split())[:120]
            notices.append(f"{f.relative_to(run_dir)} is damaged and was skipped ({msg})")
            bad.add(f)
    return concat(tables), bad


def concat(tables: list[pa.Table]) -> pa.Table | None:
    """One Arrow table from parts whose columns may differ in presence or type (int where a part had no
    value and wrote a null column, say): columns promoted, a missing one null."""
    if not tables:
        return None
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        pass
    # a column no row of a part had a value in was written as float64 nulls (a steps part's ``resumed``), where
    # another part holds values of another type (the bool of a saved steps table adopted by a resumed run):
    # the null column takes the other's type
    types: dict[str, pa.DataType] = {}
    for t in tables:
        for f, col in zip(t.schema, t.columns, strict=True):
            if col.null_count < len(col):
                types.setdefault(f.name, f.type)
    fixed = []
    for t in tables:
        for i, (f, col) in enumerate(zip(t.schema, t.columns, strict=True)):
            want = types.get(f.name)
            if want is not None and f.type != want and col.null_count == len(col):
                t = t.set_column(i, f.name, pa.nulls(len(col), want))
        fixed.append(t)
    return pa.concat_tables(fixed, promote_options="permissive")


def adopt_tables(
    run_dir: str | os.PathLike[str], files: Mapping[str, Path], start: int, empty_commit: pa.Table
) -> None:
    """Turn a run directory's finished tables (a run saved as incomplete, then resumed) into segment 0 of a
    new stream, starting at step ``start``: hard links (or copies) in a temporary folder, renamed into place
    at once, so a kill at any moment leaves either the old tables or the stream holding them. ``empty_commit``
    is written as the steps part when there is no steps table (a flush counts only with one)."""
    root = stream_dir(run_dir)
    tmp = _atomic.tmp_name(root)
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    seg = tmp / f"s000@{start}"
    seg.mkdir(parents=True)
    for name, src in files.items():
        dst = part_path(seg, 0, name)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    if COMMIT_TABLE not in files:  # a flush needs its steps part to count: an empty one
        pq.write_table(empty_commit, part_path(seg, 0, COMMIT_TABLE))
    os.replace(tmp, root)


def retire(run_dir: str | os.PathLike[str]) -> None:
    """Remove the stream once its rows are saved in the run directory's tables: renamed away first (one atomic
    step: a reader then sees the finished tables, never half a stream), then deleted."""
    root = stream_dir(run_dir)
    if not root.is_dir():
        return
    gone = _atomic.tmp_name(root)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(gone)
    os.replace(root, gone)
    shutil.rmtree(gone, ignore_errors=True)


def remove(run_dir: str | os.PathLike[str]) -> None:
    """Delete a stream (``--overwrite`` of a run directory)."""
    shutil.rmtree(stream_dir(run_dir), ignore_errors=True)
