"""The saved activations of a sampled step, for ``MemoryTracker`` (``capture/memory_tracker.py``, which this is a
part of): saved-tensor hooks pushed in the model's forward pre-hook and popped in its post-hook, each saved
storage counted once per forward under the innermost module running, and the phase boundaries and labels the
peak's parts are named by.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from precprof import _compat
from precprof import tables as T
from precprof._notice import notice
from precprof.capture.attempts import AttemptWatch, calls_running
from precprof.capture.cast_copies import CastSources
from precprof.capture.counters import PhaseCounters
from precprof.capture.peak import PeakRecorder
from precprof.capture.storage import (
    SavedGroup,
    StorageKey,
    _plain_tensors,
    _storage,
    _tensors_in,
    dtype_name,
    is_weight_copy,
    span,
)
from precprof.capture.training_forward import evaluated_before, is_evaluation, runs_aside
from precprof.tables import LOSS_SCOPE

# why a run's saved activations were not measured (``model_facts``, the report's memory section)
FOREIGN_HOOKS = (
    "the model's forward ran under saved-tensor hooks of its own (an activation checkpoint or save_on_cpu() "
    "around the model call), which decide what is kept; precprof leaves them in force and does not count "
    "those activations, so the activations and the projections leave them out"
)


# a loss function's node in autograd's graph (NllLossBackward0, MseLossBackward0, BinaryCrossEntropyBackward0...)
_LOSS_NODE = re.compile(r"Loss|CrossEntropy|KlDiv")
_LOSS_HOPS = (
    4  # how far back from a returned scalar its loss node may be (a division by the tokens, a sum of two)
)


def _is_loss(t: torch.Tensor) -> bool:
    """A scalar of floats that backward can start from, made by a loss function a few operations back: the
    model's loss (nanoGPT's cross-entropy, an HF output's ``.loss`` divided by its tokens). Not any scalar with a
    gradient: a learned temperature (CLIP's ``logit_scale.exp()``) or an auxiliary loss returned beside the
    logits, whose loss is computed in the loop, where the memory section asks for ``prof.memory_scope()``."""
    if t.dim() != 0 or not t.is_floating_point() or t.grad_fn is None:
        return False
    todo = [(t.grad_fn, 0)]
    while todo:
        fn, hops = todo.pop()
        if _LOSS_NODE.search(type(fn).__name__):
            return True
        if hops < _LOSS_HOPS:
            todo += [(f, hops + 1) for f, _ in fn.next_functions if f is not None]
    return False


_Hook = Callable[[torch.Tensor], torch.Tensor]


def saved_tensor_hooks(owner: SavedActivations) -> tuple[_Hook, _Hook, Callable[[], None]]:
    """``owner``'s pack and unpack hooks (its ``_pack`` and ``_unpack``), and what releases them. Autograd keeps
    the pair a forward was recorded under with each tensor it saved, until the backward pass reads it: a graph no
    backward ran through (a step cut off after its forward, a loss the loop holds and never used) held them, and
    through them the tracker, the model, the optimizers and the Profiler, after ``detach()`` too. Released (at
    detach), they refer to nothing of the owner's: pack keeps each tensor as before and unpack gives it back,
    neither counting anything."""
    live: SavedActivations | None = owner

    def pack(t: torch.Tensor) -> torch.Tensor:
        if live is not None and live._recording and live._groups:
            live._record_saved(t)
        # An op's output that its own backward node saves (relu, tanh, softmax, exp), kept as the tensor itself,
        # holds that node, which holds it: a cycle through autograd's C++ side that Python's gc cannot see, so a
        # forward whose backward never ran (an evaluation with grad on, a loss the loop dropped) was never freed.
        # Kept detached: the same memory and version counter, and autograd gives it its graph back on unpacking
        return t.detach() if t.grad_fn is not None else t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if live is None:
            return t
        live._unpacks += 1
        # the pass's first: its end is watched (a pass that raised is forgotten)
        if not live._attempts.pass_due:
            live._attempts.backward_seen()
        live._peak.unpacked()
        return t

    def release() -> None:
        nonlocal live
        live = None

    return pack, unpack, release


class PolicyCache:
    """The cache of one selective activation checkpoint (``checkpoint(block, x, context_fn=partial(
    create_selective_checkpoint_contexts, policy))``): its storage (``_compat.policy_caches``), and per op how
    many of its entries were counted already."""

    __slots__ = ("read", "storage")

    def __init__(self, storage: dict[Any, Any]) -> None:
        self.storage = storage
        self.read: dict[Any, int] = {}

    def new_tensors(self) -> list[torch.Tensor]:
        """The tensors the policy kept since the last call (an op's entry: its outputs, each wrapped)."""
        found: list[torch.Tensor] = []
        for op, entries in self.storage.items():
            done = self.read.get(op, 0)
            if len(entries) <= done:
                continue
            self.read[op] = len(entries)
            values = entries.values() if isinstance(entries, dict) else entries
            for entry in itertools.islice(values, done, None):
                found += _compat.cached_tensors(entry)
        return found


class SavedActivations:
    """The saved-tensor half of ``MemoryTracker``: its state is the tracker's (declared here, set there)."""

    model: nn.Module
    _sampled: bool
    _live: bool
    _stack: list[tuple[str, nn.Module | None]]
    _recording: bool
    _entry: nn.Module | None
    _saved_ctx: torch.autograd.graph.saved_tensors_hooks | None
    _unpacks: int
    _unpacks_mark: int
    _groups: list[SavedGroup]
    _param_keys: set[StorageKey]
    _input_keys: set[StorageKey]
    _unmeasured: int
    _foreign_forwards: int
    _loss_in_forward: bool
    _root_depth: int  # calls of the model in progress: 2 inside its call of itself (a distillation target)
    _step_mode: bool | None
    _eval_unpacks: int
    _peak: PeakRecorder
    _counts: PhaseCounters
    _policy_caches: list[PolicyCache]
    _casts: CastSources | None  # the recording forward's fp32 tensors and their autocast copies
    _params: list[torch.Tensor]
    # an attempt of the step that raised and was run again (an out-of-memory-and-retry loop): its saved tensors
    # are not the step's (``capture/attempts.py``; the points are ``attempt_point``'s)
    _attempts: AttemptWatch
    _hookset: _compat.HookSet | None  # the modules' and parameters' hooks (``MemoryTracker``)
    # the saved-tensor hooks of its forwards, and what empties them at detach (``saved_tensor_hooks``)
    _pack: _Hook
    _unpack: _Hook
    _release_saved: Callable[[], None]

    def _label(self, component: str, tensors: Iterable[torch.Tensor]) -> None:
        """Note the storages of ``tensors`` as ``component`` in the current phase (for the peak's parts)."""
        for t in tensors:
            for leaf in _plain_tensors(t):
                st = _storage(leaf)
                if st is not None:
                    self._peak.label(st[0], component, "", dtype_name(leaf.dtype), st[1])

    def _root_pre_hook(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        if self._root_depth:
            running = calls_running(module, self._root_depth)
            if running:
                # the model called inside its own forward, under no_grad (a self-distillation target) or with grad
                # (a siamese or recurrent wrapper): the outer call goes on recording, what the inner call saves is
                # that forward's (the inner call's end had stopped it: the loss after it and what it saved unseen).
                # Told by the stack from a call a KeyboardInterrupt ended, not by grad mode: a call with grad was
                # taken for a new forward, the outer one's last tensors unseen (6 of 8 KiB)
                self._root_depth = running + 1
                return
            self._forward_interrupted()
        self._root_depth = 1
        if self._hookset is not None:  # (an evaluation under no_grad saves nothing: ``runs_aside``)
            self._hookset.step_back()
            self._hookset.keep_last()  # (behind the hooks registered since: the user's, after attach)
            if runs_aside():
                self._hookset.step_aside(keep=module)
        if self._in_scope():
            self._model_in_scope(module, args, kwargs)
            return
        if self._saved_ctx is not None:
            # Left pushed by a forward that never reached its post-hook (KeyboardInterrupt).
            self._pop_saved_hooks()
        self._start_recording("", module)
        if self._recording:
            self._forward_inputs(args, kwargs)

    def _forward_inputs(self, args: Any, kwargs: Any) -> None:
        """Note the model's inputs: saved tensors on their storages are the step's data, counted by the bytes
        they reach (``_record_data``)."""
        inputs = [*_tensors_in(args), *_tensors_in(kwargs)]
        for t in inputs:
            self._input_keys.update(st[0] for leaf in _plain_tensors(t) if (st := _storage(leaf)) is not None)
        if self._peak.measuring:
            self._label(T.INPUTS, inputs)

    def _in_scope(self) -> bool:
        """``scope()`` is open: the bottom of the stack is the scope's, which has no module."""
        return self._saved_ctx is not None and bool(self._stack) and self._stack[0][1] is None

    def _model_in_scope(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """The model called inside ``scope()`` (``loss = F.cross_entropy(model(x), y)`` in one line): its forward
        is recorded under the scope's saved-tensor hooks, by module, and the scope goes on recording after it (the
        loss). The scope's hooks had been popped as left by an interrupted forward and recording stopped at the
        model's end: the loss's saved tensors went uncounted, and the report asked for the scope the user used.
        An evaluation forward of a training step pauses the scope until it returns (not the step's)."""
        self._stack.append(("", module))
        if not self._forward_counts(module):
            self._recording = False
            return
        self._recording = True
        self._forward_inputs(args, kwargs)

    def _model_left_scope(self, module: nn.Module) -> None:
        """The end of the model's forward inside ``scope()``: back to the scope's name, recording again."""
        for i in range(len(self._stack) - 1, 0, -1):
            if self._stack[i][1] is module:
                del self._stack[i:]
                break
        self._recording = True

    def _root_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._root_depth > 1:  # the end of the model's call of itself
            self._root_depth -= 1
            return
        self._root_depth = 0
        if self._hookset is not None:
            self._hookset.step_back()
        if self._recording:
            # a model given its targets returns its loss (nanoGPT's (logits, loss), an HF output's .loss): what
            # the loss saved for backward was recorded with the model's own, no memory scope needed
            self._loss_in_forward |= any(_is_loss(t) for t in _tensors_in(output))
        if self._recording and self._peak.measuring:
            self._label(T.OUTPUTS, _tensors_in(output))
        self._attempts.forward_ended(output)  # (None from torch's ``except``: the forward raised)
        if self._in_scope():
            self._model_left_scope(module)
            return
        self._stop_recording()

    def _forward_interrupted(self) -> None:
        """The model's forward before this call never reached its post-hook (a KeyboardInterrupt the loop caught:
        torch calls no forward hook for an exception that is not an ``Exception``): it ends here as one that raised
        does in its post-hook, so what it saved is forgotten when the loop runs the model again (it was counted
        with the next forward's, as if both were alive, as a step's saved tensors). Inside ``scope()`` (the loop
        caught it and opened the scope again to retry, or the scope is still open) the scope's hooks stay and its
        stack is trimmed to its own entry: stopping popped them, and the retried model was recorded alone, the
        loss after it not at all (576 of 3028 B)."""
        self._root_depth = 0
        self._attempts.forward_interrupted()
        if self._in_scope():
            del self._stack[1:]  # the interrupted forward's modules; the scope's entry stays
            return
        self._stop_recording()

    def _submodule_entered(self, name: str, module: nn.Module, args: Any) -> None:
        """A submodule called while nothing records: a loop that calls the model's parts itself (``for mod in
        model: h = mod(h)``, a head kept in fp32 under ``autocast(enabled=False)``) and never ``model(x)``.
        Its forward is recorded as the root's would be (its data inputs are the step's inputs), until its
        post-hook: without this, every activation of such a loop went unseen and the projections had none."""
        if self._recording or self._saved_ctx is not None or not (self._sampled and self._live):
            return
        if _compat.backward_pass_id() is not None:  # a reentrant checkpoint's recomputation: not the step's
            return
        self._start_recording(name, module)
        if not self._recording:
            return
        self._entry = module
        data = [t for t in _tensors_in(args) if t.grad_fn is None and not t.requires_grad]
        for t in data:
            self._input_keys.update(st[0] for leaf in _plain_tensors(t) if (st := _storage(leaf)) is not None)
        if self._peak.measuring:
            self._label(T.INPUTS, data)

    def _submodule_left(self, module: nn.Module, output: Any) -> None:
        """The post-hook of the submodule ``_submodule_entered`` started recording at: stop recording."""
        if self._entry is module:
            self._entry = None
            self._attempts.forward_ended(output)
            self._stop_recording()

    def _start_recording(self, name: str, module: nn.Module | None) -> None:
        self._stack.clear()
        self._entry = None
        self._recording = False
        if not (self._sampled and self._live) or not torch.is_grad_enabled() or self._saved_ctx is not None:
            return
        if not self._forward_counts(module):
            return
        top = _compat.top_saved_tensors_hooks()
        if top is not None and top is not _compat.NO_QUERY:
            # another pair is in force (``checkpoint(model, x)``, ``save_on_cpu()`` around the call, a recompute):
            # pushing ours would switch it off for everything the model saves. Not measured
            self._foreign_forwards += 1
            return
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        try:
            ctx.__enter__()
        except RuntimeError:
            # Saved-tensor hooks are disabled here (some FSDP/compile paths): no activation numbers this time.
            return
        self._saved_ctx = ctx
        self._recording = True
        self._casts = CastSources()
        self._stack.append((name, module))

    def _forward_counts(self, module: nn.Module | None) -> bool:
        """Whether a forward of the model (``module``), or ``scope()`` (None), beginning now saves tensors of the
        step; its phase and saved-tensor group begin."""
        # the step's first forward of the model decides its mode: one in eval mode after it is an evaluation (with
        # grad on, ``model.eval()`` without ``no_grad``), whose saved tensors are not the step's
        first = module is not None and self._step_mode is None
        if first:
            self._step_mode = self.model.training
        elif module is not None and evaluated_before(self._step_mode, self.model.training, self.read_back):
            self._evaluation_before_training()
        if is_evaluation(self._step_mode, self.model.training):
            return False
        self._mark_phase(T.PHASE_FORWARD)
        if first and not self._step_mode:
            self._eval_unpacks = self._unpacks
        if (
            module is not None and _compat.backward_pass_id() is None
        ):  # a forward of the model (not ``scope``)
            self._attempts.forward_begins()  # (after an attempt that raised: its groups are gone)
        if self._unpacks != self._unpacks_mark or not self._groups:
            # Backward ran since the previous forward started: its saved tensors are gone, start a new group.
            self._groups.append(SavedGroup())
        self._unpacks_mark = self._unpacks
        return True

    def _evaluation_before_training(self) -> None:
        """A forward in train mode after the step's first ran in eval mode, and no backward read what those
        saved (``evaluated_before``): they were an evaluation before the step's training (a validation with
        grad on at the step's start), not a loop that trains in eval mode. What they saved is not the step's
        (it was counted with the training's, as one forward), and the step's time so far, the evaluation's
        batch made included, is an evaluation's phase, off the step's peak (as in ``not_training``; its
        4096-row batch was the step's peak)."""
        self._step_mode = True
        self._groups, self._input_keys = [], set()
        self._peak.segments[:] = [T.PHASE_OUTSIDE] * len(self._peak.segments)
        self._counts.relabel(T.PHASE_OUTSIDE)

    def read_back(self) -> bool:
        """Whether a backward pass read back what the step's forwards saved since its first began in eval mode
        (they trained: a loop that trains in eval mode), as far as this step's measure saw."""
        return self._unpacks != self._eval_unpacks

    def _stop_recording(self) -> None:
        if self._recording:
            self._read_policy_caches()
        self._policy_caches.clear()
        self._entry = None
        was_recording = self._recording
        self._pop_saved_hooks()
        self._stack.clear()
        if was_recording:
            self._mark_phase(T.PHASE_BACKWARD)

    @contextlib.contextmanager
    def scope(self, name: str = LOSS_SCOPE) -> Iterator[None]:
        """Count what autograd saves inside this block as activations of module ``name`` (default "(loss)"):
        work outside the model's forward whose saved tensors belong to the step, above all a loss computed in
        the training loop (``F.cross_entropy`` saves fp32 log-probabilities, B*T*vocab*4 bytes). Does nothing
        on steps that are not sampled, under no_grad, or inside the model's own forward (recorded already). The
        model called inside it is recorded by module, as outside it (``_model_in_scope``). Host only; no sync."""
        if self._recording or self._saved_ctx is not None:
            yield
            return
        self._start_recording(name, None)
        try:
            yield
        finally:
            self._stop_recording()

    def _pop_saved_hooks(self, final: bool = False) -> None:
        """Pop our saved-tensor hooks if they are on top of autograd's stack (never someone else's)."""
        self._recording = False
        self._casts = None  # (it holds the forward's autograd nodes)
        ctx = self._saved_ctx
        if ctx is None:
            return
        top = _compat.top_saved_tensors_hooks()
        if top is _compat.NO_QUERY:
            top = (self._pack, self._unpack)
        if top is not None and top[0] == self._pack:
            ctx.__exit__(None, None, None)
            self._saved_ctx = None
        elif final:
            # Ours is buried under hooks someone else pushed later; popping would remove theirs. Our pack
            # hook does nothing once detached, so leaving it costs one function call per saved tensor.
            notice(
                "precprof: saved-tensor hooks left on autograd's stack under another context's; "
                "they are inert now",
                RuntimeWarning,
            )
            self._saved_ctx = None

    # ----------------------------------------------------------------------------------- saved tensors
    def _read_policy_caches(self) -> None:
        """Count what selective activation checkpoints kept since the last module hook, under the module running
        now (``_stack``'s top: the hooks call this before they push or pop a module): the outputs of the ops their
        policy saves (the matmuls, most often), held in the checkpoint's cache until the backward pass. Autograd's
        saved-tensor hooks never see them (the checkpoint's own pair is on top, and keeps nothing): the table had
        only the blocks' inputs, about a fifth of what the step kept. A cache is read while its checkpoint's
        forward runs, and once more at the first hook after it ended. Host only."""
        running = _compat.policy_caches()
        caches = self._policy_caches
        if not running and not caches:
            return
        for storage in running:
            if not any(c.storage is storage for c in caches):
                caches.append(PolicyCache(storage))
        for c in list(caches):
            for t in c.new_tensors():
                self._record_saved(t)
            if not any(c.storage is s for s in running):
                caches.remove(c)  # its checkpoint's forward is over: nothing more comes

    def _record_saved(self, t: torch.Tensor) -> None:
        group = self._groups[-1]
        name, module = self._stack[-1] if self._stack else ("", None)
        own: set[StorageKey] | None = None
        for leaf in (t,) if type(t) is torch.Tensor else _plain_tensors(t):
            st = _storage(leaf)
            if st is None:
                self._unmeasured += 1
                continue
            key, nbytes = st
            if key in self._param_keys or key in group.seen:
                continue
            if key in self._input_keys or (
                module is None and leaf.grad_fn is None and not leaf.requires_grad
            ):
                self._record_data(group, name, leaf, key, nbytes)
                continue
            if own is None:
                own = self._own_param_keys(module)
            if key in own:
                # the running module's parameter as it is now, not as the model listed it at the step's start:
                # FSDP2's all-gathered weights (a view of the unit's buffer), which a matmul saves and FSDP frees
                # after the forward. Counted as activations they were a whole unit's unsharded bytes per rank
                continue
            group.seen.add(key)
            if is_weight_copy(leaf, module, self._param_keys):
                k = (T.AUTOCAST_WEIGHT_COPIES, "", dtype_name(leaf.dtype))
            else:
                k = (T.ACTIVATIONS, name, dtype_name(leaf.dtype))
                if self._casts is not None:
                    self._casts.saved(leaf, name, nbytes, group.shared)
            group.bytes[k] = group.bytes.get(k, 0) + nbytes
            if self._peak.measuring:
                self._peak.label(key, *k, nbytes)

    def _record_data(
        self, group: SavedGroup, name: str, t: torch.Tensor, key: StorageKey, nbytes: int
    ) -> None:
        """A saved tensor on a storage the step's forward did not make: the model's input (a batch sliced from
        a dataset held in memory, ``X[i:i+B]``; a micro-batch of ``batch.chunk(k)``), or in ``scope()`` data
        with no autograd history (the targets). It counts the bytes it reaches, each byte once, not its whole
        storage: the rest of a dataset is no activation of this step (the whole of it was counted as the first
        layer's activations, 12.8 MB for a step that saves 6 KB)."""
        lo, hi = span(t, nbytes)
        b = group.cover(key, lo, hi)
        if not b:
            return
        k = (T.ACTIVATIONS, name, dtype_name(t.dtype))
        group.bytes[k] = group.bytes.get(k, 0) + b
        if self._peak.measuring and hi - lo == nbytes:  # a whole batch; a part of one stays named as input
            self._peak.label(key, *k, nbytes)

    def attempt_params(self) -> list[torch.Tensor]:
        return self._params

    def attempt_point(self) -> tuple[int, SavedGroup | None]:
        """The groups as a forward beginning now finds them: how many, and a copy of the last when this forward
        joins it (no backward since the one before: forwards alive together)."""
        groups = self._groups
        joins = bool(groups) and self._unpacks == self._unpacks_mark
        return len(groups), groups[-1].copy() if joins else None

    def attempt_back_to(self, point: tuple[int, SavedGroup | None]) -> None:
        """The groups as ``attempt_point`` found them: the forward running now joins the last or begins its own."""
        n, last = point
        del self._groups[n:]
        if last is not None:
            self._groups[-1] = last.copy()
        self._unpacks_mark = self._unpacks if last is not None else -1

    def _own_param_keys(self, module: nn.Module | None) -> set[StorageKey]:
        """The storages of ``module``'s own parameters now (none for no module): its ``_parameters`` as they are,
        what ``parameters(recurse=False)`` walks without its generators (per saved tensor of a memory step)."""
        if module is None:
            return set()
        return {
            st[0] for p in module._parameters.values() if p is not None and (st := _storage(p)) is not None
        }

    def _mark_phase(self, new_phase: str) -> None:
        """A phase boundary: a new segment of the step, placed in the allocator's events, and the phase's
        counter peaks where there is no replay (``capture/counters.py``)."""
        if not self._sampled:
            return
        self._peak.phase(new_phase)
        self._counts.mark(new_phase)
