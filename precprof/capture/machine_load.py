"""How busy the machine was with other work while a Profiler timed its steps (summary.json's
``capture.machine_load``, and ``final.other_cpu_cores`` beside the run's tokens per second).

A run timed while another job kept cores busy is steadily slower: its steps are even (``step_time_spread`` stays
small) and its tokens per second read as the format's speed. ``precprof compare`` compares two runs' speeds only
when they were timed under about the same load (``analysis.comparison.load_differs``).

On Linux the machine's busy CPU time comes from ``/proc/stat`` (its first line: the jiffies of every CPU in user,
nice, system, irq, softirq and steal time; ``os.sysconf("SC_CLK_TCK")`` of them a second), read when the Profiler
is attached and when it is detached; the run's own CPU time over the same window is taken off it: this
process's (every thread: ``time.process_time``) and its stream writer process's (``/proc/<pid>/stat``'s utime
and stime: ``capture.writer_process.pids``). What remains, over the window's wall time, is ``other_cpu_cores``:
how many cores other work kept busy on average. A few reads per attachment, on the host, never in a step.
Where ``/proc/stat`` is absent (macOS, Windows) nothing is measured: ``other_cpu_cores`` is None.

Other processes of the run itself that precprof does not know of (a DataLoader's workers) count as other work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PROC_STAT = "/proc/stat"
# the fields of /proc/stat's "cpu" line that are busy time: user, nice, system, (idle, iowait left out), irq,
# softirq, steal ("guest" is inside "user" already)
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def busy_ticks(stat_text: str) -> int | None:
    """The machine's busy jiffies from the text of ``/proc/stat`` (its aggregate "cpu" line); None when there
    is none."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:]]
            return sum(values[i] for i in BUSY_FIELDS if i < len(values))
    return None


def process_ticks(pid_stat_text: str) -> int | None:
    """A process's CPU jiffies (utime + stime, every thread) from the text of its ``/proc/<pid>/stat``; None when
    it does not parse. Its name, in parentheses, may hold spaces and parentheses: the fields after the last ")"
    are counted from the state, field 3 (utime is field 14, stime 15)."""
    tail = pid_stat_text.rpartition(")")[2].split()
    try:
        return int(tail[11]) + int(tail[12])
    except (IndexError, ValueError):
        return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _ticks_per_s() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, OSError, ValueError):
        return 100


@dataclass(frozen=True)
class Snapshot:
    """The counters at one moment: wall clock (s), the machine's busy jiffies, this process's CPU seconds and
    each writer process's jiffies (by pid)."""

    wall_s: float
    busy: int
    own_s: float
    writers: Mapping[int, int] = field(default_factory=dict)


# set to 0: nothing measured (``other_cpu_cores`` None, compare says nothing of the load): for a machine whose
# other work varies by design while its runs are compared (a test suite's other workers; the project's own tests)
ENV = "PRECPROF_MACHINE_LOAD"


def take(writer_pids: Iterable[int] = (), read: Callable[[str], str | None] = _read) -> Snapshot | None:
    """The counters now; None where ``/proc/stat`` cannot be read (not Linux), or where ``ENV`` is 0."""
    if os.environ.get(ENV, "").strip() == "0":
        return None
    text = read(PROC_STAT)
    busy = busy_ticks(text) if text is not None else None
    if busy is None:
        return None
    writers = {}
    for pid in writer_pids:
        text = read(f"/proc/{pid}/stat")
        ticks = process_ticks(text) if text is not None else None
        if ticks is not None:
            writers[pid] = ticks
    return Snapshot(time.perf_counter(), busy, time.process_time(), writers)


def other_cpu_s(start: Snapshot, end: Snapshot, ticks_per_s: int) -> float:
    """CPU seconds the machine spent on work other than this run's between ``start`` and ``end``: its busy time,
    less this process's and its writer processes' (a writer that started in between: all of its time). Never
    below 0 (the machine's jiffies and the process's clock tick apart)."""
    writers = sum(t - start.writers.get(pid, 0) for pid, t in end.writers.items())
    machine_s = (end.busy - start.busy) / ticks_per_s
    return max(0.0, machine_s - (end.own_s - start.own_s) - writers / ticks_per_s)


class MachineLoad:
    """The other work over a Profiler's attachments: ``begin`` at attach, ``end`` at detach (each a couple of
    file reads); ``figures`` for the summary."""

    def __init__(self, writer_pids: Callable[[], list[int]]) -> None:
        self._writer_pids = writer_pids
        self._start: Snapshot | None = None
        self._other_s = 0.0
        self._wall_s = 0.0
        self._measured = False

    def begin(self) -> None:
        self._start = take(self._writer_pids())

    def end(self) -> None:
        start, self._start = self._start, None
        if start is None:
            return
        stop = take(self._writer_pids())
        if stop is None:
            return
        self._other_s += other_cpu_s(start, stop, _ticks_per_s())
        self._wall_s += stop.wall_s - start.wall_s
        self._measured = True

    def figures(self) -> dict[str, Any]:
        """``other_cpu_cores`` (cores busy with other work on average while attached; None where not measured),
        ``cpu_count`` (the machine's logical CPUs) and ``window_s`` (the seconds measured)."""
        cores = self._other_s / self._wall_s if self._measured and self._wall_s > 0 else None
        return {
            "other_cpu_cores": round(cores, 3) if cores is not None else None,
            "cpu_count": os.cpu_count(),
            "window_s": round(self._wall_s, 3) if self._measured else None,
        }
