"""The format table against docs/design.md's literal values, torch.finfo and real round-to-nearest-even casts.

Every threshold is checked at the value itself and at its fp32 neighbours on both sides (``torch.nextafter``),
cast with ``x.to(dtype)`` on CPU. Exact arithmetic (``fractions.Fraction``) settles what torch's saturating
fp8_e4m3fn cast hides.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from precprof import formats
from precprof.formats import Fmt

CAST_FORMATS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]

# docs/design.md, "Numeric facts the code must get exactly right", written out literally.
DESIGN_TABLE = {
    # name: (max finite, smallest subnormal, underflow_max, overflow_min, overflow_inclusive)
    "fp16": (65504.0, 2.0**-24, 2.0**-25, 65520.0, True),
    "bf16": ((2 - 2.0**-7) * 2.0**127, 2.0**-133, 2.0**-134, (2 - 2.0**-8) * 2.0**127, True),
    "fp8_e4m3": (448.0, 2.0**-9, 2.0**-10, 464.0, False),
    "fp8_e5m2": (57344.0, 2.0**-16, 2.0**-17, 61440.0, True),
}

FIELDS = {  # name: (exponent bits, mantissa bits, smallest normal, has inf, torch dtype)
    "fp32": (8, 23, 2.0**-126, True, torch.float32),
    "tf32": (8, 10, 2.0**-126, True, None),
    "bf16": (8, 7, 2.0**-126, True, torch.bfloat16),
    "fp16": (5, 10, 2.0**-14, True, torch.float16),
    "fp8_e4m3": (4, 3, 2.0**-6, False, torch.float8_e4m3fn),
    "fp8_e5m2": (5, 2, 2.0**-14, True, torch.float8_e5m2),
}


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(math.inf, dtype=x.dtype))


def next_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(0.0, dtype=x.dtype))


def cast(x: torch.Tensor, dtype: torch.dtype) -> float:
    """Round-trip one value through ``dtype`` (a real cast) and back to a Python float (exact)."""
    return float(x.to(dtype).double())


def smallest_subnormal(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    sub = getattr(fi, "smallest_subnormal", None)
    return float(sub) if sub is not None else float(fi.tiny) * float(fi.eps)


# ------------------------------------------------------------------------------------------- the table
@pytest.mark.parametrize("name", CAST_FORMATS)
def test_design_table_literal(name: str) -> None:
    fmt = formats.get(name)
    fmax, sub, umax, omin, inclusive = DESIGN_TABLE[name]
    assert fmt.max == fmax
    assert fmt.smallest_subnormal == sub
    assert fmt.underflow_max == umax
    assert fmt.overflow_min == omin
    assert fmt.overflow_inclusive is inclusive


@pytest.mark.parametrize("name", list(FIELDS))
def test_fields(name: str) -> None:
    fmt = formats.get(name)
    ebits, mbits, normal, has_inf, dtype = FIELDS[name]
    assert fmt.name == name
    assert (fmt.exponent_bits, fmt.mantissa_bits) == (ebits, mbits)
    assert fmt.bits == 1 + ebits + mbits
    assert fmt.smallest_normal == normal
    assert fmt.smallest_subnormal == normal * 2.0**-mbits
    assert fmt.underflow_max == fmt.smallest_subnormal / 2
    assert fmt.has_inf is has_inf
    assert fmt.torch_dtype is dtype
    assert fmt.min_exponent == math.frexp(fmt.smallest_subnormal)[1] - 1
    assert fmt.max_exponent == math.frexp(fmt.max)[1] - 1
    assert fmt.normal_min_exponent == math.frexp(fmt.smallest_normal)[1] - 1


@pytest.mark.parametrize("name", ["fp32", *CAST_FORMATS])
def test_against_finfo(name: str) -> None:
    fmt = formats.get(name)
    fi = torch.finfo(fmt.torch_dtype)
    assert fmt.max == float(fi.max)
    assert fmt.smallest_normal == float(fi.smallest_normal) == float(fi.tiny)
    assert fmt.smallest_subnormal == smallest_subnormal(fmt.torch_dtype)
    assert fmt.bits == fi.bits
    assert 2.0**-fmt.mantissa_bits == float(fi.eps)


def test_tf32_and_fp32() -> None:
    assert formats.TF32.max == (2 - 2.0**-10) * 2.0**127
    assert formats.TF32.smallest_subnormal == 2.0**-136
    assert formats.FP32.smallest_subnormal == 2.0**-149
    assert formats.FP32.overflow_min == (2 - 2.0**-24) * 2.0**127
    assert formats.FP32_MIN_EXPONENT == -149 == formats.FP32.min_exponent
    assert formats.FP32_MAX_EXPONENT == 127 == formats.FP32.max_exponent
    # fp32's own thresholds, against a (single-rounding) fp64 -> fp32 cast
    omin = torch.tensor(formats.FP32.overflow_min, dtype=torch.float64)
    assert math.isinf(cast(omin, torch.float32))
    assert cast(next_down(omin), torch.float32) == formats.FP32.max
    umax = torch.tensor(formats.FP32.underflow_max, dtype=torch.float64)
    assert cast(umax, torch.float32) == 0.0
    assert cast(next_up(umax), torch.float32) == 2.0**-149


def test_names_and_lookup() -> None:
    assert [str(f) for f in Fmt] == list(formats.FORMATS)
    assert Fmt("fp8_e4m3") is Fmt.FP8_E4M3
    assert formats.WHATIF_FORMATS == ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
    assert formats.FP8_FORMATS == ("fp8_e4m3", "fp8_e5m2")
    for name in formats.FORMATS:
        assert formats.get(name) is formats.FORMATS[name]
    with pytest.raises(ValueError, match="fp16"):
        formats.get("fp12")


# ------------------------------------------------------------------------------------------- real casts
@pytest.mark.parametrize("name", CAST_FORMATS)
def test_underflow_threshold_against_casts(name: str) -> None:
    fmt = formats.get(name)
    dtype = fmt.torch_dtype
    for sign in (1.0, -1.0):
        t = f32(sign * fmt.underflow_max)
        assert cast(t, dtype) == 0.0  # the tie rounds to the even neighbour, zero
        assert cast(next_down(t), dtype) == 0.0
        assert cast(next_up(t) if sign > 0 else -next_up(-t), dtype) == sign * fmt.smallest_subnormal
        # the smallest subnormal survives, and so do its neighbours
        s = f32(sign * fmt.smallest_subnormal)
        assert cast(s, dtype) == sign * fmt.smallest_subnormal
        for v in (next_up(s.abs()), next_down(s.abs())):
            assert cast(sign * v, dtype) == sign * fmt.smallest_subnormal
    # the smallest normal is exact, and the largest subnormal is exact
    assert cast(f32(fmt.smallest_normal), dtype) == fmt.smallest_normal
    largest_sub = fmt.smallest_normal - fmt.smallest_subnormal
    assert cast(f32(largest_sub), dtype) == largest_sub


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e5m2"])
def test_overflow_threshold_against_casts(name: str) -> None:
    fmt = formats.get(name)
    dtype = fmt.torch_dtype
    assert fmt.overflow_inclusive and fmt.has_inf
    for sign in (1.0, -1.0):
        t = f32(fmt.overflow_min)
        assert cast(sign * t, dtype) == sign * math.inf  # the tie rounds to inf (max has an odd mantissa)
        assert cast(sign * next_up(t), dtype) == sign * math.inf
        assert cast(sign * next_down(t), dtype) == sign * fmt.max
        assert cast(f32(sign * fmt.max), dtype) == sign * fmt.max
        assert cast(sign * next_up(f32(fmt.max)), dtype) == sign * fmt.max


def test_e4m3_overflow_rule() -> None:
    fmt = formats.FP8_E4M3
    dtype = torch.float8_e4m3fn
    assert not fmt.has_inf and not fmt.overflow_inclusive
    t = f32(464.0)
    up, down = next_up(t), next_down(t)
    # torch saturates: the tie, both neighbours, far beyond and inf all cast to +-448
    for v in (t, up, down, f32(480.0), f32(1e30), f32(math.inf)):
        assert cast(v, dtype) == 448.0
        assert cast(-v, dtype) == -448.0
    # exact arithmetic: 464 is the midpoint of 448 (mantissa 1.110, even) and 480 (1.111, odd, not
    # representable: the all-ones pattern is nan); the tie goes to 448, anything above is nearer 480.
    assert Fraction(464) - 448 == 480 - Fraction(464)
    assert 448 == 0b1110 * 2**5 and 480 == 0b1111 * 2**5
    up_exact = Fraction(float(up))
    assert up_exact > 464
    assert abs(up_exact - 480) < abs(up_exact - 448)
    down_exact = Fraction(float(down))
    assert abs(down_exact - 448) < abs(down_exact - 480)
    # the rule: |x| > 464 overflows; 464 itself does not
    assert fmt.overflow_min == 464.0  # so 464 itself is not > overflow_min
    assert float(up) > fmt.overflow_min


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_ulp_exponent_against_casts(name: str) -> None:
    """For every binade of the format, 2^e + ulp is representable and 2^e + ulp/2 is a tie to the even side."""
    fmt = formats.get(name)
    dtype = fmt.torch_dtype
    for e in range(fmt.min_exponent, fmt.max_exponent + 1):
        u = fmt.ulp_exponent(e)
        base = 2.0**e
        one_ulp = f32(base + 2.0**u)
        half_ulp = f32(base + 2.0 ** (u - 1))
        assert float(one_ulp) == base + 2.0**u and float(half_ulp) == base + 2.0 ** (u - 1)  # exact in fp32
        if base + 2.0**u <= fmt.max:
            assert cast(one_ulp, dtype) == base + 2.0**u
        # a tie: 2^e has an even significand, except the smallest subnormal (significand 1), whose upper
        # neighbour 2^(e+1) is the even one
        assert cast(half_ulp, dtype) == (base if e > fmt.min_exponent else 2 * base)


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_every_representable_value_is_classified(name: str) -> None:
    """Enumerate the format's bit patterns (fp8) or a dense grid of them: no finite value of the format itself
    underflows or overflows by the rule."""
    fmt = formats.get(name)
    dtype = fmt.torch_dtype
    if fmt.bits == 8:
        values = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    else:
        values = torch.arange(0, 1 << 16, 7, dtype=torch.int32).to(torch.int16).view(dtype).double()
    finite = values[torch.isfinite(values) & (values != 0)].abs()
    assert bool((finite > fmt.underflow_max).all())
    assert bool((finite < fmt.overflow_min).all())
    assert float(finite.max()) <= fmt.max
    if fmt.bits == 8:
        assert float(finite.max()) == fmt.max and float(finite.min()) == fmt.smallest_subnormal


# ------------------------------------------------------------------------------------------- current scaling
TORCHAO_EPS = 1e-12  # torchao.float8.float8_utils.EPS: the least amax its FP8 scale is computed from


def brute_force_cs_exponent(fmax: float, amax: float) -> int:
    """The largest k with amax * 2^k <= fmax, by exact power-of-two steps (ldexp is exact here)."""
    k = 0
    while math.ldexp(amax, k) > fmax:
        k -= 1
    while math.ldexp(amax, k + 1) <= fmax:
        k += 1
    return k


def _fp32_amax_candidates() -> list[float]:
    out: list[float] = []
    inf32 = np.float32(np.inf)
    for e in range(-149, 128):
        for m in (1.0, 1.25, 1.5, 1.75, 1.875):
            base = np.float32(math.ldexp(m, e))
            if base == 0 or not np.isfinite(base):
                continue
            for v in (base, np.nextafter(base, inf32), np.nextafter(base, np.float32(0))):
                if v > 0 and np.isfinite(v):
                    out.append(float(v))
    return out


@pytest.mark.parametrize("name", formats.FP8_FORMATS)
def test_current_scaling_exponent_fp32_amax(name: str) -> None:
    fmt = formats.get(name)
    for amax in _fp32_amax_candidates():
        k = formats.current_scaling_exponent(fmt, amax)
        assert k == brute_force_cs_exponent(fmt.max, max(amax, TORCHAO_EPS)), amax
        # the scaled amax lands in (fmax/2, fmax]; under torchao's floor, lower
        top = math.ldexp(amax, k)
        assert fmt.max / 2 < top <= fmt.max if amax >= TORCHAO_EPS else top <= fmt.max * amax / TORCHAO_EPS


@pytest.mark.parametrize("name", formats.FP8_FORMATS)
def test_current_scaling_exponent_examples(name: str) -> None:
    fmt = formats.get(name)
    assert formats.current_scaling_exponent(fmt, fmt.max) == 0
    assert formats.current_scaling_exponent(fmt, fmt.max * 2) == -1
    assert formats.current_scaling_exponent(fmt, fmt.max / 2) == 1
    assert formats.current_scaling_exponent(fmt, 1.0) == math.floor(math.log2(fmt.max))
    assert formats.current_scaling_exponent(fmt, 2.0**-39) == math.floor(math.log2(fmt.max)) + 39
    # under torchao's floor (2^-40 < 1e-12 < 2^-39) the scale stops growing at fmax / 1e-12, rounded down to a
    # power of two: 2^-41 gets the scale 2^-40 gets, not twice it
    floor_k = math.floor(math.log2(fmt.max / 1e-12))
    assert formats.current_scaling_exponent(fmt, 2.0**-41) == floor_k == math.floor(math.log2(fmt.max)) + 40
    assert formats.current_scaling_exponent(fmt, 2.0**-149) == floor_k


@pytest.mark.parametrize("name", formats.FP8_FORMATS)
def test_current_scaling_exponent_fp64_amax(name: str) -> None:
    fmt = formats.get(name)
    for e in range(-140, 120, 7):
        amax = math.nextafter(math.ldexp(1.75, e), math.inf)
        want = brute_force_cs_exponent(fmt.max, max(amax, TORCHAO_EPS))
        assert formats.current_scaling_exponent(fmt, amax) == want, amax
