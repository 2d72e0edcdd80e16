"""fp16's advice at the ends of the loss-scale range the advice allows (AdvisorConfig.min_loss_scale_log2 and
max_loss_scale_log2), on real tiny training runs (CPU, seconds each): a gradient that no allowed scale keeps in
fp16's range is said to be one, and what each sentence claims is checked by training at that scale."""

from __future__ import annotations

import math

import torch
from scenarios import weighted_loss

from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig

MARGIN = (
    65504 / 4
)  # the advice keeps the largest gradient times the loss scale below 65504 / 2^fp16_margin_log2


def _all(seen: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for g in seen])


def _fitting_log2(gmax: float) -> int:
    """The largest k with gmax * 2^k < 65504 / 4, by exact powers of two."""
    k = 0
    while math.ldexp(gmax, k) >= MARGIN:
        k -= 1
    while math.ldexp(gmax, k + 1) < MARGIN:
        k += 1
    return k


def test_gradients_too_large_for_every_allowed_scale_are_said_to_overflow_there() -> None:
    """A loss 2^40 times the usual: the largest gradient (4e11) needs a loss scale of 2^-25, and the advice goes
    down to 2^-16. It said "2^-16 is the largest power of two that keeps it below 65504 / 4 = 1.64e+04 (max|g| x
    2^-16 = 6.72e+06)" and "Start at the recommended loss scale 2^-16, which keeps the largest gradient below the
    limit", and the verdict was fp16 at 2^-16. It says now that no allowed scale keeps them in range and how many
    values overflow there; trained at 2^-16 every step overflows, at 2^-25 none does."""
    weight = 2.0**40
    run, seen = weighted_loss.run(weight)
    g = _all(seen)
    rec = run.recommend("t4")
    scale = rec.finding("fp16_loss_scale")
    assert scale is not None
    k, raw = scale.numbers["loss_scale_log2"], _fitting_log2(float(g.abs().max()))
    assert k == AdvisorConfig().min_loss_scale_log2 and scale.numbers["fitting_scale_log2"] == raw < k
    # at 2^k, whole binades at or above 2^16 surely overflow; a real cast turns at least those into inf
    sure = int((g.abs() >= 2.0 ** (16 - k)).sum())
    cast = int(torch.isinf((g * 2.0**k).float().half()).sum())
    assert scale.numbers["overflow_values"] == sure and 0 < sure <= cast
    assert (
        f"no loss scale the advice allows keeps it below 65504 / 4 = 1.64e+04: it needs 2^{raw}"
        in scale.message
    )
    assert f"at least {sure:,} gradient values overflow fp16 there" in scale.message
    overflow = rec.finding("fp16_gradient_overflow")
    assert overflow is not None and "keeps the largest gradient below the limit" not in overflow.remedy
    for f in (scale, overflow):
        assert (
            f.remedy.startswith("Use bf16 or fp32, or make the gradients smaller") and f"2^{raw}" in f.remedy
        )
    underflow = rec.finding("fp16_gradient_underflow")
    assert underflow is not None and "Nothing to fix" not in underflow.remedy
    assert rec.format == "fp32" and "no loss scale the advice allows keeps the gradients" in rec.reasons[0]

    # trained in fp16 at the clamped scale, every step overflows and the scaler skips it; at 2^raw none does
    at_k, _ = weighted_loss.run(weight, "fp16", loss_scale=2.0**k, static=True)
    assert at_k.tables["steps"][T.SKIPPED].all()
    at_raw, seen_raw = weighted_loss.run(weight, "fp16", loss_scale=2.0**raw, static=True)
    assert not at_raw.tables["steps"][T.SKIPPED].any() and bool(_all(seen_raw).isfinite().all())
    # bf16, the advice: no loss scale, no overflow, and it trains
    bf16, seen16 = weighted_loss.run(weight, "bf16")
    assert bool(_all(seen16).isfinite().all()) and bf16.losses[-1] < bf16.losses[0]


def test_gradients_that_fit_fp16_only_without_the_headroom_at_the_smallest_scale_are_said_to() -> None:
    """A loss 2^32 times the usual: the largest gradient needs 2^-17 to stay below 65504 / 4, and at 2^-16 it lies
    between that and 65504. It was "the largest power of two that keeps it below 1.64e+04" with a product above
    it; now it is within fp16's range without the headroom, and trained at 2^-16 no step overflows."""
    weight = 2.0**32
    run, seen = weighted_loss.run(weight)
    g = _all(seen)
    gmax = float(g.abs().max())
    rec = run.recommend("t4")
    scale = rec.finding("fp16_loss_scale")
    assert scale is not None
    k, raw = scale.numbers["loss_scale_log2"], _fitting_log2(gmax)
    assert raw < k == -16 and MARGIN <= math.ldexp(gmax, k) < 65504
    assert "largest power of two" not in scale.message
    assert scale.message.endswith(
        f"max|g| x 2^-16 = {math.ldexp(gmax, k):.3g}: within fp16's 65504, without the headroom."
    )
    overflow = rec.finding("fp16_gradient_overflow")
    assert overflow is not None
    assert overflow.remedy.endswith(
        "below fp16's 65504 but not below the headroom the advice keeps (fp16_loss_scale)."
    )
    assert rec.format == "fp16" and rec.loss_scale == 2.0**k
    at_k, seen_k = weighted_loss.run(weight, "fp16", loss_scale=2.0**k, static=True)
    assert not at_k.tables["steps"][T.SKIPPED].any() and bool(_all(seen_k).isfinite().all())
