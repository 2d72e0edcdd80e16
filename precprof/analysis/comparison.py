"""Comparing runs of the same model in several precisions: the variants, each run's figures read from its
run directory, its outcome against the reference run, and the advisor's warnings checked against what the
runs did. Pure and host-side: ``precprof.compare`` trains the runs, ``precprof.report.compare_page`` draws them.

Outcome of a run against the reference: ``diverged`` (non-finite final loss), ``stalled`` (it removed less
than a quarter of the loss the reference removed), ``matched`` (final loss within ``tolerance``, relative),
else ``behind`` or ``ahead``.
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
CONFIRMED, CONTRADICTED, NOT_BORNE_OUT, MISSED, UNCHECKED, OVERRIDDEN = (
    "confirmed",
    "contradicted",
    "not borne out",
    "missed",
    "not checked",
    "overridden by measurement",
)
# the speedup over the reference that overrides the advisor's small-model default (fp32)
SMALL_MODEL_MIN_SPEEDUP = 1.1


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
    settled_scale: float | None  # median loss scale over the final window (scaled runs)
    init_scale: float | None  # the scaler's initial scale (scaled runs)
    memory: dict[str, int]
    memory_total: int
    recommendation: dict[str, Any] | None
    wall_s: float
    report: str | None
    curve_steps: list[int] = field(default_factory=list)
    curve_loss: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Check:
    """One line of the verdict check: what was predicted or observed, and whether the runs bear it out."""

    status: str
    text: str
    run: str | None = None

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
    """Tokens per second of the steps without per-layer capture (all steps if every one was sampled)."""
    if steps.empty:
        return math.nan
    df = steps[np.isfinite(steps[T.TIME_S].astype(float)) & np.isfinite(steps[T.TOKENS].astype(float))]
    plain = df[~df[T.SAMPLED].astype(bool)]
    use = plain if len(plain) >= 3 else df
    if use.empty:
        return math.nan
    t = float(use[T.TIME_S].astype(float).median())
    tok = float(use[T.TOKENS].astype(float).median())
    return tok / t if t > 0 else math.nan


def _memory(summary: Mapping[str, Any]) -> dict[str, int]:
    measured = (summary.get(T.SUMMARY_MEMORY) or {}).get("measured") or {}
    return {str(k): int(v) for k, v in measured.items() if v is not None and k != T.PROFILER_BUFFERS}


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
    scales = steps[T.LOSS_SCALE].astype(float).to_numpy() if not steps.empty else np.array([])
    kind = str(
        cfg.get("loss_scaling") or ("none" if variant.loss_scale in ("auto", "none") else variant.loss_scale)
    )
    settled = None
    if kind != "none" and len(scales):
        s = finite(scales[-win:])
        settled = float(np.median(s)) if len(s) else None
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
        settled_scale=settled,
        init_scale=float(init_scale) if isinstance(init_scale, (int, float)) else None,
        memory=mem,
        memory_total=sum(v for k, v in mem.items() if k not in T.MEMORY_PEAK_COMPONENTS),
        recommendation=summary.get(T.SUMMARY_RECOMMENDATION),
        wall_s=float(final_block.get("wall_s", math.nan) or math.nan),
        report=str(report) if report.exists() else None,
        curve_steps=[int(s) for s in steps[T.STEP]] if not steps.empty else [],
        curve_loss=[float(v) for v in loss],
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


def describe_run(run: RunResult) -> str:
    """``fp16 (dynamic scaling, settled at 2^13)``, ``fp16 without loss scaling``, ``bf16``."""
    fp16 = run.precision.startswith("fp16")
    if run.loss_scaling == "none":
        return f"{run.precision} without loss scaling" if fp16 else run.precision
    if run.loss_scaling == "static":
        return f"{run.precision} at a static loss scale of {_fmt_scale(run.settled_scale)}"
    if run.loss_scale == ADVISED:
        return (
            f"{run.precision} at the advised init_scale {_fmt_scale(run.init_scale)} (dynamic scaling, settled at "
            f"{_fmt_scale(run.settled_scale)})"
        )
    return f"{run.precision} (dynamic scaling, settled at {_fmt_scale(run.settled_scale)})"


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


def predicted_trouble(rec: Mapping[str, Any] | None, run: RunResult) -> list[dict[str, Any]]:
    """Findings of the reference run's advisor that predict trouble for ``run``'s format and scaling.

    fp16 with loss scaling: critical fp16 findings (e.g. gradients no single scale covers) and fp16 overflow
    warnings; fp16 without scaling: also the gradient-underflow warning, which is about scale 1; bf16: bf16
    warnings and criticals; pure modes: their lost-update findings as well.
    """
    fmt = "fp16" if run.precision.startswith("fp16") else "bf16" if run.precision.startswith("bf16") else None
    if fmt is None:
        return []
    out = []
    for f in _findings(rec):
        code, sev = str(f.get("code", "")), str(f.get("severity", "")).lower()
        # a what-if the advisor demoted to information (the verdict is another format) still predicts
        sev = str((f.get("numbers") or {}).get("demoted_from") or sev).lower()
        if not code.startswith(fmt + "_") or sev not in ("warning", "critical"):
            continue
        if code.endswith("lost_updates") and not run.precision.endswith("-pure"):
            continue  # autocast keeps fp32 master weights: lost updates are a what-if there
        if code == "fp16_gradient_underflow" and run.loss_scaling != "none" and sev != "critical":
            continue  # the warning is about scale 1; a scaled run is what it recommends
        out.append(f)
    return out


def check_against_runs(runs: Sequence[RunResult], ref: RunResult) -> list[Check]:
    """The advisor's verdict (from the reference run's profile) against what the other runs did."""
    rec = ref.recommendation
    checks: list[Check] = []
    others = [r for r in runs if r is not ref]
    if rec:
        fmt = str(rec.get("format", ""))
        scale = rec.get("loss_scale") if fmt == "fp16" else None
        said = f"The advisor, on the {ref.label} run's profile, recommends {fmt}" + (
            f" with init_scale {_fmt_scale(float(scale))}" if scale else ""
        )
        family = [r for r in others if r.precision == fmt or (fmt == "fp8" and r.precision == "fp8")]
        if fmt == "fp16":
            family = [r for r in family if r.loss_scaling != "none"] or family
        if fmt in ("fp32", ref.precision):
            checks.append(Check(CONFIRMED, f"{said}: the reference itself.", ref.label))
        elif not family:
            checks.append(
                Check(UNCHECKED, f"{said}; no {fmt} run in this comparison to check it against.", None)
            )
        else:
            for r in family:
                ok = r.outcome in (MATCHED, AHEAD)
                checks.append(
                    Check(
                        CONFIRMED if ok else CONTRADICTED, f"{said}: {outcome_sentence(r, ref, 0)}", r.label
                    )
                )
        # The small-model default (fp32) against the evidence: a run in the format the measurements allow
        # that matched the reference and ran faster overrides it.
        measured = str(rec.get("measured_format") or "")
        if fmt == "fp32" and measured and measured not in ("fp32", "tf32"):
            for r in others:
                if r.precision != measured or r.outcome not in (MATCHED, AHEAD) or r.speedup is None:
                    continue
                faster = r.speedup >= SMALL_MODEL_MIN_SPEEDUP
                checks.append(
                    Check(
                        OVERRIDDEN if faster else CONFIRMED,
                        f"The advisor's default for a model this small is fp32; the measurements allowed {measured}, "
                        f"and the {r.label} run {'matched' if r.outcome == MATCHED else 'beat'} {ref.label} at "
                        f"{r.speedup:.2f}x its speed: "
                        + (
                            f"the measured gain overrides the default, use {measured}."
                            if faster
                            else f"no gain worth it (below {SMALL_MODEL_MIN_SPEEDUP:.2f}x), keep fp32."
                        ),
                        r.label,
                    )
                )
        advised = rec.get("fp16_loss_scale")
        for r in others:
            if r.loss_scale != ADVISED or r.outcome == FAILED:
                continue
            ok = r.outcome in (MATCHED, AHEAD)
            checks.append(
                Check(
                    CONFIRMED if ok else CONTRADICTED,
                    f"The advisor sized fp16's loss scale at init_scale {_fmt_scale(advised)} on the {ref.label} "
                    f"profile; trained with it, {outcome_sentence(r, ref, 0)}",
                    r.label,
                )
            )
    else:
        checks.append(Check(UNCHECKED, f"The {ref.label} run has no recommendation to check.", ref.label))
    for r in others:
        if r.outcome in (FAILED, REFERENCE):
            checks.append(Check(UNCHECKED, outcome_sentence(r, ref, 0), r.label))
            continue
        trouble = predicted_trouble(rec, r)
        bad = r.outcome in BAD_OUTCOMES
        said = "; ".join(str(f.get("title", f.get("code"))) for f in trouble)
        if trouble and bad:
            status, why = CONFIRMED, f"the advisor had warned: {said}."
        elif trouble:
            status, why = NOT_BORNE_OUT, f"the advisor had warned ({said}), yet it did not hurt this run."
        elif bad:
            status, why = MISSED, "the advisor's profile gave no warning for this format."
        else:
            status, why = CONFIRMED, "as the advisor expected (no warning for this format)."
        skipped = (
            f" {r.skipped_steps} skipped step{'s' if r.skipped_steps != 1 else ''}."
            if r.skipped_steps
            else ""
        )
        checks.append(
            Check(status, f"{outcome_sentence(r, ref, 0)} {why[0].upper() + why[1:]}{skipped}", r.label)
        )
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
    return notes
