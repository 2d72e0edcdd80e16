"""The block what-if's ``saturated`` and ``flushed`` counts at their boundaries, value by value, against an
independent computation written from the rules, on hand-built blocks: a value exactly at the element max, just
above it, one above it that rounds down to it anyway, one that rounds up to it, a block whose OCP exponent is
below E8M0's smallest (2^-127), NVFP4 block maxima within an fp32 rounding of 6 either way, an E4M3 block scale
next to a rounding tie, a block scale under E4M3's smallest normal, nan/inf and all-zero blocks. The reference,
the C kernel and the Triton kernels (Triton's interpreter on CPU) must all give these counts.

The independent computation: MX (OCP MX v1.0 section 6.3) takes the shared exponent floor(log2 amax) -
emax_elem and makes the scale a real ``float8_e8m0fnu`` cast of 2^k (E8M0 holds 2^-127 .. 2^127, so 2^-129 casts
to 2^-127, the same clamp as OCP's reference code ``microxcaling``); elements are the exact quotient x / 2^k
clamped to the element max and rounded by a real fp8 cast (E4M3, E5M2) or on the E2M1 grid written out by hand.
NVFP4 follows torchao 0.18's ``nvfp4_quantize`` operation by operation in numpy float32 (the per-tensor scale
p = fl(amax / 2688) is an fp32 number; block scale E4M3(clamp(fl(fl(amax_b / 6) / p), 2^-6, 448)) by a real
cast; elements x * fl(fl(1 / p) / s)). "Saturated" is decided before rounding: the scaled value, in that fp32
arithmetic, above the element max (what torchao's clamp changes): a value that rounds down to the max anyway
counts, one that rounds up to it does not.

These are the cases where tester h91's own quantiser (s23) differed from precprof: it kept 2^-129 as an MX scale,
computed NVFP4 in float64 from 2688 / amax instead of the fp32 per-tensor scale, rounded that float64 block scale
through fp32 onto an E4M3 tie (184 -> 192 where the exact value, 183.99999, gives 176), and did not clamp block
scales to 2^-6.
"""

from __future__ import annotations

import math
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


def on_e2m1_grid(v: Fraction) -> Fraction:
    """v, already clamped to [-6, 6], rounded to nearest on the E2M1 grid, ties to the even code."""
    a = abs(v)
    hi = next(i for i, g in enumerate(E2M1_GRID) if g >= a)
    if E2M1_GRID[hi] == a or hi == 0:
        r = Fraction(E2M1_GRID[hi])
    else:
        lo_d, hi_d = a - Fraction(E2M1_GRID[hi - 1]), Fraction(E2M1_GRID[hi]) - a
        pick_hi = hi_d < lo_d or (hi_d == lo_d and hi % 2 == 0)
        r = Fraction(E2M1_GRID[hi if pick_hi else hi - 1])
    return -r if v < 0 else r


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
    out, sat, flushed = [], 0, 0
    for v in row:
        s = Fraction(v) / scale
        sat += abs(s) > fmt.max
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
            sat.append(bool(abs(scaled) > 6))
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


# MXFP8 E4M3, amax just below 512: scale 2^0. 448 is the max (not saturated); 448.00003 is above it and 464 is
# the tie 448|480 (-> 448, the even code): both saturate though they would round down to 448 anyway; 440 and the
# tie 432 (416|448 -> 448) round up to the max and do not saturate. 2^-10 is half E4M3's smallest subnormal
# (tie -> 0: flushed); 1.5 * 2^-10 -> 2^-9.
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
]
# h91's tiny gradient block: amax 476 * 2^-129 = 119 * 2^-127, OCP exponent -121 - 8 = -129, below E8M0's
# smallest: the scale is 2^-127, so 476 * 2^-129 -> 119 -> 120 (E4M3 spacing 8 there) and nothing saturates
# (kept at 2^-129 it would be 476 > 448, and 474, 475: three saturated). 2^-137 = 2^-10 * 2^-127 ties to 0;
# 3 * 2^-137 -> 1.5 * 2^-9, the tie 2^-9|2^-8 -> 2^-8 (the even code): 2^-135.
TINY = [476 * 2.0**-129, 474 * 2.0**-129, -475 * 2.0**-129, 2.0**-137, 3 * 2.0**-137]
# MXFP4, amax just below 8: scale 2^0. 6.0000005, 6.5 and 7 (the tie 6|8) saturate; 5.5 rounds up to 6 and does
# not; 5 is the tie 4|6 -> 4; 0.25 ties to 0 (flushed).
E2M1_EDGE = [
    float(np.nextafter(F32(8), F32(0))),
    6.0,
    float(np.nextafter(F32(6), F32(7))),
    7.0,
    5.5,
    5.0,
    0.25,
    -6.5,
]


def test_mx_saturation_and_flush_boundaries_by_hand_and_by_the_ocp_rule() -> None:
    x = rows32(E4M3_EDGE, TINY, E2M1_EDGE, [], [1.0, math.inf, 2.0**100])
    e4m3 = bf.MXFP8_E4M3
    assert bf.quantize(x[:1], e4m3)[0, :10].tolist() == [448.0] * 6 + [-448.0, 416.0, 0.0, 2.0**-9]
    assert counts(x[:1], e4m3) == (4, 1, 0)
    assert bf.quantize(x[1:2], e4m3)[0, :5].tolist() == [
        120 * 2.0**-127,
        120 * 2.0**-127,
        -120 * 2.0**-127,
        0.0,
        2.0**-135,
    ]
    assert counts(x[1:2], e4m3) == (0, 1, 0)
    assert bf.quantize(x[2:3], bf.MXFP4)[0, :8].tolist() == [6.0, 6.0, 6.0, 6.0, 6.0, 4.0, 0.0, -6.0]
    assert counts(x[2:3], bf.MXFP4) == (4, 1, 0)
    assert counts(x[3:], e4m3) == (0, 0, 32)  # the all-zero block loses nothing; the inf poisons its block
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
NV_CASES = {
    # p = 3696 / 2688 = 1.375 exactly; block 2: fl(1.2890625 / 6) / 1.375 = 0.15625, an E4M3 value, so x / (p s)
    # is exactly 6, but fl(fl(1 / 1.375) / 0.15625) rounds up: 1.2890625 times it is 6.0000005 > 6: clamped and
    # counted (the dequantised value is 6 p s = 1.2890625 either way)
    "exactly 6, fp32 factor above": ([[3696.0], [1.2890625, 0.5]], 1),
    # x / (p s) with the stored fp32 p is 6.00000018, but torchao's fp32 factor puts it at 6.0: not counted
    "above 6 by 3e-8, fp32 at 6": ([[0.00165557861328125], [0.000591278076171875]], 0),
    # fl(fl(amax / 6) / p) = 183.99998 (exactly 183.99999 with the fp32 p): below the E4M3 tie 184, so 176,
    # and the block max is scaled to 6.27 > 6: saturated (rounded through fp32 from float64, 184.0 -> 192: not)
    "E4M3 block scale just below a tie": ([[0.001708984375], [0.000701904296875]], 1),
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
