"""The parts a ``capture.profiler.Profiler`` reads by, made at attach and again at a re-plan: the capture plan, the
statistics buffer, the weight-update sampler, the step hooks, the GradScaler's watch, the memory tracker, the
collector that copies a sampled step to the host, and the reducer across ranks under torch.distributed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from precprof import _compat, clipwatch
from precprof import stats as st
from precprof._notice import notice
from precprof.capture import every_rank, given
from precprof.capture.block_budget import BlockDeal
from precprof.capture.collect import Collector
from precprof.capture.hooks import StepHooks
from precprof.capture.loop_order import LoopOrder
from precprof.capture.memory_tracker import MemoryTracker
from precprof.capture.plan import CapturePlan, ModuleFilter
from precprof.capture.reducer import RankReducer
from precprof.capture.sampling import Sampler
from precprof.capture.scaled_passes import ScaledPasses
from precprof.capture.scaler import ScalerWatch
from precprof.capture.updates import UpdateSampler


class PartsAssembly:
    """The part of ``capture.profiler.Profiler`` that makes what its hooks and its host copy read by."""

    model: nn.Module
    optimizers: list[Any]
    scaler: Any
    loss_scale: float | None
    module_filter: ModuleFilter
    memory_enabled: bool
    memory_peak: bool | None
    reset_peak_memory: bool
    memory_every: int | None
    weight_updates: bool
    update_sample: int
    chunk: int | None
    buffer_bytes: int
    scratch_bytes: int
    _attached: bool
    _block_formats: bool
    _blocks: BlockDeal
    _sampler: Sampler
    _compile_beside: bool
    _device: torch.device
    _reducer_spec: Any
    _reducer: Any
    _plan: CapturePlan | None
    _buffer: st.StatsBuffer | None
    _updates: UpdateSampler | None
    _hooks: StepHooks | None
    _scaler_watch: ScalerWatch | None
    _tracker: Any
    _collector: Collector | None
    _clip_norms: clipwatch.ClipNorms | None
    _autocast: dict[str, Any]
    _loop: LoopOrder

    _open_stream: Callable[[], None]  # ``capture.results.ProfilerResults``'s

    def _make_parts(self, replan: bool = False) -> None:
        """The capture plan and what reads by it; ``replan``: again, the run's reducer and stream kept."""
        plan = self._plan = CapturePlan.of(self.model, self.module_filter, self._block_formats, not replan)
        if not replan:
            self._reducer = self._resolve_reducer()
            if isinstance(self._reducer, RankReducer):  # (before the run directory's stream opens)
                every_rank.meet(self._reducer)
        self._sampler.synchronized = self._reducer is not None
        self._buffer = st.StatsBuffer(
            max(len(plan.rows), 1),
            self._device,
            chunk=self.chunk,
            block_rows=plan.block_rows(),
            # the Triton kernels of the model's dtypes compile now, never in a hook: beside the training (steps
            # are sampled once they are ready), or here for every rank alike (ranks sample the same steps)
            dtypes=sorted({p.dtype for p in self.model.parameters() if p.is_floating_point()}, key=str),
            background=self._compile_beside and self._reducer is None and not replan,
        )
        if not replan:
            self._open_stream()
        self._blocks.deal(plan, device_type=self._device.type)
        self._updates = None if replan else self._updates  # (the old plan's parameters)
        if self.weight_updates and self.optimizers:
            # sampled where each parameter lives at the step (one group per device: an offloaded layer on the
            # CPU, the rest on the GPU), in the step of the optimizer that holds it (none: not sampled, as its
            # weight moves in no step precprof sees; a group added later is sampled from the next sampled step on);
            # a parameter on ``meta`` has no data and is not sampled
            updates = UpdateSampler.following(plan.params, self.optimizers, self.update_sample, self._device)
            if not updates.tracked and any(ps.grad_row >= 0 for ps in plan.params):
                notice(given.NOT_HELD)
            self._updates = updates
        self._hooks = StepHooks(
            plan,
            self._buffer,
            self._device,
            optimizers=self.optimizers,
            updates=self._updates,
            autocast_seen=self._autocast,
            scaled=self._scales_loss,
            root=self.model,
            loop=self._loop,
        )
        if self.scaler is not None and hasattr(self.scaler, "update"):
            hooks = self._hooks
            # the passes that began at a scaled loss: gradients of any other are at scale 1
            hooks.passes = ScaledPasses(self.scaler, lambda: hooks.installed)
            self._scaler_watch = ScalerWatch(
                self.scaler,
                self._device,
                lambda: self._attached,
                optimizers=self.optimizers,
                unscaling=hooks.scaler_unscaling,
                scaling=hooks.passes.scaled,
            )
            self._scaler_watch.patch()
        if self.memory_enabled:
            self._tracker = MemoryTracker(
                self.model,
                self.optimizers,
                peak=self.memory_peak,
                reset_peaks=self.reset_peak_memory,
                own=lambda: (self._buffer, self._updates),  # named profiler_buffers at the peak
                every=self.memory_every,
                watch_shapes=self._reducer is None,  # every rank measures the same steps
            )
            self._tracker.attach()
            self._loop.trained.on_trainable = self._tracker.schedule.trains  # (layers unfrozen: measured)
        self._collector = Collector(
            plan,
            self._buffer,
            self._updates,
            self._reducer,
            self._tracker,
            lambda: self.buffer_bytes + self.scratch_bytes,
        )
        # the loop's own clip_grad_norm_ gives the gradient norm when step() is not handed one
        self._clip_norms = clipwatch.ClipNorms(self.model.parameters())
        clipwatch.watch(self._clip_norms)

    def _scales_loss(self) -> bool:
        """Whether the gradients are multiplied by a loss scale (an enabled GradScaler, a manual ``loss_scale``)."""
        scaler, manual = self.scaler, self.loss_scale
        return _compat.scaler_enabled(scaler) if scaler is not None else manual is not None and manual != 1.0

    def _resolve_reducer(self) -> Any:
        spec = self._reducer_spec
        if spec != "auto":
            return spec
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return RankReducer(joinables=(self.model, *self.optimizers))
        return None

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the run directory (rank 0 under torch.distributed)."""
        return self._reducer is None or bool(getattr(self._reducer, "is_writer", True))
