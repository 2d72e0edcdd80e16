"""Dashboard events into TensorBoard event files: a log directory's written on the calling thread
(``SyncEventWriter``), or through the ``torch.utils.tensorboard.SummaryWriter`` a caller hands in.

Scalars with ``add_scalar``; exponent histograms with ``add_histogram_raw``, bucket limits in log2 units (the
right edge e + 1 of each binade [e, e+1)), so TensorBoard's histogram view shows the exponent distribution.
The histogram's ``sum`` and ``sum_squares`` are over the bins' exponents e (floor(log2|x|)), not the values.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import numpy as np

from precprof.errors import UserError
from precprof.export.events import Event, Histogram, Scalar


def summary_writer_class(option: str = "tensorboard=...") -> Any:
    """``SummaryWriter``, or a one-line UserError when the tensorboard package is missing."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it and says so less plainly)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(f"{option} needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter


def check_log_dir(path: str, option: str) -> None:
    """Refuse, with a one-line UserError, a log directory that cannot be: a file, or in a place that does not
    exist or cannot be written. Creates nothing (the writer makes it at its first event)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{option} {path}: is a file, not a directory; choose another {option}")
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise UserError(f"{option} {path}: {here} is a file, not a directory; choose another {option}")
    if not os.access(here, os.W_OK | os.X_OK):
        what = "is not writable" if here == os.path.abspath(path) else f"cannot be created in {here}"
        raise UserError(f"{option} {path}: {what}; choose another {option}")


class TensorBoardSink:
    """Writes events to a SummaryWriter: ``target`` is a log directory (a writer is created there, and closed
    by ``close``) or a SummaryWriter the caller owns (flushed, never closed, by ``close``). A log directory
    that cannot be written is a one-line UserError: when made (a file, an unwritable place) or when the
    writer fails to create or write it (a read-only file system, a full disk)."""

    def __init__(self, target: Any, option: str = "tensorboard=...") -> None:
        writer_class = summary_writer_class(option)
        if isinstance(target, (str, os.PathLike)):
            self.target: Any = os.fspath(target)
            check_log_dir(self.target, option)
            self._owned = True
        elif isinstance(target, writer_class) or hasattr(target, "add_histogram_raw"):
            self.target = target
            self._owned = False
        else:
            raise UserError(
                f"{option}: expected a directory or a torch.utils.tensorboard.SummaryWriter, "
                f"got {type(target).__name__}"
            )
        self._option = option
        self._writer: Any = None if self._owned else target

    @property
    def writer(self) -> Any:
        """The writer: a log directory's (``SyncEventWriter``, made at the first write), or the caller's
        SummaryWriter."""
        if self._writer is None:
            with self._cannot_write():
                self._writer = SyncEventWriter(self.target)
        return self._writer

    @contextlib.contextmanager
    def _cannot_write(self) -> Iterator[None]:
        """An OSError writing a log directory precprof made as one line naming it (never for a writer the
        caller owns: that one's errors are the caller's)."""
        try:
            yield
        except OSError as e:
            if not self._owned:
                raise
            raise UserError(
                f"{self._option} {self.target}: cannot write the log there ({e.strerror or e}); "
                f"choose another {self._option}"
            ) from None

    def write(self, events: Iterable[Event]) -> None:
        with self._cannot_write():
            self._write(events)

    def _write(self, events: Iterable[Event]) -> None:
        w = self.writer
        for e in events:
            if isinstance(e, Scalar):
                w.add_scalar(e.tag, e.value, global_step=e.step)
            elif isinstance(e, Histogram):
                exps = np.arange(e.first, e.first + len(e.counts), dtype=np.float64)
                counts = e.counts.astype(np.float64)
                w.add_histogram_raw(
                    e.tag,
                    min=float(e.first),
                    max=float(e.first + len(e.counts)),
                    num=float(counts.sum()),
                    sum=float((exps * counts).sum()),
                    sum_squares=float((exps * exps * counts).sum()),
                    bucket_limits=(exps + 1.0).tolist(),
                    bucket_counts=counts.tolist(),
                    global_step=e.step,
                )
        w.flush()  # a live run is watched as it goes: SummaryWriter would otherwise wait up to 2 minutes

    def restart(self, step: int) -> None:
        """A run resumed at ``step``: a SessionLog START there, on which TensorBoard drops the points the killed
        job wrote from ``step`` on (the run's tables supersede them the same way)."""
        from tensorboard.compat.proto.event_pb2 import Event as TBEvent
        from tensorboard.compat.proto.event_pb2 import SessionLog

        writer = getattr(self.writer, "file_writer", None)  # SummaryWriter's, made with it
        if writer is None:
            return
        with self._cannot_write():
            writer.add_event(
                TBEvent(step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START))
            )
            self.writer.flush()

    def close(self) -> None:
        """Close the log directory's event file (a write after it, a Profiler attached again, starts a new one:
        the closed one kept its writer and the sink died on "write to closed file"), or flush the caller's
        SummaryWriter (theirs to close)."""
        if self._writer is None:
            return
        if self._owned:
            writer, self._writer = self._writer, None
            with self._cannot_write():
                writer.close()
        else:
            self._writer.flush()


class SyncEventWriter:
    """A TensorBoard event file written on the calling thread, with what of ``SummaryWriter`` the sink uses
    (``add_scalar``, ``add_histogram_raw``, ``flush``, ``close``, ``file_writer.add_event``).

    SummaryWriter writes on a thread of its own, which on a full disk died with a traceback on the terminal
    beside precprof's one-line warning; the sink flushed after every write anyway, so the thread bought no
    time. Here a write that fails raises OSError to the sink, which says it in one line and stops."""

    def __init__(self, log_dir: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as TBEvent
        from tensorboard.summary.writer.record_writer import RecordWriter

        os.makedirs(log_dir, exist_ok=True)
        self._file = _new_event_file(log_dir)
        self._records = RecordWriter(self._file)
        self._event_class = TBEvent
        self.file_writer = self
        self.add_event(TBEvent(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add_event(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def _summary(self, summary: Any, step: int) -> None:
        self.add_event(self._event_class(wall_time=time.time(), step=int(step), summary=summary))

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        from torch.utils.tensorboard.summary import scalar

        self._summary(scalar(tag, float(value)), global_step)

    def add_histogram_raw(self, tag: str, *, global_step: int, **raw: Any) -> None:
        from torch.utils.tensorboard.summary import histogram_raw

        self._summary(histogram_raw(tag, **raw), global_step)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.flush()
            finally:
                self._file.close()


_file_number = itertools.count()  # this process's event files, in the order they were made


def _new_event_file(log_dir: str) -> BinaryIO:
    """A new event file in ``log_dir``, opened for writing: never one that exists (a second writer in the same
    second, host and process, a Profiler attached again or a job resumed in the same process, had the same name
    and wiped the first's file). The name goes on from TensorBoard's, ``events.out.tfevents.<second>.<host>.
    <pid>``, with a number that grows with each file this process makes (zero-padded: TensorBoard reads a
    folder's files in the order of their names, and a step older than the last one read drops the newer ones)."""
    prefix = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    while True:
        path = os.path.join(log_dir, f"{prefix}.{next(_file_number):06d}.precprof")
        try:
            return open(path, "xb")  # closed by SyncEventWriter.close
        except FileExistsError:  # another process of the same pid and host (a container restarted) made it
            continue
