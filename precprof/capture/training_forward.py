"""Which forwards of a sampled step are its training, for ``StepHooks`` (``capture/hooks.py``, which this is a
part of): the model's forward hooks tell the step's training forward from an evaluation (eval mode, ``no_grad``,
``Profiler.not_training``), an activation checkpoint's second run of a block, and a first forward that raised,
and forget what a forward read once it turns out not to be the step's.

The step's first forward of the model with grad on decides its mode: in train mode, a later forward in eval mode
is an evaluation, not read. In eval mode, it is either an evaluation before the step's training (a validation
with grad on at the start of a step) or a loop that trains in eval mode (BatchNorm and dropout frozen): told
apart by what follows. A forward in train mode before any backward of the step makes it the evaluation (its rows
are forgotten), a backward makes it the training (every later forward is read, in either mode).

A model that calls itself under ``no_grad`` inside its forward (a self-distillation target computed by the model
itself) is an evaluation of the same model on other data, like one between steps: that inner call is not read
(its values would be merged into the training forward's rows, calls 2). It is the step's computation all the
same, in the step's precision, so its module forwards are counted (``self_call_forwards``) and the summary and
the report say they were not read: an overflow in that call is in none of the rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from precprof import _compat
from precprof import stats as st
from precprof.capture.attempts import AttemptWatch, calls_running
from precprof.capture.loop_order import LoopOrder
from precprof.capture.plan import CapturePlan
from precprof.capture.records import RowTable, _iter_tensors, _ModuleSlot

recomputing = _compat.recomputing  # a checkpoint's forward run again in the backward pass: read once already
# why a forward is not read (``TrainingForward._not_read``; "" when it is)
_EVALUATION, _NO_GRAD, _RECOMPUTED, _FIRST_PASS = "evaluation", "no grad", "recomputed", "first pass"
# why a module's output was not read in a call torch ran fused (``TrainingForward._fused_call``)
FUSED = (
    "run by torch's fused path (an nn.TransformerEncoderLayer in eval mode, which torch takes only when none of "
    "its modules holds a forward hook): precprof's hooks stepped aside for the call, which ran as without precprof"
)


def runs_aside() -> bool:
    """Whether a call of the model beginning now, not inside another, runs with the modules' hooks aside (only
    the model's own stay, whose post-hook puts the others back): under ``no_grad`` or ``inference_mode``, outside
    a backward pass (where a reentrant checkpoint runs it again), it is an evaluation none of whose forwards is
    read, and run through hooks it would leave torch's fast paths (``nn.TransformerEncoderLayer`` refuses one to
    a module holding any hook) and give other values than without precprof. A dictionary entry per module."""
    return not torch.is_grad_enabled() and _compat.backward_pass_id() is None


def fused_inside(root: nn.Module, slots: list[_ModuleSlot]) -> dict[int, tuple[nn.Module, list[_ModuleSlot]]]:
    """Per module of ``root`` to which torch gives a fused path that forward hooks refuse
    (``_compat.has_fused_path``: captured or not, a container), by id: it and the captured modules of its
    subtree, itself included (``TrainingForward._fused_pre_hook``); those without any are left out."""
    by_id = {id(s.module): s for s in slots}
    out = {}
    for module in root.modules():
        inside = [by_id[id(m)] for m in module.modules() if id(m) in by_id]
        if inside and _compat.has_fused_path(module):
            out[id(module)] = (module, inside)
    return out


def is_evaluation(mode: bool | None, training: bool) -> bool:
    """Whether a forward of the model with grad on, in train mode or not (``training``), is an evaluation
    (``model.eval()`` without ``no_grad``): the step's first forward with grad ran in train mode (``mode``:
    its mode, None before it) and this one runs in eval mode. The one rule for every part of the capture
    that leaves an evaluation out: the statistics' hooks (``TrainingForward``, counted in
    ``eval_forwards``), the saved activations (``capture/memory_saved.py``) and the memory schedule's input
    watch (``capture/memory_schedule.py``)."""
    return bool(mode) and not training


def evaluated_before(mode: bool | None, training: bool, trained: Callable[[], bool]) -> bool:
    """Whether a forward with grad on beginning now shows the step's forwards so far to have been an
    evaluation before its training (a validation with grad on at the step's start): they ran in eval mode
    (``mode`` False), this one runs in train mode, and no backward read what they did (``trained()`` False,
    asked last). Else the step trains in eval mode (BatchNorm and dropout frozen), or in the mode its first
    forward had. (``is_evaluation``'s rule for the forwards before the training: the step's mode is train
    mode from here.)"""
    return mode is False and training and not trained()


class TrainingForward:
    """The part of ``capture.hooks.StepHooks`` that tells the step's training forward from the others."""

    plan: CapturePlan
    rows: RowTable
    buffer: st.StatsBuffer
    installed: bool
    order: int
    eval_forwards: int
    checkpointed_forwards: int
    self_call_forwards: int
    _root: nn.Module
    _root_trains: bool
    _root_grad: bool
    _root_calls: list[bool]
    _step_mode: bool | None
    _first_in_eval: bool
    _outside: int
    _hookset: _compat.HookSet  # the modules' and parameters' hooks (``StepHooks``)
    _grad_rows: list[int]
    _attempts: AttemptWatch
    loop: LoopOrder
    _model_inputs: set[int]
    _clear_outputs: Callable[[], None]  # ``StepHooks._clear_outputs``
    stepped_no_optimizer: Callable[[], bool]  # ``GradientReads.stepped_no_optimizer``
    optimizer_alone: Callable[[], bool]  # ``GradientReads.optimizer_alone``
    _walk_head: Callable[[Any], None]  # ``OutputHead._walk_head``
    _fused_inside: dict[int, tuple[nn.Module, list[_ModuleSlot]]]  # (``fused_inside``)

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Forwards inside are not the step's (``Profiler.not_training``: an evaluation with grad on between steps
        was read into the next step's rows). The modules' forward hooks step aside meanwhile, so that the model
        runs as without precprof: ``nn.TransformerEncoderLayer`` refuses its fast path to a module holding any,
        and a bf16 evaluation gave other losses (by 4e-4) on sampled steps."""
        self._outside += 1
        self._hookset.step_aside()
        try:
            yield
        finally:
            self._outside -= 1
            if not self._outside:
                self._hookset.step_back()

    def _fused_pre_hook(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        """A call of ``module`` that torch runs fused has its modules' hooks aside so that it runs as without
        precprof (``_compat.fused_path_aside``: an ``nn.TransformerEncoderLayer`` in eval mode, a frozen encoder
        inside the training forward): when it would have been read, each captured module of it counts an
        output not read, and why (``FUSED``). The modules' own pre-hooks, which torch calls all the same, see
        that it is aside and do nothing."""
        if _compat.fused_path_aside(module, args, kwargs) and self.installed and not self._not_read():
            for s in self._fused_inside[id(module)][1]:
                self.buffer.skip(s.activation, FUSED)

    def _not_read(self) -> str:
        """Why a module's forward running now is not read ("": it is the step's training forward, read): an
        evaluation (a model in eval mode after the step's forward in train mode, or inside ``not_training``), no
        grad outside the model's forward (an evaluation between steps), a checkpoint's recomputation of what its
        first pass read, a reentrant checkpoint's first pass (without grad: its recomputation is read). A part
        the model's forward runs without grad (a frozen VAE or text encoder, a frozen backbone, under ``no_grad``
        inside a forward with grad) is read: its activations are the step's, without gradients."""
        if is_evaluation(self._step_mode, self._root.training) or self._outside:
            return _EVALUATION
        if torch.is_grad_enabled():
            return _RECOMPUTED if recomputing() else ""
        if self._root_grad:
            return _FIRST_PASS if _compat.reentrant_first_pass() else ""
        # in a backward pass: a reentrant checkpoint's first pass inside a block an outer checkpoint runs again
        if _compat.backward_pass_id() is not None and _compat.reentrant_first_pass():
            return _FIRST_PASS
        return _NO_GRAD

    def _root_pre_hook(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        # (a model that calls itself, a self-distillation teacher under no_grad inside the forward: the innermost
        # call decides, and the enclosing one's state comes back when it returns)
        if self._root_calls:
            self._end_interrupted_calls(module)
        self._root_calls.append(self._root_grad)
        self._root_grad = torch.is_grad_enabled()
        if len(self._root_calls) == 1:
            self._hookset.step_back()  # (left aside by an evaluation a KeyboardInterrupt cut short)
            self._hookset.keep_last()  # (behind the hooks registered since: the user's, after attach)
            if runs_aside():
                self._hookset.step_aside(keep=module)
            self._model_inputs = {id(t) for t in _iter_tensors((args, kwargs or {}))}
            trains = self._root_grad and not self._outside
            if trains and evaluated_before(self._step_mode, module.training, self._trained):
                self._evaluation_before_training()
            evaluation = self._outside or is_evaluation(
                self._step_mode, module.training
            )  # (as ``_not_read``)
            if self.installed and self._root_grad and not evaluation and _compat.backward_pass_id() is None:
                self._attempts.forward_begins()  # (after an attempt that raised: what it read is forgotten)
                self.loop.model_forward()  # (the step's passes: ``capture.step_passes``)
        if not self._root_grad or self._outside:
            return
        if self._step_mode is None:
            self._step_mode = module.training
            self._first_in_eval = self._root_trains and not module.training

    def _trained(self) -> bool:
        """Whether a backward pass of this step reached a captured module (a gradient row was read). Host only."""
        calls = self.rows.calls
        return any(calls[r] for r in self._grad_rows)

    def _evaluation_before_training(self) -> None:
        """The step's forwards so far ran in eval mode with grad on and no backward followed, and now the model
        runs in train mode: they were an evaluation before the step's training (a validation at the start of a
        step, ``model.eval()`` without ``no_grad``), read as its training forward (every activation row the
        evaluation's batch and the training's, merged: calls 2). What they read is forgotten and counted as an
        evaluation's forwards; the step trains in train mode from here (an eval-mode forward after it is not
        read). A loop that trains in eval mode runs its backward before any forward in train mode: kept."""
        calls = self.rows.calls
        evaluated = sum(calls[s.activation] for s in self.plan.modules if s.activation >= 0)
        self._attempts.forget_step()  # (the step's reads as its first forward found them: none)
        self.eval_forwards += evaluated
        self._clear_outputs()
        self._step_mode = True

    @property
    def forward_ran(self) -> bool:
        """Whether the model's forward ran with grad in this sampled step (its rows hold the step's training)."""
        return self._step_mode is not None

    def evaluation_only(self) -> bool:
        """Whether the step in progress ran only an evaluation: its first forward in eval mode though the step
        began in train mode, and no backward since (a validation with grad on after the last ``prof.step()``:
        a step of its own, cut off, whose memory the report showed as the run's)."""
        return self._first_in_eval and not self._trained()

    def no_step(self) -> bool:
        """Whether the step in progress, at the end of a run that ended normally, is no step: an evaluation alone
        (``evaluation_only``), a forward and backward that none of the optimizers stepped on
        (``stepped_no_optimizer``), or an optimizer step alone (``optimizer_alone``)."""
        return self.evaluation_only() or self.stepped_no_optimizer() or self.optimizer_alone()

    def _root_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        grad = self._root_grad
        self._root_grad = self._root_calls.pop() if self._root_calls else False
        if not self._root_calls:
            if grad and not self._outside:  # (once over the run: the matmul that made the output)
                self._walk_head(output)
            self._model_inputs = set()
            self._hookset.step_back()
            # (called with no output from torch's ``except`` when the forward raised: ``always_call``); what it
            # read is forgotten once the loop runs the model again, kept when the exception ends the run
            self._attempts.forward_ended(output)

    def _end_interrupted_calls(self, module: nn.Module) -> None:
        """The recorded calls of the model that no longer run (``calls_running``) never reached their post-hook (a
        KeyboardInterrupt the loop caught: torch calls no forward hook for an exception that is not an
        ``Exception``): they end here as ones that raised do in it. Left recorded, the loop's next forward was
        read as a call inside them: an evaluation under no_grad counted as the model's call of itself, a forward
        that trained kept what the interrupted one read (calls 2)."""
        running = calls_running(module, len(self._root_calls))
        if running == len(self._root_calls):
            return
        self._root_grad = self._root_calls[running]
        del self._root_calls[running:]
        if not running:
            self._model_inputs = set()
            self._attempts.forward_interrupted()

    def _skipped_forward(self, slot: _ModuleSlot, why: str) -> None:
        """A forward that is not read (``why``: ``_not_read``'s). Not a recomputation, it still takes its place in
        the forward order (a reentrant checkpoint's blocks are recomputed last block first); an evaluation with
        grad on and a checkpointed forward are counted (the summary says the model checkpoints its activations)."""
        if why == _RECOMPUTED:
            self.checkpointed_forwards += 1
            return
        if why == _FIRST_PASS:
            self.checkpointed_forwards += 1
        elif why == _EVALUATION and torch.is_grad_enabled():
            self.eval_forwards += 1
        elif why == _NO_GRAD and True in self._root_calls:  # inside a call of the model with grad on
            self.self_call_forwards += 1
        if slot.order < 0:
            # its input row's place, before it: not where a reentrant first pass found the module that made its
            # input, whose row the recomputation reads (a place no row takes shifted every later module's order)
            if slot.input >= 0 and slot.input_order < 0 and (why != _FIRST_PASS or slot.first_from == -1):
                slot.input_order = self.order
                self.order += 1
            slot.order = self.order
            self.order += 1
