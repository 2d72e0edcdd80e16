"""Comparing runs of the same model in several precisions: the variants, each run's figures read from its
run directory, its outcome against the reference run, and the advisor's warnings checked against what the
runs did. Pure and host-side: ``precprof.compare`` trains the runs, ``precprof.report.compare_page`` draws them.

Outcome of a run against the reference: ``diverged`` (non-finite final loss), ``stalled`` (it removed less
than a quarter of the loss the reference removed), ``matched`` (final loss within ``tolerance``, relative),
else ``behind`` or ``ahead``.

Every sentence states what the run directories measured: a format is "confirmed" on speed only when its run
reached ``SMALL_MODEL_MIN_SPEEDUP`` times the reference's throughput on the machine the advisor planned for
(``speed_status`` holds that rule), the warnings quoted are those the reference profile's advisor gave, and a
scaled run's loss scale is the one its steps table records, with the times it grew and backed off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from precprof import hardware
from precprof import tables as T
from precprof.analysis.throughput import throughput
from precprof.errors import UserError
from precprof.modes import PRECISIONS, parse_loss_scale

REFERENCE_PREFERENCE = ("fp32", "tf32")
DEFAULT_TOLERANCE = 0.02  # relative final-loss gap within which a run "matched" the reference
STALL_PROGRESS = 0.25  # a run that removed less than this share of the reference's loss decrease "stalled"
ADVISED = "advised"  # loss scaling spec: dynamic, from the init_scale the advisor gave on the reference run

# outcomes
REFERENCE, MATCHED, BEHIND, AHEAD, STALLED, DIVERGED, FAILED = (
    "reference",
    "matched",
    "behind",
    "ahead",
    "stalled",
    "diverged",
    "failed",
)
BAD_OUTCOMES = frozenset({BEHIND, STALLED, DIVERGED})
# verdict-check statuses
CONFIRMED, CONTRADICTED, NOT_BORNE_OUT, MISSED, NOT_MEASURED, OVERRIDDEN = (
    "confirmed",
    "contradicted",
    "not borne out",
    "missed",
    "not measured",
    "overridden by measurement",
)
# the speedup over the reference that counts as a gain: it confirms a low-precision recommendation's speed and
# overrides the advisor's fp32 default for a small model
SMALL_MODEL_MIN_SPEEDUP = 1.1
_GAIN = f"{SMALL_MODEL_MIN_SPEEDUP:.2f}x the reference's throughput or more"
# what each status means (the page's legend)
STATUS_MEANING = {
    CONFIRMED: "loss: the run matched or beat the reference, or went wrong where a warning said it would; "
    f"speed: on the machine the advisor planned for, the format said to be faster reached {_GAIN}, or the "
    "format said to be slow or not worth it did not",
    CONTRADICTED: "loss: the recommended format's run fell behind, stalled or diverged; speed: on the machine the "
    f"advisor planned for, the recommended format stayed below {_GAIN}, or a format it passed over reached it",
    NOT_BORNE_OUT: "the profile warned about this format, and the run did not suffer from it",
    MISSED: "the run went wrong and the profile gave no warning that bears on it",
    NOT_MEASURED: "no run in this comparison measures it: no run in that format, a failed run, no throughput, "
    "or speed on a machine other than this one",
    OVERRIDDEN: "the advisor's fp32 default for a small model, against a run in the format its measurements "
    f"allowed that matched and reached {_GAIN}",
}
# aspects a check covers
ASPECT_LOSS, ASPECT_SPEED, ASPECT_LOSS_SCALE, ASPECT_WARNINGS = "loss", "speed", "loss scale", "warnings"
# finding codes about a format's speed on the target, not about its numerics
SPEED_CODES = frozenset({"bf16_emulated", "bf16_unsupported", "fp8_library_missing"})


@dataclass(frozen=True)
class Variant:
    """One run of a comparison: a precision mode and its loss scaling spec ("auto", "dynamic", "none",
    "static:N", or "advised": dynamic scaling starting at the init_scale the advisor recommends on the
    reference run's profile, so that the recommendation itself is trained and checked)."""

    precision: str
    loss_scale: str = "auto"

    @property
    def label(self) -> str:
        """Display name and run-directory name: ``fp16``, ``fp16-none``, ``fp16-static-8192``."""
        if self.loss_scale == "auto":
            return self.precision
        spec = self.loss_scale.replace(":", "-")
        if spec.startswith("static-"):
            with contextlib.suppress(ValueError):  # static:8192.0 -> static-8192
                spec = f"static-{float(spec[7:]):g}"
        return f"{self.precision}-{spec}"


def parse_precisions(spec: str | Sequence[str]) -> list[Variant]:
    """``"fp32,bf16,fp16,fp16:none"`` -> variants; UserError for an unknown mode, a bad scaling spec or a
    duplicate."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Variant] = []
    for raw in items:
        item = raw.strip().lower()
        if not item:
            continue
        precision, _, scale = item.partition(":")
        if precision not in PRECISIONS:
            raise UserError(
                f"--precisions: unknown precision {precision!r}; choose from {', '.join(PRECISIONS)} "
                "(optionally with a loss scaling spec, e.g. fp16:none or fp16:static:8192)"
            )
        scale = scale or "auto"
        if scale == ADVISED:
            if not precision.startswith("fp16"):
                raise UserError(
                    f"--precisions {item!r}: 'advised' is a loss scale, for fp16 and fp16-pure only"
                )
        else:
            parse_loss_scale(scale)
        v = Variant(precision, scale)
        if v in out:
            raise UserError(f"--precisions: {v.label} is listed twice")
        out.append(v)
    if len(out) < 2:
        raise UserError("--precisions: give at least two precisions to compare, e.g. fp32,bf16,fp16")
    return out


def reference_index(variants: Sequence[Variant]) -> int:
    """The run the others are compared with: fp32 (then tf32) with default scaling, else the first."""
    for name in REFERENCE_PREFERENCE:
        for i, v in enumerate(variants):
            if v.precision == name:
                return i
    return 0


@dataclass
class RunResult:
    """What one run of the comparison did, read back from its run directory."""

    label: str
    precision: str
    loss_scale: str
    run_dir: str
    status: str
    reason: str | None
    steps: int
    initial_loss: float
    final_loss: float  # mean over the final window
    final_window: int
    gap: float | None  # (final - reference final) / reference final; None for the reference itself
    outcome: str
    tokens_per_s: float
    speedup: float | None
    skipped_steps: int
    first_nonfinite_step: int | None
    loss_scaling: str  # resolved: dynamic | static | none
    final_scale: float | None  # loss scale in effect on the last step with a finite one (scaled runs)
    init_scale: float | None  # the scaler's initial scale (scaled runs)
    scale_growths: int  # steps whose loss scale is above the previous step's
    scale_backoffs: int  # steps whose loss scale is below the previous step's
    last_scale_change_step: int | None  # the first step at the final scale, when the scale ever changed
    steps_at_final_scale: int  # steps (rows with a finite scale) from the last change to the end
    machine: str  # where the run trained: "cpu: AMD EPYC", "cuda: NVIDIA H100 80GB HBM3"
    target: str | None  # hardware name the run's summary records (what the advisor plans for by default)
    memory: dict[str, int]
    memory_total: int
    recommendation: dict[str, Any] | None
    wall_s: float
    report: str | None
    curve_steps: list[int] = field(default_factory=list)
    curve_loss: list[float] = field(default_factory=list)
    # how the loop ran the model ("compiled (torch.compile), the default for fp8", "eager, --no-compile"); None
    # for a run recorded before the loop said
    compiled: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Check:
    """One line of the verdict check: what was predicted or observed, and whether the runs bear it out."""

    status: str
    text: str
    run: str | None = None
    aspect: str = ASPECT_LOSS  # what the line checks: loss, speed, loss scale or warnings

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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

    def run(self, label: str) -> RunResult:
        return next(r for r in self.runs if r.label == label)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "tolerance": self.tolerance,
            "wall_s": self.wall_s,
            "summary": self.summary_lines,
            "checks": [c.to_dict() for c in self.checks],
            "config": self.config,
            "notes": self.notes,
            "runs": [r.to_dict() for r in self.runs],
        }


def smoothing_window(n: int) -> int:
    return max(5, n // 10) if n else 0


def finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def _tokens_per_s(steps: pd.DataFrame) -> float:
    """Tokens per second of the steps without per-layer capture (``analysis.throughput``)."""
    return float(throughput(steps)["tokens_per_s"])


def _memory(summary: Mapping[str, Any]) -> dict[str, int]:
    measured = (summary.get(T.SUMMARY_MEMORY) or {}).get("measured") or {}
    return {str(k): int(v) for k, v in measured.items() if v is not None and k != T.PROFILER_BUFFERS}


@dataclass(frozen=True)
class _ScaleHistory:
    final: float | None
    growths: int
    backoffs: int
    last_change_step: int | None
    steps_at_final: int


def _scale_history(steps: pd.DataFrame) -> _ScaleHistory:
    """The loss scale a run ended at and how it moved, from the steps table (each row: the scale in effect
    during that step). Rows without a finite scale are left out."""
    if steps.empty:
        return _ScaleHistory(None, 0, 0, None, 0)
    scales = steps[T.LOSS_SCALE].astype(float).to_numpy()
    ok = np.isfinite(scales)
    s, step = scales[ok], steps[T.STEP].to_numpy()[ok]
    if not len(s):
        return _ScaleHistory(None, 0, 0, None, 0)
    d = np.diff(s)
    changes = np.nonzero(d != 0)[0]
    last = int(changes[-1]) + 1 if len(changes) else None  # index of the first row at the final scale
    return _ScaleHistory(
        final=float(s[-1]),
        growths=int((d > 0).sum()),
        backoffs=int((d < 0).sum()),
        last_change_step=int(step[last]) if last is not None else None,
        steps_at_final=len(s) - (last or 0),
    )


def read_run(variant: Variant, run_dir: Path) -> RunResult:
    """A run's facts from its run directory (outcome and gap are filled in by ``analyse``)."""
    summary = T.read_summary(run_dir)
    steps = T.read_tables(run_dir)["steps"].sort_values(T.STEP)
    loss = steps[T.LOSS].astype(float).to_numpy() if not steps.empty else np.array([])
    win = smoothing_window(len(loss))
    tail = finite(loss[-win:]) if win else np.array([])
    bad = np.nonzero(~np.isfinite(loss))[0]
    # a run that went non-finite at its end has no meaningful final loss
    final = float(tail.mean()) if len(tail) and np.isfinite(loss[-1]) else math.nan
    first = finite(loss[:1])
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    kind = str(
        cfg.get("loss_scaling") or ("none" if variant.loss_scale in ("auto", "none") else variant.loss_scale)
    )
    scale = _scale_history(steps) if kind != "none" else _ScaleHistory(None, 0, 0, None, 0)
    hw = summary.get(T.SUMMARY_HARDWARE) or {}
    device, name = hw.get("device"), hw.get("name")
    machine = ": ".join(str(x) for x in (device, name) if x) or "unknown"
    mem = _memory(summary)
    init_scale = (
        cfg.get("static_scale") if kind == "static" else cfg.get("init_scale") if kind == "dynamic" else None
    )
    report = run_dir / T.REPORT_FILE
    final_block = summary.get(T.SUMMARY_FINAL) or {}
    return RunResult(
        label=variant.label,
        precision=variant.precision,
        loss_scale=variant.loss_scale,
        run_dir=str(run_dir),
        status=str(summary.get(T.SUMMARY_STATUS) or "missing"),
        reason=summary.get(T.SUMMARY_INCOMPLETE_REASON),
        steps=len(steps),
        initial_loss=float(first[0]) if len(first) else math.nan,
        final_loss=final,
        final_window=win,
        gap=None,
        outcome=FAILED if not len(loss) else REFERENCE,
        tokens_per_s=_tokens_per_s(steps),
        speedup=None,
        skipped_steps=int(steps[T.SKIPPED].astype(bool).sum()) if not steps.empty else 0,
        first_nonfinite_step=int(steps[T.STEP].iloc[bad[0]]) if len(bad) else None,
        loss_scaling=kind,
        final_scale=scale.final,
        init_scale=float(init_scale) if isinstance(init_scale, (int, float)) else None,
        scale_growths=scale.growths,
        scale_backoffs=scale.backoffs,
        last_scale_change_step=scale.last_change_step,
        steps_at_final_scale=scale.steps_at_final,
        machine=machine,
        target=str(name) if name else None,
        memory=mem,
        memory_total=sum(v for k, v in mem.items() if k not in T.MEMORY_PEAK_COMPONENTS),
        recommendation=summary.get(T.SUMMARY_RECOMMENDATION),
        wall_s=float(final_block.get("wall_s", math.nan) or math.nan),
        report=str(report) if report.exists() else None,
        curve_steps=[int(s) for s in steps[T.STEP]] if not steps.empty else [],
        curve_loss=[float(v) for v in loss],
        compiled=str(cfg["compiled"]) if isinstance(cfg.get("compiled"), str) else None,
    )


def classify(run: RunResult, ref: RunResult, tolerance: float) -> tuple[str, float | None]:
    """(outcome, relative gap) of ``run`` against the reference run."""
    if run.status == "missing" or not run.steps:
        return FAILED, None
    if not math.isfinite(run.final_loss):
        return DIVERGED, None
    if not math.isfinite(ref.final_loss) or ref.final_loss == 0:
        return FAILED, None
    gap = (run.final_loss - ref.final_loss) / abs(ref.final_loss)
    if run.initial_loss > 0 and run.final_loss > 1.5 * run.initial_loss:
        return DIVERGED, gap
    ref_drop = ref.initial_loss - ref.final_loss
    if ref_drop > 0 and (run.initial_loss - run.final_loss) < STALL_PROGRESS * ref_drop:
        return STALLED, gap
    if abs(gap) <= tolerance:
        return MATCHED, gap
    return (BEHIND if gap > 0 else AHEAD), gap


def _findings(rec: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list((rec or {}).get("findings") or [])


def _fmt_pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    p = abs(x) * 100
    return f"{p:.2g}%" if p < 1 else f"{p:.1f}%"


def _fmt_scale(v: float | None) -> str:
    if v is None or not math.isfinite(v) or v <= 0:
        return "n/a"
    k = math.log2(v)
    return f"2^{round(k)}" if abs(k - round(k)) < 1e-9 else f"{v:g}"


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


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
    fp16 = run.precision.startswith("fp16")
    if run.loss_scaling == "none":
        return f"{run.precision} without loss scaling" if fp16 else run.precision
    if run.loss_scaling == "static":
        return f"{run.precision} at a static loss scale of {_fmt_scale(run.final_scale)}"
    if run.loss_scale == ADVISED:
        return (
            f"{run.precision} at the advised init_scale {_fmt_scale(run.init_scale)} (dynamic loss scaling, "
            f"{describe_scale(run)})"
        )
    return f"{run.precision} with dynamic loss scaling ({describe_scale(run)})"


def outcome_sentence(run: RunResult, ref: RunResult, tolerance: float) -> str:
    who = describe_run(run)
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
    return f"{who} is the reference."


def _family(precision: str) -> str | None:
    for fmt in ("fp16", "bf16", "fp8"):
        if precision.startswith(fmt):
            return fmt
    return None


def format_warnings(rec: Mapping[str, Any] | None, fmt: str) -> list[dict[str, Any]]:
    """The warnings (and criticals) the advisor gave for ``fmt`` (finding codes ``<fmt>_...``), as the profile
    holds them; a what-if the advisor demoted to information (the verdict is another format) keeps its
    ``numbers["demoted_from"]`` and counts as the warning it was."""
    out = []
    for f in _findings(rec):
        code = str(f.get("code", ""))
        sev = str((f.get("numbers") or {}).get("demoted_from") or f.get("severity", "")).lower()
        if code.startswith(fmt + "_") and sev in ("warning", "critical"):
            out.append(f)
    return out


def _beside_the_point(f: Mapping[str, Any], run: RunResult) -> str | None:
    """Why a warning for ``run``'s format says nothing about this run's loss, or None when it does."""
    code, sev = str(f.get("code", "")), str(f.get("severity", "")).lower()
    if code in SPEED_CODES:
        return "about speed"
    if code.endswith("lost_updates") and not run.precision.endswith("-pure"):
        return "about weights held in that format; this run kept fp32 master weights"
    if code == "fp16_gradient_underflow" and run.loss_scaling != "none" and sev != "critical":
        return "about fp16 at loss scale 1; this run scaled its loss"
    return None


def predicted_trouble(rec: Mapping[str, Any] | None, run: RunResult) -> list[dict[str, Any]]:
    """Of the reference profile's warnings for ``run``'s format, those that predict trouble for its loss.

    Left out (``_beside_the_point``): speed warnings (emulated or unsupported format), lost updates in an
    autocast run (fp32 master weights: a what-if there), and the non-critical fp16 gradient-underflow warning in
    a scaled run (it is about scale 1; a scaled run is what it recommends).
    """
    fmt = _family(run.precision)
    if fmt is None:
        return []
    return [f for f in format_warnings(rec, fmt) if _beside_the_point(f, run) is None]


def _title(f: Mapping[str, Any]) -> str:
    return str(f.get("title") or f.get("code"))


def _planned_here(rec: Mapping[str, Any], ref: RunResult) -> bool:
    """Whether the advisor planned for the machine the runs trained on (a preset target is another machine)."""
    target = rec.get("target")
    return target is None or ref.target is None or str(target) == ref.target


def speed_status(speedup: float | None, planned_here: bool) -> str:
    """The one rule for speed. A format's claim to be faster than the reference is CONFIRMED when its run
    reached ``SMALL_MODEL_MIN_SPEEDUP`` times the reference's throughput, CONTRADICTED when it did not; both only
    on the machine the advisor planned for. NOT_MEASURED without a throughput, or for another machine."""
    if speedup is None or not math.isfinite(speedup) or not planned_here:
        return NOT_MEASURED
    return CONFIRMED if speedup >= SMALL_MODEL_MIN_SPEEDUP else CONTRADICTED


def _ran_at(r: RunResult, ref: RunResult, who: bool = True) -> str:
    said = f"ran at {r.speedup:.2f}x {ref.label}'s throughput on this machine ({r.machine})"
    return f"{r.label} {said}" if who else said


def _gain() -> str:
    return f"{SMALL_MODEL_MIN_SPEEDUP:.2f}x or more counts as a gain"


def _short_of_gain(r: RunResult, ref: RunResult) -> str:
    s = r.speedup or 0.0
    return (
        f"slower than {ref.label}"
        if s < 1
        else f"below the {SMALL_MODEL_MIN_SPEEDUP:.2f}x that counts as a gain"
    )


def _elsewhere(rec: Mapping[str, Any]) -> str:
    return f"the advisor planned for {rec.get('target')}, whose speed this comparison did not measure"


def _recommendation_checks(
    rec: Mapping[str, Any], ref: RunResult, others: Sequence[RunResult]
) -> list[Check]:
    """The recommended format against the runs: its loss (the run in that format matched?) and its speed (the
    run in that format against ``speed_status``); for an fp32 recommendation, the speed of each run that
    matched, which confirms it (no gain), overrides it (the format its measurements allowed, with a gain) or
    contradicts it."""
    fmt = str(rec.get("format", ""))
    scale = rec.get("loss_scale") if fmt == "fp16" else None
    target = rec.get("target")
    said = (
        f"the advisor, on the {ref.label} run's profile, recommends {fmt}"
        + (f" with init_scale {_fmt_scale(float(scale))}" if scale else "")
        + (f" for {target}" if target else "")
    )
    here = _planned_here(rec, ref)
    checks: list[Check] = []
    finished = [r for r in others if r.outcome not in (FAILED, REFERENCE)]
    if fmt in ("fp32", "tf32", ref.precision):
        measured = str(rec.get("measured_format") or "")
        small = bool(measured) and measured not in ("fp32", "tf32", fmt)
        lead = (
            f"the advisor's default for a model this small is {fmt}; the measurements allowed {measured}"
            if small
            else said
        )
        rivals = [r for r in finished if r.outcome in (MATCHED, AHEAD)]
        if not finished:
            checks.append(
                Check(
                    NOT_MEASURED,
                    f"Loss: {lead}; no other run finished to set it against.",
                    ref.label,
                    ASPECT_LOSS,
                )
            )
        elif not rivals:
            names = ", ".join(r.label for r in finished)
            checks.append(
                Check(
                    CONFIRMED,
                    f"Loss: {lead}; no run in another format matched {ref.label}'s loss ({names}).",
                    ref.label,
                    ASPECT_LOSS,
                )
            )
        for r in rivals:
            did = "matched" if r.outcome == MATCHED else "beat"
            if r.speedup is None or not math.isfinite(r.speedup):
                checks.append(
                    Check(
                        NOT_MEASURED,
                        f"Speed: {lead}; the {r.label} run {did} {ref.label}'s loss, and no throughput was measured.",
                        r.label,
                        ASPECT_SPEED,
                    )
                )
                continue
            head = (
                f"Speed: {lead}; the {r.label} run {did} {ref.label}'s loss and {_ran_at(r, ref, who=False)}"
            )
            st = speed_status(r.speedup, here)
            if st == CONFIRMED and small and r.precision == measured:
                checks.append(
                    Check(
                        OVERRIDDEN,
                        f"{head}: the measured gain overrides the default, use {measured}.",
                        r.label,
                        ASPECT_SPEED,
                    )
                )
            elif st == CONFIRMED:
                checks.append(
                    Check(
                        CONTRADICTED,
                        f"{head}: a gain ({_gain()}) that the recommendation forgoes.",
                        r.label,
                        ASPECT_SPEED,
                    )
                )
            elif st == CONTRADICTED:
                checks.append(
                    Check(
                        CONFIRMED,
                        f"{head}: no gain worth it ({_short_of_gain(r, ref)}), keep {fmt}.",
                        r.label,
                        ASPECT_SPEED,
                    )
                )
            else:
                checks.append(Check(NOT_MEASURED, f"{head}; {_elsewhere(rec)}.", r.label, ASPECT_SPEED))
        return checks
    family = [r for r in others if r.precision == fmt]
    if fmt == "fp16":
        family = [r for r in family if r.loss_scaling != "none"] or family
    if not family:
        checks.append(
            Check(
                NOT_MEASURED,
                f"Loss: {said}; no {fmt} run in this comparison to check it against.",
                None,
                ASPECT_LOSS,
            )
        )
    for r in family:
        if r.outcome == FAILED:
            checks.append(
                Check(NOT_MEASURED, f"Loss: {said}: {outcome_sentence(r, ref, 0)}", r.label, ASPECT_LOSS)
            )
            continue
        ok = r.outcome in (MATCHED, AHEAD)
        checks.append(
            Check(
                CONFIRMED if ok else CONTRADICTED,
                f"Loss: {said}: {outcome_sentence(r, ref, 0)}",
                r.label,
                ASPECT_LOSS,
            )
        )
        st = speed_status(r.speedup, here)
        if r.speedup is None or not math.isfinite(r.speedup):
            text = f"Speed: no throughput was measured for {r.label} and {ref.label}."
        elif st == CONFIRMED:
            text = f"Speed: {_ran_at(r, ref)}, a gain ({_gain()})."
        elif st == CONTRADICTED:
            text = (
                f"Speed: {_ran_at(r, ref)}, the machine the advisor planned for: {_short_of_gain(r, ref)}, not the "
                f"gain recommending {fmt} assumes ({_gain()})."
            )
        else:
            text = f"Speed: {_ran_at(r, ref)}; {_elsewhere(rec)}."
        checks.append(Check(st, text, r.label, ASPECT_SPEED))
    return checks


def _warning_checks(rec: Mapping[str, Any] | None, r: RunResult, ref: RunResult) -> list[Check]:
    """The reference profile's warnings for ``r``'s format, quoted as the advisor gave them, against what ``r``
    did: its loss (warnings that bear on it) and its speed (warnings about speed)."""
    if r.outcome in (FAILED, REFERENCE):
        return [Check(NOT_MEASURED, f"Warnings: {outcome_sentence(r, ref, 0)}", r.label, ASPECT_WARNINGS)]
    fmt = _family(r.precision)
    given = format_warnings(rec, fmt) if fmt else []
    trouble = [f for f in given if _beside_the_point(f, r) is None]
    aside = [f for f in given if _beside_the_point(f, r) is not None]
    bad = r.outcome in BAD_OUTCOMES
    said = "; ".join(_title(f) for f in trouble)
    aside_text = "; ".join(f"{_title(f)} ({_beside_the_point(f, r)})" for f in aside)
    if trouble and bad:
        status, why = CONFIRMED, f"The advisor had warned: {said}."
    elif trouble:
        status, why = NOT_BORNE_OUT, f"The advisor had warned ({said}), yet it did not hurt this run."
    elif bad:
        status = MISSED
        why = (
            f"None of the profile's {fmt} warnings bears on this run's loss: {aside_text}."
            if aside
            else "The advisor's profile gave no warning for this format."
        )
    else:
        status = CONFIRMED
        why = (
            f"As the advisor expected: the profile's {fmt} warnings do not bear on this run's loss: {aside_text}."
            if aside
            else "As the advisor expected (no warning for this format)."
        )
    if trouble and aside:
        why += f" Not about this run's loss: {aside_text}."
    skipped = f" {_steps(r.skipped_steps)} skipped." if r.skipped_steps else ""
    checks = [
        Check(
            status,
            f"Warnings for {r.label}: {outcome_sentence(r, ref, 0)} {why}{skipped}",
            r.label,
            ASPECT_WARNINGS,
        )
    ]
    speed_w = [f for f in given if str(f.get("code", "")) in SPEED_CODES]
    if speed_w:
        q = "; ".join(_title(f) for f in speed_w)
        st = speed_status(r.speedup, _planned_here(rec or {}, ref))
        if st == NOT_MEASURED:
            tail = (
                f"{_ran_at(r, ref)}; {_elsewhere(rec or {})}"
                if r.speedup is not None and math.isfinite(r.speedup)
                else f"no throughput was measured for {r.label} and {ref.label}"
            )
            checks.append(
                Check(
                    NOT_MEASURED,
                    f"Warnings for {r.label}: the advisor had warned: {q}; {tail}.",
                    r.label,
                    ASPECT_SPEED,
                )
            )
        elif st == CONTRADICTED:  # no gain: the speed warning is borne out
            checks.append(
                Check(
                    CONFIRMED,
                    f"Warnings for {r.label}: the advisor had warned: {q}; {_ran_at(r, ref)}, {_short_of_gain(r, ref)}.",
                    r.label,
                    ASPECT_SPEED,
                )
            )
        else:
            checks.append(
                Check(
                    NOT_BORNE_OUT,
                    f"Warnings for {r.label}: the advisor had warned ({q}), yet {_ran_at(r, ref)}, a gain ({_gain()}).",
                    r.label,
                    ASPECT_SPEED,
                )
            )
    return checks


def check_against_runs(runs: Sequence[RunResult], ref: RunResult) -> list[Check]:
    """The advisor's verdict (from the reference run's profile) against what the other runs did."""
    rec = ref.recommendation
    checks: list[Check] = []
    others = [r for r in runs if r is not ref]
    if rec:
        checks += _recommendation_checks(rec, ref, others)
        advised = rec.get("fp16_loss_scale")
        for r in others:
            if r.loss_scale != ADVISED or r.outcome == FAILED:
                continue
            ok = r.outcome in (MATCHED, AHEAD)
            checks.append(
                Check(
                    CONFIRMED if ok else CONTRADICTED,
                    f"Loss scale: the advisor sized fp16's loss scale at init_scale {_fmt_scale(advised)} on the "
                    f"{ref.label} profile; trained with it, {outcome_sentence(r, ref, 0)}",
                    r.label,
                    ASPECT_LOSS_SCALE,
                )
            )
    else:
        checks.append(
            Check(
                NOT_MEASURED,
                f"Loss: the {ref.label} run has no recommendation to check.",
                ref.label,
                ASPECT_LOSS,
            )
        )
    for r in others:
        checks += _warning_checks(rec, r, ref)
    return checks


def analyse(
    runs: Sequence[tuple[Variant, Path]],
    tolerance: float = DEFAULT_TOLERANCE,
    config: Mapping[str, Any] | None = None,
) -> Comparison:
    """Read the runs' directories, classify each against the reference and check the advisor's verdict."""
    if not runs:
        raise UserError("nothing to compare")
    results = [read_run(v, Path(d)) for v, d in runs]
    ref = results[reference_index([v for v, _ in runs])]
    for r in results:
        if r is ref:
            r.outcome, r.gap = (REFERENCE if r.steps else FAILED), 0.0
        else:
            r.outcome, r.gap = classify(r, ref, tolerance)
        if math.isfinite(r.tokens_per_s) and math.isfinite(ref.tokens_per_s) and ref.tokens_per_s > 0:
            r.speedup = r.tokens_per_s / ref.tokens_per_s
    checks = check_against_runs(results, ref)
    lines = [outcome_sentence(r, ref, tolerance) for r in results if r is not ref]
    return Comparison(
        runs=results,
        reference=ref.label,
        tolerance=tolerance,
        checks=checks,
        summary_lines=lines,
        config=dict(config or {}),
        notes=_notes(results, config or {}),
    )


def _notes(runs: Sequence[RunResult], config: Mapping[str, Any]) -> list[str]:
    """Caveats for reading the throughput column."""
    notes = []
    fp16 = [r.label for r in runs if r.precision.startswith("fp16")]
    if fp16 and str(config.get("device", "")).startswith("cpu") and not hardware.cpu_fp16_native():
        notes.append(
            f"This CPU has no fp16 arithmetic (AVX512-FP16 / AMX-FP16): torch emulates it, so the throughput of "
            f"{', '.join(fp16)} says nothing about fp16 on a GPU; its numerics are the real ones."
        )
    ran = [(r.label, r.compiled) for r in runs if r.compiled]
    if ran:
        notes.append(
            "How each run ran: "
            + "; ".join(f"{label} {how}" for label, how in ran)
            + ". Each mode runs as its users run it for speed (fp8 only compiled, by default); the first step, "
            "which compiles, is left out of the throughput."
        )
    return notes
