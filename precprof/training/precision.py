"""What a precision mode means on a device: the plan (autocast dtype, parameter dtype, TF32, FP8 library),
the loss scaler, the optimizer, and the FP8 conversion of eligible layers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from precprof import _compat, hardware, taxonomy
from precprof._quiet_imports import quiet_imports
from precprof.errors import MissingDependencyError, UserError
from precprof.modes import PRECISIONS, OptimizerName, Precision, resolve_loss_scale
from precprof.optim import FP32StateAdamW, FP32StateSGD
from precprof.training.config import TrainConfig

ADAMW_BETAS = (0.9, 0.95)  # nanoGPT's; the second moment adapts faster than torch's 0.999 default
SGD_MOMENTUM = 0.9


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


def make_scaler(
    config: TrainConfig, plan: PrecisionPlan, device: torch.device
) -> torch.amp.GradScaler | None:
    """The GradScaler for ``config.loss_scale`` (None for "none"); see the module docstring for static:N."""
    kind, value = resolve_loss_scale(config.loss_scale, config.precision)
    if kind == "none":
        return None
    cls = _compat.LowPrecisionGradScaler if plan.param_dtype == torch.float16 else torch.amp.GradScaler
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


def convert_fp8(model: nn.Module, library: str, tokens: int | None = None) -> int:
    """Convert the eligible ``nn.Linear`` layers of ``model`` to fp8 training in place; returns how many.

    Eligible (``taxonomy.fp8_eligible_names``, the rule the advisor applies to a recorded run): its weight a
    parameter of its own (not computed by weight_norm or spectral_norm), not tied to an embedding (a tied output
    head stays in bf16), both dimensions multiples of 16, and ``tokens`` (batch x sequence per call) a multiple
    of 16 when given. UserError when no layer qualifies.
    """
    names = set(taxonomy.fp8_eligible_names(model, tokens))

    def eligible(mod: nn.Module, fqn: str = "") -> bool:
        return fqn in names

    n = len(names)
    if n == 0:
        raise UserError(
            "--precision fp8: no nn.Linear layer of this model is FP8-eligible (its weight a parameter of its "
            "own, not computed by weight_norm or spectral_norm, both dimensions divisible by 16, not tied to an "
            "embedding"
            + (f", {tokens} tokens per call divisible by 16" if tokens is not None else "")
            + "); nothing can run in fp8"
        )
    if library == "torchao":
        with quiet_imports():  # torchao's import logs lines about itself (precprof._quiet_imports)
            from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=eligible)
        return n
    import transformer_engine.pytorch as te

    for pname, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if eligible(child, f"{pname}.{name}" if pname else name):
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


def fp8_context(plan: PrecisionPlan) -> contextlib.AbstractContextManager[Any]:
    if plan.fp8_library == "transformer_engine":
        import transformer_engine.pytorch as te

        return te.fp8_autocast(enabled=True)
    return contextlib.nullcontext()


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
