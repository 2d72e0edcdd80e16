"""The block what-if's ``saturated`` and ``flushed`` counts at their boundaries, value by value, against an
independent computation written from the rules, on hand-built blocks: a value exactly at the element max, just
above it, one above it that rounds down to it anyway, one that rounds up to it, the overflow tie itself and the
values either side of it (E4M3, E5M2, E2M1), a block whose OCP exponent is
below E8M0's smallest (2^-127), NVFP4 block maxima within an fp32 rounding of 6 either way, an E4M3 block scale
next to a rounding tie, a block scale under E4M3's smallest normal, nan/inf and all-zero blocks. The reference,
the C kernel and the Triton kernels (Triton's interpreter on CPU) must all give these counts.

The independent computation: MX (OCP MX v1.0 section 6.3) takes the shared exponent floor(log2 amax) -
emax_elem and makes the scale a real ``float8_e8m0fnu`` cast of 2^k (E8M0 holds 2^-127 .. 2^127, so 2^-129 casts
to 2^-127, the same clamp as OCP's reference code ``microxcaling``; rceil, cuBLAS's rule, at 2^-127 multiplies by
1 instead, as Transformer Engine's exp2f_rcp and torchao do); elements are the exact quotient x / 2^k clamped
to the element max and rounded by a real fp8 cast (E4M3, E5M2) or on the E2M1 grid written out by hand.
NVFP4 follows torchao 0.18's ``nvfp4_quantize`` operation by operation in numpy float32 (the per-tensor scale
p = fl(amax / 2688) is an fp32 number; block scale E4M3(clamp(fl(fl(amax_b / 6) / p), 2^-6, 448)) by a real
cast; elements x * fl(fl(1 / p) / s)). "Saturated" is what a real cast calls overflow (DESIGN.md): the scaled
value, in that fp32 arithmetic, rounded to nearest-even in the element format with its exponent unbounded above,
lands above the element max. Decided here by real casts where torch has them (E5M2: the cast gives inf; E4M3:
float8_e4m3fn saturates instead, so half the value is cast one binade down, where the grid is the same) and on
the E2M1 grid extended by the next binade's first code, 8 (even), by hand. A value above the max that rounds to
it anyway (an NVFP4 block max that fp32 rounding puts at 6.0000005) is clamped but not counted.

These are the cases where tester h91's own quantiser (s23) differed from precprof: it kept 2^-129 as an MX scale,
computed NVFP4 in float64 from 2688 / amax instead of the fp32 per-tensor scale, rounded that float64 block scale
through fp32 onto an E4M3 tie (184 -> 192 where the exact value, 183.99999, gives 176), and did not clamp block
scales to 2^-6.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch

from precprof import block_formats as bf
from precprof import tables as T
from precprof.stats import blocks as pb
from precprof.stats import kernel as ck
from precprof.stats import triton_block as tb

F32 = np.float32
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # code i holds E2M1_GRID[i]; even codes win ties
E2M1_UNBOUNDED = [
    *E2M1_GRID,
    8.0,
]  # code 8: 1.0b * 2^3, the next binade's first value, were the exponent wider
MX_RECIPES = [
    bf.get_recipe(name.removesuffix("_rceil"), "rceil" if name.endswith("_rceil") else None)
    for name in T.BLOCK_RECIPES
    if name != "nvfp4"
]
REAL_CAST = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp32(v: float) -> float:
    got = float(F32(v))
    assert got == v, f"{v!r} is not an fp32 value"
    return got


def on_e2m1_grid(v: Fraction, grid: list[float] = E2M1_GRID) -> Fraction:
    """v, already clamped to [-grid[-1], grid[-1]], rounded to nearest on the E2M1 grid, ties to the even code."""
    a = abs(v)
    hi = next(i for i, g in enumerate(grid) if g >= a)
    if grid[hi] == a or hi == 0:
        r = Fraction(grid[hi])
    else:
        lo_d, hi_d = a - Fraction(grid[hi - 1]), Fraction(grid[hi]) - a
        pick_hi = hi_d < lo_d or (hi_d == lo_d and hi % 2 == 0)
        r = Fraction(grid[hi if pick_hi else hi - 1])
    return -r if v < 0 else r


def overflows(v: Fraction, fmt: bf.NumberFormat) -> bool:
    """Whether the exact value v rounds (nearest-even, exponent unbounded above) past the element max."""
    a = abs(v)
    if a >= 2 ** (fmt.max_exponent + 1):  # at or past the next power of two: nothing rounds it back down
        return True
    if fmt.name == "fp8_e5m2":  # the cast rounds past 57344 to inf
        return math.isinf(float(torch.tensor([float(a)]).to(torch.float8_e5m2).float()))
    if fmt.name == "fp8_e4m3":  # e4m3fn saturates, so a / 2 (exact) one binade down, on the same grid
        assert Fraction(float(a / 2)) == a / 2
        return float(torch.tensor([float(a / 2)]).to(torch.float8_e4m3fn).float()) * 2 > fmt.max
    if fmt.name == "fp4_e2m1":
        return on_e2m1_grid(a, E2M1_UNBOUNDED) > Fraction(fmt.max)
    raise AssertionError(f"no independent rounding for {fmt.name} here")


def element(v: Fraction, fmt: bf.NumberFormat) -> Fraction:
    """Saturating round-to-nearest-even of an exact value: clamp to +-max, then a real cast where torch has one."""
    c = max(min(v, Fraction(fmt.max)), -Fraction(fmt.max))
    if fmt.name in REAL_CAST:
        as32 = float(c)
        assert Fraction(as32) == c, "the clamped quotient must be exact in fp32 for the real cast"
        return Fraction(float(torch.tensor([as32]).to(REAL_CAST[fmt.name]).float()))
    if fmt.name == "fp4_e2m1":
        return on_e2m1_grid(c)
    raise AssertionError(f"no independent rounding for {fmt.name} here")  # FP6: the reference tests' grids


def ref_mx(row: list[float], recipe: bf.BlockRecipe) -> tuple[list[float], int, int, int]:
    """One 32-value block by the OCP rule: (dequantised, saturated, flushed, poisoned)."""
    fmt = recipe.element
    if not all(math.isfinite(v) for v in row):
        return [math.nan] * len(row), 0, 0, len(row)  # OCP: the scale is NaN, the block dequantises to NaN
    amax = max(abs(v) for v in row)
    if amax == 0:
        return [0.0 * v for v in row], 0, 0, 0
    if recipe.scale_mode == bf.ScaleMode.RCEIL:
        mant, ex = math.frexp(float(F32(amax) / F32(fmt.max)))
        k = ex - (mant == 0.5)  # the smallest k with 2^k >= fl32(amax / max)
    else:
        k = math.frexp(amax)[1] - 1 - math.floor(math.log2(fmt.max))  # floor(log2 amax) - emax_elem
    scale = Fraction(float(torch.tensor([2.0**k]).to(torch.float8_e8m0fnu).float()))  # real E8M0 cast
    # rceil at E8M0's smallest scale (stored exponent 0) multiplies by 1, as Transformer Engine's exp2f_rcp
    down = 1 if recipe.scale_mode == bf.ScaleMode.RCEIL and scale == Fraction(2) ** -127 else 1 / scale
    out, sat, flushed = [], 0, 0
    for v in row:
        s = Fraction(v) * down
        sat += overflows(s, fmt)
        q = element(s, fmt) * scale
        flushed += v != 0 and q == 0
        out.append(math.copysign(float(q), v))
    return out, sat, flushed, 0


def ref_nvfp4(x: list[float]) -> tuple[list[float], list[bool], int, int]:
    """A tensor (a multiple of 16 values) as torchao's nvfp4_quantize does it, in fp32 step by step:
    (dequantised, saturated per value, flushed, poisoned)."""
    if not all(math.isfinite(v) for v in x):
        return [math.nan] * len(x), [False] * len(x), 0, len(x)  # a non-finite amax: all of it is nan
    p = F32(F32(max(abs(v) for v in x)) / F32(448.0 * 6.0))
    assert p > bf.NVFP4_TENSOR_SCALE_MIN  # the clamp for tiny tensors is another test's
    out, sat, flushed = [], [], 0
    for b in range(0, len(x), 16):
        blk = [F32(v) for v in x[b : b + 16]]
        pre = F32(F32(max(abs(v) for v in blk) / F32(6.0)) / p)
        pre = min(max(pre, F32(2.0**-6)), F32(448.0))  # torchao clamps to E4M3_EPS (2^-6) and 448
        s = F32(float(torch.tensor([float(pre)]).to(torch.float8_e4m3fn).float()))  # real E4M3 cast
        factor, back = F32(F32(F32(1.0) / p) / s), F32(p * s)
        for v in blk:
            scaled = F32(v * factor)
            sat.append(overflows(Fraction(float(scaled)), bf.FP4_E2M1))
            q = F32(float(on_e2m1_grid(Fraction(float(np.clip(scaled, -6, 6))))))
            d = F32(q * back)
            flushed += v != 0 and d == 0
            out.append(math.copysign(float(d), float(v)))
    return out, sat, flushed, 0


def counts(x: torch.Tensor, recipe: bf.BlockRecipe) -> tuple[int, int, int]:
    s = bf.block_stats(x, recipe)
    return int(s["saturated"]), int(s["flushed"]), int(s["poisoned"])


def engines_agree(x: torch.Tensor, recipes: list[bf.BlockRecipe]) -> None:
    """The C kernel (both orientations) and the Triton kernels (blocks along rows: the interpreter costs 0.13 s a
    launch) count what the reference counts, sums to 1e-12."""
    want = torch.stack([pb.reference_stats(x, recipes, a) for a in pb.AXES])
    got = {}
    if ck.load() is not None:
        got["c"] = ck.block_stats_2d(x, recipes)
    if tb.unavailable(torch.device("cpu")) is None:
        got["triton"] = tb.block_stats_triton(x, recipes, -1)[None]
    for name, g in got.items():
        w = want[: len(g)]
        assert g[..., :3].tolist() == w[..., :3].tolist(), name
        # (torch.allclose: torch.testing.assert_close imports torch.distributed.tensor, 2.4 s on first use)
        assert torch.allclose(g[..., 3:], w[..., 3:], rtol=1e-12, atol=0.0, equal_nan=True), name


def assert_matches_reference(x: torch.Tensor, recipe: bf.BlockRecipe) -> tuple[int, int, int]:
    """precprof's dequantised values bit for bit and its counts against the independent computation, per row for
    MX (a row of 32 is one block), per tensor for NVFP4; returns (saturated, flushed, poisoned)."""
    if recipe.scale_format == "e4m3":
        d, mask, fl, poi = ref_nvfp4(x.flatten().tolist())
        sat = sum(mask)
        want = torch.tensor(d, dtype=torch.float32).reshape(x.shape)
    else:
        assert x.shape[-1] == 32
        rows = [ref_mx(r, recipe) for r in x.tolist()]
        want = torch.tensor([r[0] for r in rows], dtype=torch.float32)
        sat, fl, poi = (sum(r[i] for r in rows) for i in (1, 2, 3))
    got = bf.quantize(x, recipe)
    assert torch.equal(got.isnan(), want.isnan()), recipe
    same = torch.where(want.isnan(), 0, want).view(torch.int32) == torch.where(got.isnan(), 0, got).view(
        torch.int32
    )
    assert same.all(), (recipe.name, recipe.scale_mode, got[~same].tolist(), want[~same].tolist())
    assert counts(x, recipe) == (sat, fl, poi), (recipe.name, recipe.scale_mode)
    return sat, fl, poi


def rows32(*rows: list[float]) -> torch.Tensor:
    x = torch.zeros(len(rows), 32)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor([fp32(v) for v in r])
    return x


# MXFP8 E4M3, amax just below 512: scale 2^0. 511.99997 rounds to 512, past 448: saturated. 448 is the max (not
# saturated); 448.00003 is above it but rounds down to 448, and so does 464, the tie 448|480 (-> 448, the even
# code): clamped, not saturated; 463.99997 too; 464.00003 rounds to 480: saturated. 440 and the tie 432 (416|448
# -> 448) round up to the max and do not saturate. 2^-10 is half E4M3's smallest subnormal (tie -> 0: flushed);
# 1.5 * 2^-10 -> 2^-9.
E4M3_EDGE = [
    float(np.nextafter(F32(512), F32(0))),
    448.0,
    float(np.nextafter(F32(448), F32(512))),
    464.0,
    440.0,
    432.0,
    -float(np.nextafter(F32(448), F32(512))),
    416.0,
    2.0**-10,
    1.5 * 2.0**-10,
    float(np.nextafter(F32(464), F32(512))),
    float(np.nextafter(F32(464), F32(0))),
]
# MXFP8 E5M2, amax just below 65536: scale 2^0. 57344 is the max; 61439.996 rounds down to it; 61440, the tie
# 57344|65536, goes to the even 65536 (a float8_e5m2 cast gives inf): saturated, and so are 61440.004 and
# 65535.996.
E5M2_EDGE = [
    float(np.nextafter(F32(65536), F32(0))),
    57344.0,
    float(np.nextafter(F32(57344), F32(65536))),
    float(np.nextafter(F32(61440), F32(0))),
    61440.0,
    -float(np.nextafter(F32(61440), F32(65536))),
]
# h91's tiny gradient block: amax 476 * 2^-129 = 119 * 2^-127, OCP exponent -121 - 8 = -129, below E8M0's
# smallest: the scale is 2^-127, so 476 * 2^-129 -> 119 -> 120 (E4M3 spacing 8 there) and nothing saturates
# (kept at 2^-129 it would be 476 > 448, and 474, 475: three saturated). 2^-137 = 2^-10 * 2^-127 ties to 0;
# 3 * 2^-137 -> 1.5 * 2^-9, the tie 2^-9|2^-8 -> 2^-8 (the even code): 2^-135.
TINY = [476 * 2.0**-129, 474 * 2.0**-129, -475 * 2.0**-129, 2.0**-137, 3 * 2.0**-137]
# MXFP4, amax just below 8: scale 2^0. 7.9999995 and 7, the tie 6|8 (to the even 8, the next binade's first
# code were the exponent wider), saturate, and so do 7.0000005 and -7; 6.0000005, 6.5 and 6.9999995 round down
# to 6 (clamped, not saturated); 5.5 rounds up to 6 and does not; 5 is the tie 4|6 -> 4; 0.25 ties to 0
# (flushed).
E2M1_EDGE = [
    float(np.nextafter(F32(8), F32(0))),
    6.0,
    float(np.nextafter(F32(6), F32(7))),
    7.0,
    5.5,
    5.0,
    0.25,
    -6.5,
    float(np.nextafter(F32(7), F32(0))),
    float(np.nextafter(F32(7), F32(8))),
    -7.0,
]


def test_mx_saturation_and_flush_boundaries_by_hand_and_by_the_ocp_rule() -> None:
    x = rows32(E4M3_EDGE, TINY, E2M1_EDGE, [], [1.0, math.inf, 2.0**100], E5M2_EDGE)
    e4m3 = bf.MXFP8_E4M3
    assert (
        bf.quantize(x[:1], e4m3)[0, :12].tolist() == [448.0] * 6 + [-448.0, 416.0, 0.0, 2.0**-9] + [448.0] * 2
    )
    assert counts(x[:1], e4m3) == (2, 1, 0)
    assert bf.quantize(x[1:2], e4m3)[0, :5].tolist() == [
        120 * 2.0**-127,
        120 * 2.0**-127,
        -120 * 2.0**-127,
        0.0,
        2.0**-135,
    ]
    assert counts(x[1:2], e4m3) == (0, 1, 0)
    assert bf.quantize(x[2:3], bf.MXFP4)[0, :11].tolist() == [6.0] * 5 + [4.0, 0.0, -6.0, 6.0, 6.0, -6.0]
    assert counts(x[2:3], bf.MXFP4) == (4, 1, 0)
    assert counts(x[3:5], e4m3) == (0, 0, 32)  # the all-zero block loses nothing; the inf poisons its block
    assert bf.quantize(x[5:], bf.MXFP8_E5M2)[0, :6].tolist() == [57344.0] * 5 + [-57344.0]
    assert counts(x[5:], bf.MXFP8_E5M2) == (3, 0, 0)
    for recipe in MX_RECIPES:
        if recipe.element.name in ("fp6_e2m3", "fp6_e3m2"):
            continue  # no real cast and no hand-written grid here (test_block_formats checks FP6 on its grids)
        assert_matches_reference(x, recipe)
    engines_agree(x, MX_RECIPES)


def nv(*blocks: list[float]) -> torch.Tensor:
    x = torch.zeros(1, 16 * len(blocks))
    for i, b in enumerate(blocks):
        x[0, 16 * i : 16 * i + len(b)] = torch.tensor([fp32(v) for v in b])
    return x


# NVFP4 tensors of two or three blocks (the tensor's amax sits in the first); the figures come from h91's run.
# Nothing saturates: a block's scaled values reach at most about 6 / (1 - 2^-4) = 6.4 (its E4M3 scale rounds
# amax / 6 down by at most 2^-4), below the tie 7, so what the clamp takes off a block max (6.0000005, 6.27)
# is rounding it would have had anyway. The cases check that, and the dequantised values bit for bit.
NV_CASES = {
    # p = 3696 / 2688 = 1.375 exactly; block 2: fl(1.2890625 / 6) / 1.375 = 0.15625, an E4M3 value, so x / (p s)
    # is exactly 6, but fl(fl(1 / 1.375) / 0.15625) rounds up: 1.2890625 times it is 6.0000005 > 6: clamped,
    # rounds to 6 anyway, not counted (the dequantised value is 6 p s = 1.2890625 either way)
    "exactly 6, fp32 factor above": ([[3696.0], [1.2890625, 0.5]], 0),
    # x / (p s) with the stored fp32 p is 6.00000018, but torchao's fp32 factor puts it at 6.0: not counted
    "above 6 by 3e-8, fp32 at 6": ([[0.00165557861328125], [0.000591278076171875]], 0),
    # fl(fl(amax / 6) / p) = 183.99998 (exactly 183.99999 with the fp32 p): below the E4M3 tie 184, so 176,
    # and the block max is scaled to 6.27 > 6: clamped, rounds to 6 anyway, not saturated (h91's block scale,
    # rounded through fp32 from float64, 184.0 -> 192, scales it to 5.75)
    "E4M3 block scale just below a tie": ([[0.001708984375], [0.000701904296875]], 0),
    # 272.00003 (272.000009 exactly): above the tie 272 -> 288, 1.43e-33 scaled to 5.67: not saturated
    "E4M3 block scale just above a tie": ([[2.359264181874364e-33], [1.4324103961380067e-33]], 0),
    # p = 1; block 2: 2^-6 / 6 = 1.33 * 2^-9 < 2^-6, clamped to E4M3's smallest normal: 2^-6 * 2^6 = 1, no
    # saturation (an unclamped subnormal scale, 2^-9, would scale it to 8 > 6); 2^-9 * 2^6 = 0.125 -> 0: flushed
    "block scale under E4M3's smallest normal": ([[2688.0], [2.0**-6, 2.0**-9]], 0),
}


@pytest.mark.parametrize("case", list(NV_CASES))
def test_nvfp4_saturation_boundaries_follow_the_fp32_arithmetic(case: str) -> None:
    blocks, sat_second = NV_CASES[case]
    x = nv(*blocks)
    assert_matches_reference(x, bf.NVFP4)
    assert sum(ref_nvfp4(x.flatten().tolist())[1][16:]) == sat_second, case  # the block worked out above
    engines_agree(x, [bf.NVFP4])


# the Triton interpreter runs the kernels' fp32 arithmetic in numpy, which warns on the nan scales of a tensor
# with an inf (the GPU computes the same values silently)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nvfp4_nonfinite_tensor_and_zero_blocks() -> None:
    x = nv([3.0, 2.875], [], [7.0])
    assert assert_matches_reference(x, bf.NVFP4)[2] == 0
    x[0, 20] = math.inf
    assert assert_matches_reference(x, bf.NVFP4) == (0, 0, 48)
    engines_agree(x, [bf.NVFP4])


def below(v: float) -> float:
    return float(np.nextafter(F32(v), F32(0)))


def above(v: float) -> float:
    return float(np.nextafter(F32(v), F32(math.inf)))


# saturation_bound: the largest fp32 magnitude not counted; the tie halfway to the next power of two is counted
# where the max's mantissa is odd (it rounds up to the even power of two), not for E4M3 (448 = 1.110b * 2^8)
SATURATION_BOUNDS = {
    "fp8_e4m3": 464.0,
    "fp8_e5m2": below(61440.0),
    "fp6_e2m3": below(7.75),
    "fp6_e3m2": below(30.0),
    "fp4_e2m1": below(7.0),
}


def test_saturation_bound_is_where_rounding_passes_the_element_max() -> None:
    for name, fmt in bf.ELEMENT_FORMATS.items():
        b = bf.saturation_bound(fmt)
        assert b == SATURATION_BOUNDS[name], name
        # the same grid with one binade more (its max twice the max): b rounds to at most the
        # max, the next fp32 above it past it
        wide = replace(fmt, max=fmt.max * 2)
        got = bf.round_to_element(torch.tensor([b, above(b)]), wide).tolist()
        assert got[0] <= fmt.max < got[1], (name, got)
        if name in ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1"):
            assert [overflows(Fraction(v), fmt) for v in (b, above(b))] == [False, True], name
    # the real casts: E5M2 overflows to inf at the tie; E4M3 (e4m3fn saturates) one binade down
    e5m2 = torch.tensor([below(61440.0), 61440.0]).to(torch.float8_e5m2).float()
    assert e5m2.tolist() == [57344.0, math.inf]
    e4m3 = torch.tensor([232.0, above(232.0)]).to(torch.float8_e4m3fn).float()
    assert e4m3.tolist() == [224.0, 240.0]  # 464 / 2 ties to 448 / 2; just above it goes to 480 / 2


def test_fp6_saturation_boundaries_in_every_engine() -> None:
    # MXFP6 E2M3, amax just below 8: scale 2^0; 7.75 (the tie 7.5|8 -> 8) and above saturate, below it not.
    # MXFP6 E3M2, amax just below 32: scale 2^0; 30 (the tie 28|32 -> 32) and above saturate.
    x = rows32(
        [below(8.0), 7.5, above(7.5), below(7.75), 7.75, -above(7.75)],
        [below(32.0), 28.0, above(28.0), below(30.0), 30.0, -above(30.0)],
    )
    e2m3, e3m2 = bf.MXFP6_E2M3, bf.MXFP6_E3M2
    assert bf.quantize(x[:1], e2m3)[0, :6].tolist() == [7.5] * 5 + [-7.5]
    assert bf.quantize(x[1:], e3m2)[0, :6].tolist() == [28.0] * 5 + [-28.0]
    assert counts(x[:1], e2m3) == (3, 0, 0)
    assert counts(x[1:], e3m2) == (3, 0, 0)
    engines_agree(x, [e2m3, e3m2, e2m3.with_scale_mode("rceil")])
