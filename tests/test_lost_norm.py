"""The one bound every what-if is judged by (issue 34): the share of a tensor's L2 norm a cast loses, from its
exponent histogram (precprof.analysis.lost_norm), and the per-tensor current scaling it assumes for FP8
(precprof.analysis.current_scaling). Checked against real casts (``x.to(torch.float8_e5m2)``) of hand-built
tensors, independently of precprof's statistics engines."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from precprof import block_formats as B
from precprof import formats
from precprof.analysis import current_scaling, lost_norm
from precprof.analysis.advisor.rules.block_losses import RECIPE_BOUNDS

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def hist(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """floor(log2 |x|) histogram of the finite nonzero values, via frexp."""
    x = x[torch.isfinite(x) & (x != 0)]
    e, c = torch.unique(torch.frexp(x)[1] - 1, return_counts=True)
    return e.numpy(), c.numpy()


def cast_lost(x: torch.Tensor, fmt: str) -> tuple[float, int]:
    """(share of the L2 norm, count) of the nonzero values a real cast to ``fmt`` flushes after per-tensor
    current scaling."""
    k = math.floor(math.log2(formats.get(fmt).max / float(x.abs().max())))
    gone = (x != 0) & ((x.double() * 2.0**k).float().to(FP8[fmt]).float() == 0)
    return float(x.double()[gone].norm() / x.double().norm()), int(gone.sum())


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = 20_000
    wide = 2.0 ** (-40 * torch.rand(n, generator=g)) * torch.randn(n, generator=g)
    ties = wide.clone()
    ties[:300] = 2.0**-20  # exact powers of two, some on the limit of one of the formats below
    spike = 2.0 + 2.0 * torch.rand(n, generator=g)
    spike[0] = 2.0**24
    normal = torch.randn(n, generator=g)
    return [wide, ties, spike, normal]


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("i", range(4))
def test_current_scaling_bound_against_real_casts(fmt: str, i: int) -> None:
    x = tensors()[i]
    f = formats.get(fmt)
    amax = np.array([float(x.abs().max())])
    assert current_scaling.exponents(f, amax)[0] == formats.current_scaling_exponent(f, float(amax[0]))
    true, n_lost = cast_lost(x, fmt)
    e, c = hist(x)
    limit = current_scaling.underflow_limit_log2(f, amax)
    group = np.zeros(len(e), dtype=np.int64)
    exact = lost_norm.lost_share_bound(e, c, group, limit, lost=np.array([n_lost]), exact=np.array([True]))[0]
    loose = lost_norm.lost_share_bound(e, c, group, limit, lost=np.array([n_lost]), exact=np.array([False]))[
        0
    ]
    # an upper bound, within 4x of the truth (each lost value at most 2x its binade's lower edge, each kept
    # one at least its lower edge), and the one-call bound at least as tight as the general one
    assert true <= exact <= loose
    assert exact <= 4 * true + (0.0 if n_lost else 1e-300)
    if n_lost == 0:
        assert exact == 0.0


@pytest.mark.parametrize("top", [1e-23, 1e-14])
def test_a_tensor_under_torchaos_amax_floor_is_judged_at_torchaos_scale(top: float) -> None:
    """torchao computes a tensor's FP8 scale from max(amax, 1e-12): a gradient of 1e-23 is scaled by 2^55 in
    e5m2, not by 2^87, and flushes entirely. The limit and the bound are those of torchao's own scale (its
    amax_to_scale, a real cast after it), not of the tensor's amax."""
    utils = pytest.importorskip("torchao.float8.float8_utils")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * top
    amax = torch.tensor(float(x.abs().max()))
    for fmt, dtype in FP8.items():
        scale = float(utils.amax_to_scale(amax, dtype, round_scales_to_power_of_2=True))
        gone = (x != 0) & ((x.double() * scale).float().to(dtype).float() == 0)
        true = float(x.double()[gone].norm() / x.double().norm())
        f = formats.get(fmt)
        assert current_scaling.exponents(f, amax.numpy()[None])[0] == math.log2(scale)
        assert bool(current_scaling.under_floor(amax.numpy()[None])[0])
        limit = current_scaling.underflow_limit_log2(f, amax.numpy()[None])
        e, c = hist(x)
        bound = lost_norm.lost_share_bound(
            e, c, np.zeros(len(e), np.int64), limit, lost=np.array([int(gone.sum())]), exact=[True]
        )[0]
        assert true <= bound <= 4 * true + (0.0 if gone.any() else 1e-300)
    if top == 1e-23:  # e5m2 keeps nothing of it: its whole norm is lost
        assert bool(gone.all())


def test_values_on_the_limit_are_counted_exactly() -> None:
    """Values exactly on 2^limit round to 0 (the tie goes to the even neighbour): with the exact count of
    what was lost, the bound takes their energy exactly, not at their binade's upper edge."""
    x = torch.cat([torch.full((1000,), 2.0**-20), torch.tensor([2.0**12])])  # e5m2: k = 3, limit 2^-20
    f = formats.FP8_E5M2
    true, n_lost = cast_lost(x, "fp8_e5m2")
    assert n_lost == 1000
    e, c = hist(x)
    limit = current_scaling.underflow_limit_log2(f, np.array([float(x.abs().max())]))
    assert limit[0] == -20
    got = lost_norm.lost_share_bound(
        e, c, np.zeros(len(e), np.int64), limit, lost=np.array([1000]), exact=[True]
    )
    assert got[0] == pytest.approx(true, rel=1e-12)


def test_without_counts_only_whole_binades_below_the_limit() -> None:
    """The fp16 rule's form (no exact count): values in binades wholly at or below the limit, at their upper
    edges, against the others at their lower edges; groups apart."""
    e = np.array([-30, -30, 2, -3, -26, -25])
    c = np.array([3, 4, 1, 7, 5, 9])
    g = np.array([0, 0, 0, 1, 2, 2])
    got = lost_norm.lost_share_bound(e, c, g, np.full(3, -25.0))
    assert got[0] == pytest.approx(math.sqrt(7 * 4.0**-29 / (7 * 4.0**-29 + 4.0**2)))
    assert got[1] == 0.0
    # -26: wholly below 2^-25; -25 holds the limit (only values exactly on it would be lost): kept here
    assert got[2] == pytest.approx(math.sqrt(5 * 4.0**-25 / (5 * 4.0**-25 + 9 * 4.0**-25)))
    empty = lost_norm.lost_share_bound(np.zeros(0), np.zeros(0), np.zeros(0, np.int64), np.full(2, -25.0))
    assert np.isnan(empty).all()


def test_top_energy_bound() -> None:
    x = torch.tensor([100.0, 90.0, 3.0, 3.0, 0.5])
    e, c = hist(x)
    top, total = lost_norm.top_energy_bound(e, c, np.zeros(len(e), np.int64), 1, np.array([2.0]))
    assert float((x[:2] ** 2).sum()) <= top[0] <= 4 * float((x[:2] ** 2).sum())
    assert total[0] <= float((x**2).sum())


def test_windows_slide_with_each_tensors_largest_value() -> None:
    w = current_scaling.windows("fp8_e4m3", np.array([448.0, 1.0, 0.0]))
    assert w[0] is not None and w[0].lo == -10 and w[0].normal_lo == -6
    assert w[1] is not None and w[1].lo == -10 - 8  # 1 * 2^8 <= 448 < 2^9: k = 8
    assert w[2] is None
    assert w[1].hi > 0  # nothing of a tensor reaches its format's overflow under current scaling


@pytest.mark.parametrize("name", sorted(RECIPE_BOUNDS))
def test_block_recipe_bounds_follow_block_formats(name: str) -> None:
    """The advisor's bounds (no torch) match the recipes block_formats quantises with."""
    recipe = next(r for r in B.column_recipes() if r.name == name)
    b = RECIPE_BOUNDS[name]
    assert b.underflow_log2 == math.log2(recipe.element.underflow_max)
    if recipe.scale_format == "e8m0" and recipe.scale_mode == B.ScaleMode.FLOOR:
        emax = recipe.element.max_exponent
        assert b.scale_max == 2.0**-emax and b.rho == 1 - recipe.element.max / 2.0 ** (emax + 1)
    # no value the recipe flushes lies above u * scale_max * amax, on tensors of every magnitude
    g = torch.Generator().manual_seed(1)
    for mag in (1.0, 2.0**-100, 2.0**-140):
        x = torch.randn(64, 64, generator=g) * mag
        x[3, ::16] *= 50
        q = B.quantize(x, recipe)
        gone = (x != 0) & (q == 0)
        if gone.any():
            amax = float(x.abs().max())
            limit = 2.0**b.underflow_log2 * max(amax * b.scale_max, b.scale_floor)
            assert float(x[gone].abs().max()) <= limit, (name, mag)


@pytest.mark.parametrize("categorical", [False, True])
def test_each_histogram_row_finds_its_tensor(categorical: bool) -> None:
    """The join the FP8 and block rules make from histogram rows to their tensors' layers rows, by integer
    keys: a missing module is the root's "", a tensor the rows do not hold is -1, a repeated key its first."""
    import pandas as pd

    from precprof import tables as T
    from precprof.analysis.advisor.evidence import _row_index

    rows = pd.DataFrame(
        [
            (0, "a", "activation", ""),
            (0, "a", "weight", "weight"),
            (1, "", "activation", ""),
            (1, "a", "activation", ""),
            (1, "a", "activation", ""),  # repeated: the first holds the key
        ],
        columns=[T.STEP, T.MODULE, T.TENSOR, T.PARAM],
    )
    hist = pd.DataFrame(
        [
            (0, "a", "activation", "", -3, 1),
            (0, "a", "weight", "weight", -5, 2),
            (1, None, "activation", "", 0, 3),
            (1, "a", "activation", "", 1, 4),
            (2, "a", "activation", "", 1, 5),  # a step the rows do not have
            (0, "b", "activation", "", 1, 6),  # a module they do not have
            (0, "a", "weight", "bias", 1, 7),
        ],
        columns=[T.STEP, T.MODULE, T.TENSOR, T.PARAM, T.EXPONENT, T.COUNT],
    )
    if categorical:
        hist = hist.astype({c: "category" for c in (T.MODULE, T.TENSOR, T.PARAM)})
    assert _row_index(hist, rows).tolist() == [0, 1, 2, 3, -1, -1, -1]


def test_fp8_summary_per_layer_and_side() -> None:
    """``fp8_summary``: per (layer, side), in the order the pairs come, the largest of its tensors' medians over
    steps (NaN skipped), the worst step, the tensor named for a share the first of the largest (ties and
    all-NaN shares go to the tensor first by ``pushed``), a floored step anywhere, and the distinct steps."""
    import pandas as pd

    from precprof import tables as T
    from precprof.analysis.advisor.rules.fp8 import fp8_summary

    nan = math.nan
    cols = [T.STEP, T.MODULE, T.TENSOR, T.PARAM, "side", "lost_norm", "lost_values"]
    cols += ["pushed", "pushed_pooled", "below", "floored"]
    losses = pd.DataFrame(
        [
            # layer a's input, read from two modules at step 0: two rows a step, one step counted
            (0, "a", "input", "", "forward", 0.125, 0.0, 0.02, nan, 0.25, False),
            (0, "a", "input", "", "forward", 0.125, 0.0, 0.02, nan, 0.25, False),
            (1, "a", "input", "", "forward", 0.5, 0.0, 0.02, nan, 0.25, False),
            (2, "a", "input", "", "forward", nan, 0.0, 0.02, nan, 0.25, False),
            (3, "a", "input", "", "forward", 0.25, 0.0, 0.02, nan, 0.25, False),
            (0, "a", "weight", "weight", "forward", 0.375, 0.5, 0.05, nan, 0.25, False),
            (1, "a", "weight", "weight", "forward", 0.625, 0.25, 0.05, nan, 0.25, True),
            (0, "b", "weight", "weight", "forward", 0.0, 0.0, 0.0, 0.5, 0.0, False),
            (0, "a", "activation_grad", "", "backward", nan, nan, nan, nan, nan, False),
            (1, "a", "activation_grad", "", "backward", nan, nan, nan, nan, nan, False),
        ],
        columns=cols,
    )
    got = fp8_summary(losses)
    assert list(got.index) == [("a", "forward"), ("b", "forward"), ("a", "backward")]
    a = got.loc[("a", "forward")]
    assert (a["norm"], a["norm_worst"], a["values"]) == (0.5, 0.625, 0.375)  # weight: medians 0.5, 0.375
    assert (a["pushed"], a["pushed_tensor"]) == (0.05, "weight")
    assert math.isnan(a["pushed_pooled"]) and a["pushed_pooled_tensor"] == "weight"  # first by pushed
    assert (a["below"], a["below_tensor"]) == (0.25, "weight")  # a tie: the first by pushed
    assert bool(a["floored"]) and a["steps"] == 4
    b = got.loc[("b", "forward")]
    assert (b["pushed_pooled"], b["pushed_pooled_tensor"], bool(b["floored"]), b["steps"]) == (
        0.5,
        "weight",
        False,
        1,
    )
    back = got.loc[("a", "backward")]
    assert math.isnan(back["norm"]) and back["pushed_tensor"] == "activation_grad" and back["steps"] == 2
    assert fp8_summary(losses.iloc[:0]).empty


def test_zero_gradient_matches_each_update_to_its_steps_gradient() -> None:
    """``lost_updates.zero_gradient``: an update whose gradient row of its step is zero everywhere (the first of
    a repeated key), or that has none on a step whose backward was read while its weight has gradients on other
    steps; keys matched as values (step 1 and 1.0 alike, a missing module with a missing one)."""
    import pandas as pd

    from precprof import tables as T
    from precprof.analysis.lost_updates import zero_gradient

    keys = [T.STEP, T.MODULE, T.PARAM]
    grads = pd.DataFrame(
        [
            (0, "a", "weight", 4, 4),  # zero everywhere
            (0, "a", "weight", 4, 0),  # a repeated key: the first counts
            (1, "a", "weight", 4, 1),
            (0, None, "weight", 2, 2),
            (0, "b", "weight", 0, 0),  # no elements: not zero
        ],
        columns=[*keys, T.NUMEL, T.ZEROS],
    )
    updates = pd.DataFrame(
        [
            (0.0, "a", "weight"),  # its step's row is zero
            (1.0, "a", "weight"),
            (1.0, "b", "weight"),  # none on a read step, its weight has a row on another: skipped by it
            (2.0, "a", "weight"),  # a step whose backward was not read
            (0.0, "c", "weight"),  # a weight whose gradient is never read
            (0.0, None, "weight"),  # a missing module matches a missing one
            (0.0, "a", "bias"),
        ],
        columns=keys,
        index=[10, 11, 12, 13, 14, 15, 16],
    )
    got = zero_gradient(grads, updates)
    assert list(got.index) == [10, 11, 12, 13, 14, 15, 16]
    assert got.tolist() == [True, False, True, False, False, True, False]
