"""A new optimizer in the middle of a run (``Profiler.use_optimizer``): a loop that switches from Adam to SGD at
step N, or makes its optimizer again after unfreezing layers. precprof's hooks sit on the step of the optimizer
it was given: once the loop steps a new one, the weight-update sample, the memory of the optimizer's states and
the summary's optimizer stayed the old one's (its hooks never fired again, its states were still counted, its
class was still named). ``use_optimizer`` moves them to the new one and records the change in the summary's
``optimizer_changes``: from which step, and the classes before and after."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from precprof.capture.model_facts import optimizer_class
from precprof.capture.plan import CapturePlan
from precprof.capture.results import NOT_HELD, given_optimizers
from precprof.capture.updates import UpdateSampler


class OptimizerSwitch:
    """The ``use_optimizer`` part of ``capture.profiler.Profiler``."""

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
        # has no hook on them, and loses nothing by the switch taking effect at once)
        hooks = self._hooks
        stepped = self._attached and hooks is not None and hooks.installed and hooks._optimizer_stepped
        if self._attached and (stepped or self._step > self._first_step):
            old = optimizer_class(self.optimizers)
            self._optimizer_changes.append(
                {"step": self._step + stepped, "from": old, "to": optimizer_class(new)}
            )
        self.optimizers, self.optimizer = new, new[0] if new else None
        # on once an optimizer is known (rows sampled before a switch to none stay said)
        self.weight_updates = self.weight_updates or (self._updates_asked and bool(new))
        if self._attached:
            if stepped:  # the step in progress keeps the old one's hooks: moved when the next one begins
                self._switch_due = new
            else:
                self._move_hooks(new)

    def _take_switch(self) -> None:
        """The hooks moved to the optimizers a switch after the old one's step left for this step (``use_optimizer``)."""
        if self._switch_due is not None:
            self._move_hooks(self._switch_due)
            self._switch_due = None

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
            warnings.warn(NOT_HELD, stacklevel=3)
