"""What the report says of precprof's overhead beside its share of the run's time, from the run's own figures
(``capture.sampling`` and ``capture.stream`` of the summary):

- ``writer_wait``: where sampled steps waited for the run directory's writer (``Profiler(out=...)``: a process at
  the lowest priority, which on busy cores gets next to no CPU), how much of precprof's time that was and what to
  do: a run 20x slower than without precprof had said 88.9% and no cause.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from precprof.report import filters as F

# the wait for the stream's writer is said where it is at least this share of precprof's added time
WRITER_WAIT_SAID = 0.10
# the environment variable that sets the writer process's niceness (precprof._priority.NICENESS_ENV)
NICENESS_ENV = "PRECPROF_HELPER_NICENESS"


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _map(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def writer_wait(capture: Mapping[str, Any]) -> str:
    """Where the training's thread waited for room in the queue of the run directory's writer
    (``capture.stream.waited_s``) for at least ``WRITER_WAIT_SAID`` of precprof's added time (the overhead's
    share of ``capture.sampling.run_s``): that share, and what to do, in words; "" otherwise (a run kept in
    memory, a summary without the figures)."""
    stream, sampling = _map(capture.get("stream")), _map(capture.get("sampling"))
    waited, overhead, run_s = (
        _number(v) for v in (stream.get("waited_s"), sampling.get("overhead"), sampling.get("run_s"))
    )
    if waited is None or overhead is None or run_s is None or not waited > 0:
        return ""
    added = overhead * run_s
    if not added > 0 or waited < WRITER_WAIT_SAID * added:
        return ""
    n = int(_number(stream.get("waits")) or 0)
    text = (
        f"{F.pct(min(1.0, waited / added))} of precprof's time was sampled steps waiting for the run directory's "
        f"writer ({F.num(waited)} s in {F.count(n)} step{'s' if n != 1 else ''}), which wrote their rows slower "
        "than they came"
    )
    niceness = _number(stream.get("writer_niceness"))
    if stream.get("writer") == "process" and niceness is not None and niceness > 0:
        text += (
            f": it is a process at niceness {niceness:g}, given only the CPU time other work leaves it. "
            f"{NICENESS_ENV}=0 runs it at the training's priority; sampling"
        )
    else:
        text += ". Sampling"
    return text + " fewer steps waits less, and a Profiler without out= (its rows kept in memory) not at all"
