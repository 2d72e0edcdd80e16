"""The gradients of a sampled step, read for ``StepHooks`` (``capture/hooks.py``, which this is a part of): each
captured parameter's post-accumulate-grad hook announces its gradient, read with the others when the backward
pass ends (under torch.distributed, each in its own hook); the optimizers' step hooks read what no hook saw (a
gradient assigned outside autograd), begin and end the weight-update sample, and keep each gradient row from
its optimizer's step on.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch

from precprof import _compat
from precprof import stats as st
from precprof.capture.loop_order import LoopOrder
from precprof.capture.records import RowTable, _local, _ModuleSlot, _ParamSlot, after_closure, dtype_bit
from precprof.capture.updates import UpdateSampler

_Tensor = torch.Tensor
_STRIDED = torch.strided  # the layout the engines read (a sparse tensor is skipped and counted)
_functorch_wrapped = _compat.is_functorch_wrapped
# why a gradient assigned outside autograd is not read when the run scales its loss (``_unread_grads``)
UNSCALED_UNREAD = (
    "assigned outside autograd (FSDP1 use_orig_params, or by hand): the loss scaler had unscaled it in place "
    "before the optimizer's hook could read it"
)


def _plain(x: torch.Tensor) -> bool:
    """Whether the engines read ``x`` in place: strided, and a tensor with a storage of its own (a wrapper
    subclass's ``data_ptr()`` is 0, a torch.func transform's wrapper has none: ``StatsBuffer.accumulate`` skips
    and counts them)."""
    return (
        x.layout is _STRIDED
        and (type(x) is _Tensor or not hasattr(x, "__tensor_flatten__"))
        and not _functorch_wrapped(x)
    )


_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")
_layout_of = operator.attrgetter("layout")
_TENSOR_ONLY = {_Tensor}
_STRIDED_ONLY = {_STRIDED}
_COMPLEX = {torch.complex32, torch.complex64, torch.complex128}


class GradientReads:
    """The gradient half of ``StepHooks``: its state is ``StepHooks``'s (declared here, set there)."""

    rows: RowTable
    buffer: st.StatsBuffer
    updates: UpdateSampler | None
    installed: bool
    has_data: bool
    grads_at_end: bool
    _device: torch.device
    _primary: Any
    _grads_due: list[_ParamSlot]
    _stepped: set[int]
    _optimizer_stepped: bool
    _scaler_unscaled: bool
    _step_mode: bool | None  # (``TrainingForward``'s: the step's forward with grad ran)
    _grad_rows: list[int]
    _weight_grad_rows: list[int]
    order: int
    loop: LoopOrder
    optimizers: list[Any]
    _grad_row_of: dict[int, int]
    _grad_slot: dict[int, _ParamSlot]
    _grad_owner: dict[int, _ModuleSlot]
    _weights_read: set[int] | None
    _scaled: Any
    _attempts: Any  # ``capture.attempts.AttemptWatch``

    def _add(self, x: torch.Tensor, row: int, assign: bool = False) -> bool:
        """Read ``x`` into ``row``: the model device's rows directly, any other device (or a tensor the engines
        cannot read in place: sparse, a wrapper subclass, a torch.func transform's wrapper) through the buffer (which skips and counts a tensor
        it cannot read: then False)."""
        primary = self._primary
        if (
            primary is not None
            and x.device == self._device
            and x.layout is _STRIDED
            and (type(x) is _Tensor or not hasattr(x, "__tensor_flatten__"))  # ``_plain``, inline: per tensor
            and not _functorch_wrapped(x)  # (the model under torch.func's grad or vmap)
            and not x.is_nested  # (a nested tensor's layout is strided too: the buffer skips one)
        ):
            primary.add(x, row, assign)
            return True
        return self.buffer.accumulate(x, row, assign=assign)

    def _make_param_hook(self, ps: _ParamSlot) -> Callable[[torch.Tensor], None]:
        attempts = self._attempts

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None or not self.installed or ps.grad_row in self._stepped:
                return None
            if (
                not attempts.pass_due
            ):  # the pass's first: its end is watched (a pass that raised is forgotten)
                attempts.backward_seen()
            if self.grads_at_end:
                due = self._grads_due
                if due or _compat.queue_backward_callback(self._read_grads):
                    due.append(ps)
                    return None
            self._read_grad(ps, g)
            return None

        return hook

    def _read_grad(self, ps: _ParamSlot, g: torch.Tensor) -> None:
        """One parameter's accumulated gradient into its row (the last accumulation of the step wins); a
        complex one is skipped and counted."""
        x = g if type(g) is _Tensor else _local(g)
        row = ps.grad_row
        if self.buffer.accumulate(x, row, assign=True) if x.is_complex() else self._add(x, row, assign=True):
            self._grad_seen(row, g.dtype)

    def _grad_seen(self, row: int, dtype: torch.dtype) -> None:
        rows = self.rows
        # backward passes that accumulated into it (gradient accumulation's micro-batches)
        rows.calls[row] += 1
        rows.dtype_bits[row] |= dtype_bit(dtype)
        self.has_data = True

    def _read_grads(self) -> None:
        """The backward pass ended: the gradients its post-accumulate-grad hooks announced, those on the model's
        device in one call of its engine (``Rows.add_many``), each as it is now (the last accumulation wins;
        GradScaler has not unscaled it yet, nor has any clipping run: the same values the hooks saw, one
        read instead of one per parameter). Not under torch.distributed, where a gradient may be a view of a
        bucket whose all-reduce is in flight by then: each is read in its own hook there."""
        due, self._grads_due = self._grads_due, []
        if not self.installed:
            return
        primary = self._primary
        # a gradient accumulated twice: read once; none whose optimizer stepped since it was announced
        slots = [ps for ps in {ps.grad_row: ps for ps in due}.values() if ps.grad_row not in self._stepped]
        grads = [ps.tensor.grad for ps in slots]
        if (
            primary is not None
            and set(map(type, grads)) == _TENSOR_ONLY  # (no None, no wrapper subclass)
            and set(map(_device_of, grads)) == {self._device}
            and set(map(_layout_of, grads)) == _STRIDED_ONLY
            and not _COMPLEX & (dtypes := set(map(_dtype_of, grads)))
        ):  # the usual case, decided by C-level maps over the step's hundreds of gradients
            present = cast(list[torch.Tensor], grads)
            rows = [ps.grad_row for ps in slots]
            primary.add_many(present, rows, assign=True)
            calls, dtype_bits = self.rows.calls, self.rows.dtype_bits
            bits = {dt: dtype_bit(dt) for dt in dtypes}
            for row, t in zip(rows, present, strict=True):
                calls[row] += 1  # one more backward pass accumulated into it (read once a pass)
                dtype_bits[row] |= bits[t.dtype]
            self.has_data = True
            return
        tensors: list[torch.Tensor] = []
        at: list[int] = []
        kinds: list[torch.dtype] = []
        for ps, g in zip(slots, grads, strict=True):
            if g is None:
                continue
            x = g if type(g) is _Tensor else _local(g)
            if primary is not None and x.device == self._device and _plain(x) and not x.is_complex():
                tensors.append(x)
                at.append(ps.grad_row)
                kinds.append(g.dtype)
            else:
                self._read_grad(ps, g)
        if primary is not None and tensors:
            primary.add_many(tensors, at, assign=True)
            for row, dtype in zip(at, kinds, strict=True):
                self._grad_seen(row, dtype)

    def _opt_pre_hook(self, k: int, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if not self.installed:
            return None
        self.loop.followed_begins()

        def grads() -> None:
            if self._grads_due:  # a backward whose end has not been read (it raised)
                self._read_grads()
            self._unread_grads(optimizer)

        def after_closure_ran() -> None:
            grads()
            if self.updates is not None:  # the intended updates: this step's gradients, made by the closure
                self.updates.intent_after_closure(k, optimizer)

        # the weights as they are before anything in the step moves them (SAM perturbs them, then calls the
        # closure); with a closure, the intent is read again once it ran
        wrapped = after_closure(args, kwargs, after_closure_ran, self.loop.closure_counter(optimizer))
        if wrapped is None:
            grads()
        if self.updates is not None:
            self.updates.before_step(k, optimizer)
            self.updates.carry.before(optimizer)
        return wrapped

    def _unread_grads(self, optimizer: Any) -> None:
        """The gradients this optimizer is about to apply (with a closure, once it has run its backward: read by
        ``after_closure``) that no hook read in this step: a wrapper assigned them outside autograd (FSDP1 with
        ``use_orig_params=True`` sets each parameter's ``.grad`` to its reduce-scattered shard; a loop that sets
        ``p.grad`` itself). Read as the optimizer gets them. Only after this step's forward ran (before it, the
        gradients are an earlier step's: ``prof.step()`` called before ``optimizer.step()``); when the run scales
        its loss they are unscaled by now, unlike every other gradient row: skipped and counted, with why."""
        if self._weights_read is None:
            return
        rows, calls, stepped, tried = self._grad_row_of, self.rows.calls, self._stepped, self.buffer.skipped
        owner = self._grad_owner
        unread = [
            (p, r)
            for g in optimizer.param_groups
            for p in g["params"]
            if (r := rows.get(id(p), -1)) >= 0
            and not calls[r]
            and not tried[r]  # (a hook found it unreadable: counted once)
            and r not in stepped
            and p.grad is not None
            and (slot := owner.get(r)) is not None
            and slot.ran  # (a layer this step did not run keeps a stale gradient: zero_grad(set_to_none=False))
        ]
        if not unread:
            return
        if self._scaled():  # (counted once a step: a second step of the optimizer finds them stepped)
            for _, r in unread:
                self.buffer.skip(r, UNSCALED_UNREAD)
            stepped.update(r for _, r in unread)
            return
        for p, r in unread:
            self._read_grad(self._grad_slot[r], p.grad)

    def _opt_post_hook(self, k: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.installed:
            return None
        if self._grads_due:  # a backward whose end has not been read (the step ran inside it, or it raised)
            self._read_grads()
        # the gradients this optimizer applied were read in this step: a later backward (a GAN's generator loss
        # through the discriminator) adds to them what no optimizer applies. After the step, not before: a
        # closure (Lightning's automatic optimization, LBFGS) runs the backward inside the step. Only rows
        # already read: a loop that steps its optimizer before this step's backward (prof.step() before
        # optimizer.step()) reads the gradients of the backward that follows
        self._optimizer_stepped = True
        # before the step's forward: a loop that calls prof.step() before optimizer.step() (with a closure, the
        # forward ran inside the step, before this hook); on no gradient at all, a skipped batch (host only)
        applied = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        self.loop.followed_stepped(optimizer, self._trained_by_now(), applied)
        self._attempts.stepped()  # (what the step read so far trained: never forgotten)
        self._keep_given(optimizer)
        if self.updates is not None and self.updates.after_step(k, optimizer):
            self.has_data = True
        if self.updates is not None:
            self.updates.carry.after(optimizer)
        return None

    def modules_of(self, optimizer: Any) -> list[str]:
        """The captured modules whose parameters ``optimizer`` updates, in the capture's order (a critic's
        optimizer named by what it trains, ``capture/loop_order.py``)."""
        rows, owner = self._grad_row_of, self._grad_owner
        slots = {
            id(slot): slot
            for g in getattr(optimizer, "param_groups", ())
            for p in g["params"]
            if (slot := owner.get(rows.get(id(p), -1))) is not None
        }
        return [s.name for s in sorted(slots.values(), key=lambda s: s.activation)]

    def _keep_given(self, optimizer: Any) -> None:
        """The rows read of ``optimizer``'s gradients kept as they are from now on in this step: what it was given."""
        rows, calls = self._grad_row_of, self.rows.calls
        self._stepped.update(
            r
            for g in optimizer.param_groups
            for p in g["params"]
            if (r := rows.get(id(p), -1)) >= 0 and calls[r] > 0
        )

    def scaler_unscaling(self, optimizer: Any) -> None:
        """``GradScaler.unscale_(optimizer)`` is about to divide its gradients in place (its ``step`` calls it
        first): what was read of them is what that optimizer is given, kept from here on as after its step,
        also when the scaler then skips the step on an inf/nan (running neither of the optimizer's step hooks:
        a GAN's generator backward would otherwise be read into the discriminator's unscaled gradients)."""
        if not self.installed or not any(o is optimizer for o in self.optimizers):
            return
        self._scaler_unscaled = True  # (its step is meant: one the scaler skips runs no optimizer hook)
        if self._grads_due:  # a backward whose end has not been read (it raised)
            self._read_grads()
        self._keep_given(optimizer)

    def stepped_no_optimizer(self) -> bool:
        """Whether the step in progress ran no step of the optimizers given (None given: unknown, False): once
        the run ended normally, what it read is no step of its own, only gradients no optimizer of this
        Profiler applies (one Profiler per GAN model: the generator's last update runs the discriminator's
        forward and backward after the discriminator's last ``prof.step()``, read as a step "cut off")."""
        return bool(self.optimizers) and not self._optimizer_stepped

    def gradients_without_step(self) -> bool:
        """Whether the step in progress read weight gradients and no optimizer given stepped, nor did a loss
        scaler unscale one (a step it skips on an inf runs no optimizer hook; None given: False): a micro-batch's
        step, where ``prof.step()`` is called once per micro-batch (``capture.loop_order``'s
        ``LOOP_NOT_STEPPED``). Host only."""
        return (
            bool(self.optimizers)
            and not self._optimizer_stepped
            and not self._scaler_unscaled
            and (
                bool(self._grads_due)
                or any(self.rows.calls[r] or self.buffer.skipped[r] for r in self._weight_grad_rows)
            )
        )

    def _trained_by_now(self) -> bool:
        """Whether the step's forward ran by now: read (its training forward), or unread but followed by a backward
        (a compiled model run compiled under a stance the loop set: no module hook fires in its graph)."""
        return self._step_mode is not None or self._weights_read is not None or self._gradient_seen()

    def _gradient_seen(self) -> bool:
        """Whether a backward of the step left a gradient in a row (read, or skipped and counted). Host only."""
        calls, skipped = self.rows.calls, self.buffer.skipped
        return bool(self._grads_due) or any(calls[r] or skipped[r] for r in self._grad_rows)

    def optimizer_alone(self) -> bool:
        """Whether the step in progress ran an optimizer step and nothing else: no forward read, no gradient (a
        loop that calls prof.step() before optimizer.step(): the run's last optimizer step, after its last
        ``prof.step()``, made a step of that update alone at detach)."""
        return self._optimizer_stepped and not self._trained_by_now()

    def ran_nothing(self) -> bool:
        """Whether the step in progress ran no module forward (read or not) and read no gradient (with no
        optimizer step: ``prof.step()`` called twice)."""
        return not self.order and not self._trained_by_now()
