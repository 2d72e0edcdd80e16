"""The first module and step with nan/inf, in the forward and in the backward pass, and whether the
loss scaler skipped those steps.

Two tables, two kinds of evidence. Layer statistics (which module, which tensor, how many nan/inf) exist
only on sampled steps, so "the first step with nan/inf" is the first *sampled* one: with ``sample_every`` > 1
it is an upper bound, and the message then says "first recorded at sampled step S" and names the sampled
step before it. The steps table has every step: whether a step's optimizer step was skipped, and the run of
consecutive skipped steps around it, come from there and are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof.analysis.advisor.evidence import (
    _attention_part,
    _dtype_has,
    _innermost,
    _mask_rows,
    _model_inputs,
    _n_modules,
    _no_forward,
    _owner,
    _Plan,
    _Run,
    _steps_without_update,
    _updated_steps,
)
from precprof.analysis.advisor.model import CRITICAL, WARNING, Finding, Number
from precprof.analysis.advisor.text import _g, _listing, _log2i, _name, _pct, _pow2
from precprof.formats import FP16
from precprof.modes import FP32_STORAGE_MODES, FP64

# The weights' dtypes whose optimizer arithmetic fp32 master weights would move to fp32.
_HALF_DTYPES = {"float16", "bfloat16", "torch.float16", "torch.bfloat16"}

# How the messages name a tensor kind.
_KIND_WORDS = {
    T.ACTIVATION: "activation",
    T.ACTIVATION_GRAD: "activation gradient",
    T.WEIGHT: "weight",
    T.WEIGHT_GRAD: "weight gradient",
    T.WEIGHT_UPDATE: "weight update",
}


def _kinds(rows: pd.DataFrame) -> str:
    """The tensor kinds of ``rows`` in schema order, in words ("activation gradient and weight gradient")."""
    present = set(rows[T.TENSOR])
    words = [_KIND_WORDS[k] for k in T.TENSOR_KINDS if k in present]
    words += sorted(str(k) for k in present if k not in _KIND_WORDS)
    return " and ".join(words) or "tensors"


@dataclass(frozen=True)
class _StepFacts:
    """What the steps table says about one step.

    ``recorded``: the step has a row. ``skipped``: its optimizer step was skipped (False when not recorded).
    ``streak``: (first, last) of the run of consecutive skipped steps that contains it, None when not skipped.
    """

    recorded: bool
    skipped: bool
    streak: tuple[int, int] | None


def _skip_streaks(steps: pd.DataFrame) -> list[tuple[int, int]]:
    """Runs of consecutive skipped steps, as (first, last) step, in step order."""
    if steps.empty:
        return []
    skipped = sorted({int(s) for s in steps[steps[T.SKIPPED]][T.STEP]})
    out: list[tuple[int, int]] = []
    for s in skipped:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _step_facts(run: _Run, streaks: list[tuple[int, int]], step: int) -> _StepFacts:
    streak = next(((a, b) for a, b in streaks if a <= step <= b), None)
    recorded = bool((run.steps[T.STEP] == step).any())
    return _StepFacts(recorded, streak is not None, streak)


def _sampled_before(run: _Run, step: int) -> int | None:
    """The last step before ``step`` with layer statistics, None when there is none."""
    earlier = run.layers[run.layers[T.STEP] < step][T.STEP]
    return int(earlier.max()) if not earlier.empty else None


def _opening(run: _Run, step: int) -> tuple[str, int | None]:
    """How a message dates a first nan/inf at layer-statistics step ``step``: "At step S" when the step before
    it was sampled too (or it is the first step of the run), else "First recorded at sampled step S (...)",
    naming the sampled step before it. Returns the words and that earlier sampled step (None when the date
    is exact)."""
    before = _sampled_before(run, step)
    known = [int(s) for s in run.steps[T.STEP]] + [int(s) for s in run.layers[T.STEP]]
    first_step = min(known, default=step)
    if (before is None and step <= first_step) or (before is not None and before == step - 1):
        return f"At step {step}", None
    if before is None:
        return (
            f"First recorded at sampled step {step} (layer statistics exist only on sampled steps, and none "
            "was sampled before it)",
            None,
        )
    return (
        f"First recorded at sampled step {step} (layer statistics exist only on sampled steps; the one "
        f"before is step {before})",
        before,
    )


def _scale_at(steps: pd.DataFrame, step: int) -> float:
    rows = steps[steps[T.STEP] == step][T.LOSS_SCALE]
    return float(rows.iloc[0]) if len(rows) and pd.notna(rows.iloc[0]) else math.nan


def _scales(steps: pd.DataFrame, a: int, b: int) -> str:
    lo, hi = _scale_at(steps, b), _scale_at(steps, a)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi > 0):
        return "(scale not recorded)"
    return f"from {_pow2(_log2i(hi))} to {_pow2(_log2i(lo))}"


def _scale_move(steps: pd.DataFrame, a: int, b: int) -> str:
    """What the scale did over the skips from ``a`` to ``b``: "backed the scale off from 2^x to 2^y", or "kept
    the scale at 2^x" (a static scaler, which never backs off)."""
    lo, hi = _scale_at(steps, b), _scale_at(steps, a)
    if math.isfinite(lo) and math.isfinite(hi) and lo > 0 and lo == hi:
        return f"kept the scale at {_pow2(_log2i(hi))}"
    return f"backed the scale off {_scales(steps, a, b)}"


def _skips(facts: _StepFacts, step: int) -> tuple[str, dict[str, Number]]:
    """What the scaler did at ``step``, as a clause without its full stop ("GradScaler skipped every step
    from A to B (N steps, no weight update)"), and its numbers: skipped (1, 0, None when the steps table has no
    row for the step) and, when skipped, the run of consecutive skips around it."""
    if not facts.recorded:
        return (
            f"The steps table has no row for step {step}, so whether its optimizer step was skipped is unknown",
            {"skipped": None},
        )
    if facts.streak is None:
        return "The optimizer step was not skipped", {"skipped": 0}
    a, b = facts.streak
    return f"GradScaler skipped every step from {a} to {b} ({b - a + 1} steps, no weight update)", {
        "skipped": 1,
        "skipped_from": a,
        "skipped_to": b,
        "skipped_steps": b - a + 1,
    }


def _why_not_the_scale(run: _Run, a: int, b: int) -> str:
    """Why the skips from ``a`` to ``b`` were no overflow, as the end of a sentence without its last words
    ("not from the scale"): the recorded gradients fit fp16 at the starting scale, else the back-off."""
    peak, start = _peak(run, (a, b)), _scale_at(run.steps, a)
    if peak is None or not (math.isfinite(start) and start > 0):
        return (
            ": an overflow would have been gone after a back-off or two, so the nan/inf comes from the backward "
            "computation"
        )
    return (
        f", although the largest finite gradient recorded from step {a} on, {_g(peak)}, fits fp16 even at the "
        f"scale they began at ({_g(peak)} x {start:g} = {_g(peak * start)} < 65504): the nan/inf comes from "
        "the backward computation"
    )


def _fp16_possible(run: _Run) -> bool:
    """Whether the run may have held values in fp16: an fp16 mode, or one the run does not say (an own loop
    whose autocast the profiler did not see). The nan/inf remedies speak of fp16 only then."""
    mode = run.precision_trained
    return not mode or mode.startswith("fp16")


def _began_before(facts: _StepFacts, step: int) -> str:
    """A sentence when the run of skips around a sampled step began before it (the steps table saw the trouble
    before the layer statistics could), else ""."""
    if facts.streak is None or facts.streak[0] >= step:
        return ""
    return f" The skips began at step {facts.streak[0]}, before this sampled step."


def _peak(run: _Run, streak: tuple[int, int]) -> float | None:
    """The largest finite gradient magnitude (unscaled) recorded on the sampled steps of ``streak`` and on the
    first sampled step after it; None when those steps recorded none."""
    a, b = streak
    after = run.layers[run.layers[T.STEP] > b][T.STEP]
    last = int(after.min()) if not after.empty else b
    g = run.kind(*T.GRADIENT_KINDS)
    g = g[(g[T.STEP] >= a) & (g[T.STEP] <= last)][T.ABSMAX]
    g = g[(g > 0) & g.map(math.isfinite)]
    return float(g.max()) if not g.empty else None


def _infs(run: _Run, streak: tuple[int, int]) -> bool:
    """Whether the gradients recorded on the sampled steps of ``streak`` hold inf values (an overflow makes
    infs, which later operations may turn into nan; a nan from the model makes none)."""
    a, b = streak
    g = run.kind(*T.GRADIENT_KINDS)
    return bool(g[(g[T.STEP] >= a) & (g[T.STEP] <= b)][T.INF].sum() > 0)


def _scaler_cannot_fix(run: _Run, streak: tuple[int, int]) -> bool:
    """Whether a run of skipped steps is more than a scale too high.

    Not when the gradients recorded around it, times the scale it began at, exceed fp16's 65504: that is an
    overflow, however many back-offs it took. Nor, at a scale that never backed off, when they come within
    ``nonfinite_backoff_log2`` powers of two of it and infs were recorded. Otherwise yes when the skips drove the scale
    ``nonfinite_backoff_log2`` powers of two below the last scale at which a step went through, or lasted to
    the end of the run over at least ``nonfinite_persist_steps`` steps (see AdvisorConfig).
    """
    a, b = streak
    steps = run.steps
    peak, start = _peak(run, streak), _scale_at(steps, a)
    if peak is not None and math.isfinite(start) and peak * start >= FP16.max:
        return False
    lowest = _scale_at(steps, b)
    if (
        peak is not None
        and math.isfinite(start)
        and lowest >= start
        and peak * start * 2.0**run.cfg.nonfinite_backoff_log2 >= FP16.max
        and _infs(run, streak)
    ):
        # a scale that never backed off (a static scaler) proves nothing by persisting: the largest finite
        # gradient is below fp16's limit at that scale by construction, and one within a few powers of two of
        # it, beside infs, is the top of a distribution the limit cut off (2^24 on gpt-nano: 0.00307 x 2^24 =
        # 51,400). A nan from the model comes without infs.
        return False
    if peak is None and not (math.isfinite(lowest) and lowest <= 2.0**run.cfg.max_loss_scale_log2):
        # no finite gradient to size the overflow by, at a scale never down to one a run would use (a static
        # 1e30, or a scaler backing off from 2^99): every gradient overflowing is what such a scale does
        return False
    ok_before = steps[(steps[T.STEP] < a) & ~steps[T.SKIPPED]]
    last_ok = float(ok_before[T.LOSS_SCALE].iloc[-1]) if len(ok_before) else math.nan
    finite = math.isfinite(last_ok) and math.isfinite(lowest) and lowest > 0 and last_ok > 0
    if finite and math.log2(last_ok / lowest) >= run.cfg.nonfinite_backoff_log2:
        return True
    last_step = int(steps[T.STEP].max()) if not steps.empty else b
    return b == last_step and b - a + 1 >= run.cfg.nonfinite_persist_steps


def _rule_nonfinite(run: _Run, plan: _Plan) -> set[int]:
    """First module and step with nan/inf, forward and backward. Returns the steps with forward nan/inf.

    Adds to ``plan.model_skips`` every skipped step of a run of skips that came with nan/inf from the model:
    one that contains a sampled step with a non-finite forward pass, or one with non-finite gradients that
    no back-off cured (``_scaler_cannot_fix``).
    """
    bad = run.layers[(run.layers[T.NAN] + run.layers[T.INF]) > 0]
    masks = bad[_mask_rows(run, bad)]
    bad = bad.drop(masks.index)  # a mask's -inf is a value the model meant
    streaks = _skip_streaks(run.steps)
    fwd = bad[bad[T.TENSOR].isin((T.ACTIVATION, T.WEIGHT))]
    # the loss is the forward pass's last value: a sampled step whose loss was not finite had a non-finite
    # forward pass, whether or not a recorded module's output was
    loss_steps = _nonfinite_loss_steps(run)
    # ... and one whose loss was finite trained on finite values, whatever a module held on the way
    contained = _contained_steps(run, bad, {int(s) for s in fwd[T.STEP].unique()} - loss_steps)
    held = fwd[fwd[T.STEP].isin(contained)]
    fwd = fwd[~fwd[T.STEP].isin(contained)]
    module_steps = {int(s) for s in fwd[T.STEP].unique()}
    fwd_steps = module_steps | loss_steps
    for s in fwd_steps:
        streak = _step_facts(run, streaks, s).streak
        if streak is not None:
            plan.model_skips.update(range(streak[0], streak[1] + 1))
    if not held.empty:
        plan.add(_contained(run, held, contained))
    outside = min(loss_steps - module_steps, default=None)
    if outside is not None and outside < min(module_steps, default=outside + 1):
        plan.add(_outside_the_modules(run, streaks, outside, len(fwd_steps), masks))
    elif not fwd.empty:
        step = int(fwd[T.STEP].min())
        at = fwd[fwd[T.STEP] == step]
        written = _written_by_the_optimizer(run, streaks, step, at, len(module_steps))
        if written is not None:
            plan.add(written)
            return fwd_steps
        first, reused = _first_origin(run, at)
        row = at[at[T.MODULE] == first]
        maker = _made_by(run, first)
        nan, inf = int(row[T.NAN].sum()), int(row[T.INF].sum())
        opening, before = _opening(run, step)
        facts = _step_facts(run, streaks, step)
        skips, skip_nums = _skips(facts, step) if not run.steps.empty else ("", {})
        skips = f" {skips}.{_began_before(facts, step)}" if skips else ""
        plan.add(
            Finding(
                "nonfinite_forward",
                CRITICAL,
                f"nan/inf first appears in the forward pass of {_name(first)}"
                if maker is None
                else f"nan/inf first appears in the forward pass in {_name(maker)}'s code ({_name(first)})",
                f"{opening}, the {_kinds(row)} of {_name(first)} "
                f"({run.types.get(first, '?')}) holds {nan} nan and {inf} inf values; it is the first "
                f"module {'called once ' if reused else ''}in forward order to do so ({len(module_steps)} "
                "sampled step(s) affected, "
                f"{_n_modules(at[T.MODULE].unique())} module(s) at step {step}).{_reused_words(reused, first)}"
                f"{_made_by_said(first, maker, bool(reused))}{_input_said(run, first, step)}{skips}",
                _forward_remedy(run, first, maker, step, row),
                modules=[first, *([maker] if maker else [])],
                numbers={
                    "step": step,
                    "nan": nan,
                    "inf": inf,
                    "steps_affected": len(module_steps),
                    **({"sampled_before": before} if before is not None else {}),
                    **skip_nums,
                },
            )
        )
    bwd = bad[bad[T.TENSOR].isin(T.GRADIENT_KINDS) & ~bad[T.STEP].isin(fwd_steps)]
    reported = False
    idle = set(_steps_without_update(run)[0])
    for step in sorted(int(s) for s in bwd[T.STEP].unique()):
        # a step without an optimizer step (a micro-batch, prof.step() called per micro-batch): its gradients
        # went to the next optimizer step, skipped or not
        late = step not in idle and _optimizer_before_forward(run, step)
        if step in idle or late:
            stepped = _next_optimizer_step(run, idle, step + 1 if late else step)
        else:
            stepped = step
        facts = _step_facts(run, streaks, stepped) if stepped is not None else _StepFacts(True, False, None)
        if facts.streak is not None:
            if not _scaler_cannot_fix(run, facts.streak):
                continue  # a scale too high: the scaler skipped the step and backed off, as it should
            plan.model_skips.update(range(facts.streak[0], facts.streak[1] + 1))
        if reported:
            continue
        reported = True
        at = bwd[bwd[T.STEP] == step]
        # Backward runs in reverse forward order: the first module to see a bad gradient is the last one.
        first = run.sort(_innermost(at[T.MODULE]))[-1]
        row = at[at[T.MODULE] == first]
        nan, inf = int(row[T.NAN].sum()), int(row[T.INF].sum())
        opening, before = _opening(run, step)
        head = (
            f"{opening}, the {_kinds(row)} of {_name(first)} ({run.types.get(first, '?')}) "
            f"{'holds' if row[T.TENSOR].nunique() == 1 else 'hold'} {nan} nan and {inf} inf values while the "
            + ("loss was finite" if step in contained else "forward pass was finite")
        )
        nums: dict[str, Number] = {"step": step, "nan": nan, "inf": inf}
        if before is not None:
            nums["sampled_before"] = before
        skips, skip_nums = _skips(facts, step if stepped is None else stepped)
        nums.update(skip_nums)
        micro = ""
        if late:
            micro = (
                f"; the optimizer step recorded at step {step} ran before its forward (prof.step() is called "
                "before optimizer.step(), or once per micro-batch), so these gradients went to a later one"
            )
            nums["optimizer_step"] = stepped
        elif stepped != step:
            micro = (
                f"; no optimizer step ran at step {step} (prof.step() is called more often than the optimizer "
                "steps: once per micro-batch)"
            )
            nums["optimizer_step"] = stepped
        severity, title = CRITICAL, f"nan/inf first appears in the backward pass at {_name(first)}"
        if facts.streak is None:
            severity, reach = _reach(run, step, bwd[bwd[T.STEP] >= step], nums)
            if severity == WARNING:
                title = f"nan/inf in the backward pass at {_name(first)}, masked before the weights"
                detail = f"{head}{reach}{micro}."
            elif micro:
                after = (
                    ""
                    if stepped is None
                    else f", and the next optimizer step, at step {stepped}, was not skipped"
                )
                detail = f"{head}{reach}{micro}{after}."
            elif facts.recorded:
                detail = f"{head}{reach}, and the optimizer step was not skipped for it."
            else:
                detail = f"{head}{reach}. {skips}."
            remedy = (
                f"Check the loss and {_name(first)}'s backward at step {step} (e.g. sqrt or log near 0)"
                + (
                    "; with fp16 use a GradScaler so such steps are skipped."
                    if _fp16_possible(run) and severity == CRITICAL
                    else "."
                )
            )
        else:
            a, b = facts.streak
            nums["grad_peak"] = _peak(run, facts.streak)
            detail = (
                f"{head}{micro}. {skips} and {_scale_move(run.steps, a, b)}{_why_not_the_scale(run, a, b)}, "
                f"not from the scale.{_began_before(facts, step)}"
            )
            remedy = (
                f"Check {_name(first)}'s backward from step {a} (sqrt or log near 0, a division by a small "
                "norm); a lower loss scale will not help."
            )
        plan.add(
            Finding(
                "nonfinite_backward",
                severity,
                title,
                detail,
                remedy,
                modules=[first],
                numbers=nums,
            )
        )
    return fwd_steps


def _optimizer_before_forward(run: _Run, step: int) -> bool:
    """Whether the optimizer step recorded in ``step`` ran before its forward, on the previous step's gradients:
    the sampled steps that saw an optimizer step before the forward (``capture.loop_order``'s ``at``,
    ``capture/loop_order.py``: ``prof.step()`` called before ``optimizer.step()``, or once per micro-batch). Past
    the steps it lists (or in a run recorded before it listed them), only where every sampled step with an
    optimizer step from the first such step on had it: one irregular step does not make the others so."""
    order = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("loop_order") or {}
    entry = order.get(T.LOOP_BEFORE_FORWARD) if isinstance(order, dict) else None
    if not isinstance(entry, dict):
        return False
    first, n, at = entry.get("first_step"), entry.get("steps"), entry.get("at")
    if isinstance(at, list) and (step in at or len(at) == n):
        return step in at
    if not isinstance(first, int) or not isinstance(n, int) or step < first:
        return False
    return n >= len({s for s in _updated_steps(run) if s >= first})


def _next_optimizer_step(run: _Run, idle: set[int], step: int) -> int | None:
    """The step that took in the gradients of the micro-batch ``step`` (one of ``idle``, the sampled steps
    without an optimizer step): the first recorded step after the micro-batches from it on, when the loss scaler
    skipped its optimizer step or its weight updates were read; None when the run does not say (that step was
    not sampled, or the run ended first)."""
    steps = run.steps
    if steps.empty:
        return None
    skipped = set(steps.loc[T.flags(steps[T.SKIPPED]), T.STEP].astype(int))
    updated = _updated_steps(run)
    later = sorted(int(s) for s in steps[T.STEP] if int(s) >= step and int(s) not in idle)
    return later[0] if later and (later[0] in skipped or later[0] in updated) else None


def _first_origin(run: _Run, at: pd.DataFrame) -> tuple[str, list[str]]:
    """The module whose forward first made nan/inf among the rows ``at`` of one step, and the modules called
    more than once in the step that come before it by their first call.

    A row adds up every call of its module in the step, and its ``order`` is its first call's: a module called
    twice (T5 applies one dropout to the embeddings and again after the last block) holds the nan/inf of its
    second call at the place of its first. Only a module called once has its values at a known place in the
    forward order, so the first such module is the origin; one called more than once is the origin only when no
    module called once holds nan/inf. A module whose weight alone holds them counts as called once: its weight
    was non-finite when its first call began."""
    origins = run.sort(_innermost(at[T.MODULE]))
    acts = at[at[T.TENSOR] == T.ACTIVATION]
    calls = acts.groupby(T.MODULE)[T.CALLS].max() if T.CALLS in acts else pd.Series(dtype=float)
    once = [m for m in origins if not calls.get(m, 1) > 1]
    if not once:
        return origins[0], []
    first = once[0]
    return first, origins[: origins.index(first)]


def _made_by(run: _Run, first: str) -> str | None:
    """The module whose forward made the value of ``first`` where it is a layer's own input row holding a
    function's output (code between modules: ``q @ k.transpose(-2, -1)`` and its softmax, read by o_proj): the
    layer's parent with a forward of its own (``_owner``), which called that function. None for a module's output,
    for the model's own input, and for a layer at the top level (the root's forward ran the function)."""
    if not first.endswith(T.INPUT_SUFFIX) or first in _model_inputs(run):
        return None
    owner = _owner(first, _model_inputs(run), _no_forward(run))
    return owner if owner != first.removesuffix(T.INPUT_SUFFIX) else None


def _attention_named(module: str) -> bool:
    """Whether ``module`` is an attention by its name, a part of it holding "attn" or "attention" (self_attn,
    attention.self, attn), as rules/fp8 tells the attention modules whose scores it does not count."""
    return any(_attention_part(p) for p in module.split("."))


def _input_said(run: _Run, first: str, step: int) -> str:
    """Where ``first`` is a norm whose input the run read (``_Run.norm_inputs``) and that input already held nan/inf
    at ``step``: the words saying so ("" otherwise). In a pre-norm model that input is the residual stream, a sum no
    module returns, and an fp16 one beyond 65504 is inf before the norm runs (fp16_residual_overflow)."""
    rows = run.norm_inputs
    if rows.empty:
        return ""
    at = rows[
        (T.texts(rows[T.MODULE]) == T.input_module(first)).to_numpy() & (rows[T.STEP] == step).to_numpy()
    ]
    nan, inf = int(at[T.NAN].sum()), int(at[T.INF].sum())
    if not nan + inf:
        return ""
    return (
        " Its input, the tensor it received (in a pre-norm model the residual stream, which no module returns), "
        f"already held {nan:,} nan and {inf:,} inf: the non-finite values began in the sum before it"
        + (" (fp16_residual_overflow)" if inf and _dtype_has(at, "float16").all() else "")
        + "."
    )


def _made_by_said(first: str, maker: str | None, reused: bool) -> str:
    """The words saying that the value of ``first`` was made by code in ``maker``'s forward ("" for none); where no
    module called more than once held nan/inf before it (``reused``), every module before it held finite values,
    so that code began the nan/inf."""
    if maker is None:
        return ""
    return (
        f" {_name(first)} is no module's output: code in {_name(maker)}'s forward made it (a function called "
        "between its submodules)"
        + (
            ""
            if reused
            else ", from the values of modules that held no nan/inf: the nan/inf began in that code, not in "
            f"{_name(first.removesuffix(T.INPUT_SUFFIX))}"
        )
        + "."
    )


def _forward_remedy(run: _Run, first: str, maker: str | None, step: int, row: pd.DataFrame) -> str:
    """What to do of the first nan/inf of the forward pass, in ``first`` at ``step`` (its rows ``row``): inspect
    the module, or the code in ``maker``'s forward that made it (``_made_by``). An fp16 value made there by an
    attention (``_attention_named``) is its scores, q·k beyond 65504 (softmax of inf is nan): the fixes are those
    of the scores, in that code, not a module's keep_fp32 (the layer reading the value computes nothing wrong)."""
    fp16 = _fp16_possible(run)
    if maker is None:
        return f"Inspect {_name(first)}'s inputs and weights at step {step}: a division, log or exp " + (
            "without a guard, or an fp16 overflow (keep it in fp32)."
            if fp16
            else "without a guard, or values that grew too large (the learning rate, a missing norm)."
        )
    layer = first.removesuffix(T.INPUT_SUFFIX)
    if fp16 and _attention_named(maker) and bool(_dtype_has(row, "float16").any()):
        return (
            f"Fix the attention scores in {_name(maker)}'s forward (keeping {_name(layer)} in fp32 changes nothing: "
            "the value it reads was nan/inf already): under fp16 autocast q @ k^T is computed in fp16, where a score "
            "beyond 65504 becomes inf and its softmax nan. Compute the scores and their softmax in fp32, outside "
            "autocast (which would cast q.float() back to fp16 for the matmul): under torch.autocast(device_type, "
            "enabled=False), q.float() @ k.float().transpose(-2, -1), then .to(v.dtype) before the product with v; "
            "scale q by "
            "1/sqrt(head_dim) before the product (F.scaled_dot_product_attention does), or normalise q and k (a q/k "
            f"norm); or keep {_name(maker)} in fp32 (outside autocast), or use bf16, whose range is fp32's."
        )
    return (
        f"Inspect the code in {_name(maker)}'s forward that makes {_name(layer)}'s input at step {step} (keeping "
        f"{_name(layer)} in fp32 changes nothing: the value it reads was nan/inf already): a division, log or exp "
        + (
            f"without a guard, or an fp16 overflow (compute it in fp32, or keep {_name(maker)} in fp32, outside "
            "autocast)."
            if fp16
            else "without a guard, or values that grew too large (the learning rate, a missing norm)."
        )
    )


def _reused_words(reused: list[str], first: str) -> str:
    """A sentence for the modules called more than once that hold nan/inf before ``first`` by their first call."""
    if not reused:
        return ""
    one = len(reused) == 1
    return (
        f" {_listing(reused, 4)} {'holds' if one else 'hold'} nan/inf too and {'comes' if one else 'come'} "
        f"earlier by {'its' if one else 'their'} first call, but {'it was' if one else 'they were'} called more "
        f"than once in the step and a row adds up all the calls: the nan/inf may come from a call after "
        f"{_name(first)}'s."
    )


def _reach(run: _Run, step: int, bad: pd.DataFrame, nums: dict[str, Number]) -> tuple[str, str]:
    """How far a nan/inf gradient at ``step`` (a step not skipped) went, as (severity, the words added to the
    finding's first sentence): into the weight gradients of some modules, at that step or a later one among the
    ``bad`` gradient rows (critical: an update takes it in), or no further, every weight gradient recorded at
    that step finite and none later (a warning: the backward pass masked it, as ReLU's does where its input was
    negative). Critical and no words when the step recorded no weight gradient."""
    lay = run.layers
    recorded = int(((lay[T.STEP] == step) & (lay[T.TENSOR] == T.WEIGHT_GRAD)).sum())
    wg = bad[bad[T.TENSOR] == T.WEIGHT_GRAD]
    if not recorded:
        return CRITICAL, ""
    if wg.empty:
        return WARNING, (
            f", but the weight gradients stayed finite (all {recorded} recorded at that step, and every one after "
            "it): the backward pass zeroed those values on the way (a ReLU's where its input was negative, a mask), so no update took them in. "
            "Harmless as the model stands, and fragile: a change that lets that gradient through (another "
            "activation, no mask) puts nan/inf into the weights"
        )
    when = int(wg[T.STEP].min())
    reached = run.sort(T.texts(wg[wg[T.STEP] == when][T.MODULE]))
    nums["weight_grad_modules_nonfinite"] = len(reached)
    return CRITICAL, (
        f"; it reached the weight gradients of {len(reached)} module(s) ({_listing(reached, 4)})"
        + ("" if when == step else f" at step {when}, its weight gradients at step {step} finite")
    )


def _nonfinite_loss_steps(run: _Run) -> set[int]:
    """The sampled steps whose loss the loop passed and was nan or inf. Only a steps table that marks the steps
    without a loss (``NO_LOSS``) tells a nan loss, written as a null, from no loss at all."""
    steps = run.steps
    if steps.empty or T.NO_LOSS not in steps or T.LOSS not in steps or run.layers.empty:
        return set()
    given = T.given_losses(T.finished_steps(steps))
    loss = pd.to_numeric(given[T.LOSS], errors="coerce").to_numpy(dtype=float)
    sampled = {int(s) for s in run.layers[T.STEP].unique()}
    return {int(s) for s in given[T.STEP][~np.isfinite(loss)]} & sampled


def _contained_steps(run: _Run, bad: pd.DataFrame, held: set[int]) -> set[int]:
    """Of the sampled steps ``held`` whose forward pass held nan/inf (among the rows ``bad``, those of the
    steps whose loss was not finite left out), those where it never reached the loss: the loss was finite, or,
    for a loop that passes no loss, gradients were recorded and every one was finite. Something after the
    module removed the nan/inf (T5's clamp of an fp16 overflow, a ``torch.where``), so the step trained on
    finite values: its gradients say what any step's do. Its loss finite is enough: a gradient that is not
    is the backward pass's to explain (or a loss scale's overflow, which the scaler skips)."""
    grads = run.kind(*T.GRADIENT_KINDS)
    clean = {int(s) for s in grads[T.STEP].unique()} - {
        int(s) for s in bad[bad[T.TENSOR].isin(T.GRADIENT_KINDS)][T.STEP].unique()
    }
    return held & (_finite_loss_steps(run) | clean)


def _finite_loss_steps(run: _Run) -> set[int]:
    """The steps whose loss was a finite number (the loop passed it: no loss is written as a null)."""
    steps = run.steps
    if steps.empty or T.LOSS not in steps:
        return set()
    loss = pd.to_numeric(steps[T.LOSS], errors="coerce").to_numpy(dtype=float)
    return {int(s) for s in steps[T.STEP][np.isfinite(loss)]}


def _contained(run: _Run, held: pd.DataFrame, contained: set[int]) -> Finding:
    """``nonfinite_forward`` as a warning: modules held nan/inf on the sampled steps ``contained`` (their rows
    ``held``), and the loss of each was finite (``_contained_steps``). Names the first module in forward
    order at the first such step, as the critical finding does."""
    step = int(held[T.STEP].min())
    at = held[held[T.STEP] == step]
    first, _ = _first_origin(run, at)
    row = at[at[T.MODULE] == first]
    nan, inf = int(row[T.NAN].sum()), int(row[T.INF].sum())
    opening, before = _opening(run, step)
    by_loss = contained <= _finite_loss_steps(run)
    return Finding(
        "nonfinite_forward",
        WARNING,
        f"nan/inf in the forward pass of {_name(first)} did not reach the loss",
        f"{opening}, the {_kinds(row)} of {_name(first)} ({run.types.get(first, '?')}) holds {nan} nan and {inf} "
        f"inf values, the first module in forward order to do so ({len(contained)} sampled step(s), "
        f"{_n_modules(at[T.MODULE].unique())} module(s) at step {step}); "
        + (
            "the loss of each of those steps was finite"
            if by_loss
            else "the loop passed no loss, and every gradient recorded at those steps was finite"
        )
        + ": code after it (a clamp, a torch.where, a mask) removed them, so those steps trained on finite "
        "values and their gradients are read as any step's.",
        f"Harmless as the model stands, and fragile: find what makes them in {_name(first)} "
        + (
            "(an fp16 overflow: keep it in fp32; a division, log or exp without a guard)"
            if _fp16_possible(run)
            else "(a division, log or exp without a guard, values that grew too large)"
        )
        + " rather than count on what removes them.",
        modules=[first],
        numbers={
            "step": step,
            "nan": nan,
            "inf": inf,
            "steps_affected": len(contained),
            **({"sampled_before": before} if before is not None else {}),
        },
    )


def _outside_the_modules(
    run: _Run, streaks: list[tuple[int, int]], step: int, affected: int, masks: pd.DataFrame
) -> Finding:
    """The first non-finite forward pass when it is the loss's alone: at sampled step ``step`` the loss was nan
    or inf while every module output and weight recorded was finite, so code no module hook sees made it (the
    model's own forward between or after its submodules, or the loss). The nan the modules hold on later steps
    follows from it (the optimizer step applies the nan gradients), so their first module is no cause. A mask
    (``masks``: rows of ``_mask_rows``) holds inf on purpose: it is said, as what that code may have read."""
    loss = run.steps[run.steps[T.STEP] == step][T.LOSS]
    kind = "inf" if len(loss) and pd.notna(loss.iloc[0]) and math.isinf(float(loss.iloc[0])) else "nan"
    at = run.layers[run.layers[T.STEP] == step]
    n_modules = _n_modules(at[at[T.TENSOR].isin((T.ACTIVATION, T.WEIGHT))][T.MODULE].unique())
    facts = _step_facts(run, streaks, step)
    skips, skip_nums = _skips(facts, step)
    masked = run.sort(T.texts(masks[masks[T.STEP] == step][T.MODULE]))
    but = (
        f" but for the inf of {_listing(masked, 4)}, {'a mask' if len(masked) == 1 else 'masks'} holding 0 and "
        "inf alone (a softmax of a row masked whole is nan)"
        if masked
        else ""
    )
    return Finding(
        "nonfinite_forward",
        CRITICAL,
        "nan/inf first appears in the loss, outside the recorded modules",
        f"At step {step}, the loss was {kind} while every output and weight of the {n_modules} module(s) "
        f"recorded at that step was finite{but}: the {kind} came from code outside the captured modules, the model's "
        f"own forward between or after its submodules, or the loss ({affected} sampled step(s) affected). "
        f"{skips}.",
        f"Inspect the model's forward code outside its submodules and the loss at step {step}: a division, log "
        "or exp without a guard, or a nan/inf constant. Computed in a submodule, it would be recorded.",
        numbers={"step": step, "steps_affected": affected, "finite_modules": n_modules, **skip_nums},
    )


def _written_by_the_optimizer(
    run: _Run, streaks: list[tuple[int, int]], step: int, at: pd.DataFrame, affected: int
) -> Finding | None:
    """The first non-finite forward pass at ``step`` when it begins in the weights, which were finite on the
    sampled step before, whose every tensor was finite and whose optimizer step went through: the optimizer
    turned finite gradients into non-finite weights (``nonfinite_forward``, told so). With Adam on fp16
    weights whose ``eps`` rounds to 0 in fp16, says why from the measured gradients. None otherwise."""
    weights = at[at[T.TENSOR] == T.WEIGHT]
    before = _sampled_before(run, step)
    if weights.empty or before is None:
        return None
    then = run.layers[run.layers[T.STEP] == before]
    mods = set(weights[T.MODULE])
    had = then[(then[T.TENSOR] == T.WEIGHT) & then[T.MODULE].isin(mods)]
    facts = _step_facts(run, streaks, before)
    # (its weight updates are what the optimizer step wrote: non-finite ones are this finding's, not a reason
    # against it)
    read = then[then[T.TENSOR] != T.WEIGHT_UPDATE]
    if had.empty or int((read[T.NAN] + read[T.INF]).sum()) or facts.skipped:
        return None
    lost = _first_unsampled_loss(run, before, step)
    if lost is not None:
        return _at_an_unsampled_step(run, streaks, step, weights, before, lost, affected)
    modules = run.sort(mods)
    first = modules[0]
    nan, inf = int(weights[T.NAN].sum()), int(weights[T.INF].sum())
    numel = int(weights[T.NUMEL].sum())
    adjacent = before == step - 1
    unsampled = (
        f"step {step - 1} was not sampled"
        if step - 1 == before + 1
        else f"steps {before + 1} to {step - 1} were not"
    )
    which = (
        f"the optimizer step of step {before}"
        if adjacent
        else f"the optimizer step of step {before} or of step {step - 1} ({unsampled})"
        if step - 1 == before + 1
        else f"an optimizer step from step {before} to step {step - 1} ({unsampled} sampled)"
    )
    nums: dict[str, Number] = {
        "step": step,
        "nan": nan,
        "inf": inf,
        "steps_affected": affected,
        "weights_step": before,
        "weight_modules": len(modules),
        "skipped": 0 if facts.recorded else None,
    }
    message = (
        f"At step {step}, the weights of {len(modules)} module(s) hold {nan:,} nan and {inf:,} inf values "
        f"({_pct((nan + inf) / numel if numel else None)} of their {numel:,}; first in forward order: {_name(first)}, "
        f"{run.types.get(first, '?')}). At step {before} every weight and every gradient recorded was finite"
        + (", and its optimizer step was not skipped" if facts.recorded else "")
        + f": {which} turned finite gradients into non-finite weights."
    )
    dtypes = sorted(set(T.texts(weights[T.DTYPE])))
    remedy = (
        f"Look at the optimizer's arithmetic in the weights' dtype ({', '.join(dtypes)}): an update that "
        "overflows, or a division by a state that underflowed to 0"
        + (
            "; keep fp32 master weights (train under torch.autocast with fp32 parameters) so that it runs in fp32."
            if any(d in _HALF_DTYPES for d in dtypes)
            else " (an eps of 0, a learning rate too high for these gradients)."
        )
    )
    adam = _adam_divides_by_zero(run, weights, before)
    if adam is not None:
        why, adam_nums = adam
        message += " " + why
        nums.update(adam_nums)
        remedy = (
            "Keep the weights and the optimizer's states in fp32 and train under torch.autocast(dtype=torch.float16) "
            "with a GradScaler: Adam's arithmetic then runs in fp32. Keeping fp16 weights, an eps that fp16 holds "
            "(1e-4) ends the division by zero, not the underflow of the second moment."
        )
    return Finding(
        "nonfinite_forward",
        CRITICAL,
        f"nan/inf first appears in the weights: {which.split(' (')[0]} wrote it",
        message,
        remedy,
        modules=modules,
        numbers=nums,
    )


def _first_unsampled_loss(run: _Run, before: int, step: int) -> tuple[int, str] | None:
    """The first step between sampled steps ``before`` and ``step`` (both left out) whose loss was non-finite,
    with "nan" or "inf", when the loss of every step from ``before`` up to it was passed and finite: the steps
    table has every step's loss, the layer statistics only the sampled steps'. None otherwise (no such step, a
    step in between without a loss, or a steps table that cannot tell a nan loss from none: no ``NO_LOSS``)."""
    steps = run.steps
    if steps.empty or T.NO_LOSS not in steps or T.LOSS not in steps or step - before < 2:
        return None
    given = T.given_losses(T.finished_steps(steps))
    loss = dict(
        zip(
            (int(s) for s in given[T.STEP]),
            pd.to_numeric(given[T.LOSS], errors="coerce").to_numpy(dtype=float),
            strict=True,
        )
    )
    for s in range(before, step):
        if s not in loss:
            return None
        if not math.isfinite(loss[s]):
            return (s, "inf" if math.isinf(loss[s]) else "nan") if s > before else None
    return None


def _at_an_unsampled_step(
    run: _Run,
    streaks: list[tuple[int, int]],
    step: int,
    weights: pd.DataFrame,
    before: int,
    lost: tuple[int, str],
    affected: int,
) -> Finding:
    """``nonfinite_forward`` when the weights first recorded non-finite, at sampled step ``step``, follow a
    non-finite loss at an unsampled step between it and the sampled step ``before`` (``lost``: that step and
    "nan" or "inf"), every loss before it finite: the nan/inf began in that step's forward pass or loss (the
    steps table has its loss, not its layers), not in an optimizer step of the steps before, and its optimizer
    step, unless skipped, carried it into the weights ``weights`` (the rows of ``step``). Says to sample it."""
    first_bad, kind = lost
    modules = set(weights[T.MODULE])  # not named as the finding's: they hold what step first_bad made
    nan, inf = int(weights[T.NAN].sum()), int(weights[T.INF].sum())
    numel = int(weights[T.NUMEL].sum())
    facts = _step_facts(run, streaks, first_bad)
    skips, skip_nums = _skips(facts, first_bad)
    where = (
        f"at sampled step {step}, the weights of {len(modules)} module(s) hold {nan:,} nan and {inf:,} inf values "
        f"({_pct((nan + inf) / numel if numel else None)} of their {numel:,})"
    )
    after = (
        f"Step {first_bad}'s optimizer step was not skipped, so it applied the {kind} gradients: {where}, and "
        f"what is recorded from there on follows from step {first_bad}, not a cause"
        if facts.recorded and not facts.skipped
        else f"{skips}; {where}"
    )
    last_ok = first_bad - 1
    if last_ok == before:
        finite = (
            f"The loss was finite at sampled step {before} and {kind} at step {first_bad}, which was not sampled "
            f"(the next sampled step is {step})"
        )
        vouched = (
            f"At step {before} every weight and gradient recorded was finite (its optimizer step, which wrote the "
            f"weights step {first_bad} read from those gradients, is the only one no finite loss vouches for)"
        )
    else:
        finite = (
            f"The loss was finite on every step from sampled step {before} to step {last_ok} and {kind} at step "
            f"{first_bad}, which was not sampled (layer statistics exist only on sampled steps; the ones around it "
            f"are steps {before} and {step})"
        )
        vouched = (
            f"The optimizer steps before it were finite: every forward pass up to step {last_ok} computed a finite "
            f"loss from the weights they wrote, and at step {before} every weight and gradient recorded was finite "
            f"(step {last_ok}'s backward pass and optimizer step, which wrote the weights step {first_bad} read, are "
            "the only ones no finite loss vouches for)"
        )
    message = (
        f"{finite}: the {kind} first appears in the forward pass or the loss of step {first_bad}. {vouched}. "
        f"{after}."
    )
    remedy = (
        f"Sample step {first_bad} to see which module made the {kind}: run again with sample_every=1 (through "
        f"step {first_bad + 1} is enough, with the same data: step {first_bad}'s batch), then look there for "
        + (
            "a division, log or exp without a guard, or an fp16 overflow (keep it in fp32)."
            if _fp16_possible(run)
            else "a division, log or exp without a guard (a norm dividing by a spread of 0), or values that "
            "grew too large (the learning rate, a missing norm)."
        )
    )
    return Finding(
        "nonfinite_forward",
        CRITICAL,
        f"nan/inf first appears at step {first_bad}, which was not sampled: its loss was {kind}",
        message,
        remedy,
        numbers={
            "step": first_bad,
            "nan": nan,
            "inf": inf,
            "steps_affected": affected,
            "sampled_before": before,
            "sampled_after": step,
            "weight_modules": len(modules),
            **skip_nums,
        },
    )


def _adam_divides_by_zero(
    run: _Run, weights: pd.DataFrame, before: int
) -> tuple[str, dict[str, Number]] | None:
    """Why Adam wrote nan/inf into fp16 weights: its ``eps`` is 0 in fp16, so where the second moment is 0 the
    update divides by zero; and the second moment's increment (1 - beta2) g^2 rounds to 0 in fp16 (2^-25 and
    below do) for |g| below sqrt(2^-25 / (1 - beta2)): at least the weight-gradient values of step ``before``
    whose whole binade lies below it (its histogram). None unless the optimizer (the capture summary) is an
    Adam whose eps rounds to 0 in fp16 and the non-finite weights are fp16; beside an optimizer that is no Adam
    (Muon for the matrices, AdamW for the rest) only the weights an Adam holds are judged and counted."""
    opt = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("optimizer") or {}
    eps, beta2 = opt.get("eps"), opt.get("beta2")
    cls = str(opt.get("adam_class") or opt.get("class") or "")
    if isinstance(opt.get("adam_modules"), list):  # beside another optimizer: the weights an Adam holds
        weights = weights[weights[T.MODULE].isin(set(opt["adam_modules"]))]
    if "Adam" not in cls or not isinstance(eps, (int, float)) or "float16" not in set(weights[T.DTYPE]):
        return None
    if float(np.float16(eps)) != 0.0:
        return None
    why = (
        f"{cls}'s eps ({eps:g}) is 0 in fp16 (its smallest subnormal is {FP16.smallest_subnormal:.2g}), so wherever its "
        "second moment v is 0, its update m / (sqrt(v) + eps) divides by zero."
    )
    nums: dict[str, Number] = {"eps": float(eps)}
    if isinstance(beta2, (int, float)) and 0 < beta2 < 1:
        bound = math.sqrt(FP16.underflow_max / (1 - beta2))
        hist = run.hist[
            (run.hist[T.STEP] == before)
            & (run.hist[T.TENSOR] == T.WEIGHT_GRAD)
            & run.hist[T.MODULE].isin(set(weights[T.MODULE]))
        ]
        total = int(hist[T.COUNT].sum())
        below = int(hist[(2.0 ** (hist[T.EXPONENT] + 1)) <= bound][T.COUNT].sum())
        why += (
            f" v grows by (1 - beta2) g^2, which rounds to 0 in fp16 for |g| below {bound:.2g} (beta2 = {beta2:g}): "
            f"an element whose gradients stay below it keeps v = 0"
        )
        if total:
            why += (
                f"; at step {before} at least {below:,} of these modules' {total:,} nonzero weight-gradient values "
                f"({_pct(below / total)}) were below it."
            )
        else:
            why += "."
        nums.update(
            {"beta2": float(beta2), "gradient_bound": bound, "gradients_below": below, "gradients": total}
        )
    return why, nums


def _rule_diverged(run: _Run, plan: _Plan) -> None:
    """The run ended with a non-finite loss: it diverged, and nothing it measured after that says anything
    about the format. With a loss scaler a nan loss on a step or two is a skipped step it can recover from, so
    there the loss must stay non-finite over the last ``nonfinite_persist_steps`` steps; without one a single
    non-finite loss at the end is enough (the weights took the step)."""
    tail = T.nonfinite_loss_tail(run.steps)
    if tail is None:
        return
    scaled = bool((run.steps[T.LOSS_SCALE].fillna(1.0) != 1.0).any()) if T.LOSS_SCALE in run.steps else False
    if scaled and tail.steps < run.cfg.nonfinite_persist_steps:
        return
    first, last, kind = tail.first, tail.last, tail.kind
    plan.diverged = (first, last)
    plan.add(
        Finding(
            "run_diverged",
            CRITICAL,
            f"The run diverged: its loss is {kind} from step {first} on",
            (
                f"The loss became {kind} at step {first} and stayed non-finite on all {tail.steps} recorded steps "
                f"to the last, step {last}"
                if tail.steps > 1
                else f"The loss became {kind} at step {first}, the last recorded step"
            )
            + f"; the last finite loss was {tail.last_finite:.4g}, at step {tail.last_finite_step}"
            + (
                "; the loss scaler could not bring it back."
                if scaled
                else "; without a loss scaler the optimizer took every one of those steps."
                if tail.steps > 1
                else "; without a loss scaler the optimizer took that step."
            )
            + " What was recorded from then on describes a broken run, not the format.",
            "Fix the divergence first: the nan/inf findings name the first module and step where non-finite "
            "values appeared; lower the learning rate"
            # an fp32 (or float64) run has no module to keep in fp32: its format is not the cause
            + (
                f" (the run trained in {'fp64' if run.precision_trained == FP64 else 'fp32'}: no format is the cause)"
                if run.precision_trained in FP32_STORAGE_MODES | {FP64}
                else " or keep that module in fp32"
            )
            + ", then profile again.",
            numbers={
                "step": first,
                "last_step": last,
                "steps": tail.steps,
                "last_finite_loss": tail.last_finite,
            },
        )
    )
