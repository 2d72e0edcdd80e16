"""Which steps are sampled: every N-th (``sample_every=N``), or as many as a time budget allows (the default).

Fixed: step s is sampled when ``(s - origin) % N == 0`` (step ``origin`` first; N = 0 samples none).

Budgeted (``sample_every=None``): the Profiler keeps its measured overhead within ``budget`` (a share of the
run's time, 3% by default). It samples

- the first steps (``FIRST_STEPS`` of them): the numbers of a run's start, and a first measure of a sampled
  step's cost (when the statistics kernels compile beside the training, the first steps once they are ready:
  no step waits for a compile);
- a step right after one that matters, as soon as precprof learns of it without a sync: a non-finite loss, a
  step the GradScaler skipped, or a loss spike (above ``SPIKE_FACTOR`` times the recent mean and
  ``SPIKE_SIGMAS`` standard deviations above it). On a GPU the loss and the skip flag reach the host by a
  non-blocking copy, read when it has landed (``event.query()``): usually the next step or the one after.
  The first such step of each kind is always sampled; later ones while the overhead stays within
  ``TRIGGER_HEADROOM`` times the budget;
- otherwise, the next step whenever sampling it keeps the overhead so far within the budget. What a run records
  grows with its sampled steps (the run directory, and the memory and time its end takes to advise and render:
  a 48-layer Llama's rows of 100 sampled steps replayed 5 times took 3.8 GB and 50 s of CPU to advise), so the
  budget's pace holds for the first ``DENSE_SAMPLES`` budgeted samples; after them each ``THIN_EVERY`` more come
  at least twice as far apart as the ones before (from twice the dense samples' mean gap on), and so do the
  steps sampled after an event of a kind seen before: a run's samples grow with the log of its length, not with
  it (``thin_gap``).

Under torch.distributed every rank must sample the same steps (a sampled step ends in collectives), while
each measures its own times: there the next budgeted step is planned at the end of each sampled step
(``plan_gap``: the fewest steps that keep the overhead within the budget, assuming unsampled steps take their
median time), and the ranks take the largest of their plans (one more small collective at a sampled step);
the steps that matter are then not sampled on their own, as a rank's loss is its own. There the second first
step comes ``FIRST_GAP`` steps after the first, so that the plan made at its end rests on timed unsampled
steps (planned before any, an 80-step run sampled a step that did not fit: 5.95% against 3%).

The overhead of a sampled step is its time beyond the median of recent unsampled steps (measured by
``Profiler.step``'s clock, which on a GPU includes waiting for the device at the sampled step's copy); the
first step of each process is left out (a resumed run's attempt too, whatever its sampling ``origin``) (its time is warm-up: allocations, compilation, precprof's first use of its
kernels), and so is the first unsampled step: a ``torch.compile``d model's sampled steps run eagerly, so its
first unsampled step is its first compiled one, whose time is Dynamo's and inductor's (seconds, against
milliseconds a step: taken as the unsampled median, it made every later step look free to sample). The
overhead reached is their sum over the time of every step but those two: counted, a compile of seconds
bought a burst of sampled steps right after it (14 of a compiled Llama's first 16 steps were sampled within
"3%"), where the budget is a share of the training's own time. Any later unsampled step in which Dynamo compiled
(a recompile for a new sequence length, a smaller last batch, an evaluation's first forward; its frame counter
moved) is left out the same way: counted, a recompile of a second sampled the next steps and, as the median
of the recent unsampled steps, made a sampled step look free (25 of 30 steps sampled within "3.2%"). A loop
that compiles on every step (a fresh function compiled each step, ``torch._dynamo.reset()`` each step) has
that in its own step time: after ``COMPILES_IN_A_ROW`` unsampled steps that all compiled, the next ones count
(left out, none was timed and the budget never allowed a sample again). A sampled step is costed once, when it
ends, against the unsampled steps of its own time (``_recent_base``: a trimmed mean of the last
``RECENT_UNSAMPLED``, no more than the median of the latest ``LATEST``); those taken before any unsampled step
was timed (the first steps) are costed against the first one timed. Re-costing every past sampled step against
the current median made a stretch of slower steps (another process on the machine, a data loader stalling)
look as if the past had cost nothing, a burst of samples in it, and the faster steps after it look over budget:
no sample for the rest of the run. What the next sampled step is expected to add is the mean of the last
``COST_WINDOW`` plus its standard error (``step_cost_s``), and budgeted samples come no closer than ``SPACING``
times the budget's pace (``_spacing``): on steps of two kinds (a loader stalling on half of them, 10 and 40 ms)
a median of a few read 0, and every step fitted (6.5% where 2.97% was said). Against a sampled step that adds
less than the steps vary, this errs on the side of the budget: what it says it took is an upper bound.

The overhead reached (``overhead``) is the sampled steps' added time (``sampled_overhead``, what the budget
bounds) and what ``Profiler.step()`` itself takes on every step (``own_share``: its host time on the unsampled
steps, 90-190 us after a 4-15 ms CPU step, 7.6% of such a run, which the overhead said before left out).
Sampling fewer steps does not lower the latter, so the budget does not spend it. The summary splits the former
by the sampled steps' reason (``overhead_by_reason``): the first steps and those right after a step that matters,
sampled beyond the budget by design, may take it past the budget, and the report says by how much.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from precprof.schema import (  # why a step was sampled (the steps table's sample_reason); the default budget
    DEFAULT_OVERHEAD_BUDGET,
    REASON_BUDGET,
    REASON_FIRST,
    REASON_INTERVAL,
    REASON_NONFINITE,
    REASON_SKIPPED,
    REASON_SPIKE,
)

DEFAULT_BUDGET = DEFAULT_OVERHEAD_BUDGET  # the share of the run's time the Profiler may add, by default

FIRST_STEPS = 2  # sampled at the start of a budgeted run
TRIGGER_HEADROOM = 2.0  # a step that matters may take the overhead up to this many budgets
SPIKE_FACTOR = 1.5  # a loss spike: above this times the recent mean ...
SPIKE_SIGMAS = 4.0  # ... and this many standard deviations above it
SPIKE_WINDOW = 50  # losses the recent mean and deviation are taken over
SPIKE_MIN = 10  # losses needed before a spike can be called
UNSAMPLED_WINDOW = 64  # unsampled step times the median is taken over
RECENT_UNSAMPLED = 16  # unsampled step times a sampled step is costed against (those of its own time)
TRIM = 8  # the base drops the slowest and the fastest 1 in TRIM of them (a pause of seconds) ...
LATEST = 3  # ... and no more than the median of the latest few (steps that just got faster)
TRIM_FROM = 4  # ... from this many on; of fewer, the fastest is the base
FIRST_GAP = 10  # synchronized: the steps timed between the first two sampled ones
COST_WINDOW = 16  # sampled steps whose mean added time is what the next one is expected to add
MIN_COST = 0.02  # ... at least this share of an unsampled step's time (a sampled step does more)
SPACING = 0.5  # budgeted samples come at least this share of the budget's pace apart (``_spacing``)
REFRESH_EVERY = 16  # budgeted steps sampled in a row before an unsampled one is timed again
DENSE_SAMPLES = 200  # budgeted samples at the budget's pace; after them ...
THIN_EVERY = 100  # ... each this many more come at least twice as far apart (``Sampler.thin_gap``)
PAUSE_FACTOR = 4.0  # a sampled step over this many times both kinds' recent times holds a pause (``_pause``)
PAUSE_HISTORY = 3  # ... judged once this many sampled steps were timed
PAUSE_MIN_S = 1.0  # ... and held at least this many seconds more than them (host jitter of small steps: ms)
PAUSES_LISTED = 64  # the paused steps the summary lists
COMPILES_IN_A_ROW = 3  # unsampled steps that compiled in a row, left out; after them compiling is the step's


@dataclass
class Sampler:
    """Decides, step by step, whether the step is sampled and why (see the module docstring).

    ``every``: N for fixed sampling (0: none), None for the budget; ``budget``: the share of the run's time;
    ``origin``: the first step of the run (a resumed run keeps its original rhythm)."""

    every: int | None
    budget: float = DEFAULT_BUDGET
    origin: int = 0
    sampled_times: list[float] = field(default_factory=list)  # sampled steps' times (the warm-up one aside)
    total_s: float = 0.0  # every step's time but the warm-ups' (the first step, the first unsampled one)
    reasons: dict[str, int] = field(default_factory=dict)  # sampled steps per reason
    _unsampled: deque[float] = field(default_factory=lambda: deque(maxlen=UNSAMPLED_WINDOW))
    _ordered: list[float] = field(default_factory=list)  # the same, in order: their median without a sort
    # each sampled step's added time, fixed when it ended; those that ended before any unsampled step was
    # timed wait in ``_uncosted`` (their times and reasons) until one is
    _added: list[float] = field(default_factory=list)
    _uncosted: list[tuple[float, str]] = field(default_factory=list)  # (time, reason)
    _spent_by: dict[str, float] = field(default_factory=dict)  # ``_spent`` by the steps' sample reason
    _spent: float = 0.0  # the sum of ``_added``
    _expected: float = 0.0  # the mean of the last ``COST_WINDOW`` of ``_added`` plus its standard error
    _losses: deque[float] = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    _pending_trigger: str = ""
    synchronized: bool = False  # every rank samples the same steps: planned ones only (see the docstring)
    held: int = 0  # steps not sampled because the statistics kernels were still compiling
    first_sampled: int | None = None  # the first step sampled
    last_sampled: int | None = None  # the last step sampled (decided so)
    last_step: int | None = None  # the last step observed
    _firsts: int = 0
    _unsampled_seen: bool = False  # the first unsampled step (warm-up of the unsampled path) has passed
    _last_budget: int = -(2**62)  # the last step sampled within the budget
    _below_base: bool = False  # the last sampled step took less than its base (``_cost``)
    _warmed_up: bool = (
        False  # this process's first step has passed (a resumed run's too, whatever ``origin``)
    )
    steps_counted: int = 0  # the steps whose time ``total_s`` holds
    own_s: float = 0.0  # ``Profiler.step()``'s own time on the unsampled steps (``own_step``)
    own_steps: int = 0
    _compiles: int = 0  # Dynamo's frames compiled when the last step ended (``_compat.compiles``)
    # the unsampled steps left out because Dynamo compiled in them (the throughput leaves them out too)
    compiled_at: list[int] = field(default_factory=list)
    _compiled_in_a_row: int = 0  # the last unsampled steps that compiled, in a row
    _since_unsampled: int = 0  # steps sampled since the last unsampled one
    next_step: int | None = None  # with ``synchronized``, the next budgeted step
    budgeted_samples: int = 0  # steps sampled for the budget (``REASON_BUDGET``)
    _first_budgeted: int = 0  # the first of them
    thin_gap: int = 0  # the fewest steps between budgeted samples past ``DENSE_SAMPLES`` (0 before)
    _triggered: dict[str, int] = field(default_factory=dict)  # the last step sampled for each event's kind
    paused_steps: list[int] = field(default_factory=list)  # sampled steps that held a pause (``_pause``)
    paused_s: float = 0.0  # the time left out of them
    paused_count: int = 0  # how many (``paused_steps`` lists the first ``PAUSES_LISTED``)

    @property
    def compile_steps(self) -> int:
        """How many unsampled steps were left out because Dynamo compiled in them."""
        return len(self.compiled_at)

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 0:
            raise ValueError("sample_every must be >= 0 (0 records steps only) or None (a time budget)")
        if not (self.budget > 0 and math.isfinite(self.budget)):
            raise ValueError(f"overhead_budget must be a number > 0, got {self.budget!r}")

    @property
    def budgeted(self) -> bool:
        return self.every is None

    def decide(self, step: int, ready: bool = True) -> str:
        """Why ``step`` is sampled, or "" when it is not. ``ready``: whether the statistics kernels can run
        (compiled beside the training, ``StatsBuffer(background=True)``); until then no step is sampled, and
        a budgeted run's first sampled steps are the first ones after."""
        reason = self._decide(step)
        if reason and not ready:
            self.held += 1
            return ""
        if reason == REASON_FIRST:
            self._firsts += 1
        if reason == REASON_BUDGET:
            self._thin(step)
        if reason and self.first_sampled is None:
            self.first_sampled = step
        if reason:
            self.last_sampled = step
        return reason

    def _decide(self, step: int) -> str:
        if self.every is not None:
            return REASON_INTERVAL if self.every > 0 and (step - self.origin) % self.every == 0 else ""
        if self.synchronized:
            if self._firsts == 0:
                return REASON_FIRST
            if self.next_step is not None and step >= self.next_step:
                self.next_step = None
                return REASON_FIRST if self._firsts < FIRST_STEPS else REASON_BUDGET
            return ""
        if self._firsts < FIRST_STEPS:
            return REASON_FIRST
        trigger, self._pending_trigger = self._pending_trigger, ""
        if trigger and (
            trigger not in self.reasons
            # (past the dense samples, those of a kind seen before no closer than the budgeted ones: a scale
            # that skipped a step every 25 sampled 3,200 steps in 80,000 within twice the budget)
            or (
                self._fits(TRIGGER_HEADROOM * self.budget)
                and step - self._triggered.get(trigger, -step) >= self.thin_gap
            )
        ):
            self._triggered[trigger] = step
            return trigger
        if self._base_in_doubt() or step - self._last_budget < max(self._spacing(), self.thin_gap):
            return ""
        if not self._fits(self.budget):
            return ""
        self._last_budget = step
        return REASON_BUDGET

    def _thin(self, step: int) -> None:
        """A budgeted sample taken at ``step``: past ``DENSE_SAMPLES`` of them, ``thin_gap`` starts at twice their
        mean gap and doubles every ``THIN_EVERY`` more (the run's data bounded, see the module docstring)."""
        self.budgeted_samples += 1
        if self.budgeted_samples == 1:
            self._first_budgeted = step
        past = self.budgeted_samples - DENSE_SAMPLES
        if past == 0:
            mean_gap = (step - self._first_budgeted) / (DENSE_SAMPLES - 1)
            self.thin_gap = max(2, math.ceil(2 * mean_gap))
        elif past > 0 and past % THIN_EVERY == 0:
            self.thin_gap *= 2

    def resumed(self, budgeted: Any, losses: Any = ()) -> None:
        """The steps the earlier attempts of a resumed run sampled within the budget: the thinning goes on from
        theirs (each attempt took its ``DENSE_SAMPLES`` at the budget's pace: a run resumed every few hours, as a
        preemptible job is, never thinned), and the spacing from the last of them. ``losses``: the finite losses
        of their finished steps, in step order: a loss spike is called against them (the attempt's window
        started empty, and a spike in its first ``SPIKE_MIN`` steps went unsampled). The other events need no
        history: a non-finite loss or a skipped step is the step's own, and the first of each kind in an
        attempt is sampled, as its first steps are."""
        for step in sorted(int(s) for s in budgeted):
            self._thin(step)
            self._last_budget = step
        self._losses.extend(float(x) for x in losses if math.isfinite(x))

    def _spacing(self) -> int:
        """The fewest steps between two budgeted samples: ``SPACING`` times the gap at which sampled steps spend
        the budget as they go. Time the budget left unspent (steps held unsampled while the base was in doubt,
        a cost estimate that fell) is spent no faster than that: no burst of samples."""
        base = self.unsampled_s
        if base is None or base <= 0:
            return 0
        return math.floor(SPACING * self.step_cost_s(base) / (self.budget * base))

    def _base_in_doubt(self) -> bool:
        """Whether the next step must be an unsampled one, timed: when recent sampled steps took no longer
        than the unsampled median (a sampled step does more, so that median holds a slow step: a checkpoint
        written, another process starting; taken as it is, it made every step look free to sample, and with
        every step sampled none was timed to correct it: a GPT-2 run on 2 CPU cores sampled 59 of 60 steps),
        and after ``REFRESH_EVERY`` sampled steps in a row (the run's step time drifts)."""
        base = self.unsampled_s
        if base is None:
            return False
        recent = self.sampled_times[-8:]
        # once an unsampled step was timed since the last sampled one, the doubt is answered: the sampled
        # times it rests on do not change until a step is sampled again (it held a run of 400 slower steps
        # unsampled)
        doubt = self._since_unsampled > 0 and (
            self._below_base or (len(recent) >= 2 and statistics.median(recent) <= base)
        )
        return doubt or self._since_unsampled >= REFRESH_EVERY

    def _fits(self, limit: float) -> bool:
        """Whether one more sampled step keeps the overhead within ``limit``."""
        base = self.unsampled_s
        if base is None:  # nothing to compare a sampled step with yet: wait for an unsampled one
            return False
        cost = self.step_cost_s(base)
        spent = self.spent_s(base)
        return spent + cost <= limit * (self.total_s + base + cost)

    def plan_gap(self) -> int:
        """In how many steps the next budgeted sample keeps the overhead within the budget, unsampled steps
        taking their median time (``FIRST_GAP`` before one was timed)."""
        base = self.unsampled_s
        if base is None or base <= 0:
            return FIRST_GAP
        cost = self.step_cost_s(base)
        # g unsampled-or-sampled steps from now: spent + cost <= budget * (total + g * base + cost)
        need = (self.spent_s(base) + cost) / self.budget - self.total_s - cost
        return max(1, math.ceil(need / base), self.thin_gap)

    @property
    def unsampled_s(self) -> float | None:
        """The median time of recent unsampled steps (None before one was timed)."""
        # as statistics.median computes it (its sort of the window took 14 us of every step's decision)
        s, n = self._ordered, len(self._ordered)
        if not n:
            return None
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

    def step_cost_s(self, base: float) -> float:
        """What a sampled step is expected to add: the mean of the last ``COST_WINDOW`` ones' added times, at
        least ``MIN_COST`` times ``base`` (an unsampled step's time, the estimate before any was costed). The
        mean of many, none clipped: each is the difference of two noisy times (a data loader that stalls on some
        steps), and a median of a few, clipped at 0, read 0 whenever a sampled step fell on a fast step after
        slow ones: every step then fitted, 19 samples in 22 slow steps."""
        return max(self._expected, MIN_COST * base) if self._added else base

    def spent_s(self, base: float | None = None) -> float:
        """The time sampled steps added so far: each beyond the unsampled steps of its own time (those taken
        before any unsampled step was timed beyond ``base``, the unsampled median by default)."""
        if not self._uncosted:
            return self._spent
        base = self.unsampled_s if base is None else base
        if base is None:
            return self._spent
        return self._spent + sum(t - base for t, _ in self._uncosted)

    def _cost(self, added: float, reason: str) -> None:
        """A sampled step's added time, fixed. One that took less than the base (below 0) says the base is
        stale (steps got faster since the unsampled ones it rests on: the end of a stall) or noise, no saving:
        counted as 0, and the next step is timed unsampled before another is sampled (kept, the end of a 0.1 s
        stretch bought 1.4 s of credit, a sample on each of the next 300 steps)."""
        self._below_base = added < 0
        self._added.append(max(0.0, added))
        self._spent += self._added[-1]
        self._spent_by[reason] = self._spent_by.get(reason, 0.0) + self._added[-1]
        # what the next one is expected to add, once per sampled step (statistics.stdev sums exact fractions:
        # on every step's decision, twice, it took 150 us of an unsampled step's prof.step())
        recent = self._added[-COST_WINDOW:]
        mean = math.fsum(recent) / len(recent)
        spread = statistics.stdev(recent) / math.sqrt(len(recent)) if len(recent) > 1 else 0.0
        self._expected = mean + spread

    def _recent_base(self) -> float | None:
        """The mean time of the last ``RECENT_UNSAMPLED`` unsampled steps, the slowest and fastest ``1 / TRIM``
        of them (at least one each) left out; the fastest of fewer than ``TRIM_FROM`` (None before one was
        timed). A mean, for the run's time is a sum: the median of steps of two kinds (a loader that stalls on
        half of them) is either kind's time, by chance; trimmed, for one pause of a second in the window made
        every sampled step look free, for good (a cost below 0 is kept)."""
        if not self._unsampled:
            return None
        window = list(self._unsampled)[-RECENT_UNSAMPLED:]
        recent = sorted(window)
        if len(recent) < TRIM_FROM:
            return recent[0]
        cut = -(-len(recent) // TRIM)
        kept = recent[cut : len(recent) - cut]
        return min(math.fsum(kept) / len(kept), statistics.median(window[-LATEST:]))

    def observe(
        self,
        step: int,
        reason: str,
        time_s: float,
        compiles: int | None = None,
        measured: bool = False,
        waited_s: float = 0.0,
    ) -> bool:
        """A step ended after ``time_s`` seconds, sampled for ``reason`` ("" when it was not); ``compiles``:
        Dynamo's count of frames compiled so far (None when it is not loaded); ``measured``: a sampled step that
        measured memory (its own work, longer: never a pause); ``waited_s``: of its time, the wait for the
        stream's writer (precprof's own: never a pause). Returns whether the step is left
        out as one Dynamo compiled in (``compiled_at``): its steps table row says so (``T.COMPILED``)."""
        self.last_step = step
        compiled = compiles is not None and compiles != self._compiles
        if compiles is not None:
            self._compiles = compiles
        if reason:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self._since_unsampled = self._since_unsampled + 1 if reason else 0
        if not math.isfinite(time_s):
            return False
        if not self._warmed_up:  # this process's first step: neither a sampled step's cost nor the run's time
            self._warmed_up = True
            return False
        if reason:
            time_s -= 0.0 if measured else self._pause(step, time_s, waited_s)
            self.sampled_times.append(time_s)
            base = self._recent_base()
            if base is None:
                self._uncosted.append((time_s, reason))
            else:
                self._cost(time_s - base, reason)
        elif compiled and self._unsampled_seen and self._compiled_in_a_row < COMPILES_IN_A_ROW:
            self._compiled_in_a_row += 1  # a recompile's time, not the training's
            self.compiled_at.append(step)
            return True
        elif self._unsampled_seen:
            self._compiled_in_a_row = self._compiled_in_a_row + 1 if compiled else 0
            if len(self._unsampled) == self._unsampled.maxlen:  # the oldest leaves the window
                del self._ordered[bisect.bisect_left(self._ordered, self._unsampled[0])]
            bisect.insort(self._ordered, time_s)
            self._unsampled.append(time_s)
            uncosted, self._uncosted = self._uncosted, []
            for t, why in uncosted:  # the first steps, costed against the first one timed
                self._cost(t - time_s, why)
        else:  # the first unsampled step: a compiled model's first compiled run (see the module docstring)
            self._unsampled_seen = True
            if compiled:
                self.compiled_at.append(step)
            return compiled
        self.total_s += time_s
        self.steps_counted += 1
        return False

    def _pause(self, step: int, time_s: float, waited_s: float = 0.0) -> float:
        """The time of sampled step ``step`` that is a pause, not the step's (0 where it holds none): over
        ``PAUSE_FACTOR`` times both the recent sampled steps' median (``PAUSE_HISTORY`` timed at least) and the
        unsampled steps' time (their trimmed mean, or the latest where slower: steps that just got slower make no
        pause), and ``PAUSE_MIN_S`` more: time outside training (a notebook's user between cells while attached).
        Its time beyond that median is left out of what the step added and of the run's time, and said
        (``paused_steps``, ``paused_count``, ``paused_s``): counted, a 3 s pause made 7% read 72%, and a budgeted
        run sampled nothing until its time caught up. A step that measured memory is never one (``observe``), nor
        its wait for the stream's writer (``waited_s``, precprof's own: taken for a pause, a run whose writer fell
        behind read 81% where its steps took 99% more), judged on the step's time without it."""
        time_s -= waited_s
        if len(self.sampled_times) < PAUSE_HISTORY or not self._unsampled:
            return 0.0
        base = self._recent_base()
        if base is None:
            return 0.0
        typical = statistics.median(self.sampled_times[-COST_WINDOW:])
        if time_s <= PAUSE_FACTOR * typical or time_s <= PAUSE_FACTOR * max(base, self._unsampled[-1]):
            return 0.0
        if (
            time_s - typical < PAUSE_MIN_S
        ):  # (a small step's host jitter on a busy machine: 4x of milliseconds)
            return 0.0
        self.paused_count += 1
        if len(self.paused_steps) < PAUSES_LISTED:
            self.paused_steps.append(step)
        self.paused_s += time_s - typical
        return time_s - typical

    def own_step(self, time_s: float) -> None:
        """``Profiler.step()``'s own time on a step that is not sampled (host clock around its work): what
        precprof takes of every step, sampled or not, beside what a sampled step adds."""
        self.own_s += time_s
        self.own_steps += 1

    @property
    def own_share(self) -> float | None:
        """What ``Profiler.step()`` takes of the run's time on every step (its mean time on the unsampled ones,
        times the steps counted, over their time); None before one was timed."""
        if not self.own_steps or self.total_s <= 0:
            return None
        return self.own_s / self.own_steps * self.steps_counted / self.total_s

    def observe_values(self, loss: float, skipped: bool) -> None:
        """A step's loss and whether the GradScaler skipped it, once they reached the host: the next decision
        samples right after a step that matters (budgeted sampling only)."""
        if not self.budgeted or self.synchronized:
            return
        if not math.isfinite(loss):
            self._pending_trigger = REASON_NONFINITE
            return
        if skipped:
            self._pending_trigger = self._pending_trigger or REASON_SKIPPED
        recent = self._losses
        if len(recent) >= SPIKE_MIN and not self._pending_trigger:
            # in floats: statistics.pstdev sums exact fractions, 70 us a step on every unsampled step; the
            # deviation only for a loss above SPIKE_FACTOR times the mean (most steps' is not: 30 us saved)
            mean = math.fsum(recent) / len(recent)
            if mean > 0 and loss > SPIKE_FACTOR * mean:
                sd = math.sqrt(math.fsum((x - mean) ** 2 for x in recent) / len(recent))
                if loss > mean + SPIKE_SIGMAS * sd:
                    self._pending_trigger = REASON_SPIKE
        recent.append(loss)

    @property
    def sampled_overhead(self) -> float | None:
        """What the budget bounds: the time sampled steps added over the time of every step (None before an
        unsampled step was timed)."""
        base = self.unsampled_s
        if base is None or self.total_s <= 0:
            return None
        return max(0.0, self.spent_s(base)) / self.total_s

    def overhead_by_reason(self) -> dict[str, float] | None:
        """``sampled_overhead`` by the sampled steps' reason (shares summing to it; None where it is None)."""
        if self.sampled_overhead is None:
            return None
        return {r: added / self.total_s for r, added in self._spent_by.items()}

    @property
    def overhead(self) -> float | None:
        """The overhead reached: what sampled steps added and what ``Profiler.step()`` took on every step, over
        the time of every step (None before an unsampled step was timed)."""
        sampled = self.sampled_overhead
        if sampled is None:
            return None
        return sampled + (self.own_share or 0.0)

    def settings(self) -> dict[str, Any]:
        """The ``sampling`` entry of a run directory's first summary, written when it is claimed: how steps are
        sampled (``mode``, ``every``, a budgeted run's ``budget``), for the report of a run killed before it saved
        (``describe``'s counts are then the steps table's, ``report.context.sampling_from_steps``)."""
        mode = "budget" if self.budgeted else ("every" if self.every else "off")
        return {"mode": mode, "every": self.every, **({"budget": self.budget} if self.budgeted else {})}

    def first_entries(self) -> dict[str, Any]:
        """The capture entries of a run directory's first summary that say how its steps are sampled:
        ``sample_every``, ``sample_origin`` and ``sampling`` (``settings``)."""
        return {"sample_every": self.every, "sample_origin": self.origin, "sampling": self.settings()}

    def describe(self, cut_off_reason: str = "") -> dict[str, Any]:
        """The ``sampling`` entry of the capture summary. ``cut_off_reason``: the sample reason of the step a
        detach cut off ("" when none was sampled): it ended unobserved, and its rows are among the sampled steps,
        so its reason counts too (``cut_off`` says which reason it is)."""
        reasons = dict(self.reasons)
        if cut_off_reason:
            reasons[cut_off_reason] = reasons.get(cut_off_reason, 0) + 1
        out: dict[str, Any] = {
            **self.settings(),
            "reasons": reasons,
            **({"cut_off": cut_off_reason} if cut_off_reason else {}),
        }
        if self.budgeted:
            out["synchronized"] = self.synchronized
            # past DENSE_SAMPLES budgeted samples, the fewest steps between two (the run's data bounded)
            out["thinned"] = (
                {"after": DENSE_SAMPLES, "doubling_every": THIN_EVERY, "least_gap": self.thin_gap}
                if self.thin_gap
                else None
            )
        out["overhead"] = self.overhead
        out["overhead_sampled"] = self.sampled_overhead  # the part the budget bounds
        out["overhead_every_step"] = self.own_share  # Profiler.step() on every step, sampled or not
        # overhead_sampled by the sampled steps' reason: what the steps sampled beyond the budget (the first ones,
        # those right after a step that matters, up to ``trigger_headroom`` budgets) added
        out["overhead_by_reason"] = self.overhead_by_reason()
        out["trigger_headroom"] = TRIGGER_HEADROOM
        out["run_s"] = self.total_s  # the time the shares are of: every step's but the warm-ups'
        out["step_call_s"] = self.own_s / self.own_steps if self.own_steps else None
        base = self.unsampled_s
        out["unsampled_step_s"] = base
        out["sampled_step_added_s"] = (
            self.step_cost_s(base) if base is not None and self.sampled_times else None
        )
        out["first_sampled_step"] = self.first_sampled
        # where none of a run's last steps was sampled, the report says so (the budget spent by then)
        out["last_sampled_step"] = self.last_sampled
        out["last_step"] = self.last_step
        out["held_for_compile"] = self.held
        out["compile_steps"] = self.compile_steps
        out["compiled_steps"] = list(self.compiled_at)
        # sampled steps that held a pause (``_pause``), the first ``PAUSES_LISTED``, and the time left out of them
        out["paused_steps"] = list(self.paused_steps)
        out["paused_s"] = self.paused_s
        out["paused_count"] = self.paused_count
        return out
