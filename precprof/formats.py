"""The number formats precprof reasons about: limits and the exact rounding thresholds of a real cast.

Pure data. Every threshold here is what a round-to-nearest-even cast from fp32 does (docs/design.md, "Numeric
facts"), and tests check each one against ``x.to(dtype)`` on CPU.

For a value x observed with loss scale s (s = 1 in the forward pass):

- x underflows to zero in a format iff ``0 < |x*s| <= underflow_max`` (half the smallest subnormal: the tie
  rounds to the even neighbour, zero);
- x overflows iff ``|x*s| >= overflow_min`` (the midpoint between the largest finite value and the next
  power-of-two step above it, where round-to-nearest-even goes to inf). fp8_e4m3 (the ``fn`` variant) has no
  inf: torch saturates to +-448, and values with ``|x*s| > 464`` are counted as overflow all the same
  (``overflow_inclusive=False``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Fmt(str, Enum):
    """Format names used in tables, the CLI and the report."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class NumberFormat:
    """One floating-point format.

    ``exponent_bits``/``mantissa_bits`` are the stored fields (the implicit leading bit is not counted).
    ``max`` is the largest finite value, ``smallest_normal`` and ``smallest_subnormal`` the smallest positive
    normal and subnormal values. ``underflow_max``: values with ``0 < |v| <= underflow_max`` become 0 in a cast.
    ``overflow_min``: values with ``|v| >= overflow_min`` (or ``> overflow_min`` when ``overflow_inclusive`` is
    False) do not survive a cast as finite values of their own magnitude. ``dtype_name``: the storage dtype for
    a real cast as the tables' dtype column spells it ("float8_e4m3fn"; None for tf32, which only exists inside
    matmul units, and for formats torch has no dtype for). Pure data, without torch: `precprof report` reads
    formats and never imports torch; ``torch_dtype`` imports it when asked.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    underflow_max: float
    overflow_min: float
    overflow_inclusive: bool
    dtype_name: str | None
    has_inf: bool
    label: str = ""  # how the report writes it: "FP8 E4M3"
    color: str = "#333333"  # its colour in every figure and in the page's CSS

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype of ``dtype_name`` (None for tf32)."""
        if self.dtype_name is None:
            return None
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def min_exponent(self) -> int:
        """floor(log2) of the smallest subnormal."""
        return math.floor(math.log2(self.smallest_subnormal))

    @property
    def max_exponent(self) -> int:
        """floor(log2) of the largest finite value."""
        return math.floor(math.log2(self.max))

    @property
    def normal_min_exponent(self) -> int:
        return math.floor(math.log2(self.smallest_normal))

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    def ulp_exponent(self, exponent: int) -> int:
        """log2 of the spacing of representable values in the binade [2^exponent, 2^(exponent+1))."""
        return max(exponent, self.normal_min_exponent) - self.mantissa_bits


def _make(
    name: str,
    exponent_bits: int,
    mantissa_bits: int,
    max_value: float,
    dtype_name: str | None,
    *,
    has_inf: bool = True,
    overflow_min: float | None = None,
    overflow_inclusive: bool = True,
    label: str,
    color: str,
) -> NumberFormat:
    bias = 2 ** (exponent_bits - 1) - 1
    smallest_normal = 2.0 ** (1 - bias)
    smallest_subnormal = 2.0 ** (1 - bias - mantissa_bits)
    if overflow_min is None:
        # halfway between max and the next step of the top binade
        top_exp = math.floor(math.log2(max_value))
        overflow_min = max_value + 2.0 ** (top_exp - mantissa_bits - 1)
    return NumberFormat(
        name=name,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=max_value,
        smallest_normal=smallest_normal,
        smallest_subnormal=smallest_subnormal,
        underflow_max=smallest_subnormal / 2,
        overflow_min=overflow_min,
        overflow_inclusive=overflow_inclusive,
        dtype_name=dtype_name,
        has_inf=has_inf,
        label=label,
        color=color,
    )


FP32 = _make("fp32", 8, 23, (2 - 2.0**-23) * 2.0**127, "float32", label="FP32", color="#1f4e79")
# TF32 keeps fp32's range and 10 mantissa bits; it exists only inside tensor-core matmuls.
TF32 = _make("tf32", 8, 10, (2 - 2.0**-10) * 2.0**127, None, label="TF32", color="#5b8db8")
BF16 = _make("bf16", 8, 7, (2 - 2.0**-7) * 2.0**127, "bfloat16", label="BF16", color="#ff7f0e")
FP16 = _make("fp16", 5, 10, 65504.0, "float16", label="FP16", color="#d62728")
# e4m3fn: no inf, the all-ones pattern is nan, so the largest finite value is 1.75 * 2^8 = 448; a value above
# 464 (halfway to 480) would round past it. torch saturates such casts to +-448; precprof counts them as
# overflow, ties at exactly 464 round down to 448 (even mantissa) and are not counted.
FP8_E4M3 = _make(
    "fp8_e4m3",
    4,
    3,
    448.0,
    "float8_e4m3fn",
    has_inf=False,
    overflow_min=464.0,
    overflow_inclusive=False,
    label="FP8 E4M3",
    color="#9467bd",
)
FP8_E5M2 = _make("fp8_e5m2", 5, 2, 57344.0, "float8_e5m2", label="FP8 E5M2", color="#2ca02c")

FORMATS: dict[str, NumberFormat] = {f.name: f for f in (FP32, TF32, BF16, FP16, FP8_E4M3, FP8_E5M2)}

# The formats with a per-tensor what-if count in the tables (in this order everywhere).
WHATIF_FORMATS: tuple[str, ...] = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
# fp8 what-if under per-tensor current scaling: e4m3 for forward tensors, e5m2 for gradients (the usual
# "hybrid" recipe), both recorded for every tensor.
FP8_FORMATS: tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2")

# dtype names (the tables' spelling) of the formats narrower than fp32: a tensor in one of them is low precision
LOW_PRECISION_DTYPES: frozenset[str] = frozenset(
    f.dtype_name for f in FORMATS.values() if f.dtype_name is not None and f.bits < 32
)

FP32_MIN_EXPONENT = -149  # floor(log2) of fp32's smallest subnormal
FP32_MAX_EXPONENT = 127


def get(name: str) -> NumberFormat:
    """Look a format up by name; raises ValueError naming the known formats."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}") from None


def label(name: str) -> str:
    """Display name of a format ("fp8_e4m3" -> "FP8 E4M3") or of a family of them ("fp8" -> "FP8")."""
    fmt = FORMATS.get(name)
    return fmt.label if fmt is not None else name.upper().replace("_", " ")


# torchao's floor on a tensor's amax when it computes an FP8 scale (``torchao.float8.float8_utils.EPS``:
# ``fmax / clamp(amax, min=1e-12)``): below it the scale stops growing, and a tensor whose largest value is under
# it flushes more than its own amax would. Transformer Engine's current scaling has none by default (its
# ``amax_epsilon`` is 0): its scale, fmax / amax, is at least the floored one, and flushes no more.
FP8_AMAX_FLOOR = 1e-12


def current_scaling_exponent(fmt: NumberFormat, amax: float) -> int:
    """Per-tensor current scaling, power-of-two variant: k such that 2^k = 2^floor(log2(fmt.max / max(amax,
    FP8_AMAX_FLOOR))).

    This is the scale torchao's tensorwise recipe applies with ``round_scales_to_power_of_2=True`` so that the
    tensor's largest magnitude lands just below the format's max, amax taken as at least its floor of 1e-12
    (``FP8_AMAX_FLOOR``); Transformer Engine's current-scaling recipe with power-of-two scales (``power_2_scale``)
    has no floor, and scales a tensor under 1e-12 by more. Both recipes' default scales (torchao's
    fmax / max(amax, 1e-12), Transformer Engine's fmax / amax) are at least 2^k and flush no value this one
    keeps. amax must be finite and > 0.
    """
    amax = max(amax, FP8_AMAX_FLOOR)
    # exact: the largest k with amax * 2^k <= fmax (log2 of the quotient can round up across a power of two)
    k = math.frexp(fmt.max)[1] - math.frexp(amax)[1]
    while math.ldexp(amax, k) > fmt.max:
        k -= 1
    while math.ldexp(amax, k + 1) <= fmt.max:
        k += 1
    return k


def current_scaling_exponent_cap(fmt: NumberFormat) -> int:
    """The largest exponent ``current_scaling_exponent`` gives in ``fmt``: that of a tensor whose largest value
    is torchao's amax floor or less (48 in e4m3, 55 in e5m2). Each statistics engine caps its k with it."""
    return current_scaling_exponent(fmt, FP8_AMAX_FLOOR)
