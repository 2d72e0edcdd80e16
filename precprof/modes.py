"""Names of the built-in loop's options (precision modes, optimizers, devices, the default model, distributed
strategies) and the parsing of their values; torch-free, so that the CLI can parse and reject arguments before
importing torch, and `precprof report` never imports it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

from precprof.errors import UserError


class Precision(str, Enum):
    """The precision modes of the built-in loop (see ``precprof.training``)."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_PURE = "bf16-pure"
    FP16_PURE = "fp16-pure"
    FP8 = "fp8"

    def __str__(self) -> str:
        return self.value


class OptimizerName(str, Enum):
    ADAMW = "adamw"
    SGD = "sgd"

    def __str__(self) -> str:
        return self.value


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"

    def __str__(self) -> str:
        return self.value


PRECISIONS: tuple[str, ...] = tuple(p.value for p in Precision)
DEFAULT_MODEL = "gpt-nano"  # the built-in model `precprof train` trains when --model is not given
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp2", "fsdp1")  # --distributed, under torchrun
DEVICES: tuple[str, ...] = tuple(d.value for d in Device)
# precision modes whose gradients are fp16 and therefore need a loss scale by default
FP16_MODES: tuple[str, ...] = (Precision.FP16.value, Precision.FP16_PURE.value)
AUTOCAST_MODES = frozenset({"bf16", "fp16", "fp8"})  # fp8: torchao Float8Linear under bf16 autocast
PURE_MODES = frozenset({"bf16-pure", "fp16-pure"})  # parameters held in 16 bits, no fp32 master copy
FP32_STORAGE_MODES = frozenset({"fp32", "tf32"})  # tf32 only changes matmul arithmetic, not storage
# a run seen training in float64 (``model.double()``): the name ``Profiler.precision_seen``, the report and the
# advisor give it, no mode of the built-in loop (``precprof train`` takes no --precision fp64). Autocast leaves
# float64 ops alone, so a float64 model under autocast trains in it too; FP32 halves every float64 tensor.
FP64 = "fp64"
# one colour per mode, wherever runs of several modes are drawn together (compare.html)
MODE_COLORS: dict[str, str] = {
    Precision.FP32.value: "#1f4e79",
    Precision.TF32.value: "#5b8db8",
    Precision.BF16.value: "#ff7f0e",
    Precision.BF16_PURE.value: "#b35806",
    Precision.FP16.value: "#d62728",
    Precision.FP16_PURE.value: "#8c1515",
    Precision.FP8.value: "#9467bd",
}
assert set(MODE_COLORS) == set(PRECISIONS), "every precision mode has a colour"


# The largest loss scale a GradScaler can hold: it keeps the scale in an fp32 tensor (larger values fail with
# "value cannot be converted to type float without overflow" at the first step)
MAX_LOSS_SCALE = (2 - 2.0**-23) * 2.0**127


def valid_loss_scale(value: float) -> bool:
    """Whether ``value`` can be a loss scale: positive, finite and at most ``MAX_LOSS_SCALE``."""
    return math.isfinite(value) and 0 < value <= MAX_LOSS_SCALE


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
        if valid_loss_scale(value):
            return "static", value
    raise UserError(
        f"--loss-scale {spec!r}: expected dynamic, none or static:N with 0 < N <= {MAX_LOSS_SCALE:.1e} "
        "(the scaler holds it in fp32), e.g. static:1024"
    )


def resolve_loss_scale(spec: str, precision: str) -> tuple[str, float | None]:
    """(kind, static value) with "auto" resolved: dynamic for fp16 and fp16-pure, none otherwise."""
    kind, value = parse_loss_scale(spec)
    if kind == "auto":
        kind = "dynamic" if precision in FP16_MODES else "none"
    return kind, value


def parse_model_args(items: Sequence[str]) -> dict[str, str]:
    """``["k=v", ...]`` (repeated ``--model-arg``) -> {k: v}; a malformed item raises UserError."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UserError(f"--model-arg {item!r}: expected KEY=VALUE, e.g. --model-arg n_layer=2")
        out[key] = value.strip()
    return out
