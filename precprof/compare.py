"""``precprof compare``: train the same model on the same data from the same seed once per precision, then
check the runs against each other and against what the advisor said.

``compare(base, ["fp32", "bf16", "fp16", "fp16:none"])`` runs ``precprof.training.train`` once per variant (a
precision mode, optionally with a loss scaling spec after a colon: ``fp16:none``, ``fp16:static:8192``, or
``fp16:advised`` — dynamic scaling from the init_scale the advisor recommends on the reference run, which
therefore trains first), each in its own run directory with its own report, then writes ``compare.json`` and
``compare.html`` next to them:

- loss curves overlaid, and each run's loss relative to the reference run (fp32 when it is in the list,
  else the first variant), smoothed;
- per run: the final loss (mean of the last tenth of the steps, at least 5) and its gap to the reference,
  throughput (tokens per second of the steps without per-layer capture, so that profiling does not count), the
  loss scale where the dynamic scaler settled, skipped steps, memory per component (the last sampled step's
  measured totals), and the run's own report;
- the verdict check: the advisor's recommendation and its per-format warnings, taken from the reference run's
  profile, set against what the other runs actually did ("fp16 (dynamic scaling, settled at 2^13) matched fp32
  within 0.4%"; "fp16 without loss scaling stalled: the advisor had flagged 38% of activation gradients
  underflowing at scale 1").

Outcome of a run against the reference: ``diverged`` (non-finite final loss), ``stalled`` (it removed less
than a quarter of the loss the reference removed), ``matched`` (final loss within ``tolerance``, relative),
else ``behind`` or ``ahead``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from precprof import _atomic, _signals, rundir
from precprof import tables as T
from precprof.errors import UserError

REFERENCE_PREFERENCE = ("fp32", "tf32")
DEFAULT_TOLERANCE = 0.02  # relative final-loss gap within which a run "matched" the reference
STALL_PROGRESS = 0.25  # a run that removed less than this share of the reference's loss decrease "stalled"
ADVISED = "advised"  # loss scaling spec: dynamic, from the init_scale the advisor gave on the reference run
COMPARE_JSON = "compare.json"
COMPARE_HTML = "compare.html"
TEMPLATE = "compare.html.j2"

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
CONFIRMED, CONTRADICTED, NOT_BORNE_OUT, MISSED, UNCHECKED = (
    "confirmed",
    "contradicted",
    "not borne out",
    "missed",
    "not checked",
)

_PRECISION_COLORS = {
    "fp32": "#1f4e79",
    "tf32": "#5b8db8",
    "bf16": "#ff7f0e",
    "bf16-pure": "#b35806",
    "fp16": "#d62728",
    "fp16-pure": "#8c1515",
    "fp8": "#9467bd",
}
_LINESTYLES = ("-", "--", ":", "-.")


# ------------------------------------------------------------------------------------------- variants
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
    from precprof.modes import PRECISIONS
    from precprof.training import parse_loss_scale

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


def _variants(precisions: str | Sequence[str] | Sequence[Variant]) -> list[Variant]:
    if not isinstance(precisions, str) and precisions and all(isinstance(p, Variant) for p in precisions):
        variants = [p for p in precisions if isinstance(p, Variant)]
        if len(variants) < 2:
            raise UserError("give at least two precisions to compare")
        return variants
    return parse_precisions([str(p) for p in precisions] if not isinstance(precisions, str) else precisions)


def reference_index(variants: Sequence[Variant]) -> int:
    """The run the others are compared with: fp32 (then tf32) with default scaling, else the first."""
    for name in REFERENCE_PREFERENCE:
        for i, v in enumerate(variants):
            if v.precision == name:
                return i
    return 0


# ------------------------------------------------------------------------------------------- analysis
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


def _window(n: int) -> int:
    return max(5, n // 10) if n else 0


def _finite(values: np.ndarray) -> np.ndarray:
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
    win = _window(len(loss))
    tail = _finite(loss[-win:]) if win else np.array([])
    bad = np.nonzero(~np.isfinite(loss))[0]
    # a run that went non-finite at its end has no meaningful final loss
    final = float(tail.mean()) if len(tail) and np.isfinite(loss[-1]) else math.nan
    first = _finite(loss[:1])
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    scales = steps[T.LOSS_SCALE].astype(float).to_numpy() if not steps.empty else np.array([])
    kind = str(
        cfg.get("loss_scaling") or ("none" if variant.loss_scale in ("auto", "none") else variant.loss_scale)
    )
    settled = None
    if kind != "none" and len(scales):
        s = _finite(scales[-win:])
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
    from precprof import hardware

    notes = []
    fp16 = [r.label for r in runs if r.precision.startswith("fp16")]
    if fp16 and str(config.get("device", "")).startswith("cpu") and not hardware.cpu_fp16_native():
        notes.append(
            f"This CPU has no fp16 arithmetic (AVX512-FP16 / AMX-FP16): torch emulates it, so the throughput of "
            f"{', '.join(fp16)} says nothing about fp16 on a GPU; its numerics are the real ones."
        )
    return notes


# ------------------------------------------------------------------------------------------- running
def compare(
    base: Any,
    precisions: str | Sequence[str] | Sequence[Variant],
    out: str | Path | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    on_run: Callable[[Variant, Path], None] | None = None,
) -> Comparison:
    """Train ``base`` (a ``precprof.training.TrainConfig``) once per precision and write the comparison.

    Every variant is checked before anything trains (unknown mode, a mode this device cannot run: UserError).
    A run that raises is recorded as failed and the others still run; Ctrl-C writes the comparison of the
    runs so far and re-raises. Returns the ``Comparison``; ``compare.html`` and ``compare.json`` are in ``out``
    (default ``runs/compare-<model>-<timestamp>``), each run in ``out/<label>/``.
    """
    from precprof import hardware, training

    variants = _variants(precisions)
    base.validate()
    device = training.resolve_device(base.device)
    hw = hardware.detect(device)
    for v in variants:
        training.plan_precision(v.precision, device, hw)
    if out is None:
        stem = training.default_out_dir(base).name.replace(f"-{base.precision}-", "-")
        out = Path("runs") / f"compare-{stem}"
    out = Path(out)
    for v in variants:  # every run directory is usable before the first run trains
        rundir.check_target(out / v.label, overwrite=base.overwrite, option="--out")
    out.mkdir(parents=True, exist_ok=True)
    sample_every = (
        base.sample_every if base.sample_every is not None else training.default_sample_every(base.steps)
    )
    done: list[tuple[Variant, Path]] = []
    t0 = time.perf_counter()
    shared = {
        k: v
        for k, v in base.to_dict().items()
        if k not in ("precision", "loss_scale", "out", "progress", "report", "refresh_every")
    }
    shared["sample_every"] = sample_every
    shared["device"] = str(device)
    shared["precisions"] = [v.label for v in variants]
    ref_i = reference_index(variants)
    # the reference trains first: "advised" variants take their loss scale from its recommendation
    run_order = [ref_i] + [i for i in range(len(variants)) if i != ref_i]
    try:
        for i in run_order:
            v = variants[i]
            run_dir = out / v.label
            cfg = dataclasses.replace(
                base, precision=v.precision, loss_scale=v.loss_scale, out=run_dir, sample_every=sample_every
            )
            if v.loss_scale == ADVISED:
                cfg = _advised_config(cfg, out / variants[ref_i].label)
            try:
                training.train(cfg)
            except UserError:
                raise
            except Exception as e:  # keep going: a failed precision is a result too
                if not T.is_run_dir(run_dir):
                    T.write_summary(
                        run_dir,
                        {
                            T.SUMMARY_STATUS: T.STATUS_INCOMPLETE,
                            T.SUMMARY_INCOMPLETE_REASON: f"{type(e).__name__}: {e}",
                        },
                    )
            done.append((v, run_dir))
            if on_run is not None:
                on_run(v, run_dir)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the run in progress saved itself; compare the rest
        with _signals.deferred():  # a second Ctrl-C does not cut compare.html short
            _signals.consume()
            if done:
                _finish(done, variants, tolerance, shared, t0, out)
                with contextlib.suppress(AttributeError):  # for the CLI's message
                    e.precprof_compare_html = out / COMPARE_HTML  # type: ignore[attr-defined]
        raise
    if not done:
        raise UserError("no run finished: nothing to compare")
    return _finish(done, variants, tolerance, shared, t0, out)


def _finish(
    done: list[tuple[Variant, Path]],
    variants: Sequence[Variant],
    tolerance: float,
    shared: dict[str, Any],
    t0: float,
    out: Path,
) -> Comparison:
    """Analyse the runs in ``done`` (in the order of ``variants``) and write compare.json and compare.html."""
    done = sorted(done, key=lambda d: variants.index(d[0]))
    comparison = analyse(done, tolerance, shared)
    comparison.wall_s = time.perf_counter() - t0
    write(comparison, out)
    return comparison


def _advised_config(cfg: Any, ref_dir: Path) -> Any:
    """``cfg`` with dynamic loss scaling starting at the init_scale (and growth interval) the advisor recommends
    on the reference run; the defaults when the reference has no recommendation."""
    rec = T.read_summary(ref_dir).get(T.SUMMARY_RECOMMENDATION) or {}
    scale = rec.get("fp16_loss_scale")
    interval = rec.get("growth_interval")
    return dataclasses.replace(
        cfg,
        loss_scale="dynamic",
        init_scale=float(scale) if isinstance(scale, (int, float)) and scale > 0 else cfg.init_scale,
        growth_interval=int(interval) if isinstance(interval, int) and interval > 0 else cfg.growth_interval,
    )


def write(comparison: Comparison, out: str | Path) -> Path:
    """Write ``compare.json`` and ``compare.html`` into ``out``; returns the HTML path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic.write_text(
        out / COMPARE_JSON, json.dumps(comparison.to_dict(), indent=2, default=str, allow_nan=True) + "\n"
    )
    return _atomic.write_text(out / COMPARE_HTML, render(comparison, base_dir=out))


# ------------------------------------------------------------------------------------------- figures
def _style(run: RunResult, i: int) -> tuple[str, str]:
    color = _PRECISION_COLORS.get(run.precision, "#555555")
    same = 0 if run.loss_scale == "auto" else 1 + (i % (len(_LINESTYLES) - 1))
    return color, _LINESTYLES[same]


def _smooth(y: np.ndarray, w: int) -> np.ndarray:
    if w <= 1 or len(y) < 3:
        return y
    s = pd.Series(y).rolling(w, min_periods=1, center=True).mean()
    return s.to_numpy(dtype=float)


def loss_figure(comparison: Comparison) -> Any:
    """Loss curves overlaid (raw, faint; smoothed, solid) and each run's smoothed loss relative to the reference."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = Figure(figsize=(13.5, 4.0))
    ax_loss, ax_rel = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.055, right=0.99, top=0.9, bottom=0.14, wspace=0.2)
    ref = comparison.run(comparison.reference)
    n = max((len(r.curve_loss) for r in comparison.runs), default=0)
    w = max(1, n // 25)
    ref_s = _smooth(np.asarray(ref.curve_loss, dtype=float), w)
    ref_steps = np.asarray(ref.curve_steps)
    finite_all: list[float] = []
    # the reference last and thinnest, on top of wider lines: curves that coincide all stay visible
    order = [i for i, r in enumerate(comparison.runs) if r is not ref] + [comparison.runs.index(ref)]
    for i in order:
        r = comparison.runs[i]
        if not r.curve_loss:
            continue
        x = np.asarray(r.curve_steps, dtype=float)
        y = np.asarray(r.curve_loss, dtype=float)
        color, ls = _style(r, i)
        width = 1.3 if r is ref else 2.6
        ax_loss.plot(x, y, color=color, lw=0.7, alpha=0.3, ls=ls)
        ys = _smooth(y, w)
        ax_loss.plot(x, ys, color=color, lw=width, ls=ls, label=r.label, zorder=3 if r is ref else 2)
        finite_all.extend(_finite(y).tolist())
        bad = ~np.isfinite(y)
        if bad.any():
            ax_loss.plot(
                x[bad][:1], [np.nanmax(_finite(y))] if np.isfinite(y).any() else [0], "X", color=color, ms=9
            )
        if r is not ref and len(ref_s):
            m = min(len(ys), len(ref_s))
            if m and np.array_equal(x[:m], ref_steps[:m]):
                rel = (ys[:m] - ref_s[:m]) / np.abs(ref_s[:m])
                ax_rel.plot(x[:m], rel, color=color, lw=1.6, ls=ls, label=r.label)
    if finite_all:
        lo, hi = np.percentile(finite_all, 0.5), np.percentile(finite_all, 99.5)
        pad = 0.05 * (hi - lo if hi > lo else 1.0)
        ax_loss.set_ylim(lo - pad, hi + pad)
    ax_loss.set_title(
        f"Training loss (faint: per step; solid: {w}-step moving average)" if w > 1 else "Training loss"
    )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    handles, labels = ax_loss.get_legend_handles_labels()
    by_label = dict(zip(labels, handles, strict=True))
    ax_loss.legend(
        [by_label[r.label] for r in comparison.runs if r.label in by_label],
        [r.label for r in comparison.runs if r.label in by_label],
        frameon=False,
        fontsize=9,
    )
    tol = comparison.tolerance
    ax_rel.axhspan(-tol, tol, color="#2ca02c", alpha=0.12, lw=0, label=f"±{tol:.0%}: matched")
    ax_rel.axhline(0, color=_PRECISION_COLORS.get(ref.precision, "#1f4e79"), lw=1.2)
    ax_rel.set_title(f"Loss relative to {ref.label} (smoothed)")
    ax_rel.set_xlabel("step")
    ax_rel.set_ylabel(f"(loss − {ref.label}) / {ref.label}")
    ax_rel.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{100 * v:+.2g}%" if v else "0%"))
    ax_rel.legend(frameon=False, fontsize=9)
    for a in (ax_loss, ax_rel):
        a.grid(True, alpha=0.3)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def resources_figure(comparison: Comparison) -> Any | None:
    """Memory per component (stacked bars, measured on the last sampled step) and throughput, per run."""
    from matplotlib.figure import Figure

    from precprof.report.plots import COMPONENT_COLORS

    runs = [r for r in comparison.runs if r.memory or math.isfinite(r.tokens_per_s)]
    if not runs:
        return None
    comps = [c for c in COMPONENT_COLORS if any(r.memory.get(c) for r in runs)]
    comps += sorted(
        {c for r in runs for c in r.memory if c not in comps and c not in T.MEMORY_PEAK_COMPONENTS}
    )
    height = 1.7 + 0.5 * len(runs)  # inches: bars plus fixed room for titles, axis labels and the legend
    fig = Figure(figsize=(13.5, height))
    ax_mem, ax_tp = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    fig.subplots_adjust(left=0.09, right=0.99, top=1 - 0.4 / height, bottom=1.05 / height, wspace=0.12)
    labels = [r.label for r in runs]
    y = np.arange(len(runs))[::-1]
    biggest = max((r.memory_total for r in runs), default=0)
    div, unit = (2**30, "GiB") if biggest >= 2**30 else (2**20, "MiB") if biggest >= 2**20 else (2**10, "KiB")
    left = np.zeros(len(runs))
    others = ("#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
    for j, c in enumerate(comps):
        vals = np.array([r.memory.get(c, 0) for r in runs], dtype=float) / div
        ax_mem.barh(
            y,
            vals,
            left=left,
            color=COMPONENT_COLORS.get(c, others[j % len(others)]),
            label=c.replace("_", " "),
        )
        left += vals
    for yi, tot in zip(y, left, strict=True):
        ax_mem.text(tot, yi, f" {tot:.3g} {unit}", va="center", fontsize=9)
    ax_mem.set_yticks(y, labels)
    ax_mem.set_xlim(0, max(left.max() * 1.18, 1e-9) if len(left) else 1)
    ax_mem.set_xlabel(unit)
    ax_mem.set_title("Memory per component (last sampled step)")
    fig.legend(
        *ax_mem.get_legend_handles_labels(),
        loc="lower left",
        bbox_to_anchor=(0.09, 0.0),
        ncol=min(len(comps), 7),
        frameon=False,
        fontsize=9,
    )
    tps = np.array([r.tokens_per_s if math.isfinite(r.tokens_per_s) else 0 for r in runs])
    ax_tp.barh(y, tps, color=[_style(r, i)[0] for i, r in enumerate(runs)])
    for yi, v, r in zip(y, tps, runs, strict=True):
        sp = (
            f" ({r.speedup:.2f}×)"
            if r.speedup is not None and r is not comparison.run(comparison.reference)
            else ""
        )
        ax_tp.text(v, yi, f" {v:,.0f}{sp}", va="center", fontsize=9)
    ax_tp.set_yticks(y, [""] * len(runs))
    ax_tp.set_xlim(0, max(tps.max() * 1.45, 1))
    ax_tp.set_xlabel("tokens / s")
    ax_tp.set_title("Throughput (steps without layer capture)")
    for a in (ax_mem, ax_tp):
        a.grid(True, axis="x", alpha=0.3)
    return fig


# ------------------------------------------------------------------------------------------- page
def _img(fig: Any, alt: str) -> dict[str, str] | None:
    if fig is None:
        return None
    from precprof.report.plots import data_uri, png_bytes

    return {"src": data_uri(png_bytes(fig)), "alt": alt}


def _rel(path: str | None, base_dir: Path | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if base_dir is not None:
        try:
            return p.resolve().relative_to(base_dir.resolve()).as_posix()
        except ValueError:
            pass
    return p.resolve().as_uri()


def render(comparison: Comparison, base_dir: Path | None = None) -> str:
    """The comparison page (HTML string): the report's look (its CSS and number filters), autoescaped."""
    import precprof
    from precprof.report.plots import COMPONENT_COLORS
    from precprof.report.render import environment

    ref = comparison.run(comparison.reference)
    comps = [c for c in COMPONENT_COLORS if any(r.memory.get(c) for r in comparison.runs)]
    comps += sorted({c for r in comparison.runs for c in r.memory if c not in comps})
    runs = []
    for r in comparison.runs:
        d = r.to_dict()
        d["report_href"] = _rel(r.report, base_dir)
        d["dir_href"] = _rel(r.run_dir, base_dir)
        d["rec_format"] = (r.recommendation or {}).get("format")
        d["described"] = describe_run(r)
        runs.append(d)
    cfg = comparison.config
    title = f"{cfg.get('model', 'model')} · {', '.join(r.label for r in comparison.runs)}"
    ctx = {
        "version": precprof.__version__,
        "title": title,
        "generated": time.strftime("%Y-%m-%d %H:%M"),
        "reference": ref.label,
        "tolerance": comparison.tolerance,
        "summary_lines": comparison.summary_lines,
        "checks": [c.to_dict() for c in comparison.checks],
        "runs": runs,
        "components": comps,
        "loss_img": _img(
            loss_figure(comparison), "loss curves of every run overlaid, and relative to the reference"
        ),
        "resources_img": _img(resources_figure(comparison), "memory per component and throughput per run"),
        "config": {k: v for k, v in cfg.items() if k != "command_line" and (k != "model_args" or v)},
        "notes": comparison.notes,
        "command": cfg.get("command_line"),
        "wall_s": comparison.wall_s,
    }
    return str(environment().get_template(TEMPLATE).render(**ctx))
