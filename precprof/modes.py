"""Names of the built-in loop's options (precision modes, optimizers, devices); torch-free, so that the CLI can
parse and reject arguments before importing torch."""

from __future__ import annotations

from enum import Enum


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
DEVICES: tuple[str, ...] = tuple(d.value for d in Device)
# precision modes whose gradients are fp16 and therefore need a loss scale by default
FP16_MODES: tuple[str, ...] = (Precision.FP16.value, Precision.FP16_PURE.value)
