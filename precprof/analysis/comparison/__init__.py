"""Comparing runs of the same model in several precisions: the variants, each run's figures read from its
run directory, its outcome against the reference run, and the advisor's warnings checked against what the
runs did. Pure and host-side: ``precprof.compare`` trains the runs, ``precprof.report.compare_page`` draws them.

Outcome of a run against the reference: ``diverged`` (non-finite final loss), ``stalled`` (it removed less
than a quarter of the loss the reference removed), ``matched`` (final loss within ``tolerance``, relative),
else ``behind`` or ``ahead``; ``not compared`` when the reference has no final loss. The reference is the first
run the rule allows (fp32, then tf32, else the first) that trained itself.

Every sentence states what the run directories measured: a format is "confirmed" on speed only when its run
reached ``SMALL_MODEL_MIN_SPEEDUP`` times the reference's throughput on the machine the advisor planned for
(``speed_status`` holds that rule), the warnings quoted are those the reference profile's advisor gave, and a
scaled run's loss scale is the one its steps table records, with the times it grew and backed off.

The package: ``runs`` (variants, reading a run, its outcome), ``wording`` (the sentences about a run), ``checks``
(the verdict check); ``analyse`` puts them together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof.analysis.comparison.checks import (
    ASPECT_LOSS,
    ASPECT_LOSS_SCALE,
    ASPECT_SPEED,
    ASPECT_WARNINGS,
    CONFIRMED,
    CONTRADICTED,
    MISSED,
    NOT_BORNE_OUT,
    NOT_MEASURED,
    OVERRIDDEN,
    SMALL_MODEL_MIN_SPEEDUP,
    SPEED_CODES,
    STATUS_MEANING,
    Check,
    check_against_runs,
    format_warnings,
    predicted_trouble,
    reference_did_not_train,
    speed_status,
)
from precprof.analysis.comparison.runs import (
    ADVISED,
    AHEAD,
    BAD_OUTCOMES,
    BEHIND,
    DEFAULT_TOLERANCE,
    DIVERGED,
    FAILED,
    MATCHED,
    NO_LOSS,
    PRECISION_UNKNOWN,
    REFERENCE,
    REFERENCE_PREFERENCE,
    SETUP_SETTINGS,
    STALL_PROGRESS,
    STALLED,
    UNCOMPARED,
    RunResult,
    Variant,
    classify,
    compared_up_to,
    cut_short,
    did_not_train,
    finite,
    no_steps_file,
    parse_precisions,
    read_run,
    read_tables,
    recorded_no_loss,
    reference_candidates,
    reference_index,
    setting_text,
    setup_differences,
    setup_differs,
    smoothing_window,
    unusable,
)
from precprof.analysis.comparison.wording import and_list, describe_run, describe_scale, outcome_sentence
from precprof.analysis.throughput import BASIS_ALL, MIN_STEPS
from precprof.errors import UserError

__all__ = [
    "ADVISED",
    "AHEAD",
    "ASPECT_LOSS",
    "ASPECT_LOSS_SCALE",
    "ASPECT_SPEED",
    "ASPECT_WARNINGS",
    "BAD_OUTCOMES",
    "BEHIND",
    "CONFIRMED",
    "CONTRADICTED",
    "DEFAULT_TOLERANCE",
    "DIVERGED",
    "FAILED",
    "MATCHED",
    "MISSED",
    "NOT_BORNE_OUT",
    "NOT_MEASURED",
    "NO_LOSS",
    "OVERRIDDEN",
    "PRECISION_UNKNOWN",
    "REFERENCE",
    "REFERENCE_PREFERENCE",
    "SETUP_SETTINGS",
    "SMALL_MODEL_MIN_SPEEDUP",
    "SPEED_CODES",
    "STALLED",
    "STALL_PROGRESS",
    "STATUS_MEANING",
    "UNCOMPARED",
    "Check",
    "Comparison",
    "RunResult",
    "Variant",
    "analyse",
    "and_list",
    "check_against_runs",
    "classify",
    "compared_up_to",
    "cut_short",
    "describe_run",
    "describe_scale",
    "did_not_train",
    "emulation",
    "finite",
    "format_warnings",
    "load_differs",
    "no_steps_file",
    "outcome_sentence",
    "parse_precisions",
    "predicted_trouble",
    "read_run",
    "read_tables",
    "recorded_no_loss",
    "reference_candidates",
    "reference_index",
    "setting_text",
    "setup_differences",
    "setup_differs",
    "smoothing_window",
    "speed_status",
    "uneven_steps",
    "unusable",
]


@dataclass
class Comparison:
    """The comparison: runs (reference first in ``reference``), verdict check, shared configuration."""

    runs: list[RunResult]
    reference: str
    tolerance: float
    checks: list[Check]
    summary_lines: list[str]
    config: dict[str, Any]
    wall_s: float = math.nan
    notes: list[str] = field(default_factory=list)
    # the notes the terminal leaves out (``terminal_notes``): the check lines printed there say them already, or
    # they bear on the page's throughput alone
    page_only: list[str] = field(default_factory=list)
    # the runs were recorded elsewhere and read from their directories (``precprof compare RUN_DIR ...``):
    # their data and seed are their own, not one comparison's
    recorded: bool = False

    def run(self, label: str) -> RunResult:
        return next(r for r in self.runs if r.label == label)

    def terminal_notes(self) -> list[str]:
        """The notes the terminal prints after the check lines: the page's, but those the check lines say."""
        return [n for n in self.notes if n not in self.page_only]

    def said_by_checks(self, phrase: str) -> bool:
        """Whether a check line says ``phrase`` (a line may start with it, capitalized)."""
        return any(phrase.lower() in c.text.lower() for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "tolerance": self.tolerance,
            "wall_s": self.wall_s,
            "summary": self.summary_lines,
            "checks": [c.to_dict() for c in self.checks],
            "config": self.config,
            "notes": self.notes,
            "recorded": self.recorded,
            "runs": [r.to_dict() for r in self.runs],
        }


def analyse(
    runs: Sequence[tuple[Variant, Path]],
    tolerance: float = DEFAULT_TOLERANCE,
    config: Mapping[str, Any] | None = None,
    common_steps: bool = False,
) -> Comparison:
    """Read the runs' directories, classify each against the reference and check the advisor's verdict. With
    ``common_steps``, runs of different lengths (recorded apart) are read up to the last step all finished,
    which the notes say: a loss 240 steps on is not a loss 40 steps on."""
    if not runs:
        raise UserError("nothing to compare")
    reads = [read_tables(Path(d)) for _, d in runs]  # each run's, read once, as its report reads it
    steps = [T.finished_steps(read.tables["steps"]) for read, _ in reads]
    lasts = [int(pd.to_numeric(s[T.STEP]).max()) if not s.empty else None for s in steps]
    known = {s for s in lasts if s is not None}
    # a run that ended with a non-finite loss diverged, whatever the others' length: it sets no common step (an
    # fp16 run that died at step 5 cut fp32's and bf16's 12 steps to 5, and bf16's match of fp32 went unmeasured)
    diverged = [_went_nonfinite(s) for s in steps]
    whole = {last for last, d in zip(lasts, diverged, strict=True) if last is not None and not d}
    until = min(whole or known) if common_steps and len(known) > 1 else None
    results = [read_run(v, Path(d), until, read) for (v, d), read in zip(runs, reads, strict=True)]
    if until is not None and whole:
        left_out = [
            r.label
            for r, last, d in zip(results, lasts, diverged, strict=True)
            if d and last is not None and last < until
        ]
        for r in results:
            r.until_leaves_out = left_out

    ref, ref_note = _reference(results, [v for v, _ in runs])
    ruled_out = bool((ref.recommendation or {}).get("fp16_ruled_out"))
    for r in results:
        r.emulated = emulation(r)
        r.ruled_out = ruled_out and r.loss_scale == ADVISED
        if r is ref:
            r.outcome, r.gap = (REFERENCE if r.steps else FAILED), 0.0
        else:
            r.outcome, r.gap = classify(r, ref, tolerance)
            r.setup_differs = setup_differs(r, ref)
        if (
            r is not ref
            and math.isfinite(r.tokens_per_s)
            and math.isfinite(ref.tokens_per_s)
            and ref.tokens_per_s > 0
        ):
            r.speed_not_taken = speed_not_taken(r, ref)
            if not r.speed_not_taken:
                r.speedup = r.tokens_per_s / ref.tokens_per_s
        elif r is ref and math.isfinite(r.tokens_per_s):
            r.speedup = 1.0
    checks = check_against_runs(results, ref)
    lines = [outcome_sentence(r, ref, tolerance) for r in results if r is not ref]
    steps_note = _steps_note(results, lasts, until)
    how_ran = _how_each_ran(results)
    comparison = Comparison(
        runs=results,
        reference=ref.label,
        tolerance=tolerance,
        checks=checks,
        summary_lines=lines,
        config=dict(config or {}),
        notes=[n for n in (steps_note, ref_note) if n]
        + _missing_notes(results)
        + _notes(results)
        + ([how_ran] if how_ran else []),
    )
    # the check lines say where runs of different lengths are compared (``cut_short``) and that the reference did
    # not train (``not_isolated``); an eager run's way of running says nothing a terminal needs
    if until is not None and comparison.said_by_checks(compared_up_to(until)):
        comparison.page_only.append(steps_note)
    if ref.did_not_train and comparison.said_by_checks(reference_did_not_train(ref)):
        comparison.page_only.append(ref_note)
    if how_ran and not any(r.compiled and not r.compiled.startswith("eager") for r in results):
        comparison.page_only.append(how_ran)
    return comparison


def _went_nonfinite(steps: pd.DataFrame) -> bool:
    """Whether a run ended diverged: the loss of its last finished step that had one (``no_loss`` steps left
    out: ``prof.step()`` without ``loss=``) is nan or inf, as ``classify`` calls DIVERGED. A run that recovered from
    an inf loss (an fp16 step its scaler skipped) did not, nor did a run that recorded no loss at all."""
    steps = T.given_losses(steps)
    if steps.empty:
        return False
    last = steps.sort_values(T.STEP)[T.LOSS].iloc[-1]
    return not np.isfinite(pd.to_numeric(pd.Series([last]), errors="coerce").to_numpy(dtype=float)[0])


def _steps_note(results: Sequence[RunResult], lasts: Sequence[int | None], until: int | None) -> str:
    """A note that runs of different lengths are compared up to step ``until`` ("" when they are not)."""
    if until is None:
        return ""
    left_out = results[0].until_leaves_out if results else []
    return (
        "The runs trained for different numbers of steps ("
        + ", ".join(
            f"{r.label}: {s + 1 if s is not None else 0}" for r, s in zip(results, lasts, strict=True)
        )
        + f"): each is compared on its steps up to step {until}, the last all of them finished"
        + (
            f" but {', '.join(left_out)}, which ended with a non-finite loss before it: a diverged run is compared on "
            "the steps it ran, and sets no common step."
            if left_out
            else "."
        )
    )


def _reference(results: Sequence[RunResult], variants: Sequence[Variant]) -> tuple[RunResult, str]:
    """The reference run and a note about it ("" when none is due): the first run the rule allows
    (``reference_candidates``) that trained. A reference that itself stalled or diverged made every other run
    "ahead" or "behind +90766%" of a loss that never fell. Runs whose loss scale the advisor sized on the first
    choice's profile keep that one, which trained first. A reference that did not train, kept because no run the
    rule allows did, carries why (``RunResult.did_not_train``) and the note says it."""
    allowed = [results[i] for i in reference_candidates(variants)]
    why = {id(r): did_not_train(r, results) for r in allowed}
    ref = allowed[0]
    if not any(v.loss_scale == ADVISED for v in variants):
        ref = next((r for r in allowed if not why[id(r)]), ref)
    ref.did_not_train = why[id(ref)]
    if ref.did_not_train:
        return ref, (
            f"The reference, {ref.label}, {unusable(ref)}: {ref.did_not_train}. The other runs' outcomes and gaps "
            "are measured against it and say nothing of their precision, and the verdict check does not judge "
            "the advisor by them."
        )
    if ref is not allowed[0]:
        first = allowed[0]
        return ref, (
            f"{first.label}, the reference by the rule (fp32, then tf32, else the first run), {unusable(first)}: "
            f"{why[id(first)]}. The reference is {ref.label}, the next run the rule allows that did."
        )
    return ref, ""


def _missing_notes(runs: Sequence[RunResult]) -> list[str]:
    """A note per run whose run directory lacks some of its tables, naming them as its report does."""
    return [
        f"Missing from {r.label}'s run directory ({r.run_dir}): {', '.join(r.missing)}. What is built from "
        f"{'it' if len(r.missing) == 1 else 'them'} is left out for {r.label}"
        + (": it has no loss to compare." if no_steps_file(r) else ".")
        for r in runs
        if r.missing
    ]


# the counted steps' interquartile range over their median above which a run's speed is not compared: steps
# of a few milliseconds still warming up spread by 0.6-1.2 (gpt-nano on 2 cores); a 2-core machine shared with
# other work gave steps of 0.02 s and 1.4 s in one run, and three identical comparisons gave bf16 at 8.2x,
# 0.04x and 15x fp32's throughput
MAX_STEP_TIME_SPREAD = 2.0


def speed_not_taken(r: RunResult, ref: RunResult) -> str:
    """Why ``r``'s speed against ``ref`` is not compared ("" when it is): steps without per-layer capture on
    both sides, even enough to time. Profiled against profiled is not like with like: a profiled step's time is
    much of it precprof's, whose cost follows the tensors' bytes and so the format (two identical comparisons of
    such steps gave bf16 at 1.44x and 0.88x fp32's speed; unprofiled, it was 0.4-0.9x). A run trained otherwise
    than the reference (``RunResult.setup_differs``) is not compared either: its speed is not the precision's, nor
    is a run's timed while the machine was busier with other work than while the reference's were
    (``load_differs``)."""
    if r.setup_differs:
        return (
            f"{r.label}'s {and_list(r.setup_differs)} differ from {ref.label}'s: their speeds are not the "
            "precision's alone"
        )
    if r.tokens_per_s_basis == ref.tokens_per_s_basis == BASIS_ALL:
        return (
            f"every step of {ref.label} and {r.label} was profiled, and a profiled step's time is much of it "
            f"precprof's, whose cost differs by format: their speeds do not compare (a run with at least "
            f"{MIN_STEPS} unprofiled steps after the first times them: more --steps, or --sample-every N)"
        )
    if r.tokens_per_s_basis != ref.tokens_per_s_basis:
        profiled, plain = (r, ref) if r.tokens_per_s_basis == BASIS_ALL else (ref, r)
        return (
            f"{profiled.label}'s steps were all profiled and {plain.label}'s unprofiled ones timed: their speeds "
            "do not compare"
        )
    return uneven_steps(ref) or uneven_steps(r) or load_differs(r, ref)


def uneven_steps(run: RunResult) -> str:
    """Why ``run``'s own step times time nothing ("" when they are even enough): the middle half of them spans
    more than ``MAX_STEP_TIME_SPREAD`` of their median. Its tokens per second then say nothing either, beside
    any run's (the compare page draws it no bar, and the others' bars without a speed-up over it)."""
    if math.isfinite(run.step_time_spread) and run.step_time_spread > MAX_STEP_TIME_SPREAD:
        return (
            f"{run.label}'s step times were too uneven to compare (the middle half of them spans "
            f"{run.step_time_spread:.0%} of their median: a machine busy with other work)"
        )
    return ""


# how far apart the cores two runs' machines spent on other work may be while their steps were timed, for their
# speeds to compare: MIN_OTHER_CORES_APART cores, or MAX_OTHER_CORES_SHARE of the machine's logical CPUs where
# that is more. A CPU-bound training runs a thread per core, and an op split over them waits for its slowest: the
# cores other work takes come off the training's (on a machine already full, the training's own CPU time is what
# the other work's grows by). 10% of the cores moves a run's speed by 10% or more, and 1.1x is the gain the speed
# checks read (``SMALL_MODEL_MIN_SPEEDUP``); below a quarter of a core is what a machine's own background (an
# idle desktop, the kernel) comes and goes by within a run
MIN_OTHER_CORES_APART = 0.25
MAX_OTHER_CORES_SHARE = 0.1


def load_differs(r: RunResult, ref: RunResult) -> str:
    """Why ``r``'s speed against ``ref`` says nothing: other work kept more of the machine busy while one of them was
    timed than while the other was ("" when both were timed under about the same load, or either was not
    measured: a run recorded before precprof measured it, or where /proc/stat is absent). A run timed while another job kept a
    core busy is steadily slower: its steps are even, and only this tells it."""
    a, b = ref.other_cpu_cores, r.other_cpu_cores
    if a is None or b is None:
        return ""
    cpus = max(n for n in (ref.cpu_count, r.cpu_count, 1) if n is not None)
    if abs(a - b) <= max(MIN_OTHER_CORES_APART, MAX_OTHER_CORES_SHARE * cpus):
        return ""
    of = (
        f"of its {ref.cpu_count} cores "
        if ref.cpu_count is not None and ref.cpu_count == r.cpu_count
        else "cores "
    )
    return (
        f"{ref.label} and {r.label} were timed while other work kept different shares of the machine busy (on "
        f"average {a:.2f} {of}while {ref.label}'s steps ran, {b:.2f} while {r.label}'s): their "
        "speeds are not the precision's alone (run the comparison on an otherwise idle machine)"
    )


def emulation(r: RunResult) -> str:
    """Why ``r``'s throughput says nothing of its format's speed, in the words of the check lines ("" when it
    does): it trained in fp16 on a CPU without fp16 arithmetic, which torch then emulates, about 15x slower than
    fp32. The CPU is the one that recorded the run (its summary.json's ``hardware.fp16_native``), not the one
    reading it; a run recorded before precprof recorded that has its speed left unjudged, whatever this machine's
    CPU, and the sentence says the record is missing (judged by this machine's CPU, a laptop's run read on an
    AVX512-FP16 machine was taken as native without a word). The note on the throughput column and the verdict
    check both go by it: an emulated fp16 run at 1.52x a bf16 run's throughput (noise on a busy machine) had
    "contradicted" an fp32 recommendation."""
    if not (r.precision.startswith("fp16") and r.machine.split(":")[0] == "cpu"):
        return ""
    if r.fp16_native is None:
        return (
            f"{r.label}'s summary.json does not record whether the CPU it trained on has fp16 arithmetic "
            "(AVX512-FP16 / AMX-FP16; it was recorded before precprof did), without which torch emulates it, so "
            f"{r.label}'s throughput is not taken for fp16's speed"
        )
    if r.fp16_native:
        return ""
    return (
        f"the CPU {r.label} trained on has no fp16 arithmetic (AVX512-FP16 / AMX-FP16) and torch emulates it, so "
        f"{r.label}'s throughput says nothing of fp16's speed"
    )


def _notes(runs: Sequence[RunResult]) -> list[str]:
    """Caveats for reading the throughput column: the runs whose format the CPU they trained on emulates
    (``emulation``), and apart, those whose summary.json does not record whether it does (their speed is left
    unjudged)."""
    notes = []
    known = [r.label for r in runs if r.emulated and r.fp16_native is not None]
    unknown = [r.label for r in runs if r.emulated and r.fp16_native is None]
    if known:
        labels, one = and_list(known), len(known) == 1
        notes.append(
            f"The throughput of {labels} says nothing about fp16 on a GPU: the CPU {'it' if one else 'they'} "
            f"trained on has no fp16 arithmetic (AVX512-FP16 / AMX-FP16) and torch emulates it; "
            f"{'its' if one else 'their'} numerics are the real ones."
        )
    if unknown:
        labels, one = and_list(unknown), len(unknown) == 1
        notes.append(
            f"The throughput of {labels} is not taken for fp16's speed: {'its' if one else 'their'} summary.json "
            f"does not record whether the CPU {'it' if one else 'they'} trained on has fp16 arithmetic "
            "(AVX512-FP16 / AMX-FP16; recorded before precprof did), without which torch emulates it; "
            f"{'its' if one else 'their'} numerics are the real ones."
        )
    return notes


def _how_each_ran(runs: Sequence[RunResult]) -> str:
    """A note on how each run ran its model (eager or compiled), "" when no run records it."""
    ran = [(r.label, r.compiled) for r in runs if r.compiled]
    if not ran:
        return ""
    # runs that ran alike, said once ("fp32 and bf16 ran no step compiled: ...")
    said: dict[str, list[str]] = {}
    for label, how in ran:
        said.setdefault(how, []).append(label)
    # the steps in which torch.compile compiled are left out of the throughput, where a run ran any compiled (a
    # run whose every step was sampled ran none: "ran no step compiled: ...", and left none out)
    return (
        "How each run ran: "
        + "; ".join(f"{and_list(labels)} {how}" for how, labels in said.items())
        + ". Each mode runs as its users run it for speed (fp8 only compiled, by default)"
        + (
            "; the steps in which torch.compile compiled are left out of the throughput."
            if any(how.startswith("compiled") for _, how in ran)
            else "."
        )
    )
