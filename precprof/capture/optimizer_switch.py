"""A new optimizer in the middle of a run (``Profiler.use_optimizer``): a loop that switches from Adam to SGD at
step N, or makes its optimizer again after unfreezing layers. precprof's hooks sit on the step of the optimizer
it was given: once the loop steps a new one, the weight-update sample, the memory of the optimizer's states and
the summary's optimizer stayed the old one's (its hooks never fired again, its states were still counted, its
class was still named). ``use_optimizer`` moves them to the new one and records the change in the summary's
``optimizer_changes``: from which step, and the classes before and after."""

from __future__ import annotations

from typing import Any

import torch

from precprof._notice import notice
from precprof.capture.given import NOT_HELD, given_optimizers
from precprof.capture.model_facts import optimizer_class
from precprof.capture.plan import CapturePlan
from precprof.capture.replan import Replanning
from precprof.capture.storage import optimizer_state_tensors
from precprof.capture.updates import UpdateSampler


class OptimizerSwitch(Replanning):
    """The ``use_optimizer`` part of ``capture.profiler.Profiler`` (a new optimizer often comes with a model whose
    parameters changed: ``Replanning``)."""

    optimizer: Any
    optimizers: list[Any]
    weight_updates: bool
    update_sample: int
    _updates_asked: bool  # ``Profiler(weight_updates=...)`` as given, before an optimizer was known
    _optimizer_changes: list[dict[str, Any]]
    _attached: bool
    _step: int
    _first_step: int
    _device: torch.device
    _plan: CapturePlan | None
    _hooks: Any
    _tracker: Any
    _collector: Any
    _scaler_watch: Any
    _updates: UpdateSampler | None
    # the optimizers a switch after the old ones stepped in the sampled step in progress moves the hooks to once
    # it ends (``use_optimizer``)
    _switch_due: list[Any] | None = None
    # a switch on a step that is not sampled, which no hook tells the date of: the change recorded, the
    # optimizers before and after it, and what tells whether one stepped since (``_date_switch``)
    _switch_unseen: tuple[dict[str, Any], list[Any], list[int]] | None = None
    # an optimizer given while the Profiler followed none (minGPT's Trainer makes its own in run(), reachable from
    # the first batch's callback, after that batch's step): the step in progress then, and the first sampled step
    # whose optimizer step the update sample read since. Steps before it have no weight_update rows
    _optimizer_given_at: int | None = None
    _updates_read_from: int | None = None
    _updates_read_steps: int = 0  # the sampled steps whose optimizer step the update sample read

    def use_optimizer(self, optimizer: Any) -> None:
        """Follow ``optimizer`` (one, a list of them, or None) in place of the optimizers the Profiler follows now:
        its step is the one whose updates are sampled (``weight_update`` rows), its states are what the memory
        table counts as ``optimizer_states``, and its class and settings are the summary's ``optimizer``. Call it
        once the new optimizer is made, before its first ``step()``. From the step in progress on, or from the
        next one when the old optimizer stepped in this one already (a switch after ``old.step()``, before
        ``prof.step()``): that step keeps the old one's updates and states. The change goes into the summary's
        ``optimizer_changes`` as ``{"step", "from", "to"}`` (the first step of the new optimizer, the classes);
        before the Profiler is attached, or before the old optimizer stepped, there is no change to say (the
        optimizer the run trains with is simply the new one). The optimizers followed already: nothing."""
        new = given_optimizers(optimizer)
        if list(map(id, new)) == list(map(id, self.optimizers)):
            return
        # the old ones stepped in this step: known on a sampled step, whose hooks are on them (an unsampled one
        # has no hook on them, and loses nothing by the switch taking effect at once: dated at its end)
        hooks = self._hooks
        sampled = self._attached and hooks is not None and hooks.installed
        stepped = sampled and hooks._optimizer_stepped
        if sampled:  # (a new one that stepped in this step already is followed now: no fault of the loop's)
            hooks.loop.followed_now(new)
        if self._attached and not self.optimizers and new and self._optimizer_given_at is None:
            self._optimizer_given_at = self._step
        if self._attached and (stepped or self._step > self._first_step):
            change = {
                "step": self._step + stepped,
                "from": optimizer_class(self.optimizers),
                "to": optimizer_class(new),
            }
            self._optimizer_changes.append(change)
            if not sampled:  # dated once the step ends (``_date_switch``)
                both = [*self.optimizers, *new]
                self._switch_unseen = (change, both, _step_marks(both))
        self.optimizers, self.optimizer = new, new[0] if new else None
        # on once an optimizer is known (rows sampled before a switch to none stay said)
        self.weight_updates = self.weight_updates or (self._updates_asked and bool(new))
        if self._attached:
            if stepped:  # the step in progress keeps the old one's hooks: moved when the next one begins
                self._switch_due = new
            else:
                self._move_hooks(new)
            # a new optimizer comes with a model whose parameters changed (weight norm removed, adapters added):
            # the capture follows it from this step on before the model's forward ran (what the change itself
            # ran, the weight computed once more by remove_parametrizations, is no step's), else from the next one
            if sampled and not stepped and not hooks.forward_ran and self._replan_if_changed(mid_step=True):
                self._arm(hooks.turn)

    def _note_updates_read(self) -> None:
        """At a sampled step's end: whether the update sample read its optimizer step (counted: the summary's
        ``updates_read_steps``), and the first step it did, once the Profiler was given its optimizer late
        (``updates_from``)."""
        hooks = self._hooks
        if self._updates is not None and hooks is not None and hooks._optimizer_stepped:
            self._updates_read_steps += 1
        if (
            self._optimizer_given_at is not None
            and self._updates_read_from is None
            and self._updates is not None
            and hooks is not None
            and hooks._optimizer_stepped
        ):
            self._updates_read_from = self._step

    def _take_switch(self) -> None:
        """The hooks moved to the optimizers a switch after the old one's step left for this step (``use_optimizer``);
        a switch on the step that ended, not sampled, dated."""
        self._date_switch()
        if self._switch_due is not None:
            self._move_hooks(self._switch_due)
            self._switch_due = None

    def _date_switch(self) -> None:
        """A switch on a step that was not sampled, which has no hook on the optimizers to say whether the old ones
        had stepped by then (by design: nothing on a step that is not sampled): dated that step when one of the
        optimizers stepped after it (the new ones did), else the next one (it came after the step's update, the
        old ones'; it was dated one step early). Read off the parameters' version counters, which a step's in-place
        update moves (a fused optimizer's does not), and the number of parameters with a state (a new Adam or SGD
        with momentum makes theirs at its first step): nothing read on the device."""
        unseen, self._switch_unseen = self._switch_unseen, None
        if unseen is not None:
            change, optimizers, before = unseen
            if _step_marks(optimizers) == before:
                change["step"] += 1

    def _move_hooks(self, new: list[Any]) -> None:
        """The attached hooks and the update sampler moved to ``new``."""
        if self._hooks is not None:
            self._hooks.use_optimizers(new)
        if self._tracker is not None and hasattr(self._tracker, "use_optimizers"):
            self._tracker.use_optimizers(new)
        if self._scaler_watch is not None:  # the found-inf flags it reads: the followed optimizers'
            self._scaler_watch.use_optimizers(new)
        updates = self._updates
        if updates is not None:
            updates.use(new)
        elif self.weight_updates and self._plan is not None:  # the Profiler was given no optimizer
            updates = UpdateSampler.following(self._plan.params, new, self.update_sample, self._device)
            self._updates = updates
            for part in (self._hooks, self._collector):
                if part is not None:
                    part.updates = updates
        trained = self._plan is not None and any(ps.grad_row >= 0 for ps in self._plan.params)
        if new and updates is not None and not updates.tracked and trained:
            notice(NOT_HELD)


def _step_marks(optimizers: list[Any]) -> list[int]:
    """What an optimizer's step changes, of ``optimizers``: their parameters' version counters, and how many
    state tensors each holds (a ZeroRedundancyOptimizer's: the optimizer it wraps)."""
    params = {id(p): p for opt in optimizers for g in opt.param_groups for p in g["params"]}
    marks = [p._version for p in params.values() if isinstance(p, torch.Tensor)]
    return marks + [len(optimizer_state_tensors(opt)) for opt in optimizers]
