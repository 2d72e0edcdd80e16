"""Block-scaled formats (MXFP8, MXFP6, MXFP4, NVFP4): the exact reference quantisation and its loss counts.

How this plugs into the one-pass engines later. For an MX recipe the block scale is a power of two, so an
element's fate depends only on d = floor(log2|x|) - floor(log2 amax_block) and its own mantissa: a histogram
of d per tensor (with, per bin, how many values are exact powers of two, since a tie at half the smallest
subnormal rounds to zero) gives the flushed count of every MX element format and both scale modes from one
pass; "rceil" shifts a block's d by one when fl(amax / max) is not a power of two, so it needs d binned per
(block shifted or not). Saturation only happens in the block-max binade (d = 0): count those values by
mantissa above the element max's mantissa (floor mode). SQNR needs the rounding error itself: a fused
elementwise sum of (x - q)^2 per recipe. NVFP4 needs more: its block scales are E4M3 values times an fp32
per-tensor scale built from the tensor's amax, so it needs that amax before the blocks (a second pass, or the
previous step's amax) and per-element comparisons against each block's own non-power-of-two thresholds.

The rules, read from the OCP MX v1.0 spec and torchao 0.18 (``torchao.prototype.mx_formats``):

- Blocks run along one axis (the last by default: the reduction dimension of the matmul that reads the tensor;
  pass ``axis=-2`` for the transposed orientation a weight-gradient matmul reads). A length that is not a
  multiple of the block size is padded with zeros (they change no block's amax and are not counted); torchao
  refuses such tensors instead.
- Element rounding is round-to-nearest-even with saturation: a scaled magnitude above the element format's max
  is clamped to it (MX spec; torchao clamps before its casts). "Saturated" counts the values that overflow
  as a real cast would (DESIGN.md): the scaled magnitude |x / scale|, in the recipe's fp32 arithmetic, rounded
  to nearest-even in the element format with its exponent unbounded above, lands above the element max
  (``saturation_bound``: E4M3 |y| > 464, E5M2 |y| >= 61440, FP6 E2M3 |y| >= 7.75, E3M2 |y| >= 30, FP4 E2M1
  |y| >= 7). A value above max that rounds to max anyway (an NVFP4 block max that fp32 rounding puts at
  6.0000005) is clamped with no loss beyond its rounding and is not counted. "Flushed" counts nonzero inputs
  whose dequantised value is zero.
- MX (block 32, E8M0 scale 2^k, k clamped to [-127, 127]). ``floor`` (OCP): k = floor(log2 amax) - emax_elem,
  where emax_elem = floor(log2 element max). ``rceil`` (cuBLAS / torchao RCEIL): k = the smallest integer with
  2^k >= fl32(amax / element max), so amax lands at or below the element max and nothing saturates except when
  that fp32 division rounds down. Blocks whose amax is 0 get k = -127, and so do rceil blocks whose
  fl32(amax / element max) is 0 (amax below the max times 2^-150: every k qualifies, the smallest is
  taken, as torchao's clamped ceil(log2 0) and cvt.rp.satfinite.ue8m0 of 0 give). An rceil block whose k
  is -127 (E8M0's stored exponent 0: fl32(amax / element max) <= 2^-127, an amax of at most the element max
  times 2^-127) multiplies its values by 1, not 2^127, before the element cast, as Transformer Engine's
  ``exp2f_rcp`` (1 for exponent 0) and torchao's RCEIL after it do, and dequantises with 2^-127: every
  nonzero value there flushes (the largest, 57344 * 2^-127, is far below any element's smallest subnormal).
- NVFP4 (block 16, FP4 E2M1 elements), two-level scaling as torchao's ``nvfp4_quantize`` and the NVIDIA
  recipe: per-tensor fp32 scale p = fl(amax_tensor / (448 * 6)); block scale s = E4M3(clamp(fl(fl(amax_block /
  6) / p), 2^-6, 448)); elements q = E2M1(clamp(x * fl(fl(1 / p) / s), -6, 6)); dequantised q * fl(p * s).
  Every fl() is one fp32 rounding, in that order (torchao multiplies by the reciprocal, as its kernels do).
  An all-zero tensor quantises to zeros (torchao's 0/0 would give nan). Tiny tensors: where torchao's
  reciprocals overflow, its factor is inf, every nonzero value saturates and a zero becomes 0 * inf = nan,
  which its E2M1 cast turns into 1.5; Transformer Engine's NVFP4 kernels clamp the global and the per-block
  encode scales to the fp32 max instead, and so does this: p is at
  least ``NVFP4_TENSOR_SCALE_MIN`` (the smallest fp32 whose reciprocal is finite; amax below 2688 * 2^-128,
  about 2^-116.6) and fl(fl(1 / p) / s) at most the fp32 max (reached from amax below about 2^-110.6 in blocks
  with a small scale). Wherever torchao's factor is finite, nothing differs.
- Non-finite inputs: an MX block holding a nan or inf has no finite scale (OCP: the E8M0 scale is NaN) and
  dequantises to nan entirely; for NVFP4 the per-tensor amax is then non-finite and the whole tensor is nan.
  Those values are counted as ``poisoned`` and left out of every other count and of the error sums. (torchao
  agrees for nan; for inf it saturates the inf and keeps the block finite.)

Everything is torch ops on the input's device; nothing here syncs with the host except ``sqnr_db``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F

from precprof import formats, tables
from precprof.errors import UserError
from precprof.formats import NumberFormat

# The MX element formats narrower than fp8. They have no inf and no nan; a value above max is clamped to it.
# They have no torch dtype to cast to. Their ``overflow_min`` is the same rule as fp8's (formats.py): the
# smallest magnitude that round-to-nearest-even, with the exponent unbounded above, takes past max, i.e. max
# plus half the top binade's spacing, and whether that tie itself rounds up. Worked out from the encodings:
# each max has an all-ones mantissa (odd), so the tie rounds up to the next power of two (even mantissa) and
# is counted (inclusive): E2M3 max 7.5 = 1.111b * 2^2, the tie 7.75 goes to 8; E3M2 max 28 = 1.11b * 2^4, the
# tie 30 goes to 32; E2M1 max 6 = 1.1b * 2^2, the tie 7 goes to 8. (E5M2 the same: 57344 = 1.11b * 2^15, the
# tie 61440 goes to 65536, a float8_e5m2 cast gives inf; E4M3's max 448 = 1.110b * 2^8 is even, its tie 464
# goes down to 448 and only |x| > 464 is counted.) ``_make``'s defaults are exactly this rule.
# (fp8's two formats are formats.FP8_E4M3 / FP8_E5M2 themselves.)
FP6_E2M3 = formats._make("fp6_e2m3", 2, 3, 7.5, None, has_inf=False, label="FP6 E2M3", color="#8c564b")
FP6_E3M2 = formats._make("fp6_e3m2", 3, 2, 28.0, None, has_inf=False, label="FP6 E3M2", color="#e377c2")
FP4_E2M1 = formats._make("fp4_e2m1", 2, 1, 6.0, None, has_inf=False, label="FP4 E2M1", color="#7f7f7f")

ELEMENT_FORMATS: dict[str, NumberFormat] = {
    f.name: f for f in (formats.FP8_E4M3, formats.FP8_E5M2, FP6_E2M3, FP6_E3M2, FP4_E2M1)
}

E8M0_MIN_EXPONENT = -127  # E8M0 encodes 2^-127 .. 2^127 (and 0xFF = nan)
E8M0_MAX_EXPONENT = 127
NVFP4_SCALE_MIN = 2.0**-6  # torchao clamps the E4M3 block scale to finfo(e4m3fn).tiny (no subnormal scales)
# the smallest fp32 whose reciprocal is finite (2^-128 + 2^-149, bits 0x00200001): NVFP4's per-tensor scale is
# clamped to it, so that fl(1 / p) stays finite for tensors of amax below ~2^-116.6 (module docstring)
NVFP4_TENSOR_SCALE_BITS = 0x00200001
NVFP4_TENSOR_SCALE_MIN = 2.0**-128 + 2.0**-149
FLOAT32_MAX = torch.finfo(torch.float32).max


@functools.cache
def saturation_bound(fmt: NumberFormat) -> float:
    """The largest fp32 magnitude an element format does not saturate: a scaled value y is counted as
    ``saturated`` when |y| > this, i.e. when it rounds (nearest-even, exponent unbounded above) past the
    format's max, as a real cast overflows (``fmt.overflow_min``; DESIGN.md). E4M3 464; E5M2 just below 61440;
    FP6 E2M3 just below 7.75; FP6 E3M2 just below 30; FP4 E2M1 just below 7. One comparison per value, the
    same in the reference, the C kernel and the Triton kernels."""
    t = torch.tensor(fmt.overflow_min, dtype=torch.float32)
    if fmt.overflow_inclusive:
        t = torch.nextafter(t, torch.zeros_like(t))
    return float(t)


def exponent_bias(fmt: NumberFormat) -> int:
    """The format's exponent bias, 2^(exponent_bits - 1) - 1 (7 for E4M3, 1 for E2M1)."""
    return 2 ** (fmt.exponent_bits - 1) - 1


class ScaleMode(str, Enum):
    """How an MX block's E8M0 scale exponent is chosen (see the module docstring)."""

    FLOOR = "floor"  # OCP MX v1.0: floor(log2 amax) - emax_elem
    RCEIL = "rceil"  # cuBLAS / torchao RCEIL: round fl(amax / elem max) up to a power of two

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BlockRecipe:
    """One block-scaled recipe: element format, block size and how the block scale is made.

    ``scale_format`` is "e8m0" (MX: power-of-two scales, chosen by ``scale_mode``) or "e4m3" (NVFP4: an E4M3
    block scale times an fp32 per-tensor scale, ``per_tensor_scale``).
    """

    name: str
    element: NumberFormat
    block_size: int
    scale_format: str
    scale_mode: ScaleMode | None = None
    per_tensor_scale: bool = False
    label: str = ""

    def with_scale_mode(self, mode: ScaleMode | str) -> BlockRecipe:
        """The same MX recipe with another scale mode ("floor" or "rceil")."""
        if self.scale_format != "e8m0":
            raise UserError(
                f"{self.name} has no scale mode (its block scale is {self.scale_format}); drop it"
            )
        try:
            m = ScaleMode(mode)
        except ValueError:
            raise UserError(
                f"unknown scale mode {mode!r}; use one of: {', '.join(m.value for m in ScaleMode)}"
            ) from None
        return replace(self, scale_mode=m)


def _mx(name: str, element: NumberFormat, label: str) -> BlockRecipe:
    return BlockRecipe(name, element, 32, "e8m0", ScaleMode.FLOOR, label=label)


MXFP8_E4M3 = _mx("mxfp8_e4m3", formats.FP8_E4M3, "MXFP8 E4M3")
MXFP8_E5M2 = _mx("mxfp8_e5m2", formats.FP8_E5M2, "MXFP8 E5M2")
MXFP6_E2M3 = _mx("mxfp6_e2m3", FP6_E2M3, "MXFP6 E2M3")
MXFP6_E3M2 = _mx("mxfp6_e3m2", FP6_E3M2, "MXFP6 E3M2")
MXFP4 = _mx("mxfp4", FP4_E2M1, "MXFP4")
NVFP4 = BlockRecipe("nvfp4", FP4_E2M1, 16, "e4m3", None, per_tensor_scale=True, label="NVFP4")

RECIPES: dict[str, BlockRecipe] = {
    r.name: r for r in (MXFP8_E4M3, MXFP8_E5M2, MXFP6_E2M3, MXFP6_E3M2, MXFP4, NVFP4)
}


def get_recipe(name: str, scale_mode: ScaleMode | str | None = None) -> BlockRecipe:
    """A recipe by name ("mxfp4"), optionally with an MX scale mode; UserError naming the known ones."""
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise UserError(f"unknown block recipe {name!r}; known: {', '.join(RECIPES)}") from None
    return recipe if scale_mode is None else recipe.with_scale_mode(scale_mode)


def column_recipes() -> tuple[BlockRecipe, ...]:
    """The recipes of the layers table's block columns, in ``tables.BLOCK_RECIPES`` order (a name ending in
    ``_rceil`` is that MX recipe in rceil mode)."""
    out = []
    for name in tables.BLOCK_RECIPES:
        base, rceil = (name.removesuffix("_rceil"), True) if name.endswith("_rceil") else (name, False)
        recipe = RECIPES[base]
        out.append(replace(recipe.with_scale_mode(ScaleMode.RCEIL), name=name) if rceil else recipe)
    return tuple(out)


def per_recipes(
    memo: dict[int, tuple[Any, Any]], recipes: Sequence[BlockRecipe], compute: Callable[[], Any]
) -> Any:
    """``compute()`` for a set of recipes, kept in ``memo`` by the identity of ``recipes`` when it is a tuple
    (immutable: its identity stands for its value while ``memo`` holds it). A hot path asks per tensor, and
    comparing or hashing seven recipes field by field costs about 10 us."""
    held = memo.get(id(recipes))
    if held is not None and held[0] is recipes:
        return held[1]
    value = compute()
    if isinstance(recipes, tuple):
        memo[id(recipes)] = (recipes, value)
    return value


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for integer k in [-127, 127], exactly (built from the bits; 2^-127 is subnormal)."""
    k = k.to(torch.int32)
    normal = torch.bitwise_left_shift(k + 127, 23)
    return torch.where(k >= -126, normal, torch.full_like(k, 1 << 22)).view(torch.float32)


def _div(a: torch.Tensor, d: float) -> torch.Tensor:
    """fl(a / d) for a Python number ``d``, correctly rounded on every device. A CUDA kernel turns division by
    a host scalar into multiplication by its reciprocal, one ulp off whenever 1/d is inexact (1/6, 1/448): on
    an H100 that moved one NVFP4 saturated count in 4 of 18 cases. Dividing by a tensor on ``a``'s device is
    IEEE division everywhere."""
    return a / torch.full((), d, dtype=a.dtype, device=a.device)


def round_to_element(v: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Round float32 ``v`` to ``fmt`` with round-to-nearest-even and saturation to +-fmt.max; float32 result.

    Exact float ops: the value is clamped, then divided by its spacing (a power of two, read from the exponent
    bits: exact), rounded half-to-even by ``torch.round`` and multiplied back. nan stays nan; the sign of zero
    is kept.
    """
    a = v.float().clamp(-fmt.max, fmt.max)
    e = torch.bitwise_right_shift(a.view(torch.int32), 23).bitwise_and(0xFF) - 127  # floor(log2|a|); -127: 0
    e = e.clamp(min=fmt.normal_min_exponent)  # subnormals share the smallest normal binade's spacing
    ulp = torch.bitwise_left_shift(e - fmt.mantissa_bits + 127, 23).view(torch.float32)
    return torch.round(a / ulp) * ulp


def _check(x: torch.Tensor, recipe: BlockRecipe, axis: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise UserError(f"block quantisation needs a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UserError(
            f"block quantisation starts from float32, bfloat16 or float16, got {x.dtype}; cast it first (x.float())"
        )
    if x.dim() == 0:
        raise UserError(
            "block quantisation needs a tensor with at least one dimension; reshape it (x.reshape(1))"
        )
    if not -x.dim() <= axis < x.dim():
        raise UserError(
            f"axis {axis} is out of range for a {x.dim()}-d tensor; use -{x.dim()}..{x.dim() - 1}"
        )
    if not isinstance(recipe, BlockRecipe):
        raise UserError(f"recipe must be a BlockRecipe (one of: {', '.join(RECIPES)}), got {recipe!r}")


def _quantize(x: torch.Tensor, recipe: BlockRecipe, axis: int) -> tuple[torch.Tensor, ...]:
    """(x as float32, dequantised, saturated mask, poisoned mask), all in x's shape and axis order."""
    _check(x, recipe, axis)
    xf = x.float().movedim(axis, -1)
    n = xf.shape[-1]
    b = recipe.block_size
    pad = -n % b
    xb = F.pad(xf, (0, pad)) if pad else xf
    xb = xb.reshape(*xb.shape[:-1], xb.shape[-1] // b, b)  # (..., blocks, b)
    amax = xb.abs().amax(dim=-1, keepdim=True)  # (..., blocks, 1); nan if the block holds a nan
    fmt = recipe.element
    if recipe.scale_format == "e8m0":
        ok = torch.isfinite(amax)
        if recipe.scale_mode == ScaleMode.RCEIL:
            d = _div(amax, fmt.max)
            mant, ex = torch.frexp(d)  # fl32(amax / max) = mant * 2^ex, mant in [0.5, 1)
            k = ex - (mant == 0.5).to(ex.dtype)  # ceil(log2): one less when it is a power of two
            k = torch.where(d > 0, k, E8M0_MIN_EXPONENT)  # a quotient of 0: every 2^k is >= it
        else:
            _, ex = torch.frexp(amax)
            k = ex - 1 - fmt.max_exponent  # floor(log2 amax) - emax_elem
        k = torch.where((amax > 0) & ok, k, E8M0_MIN_EXPONENT).clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
        scale = _pow2(k)
        # exact: a power of two (results below fp32's normals are far below half a subnormal)
        scaled = xb / scale
        if recipe.scale_mode == ScaleMode.RCEIL:  # E8M0's smallest scale: a factor of 1 (module docstring)
            scaled = torch.where(k == E8M0_MIN_EXPONENT, xb, scaled)
        deq = round_to_element(scaled, fmt) * scale  # exact: a few significant bits times a power of two
        poisoned = ~ok
    else:  # NVFP4, torchao's arithmetic step by step (module docstring)
        tmax = xb.abs().amax() if xb.numel() else xb.new_zeros(())
        ok = torch.isfinite(tmax)
        p = torch.where(tmax > 0, _div(tmax, formats.FP8_E4M3.max * fmt.max), 1.0).clamp(
            min=NVFP4_TENSOR_SCALE_MIN
        )  # all-zero tensor: any p works
        s = round_to_element(
            (_div(amax, fmt.max) / p).clamp(NVFP4_SCALE_MIN, formats.FP8_E4M3.max), formats.FP8_E4M3
        )
        scaled = xb * ((1.0 / p) / s).clamp(max=FLOAT32_MAX)  # an overflowing factor is the fp32 max
        deq = round_to_element(scaled, fmt) * (p * s)
        poisoned = ~ok.expand(amax.shape)
    saturated = (scaled.abs() > saturation_bound(fmt)) & ~poisoned
    deq = torch.where(poisoned, torch.nan, deq)

    def back(t: torch.Tensor) -> torch.Tensor:
        t = t.expand(xb.shape).reshape(*xb.shape[:-2], -1)
        return (t[..., :n] if pad else t).movedim(-1, axis)

    return xf.movedim(-1, axis), back(deq), back(saturated), back(poisoned)


def quantize(x: torch.Tensor, recipe: BlockRecipe, axis: int = -1) -> torch.Tensor:
    """Quantise ``x`` to ``recipe`` along ``axis`` and dequantise: float32, x's shape, on x's device.

    What an MX/NVFP4 matmul would read instead of ``x``. Blocks with a nan/inf dequantise to nan (for NVFP4,
    the whole tensor). Raises UserError for a non-float tensor, a 0-d tensor or a bad axis.
    """
    return _quantize(x, recipe, axis)[1]


STAT_KEYS: tuple[str, ...] = ("total", "poisoned", "flushed", "saturated", "sum_x2", "sum_err2")


def block_stats(x: torch.Tensor, recipe: BlockRecipe, axis: int = -1) -> dict[str, torch.Tensor]:
    """What quantising ``x`` to ``recipe`` along ``axis`` loses, as 0-d tensors on x's device (no host sync).

    - ``total``: elements of x (int64);
    - ``poisoned``: elements in blocks (NVFP4: tensors) holding a nan or inf, which dequantise to nan;
    - ``flushed``: nonzero values whose dequantised value is zero;
    - ``saturated``: values whose scaled magnitude rounds past the element max (``saturation_bound``) and
      was clamped to it;
    - ``sum_x2``, ``sum_err2``: sum of x^2 and of (x - q)^2 over the values that are not poisoned, in float64
      so that sums over layers and steps merge (``merge_stats``); ``sqnr_db`` turns them into a figure.
    """
    xf, deq, saturated, poisoned = _quantize(x, recipe, axis)
    keep = ~poisoned
    x64 = torch.where(keep, xf, 0.0).double()
    err = torch.where(keep, xf.double() - deq.double(), 0.0)
    return {
        "total": torch.tensor(xf.numel(), dtype=torch.int64, device=xf.device),
        "poisoned": poisoned.sum(),
        "flushed": ((xf != 0) & (deq == 0) & keep).sum(),
        "saturated": saturated.sum(),
        "sum_x2": (x64 * x64).sum(),
        "sum_err2": (err * err).sum(),
    }


def merge_stats(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two ``block_stats`` results added up (counts and float64 sums), e.g. over steps or over tensors."""
    return {k: a[k] + b[k] for k in STAT_KEYS}


def sqnr_db(stats: Mapping[str, torch.Tensor | float]) -> float:
    """Signal-to-quantisation-noise ratio, 10·log10(sum x^2 / sum (x - q)^2), in dB.

    inf when nothing was lost (no error; an all-zero tensor included). Reads two numbers: one host sync.
    """
    signal, noise = float(stats["sum_x2"]), float(stats["sum_err2"])
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
