"""The comparison's sentences about a run: its precision and loss scaling in words, how its scale moved, and its
outcome against the reference."""

from __future__ import annotations

import math

from precprof.analysis.comparison.runs import (
    ADVISED,
    AHEAD,
    BEHIND,
    DIVERGED,
    FAILED,
    MATCHED,
    NO_LOSS,
    PRECISION_UNKNOWN,
    PRECISION_UNKNOWN_WHY,
    STALLED,
    STEPS_FILE,
    UNCOMPARED,
    UNRECORDED,
    RunResult,
    no_steps_file,
)
from precprof.percent import change_pct


def _fmt_pct(x: float | None) -> str:
    """The size of a gap, as the page's header card writes it with its sign (``percent.change_pct``)."""
    if x is None or not math.isfinite(x):
        return "n/a"
    return change_pct(x, signed=False)


def _fmt_scale(v: float | None) -> str:
    if v is None or not math.isfinite(v) or v <= 0:
        return "n/a"
    k = math.log2(v)
    return f"2^{round(k)}" if abs(k - round(k)) < 1e-9 else f"{v:g}"


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def and_list(items: list[str]) -> str:
    """``["optimizer", "learning rate", "seed"]`` -> ``optimizer, learning rate and seed``."""
    return " and ".join(x for x in (", ".join(items[:-1]), items[-1] if items else "") if x)


def _steps(n: int) -> str:
    return f"{n} step{'s' if n != 1 else ''}"


def describe_scale(run: RunResult) -> str:
    """How a dynamic scaler's scale moved, from the run's steps table: ``stayed at 2^16, never changed in 12
    steps``; ``settled at 2^13 after backing off 3 times, the last change at step 4 (36 steps at 2^13)`` when it
    then held for at least the final window (the steps the final loss averages); else ``ended at ...``."""
    at = _fmt_scale(run.final_scale)
    if run.final_scale is None:
        return "no loss scale recorded"
    if not run.scale_growths and not run.scale_backoffs:
        return f"stayed at {at}, never changed in {_steps(run.steps_at_final_scale)}"
    moves = " and ".join(
        m
        for m in (
            f"backing off {_times(run.scale_backoffs)}" if run.scale_backoffs else "",
            f"growing {_times(run.scale_growths)}" if run.scale_growths else "",
        )
        if m
    )
    verb = "settled at" if run.steps_at_final_scale >= max(run.final_window, 1) else "ended at"
    return (
        f"{verb} {at} after {moves}, the last change at step {run.last_scale_change_step} "
        f"({_steps(run.steps_at_final_scale)} at {at})"
    )


def describe_run(run: RunResult) -> str:
    """``fp16 with dynamic loss scaling (stayed at 2^16, never changed in 12 steps)``, ``fp16 without loss
    scaling``, ``bf16``."""
    if run.status == UNRECORDED:  # no summary.json: its precision is not known
        return f"{run.label} (its precision not recorded)"
    if run.precision == PRECISION_UNKNOWN:  # not "run matched fp32"
        return f"{run.label} (its precision not recorded: {PRECISION_UNKNOWN_WHY})"
    fp16 = run.precision.startswith("fp16")
    if run.loss_scaling == "none":
        return f"{run.precision} without loss scaling" if fp16 else run.precision
    if run.loss_scaling == "static":
        return f"{run.precision} at a static loss scale of {_fmt_scale(run.final_scale)}"
    if run.loss_scale == ADVISED and run.ruled_out:
        return (
            f"{run.precision} at init_scale {_fmt_scale(run.init_scale)}, the scale the advisor sized though it "
            f"ruled fp16 out (dynamic loss scaling, {describe_scale(run)})"
        )
    if run.loss_scale == ADVISED:
        return (
            f"{run.precision} at the advised init_scale {_fmt_scale(run.init_scale)} (dynamic loss scaling, "
            f"{describe_scale(run)})"
        )
    return f"{run.precision} with dynamic loss scaling ({describe_scale(run)})"


def outcome_sentence(run: RunResult, ref: RunResult, tolerance: float) -> str:
    who = describe_run(run)
    if no_steps_file(run):  # not "did not finish": the run may have, and its steps are not there to say
        return (
            f"{who} has no loss to compare: {STEPS_FILE} is missing from its run directory ({run.run_dir})."
        )
    if run.outcome == NO_LOSS:  # not "diverged": its final loss is nan for want of one
        return (
            f"{run.label} has no loss to compare: its loop called prof.step() without loss= on each of its "
            f"{_steps(run.steps)}."
        )
    if run.outcome == MATCHED:
        return f"{who} matched {ref.label} within {_fmt_pct(run.gap)}."
    if run.outcome == DIVERGED:
        where = f" at step {run.first_nonfinite_step}" if run.first_nonfinite_step is not None else ""
        return f"{who} diverged: the loss became non-finite{where}."
    if run.outcome == STALLED:
        return (
            f"{who} stalled: loss {run.initial_loss:.3g} → {run.final_loss:.3g}, while {ref.label} reached "
            f"{ref.final_loss:.3g}."
        )
    if run.outcome == BEHIND:
        return f"{who} ended {_fmt_pct(run.gap)} above {ref.label}'s loss ({run.final_loss:.4g} vs {ref.final_loss:.4g})."
    if run.outcome == AHEAD:
        return f"{who} ended {_fmt_pct(run.gap)} below {ref.label}'s loss ({run.final_loss:.4g} vs {ref.final_loss:.4g})."
    if run.outcome == FAILED:
        return f"{who} did not finish{': ' + run.reason if run.reason else ''}."
    if run.outcome == UNCOMPARED:
        return f"{who} ended at loss {run.final_loss:.4g}; {ref.label} has no final loss to compare it with."
    return f"{who} is the reference."
