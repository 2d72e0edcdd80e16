"""Throughput from the steps table, and what a profiled step costs.

The steps that recorded per-layer statistics (sampled) do more work than the others, and the first step of a
run pays for warm-up (allocator, kernel selection, compilation), so a wall-clock rate over the whole run says
little about the training itself. The throughput precprof reports is the rate of the steps it left alone:
median tokens per step over median time per step, over the unsampled steps, the first step left out (and the
first of each attempt of a resumed run: a new process's warm-up too), and so are the unsampled steps in
which torch.compile compiled (the summary's ``capture.sampling.compiled_steps``: a compiled model's sampled
steps run eagerly, so it compiles in its first unsampled step, not its first: a compile of 98.6 s among 8
unsampled steps moved their median, and a Trainer run's rate read 15% low). When
fewer than three such steps exist (every step sampled), every step but the first counts, and the result says
so. The sampled steps' median time beside it, as a ratio, is what profiling a step costs, when at least
``MIN_STEPS`` steps of each kind were timed (a run killed after a few steps has one or two of each: no ratio of
their times measures anything).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import pandas as pd

from precprof import tables as T

MIN_STEPS = 3  # fewer unsampled steps than this: the rate counts every step but the first

BASIS_UNSAMPLED = "unsampled steps"
BASIS_ALL = "all steps"


def _median(values: pd.Series) -> float:
    return float(values.median()) if len(values) else math.nan


def timed_enough(tp: Mapping[str, Any]) -> bool:
    """Whether ``throughput``'s figures ``tp`` timed at least ``MIN_STEPS`` steps of each kind: the least the
    page measures a sampled step's cost from, and precprof's overhead, which rests on the same steps' times."""
    return int(tp["steps_timed_unsampled"]) >= MIN_STEPS and int(tp["steps_timed_sampled"]) >= MIN_STEPS


def within_noise(tp: Mapping[str, Any]) -> bool:
    """Whether a sampled step adds less than the steps' times vary (``throughput``'s figures ``tp``, from enough
    timed steps): the sampled steps' median took less than the unsampled steps' (``sampled_step_cost`` below 1),
    or more by less than the unsampled steps' spread (the middle half of their times, over their median). The
    sampler then counts what each sampled step seemed to add, clipped at 0, plus its standard error: the
    overhead it reports is an upper bound, not a measurement."""
    cost, spread = float(tp["sampled_step_cost"]), float(tp["step_time_spread"])
    if not timed_enough(tp) or not math.isfinite(cost):
        return False
    return cost < 1 or (math.isfinite(spread) and cost - 1 < spread)


def compiled_steps(summary: Mapping[str, Any]) -> list[int]:
    """The steps in which torch.compile compiled, as the sampler left them out of the run's time (the summary's
    ``capture.sampling.compiled_steps``; none in a summary written before it)."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    sampling = capture.get("sampling") if isinstance(capture, Mapping) else None
    steps = sampling.get("compiled_steps") if isinstance(sampling, Mapping) else None
    return [int(s) for s in steps or [] if isinstance(s, (int, float)) and math.isfinite(s)]


def throughput(steps: pd.DataFrame, compiled: Collection[int] = ()) -> dict[str, Any]:
    """Throughput figures of a run from its steps table (``T.TIME_S``, ``T.TOKENS``, ``T.SAMPLED``);
    ``compiled``: the steps in which torch.compile compiled (``compiled_steps``), left out of every figure, as
    are the steps the table's ``T.COMPILED`` flags.

    Returns ``tokens_per_s`` (median tokens / median seconds of the counted steps; NaN without tokens),
    ``tokens_per_s_basis`` (``"unsampled steps"`` or ``"all steps"``), ``tokens_per_s_steps`` (how many steps
    count), ``step_time_unsampled_median_s`` and ``step_time_sampled_median_s`` (the first step of the run and of
    each resumed attempt left out of both), ``steps_timed_unsampled`` and ``steps_timed_sampled`` (how many of each were timed) and
    ``sampled_step_cost`` (their ratio: NaN unless at least ``MIN_STEPS`` of each kind were timed),
    ``steps_timed_s`` (the time of the steps timed, both kinds: what a share of the run's time is of) and
    ``step_time_spread`` (the interquartile range of the counted steps' times over their median; NaN with
    fewer than 4: a machine busy with other work makes it large, and a rate from such steps says little) and
    ``steps_compiled_left_out`` (how many steps of ``compiled`` the table held, left out).
    """
    out: dict[str, Any] = {
        "tokens_per_s": math.nan,
        "tokens_per_s_basis": BASIS_UNSAMPLED,
        "tokens_per_s_steps": 0,
        "step_time_unsampled_median_s": math.nan,
        "step_time_sampled_median_s": math.nan,
        "sampled_step_cost": math.nan,
        "steps_timed_unsampled": 0,
        "steps_timed_sampled": 0,
        "steps_timed_s": 0.0,
        "step_time_spread": math.nan,
        "steps_compiled_left_out": 0,
    }
    if steps.empty or T.TIME_S not in steps:
        return out
    df = steps.sort_values(T.STEP) if T.STEP in steps else steps
    # the first step of each attempt, the run's and each resumed one's: a new process's warm-up and compilation
    first = pd.Series(np.arange(len(df)) == 0, df.index)
    df = df[~(first | T.flags(df[T.RESUMED]))] if T.RESUMED in df else df.iloc[1:]
    if T.COMPILED in df and T.STEP in df:  # every attempt's: a resumed run's summary holds its last attempt's
        compiled = {*compiled, *(int(s) for s in df[T.STEP][T.flags(df[T.COMPILED])])}
    if compiled and T.STEP in df:  # a compile's time, not the training's
        left_out = df[T.STEP].isin(list(compiled))
        out["steps_compiled_left_out"] = int(left_out.sum())
        df = df[~left_out]
    time = pd.to_numeric(df[T.TIME_S], errors="coerce")
    tokens = pd.to_numeric(df[T.TOKENS], errors="coerce") if T.TOKENS in df else pd.Series(np.nan, df.index)
    sampled = T.flags(df[T.SAMPLED]) if T.SAMPLED in df else pd.Series(False, df.index)
    timed = np.isfinite(time) & (time > 0)
    plain, profiled = timed & ~sampled, timed & sampled
    out["step_time_unsampled_median_s"] = _median(time[plain])
    out["step_time_sampled_median_s"] = _median(time[profiled])
    out["steps_timed_unsampled"] = int(plain.sum())
    out["steps_timed_sampled"] = int(profiled.sum())
    out["steps_timed_s"] = float(time[timed].sum())
    if timed_enough(out):
        out["sampled_step_cost"] = out["step_time_sampled_median_s"] / out["step_time_unsampled_median_s"]
    use = plain if int(plain.sum()) >= MIN_STEPS else timed
    out["tokens_per_s_basis"] = BASIS_UNSAMPLED if use is plain else BASIS_ALL
    counted = use & np.isfinite(tokens) & (tokens >= 0)  # (a device tensor's negative count: not checked)
    out["tokens_per_s_steps"] = int(counted.sum())
    if counted.any():
        t = _median(time[counted])
        out["tokens_per_s"] = _median(tokens[counted]) / t if t > 0 else math.nan
        times = time[counted]
        if len(times) >= 4 and t > 0:  # the middle half of the counted steps' times, over their median
            out["step_time_spread"] = float(times.quantile(0.75) - times.quantile(0.25)) / t
    return out
