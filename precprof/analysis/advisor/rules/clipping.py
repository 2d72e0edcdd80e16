"""Gradient clipping on still-scaled gradients: the norm handed to ``prof.step`` is the loss scale times the
norm of the gradients."""

from __future__ import annotations

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof.analysis.advisor.evidence import _Plan, _rows_of_kinds, _Run
from precprof.analysis.advisor.model import WARNING, Finding
from precprof.analysis.advisor.text import _loss_scale_said, _pct


def _rule_scaled_clipping(run: _Run, plan: _Plan) -> None:
    """The recorded gradient norm against the norm of the recorded (unscaled) weight gradients.

    The histogram bounds the norm of a step's weight gradients: each value lies in [2^e, 2^(e+1)), so the norm
    is within [est, 2 est) of est = sqrt(sum count * 4^e). A norm computed after ``scaler.unscale_`` lies in
    that range; one computed before it is the loss scale times larger. A step counts as scaled when the ratio
    exceeds sqrt(2 * scale), the geometric midpoint of the two cases, and the scale is at least 16.
    """
    steps = run.steps
    if T.GRAD_NORM not in steps or T.LOSS_SCALE not in steps or run.hist.empty:
        return
    s = steps[[T.STEP, T.GRAD_NORM, T.LOSS_SCALE]].dropna()
    s = s[(s[T.LOSS_SCALE] >= 16) & (s[T.GRAD_NORM] > 0) & np.isfinite(s[T.GRAD_NORM])]
    if s.empty:
        return
    wg = _rows_of_kinds(run.hist[T.TENSOR], (T.WEIGHT_GRAD,))  # the columns read, not a copy of the rows
    if not wg.any():
        return
    hist = run.hist
    energy = hist[T.COUNT].to_numpy(dtype=float)[wg] * 4.0 ** hist[T.EXPONENT].to_numpy(dtype=float)[wg]
    # the lower edge of each step's norm
    est = pd.Series(energy).groupby(hist[T.STEP].to_numpy()[wg]).sum().pow(0.5).rename("_est")
    joined = s.join(est, on=T.STEP).dropna()
    joined = joined[joined["_est"] > 0]
    if joined.empty:
        return
    ratio = joined[T.GRAD_NORM] / joined["_est"]
    scaled = ratio > np.sqrt(2.0 * joined[T.LOSS_SCALE])
    share = float(scaled.mean())
    if share <= 0.5:
        return
    # a scale the run had (the upper middle one: a median of two averaged them into one it never had)
    scales = sorted(joined[T.LOSS_SCALE].astype(float))
    scale = scales[len(scales) // 2]
    plan.add(
        Finding(
            "grad_norm_scaled",
            WARNING,
            "Gradient norm measured on still-scaled gradients",
            f"On {int(scaled.sum())} of {len(joined)} sampled steps ({_pct(share)}) the gradient norm handed to "
            f"precprof is about the loss scale times the norm of the weight gradients (median ratio "
            f"{float(ratio.median()):.3g}, loss scale {_loss_scale_said(scale)}): it was computed "
            "before scaler.unscale_. Clipping at that norm (clip_grad_norm_ on scaled gradients) clips by a "
            "threshold the loss scale makes meaningless, and it changes whenever the scale does.",
            "Call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_, and pass prof.step the norm "
            "that call returns.",
            numbers={
                "steps": len(joined),
                "scaled_steps": int(scaled.sum()),
                "median_ratio": float(ratio.median()),
                "loss_scale": scale,
            },
        )
    )
