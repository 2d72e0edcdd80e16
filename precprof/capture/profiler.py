"""The Profiler: hooks on a model, its optimizer and GradScaler that record per-layer statistics.

What is recorded on a sampled step, for every captured module (see ``Profiler``'s docstring for which):

- ``activation``: every floating tensor the module outputs (tuples, lists, dicts and ModelOutputs are
  walked), all calls of the step aggregated into one row;
- ``activation_grad``: the gradients of those outputs, through ``Tensor.register_hook`` on each output,
  registered from the forward hook (``register_full_backward_hook`` breaks on in-place ops such as
  ``ReLU(inplace=True)``);
- ``weight``: the module's own parameters, as the forward pass sees them (first call of the step);
- ``weight_grad``: the accumulated gradient of each parameter (``register_post_accumulate_grad_hook``; with
  gradient accumulation the last accumulation of the step wins);
- ``weight_update``: for a strided sample of each parameter's elements, the update the optimizer applied,
  and how many nonzero updates would vanish if the weight were held in bf16 / fp16.

Hooks never synchronise with the device: statistics accumulate into a preallocated device buffer
(``precprof.stats.StatsBuffer``); the loss scale and the scaler's found-inf flag are read as device tensors
(``GradScaler.update`` is wrapped for the duration of the attachment to read them before the update). The
buffer, the losses of the steps since the last sampled step and the memory rows are copied to the host once,
in ``Profiler.step()`` of a sampled step: that is precprof's one synchronisation point. On steps that are not
sampled, hooks return at once and no tensor hook is registered.

``torch.no_grad()`` forwards (evaluation between training steps) are ignored, so they never pollute a
training step's rows.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from precprof import parts, rundir, taxonomy
from precprof import stats as st
from precprof import tables as T
from precprof._run_finisher import machine_describer, run_finisher
from precprof._version import __version__
from precprof.capture import clipwatch, columns
from precprof.capture.block_budget import DEFAULT_SHARE, BlockBudget
from precprof.capture.hooks import HookFactories, reads_block_operands
from precprof.capture.memory_tracker import MemoryTracker
from precprof.capture.recorded import Recorded
from precprof.capture.records import (
    MAX_PENDING_STEPS,
    _ModuleSlot,
    _ParamSlot,
    _PendingStep,
    _Row,
)
from precprof.capture.reducer import RankReducer
from precprof.capture.scaler import ScalerWatch
from precprof.capture.stream import StreamWriter
from precprof.capture.updates import UpdateSampler
from precprof.export.live import LiveDashboards
from precprof.stats import transfer

ModuleFilter = Sequence[str | type[nn.Module]] | None


class Profiler(HookFactories):
    """Record per-layer dtypes, exponent histograms and exact underflow/overflow counts during training.

    Args:
        model: the module to watch (also a DDP/FSDP wrapper or a ``torch.compile``d module).
        optimizer: optional; enables ``weight_update`` rows and gradient/optimizer-state memory.
        scaler: optional ``torch.amp.GradScaler``; its scale and skipped steps are recorded and gradients are
            stored unscaled.
        sample_every: record layers every N steps (step 0 is sampled); 0 records steps only.
        modules: which modules to capture — None: every leaf module plus every module that owns parameters
            directly; otherwise a list of qualified-name patterns (``fnmatch``, e.g. ``"transformer.h.*.mlp.*"``)
            and/or module types.
        memory: track memory per component (``precprof.capture.memory_tracker``) on sampled steps.
        memory_peak: also replay the allocator's events of sampled steps, for each phase's peak and what was
            allocated at the step's peak, by part (``precprof.capture.peak``). None (the default): on CUDA
            (the caching allocator's history; host calls only), off on the CPU, where it needs torch.profiler's
            memory events and a program's own torch.profiler could not start during a sampled step; True: on
            the CPU too (the built-in loop's choice); False: off.
        reset_peak_memory: let precprof reset the process's CUDA peak-memory counters at phase boundaries, for
            exact counter peaks of every phase where a step has no replay. Off by default: a loop that reads
            ``torch.cuda.max_memory_allocated()`` (its own logs, Lightning's, the Trainer's) would read precprof's
            phases instead of its own peak. The built-in loop turns it on.
        weight_updates: record ``weight_update`` rows (needs ``optimizer``).
        update_sample: elements per parameter sampled (strided) for the weight-update statistics.
        chunk: scratch chunk size for the statistics (see ``StatsBuffer``).
        reducer: how statistics combine across ranks. ``"auto"``: under an initialised torch.distributed
            process group of more than one rank, ``precprof.capture.reducer.RankReducer`` (counts and histograms
            summed, absmax/absmin reduced, rank 0 writes); None: this process only.
        loss_scale: a manual static loss scale, for loops that scale by hand (``(loss * 1024).backward()``,
            then divide the gradients): gradients are read at that scale and stored unscaled, as with a
            GradScaler. Not with ``scaler``.
        tensorboard: a log directory (str or Path) or a ``torch.utils.tensorboard.SummaryWriter``: loss, loss
            scale, skipped steps, exponent histograms and underflow/overflow shares are written there after
            each host copy, to watch a run live (tags: ``precprof.export.events``; needs ``tensorboard``).
        wandb: True to log the same to the current ``wandb.run``, or a wandb run object (needs ``wandb``).
            Only the writer process (rank 0) writes to either.
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
            cost (``capture/block_budget.py``; the summary and the report say how many it took).
        block_budget: with ``block_groups=None``, the share of the rest of a sampled step that the block
            what-if may add (0.1).
        out: a run directory to stream into while training runs (a path, or a ``precprof.rundir.RunDir``
            already claimed): each flush's rows are written there as Parquet parts on a background thread
            (``precprof.capture.stream``), so the recording's host memory stays bounded and a killed run keeps
            every step flushed before the kill. The directory is claimed (checked, locked, a first summary.json
            written) at ``attach()``; ``save()`` and ``report()`` then default to it. Only the writer rank
            writes; other ranks keep their steps rows only. None (the default): every row is kept in memory until ``save()``.
        resume: with ``out``, continue the run already there (a job restarted from its checkpoint, with
            ``first_step`` = the checkpoint's step): rows it recorded at or after ``first_step`` are superseded
            by the new ones, sampling keeps the original run's rhythm, and the steps table marks the restart
            (``resumed``). A directory without a run starts one.
        overwrite: with ``out``, replace a run already there (precprof's files only).

    Call ``step()`` once per optimizer step, at its end. Statistics of a tied parameter (one Parameter owned
    by two modules, e.g. tied embeddings) are recorded under the first module that owns it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        *,
        sample_every: int = 10,
        modules: ModuleFilter = None,
        memory: bool = True,
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
        block_formats: bool | None = None,
        block_groups: int | None = None,
        block_budget: float = DEFAULT_SHARE,
        out: Any = None,
        resume: bool = False,
        overwrite: bool = False,
    ) -> None:
        if sample_every < 0:
            raise ValueError("sample_every must be >= 0 (0 records steps only)")
        if block_groups is not None and block_groups < 1:
            raise ValueError(f"block_groups must be >= 1 or None, got {block_groups}")
        if not (block_budget > 0 and math.isfinite(block_budget)):
            raise ValueError(f"block_budget must be a number > 0, got {block_budget!r}")
        if loss_scale is not None:
            if scaler is not None:
                raise ValueError(
                    "loss_scale declares a manual static loss scale; with a GradScaler leave it out"
                )
            if not (math.isfinite(loss_scale) and loss_scale > 0):
                raise ValueError(f"loss_scale must be a finite number > 0, got {loss_scale!r}")
        self.model = model
        # wrappers such as accelerate's AcceleratedOptimizer hold the real optimizer, whose hooks fire
        while optimizer is not None and not hasattr(optimizer, "_optimizer_step_pre_hooks"):
            inner = getattr(optimizer, "optimizer", None)
            if inner is None or inner is optimizer:
                break
            optimizer = inner
        self.optimizer = optimizer
        self.scaler = scaler
        # a manual static loss scale ((loss * s).backward(), then the gradients divided by s): the gradients
        # are read at scale s, and the tables are unscaled by it
        self.loss_scale = float(loss_scale) if loss_scale is not None else None
        self.sample_every = sample_every
        self.module_filter = modules
        self.memory_enabled = memory
        self.memory_peak = memory_peak
        self.reset_peak_memory = reset_peak_memory
        self.weight_updates = weight_updates and optimizer is not None
        self.update_sample = update_sample
        self.chunk = chunk
        self._block_formats = bool(block_formats) if block_formats is not None else block_formats_from_env()
        self._block_outputs = {}
        self._block_groups_spec = block_groups
        self._block_budget_share = float(block_budget)
        self._block_budget = BlockBudget(self._block_budget_share, block_groups, n_layers=0)
        self._block_loads: list[int] = [1]
        self._block_turn = 0
        self._first_step = first_step
        self._sample_origin = (
            first_step  # steps are sampled every sample_every from here (a resumed run's start)
        )
        self._out = out
        self._resume = resume
        self._overwrite = overwrite
        self._owned_run: rundir.RunDir | None = None
        self._reducer_spec = reducer
        self._reducer: Any = None
        # dashboards: checked here (a missing package is a UserError at once), written after each host copy
        self._dashboards = LiveDashboards.create(tensorboard=tensorboard, wandb=wandb)

        self._attached = False
        self._handles: list[Any] = []
        self._scaler_watch: ScalerWatch | None = None
        self._modules: list[_ModuleSlot] = []
        self._params: list[_ParamSlot] = []
        self._rows: list[_Row] = []
        self._buffer: st.StatsBuffer | None = None
        self._updates: UpdateSampler | None = None
        self._tracker: Any = None
        self._clip_norms: clipwatch.ClipNorms | None = None

        self._step = first_step
        self._sampling = False
        self._order_counter = 0
        self._t_last = time.perf_counter()
        self._pending: list[_PendingStep] = []
        self._step_has_data = False

        self._recorded = Recorded()
        self._autocast_seen: dict[str, Any] = {}
        # the dtypes of the loss tensors step() was given (name -> steps): a 16-bit loss is a finding
        self._loss_dtypes: dict[str, int] = {}
        self._status = T.STATUS_COMPLETE
        self._reason: str | None = None
        self._device: torch.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------ attach/detach
    def __enter__(self) -> Profiler:
        self.attach()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and self._status == T.STATUS_COMPLETE:
            self.mark_incomplete(f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__)
        self.detach()

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

    def _selected(self, name: str, module: nn.Module) -> bool:
        if self.module_filter is None:
            has_children = next(module.children(), None) is not None
            has_params = next(module.parameters(recurse=False), None) is not None
            return (not has_children) or has_params
        for f in self.module_filter:
            if isinstance(f, str):
                if fnmatch.fnmatchcase(name, f):
                    return True
            elif isinstance(module, f):
                return True
        return False

    def _new_row(self, module: str, module_type: str, tensor: str, param: str = "") -> _Row:
        row = _Row(len(self._rows), module, module_type, tensor, param)
        self._rows.append(row)
        return row

    def _block_rows(self) -> list[int]:
        """The rows the hooks may add block-format statistics to (hooks.py), each given a slot of the block
        accumulator: module outputs (a linear layer may read them), linear layers' own inputs and output
        gradients, and the matrix weights of the modules whose operands a block-scaled GEMM reads. None
        without block formats."""
        if not self._block_formats:
            return []
        rows = []
        for slot in self._modules:
            mtype = type(slot.module).__name__
            rows.append(slot.activation.index)
            if slot.input is not None:
                rows.append(slot.input.index)
            if taxonomy.is_linear_type(mtype):
                rows.append(slot.activation_grad.index)
            if reads_block_operands(mtype):
                rows += [row.index for _, p, row in slot.weights if p.dim() >= 2]
        return rows

    def attach(self) -> Profiler:
        """Register every hook. Idempotent; ``detach()`` removes them all."""
        if self._attached:
            return self
        try:
            self._attach()
        except BaseException:
            self._remove_hooks()
            self._close_stream()
            if self._owned_run is not None:
                self._owned_run.release()
            raise
        self._attached = True
        # the step in progress starts now: a re-attached Profiler does not count the time it was detached
        self._t_last = time.perf_counter()
        return self

    def _attach(self) -> None:
        # the statistics merge on the model's device: its first parameter's that holds data (a parameter on
        # ``meta`` has none; each tensor is still read on its own device)
        devices = [p.device for p in self.model.parameters()]
        real = [d for d in devices if d.type != "meta"]
        self._device = real[0] if real else torch.device("cpu")
        seen_params: set[int] = set()
        self._modules, self._params, self._rows = [], [], []
        for name, module in self.model.named_modules():
            if not self._selected(name, module):
                continue
            mtype = type(module).__name__
            slot = _ModuleSlot(
                name=name,
                module=module,
                activation=self._new_row(name, mtype, T.ACTIVATION),
                activation_grad=self._new_row(name, mtype, T.ACTIVATION_GRAD),
                weights=[],
            )
            if self._block_formats and taxonomy.is_linear_type(mtype):
                slot.input = self._new_row(T.input_module(name), T.INPUT_MODULE_TYPE, T.ACTIVATION)
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen_params:
                    continue
                seen_params.add(id(p))
                slot.weights.append((pname, p, self._new_row(name, mtype, T.WEIGHT, pname)))
                grad_row = self._new_row(name, mtype, T.WEIGHT_GRAD, pname) if p.requires_grad else None
                self._params.append(_ParamSlot(name, pname, p, grad_row, -1))
            self._modules.append(slot)
        self._buffer = st.StatsBuffer(
            max(len(self._rows), 1),
            self._device,
            chunk=self.chunk,
            block_rows=self._block_rows(),
            # the Triton kernels of the model's dtypes compile here, at attach, not in a hook
            dtypes=sorted({p.dtype for p in self.model.parameters() if p.is_floating_point()}, key=str),
        )
        self._reducer = self._resolve_reducer()
        self._open_stream()

        self._deal_block_groups()
        for slot in self._modules:
            self._handles.append(slot.module.register_forward_pre_hook(self._make_pre_hook(slot)))
            self._handles.append(slot.module.register_forward_hook(self._make_fwd_hook(slot)))
        for ps in self._params:
            if ps.grad_row is not None:
                self._handles.append(
                    ps.tensor.register_post_accumulate_grad_hook(self._make_grad_acc_hook(ps))
                )

        if self.weight_updates and self.optimizer is not None:
            # sampled where each parameter lives at the step (one group per device: an offloaded layer on the
            # CPU, the rest on the GPU); a parameter on ``meta`` has no data and is not sampled
            tracked = [ps for ps in self._params if ps.grad_row is not None]
            self._updates = UpdateSampler(tracked, self.update_sample, self._device)
            self._handles.append(self.optimizer.register_step_pre_hook(self._opt_pre_hook))
            self._handles.append(self.optimizer.register_step_post_hook(self._opt_post_hook))

        if self.scaler is not None and hasattr(self.scaler, "update"):
            self._scaler_watch = ScalerWatch(self.scaler, self._device, lambda: self._attached)
            self._scaler_watch.patch()

        if self.memory_enabled:
            self._tracker = MemoryTracker(
                self.model,
                self.optimizer,
                peak=self.memory_peak,
                reset_peaks=self.reset_peak_memory,
                own=lambda: (self._buffer, self._updates),  # named profiler_buffers at the peak
            )
            self._tracker.attach()

        # the loop's own clip_grad_norm_ gives the gradient norm when step() is not handed one
        self._clip_norms = clipwatch.ClipNorms(self.model.parameters())
        clipwatch.watch(self._clip_norms)

        # a re-attached Profiler goes on counting where it stopped: its steps were recorded once, by number
        self._begin_step()

    def _open_stream(self) -> None:
        """With ``out``: claim the run directory (the writer rank), open this attachment's segment of its stream
        and hand the recording a stream writer. The sampling origin becomes the run's first segment's start."""
        if self._out is None:
            return
        if self._recorded.sink is not None:  # re-attached: the same segment goes on, parts numbered on
            self._recorded.sink.reopen()
            return
        if not self.is_writer:
            self._recorded = Recorded(keep=False)  # rank 0 writes; the others keep their steps rows only
            return
        if isinstance(self._out, rundir.RunDir):
            run = self._out
        else:
            first = {
                T.SUMMARY_CAPTURE: {"sample_every": self.sample_every, "sample_origin": self._first_step}
            }
            describe = machine_describer()
            if describe is not None:  # a run killed before it saves is still planned for this machine
                # never at the cost of the user's attach: the end of the run detects it again
                with contextlib.suppress(Exception):
                    first.update(describe(str(self._device)))
            run = self._owned_run = rundir.claim(
                self._out, overwrite=self._overwrite, resume=self._resume, summary=first, option="out"
            )
        segment = parts.new_segment(run.path, self._first_step)
        self._sample_origin = parts.segments(run.path)[0].start
        self._recorded = Recorded(StreamWriter(run.path, segment))

    def _close_stream(self) -> None:
        sink = self._recorded.sink
        if sink is not None:
            sink.close()

    @property
    def run_dir(self) -> Path | None:
        """The run directory this Profiler streams into (``out``), None without one."""
        sink = self._recorded.sink
        if sink is not None:
            return Path(sink.run_dir)
        if isinstance(self._out, rundir.RunDir):
            return self._out.path
        return Path(self._out) if self._out is not None else None

    def _resolve_reducer(self) -> Any:
        spec = self._reducer_spec
        if spec != "auto":
            return spec
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return RankReducer()
        return None

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the run directory (rank 0 under torch.distributed)."""
        return self._reducer is None or bool(getattr(self._reducer, "is_writer", True))

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._scaler_watch is not None:
            self._scaler_watch.unpatch()
        if self._tracker is not None:
            self._tracker.detach()
        if self._clip_norms is not None:
            clipwatch.unwatch(self._clip_norms)

    def detach(self) -> None:
        """Remove every hook (also after an exception) and bring the host tables up to date."""
        if not self._attached:
            return
        self._attached = False
        self._remove_hooks()
        # a step that was in progress (crash, Ctrl-C, or hooks removed mid-step) keeps what it recorded
        if self._sampling and self._step_has_data:
            self._pending.append(self._make_pending(None, None, None, partial=True))
            self._flush(sampled_step_done=True)
        else:
            self._flush(sampled_step_done=False)
        self._sampling = False
        self._close_stream()  # every flush on disk
        if self._dashboards is not None and self.is_writer:
            self._dashboards.close()

    @property
    def block_groups(self) -> int:
        """How many groups the block-format what-if is dealt into now (see ``block_groups``)."""
        return self._block_budget.groups

    def _deal_block_groups(self, groups: int | None = None) -> None:
        """Deal the layers whose operands get the block-format what-if into ``groups`` (at attach: the budget's
        start) groups of about equal cost: largest first, each to the lightest group so far (ties to the lowest
        group, so every rank deals alike). A layer's cost is the sum of its weight's dimensions (in + out
        features for a linear layer: what its input and output gradient add per token; the weight itself is a
        small share)."""
        slots = [s for s in self._modules if reads_block_operands(type(s.module).__name__)]
        if groups is None:  # at attach: a re-attached Profiler keeps what its budget measured
            if self._block_budget.n_layers != len(slots):
                self._block_budget = BlockBudget(
                    self._block_budget_share, self._block_groups_spec, n_layers=len(slots)
                )
            groups = self._block_budget.groups
        loads = [0] * groups

        def cost(slot: _ModuleSlot) -> int:
            return max((sum(p.shape) for _, p, _ in slot.weights if p.dim() == 2), default=1)

        for slot in sorted(slots, key=lambda s: -cost(s)):  # stable: model order among equals
            g = loads.index(min(loads))
            slot.block_group = g
            loads[g] += cost(slot)
        self._block_loads = loads

    def _adapt_block_groups(self, step: int, step_s: float) -> None:
        """After a sampled step's host copy: measure what its block what-if cost and re-deal the layers when
        the budget asks for another number of groups (the same decision on every rank)."""
        assert self._buffer is not None
        block_s = self._buffer.block_timer.read_s()  # the device finished this step's work at the copy
        budget = self._block_budget
        if not (self._block_formats and budget.adaptive):
            return
        total = sum(self._block_loads)
        share = self._block_loads[self._block_turn] / total if total else 0.0
        ratio = budget.estimate(step_s, block_s, share)
        if self._reducer is not None:
            # every rank must deal alike: the mean of the ranks' estimates (a rank without one counts 0)
            t = torch.tensor([ratio or 0.0, ratio is not None], dtype=torch.float64, device=self._device)
            mean, n = self._reducer.reduce_sum(t).cpu().tolist()
            ratio = mean / n if n else None
        if budget.observe(step, ratio):
            self._deal_block_groups(budget.groups)

    # ----------------------------------------------------------------------------------------- steps
    def _is_sampled(self, step: int) -> bool:
        return self.sample_every > 0 and (step - self._sample_origin) % self.sample_every == 0

    def _begin_step(self) -> None:
        self._sampling = self._is_sampled(self._step)
        if self._sampling:
            self._block_turn = (self._step - self._sample_origin) // self.sample_every % self.block_groups
        self._step_has_data = False
        self._order_counter = 0
        self._block_outputs.clear()
        if self._sampling:
            if self._buffer is not None:
                self._buffer.reset()
            if self._updates is not None:
                self._updates.reset()
            for row in self._rows:
                row.calls = 0
                row.dtypes = []
            for slot in self._modules:
                slot.called = False
                slot.order = slot.input_order = -1
        if self._tracker is not None:
            self._tracker.begin_step(self._step, self._sampling)

    def _make_pending(
        self, loss: Any, grad_norm: Any, tokens: int | None, partial: bool = False
    ) -> _PendingStep:
        now = time.perf_counter()
        scale, found = (
            self._scaler_watch.take() if self._scaler_watch is not None else (self.loss_scale or 1.0, None)
        )
        if isinstance(loss, torch.Tensor):
            name = str(loss.dtype).removeprefix("torch.")  # host metadata: no sync
            self._loss_dtypes[name] = self._loss_dtypes.get(name, 0) + 1
            loss = loss.detach().reshape(-1)[0] if loss.numel() else None
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.detach().reshape(())
        pending = _PendingStep(
            step=self._step,
            loss=loss,
            scale=scale,
            found_inf=found,
            grad_norm=grad_norm,
            time_s=math.nan if partial else now - self._t_last,
            sampled=self._sampling,
            tokens=tokens,
        )
        self._t_last = now
        return pending

    def step(self, loss: Any = None, grad_norm: Any = None, tokens: int | None = None) -> None:
        """End the step in progress: call once per optimizer step, after ``scaler.update()``.

        ``loss`` and ``grad_norm`` may be device tensors: they are kept on the device and copied with the
        next sampled step's statistics (no sync here on steps that are not sampled). Without ``grad_norm``, the
        norm that ``torch.nn.utils.clip_grad_norm_`` returned in this step is recorded, if the loop clipped
        (``precprof.capture.clipwatch``). ``tokens``: tokens processed in the step, for throughput.
        """
        if not self._attached:
            raise RuntimeError("Profiler.step() called while the profiler is not attached (use `with prof:`)")
        clipped = self._clip_norms.take() if self._clip_norms is not None else None
        if grad_norm is None:
            grad_norm = clipped
        started = self._t_last  # this step's start (the previous step's end)
        self._pending.append(self._make_pending(loss, grad_norm, tokens))
        if self._sampling or len(self._pending) >= MAX_PENDING_STEPS:
            self._flush(sampled_step_done=self._sampling)
            if self._sampling and self._buffer is not None:
                self._adapt_block_groups(self._step, time.perf_counter() - started)
        self._step += 1
        self._begin_step()

    # ------------------------------------------------------------------------------------- host side
    def _flush(self, sampled_step_done: bool) -> None:
        """Copy pending step records (and, after a sampled step, its statistics) to the host. Syncs. Then hand
        the new rows to the stream writer (queued for its thread: the step does not wait for the disk) and the
        dashboards (host data only: no further sync)."""
        self._copy_to_host(sampled_step_done)
        new = self._recorded.take()
        if self._dashboards is not None and self.is_writer:
            self._dashboards.write(new)

    def _copy_to_host(self, sampled_step_done: bool) -> None:
        """The Profiler's sync: the pending steps' scalars and, after a sampled step, its statistics (rows,
        block accumulator, weight-update counts; reduced over ranks first when distributed) reach the host in
        one transfer per device (``stats.transfer.to_host``)."""
        pending, self._pending = self._pending, []
        floats = Recorded.step_floats(pending)
        tensors = [floats.device] if floats.device is not None else []
        layers = sampled_step_done and self._buffer is not None
        step = pending[-1].step if pending else self._step
        order = {s.name: s.order for s in self._modules}
        order |= {T.input_module(s.name): s.input_order for s in self._modules if s.input is not None}
        n_stats = 0
        if layers:
            if self._reducer is not None:
                order, stats_part, counts_part = self._reduce_sampled(step, order)
            else:
                stats_part, counts_part = self._sampled_tensors()
            n_stats = len(stats_part)
            tensors += stats_part + counts_part
        host = transfer.to_host(tensors)  # the sync
        step_scale = self._recorded.add_steps(
            pending, floats.values(host.pop(0) if floats.device is not None else None)
        )
        if not layers:
            return
        self._collect_layers(step, step_scale, order, host[:n_stats], host[n_stats:])
        if self._tracker is not None:
            try:
                rows = self._tracker.end_step(step)
            except Exception as e:  # memory accounting must never take training down
                rows = []
                self._memory_error = f"{type(e).__name__}: {e}"
            if self._reducer is not None and hasattr(self._reducer, "reduce_memory"):
                rows = self._reducer.reduce_memory(rows)  # collective: every rank, every sampled step
            self._recorded.add_memory(rows)
        self._recorded.add_memory(
            [
                {
                    T.STEP: step,
                    T.COMPONENT: T.PROFILER_BUFFERS,
                    T.MODULE: "",
                    T.DTYPE: "int64",
                    T.BYTES: self.buffer_bytes + self.scratch_bytes,
                }
            ]
        )

    def _sampled_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A sampled step's device data, not copied: every device's rows and block accumulator; every device
        group's weight-update counts."""
        assert self._buffer is not None
        return self._buffer.device_tensors(), self._updates.device_counts() if self._updates else []

    def _reduce_sampled(
        self, step: int, order: dict[str, int]
    ) -> tuple[dict[str, int], list[torch.Tensor], list[torch.Tensor]]:
        """Under a process group: the rows, block sums and update counts reduced over ranks (collectives:
        every rank reaches this on the same sampled step), with the rows' host metadata and the order."""
        assert self._buffer is not None and self._reducer is not None
        device_rows = self._reducer.reduce_rows(self._buffer.dense())
        block_sums = self._reducer.reduce_sum(self._buffer.blocks_dense())  # counts and sums add
        meta = self._reducer.reduce_meta(
            [
                {
                    "calls": r.calls,
                    "dtypes": list(r.dtypes),
                    "module": r.module,
                    "tensor": r.tensor,
                    "param": r.param,
                }
                for r in self._rows
            ],
            order,
            step=step,
        )
        for r, m in zip(self._rows, meta["rows"], strict=True):
            r.calls, r.dtypes = int(m["calls"]), list(m["dtypes"])
        counts = [self._reducer.reduce_sum(self._updates.combined())] if self._updates is not None else []
        return meta["order"], [device_rows, block_sums], counts

    def _collect_layers(
        self,
        step: int,
        scale: float,
        order: dict[str, int],
        stats_host: list[np.ndarray],
        counts_host: list[np.ndarray],
    ) -> None:
        """Layer, histogram and weight-update rows of a sampled step from the host copies of
        :meth:`_sampled_tensors` (or of :meth:`_reduce_sampled`'s tensors)."""
        assert self._buffer is not None
        counts: np.ndarray | None = None
        if self._reducer is not None:
            data, blocks = stats_host[0], self._buffer.expand_blocks(stats_host[1])
            counts = counts_host[0] if counts_host else None
        else:
            data, blocks = self._buffer.from_host(stats_host)
            if self._updates is not None:
                counts = self._updates.host_counts(counts_host)
        active = [row for row in self._rows if row.calls > 0]
        if active:
            cols, hist = columns.layer_columns(step, active, data, scale, order)
            cols.update(columns.block_columns(active, blocks, self._buffer.blocks_seen, scale))
            self._recorded.add_layers(step, cols, hist)
        if self._updates is not None and counts is not None:
            types = {slot.name: type(slot.module).__name__ for slot in self._modules}
            updates = self._updates.rows(counts, step, order, types)
            if updates:
                self._recorded.add_layers(step, {c: [u[c] for u in updates] for c in updates[0]})

    def memory_scope(self, name: str = "(loss)") -> contextlib.AbstractContextManager[None]:
        """Context manager: activations saved for backward inside it (e.g. a loss computed outside the
        model's forward) are attributed to ``name`` in the memory table. A no-op without memory tracking."""
        if self._tracker is not None and hasattr(self._tracker, "scope"):
            scope: contextlib.AbstractContextManager[None] = self._tracker.scope(name)
            return scope
        return contextlib.nullcontext()

    @property
    def buffer_bytes(self) -> int:
        """Bytes precprof holds persistently on the device: statistics rows, update samples, memory tracking."""
        total = self._buffer.buffer_bytes if self._buffer is not None else 0
        if self._updates is not None:
            total += self._updates.nbytes
        if self._tracker is not None:
            total += int(getattr(self._tracker, "buffer_bytes", 0))
        return total

    @property
    def scratch_bytes(self) -> int:
        """Bytes of reusable scratch the statistics hold (bounded by the chunk size)."""
        return self._buffer.scratch_bytes if self._buffer is not None else 0

    # ------------------------------------------------------------------------------------ results
    def tables(self) -> dict[str, pd.DataFrame]:
        """The four tables recorded so far (see precprof/tables.py for the schema). Syncs if steps are pending."""
        if self._pending and not self._attached:
            self._flush(sampled_step_done=False)
        return self._recorded.tables()

    def mark_incomplete(self, reason: str) -> None:
        """Mark the run as incomplete (a crash, a nan that stopped training, Ctrl-C), with the cause."""
        self._status = T.STATUS_INCOMPLETE
        self._reason = reason

    @property
    def status(self) -> tuple[str, str | None]:
        return self._status, self._reason

    def _low_precision_buffers(self) -> list[dict[str, str]]:
        """Floating buffers of the captured modules held in fp16 or bf16 (BatchNorm running statistics after
        ``model.half()``, say): the guide keeps them in fp32."""
        out = []
        for slot in self._modules:
            for bname, buf in slot.module.named_buffers(recurse=False):
                if buf is not None and buf.dtype in (torch.float16, torch.bfloat16):
                    out.append(
                        {"module": slot.name, "buffer": bname, "dtype": str(buf.dtype).removeprefix("torch.")}
                    )
        return out

    def skipped_tensors(self) -> list[dict[str, Any]]:
        """Tensors the statistics could not read (on the ``meta`` device: no data), per row, with how many
        times over the run."""
        if self._buffer is None:
            return []
        out = []
        for r in self._rows:
            count = int(self._buffer.skipped_total[r.index])
            if count:
                out.append(
                    {
                        "module": r.module,
                        "tensor": r.tensor,
                        "param": r.param,
                        "count": count,
                        "reason": "on the meta device (no data to read)",
                    }
                )
        return out

    def summary(self) -> dict[str, Any]:
        """The ``capture`` part of summary.json: what was captured and how."""
        modules = []
        for slot in self._modules:
            modules.append(
                {
                    "name": slot.name,
                    "type": type(slot.module).__name__,
                    "params": {pname: list(p.shape) for pname, p, _ in slot.weights},
                }
            )
        n_params = sum(p.numel() for p in self.model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {
            "sample_every": self.sample_every,
            "block_formats": (self._block_budget.describe() if self._block_formats else False),
            "device": str(self._device),
            "stats_engine": {
                **st.engine_status([self._device]),
                "used": self._buffer.engines if self._buffer is not None else {},
            },
            "skipped_tensors": self.skipped_tensors(),
            "steps_recorded": self._recorded.steps_recorded,
            "sampled_steps": self._recorded.sampled_steps,
            "sample_origin": self._sample_origin,
            "stream": self._stream_summary(),
            "modules_captured": len(self._modules),
            "modules": modules,
            "n_params": n_params,
            "param_bytes": param_bytes,
            "profiler_buffer_bytes": self.buffer_bytes,
            "profiler_scratch_bytes": self.scratch_bytes,
            "profiler_buffer_share_of_params": self.buffer_bytes / param_bytes if param_bytes else None,
            "model_class": type(_unwrapped(self.model)).__name__,
            "precision_seen": self.precision_seen(),
            "autocast": self._autocast_seen or {"enabled": False, "dtype": None},
            "scaler": type(self.scaler).__name__ if self.scaler is not None else None,
            "scaler_enabled": bool(_scaler_enabled(self.scaler)) if self.scaler is not None else None,
            "static_loss_scale": self.loss_scale,
            "low_precision_buffers": self._low_precision_buffers(),
            "loss_dtypes": dict(self._loss_dtypes),
            "histogram_shift_exact": not (self._scaler_watch is not None and self._scaler_watch.non_pow2),
            "weight_update_sample": self.update_sample if self.weight_updates else 0,
            "fp8_recipe": "per-tensor current scaling, scale = 2^floor(log2(fmax / amax))",
            "memory_error": getattr(self, "_memory_error", None),
        }

    def _stream_summary(self) -> dict[str, Any] | None:
        sink = self._recorded.sink
        if sink is None:
            return None
        return {
            "segment": sink.segment.path.name,
            "parts_written": sink.parts_written,
            "error": sink.error,
            "resumed_from": self._first_step if sink.segment.index > 0 else None,
        }

    def precision_seen(self) -> str | None:
        """The precision mode this loop trains in, as the built-in loop names them (``precprof.modes``), read
        from what the hooks saw: autocast and its dtype on the first recorded forward pass, a torchao Float8
        linear layer, a GradScaler, the parameters' dtype. None before any forward pass was recorded."""
        if not self._autocast_seen:
            return None
        model = _unwrapped(self.model)
        if any(type(m).__name__ == "Float8Linear" for m in model.modules()):
            return "fp8"
        if self._autocast_seen.get("enabled"):
            dtype = self._autocast_seen.get("dtype")
            return {"bfloat16": "bf16", "float16": "fp16"}.get(str(dtype), f"autocast {dtype}")
        sizes: dict[torch.dtype, int] = {}
        for p in model.parameters():
            if p.is_floating_point():
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        main = max(sizes, key=lambda d: sizes[d]) if sizes else torch.float32
        if main == torch.bfloat16:
            return "bf16-pure"
        if main == torch.float16:
            return "fp16-pure"
        if self._device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
        return "fp32"

    def run_summary(
        self, summary: dict[str, Any] | None = None, status: str | None = None, reason: str | None = None
    ) -> dict[str, Any]:
        """``summary`` completed with what the recorder knows: version, status and cause, the ``capture``
        block (and the distributed description)."""
        if status is not None:
            self._status = status
        if reason is not None:
            self._reason = reason
        full: dict[str, Any] = dict(summary or {})
        full[T.SUMMARY_VERSION] = __version__
        full[T.SUMMARY_STATUS] = self._status
        full[T.SUMMARY_INCOMPLETE_REASON] = self._reason
        capture = dict(full.get(T.SUMMARY_CAPTURE) or {})
        capture.update(self.summary())
        if self._reducer is not None and hasattr(self._reducer, "describe"):
            capture["distributed"] = self._reducer.describe(self.model)
        full[T.SUMMARY_CAPTURE] = capture
        return full

    def model_facts(self) -> dict[str, Any] | None:
        """What the memory tracker learned about the model (refines the memory projection); None if unknown."""
        if self._tracker is None or not hasattr(self._tracker, "model_facts"):
            return None
        try:
            facts: dict[str, Any] | None = self._tracker.model_facts()
        except Exception:  # facts only refine the projection
            return None
        return facts

    def save(
        self,
        run_dir: str | Path | None = None,
        summary: dict[str, Any] | None = None,
        status: str | None = None,
        reason: str | None = None,
        *,
        render: bool = False,
        report_path: str | Path | None = None,
    ) -> Path:
        """Write the run directory: the four Parquet tables, the recommendation and summary.json (``summary``
        merged in), and report.html (or ``report_path``) when ``render``; see ``precprof.pipeline.finish_run``
        for the order.

        A failure to write (full disk, read-only file system) does not raise: summary.json then says
        "incomplete" with the cause. Under torch.distributed only the writer (rank 0) writes; other ranks
        return the path without touching it. ``run_dir`` defaults to ``out``; saving there turns its stream
        into the four tables and releases the directory's lock if this Profiler claimed it.
        """
        if run_dir is None:
            run_dir = self.run_dir
            if run_dir is None:
                raise ValueError("save() needs a run directory: save(run_dir), or Profiler(..., out=run_dir)")
        run_dir = Path(run_dir)
        if not self.is_writer:
            return run_dir
        finisher = run_finisher()
        if finisher is None:
            raise RuntimeError("precprof.pipeline, which writes run directories, is not loaded")
        full = self.run_summary(summary, status, reason)
        written = finisher(
            run_dir, self.tables(), full, facts=self.model_facts(), render=render, report_path=report_path
        )
        self._status = written[T.SUMMARY_STATUS]
        self._reason = written[T.SUMMARY_INCOMPLETE_REASON]
        if self._owned_run is not None and not self._attached and run_dir == self._owned_run.path:
            self._owned_run.release()
            self._owned_run = None
        return run_dir

    def report(self, path: str | Path | None = None, summary: dict[str, Any] | None = None) -> Path:
        """Write the run directory (``path`` itself, or the folder of ``path`` when it names an .html file;
        default ``out``) and render the HTML report there; returns the report's path."""
        if path is None:
            path = self.run_dir
            if path is None:
                raise ValueError("report() needs a path: report(run_dir), or Profiler(..., out=run_dir)")
        path = Path(path)
        html = path.suffix == ".html"
        run_dir = path.parent if html else path
        self.save(run_dir, summary=summary, render=True, report_path=path if html else None)
        return path if html else run_dir / T.REPORT_FILE


def iter_module_names(model: nn.Module) -> Iterable[str]:
    """Qualified names of the modules a default Profiler captures, in registration order."""
    prof = Profiler(model, memory=False)
    return [name for name, m in model.named_modules() if prof._selected(name, m)]


BLOCK_FORMATS_ENV = "PRECPROF_BLOCK_FORMATS"


def block_formats_from_env() -> bool:
    """``PRECPROF_BLOCK_FORMATS``: "0", "false", "no" or "off" turn the block-format what-if off; on otherwise."""
    return os.environ.get(BLOCK_FORMATS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/FSDP1 (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    for _ in range(8):
        attr = _WRAPPERS.get(type(model).__name__)
        inner = getattr(model, attr, None) if attr else None
        if not isinstance(inner, nn.Module) or inner is model:
            break
        model = inner
    return model


# wrapper class name -> the attribute holding the wrapped module
_WRAPPERS = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "OptimizedModule": "_orig_mod",
}


def _scaler_enabled(scaler: Any) -> bool:
    """Whether a GradScaler (or a scaler like it) scales at all: ``GradScaler(enabled=False)`` is a no-op."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
