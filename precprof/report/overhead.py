"""What the report says of precprof's overhead beside its share of the run's time, from the run's own figures
(``capture.sampling`` and ``capture.stream`` of the summary):

- ``past_budget``: where the sampled steps took more than the budget, which steps sampled beyond it by design
  took it there (the first steps; those right after a step that matters, up to ``trigger_headroom`` budgets),
  with what they added: "within 3%" stood beside "they took 5.73%", unexplained;
- ``writer_wait``: where sampled steps waited for the run directory's writer (``Profiler(out=...)``: a process at
  the lowest priority, which on busy cores gets next to no CPU), how much of precprof's time that was and what to
  do: a run 20x slower than without precprof had said 88.9% and no cause.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from precprof import schema as S
from precprof._priority import NICENESS_ENV
from precprof.report import filters as F

# the wait for the stream's writer is said where it is at least this share of precprof's added time
WRITER_WAIT_SAID = 0.10

# a step right after one of these is sampled beyond the budget (the first steps of a budgeted run are too, whatever
# it); what the steps were, in words
EVENTS = {
    S.REASON_SPIKE: "loss spikes",
    S.REASON_NONFINITE: "non-finite losses",
    S.REASON_SKIPPED: "skipped steps",
}
EVENT = {
    S.REASON_SPIKE: "a loss spike",
    S.REASON_NONFINITE: "a non-finite loss",
    S.REASON_SKIPPED: "a skipped step",
}


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _map(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _steps(n: int, what: str) -> str:
    return f"the {F.count(n)} {what}" if n > 1 else f"the {what.replace('steps', 'step', 1)}"


def past_budget(sampling: Mapping[str, Any]) -> tuple[str, str]:
    """Where budgeted sampling's sampled steps took more than the budget and steps sampled beyond it by design
    added to it: (the header's words, the environment's), else ("", ""). The header's only where those steps
    took it past (what the rest added is within the budget); the environment's says what they added either way.
    From the summary's sample reasons and ``overhead_by_reason``; ("", "") where it has none (an older run)."""
    budget, part = _number(sampling.get("budget")), _number(sampling.get("overhead_sampled"))
    by = _map(sampling.get("overhead_by_reason"))
    reasons = _map(sampling.get("reasons"))
    if sampling.get("mode") != "budget" or budget is None or part is None or not by:
        return "", ""
    if part <= budget or F.pct(part) == F.pct(budget):
        return "", ""
    kinds = [r for r in EVENTS if int(reasons.get(r) or 0) > 0]
    n_events = sum(int(reasons[r]) for r in kinds)
    added_events = sum(_number(by.get(r)) or 0.0 for r in kinds)
    who: list[tuple[str, float]] = []
    rest = part
    if n_events:
        what = " or ".join(EVENTS[r] for r in kinds) if n_events > 1 else EVENT[kinds[0]]
        who.append((_steps(n_events, f"steps sampled right after {what}"), added_events))
        rest -= added_events
    n_first, added_first = int(reasons.get(S.REASON_FIRST) or 0), _number(by.get(S.REASON_FIRST)) or 0.0
    # the first steps too, where the rest is past the budget without them (a short run's)
    first = rest > budget and n_first > 0 and added_first > 0
    if first:
        who.append((_steps(n_first, "first steps"), added_first))
        rest -= added_first
    if not who:
        return "", ""
    took_it = rest <= budget
    named = " and ".join(f"{name} ({F.pct(share)})" for name, share in who)
    design = _design(bool(n_events), first)
    headroom = _number(sampling.get("trigger_headroom"))
    if n_events and headroom is not None:
        design += (
            f", later ones while the overhead stays within {headroom:g}× it ({F.pct(headroom * budget)})"
        )
    if took_it:
        return f"exceeded by design by {named}", f"past the budget by {named}: by design, {design}"
    return "", f"{named} of it: by design, {design}"


def _design(events: bool, first: bool) -> str:
    if events and first:
        return "the first steps and the first step after each kind of event are sampled whatever the budget"
    if first:
        return "the first steps are sampled whatever the budget"
    return "the first step after each kind of event is sampled whatever the budget"


def writer_wait(capture: Mapping[str, Any], share_known: bool = True, time_of: str = "the run's time") -> str:
    """Where the training's thread waited for room in the queue of the run directory's writer
    (``capture.stream.waited_s``) for at least ``WRITER_WAIT_SAID`` of precprof's added time (the overhead's
    share of ``capture.sampling.run_s``): that share, and what to do, in words; "" otherwise (a run kept in
    memory, a summary without the figures). Where precprof's share is not known (every step sampled: no
    unsampled step to measure it against) or not said (``share_known`` False: too few steps timed), the wait's
    share of the run's time, said from ``WRITER_WAIT_SAID`` of it (precprof's time is part of the run's, so the
    wait is then at least that share of precprof's too): a ``sample_every=1`` run that waited 244 s of its
    342 s had said nothing. ``time_of``: whose time that is (a resumed run's figures are its last attempt's)."""
    stream, sampling = _map(capture.get("stream")), _map(capture.get("sampling"))
    waited, overhead, run_s = (
        _number(v) for v in (stream.get("waited_s"), sampling.get("overhead"), sampling.get("run_s"))
    )
    if waited is None or run_s is None or not waited > 0:
        return ""
    if share_known and overhead is not None:
        added = overhead * run_s
        if not added > 0 or waited < WRITER_WAIT_SAID * added:
            return ""
        of = f"{F.pct(min(1.0, waited / added))} of precprof's time"
    else:
        if not run_s > 0 or waited < WRITER_WAIT_SAID * run_s:
            return ""
        of = f"{F.pct(min(1.0, waited / run_s))} of {time_of}"
    n = int(_number(stream.get("waits")) or 0)
    text = (
        f"{of} was sampled steps waiting for the run directory's writer ({F.num(waited)} s in {F.count(n)} "
        f"step{'s' if n != 1 else ''}), which wrote their rows slower than they came"
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
