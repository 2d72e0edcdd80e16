"""Exactness of the numeric core: every count and every histogram bin of ``precprof.stats`` against
independent computations, equal and not close.

References:

- counts: real casts (``x.to(torch.float16)``, ``torch.bfloat16``, ``torch.float8_e4m3fn``,
  ``torch.float8_e5m2``) of the fp32 value; underflow = nonzero finite x whose cast is 0, overflow = finite x
  whose cast is inf, or for e4m3 (which torch saturates to +-448) |x| > 464 in float64;
- fp64 inputs (not representable in fp32): torch's fp64 -> fp16/bf16/fp8 casts go through fp32 and round twice
  (fp64 2^-25 + 2^-60 becomes 0 in fp16, the correctly rounded result is 2^-24), so they are checked against
  ``rne_round``, an exact round-to-nearest-even in numpy float64 arithmetic, itself checked against real
  casts below;
- histogram: ``torch.bincount`` of ``torch.frexp`` exponents (frexp's e is floor(log2|x|) + 1);
- fp8 current scaling: the scale found by brute force, then real casts of x * 2^k.

The helpers take a ``device`` so that ``test_stats_gpu.py`` runs the same checks on CUDA.
"""

from __future__ import annotations

import ctypes
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import kernel_required
from hypothesis import given, settings
from hypothesis import strategies as st

from precprof import formats, stats
from precprof.stats import COL_UNDERFLOW_CS, RowStats, StatsBuffer, decode, engine, tensor_stats

WHATIF = formats.WHATIF_FORMATS
INPUT_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp64": torch.float64,
}
EXPONENTS = np.arange(-149, 128)


# ------------------------------------------------------------------------------------------- references
def rne_round(values: np.ndarray, fmt: formats.NumberFormat) -> np.ndarray:
    """Round finite float64 ``values`` to ``fmt`` with round-to-nearest-even and an unbounded exponent on top.

    A result above ``fmt.max`` means the cast overflows (IEEE: the rounded value exceeds the largest finite
    one). All steps are exact in float64: scaling by powers of two and ``np.rint`` (ties to even).
    """
    a = np.abs(values)
    _, e = np.frexp(a)
    q = np.maximum(e - 1, fmt.normal_min_exponent) - fmt.mantissa_bits  # log2 of the spacing at |v|
    return np.copysign(np.ldexp(np.rint(np.ldexp(a, -q)), q), values)


TORCHAO_EPS = 1e-12  # torchao.float8.float8_utils.EPS: the least amax its FP8 scale is computed from


def brute_force_cs_exponent(fmax: float, amax: float) -> int:
    """The largest k with amax * 2^k <= fmax (ldexp is exact)."""
    k = 0
    while math.ldexp(amax, k) > fmax:
        k -= 1
    while math.ldexp(amax, k + 1) <= fmax:
        k += 1
    return k


def _cast_counts(x: torch.Tensor, fmt: formats.NumberFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(underflow mask, overflow mask) of flat ``x`` for one format, from a real cast or exact rounding."""
    xd = x.double()
    finite = torch.isfinite(xd)
    nonzero = finite & (xd != 0)
    if x.dtype != torch.float64:
        c = x.float().to(fmt.torch_dtype).double()  # the value is exact in fp32: one real cast
        under = nonzero & (c == 0)
        # e4m3fn has no inf: torch saturates to +-448, the rule counts |x| > 464
        over = finite & (xd.abs() > 464.0) if fmt.name == "fp8_e4m3" else finite & torch.isinf(c)
        return under, over
    rounded = torch.zeros_like(xd)
    rounded[finite] = torch.from_numpy(rne_round(xd[finite].numpy(), fmt))
    return nonzero & (rounded == 0), finite & (rounded.abs() > fmt.max)


def reference(x: torch.Tensor) -> dict:
    """Everything ``decode(row, scale=1)`` reports, computed independently of precprof.stats."""
    x = x.detach().cpu().reshape(-1)
    xd = x.double()
    finite = torch.isfinite(xd)
    nonzero = finite & (xd != 0)
    absx = xd.abs()
    out: dict = {
        "numel": x.numel(),
        "zeros": int((xd == 0).sum()),
        "nan": int(torch.isnan(xd).sum()),
        "inf": int(torch.isinf(xd).sum()),
        "absmax": float(absx[finite].max()) if bool(finite.any()) else None,  # NaN: no finite value
        "absmin": float(absx[nonzero].min()) if bool(nonzero.any()) else None,
    }
    for name in WHATIF:
        under, over = _cast_counts(x, formats.get(name))
        out[f"underflow_{name}"] = int(under.sum())
        out[f"overflow_{name}"] = int(over.sum())
    _, e = torch.frexp(xd[nonzero])
    out["hist"] = dict(Counter((e.long() - 1).tolist()))
    amax = out["absmax"]
    for name in formats.FP8_FORMATS:
        fmt = formats.get(name)
        if not amax:
            out[f"cs_{name}"] = 0
            continue
        # torchao's scale: fmax / max(amax, 1e-12) (its EPS), rounded down to a power of two
        y = xd * 2.0 ** brute_force_cs_exponent(fmt.max, max(amax, TORCHAO_EPS))  # exact in float64
        if x.dtype != torch.float64:
            # y.float() is exact wherever it matters (near the fp8 underflow tie y is a normal fp32)
            c = y.float().to(fmt.torch_dtype).double()
        else:
            c = torch.ones_like(y)
            c[finite] = torch.from_numpy(rne_round(y[finite].numpy(), fmt))
        out[f"cs_{name}"] = int((nonzero & (c == 0)).sum())
    return out


def observed(rs: RowStats) -> dict:
    out: dict = {
        "numel": rs.numel,
        "zeros": rs.zeros,
        "nan": rs.nan,
        "inf": rs.inf,
        "absmax": None if math.isnan(rs.absmax) else rs.absmax,
        "absmin": None if math.isnan(rs.absmin) else rs.absmin,
    }
    for name in WHATIF:
        out[f"underflow_{name}"] = rs.underflow[name]
        out[f"overflow_{name}"] = rs.overflow[name]
    assert len(rs.hist) == len(rs.exponents) == len(EXPONENTS)
    out["hist"] = {int(e): int(c) for e, c in zip(rs.exponents, rs.hist, strict=True) if c}
    for name in formats.FP8_FORMATS:
        out[f"cs_{name}"] = rs.underflow_cs[name]
    return out


def stats_of(x: torch.Tensor, device: str = "cpu", chunk: int | None = None, scale: float = 1.0) -> RowStats:
    buf = StatsBuffer(1, device, chunk=chunk)
    buf.accumulate(x.to(device), 0)
    return decode(buf.to_host()[0], scale)


def check_exact(x: torch.Tensor, device: str = "cpu", chunk: int | None = None) -> None:
    assert observed(stats_of(x, device, chunk)) == reference(x)


# ------------------------------------------------------------------------------------------- inputs
def _f32_neighbours(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float32)
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    down = torch.nextafter(t, torch.zeros_like(t))
    return torch.cat([t, up, down]).tolist()


def boundary_values() -> list[float]:
    """Rounding boundaries of every format (all exact in fp32)."""
    out: list[float] = []
    for name in WHATIF:
        f = formats.get(name)
        sub = f.smallest_subnormal
        out += [
            f.underflow_max,
            sub,
            1.5 * sub,  # tie between subnormals 1 and 2: rounds to 2
            2.5 * sub,  # tie between 2 and 3: rounds to 2
            f.smallest_normal - sub,
            f.smallest_normal,
            f.smallest_normal - sub / 2,  # tie between the largest subnormal and the smallest normal
            f.max,
            f.overflow_min,
            f.max - 2.0 ** (f.max_exponent - f.mantissa_bits - 1),  # a tie below max
        ]
    return out


def hand_built() -> torch.Tensor:
    """fp32: powers of two over the whole range, subnormals of each binade, every format's boundaries and
    their fp32 neighbours, specials; both signs."""
    vals: list[float] = [2.0**e for e in range(-149, 128)]
    for e in range(-149, -126):  # each subnormal binade: its bottom + 1 ulp, its top, one inside
        vals += [2.0**e + 2.0**-149, 2.0 ** (e + 1) - 2.0**-149, 1.625 * 2.0 ** max(e, -146)]
    vals += _f32_neighbours(boundary_values())
    vals += _f32_neighbours([2.0**-149, 2.0**-126, float(torch.finfo(torch.float32).max), 1.0])
    vals += [1.5 * 2.0**127, 464.0 + 16.0, 61440.0 + 4096.0]
    x = torch.tensor(vals, dtype=torch.float64)
    x = torch.cat([x, -x]).float()
    assert bool((x.double().abs() == torch.tensor(vals + vals, dtype=torch.float64).abs()).all())
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 0.0], dtype=torch.float32)
    return torch.cat([x, specials])


def random_values(
    n: int, seed: int, lo: float = -140.0, hi: float = 130.0, special: float = 0.03
) -> torch.Tensor:
    """float64 values with log-uniform magnitudes in [2^lo, 2^hi), random signs, a fraction of specials."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = sign * mag
    pick = torch.rand(n, generator=g) < special
    choice = torch.randint(0, 5, (n,), generator=g)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    return torch.where(pick, specials[choice], x)


def dtype_range(dtype: torch.dtype) -> tuple[float, float]:
    """log2 span reaching a few binades past both ends of ``dtype``."""
    if dtype == torch.float64:
        return -140.0, 127.99
    fmt = {torch.float32: formats.FP32, torch.bfloat16: formats.BF16, torch.float16: formats.FP16}.get(dtype)
    if fmt is None:
        fmt = formats.FP8_E4M3 if dtype == torch.float8_e4m3fn else formats.FP8_E5M2
    return fmt.min_exponent - 3.0, fmt.max_exponent + 3.0


# ------------------------------------------------------------------------------------------- the references
def test_reference_rounding_matches_real_casts() -> None:
    """rne_round (used for fp64 inputs) agrees with torch's casts on every fp32 value we use."""
    x = torch.cat([hand_built(), random_values(4000, 1).float()])
    for name in WHATIF:
        fmt = formats.get(name)
        x = x[torch.isfinite(x)]
        r = torch.from_numpy(rne_round(x.double().numpy(), fmt))
        c = x.to(fmt.torch_dtype).double()
        ok = r.abs() <= fmt.max
        assert torch.equal(r[ok], c[ok]), name
        if fmt.has_inf:
            assert bool(torch.isinf(c[~ok]).all())
        else:
            assert bool((c[~ok].abs() == fmt.max).all())
            assert torch.equal(~ok, x.double().abs() > 464.0)


def test_torch_fp64_casts_round_twice() -> None:
    """Why fp64 inputs use rne_round: torch rounds fp64 -> fp32 -> fp16, the rule rounds once."""
    x = torch.tensor([2.0**-25 + 2.0**-60, 65520.0 - 2.0**-30], dtype=torch.float64)
    assert x.to(torch.float16).double().tolist() == [0.0, math.inf]  # double rounding
    assert rne_round(x.numpy(), formats.FP16).tolist() == [2.0**-24, 65504.0]
    assert np.array(x.numpy()).astype(np.float16).astype(np.float64).tolist() == [2.0**-24, 65504.0]


# ------------------------------------------------------------------------------------------- hand-built
def test_hand_built_fp32() -> None:
    x = hand_built()
    rs = stats_of(x)
    ref = reference(x)
    assert observed(rs) == ref
    # spot checks of the reference itself
    assert ref["zeros"] >= 3 and ref["nan"] == 2 and ref["inf"] >= 2
    assert ref["hist"][-149] >= 2 and ref["hist"][127] >= 2
    assert ref["absmax"] == float(torch.finfo(torch.float32).max) and ref["absmin"] == 2.0**-149


@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_hand_built_each_dtype(dtype: torch.dtype) -> None:
    check_exact(hand_built().to(dtype))


def test_hand_built_fp64_neighbours() -> None:
    """fp64 values one fp64 ulp either side of every threshold (not representable in fp32)."""
    t = torch.tensor(boundary_values() + [2.0**e for e in range(-140, 128)], dtype=torch.float64)
    x = torch.cat(
        [t, torch.nextafter(t, torch.full_like(t, math.inf)), torch.nextafter(t, torch.zeros_like(t))]
    )
    x = torch.cat([x, -x])
    check_exact(x)
    rs = stats_of(x)
    # the exact rule at the fp16 underflow tie: 2^-25 and below vanish, nextafter(2^-25, inf) does not
    assert rs.underflow["fp16"] == int(((x.abs() <= 2.0**-25) & (x != 0)).sum())
    assert rs.overflow["fp16"] == int((x.abs() >= 65520.0).sum())


@pytest.mark.parametrize("name", WHATIF)
def test_threshold_counts(name: str) -> None:
    """At each threshold and its fp32 neighbours, one value each: the counts are 0 or 1 as the rule says."""
    fmt = formats.get(name)
    for t, under in ((fmt.underflow_max, True), (fmt.smallest_subnormal, False)):
        for v, u in zip(_f32_neighbours([t]), (under, False, under), strict=True):
            rs = tensor_stats(torch.tensor([v], dtype=torch.float32))
            assert rs.underflow[name] == int(u), (v, u)
            assert rs.underflow[name] == int(float(torch.tensor(v).to(fmt.torch_dtype)) == 0)
    tie, up, down = _f32_neighbours([fmt.overflow_min])
    for v, o in ((tie, fmt.overflow_inclusive), (up, True), (down, False)):
        for sign in (1, -1):
            rs = tensor_stats(torch.tensor([sign * v], dtype=torch.float32))
            assert rs.overflow[name] == int(o), (v, o)


def test_fp64_outside_fp32_range_folds_into_end_bins() -> None:
    """Documented: fp64 exponents beyond fp32's range land in the end bins; the counts stay exact."""
    x = torch.tensor(
        [2.0**-200, -(2.0**-1074), 2.0**-150, 2.0**200, -1e300, 2.0**128, 1.0], dtype=torch.float64
    )
    rs = tensor_stats(x)
    assert observed(rs)["hist"] == {-149: 3, 127: 3, 0: 1}
    assert all(rs.underflow[f] == 3 for f in WHATIF)
    assert all(rs.overflow[f] == 3 for f in WHATIF)
    assert rs.absmax == 1e300 and rs.absmin == 2.0**-1074


def test_exact_zero_nan_inf_only() -> None:
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan])
    rs = tensor_stats(x)
    assert (rs.zeros, rs.nan, rs.inf, rs.numel) == (2, 2, 2, 6)
    assert all(v == 0 for v in rs.underflow.values()) and all(v == 0 for v in rs.overflow.values())
    assert int(rs.hist.sum()) == 0
    assert rs.absmax == 0.0 and math.isnan(rs.absmin)  # the zeros are finite: the largest is 0


# ------------------------------------------------------------------------------------------- random
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_random_wide_span(dtype: torch.dtype, seed: int) -> None:
    hi = 127.99 if dtype == torch.float64 else 130.0
    check_exact(random_values(3000, seed, -140.0, hi).to(dtype))


@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_random_dtype_span(dtype: torch.dtype) -> None:
    lo, hi = dtype_range(dtype)
    check_exact(random_values(3000, 7, lo, hi).to(dtype))


def _shapes(dtype: torch.dtype) -> list[torch.Tensor]:
    base = random_values(35 * 24, 3, -140.0, 127.99).to(dtype)
    m = base.view(35, 24)
    return [
        base[:0],
        torch.empty((0, 5), dtype=dtype),
        base[5],  # 0-dim
        base[:1],
        m.t(),  # transposed
        m[:, 1::3],  # strided
        m[::4].t()[2:],
        base[::7],
        base.view(5, 7, 24).permute(2, 0, 1)[::2],
        base[3:4].expand(50),  # stride 0
        base[: 1001 % base.numel()],
    ]


@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_shapes_and_strides(dtype: torch.dtype) -> None:
    for x in _shapes(dtype):
        check_exact(x)


def test_empty_and_0dim() -> None:
    rs = tensor_stats(torch.empty(0))
    assert rs.numel == 0 and math.isnan(rs.absmax) and math.isnan(rs.absmin) and int(rs.hist.sum()) == 0
    assert rs.underflow_cs == {"fp8_e4m3": 0, "fp8_e5m2": 0}
    rs = tensor_stats(torch.tensor(-3.0))
    assert rs.numel == 1 and rs.absmax == rs.absmin == 3.0
    assert observed(rs)["hist"] == {1: 1}


@pytest.mark.parametrize("chunk", [7, 64, 1000])
@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_chunked_equals_whole(dtype: torch.dtype, chunk: int) -> None:
    lo, hi = dtype_range(dtype)
    x = random_values(2501, 11, lo, hi, special=0.02).to(dtype).view(41, 61).t()
    whole = StatsBuffer(1, "cpu", chunk=0)
    whole.accumulate(x, 0)
    chunked = StatsBuffer(1, "cpu", chunk=chunk)
    chunked.accumulate(x, 0)
    assert np.array_equal(chunked.to_host(), whole.to_host())
    assert observed(decode(chunked.to_host()[0])) == reference(x)


@pytest.mark.parametrize("case", ["chunked", "two_calls"])
def test_absmin_after_all_zero_chunk(case: str) -> None:
    if case == "chunked":
        buf = StatsBuffer(1, "cpu", chunk=4)
        buf.accumulate(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5]), 0)
        expected = 1.5
    else:
        buf = StatsBuffer(1, "cpu")
        buf.accumulate(torch.zeros(3), 0)
        buf.accumulate(torch.tensor([2.0]), 0)
        expected = 2.0
    assert decode(buf.to_host()[0]).absmin == expected


# ------------------------------------------------------------------------------------------- absmax / absmin
def test_absmax_absmin_with_specials() -> None:
    x = torch.tensor([0.0, -3.0, math.nan, math.inf, -math.inf, 2.0**-149, -5.0, -0.0, 1.0])
    rs = tensor_stats(x)
    assert rs.absmax == 5.0 and rs.absmin == 2.0**-149
    rs = tensor_stats(torch.tensor([math.inf, -7.5, math.nan]))
    assert rs.absmax == rs.absmin == 7.5
    rs = tensor_stats(torch.tensor([float(torch.finfo(torch.float32).max), -math.inf]))
    assert rs.absmax == rs.absmin == float(torch.finfo(torch.float32).max)


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(10),
        -torch.zeros(3, 3),
        torch.full((7,), math.nan),
        torch.full((4,), -math.inf),
        torch.tensor([math.nan, math.inf, 0.0]),
    ],
    ids=["zeros", "neg_zeros", "nan", "neg_inf", "mixed"],
)
def test_absmax_absmin_no_finite_nonzero(x: torch.Tensor) -> None:
    rs = tensor_stats(x)
    # the largest finite |x| is 0 where zeros are among the values; where none is finite there is none: NaN
    assert (rs.absmax == 0.0) if bool(torch.isfinite(x).any()) else math.isnan(rs.absmax)
    assert math.isnan(rs.absmin)
    assert rs.underflow_cs == {"fp8_e4m3": 0, "fp8_e5m2": 0}
    assert observed(rs) == reference(x)


def _buffer_of(name: str, rows: int) -> StatsBuffer:
    """A buffer whose rows the engine ``name`` fills: "c", "torch-host", "torch-device" (the CUDA code path on
    the CPU) or "triton" (its interpreter), skipped where it cannot run here."""
    if name == "c":
        _kernel_or_skip()
        return StatsBuffer(rows, "cpu", engine="c")
    if name == "triton":
        pytest.importorskip("triton")
        if not stats.triton_engine.interpreting():
            pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it without CUDA)")
        return StatsBuffer(rows, "cpu", engine="triton")
    return StatsBuffer(rows, "cpu", engine="torch", host_rows=name == "torch-host")


@pytest.mark.parametrize("name", ["c", "torch-host", "torch-device", "triton"])
def test_absmax_is_nan_without_a_finite_value_over_every_call(name: str) -> None:
    """README: absmax is the largest finite |x|. A tensor of nan and inf alone has none, and its absmax read
    0.0 beside absmin NaN, as a tensor of zeros would (every gradient of a step a GradScaler skipped). It is NaN
    on every engine, in ``decode`` and ``decode_rows`` alike and at any loss scale; merged over calls (gradient
    accumulation, the merge of ranks' rows) a call without a finite value neither hides another call's largest
    nor makes one up, and zeros are a finite largest value of 0."""
    nan, inf = math.nan, math.inf
    calls = [
        [[nan] * 5],  # all nan
        [[inf, -inf, inf], [nan, -inf]],  # all inf, then nan and inf: no finite value in either call
        [[nan, nan], [3.0, -5.0, nan]],  # a call without a finite value, then one with
        [[-5.0, inf], [nan, -inf]],  # the other way round
        [[0.0, -0.0], [inf, nan]],  # zeros are finite: the largest is 0
    ]
    want = [nan, nan, 5.0, 5.0, 0.0]
    buf = _buffer_of(name, len(calls))
    for slot, parts in enumerate(calls):
        for values in parts:
            buf.accumulate(torch.tensor(values, dtype=torch.float16), slot)
    rows = buf.to_host()
    for scale in (1.0, 2.0**16):
        many = stats.decode_rows(rows, np.full(len(rows), scale))["absmax"]
        for slot, expected in enumerate(want):
            got = decode(rows[slot], scale).absmax
            if math.isnan(expected):
                assert math.isnan(got) and math.isnan(many[slot]), (slot, got, many[slot])
            else:
                assert got == many[slot] == expected / scale, (slot, got, many[slot])
            assert math.isnan(decode(rows[slot], scale).absmin) == (slot not in (2, 3))
    # the merge of two rows (the reducer's, a flush's of the devices' rows): that of the calls on one row
    alone = StatsBuffer(2, "cpu")
    alone.accumulate(torch.tensor([nan, inf]), 0)
    alone.accumulate(torch.tensor([2.5, nan]), 1)
    a, b = alone.to_host()
    assert decode(stats.merge_rows(a, b)).absmax == decode(stats.merge_rows(b, a)).absmax == 2.5
    assert math.isnan(decode(stats.merge_rows(a, a)).absmax)


# ------------------------------------------------------------------------------------------- scale
@pytest.mark.parametrize("k", [0, 1, 3, 10, 16, 24, -5])
def test_scale_shifts_histogram(k: int) -> None:
    lo = -121.0 + max(0, -k) if k < 0 else -120.0
    g = random_values(3000, 5, lo, 100.0).float()
    g = torch.cat([g, torch.tensor([2.0**lo, -(2.0**-149) if k >= 0 else 2.0**-120, 65504.0 / 2**k])])
    raw = g * 2.0**k
    torch.testing.assert_close(raw / 2.0**k, g, rtol=0, atol=0, equal_nan=True)  # exact: no lost bits
    rs = stats_of(raw, scale=2.0**k)
    obs = observed(rs)
    ref_raw = reference(raw)
    ref_g = reference(g)
    for key in (
        "numel",
        "zeros",
        "nan",
        "inf",
        *(f"underflow_{f}" for f in WHATIF),
        *(f"overflow_{f}" for f in WHATIF),
    ):
        assert obs[key] == ref_raw[key], key  # counts of the scaled values, as the cast sees them
    assert obs["hist"] == ref_g["hist"]  # histogram of the unscaled values
    assert np.array_equal(rs.exponents, EXPONENTS - k)
    assert obs["absmax"] == ref_g["absmax"] and obs["absmin"] == ref_g["absmin"]
    # current scaling does not depend on a power-of-two scale
    assert obs["cs_fp8_e4m3"] == ref_g["cs_fp8_e4m3"] and obs["cs_fp8_e5m2"] == ref_g["cs_fp8_e5m2"]


def test_scale_fp16_underflow_of_scaled_gradient() -> None:
    """g * 2^k underflows fp16 iff |g| <= 2^(-25-k) (the tie included)."""
    g = torch.tensor([2.0**-34, 2.0**-33, 1.5 * 2.0**-34, 2.0**-30, 2.0**-20])
    for k, expected in ((0, 4), (5, 4), (8, 3), (9, 1), (10, 0)):
        rs = tensor_stats(g * 2.0**k, scale=2.0**k)
        assert rs.underflow["fp16"] == expected == int(((g * 2.0**k).to(torch.float16) == 0).sum()), k


# ------------------------------------------------------------------------------------------- current scaling
@pytest.mark.parametrize(
    "values",
    [
        [448.0, 2.0**-10, -(2.0**-10), 1.5 * 2.0**-10, 2.0**-9, 2.0**-11],  # k = 0, ties at 2^-10
        [200.0, 2.0**-11, 2.0**-12, 1.25 * 2.0**-11, -(2.0**-11)],  # k = 1: 2^-11 lands on the tie
        [57344.0 / 4, 2.0**-19, 1.5 * 2.0**-19, 2.0**-20],  # e5m2 k = 2: 2^-19 lands on its tie
        [1e6, 2.0**-3, 2.0**-2, 1e-5, 3.0],  # amax above both maxima: k < 0
        [1e-3, 2.0**-20, 2.0**-30, 2.0**-149, 1e-9, math.inf, math.nan, 0.0],  # small amax, specials
        [2.0**-149],  # a single subnormal: scaled up to the top of the format
    ],
)
def test_current_scaling_ties(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    assert observed(tensor_stats(x)) == reference(x)


def test_current_scaling_tie_counts() -> None:
    """The first case above, counted by hand: s = 1, so 2^-10 and -2^-10 and 2^-11 vanish in e4m3."""
    x = torch.tensor([448.0, 2.0**-10, -(2.0**-10), 1.5 * 2.0**-10, 2.0**-9, 2.0**-11])
    rs = tensor_stats(x)
    assert rs.underflow_cs["fp8_e4m3"] == 3 == int((x.to(torch.float8_e4m3fn).float() == 0).sum())
    # e5m2: s = 2^7 (57344 / 448 = 128): everything is >= 2^-18 after scaling
    assert rs.underflow_cs["fp8_e5m2"] == int(((x * 128).to(torch.float8_e5m2).float() == 0).sum()) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_current_scaling_random(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    span = float(torch.randint(4, 40, (1,), generator=g))
    top = float(torch.randint(-100, 100, (1,), generator=g))
    x = random_values(2000, seed, top - span, top, special=0.05).float()
    assert observed(tensor_stats(x)) == reference(x)


def test_current_scaling_fp64_amax_near_power_of_two() -> None:
    x = torch.tensor([math.nextafter(0.4375, math.inf), 1.5 * 2.0**-20], dtype=torch.float64)
    assert tensor_stats(x).underflow_cs["fp8_e4m3"] == reference(x)["cs_fp8_e4m3"] == 1


@pytest.mark.parametrize("top", [1.0, 1e-11, 1e-13, 1e-23])
def test_current_scaling_counts_what_torchaos_cast_flushes(top: float) -> None:
    """The counts are what torchao's own tensorwise cast (power-of-two scale) flushes, a tensor whose largest
    value is under torchao's amax floor of 1e-12 included: its scale stops growing there, and gradients of
    1e-23 flush entirely in e5m2, where a scale of fmax / amax would keep them all."""
    utils = pytest.importorskip("torchao.float8.float8_scaling_utils")
    mm = pytest.importorskip("torchao.float8.float8_training_tensor")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * top).float()
    rs = tensor_stats(x)
    for name in formats.FP8_FORMATS:
        f8 = utils.hp_tensor_to_float8_dynamic(
            x, formats.get(name).torch_dtype, mm.LinearMMConfig(), round_scales_to_power_of_2=True
        )
        flushed = int(((f8._data.float() == 0) & (x != 0)).sum())
        assert rs.underflow_cs[name] == flushed, name
    if top == 1e-23:
        assert rs.underflow_cs["fp8_e5m2"] == int((x != 0).sum())


# ------------------------------------------------------------------------------------------- the buffer
def _row(x: torch.Tensor) -> np.ndarray:
    buf = StatsBuffer(1, "cpu")
    buf.accumulate(x, 0)
    return buf.to_host()[0]


def test_accumulate_twice_is_sum() -> None:
    a = random_values(500, 21).float()
    b = random_values(300, 22, -30.0, 30.0).to(torch.bfloat16)
    buf = StatsBuffer(2, "cpu")
    buf.accumulate(a, 1)
    buf.accumulate(b, 1)
    both = _row(torch.cat([a.double(), b.double()]))
    # every column is the row of the concatenation except fp8 current scaling, where each call is one
    # tensor with its own amax and scale: that column is the sum of the calls
    cs = slice(COL_UNDERFLOW_CS, COL_UNDERFLOW_CS + 2)
    got = buf.to_host()[1]
    assert np.array_equal(np.delete(got, range(cs.start, cs.stop)), np.delete(both, range(cs.start, cs.stop)))
    assert np.array_equal(got[cs], _row(a)[cs] + _row(b)[cs])
    ra, rb, r = decode(_row(a)), decode(_row(b)), decode(buf.to_host()[1])
    assert r.numel == ra.numel + rb.numel and np.array_equal(r.hist, ra.hist + rb.hist)
    for name in WHATIF:
        assert r.underflow[name] == ra.underflow[name] + rb.underflow[name]
        assert r.overflow[name] == ra.overflow[name] + rb.overflow[name]
    assert r.absmax == max(ra.absmax, rb.absmax) and r.absmin == min(ra.absmin, rb.absmin)
    expected = reference(torch.cat([a.double(), b.double()]))
    for name in formats.FP8_FORMATS:
        expected[f"cs_{name}"] = reference(a.double())[f"cs_{name}"] + reference(b.double())[f"cs_{name}"]
    assert observed(r) == expected


@pytest.mark.parametrize("device_rows", [False, True], ids=["host rows", "device rows"])
def test_assign_replaces_and_rows_are_independent(device_rows: bool) -> None:
    """An assign replaces what a row holds (the device rows clear a row only when it was written since the last
    reset of all rows: a first assign after it has nothing to clear)."""
    a = random_values(400, 31).float()
    b = random_values(200, 32).float()
    kw: dict[str, Any] = {"engine": "torch", "host_rows": False} if device_rows else {}
    fresh = StatsBuffer(3, "cpu", **kw).to_host()
    buf = StatsBuffer(3, "cpu", **kw)
    buf.accumulate(a, 0)
    buf.accumulate(a, 2)
    buf.accumulate(b, 2, assign=True)
    host = buf.to_host()
    assert np.array_equal(host[0], _row(a))
    assert np.array_equal(host[1], fresh[1])
    assert np.array_equal(host[2], _row(b))
    buf.accumulate(torch.empty(0), 0, assign=True)
    assert np.array_equal(buf.to_host()[0], fresh[0])
    buf.reset()
    buf.accumulate(b, 1, assign=True)  # nothing written since the reset
    buf.accumulate(a, 1, assign=True)  # written: cleared first
    host = buf.to_host()
    assert np.array_equal(host[1], _row(a)) and np.array_equal(host[0], fresh[0])


def test_reset() -> None:
    buf = StatsBuffer(3, "cpu")
    for i in range(3):
        buf.accumulate(random_values(100, 40 + i).float(), i)
    buf.reset(slice(1, 2))
    fresh = StatsBuffer(3, "cpu").to_host()
    host = buf.to_host()
    assert np.array_equal(host[1], fresh[1]) and not np.array_equal(host[0], fresh[0])
    buf.reset()
    assert np.array_equal(buf.to_host(), fresh)
    rs = decode(fresh[0])
    assert rs.numel == 0 and math.isnan(rs.absmax) and math.isnan(rs.absmin)
    assert int(rs.hist.sum()) == 0 and rs.underflow_cs == {"fp8_e4m3": 0, "fp8_e5m2": 0}
    # the buffer is reusable after a reset
    x = random_values(100, 50).float()
    buf.accumulate(x, 0)
    assert observed(decode(buf.to_host()[0])) == reference(x)


@pytest.mark.parametrize("host_rows", [None, False])
def test_a_snapshot_restores_the_rows_as_they_were(host_rows: bool | None) -> None:
    """``snapshot``/``restore`` (a sampled step's attempt that raised goes back to what was read before it):
    after more adds, an assign, a window grown to far bins, block statistics and a skipped tensor, the rows, the
    block accumulator and the skip counts are those of a buffer that only took what came before the snapshot, on
    the host rows and on the device code path; and a second restore from the same snapshot gives them again."""
    a = random_values(500, 71, -5.0, 5.0).float().reshape(20, 25)
    far = torch.cat([random_values(300, 72, 60.0, 100.0), random_values(300, 73, -120.0, -90.0)])
    bufs = [StatsBuffer(3, "cpu", host_rows=host_rows) for _ in range(2)]
    for buf in bufs:
        buf.accumulate(a, 0)
        buf.accumulate(a[:10], 1, blocks=True)
        buf.skip(2, "a tensor of the test's")
    buf, fresh = bufs
    held = buf.snapshot()
    for _ in range(2):
        buf.accumulate(far.float(), 0)
        buf.accumulate(far.double().reshape(30, 20), 1, assign=True, blocks=True)
        buf.accumulate(a, 2, blocks=True)
        buf.accumulate(torch.zeros(3, dtype=torch.complex64), 2)
        buf.restore(held)
        assert np.array_equal(buf.to_host(), fresh.to_host())
        assert np.array_equal(buf.blocks_to_host(), fresh.blocks_to_host())
        assert buf.skipped.tolist() == buf.skipped_total.tolist() == [0, 0, 1]
        assert buf.blocks_seen.tolist() == fresh.blocks_seen.tolist() == [False, True, False]
    buf.accumulate(a, 2)  # the rows take more as before
    fresh.accumulate(a, 2)
    assert np.array_equal(buf.to_host(), fresh.to_host())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_requires_grad_untouched(dtype: torch.dtype) -> None:
    w = random_values(300, 60, -20.0, 10.0).to(dtype).requires_grad_(True)
    y = w * 3  # a non-leaf in a graph
    bits_w = w.detach().clone().view(torch.int16)
    bits_y = y.detach().clone().view(torch.int16)
    buf = StatsBuffer(2, "cpu", chunk=64)
    buf.accumulate(w, 0)
    buf.accumulate(y, 1)
    assert torch.equal(w.detach().view(torch.int16), bits_w) and torch.equal(
        y.detach().view(torch.int16), bits_y
    )
    assert w.requires_grad and w.grad is None and w.is_leaf and y.grad_fn is not None
    assert not buf.data.requires_grad
    assert observed(decode(buf.to_host()[0])) == reference(w.detach())
    y.sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 3))


def test_tensor_stats_is_decode_of_one_row() -> None:
    x = random_values(100, 70).float()
    assert observed(tensor_stats(x, scale=4.0)) == observed(decode(_row(x), 4.0))


def test_a_scale_that_is_no_power_of_two_shifts_the_bins_by_its_nearest_one_as_documented() -> None:
    """Gradients arriving at a loss scale of 1000 (not a power of two): the bins are shifted by round(log2 1000)
    = 10, so a value just above a power of two lands a bin low (1000 * 2^-20 -> -21, not -20), a bin off at most;
    at a power of two the shift is exact. The README's ``histograms`` table and docs/design.md say so, and
    name ``capture.histogram_shift_exact`` (t7 found them saying "floor(log2|x|) of the unscaled value" alone)."""
    scaled = torch.tensor([1000.0, 1000.0 * 2**-20, 999.0, 1001.0, 3000.0])
    rs = decode(_row(scaled), 1000.0)
    got = Counter({int(e): int(c) for e, c in zip(rs.exponents, rs.hist, strict=True) if c})
    true = Counter(math.floor(math.log2(v / 1000.0)) for v in scaled.double().tolist())
    assert got == Counter({-21: 1, -1: 3, 1: 1}) and true == Counter({-20: 1, -1: 1, 0: 2, 1: 1})
    assert sorted(got.elements()) == sorted(  # each value a bin off at most: floor(log2 x) - 10
        math.floor(math.log2(v)) - 10 for v in scaled.double().tolist()
    )
    assert all(abs(a - b) <= 1 for a, b in zip(sorted(got.elements()), sorted(true.elements()), strict=True))
    rs = decode(_row(scaled / 1000 * 1024), 1024.0)  # a power of two: exact
    assert Counter({int(e): int(c) for e, c in zip(rs.exponents, rs.hist, strict=True) if c}) == Counter(
        math.floor(math.log2(v / 1000.0)) for v in scaled.double().tolist()
    )
    root = Path(__file__).resolve().parents[1]
    readme = " ".join((root / "README.md").read_text().split())
    table = readme[readme.index("`histograms`: `step, module") :][:1000]
    design = " ".join((root / "docs" / "design.md").read_text().split())
    bins = design[design.index("Exponent histogram bin of x") :][:600]
    for doc in (table, bins):
        assert "not a power of two" in doc and "histogram_shift_exact" in doc, doc


def test_is_power_of_two() -> None:
    assert all(stats.is_power_of_two(2.0**k) for k in range(-1074, 1024))
    for v in (0.0, -2.0, 3.0, math.inf, math.nan, 2.0**-1074 * 3, 65504.0):
        assert not stats.is_power_of_two(v)


# ------------------------------------------------------------------------------------------- property
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), max_size=40),
    st.sampled_from(list(INPUT_DTYPES.values())),
    st.integers(0, 5),
)
def test_property_random_lists(values: list[float], dtype: torch.dtype, chunk: int) -> None:
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    ref = reference(x)
    obs = observed(stats_of(x, chunk=chunk))
    assert obs == ref


# ------------------------------------------------------------------------- the device path, run on the CPU
@pytest.mark.parametrize("chunk", [0, 7, 1000])
def test_device_path_equals_host_path(chunk: int) -> None:
    """The CUDA code path (dense device rows, index_add_, on-device current scaling) gives the same rows as
    the CPU path; run here on the CPU so that it is checked without a GPU."""
    xs = [
        random_values(3000, 41).float(),
        random_values(2000, 42, -30.0, 30.0).to(torch.bfloat16),
        torch.tensor([0.0, -0.0, math.inf, math.nan, 2.0**-25, 2.0**-10, 464.0, 465.0, 65520.0, 2.0**-149]),
        torch.zeros(5),
        random_values(500, 43, -20.0, 10.0).to(torch.float16),
    ]
    host = StatsBuffer(3, "cpu", chunk=chunk)
    dev = StatsBuffer(3, "cpu", chunk=chunk, host_rows=False)
    for i, x in enumerate(xs):
        for buf in (host, dev):
            buf.accumulate(x, i % 3)
            buf.accumulate(x[: len(x) // 2], 2, assign=i == 3)
    assert np.array_equal(host.to_host(), dev.to_host())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_compiled_cpu_kernel_equals_torch_ops(dtype: torch.dtype) -> None:
    """The one-pass C kernel (when a compiler is there) and the torch-op path give identical rows."""
    _kernel_or_skip()
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
            2.0**-25,
            2.0**-24,
            2.0**-10,
            464.0,
            465.0,
            61440.0,
            65520.0,
        ]
    )
    xs = [
        random_values(5000, 51).to(dtype),
        torch.cat([specials, random_values(300, 52, -30.0, 30.0)]).to(dtype),
        torch.zeros(7, dtype=dtype),
        random_values(4000, 53).to(dtype).reshape(40, 100).t(),  # transposed (reshaped into a copy)
        random_values(4000, 54).to(dtype)[::3],  # a strided 1-D view, read in place
        torch.full((3,), math.nan, dtype=dtype),
    ]
    kernel = StatsBuffer(2, "cpu")
    ops = StatsBuffer(2, "cpu", chunk=1000)
    ops.use_kernel = False
    for i, x in enumerate(xs):
        for buf in (kernel, ops):
            buf.accumulate(x, i % 2)
    assert np.array_equal(kernel.to_host(), ops.to_host())


def _kernel_or_skip() -> None:
    """Skip without the compiled kernel, except in CI (CI or PRECPROF_REQUIRE_KERNEL=1 set), where a missing
    kernel is a failure: the suite must never pass without having tested it."""
    from precprof.stats import kernel as _cpu_kernel

    if _cpu_kernel.load() is None:
        why = f"the C kernel is not available: {_cpu_kernel.status()['reason']}"
        if kernel_required():
            pytest.fail(why + " (required here: CI or PRECPROF_REQUIRE_KERNEL=1)")
        pytest.skip(why + ": only the torch-op path runs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_compiled_cpu_kernel_large_tensors(dtype: torch.dtype, threads: int) -> None:
    """Tensors big enough for the kernel's thread split (2^18 values and up) and many 2048-value blocks:
    ordinary blocks take its fast exponent-only path, and single rare values (a subnormal, an exact power of
    two, inf, nan, a value above 256, an overflow tie) placed in otherwise ordinary blocks, at block and
    thread boundaries, must switch exactly those blocks to the exact path. Rows equal the torch-op path's."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(61)
    n = (1 << 19) + 777
    base = (torch.randn(n, generator=g, dtype=torch.float64) * 0.05).to(dtype)
    rare = [2.0**-140 if dtype == torch.float32 else 2.0**-20, 2.0**-3, math.inf, -math.nan, 300.0, 65520.0]
    x = base.clone()
    for i, pos in enumerate([0, 2047, 2048, n // 2, n // 2 + 1, n - 1]):
        x[pos] = rare[i]
    zeros = base.clone()
    zeros[::5] = 0.0
    for t in (base, x, zeros, torch.zeros(n, dtype=dtype)):
        kernel = StatsBuffer(1, "cpu")
        kernel.kernel_threads = threads
        ops = StatsBuffer(1, "cpu", chunk=1 << 16)
        ops.use_kernel = False
        kernel.accumulate(t, 0)
        ops.accumulate(t, 0)
        assert np.array_equal(kernel.to_host(), ops.to_host())


def test_same_tensor_twice_is_read_once_and_counted_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor accumulated again right away (a module returning its submodule's output) is merged from the
    kernel's last call: the rows equal reading it twice, and an in-place change in between is seen."""
    _kernel_or_skip()
    lib = engine._kernel()
    reads: list[int] = []
    real_add = lib.pp_add_at

    def counting_add(ctx: int) -> int:
        # pp_add_at's arguments sit in the context: data, n, stride, dtype, row, flags from index 9
        args = (ctypes.c_int64 * 15).from_address(ctx)
        if not args[14] & 2:  # flag 2: merged from the last call, not read
            reads.append(int(args[10]))
        return int(real_add(ctx))

    monkeypatch.setattr(lib, "pp_add_at", counting_add)
    x = random_values(3000, 71).float()
    fresh = StatsBuffer(4, "cpu")
    fresh.use_kernel = False
    buf = StatsBuffer(4, "cpu")
    for b in (buf, fresh):
        b.accumulate(x, 0)
        b.accumulate(x, 1)
    buf.accumulate(x, 2)
    assert reads == [3000]  # read once for three rows
    fresh.accumulate(x, 2)
    x.mul_(3.0)  # bumps x._version: must be read again
    for b in (buf, fresh):
        b.accumulate(x, 3)
    assert np.array_equal(buf.to_host(), fresh.to_host())
    with torch.inference_mode():  # no version counter: always read
        y = x * 2
    buf.accumulate(y, 0)
    fresh.accumulate(y, 0)
    buf.accumulate(y, 0)
    fresh.accumulate(y, 0)
    assert np.array_equal(buf.to_host(), fresh.to_host())
    assert reads == [3000, 3000, 3000, 3000]


def test_decode_rows_equals_decode_row_by_row() -> None:
    """The vectorised decoder (used on every sampled step) gives decode()'s numbers for every row and scale,
    including empty rows, rows without finite nonzero values, and non-power-of-two or zero scales."""
    buf = StatsBuffer(6, "cpu")
    buf.accumulate(random_values(4000, 81).float(), 0)
    buf.accumulate(random_values(3000, 82, -30.0, 30.0).to(torch.bfloat16), 1)
    buf.accumulate(torch.tensor([0.0, math.inf, math.nan]), 2)
    buf.accumulate(random_values(500, 83, -20.0, 10.0).to(torch.float16), 4)
    buf.accumulate(random_values(500, 84).double(), 5)
    rows = buf.to_host()
    scales = np.array([1.0, 2.0**16, 0.5, 1000.0, 0.0, 2.0**-3])
    got = stats.decode_rows(rows, scales)
    for i, row in enumerate(rows):
        ref = decode(row, float(scales[i]))
        assert (got["numel"][i], got["zeros"][i], got["nan"][i], got["inf"][i]) == (
            ref.numel,
            ref.zeros,
            ref.nan,
            ref.inf,
        )
        for key in ("absmax", "absmin"):
            a, b = float(got[key][i]), getattr(ref, key)
            assert a == b or (math.isnan(a) and math.isnan(b))
        for f in WHATIF:
            assert got["underflow"][f][i] == ref.underflow[f]
            assert got["overflow"][f][i] == ref.overflow[f]
        for f in formats.FP8_FORMATS:
            assert got["underflow_cs"][f][i] == ref.underflow_cs[f]
        assert np.array_equal(got["hist"][i], ref.hist)
        assert np.array_equal(stats.EXP_MIN + np.arange(stats.N_BINS) - got["shift"][i], ref.exponents)
    # the per-row columns outlive the rows (kept per sampled step): none may be a view of them
    columns = [v for k, v in got.items() if isinstance(v, np.ndarray) and k != "hist"]
    columns += [v for k in ("underflow", "overflow", "underflow_cs") for v in got[k].values()]
    assert columns and not any(np.shares_memory(v, rows) for v in columns)


def test_kernel_threads_run_in_torchs_openmp_pool() -> None:
    """Where torch ships libgomp.so.1 (the PyPI CPU wheels), the kernel's OpenMP regions use torch's own pool:
    one OpenMP runtime is mapped into the process, and it is torch's, so the kernel defaults to torch's
    thread count instead of starting threads that compete with torch's spinning workers."""
    import os

    from precprof.stats import kernel as _cpu_kernel

    _kernel_or_skip()
    torch_gomp = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    lib = engine._kernel()
    if not os.path.exists(torch_gomp) or not lib.pp_openmp():
        pytest.skip("torch does not ship libgomp.so.1 here, or the kernel was built without OpenMP")
    runtimes = _cpu_kernel.openmp_runtimes()
    assert [os.path.realpath(r) for r in runtimes] == [os.path.realpath(torch_gomp)]
    assert _cpu_kernel.shares_torch_threads(lib)
    if os.environ.get("PRECPROF_CPU_KERNEL_THREADS") is None:
        old = torch.get_num_threads()  # (1 in the tests: conftest)
        torch.set_num_threads(3)
        try:
            assert StatsBuffer(1, "cpu")._threads() == torch.get_num_threads() == 3
        finally:
            torch.set_num_threads(old)
