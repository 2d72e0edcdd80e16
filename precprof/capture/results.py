"""What a Profiler hands out: the four tables, the capture summary, and the run directory it saves (through
``precprof.pipeline``, registered as the run finisher). ``ProfilerResults`` is the results half of
``capture.profiler.Profiler``; the recording half (attach, hooks, steps) lives there."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from precprof import _compat, _signals, parts, rundir, runfiles
from precprof import stats as st
from precprof import tables as T
from precprof._run_finisher import machine_describer, run_finisher, run_renderer
from precprof._version import __version__
from precprof.capture import arguments, attached, resumed, unsaved
from precprof.capture.block_budget import BlockDeal
from precprof.capture.collect import Collector
from precprof.capture.compiled_facts import compiled_elsewhere, compiled_parts
from precprof.capture.model_facts import (
    FP8_WHATIF_RECIPE,
    block_recipes,
    dropout_layers,
    dropped_biases,
    float64_run,
    fp8_emulated,
    fp8_recipes,
    low_precision_buffers,
    low_precision_linear,
    main_float_dtype,
    model_class_name,
    model_info,
    modules_without_forward,
    optimizer_settings,
    resumed_optimizer_changes,
)
from precprof.capture.plan import CapturePlan
from precprof.capture.recorded import Recorded
from precprof.capture.records import module_entries
from precprof.capture.reducer import wrapper_info
from precprof.capture.sampling import Sampler
from precprof.capture.scaler import ScalerWatch, norm_type_said, scaler_enabled
from precprof.capture.storage import sharded_states
from precprof.capture.stream import StreamWriter
from precprof.capture.updates import UpdateSampler
from precprof.modes import FP64


class ProfilerResults:
    """The tables, summary and run directory of a ``Profiler`` (see ``capture.profiler``)."""

    model: nn.Module
    scaler: Any
    wrappers_said: dict[str, Any]  # the capture's words of the framework's wrappers (``given.from_wrappers``)
    optimizer: Any
    optimizers: list[Any]
    sample_every: int | None
    loss_scale: float | None
    weight_updates: bool
    update_sample: int
    memory_enabled: bool
    _clip_norms: Any
    _attached: bool
    _pending: list[Any]
    _recorded: Recorded
    _status: str
    _reason: str | None
    _saved: tuple[str, str | None] | None = None  # the status and cause the last save wrote
    _saved_into: frozenset[Path] = frozenset()  # the run directories claimed for a save (``_ours``)
    _device: torch.device
    _plan: CapturePlan | None
    _buffer: st.StatsBuffer | None
    _updates: UpdateSampler | None
    _tracker: Any
    _stance: Any  # capture.stance.SampledStance
    _loop: Any  # capture.loop_order.LoopOrder
    _hooks: Any
    _reducer: Any
    _collector: Collector | None
    _scaler_watch: ScalerWatch | None
    _sampler: Sampler
    _block_formats: bool
    _blocks: BlockDeal
    _first_step: int
    _sample_origin: int
    _loss_dtypes: dict[torch.dtype, int]
    _optimizer_changes: list[dict[str, Any]]
    _optimizer_given_at: int | None
    _updates_read_from: int | None
    _updates_read_steps: int
    _model_changes: list[dict[str, Any]]
    _owned_run: rundir.RunDir | None
    _out: Any
    _overwrite: bool
    _resume: bool

    @property
    def buffer_bytes(self) -> int:
        """Bytes precprof holds persistently on the device: statistics rows and update samples. The memory
        tracker's own bytes are host Python objects (addresses, totals), not device memory: not counted."""
        total = self._buffer.buffer_bytes if self._buffer is not None else 0
        if self._updates is not None:
            total += self._updates.nbytes
        return total

    @property
    def scratch_bytes(self) -> int:
        """Bytes of reusable scratch the statistics hold (bounded by the chunk size)."""
        return self._buffer.scratch_bytes if self._buffer is not None else 0

    @property
    def _autocast_seen(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def is_writer(self) -> bool:
        raise NotImplementedError

    def _flush(self, sampled_step_done: bool) -> None:
        raise NotImplementedError

    def not_training(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    # ------------------------------------------------------------------------- the run directory
    def _open_stream(self) -> None:
        """With ``out``: claim the run directory (the writer rank), open this attachment's segment of its stream
        and hand the recording a stream writer. The sampling origin becomes the run's first segment's start."""
        if self._out is None:
            return
        if self._recorded.sink is not None:  # re-attached: the same segment goes on, parts numbered on
            unsaved.refuse_taken(self)  # (unless another Profiler took the run over)
            self._recorded.sink.reopen()
            return
        if not self.is_writer:
            self._recorded = Recorded(keep=False)  # rank 0 writes; the others keep their steps rows only
            return
        if isinstance(self._out, rundir.RunDir):
            run = self._out
        else:
            capture: dict[str, Any] = self._sampler.first_entries()  # a killed run's sampling, its budget
            capture["model_class"] = model_class_name(_compat.unwrapped(self.model))  # a killed run's title
            first: dict[str, Any] = {T.SUMMARY_CAPTURE: capture}
            # a killed distributed run still says it was one (its counts are sums over ranks)
            if self._reducer is not None:
                with contextlib.suppress(Exception):
                    first[T.SUMMARY_CAPTURE]["distributed"] = self._reducer.describe(self.model)
            describe = machine_describer()
            if describe is not None:  # a run killed before it saves is still planned for this machine
                # never at the cost of the user's attach: the end of the run detects it again
                with contextlib.suppress(Exception):
                    first.update(describe(str(self._device)))
            # the optimizers the continued run had: its summary is replaced at the claim
            previous = None
            if self._resume:
                with contextlib.suppress(Exception):  # (a damaged summary: the claim says so)
                    previous = runfiles.read_summary(self._out).get(T.SUMMARY_CAPTURE)
            self._optimizer_changes[:0] = resumed_optimizer_changes(
                previous, self._first_step, self.optimizers
            )
            run = self._owned_run = rundir.claim(
                self._out, overwrite=self._overwrite, resume=self._resume, summary=first, option="out"
            )
            unsaved.hold(self, run)  # detached, its run can be taken over; collected, it lets go
        if self._resume and self._first_step == 0:
            rundir.warn_replaced(run.path)
        segment = parts.new_segment(run.path, self._first_step)
        self._sample_origin = self._sampler.origin = parts.segments(run.path)[0].start
        self._recorded = Recorded(StreamWriter(run.path, segment))
        if self._resume and parts.segments(run.path)[0].start < self._first_step:
            self._go_on_from(run.path)

    def _go_on_from(self, path: Path) -> None:
        """A run resumed at ``first_step`` goes on from the steps its earlier attempts recorded before it
        (``capture.resumed``)."""
        reducer = self._reducer if hasattr(self._reducer, "earlier_samples") else None
        dashboards = getattr(self, "_dashboards", None)
        # (the block turns: not under torch.distributed, where the other ranks, which read nothing, take them too)
        blocks = self._blocks if self._block_formats and self._reducer is None else None
        resumed.go_on_from(
            path, self._first_step, self._sampler, reducer, dashboards, self._loop.trained, blocks
        )

    def _close_stream(self) -> None:
        self._recorded.close_stream()

    @property
    def run_dir(self) -> Path | None:
        """The run directory this Profiler streams into (``out``), None without one."""
        sink = self._recorded.sink
        if sink is not None:
            return Path(sink.run_dir)
        if isinstance(self._out, rundir.RunDir):
            return self._out.path
        return Path(self._out) if self._out is not None else None

    # ------------------------------------------------------------------------------------ results
    def tables(self) -> dict[str, pd.DataFrame]:
        """The four tables so far (precprof/tables.py), every step ended included (syncs if one is pending)."""
        with self.not_training():
            if self._pending:
                self._flush(sampled_step_done=False)
            return self._recorded.tables()

    @property
    def compiled_steps(self) -> list[int]:
        """The steps in which torch.compile compiled: left out of the run's time, and of its throughput."""
        return list(self._sampler.compiled_at)

    def mark_incomplete(self, reason: str) -> None:
        """Mark the run as incomplete (a crash, a nan that stopped training, Ctrl-C), with the cause."""
        self._status, self._reason, self._saved = T.STATUS_INCOMPLETE, reason, None

    @property
    def status(self) -> tuple[str, str | None]:
        """The run's status and why it is incomplete: as the last save wrote it (what it could not write is that
        save's own, never the next one's), else as recorded (``mark_incomplete``)."""
        return self._saved or (self._status, self._reason)

    def skipped_tensors(self) -> list[dict[str, Any]]:
        """Tensors the statistics could not read (``stats.buffer.unreadable``: on the ``meta`` device, sparse,
        complex, a wrapper subclass), per row, with how many times over the run and why; then the parameters
        whose weight updates the update sample could not read, for the same reasons (``UpdateSampler.skipped``)."""
        if self._buffer is None or self._plan is None:
            return []
        out = []
        for r in self._plan.rows.info:
            count = int(self._buffer.skipped_total[r.index])
            if count:
                out.append(
                    {
                        "module": r.module,
                        "tensor": r.tensor,
                        "param": r.param,
                        "count": count,
                        "reason": self._buffer.skipped_why.get(r.index, "not readable"),
                    }
                )
        skipped_updates = self._updates.skipped if self._updates is not None else {}
        for (module, param), (count, why) in skipped_updates.items():
            out.append(dict(module=module, tensor=T.WEIGHT_UPDATE, param=param, count=count, reason=why))
        return out

    def summary(self) -> dict[str, Any]:
        """The ``capture`` part of summary.json: what was captured and how."""
        modules = module_entries(self._plan, self._loop.trained)
        plan = self._plan
        # per module, its parameters recorded under another module (a tied head: {"weight": its embedding})
        shared = {slot.name: dict(slot.shared) for slot in plan.modules if slot.shared} if plan else {}
        # per module, its parameters whose first owner was not captured: {param: {"module", "type"}}
        outside = (
            {
                slot.name: {p: {"module": m, "type": t} for p, (m, t) in slot.shared_outside.items()}
                for slot in plan.modules
                if slot.shared_outside
            }
            if plan
            else {}
        )
        # per matmul layer (linear layers and convolutions), the captured modules whose outputs it read as its
        # input (an empty list: it read only its own input row, T.input_module)
        gemm_inputs = (
            {
                slot.name: sorted({plan.rows.info[r].module for r in slot.input_from})
                for slot in plan.modules
                if slot.reads_input
            }
            if plan is not None
            else None
        )
        # the input rows that held a tensor the model was called with (its own input, passed on by containers)
        model_inputs = sorted(T.input_module(s.name) for s in plan.modules if s.model_input) if plan else []
        n_params = sum(_compat.global_numel(p) for p in self.model.parameters())  # the model's, every rank's
        param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {
            "sample_every": self.sample_every,
            "sampling": self._sampler.describe(self._recorded.cut_off_reason),
            "block_formats": (self._blocks.describe() if self._block_formats else False),
            "device": str(self._device),
            "stats_engine": {
                **st.engine_status([self._device]),
                "used": self._buffer.engines if self._buffer is not None else {},
                "launch": self._buffer.launches if self._buffer is not None else {},
                "compiled_beside_training_s": self._buffer.warm_s if self._buffer is not None else None,
                "compile_error": self._buffer.warm_error if self._buffer is not None else None,
                "compile_phases_s": self._buffer.warm_phases if self._buffer is not None else {},
                "compile_ahead_error": self._buffer.ahead_error if self._buffer is not None else None,
            },
            "skipped_tensors": self.skipped_tensors(),
            "steps_recorded": self._recorded.steps_recorded,
            "sampled_steps": self._recorded.sampled_steps,
            "sample_origin": self._sample_origin,
            "stream": self._stream_summary(),
            "modules_captured": len(self._plan.modules) if self._plan is not None else 0,
            "modules": modules,
            "shared_params": shared,
            "shared_outside": outside,
            **({"gemm_inputs": gemm_inputs, "model_inputs": model_inputs} if gemm_inputs is not None else {}),
            **(plan.norm_facts() if plan is not None else {"norm_inputs_from": {}, "norms_fp32_inside": []}),
            "modules_without_forward": modules_without_forward(self.model) if plan is not None else [],
            "n_params": n_params,
            "param_bytes": param_bytes,
            "profiler_buffer_bytes": self.buffer_bytes,
            "profiler_scratch_bytes": self.scratch_bytes,
            "profiler_buffer_share_of_params": self.buffer_bytes / param_bytes if param_bytes else None,
            "model_class": model_class_name(_compat.unwrapped(self.model)),
            "precision_seen": self.precision_seen(),
            "fp8_emulated": fp8_emulated(_compat.unwrapped(self.model)),
            # None: no recorded forward pass saw autocast (nothing sampled), which is not "off"
            "autocast": dict(self._autocast_seen) or None,
            "scaler": type(self.scaler).__name__ if self.scaler is not None else None,
            "scaler_enabled": bool(scaler_enabled(self.scaler)) if self.scaler is not None else None,
            "scaler_growth_interval": _compat.scaler_growth_interval(self.scaler),
            **self.wrappers_said,  # scaler_from (a GradScaler not given, found on a wrapper: where), its request
            "compiled": compiled_parts(self.model),
            "compiled_elsewhere": compiled_elsewhere(self.model, self._stance.entries_before),
            "loop_stance": self._stance.summary(),  # a stance the loop set itself
            "loop_order": self._loop.summary(),  # prof.step() misplaced, an optimizer not followed (loop_order.py)
            "dropout_layers": dropout_layers(self.model),
            "static_loss_scale": self.loss_scale,
            "low_precision_buffers": low_precision_buffers(self.model) if plan is not None else [],
            "loss_dtypes": {str(d).removeprefix("torch."): n for d, n in self._loss_dtypes.items()},
            # a histogram unscaled by log2(scale) is exact for powers of two only: a scaler's, or a manual one's
            "histogram_shift_exact": not (
                (self._scaler_watch is not None and self._scaler_watch.non_pow2)
                or (self.loss_scale is not None and not st.is_power_of_two(self.loss_scale))
            ),
            "weight_update_sample": self.update_sample if self.weight_updates else 0,
            "optimizer": optimizer_settings(
                self.optimizers,
                self._plan.params if self._plan is not None else (),
                self._scaler_watch is not None,
                self._updates.carry if self._updates is not None else None,
            ),
            # a new optimizer followed from a step on (``use_optimizer``): {"step", "from", "to"}, in order
            "optimizer_changes": [dict(c) for c in self._optimizer_changes],
            # an optimizer given after the run began (``use_optimizer``): from which step its updates were read
            "updates_from": self.updates_from(),
            "updates_read_steps": self._updates_read_steps,  # sampled steps whose optimizer step was read
            "model_changes": [dict(c) for c in self._model_changes],  # planned again (replan.py)
            **self._loop.trained_summary(self.model),  # requires_grad changed; not in the optimizer
            "fp8_recipe": fp8_recipes(_compat.unwrapped(self.model)),  # what its Float8Linear layers ran
            "block_recipe": block_recipes(_compat.unwrapped(self.model)),  # what its MX layers ran
            # the nn.Linear biases their torchao training weight's F.linear leaves out (MXFP8 through quantize_)
            "bias_dropped": dropped_biases(_compat.unwrapped(self.model)),
            "fp8_whatif_recipe": FP8_WHATIF_RECIPE,  # what every FP8 what-if assumes, whatever the run ran
            "memory_error": self._collector.memory_error if self._collector is not None else None,
            "memory_steps": self._tracker.schedule.describe() if hasattr(self._tracker, "schedule") else None,
            "memory_enabled": self.memory_enabled,
            # the norm the loop clipped by, when it was not the 2-norm ("inf": max |g|); what grad_norm holds
            "grad_norm_type": norm_type_said(self._clip_norms),
            # module forwards of sampled steps that ran in eval mode with grad on (an evaluation): not read
            "eval_forwards_ignored": self._hooks.eval_forwards if self._hooks is not None else 0,
            # module forwards of sampled steps an activation checkpoint ran again (read once; saved: what it keeps)
            "checkpointed_forwards": self._hooks.checkpointed_forwards if self._hooks is not None else 0,
            # forwards of sampled steps in the model's own no_grad call of itself (an evaluation, not read)
            "self_call_forwards_unread": self._hooks.self_call_forwards if self._hooks is not None else 0,
            # sampled steps whose backward left no weight gradient in .grad (torch.autograd.grad): none read
            "weight_grads_unread_steps": self._hooks.weight_grads_unread if self._hooks is not None else 0,
            # the modules whose weight gradients were not read on sampled steps that read others', with how many
            "weight_grads_unread_modules": dict(getattr(self._hooks, "weight_grads_unread_in", {})),
            # the matmul that made the model's output (capture/output_head.py): the block plan's output head
            "output_head": self._hooks.head_found if self._hooks is not None else None,
        }

    def _stream_summary(self) -> dict[str, Any] | None:
        sink = self._recorded.sink
        if sink is None:
            return None
        return {
            "segment": sink.segment.path.name,
            "parts_written": sink.parts_written,
            "error": sink.error,
            "writer": sink.writer,  # "process" (its own), or "thread" where the process could not start
            "writer_note": sink.writer_note,
            **sink.timing(),  # the training's thread's wait for the writer (waited_s, waits), its pickling
            "resumed_from": self._first_step if sink.segment.index > 0 else None,
        }

    def precision_seen(self) -> str | None:
        """The precision mode this loop trains in, as the built-in loop names them (``precprof.modes``), read
        from what the hooks saw: autocast and its dtype on the first recorded forward pass, a torchao Float8
        linear layer, torchao's MX layers (their format, "mxfp8": no mode of the built-in loop), float64
        parameters ("fp64": ``float64_run``), a wrapper's mixed precision (FSDP's ``MixedPrecisionPolicy(
        param_dtype=torch.bfloat16)`` over fp32 parameters: bf16), the parameters' dtype; None before a forward."""
        autocast = self._autocast_seen
        if not autocast:
            return None
        model = _compat.unwrapped(self.model)
        if (layers := low_precision_linear(model)) is not None:  # torchao's FP8 or MX training layers
            return layers
        if float64_run(main := main_float_dtype(model), model, bool(autocast.get("enabled"))):
            return FP64
        if autocast.get("enabled"):
            dtype = autocast.get("dtype")
            return {"bfloat16": "bf16", "float16": "fp16"}.get(str(dtype), f"autocast {dtype}")
        if self._reducer is not None:  # FSDP's (or DDP's) mixed precision: fp32 masters, 16-bit compute
            info = wrapper_info(self.model)
            mixed = {"bfloat16": "bf16", "float16": "fp16"}.get(str(info.get("param_dtype")))
            if mixed and info.get("storage_dtypes") == ["float32"]:
                return mixed
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
        """``summary`` completed with what the recorder knows: version, status and cause, the ``model`` block
        (where ``summary`` has none), the ``capture`` block (and the distributed description)."""
        if status is not None:
            self._status = status
        if reason is not None:
            self._reason = reason
        full: dict[str, Any] = dict(summary or {})
        full[T.SUMMARY_VERSION] = __version__
        full[T.SUMMARY_STATUS] = self._status
        full[T.SUMMARY_INCOMPLETE_REASON] = self._reason
        full.setdefault(T.SUMMARY_MODEL, model_info(_compat.unwrapped(self.model)))
        given = dict(full.get(T.SUMMARY_CAPTURE) or {})
        # what the recorder knows, and what the caller knows where it does not (a Trainer's torch_compile)
        capture = {**given, **{k: v for k, v in self.summary().items() if v is not None or k not in given}}
        if self._reducer is not None and hasattr(self._reducer, "describe"):
            capture["distributed"] = self._reducer.describe(self.model)
            if sharded_states(self.optimizers):
                capture["distributed"].setdefault("semantics", {})["optimizer_states"] = SHARDED_STATES
        full[T.SUMMARY_CAPTURE] = capture
        return full

    def updates_from(self) -> dict[str, int | None] | None:
        """From which step the weight updates were read, and why, for the summary: {"step": the first sampled
        step whose optimizer step was read (None: none yet), "optimizer_given_at": the step in progress when
        ``use_optimizer`` gave the Profiler an optimizer, having followed none}; None when it had one from the
        start (its updates are read from the first sampled step)."""
        if self._optimizer_given_at is None:
            return None
        return {"step": self._updates_read_from, "optimizer_given_at": self._optimizer_given_at}

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
        overwrite: bool = False,
    ) -> Path:
        """Write the run directory: the four Parquet tables, the recommendation and summary.json (``summary``
        merged in), and report.html (or ``report_path``) when ``render``; see ``precprof.pipeline.finish_run``
        for the order.

        A directory not yet this Profiler's is claimed first, as ``Profiler(out=...)`` claims one
        (``rundir.claim``): an empty name, a file, a place that cannot be created, a run another process writes,
        and a run already there (unless ``overwrite``: precprof's files of it are replaced) are refused with a
        one-line ``RunDirError`` before anything is written. A failure to write (full disk, read-only file
        system) does not raise: summary.json then says "incomplete" with the cause. Under torch.distributed
        only the writer (rank 0) writes; other ranks return the path without touching it. ``run_dir`` defaults
        to ``out``; saving there turns its stream into the four tables and releases the directory's lock if this
        Profiler claimed it, once detached: while attached, a save there is a snapshot of the run so far, which
        goes on streaming (``_snapshot``); elsewhere, an incomplete run saying it is still recording.
        """
        arguments.save_status(status, reason)
        if run_dir is None:
            run_dir = self.run_dir
            if run_dir is None:
                raise ValueError("save() needs a run directory: save(run_dir), or Profiler(..., out=run_dir)")
        run_dir = rundir.check_name(run_dir, "path")  # (an empty one was the working directory)
        # nothing recorded (never attached, its attach refused): no run to write, nor one to write over
        if not (self._attached or self._recorded.steps_recorded or self._pending or self._ours(run_dir)):
            raise RuntimeError(attached.NOTHING_RECORDED if self._plan is None else unsaved.RECORDED_NONE)
        if not self.is_writer:
            return run_dir
        unsaved.refuse_taken(self)  # its run taken over by another Profiler: its stream is that one's
        sink = self._recorded.sink
        if self._attached and sink is not None and run_dir.resolve() == Path(sink.run_dir).resolve():
            return self._snapshot(run_dir, summary, status, reason, render, report_path)
        finisher = run_finisher()
        if finisher is None:
            raise RuntimeError("precprof.pipeline, which writes run directories, is not loaded")
        # refused in one line where another run is there: a killed run's stream may be its only record
        claimed = None if self._ours(run_dir) else rundir.claim(run_dir, overwrite=overwrite, option="path")
        # mid-run, its time is not the step's (``not_training``); a Ctrl-C while the stream drains or the tables
        try:  # are read is held (``_signals``) until the finisher wrote them: it raises it before rendering
            with (held := _signals.holding()), self.not_training(), self._recorded.saving(run_dir):
                full = self.run_summary(summary, status, reason)
                tables, live = self.tables(), None
                if self._attached:  # a look at the run so far, saying so as ``_snapshot``'s does
                    last = int(ended.max()) if len(ended := tables["steps"][T.STEP].dropna()) else None
                    live = rundir.live_note(run_dir, last, recording=True, streamed=False)
                    full[T.SUMMARY_STATUS], full[T.SUMMARY_INCOMPLETE_REASON] = T.STATUS_INCOMPLETE, live
                held.close()
                written = finisher(
                    run_dir,
                    tables,
                    full,
                    facts=self.model_facts(),
                    render=render,
                    report_path=report_path,
                    live=live,
                    lost=self._recorded.lost(tables["steps"]),
                )
                del tables
        finally:
            if claimed is not None:
                claimed.release()
                self._saved_into |= {run_dir.resolve()}
        runfiles.release_memory()  # the tables are dropped: what the allocators kept of them goes back
        if not self._attached:  # (the run's status is its end's, not a snapshot's)
            self._saved = written[T.SUMMARY_STATUS], written[T.SUMMARY_INCOMPLETE_REASON]
        if sink is not None and not self._attached:  # the run is saved: it gives the writer process back
            sink.end()
        if self._owned_run is not None and not self._attached and run_dir == self._owned_run.path:
            self._owned_run.release()
            self._owned_run = None
        return run_dir

    def _ours(self, run_dir: Path) -> bool:
        """Whether ``run_dir`` is this Profiler's to write as it is: the run directory it streams into (or was
        handed claimed, ``out=RunDir``), or one claimed for an earlier save (saved again, it is replaced)."""
        mine, out = set(self._saved_into), self.run_dir
        if out is not None and (self._recorded.sink is not None or isinstance(self._out, rundir.RunDir)):
            mine.add(out.resolve())
        return run_dir.resolve() in mine

    def _snapshot(
        self,
        run_dir: Path,
        summary: dict[str, Any] | None,
        status: str | None,
        reason: str | None,
        render: bool,
        report_path: str | Path | None,
    ) -> Path:
        """``save()`` into the run directory this Profiler streams into, while it is attached (a notebook's look
        at the run so far): the steps ended since the last flush are flushed and the stream drained, so that
        the directory holds every step recorded; with ``render``, the page of them, read from the stream and
        saying that the run is still recording (``pipeline.rerender``, as ``precprof report`` renders a live
        run). The stream goes on and summary.json still says "running": the four tables in its place, and the
        run's status, wait for the save after ``detach()`` (finishing here had ended the stream: later steps
        stayed in memory, lost by a kill, and the next save wrote the steps between the two again). Its time
        and memory are not the step's (``not_training``)."""
        with self.not_training():
            self._flush(sampled_step_done=False)
            self._recorded.sink.drain()
            full = self.run_summary(summary, status, reason)
            if render:
                renderer = run_renderer()
                if renderer is None:
                    raise RuntimeError("precprof.pipeline, which renders run directories, is not loaded")
                renderer(run_dir, out=report_path, recording=full, facts=self.model_facts())
        return run_dir

    def report(
        self,
        path: str | Path | None = None,
        summary: dict[str, Any] | None = None,
        *,
        overwrite: bool = False,
    ) -> Path:
        """Write the run directory (``path`` itself, or the folder of ``path`` when it names an .html file;
        default ``out``) and render the HTML report there; returns the report's path. A directory holding
        another run is refused unless ``overwrite``, as ``save`` refuses it."""
        if path is None:
            path = self.run_dir
            if path is None:
                raise ValueError("report() needs a path: report(run_dir), or Profiler(..., out=run_dir)")
        path = rundir.check_name(path, "path")  # (an empty one was the working directory)
        html = path.suffix == ".html"
        run_dir = path.parent if html else path
        self.save(
            run_dir, summary=summary, render=True, report_path=path if html else None, overwrite=overwrite
        )
        return path if html else run_dir / T.REPORT_FILE


# the summary's word on optimizer states that every rank holds a shard of (ZeroRedundancyOptimizer)
SHARDED_STATES = (
    "each rank's own shard (ZeroRedundancyOptimizer): the memory table's are rank 0's, about 1/world_size of "
    "the whole model's"
)
