"""Memory per component, measured on sampled steps, and what each precision mode would take.

``MemoryTracker`` measures, on the steps it is told are sampled (the ``memory`` table, schema
``precprof.tables.MEMORY_COLUMNS``; one row per step, component, module, dtype, phase, moment):

- ``parameters``, ``buffers``: the model's, per dtype, each storage once (tied or shared weights once: storages
  are de-duplicated by ``untyped_storage().data_ptr()``, so a view of a flat buffer counts the whole buffer);
- ``gradients``: per dtype, measured while they exist — in the optimizer's step pre-hook (users often call
  ``zero_grad(set_to_none=True)`` before ``Profiler.step()``), else when each backward pass ended (a step that
  GradScaler skipped, or no optimizer), else ``.grad`` at ``end_step`` (``capture/memory_grads.py``);
- ``optimizer_states``: every tensor in ``optimizer.state`` (exp_avg, exp_avg_sq, step counters, momentum
  buffers), per dtype, measured at ``end_step``; ``master_weights``: tensors in the optimizer's param groups that
  are not the model's parameters (the fp32 master copy of a pure-bf16/fp16 model; their gradients count as
  ``gradients``);
- ``activations``: tensors saved for backward, per module (the innermost module running when autograd saved
  them) and per dtype, through ``torch.autograd.graph.saved_tensors_hooks`` pushed in the model's forward
  pre-hook and popped in its forward post-hook (``capture/memory_saved.py``); a loop that calls the model's
  submodules itself instead of the model has them pushed in each such call's hooks. Each storage counts once per
  forward pass; parameters and buffers are not activations. A tensor saved from a storage the step's forward did
  not make (the model's inputs, and in ``scope()`` data without autograd history such as targets) counts the bytes
  it reaches, each once, not its whole storage: a batch sliced from a dataset held in memory (``X[i:i+B]``) or a
  micro-batch of ``batch.chunk(k)`` counts as the same batch copied out. Tensors saved outside the model's
  forward (a loss computed in the training loop) are seen only inside ``MemoryTracker.scope()`` (module
  ``"(loss)"``). Under activation checkpointing a region keeps only its inputs until the backward pass
  recomputes the rest: those inputs are counted, under the module running when the checkpoint was called
  (Hugging Face's checkpointed layers: the layer itself), and what the region saves is not (non-reentrant: through the checkpoint's own hooks, which keep nothing; reentrant: its
  forward runs without grad). Selective activation checkpointing (``create_selective_checkpoint_contexts``)
  keeps the outputs of the ops its policy saves in a cache of its own, which no saved-tensor hook sees: they are
  read from that cache at each module hook while the region runs and counted under the module that made them.
  A forward that begins under saved-tensor hooks someone else pushed (a checkpoint
  of the whole model, ``save_on_cpu()`` or an offloading hook around the model call) is left to them and not
  measured (``model_facts()["activations_note"]`` says so): autograd calls only the innermost pair, and ours
  would switch theirs off. Under gradient accumulation the saved tensors of one micro-batch are freed by its
  backward, so the step reports the largest group of forwards that were alive together (forwards with no
  backward between them add up). An attempt that raised and was run again (an out-of-memory-and-retry loop) held
  no activations of the step: its saved tensors are forgotten with it (``capture/attempts.py``);
- ``autocast_weight_copies``: saved tensors that are casts of a parameter (grad_fn ``ToCopyBackward0`` whose
  input is the parameter's ``AccumulateGrad``, possibly behind a view such as ``t()``), and for frozen
  parameters (no grad_fn) a saved tensor of the running module with a frozen parameter's shape and another
  dtype. Only copies that backward keeps count: under autocast, the first Linear's weight copy is not saved when
  its input does not require grad;
- ``allocator_peak`` / ``allocator_reserved_peak`` per phase (``phase`` column: forward, backward, optimizer,
  other), and what was allocated at the moment of the step's peak, every byte in one part (``moment`` "peak"
  rows: the components above, ``inputs``, ``outputs``, precprof's own buffers, ``temporaries`` by the phase
  that allocated them, ``other``, and on CUDA ``allocator_cache``, reserved - allocated): found by replaying
  the allocator's own events of the step (``precprof.capture.peak``, where the choice is weighed). On CUDA by
  default, from the caching allocator's history (host calls only: no sync); on the CPU only with
  ``peak=True`` (torch.profiler's memory events; the built-in loop asks for it). Where a CUDA step has no
  replay (``peak=False``, or the program records the allocator's history itself) the phase peaks come from
  the process's peak counters: ``max_memory_allocated`` only grows, so when it grew during a phase its new
  value is that phase's exact peak (``allocator_peak``); when it did not, the most memory allocated that the
  hooks saw in the phase is a lower bound of its peak (``allocator_seen_max``). The process's peak counters
  belong to the program (its own ``torch.cuda.max_memory_allocated()``, Lightning's and the Trainer's memory
  logs): they are never reset unless ``reset_peaks=True`` (the built-in loop, which owns the process).
  ``device_used`` / ``device_total`` come from NVML when a driver and nvidia-ml-py are there (silently absent
  otherwise).

Outside sampled steps the tracker has no hook at all (``begin_step`` installs them for a sampled step and
``end_hooks`` removes them, or with ``keep`` leaves them doing nothing until the next ``begin_step`` arms them
for a sampled step or removes them). The tracker holds no tensor: only storage addresses, sizes,
totals and its hook handles (``buffer_bytes``). The pack hook returns the tensor, or, when it has a graph, the tensor
detached (the same memory: an output saved by its own backward node would otherwise hold that node in a cycle
Python's gc cannot free, for ever when no backward runs): training is bitwise the same.

What the memory table means per mode is ``precprof.analysis.memory_projection``'s business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from precprof import _compat
from precprof import tables as T
from precprof.capture.attempts import AttemptWatch
from precprof.capture.cast_copies import CastSources
from precprof.capture.counters import PhaseCounters
from precprof.capture.memory_grads import GradientBytes
from precprof.capture.memory_saved import FOREIGN_HOOKS, PolicyCache, SavedActivations, saved_tensor_hooks
from precprof.capture.memory_schedule import MemorySchedule
from precprof.capture.peak import CudaHistory, Label, PeakRecorder, ProfilerMemory
from precprof.capture.records import after_closure
from precprof.capture.storage import (
    SavedGroup,
    Steady,
    StorageKey,
    StorageMemo,
    _sizeof,
    _storage_keys,
    model_sizes,
    module_tensors,
    optimizer_state_tensors,
    persistent_labels,
    steady_bytes,
)


class MemoryTracker(SavedActivations):
    """Memory per component of one model (and optimizer), measured on sampled steps.

    Drive it as ``attach()``; per step ``begin_step(step, sampled)`` before the forward, the user's forward,
    backward, optimizer step and ``zero_grad``, then ``end_step(step)`` (rows on sampled steps); ``detach()``.
    ``precprof.capture.Profiler`` does this; it works standalone too. See the module docstring for what each
    component means. Measurements are host-side only (no device synchronisation anywhere).

    ``peak``: replay the allocator's events of sampled steps for the peak rows (``precprof.capture.peak``).
    None: on CUDA (the allocator's history), off on the CPU; True: also on the CPU (torch.profiler's memory
    events: a program's own torch.profiler cannot start during a sampled step); False: off. ``own``: returns
    the objects holding precprof's own device buffers, named ``profiler_buffers`` at the peak.
    ``reset_peaks``: reset the process's CUDA peak counters at phase boundaries (exact counter peaks per phase
    where there is no replay); only where no one else reads them, i.e. in precprof's own loop.
    ``every``, ``watch_shapes``: which sampled steps are measured (``capture/memory_schedule.py``; 1: all; None:
    a cadence that spaces out while the measured steps agree).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        *,
        peak: bool | None = None,
        own: Callable[[], Iterable[Any]] | None = None,
        reset_peaks: bool = False,
        every: int | None = 1,
        watch_shapes: bool = True,
    ) -> None:
        self.schedule = MemorySchedule(every, watch_shapes)
        self.model = model
        self.reset_peaks = reset_peaks
        self.optimizers = (
            list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer else []
        )
        self.peak = peak
        self._own = own
        self._handles: list[Any] = []
        # per module of the model: (module, pre-hook, post-hook), installed for sampled steps
        self._module_hooks: list[tuple[nn.Module, Any, Any]] = []
        self._hookset: _compat.HookSet | None = None
        self._outside = 0  # inside ``outside`` (nested: a depth)
        self._modules: list[nn.Module] = []  # the model's modules as attach found them
        # the model's parameters and buffers listed at the sampled step's start; their storages, and the bytes
        # of them and of the optimizer's tensors (computed again only when one of those tensors changed)
        self._params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._model_keys, self._steady, self._steady_labels = Steady(), Steady(), Steady()
        self._storage_of = StorageMemo()  # storages of the parameters and states read step after step
        self._attached = False
        self._step = 0
        self._sampled = False
        self._live = False  # the hooks act (a sampled step's forward to its end_hooks)
        self._stack: list[tuple[str, nn.Module | None]] = []  # running modules, innermost last
        self._recording = False  # inside a sampled forward with our saved-tensor hooks pushed
        # the submodule that a loop called itself, not through the model, whose forward records now
        self._entry: nn.Module | None = None
        self._saved_ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._unpacks = 0  # saved tensors read back by backward (any step): tells forwards apart
        self._unpacks_mark = -1
        self._groups: list[SavedGroup] = []
        # the caches of the selective activation checkpoints running in this forward (``_read_policy_caches``)
        self._policy_caches: list[PolicyCache] = []
        self._casts: CastSources | None = None
        self._param_keys: set[StorageKey] = set()
        self._input_keys: set[StorageKey] = set()  # storages of the tensors given to the model this step
        self._grads = GradientBytes()
        self._unmeasured = 0  # saved tensors without a real storage (fake, sparse): not counted
        # sampled forwards that began under someone else's saved-tensor hooks (a checkpoint or offload around
        # the model call), left to them: ours would replace theirs (autograd calls only the innermost pair)
        self._foreign_forwards = 0
        self._loss_in_forward = (
            False  # a sampled forward of the model returned a loss (a scalar with grad_fn)
        )
        self._root_depth = 0
        self._step_mode: bool | None = None
        # the saved tensors read back when the step's first forward began in eval mode (``_start_recording``)
        self._eval_unpacks = 0
        self.arm_error: str | None = None  # why measuring a step from its forward failed, if it did
        self._on_cpu = True
        self._peak = PeakRecorder(None)
        # the counters' phase peaks (CUDA steps without a replay)
        self._counts = PhaseCounters(None, reset_peaks)  # and the device whose allocator is read (_cuda)
        self._attempts = AttemptWatch(self)
        self._pack, self._unpack, self._release_saved = saved_tensor_hooks(self)

    @property
    def _cuda(self) -> torch.device | None:
        """The CUDA device whose allocator is read (None on the CPU)."""
        return self._counts.cuda

    @_cuda.setter
    def _cuda(self, device: torch.device | None) -> None:
        self._counts.cuda = device

    # ------------------------------------------------------------------------------------ attach/detach
    def attach(self) -> None:
        """Make the hooks and learn the model's device; the hooks are installed for sampled steps only
        (``begin_step``), and removed at their ``end_step``."""
        if self._attached:
            return
        self._module_hooks = []
        self._hookset = None
        self._pack, self._unpack, self._release_saved = saved_tensor_hooks(self)  # (released at a detach)
        self._modules = [mod for _, mod in self.model.named_modules()]
        self._module_hooks.append((self.model, self._root_pre_hook, self._root_post_hook))
        for name, mod in _compat.named_modules(self.model):  # a module reached twice keeps its first name
            if mod is not self.model and name:  # a wrapper's module ("" under DDP) is the root's forward
                self._module_hooks.append((mod, self._make_pre_hook(name, mod), self._make_post_hook(name)))
        dev = next((p.device for p in self.model.parameters()), None)
        self._cuda = dev if dev is not None and dev.type == "cuda" and torch.cuda.is_available() else None
        self._on_cpu = dev is None or dev.type == "cpu"
        self._attached = True

    def _install(self) -> None:
        """The hooks of a sampled step: every module's (the module stack, the saved-tensor hooks of the model's
        forward), gradient and optimizer hooks."""
        if self._hookset is None:
            self._hookset = _compat.HookSet(
                [(m, pre, post, True) for m, pre, post in self._module_hooks],
                [(p, self._grad_hook) for p in self.model.parameters() if p.requires_grad],
                kwargs_pre=self.model,
                kwargs_entries=[
                    k for k, (m, _, _) in enumerate(self._module_hooks) if _compat.has_fused_path(m)
                ],
            )
        if self._hookset.installed:
            if not self._outside:
                self._hookset.step_back()  # (left aside by an evaluation a KeyboardInterrupt cut short)
            return
        self._hook_optimizers()  # (first: the modules' hooks then know nothing was registered after them)
        self._hookset.install()
        if self._outside:  # (inside ``outside``: they wait for its end)
            self._hookset.step_aside()

    def _hook_optimizers(self) -> None:
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(self._opt_pre_hook))
            self._handles.append(opt.register_step_post_hook(self._opt_post_hook))

    def use_optimizers(self, optimizers: Sequence[Any]) -> None:
        """Measure the states and master weights of ``optimizers`` from now on, and their step as the optimizer
        phase (a new optimizer made mid-run): the old ones' hooks come off, the new ones' go on at once when the
        hooks are in place."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.optimizers = list(optimizers)
        if self._hookset is not None and self._hookset.installed:
            self._hook_optimizers()

    def _uninstall(self) -> None:
        if self._hookset is not None:
            self._hookset.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def take_over(self, old: MemoryTracker) -> None:
        """Go on from ``old``, the tracker of the plan before a re-plan (``capture/replan.py``): the steps it
        measured and their cadence, what it learned of the model over the run (a loss in the forward, saved
        tensors it could not measure, forwards under someone else's saved-tensor hooks) and its peak's source."""
        self.schedule = old.schedule
        self._loss_in_forward |= old._loss_in_forward
        self._unmeasured += old._unmeasured
        self._foreign_forwards += old._foreign_forwards
        if self._peak.source is None:
            self._peak.source, self._peak.note = old._peak.source, old._peak.note

    def detach(self) -> None:
        """Remove every hook and pop the saved-tensor hooks if a forward left them pushed; stop reading the
        allocator's events (a step in progress keeps them for its ``end_step``). Idempotent."""
        self._peak.stop()
        self._pop_saved_hooks(final=True)
        self._uninstall()
        self.schedule.unwatch()
        # the hooks' closures refer back to the tracker: dropped, nothing keeps the model alive through them; nor
        # through the saved-tensor hooks that a graph the loop still holds keeps
        self._module_hooks, self._hookset, self._modules = [], None, []
        self._release_saved()
        self._stack.clear()
        self._policy_caches.clear()  # (a forward that never returned: they hold its cached tensors)
        self._recording = False
        self._attached = False
        self._counts.close()

    # ------------------------------------------------------------------------------------------- steps
    def begin_step(self, step: int, sampled: bool) -> None:
        """Start ``step``; on sampled steps the schedule measures, arm the hooks and start reading the
        allocator's events (host only, no sync)."""
        self._peak.abort()  # a sampled step that never reached end_step
        self._step = step
        self._groups = []
        self._input_keys = set()
        self._unpacks_mark = -1
        self._grads.reset()
        self._step_mode = None  # the mode of the step's first forward of the model (``_start_recording``)
        self._root_depth = 0  # (a forward a KeyboardInterrupt left never reached its post-hook)
        self._attempts.begin_step()
        model = self.model if self._attached else None
        self._sampled = self.schedule.begin(step, sampled, model, self._arm_at_forward, self.read_back)
        if not self._sampled:
            self._uninstall()
            return
        self._arm()

    def _arm_at_forward(self, root: nn.Module, args: Any, kwargs: Any) -> None:
        """A sampled step the schedule did not measure turns out to run new shapes (the schedule's watch, in
        the root's forward pre-hook): measure it from here, its root pre-hook called by hand (the one installed
        now runs from the next forward on). A failure leaves the step unmeasured, never the forward failed."""
        try:
            self._sampled = True
            self._arm()
            self._root_pre_hook(root, args, kwargs)
        except Exception as e:  # memory accounting must never take training down
            self.arm_error = f"{type(e).__name__}: {e}"
            self._sampled = self.schedule.measuring = False
            self.end_hooks()
            self._pop_saved_hooks()

    def _arm(self) -> None:
        if self._attached:
            self._install()
        self._live = True
        self._params, self._buffers = self._model_tensors()
        both = self._params + self._buffers
        self._param_keys = self._model_keys.get(both, lambda: self._keys(both))
        self._counts.begin()
        if self._attached:
            # the source of allocator events, chosen on the first sampled step
            if self._peak.source is None:
                if self._cuda is not None and self.peak is not False:
                    self._peak.source = CudaHistory(self._cuda)
                elif self._cuda is None and self.peak and self._on_cpu:
                    self._peak.source = ProfilerMemory()
                elif self.peak is False:
                    self._peak.note = "not asked for (memory_peak=False)"
                elif self._on_cpu:
                    self._peak.note = (
                        "on the CPU it needs torch.profiler's memory events, read only when asked for "
                        "(Profiler(memory_peak=True); the built-in loop does)"
                    )
                else:
                    self._peak.note = "no allocator history to read on this device"
            self._peak.begin(self._persistent)

    def end_step(self, step: int) -> list[dict[str, Any]]:
        """Memory rows of ``step`` (``[]`` when it was not sampled). Host only; no device sync."""
        kept = self.schedule.done(step)  # (not: measured only for an evaluation's shapes, ``MemorySchedule``)
        if not self._sampled:
            return []
        self._mark_phase(T.PHASE_OTHER)
        peak = self._peak.finish(self._persistent)
        rows: list[dict[str, Any]] = []

        def row(
            component: str, module: str, dt: str, b: int, phase: str = "", moment: str = ""
        ) -> dict[str, Any]:
            return {
                T.STEP: step,
                T.COMPONENT: component,
                T.MODULE: module,
                T.DTYPE: dt,
                T.BYTES: int(b),
                T.PHASE: phase,
                T.MOMENT: moment,
            }

        def add(
            component: str, per_dtype: Mapping[str, int], module: str = "", phase: str = "", moment: str = ""
        ) -> None:
            rows.extend(row(component, module, dt, b, phase, moment) for dt, b in sorted(per_dtype.items()))

        params, buffers = (self._params, self._buffers) if self._params else self._model_tensors()
        opt_params: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        for opt in self.optimizers:
            opt_params += [p for g in opt.param_groups for p in g["params"]]
            states += optimizer_state_tensors(opt)
        steady = self._steady.get(
            [*params, *buffers, *opt_params, *states],
            lambda: steady_bytes(params, buffers, opt_params, states, self._storage_of),
        )
        add(T.PARAMETERS, steady[T.PARAMETERS])
        add(T.BUFFERS, steady[T.BUFFERS])
        add(T.GRADIENTS, self._grads.bytes(params))
        if self.optimizers:
            add(T.MASTER_WEIGHTS, steady.get(T.MASTER_WEIGHTS, {}))
            add(T.OPTIMIZER_STATES, steady.get(T.OPTIMIZER_STATES, {}))
        group = max(self._groups, key=SavedGroup.total) if self._groups else None
        if group is not None:  # a row per module and dtype: built here, not through ``add`` (hundreds a step)
            rows += [row(comp, module, dt, b) for (comp, module, dt), b in sorted(group.bytes.items())]
            shared = sorted(group.shared.items())
            rows += [row(T.ACTIVATIONS, m, dt, b, moment=T.MOMENT_CAST_COPIES) for (m, dt), b in shared]
        if peak is not None:
            for phase in T.MEMORY_PHASES:
                allocated, reserved = peak.phase_peaks.get(phase, (None, None))
                if allocated is not None:
                    add(T.ALLOCATOR_PEAK, {"": allocated}, phase=phase)
                if reserved is not None:
                    add(T.ALLOCATOR_RESERVED_PEAK, {"": reserved}, phase=phase)
            for (comp, module, dt), b in sorted(peak.parts.items()):
                add(comp, {dt: b}, module=module, phase=peak.phase, moment=T.MOMENT_PEAK)
        else:  # no replay: the counters' peaks (CUDA only)
            for (comp, phase), b in sorted(self._counts.peaks.items()):
                if phase != T.PHASE_OUTSIDE:
                    add(comp, {"": b}, phase=phase)
        self._counts.peaks = {}
        for comp, b in self._counts.device_memory().items():
            add(comp, {"": b})
        # Keep nothing between steps but the module names: buffer_bytes stays flat over a run.
        self._groups = []
        self._input_keys = set()
        self._grads.reset()
        self._sampled = False
        if kept:
            self.schedule.result(step, rows)
        return rows if kept else []

    def end_hooks(self, keep: bool = False) -> None:
        """The sampled step's forward, backward and optimizer step are over: its hooks come off (``end_step``
        reads what they saw); with ``keep`` they stay in place doing nothing, for a next step that may be
        sampled too (``begin_step`` arms them again, or removes them for a step that is not sampled)."""
        self._live = False
        self.schedule.pause()
        if not keep:
            self._uninstall()

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """An evaluation between steps (``Profiler.not_training``): a phase of its own, which is not the step's,
        so that the step's peak is the training's (an evaluation's batch of 256 set a step's "peak" at 6.7 MiB
        where its training peaked at 0.85 MiB, and the memory verdict was taken from it)."""
        before = self._peak.segments[-1]
        self._mark_phase(T.PHASE_OUTSIDE)
        # the module hooks and the input watch step aside meanwhile: the evaluation runs as without precprof
        # (``StepHooks.outside``), and what it saves or the shapes it runs are not the step's
        self._outside += 1
        if self._hookset is not None:
            self._hookset.step_aside()
        try:
            with self.schedule.aside():
                yield
        finally:
            self._outside -= 1
            if self._hookset is not None and not self._outside:
                self._hookset.step_back()
            self._mark_phase(before)

    @property
    def peak_note(self) -> str:
        """Why the last sampled step has no peak rows ("" when it has them)."""
        return self._peak.note

    def _persistent(self) -> dict[StorageKey, Label]:
        """Storages that outlive the step, read now (host only; ``persistent_labels`` says which)."""
        params, buffers = (self._params, self._buffers) if self._params else self._model_tensors()
        return persistent_labels(
            params, buffers, self.optimizers, self._own, self._storage_of, self._steady_labels
        )

    @property
    def buffer_bytes(self) -> int:
        """Host bytes the tracker itself holds (hook handles, storage addresses, totals); no device memory."""
        memo: set[int] = set()
        return sum(
            _sizeof(x, memo)
            for x in (
                self._handles,
                self._stack,
                self._groups,
                [(g.seen, g.bytes, g.shared, g.spans) for g in self._groups],
                self._param_keys,
                self._input_keys,
                self._grads.seen,
                self._grads.snapshot,
                self._peak.segments,
                self._peak.labels,
                self._counts.peaks,
            )
        )

    def model_facts(self) -> dict[str, Any]:
        """What the projection needs to know about the model beyond the memory table.

        ``n_params`` (unique parameter elements), ``n_trainable``, ``sparse_grad_numel`` (trained elements whose
        gradient is sparse: nn.Embedding(sparse=True)), ``matmul_weight_numel`` (elements of >=2-D
        weights of matmul modules: what autocast casts) and ``module_classes`` (module name -> matmul |
        elementwise | fp32 | other, see ``module_class``), ``loss_in_forward`` (a sampled forward of the model
        returned a loss: what the loss saved is in the model's activations). Store it as
        ``summary["memory"]["model"]``.
        """
        return {
            **model_sizes(self.model),
            "unmeasured_saved_tensors": self._unmeasured,
            "activations_note": FOREIGN_HOOKS if self._foreign_forwards else "",
            "loss_in_forward": self._loss_in_forward,
            "peak_source": type(self._peak.source).__name__ if self._peak.source is not None else None,
            "peak_note": self.peak_note,
        }

    # ------------------------------------------------------------------------------------- gradients
    def _grad_hook(self, p: torch.Tensor) -> None:
        # Records sizes only: holding the gradient would keep it alive past the user's zero_grad.
        g = p.grad
        if not (self._sampled and self._live) or g is None:
            return
        if (
            not self._attempts.pass_due
        ):  # the pass's first: its end is watched (a pass that raised is forgotten)
            self._attempts.backward_seen()
        if self._counts.cuda is None and not self._peak.measuring:  # nothing to do at this gradient's moment
            if self._grads.read_at_backward_end(self._grad_params):
                return
        elif self._counts.cuda is not None and not self._peak.measuring:
            self._counts.sample_live()  # the phase's lower bound where there is no replay (~20 us a read)
        self._grads.add(g)
        if self._peak.measuring:
            self._label(T.GRADIENTS, (g,))

    def _grad_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients a backward pass's end reads: the step's, else the model's now."""
        return self._params or list(self.model.parameters())

    def _opt_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if not (self._sampled and self._live):
            return None

        def optimizer_phase() -> None:  # (after a closure's forward and backward: ``after_closure``)
            self._mark_phase(T.PHASE_OPTIMIZER)
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            grads += [p.grad for p in self._params or self.model.parameters() if p.grad is not None]
            grads = list({id(g): g for g in grads}.values())  # usually the same tensors twice
            self._grads.at_optimizer(grads)
            if self._peak.measuring:
                self._label(T.GRADIENTS, grads)

        wrapped = after_closure(args, kwargs, optimizer_phase)
        if wrapped is None:
            optimizer_phase()
        return wrapped

    def _opt_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._sampled and self._live:
            self._mark_phase(T.PHASE_OTHER)
            self._attempts.stepped()  # (the activations so far trained: never forgotten)

    # ---------------------------------------------------------------------------------- forward hooks
    def _make_pre_hook(self, name: str, module: nn.Module) -> Callable[..., None]:
        fused = _compat.has_fused_path(module)  # (its hooks aside for a call torch runs fused, as the stats')

        def hook(module: nn.Module, args: Any, kwargs: Any = None) -> None:
            if fused and _compat.fused_path_aside(module, args, kwargs):
                return
            self._grads.forward_began()
            if self._recording:
                self._read_policy_caches()
                self._stack.append((name, module))
            else:
                self._submodule_entered(name, module, args)

        return hook

    def _make_post_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            stack = self._stack
            if not self._recording or not stack:
                return
            self._read_policy_caches()
            if self._counts.cuda is not None and self._sampled and not self._peak.measuring:
                self._counts.sample_live()  # the phase's lower bound where there is no replay
            if stack[-1][1] is module:
                stack.pop()
                self._submodule_left(module, output)
                return
            # An exception unwound past inner modules: drop them with this one.
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i][1] is module:
                    del self._stack[i:]
                    self._submodule_left(module, output)
                    return

        return hook

    # ----------------------------------------------------------------------------------------- device
    def _model_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's parameters and buffers now, from the modules attach listed (a module added to the model
        since is not seen, as it has no hooks either; re-attach to take it in); walked when not attached."""
        if self._modules:
            return module_tensors(self._modules)
        return list(self.model.parameters()), list(self.model.buffers())

    def _keys(self, tensors: Iterable[torch.Tensor]) -> set[StorageKey]:
        return _storage_keys(tensors, self._storage_of)
