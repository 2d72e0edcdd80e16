"""An attempt of a sampled step that raised, run again: a loop that catches an out-of-memory error (or any
exception from the forward or the backward), frees memory and runs the step again, in smaller micro-batches, or
runs the failed micro-batch again. What the failed attempt read is no step's: the step's rows and its activation
memory are what the attempts that trained read, as in a run without the failure (they were merged: fc1 calls=4
where 2 forwards trained, and activations 2.8x those held). Nothing is forgotten until the loop runs the model
again: a crash keeps what it read, as does a loop that skips the batch and goes on to the next step.

``AttemptWatch`` tells when and how far to go back; its owner (``StepHooks`` for the statistics rows, through
``StepAttempts`` below; ``MemoryTracker`` for the saved activations, ``capture/memory_saved.py``) says what a
point to go back to holds. Two points are kept: the state at the step's first forward (or the first since an
optimizer of the run stepped: what trained before stays), and at the forward running now. The loop runs the
model again after

- a forward that raised (the model's forward hook called with no output, from torch's ``except``; for a
  KeyboardInterrupt, which torch calls no hook for, the model's next call tells, ``calls_running``): back to that
  forward's point, the micro-batches before it kept, unless the loop discarded their gradients since (it zeroed
  them to run the whole step again): then back to the step's;
- a backward pass that raised (autograd runs a pass's queued callbacks only when it ends well, so a pass whose
  hooks fired and whose callback did not run raised): back to the step's point. The gradient hooks the pass had
  fired, for the layers it reached, had read what is forgotten with it; the gradients it accumulated are the
  loop's to discard (they are not the step's either way: a loop cannot keep half a backward pass).

A backward that raised before any hook of precprof fired (in the loss, before the model's output) is not seen,
nor a forward that raised in a hook of the user's on the model itself after precprof's: the model's next
forward then reads as a second forward of the step. Host only, no sync, on sampled steps alone: the step's
first forward copies nothing (nothing was read yet); each later one copies the rows (a device copy per device,
and the row table's lists), and a gradient hook tests a flag.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from precprof import _compat
from precprof import stats as st
from precprof.capture.plan import CapturePlan
from precprof.capture.records import RowTable, _ParamSlot

_NONE: Any = object()  # no point taken


def raised() -> bool:
    """Whether an exception is being handled (a hook torch calls from its ``except``: the forward raised)."""
    return sys.exc_info()[1] is not None


def calls_running(model: torch.nn.Module, recorded: int) -> int:
    """How many of the ``recorded`` calls of ``model`` (its pre-hooks' count less its post-hooks') are still
    running, asked by the pre-hook of a call beginning now: the model's call of itself (a self-distillation target,
    a siamese or recurrent wrapper) runs inside them; a call ended by an exception that is not an ``Exception``
    (KeyboardInterrupt, SystemExit, or a subclass) does not, and no hook of torch's told its end, not even the
    always-called forward hook that tells one that raised. Told by the model's frames on the stack, the one
    beginning now left out; where the stack does not show it (a call torch made without that frame), every
    recorded call is taken to run, as the hooks count them."""
    found = _compat.calls_on_stack(model)
    return recorded if found == 0 else min(found - 1, recorded)


class AttemptOwner(Protocol):
    """What the owner of an ``AttemptWatch`` says: ``attempt_point()`` returns a point of its own,
    ``attempt_back_to(point)`` restores it (leaving the point as it is: a second failure goes back to it again);
    ``attempt_params()``: the parameters whose gradients tell whether the loop discarded the step's gradients."""

    def attempt_point(self) -> Any: ...

    def attempt_back_to(self, point: Any) -> None: ...

    def attempt_params(self) -> Sequence[torch.Tensor]: ...


class AttemptWatch:
    """When a sampled step's loop runs the model again after an attempt that raised, and which point of its
    ``owner``'s to go back to (see the module docstring). The owner is held weakly (it holds the watch: no cycle
    keeps a detached one alive).

    The owner calls ``begin_step`` when a sampled step begins, ``forward_begins`` when a forward of the model
    that the step reads begins (the outermost call, outside a backward pass), ``forward_ended`` from the model's
    always-called forward hook, ``backward_seen`` from a hook inside a backward pass while ``pass_due`` is False,
    and ``stepped`` after an optimizer step."""

    def __init__(self, owner: AttemptOwner) -> None:
        self._owner = weakref.ref(owner)
        self.pass_due = False  # a backward pass began, whose end (``_pass_ended``) has not run yet
        self.begin_step()

    def begin_step(self) -> None:
        self._step_point = self._point = _NONE
        self._open = self._failed = self.pass_due = False
        # a gradient as the forward running now found it: (its parameter, the gradient, its in-place version)
        self._mark: tuple[torch.Tensor, weakref.ref[torch.Tensor], int] | None = None
        self._param_at = 0  # where ``_gradient_mark`` found one last

    def forward_begins(self) -> None:
        """A forward of the model that the step reads begins: after an attempt that raised, what it read is
        forgotten first (the loop runs the model again); else this forward's point is taken."""
        self._open = True
        if self._failed or self.pass_due:
            self._go_back()
        elif self._step_point is _NONE:
            self._step_point = self._point = self._take()
            self._mark = None
        else:
            self._point = self._take()
            self._mark = self._gradient_mark()

    def _take(self) -> Any:
        owner = self._owner()
        return owner.attempt_point() if owner is not None else _NONE

    def forward_ended(self, output: Any) -> None:
        """The model's forward returned, or raised (its always-called forward hook, given no output)."""
        if self._open:
            self._open = False
            self._failed = output is None and raised()

    def forward_interrupted(self) -> None:
        """The model's forward was ended by an exception that is not an ``Exception`` (a KeyboardInterrupt the loop
        caught), which no forward hook sees: told at the model's next call (``calls_running``), and taken as a
        forward that raised, what it read forgotten once the loop runs the model again with grad."""
        if self._open:
            self._open = False
            self._failed = True

    def backward_seen(self) -> None:
        """A hook fired inside a backward pass: its end is watched (a callback autograd runs if it ends well)."""
        self.pass_due = _compat.queue_backward_callback(self._pass_ended)

    def _pass_ended(self) -> None:
        self.pass_due = False

    def stepped(self) -> None:
        """An optimizer stepped: what the step read so far trained, and is never gone back over."""
        self.begin_step()

    def forget_step(self) -> None:
        """What the step read so far is not the step's (an evaluation before its training forward,
        ``TrainingForward._evaluation_before_training``): back to the step's point, which stays the step's."""
        self._failed = self.pass_due = False
        owner = self._owner()
        if self._step_point is not _NONE and owner is not None:
            owner.attempt_back_to(self._step_point)
        self._point, self._mark = self._step_point, None

    def _go_back(self) -> None:
        """Back to the step's point after a backward that raised, or after a forward that raised when the loop
        discarded the gradients of the micro-batches before it; else to the failed forward's point."""
        whole = self.pass_due or self._discarded()
        point = self._step_point if whole else self._point
        self._failed = self.pass_due = False
        owner = self._owner()
        if point is _NONE or owner is None:
            return
        owner.attempt_back_to(point)
        if whole:
            self._point, self._mark = self._step_point, None

    def _gradient_mark(self) -> tuple[torch.Tensor, weakref.ref[torch.Tensor], int] | None:
        """A parameter's gradient as it is now (the micro-batches before this forward accumulated it), to tell
        at a retry whether the loop discarded it since (``zero_grad``: set to None, or zeroed in place)."""
        owner = self._owner()
        params = owner.attempt_params() if owner is not None else ()
        n = len(params)
        for k in range(n):
            at = (self._param_at + k) % n
            g = params[at].grad
            if g is not None:
                self._param_at = at
                return params[at], weakref.ref(g), _compat.tensor_version(g) or 0
        return None

    def _discarded(self) -> bool:
        mark = self._mark
        if mark is None:
            return False
        p, held, version = mark
        g = p.grad
        return g is None or held() is not g or (_compat.tensor_version(g) or 0) != version


class StepAttempts:
    """The ``AttemptWatch`` points of ``capture.hooks.StepHooks``, which this is a part of: the statistics rows
    (every device's, and the row table's calls, dtypes and call sizes), the modules' forward order, and what the
    step's hooks know of its forwards."""

    plan: CapturePlan
    rows: RowTable
    buffer: st.StatsBuffer
    order: int
    has_data: bool
    eval_forwards: int
    checkpointed_forwards: int
    self_call_forwards: int
    _weights_read: set[int] | None
    _step_mode: bool | None
    _first_in_eval: bool
    _grads_due: list[_ParamSlot]
    _outputs_made: list[Any]
    _outputs_by_data: dict[Any, Any]
    _indexed: int

    _attempt_params: list[torch.Tensor]
    _shape_slots: list[list[tuple[int, ...]]]

    def _watch(self) -> AttemptWatch:
        self._attempt_params = [ps.tensor for ps in self.plan.params if ps.grad_row >= 0]
        # the shapes of their calls the modules record (``_ModuleSlot.call_shapes``), listed once here rather
        # than found among every module at each training forward of a sampled step
        self._shape_slots = [s.call_shapes for s in self.plan.modules if s.call_shapes is not None]
        return AttemptWatch(self)

    def attempt_params(self) -> list[torch.Tensor]:
        return self._attempt_params

    def attempt_point(self) -> tuple[Any, ...]:
        """The step's reads as they are now. Before its first read (the usual first forward): nothing to copy."""
        rows = self.rows
        if self._weights_read is None and not any(rows.calls) and not self.buffer.skipped.any():
            held: tuple[Any, ...] | None = None
        else:
            slots = [(s.order, s.input_order, s.ran, s.first_from) for s in self.plan.modules]
            held = (self.buffer.snapshot(), rows.calls[:], rows.dtype_bits[:], rows.numel_gcd[:], slots)
        state = (self.order, self.has_data, self._weights_read, self._step_mode, self._first_in_eval)
        counts = (self.eval_forwards, self.checkpointed_forwards, self.self_call_forwards)
        shapes = [
            len(calls) for calls in self._shape_slots
        ]  # the calls each module has recorded the shapes of
        return held, state, len(self._outputs_made), counts, shapes

    def attempt_back_to(self, point: tuple[Any, ...]) -> None:
        """The step's reads as ``attempt_point`` found them (``point`` left as it is); the gradients a backward that
        raised announced are not read."""
        held, state, outputs, counts, shapes = point
        self.eval_forwards, self.checkpointed_forwards, self.self_call_forwards = counts
        rows, slots = self.rows, self.plan.modules
        for recorded, n_calls in zip(self._shape_slots, shapes, strict=True):
            del recorded[n_calls:]  # (the attempt's calls: not the step's)
        n = len(rows.calls)
        if held is None:
            self.buffer.restore(None)
            rows.calls[:], rows.dtype_bits[:], rows.numel_gcd[:] = [0] * n, [0] * n, [0] * n
            for s in slots:
                s.order = s.input_order = s.first_from = -1
                s.ran = False
        else:
            buffer, calls, bits, gcd, orders = held
            self.buffer.restore(buffer)
            rows.calls[:], rows.dtype_bits[:], rows.numel_gcd[:] = calls, bits, gcd
            for s, (order, input_order, ran, first_from) in zip(slots, orders, strict=True):
                s.order, s.input_order, s.ran, s.first_from = order, input_order, ran, first_from
        self.order, self.has_data, self._weights_read, self._step_mode, self._first_in_eval = state
        del self._outputs_made[outputs:]
        self._outputs_by_data.clear()  # made again from the outputs kept, at its next lookup
        self._indexed = 0
        self._grads_due.clear()
