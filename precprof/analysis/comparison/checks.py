"""The verdict check: the advisor's recommendation and per-format warnings, given on the reference run's profile,
against what the other runs did.

Every sentence states what the run directories measured: a format is "confirmed" on speed only when its run
reached ``SMALL_MODEL_MIN_SPEEDUP`` times the reference's throughput on the machine the advisor planned for
(``speed_status`` holds that rule), neither run in a format that machine emulates, and an fp32 verdict's loss
and speed only against an fp32 (or tf32) reference (``no_full_precision``); the warnings quoted are those the reference
profile's advisor gave.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from precprof.analysis.comparison.runs import (
    ADVISED,
    AHEAD,
    BAD_OUTCOMES,
    DIVERGED,
    FAILED,
    MATCHED,
    PRECISION_UNKNOWN,
    PRECISION_UNKNOWN_WHY,
    REFERENCE,
    UNRECORDED,
    RunResult,
    cut_short,
    no_steps_file,
    recorded_no_loss,
    unusable,
)
from precprof.analysis.comparison.wording import _fmt_scale, _steps, and_list, outcome_sentence

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
    "speed on a machine other than this one, the speed of a format emulated where it ran (fp16 on a CPU without "
    "fp16 arithmetic), an fp32 verdict's loss or speed without an fp32 run, a run trained otherwise than the reference "
    "besides its precision, a run or reference whose precision is not recorded (no sampled step), an fp16 run without the loss scaling the advice gives it, a reference that did not "
    "train, a run without summary.json, or a run that stopped early or is compared short of its end (runs of "
    "different lengths)",
    OVERRIDDEN: "the advisor's fp32 default for a small model, against a run in the format its measurements "
    f"allowed that matched and reached {_GAIN}",
}
# aspects a check covers
ASPECT_LOSS, ASPECT_SPEED, ASPECT_LOSS_SCALE, ASPECT_WARNINGS = "loss", "speed", "loss scale", "warnings"
# finding codes about a format's speed on the target, not about its numerics
SPEED_CODES = frozenset({"bf16_emulated", "bf16_unsupported", "fp8_library_missing"})


@dataclass
class Check:
    """One line of the verdict check: what was predicted or observed, and whether the runs bear it out."""

    status: str
    text: str
    run: str | None = None
    aspect: str = ASPECT_LOSS  # what the line checks: loss, speed, loss scale or warnings

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _findings(rec: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list((rec or {}).get("findings") or [])


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
    # (fp32_lost_updates is measured in the run's own fp32 weights: to the point)
    if code in ("bf16_lost_updates", "fp16_lost_updates") and not run.precision.endswith("-pure"):
        return "about weights held in that format; this run kept fp32 master weights"
    if code == "fp16_gradient_underflow" and run.loss_scaling != "none" and sev != "critical":
        return "about fp16 at loss scale 1; this run scaled its loss"
    return None


def _scaling_not_followed(
    rec: Mapping[str, Any] | None, r: RunResult, quoted: frozenset[str] = frozenset()
) -> str:
    """Where ``r`` is an fp16 run that scaled no loss and the reference profile's fp16 advice scales it (a
    GradScaler started at the scale it sized; fp16 not ruled out), that advice in words, with what the profile
    found at scale 1 unless the sentence it joins quotes that finding already (its code in ``quoted``); ""
    otherwise. Such a run checks no warning of the advice: what it does at scale 1 is what the advice avoids, and
    its loss can match in a short run while its gradients flush."""
    scale = (rec or {}).get("fp16_loss_scale")
    if _family(r.precision) != "fp16" or r.loss_scaling != "none" or (rec or {}).get("fp16_ruled_out"):
        return ""
    if not isinstance(scale, (int, float)) or scale <= 1:
        return ""
    code = "fp16_gradient_underflow"
    under = [] if code in quoted else [_title(f) for f in _findings(rec) if f.get("code") == code]
    return (
        f"This run scaled no loss; the advisor's fp16 advice scales it (GradScaler at init_scale {_fmt_scale(scale)}"
        + (f"; the profile found {under[0]}" if under else "")
        + ")"
    )


def _own_warnings(r: RunResult) -> str:
    """The warnings (and criticals) ``r``'s own profile gave for its format, quoted as a sentence ("" for none)."""
    fmt = _family(r.precision)
    own = [_title(f) for f in format_warnings(r.recommendation, fmt)] if fmt else []
    return (
        f" Its own profile warned: {'; '.join(own)}." if own else " Its own profile gave no warning for it."
    )


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


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _title(f: Mapping[str, Any]) -> str:
    return str(f.get("title") or f.get("code"))


def not_isolated(r: RunResult, ref: RunResult) -> str:
    """Why ``r``'s outcome against ``ref`` says nothing of its precision, in words ("" when it does): the
    reference did not train (``RunResult.did_not_train``), either has no summary.json (what it trained is not
    recorded), ``r`` trained with other settings than the reference besides its precision
    (``RunResult.setup_differs``: another optimizer, learning rate, seed...), or either is not a whole run
    (``cut_short``: it stopped early, or runs of different lengths are compared on their first steps) and ``r``
    did not diverge.
    A run of bf16 at a learning rate of 20 diverged, and the check said the advisor had missed it."""
    if ref.did_not_train:
        return reference_did_not_train(ref)
    unrecorded = [x.label for x in (r, ref) if x.status == UNRECORDED]
    if unrecorded:
        return (
            f"{and_list(unrecorded)} has no summary.json: the precision, model and settings it trained with are "
            "not recorded"
        )
    if r.setup_differs:
        return (
            f"this comparison does not isolate precision for {r.label}: its {and_list(r.setup_differs)} "
            f"differ from {ref.label}'s"
        )
    short = cut_short(r, ref)
    if (
        short and r.outcome != DIVERGED
    ):  # a loss that went non-finite in the steps it ran diverged all the same
        return f"not whole runs: {short}; a loss short of a run's end is not the loss it ends at"
    return ""


def reference_did_not_train(ref: RunResult) -> str:
    """That the reference did not train, and why, in the words of the check lines."""
    return f"the reference, {ref.label}, {unusable(ref)} ({ref.did_not_train})"


def no_loss(r: RunResult) -> bool:
    """Whether ``r`` has no loss to check anything by: it failed, its steps table is missing (a run whose
    steps.parquet was deleted was called failed, beside its status "complete"), or its loop passed no loss."""
    return r.outcome == FAILED or no_steps_file(r) or recorded_no_loss(r)


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


# the references an fp32 or tf32 verdict's speed is measured against: a run's gain over a bf16 reference is no
# gain over fp32
_FULL_PRECISION = ("fp32", "tf32")


def speed_unjudged(r: RunResult, ref: RunResult, fmt: str) -> str:
    """Why ``r``'s speed against ``ref`` neither confirms nor contradicts a recommendation of ``fmt``, in words
    ("" when it may): for an fp32 (or tf32) recommendation, a reference in neither (no fp32 run compared: bf16 is
    the reference for want of one); and a run or reference whose format the machine emulates
    (``RunResult.emulated``). Two runs, bf16 and an fp16 emulated on a CPU, had "confirmed" keeping fp32 from
    fp16 at 1.06x bf16's throughput, and "contradicted" it from a noisy 1.52x. A run or reference whose precision
    is not recorded (``PRECISION_UNKNOWN``) measures no format's speed either."""
    unknown = [x.label for x in (r, ref) if x.precision == PRECISION_UNKNOWN]
    why = [
        no_full_precision(ref, fmt, "speed"),
        *(x.emulated for x in (r, ref)),
        f"the precision{'s' if len(unknown) > 1 else ''} {and_list(unknown)} trained in "
        f"{'are' if len(unknown) > 1 else 'is'} not recorded "
        f"({PRECISION_UNKNOWN_WHY})"
        if unknown
        else "",
    ]
    return "; ".join(w for w in why if w)


def no_full_precision(ref: RunResult, fmt: str, what: str) -> str:
    """Why an fp32 (or tf32) recommendation's ``what`` ("loss", "speed") is not measured against ``ref``, in
    words ("" when it is): ``ref`` is in neither, so the comparison has no fp32 or tf32 run (the reference is
    fp32, then tf32, wherever one is). How the other formats fared against a bf16 reference says nothing of
    fp32's: fp16 behind bf16 had "confirmed" keeping fp32 on loss with no fp32 run."""
    if fmt not in _FULL_PRECISION or ref.precision in _FULL_PRECISION:
        return ""
    return (
        f"this comparison has no fp32 or tf32 run, so no {what} of {fmt} was measured ({ref.label} is the "
        "reference for want of one)"
    )


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
    contradicts it. That no run in another format matched the reference confirms only a recommendation of the
    reference's own format, or of fp32 (tf32) against an fp32 (tf32) reference (``no_full_precision``)."""
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
    done = [r for r in others if not no_loss(r) and r.outcome != REFERENCE]
    if fmt in ("fp32", "tf32", ref.precision):
        # a run in the reference's own precision, or in the recommended one, is no rival format: what its loss
        # and speed differ by is the machine, the seed or the run, not a format (a rerun of an fp32 run on a
        # quieter machine ran 1.5x faster and "contradicted" the fp32 recommendation)
        # a run whose precision is not recorded (``PRECISION_UNKNOWN``) is no rival either: it may have trained in
        # the reference's format (two fp32 runs, one of sample_every=0, had "confirmed" keeping fp32 at 0.88x)
        same = [r for r in done if r.precision in (ref.precision, fmt, PRECISION_UNKNOWN)]
        done = [r for r in done if r not in same]
        finished = [r for r in done if not not_isolated(r, ref)]
        apart = [_sentence(w) + "." for w in dict.fromkeys(not_isolated(r, ref) for r in done) if w]
        measured = str(rec.get("measured_format") or "")
        small = bool(measured) and measured not in ("fp32", "tf32", fmt)
        lead = (
            f"the advisor's default for a model this small is {fmt}; the measurements allowed {measured}"
            if small
            else said
        )
        rivals = [r for r in finished if r.outcome in (MATCHED, AHEAD)]
        if not finished:
            if same and apart:
                why = f"{_same_format(same, ref, fmt)}; no run in another format sets it against precision alone."
            elif same:
                why = f"no run in this comparison sets another format against it: {_same_format(same, ref, fmt)}."
            elif apart:
                why = "no other run sets it against precision alone."
            else:
                why = f"{_nothing_against(others)}."
            checks.append(
                Check(
                    NOT_MEASURED,
                    " ".join([f"Loss: {lead}; {why}", *apart]),
                    ref.label,
                    ASPECT_LOSS,
                )
            )
        elif not rivals and no_full_precision(ref, fmt, "loss"):
            names = and_list([r.label for r in finished])
            checks.append(
                Check(
                    NOT_MEASURED,
                    " ".join(
                        [
                            f"Loss: {lead}; {no_full_precision(ref, fmt, 'loss')}: that {names} did not match "
                            f"{ref.label}'s loss says nothing of {fmt}'s.",
                            *apart,
                        ]
                    ),
                    ref.label,
                    ASPECT_LOSS,
                )
            )
        elif not rivals:
            names = ", ".join(r.label for r in finished)
            # confirmed only when every run in another format was set against it: a run compared short of its end
            # (bf16, cut to the step a dead fp16 run reached) may match it yet
            unset = [r.label for r in done if r not in finished]
            checks.append(
                Check(
                    NOT_MEASURED if unset else CONFIRMED,
                    " ".join(
                        [
                            f"Loss: {lead}; no run in another format matched {ref.label}'s loss ({names})"
                            + (f", and {', '.join(unset)} cannot tell." if unset else "."),
                            *apart,
                        ]
                    ),
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
                        f"Speed: {lead}; the {r.label} run {did} {ref.label}'s loss, and {_unmeasured(r, ref)}.",
                        r.label,
                        ASPECT_SPEED,
                    )
                )
                continue
            head = (
                f"Speed: {lead}; the {r.label} run {did} {ref.label}'s loss and {_ran_at(r, ref, who=False)}"
            )
            unjudged = speed_unjudged(r, ref, fmt)
            st = NOT_MEASURED if unjudged else speed_status(r.speedup, here)
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
                checks.append(
                    Check(NOT_MEASURED, f"{head}; {unjudged or _elsewhere(rec)}.", r.label, ASPECT_SPEED)
                )
        for r in same:
            if r.speedup is not None and math.isfinite(r.speedup):
                checks.append(
                    Check(
                        NOT_MEASURED,
                        f"Speed: {lead}; {_same_format([r], ref, fmt)}: its {r.speedup:.2f}x {ref.label}'s "
                        + (
                            "throughput is no known format's gain."
                            if r.precision == PRECISION_UNKNOWN
                            else "throughput is the machine's or the run's, no format's gain."
                        ),
                        r.label,
                        ASPECT_SPEED,
                    )
                )
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
        if no_loss(r) or not_isolated(r, ref):
            why = f" {_sentence(not_isolated(r, ref))}." if not no_loss(r) else ""
            checks.append(
                Check(NOT_MEASURED, f"Loss: {said}: {outcome_sentence(r, ref, 0)}{why}", r.label, ASPECT_LOSS)
            )
            continue
        ok = r.outcome in (MATCHED, AHEAD)
        unscaled = _scaling_not_followed(rec, r)
        checks.append(
            Check(
                NOT_MEASURED if unscaled else CONFIRMED if ok else CONTRADICTED,
                f"Loss: {said}: {outcome_sentence(r, ref, 0)}"
                + (f" {unscaled}, so this run does not check it." if unscaled else ""),
                r.label,
                ASPECT_LOSS,
            )
        )
        unjudged = speed_unjudged(r, ref, fmt)
        st = NOT_MEASURED if unjudged else speed_status(r.speedup, here)
        if r.speedup is None or not math.isfinite(r.speedup):
            text = f"Speed: {_unmeasured(r, ref)}."
        elif st == CONFIRMED:
            text = f"Speed: {_ran_at(r, ref)}, a gain ({_gain()})."
        elif st == CONTRADICTED:
            text = (
                f"Speed: {_ran_at(r, ref)}, the machine the advisor planned for: {_short_of_gain(r, ref)}, not the "
                f"gain recommending {fmt} assumes ({_gain()})."
            )
        else:
            text = f"Speed: {_ran_at(r, ref)}; {unjudged or _elsewhere(rec)}."
        checks.append(Check(st, text, r.label, ASPECT_SPEED))
    return checks


def _same_format(runs: Sequence[RunResult], ref: RunResult, fmt: str) -> str:
    """That ``runs`` trained in the reference's own precision, or in the recommended ``fmt``, in words."""
    parts = []
    for prec in dict.fromkeys(r.precision for r in runs):
        names = and_list([r.label for r in runs if r.precision == prec])
        if prec == PRECISION_UNKNOWN:  # not "b trained in unknown, as a did"
            many = sum(r.precision == prec for r in runs) > 1
            parts.append(
                f"the precision{'s' if many else ''} {names} trained in {'are' if many else 'is'} not recorded "
                f"({PRECISION_UNKNOWN_WHY})"
                + (f", nor is {ref.label}'s" if ref.precision == PRECISION_UNKNOWN else "")
            )
            continue
        whose = f"as {ref.label} did" if prec == ref.precision else "the format recommended"
        parts.append(f"{names} trained in {prec}, {whose}")
    return "; ".join(parts)


def _nothing_against(others: Sequence[RunResult]) -> str:
    """Why no other run is set against the reference: none finished, or (named) their steps table is missing."""
    unread = [r.label for r in others if no_steps_file(r)]
    unpassed = [r.label for r in others if recorded_no_loss(r)]
    whys = [
        f"{and_list(unread)}: no steps.parquet in its run directory" if unread else "",
        f"{and_list(unpassed)}: its loop called prof.step() without loss=" if unpassed else "",
    ]
    if unread or unpassed:
        return f"no other run has a loss to set against it ({'; '.join(w for w in whys if w)})"
    return "no other run finished to set it against"


def _unmeasured(r: RunResult, ref: RunResult) -> str:
    """Why there is no speed of ``r`` against ``ref``, in words (``RunResult.speed_not_taken``)."""
    return r.speed_not_taken or f"no throughput was measured for {r.label} and {ref.label}"


# the critical finding that only says a run diverged: the comparison's outcome already says so
_RESTATES_OUTCOME = frozenset({"run_diverged"})


def own_diagnosis(r: RunResult) -> str:
    """The title of the first critical finding of ``r``'s own profile that says more than that it diverged,
    as a sentence ("" when it has none): a run that went wrong may have been told why by its own profile (a nan
    that came from the loss, outside the model), which the reference profile's warnings do not know."""
    for f in _findings(r.recommendation):
        sev = str(f.get("severity", "")).lower()
        if sev == "critical" and str(f.get("code", "")) not in _RESTATES_OUTCOME:
            return f" Its own profile's critical finding: {_title(f)}."
    return ""


def _warning_checks(rec: Mapping[str, Any] | None, r: RunResult, ref: RunResult) -> list[Check]:
    """The reference profile's warnings for ``r``'s format, quoted as the advisor gave them, against what ``r``
    did: its loss (warnings that bear on it) and its speed (warnings about speed)."""
    if no_loss(r) or r.outcome == REFERENCE:
        return [Check(NOT_MEASURED, f"Warnings: {outcome_sentence(r, ref, 0)}", r.label, ASPECT_WARNINGS)]
    apart = not_isolated(r, ref)
    if apart:
        return [
            Check(
                NOT_MEASURED,
                f"Warnings for {r.label}: {outcome_sentence(r, ref, 0)} {_sentence(apart)}, so the advisor's "
                "warnings are not checked against it.",
                r.label,
                ASPECT_WARNINGS,
            )
        ]
    if r.precision == PRECISION_UNKNOWN:  # not "as the advisor expected (no warning for this format)"
        return [
            Check(
                NOT_MEASURED,
                f"Warnings for {r.label}: {outcome_sentence(r, ref, 0)} The precision it trained in is not "
                f"recorded ({PRECISION_UNKNOWN_WHY}), so the advisor's warnings for a format are not checked "
                "against it.",
                r.label,
                ASPECT_WARNINGS,
            )
        ]
    fmt = _family(r.precision)
    given = format_warnings(rec, fmt) if fmt else []
    trouble = [f for f in given if _beside_the_point(f, r) is None]
    aside = [f for f in given if _beside_the_point(f, r) is not None]
    bad = r.outcome in BAD_OUTCOMES
    unscaled = _scaling_not_followed(rec, r)
    said = "; ".join(_title(f) for f in trouble)
    aside_text = "; ".join(f"{_title(f)} ({_beside_the_point(f, r)})" for f in aside)
    if trouble and bad:
        status, why = CONFIRMED, f"The advisor had warned: {said}."
    elif trouble:
        status, why = NOT_BORNE_OUT, f"The advisor had warned ({said}), yet it did not hurt this run."
    elif unscaled:  # neither "missed" nor "as expected": the run was not trained as advised
        status = NOT_MEASURED
        why = f"{unscaled}, so this run does not check that advice" + (
            f"; the profile's {fmt} warnings do not bear on it: {aside_text}." if aside else "."
        )
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
    if unscaled and trouble:  # the advice not followed, without the finding the warnings quote already
        why += f" {_scaling_not_followed(rec, r, frozenset(str(f.get('code', '')) for f in trouble))}."
    if unscaled:
        why += _own_warnings(r)
    if bad:
        why += own_diagnosis(r)
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
        unjudged = speed_unjudged(r, ref, "")  # a speed warning is about r's format against the reference's
        st = NOT_MEASURED if unjudged else speed_status(r.speedup, _planned_here(rec or {}, ref))
        if st == NOT_MEASURED:
            tail = (
                f"{_ran_at(r, ref)}; {unjudged or _elsewhere(rec or {})}"
                if r.speedup is not None and math.isfinite(r.speedup)
                else _unmeasured(r, ref)
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
            if r.loss_scale != ADVISED or no_loss(r):
                continue
            ok = r.outcome in (MATCHED, AHEAD)
            apart = not_isolated(r, ref)
            if rec.get("fp16_ruled_out"):  # no scale was advised: what the run tests is the ruling
                status = NOT_MEASURED if apart else NOT_BORNE_OUT if ok else CONFIRMED
                said = (
                    f"Loss scale: the advisor ruled fp16 out on the {ref.label} profile (its reasons say why) and "
                    f"gave no loss scale to start it at; trained at the one sized on the largest gradient, "
                    f"init_scale {_fmt_scale(advised)}, "
                )
            else:
                status = NOT_MEASURED if apart else CONFIRMED if ok else CONTRADICTED
                said = (
                    f"Loss scale: the advisor sized fp16's loss scale at init_scale {_fmt_scale(advised)} on the "
                    f"{ref.label} profile; trained with it, "
                )
            checks.append(
                Check(
                    status,
                    said + outcome_sentence(r, ref, 0) + (f" {_sentence(apart)}." if apart else ""),
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
