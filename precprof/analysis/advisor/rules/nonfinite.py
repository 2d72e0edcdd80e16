"""The first module and step with nan/inf, in the forward and in the backward pass, and whether the
loss scaler skipped those steps.
"""

from __future__ import annotations

import math

import pandas as pd

from precprof import tables as T
from precprof.analysis.advisor.evidence import _innermost, _Plan, _Run
from precprof.analysis.advisor.model import CRITICAL, Finding, Number
from precprof.analysis.advisor.text import _log2i, _name, _pow2


def _rule_nonfinite(run: _Run, plan: _Plan) -> set[int]:
    """First module and step with nan/inf, forward and backward. Returns the steps with forward nan/inf."""
    bad = run.layers[(run.layers[T.NAN] + run.layers[T.INF]) > 0]
    fwd = bad[bad[T.TENSOR].isin((T.ACTIVATION, T.WEIGHT))]
    fwd_steps = {int(s) for s in fwd[T.STEP].unique()}
    if not fwd.empty:
        step = int(fwd[T.STEP].min())
        at = fwd[fwd[T.STEP] == step]
        origins = run.sort(_innermost(at[T.MODULE]))
        first = origins[0]
        row = at[at[T.MODULE] == first]
        nan, inf = int(row[T.NAN].sum()), int(row[T.INF].sum())
        kinds = sorted(set(row[T.TENSOR]))
        plan.add(
            Finding(
                "nonfinite_forward",
                CRITICAL,
                f"nan/inf first appears in the forward pass of {_name(first)}",
                f"At step {step}, the {'/'.join(kinds)} of {_name(first)} "
                f"({run.types.get(first, '?')}) holds {nan} nan and {inf} inf values; it is the first "
                f"module in forward order to do so ({len(fwd_steps)} sampled step(s) affected, "
                f"{at[T.MODULE].nunique()} module(s) at step {step}).",
                f"Inspect {_name(first)}'s inputs and weights at step {step}: a division, log or exp "
                "without a guard, or an fp16 overflow (keep it in fp32).",
                modules=[first],
                numbers={"step": step, "nan": nan, "inf": inf, "steps_affected": len(fwd_steps)},
            )
        )
    bwd = bad[bad[T.TENSOR].isin(T.GRADIENT_KINDS) & ~bad[T.STEP].isin(fwd_steps)]
    if bwd.empty:
        return fwd_steps
    streaks = _skip_streaks(run.steps)
    for step in sorted(int(s) for s in bwd[T.STEP].unique()):
        streak = next(((a, b) for a, b in streaks if a <= step <= b), None)
        if streak is not None and not _scaler_cannot_fix(run, streak):
            continue  # a scale too high: the scaler skipped the step and backed off, as it should
        at = bwd[bwd[T.STEP] == step]
        # Backward runs in reverse forward order: the first module to see a bad gradient is the last one.
        first = run.sort(_innermost(at[T.MODULE]))[-1]
        row = at[at[T.MODULE] == first]
        nan, inf = int(row[T.NAN].sum()), int(row[T.INF].sum())
        where = f"{_name(first)} ({run.types.get(first, '?')})"
        nums: dict[str, Number] = {"step": step, "nan": nan, "inf": inf}
        if streak is None:
            detail = (
                f"At step {step}, gradients of {where} hold {nan} nan and {inf} inf values while the forward "
                "pass was finite, and the optimizer step was not skipped for it."
            )
            remedy = (
                f"Check the loss and {_name(first)}'s backward at step {step} (e.g. sqrt or log near 0); "
                "with fp16 use a GradScaler so such steps are skipped."
            )
        else:
            a, b = streak
            scales = _scales(run.steps, a, b)
            nums.update({"skipped_from": a, "skipped_to": b, "skipped_steps": b - a + 1})
            first_seen = "" if step == a else f" (recorded first at sampled step {step})"
            detail = (
                f"From step {a}{first_seen}, gradients of {where} hold {nan} nan and {inf} inf values while the "
                f"forward pass was finite. GradScaler skipped every step from {a} to {b} ({b - a + 1} steps, "
                f"no weight update) and backed the scale off {scales}: an overflow would have been gone after "
                "a back-off or two, so the nan/inf comes from the backward computation, not from the scale."
            )
            remedy = (
                f"Check {_name(first)}'s backward from step {a} (sqrt or log near 0, a division by a small "
                "norm); a lower loss scale will not help."
            )
        plan.add(
            Finding(
                "nonfinite_backward",
                CRITICAL,
                f"nan/inf first appears in the backward pass at {_name(first)}",
                detail,
                remedy,
                modules=[first],
                numbers=nums,
            )
        )
        break
    return fwd_steps


def _skip_streaks(steps: pd.DataFrame) -> list[tuple[int, int]]:
    """Runs of consecutive skipped steps, as (first, last) step."""
    if steps.empty:
        return []
    skipped = sorted(int(s) for s in steps[steps[T.SKIPPED].fillna(False).astype(bool)][T.STEP])
    out: list[tuple[int, int]] = []
    for s in skipped:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _scale_at(steps: pd.DataFrame, step: int) -> float:
    rows = steps[steps[T.STEP] == step][T.LOSS_SCALE]
    return float(rows.iloc[0]) if len(rows) and pd.notna(rows.iloc[0]) else math.nan


def _scales(steps: pd.DataFrame, a: int, b: int) -> str:
    lo, hi = _scale_at(steps, b), _scale_at(steps, a)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi > 0):
        return "(scale not recorded)"
    return f"from {_pow2(_log2i(hi))} to {_pow2(_log2i(lo))}"


def _scaler_cannot_fix(run: _Run, streak: tuple[int, int]) -> bool:
    """Whether a run of skipped steps is more than a scale too high (see AdvisorConfig.nonfinite_*)."""
    a, b = streak
    steps = run.steps
    lowest = _scale_at(steps, b)
    ok_before = steps[(steps[T.STEP] < a) & ~steps[T.SKIPPED].fillna(False).astype(bool)]
    last_ok = float(ok_before[T.LOSS_SCALE].iloc[-1]) if len(ok_before) else math.nan
    finite = math.isfinite(last_ok) and math.isfinite(lowest) and lowest > 0 and last_ok > 0
    if finite and math.log2(last_ok / lowest) >= run.cfg.nonfinite_backoff_log2:
        return True
    last_step = int(steps[T.STEP].max()) if not steps.empty else b
    return b == last_step and b - a + 1 >= run.cfg.nonfinite_persist_steps
