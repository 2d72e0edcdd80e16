"""The stream's writer process: it decodes the flushes a training process hands it and writes them as Parquet
parts of the run directory (``precprof.parts``), so that none of that work, nor the interpreter lock it would
hold, is the training's. ``precprof.capture.stream.StreamWriter`` (through
``precprof.capture.writer_process``: one process per Python process, each run streaming from it on a channel of
its own) starts it (its ``main``, as ``python -m precprof.stream_child`` would, but importing nothing from the
working directory) and talks to it over two pipes; it imports no torch (``precprof.flush``).

The hand-over (``Wire``): on the training's thread a flush is pickled, its sampled steps' rows compact as the
copy brought them (``flush.StepRows``). What those rows share from step to step (the row table's texts, the
modules' order) is sent once, by key, and referred to after.

Messages in: ``struct HEAD`` (the lengths of the meta pickle and of the flushes), then ``(channel, seq, reset,
shared, segment, compact_every, drops, sizes)`` (the run's channel; the objects the flushes refer to that the
process has not had yet from it, ``reset``: forget the channel's earlier ones; the segment folder their parts
go into, and how often they merge; ``drops``: channels whose runs ended, to forget; ``sizes``: each flush's
pickle), then the flushes: one, or those a writer behind the training found queued, written as one flush (most
of a write's cost is per file); none (``SYNC``): wait for the channel's merge. One JSON line out per message,
once its parts are on disk: ``{"seq", "parts", "compact_error"}`` or ``{"seq", "error"}``. The first line out
is ``ready``.

The process ignores SIGINT, SIGTERM and SIGHUP (and starts in a session of its own, so that a terminal's
Ctrl-C reaches the training alone, which saves the run and closes the pipe). When its input closes, cut short
or not (the training ended, or was killed), it has written every whole message it received and exits: a
killed training loses at most the flush it was handing over.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import shutil
import signal
import struct
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from precprof import parts
from precprof import tables as T
from precprof.flush import Flush, StepRows

HEAD = struct.Struct("<QQ")
READY = b"ready\n"
RESERVE_BYTES = 1 << 20  # left free on the run directory's file system for the end of the run
RECENT_BYTES = 64 << 20  # a run's tables the process keeps for their merge (64 flushes of 800 rows: 52 MB)
SYNC: list[int] = []  # a message's ``sizes`` with no flush: wait for the run's merge, say how it went
_SHARED = ("fixed", "order")  # what a StepRows shares with the steps before it
_IGNORED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Merging:
    """A segment's merges (``parts.compact``), as the writer process does them: the tables of the single flushes
    written since the last merge are kept as written (up to ``RECENT_BYTES``), so that the merge does not read
    their files back (3/4 of its time), and the merge runs on a thread of its own, so that the next flush is
    written and answered meanwhile (a merge of 64 flushes of 800 rows took 0.2-0.7 s, while the training, its
    queue full, waited). ``wait()`` waits for it (the run's writer asks before the run is read)."""

    def __init__(self) -> None:
        self.tables: dict[int, dict[str, pa.Table]] = {}
        self.nbytes = 0
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def keep(self, seq: int, tables: dict[str, pa.Table]) -> None:
        n = sum(t.nbytes for t in tables.values())
        if self.nbytes + n <= RECENT_BYTES:
            self.tables[seq] = tables
            self.nbytes += n

    def start(self, segment: Path, first: int, last: int) -> str | None:
        """Merge flushes ``first``..``last`` beside the writing (after the merge before it). Returns why a
        merge before it failed (None when none did)."""
        error = self.wait()
        tables = {seq: self.tables.pop(seq) for seq in [s for s in self.tables if s <= last]}
        self.nbytes -= sum(t.nbytes for one in tables.values() for t in one.values())
        self._thread = threading.Thread(
            target=self._merge, args=(segment, first, last, tables), name="precprof-merge", daemon=True
        )
        self._thread.start()
        return error

    def wait(self) -> str | None:
        """Wait for the merge under way; why the last one failed (None when none did), said once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error

    def _merge(self, segment: Path, first: int, last: int, tables: dict[int, dict[str, pa.Table]]) -> None:
        self._error = _compact(segment, first, last, tables)


def _compact(
    segment: Path, first: int, last: int, tables: dict[int, dict[str, pa.Table]] | None
) -> str | None:
    """Merge flushes ``first``..``last`` of ``segment``; why it failed (the single parts are still there and
    read as before), None when it did not."""
    try:  # the last flushes as one part per table: what a reader opens stays few files
        parts.compact(segment, first, last, T.TABLES, tables)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def write_flush(
    segment: Path, seq: int, flush: Flush, compact_every: int, merging: Merging | None = None
) -> tuple[int, str | None]:
    """Write ``flush`` as the parts numbered ``seq`` of ``segment`` (the steps part last: it commits the
    flush), and every ``compact_every`` flushes merge the last ones (``parts.COMPACT_EVERY``; by ``merging``
    beside the writing where given, else at once). Returns the parts written and why a merge failed (None
    when none did: the single parts are still there and read as before). Raises when a part cannot be
    written, and while less than ``RESERVE_BYTES`` are free (room left for summary.json)."""
    free = shutil.disk_usage(segment).free
    if free < RESERVE_BYTES:
        raise OSError(
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)} (less than {RESERVE_BYTES >> 20} MiB left: the stream stopped to "
            "leave room for summary.json)",
        )
    tables = flush.arrow()
    written = 0
    for name in (*(n for n in T.TABLES if n != parts.COMMIT_TABLE), parts.COMMIT_TABLE):
        table = tables.get(name)
        if table is None or (table.num_rows == 0 and name != parts.COMMIT_TABLE):
            continue
        parts.write_part(parts.part_path(segment, seq, name), table, parts.SINGLE_COMPRESSION)
        written += 1
    if merging is not None:
        merging.keep(seq, tables)
    if (seq + 1) % compact_every != 0:
        return written, None
    first = seq + 1 - compact_every
    if merging is not None:
        return written, merging.start(segment, first, seq)
    return written, _compact(segment, first, seq, None)


class Wire:
    """The training's side of the hand-over: a flush pickled with its shared objects as keys (``encode``,
    on the training's thread), and what the process has of them (``message``, on the sending thread)."""

    MAX_SHARED = 16  # objects the process keeps; past that it is told to forget them and gets them again

    def __init__(self) -> None:
        self._keys: dict[int, tuple[Any, int]] = {}  # id -> (the object, held so its id stays its own; key)
        self._next = 0
        self._sent: set[int] = set()  # keys the process has
        self.generation = 0  # the process that has them (``restart``)

    def encode(self, flush: Flush) -> tuple[bytes, dict[int, Any]]:
        """The flush pickled, and the shared objects it refers to by key."""
        refs: dict[int, Any] = {}
        layer_parts: list[Any] = []
        for part in flush.layer_parts:
            if isinstance(part, StepRows):
                part = copy.copy(part)
                for name in _SHARED:
                    obj = getattr(part, name)
                    key = self._key(obj)
                    refs[key] = obj
                    setattr(part, name, key)
            layer_parts.append(part)
        wire = Flush(flush.step_rows, layer_parts, flush.hist_parts, flush.memory_rows)
        return pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL), refs

    def _key(self, obj: Any) -> int:
        held = self._keys.get(id(obj))
        if held is None:
            if len(self._keys) >= self.MAX_SHARED:
                self._keys.clear()  # new keys from here on: the process is sent each object again
            held = self._keys[id(obj)] = (obj, self._next)
            self._next += 1
        return held[1]

    def message(
        self,
        channel: int,
        seq: int,
        segment: str,
        compact_every: int,
        drops: list[int],
        bodies: list[bytes],
        refs: dict[int, Any],
    ) -> list[bytes]:
        """The bytes that hand the process flushes (``encode``'s ``bodies`` and their ``refs``) of ``channel``,
        to be written into ``segment`` as its parts ``seq``, with the ``drops`` of channels it may forget."""
        new = {k: v for k, v in refs.items() if k not in self._sent}
        reset = len(self._sent) + len(new) > self.MAX_SHARED
        if reset:
            self._sent.clear()
            new = dict(refs)
        self._sent |= new.keys()
        sizes = [len(b) for b in bodies]
        meta = (channel, seq, reset, new, segment, compact_every, drops, sizes)
        head = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        return [HEAD.pack(len(head), sum(sizes)), head, *bodies]

    def restart(self, generation: int) -> None:
        """A new process (``generation``) has none of the shared objects."""
        self._sent.clear()
        self.generation = generation


def _read(stream: BinaryIO, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or None when the input ends first."""
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Read flushes from ``inp`` until it ends, write each and answer on ``out``."""
    channels: dict[int, dict[int, Any]] = {}  # what each run's flushes share
    merging: dict[int, Merging] = {}  # each run's merges
    _answer(out, READY)
    while True:
        head = _read(inp, HEAD.size)
        if head is None:
            break
        n_head, n_body = HEAD.unpack(head)
        meta, body = _read(inp, n_head), _read(inp, n_body)
        if meta is None or body is None:  # cut off while it was handed over: the training was killed
            break
        channel, seq, reset, new, segment, compact_every, drops, sizes = pickle.loads(meta)
        for gone in drops:
            channels.pop(gone, None)
            done = merging.pop(gone, None)
            if done is not None:
                done.wait()
        shared = channels.setdefault(channel, {})
        if reset:
            shared.clear()
        shared.update(new)
        merges = merging.setdefault(channel, Merging())
        try:
            if sizes == SYNC:
                written, compact_error = 0, merges.wait()
            else:
                flush = _flush(body, sizes, shared)
                written, compact_error = write_flush(Path(segment), seq, flush, compact_every, merges)
            answer = {"seq": seq, "parts": written, "compact_error": compact_error}
        except Exception as e:  # said to the training, which keeps this flush and the later ones in memory
            answer = {"seq": seq, "error": f"{type(e).__name__}: {e}"}
        _answer(out, json.dumps(answer).encode() + b"\n")
    for merges in merging.values():  # (before the process exits)
        merges.wait()


def _flush(body: bytes, sizes: list[int], shared: dict[int, Any]) -> Flush:
    """The flushes pickled one after the other in ``body`` (``sizes`` bytes each), as one, their shared
    objects in place."""
    flush = Flush()
    at = 0
    for size in sizes:
        one = pickle.loads(body[at : at + size])
        at += size
        for part in one.layer_parts:
            if isinstance(part, StepRows):
                for name in _SHARED:
                    setattr(part, name, shared[getattr(part, name)])
        flush.extend(one)
    return flush


def _answer(out: BinaryIO, line: bytes) -> None:
    try:
        out.write(line)
        out.flush()
    except (BrokenPipeError, ValueError):  # the training is gone: go on writing what it sent
        pass


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C, and the SIGTERM that Slurm sends every process of a job: the training saves the run and closes
    # the pipe, or dies and the pipe closes; either way this process writes what it was handed, then exits
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python -m precprof.stream_child (flushes on stdin, from a training)", file=sys.stderr)
        return 2
    serve(sys.stdin.buffer, sys.stdout.buffer)
    # every part is written and closed (each atomically, fsynced): skip the interpreter's teardown of pandas
    # and Arrow (0.15 s a run, which a save waiting for the process paid)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
