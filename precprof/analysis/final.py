"""A run's final figures from its steps table: summary.json's ``final`` block (final loss, steps done, skipped
steps, tokens/s) as the report's header gives them, for the runs whose summary no loop of precprof's filled
(a Profiler in the user's own loop: ``pipeline.finish_run``; the framework callbacks)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import pandas as pd

from precprof import tables as T
from precprof.analysis.throughput import throughput


def final_loss(steps: pd.DataFrame) -> float | None:
    """The loss a run ended at, as the report's header gives it: the last loss the loop passed, of the steps
    that finished (a step cut off by a crash has none), nan or inf where the run ended on one (diverged, or
    never finite); in a table written before ``T.NO_LOSS``, whose null losses may be missing ones, the last that
    is not null. None when no step has a loss."""
    if steps.empty or T.LOSS not in steps:
        return None
    if T.NO_LOSS in steps:
        given = T.given_losses(T.finished_steps(steps))
        if len(given):
            return float(pd.to_numeric(given[T.LOSS], errors="coerce").iloc[-1])
    loss = pd.to_numeric(steps[T.LOSS], errors="coerce").dropna()
    return float(loss.iloc[-1]) if len(loss) else None


def machine_load(summary: Mapping[str, Any]) -> dict[str, Any]:
    """How busy the machine was with other work while the run's steps were timed, as the Profiler measured it
    (the summary's ``capture.machine_load``: ``capture/machine_load.py``), for the ``final`` block beside the
    run's tokens per second: ``other_cpu_cores`` (None where not measured: no /proc/stat) and ``cpu_count``. Empty
    for a summary without it (a run recorded before precprof measured it)."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    load = capture.get("machine_load") if isinstance(capture, Mapping) else None
    if not isinstance(load, Mapping):
        return {}
    return {k: load.get(k) for k in ("other_cpu_cores", "cpu_count")}


def final_block(steps: pd.DataFrame, wall_s: float, compiled: Collection[int]) -> dict[str, Any]:
    """The ``final`` block of summary.json from the steps table (the keys precprof.training writes);
    ``wall_s``: the run's wall-clock time (nan where not known: a Profiler in the user's own loop, which sees
    its steps but not the loop around them); ``compiled``: the steps in which torch.compile compiled
    (``Profiler.compiled_steps``, ``throughput.compiled_steps`` of a summary)."""
    last, rates = final_loss(steps), throughput(steps, compiled)  # as the report's header reads them
    steps = T.finished_steps(steps)  # a step a crash cut off has no loss
    losses = steps[T.LOSS].astype(float) if not steps.empty else pd.Series(dtype=float)
    finite = losses.dropna()
    times = steps[T.TIME_S].astype(float).dropna() if not steps.empty else pd.Series(dtype=float)
    tokens = steps[T.TOKENS].astype(float).dropna() if not steps.empty else pd.Series(dtype=float)
    total_tokens = float(tokens.sum()) if len(tokens) else math.nan
    return {
        "final_loss": last,  # None (null): no step had a loss
        # None as final_loss where no step had a loss (a loop's prof.step() without loss=): "NaN" is what a run
        # that diverged reached
        "final_loss_avg10": None
        if last is None
        else float(finite.iloc[-10:].mean())
        if len(finite)
        else math.nan,
        "steps_done": len(steps),
        "skipped_steps": int(steps[T.SKIPPED].astype(bool).sum()) if not steps.empty else 0,
        **rates,  # the steps precprof left alone; the wall-clock rate beside it
        "tokens_per_s_wall": total_tokens / wall_s
        if wall_s > 0 and math.isfinite(total_tokens)
        else math.nan,
        "wall_s": wall_s,
        "step_time_median_s": float(times.median()) if len(times) else math.nan,
    }
