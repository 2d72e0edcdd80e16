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

Compiling (``--compile`` / ``--no-compile``, ``TrainConfig.compile``): fp8 compiles by default, being fast only
compiled; the other modes run eager unless asked (``precprof.training.compiling``).

Loss scaling (``--loss-scale``, default ``dynamic`` for fp16 and fp16-pure, ``none`` otherwise):
``dynamic`` is ``torch.amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval)``;
``static:N`` is a GradScaler whose scale stays N (growth and backoff factors 1): it still checks every step
for inf/nan gradients and skips those steps, but never changes the scale; ``none`` scales nothing.

One optimizer step: forward and loss (under autocast), ``scaler.scale(loss).backward()``,
``scaler.unscale_`` (so the gradient norm and clipping see true gradients), the gradient norm (and clipping
to ``--grad-clip``), ``scaler.step`` + ``scaler.update()``, ``zero_grad(set_to_none=True)``, then
``Profiler.step(loss, grad_norm, tokens)``. The loop itself syncs with the device only to refresh the progress
bar (every ``refresh_every`` steps, and once after the first step, which the bar's tokens/s leaves out: it
warms up); GradScaler.step syncs once per step, as it always does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from precprof.modes import parse_loss_scale, resolve_loss_scale
from precprof.training.config import TrainConfig, default_out_dir, default_sample_every, writes_run_dir

if TYPE_CHECKING:
    from precprof.training.loop import (
        Callback,
        TrainResult,
        TrainRun,
        grad_norm_,
        loss_from_output,
        notes_once,
        train,
    )
    from precprof.training.precision import (
        PrecisionPlan,
        convert_fp8,
        make_optimizer,
        make_scaler,
        plan_precision,
        resolve_device,
        tf32_flags,
    )

# the names that live in the modules that import torch, loaded on first use (PEP 562): the CLI reads
# TrainConfig's defaults for its options, and `precprof report` must not pay for torch to do it
_LOADED_ON_USE = {
    "loop": ("Callback", "TrainResult", "TrainRun", "grad_norm_", "loss_from_output", "notes_once", "train"),
    "precision": (
        "PrecisionPlan",
        "convert_fp8",
        "make_optimizer",
        "make_scaler",
        "plan_precision",
        "resolve_device",
        "tf32_flags",
    ),
}

__all__ = [
    "Callback",
    "PrecisionPlan",
    "TrainConfig",
    "TrainResult",
    "TrainRun",
    "convert_fp8",
    "default_out_dir",
    "default_sample_every",
    "grad_norm_",
    "loss_from_output",
    "make_optimizer",
    "make_scaler",
    "notes_once",
    "parse_loss_scale",
    "plan_precision",
    "resolve_device",
    "resolve_loss_scale",
    "tf32_flags",
    "train",
    "writes_run_dir",
]


def __getattr__(name: str) -> Any:
    if not any(name in names for names in _LOADED_ON_USE.values()):
        raise AttributeError(f"module 'precprof.training' has no attribute {name!r}")
    from precprof.training import loop, precision  # import torch

    for module in (loop, precision):
        globals().update({n: getattr(module, n) for n in _LOADED_ON_USE[module.__name__.rsplit(".", 1)[1]]})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
