"""How many groups the block-format what-if is dealt into, so that it fits a time budget whatever its speed.

The what-if of the block-scaled formats reads every GEMM operand of the linear layers in two orientations for
seven recipes: on a CPU it costs about a third of a gpt-mini step, and the first Triton kernels on an H100 cost
12x a gpt2-small step. The layers are dealt into groups of about equal cost and each sampled step evaluates
one group in turn (each layer's numbers are exact on the steps it was evaluated on). With ``block_groups``
left to precprof, the number of groups follows what the what-if is measured to cost. It starts with one layer
per group, so the first sampled steps cost the least whatever the kernels' speed; after each sampled step
(the first, which pays for warm-up, aside) the time of the group just evaluated is scaled by its share of the
deal's cost to what every layer would take, relative to the rest of the step; the groups are then the fewest
that keep one group's time within ``share`` of the rest of the step, from the median of the recent estimates
(``ESTIMATE_WINDOW``; one noisy step does not re-deal the layers), and never more than one group per layer.
More groups follow the first estimate that asks for them; fewer wait for three estimates since the last change
(counted over the whole run, a median near the boundary between two counts re-dealt the layers back and forth on
consecutive sampled steps: 8 changes in a 30-step gpt-nano run).

The what-if's timer reads its calls, but a sampled step pays more than that: on the CPU the calls cost about
twice as much among the training's work as in a loop of their own and slow the code that runs after them by as
much again; on CUDA the launches' host time is not in the kernels' events. So a few sampled steps evaluate no
block format at all (the 3rd and 5th sampled steps, then one in ``CONTROL_EVERY``; only with the budget
adapting): their time is that of a sampled step without the what-if, and the evaluating steps' time beyond it,
around each control, is what the what-if really added. The timer's readings are scaled by the median of those
ratios over their timer's (at least 1, at most ``MAX_FACTOR``), compared like with like (steps that measure
memory with steps that do), once the ratios agree well enough to tell. Until they do (a machine whose step
time varies by more than the what-if's cost never tells), each call the timer read is taken to add what the
steps that did tell found a call adds beyond its reading where the timer runs (``PRIOR_CALL_S``): a cost per
call, so that thousands of tiny tensors count it and a few large ones barely do (at a factor of 1, a CPU
budget of 10% let the what-if of tiny layers add 17-19%; a flat factor of 2 halved the layers a larger model
evaluated, where the controls that told found 1.0).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from precprof import taxonomy

DEFAULT_SHARE = 0.1  # the block what-if may add this much to the rest of a sampled step
# fewer groups (more layers per sampled step) only on this many estimates since the groups last changed: quick
# to protect the budget, slow to spend it (one estimate from one small layer is mostly its per-call overhead)
MIN_ESTIMATES_TO_WIDEN = 3
ESTIMATE_WINDOW = 16  # the groups follow the median of this many recent estimates
CONTROL_FIRST = (2, 4)  # sampled steps (counted from 0) that evaluate no block format ...
CONTROL_EVERY = 8  # ... and one in this many after them
CONTROL_TURN = -1  # the turn of such a step: no group's
CALIBRATION_WINDOW = 8  # about this many recent controls calibrate
# an evaluating step calibrates when its timed what-if is at least this share of the control's time
MIN_TIMED_SHARE = 0.02
MAX_FACTOR = 3.0  # the most the timer's reading is scaled by
MAX_SPREAD = 0.5  # the local ratios' median deviation beyond which they do not calibrate
# before the controls agree, what a call of the what-if adds to a step beyond what the timer read of it, per
# device type: on the CPU the runs of bench/host_cost.py steady enough to calibrate found factors of 1.1 to 3.0
# (median about 1.9, 2026-11-27) on calls the timer read at 14-17 us each, so about 15 us a call; on gpt-mini
# in fp32 (bench/overhead.py), whose calls read whole layers, they found 1.0. On CUDA it is not measured yet.
PRIOR_CALL_S = {"cpu": 15e-6}


def is_control(k: int) -> bool:
    """Whether the ``k``-th sampled step (from 0) evaluates no block format, to measure a step without it."""
    return k in CONTROL_FIRST or (k > CONTROL_FIRST[-1] and k % CONTROL_EVERY == CONTROL_FIRST[0])


class TimerCalibration:
    """What the block what-if adds to a sampled step against what its timer reads, from the sampled steps in
    their order: each control (a step that evaluated none) against the evaluating steps of its kind right
    before and after it (a step that measures memory costs more: it is compared with its own kind), so that a
    machine whose speed drifts over seconds compares steps of the same moment. Where those local ratios disagree by
    more than ``MAX_SPREAD`` (their median deviation; a machine shared with other work), they say nothing: the
    factor stays what it was."""

    def __init__(self) -> None:
        # (control, memory, step_s, block_s) per sampled step, oldest first
        self._steps: deque[tuple[bool, bool, float, float]] = deque(
            maxlen=CALIBRATION_WINDOW * CONTROL_EVERY + 2
        )
        self._factor = 1.0
        self._told = False  # the controls agreed once: the factor is theirs
        self._per_call = 0.0  # the prior: seconds a call adds beyond the timer's reading

    @property
    def told(self) -> bool:
        """Whether the factor is the controls' (else the prior's)."""
        return self._told

    def use_prior(self, device_type: str) -> None:
        """Until the controls tell, take each call to add what such steps found a call adds where the timer
        runs (``PRIOR_CALL_S``; nothing where none was measured)."""
        self._per_call = PRIOR_CALL_S.get(device_type, 0.0)

    def factor_for(self, block_s: float, calls: int) -> float:
        """The factor for a step whose timer read ``block_s`` over ``calls`` calls: the controls' once they
        told, else ``1 + calls * PRIOR_CALL_S / block_s`` (at most ``MAX_FACTOR``), kept as :attr:`factor`."""
        if not self._told and block_s > 0:
            self._factor = min(MAX_FACTOR, 1.0 + calls * self._per_call / block_s)
        return self._factor

    def control(self, step_s: float, memory: bool) -> None:
        if math.isfinite(step_s) and step_s > 0:
            self._steps.append((True, memory, step_s, 0.0))
            self._update()

    def evaluated(self, step_s: float, block_s: float, memory: bool) -> None:
        if math.isfinite(step_s) and block_s > 0:
            self._steps.append((False, memory, step_s, block_s))
            self._update()

    def _neighbours(self, j: int, memory: bool) -> list[tuple[float, float]]:
        """The evaluating steps of kind ``memory`` nearest before and after step ``j`` (step_s, block_s)."""
        steps, out = self._steps, []
        for side in (range(j - 1, -1, -1), range(j + 1, len(steps))):
            for i in side:
                control, kind, step_s, block_s = steps[i]
                if not control and kind == memory:
                    out.append((step_s, block_s))
                    break
        return out

    @property
    def factor(self) -> float:
        """Seconds a sampled step gains per second the timer read: the median over recent controls of (their
        neighbours' mean time - theirs) / their neighbours' mean timer reading, within [1, ``MAX_FACTOR``]; the
        prior's for the last step (:meth:`factor_for`; 1 without one) until three controls with a neighbour on
        each side agree."""
        return self._factor

    def _update(self) -> None:
        ratios: list[float] = []
        for j, (control, memory, step_s, _) in enumerate(self._steps):
            near = self._neighbours(j, memory) if control else []
            if len(near) < 2:
                continue
            timed = statistics.fmean(b for _, b in near)
            if timed >= MIN_TIMED_SHARE * step_s:
                ratios.append((statistics.fmean(s for s, _ in near) - step_s) / timed)
        if len(ratios) >= 3:
            mid = statistics.median(ratios)
            if statistics.median(abs(r - mid) for r in ratios) <= MAX_SPREAD:
                self._factor = min(MAX_FACTOR, max(1.0, mid))
                self._told = True


@dataclass
class BlockBudget:
    """The number of groups (``groups``), fixed by the user or adapted to the measured cost.

    ``fixed``: the user's ``block_groups`` (never changes); None adapts, starting from ``start`` groups (None:
    one per layer).
    ``n_layers``: how many layers are dealt (the most groups there can be).
    """

    share: float
    fixed: int | None
    n_layers: int
    start: int | None = None
    groups: int = field(init=False)
    ratios: list[float] = field(default_factory=list)  # every layer's what-if time / the rest of the step
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per change of ``groups``
    _observed: int = 0
    _since_change: int = 0  # estimates since ``groups`` last changed (since attach before the first change)

    def __post_init__(self) -> None:
        if not (self.share > 0 and math.isfinite(self.share)):
            raise ValueError(f"block_budget must be a number > 0, got {self.share!r}")
        start = self.n_layers if self.start is None else self.start
        self.groups = self.fixed if self.fixed is not None else max(1, min(start, self.n_layers or 1))

    @property
    def adaptive(self) -> bool:
        return self.fixed is None

    def estimate(self, step_s: float, block_s: float, evaluated_share: float) -> float | None:
        """Every layer's what-if time over the rest of the step, from one sampled step: its time ``step_s``
        (host copy included), the what-if's ``block_s`` and the share of the deal's cost it evaluated. None
        when the step says nothing (no what-if ran, or no time was left for the rest)."""
        rest = step_s - block_s
        if not (block_s > 0 and evaluated_share > 0 and rest > 0 and math.isfinite(step_s)):
            return None
        return block_s / evaluated_share / rest

    def observe(self, step: int, ratio: float | None) -> bool:
        """Take one sampled step's :meth:`estimate` (the same on every rank); True when ``groups`` changed."""
        self._observed += 1
        if not self.adaptive or ratio is None or self._observed == 1:  # the first sampled step warms up
            return False
        self.ratios.append(ratio)
        self._since_change += 1
        recent = statistics.median(self.ratios[-ESTIMATE_WINDOW:])
        want = max(1, min(self.n_layers or 1, math.ceil(recent / self.share - 1e-9)))
        if want == self.groups or (want < self.groups and self._since_change < MIN_ESTIMATES_TO_WIDEN):
            return False
        self.history.append({"step": step, "groups": want, "from": self.groups})
        self.groups = want
        self._since_change = 0
        return True

    def describe(self) -> dict[str, Any]:
        """The ``block_formats`` entry of the capture summary."""
        out: dict[str, Any] = {"groups": self.groups, "adaptive": self.adaptive}
        if self.adaptive:
            out["budget"] = self.share
            out["changes"] = list(self.history)
            # estimates so far, and how many it takes to put more layers in a group: a run with fewer never
            # widened its groups, whatever its budget (the report and the advisor say so)
            out["estimates"] = len(self.ratios)
            out["estimates_to_widen"] = MIN_ESTIMATES_TO_WIDEN
            if self.ratios:
                # x the rest of a sampled step, as the groups were last chosen from
                out["every_layer_cost"] = statistics.median(self.ratios[-ESTIMATE_WINDOW:])
        return out


class BlockDeal:
    """The layers dealt into groups for the block-format what-if, the budget that sets how many groups, and
    whose turn it is: each sampled step evaluates the next group (``next_turn``), the same on every rank."""

    def __init__(self, share: float, fixed: int | None) -> None:
        self.share = share
        self.fixed = fixed
        self.budget = BlockBudget(share, fixed, n_layers=0)
        self.loads: list[int] = [1]
        self.turn = 0
        self._samples = 0  # sampled steps so far
        self._rotation = 0  # sampled steps that evaluated a group (the groups' turns)
        self.control_steps = 0  # sampled steps that evaluated none, to calibrate the timer
        self.calibration = TimerCalibration()
        self._slots: list[Any] = []  # the plan's layers that get the what-if (their ``block_group``)
        self.turns: dict[str, int] = {}  # layer -> sampled steps that evaluated its block formats
        # the layers whose forward ran on a sampled step (nn.MultiheadAttention's out_proj never does: the
        # attention reads its weight as a function's): those the coverage counts, as the advisor's plan does
        self.ran: set[str] = set()
        # a resumed run's earlier attempts (``resumed``): per layer the sampled steps that evaluated it, and those
        # that evaluated none; their turns go on from these
        self._earlier: dict[str, int] = {}
        self._earlier_controls = 0
        self._offered: dict[str, int] = {}  # layer -> turns its group had in this process (ran or not)

    @property
    def groups(self) -> int:
        return self.budget.groups

    def deal(self, plan: Any, groups: int | None = None, device_type: str | None = None) -> None:
        """Deal ``plan``'s layers into ``groups`` groups (at attach: the budget's start; a re-attached
        Profiler keeps what its budget measured). ``plan``: a ``capture.plan.CapturePlan``; ``device_type``:
        where the what-if runs (at attach: the calibration's prior)."""
        if device_type is not None:
            self.calibration.use_prior(device_type)
        self._slots = plan.block_slots()
        for slot in self._slots:
            self.turns.setdefault(slot.name, 0)
        if groups is None:
            n = len(self._slots)
            if self.budget.n_layers != n:
                self.budget = BlockBudget(self.share, self.fixed, n_layers=n)
            groups = self.budget.groups
        self.loads = plan.deal_block_groups(groups)

    def resumed(self, evaluated: dict[str, int], evaluating: int, controls: int) -> None:
        """What the earlier attempts of a resumed run evaluated, from their tables: per layer on how many sampled
        steps (``evaluated``), how many sampled steps evaluated a group (``evaluating``) and how many none
        (``controls``). The turns go on from them (``next_turn``: a resumed attempt started them over, and
        evaluated the first groups again and the last never), and the coverage counts them (``describe``). The
        control steps and the budget's measures stay this process's own: its timer and its speed."""
        self._earlier = {name: int(n) for name, n in evaluated.items() if n > 0}
        self._rotation = max(0, int(evaluating))
        self._earlier_controls = max(0, int(controls))

    def next_turn(self) -> int:
        """The group the sampled step beginning now evaluates (``CONTROL_TURN``: none, a control step)."""
        k = self._samples
        self._samples += 1
        if self.budget.adaptive and self._slots and is_control(k):
            self.turn = CONTROL_TURN
            return self.turn
        self.turn = self._least_covered() if self._earlier and self._slots else self._rotation % self.groups
        self._rotation += 1
        return self.turn

    def _least_covered(self) -> int:
        """A resumed run's turn: the group whose least evaluated layer, over every attempt, was evaluated least
        (the earlier attempts' evaluations and this one's turns), ties to the next in rotation. Where the groups
        stay the same, the rotation the run would have had uninterrupted, once the turns have caught up."""
        groups = self.groups
        least = [math.inf] * groups
        for slot in self._slots:
            g = slot.block_group
            if 0 <= g < groups:
                least[g] = min(least[g], self._earlier.get(slot.name, 0) + self._offered.get(slot.name, 0))
        start = self._rotation % groups
        return min(range(groups), key=lambda g: (least[g], (g - start) % groups))

    def count_turn(self) -> None:
        """The sampled step that began with ``next_turn`` recorded its statistics: its group's layers were
        evaluated once more; a control step, counted here, as recorded (counted as it began, the step the last
        prof.step() began and the loop never ran was one more: "2 sampled steps evaluated none" of a run with 1)."""
        ran = [slot for slot in self._slots if slot.ran]  # (one whose forward did not run: nothing evaluated)
        self.ran.update(slot.name for slot in ran)
        if self.turn == CONTROL_TURN:
            self.control_steps += 1
            return
        for slot in self._slots:
            if slot.block_group == self.turn:
                self._offered[slot.name] = self._offered.get(slot.name, 0) + 1
        for slot in ran:
            if slot.block_group == self.turn:
                self.turns[slot.name] = self.turns.get(slot.name, 0) + 1

    def describe(self) -> dict[str, Any]:
        """The ``block_formats`` entry of the capture summary: the budget's, and how many layers the sampled
        steps covered and how often (``layers``, ``layers_evaluated``, ``evaluations``: fewest and most sampled
        steps that evaluated a layer), a resumed run's over every attempt (``resumed``)."""
        out = self.budget.describe()
        if self.budget.adaptive:
            out["control_steps"] = self.control_steps + self._earlier_controls
            out["timer_factor"] = self.calibration.factor
            out["timer_factor_measured"] = self.calibration.told
        # linear layers apart from the embeddings whose weight a tied head reads (a GPT-2's 9 and 2: the report
        # said "3 of 11 layers evaluated" beside the advisor's "3 of the 9 linear layers")
        # (and those whose forward ran on a sampled step: a linear layer none ran, the out_proj of an
        # nn.MultiheadAttention, read "7 of 7 linear layers evaluated" beside the plan's 5 linear layers)
        linear = {s.name for s in self._slots if taxonomy.is_linear_type(s.module_type)}
        turns = dict(self.turns)
        for name, n in self._earlier.items():
            turns[name] = turns.get(name, 0) + n
        ran = self.ran | set(self._earlier)
        counts = [c for name, c in turns.items() if name in linear and name in ran]
        others = [c for name, c in turns.items() if name not in linear and name in ran]
        out["layers"] = len(counts)
        out["layers_evaluated"] = sum(c > 0 for c in counts)
        out["evaluations"] = [min(counts), max(counts)] if counts else [0, 0]
        if others:
            out["embeddings"] = len(others)
            out["embeddings_evaluated"] = sum(c > 0 for c in others)
            out["embeddings_tied"] = len(self._tied(linear))
        return out

    def _tied(self, linear: set[str]) -> set[str]:
        """The embeddings (block slots apart from ``linear``) whose weight a linear layer also holds: a head tied
        to it, registered after it (the head's ``shared`` names it) or before (the embedding's names the head).
        The what-if evaluates every embedding; only these have a GEMM that reads their weight."""
        tied = set()
        for slot in self._slots:
            owners = set(slot.shared.values())
            if slot.name in linear:
                tied |= {o for o in owners if o not in linear}
            elif owners & linear:
                tied.add(slot.name)
        return tied - linear

    def adapt(
        self,
        plan: Any,
        step: int,
        step_s: float,
        block_s: float,
        mean: Any = None,
        memory: bool = False,
        calls: int = 0,
    ) -> None:
        """After a sampled step's host copy: from what its what-if cost (``block_s`` of ``step_s``, as its
        timer read it, scaled by the calibration), re-deal the layers when the budget asks for another number of
        groups. ``mean``: turns one rank's estimate into the mean over ranks (a collective), so that every rank
        deals alike. ``memory``: the step measured memory (the calibration compares steps of the same kind);
        ``calls``: how many calls the timer read (the calibration's prior counts them)."""
        if not self.budget.adaptive:
            return
        if self.turn == CONTROL_TURN:  # the same steps on every rank: no collective skipped on one alone
            self.calibration.control(step_s, memory)
            return
        if self._samples > 1:  # (the first sampled step warms up)
            self.calibration.evaluated(step_s, block_s, memory)
        total = sum(self.loads)
        share = self.loads[self.turn] / total if total else 0.0
        ratio = self.budget.estimate(step_s, block_s * self.calibration.factor_for(block_s, calls), share)
        if mean is not None:
            ratio = mean(ratio)
        if self.budget.observe(step, ratio):
            self.deal(plan, self.budget.groups)
