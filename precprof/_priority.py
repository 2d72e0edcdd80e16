"""A helper process's own CPU priority, lowered: the stream's writer and the Triton compile beside the training
take only the CPU time the training leaves.

On Linux, with the kernel's autogroups (on by default on desktops and many servers), CPU time is shared between
sessions first and niceness only orders the processes of one session: the writer, a session of its own (so that a
terminal's Ctrl-C reaches the training alone), also lowers its session's group. Measured on 2 cores (gpt-nano,
``sample_every=2``, 4 alternated pairs, ``bench/results/first_step_cpu_writer_priority_2026-11-29.json``): with
the writer at the training's priority its start (pandas and Arrow imports) made the first sampled step
0.56-0.59 s against 0.13-0.22 s lowered, and 40 steps took 1.5-2.2 s against 1.2-1.7 s.
"""

from __future__ import annotations

import contextlib
import os

LOWEST = 19  # the niceness of a process that should run only when nothing else wants the CPU
# the environment variable that sets the helpers' niceness instead (0-19): where every core is busy at the
# training's priority (other jobs beside it, a test suite's workers), a helper at 19 gets next to no CPU and a step
# that waits on it waits for the others
NICENESS_ENV = "PRECPROF_HELPER_NICENESS"


def helper_niceness() -> int:
    """The niceness precprof's helper processes take: ``PRECPROF_HELPER_NICENESS`` where it is a number from 0 to
    19, else ``LOWEST``."""
    try:
        value = int(os.environ.get(NICENESS_ENV, ""))
    except ValueError:
        return LOWEST
    return value if 0 <= value <= LOWEST else LOWEST


def lower_own_priority(niceness: int | None = None) -> int | None:
    """Raise this process's niceness to ``niceness`` (None: ``helper_niceness()``; never lowers it); a session
    leader also sets its autogroup's
    (``/proc/self/autogroup``, where there is one), which a process inside the training's session must never do:
    it would lower the training with it. Returns the niceness reached, None where there is none (Windows). Never
    raises: a sandbox that forbids it leaves the priority as it was."""
    nice = getattr(os, "nice", None)
    if nice is None:
        return None
    niceness = helper_niceness() if niceness is None else niceness
    with contextlib.suppress(OSError):
        now = nice(0)
        if niceness > now:
            nice(niceness - now)
    getsid = getattr(os, "getsid", None)
    with contextlib.suppress(OSError):
        if getsid is not None and getsid(0) == os.getpid():
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(niceness))
    return int(nice(0))
