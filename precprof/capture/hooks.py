"""The hooks of a sampled step: installed when the step begins, removed when it ends (kept, paused, for a next
step that is sampled too).

On a step that is not sampled precprof has no hook anywhere: the model runs exactly as without it, eager or
compiled (a compiled model runs the very graph it runs without precprof: nothing is traced, nothing guards on
precprof's state). A sampled step installs, for its duration (``StepHooks.install`` / ``remove``; a sampled
step followed by another keeps them in place between the two, doing nothing, ``pause``):

- a forward pre-hook and a forward hook on every captured module, made at attach for its slot
  (``capture/plan.py``). The first captured module's pre-hook reads every captured parameter, per device in
  one call of the engine (``Rows.add_many``: one C call on the CPU, up to 16 tensors a launch on CUDA; the
  block what-if of the step's group's weights in one more, ``Rows.accumulate_blocks_many``); a module's
  output is read in its forward hook and, when it requires grad, gets a tensor hook for its gradient
  (``register_full_backward_hook`` breaks on in-place ops such as ``ReLU(inplace=True)``). Per-module hooks,
  not global ones: ``torch.compile(module)`` warns when global module hooks exist, and they would fire for
  every module of the process;
- a post-accumulate-grad hook on every captured parameter (the last accumulation of the step wins): the
  gradients its hooks announce are read together when the backward pass ends, those on the model's device in
  one call of its engine (``Rows.add_many``; autograd's own end-of-backward callback, before GradScaler
  unscales them or anything clips them); under torch.distributed, where a gradient may be a view of a DDP
  bucket whose all-reduce is in flight by then, each is read in its own hook (``capture/grad_reads.py``);
- the optimizers' step pre- and post-hooks: a gradient no hook read (assigned outside autograd: FSDP1's
  ``use_orig_params``), the weight-update sample (``capture/updates.py``), each gradient row kept from its
  optimizer's step on; a step given a closure runs them once the closure has run its backward. With them,
  torch's global optimizer step hooks, which see an optimizer the Profiler was not given step the model's
  parameters, and the followed ones step before the forward or more than once (``capture/loop_order.py``).

A hook is a lookup and one call into the engine of the tensor's device (``stats.rows``): everything else was
decided at attach. Hooks never synchronise with the device and return None (a returned value would replace the
module's output). ``torch.no_grad()`` forwards (evaluation between training steps) are ignored: the model's call
under ``no_grad`` runs with the modules' hooks aside, as does everything inside ``Profiler.not_training``, so that
torch's fast paths (``nn.TransformerEncoderLayer``'s, refused to a module holding any hook) run as without
precprof (``_compat.HookSet.step_aside``, ``training_forward.runs_aside``); inside the training forward, such a
layer's call torch runs fused (a frozen encoder in eval mode) has its modules' hooks aside for the call, its
outputs counted not read (``_compat.fused_path_aside``, ``TrainingForward._fused_pre_hook``). Also ignored are forwards
of a model in eval mode after the step's first forward of it ran in train mode (an evaluation with grad on), or
before a forward in train mode that no backward came between (``capture/training_forward.py``), and the
forward an activation checkpoint runs again inside the backward pass when it read the block's outputs in the
step's forward already (non-reentrant, ``_compat.recomputing``, a checkpoint nested in the block included); a
reentrant checkpoint's forward runs under ``no_grad`` (it takes its place in the forward order then), and its
recomputation is the run read.

On sampled steps, the operands a block-scaled GEMM would quantise also get the block-format what-if
(``precprof.stats.blocks``), unless the Profiler was made with ``block_formats=False``: the weight and the output
gradient of every linear layer of this step's group (``taxonomy.is_linear_type``; an embedding's weight too,
for tied heads), and the output of any captured module that a linear layer then reads as its input (matched by
tensor identity in the linear layer's pre-hook, so each such tensor is read once however many layers read it;
it is recorded under the producing module's ``activation`` row). Nothing else: an activation no linear layer
reads, a weight gradient, a norm's weight, are never quantised by such a GEMM."""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from precprof import _compat
from precprof import stats as st
from precprof import tables as T
from precprof.capture.attempts import StepAttempts
from precprof.capture.gemm_inputs import GemmInputs, Made, made_entry
from precprof.capture.grad_reads import _COMPLEX, GradientReads, _plain
from precprof.capture.loop_order import LoopOrder
from precprof.capture.output_head import _NOT_WALKED, OutputHead
from precprof.capture.plan import CapturePlan, reads_block_operands
from precprof.capture.records import (
    _iter_tensors,
    _local,
    _ModuleSlot,
    _ParamSlot,
    _readable,
    _weights_key,
    autocast_state,
    call_shape,
    dtype_bit,
    input_keyword,
)
from precprof.capture.scaled_passes import ScaledPasses
from precprof.capture.training_forward import _FIRST_PASS, TrainingForward, fused_inside
from precprof.capture.updates import UpdateSampler

_Tensor = torch.Tensor
# what a released gradient hook refers to in place of its ``StepHooks`` (``_make_grad_hook``): never installed
_RELEASED = types.SimpleNamespace(installed=False)


class StepHooks(TrainingForward, GradientReads, GemmInputs, StepAttempts, OutputHead):
    """The hooks of the sampled steps of one attachment (see the module docstring).

    ``device``: the model's device, whose rows the hooks add into directly (a tensor elsewhere goes through
    ``StatsBuffer.accumulate``); ``updates``: the weight-update sampler, whose optimizer hooks are installed
    with the others (needs ``optimizer``); ``autocast_seen``: filled with autocast's state at the first recorded
    forward (``precision_seen``)."""

    def __init__(
        self,
        plan: CapturePlan,
        buffer: st.StatsBuffer,
        device: torch.device,
        *,
        optimizers: Sequence[Any] = (),
        updates: UpdateSampler | None = None,
        autocast_seen: dict[str, Any] | None = None,
        scaled: Callable[[], bool] = lambda: False,
        root: nn.Module | None = None,
        loop: LoopOrder | None = None,
    ) -> None:
        self.plan = plan
        self.rows = plan.rows
        self.buffer = buffer
        self.block_formats = plan.block_formats
        # module outputs are kept by object for the lookups of the matmuls that read them (``_gemm_input``)
        self._track_outputs = any(s.input >= 0 for s in plan.modules)  # (a matmul's input, a norm's)
        self.optimizers = list(optimizers)
        self.updates = updates
        # the Profiler's: what its sampled steps saw of the loop's order (``capture/loop_order.py``)
        self.loop = loop if loop is not None else LoopOrder()
        self._device = device
        self._primary = buffer.rows_of(device) if device.type != "meta" else None
        self._root = root if root is not None else nn.Module()  # (a stand-in that trains)
        self._root_trains = False
        self._root_grad = False  # inside the model's forward, begun with grad on (``_not_read``)
        # whether the step's first forward of the model with grad ran in train mode (None: none yet): a later one
        # in eval mode is an evaluation; and whether that first one was in eval mode though the step began in
        # train mode (a validation after the last prof.step(), or a loop that trains in eval mode: told apart by
        # whether a backward follows, ``evaluation_only``)
        self._step_mode: bool | None = None
        self._first_in_eval = False
        self._outside = 0  # inside ``Profiler.not_training`` (nested: a depth)
        self._grad_rows = [r.index for r in plan.rows.info if r.tensor in (T.ACTIVATION_GRAD, T.WEIGHT_GRAD)]
        self._weight_grad_rows = [r.index for r in plan.rows.info if r.tensor == T.WEIGHT_GRAD]
        self._root_calls: list[bool] = []  # the enclosing calls' ``_root_grad`` (a model that calls itself)
        # an attempt of the step that raised and was run again (an out-of-memory-and-retry loop): forgotten
        self._attempts = self._watch()
        # the tensors the model's outermost forward was called with, by id, while it runs (``_gemm_input``)
        self._model_inputs: set[int] = set()
        # the matmul that makes the model's output (``OutputHead``), once walked
        self.output_head = _NOT_WALKED
        self._head_nodes: dict[Any, str] = {}  # until then: each linear layer's output node -> its name
        self._releases: list[Callable[[], None]] = []  # each gradient hook's (``_make_grad_hook``)
        self._fused_inside = fused_inside(self._root, plan.modules)
        roots = [(root, self._root_pre_hook, self._root_post_hook, True)] if root is not None else []
        entries: list[tuple[Any, Any, Any, bool]] = [
            *roots,
            *((s.module, self._make_pre_hook(s), self._make_fwd_hook(s), False) for s in plan.modules),
        ]
        # the root's pre-hook takes the forward's keyword arguments too: model(x=features), model(**batch); so
        # do those of the modules whose input is read, called with it by keyword (self.fc(input=h)), and those
        # that tell a call torch runs fused (``_fused_pre_hook``)
        kwargs_entries = [
            len(roots) + k for k, s in enumerate(plan.modules) if s.reads_input or s.call_shapes is not None
        ]
        for module, _ in self._fused_inside.values():
            kwargs_entries.append(len(entries))
            entries.append((module, self._fused_pre_hook, None, False))
        self._hookset = _compat.HookSet(
            entries,
            [(ps.tensor, self._make_param_hook(ps)) for ps in plan.params if ps.grad_row >= 0],
            kwargs_pre=root,
            kwargs_entries=kwargs_entries,
        )
        # the parameters read at the step's first captured forward, and each one's row
        self._weights = [(p, row) for s in plan.modules for _, p, row in s.weights]
        # per module with parameters, each parameter's row and gradient row (-1: none)
        grad_rows = {id(ps.tensor): ps.grad_row for ps in plan.params}
        self._weight_grads = [
            (s, [(p, row, grad_rows.get(id(p), -1)) for _, p, row in s.weights])
            for s in plan.modules
            if s.weights
        ]
        self._weight_tensors = [p for p, _ in self._weights]
        # each gradient row's module: a gradient no hook read counts only if that module ran (``_unread_grads``)
        self._grad_owner = {grad: s for s, params in self._weight_grads for _, _, grad in params if grad >= 0}
        # ``_sort_weights``'s answer, and the ``_weights_key`` it holds for
        self._weights_held: tuple[Any, ...] | None = None
        # the rows whose parameter is read in another dtype than its own (FSDP1's FlatParameter under
        # MixedPrecision: its fp32 shard, while the parameter is the gathered bf16 copy), and that dtype
        self._read_dtypes: dict[int, torch.dtype] = {}
        # the matrix weights of the block group whose turn it is, read with the others: (turn, deal) -> them
        self._turn_weights: tuple[tuple[int, int], list[tuple[nn.Parameter, int]]] = ((-1, -1), [])
        self._handles: list[Any] = []
        self.installed = False
        # this sampled step's state
        self.turn = 0  # the block group (_ModuleSlot.block_group) whose operands this step evaluates
        self.order = 0  # forward order counter
        self.has_data = False
        self.stance_at_forward: Any = None  # Dynamo's stance when the step's first hooked forward began
        self._weights_read: set[int] | None = None  # rows of the parameters read this step
        # gradient rows of the parameters whose optimizer has stepped in this step: what a later backward adds
        # to them (a GAN's generator loss flowing back through the discriminator) is no gradient that optimizer
        # applied, so their rows keep the one it did
        self._stepped: set[int] = set()
        self._optimizer_stepped = (
            False  # whether one of the optimizers stepped in this step (``_opt_post_hook``)
        )
        self._scaler_unscaled = (
            False  # a loss scaler unscaled one of them in this step (``scaler_unscaling``)
        )
        self._grad_row_of = {id(ps.tensor): ps.grad_row for ps in plan.params if ps.grad_row >= 0}
        self._grad_slot = {ps.grad_row: ps for ps in plan.params if ps.grad_row >= 0}
        # parameters whose gradient was accumulated in the backward pass now running, read together when it
        # ends (``_read_grads``); per parameter at once under torch.distributed (``grads_at_end``). Left over
        # only by a pass that raised (its read never ran): the next forward's first pre-hook reads them
        self._grads_due: list[_ParamSlot] = []
        self.grads_at_end = True
        # this step's module outputs a linear layer may read, each (the tensor, its activation row): by object
        # (``id``), and in order, for the index by memory (``_same_data``) that a lookup by object that misses
        # builds (a wrapper's new tensor object over the same memory); most steps never need it
        self._block_outputs: dict[int, Made] = {}
        self._outputs_made: list[Made] = []
        self._outputs_by_data: dict[tuple[Any, ...], Made] = {}
        self._indexed = 0  # how many of ``_outputs_made`` the index by memory covers
        self._read_from = {}  # the makers each linear layer read this step (``GemmInputs._note_makers_again``)
        # autocast as the first recorded forward saw it (the Profiler's dict, kept over the run)
        self.autocast_seen: dict[str, Any] = autocast_seen if autocast_seen is not None else {}
        # whether forwards still look at autocast's state: until the end of the first sampled step that recorded
        # one (``_see_autocast``)
        self._autocast_open = not self.autocast_seen
        # whether the run scales its loss (a GradScaler, a manual ``loss_scale``): a gradient no hook read is then
        # unscaled by the time the optimizer's hooks see it (``_unread_grads``)
        self._scaled = scaled
        self.passes: ScaledPasses | None = None  # under a GradScaler, its scaled backward passes (assembly)
        self.eval_forwards = 0  # module forwards in eval mode with grad on, not read (over the run)
        self.checkpointed_forwards = 0  # module forwards an activation checkpoint ran twice (over the run)
        self.self_call_forwards = (
            0  # module forwards of the model's own call under no_grad in its forward (run)
        )
        self.weight_grads_unread = 0  # sampled steps whose backward left no gradient in .grad (over the run)
        # modules whose weight gradients a sampled step left unread while others were read, and on how many steps
        self.weight_grads_unread_in: dict[str, int] = {}

    # ------------------------------------------------------------------------------------ install/remove
    def install(self, turn: int) -> None:
        """Begin a sampled step: its state reset, every hook registered. Idempotent."""
        self.turn = turn
        self.order = 0
        self.has_data = False
        self.stance_at_forward = None
        self._weights_read = None
        self._stepped, self._optimizer_stepped, self._scaler_unscaled = set(), False, False
        self._clear_outputs()
        self.grads_at_end = not _distributed()
        for slot in self.plan.modules:
            slot.order = slot.input_order = slot.first_from = -1
            slot.ran = False
            slot.call_shapes_done = bool(slot.call_shapes)
        self._root_trains = self._root.training
        self._root_grad, self._root_calls = False, []
        self._step_mode, self._first_in_eval = None, False
        self._attempts.begin_step()
        self.loop.begin()
        if self.passes is not None:
            self.passes.begin_step()
        self.installed = True
        if self._hookset.installed:  # kept from the sampled step before (``pause``)
            if not self._outside:
                self._hookset.step_back()  # (left aside by an evaluation a KeyboardInterrupt cut short)
            return
        self._hook_optimizers()  # (first: the modules' hooks then know nothing was registered after them)
        self._hookset.install()
        if self._outside:  # (a step begun inside ``not_training``: its hooks wait for its end)
            self._hookset.step_aside()

    def _hook_optimizers(self) -> None:
        for k, opt in enumerate(self.optimizers):
            self._handles.append(opt.register_step_pre_hook(functools.partial(self._opt_pre_hook, k)))
            self._handles.append(opt.register_step_post_hook(functools.partial(self._opt_post_hook, k)))
        self._handles += self.loop.watch(self.optimizers, self._grad_row_of)  # (any optimizer's step)

    def use_optimizers(self, optimizers: Sequence[Any]) -> None:
        """Read the gradients and updates around the steps of ``optimizers`` from now on (a new optimizer made
        mid-run): the old ones' hooks come off, and the new ones' go on at once when the hooks are in place."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.optimizers = list(optimizers)
        if self._hookset.installed:
            self._hook_optimizers()

    def pause(self) -> None:
        """End the sampled step, its hooks left in place but doing nothing (a gradient hook that has not fired
        yet included) until the next ``install`` (the next step is sampled too: removing and installing them
        again would cost a millisecond per thousand hooks) or ``remove`` (it is not). Idempotent."""
        self._unrun_weights()
        self._count_unread_weight_grads()
        self._note_makers_again()
        self.installed = self.loop.active = False
        self._clear_outputs()
        self._autocast_open = self._autocast_open and not self.autocast_seen

    def remove(self, finished: bool = True) -> None:
        """End the sampled step: every hook removed (a module output's gradient hook that has not fired yet
        does nothing from now on). Idempotent. ``finished`` False: the step in progress was cut off (a crash or
        Ctrl-C before its end), so its backward never left gradients to read, and that is not the loop's doing;
        the hooks come off for good then (detach, a failed attach, a re-plan: the next attach makes new ones), and
        the gradient hooks left on the graphs of sampled steps are released (``_make_grad_hook``)."""
        self._unrun_weights()
        if finished:
            self._count_unread_weight_grads()
            self._note_makers_again()
        self._hookset.remove()
        self._autocast_open = self._autocast_open and not self.autocast_seen
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.installed = self.loop.active = False
        self._clear_outputs()
        if not finished:
            for release in self._releases:
                release()

    def _unrun_weights(self) -> None:
        """The weights of modules whose forward never ran this step, used by a parent (``nn.MultiheadAttention``
        reads ``out_proj.weight`` without calling ``out_proj``) or by nothing (an expert no token reached): read
        with the others at the step's first forward, they are kept as a module's that ran, as their updates are."""
        read = self._weights_read
        if not self.installed or not read:
            return
        rows = self.rows
        calls = rows.calls
        for slot, params in self._weight_grads:
            if slot.ran:
                continue
            for p, row, _ in params:
                if row in read and not calls[row]:
                    rows.seen(row, self._read_dtypes.get(row, p.dtype))

    def _count_unread_weight_grads(self) -> None:
        """A sampled step whose backward reached the modules' outputs but left no parameter a gradient in
        ``.grad`` while some train (a loop taking its gradients with ``torch.autograd.grad``, which accumulates
        none): its weight gradients are not read, and the summary says so (``weight_grads_unread``). A gradient
        that reached ``.grad`` but was skipped (a sparse embedding's, counted in ``skipped_tensors``) is no
        unread one."""
        calls, skipped = self.rows.calls, self.buffer.skipped
        if not self.installed or not any(ps.tensor.requires_grad for ps in self.plan.params):
            return
        # (the rows' calls as they are where no tensor was skipped, as a sampled step's usually is: one numpy
        # call, not an element of it read per row)
        reached = (
            calls if not skipped.any() else [c or k for c, k in zip(calls, skipped.tolist(), strict=False)]
        )
        if not any(map(reached.__getitem__, self._weight_grad_rows)):
            if any(map(calls.__getitem__, self._grad_rows)):  # (an output's gradient, then)
                self.weight_grads_unread += 1
            return
        # some were read: a module whose output's gradient was read while none of its trained parameters' was
        # (a sub-model trained with torch.autograd.grad beside the rest's backward) is named
        for slot, params in self._weight_grads:
            trained = [g for p, _, g in params if g >= 0 and p.requires_grad]
            out = slot.activation_grad
            if trained and out >= 0 and calls[out] and not any(map(reached.__getitem__, trained)):
                self.weight_grads_unread_in[slot.name] = self.weight_grads_unread_in.get(slot.name, 0) + 1

    def _clear_outputs(self) -> None:
        self._grads_due.clear()
        self._block_outputs.clear()
        self._outputs_made.clear()
        self._head_nodes.clear()
        self._outputs_by_data.clear()
        self._indexed = 0
        self._read_from.clear()

    # ------------------------------------------------------------------------------------------ reading
    def _read_weights(self) -> set[int]:
        """Every captured parameter, per device in one call of its engine, and the block what-if of this step's
        group's matrix weights; returns the rows read. Which parameter goes where is decided once and kept while
        the parameters' types, dtypes, devices and sizes stay as they were (``_weights_key``): step after step,
        a sampled step's first pre-hook is the engine calls alone."""
        key = _weights_key(self._weight_tensors)
        held = self._weights_held
        if key is None or held is None or held[0] != key:
            held = (key, *self._sort_weights())
            self._weights_held = held if key is not None else None
        _, by_device, skipped, done = held
        for x, row in skipped:
            self.buffer.accumulate(x, row)  # skipped and counted
        for dev, (tensors, rows) in by_device.items():
            self.buffer.rows_of(dev).add_many(tensors, rows)
        if self.block_formats:
            turn = [(_local(p), row) for p, row in self._block_weights() if row in done]
            if turn:
                self.buffer.accumulate_blocks_many([t for t, _ in turn], [r for _, r in turn])
        return done

    def _sort_weights(
        self,
    ) -> tuple[
        dict[torch.device, tuple[list[torch.Tensor], list[int]]], list[tuple[torch.Tensor, int]], set[int]
    ]:
        """Where each captured parameter is read: per device, the engine's (tensors, rows); those it cannot read
        (``meta``, a wrapper without values of its own, complex), to be skipped and counted; the rows read."""
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        skipped: list[tuple[torch.Tensor, int]] = []
        done: set[int] = set()
        self._read_dtypes.clear()
        for p, row in self._weights:
            if not (p.is_floating_point() or p.is_complex()) or p.numel() == 0:
                continue
            # FSDP1's FlatParameter: its stored shard, not the whole (param_dtype) copy gathered for the forward
            shard = _compat.flat_param_shard(p)
            x = _local(p) if shard is None else shard
            if x.dtype != p.dtype:
                self._read_dtypes[row] = x.dtype
            dev = x.device
            if dev.type == "meta" or not _plain(x) or x.is_complex():
                skipped.append((x, row))
                continue
            tensors, rows = by_device.setdefault(dev, ([], []))
            tensors.append(x)
            rows.append(row)
            done.add(row)
        return by_device, skipped, done

    def _block_weights(self) -> list[tuple[nn.Parameter, int]]:
        """The matrix weights a block-scaled GEMM reads of this step's block group (``turn``), and their rows:
        read with the other parameters, in one call (their layers' pre-hooks read them one by one before)."""
        key = (self.turn, self.plan.deals)
        if self._turn_weights[0] != key:
            weights = [
                (p, row)
                for s in self.plan.modules
                if s.block_group == self.turn and reads_block_operands(s.module_type)
                for _, p, row in s.weights
                if p.dim() >= 2
            ]
            self._turn_weights = (key, weights)
        return self._turn_weights[1]

    # ------------------------------------------------------------------------------------------- hooks
    def _make_pre_hook(self, slot: _ModuleSlot) -> Callable[..., None]:
        key = input_keyword(slot.module) if slot.input >= 0 else None  # its input's name, given by keyword
        fused = _compat.has_fused_path(slot.module)  # (``TrainingForward._fused_pre_hook``)

        def pre_hook(module: nn.Module, args: Any, kwargs: Any = None) -> None:
            if not self.installed or (fused and _compat.fused_path_aside(module, args, kwargs)):
                return None
            x = args[0] if args else kwargs.get(key) if kwargs else None
            why = self._not_read()
            if why:
                if why == _FIRST_PASS and slot.input >= 0 and isinstance(x, _Tensor):
                    self._first_pass_input(slot, x)
                self._skipped_forward(slot, why)
                return None
            if self._weights_read is None:  # the step's first forward read
                self._weights_read = self._read_weights()
                self.stance_at_forward = _compat.stance()  # (the loop's, set before: the model ran compiled)
            if self._grads_due and _compat.backward_pass_id() is None:
                self._read_grads()  # announced by a backward pass that raised, whose read never ran
            turn = slot.block_group == self.turn
            if slot.reads_input and isinstance(x, _Tensor):
                self._gemm_input(slot, x, turn)
            elif slot.input >= 0 and isinstance(x, _Tensor) and x.dtype in slot.input_dtypes:
                self._norm_input(slot, x)
            if slot.call_shapes is not None and not slot.call_shapes_done:
                slot.call_shapes.append(call_shape(slot, module, args, kwargs, x))
            if slot.order < 0:
                slot.order = self.order
                self.order += 1
            if slot.ran:
                return None
            slot.ran = True
            for _, p, row in slot.weights:
                if row in self._weights_read:
                    self.rows.seen(row, self._read_dtypes.get(row, p.dtype))
                    self.has_data = True
            return None

        return pre_hook

    def _make_fwd_hook(self, slot: _ModuleSlot) -> Callable[[nn.Module, Any, Any], None]:
        act = slot.activation
        rows = self.rows
        # a linear layer's: each call's output elements are kept (``RowTable.numel_gcd``) for FP8's rule
        gemm = slot.gemm
        grad_hook = self._make_grad_hook(slot)
        hook_id = _compat.reserve_hook_ids(1)[0]  # its key in each output's hook dictionary
        add_grad_hook = _compat.add_grad_hook

        def fwd_hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.installed:
                return None
            why = self._not_read()
            if why:
                if why == _FIRST_PASS and self._track_outputs:
                    self._first_pass_outputs(output, act)
                return None
            if isinstance(output, _Tensor):
                tensors: Any = (output,) if output.is_floating_point() or output.is_complex() else ()
            else:
                tensors = _iter_tensors(output)
            any_tensor = False
            for t in tensors:
                if t.dtype in _COMPLEX:  # skipped and counted: the report says which module's and why
                    self.buffer.accumulate(t, act)
                    if t.requires_grad:  # (its gradient too, as the hook finds it complex)
                        add_grad_hook(t, hook_id, grad_hook)
                    continue
                x = t if type(t) is _Tensor and not t.is_nested else _readable(t)
                if not self._add(x, act):
                    # skipped (a torch.func transform's wrapper): its gradient is counted skipped too
                    if t.requires_grad:
                        _grad_hook_if_allowed(t, hook_id, grad_hook)
                    continue
                any_tensor = True
                rows.dtype_bits[act] |= dtype_bit(t.dtype)
                if gemm:
                    rows.numel_gcd[act] = math.gcd(rows.numel_gcd[act], x.numel())
                    if self.output_head is _NOT_WALKED and t.grad_fn is not None:
                        self._head_nodes.setdefault(t.grad_fn, slot.name)  # (``OutputHead``)
                if self._track_outputs and t.dim() >= 2:
                    entry = made_entry(t, act)
                    self._block_outputs[id(t)] = entry
                    self._outputs_made.append(entry)
                if t.requires_grad:
                    add_grad_hook(t, hook_id, grad_hook)
            if any_tensor:
                rows.calls[act] += 1
                self.has_data = True
                if self._autocast_open:
                    self._see_autocast()
            return None

        return fwd_hook

    def _see_autocast(self) -> None:
        """autocast's state at the first recorded forward, or at the first one under autocast in that sampled
        step: a model whose first layers run outside autocast (kept in fp32, as keep_fp32 advises) trains under
        autocast all the same (its first forward said it did not, and the fp16 what-if then counted the
        fp32 layers' inputs as cast)."""
        state = autocast_state(self._device.type)
        if not self.autocast_seen or state["enabled"]:
            self.autocast_seen.update(state)
        self._autocast_open = not state["enabled"]

    def _first_pass_outputs(self, output: Any, act: int) -> None:
        """A reentrant checkpoint's first pass (read when it runs again) made ``output``: kept as that module's
        for the lookups of the matmuls outside the block that read it (the same values the recomputation
        reads), which took it for an input no captured module made, a row of their own."""
        for t in (output,) if isinstance(output, _Tensor) else _iter_tensors(output):
            if t.is_floating_point() and t.dim() >= 2:
                entry = made_entry(t, act)
                self._block_outputs[id(t)] = entry
                self._outputs_made.append(entry)

    def _make_grad_hook(self, slot: _ModuleSlot) -> Callable[[torch.Tensor], None]:
        """The gradient hook of ``slot``'s outputs. Autograd keeps it on each sampled step's graph as long as that
        graph lives (a loop holding its last loss, after ``detach()`` too): ``release`` empties what it refers to
        (these hooks, which hold the model, the optimizers and the Profiler's tables; the slot, its module), so
        from then on it holds nothing of the model's or the Profiler's, and does nothing. Its cells are emptied,
        not looked up through a weak reference: nothing added to each call."""
        row = slot.activation_grad
        # a linear layer's output gradient is an operand of its input- and weight-gradient GEMMs
        gemm_blocks = self.block_formats and slot.gemm
        owner, attempts = self, self._attempts

        def grad_hook(g: torch.Tensor) -> None:
            if g is None or not owner.installed:
                return None
            if (
                not attempts.pass_due
            ):  # the pass's first: its end is watched (a pass that raised is forgotten)
                attempts.backward_seen()
            x = g if type(g) is _Tensor and not g.is_nested else _readable(g)
            if owner.passes is not None and x.dtype not in _COMPLEX:
                x = owner.passes.as_read(x)  # (a pass at scale 1, read as if at the step's scale)
            if x.dtype in _COMPLEX:  # a complex output's: skipped and counted, as the output was
                owner.buffer.accumulate(x, row)
            elif owner._add(x, row):
                if gemm_blocks and slot.block_group == owner.turn:
                    owner.buffer.accumulate_blocks(x, row, read=True)
                owner.rows.seen(row, g.dtype)
            return None

        def release() -> None:
            nonlocal owner, attempts, slot
            owner, attempts, slot = _RELEASED, None, None  # type: ignore[assignment]

        self._releases.append(release)
        return grad_hook


def _distributed() -> bool:
    """Whether a torch.distributed process group is up (DDP, FSDP, tensor parallel may hold the gradients)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _grad_hook_if_allowed(t: torch.Tensor, hook_id: int, hook: Any) -> None:
    """``add_grad_hook`` on an output the statistics skipped (a torch.func transform's wrapped tensor), so that the
    gradient that comes back to it is counted skipped too, as a complex output's is; an output that takes no hook
    (a transform refusing one) is left without: its output was counted, and training goes on."""
    with contextlib.suppress(RuntimeError):
        _compat.add_grad_hook(t, hook_id, hook)
