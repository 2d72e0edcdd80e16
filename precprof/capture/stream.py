"""The Profiler's stream writer: each flush's host rows become Parquet parts of the run directory
(``precprof.parts``), written by a process of their own (``precprof.stream_child``) so that a training step
never waits for the disk, nor for the decoding and the writing, which held the interpreter lock that every op
of the training takes.

The training's thread pickles each flush (its sampled steps' rows compact, as the copy brought them: 0.2-0.3
ms for 800 rows) and queues it; the writer thread hands it to the process and waits, without the lock, until
the process says its parts are on disk. Where the process cannot start (no Python executable, a frozen
application), the thread writes itself, as before: ``writer`` says which, ``writer_note`` why.

Invariants:

- Bounded memory: at most ``max_queued`` flushes wait for the writer (plus the one it writes). When the disk
  is slower than training, ``put`` blocks the step that flushes until one is written: memory stays bounded
  rather than training running ahead of the disk.
- What is on disk is consistent at every moment: each part is atomic, and a flush's steps part is written
  last (it commits the flush; see ``precprof.parts``). A flush is held here until it is on disk.
- A failure to write (a full disk, a read-only file system, the process ended) never raises into training: the
  flush that failed and every later one are kept in memory instead (``unwritten``), ``error`` says why, and
  the tables still hold every row. The stream also stops while less than ``RESERVE_BYTES`` are free, so that
  the end of the run still has room to write summary.json with the cause.
- ``drain()`` returns when everything queued is on disk; ``close()`` also ends the thread, and ``reopen()``
  starts it again (the process waits, idle, for it; ``end()`` ends it). None touches a device: the rows were
  copied to the host by the Profiler's one sync.
"""

from __future__ import annotations

import contextlib
import json
import queue
import select
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import IO, Any

from precprof import _signals, parts, stream_child
from precprof.flush import Flush
from precprof.stream_child import RESERVE_BYTES

# flushes that may wait for the writer thread: with the one being written, three sampled steps in host memory
MAX_QUEUED = 2
# False: the writer thread writes the parts itself, as where the process cannot start (the tests that fake a
# failure inside this process set it)
USE_PROCESS = True
# The process's program: it imports this very precprof (from the folder that holds it: a source tree run with
# its path added at run time too), and nothing from the working directory, which ``python -m`` would put first
# (a user's json.py there would shadow the standard library's)
_ROOT = str(Path(stream_child.__file__).resolve().parents[1])
_PROGRAM = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    f"if {_ROOT!r} not in sys.path:\n"
    f"    sys.path.insert(0, {_ROOT!r})\n"
    "from precprof.stream_child import main\n"
    "sys.exit(main())\n"
)

__all__ = ["MAX_QUEUED", "RESERVE_BYTES", "USE_PROCESS", "StreamWriter"]


class StreamWriter:
    """Writes flushes into ``segment`` (a folder of the run's stream) as parts numbered from 0."""

    def __init__(self, run_dir: Path, segment: parts.Segment, max_queued: int = MAX_QUEUED) -> None:
        self.run_dir = run_dir
        self.segment = segment
        self.error: str | None = None
        self.unwritten: list[Flush] = []
        self.parts_written = 0
        self.compact_error: str | None = None  # why the last merge of parts failed (they stay single)
        # who writes: a process of its own, or this writer's thread
        self.writer = "process" if USE_PROCESS else "thread"
        self.writer_note: str | None = None  # why the thread writes, where the process could not
        self._seq = 0
        self._current: Flush | None = None
        self._queue: queue.Queue[Flush | None] = queue.Queue(maxsize=max(1, max_queued))
        self._thread = threading.Thread()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the process said it is ready
        self._err: IO[bytes] | None = None  # its stderr, a file
        self._wire = stream_child.Wire()
        self._release: weakref.finalize[Any, Any] = weakref.finalize(self, lambda: None)
        self.reopen()

    def reopen(self) -> None:
        """Start the writer thread, and its process unless it is there (again, after ``close()``: a
        re-attached Profiler's flushes go on into the same segment, numbered after the last part).
        Idempotent."""
        if not self._thread.is_alive():
            if self.writer == "process" and (self._proc is None or self._proc.poll() is not None):
                self._end_process()  # (one that ended while the Profiler was detached)
                self._start_process()
            self._thread = threading.Thread(target=self._run, name="precprof-stream", daemon=True)
            self._thread.start()

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
        with _signals.deferred(None), contextlib.suppress(Exception):
            if self.writer == "process":
                flush._wire = self._wire.encode(flush)
            else:
                flush.arrow()
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
        """Write what is queued and end the thread. Idempotent. The process stays, idle, for ``reopen()`` (a
        Profiler detached and attached again, around each evaluation say, would start one each time: 0.4 s of
        imports beside the training); ``end()`` ends it, and so does this writer's collection or the
        interpreter's exit (its pipe closes)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._proc is not None and not self._ready and self._proc.poll() is not None:
            self._process_ready()  # it ended before a flush asked: say why (``writer_note``)

    def end(self) -> None:
        """``close()``, and end the process (the run is saved). Idempotent; ``reopen()`` starts another."""
        self.close()
        self._end_process()

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
                    self.error = str(e) if isinstance(e, _WriteError) else f"{type(e).__name__}: {e}"
                    self.unwritten.append(flush)
                finally:
                    self._current = None
            finally:
                self._queue.task_done()

    def _write(self, flush: Flush) -> None:
        seq = self._seq
        self._seq += 1
        wire, flush._wire = flush._wire, None
        if wire is None or not self._process_ready():  # the thread writes (no process yet, or no pickle)
            written, compact_error = stream_child.write_flush(
                self.segment.path, seq, flush, parts.COMPACT_EVERY
            )
        else:
            written, compact_error = self._hand_over(seq, *wire)
        self.parts_written += written
        if compact_error is not None:
            self.compact_error = compact_error

    # ------------------------------------------------------------------------------------ the process
    def _start_process(self) -> None:
        """Start the writer process; it says when it is ready (``_process_ready``). Where it cannot start,
        the thread writes (``writer_note`` says why)."""
        err = None
        try:
            # what it says on stderr (a traceback, warnings) goes to a file, read when it ends: a pipe nobody
            # reads would stop it once full
            err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by ``_release``, with the process)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _PROGRAM, str(self.segment.path), str(parts.COMPACT_EVERY)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                # a session of its own: a terminal's Ctrl-C (or hangup) reaches the training alone, which
                # saves the run and closes the pipe
                start_new_session=True,
            )
            self._err = err
        except Exception as e:
            if err is not None:
                err.close()
            self._no_process(e)
            return
        self._ready = False
        self._wire.restart()
        self._release = weakref.finalize(self, _release, self._proc, err)  # on collection, and at exit

    def _process_ready(self) -> bool:
        """Whether the process is there to hand flushes to. While it starts (imports take about 0.4 s) the
        thread writes the flushes itself rather than hold them: a step never waits for it, and what is held
        stays bounded."""
        proc = self._proc
        if proc is None:
            return False
        if not self._ready:
            assert proc.stdout is not None
            if not select.select([proc.stdout], [], [], 0)[0]:
                return False  # still starting
            line = proc.stdout.readline()
            if line != stream_child.READY:  # it ended, or is not ours
                proc.kill()
                proc.wait()
                why = RuntimeError(f"it said {line!r}{_said(proc, self._err)}")
                self._end_process()
                self._no_process(why)
                return False
            self._ready = True
        return True

    def _no_process(self, e: Exception) -> None:
        self.writer = "thread"
        self.writer_note = f"the stream's writer process did not start ({type(e).__name__}: {e})"

    def _hand_over(self, seq: int, body: bytes, refs: dict[int, Any]) -> tuple[int, str | None]:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            for chunk in self._wire.message(seq, body, refs):
                _write_all(proc.stdin, chunk)
            line = proc.stdout.readline()
        except OSError:  # the pipe broke: the process is gone
            line = b""
        if not line:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            raise _WriteError(
                f"the stream's writer process ended (exit code {proc.returncode}){_said(proc, self._err)}"
            )
        answer = json.loads(line)
        if "error" in answer:
            raise _WriteError(answer["error"])
        return int(answer["parts"]), answer.get("compact_error")

    def _end_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self._release()


def _release(proc: subprocess.Popen[bytes], err: IO[bytes]) -> None:
    """Close the process's pipe: it has written every flush it was handed, and exits; wait for that."""
    with contextlib.suppress(OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    for stream in (proc.stdout, err):
        if stream is not None:
            stream.close()


class _WriteError(Exception):
    """A write that failed in the process, as it said it (``TypeName: message``), or the process's end."""

    def __str__(self) -> str:
        return str(self.args[0])


def _write_all(stream: IO[bytes], data: bytes) -> None:
    stream.write(data)
    stream.flush()


def _said(proc: subprocess.Popen[bytes], err: IO[bytes] | None) -> str:
    """The last line a process that ended wrote to stderr (``err``, its file), as ``: ...`` (empty when
    none)."""
    if proc.poll() is None or err is None:
        return ""
    with contextlib.suppress(OSError, ValueError):
        err.seek(0, 2)
        err.seek(max(0, err.tell() - 4096))
        text = err.read().decode(errors="replace").strip()
        if text:
            return ": " + text.splitlines()[-1][:300]
    return ""
