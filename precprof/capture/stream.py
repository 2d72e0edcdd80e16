"""The Profiler's stream writer: each flush's host rows become Parquet parts of the run directory
(``precprof.parts``), written on a background thread so that a training step never waits for the disk.

Invariants:

- Bounded memory: at most ``max_queued`` flushes wait for the thread (plus the one it writes). When the disk
  is slower than training, ``put`` blocks the step that flushes until one is written: memory stays bounded
  rather than training running ahead of the disk.
- What is on disk is consistent at every moment: each part is atomic, and a flush's steps part is written
  last (it commits the flush; see ``precprof.parts``).
- A failure to write (a full disk, a read-only file system) never raises into training: the flush that failed
  and every later one are kept in memory instead (``unwritten``), ``error`` says why, and the tables still
  hold every row. The stream also stops while less than ``RESERVE_BYTES`` are free, so that the end of the run
  still has room to write summary.json with the cause.
- ``drain()`` returns when everything queued is on disk; ``close()`` also ends the thread, and ``reopen()``
  starts it again. None touches a device: the rows were copied to the host by the Profiler's one sync.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import threading
from pathlib import Path

from precprof import _signals, parts
from precprof import tables as T
from precprof.capture.recorded import Flush

# flushes that may wait for the writer thread: with the one being written, three sampled steps in host memory
MAX_QUEUED = 2
RESERVE_BYTES = 1 << 20  # left free on the run directory's file system for the end of the run


class StreamWriter:
    """Writes flushes into ``segment`` (a folder of the run's stream) as parts numbered from 0."""

    def __init__(self, run_dir: Path, segment: parts.Segment, max_queued: int = MAX_QUEUED) -> None:
        self.run_dir = run_dir
        self.segment = segment
        self.error: str | None = None
        self.unwritten: list[Flush] = []
        self.parts_written = 0
        self.compact_error: str | None = None  # why the last merge of parts failed (they stay single)
        self._seq = 0
        self._current: Flush | None = None
        self._queue: queue.Queue[Flush | None] = queue.Queue(maxsize=max(1, max_queued))
        self._thread = threading.Thread()
        self.reopen()

    def reopen(self) -> None:
        """Start the writer thread (again, after ``close()``: a re-attached Profiler's flushes go on into the
        same segment, numbered after the last part). Idempotent."""
        if not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="precprof-stream", daemon=True)
            self._thread.start()

    def put(self, flush: Flush) -> None:
        """Queue one flush for writing; waits while ``max_queued`` flushes wait (bounded memory).

        The queue takes it with signals deferred (``precprof._signals``): a Ctrl-C raised inside ``Queue.put``
        between its count of unfinished flushes and its notify would leave the writer asleep on an empty queue
        and the save that follows waiting for it forever. The wait for room is outside, where a signal stops
        it."""
        if flush.empty:
            return
        while True:
            if not self._thread.is_alive():  # closed: keep it in memory rather than lose it
                self.unwritten.append(flush)
                return
            with _signals.deferred(None):
                try:
                    self._queue.put_nowait(flush)
                    return
                except queue.Full:
                    pass
            # the writer is behind the training: wait until it takes a flush (its ``get`` notifies at once; a
            # sleep of 5 ms had kept a step waiting that long after the room was there)
            with self._queue.not_full:  # (the queue's own lock: ``full()`` would take it again)
                if len(self._queue.queue) >= self._queue.maxsize:
                    self._queue.not_full.wait(0.05)

    def held(self) -> list[Flush]:
        """The flushes in host memory: queued, being written, or kept after a failure to write."""
        with self._queue.mutex:
            queued = [f for f in self._queue.queue if f is not None]
        current = self._current
        return [*queued, *([current] if current is not None else []), *self.unwritten]

    def drain(self) -> None:
        """Wait until every queued flush is written (or kept in ``unwritten``)."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Write what is queued and end the thread. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            flush = self._queue.get()
            try:
                if flush is None:
                    return
                if self.error is not None:
                    self.unwritten.append(flush)
                    continue
                self._current = flush
                try:
                    self._write(flush)
                except Exception as e:  # writing must never take training down; the rows stay in memory
                    self.error = f"{type(e).__name__}: {e}"
                    self.unwritten.append(flush)
                finally:
                    self._current = None
            finally:
                self._queue.task_done()

    def _write(self, flush: Flush) -> None:
        free = shutil.disk_usage(self.segment.path).free
        if free < RESERVE_BYTES:
            raise OSError(
                errno.ENOSPC,
                f"{os.strerror(errno.ENOSPC)} (less than {RESERVE_BYTES >> 20} MiB left: the stream stopped to "
                "leave room for summary.json)",
            )
        seq = self._seq
        self._seq += 1
        tables = flush.arrow()
        # the steps part last: it commits the flush (a kill before it leaves the others unread)
        for name in (*(n for n in T.TABLES if n != parts.COMMIT_TABLE), parts.COMMIT_TABLE):
            table = tables.get(name)
            if table is None or (table.num_rows == 0 and name != parts.COMMIT_TABLE):
                continue
            parts.write_part(parts.part_path(self.segment.path, seq, name), table)
            self.parts_written += 1
        if (seq + 1) % parts.COMPACT_EVERY == 0:
            try:  # the last COMPACT_EVERY flushes as one part per table: what a reader opens stays few files
                parts.compact(self.segment.path, seq + 1 - parts.COMPACT_EVERY, seq, T.TABLES)
            except Exception as e:  # the single parts are still there and read as before
                self.compact_error = f"{type(e).__name__}: {e}"
