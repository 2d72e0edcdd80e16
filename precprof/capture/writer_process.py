"""The stream's writer process (``precprof.stream_child``): one per Python process, shared by every run that
streams from it (the runs of ``precprof compare``, a notebook's, a test session's), each on a channel of its
own. Starting one costs 0.4 s of imports (pandas, Arrow); a process per run paid that every run, beside the
training.

- ``acquire()`` hands a run the process, starting it unless one started from the same Python is there and
  alive; ``release()`` gives the run's channel back. Unused for ``IDLE_S`` it ends (its pipe closes: it has
  written everything it was handed, and exits), and so at the interpreter's exit.
- ``WriterProcess.hand_over`` sends one flush (``stream_child.Wire``) and waits, without the interpreter
  lock, for the process to say its parts are on disk; one hand-over at a time.
- A fork (a DataLoader's workers, by default on Linux) copies the pipes into the child. Held open there, the
  process would never see its input end while the workers live: the child's copies are pointed at
  ``/dev/null`` at once, and the child starts a process of its own if it streams.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from precprof import stream_child

IDLE_S = 60.0  # seconds the process waits, used by no run, before it ends
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
    # the lowest priority before its imports (0.4 s of pandas and Arrow, beside the training's first steps)
    "from precprof._priority import lower_own_priority\n"
    "lower_own_priority()\n"
    "from precprof.stream_child import main\n"
    "sys.exit(main())\n"
)

__all__ = ["IDLE_S", "WriteError", "WriterProcess", "acquire", "pids", "release"]


class WriteError(Exception):
    """A write that failed in the process, as it said it (``TypeName: message``), or the process's end."""

    def __str__(self) -> str:
        return str(self.args[0])


class WriterProcess:
    """One writer process: its pipes, whether it said it is ready, and the runs that use it."""

    _generations = itertools.count(1)

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.generation = next(self._generations)  # a Wire that knew another process sends everything again
        self.ready = False  # it said so
        self.failed: str | None = None  # why it is no writer (it said something else than ready, or ended)
        self.users = 0  # runs that hold it (``acquire``/``release``)
        self._drops: list[int] = []  # channels whose runs ended: the process forgets what they shared
        self._io = threading.Lock()  # one hand-over at a time
        # what it says on stderr (a traceback, warnings) goes to a file, read when it ends: a pipe nobody reads
        # would stop it once full
        self._err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by ``close``)
        try:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._err,
                # a session of its own: a terminal's Ctrl-C (or hangup) reaches the training alone, which
                # saves the run and closes the pipe
                start_new_session=True,
            )
        except BaseException:
            self._err.close()
            raise

    def alive(self) -> bool:
        return self.failed is None and self.proc.poll() is None

    def is_ready(self) -> bool:
        """Whether it is there to hand flushes to; never waits. While it starts (imports take about 0.4 s) a
        run's writer thread writes its flushes itself rather than hold them. False with ``failed`` set: it
        will not be."""
        if self.ready or self.failed is not None:
            return self.ready
        with self._io:
            stdout = self.proc.stdout
            if self.ready or self.failed is not None or stdout is None:
                return self.ready
            if not select.select([stdout], [], [], 0)[0]:
                return False  # still starting
            line = stdout.readline()
            if line == stream_child.READY:
                self.ready = True
            else:  # it ended, or is not ours
                self.failed = self._not_ready(line)
            return self.ready

    def _not_ready(self, line: bytes) -> str:
        """Why the process, which said ``line`` where its ready line was due, is no writer, in words: it ended
        (b"", its end's exit code or signal and its last line on stderr; it said "RuntimeError: it said b''"
        of a process killed while it started), or it is not ours (what it said). Ends it."""
        if not line:  # its output closed: it ends (its exit code, not the kill's below)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1)
        self.proc.kill()
        self.proc.wait()
        if line:
            said = line.decode(errors="replace").strip()[:200]
            return f"it printed {said!r} instead of saying it was ready{self.said()}"
        code = self.proc.returncode
        if code < 0:  # (SIGKILL: the OOM killer, or a kill -9)
            with contextlib.suppress(ValueError):
                return f"it was killed ({signal.Signals(-code).name}) before it was ready{self.said()}"
        return f"it ended before it was ready, exit code {code}{self.said()}"

    def hand_over(
        self,
        wire: stream_child.Wire,
        channel: int,
        seq: int,
        segment: Path,
        compact_every: int,
        bodies: list[bytes],
        refs: dict[int, Any],
    ) -> tuple[int, str | None]:
        """Send flushes (``wire.encode``'s ``bodies`` and their ``refs``) of ``channel``, to be written into
        ``segment`` as its parts ``seq``, one flush of them all, and wait until they are on disk: the parts
        written, and why a merge failed."""
        with self._io:
            proc = self.proc
            if proc.stdin is None or proc.stdout is None:
                raise WriteError("the stream's writer process was closed")
            if wire.generation != self.generation:
                wire.restart(self.generation)
            drops, self._drops = self._drops, []
            try:
                for chunk in wire.message(channel, seq, str(segment), compact_every, drops, bodies, refs):
                    proc.stdin.write(chunk)
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (OSError, ValueError):  # the pipe broke (the process is gone), or was closed
                line = b""
            if not line:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                raise WriteError(
                    f"the stream's writer process ended (exit code {proc.returncode}){self.said()}"
                )
        answer = json.loads(line)
        if "error" in answer:
            raise WriteError(answer["error"])
        return int(answer["parts"]), answer.get("compact_error")

    def said(self) -> str:
        """The last line the process wrote to stderr once it ended, as ``: ...`` (empty when none)."""
        if self.proc.poll() is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._err.seek(0, 2)
            self._err.seek(max(0, self._err.tell() - 4096))
            text = self._err.read().decode(errors="replace").strip()
            if text:
                return ": " + text.splitlines()[-1][:300]
        return ""

    def close(self, wait: float = 0.0) -> None:
        """Close its input: it writes every whole message it was handed, and exits; wait that long for it."""
        with self._io:
            with contextlib.suppress(OSError, ValueError):
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(wait)
            if self.proc.returncode is not None:
                for stream in (self.proc.stdout, self._err):
                    if stream is not None:
                        stream.close()

    def _forked(self) -> None:
        """In a forked child: the pipes' copies point at /dev/null (their numbers stay taken, so that closing
        the file objects later closes nothing of the child's), and nothing here is used again."""
        self.failed = "forked"
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            for stream in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError, ValueError):
                    if stream is not None:
                        os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


_lock = threading.RLock()  # re-entrant: a run's writer collected inside ``acquire`` releases its channel
_current: WriterProcess | None = None
_known: list[WriterProcess] = []  # every process not yet ended, for the fork handler and the exit
_timer: threading.Timer | None = None
_channels = itertools.count()
_exiting = False


def acquire() -> tuple[WriterProcess, int]:
    """The writer process for a new run (started unless one from this Python is alive) and the run's
    channel. Raises where it cannot start (no Python executable: a frozen application)."""
    global _current, _timer
    command = [sys.executable, "-c", _PROGRAM]
    with _lock:
        if _timer is not None:
            _timer.cancel()
            _timer = None
        wp = _current
        if wp is None or not wp.alive() or wp.command != command:
            if wp is not None and wp.users == 0:
                _end(wp)
            wp = _current = WriterProcess(command)
            _known.append(wp)
        wp.users += 1
        return wp, next(_channels)


def pids() -> list[int]:
    """The process ids of this Python's writer processes not yet ended: their CPU time is the runs' own
    (``capture.machine_load``)."""
    with _lock:
        return [wp.proc.pid for wp in _known if wp.proc.poll() is None]


def release(wp: WriterProcess, channel: int) -> None:
    """A run is done with ``wp``: it forgets the run's shared objects at the next hand-over; unused, it ends
    after ``IDLE_S`` (one that is not the current one, at once)."""
    global _timer
    with _lock:
        wp._drops.append(channel)
        wp.users -= 1
        if wp.users > 0:
            return
        if wp is not _current or not wp.alive() or _exiting:
            _end(wp)
        elif _timer is None:
            _timer = threading.Timer(IDLE_S, _idle_end, (wp,))
            _timer.daemon = True
            _timer.name = "precprof-stream-idle"
            _timer.start()


def _idle_end(wp: WriterProcess) -> None:
    global _current, _timer
    with _lock:
        if _timer is not threading.current_thread() or wp.users > 0:  # (cancelled while it fired)
            return
        _timer = None
        if _current is wp:
            _current = None
    _end(wp, wait=60.0)  # (this timer's own thread: it may wait for the process to exit)


def _end(wp: WriterProcess, wait: float = 0.0) -> None:
    """Close ``wp``'s input; it exits once it has written what it was handed (``subprocess`` reaps it)."""
    with _lock:
        if wp in _known:
            _known.remove(wp)
    wp.close(wait=0.0 if _exiting else wait)


@atexit.register
def _at_exit() -> None:
    """Close the input of every process no run holds: each writes what it was handed, then exits (in a session
    of its own, it needs no one to wait for it). One a run still holds stays open for an exit handler
    registered before this one (a callback's, which saves its run); the pipe closes when this process ends."""
    global _exiting, _current
    _exiting = True
    with _lock:
        idle = [wp for wp in _known if wp.users == 0]
        if _current in idle:
            _current = None
    for wp in idle:
        _end(wp)


def _after_fork_in_child() -> None:
    global _lock, _current, _timer
    _lock = threading.RLock()  # (it may have been held by another thread at the fork)
    for wp in _known:
        wp._io = threading.Lock()
        wp._forked()
    _known.clear()
    _current = _timer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
