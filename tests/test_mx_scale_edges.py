"""MX block scales at the edges of E8M0 and fp32, in every engine, against the OCP MX rule computed here
independently (exact fractions, no precprof arithmetic).

The rule (OCP MX v1.0; ``block_formats``' module docstring): ``floor`` k = floor(log2 amax) - emax_elem;
``rceil`` (cuBLAS, torchao RCEIL) the smallest k with 2^k >= fl32(amax / element max), which is no integer at
all when that quotient is 0 (an amax below the max times 2^-150): k is then E8M0's smallest, as torchao's
ceil(log2 0) = -inf clamped and the cvt.rp.ue8m0 instruction give. k is clamped to E8M0's [-127, 127]; a block
of zeros takes -127. An rceil block whose k is -127 (stored E8M0 exponent 0) multiplies its values by 1, not
2^127, before the element cast, as Transformer Engine's ``exp2f_rcp`` and torchao's RCEIL do; it dequantises
with 2^-127 all the same. Elements round to nearest, ties to even, clamped to the element max; the dequantised
value is fp32 (past fp32's max it is inf, as the engines' fp32 product is).

Blocks built by hand: amax in fp32's subnormals (2^-127 .. 2^-149), at and below E8M0's smallest scale, zero
blocks, near fp32's max, exactly powers of two and the element maxima, and values at every element format's
rounding ties (normal and subnormal in the format). Checked: ``block_formats.quantize`` value by value; the
Triton kernel's ``_mx_scale`` and ``_round_value`` value by value (interpreter on the CPU, as
test_triton_block runs them); the statistics of the torch reference, the C kernel and the Triton kernel.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import pytest
import torch
from _s129a_interpreter import skip_nested_patching

from precprof import block_formats as bf
from precprof import tables as T
from precprof.stats import kernel
from precprof.stats import triton_block as tb
from precprof.stats.triton_engine import interpreting

MX = [bf.get_recipe(n, m) for n in bf.RECIPES if n != "nvfp4" for m in ("floor", "rceil")]
FLT_MAX = float(np.finfo(np.float32).max)
F32 = np.float32

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # the kernels' fp32 arithmetic overflows on purpose near fp32's max (numpy warns in the interpreter)
    pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning"),
]


# ------------------------------------------------------------------------------------ the rule, by hand


def floor_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > v else e


def spec_k(amax: float, recipe: bf.BlockRecipe) -> int:
    fmax = recipe.element.max
    if amax == 0:
        return -127
    if recipe.scale_mode == bf.ScaleMode.RCEIL:
        d = Fraction(float(F32(amax) / F32(fmax)))  # fl32(amax / max): numpy's IEEE fp32 division
        if d == 0:
            return -127  # 2^k >= 0 for every k: the smallest scale there is
        k = floor_log2(d) + (Fraction(2) ** floor_log2(d) != d)
    else:
        k = floor_log2(Fraction(amax)) - math.floor(math.log2(fmax))
    return max(-127, min(127, k))


def spec_element(y: Fraction, fmt: bf.NumberFormat, clamp: bool = True) -> Fraction:
    """|y| rounded to nearest-even in ``fmt`` (clamped to its max, or with the exponent unbounded above)."""
    emin = 2 - 2 ** (fmt.exponent_bits - 1)  # 1 - bias
    c = min(abs(y), Fraction(fmt.max)) if clamp else abs(y)
    if c == 0:
        return Fraction(0)
    step = Fraction(2) ** (max(floor_log2(c), emin) - fmt.mantissa_bits)
    return round(c / step) * step  # Fraction's round(): half to even


def spec_block(row: list[float], recipe: bf.BlockRecipe) -> tuple[list[float], int, int, Fraction]:
    """One finite block: |dequantised| per value (fp32: inf past its max), flushed, saturated, sum of err^2."""
    k = spec_k(max(abs(v) for v in row), recipe)
    scale = Fraction(2) ** k
    # rceil at E8M0's smallest scale: the values are cast as they are (a factor of 1, not 2^127)
    down = 1 if k == -127 and recipe.scale_mode == bf.ScaleMode.RCEIL else 1 / scale
    out, flushed, sat, err2 = [], 0, 0, Fraction(0)
    for v in row:
        y = Fraction(v) * down
        q = spec_element(y, recipe.element) * scale
        sat += spec_element(y, recipe.element, clamp=False) > Fraction(recipe.element.max)
        flushed += v != 0 and q == 0
        if q > Fraction(FLT_MAX):
            out.append(math.inf)
            err2 = Fraction(10) ** 400  # inf below
        else:
            out.append(float(q))
            err2 += (abs(Fraction(v)) - q) ** 2
    return out, flushed, sat, err2


def spec_stats(x: torch.Tensor, recipe: bf.BlockRecipe) -> list[float]:
    flushed = sat = 0
    err2 = x2 = Fraction(0)
    for row in x.tolist():
        _, f, s, e = spec_block(row, recipe)
        flushed, sat, err2 = flushed + f, sat + s, err2 + e
        x2 += sum(Fraction(v) ** 2 for v in row)
    big = err2 >= Fraction(10) ** 400
    return [flushed, sat, 0, float(x2), math.inf if big else float(err2)]


# ------------------------------------------------------------------------------------ the blocks


def blocks(*rows: list[float]) -> torch.Tensor:
    """One 32-value block per row (fp32: the rule reads the values back from it), zeros after."""
    x = torch.zeros(len(rows), 32)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return x


P = [2.0**-e for e in range(0, 150)]  # P[e] = 2^-e
SUB_MAX = float(np.nextafter(F32(2.0**-126), F32(0)))  # the largest fp32 subnormal

# amax in fp32's subnormals and just above: E8M0's smallest scale 2^-127 is reached (clamped) in every format
TINY = blocks(
    [P[125], P[136], P[137], 3 * P[137], -P[130], 1.5 * P[134], P[138] * 1.5],
    [P[126], P[137], P[138], 5 * P[140], P[149]],
    [SUB_MAX, P[136], -P[137], 3 * P[139]],
    [P[127], P[140], 3 * P[141], P[149], -P[138]],
    [P[140], P[143], P[144], 3 * P[145], -P[142]],  # E5M2 rceil: fl32(amax / 57344) is 0
    [P[134], P[141], P[145], 3 * P[146]],  # E5M2 rceil: fl32(amax / 57344) just above 0
    [P[149]],
    [3 * P[149], P[149], 2 * P[149]],
    [P[118], P[119], P[127], P[128], 3 * P[129]],  # E4M3 floor k = -126: no clamp yet
    [1.75 * P[119], P[131], 3 * P[131]],
    # E4M3 rceil: fl32(amax / 448) is exactly 2^-127 (k = -127 unclamped), then a hair above it (k = -126)
    [448 * P[127], P[121], -P[126], 3 * P[130]],
    [float(np.nextafter(F32(448 * P[127]), F32(1))), P[121], -P[126], 3 * P[130]],
    # a block spread over [2^-122, 2^-121] (E4M3 rceil k = -129, clamped) and a value alone in its block
    [P[121] * (0.5 + j / 62) for j in range(32)],
    [-1.88079096131566e-37],
    [],  # zeros
    [0.0, -0.0],
)
# amax near fp32's max: the largest scales; rceil's dequantised max rounds past fp32 (inf)
HUGE = blocks(
    [FLT_MAX, -FLT_MAX / 3, 2.0**100, 1.0, FLT_MAX / 1.9],
    [2.0**127, -1.5 * 2.0**126, 1.0625 * 2.0**126, 2.0**110],
    [float(np.nextafter(F32(2.0**127), F32(0))), 1.75 * 2.0**126, 2.0**119],
    [448 * 2.0**119, 57344 * 2.0**112, 6 * 2.0**125, 2.0**120],
)
# amax exactly a power of two or an element max (just below, just above), and every element format's ties
MAXIMA = [
    1.0,
    2.0,
    4.0,
    6.0,
    7.5,
    8.0,
    28.0,
    32.0,
    256.0,
    448.0,
    464.0,
    480.0,
    512.0,
    57344.0,
    61440.0,
    65536.0,
]
TIE_MANTISSAS = [1 + Fraction(2 * j + 1, 2 ** (m + 1)) for m in (0, 1, 2, 3) for j in range(2**m)]
TIES = [float(t * Fraction(2) ** -p) for p in range(0, 22) for t in TIE_MANTISSAS]
EVEN = blocks(
    *[[a, a / 3, -a * 0.75, a / 2**10, float(np.nextafter(F32(a), F32(0)))] for a in MAXIMA],
    *[[float(np.nextafter(F32(a), F32(math.inf))), a / 64, a * 0.5625] for a in MAXIMA],
    *[[1.0, *TIES[i : i + 31]] for i in range(0, len(TIES), 31)],
    *[[8.0, *[-v for v in TIES[i : i + 31]]] for i in range(0, len(TIES), 62)],
    # E5M2's subnormal ties, the half of its smallest subnormal (2^-17 scaled) among them
    [1.0, *[float(t) * 2.0**-31 for t in TIE_MANTISSAS], 1.5 * 2.0**-31, 1.5 * 2.0**-32, 2.0**-32, 2.0**-33],
)
CASES = {"tiny": TINY, "huge": HUGE, "even": EVEN}


def test_the_blocks_hold_what_they_promise() -> None:
    assert (TINY.abs().amax(1) < 2.0**-117).all() and (TINY.abs() < 2.0**-126).logical_and(TINY != 0).any()
    assert (HUGE.abs().amax(1) > 2.0**126).all()
    # every recipe meets E8M0's smallest scale, a tie in the format's normal range and one below it
    for r in MX:
        assert any(spec_k(float(a), r) == -127 and a > 0 for a in TINY.abs().amax(1))
        emin = 2 - 2 ** (r.element.exponent_bits - 1)
        kinds = set()
        for row in EVEN.tolist():
            scale = Fraction(2) ** spec_k(max(abs(v) for v in row), r)
            for v in row:
                y = abs(Fraction(v)) / scale
                if 0 < y <= r.element.max:
                    step = Fraction(2) ** (max(floor_log2(y), emin) - r.element.mantissa_bits)
                    if (y / step).denominator == 2:
                        kinds.add(floor_log2(y) >= emin)
        assert kinds == {True, False}, r


# ------------------------------------------------------------------------------------ the engines


@pytest.mark.parametrize("case", list(CASES))
def test_torch_reference_quantises_each_value_by_the_rule(case: str) -> None:
    x = CASES[case]
    for r in MX:
        want = [v for row in x.tolist() for v in spec_block(row, r)[0]]
        got = bf.quantize(x, r).abs().flatten().tolist()
        assert got == want, (case, r.name, r.scale_mode)


def engines() -> Iterator[tuple[str, object]]:
    yield (
        "torch",
        lambda x: torch.stack(
            [torch.stack([bf.block_stats(x, r)[s].double() for s in T.BLOCK_STATS]) for r in MX]
        ),
    )
    if kernel.load() is not None:
        yield "c", lambda x: kernel.block_stats_c(x, MX, -1)
    if TRITON_WHY is None:
        yield "triton", lambda x: tb.block_stats_triton(x, MX, -1)


@pytest.fixture(scope="module")
def _interpreter_patches_once_a_launch() -> Iterator[None]:
    with skip_nested_patching():
        yield


@pytest.mark.usefixtures("_interpreter_patches_once_a_launch")
@pytest.mark.parametrize("case", list(CASES))
def test_every_engine_counts_by_the_rule(case: str) -> None:
    x = CASES[case]
    want = torch.tensor([spec_stats(x, r) for r in MX], dtype=torch.float64)
    ran = []
    for name, run in engines():
        got = run(x).cpu()  # type: ignore[operator]
        ran.append(name)
        for i, r in enumerate(MX):
            what = (case, name, r.name, str(r.scale_mode))
            assert got[i, :3].tolist() == want[i, :3].tolist(), what
            torch.testing.assert_close(got[i, 3:], want[i, 3:], rtol=1e-12, atol=0.0, msg=str(what))
    assert ran[0] == "torch", ran


TRITON_WHY = (
    tb.unavailable(torch.device("cpu")) if interpreting() else "the test runs Triton's interpreter only"
)
if TRITON_WHY is None:
    import triton
    import triton.language as tl

    from precprof.stats import triton_block_math as tbm

    @triton.jit
    def _one_recipe(
        x_ptr,
        ab_ptr,
        q_ptr,
        NB: tl.constexpr,
        MB: tl.constexpr,
        EMIN: tl.constexpr,
        FMAX: tl.constexpr,
        RCEIL: tl.constexpr,
    ):
        rows = tl.arange(0, NB)
        at = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
        down, up = tbm._mx_scale(tbm._mx_k(tl.load(ab_ptr + rows), FMAX, RCEIL), RCEIL)
        a = tl.abs(tl.load(x_ptr + at))
        tl.store(q_ptr + at, tbm._round_value(a * down, MB, EMIN, FMAX) * up)


def _triton_values(x: torch.Tensor, r: bf.BlockRecipe) -> torch.Tensor:
    """|dequantised| of each value by the Triton kernel's own _mx_scale and _round_value (the interpreter)."""
    nb = 1 << (x.shape[0] - 1).bit_length()
    xp = torch.cat([x, x.new_zeros(nb - x.shape[0], 32)])
    ab = xp.abs().amax(1).view(torch.int32).contiguous()
    q = torch.empty_like(xp)
    c = tb._constants()
    f = tb.ELEMENTS.index(r.element.name)
    _one_recipe[(1,)](
        xp,
        ab,
        q,
        NB=nb,
        MB=c[f"MB{f}"],
        EMIN=c[f"EMIN{f}"],
        FMAX=c[f"FMAX{f}"],
        RCEIL=r.scale_mode == bf.ScaleMode.RCEIL,
        **tb.LAUNCH_OPTIONS,
    )
    return q[: x.shape[0]]


@pytest.mark.skipif(TRITON_WHY is not None, reason=str(TRITON_WHY))
@pytest.mark.usefixtures("_interpreter_patches_once_a_launch")
def test_triton_scale_and_rounding_value_by_value() -> None:
    for case, x in CASES.items():
        for r in MX:
            want = [v for row in x.tolist() for v in spec_block(row, r)[0]]
            got = _triton_values(x, r).flatten().tolist()
            assert got == want, (case, r.name, str(r.scale_mode))
