"""A model whose parameters or modules change while precprof is attached: ``remove_parametrizations`` (weight norm
taken off before fine-tuning), adapters injected, a layer swapped for another (torchao's
``convert_to_float8_training`` swaps every ``nn.Linear`` for a ``Float8Linear`` holding the same parameters). The
capture plan (``capture/plan.py``) holds the modules and parameters the model had at attach, and its hooks read
them: the new parameters had no row, while the ones the model no longer held kept being read, their values
frozen, as if they still trained; a module swapped for another kept its hooks on the old one, which no longer
ran, so its outputs, their gradients and its input had no row.

At the start of every sampled step (and at ``use_optimizer``, a new optimizer being what such a change comes
with) the model's modules and parameters are compared with the plan's, object by object; when they differ, the
capture is planned again, as at a re-attach, from that step on: the rows of the modules and parameters the model
holds now, and none of the others. The summary's ``model_changes`` says from which step, which parameters came
and went, and which modules were replaced, added or taken out (``modules``). Nothing of this runs on a step that
is not sampled."""

from __future__ import annotations

from typing import Any

from precprof import clipwatch
from precprof._notice import notice
from precprof.capture.plan import CapturePlan

# what the hooks count or found over the run, carried over to the hooks of the new plan
_HOOK_COUNTS = (
    "output_head",
    "eval_forwards",
    "checkpointed_forwards",
    "self_call_forwards",
    "weight_grads_unread",
    "weight_grads_unread_in",
)


class Replanning:
    """The re-plan part of ``capture.profiler.Profiler``."""

    model: Any
    _plan: CapturePlan | None
    _hooks: Any
    _tracker: Any
    _buffer: Any
    _updates: Any
    _scaler_watch: Any
    _clip_norms: Any
    _step: int
    _model_changes: list[dict[str, Any]]

    def _make_parts(self, replan: bool = False) -> None:
        raise NotImplementedError

    def _arm(self, turn: int) -> None:
        """A sampled step begins: the memory tracker told, the rows emptied, the hooks installed (the block what-if
        of group ``turn``)."""
        assert self._plan is not None and self._hooks is not None
        if self._tracker is not None:
            self._tracker.begin_step(self._step, True)
        if self._buffer is not None:
            self._buffer.reset()
        if self._updates is not None:
            self._updates.reset()
        self._plan.rows.begin_step()
        self._hooks.install(turn)

    def _replan_if_changed(self, mid_step: bool = False) -> bool:
        """Plan the capture again when the model's parameters are no longer the plan's (see the module
        docstring); whether it did. On a sampled step only, before its hooks read anything: one pass over the
        parameters. ``mid_step``: the sampled step is armed already (``use_optimizer`` before its forward)."""
        old = self._plan
        if old is None or not old.stale(self.model):
            return False
        names = dict(old.param_names)
        hooks, tracker, buffer, updates = self._hooks, self._tracker, self._buffer, self._updates
        if hooks is not None:
            hooks.remove(finished=False)  # (its step's counts were taken when it ended)
        if tracker is not None:
            tracker.detach()
        self._unhook_parts()
        self._make_parts(replan=True)
        new = self._plan
        assert new is not None
        if hooks is not None and self._hooks is not None:
            for attr in _HOOK_COUNTS:
                setattr(self._hooks, attr, getattr(hooks, attr))
        if tracker is not None and self._tracker is not None:
            self._tracker.take_over(tracker)
        if buffer is not None and self._buffer is not None:
            _carry_skipped(old, buffer, new, self._buffer, mid_step)
        if updates is not None and self._updates is not None:  # the updates not sampled, counted over the run
            for key, (count, why) in updates.skipped.items():
                self._updates.skipped.setdefault(key, [0, why])[0] += count
            # what it found and measured of the optimizers, over the run
            self._updates.carry = updates.carry
        now = dict(new.param_names)
        added = [n for k, n in now.items() if k not in names]
        removed = [n for k, n in names.items() if k not in now]
        modules = _modules_changed(old, new)
        self._model_changes.append(
            {"step": self._step, "added": added, "removed": removed, "modules": modules}
        )
        what = "parameters" if added or removed else "modules"
        said = f"new: {_few(added)}; gone: {_few(removed)}" if added or removed else _few(modules)
        notice(
            f"precprof: the model's {what} changed before step {self._step} ({said}): the capture follows the "
            "model as it is now from this step on",
        )
        return True

    def _unhook_parts(self) -> None:
        """The GradScaler's and ``clip_grad_norm_``'s watches off (the parts made again with the plan)."""
        if self._scaler_watch is not None:
            self._scaler_watch.unpatch()
        if self._clip_norms is not None:
            clipwatch.unwatch(self._clip_norms)


def _carry_skipped(
    old: CapturePlan, old_buffer: Any, new: CapturePlan, new_buffer: Any, mid_step: bool
) -> None:
    """The counts of tensors the statistics could not read, over the run's steps before this one, kept for the
    rows the new plan has too (the same module, kind and parameter). ``mid_step``: the step's own so far are
    left (the change ran them: ``remove_parametrizations`` computes the weight once more; the new plan reads the
    step), else the last sampled step's are its own."""
    index = {(r.module, r.tensor, r.param): r.index for r in new.rows.info}
    before = old_buffer.skipped_total - (old_buffer.skipped if mid_step else 0)
    for r in old.rows.info:
        k = index.get((r.module, r.tensor, r.param))
        if k is not None and before[r.index]:
            new_buffer.skipped_total[k] += before[r.index]
            if r.index in old_buffer.skipped_why:
                new_buffer.skipped_why.setdefault(k, old_buffer.skipped_why[r.index])


def _modules_changed(old: CapturePlan, new: CapturePlan) -> list[str]:
    """The names of the modules that are not the objects they were at ``old``: replaced by another (a
    ``Float8Linear`` for an ``nn.Linear``), added, or taken out; in the model's order, those taken out last."""
    was = {name: k for k, name in old.module_names}
    now = {name: k for k, name in new.module_names}
    return [n for n, k in now.items() if was.get(n) != k] + [n for n in was if n not in now]


def _few(names: list[str]) -> str:
    return (", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")) or "none"
