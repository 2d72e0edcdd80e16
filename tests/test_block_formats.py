"""Block-scaled formats: exact element rounding, hand-built blocks at every boundary, and torchao as the referee.

Expected values in the hand-built tests are worked out in the comments next to them, from the element grids
written out by hand (FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6). The torchao tests compare against
``torchao.prototype.mx_formats`` (an independent implementation): dequantised values bit for bit, flushed and
saturated counts derived from torchao's own output and scales (saturated: the scaled value rounds past the element
max, by the thresholds of ``OVERFLOW`` below), and SQNR; where torchao departs from the OCP rule
(or from cuBLAS's round-up rule), a test shows the value and says why.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

from precprof import block_formats as bf
from precprof.errors import UserError
from precprof.models.registry import build_model

FP4_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# torchao's quantisation: (dequantised tensor, the factor each element was multiplied by before the clamp)
Ao = Callable[[torch.Tensor, bf.BlockRecipe], tuple[torch.Tensor, torch.Tensor]]
MX_RECIPES = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4"]
# where a scaled value overflows its element format, as a real cast does (DESIGN.md): the tie halfway between
# the max and the next power of two, and whether the tie itself rounds up (the max's mantissa is odd) or down
# to the max (E4M3's 448 = 1.110b * 2^8 is even)
OVERFLOW = {
    "fp8_e4m3": (464.0, False),
    "fp8_e5m2": (61440.0, True),
    "fp6_e2m3": (7.75, True),
    "fp6_e3m2": (30.0, True),
    "fp4_e2m1": (7.0, True),
}


def overflows(y: torch.Tensor, fmt: bf.NumberFormat) -> torch.Tensor:
    t, inclusive = OVERFLOW[fmt.name]
    return y.abs() >= t if inclusive else y.abs() > t


def f32(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def block(values: list[float], size: int = 32) -> torch.Tensor:
    """One block (1, size): ``values`` first, zeros after."""
    x = torch.zeros(1, size)
    x[0, : len(values)] = f32(*values)
    return x


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def grid(e: int, m: int, max_value: float) -> list[float]:
    """Every non-negative value of a format, from its definition: subnormals i·2^(1-bias-m), normals (1+j/2^m)·2^(E-bias)."""
    bias = 2 ** (e - 1) - 1
    values = [i * 2.0 ** (1 - bias - m) for i in range(2**m)]
    values += [(1 + j / 2**m) * 2.0 ** (big_e - bias) for big_e in range(1, 2**e) for j in range(2**m)]
    return [v for v in values if v <= max_value]


# ---------------------------------------------------------------------------------------------- element formats


def test_element_format_data() -> None:
    want = {  # (max, smallest subnormal, smallest normal, bias), from the OCP MX spec's tables
        "fp8_e4m3": (448.0, 2.0**-9, 2.0**-6, 7),
        "fp8_e5m2": (57344.0, 2.0**-16, 2.0**-14, 15),
        "fp6_e2m3": (7.5, 0.125, 1.0, 1),
        "fp6_e3m2": (28.0, 0.0625, 0.25, 3),
        "fp4_e2m1": (6.0, 0.5, 1.0, 1),
    }
    for name, (mx, sub, normal, bias) in want.items():
        fmt = bf.ELEMENT_FORMATS[name]
        assert (fmt.max, fmt.smallest_subnormal, fmt.smallest_normal, bf.exponent_bias(fmt)) == (
            mx,
            sub,
            normal,
            bias,
        )
        assert fmt.has_inf is name.endswith("e5m2")
    assert grid(2, 1, 6.0) == FP4_GRID


@pytest.mark.parametrize("name", list(bf.ELEMENT_FORMATS))
def test_rounding_at_every_midpoint_of_the_grid(name: str) -> None:
    fmt = bf.ELEMENT_FORMATS[name]
    values = grid(fmt.exponent_bits, fmt.mantissa_bits, fmt.max)
    assert values[-1] == fmt.max
    g = f32(*values)
    mids = (g[:-1] + g[1:]) / 2  # exact in fp32
    up, down = torch.nextafter(mids, g[1:]), torch.nextafter(mids, g[:-1])
    # a tie goes to the neighbour with the even code; consecutive non-negative values have consecutive codes
    even = torch.where(torch.arange(len(mids)) % 2 == 0, g[:-1], g[1:])
    for sign in (1.0, -1.0):
        assert bits_equal(bf.round_to_element(sign * g, fmt), sign * g)
        assert bits_equal(bf.round_to_element(sign * mids, fmt), sign * even)
        assert bits_equal(bf.round_to_element(sign * up, fmt), sign * g[1:])
        assert bits_equal(bf.round_to_element(sign * down, fmt), sign * g[:-1])
    # saturation: above max (even past the next binade) clamps to max; nan stays nan
    over = bf.round_to_element(f32(fmt.max * 1.01, fmt.max * 4, -fmt.max * 1e6, math.inf, math.nan), fmt)
    assert over[:4].tolist() == [fmt.max, fmt.max, -fmt.max, fmt.max] and over[4].isnan()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rounding_matches_torch_casts(dtype: torch.dtype) -> None:
    fmt = bf.formats.FP8_E4M3 if dtype == torch.float8_e4m3fn else bf.formats.FP8_E5M2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=g) * torch.exp2(torch.randint(-24, 17, (50_000,), generator=g).float())
    x = x.clamp(-fmt.max, fmt.max)
    assert bits_equal(bf.round_to_element(x, fmt), x.to(dtype).float())


# ------------------------------------------------------------------------------------- hand-built MX blocks


def test_mxfp4_ties_subnormals_and_saturation_by_hand() -> None:
    # amax 6: k = floor(log2 6) - emax(E2M1)=2 -> 0, scale 1, so elements round on the FP4 grid as they are
    x = block([6.0, 2.5, 5.0, 0.25, 0.2500001, -0.5, -0.2, 1.25])
    q = bf.quantize(x, bf.MXFP4)
    # 2.5: tie 2|3 -> 2 (code 4 even); 5: tie 4|6 -> 4; 0.25: half the smallest subnormal, tie 0|0.5 -> 0;
    # just above it -> 0.5; -0.2 -> -0; 1.25: tie 1|1.5 -> 1
    assert q[0, :8].tolist() == [6.0, 2.0, 4.0, 0.0, 0.5, -0.5, -0.0, 1.0]
    s = bf.block_stats(x, bf.MXFP4)
    assert (s["total"], s["flushed"], s["saturated"], s["poisoned"]) == (32, 2, 0, 0)
    err2 = 0.5**2 + 1**2 + 0.25**2 + (0.5 - 0.2500001) ** 2 + 0.2**2 + 0.25**2
    assert float(s["sum_err2"]) == pytest.approx(err2, rel=1e-6)
    assert float(s["sum_x2"]) == pytest.approx(sum(v * v for v in x[0].double().tolist()), rel=1e-12)


def test_mx_amax_power_of_two_and_just_below_floor_and_rceil() -> None:
    below8 = float(torch.nextafter(f32(8.0), f32(0.0)))
    # amax 8 = 2^3: floor k = 3 - 2 = 1, scale 2: 8 -> 4, 3 -> 1.5, 7 -> 3.5 tie 3|4 -> 4 -> 8; nothing saturates
    x = block([8.0, 3.0, 7.0])
    assert bf.quantize(x, bf.MXFP4)[0, :3].tolist() == [8.0, 3.0, 8.0]
    assert int(bf.block_stats(x, bf.MXFP4)["saturated"]) == 0
    # amax just below 8: floor k = 2 - 2 = 0, scale 1: 7.99.. and 7 (the tie 6|8, to the even 8) round past 6
    # and saturate to 6 (the OCP rule's known cost); rceil: fl(7.99../6) = 1.33 -> k = 1, scale 2: 7.99../2 -> 4 -> 8, 7/2 = 3.5 -> 4 -> 8
    x = block([below8, 7.0, 3.0])
    assert bf.quantize(x, bf.MXFP4)[0, :3].tolist() == [6.0, 6.0, 3.0]
    assert int(bf.block_stats(x, bf.MXFP4)["saturated"]) == 2
    rceil = bf.MXFP4.with_scale_mode("rceil")
    assert bf.quantize(x, rceil)[0, :3].tolist() == [8.0, 8.0, 3.0]
    assert int(bf.block_stats(x, rceil)["saturated"]) == 0
    # rceil at an exact power of two: amax 12 = 6·2 -> fl(12/6) = 2 -> k = 1 exactly, 12 -> 6, no saturation
    assert bf.quantize(block([12.0, 5.0]), rceil)[0, :2].tolist() == [12.0, 4.0]


def test_mxfp8_outlier_flushes_the_rest_of_its_block() -> None:
    # amax 2^20: k = 20 - 8 = 12. E4M3's smallest subnormal is 2^-9, half of it 2^-10 -> 2^-10·2^12 = 4
    # in input units: 4 ties to 0, anything below flushes, just above 4 rounds up to 2^-9·2^12 = 8
    above4 = float(torch.nextafter(f32(4.0), f32(5.0)))
    x = block([2.0**20, 1.0, 4.0, -3.0, above4, 1e-30])
    q = bf.quantize(x, bf.MXFP8_E4M3)
    assert q[0, :6].tolist() == [2.0**20, 0.0, 0.0, -0.0, 8.0, 0.0]
    s = bf.block_stats(x, bf.MXFP8_E4M3)
    assert (int(s["flushed"]), int(s["saturated"])) == (4, 0)
    # the other block of the row keeps its own scale: ones survive there
    x2 = torch.cat([x, torch.ones(1, 32)], dim=1)
    assert bf.quantize(x2, bf.MXFP8_E4M3)[0, 32:].eq(1.0).all()


def test_all_zero_blocks() -> None:
    x = torch.zeros(3, 64)
    for recipe in bf.RECIPES.values():
        s = bf.block_stats(x, recipe)
        assert bits_equal(bf.quantize(x, recipe), x)
        assert [int(s[k]) for k in ("total", "poisoned", "flushed", "saturated")] == [192, 0, 0, 0]
        assert bf.sqnr_db(s) == math.inf


def test_mx_tiny_block_uses_the_smallest_e8m0_scale_exactly() -> None:
    # amax 2^-120: floor k = -128 -> clamped to E8M0's -127; 2^-120 / 2^-127 = 128 is exact in E4M3
    x = block([2.0**-120, 2.0**-126])
    assert bf.quantize(x, bf.MXFP8_E4M3)[0, :2].tolist() == [2.0**-120, 2.0**-126]


# ---------------------------------------------------------------------------------- hand-built NVFP4 blocks


def test_nvfp4_two_level_scales_by_hand() -> None:
    x = torch.zeros(1, 64)
    x[0, 0] = 2688.0  # block 0: tensor amax = 448·6 -> per-tensor scale p = 1 exactly
    # block 1: amax 24 -> block scale 24/6/1 = 4, an E4M3 value: 24 -> 6, 10 -> 2.5 tie -> 2 -> 8,
    # 1 -> 0.25 tie -> 0 (flushed), 1.0000001 -> 0.5 -> 2
    x[0, 16:20] = f32(24.0, 10.0, 1.0, 1.0000001)
    # block 2: amax 55.5 -> 9.25, between E4M3's 9 and 10 -> 9; 55.5·fl(1/9) ≈ 6.17 rounds to 6 (below the tie
    # 7): clamped to 6 with no loss beyond its rounding, not saturated -> 6·9 = 54
    x[0, 32:34] = f32(55.5, 18.0)  # 18·fl(1/9) = 2 (to fp32 rounding) -> 2·9 = 18
    # block 3: amax 6·2^-8 -> scale 2^-8, below E4M3's smallest normal: clamped to 2^-6 -> 6·2^-8·2^6 = 1.5
    # -> 1.5·2^-6 (exact); 2^-8 -> 0.25 tie -> 0 (flushed)
    x[0, 48:50] = f32(6 * 2.0**-8, 2.0**-8)
    # block 0: 2688·fl(1/448) exceeds 6 by a rounding (fl(1/448) rounds up): clamped, rounds to 6 anyway, not
    # counted -> 6·448 = 2688
    assert float(f32(1.0) / 448) > 1 / 448
    q = bf.quantize(x, bf.NVFP4)
    assert q[0, 0] == 2688.0
    assert q[0, 16:20].tolist() == [24.0, 8.0, 0.0, 2.0]
    assert q[0, 32:34].tolist() == [54.0, 18.0]
    assert q[0, 48:50].tolist() == [6 * 2.0**-8, 0.0]
    s = bf.block_stats(x, bf.NVFP4)
    assert (int(s["flushed"]), int(s["saturated"])) == (2, 0)


# ------------------------------------------------------------------------- padding, axis, dtypes, non-finite


def test_length_not_a_multiple_of_the_block_is_padded_with_zeros() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 40, generator=g)  # one full block of 32 and one of 8, padded with 24 zeros
    padded = torch.cat([x, torch.zeros(4, 24)], dim=1)
    for recipe in (bf.MXFP4, bf.MXFP8_E4M3.with_scale_mode("rceil"), bf.NVFP4):
        assert bits_equal(bf.quantize(x, recipe), bf.quantize(padded, recipe)[:, :40])
        s, sp = bf.block_stats(x, recipe), bf.block_stats(padded, recipe)
        assert int(s["total"]) == 160 and int(sp["total"]) == 256
        assert [int(s[k]) for k in ("flushed", "saturated")] == [int(sp[k]) for k in ("flushed", "saturated")]
        for k in ("sum_x2", "sum_err2"):  # the same terms, summed in another order
            assert float(s[k]) == pytest.approx(float(sp[k]), rel=1e-12), k


def test_axis_quantises_the_transposed_orientation() -> None:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    for recipe in (bf.MXFP6_E3M2, bf.NVFP4):
        assert bits_equal(bf.quantize(x, recipe, axis=0), bf.quantize(x.t().contiguous(), recipe).t())
        assert not bits_equal(bf.quantize(x, recipe, axis=0), bf.quantize(x, recipe))


def test_half_precision_inputs_are_read_exactly() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert bits_equal(bf.quantize(x, bf.MXFP8_E5M2), bf.quantize(x.float(), bf.MXFP8_E5M2))


def test_nan_and_inf_poison_their_block_mx_and_the_tensor_nvfp4() -> None:
    x = torch.ones(2, 64)
    x[0, 3] = math.nan
    x[1, 40] = -math.inf
    x[1, 41] = 100.0  # would saturate nothing, but its block is poisoned anyway
    q = bf.quantize(x, bf.MXFP4)
    poisoned = torch.zeros(2, 64, dtype=torch.bool)
    poisoned[0, :32] = True
    poisoned[1, 32:] = True
    assert torch.equal(q.isnan(), poisoned) and q[~poisoned].eq(1.0).all()
    s = bf.block_stats(x, bf.MXFP4)
    assert [int(s[k]) for k in ("poisoned", "flushed", "saturated")] == [64, 0, 0]
    assert float(s["sum_x2"]) == 64.0 and float(s["sum_err2"]) == 0.0
    s = bf.block_stats(x, bf.NVFP4)
    assert int(s["poisoned"]) == 128 and bf.quantize(x, bf.NVFP4).isnan().all()
    assert float(s["sum_x2"]) == 0.0 and bf.sqnr_db(s) == math.inf


def test_user_errors_are_one_line() -> None:
    cases = [
        lambda: bf.quantize(torch.ones(4, 32, dtype=torch.int32), bf.MXFP4),
        lambda: bf.quantize(torch.ones(4, 32, dtype=torch.float64), bf.MXFP4),
        lambda: bf.quantize(torch.tensor(1.0), bf.MXFP4),
        lambda: bf.block_stats(torch.ones(4, 32), bf.MXFP4, axis=2),
        lambda: bf.get_recipe("mxfp3"),
        lambda: bf.get_recipe("mxfp4", "round"),
        lambda: bf.NVFP4.with_scale_mode("rceil"),
    ]
    for case in cases:
        with pytest.raises(UserError) as err:
            case()
        assert "\n" not in str(err.value)
    assert bf.get_recipe("mxfp6_e2m3", "rceil").scale_mode is bf.ScaleMode.RCEIL


def test_merged_stats_and_sqnr_against_a_float64_computation() -> None:
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(16, 64, generator=g), torch.randn(8, 64, generator=g) * 1e3
    merged = bf.merge_stats(bf.block_stats(a, bf.MXFP4), bf.block_stats(b, bf.MXFP4))
    both = torch.cat([a, b])
    q = bf.quantize(both, bf.MXFP4).double()
    want = 10 * math.log10(float((both.double() ** 2).sum()) / float(((both.double() - q) ** 2).sum()))
    assert bf.sqnr_db(merged) == pytest.approx(want, rel=1e-12)
    assert int(merged["total"]) == both.numel()
    # MXFP4 keeps about 1 bit of mantissa on Gaussian data: SQNR lies between FP4's and FP8's plausible ranges
    assert 10 < bf.sqnr_db(merged) < 25


# ------------------------------------------------------------------------------------------ against torchao


@pytest.fixture(scope="module")
def ao() -> Ao:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
        consts = pytest.importorskip("torchao.prototype.mx_formats.constants")
        nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    dtypes = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e2m3": consts.DTYPE_FP6_E2M3,
        "mxfp6_e3m2": consts.DTYPE_FP6_E3M2,
        "mxfp4": torch.float4_e2m1fn_x2,
    }

    def quantize(x: torch.Tensor, recipe: bf.BlockRecipe) -> tuple[torch.Tensor, torch.Tensor]:
        """torchao's dequantised tensor and the factor it multiplied each element by before its clamp."""
        x = x.contiguous()
        if recipe.scale_format == "e4m3":
            p = nv.per_tensor_amax_to_scale(x.abs().amax())
            t = nv.NVFP4Tensor.to_nvfp4(x.reshape(-1, x.shape[-1]), 16, per_tensor_scale=p)
            factor = (1.0 / p) / t.scale.float()  # torchao's own arithmetic, from its stored scales
            return t.dequantize(torch.float32).reshape(x.shape), factor.repeat_interleave(16, -1).reshape(
                x.shape
            )
        dt, mode = dtypes[recipe.name], cfg.ScaleCalculationMode(str(recipe.scale_mode))
        scale, data = mx.to_mx(x, dt, 32, mode)
        deq = mx.to_dtype(data, scale, dt, 32, torch.float32).reshape(x.shape)
        factor = 1 / mx.get_fp_scale(scale)  # exact: a power of two
        if (
            recipe.scale_mode == bf.ScaleMode.RCEIL
        ):  # its smallest scale multiplies by 1 (Transformer Engine's)
            factor = torch.where(scale.view(torch.uint8) == 0, 1.0, factor)
        return deq, factor.repeat_interleave(32, -1).reshape(x.shape)

    return quantize


def all_recipes() -> list[bf.BlockRecipe]:
    mx = [bf.get_recipe(n, m) for n in MX_RECIPES for m in ("floor", "rceil")]
    return [*mx, bf.NVFP4]


def agree_with_torchao(ao: Ao, x: torch.Tensor, recipe: bf.BlockRecipe) -> None:
    deq, factor = ao(x, recipe)
    assert bits_equal(bf.quantize(x, recipe), deq), recipe
    s = bf.block_stats(x, recipe)
    assert int(s["flushed"]) == int(((x != 0) & (deq == 0)).sum()), recipe
    assert int(s["saturated"]) == int(overflows(x * factor, recipe.element).sum()), recipe
    x64, d64 = x.double(), deq.double()
    noise = float(((x64 - d64) ** 2).sum())
    want = 10 * math.log10(float((x64**2).sum()) / noise) if noise else math.inf
    assert bf.sqnr_db(s) == pytest.approx(want, rel=1e-12), recipe


def test_random_tensors_with_outliers_match_torchao(ao: Ao) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    rows, cols = torch.randint(0, 64, (40,), generator=g), torch.randint(0, 256, (40,), generator=g)
    x[rows, cols] *= torch.exp2(torch.randint(4, 16, (40,), generator=g).float())  # outliers
    x[5, :64] = 0.0
    for recipe in all_recipes():
        agree_with_torchao(ao, x, recipe)
    for recipe in (bf.MXFP4, bf.NVFP4):  # the outliers do flush their neighbours
        assert int(bf.block_stats(x, recipe)["flushed"]) > 0


def boundary_blocks() -> torch.Tensor:
    """Every element grid's midpoints (ties), the values just above them and half the smallest subnormal, 15 at
    a time after a block amax at max, at a power of two and just below the next one, at three scales; the amax
    sits at positions 0 and 16, so MX blocks (32) and NVFP4 blocks (16) both see it."""
    rows = []
    for fmt in bf.ELEMENT_FORMATS.values():
        g = f32(*grid(fmt.exponent_bits, fmt.mantissa_bits, fmt.max))
        mids = (g[:-1] + g[1:]) / 2
        vals = torch.cat([mids, torch.nextafter(mids, g[1:]), f32(fmt.smallest_subnormal / 2)])
        vals = torch.nn.functional.pad(vals, (0, -len(vals) % 15)).reshape(-1, 15)
        below = float(torch.nextafter(f32(2.0 ** (fmt.max_exponent + 1)), f32(0)))
        for top in (fmt.max, 2.0**fmt.max_exponent, below):
            half = torch.cat([torch.full((len(vals), 1), top), vals], dim=1)
            for scale in (2.0**-20, 1.0, 2.0**30):
                rows.append(torch.cat([half, half], dim=1) * scale)
    x = torch.cat(rows)
    x = torch.cat([x, -x.flip(0), torch.zeros(2, 32)])
    return x


# Binades of a block's amax from fp32's lowest to its highest: both edges of the range, [2^-90, 2^101), where
# the kernels carry MX scales to per-block bounds (``triton_block_math``, ``kernel.c``'s tile_mx_bounds) and the
# values just outside it, where they compute as the reference does, and a few between
AMAX_BINADES = (-126, -115, -100, -95, -91, -90, -89, -40, 0, 40, 99, 100, 101, 102, 106, 115, 126, 127)


def boundary_blocks_at(binade: int) -> torch.Tensor:
    """Eight of ``boundary_blocks`` (every format's ties and half-subnormals), with a zero and a value every
    format flushes (2^-33 of the amax's binade) in each line, each line moved by a power of two (exactly) so that
    its amax lies in the binade 2^binade."""
    x = boundary_blocks()
    x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(5))][:8].double()
    top = torch.floor(torch.log2(x.abs().amax(dim=1, keepdim=True)))
    assert top.isfinite().all()
    x[:, 30] = 0.0
    x[:, 31] = torch.exp2(top[:, 0] - 33)
    y = (x * torch.exp2(binade - top)).float()
    assert y.isfinite().all()
    return y


def test_hand_built_boundary_blocks_match_torchao(ao: Ao) -> None:
    x = boundary_blocks()
    for recipe in all_recipes():
        agree_with_torchao(ao, x, recipe)


GPT_NANO_LAYERS = (
    "transformer.h.0.attn.c_attn",
    "transformer.h.3.mlp.c_proj",
    "lm_head",
)


@pytest.fixture(scope="module")
def gpt_nano_tensors() -> dict[str, torch.Tensor]:
    """After one training step of gpt-nano, for a few Linears: input, output, output gradient, weight gradient
    (and its transpose, the orientation a weight-gradient matmul reads), captured with plain hooks."""
    torch.manual_seed(0)
    model = build_model("gpt-nano", vocab_size=256, seq_len=32).module
    modules = dict(model.named_modules())
    captured: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def forward_hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            captured[f"{name} input"], captured[f"{name} output"] = args[0].detach(), out.detach()
            out.register_hook(lambda grad: captured.__setitem__(f"{name} output grad", grad.detach()))

        return forward_hook

    handles = [modules[name].register_forward_hook(hook(name)) for name in GPT_NANO_LAYERS]
    try:
        idx = torch.randint(0, 256, (2, 32))
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(idx, -1, 1).flatten()).backward()
    finally:
        for h in handles:
            h.remove()
    for name in GPT_NANO_LAYERS:
        grad = modules[name].weight.grad
        assert grad is not None
        captured[f"{name} weight grad"], captured[f"{name} weight grad^T"] = grad, grad.t().contiguous()
    return captured


def test_gpt_nano_activations_and_gradients_match_torchao(
    ao: Ao, gpt_nano_tensors: dict[str, torch.Tensor]
) -> None:
    assert len(gpt_nano_tensors) == 5 * len(GPT_NANO_LAYERS)
    for name, x in gpt_nano_tensors.items():
        assert x.abs().amax() > 0, name
        for recipe in all_recipes():
            agree_with_torchao(ao, x, recipe)
    # real tensors do lose something in MXFP4: the checks above compared nonzero counts
    assert sum(int(bf.block_stats(x, bf.MXFP4)["flushed"]) for x in gpt_nano_tensors.values()) > 0


# ----------------------------------------------------------- where torchao departs from the rule, and why


def test_torchao_floor_halves_blocks_below_the_smallest_e8m0_scale(ao: Ao) -> None:
    # OCP: k = floor(log2 2^-120) - 8 = -128 -> E8M0's smallest, 2^-127: 2^-120 / 2^-127 = 128, exact.
    # torchao FLOOR divides by max(2^-127, 2^-126) (it clamps the fp32 scale to the smallest normal) but
    # dequantises with the stored E8M0 scale 2^-127: 2^-120 -> 64 -> 64·2^-127 = 2^-121, half the input.
    x = block([2.0**-120])
    deq, _ = ao(x, bf.MXFP8_E4M3)
    assert float(bf.quantize(x, bf.MXFP8_E4M3)[0, 0]) == 2.0**-120
    assert float(deq[0, 0]) == 2.0**-121


def test_torchao_rceil_on_cpu_rounds_log2_in_fp32(ao: Ao) -> None:
    # cuBLAS's rule (and torchao's own PTX path, cvt.rp.ue8m0): round fl(amax/448) up to a power of two. For
    # amax/448 = the next fp32 after 16, that is 32. torchao's CPU fallback takes ceil(torch.log2(.)) in fp32,
    # and log2(16·(1 + 2^-23)) rounds to exactly 4.0: scale 16, amax/16 a hair above 448 is clamped (it rounds
    # to 448 anyway: not saturated either way). The dequantised value happens to agree (448·16 = 224·32).
    recipe = bf.MXFP8_E4M3.with_scale_mode("rceil")
    amax = float(torch.nextafter(f32(16.0), f32(17.0))) * 448  # exact in fp32: 448 = 7·2^6
    x = block([amax, 1.0])
    deq, factor = ao(x, recipe)
    assert float(factor[0, 0]) == 1 / 16 and float(x[0, 0] / 16) > 448
    assert int(bf.block_stats(x, recipe)["saturated"]) == 0
    assert bits_equal(bf.quantize(x, recipe), deq)


def test_rceil_smallest_scale_multiplies_by_one_as_torchao_and_transformer_engine(ao: Ao) -> None:
    # fl(2^-125 / 448) < 2^-127: E8M0's smallest scale 2^-127 (stored exponent 0). Transformer Engine's
    # exp2f_rcp gives 1 for that exponent, not 2^127, and torchao's RCEIL follows it: the block is cast as it is,
    # every value flushes to zero (E4M3's smallest subnormal is 2^-9), and dequantising multiplies by 2^-127.
    recipe = bf.MXFP8_E4M3.with_scale_mode("rceil")
    x = block([2.0**-125])
    assert float(bf.quantize(x, recipe)[0, 0]) == 0.0
    assert float(ao(x, recipe)[0][0, 0]) == 0.0
    # a value alone in its block (about 2^-122.3) and a full block spread over [2^-122, 2^-121], beside
    # ordinary blocks: with FP8's maxima fl(amax / max) rounds up to 2^-129 or below, clamped to -127, and
    # every value flushes in rceil; FP6's and FP4's small maxima give scales of 2^-125 .. 2^-123, which keep
    # them. Floor keeps them all (2^-121 / 2^-127 = 64; torchao's floor halves such blocks instead:
    # test_torchao_floor_halves_blocks_below_the_smallest_e8m0_scale).
    x = torch.zeros(4, 64)
    x[0, 0] = -1.88079096131566e-37
    x[1, :32] = 2.0**-121 * torch.linspace(0.5, 1, 32)
    x[2, 5], x[3] = 1.0, torch.randn(64, generator=torch.Generator().manual_seed(4))
    for name in MX_RECIPES:
        agree_with_torchao(ao, x, bf.get_recipe(name, "rceil"))
        s = bf.block_stats(x[:2], bf.get_recipe(name, "rceil"))
        assert int(s["saturated"]) == 0, name
        if name.startswith("mxfp8"):
            assert int(s["flushed"]) == 33, name
            assert float(s["sum_err2"]) == float(s["sum_x2"]) > 0, name
        else:
            assert int(s["flushed"]) < 33, name
    assert int(bf.block_stats(x[:2], bf.MXFP8_E4M3)["flushed"]) == 0


def test_torchao_keeps_inf_where_ocp_makes_the_block_nan(ao: Ao) -> None:
    # OCP MX: floor(log2 inf) is above E8M0's range, so the block's scale is NaN and the whole block is nan.
    # torchao reads the exponent bits of inf as 128, scales by 2^120, and gives inf and flushed zeros.
    # A nan block agrees (torchao encodes the scale as 0xFF too).
    x = torch.ones(1, 32)
    x[0, 0] = math.inf
    assert bf.quantize(x, bf.MXFP8_E4M3).isnan().all()
    deq = ao(x, bf.MXFP8_E4M3)[0]
    assert deq[0, 0] == math.inf and deq[0, 1:].eq(0).all()
    x[0, 0] = math.nan
    assert ao(x, bf.MXFP8_E4M3)[0].isnan().all() and bf.quantize(x, bf.MXFP8_E4M3).isnan().all()


def test_torchao_nvfp4_all_zero_tensor_is_nan(ao: Ao) -> None:
    # amax 0 makes torchao's per-tensor scale 0 and its block scale 0/0 = nan; zeros quantise to zeros here.
    x = torch.zeros(2, 16)
    assert ao(x, bf.NVFP4)[0].isnan().all()
    assert bits_equal(bf.quantize(x, bf.NVFP4), x)


def nvfp4_with_te_clamps(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 of a 2-D float32 ``x`` (blocks of 16 along the last dim), computed independently of block_formats:
    numpy fp32 scalars for every fl() step, torch's float8_e4m3fn cast for the block scale and torchao's E2M1
    cast for the elements, with Transformer Engine's clamps (an encode factor that overflows is the fp32 max)
    applied to torchao's order of operations."""
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    f32max = np.float32(np.finfo(np.float32).max)
    a = x.numpy().astype(np.float32)
    amax = np.float32(np.abs(a).max())
    with np.errstate(over="ignore", divide="ignore"):
        p = amax / np.float32(2688.0) if amax > 0 else np.float32(1.0)
        r = np.float32(1.0) / p
        if not np.isfinite(r):  # the smallest p whose reciprocal is finite
            p = np.nextafter(np.float32(2.0**-128), np.float32(1.0))
            r = np.float32(1.0) / p
        out = np.zeros_like(a)
        for i in range(a.shape[0]):
            for j in range(0, a.shape[1], 16):
                blk = a[i, j : j + 16]
                t = np.float32(np.float32(np.abs(blk).max()) / np.float32(6.0)) / p
                t = min(max(t, np.float32(2.0**-6)), np.float32(448.0))
                s = np.float32(torch.tensor(float(t)).to(torch.float8_e4m3fn).float().item())
                f = min(np.float32(r / s), f32max)
                scaled = np.clip(blk * f, np.float32(-6.0), np.float32(6.0)).astype(np.float32)
                q = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked(torch.from_numpy(scaled))).numpy()
                out[i, j : j + 16] = q * np.float32(p * s)
    return torch.from_numpy(out)


@pytest.mark.parametrize("top", [2.0**-100, 2.0**-112, 2.0**-117, 2.0**-120, 2.0**-130, 2.0**-140, 2.0**-149])
def test_nvfp4_of_tiny_tensors_clamps_its_factors_as_transformer_engine(top: float) -> None:
    # A block of small values (scale clamped to 2^-6) and a zero block beside the tensor's amax: torchao's
    # factor fl(fl(1 / p) / s) overflows to inf for such tensors and 0 * inf turns the zeros nan; with the
    # clamps every value is finite and equal to an independent step-by-step computation.
    g = torch.Generator().manual_seed(int(-math.log2(top)))
    big = torch.randn(2, 16, generator=g) * top / 3
    big[0, 0] = top
    x = torch.cat([big, big / 2**12, torch.zeros(2, 16)], dim=1).clamp(-top, top)
    want = nvfp4_with_te_clamps(x)
    got = bf.quantize(x, bf.NVFP4)
    assert got.isfinite().all() and bits_equal(got, want)
    s = bf.block_stats(x, bf.NVFP4)
    assert math.isfinite(float(s["sum_err2"]))
    assert int(s["flushed"]) == int(((x != 0) & (want == 0)).sum())
    assert float(s["sum_err2"]) == pytest.approx(float(((x.double() - want.double()) ** 2).sum()), rel=1e-12)


def test_torchao_nvfp4_of_a_tiny_tensor_where_its_factor_overflows(ao: Ao) -> None:
    # Where torchao's factors stay finite the clamps change nothing: a tiny tensor whose blocks all have
    # large scales agrees bit for bit. Add a zero block and a block of small values: torchao's factor is inf
    # there, its zeros come out as 1.5·fl(p·s) (0·inf = nan, which its E2M1 cast maps to 1.5) and its small
    # values saturate; ours stay zero and round from the clamped factor, as Transformer Engine's would.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 48, generator=g) * 2.0**-115
    agree_with_torchao(ao, x, bf.NVFP4)
    x[0, :16] = 0.0
    x[1, 16:32] *= 2.0**-12
    deq = ao(x, bf.NVFP4)[0]
    assert deq[0, :16].ne(0).all() and (deq[1, 16:32].abs() == deq[1, 16:32].abs().amax()).all()
    ours = bf.quantize(x, bf.NVFP4)
    assert ours[0, :16].eq(0).all() and bits_equal(ours, nvfp4_with_te_clamps(x))
    assert bits_equal(ours[2:], deq[2:]) and bits_equal(ours[:, 32:], deq[:, 32:])
