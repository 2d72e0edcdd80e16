"""The steps of the built-in loop, as the README describes one, and the end of a run."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from precprof import _compat, _signals, footprint, hardware, rundir
from precprof import tables as T
from precprof._notice import notice
from precprof.analysis.throughput import throughput
from precprof.capture import Profiler
from precprof.capture.plan import refuse_lazy
from precprof.capture.reducer import RankReducer
from precprof.data import TokenSource, load_data
from precprof.errors import UserError
from precprof.models import BUILTIN_MODELS, BuiltModel, build_model, vocabulary_note
from precprof.models.hf import cast_as_loaded
from precprof.modes import FP16_MODES, resolve_loss_scale
from precprof.stats import engine as stats_engine
from precprof.training import compiling, contract, failure, progress, torch_log
from precprof.training import distributed as launch
from precprof.training.config import (
    DYNAMIC_SCALER_OPTIONS,
    TrainConfig,
    data_seed,
    default_out_dir,
    default_sample_every,
)
from precprof.training.precision import (
    PrecisionPlan,
    convert_fp8,
    fp8_context,
    make_optimizer,
    make_scaler,
    plan_precision,
    resolve_device,
    tf32_flags,
)


@dataclass
class TrainResult:
    """What ``train`` returns: the run directory, the final loss (last step), the steps table, summary.json."""

    run_dir: Path
    final_loss: float
    steps: pd.DataFrame
    summary: dict[str, Any]


@dataclass
class TrainRun:
    """The live state of a run, handed to callbacks. ``step`` is the index of the step in progress."""

    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    profiler: Any
    device: torch.device
    run_dir: Path
    step: int = 0
    loss: torch.Tensor | None = None


class Callback:
    """Override any of these to observe or steer a run (``train(config, callbacks=[...])``).

    ``after_backward`` runs when the gradients exist, still multiplied by the loss scale, before unscaling,
    clipping and the optimizer step (a place to inspect or perturb gradients). ``on_step_end`` runs after
    the optimizer step, ``zero_grad`` and ``Profiler.step``.
    """

    def on_start(self, run: TrainRun) -> None:
        """Before the first step."""

    def after_backward(self, run: TrainRun) -> None:
        """After ``backward()`` of step ``run.step``."""

    def on_step_end(self, run: TrainRun) -> None:
        """After step ``run.step`` is complete."""

    def on_end(self, run: TrainRun) -> None:
        """After the last step, before the run directory is written."""


def loss_from_output(
    out: Any, targets: torch.Tensor, vocab_size: int | None = None, passed_targets: bool = False
) -> torch.Tensor:
    """The training loss from a model's output (see the model contract in ``precprof.models``).

    A scalar tensor or an output's ``loss`` is used as is; logits (B, T, V) give the mean next-token
    cross-entropy against ``targets`` (B, T), computed in fp32. A tuple or list gives its logits, or, for a
    model that was given the targets (``passed_targets``: nanoGPT's and minGPT's ``forward(idx, targets)`` ->
    ``(logits, loss)``), its first scalar tensor. UserError for any other output, for a tuple of logits and a
    scalar from a model not given the targets (an auxiliary loss, or the loss? precprof cannot tell), and for
    logits with fewer classes than ``vocab_size`` (the token ids of the data: cross-entropy would index past
    them).
    """
    loss, logits = _loss_and_logits(out, targets, passed_targets)
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return loss  # in its own dtype: a model that computed it in 16-bit is a finding (bf16_loss)
    if isinstance(logits, torch.Tensor) and logits.ndim == 3 and logits.shape[:2] == targets.shape:
        if vocab_size is not None and logits.shape[-1] < vocab_size:
            raise UserError(
                f"the model's logits have {logits.shape[-1]} classes but the data has {vocab_size} token ids: "
                f"give the model a vocabulary of at least {vocab_size} (e.g. -a vocab_size={vocab_size})"
            )
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    shape: tuple[Any, ...] | None = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
    if isinstance(out, (tuple, list)):
        shape = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in out)
    # where the loop looks in an output that is no tensor: a dict's keys, an object's attributes
    keys = f" with keys {', '.join(map(repr, list(out)[:8]))}" if isinstance(out, dict) and out else ""
    under = (
        " among its items"
        if isinstance(out, (tuple, list))
        else " under its key 'logits' or 'loss'"
        if isinstance(out, dict)
        else " as its .logits or .loss"
        if out is not None and not isinstance(out, torch.Tensor)
        else ""
    )
    raise UserError(
        f"the model's forward returned {type(out).__name__}{keys}{f' of shape {shape}' if shape else ''}; "
        f"expected logits of shape ({targets.shape[0]}, {targets.shape[1]}, vocab_size) or a scalar loss{under}"
    )


def logits_read(out: Any, targets: torch.Tensor, passed_targets: bool = False) -> torch.Tensor | None:
    """The logits ``loss_from_output`` takes the cross-entropy of, read as (batch, seq_len, vocab); None when
    the output gives its loss (or is refused)."""
    loss, logits = _loss_and_logits(out, targets, passed_targets)
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return None
    if isinstance(logits, torch.Tensor) and logits.ndim == 3 and logits.shape[:2] == targets.shape:
        return logits
    return None


def _loss_and_logits(out: Any, targets: torch.Tensor, passed_targets: bool) -> tuple[Any, Any]:
    """The loss and the logits a model's output holds, either None (see ``loss_from_output``)."""
    loss = logits = None
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if isinstance(t, torch.Tensor)]
        loss = next((t for t in tensors if t.ndim == 0), None)
        logits = next((t for t in tensors if t.ndim == 3 and t.shape[:2] == targets.shape), None)
        if loss is not None and logits is not None and not passed_targets:
            raise UserError(
                f"the model's forward returned a {type(out).__name__} of logits and a scalar, and takes no targets: "
                "precprof cannot tell whether the scalar is the loss or an auxiliary one; return the loss alone, "
                "or the logits alone (the loop adds the next-token cross-entropy), or take a targets argument and "
                "return (logits, loss)"
            )
    elif isinstance(out, torch.Tensor):
        if out.ndim == 0:
            loss = out
        else:
            logits = out
    elif isinstance(out, dict):  # also Hugging Face's ModelOutput
        loss, logits = out.get("loss"), out.get("logits")
    else:
        loss, logits = getattr(out, "loss", None), getattr(out, "logits", None)
    return loss, logits


def grad_norm_(params: Sequence[torch.Tensor], max_norm: float = 0.0) -> torch.Tensor:
    """Global L2 norm of the gradients (an fp32 device tensor; no host sync) and, when ``max_norm > 0``,
    clipping as ``torch.nn.utils.clip_grad_norm_`` does (gradients scaled by min(1, max_norm/(norm+1e-6))).

    Norms are accumulated in fp32 at least, so fp16 gradients cannot overflow the sum; float64 gradients in
    float64 (vector_norm refuses to narrow them), the total then in fp32. A sparse gradient
    (``nn.Embedding(sparse=True)``) counts as its dense self: the norm of its values with duplicate indices
    summed in its dtype (``_compat.coalesced_values``: as torch's ``coalesce()`` and the optimizer sum them, so an
    fp16 gradient whose duplicates overflow is inf here as there), and clipping scales its values; torch's ``clip_grad_norm_`` and
    ``vector_norm`` refuse sparse tensors.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [
        torch.linalg.vector_norm(v, dtype=torch.promote_types(v.dtype, torch.float32)).float()
        for v in map(_dense_part, grads)
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if hasattr(total, "full_tensor"):  # FSDP2's DTensor gradients: the norm over every rank's shard
        total = total.full_tensor()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


def _dense_part(g: torch.Tensor) -> torch.Tensor:
    """A dense tensor with ``g``'s vector norm: ``g`` itself, or a sparse gradient's values."""
    if g.layout == torch.sparse_coo:
        return _compat.coalesced_values(g)
    return g


def _final(
    steps: pd.DataFrame,
    wall_s: float,
    data: dict[str, Any],
    steps_done: int,
    tokens_per_step: int,
    compiled: list[int],
) -> dict[str, Any]:
    losses = steps[T.LOSS].astype(float) if not steps.empty else pd.Series(dtype=float)
    last = float(losses.iloc[-1]) if len(losses) else math.nan
    avg = float(losses.iloc[-10:].mean()) if len(losses) else math.nan
    floor = data.get("entropy_rate_nats")
    times = steps[T.TIME_S].astype(float).dropna() if not steps.empty else pd.Series(dtype=float)
    return {
        "final_loss": last,
        "final_loss_avg10": avg,  # mean of the last 10 steps: less noisy than one batch
        "steps_done": steps_done,
        "skipped_steps": int(steps[T.SKIPPED].astype(bool).sum()) if not steps.empty else 0,
        # the rate of the steps precprof left alone (analysis.throughput); the wall-clock rate of the whole
        # run, sampled steps and warm-up included, beside it
        **throughput(steps, compiled),  # the steps torch.compile compiled in left out too
        "tokens_per_s_wall": steps_done * tokens_per_step / wall_s if wall_s > 0 else math.nan,
        "wall_s": wall_s,
        "step_time_median_s": float(times.median()) if len(times) else math.nan,
        # the best loss the data allows (synthetic: the chain's entropy rate); None when unknown
        "loss_floor_nats": floor,
        "loss_above_floor_nats": avg - floor if floor is not None and math.isfinite(avg) else None,
    }


@dataclass
class _Setup:
    """Everything built before the first step; ``scaler`` is None without loss scaling."""

    config: TrainConfig
    summary: dict[str, Any]
    built: BuiltModel
    model: nn.Module  # what the loop calls: the distributed wrapper under torchrun
    inner: nn.Module  # what the Profiler watches (plain module names)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    plan: PrecisionPlan
    data: TokenSource
    device: torch.device
    run_dir: Path
    prof_kwargs: dict[str, Any]
    tokens_per_step: int
    writer: bool  # rank 0 (or a single process) writes the run directory
    dist_info: Any


# the notes printed so far by the runs of an enclosing ``notes_once()`` (``precprof compare``'s, one per precision:
# fp16, fp16:none and fp16:advised each said that this CPU emulates fp16)
_NOTES_SAID: list[set[str]] = []


@contextlib.contextmanager
def notes_once() -> Any:
    """Within it, each note on how a run will run is printed once, however many runs ``train`` makes."""
    _NOTES_SAID.append(set())
    try:
        yield
    finally:
        _NOTES_SAID.pop()


def _note(text: str) -> None:
    """``text`` as a note on standard error, unless an enclosing ``notes_once()`` printed it already."""
    if _NOTES_SAID:
        if text in _NOTES_SAID[-1]:
            return
        _NOTES_SAID[-1].add(text)
    print(f"precprof: note: {text}", file=sys.stderr)


def train(
    config: TrainConfig,
    *,
    profiler_kwargs: dict[str, Any] | None = None,
    callbacks: Sequence[Callback] = (),
    label: str | None = None,
) -> TrainResult:
    """Train ``config.model`` with the Profiler attached and write the run directory.

    ``profiler_kwargs`` are passed to ``precprof.capture.Profiler`` (``sample_every`` defaults to
    ``config.sample_every`` or about 100 sampled steps). The run directory is checked, created and locked
    before the first step (``precprof.rundir``). On an exception or KeyboardInterrupt what was recorded is
    saved with status "incomplete" and the cause, an exception's traceback into the run directory's
    traceback.txt (``precprof.training.failure``), and the exception is re-raised. Raises UserError for
    mistakes in the configuration before anything is written. ``label``: the run's name in the progress lines,
    after the model's (default: its precision; ``precprof compare`` names each run as its directory, "fp16-none").
    """
    config.validate()
    _check_arguments(profiler_kwargs, callbacks)
    user_out = config.out is not None  # else a default name, which moves on to a free one
    setup = _prepare(config, profiler_kwargs)
    claimed = _claim(setup, user_out)
    try:
        return _run(setup, callbacks, claimed, label or config.precision)
    finally:
        if claimed is not None:
            claimed.release()


# what the loop gives the Profiler itself: not in ``profiler_kwargs``
_LOOP_GIVES = ("model", "optimizer", "scaler", "out")
_HOOKS = ("on_start", "after_backward", "on_step_end", "on_end")


def _check_arguments(profiler_kwargs: dict[str, Any] | None, callbacks: Sequence[Callback]) -> None:
    """``train``'s own arguments, in one line before anything is built or claimed: a name the Profiler does not
    take (a typo) or that the loop gives it, and a callback without ``Callback``'s hooks. Found once the run
    directory was claimed, they left it reading "running (pid ...)", a run the corrected rerun was refused over
    (t4)."""
    taken = set(inspect.signature(Profiler).parameters) - set(_LOOP_GIVES)
    for name in profiler_kwargs or {}:
        if name in _LOOP_GIVES:
            raise UserError(
                f"profiler_kwargs={{{name!r}: ...}}: the loop gives the Profiler its {name} itself"
            )
        if name not in taken:
            near = difflib.get_close_matches(str(name), sorted(taken), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; it takes {', '.join(sorted(taken))}"
            raise UserError(f"profiler_kwargs={{{name!r}: ...}}: precprof.Profiler takes no {name!r}{hint}")
    for i, cb in enumerate(callbacks):
        missing = [h for h in _HOOKS if not callable(getattr(cb, h, None))]
        if missing:
            raise UserError(
                f"callbacks[{i}] ({type(cb).__name__}) has no {', '.join(missing)}: subclass "
                "precprof.training.Callback and override the hooks it needs"
            )


def _claim(setup: _Setup, user_out: bool) -> rundir.RunDir | None:
    """Claim the run directory (the writer; a default name moves on to a free one) and make it every rank's:
    under torchrun rank 0 says which it claimed (``launch.share_run_dir``), or that it could not, so that no
    rank names another or trains on without it. Returns the writer's claim (None on the other ranks)."""
    claimed: rundir.RunDir | None = None
    failed: Exception | None = None
    if setup.writer:
        try:
            if user_out:
                claimed = rundir.claim(setup.run_dir, overwrite=setup.config.overwrite, summary=setup.summary)
            else:
                claimed = rundir.claim_new(setup.run_dir, summary=setup.summary)
        except Exception as e:
            if setup.dist_info is None:
                raise
            failed = e  # said to the other ranks first
    path = claimed.path if claimed is not None else setup.run_dir
    if setup.dist_info is not None:
        try:
            path = launch.share_run_dir(
                setup.dist_info, claimed.path if claimed is not None else None, failed
            )
        except BaseException:
            if claimed is not None:  # nothing was recorded in it
                claimed.abandon()
            raise
    if path != setup.run_dir:
        setup.run_dir = path
        setup.config = dataclasses.replace(setup.config, out=path)
        setup.summary[T.SUMMARY_CONFIG]["out"] = str(path)
    return claimed


def _prepare(config: TrainConfig, profiler_kwargs: dict[str, Any] | None) -> _Setup:
    """Device, precision plan, data, model, optimizer, scaler and the summary's configuration."""
    # under torchrun (WORLD_SIZE > 1): join the process group; each rank trains on its own device and batches
    dist_info = launch.init_from_env()
    device = dist_info.device if dist_info is not None else resolve_device(config.device)
    hw = hardware.detect(device)
    plan = plan_precision(config.precision, device, hw)
    # a forced engine that cannot run here is refused before the run directory is made (refused at attach, it left
    # a 0-step run there that blocked the corrected rerun)
    if stats_engine.requested_engine() != "auto":
        stats_engine.resolve_engine(None, device)
    loss_kind, static_scale = resolve_loss_scale(config.loss_scale, config.precision)
    compiled = compiling.should_compile(config.compile, config.precision)
    if compiled:
        compiling.check_can_compile(device)
    data = load_data(config.data, seed=data_seed(config.seed, dist_info.rank if dist_info is not None else 0))
    data.check(config.seq_len)
    _refuse_before_building(config, plan, data, device, dist_info)
    torch.manual_seed(config.seed)
    built: BuiltModel = build_model(
        config.model, config.model_args, vocab_size=data.vocab_size, seq_len=config.seq_len
    )
    # a complex parameter the precision cannot train, in one line before it is cast or measured
    contract.complex_parameters(built.name, built.module, config.precision, loss_kind != "none")
    # the model's own code raising in what follows (an override of train() or _apply, its forward) is said in
    # one line naming the user's line (a traceback through typer's frames, before any run directory)
    with failure.preparing(built.module, built.kind, built.name):
        model = built.module.to(device)
        if plan.param_dtype != torch.float32:
            if (
                built.kind == "hf"
            ):  # as from_pretrained(..., dtype=) loads it: its rotary frequencies stay fp32
                cast_as_loaded(model, plan.param_dtype)
            else:
                model.to(plan.param_dtype)
        n_fp8 = (
            convert_fp8(model, plan.fp8_library, tokens=config.batch_size * config.seq_len)
            if plan.fp8_library
            else 0
        )
        model.train()
        refuse_lazy(model)  # before the memory check, which measures every parameter
        shapes: list[tuple[int, ...]] = []  # of the logits the measuring passes read
        forward_loss = _forward_loss(config, built, model, plan, data, device, shapes)
        fp = _check_memory(config, built, model, forward_loss, device, _sharding(config, model, dist_info))
        # the pass the estimate could not measure, again: a factory's model that fails it is refused here, in one line
        contract.check_forward(
            built, model, forward_loss, fp.failed_at, config.batch_size, config.seq_len, data.vocab_size
        )
        # sparse gradients the optimizer cannot take, in one line before the run directory is made
        contract.sparse_gradients(
            built.name,
            model,
            forward_loss,
            config.batch_size,
            config.optimizer,
            config.weight_decay,
            config.distributed if dist_info is not None else "",
        )
        built = built.with_logits_vocab(shapes[0] if shapes else None)
        inner = model
        if (
            dist_info is not None
        ):  # the Profiler watches the inner module (plain names); the reducer the wrapper
            model = launch.wrap_model(model, config.distributed, device=device)
            profiler_kwargs = {"reducer": RankReducer(wrapped=model), **(profiler_kwargs or {})}
        optimizer = make_optimizer(config, model, plan)
        if (
            compiled
        ):  # the loop calls the compiled model; the Profiler and the optimizer hold the module's own
            model = compiling.compile_model(model)
        scaler = make_scaler(config, plan, device)
    sample_every = (
        config.sample_every
        if config.sample_every is not None
        else default_sample_every(config.steps, compiled=compiled)
    )
    # the built-in loop owns the process: nothing else reads its peak counters (every phase's counter peak is
    # exact), and the peak's parts are measured on the CPU too (torch.profiler's memory events)
    prof_kwargs = {
        "sample_every": sample_every,
        "memory_peak": True,
        "reset_peak_memory": True,
        **(profiler_kwargs or {}),
    }
    run_dir = Path(config.out) if config.out is not None else default_out_dir(config)
    config = dataclasses.replace(config, out=run_dir)
    world_size = dist_info.world_size if dist_info is not None else 1
    summary: dict[str, Any] = {
        T.SUMMARY_CONFIG: {
            **config.to_dict(),
            # GradScaler's dynamic settings where it scaled dynamically (a bf16 run recorded an --init-scale unused)
            **({k: None for k in DYNAMIC_SCALER_OPTIONS} if loss_kind != "dynamic" else {}),
            "device": str(device),
            "device_requested": config.device,
            "loss_scaling": loss_kind,
            "static_scale": static_scale,
            "sample_every": prof_kwargs["sample_every"],
            "plan": plan.to_dict(),
            "fp8_layers": n_fp8,
            **compiling.summary(config.compile, compiled, config.precision),  # compiled or eager, and why
            "optimizer_class": type(optimizer).__name__,
            "data": data.describe(),
            "tf32_matmul": plan.tf32 if device.type == "cuda" else False,
            "world_size": world_size,
            # the strategy only applies under torchrun with more than one process
            "distributed": config.distributed if world_size > 1 else "none (one process)",
            "memory_estimate": footprint.describe(fp),
        },
        T.SUMMARY_HARDWARE: hw.to_dict(),
        T.SUMMARY_VERSIONS: hardware.software_versions(),
        T.SUMMARY_MODEL: built.info(),
    }
    writer = dist_info is None or dist_info.is_writer
    # the notes on how the run will run are warnings, shown without the progress bar too (a batch job's
    # --no-progress hid that fp16 would run 15x slower); the estimate goes with the bar (and summary.json)
    if device.type == "cpu" and config.precision in FP16_MODES and writer and not hw.fp16_native:
        _note(
            "this CPU has no fp16 arithmetic; torch emulates fp16 matmuls, about 15x slower than fp32 (bf16 runs "
            "natively or close to it)"
        )
    if (note := compiling.note(config.precision, compiled)) and writer:
        _note(note)
    if (note := contract.layout_note(built, shapes[0] if shapes else None)) and writer:
        _note(note)
    if (note := vocabulary_note(built, config.model_args, data.vocab_size)) and config.progress and writer:
        _note(note)
    if config.progress and writer:
        print(f"precprof: {footprint.line(fp)}", file=sys.stderr)
    return _Setup(
        config=config,
        summary=summary,
        built=built,
        model=model,
        inner=inner,
        optimizer=optimizer,
        scaler=scaler,
        plan=plan,
        data=data,
        device=device,
        run_dir=run_dir,
        prof_kwargs=prof_kwargs,
        tokens_per_step=config.batch_size * config.seq_len * world_size,  # every rank's batch
        writer=writer,
        dist_info=dist_info,
    )


def _check_memory(
    config: TrainConfig,
    built: BuiltModel,
    model: nn.Module,
    forward_loss: Callable[[int], torch.Tensor],
    device: torch.device,
    sharding: footprint.Sharding,
) -> footprint.Footprint:
    """Refuse, before the first step, a run that cannot fit in this device's memory (``precprof.footprint``):
    one rank's, ``model`` unwrapped, its states held as ``sharding`` says the wrapper will hold them."""
    try:
        return footprint.check_training_fits(
            model,
            batch_size=config.batch_size,
            optimizer=config.optimizer,
            forward_loss=forward_loss,
            device=device,
            what=_run_what(config, built.name),
            processes_sharing=_ranks_sharing(device),
            sharding=sharding,
        )
    except footprint.ModelDoesNotFit as e:
        raise e.with_example(built.smaller() if built.smaller is not None else None) from None


def _sharding(config: TrainConfig, model: nn.Module, dist_info: launch.DistInfo | None) -> footprint.Sharding:
    """How the ranks will hold the model states: FSDP shards them (``--distributed fsdp2|fsdp1``), DDP and one
    process keep them whole."""
    if dist_info is None:
        return footprint.Sharding()
    gathered = launch.gathered_unit_bytes(model, config.distributed)
    return footprint.Sharding(dist_info.world_size, sharded=gathered > 0, gathered=gathered)


def _forward_loss(
    config: TrainConfig,
    built: BuiltModel,
    model: nn.Module,
    plan: PrecisionPlan,
    data: TokenSource,
    device: torch.device,
    shapes: list[tuple[int, ...]] | None = None,
) -> Callable[[int], torch.Tensor]:
    """``forward_loss(batch)`` for ``footprint``: the forward pass and the loss on random tokens at the run's
    sequence length, in the run's precision, on ``device`` (``meta`` too; footprint forks the RNG state).
    ``shapes`` gets the shape of the logits each pass read (``logits_read``), for ``contract.layout_note``."""

    def forward_loss(batch: int) -> torch.Tensor:
        seq = torch.randint(0, data.vocab_size, (batch, config.seq_len + 1), device=device)
        # contiguous, as the data's batches are (nanoGPT's targets.view(-1) refuses a slice from batch 2 on)
        x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        autocast = (
            torch.autocast(device.type, dtype=plan.autocast_dtype)
            if plan.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast, fp8_context(plan):
            out = model(x, targets=y) if built.pass_targets else model(x)
            loss = loss_from_output(out, y, data.vocab_size, built.pass_targets)
            logits = logits_read(out, y, built.pass_targets)
            if shapes is not None and logits is not None:
                shapes.append(tuple(logits.shape))
            if not loss.requires_grad and torch.is_grad_enabled():  # refused before training (check_forward)
                raise contract.no_gradient(built.name, model, loss, logits)
            return loss

    return forward_loss


def _ranks_sharing(device: torch.device) -> int:
    """How many ranks train on this device's memory: CPU ranks of one machine share its RAM."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1


def _run_what(config: TrainConfig, name: str) -> str:
    return f"{name} at batch {config.batch_size} x seq {config.seq_len} in {config.precision}"


# A refusal from the meta device needs this much more than the real check's limit: the meta kernels may save a
# little more or less than the device's own (e.g. attention's), and a run near the limit is the real check's.
META_MARGIN = 1.25


def _refuse_before_building(
    config: TrainConfig,
    plan: PrecisionPlan,
    data: TokenSource,
    device: torch.device,
    dist_info: launch.DistInfo | None = None,
) -> None:
    """Refuse a run that clearly cannot fit before its model exists: a built-in model built on the meta device
    (no memory, no arithmetic) and measured there like ``_check_memory`` measures the real one. gpt2-medium at
    batch 512 x 1024 is refused in seconds instead of after two real measuring passes (a minute on a CPU).
    Only runs without autocast or fp8 (meta tensors see neither, so they would measure another precision);
    every other run, any failure here, and anything within ``META_MARGIN`` of the limit is left to
    ``_check_memory`` on the real model."""
    if config.model not in BUILTIN_MODELS or plan.autocast_dtype is not None or plan.fp8_library:
        return
    avail = footprint.available_bytes(device)
    if avail is None:
        return
    sharing = _ranks_sharing(device)
    avail //= max(sharing, 1)
    try:
        with torch.device("meta"):
            built = build_model(
                config.model, config.model_args, vocab_size=data.vocab_size, seq_len=config.seq_len
            )
        model = built.module.to(plan.param_dtype)
        meta = _forward_loss(config, built, model, plan, data, torch.device("meta"))
        # on meta, attention runs its math kernel and saves each (seq, seq) matrix, which the device's fused
        # kernel does not keep (gpt-nano at seq 256: 50% more a sample, growing with seq^2, refusing a batch
        # that fits); left out, the meta measure stays below the real one
        seq = config.seq_len
        fp = footprint.estimate(
            model,
            batch_size=config.batch_size,
            optimizer=config.optimizer,
            forward_loss=meta,
            leave_out=lambda t: t.dim() >= 2 and t.shape[-1] == t.shape[-2] == seq,
            sharding=_sharding(config, model, dist_info),
        )
    except Exception:  # the real model's check decides (and a real error is met where it is recorded)
        return
    if fp.measured and fp.total > META_MARGIN * footprint.HEADROOM * avail:
        try:
            footprint.check_fits(
                fp, avail, what=_run_what(config, built.name), where=footprint.place(device, sharing)
            )
        except footprint.ModelDoesNotFit as e:
            raise e.with_example(built.smaller() if built.smaller is not None else None) from None


def _run(s: _Setup, callbacks: Sequence[Callback], claimed: rundir.RunDir | None, label: str) -> TrainResult:
    """The steps and the end of the run, on a claimed run directory (the writer's ``claimed``): the Profiler
    streams each flush into it, so a killed run keeps every step whose flush reached the writer. ``label``: the run's
    name in the progress lines, after the model's."""
    config, model, optimizer, device, data = s.config, s.model, s.optimizer, s.device, s.data
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = claimed if claimed is not None else s.run_dir  # a rank that does not write keeps its steps only
    try:
        prof = Profiler(s.inner, optimizer=optimizer, scaler=s.scaler, out=out, **s.prof_kwargs)
    except BaseException:  # a value the Profiler refuses (profiler_kwargs): nothing was recorded in the claim
        if claimed is not None:
            claimed.abandon()
        raise
    run = TrainRun(config, model, optimizer, s.scaler, prof, device, s.run_dir)
    # as in nanoGPT: a disabled GradScaler passes the loss through and calls optimizer.step() itself
    scaler = s.scaler if s.scaler is not None else torch.amp.GradScaler(device.type, enabled=False)
    autocast = (
        contextlib.nullcontext()
        if s.plan.autocast_dtype is None
        else torch.autocast(device.type, dtype=s.plan.autocast_dtype)
    )
    name = f"{progress.short_name(s.built.name, s.built.kind)} {label}"
    bar = progress.progress(config if s.writer else dataclasses.replace(config, progress=False), name)
    steps_done = 0
    phase = failure.START  # the part of the run in progress, for the error that stops it
    # what Dynamo and inductor log in a step is printed when it ends; the failed step's goes into traceback.txt
    held = torch_log.Held.of_torch(compiling.should_compile(config.compile, config.precision))
    t_start = time.perf_counter()
    t_refresh, steps_at_refresh = t_start, 0
    # once the last step trained, a Ctrl-C or SIGTERM is the save's, not the training's: held (its record, the
    # Profiler's detach, the tables read for the summary) until the run is written whole, then raised before its
    # report renders (``pipeline.finish_run``), as one while it renders (it had stopped the finished run as a
    # partial one, its summary left saying "running", or its final loss an earlier step's)
    finishing = contextlib.ExitStack()
    try:
        with tf32_flags(s.plan.tf32, device), prof:
            for cb in callbacks:
                cb.on_start(run)
            for step in range(config.steps):
                run.step = step
                phase = failure.FORWARD
                x, y = data.batch(config.batch_size, config.seq_len, device)
                with autocast, fp8_context(s.plan):
                    try:
                        out = model(x, targets=y) if s.built.pass_targets else model(x)
                    except (RuntimeError, TypeError, ValueError, IndexError) as e:
                        if step or s.built.kind != "factory" or not _no_token_model(model, e):
                            raise  # a language model's own failure keeps its traceback
                        raise not_a_language_model(s.built.name, x, e) from e
                    with prof.memory_scope():  # what the loss saves for backward counts as activations
                        loss = loss_from_output(out, y, data.vocab_size, s.built.pass_targets)
                    if not loss.requires_grad and torch.is_grad_enabled():  # backward would refuse it
                        logits = logits_read(out, y, s.built.pass_targets)
                        raise contract.no_gradient(s.built.name, s.inner, loss, logits)
                run.loss = loss.detach()
                phase = failure.BACKWARD
                scaler.scale(loss).backward()
                phase = failure.OPTIMIZER
                if step == 0:  # a sparse gradient no layer announced (F.embedding(..., sparse=True))
                    sparse = [
                        n for n, p in s.inner.named_parameters() if p.grad is not None and p.grad.is_sparse
                    ]
                    contract.refuse_sparse(s.built.name, sparse, config.optimizer, config.weight_decay)
                for cb in callbacks:
                    cb.after_backward(run)
                scaler.unscale_(optimizer)  # clipping and the norm see the true gradients
                norm = grad_norm_(params, config.grad_clip)
                scaler.step(optimizer)  # skips the step when a gradient is inf/nan
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if step == config.steps - 1:  # the last step trained: what follows is the run's end
                    finishing.enter_context(_signals.deferred())
                with _signals.deferred(note=None):  # the step is recorded and counted, or neither
                    prof.step(loss=run.loss, grad_norm=norm, tokens=s.tokens_per_step)
                    steps_done = step + 1
                if steps_done == 1:  # the first step warms up (allocations, kernels, autotuning): the rate
                    if device.type == "cuda":  # starts after it (one sync, once: its kernels are done)
                        torch.cuda.synchronize(device)
                    t_refresh, steps_at_refresh = time.perf_counter(), 1
                if steps_done % config.refresh_every == 0 or steps_done == config.steps:
                    # the only host syncs of the loop: loss value, scale, throughput since the last refresh
                    now = time.perf_counter()
                    postfix = {"loss": f"{run.loss.item():.4f}"}
                    if scaler.is_enabled():
                        postfix["scale"] = progress.scale_text(scaler.get_scale())
                    if steps_done > steps_at_refresh:
                        rate = (steps_done - steps_at_refresh) * s.tokens_per_step / (now - t_refresh)
                        postfix["tok/s"] = f"{rate:,.0f}"
                    bar.set_postfix(postfix, refresh=False)
                    t_refresh, steps_at_refresh = now, steps_done
                bar.update(1)
                held.release()
                for cb in callbacks:
                    cb.on_step_end(run)
                _signals.check()  # a Ctrl-C or SIGTERM whose exception was swallowed on the way stops here
            phase = failure.END
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall_s = time.perf_counter() - t_start
            for cb in callbacks:
                cb.on_end(run)
    except BaseException as e:
        with _signals.deferred():  # a second Ctrl-C must not cut the save short
            finishing.close()  # (an error after the last step: this save holds them)
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone: the run still saves
                bar.close()
            interrupted = _signals.as_interrupted(e)
            if interrupted is not None:
                _signals.consume()
            reason = interrupted.reason if interrupted is not None else failure.reason(e, s.inner)
            kept = None
            if interrupted is None and isinstance(e, Exception) and not isinstance(e, UserError):
                # its traceback beside the run, and a line for the terminal (the CLI's, for the model's error);
                # saying it must not hide it
                with contextlib.suppress(Exception):
                    where = s.run_dir if s.writer else None
                    kept = failure.keep(e, s.inner, s.built.kind, where, run.step, phase, held.text())
                    if kept.traceback is not None:
                        held.drop()  # in the file the one line names; else printed, as torch logged it
            held.close()
            if s.dist_info is not None:  # rank 0's error may be the consequence of another rank's failure
                if s.writer:
                    own = reason
                    reason = launch.failure_cause(s.dist_info, e, reason, interrupted is not None)
                    peer = launch.peer_traceback(s.dist_info)
                    if kept is not None and reason != own:  # the terminal says it as the run does, in a line,
                        # and traceback.txt holds the failing rank's traceback first
                        kept = failure.caused_by_peer(kept, reason, s.dist_info.rank, peer)
                    else:  # interrupted, or failed on its own: the failing rank's traceback is in the file too
                        kept = failure.peers_too(kept, s.run_dir, s.dist_info.rank, peer)
                elif interrupted is None:  # for rank 0's run, before this rank leaves the group
                    model_error = (
                        kept is not None and kept.blame == "model"
                    )  # said with its line, as rank 0 says it
                    said, trace = (
                        (kept.text if model_error else "", kept.trace) if kept is not None else ("", "")
                    )
                    if (
                        launch.record_failure(s.dist_info, e, said, trace)
                        and kept is not None
                        and model_error
                    ):
                        kept = failure.told_rank_0(
                            kept, s.run_dir
                        )  # its one line, as a single process says it
            # a crashed run gets its tables, summary and report of the steps recorded, marked incomplete
            _save(s, prof, time.perf_counter() - t_start, steps_done, reason)
        _saved_to(e, s, "the partial run")
        if kept is not None:
            with contextlib.suppress(AttributeError):
                e.precprof_failure = kept  # type: ignore[attr-defined]
            if kept.note() and hasattr(e, "add_note"):
                e.add_note(kept.note())
        raise
    finally:
        held.close()  # the handlers as they were (closing twice is harmless)
    with finishing:
        bar.close()
        steps_table = _tabulate(s, prof, wall_s, steps_done)
    try:
        _save(s, prof, wall_s, steps_done, None, steps_table)
        _signals.check()  # one held where the save raised none (a rank that writes no run directory)
    except KeyboardInterrupt as e:  # Ctrl-C while the report rendered, or held while the run was written
        _saved_to(e, s, "the run")
        raise
    # --compile (or fp8's default) with every step sampled ran nothing compiled: said, as summary.json says it
    if (
        note := compiling.ran_note(s.summary[T.SUMMARY_CONFIG], s.prof_kwargs.get("sample_every"))
    ) and s.writer:
        _note(note)
    if s.dist_info is not None and s.dist_info.owns_group:
        launch.shutdown()  # after rank 0 wrote: its barrier waits for it
    summary = T.read_summary(s.run_dir)
    saved = prof.status  # the save's own word: a summary that did not fit is not on disk
    if (summary.get(T.SUMMARY_STATUS), summary.get(T.SUMMARY_INCOMPLETE_REASON)) != saved:
        summary = {**summary, T.SUMMARY_STATUS: saved[0], T.SUMMARY_INCOMPLETE_REASON: saved[1]}
    return TrainResult(
        run_dir=s.run_dir,
        final_loss=float(s.summary[T.SUMMARY_FINAL]["final_loss"]),
        steps=steps_table,
        summary=summary,
    )


def _saved_to(e: BaseException, s: _Setup, what: str) -> None:
    """Say where ``what`` (the run, the partial run) that ``e`` stopped was saved, before ``e`` is raised on: the
    CLI's message reads ``precprof_run_dir``, a traceback shows the note. Ends the process group it began."""
    with contextlib.suppress(AttributeError):
        e.precprof_run_dir = s.run_dir  # type: ignore[attr-defined]
    if hasattr(e, "add_note"):
        e.add_note(
            f"precprof: {what} was saved to {s.run_dir}"
            if s.writer
            else f"precprof: this rank writes no run directory; rank 0 saves what it recorded to {s.run_dir}"
        )
    if s.dist_info is not None and s.dist_info.owns_group:
        launch.shutdown(barrier=False)


def _no_token_model(model: nn.Module, e: BaseException) -> bool:
    """Whether a factory's model that failed on its first forward pass is plainly no language model: it has no
    embedding to read token ids with (an image model), and the failure is not the device's memory."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    return not any(isinstance(m, nn.Embedding) for m in model.modules())


def not_a_language_model(name: str, x: torch.Tensor, e: BaseException) -> UserError:
    """The one-line error for a user's model whose first forward pass fails on the token ids the loop feeds
    it: most likely not a language model (an image model's convolution refuses (batch, seq) ids)."""
    what = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return UserError(
        f"{name} failed on its first forward pass, given token ids of shape {tuple(x.shape)} ({x.dtype}): "
        f"{type(e).__name__}: {what[:200]}. precprof train trains language models (forward(ids) -> logits, "
        "or an output with .logits or .loss); profile any other model in your own loop with precprof.Profiler"
    )


def _save(
    s: _Setup,
    prof: Profiler,
    wall_s: float,
    steps_done: int,
    reason: str | None,
    steps_table: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Write the run directory (complete when ``reason`` is None); returns the steps table (``steps_table``:
    ``_tabulate``'s, already taken).

    For an incomplete run this is best effort: a failure here must not hide the exception that stopped
    training (the caller re-raises it).
    """
    try:
        if steps_table is None:
            steps_table = _tabulate(s, prof, wall_s, steps_done)
        status = T.STATUS_COMPLETE if reason is None else T.STATUS_INCOMPLETE
        render = s.config.report and s.writer
        prof.save(s.run_dir, summary=s.summary, status=status, reason=reason, render=render)
        return steps_table
    except Exception as err:
        if reason is None:
            raise
        # (said, never raised: the training's own error goes on)
        notice(f"precprof: could not save the partial run to {s.run_dir}: {err}")
        return pd.DataFrame()


def _tabulate(s: _Setup, prof: Profiler, wall_s: float, steps_done: int) -> pd.DataFrame:
    """The run's steps table, and what the summary takes from it: its configuration's compiled steps and its
    final block (``_final``)."""
    steps_table = prof.tables()["steps"]
    finished = T.finished_steps(steps_table)
    # how many steps ran the compiled model: a sampled step runs it eagerly, for the hooks (a run whose every
    # step was sampled ran none, and its config said "compiled (torch.compile)")
    cfg = s.summary[T.SUMMARY_CONFIG]
    cfg.update(
        compiling.ran(
            s.config.compile,
            bool(cfg.get("compile")),
            s.config.precision,
            len(finished),
            int(T.flags(finished[T.SAMPLED]).sum()) if T.SAMPLED in finished else 0,
            eager_when_sampled=hasattr(torch.compiler, "set_stance"),
        )
    )
    s.summary[T.SUMMARY_FINAL] = _final(
        finished,
        wall_s,
        s.data.describe(),
        steps_done,
        s.tokens_per_step,
        prof.compiled_steps,
    )
    return steps_table
