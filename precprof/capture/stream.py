"""The Profiler's stream writer: each flush's host rows become Parquet parts of the run directory
(``precprof.parts``), written by a process of their own (``precprof.stream_child``) so that a training step
never waits for the disk, nor for the decoding and the writing, which held the interpreter lock that every op
of the training takes.

The training's thread pickles each flush (its sampled steps' rows compact, as the copy brought them: 0.2-0.3
ms for 800 rows) and queues it; the writer thread hands it to the process and waits, without the lock, until
the process says its parts are on disk. The process is shared by the runs of this Python process
(``precprof.capture.writer_process``). Where it cannot start (no Python executable, a frozen application),
the thread writes itself, as before: ``writer`` says which, ``writer_note`` why.

Invariants:

- Bounded memory: at most ``max_queued`` flushes wait for the writer (plus those it writes: the ones it found
  queued, written as one, since most of a write's cost is per file). When the disk is slower than training,
  ``put`` blocks the step that flushes until the writer takes what waits: memory stays bounded rather than
  training running ahead of the disk.
- What is on disk is consistent at every moment: each part is atomic, and a flush's steps part is written
  last (it commits the flush; see ``precprof.parts``). A flush is held here until it is on disk.
- What a kill (SIGKILL, the OOM killer) of the training's process keeps: every flush the process took whole
  (its pipe holds a message written whole after its writer dies; it writes it, then exits). It loses what is
  still here: the flush being handed over, those queued behind it (``max_queued``), and, while the process
  starts (``_process_ready``: its imports, at niceness 19, take seconds on busy cores), the flush this thread
  writes itself (its parts so far stay behind without their steps part: skipped whole when read) and those
  queued behind it. Sending each flush on into the pipe at once would keep the queued ones too.
- A failure to write (a full disk, a read-only file system, the process ended) never raises into training: the
  flush that failed and every later one are kept in memory instead (``unwritten``), ``error`` says why, and
  the tables still hold every row, unless what the stream wrote is gone (its folder removed mid-run:
  ``steps_written`` says which steps it wrote, ``parts_gone`` whether its folder is still there). The stream
  also stops while less than ``RESERVE_BYTES`` are free, so that the end of the run still has room to write
  summary.json with the cause.
- ``drain()`` returns when everything queued is on disk; ``close()`` also ends the thread, and ``reopen()``
  starts it again (the process stays the run's; ``end()`` gives it back). None touches a device: the rows were
  copied to the host by the Profiler's one sync.
- An interpreter that exits with a run still streaming (a script's loop ended by an uncaught exception, Ctrl-C
  or ``sys.exit`` without ``detach()``) first writes what its writers were handed (``_drain_at_exit``, up to
  ``EXIT_WAIT_S``): the thread is a daemon, which the interpreter's end stopped mid-write, losing the flushes
  still queued and leaving the part it wrote as a ``.tmp``. Steps not flushed yet (on the device) stay lost,
  as under a kill.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from precprof import _atomic, _signals, parts, stream_child
from precprof import tables as T
from precprof.capture import writer_process
from precprof.flush import Flush
from precprof.stream_child import RESERVE_BYTES

# flushes that may wait for the writer thread: with those being written, at most five sampled steps in host memory
MAX_QUEUED = 2
# False: the writer thread writes the parts itself, as where the process cannot start (the tests that fake a
# failure inside this process set it)
USE_PROCESS = True
# seconds an exiting interpreter waits, at most, for the stream's writers to write what they were handed
EXIT_WAIT_S = 30.0
# after this long it says why it waits
EXIT_NOTE_S = 1.0

__all__ = ["EXIT_WAIT_S", "MAX_QUEUED", "RESERVE_BYTES", "USE_PROCESS", "StreamWriter"]

_streaming: weakref.WeakSet[StreamWriter] = weakref.WeakSet()  # writers whose thread was started


class StreamWriter:
    """Writes flushes into ``segment`` (a folder of the run's stream) as parts numbered from 0."""

    def __init__(self, run_dir: Path, segment: parts.Segment, max_queued: int = MAX_QUEUED) -> None:
        self.run_dir = run_dir
        self.segment = segment
        self.error: str | None = None
        self.unwritten: list[Flush] = []
        self.parts_written = 0
        # the steps whose rows this writer put on disk, as [first, last] ranges (one for a run's usual steps)
        self.steps_written: list[list[int]] = []
        self.compact_error: str | None = None  # why the last merge of parts failed (they stay single)
        # who writes: a process of its own, or this writer's thread
        self.writer = "process" if USE_PROCESS else "thread"
        self.writer_note: str | None = None  # why the thread writes, where the process could not
        # the training's thread: sampled steps waiting for room in the queue (the writer behind), and how many
        # did; making flushes ready (pickled for the process, Arrow tables for the thread)
        self.waited_s = 0.0
        self.waits = 0
        self.prepared_s = 0.0
        self._niceness: int | None = None  # the writer process's, read at the first wait
        self._seq = 0
        self._current: list[Flush] = []  # the flushes being written
        self._queue: queue.Queue[Flush | None] = queue.Queue(maxsize=max(1, max_queued))
        self._thread = threading.Thread()
        self._compact_every = parts.COMPACT_EVERY
        # where the parts go, whatever the working directory of the process (started by an earlier run, from
        # another folder) or of the training later
        self._where = Path(os.path.abspath(segment.path))
        self._proc: writer_process.WriterProcess | None = None  # the process this run hands its flushes to
        self._channel = -1  # this run's, in it
        self._handed = False  # flushes handed to it since the last ``_sync``
        self._wire = stream_child.Wire()
        self._release: weakref.finalize[Any, Any] | None = None  # gives the process back at collection
        self._exiting = False  # closed at the interpreter's exit: no wait for the process's merge
        self._end_queued = False  # (its end queued there)
        self.reopen()

    def reopen(self) -> None:
        """Start the writer thread, and take the writer process unless this run has it (again, after
        ``close()``: a re-attached Profiler's flushes go on into the same segment, numbered after the last
        part). Idempotent."""
        if not self._thread.is_alive():
            if self.writer == "process" and (self._proc is None or not self._proc.alive()):
                self._give_back()  # (one that ended while the Profiler was detached)
                self._take_process()
            self._exiting = self._end_queued = False
            self._thread = threading.Thread(target=self._run, name="precprof-stream", daemon=True)
            self._thread.start()
            _streaming.add(self)

    def put(self, flush: Flush) -> None:
        """Queue one flush for writing; waits while ``max_queued`` flushes wait (bounded memory).

        The flush is made ready for the writer here, on the training's thread: pickled for the process, or
        its Arrow tables made for the thread (there, these milliseconds of Python would hold the interpreter
        lock against the training's every op for the flush's whole write). A failure to do so never ends the
        training: the writer's thread meets it again, records it and keeps the flush in memory.

        The queue takes it with signals deferred (``precprof._signals``): a Ctrl-C raised inside ``Queue.put``
        between its count of unfinished flushes and its notify would leave the writer asleep on an empty queue
        and the save that follows waiting for it forever. The wait for room is outside, where a signal stops
        it."""
        if flush.empty:
            return
        t0 = time.perf_counter()
        with _signals.deferred(None), contextlib.suppress(Exception):
            if self.writer == "process":
                flush._wire = self._wire.encode(flush)
            else:
                flush.arrow()
        self.prepared_s += time.perf_counter() - t0
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
            self._wait_for_room()

    def make_room(self) -> float:
        """Wait until ``put`` finds room at once (the writer took what waited), or the writer is closed: the
        Profiler waits here before it stamps a sampled step's time, so that the steps table's ``time_s`` holds
        the wait, as the step did (a step that waited 27 ms for a writer behind had read 2.4 ms there). Returns
        the seconds waited (0.0 without a wait): precprof's own time, never a pause of the loop's."""
        if not (self._thread.is_alive() and len(self._queue.queue) >= self._queue.maxsize):
            return 0.0
        t0 = time.perf_counter()  # the writer is behind the training: the step's wait, for the summary
        while self._thread.is_alive() and len(self._queue.queue) >= self._queue.maxsize:
            self._wait_for_room()
        waited = time.perf_counter() - t0
        self.waited_s += waited
        self.waits += 1
        if self._niceness is None:
            self._niceness = self._read_niceness()
        return waited

    def timing(self) -> dict[str, Any]:
        """What the stream cost the training's thread, for the summary: ``waited_s``, the seconds sampled steps
        waited for room in the queue (``make_room``: they came faster than the writer wrote them, a writer
        process starved of CPU at its niceness, ``writer_niceness`` as read at the first wait, or a slow disk),
        in ``waits`` steps (a wait of ``put`` at the end of the run, outside any step, is not counted);
        ``prepared_s``, the seconds it made flushes ready for the writer (pickled, or Arrow tables made)."""
        return {
            "waited_s": self.waited_s,
            "waits": self.waits,
            "prepared_s": self.prepared_s,
            "writer_niceness": self._niceness,
        }

    def _read_niceness(self) -> int | None:
        """The writer process's niceness, read from outside (None: the thread writes, or it cannot be read)."""
        proc, getpriority = self._proc, getattr(os, "getpriority", None)
        if self.writer != "process" or proc is None or getpriority is None:
            return None
        try:
            return int(getpriority(os.PRIO_PROCESS, proc.proc.pid))
        except OSError:  # it ended
            return None

    def _wait_for_room(self) -> None:
        """The writer is behind the training: wait until it takes a flush (its ``get`` notifies at once; a sleep
        of 5 ms had kept a step waiting that long after the room was there), 50 ms at most."""
        with self._queue.not_full:  # (the queue's own lock: ``full()`` would take it again)
            if len(self._queue.queue) >= self._queue.maxsize:
                self._queue.not_full.wait(0.05)

    def parts_gone(self) -> bool:
        """Whether this writer wrote parts and their folder is no longer there (removed while the run streamed:
        the steps it wrote are lost)."""
        return bool(self.steps_written) and not self._where.is_dir()

    def _note_written(self, flushes: list[Flush]) -> None:
        """Add the steps of ``flushes``, on disk now, to ``steps_written``."""
        ranges = self.steps_written
        for flush in flushes:
            for row in flush.step_rows:
                step = int(row[T.STEP])
                if ranges and ranges[-1][0] <= step <= ranges[-1][1] + 1:
                    ranges[-1][1] = max(ranges[-1][1], step)
                else:
                    ranges.append([step, step])

    def held(self) -> list[Flush]:
        """The flushes in host memory: queued, being written, or kept after a failure to write."""
        with self._queue.mutex:
            queued = [f for f in self._queue.queue if f is not None]
        return [*queued, *self._current, *self.unwritten]

    def drain(self) -> None:
        """Wait until every queued flush is written (or kept in ``unwritten``)."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Write what is queued and end the thread. Idempotent. The process stays this run's for ``reopen()``
        (a Profiler detached and attached again, around each evaluation say); ``end()`` gives it back, and so
        does this writer's collection."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._proc is not None and not self._proc.ready and self._proc.proc.poll() is not None:
            self._process_ready()  # it ended before a flush asked: say why (``writer_note``)

    def end(self) -> None:
        """``close()``, and give the process back (the run is saved). Idempotent; ``reopen()`` takes it
        again."""
        self.close()
        self._give_back()

    def close_by(self, deadline: float) -> bool:
        """``close()`` at the interpreter's exit, waiting until ``deadline`` (``time.monotonic()``) at most:
        whether the thread wrote everything and ended. It leaves the merge of the parts to the process (which
        finishes it before it exits) rather than wait for it."""
        if not self._thread.is_alive():
            return True
        if not self._end_queued:
            self._exiting = True
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                return False
            self._end_queued = True
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            batch = self._take()
            try:
                flushes = [f for f in batch if f is not None]
                if self.error is not None:
                    self.unwritten += flushes
                else:
                    self._current = flushes
                    try:
                        self._write_batch(flushes)
                    except Exception as e:  # writing must never take training down; the rows stay in memory
                        self.error = (
                            str(e) if isinstance(e, writer_process.WriteError) else f"{type(e).__name__}: {e}"
                        )
                        self.unwritten += self._current
                    finally:
                        self._current = []
                if batch[-1] is None:
                    self._sync()
            finally:
                for _ in batch:
                    self._queue.task_done()
            if batch[-1] is None:
                return

    def _sync(self) -> None:
        """Closing: wait for the process's merge of this run's parts (it merges beside the writing), so that
        the run is read, and saved, whole."""
        proc = self._proc
        if self._handed and proc is not None and self.error is None and not self._exiting:
            self._handed = False
            try:
                how = proc.hand_over(self._wire, self._channel, -1, self._where, self._compact_every, [], {})
            except Exception as e:  # every flush is on disk already: only a merge may be missing
                self.compact_error = f"{type(e).__name__}: {e}"
            else:
                self._wrote(*how)

    def _take(self) -> list[Flush | None]:
        """The next flush, and every flush queued behind it (a writer behind the training writes them as one:
        most of a write's cost is per file), up to the end (None) if it is queued."""
        batch = [self._queue.get()]
        while batch[-1] is not None:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _write_batch(self, batch: list[Flush]) -> None:
        """Write ``batch``: handed over to the process as one flush where each was pickled for it, else one by
        one (by the process or this thread)."""
        wires = [f._wire for f in batch]
        if len(batch) > 1 and all(w is not None for w in wires) and self._process_ready():
            for f in batch:
                f._wire = None
            self._hand_over([w for w in wires if w is not None])
            self._note_written(batch)
            return
        for i, flush in enumerate(batch):
            self._write(flush)
            self._note_written([flush])
            self._current = batch[i + 1 :]  # (written: no longer held here)

    def _write(self, flush: Flush) -> None:
        wire, flush._wire = flush._wire, None
        if wire is None or not self._process_ready():  # the thread writes (no process yet, or no pickle)
            seq = self._next_seq()
            self._wrote(*stream_child.write_flush(self._where, seq, flush, self._compact_every))
        else:
            self._hand_over([wire])

    def _hand_over(self, wires: list[tuple[bytes, dict[int, Any]]]) -> None:
        assert self._proc is not None
        refs = {k: v for _, r in wires for k, v in r.items()}
        bodies = [body for body, _ in wires]
        seq = self._next_seq()
        self._handed = True
        self._wrote(
            *self._proc.hand_over(
                self._wire, self._channel, seq, self._where, self._compact_every, bodies, refs
            )
        )

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _wrote(self, written: int, compact_error: str | None) -> None:
        self.parts_written += written
        if compact_error is not None:
            self.compact_error = compact_error

    # ------------------------------------------------------------------------------------ the process
    def _take_process(self) -> None:
        """Take the writer process (started unless this Python has one); it says when it is ready
        (``_process_ready``). Where it cannot start, the thread writes (``writer_note`` says why)."""
        try:
            self._proc, self._channel = writer_process.acquire()
        except Exception as e:
            self._no_process(e)
            return
        self._release = weakref.finalize(self, writer_process.release, self._proc, self._channel)

    def _process_ready(self) -> bool:
        """Whether the process is there to hand flushes to. While it starts (imports take about 0.4 s) the
        thread writes the flushes itself rather than hold them: a step never waits for it, and what is held
        stays bounded."""
        proc = self._proc
        if proc is None:
            return False
        if proc.is_ready():
            return True
        if proc.failed is not None:  # it ended, or is not ours
            self._give_back()
            self._no_process(proc.failed)
        return False

    def _no_process(self, why: Exception | str) -> None:
        """The thread writes: the process could not start (``why``: the error, or the process's ``failed``)."""
        self.writer = "thread"
        said = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        self.writer_note = f"the stream's writer process did not start ({said})"

    def _give_back(self) -> None:
        release, self._release, self._proc = self._release, None, None
        if release is not None:
            release()


# (registered after ``writer_process``'s: run before it, while the process still takes flushes)
@atexit.register
def _drain_at_exit() -> None:
    """Before the interpreter ends: every stream writer still writing writes what it was handed, waiting
    ``EXIT_WAIT_S`` in all at most (said after ``EXIT_NOTE_S``), and says which run kept less where that was
    not enough. A Profiler saved or detached before has nothing left here."""
    started = time.monotonic()
    deadline = started + EXIT_WAIT_S
    writers = [w for w in list(_streaming) if w._thread.is_alive()]
    if not writers:
        return
    said = False
    try:
        for writer in writers:
            if not said and not writer.close_by(min(deadline, started + EXIT_NOTE_S)):
                said = True
                print(
                    f"precprof: writing the last recorded steps of {writer.run_dir} before exiting "
                    f"(up to {EXIT_WAIT_S:g} s; Ctrl-C to leave them out)",
                    file=sys.stderr,
                    flush=True,
                )
            if not writer.close_by(deadline):
                _left(writer, f"its writer was still writing after {EXIT_WAIT_S:g} s")
    except KeyboardInterrupt:
        for writer in writers:
            if writer._thread.is_alive():
                _left(writer, "Ctrl-C at exit")


def _left(writer: StreamWriter, why: str) -> None:
    """Say that ``writer``'s run lost the steps it still held at exit, and remove the part it was writing (the
    interpreter's end stops its thread for good)."""
    for tmp in Path(writer._where).glob(f".*.{os.getpid()}{_atomic.TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            tmp.unlink()
    print(
        f"precprof: the last recorded steps of {writer.run_dir} were not written ({why}); the steps before "
        "them are in its stream",
        file=sys.stderr,
        flush=True,
    )
