"""The reference training loop: every precision mode, loss scaling, clipping, a progress bar, the Profiler.

``train(TrainConfig(...))`` builds the model and data, trains, and leaves a run directory (Parquet tables,
summary.json, report.html when the renderer is installed). ``precprof train`` is a thin wrapper around it,
and ``precprof compare`` runs it once per precision.

Precision modes (``--precision``):

- ``fp32``: fp32 everywhere; TF32 matmuls/convolutions explicitly off on CUDA.
- ``tf32``: fp32 storage, TF32 tensor-core matmuls and convolutions (CUDA, compute capability 8.0+).
- ``bf16`` / ``fp16``: ``torch.autocast`` with fp32 parameters and optimizer (fp16 adds a GradScaler).
- ``bf16-pure`` / ``fp16-pure``: parameters stored in bf16/fp16, no autocast, no fp32 master weights;
  optimizer states in fp32 (``precprof.optim``): each update is computed in fp32 and rounded into the
  low-precision weight. With a loss scaler, fp16 gradients are unscaled in place in fp16 (as apex's O3 did).
- ``fp8``: bf16 autocast with eligible ``nn.Linear`` layers (both dims multiples of 16, not tied to an
  embedding) converted to float8 training by torchao (``convert_to_float8_training``) or replaced by
  Transformer Engine's ``te.Linear`` under ``te.fp8_autocast``, whichever is installed; CUDA 8.9+ only.

Loss scaling (``--loss-scale``, default ``dynamic`` for fp16 and fp16-pure, ``none`` otherwise):
``dynamic`` is ``torch.amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval)``;
``static:N`` is a GradScaler whose scale stays N (growth and backoff factors 1): it still checks every step
for inf/nan gradients and skips those steps, but never changes the scale; ``none`` scales nothing.

One optimizer step: forward and loss (under autocast), ``scaler.scale(loss).backward()``,
``scaler.unscale_`` (so the gradient norm and clipping see true gradients), the gradient norm (and clipping
to ``--grad-clip``), ``scaler.step`` + ``scaler.update()``, ``zero_grad(set_to_none=True)``, then
``Profiler.step(loss, grad_norm, tokens)``. The loop itself syncs with the device only to refresh the progress
bar (every ``refresh_every`` steps); GradScaler.step syncs once per step, as it always does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from precprof import _signals, hardware, rundir
from precprof import tables as T
from precprof.data import TokenSource, load_data
from precprof.errors import MissingDependencyError, UserError
from precprof.models import DEFAULT_MODEL, BuiltModel, build_model
from precprof.modes import DEVICES, FP16_MODES, PRECISIONS, OptimizerName, Precision
from precprof.optim import FP32StateAdamW, FP32StateSGD

ADAMW_BETAS = (0.9, 0.95)  # nanoGPT's; the second moment adapts faster than torch's 0.999 default
SGD_MOMENTUM = 0.9
FP8_DIM_MULTIPLE = 16  # float8 matmuls need both dimensions divisible by 16


@dataclass
class TrainConfig:
    """Everything ``precprof train`` takes. Defaults train gpt-nano on synthetic data in about a minute on CPU.

    ``loss_scale``: "auto" (dynamic for fp16 and fp16-pure, none otherwise), "dynamic", "static:N" or "none".
    ``grad_clip``: max global L2 norm of the (unscaled) gradients; 0 disables clipping.
    ``sample_every``: profile layers every N steps; None picks N so that about 100 steps are sampled.
    ``out``: run directory; None means ``runs/<model>-<precision>-<timestamp>``.
    ``refresh_every``: steps between progress-bar refreshes (each refresh syncs with the device).
    """

    model: str = DEFAULT_MODEL
    model_args: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"
    loss_scale: str = "auto"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 64
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    data: str = "synthetic"
    out: str | Path | None = None
    sample_every: int | None = None
    progress: bool = True
    refresh_every: int = 10
    report: bool = True
    command_line: str | None = None
    distributed: str = "ddp"  # under torchrun: ddp | fsdp2 | fsdp1 (precprof.distributed.wrap_model)
    overwrite: bool = False  # replace the run already in ``out`` (else an existing run is refused)

    def validate(self) -> None:
        """Raise UserError for a value no run can use (checked before anything is built)."""
        if self.precision not in PRECISIONS:
            raise UserError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.optimizer not in {o.value for o in OptimizerName}:
            raise UserError(f"unknown optimizer {self.optimizer!r}; choose adamw or sgd")
        parse_loss_scale(self.loss_scale)
        checks = [
            (self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
            (self.batch_size >= 1, f"--batch-size must be at least 1, got {self.batch_size}"),
            (self.seq_len >= 1, f"--seq-len must be at least 1, got {self.seq_len}"),
            (self.lr > 0 and math.isfinite(self.lr), f"--lr must be a positive number, got {self.lr}"),
            (self.weight_decay >= 0, f"--weight-decay must not be negative, got {self.weight_decay}"),
            (self.grad_clip >= 0, f"--grad-clip must be >= 0 (0 disables clipping), got {self.grad_clip}"),
            (self.init_scale > 0, f"--init-scale must be positive, got {self.init_scale}"),
            (self.growth_factor > 1, f"--growth-factor must be > 1, got {self.growth_factor}"),
            (0 < self.backoff_factor < 1, f"--backoff-factor must be in (0, 1), got {self.backoff_factor}"),
            (self.growth_interval >= 1, f"--growth-interval must be at least 1, got {self.growth_interval}"),
            (self.refresh_every >= 1, f"refresh_every must be at least 1, got {self.refresh_every}"),
            (
                self.sample_every is None or self.sample_every >= 0,
                f"--sample-every must be >= 0 (0 records steps only), got {self.sample_every}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)
        from precprof.distributed import STRATEGIES

        if self.distributed not in STRATEGIES:
            raise UserError(
                f"unknown --distributed {self.distributed!r}; choose one of {', '.join(STRATEGIES)}"
            )
        if not (self.device in DEVICES or self.device.startswith("cuda:")):
            raise UserError(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.out is not None:
            rundir.check_target(self.out, overwrite=self.overwrite)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out) if self.out is not None else None
        return d


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


# ------------------------------------------------------------------------------------------ precision
@dataclass(frozen=True)
class PrecisionPlan:
    """What a precision mode means on a given device."""

    precision: Precision
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype
    tf32: bool
    fp8_library: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision.value,
            "autocast_dtype": str(self.autocast_dtype).removeprefix("torch.")
            if self.autocast_dtype
            else None,
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "tf32": self.tf32,
            "fp8_library": self.fp8_library,
        }


def plan_precision(precision: str, device: torch.device, hw: hardware.HardwareInfo) -> PrecisionPlan:
    """The plan for ``precision`` on ``device``; UserError when the device cannot run the mode."""
    try:
        mode = Precision(precision)
    except ValueError:
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}") from None
    where = f"{hw.name} ({device.type})" if device.type == "cuda" else "the CPU"
    cc = ".".join(map(str, hw.compute_capability)) if hw.compute_capability else None
    if mode is Precision.TF32 and not (device.type == "cuda" and hw.tf32_supported):
        raise UserError(
            f"--precision tf32 needs an NVIDIA GPU with compute capability 8.0+ (TF32 exists only in its "
            f"tensor cores); this run is on {where}{f', compute capability {cc}' if cc else ''}: "
            "use --precision fp32 or bf16"
        )
    if mode in (Precision.BF16, Precision.BF16_PURE) and device.type == "cuda" and not hw.bf16_supported:
        raise UserError(
            f"--precision {mode} needs bf16 support, which {hw.name} (compute capability {cc}) lacks: "
            "use --precision fp16 (with loss scaling) instead"
        )
    if mode is Precision.FP8:
        if device.type != "cuda" or not hw.fp8_supported:
            raise UserError(
                f"--precision fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                f"Hopper or newer); this run is on {where}{f', compute capability {cc}' if cc else ''}. "
                "The report's FP8 what-if analysis works in every mode: try --precision bf16"
            )
        lib = hardware.fp8_library()
        if lib is None:
            raise MissingDependencyError("torchao", extra="fp8", purpose="--precision fp8")
        return PrecisionPlan(mode, torch.bfloat16, torch.float32, tf32=False, fp8_library=lib)
    autocast = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(mode)
    params = {Precision.BF16_PURE: torch.bfloat16, Precision.FP16_PURE: torch.float16}.get(
        mode, torch.float32
    )
    return PrecisionPlan(mode, autocast, params, tf32=mode is Precision.TF32)


def parse_loss_scale(spec: str) -> tuple[str, float | None]:
    """``"auto" | "dynamic" | "none" | "static:N"`` -> (kind, N); UserError for anything else."""
    s = spec.strip().lower()
    if s in ("auto", "dynamic", "none"):
        return s, None
    if s.startswith("static:"):
        try:
            value = float(s.split(":", 1)[1])
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value > 0:
            return "static", value
    raise UserError(
        f"--loss-scale {spec!r}: expected dynamic, none or static:N with N > 0 (e.g. static:1024)"
    )


def resolve_loss_scale(spec: str, precision: str) -> tuple[str, float | None]:
    """(kind, static value) with "auto" resolved: dynamic for fp16 and fp16-pure, none otherwise."""
    kind, value = parse_loss_scale(spec)
    if kind == "auto":
        kind = "dynamic" if precision in FP16_MODES else "none"
    return kind, value


class _LowPrecisionGradScaler(torch.amp.GradScaler):
    """A GradScaler that accepts fp16 gradients (fp16-pure): they are unscaled in place, in fp16.

    torch's GradScaler refuses fp16 gradients because unscaling them in fp16 flushes values below 2^-24 to
    zero; in the pure mode that loss is part of what is being measured, as in apex's pure-fp16 (O3) mode.
    """

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def make_scaler(
    config: TrainConfig, plan: PrecisionPlan, device: torch.device
) -> torch.amp.GradScaler | None:
    """The GradScaler for ``config.loss_scale`` (None for "none"); see the module docstring for static:N."""
    kind, value = resolve_loss_scale(config.loss_scale, config.precision)
    if kind == "none":
        return None
    cls = _LowPrecisionGradScaler if plan.param_dtype == torch.float16 else torch.amp.GradScaler
    if kind == "static":
        assert value is not None
        scaler = cls(device.type, init_scale=value, growth_interval=config.growth_interval)
        # GradScaler's constructor insists on growth > 1 and backoff < 1; the setters do not check, and with
        # both at 1 the scale stays N while inf/nan steps are still detected and skipped
        scaler.set_growth_factor(1.0)
        scaler.set_backoff_factor(1.0)
        return scaler
    return cls(
        device.type,
        init_scale=config.init_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval,
    )


def make_optimizer(config: TrainConfig, model: nn.Module, plan: PrecisionPlan) -> torch.optim.Optimizer:
    """AdamW or SGD; for low-precision parameters, the fp32-state variants of ``precprof.optim``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError(
            f"the model ({type(model).__name__}) has no trainable parameters: nothing to train or profile; "
            "check the factory returns the model with its layers (and requires_grad=True)"
        )
    pure = plan.param_dtype != torch.float32
    if config.optimizer == OptimizerName.SGD.value:
        if pure:
            return FP32StateSGD(params, lr=config.lr, momentum=SGD_MOMENTUM, weight_decay=config.weight_decay)
        return torch.optim.SGD(params, lr=config.lr, momentum=SGD_MOMENTUM, weight_decay=config.weight_decay)
    if pure:
        return FP32StateAdamW(params, lr=config.lr, betas=ADAMW_BETAS, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, betas=ADAMW_BETAS, weight_decay=config.weight_decay)


@contextlib.contextmanager
def tf32_flags(enabled: bool, device: torch.device) -> Iterator[None]:
    """Set torch's TF32 flags (matmul and cuDNN) for a CUDA run, restoring them afterwards.

    fp32 runs turn TF32 off explicitly: cuDNN allows it by default, which would make "fp32" convolutions TF32.
    """
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def convert_fp8(model: nn.Module, library: str) -> int:
    """Convert the eligible ``nn.Linear`` layers of ``model`` to fp8 training in place; returns how many.

    Eligible: both dimensions multiples of 16 and a weight not shared with an embedding (a tied output head
    stays in bf16). UserError when no layer qualifies.
    """
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def eligible(mod: nn.Module, fqn: str = "") -> bool:
        return (
            isinstance(mod, nn.Linear)
            and mod.in_features % FP8_DIM_MULTIPLE == 0
            and mod.out_features % FP8_DIM_MULTIPLE == 0
            and id(mod.weight) not in tied
        )

    n = sum(1 for m in model.modules() if eligible(m))
    if n == 0:
        raise UserError(
            "--precision fp8: no nn.Linear layer of this model has both dimensions divisible by 16; "
            "nothing can run in fp8"
        )
    if library == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=eligible)
        return n
    import transformer_engine.pytorch as te

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if eligible(child):
                assert isinstance(child, nn.Linear)
                new = te.Linear(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    params_dtype=child.weight.dtype,
                    device=child.weight.device,
                )
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
                setattr(parent, name, new)
    return n


def _fp8_context(plan: PrecisionPlan) -> contextlib.AbstractContextManager[Any]:
    if plan.fp8_library == "transformer_engine":
        import transformer_engine.pytorch as te

        return te.fp8_autocast(enabled=True)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------- the step
def loss_from_output(out: Any, targets: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """The training loss from a model's output (see the model contract in ``precprof.models``).

    A scalar tensor or an output's ``loss`` is used as is; logits (B, T, V) give the mean next-token
    cross-entropy against ``targets`` (B, T), computed in fp32. UserError for any other output, and for logits
    with fewer classes than ``vocab_size`` (the token ids of the data: cross-entropy would index past them).
    """
    loss = logits = None
    if isinstance(out, torch.Tensor):
        if out.ndim == 0:
            loss = out
        else:
            logits = out
    elif isinstance(out, dict):  # also Hugging Face's ModelOutput
        loss, logits = out.get("loss"), out.get("logits")
    else:
        loss, logits = getattr(out, "loss", None), getattr(out, "logits", None)
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return loss.float()
    if isinstance(logits, torch.Tensor) and logits.ndim == 3 and logits.shape[:2] == targets.shape:
        if vocab_size is not None and logits.shape[-1] < vocab_size:
            raise UserError(
                f"the model's logits have {logits.shape[-1]} classes but the data has {vocab_size} token ids: "
                f"give the model a vocabulary of at least {vocab_size} (e.g. -a vocab_size={vocab_size})"
            )
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
    raise UserError(
        f"the model's forward returned {type(out).__name__}{f' of shape {shape}' if shape else ''}; "
        f"expected logits of shape ({targets.shape[0]}, {targets.shape[1]}, vocab_size) or a scalar loss"
    )


def grad_norm_(params: Sequence[torch.Tensor], max_norm: float = 0.0) -> torch.Tensor:
    """Global L2 norm of the gradients (an fp32 device tensor; no host sync) and, when ``max_norm > 0``,
    clipping as ``torch.nn.utils.clip_grad_norm_`` does (gradients scaled by min(1, max_norm/(norm+1e-6))).

    Norms are accumulated in fp32 whatever the gradient dtype, so fp16 gradients cannot overflow the sum.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if hasattr(total, "full_tensor"):  # FSDP2's DTensor gradients: the norm over every rank's shard
        total = total.full_tensor()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


# ------------------------------------------------------------------------------------------ the loop
def resolve_device(spec: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu; UserError for cuda without a GPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {spec}: no CUDA device is available here; use --device cpu (or auto)")
        dev = torch.device(spec)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev
    if spec == "cpu":
        return torch.device("cpu")
    raise UserError(f"unknown device {spec!r}; choose auto, cpu or cuda")


def default_sample_every(steps: int) -> int:
    """Sampling interval that records about 100 steps of layer statistics."""
    return max(1, round(steps / 100))


def default_out_dir(config: TrainConfig, root: str | Path = "runs") -> Path:
    """``runs/<model>-<precision>-<YYYYmmdd-HHMMSS>`` (with -2, -3... if that directory exists)."""
    name = config.model.removesuffix(".py")
    if ":" in name and not name.startswith("hf:"):
        name = name.rsplit(":", 1)[1]  # a factory: its function name
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.") or "model"
    base = Path(root) / f"{name}-{config.precision}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, i = base, 2
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    return out


def _data_summary(data: TokenSource) -> dict[str, Any]:
    return data.describe()


def _final(
    steps: pd.DataFrame, wall_s: float, data: dict[str, Any], steps_done: int, tokens_per_step: int
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
        "tokens_per_s": steps_done * tokens_per_step / wall_s if wall_s > 0 else math.nan,
        "wall_s": wall_s,
        "step_time_median_s": float(times.median()) if len(times) else math.nan,
        # the best loss the data allows (synthetic: the chain's entropy rate); None when unknown
        "loss_floor_nats": floor,
        "loss_above_floor_nats": avg - floor if floor is not None and math.isfinite(avg) else None,
    }


def _progress(config: TrainConfig, name: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=config.steps,
        desc=name,
        unit="step",
        disable=not config.progress,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=True,
    )


def train(
    config: TrainConfig,
    *,
    profiler_kwargs: dict[str, Any] | None = None,
    callbacks: Sequence[Callback] = (),
) -> TrainResult:
    """Train ``config.model`` with the Profiler attached and write the run directory.

    ``profiler_kwargs`` are passed to ``precprof.capture.Profiler`` (``sample_every`` defaults to
    ``config.sample_every`` or about 100 sampled steps). On an exception or KeyboardInterrupt what was recorded
    is saved with status "incomplete" and the cause, and the exception is re-raised. Raises UserError for
    mistakes in the configuration before anything is written.
    """
    from precprof import distributed

    config.validate()
    user_out = config.out is not None  # else a default name, which moves on to a free one
    # under torchrun (WORLD_SIZE > 1): join the process group; each rank trains on its own device and batches
    dist_info = distributed.init_from_env()
    device = dist_info.device if dist_info is not None else resolve_device(config.device)
    hw = hardware.detect(device)
    plan = plan_precision(config.precision, device, hw)
    loss_kind, static_scale = resolve_loss_scale(config.loss_scale, config.precision)
    data = load_data(config.data, seed=config.seed + (dist_info.rank if dist_info is not None else 0))
    data.check(config.seq_len)
    torch.manual_seed(config.seed)
    built: BuiltModel = build_model(
        config.model, config.model_args, vocab_size=data.vocab_size, seq_len=config.seq_len
    )
    model = built.module.to(device)
    if plan.param_dtype != torch.float32:
        model.to(plan.param_dtype)
    n_fp8 = convert_fp8(model, plan.fp8_library) if plan.fp8_library else 0
    model.train()
    inner = model
    if (
        dist_info is not None
    ):  # the Profiler watches the inner module (plain names); the reducer describes the wrapper
        model = distributed.wrap_model(model, config.distributed, device=device)
        profiler_kwargs = {"reducer": distributed.RankReducer(wrapped=model), **(profiler_kwargs or {})}
    optimizer = make_optimizer(config, model, plan)
    scaler = make_scaler(config, plan, device)
    sample_every = (
        config.sample_every if config.sample_every is not None else default_sample_every(config.steps)
    )
    prof_kwargs = {"sample_every": sample_every, **(profiler_kwargs or {})}
    run_dir = Path(config.out) if config.out is not None else default_out_dir(config)
    config = dataclasses.replace(config, out=run_dir)
    world_size = dist_info.world_size if dist_info is not None else 1
    tokens_per_step = config.batch_size * config.seq_len * world_size  # every rank's batch
    writer = dist_info is None or dist_info.is_writer

    summary: dict[str, Any] = {
        T.SUMMARY_CONFIG: {
            **config.to_dict(),
            "device": str(device),
            "device_requested": config.device,
            "loss_scaling": loss_kind,
            "static_scale": static_scale,
            "sample_every": prof_kwargs["sample_every"],
            "plan": plan.to_dict(),
            "fp8_layers": n_fp8,
            "optimizer_class": type(optimizer).__name__,
            "data": _data_summary(data),
            "tf32_matmul": plan.tf32 if device.type == "cuda" else False,
        },
        T.SUMMARY_HARDWARE: hw.to_dict(),
        T.SUMMARY_VERSIONS: hardware.software_versions(),
        T.SUMMARY_MODEL: built.info(),
    }
    if (
        device.type == "cpu"
        and config.precision in FP16_MODES
        and config.progress
        and not hardware.cpu_fp16_native()
    ):
        print(
            "precprof: note: this CPU has no fp16 arithmetic; torch emulates fp16 matmuls, about 15x slower "
            "than fp32 (bf16 runs natively or close to it)",
            file=sys.stderr,
        )
    summary[T.SUMMARY_CONFIG]["world_size"] = world_size
    claimed: rundir.RunDir | None = None
    if writer:  # the run directory is checked, created and locked before the first step
        if user_out:
            claimed = rundir.claim(run_dir, overwrite=config.overwrite, summary=summary)
        else:
            claimed = rundir.claim_new(run_dir, summary=summary)
        if claimed.path != run_dir:
            run_dir = claimed.path
            config = dataclasses.replace(config, out=run_dir)
            summary[T.SUMMARY_CONFIG]["out"] = str(run_dir)
    try:
        return _train_loop(
            config,
            summary,
            built,
            model,
            inner,
            optimizer,
            scaler,
            plan,
            data,
            device,
            run_dir,
            prof_kwargs,
            tokens_per_step,
            writer,
            dist_info,
            callbacks,
        )
    finally:
        if claimed is not None:
            claimed.release()


def _train_loop(
    config: TrainConfig,
    summary: dict[str, Any],
    built: BuiltModel,
    model: nn.Module,
    inner: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    plan: PrecisionPlan,
    data: TokenSource,
    device: torch.device,
    run_dir: Path,
    prof_kwargs: dict[str, Any],
    tokens_per_step: int,
    writer: bool,
    dist_info: Any,
    callbacks: Sequence[Callback],
) -> TrainResult:
    """The steps of ``train`` and the end of the run, on a claimed run directory."""
    from precprof import distributed
    from precprof.capture import Profiler

    params = [p for group in optimizer.param_groups for p in group["params"]]
    prof = Profiler(inner, optimizer=optimizer, scaler=scaler, **prof_kwargs)
    run = TrainRun(config, model, optimizer, scaler, prof, device, run_dir)

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if plan.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=plan.autocast_dtype)

    bar = _progress(
        config if writer else dataclasses.replace(config, progress=False), f"{built.name} {config.precision}"
    )
    steps_done = 0
    t_start = time.perf_counter()
    t_refresh, steps_at_refresh = t_start, 0
    try:
        with tf32_flags(plan.tf32, device), prof:
            for cb in callbacks:
                cb.on_start(run)
            for step in range(config.steps):
                run.step = step
                x, y = data.batch(config.batch_size, config.seq_len, device)
                with autocast(), _fp8_context(plan):
                    out = model(x, targets=y) if built.pass_targets else model(x)
                    with prof.memory_scope():  # what the loss saves for backward counts as activations
                        loss = loss_from_output(out, y, data.vocab_size)
                run.loss = loss.detach()
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                for cb in callbacks:
                    cb.after_backward(run)
                if scaler is not None:
                    scaler.unscale_(optimizer)
                norm = grad_norm_(params, config.grad_clip)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                with _signals.deferred(note=None):  # the step is recorded and counted, or neither
                    prof.step(loss=run.loss, grad_norm=norm, tokens=tokens_per_step)
                    steps_done = step + 1
                if steps_done % config.refresh_every == 0 or steps_done == config.steps:
                    # the only host syncs of the loop: loss value, scale, throughput since the last refresh
                    now = time.perf_counter()
                    postfix = {"loss": f"{run.loss.item():.4f}"}
                    if scaler is not None:
                        postfix["scale"] = f"{scaler.get_scale():g}"
                    postfix["tok/s"] = (
                        f"{(steps_done - steps_at_refresh) * tokens_per_step / (now - t_refresh):,.0f}"
                    )
                    bar.set_postfix(postfix, refresh=False)
                    t_refresh, steps_at_refresh = now, steps_done
                bar.update(1)
                for cb in callbacks:
                    cb.on_step_end(run)
                _signals.check()  # a Ctrl-C or SIGTERM whose exception was swallowed on the way stops here
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall_s = time.perf_counter() - t_start
            for cb in callbacks:
                cb.on_end(run)
    except BaseException as e:
        with _signals.deferred():  # a second Ctrl-C must not cut the save short
            bar.close()
            interrupted = _signals.as_interrupted(e)
            if interrupted is not None:
                _signals.consume()
            reason = interrupted.reason if interrupted is not None else f"{type(e).__name__}: {e}"
            # a crashed run gets its tables, summary and report of the steps recorded, marked incomplete
            _save_incomplete(
                prof,
                run_dir,
                summary,
                reason,
                time.perf_counter() - t_start,
                data,
                steps_done,
                tokens_per_step,
                render=config.report and writer,
            )
        with contextlib.suppress(AttributeError):  # for the CLI's message
            e.precprof_run_dir = run_dir  # type: ignore[attr-defined]
        if hasattr(e, "add_note"):
            e.add_note(f"precprof: the partial run was saved to {run_dir}")
        if dist_info is not None and dist_info.owns_group:
            distributed.shutdown(barrier=False)
        raise
    bar.close()
    steps_table = prof.tables()["steps"]
    summary[T.SUMMARY_FINAL] = _final(steps_table, wall_s, _data_summary(data), steps_done, tokens_per_step)
    prof.save(run_dir, summary=summary, status=T.STATUS_COMPLETE, render=config.report and writer)
    if dist_info is not None and dist_info.owns_group:
        distributed.shutdown()  # after rank 0 wrote: its barrier waits for it
    final_summary = T.read_summary(run_dir)
    return TrainResult(
        run_dir=run_dir,
        final_loss=float(summary[T.SUMMARY_FINAL]["final_loss"]),
        steps=steps_table,
        summary=final_summary,
    )


def _save_incomplete(
    prof: Any,
    run_dir: Path,
    summary: dict[str, Any],
    reason: str,
    wall_s: float,
    data: TokenSource,
    steps_done: int,
    tokens_per_step: int,
    render: bool,
) -> None:
    """Best effort: a failure here must not hide the exception that stopped training."""
    try:
        steps_table = prof.tables()["steps"]
        summary[T.SUMMARY_FINAL] = _final(
            steps_table, wall_s, _data_summary(data), steps_done, tokens_per_step
        )
        prof.save(run_dir, summary=summary, status=T.STATUS_INCOMPLETE, reason=reason, render=render)
    except Exception as err:  # the original exception is re-raised by the caller
        warnings.warn(f"precprof: could not save the partial run to {run_dir}: {err}", stacklevel=2)
