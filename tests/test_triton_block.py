"""The Triton block-format kernels against the torch-op reference ``block_formats.block_stats``, under Triton's
interpreter on CPU tensors: counts equal, sums to 1e-12, for every recipe, both orientations, fp32/bf16/fp16,
random tensors with outliers and subnormals, the reference tests' hand-built boundary blocks, nan/inf blocks,
lengths that are not a multiple of the block, strided views, and the degenerate NVFP4 scales of tiny tensors.

The interpreter pays per operation, not per element: tensors here are a few tiles each (a tile is 32 positions
along the block axis and, by default in the interpreter, 1024 lines across).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from _s129a_interpreter import skip_nested_patching
from test_block_formats import (  # the reference tests' hand-built blocks
    AMAX_BINADES,
    block,
    boundary_blocks,
    boundary_blocks_at,
    f32,
)

from precprof import block_formats as bf
from precprof import tables as T
from precprof.errors import UserError
from precprof.stats import triton_block as tb
from precprof.stats.triton_engine import interpreting

# where the kernels run: on CUDA when there is one (compiled for real), else on CPU tensors in Triton's
# interpreter (TRITON_INTERPRET=1, which conftest sets without CUDA)
DEV = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
# why the kernels cannot run there (triton does not import, or no interpreter on the CPU); None: they can
WHY = tb.unavailable(DEV)
if WHY is not None:
    pytest.skip(WHY, allow_module_level=True)

import triton  # noqa: E402  (there is a Triton to run: the kernels' own functions are tested too)
import triton.language as tl  # noqa: E402

from precprof.stats import triton_block_math as tbm  # noqa: E402

# the kernels' fp32 arithmetic meets inf and nan on purpose (a block at fp32's max, a nan tensor's NVFP4
# scales): numpy, which runs it in the interpreter, warns where the GPU computes the same values silently
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


@pytest.fixture(scope="module", autouse=True)
def _interpreter_patches_once_a_launch() -> Iterator[None]:
    """In the interpreter, a launch patches triton.language once, not again at each call of a kernel's helper
    (tests/_s129a_interpreter.py: the same arithmetic, a third of the CPU time less)."""
    with skip_nested_patching():
        yield


RECIPES = [
    bf.get_recipe(name.removesuffix("_rceil"), "rceil" if name.endswith("_rceil") else None)
    for name in T.BLOCK_RECIPES
]
FP4 = [bf.MXFP4, bf.NVFP4]


def reference(x: torch.Tensor, recipes: Sequence[bf.BlockRecipe], axis: int) -> torch.Tensor:
    """block_formats.block_stats of x viewed 2-D as [prod(leading), last] (1-D stays 1-D), per recipe."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x
    rows = []
    for recipe in recipes:
        s = bf.block_stats(x2, recipe, axis)
        rows.append(torch.stack([s[k].double() for k in T.BLOCK_STATS]))
    return torch.stack(rows)


def check(x: torch.Tensor, recipes: Sequence[bf.BlockRecipe], axis: int, **kw: int) -> torch.Tensor:
    """The kernels' result on ``DEV`` (as a CPU tensor), after asserting it equals the reference on the CPU
    (counts exactly, sums to 1e-12)."""
    got = tb.block_stats_triton(x.to(DEV), recipes, axis, **kw)
    want = reference(x, recipes, axis)
    assert got.dtype == torch.float64 and got.shape == (len(recipes), 5) and got.device.type == DEV.type
    got = got.cpu()
    for i, recipe in enumerate(recipes):
        assert got[i, :3].tolist() == want[i, :3].tolist(), (recipe.name, recipe.scale_mode, axis)
        torch.testing.assert_close(got[i, 3:], want[i, 3:], rtol=1e-12, atol=0.0, equal_nan=True)
    return got


def rough(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian values over many binades per line, outliers, exact powers of two, zeros, and the dtype's
    subnormals."""
    g = torch.Generator().manual_seed(seed)
    rows = shape[0]
    lo, hi, outlier = {
        torch.float32: (-40, 40, 12),
        torch.bfloat16: (-40, 40, 12),
        torch.float16: (-14, 2, 8),
    }[dtype]
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(lo, hi, (rows, 1), generator=g).float())
    pick = torch.rand(shape, generator=g)
    x = torch.where(pick < 0.02, x * 2.0**outlier, x)  # outliers that flush their blocks' small values
    x = torch.where(
        (pick > 0.5) & (pick < 0.53), torch.exp2(torch.randint(-20, 5, shape, generator=g).float()), x
    )
    x = torch.where(pick > 0.97, 0.0, x)
    tiny = {torch.float32: 2.0**-140, torch.bfloat16: 2.0**-130, torch.float16: 2.0**-20}[dtype]
    x = torch.where((pick > 0.9) & (pick < 0.92), torch.randn(shape, generator=g) * tiny, x)
    x = x.to(dtype)
    assert x.isfinite().all()
    assert (x.float().abs() < torch.finfo(dtype).tiny).logical_and(x != 0).any()  # subnormals are there
    return x


# ----------------------------------------------------------------------------------------- random tensors


@pytest.mark.parametrize(
    ("dtype", "shape", "axes"),
    [
        (torch.float32, (40, 24), (-1, -2)),
        (torch.bfloat16, (40, 40), (-1,)),
        (torch.float16, (40, 40), (-2,)),
    ],
)
def test_random_tensors_every_recipe(
    dtype: torch.dtype, shape: tuple[int, int], axes: tuple[int, ...]
) -> None:
    # 24 and 40 are multiples of neither 32 nor 16: every orientation ends in a padded block. (Half-precision
    # inputs differ only in how a value is decoded, which the orientation does not touch: one orientation each.)
    x = rough(shape, dtype, seed=len(str(dtype)))
    for axis in axes:
        got = check(x, RECIPES, axis)
        # the tensor loses values in every way the statistics count
        assert got[:, 0].sum() > 0 and got[:, 1].sum() > 0 and (got[:, 4] > 0).all()


def test_3d_and_strided_views_are_read_in_place() -> None:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 8, 40, generator=g) * 4.0)[:, ::2, :]  # leading dims merge into one stride: a view
    assert not x.is_contiguous()
    check(x, [bf.MXFP4], -1)
    check(x, FP4, -2)  # blocks along the 12 lines of the flattened leading dims
    w = torch.randn(40, 24, generator=g).t()  # a transposed weight: the row orientation reads stride 24
    check(w, [bf.MXFP4], -1)
    check(w, [bf.MXFP4], 0)  # axis 0 of a 2-D tensor is its "col" orientation
    check(torch.randn(40, generator=g), [bf.MXFP4], -1)  # 1-D: one line of 40


# ------------------------------------------------------------------- both orientations into an accumulator


def both(x: torch.Tensor, recipes: Sequence[bf.BlockRecipe]) -> torch.Tensor:
    """The reference's [2, len(recipes), 5]: "row" then "col" of x viewed 2-D."""
    return torch.stack([reference(x, recipes, a) for a in (-1, -2)])


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Counts equal, sums to 1e-12 (float64 additions in another order)."""
    got = got.cpu()
    assert torch.equal(got[..., :3], want[..., :3])
    torch.testing.assert_close(got[..., 3:], want[..., 3:], rtol=1e-12, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulator_gets_both_orientations_in_one_launch_and_adds(dtype: torch.dtype) -> None:
    """``TritonBlocks.add`` writes "row" and "col" of a tensor in one launch (two with NVFP4's amax), adds into
    what the accumulator held, and its scratch (the amax, the count of programs done) starts clean for the next
    tensor: a second tensor with a far smaller amax gets its own NVFP4 scales."""
    eng = tb.TritonBlocks(DEV, RECIPES, tile=8, max_programs=3)  # several programs per orientation
    x = rough((40, 24), dtype, seed=3)
    y = (rough((16, 48), dtype, seed=4).float() * 2.0**-20).to(dtype)
    acc = torch.zeros(2, len(RECIPES), 5, dtype=torch.float64, device=DEV)
    assert eng.add(x.to(DEV), acc)
    assert_same(acc, both(x, RECIPES))
    assert eng.add(y.to(DEV), acc)
    assert_same(acc, both(x, RECIPES) + both(y, RECIPES))
    assert eng.scratch.cpu().tolist() == [0, 0]
    # 3-D, a strided view (leading dims merge into one stride), a transposed weight: read in place
    g = torch.Generator().manual_seed(7)
    z = (torch.randn(3, 8, 40, generator=g) * 4.0)[:, ::2, :].to(dtype)
    w = torch.randn(40, 24, generator=g).to(dtype).t()
    for t in (z, w):
        acc = torch.zeros(2, len(RECIPES), 5, dtype=torch.float64, device=DEV)
        assert eng.add(t.to(DEV), acc)
        assert_same(acc, both(t, RECIPES))


def test_a_position_at_a_time_as_a_gpu_reads_gives_the_same_statistics() -> None:
    """The GPU's way through a block (a thread reads one position of its line at a time: ``positions=1``),
    which the interpreter otherwise leaves to the GPU (it reads all 32 at once): the same counts, the same sums
    to 1e-12, for every recipe, both orientations, NVFP4's two halves of a block included (fp16: the dtype
    only changes how a value is decoded; the interpreter pays per operation, 64 a block here)."""
    x = rough((12, 36), torch.float16, seed=11)
    eng = tb.TritonBlocks(DEV, RECIPES, tile=16, max_programs=2, positions=1)
    acc = torch.zeros(2, len(RECIPES), 5, dtype=torch.float64, device=DEV)
    assert eng.add(x.to(DEV), acc)
    assert_same(acc, both(x, RECIPES))
    assert (acc[..., 0] > 0).any() and (acc[..., 1] > 0).any()  # values flushed and saturated both ways
    # the reference's arithmetic (every block amax past 2^101) a position at a time, and the bounds' four
    for y, positions in ((boundary_blocks_at(110), 1), (boundary_blocks_at(0), 4)):
        eng = tb.TritonBlocks(DEV, RECIPES, tile=8, positions=positions)
        acc = torch.zeros(2, len(RECIPES), 5, dtype=torch.float64, device=DEV)
        assert eng.add(y.to(DEV), acc)
        assert_same(acc, both(y, RECIPES))


def test_accumulator_slot_of_a_larger_tensor_and_what_it_does_not_read() -> None:
    """``out`` is a slot of the block accumulator (a view inside a larger tensor): nothing around it is
    written; a tensor of another dtype, of one dimension or without values is not read (False)."""
    eng = tb.TritonBlocks(DEV, FP4)
    x = rough((33, 40), torch.float32, seed=5)
    blocks = torch.full((3, 2, 2, 5), 7.0, dtype=torch.float64, device=DEV)
    assert eng.add(x.to(DEV), blocks[1])
    assert_same(blocks[1], both(x, FP4) + 7.0)
    assert blocks[0].eq(7).all() and blocks[2].eq(7).all()
    for bad in (x.double(), torch.ones(40), torch.ones(0, 32)):
        assert not eng.add(bad.to(DEV), blocks[0])
    assert blocks[0].eq(7).all()
    for bad_args in (dict(recipes=[]), dict(tile=24), dict(positions=3), dict(positions=64)):
        with pytest.raises(UserError):
            tb.TritonBlocks(DEV, **{"recipes": FP4, **bad_args})  # type: ignore[arg-type]


def test_a_program_reads_at_most_max_iters_tiles_and_the_scratch_grows_for_more_programs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A program reads at most ``MAX_ITERS`` tiles (a thread's int32 counts take at most 32 values of its line
    a tile), so a tensor that needs it gets more programs than ``max_programs`` (2^36 values at 528 programs:
    8,197 of at most 2,047 tiles), and ``TritonBlocks.add`` grows its partials' scratch for them. With the
    bound at 2 tiles (6 programs where 2 were sized), the same statistics."""
    assert 32 * tb.MAX_ITERS < 1 << 31
    (*_, tiles, iters), programs = tb._geometry(1 << 20, 1 << 16, 1, 1 << 20, 128, 528)
    assert (tiles, programs, iters) == (1 << 24, 8197, 2047)
    assert tb._geometry(1 << 10, 1 << 14, 1, 1 << 10, 128, 528)[1] == 528  # (the usual case: most)
    monkeypatch.setattr(tb, "MAX_ITERS", 2)
    eng = tb.TritonBlocks(DEV, RECIPES, tile=8, max_programs=1)
    assert eng.part.shape[0] == 2
    x = rough((40, 24), torch.float32, seed=12)  # 5 tiles one way, 6 the other
    acc = torch.zeros(2, len(RECIPES), 5, dtype=torch.float64, device=DEV)
    assert eng.add(x.to(DEV), acc)
    assert eng.part.shape[0] == 6
    assert_same(acc, both(x, RECIPES))


def test_a_sampled_tensor_is_one_launch_with_no_torch_work_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks' path (``StatsBuffer.accumulate_blocks`` on the Triton engine): one call of the launch for a
    tensor's two orientations, and around it only views (no allocation, no reduction, no copy: the launch adds
    into the accumulator's slot itself). It had been four launches and about 20 torch ops a tensor."""
    if DEV.type == "cuda":
        pytest.skip("on CUDA the launch is direct (tests/test_stats_gpu.py)")
    from torch.utils._python_dispatch import TorchDispatchMode

    from precprof.stats import StatsBuffer

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    launches: list[tuple[object, ...]] = []
    monkeypatch.setattr(tb, "_launch", lambda *a, **kw: launches.append(a) or [])
    buf = StatsBuffer(2, DEV, engine="triton")
    for x in (torch.randn(64, 96), torch.randn(4, 8, 96).to(torch.bfloat16)):
        launches.clear()
        with Ops() as ops:
            buf.accumulate_blocks(x, 0)
        buf.reset()
        assert len(launches) == 1
        views = {"aten.detach.default", "aten.select.int", "aten.view.dtype", "aten.view.default"}
        assert set(ops.seen) <= views, ops.seen


# the values a program rounds: 1,024 on a GPU; in the interpreter, which runs a program's operations on all its
# values at once (numpy) and the programs one after another, 2^16 (the same values, a few programs each format)
_SPAN = 1 << 16 if DEV.type == "cpu" else 1024


@triton.jit
def _both_roundings(
    x_ptr,
    fast_ptr,
    general_ptr,
    n,
    MB: tl.constexpr,
    EMIN: tl.constexpr,
    FMAX: tl.constexpr,
    SPAN: tl.constexpr,
):
    i = tl.arange(0, SPAN) + tl.program_id(0) * SPAN
    a = tl.load(x_ptr + i, mask=i < n, other=0).to(tl.float32, bitcast=True)
    tl.store(fast_ptr + i, tbm._round_value(a, MB, EMIN, FMAX), mask=i < n)
    tl.store(general_ptr + i, tbm._round_elem(a, MB, EMIN, FMAX), mask=i < n)


def test_the_rounding_on_bits_equals_the_general_rounding_and_real_casts() -> None:
    """``_round_value`` (the per-value rounding: the magic-number sum with a power of two from the value's
    exponent bits) equals ``_round_elem`` (the general one, kept for NVFP4's block scales) on a
    dense set of fp32 magnitudes of every element format: each binade's ulps of the format around 2^EMIN,
    around the max, every tie and its neighbours, fp32 subnormals, zero and values past the max; and equals
    the real fp8 casts (torch's e4m3fn and e5m2, after the clamp to the max)."""
    consts = tb._constants()
    for f, name in enumerate(tb.ELEMENTS):
        mb, emin, fmax_bits = consts[f"MB{f}"], consts[f"EMIN{f}"], consts[f"FMAX{f}"]
        fmax = torch.tensor(fmax_bits, dtype=torch.int32).view(torch.float32).item()
        # every fp32 pattern within 2^12 ulps of each power of two from below 2^(EMIN - MB - 2) to past the max
        # (ties of the format and their neighbours included: a format ulp is 2^(23 - MB) fp32 ulps), the fp32
        # subnormals near 0 and near the normal range, and every multiple of a quarter format ulp below 2^EMIN
        pows = torch.arange(emin - mb - 3, int(math.log2(fmax)) + 3, dtype=torch.int32)
        around = ((pows + 127) << 23)[:, None] + torch.arange(-(2**12), 2**12, dtype=torch.int32)[None, :]
        sub = torch.cat([torch.arange(0, 4096), torch.arange(0x7FF000, 0x800000)]).to(torch.int32)
        quarter = torch.arange(0, 4 << mb).float() * 2.0 ** (emin - mb - 2)
        # every tie between two neighbours of the format in its normal binades, and the fp32 values beside it
        sh = 23 - mb
        ties = ((pows + 127) << 23)[:, None] + (torch.arange(1 << mb, dtype=torch.int32) << sh)[None, :]
        ties = (ties + (1 << (sh - 1))).flatten()[:, None] + torch.arange(-2, 3, dtype=torch.int32)[None, :]
        parts = [around.flatten(), ties.flatten(), sub, quarter.view(torch.int32)]
        bits = torch.cat([*parts, torch.tensor([0x7F7FFFFF], dtype=torch.int32)])
        bits = bits[bits >= 0]
        fast = torch.empty(bits.numel(), dtype=torch.float32)
        general = torch.empty_like(fast)
        grid = (-(-bits.numel() // _SPAN),)
        bits, fast, general = bits.to(DEV), fast.to(DEV), general.to(DEV)
        _both_roundings[grid](
            bits,
            fast,
            general,
            bits.numel(),
            MB=mb,
            EMIN=emin,
            FMAX=fmax_bits,
            SPAN=_SPAN,
            **tb.LAUNCH_OPTIONS,
        )
        bits, fast, general = bits.cpu(), fast.cpu(), general.cpu()
        assert torch.equal(fast.view(torch.int32), general.view(torch.int32)), name
        cast = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(name)
        if cast is not None:
            a = bits.view(torch.float32).clamp(max=fmax)
            assert torch.equal(fast, a.to(cast).float()), name


# ------------------------------------------------------------------------ the reference tests' blocks


def test_hand_built_boundary_blocks_both_orientations() -> None:
    x = boundary_blocks()  # test_block_formats' torchao boundary set
    got = check(x, RECIPES, -1)
    floor = [i for i, r in enumerate(RECIPES) if r.scale_mode == bf.ScaleMode.FLOOR]
    assert (got[:, 0] > 0).all() and (got[floor, 1] > 0).all()
    assert got[RECIPES.index(bf.NVFP4), 1] == 0  # NVFP4's scaled values stay below 6.4: none rounds past 6
    check(x.t(), RECIPES, -2)  # the same blocks down the columns of a transposed view, no copy


def test_block_amaxes_from_fp32s_lowest_binade_to_its_highest() -> None:
    # A tile whose block amaxes all lie in [2^-90, 2^101) (or are 0) has its MX scales carried to the bounds
    # (triton_block_math._mx_fast: no product by 2^-k or 2^k, whose bounds would overflow or fall below fp32's
    # normals further out); any other tile is computed as the reference computes it. One binade at a time (a
    # sum of squares over all would hide the lower binades' errors), every MX recipe in both scale modes and
    # NVFP4
    mx = [bf.get_recipe(n, m) for n in bf.RECIPES if n != "nvfp4" for m in ("floor", "rceil")]
    for binade in AMAX_BINADES:
        check(boundary_blocks_at(binade), [*mx, bf.NVFP4], -1, tile=8)


def test_hand_built_mx_blocks() -> None:
    # test_block_formats' MX blocks, one per line: FP4 ties and half-subnormals, amax 8 and just below 8
    # (floor saturates, rceil does not), rceil at an exact power of two, an outlier that flushes its block,
    # the smallest E8M0 scale, zeros; the ties and flushes are worked out there
    below8 = float(torch.nextafter(f32(8.0), f32(0.0)))
    above4 = float(torch.nextafter(f32(4.0), f32(5.0)))
    x = torch.cat(
        [
            block([6.0, 2.5, 5.0, 0.25, 0.2500001, -0.5, -0.2, 1.25]),
            block([8.0, 3.0, 7.0]),
            block([below8, 7.0, 3.0]),
            block([12.0, 5.0]),
            block([2.0**20, 1.0, 4.0, -3.0, above4, 1e-30]),
            block([2.0**-120, 2.0**-126]),
            block([2.0**-125]),
            torch.zeros(1, 32),
        ]
    )
    got = check(x, RECIPES[:6], -1)
    assert got[0, 0] == 4  # MXFP8 E4M3: the outlier block's 1, 4, -3 and 1e-30 flush
    assert got[RECIPES.index(bf.MXFP4), 1] == 2  # the block just below 8: 7.99.. and 7 saturate
    assert got[1, 1] == 0  # rceil saturates nothing here


def test_hand_built_nvfp4_two_level_scales() -> None:
    # test_block_formats' NVFP4 tensor: p = 1 exactly, block scales 4, 9 (55.5 -> 6.17, clamped to 6, where it
    # rounds anyway), the smallest E4M3 scale 2^-6, and 2688·fl(1/448) > 6 clamped (rounds to 6 too): 2 flushed,
    # none saturated
    x = torch.zeros(1, 64)
    x[0, 0] = 2688.0
    x[0, 16:20] = f32(24.0, 10.0, 1.0, 1.0000001)
    x[0, 32:34] = f32(55.5, 18.0)
    x[0, 48:50] = f32(6 * 2.0**-8, 2.0**-8)
    assert check(x, [bf.NVFP4], -1)[0, :2].tolist() == [2, 0]


# ---------------------------------------------------------------------------------- nan, inf, extremes


def test_nan_and_inf_poison_their_block_mx_and_the_tensor_nvfp4() -> None:
    x = torch.ones(2, 64)
    x[0, 3] = math.nan
    x[1, 40] = -math.inf
    x[1, 41] = 100.0
    got = check(x, RECIPES, -1)
    assert got[:, 2].tolist() == [64] * 6 + [128]
    got = check(x, RECIPES, -2)  # down the columns: blocks of 2 lines, two of them poisoned
    assert got[:, 2].tolist() == [4] * 6 + [128]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_nan_inf_and_subnormal_bits(dtype: torch.dtype) -> None:
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    x = torch.tensor([[1.0, -3.0, tiny, 5 * tiny, 0.0, 2.0**-3], [math.inf, 1.0, 2.0, 3.0, -0.0, 4.0]]).to(
        dtype
    )
    x = torch.cat([x, x.abs().flip(0)], dim=1)
    x[0, 7] = math.nan
    check(x, FP4, -1)
    check(x[:, :6].abs().t().contiguous(), [bf.MXFP8_E5M2, bf.NVFP4], -1)  # finite: NVFP4 counts too


def test_tiny_tensors_nvfp4_degenerate_scales_and_mx_smallest_scales() -> None:
    # NVFP4 with tensor amax 2^-140: p = fl(2^-140 / 2688) rounds to 0 and is clamped to the smallest fp32
    # whose reciprocal is finite; the block scale clamps to 2^-6, the element factor to the fp32 max, and every
    # nonzero value flushes. 2^-120: p clamped again, an ordinary quantisation from there (4 small values
    # flush). 2^-115: p subnormal, 1/p finite, torchao's arithmetic unclamped (two values scaled above 6 round
    # to 6: clamped, not saturated). No error sum is nan.
    want = {2.0**-140: [16, 0], 2.0**-120: [4, 0], 2.0**-115: [4, 0]}
    recipes = [bf.NVFP4, bf.MXFP4.with_scale_mode("rceil"), bf.MXFP8_E4M3]
    for top, counts in want.items():
        x = torch.tensor(
            [[top, top / 3, top / 64, 0.0, -top / 5], [top / 7, top / 2**9, 0.0, top / 1.5, top]]
        )
        got = check(torch.cat([x, x * 0.75], dim=1), recipes, -1)
        assert got[0, :2].tolist() == counts and math.isfinite(got[0, 4])
    # MX blocks whose fl32(amax / max) is 0 (rceil takes E8M0's smallest, 2^-127) or below E8M0's 2^-127
    x = torch.tensor([[2.0**-149, 2.0**-148, 0.0, 3 * 2.0**-149], [2.0**-147, 2.0**-140, 0.0, 0.0]])
    check(x, RECIPES[:6], -1)


def test_values_near_the_fp32_max_overflow_the_rceil_dequantisation() -> None:
    # amax = fp32's max: rceil picks 2^126 for MXFP4 (and 2^113 for E5M2), the max rounds up to 4·2^126 = 2^128
    # (resp. 2^15·2^113): the fp32 product is inf and so is the error; floor saturates instead
    big = torch.finfo(torch.float32).max
    x = block([big, 1.0, -big / 3, 2.0**100, big / 1.9])
    got = check(x, [bf.MXFP4.with_scale_mode("rceil"), bf.MXFP8_E5M2.with_scale_mode("rceil"), bf.MXFP4], -1)
    assert got[:2, 4].tolist() == [math.inf, math.inf] and math.isfinite(got[2, 4])


def test_all_zero_and_empty_tensors() -> None:
    got = check(torch.zeros(3, 32), RECIPES, -1)
    assert got.eq(0).all()
    assert tb.block_stats_triton(torch.zeros(0, 32, device=DEV), RECIPES, -1).eq(0).all()
    assert tb.block_stats_triton(torch.ones(4, 32, device=DEV), [], -1).shape == (0, 5)


# ------------------------------------------------------------------------- tiles, programs, determinism


def test_tiles_and_programs_change_no_count_and_results_repeat_bitwise() -> None:
    x = rough((24, 20), torch.float32, seed=9)
    recipes = [bf.NVFP4, bf.MXFP4, bf.MXFP4]  # any order, repeats allowed: rows follow the list
    one = check(x, recipes, -1)  # one tile, one program
    # 3 tiles, 2 programs x 2 iterations
    many = tb.block_stats_triton(x.to(DEV), recipes, -1, tile=8, max_programs=2).cpu()
    assert torch.equal(one[:, :3], many[:, :3]) and torch.equal(one[1], one[2])
    torch.testing.assert_close(one[:, 3:], many[:, 3:], rtol=1e-12, atol=0.0)
    assert torch.equal(tb.block_stats_triton(x.to(DEV), recipes, -1).cpu(), one)  # run to run: bit for bit


def test_user_errors() -> None:
    x = torch.ones(4, 32, device=DEV)
    cases = [
        lambda: tb.block_stats_triton(x.double(), FP4, -1),
        lambda: tb.block_stats_triton(x.int(), FP4, -1),
        lambda: tb.block_stats_triton(torch.tensor(1.0, device=DEV), FP4, -1),
        lambda: tb.block_stats_triton(torch.ones(32, device=DEV), FP4, -2),
        lambda: tb.block_stats_triton(x, FP4, 2),
        lambda: tb.block_stats_triton(x, FP4, -1, tile=24),
        lambda: tb.block_stats_triton(x, [bf.BlockRecipe("mx16", bf.FP4_E2M1, 16, "e8m0")], -1),
        lambda: tb.block_stats_triton(x, ["mxfp4"], -1),  # type: ignore[list-item]
    ]
    for case in cases:
        with pytest.raises(UserError) as err:
            case()
        assert "\n" not in str(err.value)
    assert [tb.slot(r) for r in RECIPES] == [0, 1, 2, 4, 6, 8, 10]


_PTX_OF_SM90 = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from precprof.stats import blocks, triton_block as tb, triton_block_kernels as k
out = {}
for kind, fusion in ((0, False), (2, False), (0, True)):
    signature = {"x_ptr": "*i32" if kind == 0 else "*i16", "scr_ptr": "*i32", "part_ptr": "*fp64", "out_ptr": "*fp64"}
    geometry = ["n_along", "n_across", "st_along", "st_across", "tiles", "iters"]
    signature.update(dict.fromkeys([g + "0" for g in geometry] + ["progs0"] + [g + "1" for g in geometry], "i64"))
    consts = tb._consts(kind, 32, [tb.slot(r) for r in blocks.RECIPES])
    signature.update(dict.fromkeys(consts, "constexpr"))
    options = {**tb._options(tb.MAX_REGISTERS), **({"enable_fp_fusion": True} if fusion else {})}
    source = ASTSource(k._blocks, signature=signature, constexprs=consts)
    out[f"{kind}{'+fusion' if fusion else ''}"] = compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
json.dump(out, sys.stdout)
"""


def test_the_kernel_compiled_for_sm90_keeps_its_arithmetic_exact() -> None:
    """The kernel matches the reference because its fp32 operations are IEEE ones in the reference's order.
    Compiled for an H100 (sm_90: no GPU needed, in a process without the interpreter) with the launch's
    options, its PTX holds no fused multiply-add of fp32 values, no flush of subnormals (``.ftz``) and no
    approximate division, for fp32 and for fp16 (decoded by the exact conversion instruction); with fusion on,
    the same source would contract (what the option is there for). The register bound reaches ptxas."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _PTX_OF_SM90],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = json.loads(done.stdout)
    for kind in ("0", "2"):
        exact = ptx[kind]
        for forbidden in ("fma.rn.f32", "fma.f32", ".ftz", "div.full", "div.approx", "rcp.approx.f32"):
            assert forbidden not in exact, (kind, forbidden)
        assert exact.count("div.rn.f32") >= 5  # every division correctly rounded (rceil's, NVFP4's scales)
    assert "cvt.f32.f16" in ptx["2"]
    # the bound on a thread's registers (eight programs a multiprocessor)
    assert f".maxnreg {tb.MAX_REGISTERS}" in ptx["0"]
    assert "fma.rn.f32" in ptx["0+fusion"]
