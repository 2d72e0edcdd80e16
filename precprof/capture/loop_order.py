"""The loop's order around ``prof.step()``, as the hooks of a sampled step see it (``capture/hooks.py``).

precprof's rows are a step's because the loop calls ``prof.step()`` once per optimizer step, after
``optimizer.step()``, and steps the optimizers it gave the Profiler. A loop that does otherwise trained as it
should, but its rows were silently wrong:

- a new optimizer made mid-run without ``prof.use_optimizer(new_opt)``: the weight-update rows stopped without
  a word, and the memory table kept counting the old optimizer's states (precprof held them alive);
- ``prof.step()`` called at a logging interval, every few optimizer steps: each row held several steps (activation
  calls 3, the weight updates of three steps summed);
- ``prof.step()`` called twice after one optimizer step: an empty step, marked sampled;
- ``prof.step()`` called before ``optimizer.step()``: every weight-update row was the step before's update, and
  detach made a last step of that update alone.

An optimizer step on no gradient at all before the step's forward is none of these: a batch the loop skipped
(Lightning's automatic optimization steps the optimizer after a ``training_step`` that returned None, its closure
zeroing the gradients and running no backward), which updated nothing (torch's optimizers skip a parameter
without a gradient, and ``capture/update_steps.py`` leaves its row out of the update-to-weight ratio).

On a sampled step the hooks note which optimizers stepped, how often, and whether the model's forward had run by
then; an optimizer the Profiler does not follow is seen through torch's global optimizer hooks, in place only
while a sampled step's hooks are (nothing on a step that is not sampled; host only, no sync). At the step's end
(``LoopOrder.judge``) what went wrong is said once per run and kind, as a warning that names the fix, and counted
for the summary's ``capture.loop_order`` (the report's environment section says it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from precprof import tables as T
from precprof._notice import notice
from precprof.capture.model_facts import optimizer_class
from precprof.capture.optimizer_held import HeldSeen
from precprof.capture.trainable import TrainedSeen

# what can go wrong, as the summary names it (``capture.loop_order``)
UNFOLLOWED = T.LOOP_NOT_FOLLOWED  # an optimizer the Profiler does not follow stepped the model's parameters
SEVERAL = T.LOOP_SEVERAL_STEPS  # the optimizer it follows (each of them) stepped more than once in the step
# of several it follows, one stepped more than once and another once (a WGAN's critic): no fault, not warned of
CRITIC = T.LOOP_CRITIC_STEPS
EMPTY = "empty_step"  # no forward, backward or optimizer step at all
BEFORE_FORWARD = T.LOOP_BEFORE_FORWARD  # an optimizer stepped before the step's forward
# weight gradients read and no optimizer step (a micro-batch's step): counted, not warned of (``T.LOOP_NOT_STEPPED``)
NOT_STEPPED = T.LOOP_NOT_STEPPED

ONCE_PER_STEP = "call prof.step() once per optimizer step, after optimizer.step()"
AT_MAX = 256  # the sampled steps of a fault listed (``at``); past this many only counted
_FIX = {
    UNFOLLOWED: "give the Profiler every optimizer the loop steps (optimizer=[opt1, opt2]), or call "
    "prof.use_optimizer(new_opt) for one made later (a list when the loop steps several)",
    SEVERAL: ONCE_PER_STEP,
    EMPTY: ONCE_PER_STEP,
    BEFORE_FORWARD: ONCE_PER_STEP,
    NOT_STEPPED: ONCE_PER_STEP,
    CRITIC: "",
}
# what the rows of a step of several optimizer steps hold (the warning's and the report's words)
SEVERAL_ROWS = (
    "each layer's activation calls and their gradients, the weight updates; each weight-gradient row is the "
    "gradient of its optimizer's first step"
)
LISTED = 4  # the modules named of an optimizer that stepped several times


class LoopOrder:
    """What the sampled steps saw of the loop's order: the step in progress's (reset by ``begin``), and, over the
    run, each kind of fault with the first step it was seen on and how many sampled steps had it."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, Any]] = {}  # kind -> {"first_step", "steps", ...}: the summary's
        self.active = False  # a sampled step's hooks are acting
        self._followed: set[int] = set()  # the ids of the optimizers the Profiler follows
        self._followed_names: str | None = None
        self._place: dict[int, int] = {}  # optimizer id -> its place in the list the Profiler was given
        # the passes of the sampled steps (the summary's ``capture.step_passes``): the model's own training forwards
        # a step, least and most, and the classes of the followed optimizers whose closure ran more than once in a step
        self._forwards_seen: tuple[int, int] | None = None  # (least, most)
        self._closures: set[str] = set()
        self._closure_most = 0  # the most evaluations of one of their closures in an optimizer step
        self._params: Mapping[int, Any] = {}  # the ids of the model's trained parameters
        # which parameters trained on the sampled steps (a layer unfrozen mid-run)
        self.trained = TrainedSeen()
        # which trainable parameters no optimizer it follows held on the sampled steps they stepped in
        self.held = HeldSeen()
        self.begin()

    def begin(self) -> None:
        """A sampled step begins."""
        self.active = True
        self._steps_of: dict[int, int] = {}  # optimizer id -> its steps in this step
        self._stepped: dict[
            int, Any
        ] = {}  # optimizer id -> the optimizer (this step's, named if it steps again)
        self._forwards = 0  # the model's own training forwards (``model_forward``)
        self._before_forward = False
        # optimizer id -> class, of the optimizers not followed that stepped the model's parameters
        self._unfollowed: dict[int, str] = {}
        # the ids of the parameters those optimizers hold (``HeldSeen``: stepped by an optimizer not given, and so
        # in an optimizer, though not in one the Profiler follows)
        self._unfollowed_params: set[int] = set()
        self._inside = 0  # followed optimizers' steps in progress (one may step another inside it)
        self._followed_steps = 0
        # per step of an optimizer not followed in progress: ``_followed_steps`` as it began
        self._outer: list[int] = []
        self._followed_late = (
            False  # one that stepped the model's parameters was followed before the step ended
        )

    def watch(self, followed: Sequence[Any], params: Mapping[int, Any]) -> list[Any]:
        """Hooks on every optimizer's step (torch's global ones), for a sampled step's hooks to remove with theirs;
        none when the Profiler follows no optimizer (then it reads no update, and asks for none)."""
        self._followed = {id(o) for o in followed}
        self._place = {id(o): k for k, o in enumerate(followed)}
        self._followed_names = optimizer_class(list(followed))
        self._params = params
        if not followed:
            return []
        return [
            register_optimizer_step_pre_hook(self._any_pre),
            register_optimizer_step_post_hook(self._any_post),
        ]

    def followed_begins(self) -> None:
        """A followed optimizer's step begins (its own pre-hook)."""
        self._inside += 1

    def model_forward(self) -> None:
        """A training forward of the model itself begins (its outermost call, with grad, no evaluation)."""
        self._forwards += 1

    def closure_counter(self, optimizer: Any) -> Callable[[], None]:
        """What counts the evaluations of the closure a followed optimizer's step was given: one evaluated more
        than once in a step (LBFGS) makes passes of its own (``passes``); evaluated once, as Lightning's automatic
        optimization runs the last micro-batch's training step, it makes none (its micro-batches were said to be
        its closure's evaluations: reviewer r1)."""
        name, count = type(optimizer).__name__, 0

        def evaluated() -> None:
            nonlocal count
            count += 1
            if count > 1:
                self._closures.add(name)
                self._closure_most = max(self._closure_most, count)

        return evaluated

    def followed_stepped(self, optimizer: Any, after_forward: bool, applied: bool = True) -> None:
        """A followed optimizer stepped (its own post-hook); ``after_forward``: the step's forward had run;
        ``applied``: one of its parameters had a gradient (none: a skipped batch's step, which updated nothing and
        is no step before's update)."""
        self._inside = max(self._inside - 1, 0)
        self._followed_steps += 1
        key = id(optimizer)
        self._steps_of[key] = self._steps_of.get(key, 0) + 1
        self._stepped[key] = optimizer
        self._before_forward = self._before_forward or (applied and not after_forward)

    def followed_now(self, optimizers: Sequence[Any]) -> None:
        """``prof.use_optimizer`` before the step ended: what those optimizers stepped in it is no fault (Lightning's
        callback follows a new optimizer at the end of the batch that stepped it first)."""
        for o in optimizers:
            self._followed_late = self._unfollowed.pop(id(o), None) is not None or self._followed_late

    def _any_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active and id(optimizer) not in self._followed:
            self._outer.append(self._followed_steps)

    def _any_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active or id(optimizer) in self._followed:
            return
        began = self._outer.pop() if self._outer else self._followed_steps
        # one that wraps a followed optimizer (a Lookahead over it) or runs inside its step (ZeroRedundancyOptimizer's
        # local optimizer) is that optimizer's step
        if self._inside or began != self._followed_steps or id(optimizer) in self._unfollowed:
            return
        params = self._params
        ids = {id(p) for g in getattr(optimizer, "param_groups", ()) for p in g["params"]}
        if any(i in params for i in ids):
            self._unfollowed[id(optimizer)] = type(optimizer).__name__
            self._unfollowed_params |= ids

    def judge(self, step: int, hooks: Any) -> None:
        """The sampled step ``step`` ends: its faults counted and, the first time of each kind, warned about, and
        which parameters trained in it noted (``trainable.py``), and, where a followed optimizer stepped, which of
        them it held (``optimizer_held.py``). ``hooks``: the step's ``StepHooks`` (None: none),
        whose ``ran_nothing`` tells whether it ran no forward and no backward (asked only when no optimizer
        stepped)."""
        self.active = False
        ran_nothing: Callable[[], bool] = hooks.ran_nothing if hooks is not None else bool
        if hooks is not None:
            self.trained.note(step, hooks)
            if self._steps_of:
                self.held.note(hooks, self._unfollowed_params if self._unfollowed else set())
        seen, n = self._forwards_seen, self._forwards
        self._forwards_seen = (min(seen[0], n), max(seen[1], n)) if seen is not None else (n, n)
        most = max(self._steps_of.values(), default=0)
        faults: dict[str, dict[str, Any]] = {}
        if self._unfollowed:
            faults[UNFOLLOWED] = {"optimizers": sorted(set(self._unfollowed.values()))}
        if most > 1 and min(self._steps_of.values()) == 1:  # a critic's steps beside its generator's one
            several = [self._stepped[k] for k, n in self._steps_of.items() if n > 1]
            faults[CRITIC] = {"most": most, "optimizers": [self._named(o, hooks) for o in several]}
        elif most > 1:
            faults[SEVERAL] = {"most": most}
        if self._before_forward:
            faults[BEFORE_FORWARD] = {}
        if not most and not self._unfollowed and ran_nothing():
            faults[EMPTY] = {}
        if (
            not most
            and not self._unfollowed
            and not self._followed_late
            and hooks is not None
            and hooks.gradients_without_step()
        ):
            faults[NOT_STEPPED] = {}
        for kind, facts in faults.items():
            self._count(kind, step, facts)
        self._stepped = {}

    def _named(self, optimizer: Any, hooks: Any) -> str:
        """A followed optimizer in words: its place in the list the Profiler was given, its class and the modules
        whose parameters it updates ("optimizer 0 (Adam: D.0, D.2)")."""
        modules: list[str] = hooks.modules_of(optimizer) if hooks is not None else []
        shown = ", ".join(modules[:LISTED]) + (
            f" and {len(modules) - LISTED} more" if len(modules) > LISTED else ""
        )
        what = type(optimizer).__name__ + (f": {shown}" if shown else "")
        return f"optimizer {self._place.get(id(optimizer), 0)} ({what})"

    def _count(self, kind: str, step: int, facts: dict[str, Any]) -> None:
        entry = self.seen.get(kind)
        if entry is None:
            self.seen[kind] = {"first_step": step, "steps": 1, "at": [step], **facts}
            # (a loop that skips a bad batch's optimizer step has a few: the advisor judges; a critic's steps are
            # no fault)
            if kind not in (NOT_STEPPED, CRITIC):
                notice(f"precprof: {self._said(kind, step, facts)}; {_FIX[kind]}")  # (inside prof.step())
            return
        entry["steps"] += 1
        if len(entry["at"]) < AT_MAX:
            entry["at"].append(step)
        if "most" in facts:
            entry["most"] = max(entry["most"], facts["most"])
        if "optimizers" in facts:
            entry["optimizers"] = sorted({*entry["optimizers"], *facts["optimizers"]})

    def _said(self, kind: str, step: int, facts: Mapping[str, Any]) -> str:
        followed = self._followed_names or "the optimizer given"
        if kind == UNFOLLOWED:
            others = ", ".join(facts["optimizers"])
            return (
                f"in sampled step {step} an optimizer the Profiler was not given ({others}) stepped the model's "
                "parameters: their updates are not read, and the memory table counts the states of the optimizers "
                f"it was given ({followed}), not this one's"
            )
        if kind == SEVERAL:
            return (
                f"sampled step {step} holds {facts['most']} steps of {followed}: its rows add them up "
                f"({SEVERAL_ROWS})"
            )
        if kind == BEFORE_FORWARD:
            return (
                f"in sampled step {step} {followed} stepped before the model's forward: its weight-update rows are "
                "the step before's update (prof.step() called before optimizer.step()?)"
            )
        return f"sampled step {step} ran no forward, backward or optimizer step (prof.step() called twice?)"

    def trained_summary(self, model: Any) -> dict[str, Any]:
        """For summary.json's ``capture``: which parameters trained, where that changed during the run
        (``TrainedSeen.summary``), those no optimizer the Profiler follows held (``HeldSeen.summary``), and the
        sampled steps' passes (``passes``)."""
        return {**self.trained.summary(model), **self.held.summary(), T.SUMMARY_STEP_PASSES: self.passes()}

    def passes(self) -> dict[str, Any]:
        """For summary.json's ``capture.step_passes``: the model's own training forwards a sampled step (least and
        most; 0 where the loop calls parts of the model itself), and the classes of the followed optimizers whose
        closure ran the forward and backward several times in an optimizer step (LBFGS), with the most times."""
        seen = self._forwards_seen
        return {
            "model_forwards": {"least": seen[0], "most": seen[1]} if seen is not None else None,
            "closures": sorted(self._closures),
            "closure_evaluations": self._closure_most or None,
        }

    def summary(self) -> dict[str, dict[str, Any]]:
        """For summary.json's ``capture.loop_order``: per kind seen, the first sampled step, how many had it and
        which (``at``: the first ``AT_MAX``)."""
        # (a loop that steps its optimizer before the forward steps each step's gradients in the next step: its
        # first step, with no optimizer step, is that, no micro-batch)
        late = BEFORE_FORWARD in self.seen
        return {
            kind: {**entry, "at": list(entry["at"])}
            for kind, entry in self.seen.items()
            if not (late and kind == NOT_STEPPED)
        }
