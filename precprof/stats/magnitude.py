"""|x| as fp64 bit patterns, from x's own bits by integer operations (the torch-op engine's first step).

The torch-op engine keys every value by its fp64 exponent field and whether its mantissa is zero (``layout``).
Taking ``abs`` of the value widened to fp64 leaves that to the device's float unit, and on CUDA it went wrong:
PTX leaves the sign of ``abs(nan)`` unspecified, a negative nan kept its sign bit, its key came out negative
and ``index_add_`` ended the process's CUDA context with a device-side assert (H100, torch 2.11). Here the
magnitude is built from the source dtype's raw bits with shifts, masks and adds only, like the Triton kernel:

- the sign bit is masked off first, so every result is a non-negative int64 and its exponent field
  (``bits >> 52``) lies in [0, 2047] whatever the input: keys stay in [0, 4096) by construction;
- a normal value is its exponent and mantissa moved into fp64's fields (a shift and one add of the bias
  difference); a subnormal one is its mantissa, an integer, converted to fp64 (exact: no subnormal is
  involved) and scaled by a power of two as an integer add to the exponent field, so no device's treatment of
  subnormals (flush to zero) can change a count;
- inf and nan keep fp64's all-ones exponent and a (non)zero mantissa; fp8 e4m3fn has no inf and one nan.

Any other floating dtype is widened by a float copy and its sign bit masked (fp64 needs no widening).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ABS_MASK = (1 << 63) - 1  # every bit but the sign of an int64
_F64_NAN_E4M3 = (0x7FF << 52) | (7 << 49)  # e4m3fn's one nan (S.1111.111), as fp64 bits


@dataclass(frozen=True)
class SourceBits:
    """How a dtype's bits read: the integer view of the same width, exponent and mantissa widths, bias, and
    whether the all-ones exponent means inf/nan (IEEE) or only its all-ones mantissa is nan (e4m3fn)."""

    view: torch.dtype
    exp_bits: int
    mant_bits: int
    bias: int
    ieee_specials: bool = True

    @property
    def magnitude_mask(self) -> int:
        return (1 << (self.exp_bits + self.mant_bits)) - 1

    @property
    def exp_all(self) -> int:
        return (1 << self.exp_bits) - 1


SOURCES: dict[torch.dtype, SourceBits] = {
    torch.float32: SourceBits(torch.int32, 8, 23, 127),
    torch.bfloat16: SourceBits(torch.int16, 8, 7, 127),
    torch.float16: SourceBits(torch.int16, 5, 10, 15),
    torch.float8_e4m3fn: SourceBits(torch.uint8, 4, 3, 7, ieee_specials=False),
    torch.float8_e5m2: SourceBits(torch.uint8, 5, 2, 15),
}


def abs_bits(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the fp64 bit patterns of |part| (1-D) into ``out`` (int64, at least as long) and return that
    slice. Integer operations on ``part``'s own bits (module docstring); exact, never syncs. Temporaries: at
    most 25 bytes per value of ``part``, freed on return."""
    n = part.numel()
    bits = out[:n]
    if part.dtype == torch.float64:
        bits.copy_(part.view(torch.int64)).bitwise_and_(ABS_MASK)
        return bits
    src = SOURCES.get(part.dtype)
    if src is None:  # another floating dtype: a float widening (exact for every format narrower than fp64)
        bits.view(torch.float64).copy_(part)
        return bits.bitwise_and_(ABS_MASK)
    m_bits = src.mant_bits
    r = part.view(src.view).to(torch.int64).bitwise_and_(src.magnitude_mask)  # sign dropped
    exp = r >> m_bits
    # a normal value: fields moved into fp64's (e << 52 | m << (52 - M)), the bias difference added
    torch.bitwise_left_shift(r, 52 - m_bits, out=bits)
    bits.add_((1023 - src.bias) << 52)
    # a subnormal one (exponent field 0): m * 2^(1 - bias - M), with m converted exactly as an integer
    mant = r.bitwise_and_((1 << m_bits) - 1)
    sub = mant.to(torch.float64).view(torch.int64)
    sub.add_((1 - src.bias - m_bits) << 52).masked_fill_(mant == 0, 0)  # 0 stays 0
    torch.where(exp == 0, sub, bits, out=bits)
    del sub
    if src.ieee_specials:  # all-ones exponent: inf (mantissa 0) or nan
        special = mant.bitwise_left_shift_(52 - m_bits).bitwise_or_(0x7FF << 52)
        torch.where(exp == src.exp_all, special, bits, out=bits)
    else:  # e4m3fn: only S.1111.111 is nan; the rest of that binade is finite
        bits.masked_fill_((exp == src.exp_all) & (mant == (1 << m_bits) - 1), _F64_NAN_E4M3)
    return bits
