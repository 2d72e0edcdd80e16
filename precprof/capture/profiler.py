"""The Profiler: hooks on a model, its optimizer and GradScaler that record per-layer statistics.

What is recorded on a sampled step, for every captured module (see ``Profiler``'s docstring for which):

- ``activation``: every floating tensor the module outputs (tuples, lists, dicts and ModelOutputs walked), the
  step's calls aggregated into one row;
- ``activation_grad``: their gradients, through ``Tensor.register_hook`` on each output from the forward hook
  (``register_full_backward_hook`` breaks on in-place ops such as ``ReLU(inplace=True)``);
- ``weight``: the module's own parameters, as the step's first forward sees them;
- ``weight_grad``: each parameter's accumulated gradient (``register_post_accumulate_grad_hook``, read together
  when the backward ends; under gradient accumulation the step's last accumulation);
- ``weight_update``: on a strided sample of each parameter's elements, the update the optimizer applied (its RMS
  against the weight's, its extremes) and how many nonzero updates would vanish in bf16 / fp16 weights.

Hooks never synchronise with the device: statistics accumulate into a preallocated device buffer
(``precprof.stats.StatsBuffer``); the loss scale and the scaler's found-inf flag are read as device tensors
(``GradScaler.update`` is wrapped while attached, to read them first). The buffer, the losses since the last
sampled step and the memory rows are copied to the host once, in a sampled step's ``Profiler.step()``:
precprof's one synchronisation point. Unsampled steps have no hook at all (``capture/hooks.py`` installs them
for a sampled step only). ``torch.no_grad()`` forwards (evaluations between steps) are ignored: they never
pollute a training step's rows.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from precprof import _compat, _signals, clipwatch, rundir
from precprof import stats as st
from precprof import tables as T
from precprof.capture import arguments, attached, given, records, unsaved, writer_process
from precprof.capture.assembly import PartsAssembly
from precprof.capture.block_budget import DEFAULT_SHARE, BlockDeal
from precprof.capture.collect import Collector
from precprof.capture.hooks import StepHooks
from precprof.capture.landed import LandedValues
from precprof.capture.loop_order import LoopOrder
from precprof.capture.machine_load import MachineLoad
from precprof.capture.optimizer_switch import OptimizerSwitch
from precprof.capture.plan import CapturePlan, ModuleFilter, block_formats_from_env
from precprof.capture.recorded import Recorded
from precprof.capture.records import MAX_PENDING_STEPS, RowInfo, _ModuleSlot, _PendingStep, held_scalar
from precprof.capture.reducer import mean_over_ranks
from precprof.capture.results import ProfilerResults
from precprof.capture.sampling import DEFAULT_BUDGET, Sampler
from precprof.capture.scaler import ScalerWatch, taken
from precprof.capture.stance import SampledStance
from precprof.capture.updates import UpdateSampler
from precprof.export.live import LiveDashboards


class Profiler(PartsAssembly, ProfilerResults, OptimizerSwitch):
    """Record per-layer dtypes, exponent histograms and exact underflow/overflow counts during training.

    Args:
        model: the module to watch (also a DDP/FSDP/Fabric wrapper or a ``torch.compile``d module).
        optimizer: optional, one or a list (Muon for the matrices, AdamW for the rest); enables ``weight_update``
            rows (each parameter read around the step of the optimizer that holds it) and optimizer-state memory.
        scaler: optional ``torch.amp.GradScaler`` (left out: the one a Fabric or accelerate wrapper of the model
            or optimizer holds); its scale and skipped steps are recorded and gradients are stored unscaled.
        sample_every: record layers every N steps (step 0 is sampled); 0 records steps only. None (the
            default): as many steps as keep precprof's measured overhead within ``overhead_budget``, plus the
            first steps and the steps right after a non-finite loss, a skipped GradScaler step or a loss spike
            (``capture/sampling.py``; the summary says the overhead reached and why each step was sampled).
        overhead_budget: with ``sample_every=None``, the share of the run's time precprof may add (0.03).
        modules: which modules to capture — None: every leaf module plus every module that owns parameters
            directly; otherwise a list of qualified-name patterns (``fnmatch``, e.g. ``"transformer.h.*.mlp.*"``)
            and/or module types (``nn.Module`` subclasses); one pattern or type alone is that one.
        memory: track memory per component (``precprof.capture.memory_tracker``) on sampled steps.
        memory_every: which sampled steps measure memory: the first two, every ``memory_every``-th after them,
            and any whose model inputs have shapes no measured step had, from its forward on
            (``capture/memory_schedule.py``: a step's memory changes with its shapes). 1: every sampled step.
            None (the default): every 4th, spacing out to every 32nd while measured steps of the same shapes
            hold the same memory, and back to every 4th when one does not.
        memory_peak: also replay the allocator's events of sampled steps: each phase's peak and what was
            allocated at the step's peak, by part (``capture.peak``). None (the default): on CUDA (the caching
            allocator's history; host calls only), off on the CPU (it needs torch.profiler's memory events, and
            the program's own torch.profiler could not start in a sampled step); True: on the CPU too.
        reset_peak_memory: reset the CUDA peak-memory counters at phase boundaries (exact peaks of each phase a
            step has no replay of). Off by default: a loop reading ``torch.cuda.max_memory_allocated()`` (its
            logs, Lightning's, the Trainer's) would read precprof's phases. The built-in loop turns it on.
        weight_updates: record ``weight_update`` rows (needs ``optimizer``).
        update_sample: elements per parameter sampled (strided) for the weight-update statistics.
        chunk: scratch chunk size for the statistics (see ``StatsBuffer``).
        first_step: the number of the first step (0): a job restarted from its checkpoint gives the checkpoint's
            step (with ``out`` and ``resume``), so that its steps are numbered, and sampled, as the run's.
        reducer: how statistics combine across ranks. ``"auto"``: under an initialised torch.distributed
            process group of more than one rank, ``precprof.capture.reducer.RankReducer`` (counts and histograms
            summed, absmax/absmin reduced, rank 0 writes; every rank attaches one: one attached on some ranks
            only is refused at attach, ``capture.every_rank``); None: this process only.
        loss_scale: a manual static loss scale, for loops that scale by hand (``(loss * 1024).backward()``,
            then divide the gradients): gradients are read at that scale and stored unscaled, as with a
            GradScaler. Not with ``scaler``.
        tensorboard: a log directory (str or Path) or a ``torch.utils.tensorboard.SummaryWriter``: loss, loss
            scale, skipped steps, exponent histograms and underflow/overflow shares are written there after
            each host copy, to watch a run live (tags: ``precprof.export.events``; needs ``tensorboard``).
        wandb: True to log the same to the current ``wandb.run``, or a wandb run object (needs ``wandb``).
            Only the writer process (rank 0) writes to either.
        dashboard_layers: which layers get per-layer tags on those dashboards: ``"auto"`` (the default: every
            layer for a model of up to 32 captured layers, none beyond), ``"all"``, ``"none"``, or a list of
            qualified-name patterns (``fnmatch``, e.g. ``["transformer.h.0.*"]``); the aggregates over all
            layers are written either way (``precprof.export.events``). What is captured is ``modules``'.
        block_formats: on sampled steps, also evaluate the block-scaled formats (MXFP8, MXFP6, MXFP4, NVFP4:
            ``precprof.block_formats``) on what a block-scaled GEMM would read (each linear layer's input,
            weight and output gradient; ``capture/hooks.py``), in both block orientations: the
            ``tables.BLOCK_COLUMNS`` of the layers table. None (the default): on, unless the environment says
            ``PRECPROF_BLOCK_FORMATS=0`` (a run-wide switch for loops one cannot edit, e.g. a Trainer callback).
        block_groups: the layers whose operands a block-scaled GEMM reads are dealt into this many groups of
            about equal size, and each sampled step evaluates the block formats of one group in turn: every layer's
            numbers are exact for the steps it was evaluated on, each layer is evaluated on every
            ``block_groups``-th sampled step, and a sampled step pays for a ``1 / block_groups`` share of the
            what-if (bench/overhead.py). 1: every layer on every sampled step. None (the default): as many
            groups as keep the what-if within ``block_budget`` of the rest of a sampled step, from its measured
            cost (``capture/block_budget.py``: a few sampled steps evaluate none, to measure what it adds; the
            summary and the report say how many it took).
        block_budget: with ``block_groups=None``, the share of the rest of a sampled step that the block
            what-if may add (0.1).
        out: a run directory to stream into (a path, or a claimed ``precprof.rundir.RunDir``): each flush's rows
            go there as Parquet parts, written by a process of its own at the lowest priority
            (``capture.stream``, ``capture.writer_process``): host memory stays bounded, and a killed run keeps
            every step whose flush reached that process before the kill (not those still queued in this process:
            README, "In your own training loop"). Claimed (checked, locked, a first summary.json
            written) at ``attach()``; ``save()`` and ``report()`` then default to it (while attached, a look at
            the steps so far: the stream goes on, the run stays "running"). Only the writer rank writes; other
            ranks keep their steps rows. None (the default): every row is kept in memory until ``save()``.
        resume: with ``out``, continue the run already there (a job restarted from its checkpoint, with
            ``first_step`` = the checkpoint's step): rows it recorded at or after ``first_step`` are superseded
            by the new ones, sampling keeps the original run's rhythm, and the steps table marks the restart
            (``resumed``). A directory without a run starts one.
        overwrite: with ``out``, replace a run already there (precprof's files only).
        compile_beside: on a GPU, compile the statistics kernels (Triton) on a thread beside the training, and
            sample steps once they are ready (True, the default: with an empty kernel cache no step waits for
            a compile; the summary says how many steps were held). False: compile them at ``attach()``, which
            then takes as long as the compile (seconds with Triton's cache, minutes on a machine's first run),
            so that the steps asked for are sampled from the first one (tests, short runs). Under
            torch.distributed the kernels always compile at attach, so that every rank samples the same steps.

    On a step that is not sampled precprof has no hook on the model (they are installed for a sampled step
    and removed at its end: ``capture/hooks.py``), so a ``torch.compile``d model runs the graph it runs
    without precprof; a sampled step runs compiled code eagerly (``torch.compiler.set_stance("force_eager")``,
    torch 2.6 and later) so that every hook fires, with no graph break and no recompile.

    Call ``step()`` once per optimizer step, at its end (a loop that does not is warned: ``loop_order.py``). A
    tied parameter (one Parameter of two modules: tied embeddings) is recorded under the first module owning it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: Any = None,
        *,
        sample_every: int | None = None,
        overhead_budget: float = DEFAULT_BUDGET,
        modules: ModuleFilter | str | type[nn.Module] = None,
        memory: bool = True,
        memory_every: int | None = None,
        memory_peak: bool | None = None,
        reset_peak_memory: bool = False,
        weight_updates: bool = True,
        update_sample: int = 256,
        chunk: int | None = None,
        first_step: int = 0,
        reducer: Any = "auto",
        loss_scale: float | None = None,
        tensorboard: Any = None,
        wandb: Any = None,
        dashboard_layers: str | Sequence[str] = "auto",
        block_formats: bool | None = None,
        block_groups: int | None = None,
        block_budget: float = DEFAULT_SHARE,
        out: Any = None,
        resume: bool = False,
        overwrite: bool = False,
        compile_beside: bool = True,
    ) -> None:
        # every argument checked before anything is claimed or hooked: one line naming the one that is wrong
        a = arguments.checked(
            {
                "scaler": scaler,
                "sample_every": sample_every,
                "overhead_budget": overhead_budget,
                "modules": modules,
                "memory": memory,
                "memory_every": memory_every,
                "memory_peak": memory_peak,
                "reset_peak_memory": reset_peak_memory,
                "weight_updates": weight_updates,
                "update_sample": update_sample,
                "chunk": chunk,
                "first_step": first_step,
                "reducer": reducer,
                "loss_scale": loss_scale,
                "block_formats": block_formats,
                "block_groups": block_groups,
                "block_budget": block_budget,
                "resume": resume,
                "overwrite": overwrite,
                "compile_beside": compile_beside,
                "tensorboard": tensorboard,
                "wandb": wandb,
                "out": out,
            }
        )
        sample_every, first_step = a["sample_every"], a["first_step"]
        update_sample, chunk, block_groups = a["update_sample"], a["chunk"], a["block_groups"]
        self.model = given.checked_model(model)
        # several optimizers (Muon for the matrices and AdamW for the rest, say): each samples its own parameters
        self.optimizers = given.given_optimizers(optimizer)
        self.optimizer = self.optimizers[0] if self.optimizers else None
        self.scaler, self.wrappers_said = given.from_wrappers(scaler, loss_scale, model, optimizer)
        # a manual static loss scale ((loss * s).backward(), gradients / s): read at s, tables unscaled by it
        self.loss_scale = float(a["loss_scale"]) if a["loss_scale"] is not None else None
        self.sample_every = sample_every
        self.overhead_budget = float(a["overhead_budget"])
        self.module_filter: ModuleFilter = a["modules"]  # one pattern or type alone: a list of it
        # the checked values (a numpy int, a 0-d tensor, 0 for False: as the plain ones they stand for)
        self.memory_enabled = a["memory"]
        self.memory_every = a["memory_every"]
        self.memory_peak = a["memory_peak"]
        self.reset_peak_memory = a["reset_peak_memory"]
        self.weight_updates = a["weight_updates"] and optimizer is not None
        self._updates_asked = a["weight_updates"]
        self._optimizer_changes: list[dict[str, Any]] = []  # ``use_optimizer``'s, for the summary
        self._model_changes: list[dict[str, Any]] = []  # the model changed (``capture/replan.py``)
        self.update_sample = update_sample
        self.chunk = chunk
        formats = a["block_formats"]
        self._block_formats = formats if formats is not None else block_formats_from_env()
        self._blocks = BlockDeal(float(a["block_budget"]), block_groups)
        self._first_step = first_step
        # steps are sampled from here (a resumed run's start: it keeps the original run's rhythm)
        self._sample_origin = first_step
        self._sampler = Sampler(sample_every, self.overhead_budget, first_step)
        self._landed = LandedValues()
        self._out = out
        self._resume = a["resume"]
        self._overwrite = a["overwrite"]
        self._compile_beside = a["compile_beside"]
        self._owned_run: rundir.RunDir | None = None
        self._reducer_spec = a["reducer"]
        self._reducer: Any = None
        # dashboards: checked here (a missing package is a UserError at once), written after each host copy
        self._dashboards = LiveDashboards.create(
            tensorboard=tensorboard, wandb=wandb, layers=dashboard_layers
        )

        self._attached = False
        self._scaler_watch: ScalerWatch | None = None
        self._plan: CapturePlan | None = None
        self._hooks: StepHooks | None = None
        self._collector: Collector | None = None
        self._buffer: st.StatsBuffer | None = None
        self._updates: UpdateSampler | None = None
        self._tracker: Any = None
        self._clip_norms: clipwatch.ClipNorms | None = None
        self._stance = SampledStance()  # force_eager for the sampled steps, and a loop's own stance
        self._loop = LoopOrder()  # what the sampled steps saw of the loop's order (prof.step() misplaced)
        self._load = MachineLoad(writer_process.pids)  # other work on the machine while attached

        self._step = first_step
        self._sampling = False
        self._sample_reason = ""  # why the step in progress is sampled ("" when it is not)
        self._t_last = time.perf_counter()
        self._outside_s = 0.0  # this step's time in ``not_training`` blocks: not the step's
        self._writer_wait_s = (
            0.0  # the sampled step's wait for the stream's writer: precprof's, never a pause
        )
        self._outside_depth = 0
        self._pending: list[_PendingStep] = []
        # the last flush: a streamed run's steps go out every few seconds
        self._t_flushed = time.perf_counter()

        self._recorded = Recorded()
        self._autocast: dict[str, Any] = {}  # autocast as the first recorded forward saw it
        # the dtypes of the loss tensors step() was given (dtype -> steps): a 16-bit loss is a finding
        self._loss_dtypes: dict[torch.dtype, int] = {}
        self._status = T.STATUS_COMPLETE
        self._reason: str | None = None  # why the run is incomplete
        self._exit_cause: str | None = (
            None  # the cause ``__exit__`` marked the run incomplete with (``attach``)
        )
        self._device: torch.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------ attach/detach
    def __enter__(self) -> Profiler:
        self.attach()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._stance.explain(exc, self._step)  # (a fail_on_recompile error: why)
        if exc is not None and self._status == T.STATUS_COMPLETE:
            self.mark_incomplete(unsaved.cause(exc))
            self._exit_cause = self._reason
        # a second Ctrl-C in the detach that a first one began had cut its copy of the last steps short
        with _signals.deferred(None) if exc is not None else contextlib.nullcontext():
            self.detach()
            if exc is not None:  # its summary says why, not "running ... killed" (every step is on disk now)
                unsaved.say(self, exc)

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def current_step(self) -> int:
        """Index of the step in progress (the one the next ``step()`` call ends)."""
        return self._step

    @property
    def sampling(self) -> bool:
        """Whether the step in progress is sampled."""
        return self._sampling

    @property
    def _autocast_seen(self) -> dict[str, Any]:
        return self._autocast

    # what tests and benches read of the plan
    @property
    def _modules(self) -> list[_ModuleSlot]:
        return self._plan.modules if self._plan is not None else []

    @property
    def _rows(self) -> list[RowInfo]:
        return self._plan.rows.info if self._plan is not None else []

    def attach(self) -> Profiler:
        """Make the capture plan and arm the first step. Idempotent; ``detach()`` undoes it."""
        if self._attached:
            return self
        attached.claim(self)  # one left attached by a loop that stopped is detached first
        claims = self._owned_run is None and not self._resume  # a first attach claims ``out``
        try:
            self._attach()
        except BaseException:
            self._remove_hooks()
            self._close_stream()
            if self._owned_run is not None and claims:  # no step recorded: what the claim wrote goes (a retry
                self._owned_run.abandon()  # claims it anew; the dropped stream's writer process goes back)
                self._recorded, self._owned_run = Recorded(), None
            elif self._owned_run is not None:
                self._owned_run.release()
            raise
        self._attached = True
        # attached again after a `with` block that raised (a notebook cell run again): its run goes on, and is no
        # longer stopped by that exception (a status the user or a failed write set stays)
        stopped, self._exit_cause = (T.STATUS_INCOMPLETE, self._exit_cause), None
        if stopped[1] is not None and (self._status, self._reason) == stopped:
            self._status, self._reason = T.STATUS_COMPLETE, None
            self._saved = None if self._saved == stopped else self._saved
        unsaved.watch(self)  # an uncaught exception that ends the script: its run says so
        # the step in progress starts now: a re-attached Profiler does not count the time it was detached
        self._t_last = time.perf_counter()
        self._load.begin()  # (its stream's writer process started: its pid known)
        return self

    def _attach(self) -> None:
        # the statistics merge on the model's device: its first parameter's with data (each tensor read on its own)
        devices = [p.device for p in self.model.parameters()]
        real = [d for d in devices if d.type != "meta"]
        self._device = _compat.indexed_device(real[0]) if real else torch.device("cpu")
        self._make_parts()
        # a re-attached Profiler goes on counting where it stopped: its steps were recorded once, by number
        self._begin_step()

    def _remove_hooks(self) -> None:
        self._switch_due = self._switch_unseen = None
        if self._hooks is not None:
            self._hooks.remove(finished=False)  # a step still in progress at detach was cut off
        self._stance.end(self._step, False)
        if self._tracker is not None:
            self._tracker.detach()
        self._unhook_parts()

    def detach(self) -> None:
        """Remove every hook (also after an exception) and bring the host tables up to date."""
        if not self._attached:
            return
        self._attached = False
        raised = unsaved.in_flight()
        raised = raised if raised is not None and self._status == T.STATUS_COMPLETE else None
        if raised is not None:
            # the loop's `finally:` (or `except:`) around an exception that stopped training: the run is cut off by
            # it, as a `with` block that raised says (its save had read "complete", the cause nowhere)
            self.mark_incomplete(unsaved.cause(raised))
            self._exit_cause = self._reason
        self._load.end()  # the steps are timed: the last flush and the stream's close are not theirs
        hooks, clean = self._hooks, self._status == T.STATUS_COMPLETE
        has_data = hooks is not None and hooks.has_data and not (clean and hooks.no_step())
        self._remove_hooks()
        # a step in progress (crash, Ctrl-C, hooks removed mid-step) keeps its rows; at the end of a run that ended
        # normally, an evaluation alone or a backward none of the optimizers stepped on is no step
        if self._sampling and has_data:
            if self._block_formats:
                self._blocks.count_turn()
            self._pending.append(self._make_pending(None, None, None, partial=True))
            self._flush(sampled_step_done=True)
        else:
            self._flush(sampled_step_done=False)
        self._sampling = False
        self._close_stream()  # every flush on disk
        if self._dashboards is not None and self.is_writer:
            self._dashboards.close()
        if raised is not None:
            unsaved.say(self, raised)  # summary.json says it too, not "running ... killed", until a save

    def summary(self) -> dict[str, Any]:
        """The ``capture`` part of summary.json (``ProfilerResults.summary``), with ``machine_load``: how busy the
        machine was with other work while attached (``capture.machine_load``)."""
        return {**super().summary(), "machine_load": self._load.figures()}

    # ------------------------------------------------------------------------------------ block formats
    @property
    def block_groups(self) -> int:
        """How many groups the block-format what-if is dealt into now (see ``block_groups``)."""
        return self._blocks.groups

    def _adapt_block_groups(self, step: int, step_s: float) -> None:
        """After a sampled step's host copy: what its block what-if cost, for the number of groups."""
        assert self._buffer is not None and self._plan is not None
        block_s = self._buffer.block_timer.read_s()  # the device finished this step's work at the copy
        if not self._block_formats:
            return
        schedule, calls = getattr(self._tracker, "schedule", None), self._buffer.block_timer.last_calls
        memory = bool(schedule is not None and schedule.measuring)
        mean = None if self._reducer is None else mean_over_ranks(self._reducer, self._device)
        self._blocks.adapt(self._plan, step, step_s, block_s, mean, memory, calls)

    # ----------------------------------------------------------------------------------------- steps
    def _begin_step(self) -> None:
        ready = self._buffer is None or self._buffer.ready
        after_sampled = self._sampling  # the step that ended was sampled: its hooks are still in place
        self._sample_reason = self._sampler.decide(self._step, ready)
        self._sampling = bool(self._sample_reason)
        self._stance.begin(self._step, self._sampling)
        if not self._sampling and not after_sampled:
            return  # no hook of the step that ended to remove, no memory measure to end (25 + 14 us a step)
        if not self._sampling:
            if self._tracker is not None:
                self._tracker.begin_step(self._step, False)  # (removes its hooks)
            if self._hooks is not None:
                self._hooks.remove()  # left in place by the sampled step before, if it was
            return
        self._replan_if_changed()
        # the block groups take turns over the sampled steps (the same turn on every rank: same schedule)
        self._arm(self._blocks.next_turn())

    def _end_sampled_hooks(self) -> None:
        """The sampled step's hooks stop acting (and compiled code runs compiled again) before its copy; they
        come off in ``_begin_step`` unless the next step is sampled too."""
        if self._hooks is not None:
            self._hooks.pause()
        if self._tracker is not None:
            self._tracker.end_hooks(keep=True)
        self._stance.end(self._step, True, getattr(self._hooks, "stance_at_forward", None))

    def _make_pending(
        self, loss: Any, grad_norm: Any, tokens: int | None, partial: bool = False
    ) -> _PendingStep:
        now = time.perf_counter()
        scale, found, each = taken(self._scaler_watch, self.loss_scale)
        if isinstance(loss, torch.Tensor):
            # host metadata, no sync; named in the summary (str(dtype) took 12 us of an unsampled step)
            self._loss_dtypes[loss.dtype] = self._loss_dtypes.get(loss.dtype, 0) + 1
            loss = held_scalar(loss)  # read on the CPU, copied on a device (no sync)
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.detach().reshape(()).clone()
        if self._sampler.budgeted and not self._sampler.synchronized and not partial:
            # the loss and the skip flag on their way to the host, for the next sampling decisions (no sync)
            for value, skipped in self._landed.put(loss, found):
                self._sampler.observe_values(value, skipped)
        time_s = math.nan if partial else now - self._t_last - self._outside_s
        self._t_last, self._outside_s = now, 0.0
        step, reason, sampled = self._step, self._sample_reason, self._sampling
        pending = _PendingStep(step, loss, scale, found, grad_norm, time_s, sampled, tokens, reason, partial)
        pending.skipped_each = each
        return pending

    @_compat.never_traced  # inside a compiled train step: a graph break, and the step's bookkeeping eager
    def step(self, loss: Any = None, grad_norm: Any = None, tokens: int | None = None) -> None:
        """End the step in progress: call once per optimizer step, after ``scaler.update()``.

        ``loss`` and ``grad_norm``: numbers, or tensors of one element, which may be on the device: they are kept
        there and copied with the next sampled step's statistics (no sync here on steps that are not sampled). Without ``grad_norm``, the
        norm that ``torch.nn.utils.clip_grad_norm_`` returned in this step is recorded, if the loop clipped
        (``precprof.clipwatch``). ``tokens``: tokens processed in the step (>= 0), for throughput. Anything else is a one-line error (``capture/arguments.py``).
        """
        if not self._attached:
            raise RuntimeError(attached.not_attached(self))
        arguments.step_values(loss, grad_norm, tokens)  # host checks of what is passed: no sync
        entered = time.perf_counter()  # this call's own time, on an unsampled step, is precprof's
        started = self._t_last  # this step's start (the previous step's end)
        if self._sampling:
            self._note_updates_read()
            self._loop.judge(self._step, self._hooks)
            self._end_sampled_hooks()
            if self._block_formats:
                self._blocks.count_turn()
        clipped = self._clip_norms.take() if self._clip_norms is not None else None
        if grad_norm is None:
            grad_norm = clipped
        outside = self._outside_s
        pending = self._make_pending(loss, grad_norm, tokens)
        self._pending.append(pending)
        if not self._sampling:  # before a flush hands its row on: the row says if Dynamo compiled in it
            pending.compiled = self._sampler.observe(self._step, "", pending.time_s, _compat.compiles())
        if (
            self._sampling
            or len(self._pending) >= MAX_PENDING_STEPS
            or (entered - self._t_flushed >= records.STREAM_STEPS_EVERY_S and self._recorded.sink is not None)
        ):
            self._flush(sampled_step_done=self._sampling, timed=pending if self._sampling else None)
        elif self._dashboards is not None and self.is_writer:
            self._dashboards.tick()  # host only: a wandb row waiting for the loop's next wandb step
        if self._sampling:
            # a sampled step's time includes its copy: what it cost, for the budgets and the steps table
            self._t_last = time.perf_counter()
            step_s = self._t_last - started - outside
            if self._buffer is not None:
                self._adapt_block_groups(self._step, step_s)
            schedule = getattr(
                self._tracker, "schedule", None
            )  # (a step measuring memory: its own work, longer)
            measured = bool(schedule is not None and schedule.measuring)
            waited, self._writer_wait_s = self._writer_wait_s, 0.0
            self._sampler.observe(
                self._step, self._sample_reason, step_s, _compat.compiles(), measured, waited
            )
            if self._sampler.synchronized and self._sampler.budgeted and self._reducer is not None:
                # every rank samples the same steps: the next one planned now, the latest of the ranks' plans
                gap = torch.tensor([self._sampler.plan_gap()], dtype=torch.int64, device=self._device)
                self._sampler.next_step = self._step + int(self._reducer.reduce_max(gap).item())
        self._step += 1
        attached.settle(
            self
        )  # one whose loop stopped in a sampled step, seen over this one's steps: detached
        self._take_switch()
        sampled = self._sampling
        self._begin_step()
        if not sampled:
            self._sampler.own_step(time.perf_counter() - entered)

    @contextlib.contextmanager
    def not_training(self) -> Iterator[None]:
        """Time, memory and forwards inside are not the step's (an evaluation, a checkpoint between steps): left out
        of its rows, ``time_s``, cost, the overhead budget and its memory peak (the callbacks' evaluations)."""
        if not self._attached:  # no step in progress: its time came off the next attachment's first step
            yield
            return
        t0 = time.perf_counter()
        self._outside_depth += 1  # one inside another (a save's look at the tables) is timed once
        with contextlib.ExitStack() as inside:
            for part in (p for p in (self._hooks, self._tracker) if p is not None):
                inside.enter_context(part.outside())
            try:
                yield
            finally:
                self._outside_depth -= 1
                if not self._outside_depth:
                    self._outside_s += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------- host side
    def _flush(self, sampled_step_done: bool, timed: _PendingStep | None = None) -> None:
        """Copy pending step records (and, after a sampled step, its statistics) to the host. Syncs. Then hand
        the new rows to the stream writer (pickled and queued for its process: the step does not wait for the
        disk) and the dashboards (host data only: no further sync). ``timed``: the sampled step just ended,
        whose time in the steps table then includes this copy."""
        pending, self._pending = self._pending, []
        self._t_flushed = time.perf_counter()
        layers = sampled_step_done and self._buffer is not None and self._collector is not None
        step = pending[-1].step if pending else self._step
        if self._collector is not None:
            self._collector.copy(self._recorded, pending, layers, step)
        else:
            self._recorded.add_steps(pending, Recorded.step_floats(pending).values(None))
        if timed is not None and self._recorded.new.step_rows:
            row = self._recorded.new.step_rows[-1]
            if row[T.STEP] == timed.step:
                # a wait for the stream's writer is the step's time too (and precprof's: never a pause)
                self._writer_wait_s = self._recorded.make_room()
                row[T.TIME_S] = time.perf_counter() - (self._t_last - timed.time_s)
        new = self._recorded.take()
        if self._dashboards is not None and self.is_writer:
            self._dashboards.write(new)

    def memory_scope(self, name: str = "(loss)") -> contextlib.AbstractContextManager[None]:
        """Context manager: activations saved for backward inside it (e.g. a loss computed outside the
        model's forward) are attributed to ``name`` in the memory table. A no-op without memory tracking."""
        if self._tracker is not None and hasattr(self._tracker, "scope"):
            scope: contextlib.AbstractContextManager[None] = self._tracker.scope(name)
            return scope
        return contextlib.nullcontext()
