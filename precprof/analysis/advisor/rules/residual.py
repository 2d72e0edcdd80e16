"""The residual stream of an fp16 run, read at the norms' inputs (``capture.plan.reads_norm_input``,
``_Run.norm_inputs``): in a pre-norm transformer each norm's input is ``x + f(x)``, a sum no module returns, so no
module's row holds it, and fp16_activation_overflow / _near_overflow, which read modules' outputs, never see it.

- fp16_residual_overflow (critical): on a sampled step a norm's fp16 input held inf while no module before it in
  the forward output one (a mask's inf aside): a sum of finite fp16 values went beyond 65504 there.
- fp16_residual_near_overflow (warning): a norm's fp16 input reached |x| >= 65504 / 2 (``fp16_activation_headroom_
  log2``) without overflowing on the sampled steps: the steps in between may.

Only inputs that were fp16 in the run count: under fp16 autocast with fp32 weights the embedding's output is fp32,
and ``x + f(x)`` of an fp32 ``x`` and an fp16 ``f(x)`` is fp32, so the stream is never fp16 there (the remedy)."""

from __future__ import annotations

import pandas as pd

from precprof import tables as T
from precprof.analysis.advisor.evidence import (
    _ancestors,
    _dtype_has,
    _mask_rows,
    _norm_inputs_from,
    _Plan,
    _Run,
)
from precprof.analysis.advisor.model import CRITICAL, WARNING, Finding
from precprof.analysis.advisor.text import _g, _listing, _name
from precprof.formats import FP16

_REMEDY = (
    "Keep the residual stream in fp32: train under torch.autocast(dtype=torch.float16) with fp32 weights, where the "
    "embedding's output is fp32 and x + f(x) of an fp32 x and an fp16 f(x) is fp32, so the sums are never rounded to "
    "fp16 (autocast runs the matmuls in fp16); or train in bf16, whose range is fp32's. With fp16 weights (a "
    "half() model, adapters on an fp16 base), run the forward under that autocast and upcast the embedding's output "
    "(h = h.float()): autocast casts each matmul's input to fp16, and the sums stay fp32."
)


def _rule_fp16_residual(run: _Run, plan: _Plan) -> None:
    rows = run.norm_inputs
    if rows.empty:
        return
    # (a norm fed a module's output, as it made it: that module's row holds the values, which the fp16 activation
    # rules read)
    made = set(_norm_inputs_from(run))
    fed = T.texts(rows[T.MODULE]).str.removesuffix(T.INPUT_SUFFIX).isin(made)
    rows = rows[_dtype_has(rows, "float16").to_numpy() & ~fed.to_numpy()]
    if rows.empty:
        return
    names = T.texts(rows[T.MODULE])
    stems = names.str.removesuffix(T.INPUT_SUFFIX)
    overflowed = _overflowed(run, rows)
    if overflowed:
        _overflow_finding(run, plan, rows, names, overflowed)
    limit = FP16.max / 2.0**run.cfg.fp16_activation_headroom_log2
    per = rows.groupby(stems.to_numpy()).agg(absmax=(T.ABSMAX, "max"), inf=(T.INF, "sum"))
    near = run.sort(str(m) for m in per.index[(per["absmax"] >= limit) & (per["inf"] == 0)])
    if not near:
        return
    top = float(per.loc[near, "absmax"].max())
    listed = near[: run.cfg.max_listed_modules]
    plan.add(
        Finding(
            "fp16_residual_near_overflow",
            WARNING,
            f"The residual stream comes within {2**run.cfg.fp16_activation_headroom_log2}x of fp16's limit: up to "
            f"{_g(top)}",
            f"The fp16 inputs of {_listing([_name(m) for m in near], run.cfg.max_listed_modules)} (the tensors those "
            "norms received: in a pre-norm model the residual stream, a sum no module returns, which no module's "
            f"row holds) reach |x| >= {_g(limit)} (65504 / {2**run.cfg.fp16_activation_headroom_log2}): "
            + "; ".join(f"{_name(m)}: {_g(per.loc[m, 'absmax'])}" for m in listed)
            + ". A sum of finite fp16 values beyond 65504 is inf, and a norm that reads inf returns nan. Steps that "
            "were not sampled may overflow.",
            _REMEDY,
            modules=near,
            numbers={"modules": len(near), "absmax": top, "limit": limit},
        )
    )


def _overflowed(run: _Run, rows: pd.DataFrame) -> dict[str, list[int]]:
    """The norms whose fp16 input held inf on a step where no module before it in the forward (by its first call's
    order; the norm's own enclosing modules, which finish after it, aside) output an fp16 inf that was not a mask:
    each with those steps, in forward order."""
    held = rows[(rows[T.INF] > 0).to_numpy()]
    if held.empty:
        return {}
    acts = run.kind(T.ACTIVATION)
    bad = acts[(acts[T.INF] > 0).to_numpy() & _dtype_has(acts, "float16").to_numpy()]
    bad = bad[~_mask_rows(run, bad).to_numpy()] if not bad.empty else bad
    found: dict[str, list[int]] = {}
    for step, at in held.groupby(T.STEP, sort=True):
        row = at.sort_values(T.ORDER, kind="stable").iloc[
            0
        ]  # the first norm on the step: a later one's is its own
        norm, order = str(row[T.MODULE]).removesuffix(T.INPUT_SUFFIX), int(row[T.ORDER])
        before = bad[(bad[T.STEP] == step).to_numpy() & (bad[T.ORDER] < order).to_numpy()]
        if T.texts(before[T.MODULE]).isin(set(_ancestors(norm))).all():
            found.setdefault(norm, []).append(int(step))
    return {m: found[m] for m in run.sort(found)}


def _overflow_finding(
    run: _Run, plan: _Plan, rows: pd.DataFrame, names: pd.Series, overflowed: dict[str, list[int]]
) -> None:
    first = next(iter(overflowed))
    steps = sorted({s for ss in overflowed.values() for s in ss})
    at = rows[(names == T.input_module(first)).to_numpy() & (rows[T.STEP] == overflowed[first][0]).to_numpy()]
    inf = int(at[T.INF].sum())
    out = run.kind(T.ACTIVATION)
    mine = out[
        (T.texts(out[T.MODULE]) == first).to_numpy() & (out[T.STEP] == overflowed[first][0]).to_numpy()
    ]
    nan = int(mine[T.NAN].sum()) if not mine.empty else 0
    plan.add(
        Finding(
            "fp16_residual_overflow",
            CRITICAL,
            f"The residual stream overflows fp16 before {_name(first)}",
            f"At step {overflowed[first][0]}, the fp16 input of {_name(first)} (the tensor it received: in a pre-norm "
            f"model the residual stream, a sum no module returns) held {inf:,} inf, and no module before it in the "
            "forward output one: a sum of finite fp16 values went beyond 65504 there"
            + (f", and {_name(first)} returned {nan:,} nan from it" if nan else "")
            + f". On {len(steps)} sampled step(s) ({', '.join(map(str, steps[:8]))}"
            + (" ..." if len(steps) > 8 else "")
            + ")"
            + (
                f", at the inputs of {_listing([_name(m) for m in overflowed], 4)}"
                if len(overflowed) > 1
                else ""
            )
            + ".",
            _REMEDY,
            modules=list(overflowed),
            numbers={"step": overflowed[first][0], "inf": inf, "steps_affected": len(steps)},
        )
    )
