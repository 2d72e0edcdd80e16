"""The report's structure: from tables, summary and recommendation to the plain data the templates show.

Layers, as in ydata-profiling: ``summarize`` computes, ``plots`` draws, this module assembles one dict per
section, ``render`` fills the templates. Nothing here writes HTML.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from precprof import __version__, formats
from precprof import tables as T
from precprof.analysis import current_scaling
from precprof.analysis import snippets as snippet_code
from precprof.analysis.final import final_loss
from precprof.analysis.throughput import MIN_STEPS, compiled_steps, throughput, within_noise
from precprof.report import blocks, environment, plots, timeline
from precprof.report import filters as F
from precprof.report import memory_summary as M
from precprof.report import summarize as S
from precprof.report.overhead import past_budget, writer_wait
from precprof.schema import DEFAULT_OVERHEAD_BUDGET

SEVERITY_ORDER = {"critical": 0, "error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Section:
    """One section of the report: its anchor (and template ``_<id>.html.j2``), its name in the navigation,
    its heading, and its number (its place in ``SECTIONS``)."""

    id: str
    name: str
    number: int
    subtitle: str = ""

    @property
    def heading(self) -> str:
        return f"{self.name}: {self.subtitle}" if self.subtitle else self.name


# The report's sections, in order: the navigation, the page and the headings' numbers all come from here.
SECTIONS: tuple[Section, ...] = tuple(
    Section(sid, name, i, subtitle)
    for i, (sid, name, subtitle) in enumerate(
        (
            ("verdict", "Verdict", ""),
            ("training", "Training", ""),
            ("signature", "Where values fall", "layers × log2 magnitude"),
            ("whatif", "What-if per format", ""),
            ("layers", "Per layer", ""),
            ("memory", "Memory", ""),
            ("verification", "Precision check", ""),
            ("environment", "Environment", ""),
        ),
        start=1,
    )
)
# order of the signature heatmaps: activation gradients first (the one loss scaling is about)
HEATMAP_KINDS: tuple[str, ...] = (T.ACTIVATION_GRAD, T.ACTIVATION, T.WEIGHT_GRAD)


def recommendation_dict(recommendation: Any) -> dict[str, Any] | None:
    """A Recommendation object or its dict form as a dict (None stays None)."""
    if recommendation is None:
        return None
    if hasattr(recommendation, "to_dict"):
        d = recommendation.to_dict()
    elif isinstance(recommendation, Mapping):
        d = dict(recommendation)
    else:
        raise TypeError(
            f"recommendation must be a Recommendation or a dict, not {type(recommendation).__name__}"
        )
    d["findings"] = [f.to_dict() if hasattr(f, "to_dict") else dict(f) for f in d.get("findings") or []]
    return d


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _f(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _img(fig: Any, alt: str) -> dict[str, str] | None:
    if fig is None:
        return None
    return {"src": plots.data_uri(plots.png_bytes(fig)), "alt": alt}


_FINDING_DEFAULTS: dict[str, Any] = {
    "code": "",
    "severity": "info",
    "title": "",
    "message": "",
    "remedy": "",
    "modules": [],
    "numbers": {},
    "method": "",
}


def sorted_findings(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings with every field present, most severe first (stable within a severity)."""
    full = [{**_FINDING_DEFAULTS, **{k: v for k, v in f.items() if v is not None}} for f in findings]
    for f in full:
        f["severity"] = str(f["severity"]).lower()
    return sorted(full, key=lambda f: SEVERITY_ORDER.get(f["severity"], 3))


def _verdict(
    rec: dict[str, Any] | None, summary: Mapping[str, Any], measured: Mapping[str, Any], records: list[Any]
) -> dict[str, Any] | None:
    if rec is None:
        return None
    fmt = str(rec.get("format") or "")
    current = S.trained_precision(summary)
    # the run's training memory: precprof's own buffers and scratch are not part of what a format changes
    own = float((measured.get("components") or {}).get(T.PROFILER_BUFFERS) or 0.0)
    block = summary.get(T.SUMMARY_MEMORY)
    from_matmul = bool(block.get("outputs_from_matmul")) if isinstance(block, Mapping) else False
    saving = M.expected_saving(
        records, float(measured.get("total") or 0.0) - own, current, fmt, measured, from_matmul
    )
    diverged = next(
        (f.get("numbers") or {} for f in rec.get("findings") or [] if f.get("code") == "run_diverged"), None
    )
    # (critical only: a warning is of layers behind a weight whose learning rate may be meant to start later)
    dead = next(
        (
            f
            for f in rec.get("findings") or []
            if f.get("code") == "no_gradient" and f.get("severity") == "critical"
        ),
        None,
    )
    # weights the run holds in bf16 lose their updates (critical): a bf16 verdict is bf16 for compute alone
    held = next(
        (
            f.get("numbers") or {}
            for f in rec.get("findings") or []
            if f.get("code") == "bf16_lost_updates" and f.get("severity") == "critical"
        ),
        None,
    )
    allowed = str(rec.get("measured_format") or fmt)
    return {
        "format": fmt,
        "format_label": formats.label(fmt),
        # the box says so beside a bf16 or fp8 verdict (or what the measurements allow): fp32 master weights,
        # and the share the run's bf16 weights lost (it read "the measurements allow BF16" beside the finding)
        "master_weights": {"share": _f(held.get("share")), "label": formats.label(allowed)}
        if held is not None and allowed in ("bf16", "fp8")
        else None,
        # a run that diverged: the box says so beside the format, which rests on the steps before it
        "diverged": {"step": diverged.get("step"), "last": diverged.get("last_step")} if diverged else None,
        # layers whose weights got no gradient on any sampled step: the box says so beside the format, which
        # the other layers' numbers decided (an FP8 run whose every weight gradient was 0 read as a healthy run)
        "no_gradient": _no_gradient(dead) if dead else None,
        "measured_format": str(rec.get("measured_format") or ""),
        "measured_label": formats.label(str(rec.get("measured_format") or "")),
        "loss_scale": _f(rec.get("loss_scale")),
        "fp16_loss_scale": _f(rec.get("fp16_loss_scale")),
        "fp16_ruled_out": bool(rec.get("fp16_ruled_out")),
        # the scale rests on a lower bound of the largest gradient: the box says it is the most a start can be
        "fp16_scale_at_most": bool(rec.get("fp16_loss_scale_at_most")),
        # no gradient of the run sized the scale (its finding has no largest gradient): the box says it is a default
        "fp16_scale_default": _scale_unmeasured(rec),
        "growth_interval": rec.get("growth_interval"),
        "keep_fp32": list(rec.get("keep_fp32") or []),
        "fp16_keep_fp32": list(rec.get("fp16_keep_fp32") or []),
        "fp8_layers": list(rec.get("fp8_layers") or []),
        "block_plan": blocks.plan_groups(
            rec.get("block_plan"),
            (rec.get("block_what_if") or {}).get("plan_labels") or {},
            (rec.get("block_what_if") or {}).get("running"),
        ),
        # the linear layers the block what-if did not reach: named beside the plan, not left to "the rest"
        "block_unreached": [str(m) for m in (rec.get("block_what_if") or {}).get("not_evaluated") or []]
        if rec.get("block_plan")
        else [],
        "reasons": [str(r) for r in rec.get("reasons") or []],
        "target": rec.get("target"),
        "current": current,
        "saving": saving,
        "snippets": snippet_code.snippets(rec),
    }


def _no_gradient(found: Mapping[str, Any]) -> dict[str, Any]:
    """What the verdict box says of the no_gradient finding: how many layers of how many, whether FP8 flushed
    their gradients, and whether no layer got one (the format then rests on no gradient at all)."""
    nums = found.get("numbers") or {}
    n, of = int(nums.get("no_gradient_layers") or 0), int(nums.get("weight_gradient_layers") or 0)
    # the norms whose fp16 x.pow(2) overflowed and starved every one of them (fp16_norm_overflow), named: the box
    # points to that finding, the cause, before no_gradient
    norm = nums.get("fp16_norm_overflow_norms")
    by_norm = isinstance(norm, str) and int(nums.get("fp16_norm_overflow_layers") or 0) == n
    return {
        "layers": n,
        "of": of,
        "fp8": bool(nums.get("fp8_flushed_layers")),
        "all": n >= of > 0,
        "norm": norm if by_norm else None,
    }


def _scale_unmeasured(rec: Mapping[str, Any]) -> bool:
    """Whether the fp16 loss scale is a default no gradient of the run sized: its finding (fp16_loss_scale) has no
    largest gradient (none recorded, none finite and nonzero, or every sampled forward pass non-finite)."""
    found = next((f for f in rec.get("findings") or [] if f.get("code") == "fp16_loss_scale"), None)
    return (
        found is not None
        and "grad_absmax" in (found.get("numbers") or {})
        and found["numbers"]["grad_absmax"] is None
    )


def _skipped_said(summary: Mapping[str, Any], steps: pd.DataFrame) -> str:
    """The header's skipped steps: their count, and with several optimizers under one loss scaler (a GAN's) how
    many of them each optimizer was skipped on ("3 (optimizer 0, Adam, on 3; optimizer 1, SGD, on none)": a step
    the scaler skipped the discriminator at trained the generator)."""
    skipped = T.flags(steps[T.SKIPPED]).to_numpy()
    said = F.count(int(skipped.sum()))
    if T.SKIPPED_OPTIMIZERS not in steps or not skipped.any():
        return said
    counts: dict[int, int] = {}
    for text in steps[T.SKIPPED_OPTIMIZERS][skipped]:
        for i in T.optimizer_places(text):
            counts[i] = counts.get(i, 0) + 1
    if not counts:
        return said
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    each = ((capture.get("optimizer") or {}) if isinstance(capture, Mapping) else {}).get("each") or []
    n = max(len(each), max(counts) + 1)
    parts = [
        f"optimizer {i}"
        + (f", {each[i]['class']}," if i < len(each) and isinstance(each[i], Mapping) else "")
        + f" on {F.count(counts[i]) if counts.get(i) else 'none'}"
        for i in range(n)
    ]
    return f"{said} ({'; '.join(parts)})"


def _headline(summary: Mapping[str, Any], steps: pd.DataFrame, layers: pd.DataFrame) -> list[tuple[str, str]]:
    final = summary.get(T.SUMMARY_FINAL) or {}
    out: list[tuple[str, str]] = []
    prec = S.trained_precision(summary)
    if prec and S.precision_from_layers(summary):
        prec += " (read from the layers' dtypes)"
    if prec:
        out.append(("precision", prec))
    # finished steps: a cut-off step's row (a crash or signal mid-step) is no step done (final.steps_done)
    n_steps = len(T.finished_steps(steps)) if not steps.empty else final.get("steps")
    if n_steps is not None:
        out.append(("steps", F.count(n_steps)))
    if not layers.empty:
        # the step a crash cut off keeps what it recorded, so it is sampled but not among the steps above
        sampled = set(layers[T.STEP].dropna().astype(int))
        cut_off = steps[T.flags(steps[T.CUT_OFF]).to_numpy()] if T.CUT_OFF in steps else steps.iloc[:0]
        cut = len(sampled & set(cut_off[T.STEP].dropna().astype(int)))
        out.append(("sampled steps", F.count(len(sampled)) + (f" ({F.count(cut)} cut off)" if cut else "")))
    if not steps.empty:
        out.append(("skipped steps", _skipped_said(summary, steps)))
        tail = T.nonfinite_loss_tail(steps)
        last = final_loss(steps)  # summary.json's final.final_loss (analysis.final)
        if tail is not None:  # diverged: the last finite loss is not the final one
            out.append(("final loss", f"{tail.kind} from step {tail.first}"))
        elif last is not None and not math.isfinite(last):  # never finite: the last loss given, nan or inf
            out.append(("final loss", "inf" if math.isinf(last) else "nan"))
        elif last is not None:
            out.append(("final loss", F.num(last, 4)))
    # throughput of the steps precprof left alone, first step out (analysis.throughput), and what a profiled
    # step cost beside it; a wall-clock rate would count sampled steps and warm-up; the steps torch.compile
    # compiled in are left out, and said to be
    tp = throughput(steps, compiled_steps(summary))
    if math.isfinite(tp["tokens_per_s"]):
        basis = f"{tp['tokens_per_s_basis']}, median of {F.count(tp['tokens_per_s_steps'])}"
        n = tp["steps_compiled_left_out"]
        if n:
            basis += f"; torch.compile's {F.count(n) + ' steps' if n > 1 else 'step'} left out"
        out.append((f"tokens/s ({basis})", F.num(tp["tokens_per_s"])))
    elif final.get("tokens_per_s") is not None:
        out.append(("tokens/s", F.num(final["tokens_per_s"])))
    # steps whose fed ids a framework callback could not know (Lightning's, under torch.compile), and why
    unknown = (summary.get(T.SUMMARY_CAPTURE) or {}).get("tokens_unknown")
    if isinstance(unknown, Mapping) and unknown.get("steps"):
        n = int(unknown["steps"])
        said = f"on {F.count(n)} step{'s' if n > 1 else ''} from step {unknown.get('first_step')}"
        out.append(("tokens not known", f"{said}: {unknown.get('why') or ''}".rstrip(": ")))
    cost = tp["sampled_step_cost"]
    n_s, n_u = tp["steps_timed_sampled"], tp["steps_timed_unsampled"]
    overhead = _overhead(summary, tp)
    if overhead:  # what the sampler measured precprof took of the run (its steps' added time over the run's)
        out.append(("precprof's overhead", overhead))
    if math.isfinite(cost) and cost >= 1:
        out.append(("a sampled step", f"{cost:.2f}× an unsampled one{_by_medians(tp) if overhead else ''}"))
    elif math.isfinite(cost):
        # a step that records more cannot take less time: the timings are noise (a busy machine, a sync that
        # landed on other steps), not a cost
        out.append(
            (
                "a sampled step",
                f"cost not measured (median {F.num(tp['step_time_sampled_median_s'], 3)} s over {F.count(n_s)} "
                f"sampled steps, {F.num(tp['step_time_unsampled_median_s'], 3)} s over {F.count(n_u)} unsampled: noise)",
            )
        )
    elif n_s and n_u and not overhead:
        out.append(
            (
                "a sampled step",
                f"cost not measured ({F.count(n_s)} sampled, {F.count(n_u)} unsampled steps timed)",
            )
        )
    if final.get("time_s") is not None:
        out.append(("time (s)", F.num(final["time_s"])))
    if not layers.empty:
        # a layer's own input row (T.input_module) is not a layer
        modules = layers[T.MODULE].dropna().unique()
        out.append(("layers profiled", F.count(sum(not str(m).endswith(T.INPUT_SUFFIX) for m in modules))))
    return out


def _by_medians(tp: Mapping[str, Any]) -> str:
    """Beside an overhead that is an upper bound (``within_noise``), what the medians' cost makes of the sampled
    steps' share, and why the two differ ("" otherwise): "at most 8.09% of the run's time" sat beside "a sampled
    step 1.07x an unsampled one", which on its 12 sampled steps is about 0.75%, unexplained."""
    if not within_noise(tp) or not tp["steps_timed_s"] > 0:
        return ""
    n = int(tp["steps_timed_sampled"])
    added = n * (tp["step_time_sampled_median_s"] - tp["step_time_unsampled_median_s"])
    return (
        f" (their median times; at that cost the {F.count(n)} sampled steps timed took about "
        f"{F.pct(added / tp['steps_timed_s'])} of the run's time. The overhead above is an upper bound: it counts "
        "each sampled step's time over the unsampled steps just before it, one that came out faster as adding "
        "nothing, which on steps as uneven as these counts their noise as cost)"
    )


def _overhead(summary: Mapping[str, Any], tp: dict[str, Any]) -> str:
    """The share of the run's time precprof took, as its sampler measured it (``capture.sampling``), and the
    budget it kept to: "2.9% of the run's time (budget 3%)"; "" where the summary does not say. From fewer timed
    steps than a sampled step's cost is measured from (``tp``, ``environment.overhead_withheld``, the rule the
    environment's "steps sampled" row keeps to), "not measured" and the counts: 2 sampled steps of a run cut
    short made 32.4% where the page withheld the cost of a sampled step. Where a
    sampled step adds less than the steps' times vary (``within_noise``), "at most" and why. Of a resumed run,
    the sampler's figures are its last attempt's (the summary's), and say so ("of the time of the attempt resumed
    at step 20"), as the environment's "steps sampled" row does: "6.4% of the run's time ... the 2 first steps"
    stood beside the sampled steps of every attempt (tester t5)."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    sampling = capture.get("sampling") if isinstance(capture, Mapping) else None
    if not isinstance(sampling, Mapping):
        return ""
    time_of = _time_of(capture if isinstance(capture, Mapping) else {})
    if isinstance(capture, Mapping) and capture.get("sampled_steps") == 0 and not tp["steps_timed_sampled"]:
        # nothing sampled (sample_every=0): the overhead is prof.step()'s own time on every step, measured on
        # the unsampled steps alone; "0 sampled steps timed: 3 needed" withheld a measured 2.42%
        return _overhead_unsampled(sampling, tp, time_of)
    share, budget = sampling.get("overhead"), sampling.get("budget")
    if not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
        # no unsampled step timed (sample_every=1): no share, but a wait for the writer is said of the run's time
        wait = (
            writer_wait(capture, share_known=False, time_of=time_of) if isinstance(capture, Mapping) else ""
        )
        return f"not measured ({_unmeasured(sampling, tp)}). {wait}" if wait else ""
    text = f"{F.pct(float(share))} of {time_of}"
    said = []
    withheld = environment.overhead_withheld(tp)
    if withheld:
        text = "not measured"
        said.append(withheld)
    else:
        said.extend(overhead_parts(sampling))
        said.extend(_paused(sampling))
        said.extend(_fixed_interval(sampling))
    if sampling.get("mode") == "budget" and isinstance(budget, (int, float)) and math.isfinite(budget):
        past = "" if withheld else past_budget(sampling)[0]  # steps sampled beyond it by design took it past
        said.append(f"budget {F.pct(float(budget))}" + (f", {past}" if past else ""))
    if within_noise(tp):
        # the sampler counted what each sampled step seemed to add, clipped at 0: beside a card that says the
        # cost was noise, the plain share had read as measured
        text = f"at most {text}"
        said.append("an upper bound: a sampled step adds less than the steps' times vary")
    # sampled steps that waited for the run directory's writer: how much of precprof's time, and what to do
    # (of the run's time where precprof's share is withheld)
    wait = (
        writer_wait(capture, share_known=not withheld, time_of=time_of)
        if isinstance(capture, Mapping)
        else ""
    )
    return text + (f" ({'; '.join(said)})" if said else "") + (f". {wait}" if wait else "")


def _fixed_interval(sampling: Mapping[str, Any]) -> list[str]:
    """Where the steps were sampled at a fixed interval (``sample_every=N``, the built-in loop's about 100
    sampled steps), that interval, and that the Profiler's default is a budget: a first run's card read "14.6% of
    the run's time" with nothing to say that a Profiler left at its defaults keeps to 3%."""
    every = sampling.get("every")
    if sampling.get("mode") != "every" or not isinstance(every, int) or every < 1:
        return []
    return [
        f"{environment.ordinal_every(every)} sampled: a fixed interval, not the Profiler's default budget of "
        f"{F.pct(DEFAULT_OVERHEAD_BUDGET)}"
    ]


def _time_of(capture: Mapping[str, Any]) -> str:
    """Whose time the sampler's figures are a share of: the run's, or its last attempt's where it was resumed
    (``capture.stream.resumed_from``)."""
    resumed = environment.resumed_from(capture)
    if resumed is not None:
        return f"the time of the attempt resumed at step {F.count(resumed)}"
    return "the run's time"


def _unmeasured(sampling: Mapping[str, Any], tp: Mapping[str, Any]) -> str:
    """Why the sampler has no overhead figure, in words: every step sampled, none to time a sampled one's
    cost against; else the timed steps' counts."""
    if sampling.get("mode") == "every" and sampling.get("every") == 1:
        return "every step sampled: no unsampled step to measure a sampled one's cost against"
    return environment.overhead_withheld(tp) or "no unsampled step timed"


def _overhead_unsampled(
    sampling: Mapping[str, Any], tp: Mapping[str, Any], time_of: str = "the run's time"
) -> str:
    """precprof's overhead in a run that sampled no step: what ``prof.step()`` took on every step (the
    sampler's ``overhead_every_step``), "not measured" from fewer than ``MIN_STEPS`` unsampled steps timed, and
    "" where the summary predates the figure."""
    n_u = int(tp["steps_timed_unsampled"])
    if n_u < MIN_STEPS:  # (a run of 1 or 2 steps, whose summary has no overhead at all, too)
        timed = f"{F.count(n_u)} step{'' if n_u == 1 else 's'} timed"
        return f"not measured (no step sampled; {timed}: {MIN_STEPS} needed)"
    every = sampling.get("overhead_every_step")
    if not isinstance(every, (int, float)) or not math.isfinite(every) or every < 0:
        return ""
    return f"{F.pct(float(every))} of {time_of} (no step sampled; prof.step() on every step {F.pct(float(every))})"


def _paused(sampling: Mapping[str, Any]) -> list[str]:
    """The sampled steps that held a pause (``capture.sampling.paused_steps``, ``sampling.Sampler._pause``), in
    words: counted at a sampled step's median time, the rest left out; none where there were none."""
    steps, left = sampling.get("paused_steps"), sampling.get("paused_s")
    if not isinstance(steps, list) or not steps or not isinstance(left, (int, float)):
        return []
    count = sampling.get("paused_count")  # (the list holds the first 64; older summaries only it)
    n = count if isinstance(count, int) and count >= len(steps) else len(steps)
    return [
        f"{F.count(n)} sampled step{'s' if n != 1 else ''} ({', '.join(F.count(s) for s in steps[:6])}"
        f"{', ...' if n > 6 else ''}) took over 4x the other steps' time and at least a second more: time "
        f"outside the step's work (a pause, as between notebook cells), each counted at the recent sampled "
        f"steps' median time, {left:.2f} s left out"
    ]


def overhead_parts(sampling: Mapping[str, Any]) -> list[str]:
    """The two parts of precprof's overhead (``capture.sampling``), in words: what the sampled steps added (the
    part the budget bounds) and what ``prof.step()`` took on every step; none where the summary predates them."""
    sampled, every = sampling.get("overhead_sampled"), sampling.get("overhead_every_step")
    if not isinstance(sampled, (int, float)) or not isinstance(every, (int, float)):
        return []
    if not (math.isfinite(sampled) and math.isfinite(every)):
        return []
    return [f"sampled steps {F.pct(float(sampled))}", f"prof.step() on every step {F.pct(float(every))}"]


def heatmap_focus(summary: Mapping[str, Any], rec: Mapping[str, Any] | None) -> tuple[str, str]:
    """(format, why) whose losses choose the heatmaps' rows and fill their side panel: the run's own FP16 or FP8,
    else the recommended one, else FP16 (the format whose range is narrowest at scale 1)."""
    ran = S.trained_precision(summary)
    if ran.startswith("fp8"):
        return "fp8", "this run trained in FP8"
    if ran.startswith("fp16"):
        return "fp16", "this run trained in FP16"
    fmt = str((rec or {}).get("format") or "")
    if fmt in ("fp8", "fp16"):
        return fmt, f"the recommended format is {fmt.upper()}"
    return "fp16", "FP16 has the narrowest range of the formats a run can train in"


def _heatmaps(
    tables: Mapping[str, pd.DataFrame],
    rec: dict[str, Any] | None,
    totals: pd.DataFrame | None = None,
    summary: Mapping[str, Any] | None = None,
    order: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    layers = tables["layers"]
    hist = T.sum_histogram_frame(totals if totals is not None else tables["histograms"])
    rec_scale = None
    if rec:
        rec_scale = (
            _f(rec.get("loss_scale")) if rec.get("format") == "fp16" else _f(rec.get("fp16_loss_scale"))
        )
    focus, why = heatmap_focus(summary or {}, rec)
    out: list[dict[str, Any]] = []
    for kind in HEATMAP_KINDS:
        hm = plots.signature_heatmap(
            hist,
            layers,
            kind,
            recommended_scale=rec_scale,
            focus=focus,
            shared=T.shared_params(summary),
            order=order,
        )
        title = S.KIND_LABELS[kind].capitalize()
        if hm is None:
            # (its own name: ``why`` says why the side panel shows its format, in every later caption)
            unread = environment.weight_grads_unread(summary.get(T.SUMMARY_CAPTURE) or {}) if summary else ""
            out.append(
                {
                    "kind": kind,
                    "title": title,
                    "img": None,
                    "empty": _no_magnitude(kind, S.without_magnitude(layers, kind)),
                    "notes": [unread] if kind == T.WEIGHT_GRAD and unread else [],
                }
            )
            continue
        notes: list[str] = []
        sc = hm.scale
        if kind in T.GRADIENT_KINDS:
            rng = (
                f" (it ranged {F.pow2(sc['min'])} to {F.pow2(sc['max'])} over sampled steps)"
                if sc["min"] != sc["max"]
                else ""
            )
            notes.append(
                f"The FP16 window is drawn at the loss scale of the last sampled step, {F.pow2(sc['last'])}{rng}: "
                "a gradient g is stored as g·scale, so the window slides left as the scale grows."
            )
            if rec_scale and rec_scale != sc["last"]:
                notes.append(
                    f"The dotted dark-red lines are FP16's window at the recommended scale {F.pow2(rec_scale)}."
                )
            if kind == T.WEIGHT_GRAD and (n := _accumulated(layers, summary or {})) > 1:
                notes.append(
                    f"Gradient accumulation: up to {n} backward passes added into each weight gradient per "
                    "step, and these rows are their sum. Under autocast each micro-batch's gradient is computed "
                    f"in 16-bit before it is added, up to log2({n}) = {math.log2(n):.1f} binades smaller than "
                    "the sum: more of it underflows than this heatmap shows."
                )
        else:
            notes.append("Forward tensors are not loss-scaled: every window is at scale 1.")
        notes.append(
            "The BF16 window is static (scale 1). FP8 E4M3 and E5M2 are drawn under per-tensor current scaling, "
            f"the recipe the FP8 advice assumes, with power-of-two scales (scale {current_scaling.SCALE_WORDS}): "
            "each row's window slides so that its largest value over the sampled steps lands just below the "
            "format's max, and is marked on that row; the strip shows it for the row with the largest value. The "
            "what-if table's “current scaling” columns count that recipe."
        )
        notes.append(
            f"The columns are the binades that hold values, 2^{round(hm.x_range[0])} to 2^{round(hm.x_range[1])}; "
            "a window beyond them is named in the strip (← → where it reaches past)."
        )
        notes.append(f"The right panel: the share of each row lost in {hm.focus_label} ({why}).")
        if hm.rows_shown < hm.rows_total:
            notes.append(hm.rows_note())
        if hm.all_zero:
            notes.append(hm.zero_note())
        alt = (
            f"Heatmap of {S.KIND_LABELS[kind]}: {hm.rows_shown} rows in forward order by log2 magnitude, "
            f"with FP16, BF16, FP8 E4M3 and E5M2 windows; right: lost in {hm.focus_label}"
        )
        out.append({"kind": kind, "title": title, "img": _img(hm.figure, alt), "notes": notes})
    return out


def _no_magnitude(kind: str, got: Mapping[str, int] | None) -> str:
    """The sentence in place of a heatmap whose kind was recorded with no finite nonzero value ("" when none was
    recorded): it said no histograms were recorded, beside findings that every value was zero."""
    if got is None:
        return ""
    what = S.KIND_LABELS[kind].removesuffix("s").replace(" ", "-") + " value"  # "activation-gradient value"
    where = (
        f"{F.count(got['values'])} values over {F.count(got['steps'])} sampled step(s), "
        f"from {F.count(got['layers'])} layer(s)"
    )
    if got["zeros"] == got["values"]:
        return f"Every {what} recorded was an exact zero: {where}. There is no magnitude to draw."
    parts = [(got["zeros"], "zero"), (got["nan"], "NaN"), (got["inf"], "infinite")]
    some = [f"{F.count(n)} {word}" for n, word in parts if n]
    some[0] = some[0].replace(" ", " were ", 1)
    told = ", ".join(some[:-1]) + " and " + some[-1] if len(some) > 1 else some[0]
    return f"No {what} recorded was finite and nonzero: of {where}, {told}. There is no magnitude to draw."


def _whatif(
    layers: pd.DataFrame,
    summary: Mapping[str, Any],
    rec: dict[str, Any] | None,
    order: Sequence[str] | None = None,
) -> dict[str, Any]:
    cols = S.whatif_columns()
    headers = []
    for col, fmt, what in cols:
        label = formats.label(fmt)
        sub = {
            "underflow": "underflow",
            "overflow": "overflow",
            "underflow_cs": "underflow, current scaling",
        }[what]
        headers.append({"col": col, "format": fmt, "label": label, "what": sub, "full": f"{label} {sub}"})
    counted = S.whatif_rows(layers)  # the rows both tables count, selected once
    by_layer = S.whatif_by_layer(layers, T.shared_params(summary), order, counted)
    rows = []
    for r in by_layer.to_dict("records"):
        rows.append(
            {
                "module": S.module_label(str(r[T.MODULE])),
                "module_type": r[T.MODULE_TYPE],
                "kind": S.KIND_LABELS.get(str(r[T.TENSOR]), str(r[T.TENSOR])),
                "numel": r[T.NUMEL],
                # the loss scales its values were counted at, lowest to highest (its shares are summed over them)
                "scale_lo": r[S.SCALE_MIN],
                "scale_hi": r[S.SCALE_MAX],
                "shares": [r[h["col"]] for h in headers],
                "nonfinite": r[S.NONFINITE],
            }
        )
    overview = []
    for r in S.whatif_overview(layers, counted).to_dict("records"):
        overview.append(
            {
                "kind": S.KIND_LABELS.get(str(r[T.TENSOR]), str(r[T.TENSOR])),
                "numel": r[T.NUMEL],
                "shares": [r[h["col"]] for h in headers],
                "nonfinite": r[S.NONFINITE],
            }
        )
    groups: list[dict[str, Any]] = []
    for h in headers:
        if groups and groups[-1]["label"] == h["label"]:
            groups[-1]["n"] += 1
        else:
            groups.append({"label": h["label"], "format": h["format"], "n": 1})
    return {
        "headers": headers,
        "groups": groups,
        "rows": rows,
        "overview": overview,
        # a column of the values already nan or inf, which no format's column counts: only when there were some
        "nonfinite": any(r["nonfinite"] > 0 for r in overview),
        "blocks": blocks.table(rec, (summary.get(T.SUMMARY_CAPTURE) or {}).get("block_formats")),
        "fp8_at_scale": _fp8_at_scale(layers),
        "fp16_already": _fp16_already(layers),
        "fp16_flush_findings": _fp16_flush_findings(rec),
    }


def _fp8_at_scale(layers: pd.DataFrame) -> dict[str, Any] | None:
    """The tensor kinds recorded at a loss scale other than 1 and the scales' range, for the note that says why
    their FP8 cells at the loss scale read "—" (``S.fp8_scaled_columns``); None when every kind was at scale 1."""
    scales = {k: S.scale_in_effect(layers, k) for k in S.HIST_KINDS if (layers[T.TENSOR] == k).any()}
    kinds = [k for k, sc in scales.items() if not sc["min"] == sc["max"] == 1]
    if not kinds:
        return None
    return {
        "kinds": " and ".join(S.KIND_LABELS[k] for k in kinds),
        "lo": min(scales[k]["min"] for k in kinds),
        "hi": max(scales[k]["max"] for k in kinds),
    }


# the findings that say what a run can tell of the activation gradients fp16 flushed in tensors it held in fp16,
# where neither the what-if's columns nor the timeline can (a flushed value is a zero there)
_FP16_FLUSH_CODES = ("fp16_gradient_underflow", "fp16_no_loss_scaling")


def _fp16_flush_findings(rec: Mapping[str, Any] | None) -> list[str]:
    """The codes of ``_FP16_FLUSH_CODES`` among the findings of ``rec``."""
    codes = {str(f.get("code")) for f in (rec or {}).get("findings") or []}
    return [c for c in _FP16_FLUSH_CODES if c in codes]


def _fp16_already(layers: pd.DataFrame) -> list[dict[str, Any]]:
    """Per tensor kind the run held in fp16 (its rows' dtype float16): the share of its values that are zeros and
    its count of inf/nan, for the note that says why its FP16 columns read 0% (what fp16 lost is in those zeros
    and inf/nan already: an fp16 run that flushed 48% of its gradients read "0%" there, without a word)."""
    out: list[dict[str, Any]] = []
    if T.DTYPE not in layers or layers.empty:
        return out
    fp16 = T.texts(layers[T.DTYPE]) == "float16"
    for k in S.HIST_KINDS:
        rows = layers.loc[fp16 & (layers[T.TENSOR] == k), [T.NUMEL, T.ZEROS, T.NAN, T.INF]]
        n = float(pd.to_numeric(rows[T.NUMEL], errors="coerce").sum())
        if n <= 0:
            continue
        zeros = float(pd.to_numeric(rows[T.ZEROS], errors="coerce").sum())
        bad = int(
            pd.to_numeric(rows[T.NAN], errors="coerce").sum()
            + pd.to_numeric(rows[T.INF], errors="coerce").sum()
        )
        if zeros or bad:
            out.append({"kind": S.KIND_LABELS[k], "zeros": zeros / n, "nonfinite": bad})
    return out


def _memory(
    tables: Mapping[str, pd.DataFrame], summary: Mapping[str, Any], order: Sequence[str] | None = None
) -> dict[str, Any]:
    # the largest saved activations' ties in forward order
    if order is None:
        order = S.forward_order(tables["layers"], T.shared_params(summary))
    measured = M.measured_memory(tables["memory"], order)
    records = M.memory_records(summary)
    mem = summary.get(T.SUMMARY_MEMORY)
    mem = mem if isinstance(mem, Mapping) else {}
    current = S.trained_precision(summary)
    # each mode's allocator peak, projected from this run's (the verdict's figures): what a run at its limit asks
    peaks = M.projected_peaks(measured, records, current, bool(mem.get("outputs_from_matmul")))
    modes = peaks["modes"] if peaks else None
    fig = plots.memory_figure(measured, records, current, modes)
    claim = mem.get("textbook_claim")
    return {
        "img": _img(fig, "Stacked bars of memory per component: this run as measured and projected per mode"),
        "measured": measured,
        "step_note": M.step_note(measured, _new_shapes(summary)),
        # the projection per mode; this run's measurement is the measured table's, said once
        "projection": M.memory_table(records, "projected", modes),
        # what the projected peaks start from: "parts at the peak" or "parts held at the step's end"
        "peak_basis": peaks["basis"] if peaks else "",
        "textbook": M.memory_table(records, "textbook"),
        # (parameters that train, all of them) where some are frozen: the textbook's gradients and states are of
        # those that train
        "trainable": environment.trainable(summary, mem.get("step")),
        # requires_grad changed during the run ("" where it did not): the counts are the step measured's where the
        # sampled steps saw it (``trainable_on_step``), else the end's
        "trainable_changes": environment.trainable_changes_said(summary),
        "trainable_on_step": T.trainable_at(summary, mem.get("step")) is not None,
        "step_measured": mem.get("step"),
        "claim": claim.get("text")
        if isinstance(claim, Mapping)
        else (claim if isinstance(claim, str) else None),
        "assumptions": [str(a) for a in mem.get("assumptions") or []],
        # components the run did not measure, and why (the states of an optimizer the Profiler was not given)
        "unmeasured": {str(c): str(w) for c, w in (mem.get("unmeasured") or {}).items()},
        "has_projection": bool(records),
        "peak_note": str((mem.get("model") or {}).get("peak_note") or ""),
        "activations_note": str((mem.get("model") or {}).get("activations_note") or ""),
        # the model's forward returned its loss: what the loss saved is among the activations already
        "loss_in_forward": bool((mem.get("model") or {}).get("loss_in_forward")),
        "none_why": _no_memory_why(summary),
        "scope": _memory_scope_call(summary),
        # DDP's gradient buckets, a copy of the gradients outside every component unless they are its views
        "ddp_buckets": M.ddp_buckets(summary),
    }


def _memory_scope_call(summary: Mapping[str, Any]) -> dict[str, str]:
    """How this run's loop reaches ``Profiler.memory_scope()``: ``prof`` in a loop of the user's own; under the
    Lightning or Hugging Face callback, the callback's ``profiler`` (the user holds no Profiler of their own)."""
    config = summary.get("config")
    source = config.get("source") if isinstance(config, Mapping) else None
    if source == T.SOURCE_LIGHTNING:
        return {
            "call": "precprof_cb.profiler.memory_scope()",
            "where": "in your LightningModule's training_step, precprof_cb being the PrecprofCallback you gave "
            "the Trainer",
            "code": "out = self(x)\nwith precprof_cb.profiler.memory_scope():\n    loss = loss_fn(out, y)\nreturn loss",
        }
    if source == T.SOURCE_TRANSFORMERS:
        return {
            "call": "precprof_cb.profiler.memory_scope()",
            "where": "in your Trainer's compute_loss, precprof_cb being the PrecprofCallback you gave the Trainer",
            "code": "outputs = model(**inputs)\nwith precprof_cb.profiler.memory_scope():\n"
            "    loss = loss_fn(outputs.logits, labels)",
        }
    return {
        "call": "prof.memory_scope()",
        "where": "",
        "code": "out = model(x)\nwith prof.memory_scope():\n    loss = loss_fn(out, y)",
    }


def _new_shapes(summary: Mapping[str, Any]) -> list[int]:
    """The steps measured for their new input shapes (``capture.memory_steps``)."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    steps = capture.get("memory_steps") if isinstance(capture, Mapping) else None
    new = steps.get("measured_for_new_shapes") if isinstance(steps, Mapping) else None
    return [int(s) for s in new or [] if isinstance(s, (int, float))]


def _accumulated(layers: pd.DataFrame, summary: Mapping[str, Any]) -> int:
    """The most backward passes that accumulated into one weight gradient in a sampled step on one rank (its
    row's ``calls``, summed over the ranks of a distributed run): more than 1 under gradient accumulation; 0
    without weight-gradient rows."""
    has = T.TENSOR in layers and T.CALLS in layers
    calls = (
        pd.to_numeric(layers.loc[layers[T.TENSOR] == T.WEIGHT_GRAD, T.CALLS], errors="coerce")
        if has
        else pd.Series(dtype=float)
    )
    if not len(calls) or pd.isna(calls.max()):
        return 0
    dist = (summary.get(T.SUMMARY_CAPTURE) or {}).get("distributed") or {}
    ranks = dist.get("world_size") if isinstance(dist, Mapping) else None
    return int(calls.max()) // (ranks if isinstance(ranks, int) and ranks > 1 else 1)


def _reduced_steps_counted(summary: Mapping[str, Any], steps: pd.DataFrame) -> Mapping[str, Any]:
    """The summary with the sampled steps a distributed run reduced over its ranks counted from its steps
    table, where the summary is the first one, written at attach (a run cut off before it saved: its
    ``sampled_steps_reduced`` is the 0 of then, and the Processes row said "the statistics of 0 sampled steps
    are every rank's together" of 5 reduced steps). Each sampled step the run finished was reduced; the step a
    crash cut off never was."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    dist = capture.get("distributed") if isinstance(capture, Mapping) else None
    if not isinstance(dist, Mapping) or "sampled_steps" in capture or T.SAMPLED not in steps:
        return summary
    cut = T.flags(steps[T.CUT_OFF]).to_numpy() if T.CUT_OFF in steps else np.zeros(len(steps), dtype=bool)
    reduced = int((T.flags(steps[T.SAMPLED]).to_numpy() & ~cut).sum())
    capture = {**capture, "distributed": {**dist, "sampled_steps_reduced": reduced}}
    return {**summary, T.SUMMARY_CAPTURE: capture}


def sampling_from_steps(summary: Mapping[str, Any], steps: pd.DataFrame) -> Mapping[str, Any]:
    """The summary with its sampling counted from the steps table where the summary is the first one, written at
    attach (a run killed before it saved: its "steps sampled" row had no counts, and a budgeted run's no row at
    all): the sampled steps, the steps recorded, the sampled steps per reason (each row says why its step was
    sampled) and the first sampled step, every attempt's. The budget is the first summary's (unknown in a run
    of a precprof that wrote none there); what the sampled steps took, and the steps held unsampled, were
    the sampler's to say at the end: ``from_steps`` tells the page so."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    if (
        not isinstance(capture, Mapping)
        or "sampled_steps" in capture
        or T.SAMPLED not in steps
        or steps.empty
    ):
        return summary
    sampled = T.flags(steps[T.SAMPLED]).to_numpy()
    # (the built-in loop's first summary says its interval in its config: a killed --sample-every 1 run was told
    # "within the overhead budget (not recorded)", a budget it never had)
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    every = capture.get("sample_every", cfg.get("sample_every") if isinstance(cfg, Mapping) else None)
    known = capture.get("sampling")
    sampling: dict[str, Any] = {
        "mode": "budget" if every is None else ("every" if every else "off"),
        "every": every,
        **(known if isinstance(known, Mapping) else {}),
        "from_steps": True,
    }
    if T.SAMPLE_REASON in steps:
        reasons = T.texts(steps[T.SAMPLE_REASON])[sampled].astype(str)
        sampling["reasons"] = {
            str(r): int(n) for r, n in reasons[reasons != ""].value_counts(sort=False).items()
        }
    first = pd.to_numeric(steps[T.STEP], errors="coerce")[sampled].min() if sampled.any() else math.nan
    if math.isfinite(first):  # (a step column without a number: no first step said)
        sampling["first_sampled_step"] = int(first)
    counts = {"sampled_steps": int(sampled.sum()), "steps_recorded": len(steps), "sampling": sampling}
    return {**summary, T.SUMMARY_CAPTURE: {**capture, **counts}}


def _last_sampled(summary: Mapping[str, Any], steps: pd.DataFrame) -> Mapping[str, Any]:
    """The summary with its sampling's last sampled step and last step taken from the steps table where it has
    none (a run recorded before the summary did, or killed before it saved), for the "steps sampled" row's
    word on a budgeted run's unsampled last steps (``environment.sampling_text``)."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    if not isinstance(capture, Mapping):
        return summary
    sampling = capture.get("sampling")
    if not isinstance(sampling, Mapping) or "last_sampled_step" in sampling or T.SAMPLED not in steps:
        return summary
    step = pd.to_numeric(steps[T.STEP], errors="coerce") if T.STEP in steps else pd.Series(dtype=float)
    sampled = step[T.flags(steps[T.SAMPLED]).to_numpy()].dropna() if len(step) else step
    if sampled.empty:
        return summary
    last = {"last_sampled_step": int(sampled.max()), "last_step": int(step.max())}
    return {**summary, T.SUMMARY_CAPTURE: {**capture, "sampling": {**sampling, **last}}}


def _stopped(steps: pd.DataFrame, cfg: Mapping[str, Any]) -> str:
    """Where an incomplete run stopped, for its banner: "after step 670 (671 steps of the 3,000 planned; step
    671 was cut off)"; the planned count where the run's configuration has one (the built-in loop's); "" without
    steps. Only finished steps count: the step a crash or signal cut off (``CUT_OFF``) has a row but never
    finished, and counting it said one step more than the summary's ``steps_done``."""
    if T.STEP not in steps:
        return ""
    step = pd.to_numeric(steps[T.STEP], errors="coerce")
    cut_off = T.flags(steps[T.CUT_OFF]).to_numpy() if T.CUT_OFF in steps else np.zeros(len(steps), dtype=bool)
    numbers, cut = step[~cut_off].dropna(), step[cut_off].dropna()
    cut_note = f"; step {F.count(int(cut.max()))} was cut off" if len(cut) else ""
    if numbers.empty:
        return f"before any step finished ({cut_note[2:]})" if cut_note else ""
    last, done = int(numbers.max()), len(numbers)
    planned = cfg.get("steps")
    of = f" of the {F.count(planned)} planned" if isinstance(planned, int) and planned > done else ""
    return f"after step {F.count(last)} ({F.count(done)} step{'s' if done != 1 else ''}{of}{cut_note})"


def _one_rank_note(steps: pd.DataFrame, summary: Mapping[str, Any]) -> str:
    """For a distributed run, that the step a crash cut off holds the writing rank's rows alone: no collective
    runs while an exception unwinds (``RankReducer``), so its counts are one rank's where every other sampled
    step's are every rank's together (its activations held half the elements of the others' on 2 ranks, and
    nothing said so)."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    dist = capture.get("distributed") if isinstance(capture, Mapping) else None
    world = dist.get("world_size") if isinstance(dist, Mapping) else None
    if not isinstance(world, int) or world < 2 or T.CUT_OFF not in steps or T.SAMPLED not in steps:
        return ""
    cut = steps[T.flags(steps[T.CUT_OFF]).to_numpy() & T.flags(steps[T.SAMPLED]).to_numpy()]
    if cut.empty:
        return ""
    rank = dist.get("writer_rank", 0) if isinstance(dist, Mapping) else 0
    return (
        f"; step {F.count(int(cut[T.STEP].max()))}'s statistics are rank {rank}'s alone, not summed over the "
        f"{F.count(world)} ranks as the other steps' are"
    )


def _no_memory_why(summary: Mapping[str, Any]) -> str:
    """Why a run recorded no memory, when the summary tells: the breakdown failed, or no step was sampled (a
    sampled step measures it)."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    if not isinstance(capture, Mapping):
        return ""
    if capture.get("memory_enabled") is False:
        return "Profiler(memory=False) turned it off."
    if capture.get("memory_error"):
        return f"The memory breakdown failed: {capture['memory_error']}."
    steps = capture.get("memory_steps")
    if isinstance(steps, Mapping) and not steps.get("measured_steps"):
        if not steps.get("sampled_steps"):
            cfg = summary.get(T.SUMMARY_CONFIG)
            cfg = cfg if isinstance(cfg, Mapping) else {}
            held = T.compile_held_steps(capture)
            if held is not None:
                return (
                    f"Memory is measured on sampled steps, and no step was sampled ({held}): a longer run, or "
                    "the same run again, measures it."
                )
            return (
                f"Memory is measured on sampled steps, and no step was sampled "
                f"({T.sample_every_setting(cfg, '0')} samples none): sample some steps to measure it."
            )
        return "No sampled step measured it."
    return ""


def _loss_note(steps: pd.DataFrame) -> str:
    """What the loss curve lacks: the steps the loop passed no loss for (``T.NO_LOSS``), and why that happens.
    The step a crash or Ctrl-C cut off has none either, the run's doing, not the loop's: said apart (a Ctrl-C'd
    run of the built-in loop, which always passes its loss, read "the loop passed none")."""
    if steps.empty or T.NO_LOSS not in steps:
        return ""
    done = T.finished_steps(steps)
    cut = steps[T.flags(steps[T.NO_LOSS]).to_numpy() & ~steps.index.isin(done.index)]
    cut_note = (
        f"Step {F.count(int(cut[T.STEP].iloc[0]))} has no loss: the run was cut off during it (a crash or Ctrl-C)."
        if len(cut)
        else ""
    )
    steps = done
    missing = int(T.flags(steps[T.NO_LOSS]).sum())
    if not missing:
        return cut_note
    return " ".join(t for t in (_loss_without_cut(steps, missing), cut_note) if t)


def _loss_without_cut(steps: pd.DataFrame, missing: int) -> str:
    """The finished steps the loop passed no loss for, in words."""
    why = (
        "the loop passed none (prof.step() without loss=; under Lightning, a training_step that returns nothing, "
        "as manual optimization often does: return the loss)"
    )
    if missing == len(steps):
        return f"No loss was recorded: {why}."
    return (
        f"{F.count(missing)} of {F.count(len(steps))} steps have no loss: {why}; the curve leaves them out."
    )


def _holes_note(steps: pd.DataFrame) -> str:
    """The steps between the first and the last that the table has no row for, in words ("" when none): a job
    killed before it flushed its last steps and resumed from a later checkpoint leaves them; the curve breaks
    there."""
    if steps.empty or T.STEP not in steps:
        return ""
    present = np.unique(pd.to_numeric(steps[T.STEP], errors="coerce").dropna().astype(np.int64).to_numpy())
    if len(present) < 2:
        return ""
    jumps = np.flatnonzero(np.diff(present) > 1)
    if jumps.size == 0:
        return ""
    ranges = [(int(present[j]) + 1, int(present[j + 1]) - 1) for j in jumps]
    said = ", ".join(F.count(a) if a == b else f"{F.count(a)}-{F.count(b)}" for a, b in ranges[:4]) + (
        f" and {len(ranges) - 4} more ranges" if len(ranges) > 4 else ""
    )
    n = sum(b - a + 1 for a, b in ranges)
    restarts = set(_restarts(steps))
    why = (
        ": the job killed before it flushed them was resumed from a later checkpoint"
        if any(b + 1 in restarts for _, b in ranges)
        else ""
    )
    return (
        f"No record of step{'s' if n != 1 else ''} {said} ({F.count(n)} in all){why}; the curve breaks there."
    )


def _restarts(steps: pd.DataFrame) -> list[int]:
    """The steps a resumed run restarted from."""
    if steps.empty or T.RESUMED not in steps:
        return []
    return sorted({int(s) for s in steps[T.STEP][T.flags(steps[T.RESUMED])]})


def _timeline(
    layers: pd.DataFrame,
    steps: pd.DataFrame,
    capture: Mapping[str, Any],
    weights: pd.Series | None = None,
) -> dict[str, Any] | None:
    """The time axis over sampled steps (``report.timeline``): a figure and what it aggregated, and from which
    step the weight updates were read when the optimizer was given late. ``weights``:
    ``tables.sample_weights(layers)`` where the caller has it."""
    tl = timeline.timeline(layers, weights=weights)
    if tl is None or tl.n_steps < 2:
        return None
    alt = f"Share of values lost in FP16 per tensor kind over {tl.n_steps} sampled steps"
    late = environment.updates_from(capture)
    held = [f["kind"] for f in _fp16_already(layers)]
    # a value fp16 flushed in a tensor the run held in fp16 is a zero there, which no count tells from a true one
    blind = (
        f"The row{'s' if len(held) > 1 else ''} of the {' and '.join(held)} cannot show what fp16 flushed there: "
        "this run held them in fp16, where a flushed value is a zero already, which no count tells from a true zero "
        "(the what-if section says more)."
        if held
        else ""
    )
    sampling = capture.get("sampling") if isinstance(capture, Mapping) else None
    tail = environment.unsampled_tail(sampling, steps) if isinstance(sampling, Mapping) else ""
    return {
        "img": _img(timeline.timeline_figure(tl, _restarts(steps)), alt),
        "note": " ".join(t for t in (tl.note, tail, blind, f"Weight updates: {late}." if late else "") if t),
        "aggregated": tl.aggregated,
    }


def build_context(
    tables: Mapping[str, pd.DataFrame],
    summary: Mapping[str, Any],
    recommendation: Any = None,
    *,
    histogram_totals: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """Everything the templates show, as plain data (numbers unformatted; the filters format them).
    ``histogram_totals``: the histograms summed over steps (``tables.read_run(..., histogram_totals=True)``),
    drawn instead of ``tables["histograms"]``."""
    tabs = {name: tables.get(name, T.empty(name)) for name in T.TABLES}
    tabs = {name: df if len(df.columns) else T.empty(name) for name, df in tabs.items()}
    layers, steps = tabs["layers"], tabs["steps"]
    if recommendation is None:
        recommendation = summary.get(T.SUMMARY_RECOMMENDATION)
    rec = recommendation_dict(recommendation)
    # the modules in forward order, read once: the heatmaps, the what-if and per-layer tables and the memory
    # section each order their rows by it (~25 ms a call for a 48-layer model)
    order = S.forward_order(layers, T.shared_params(summary))
    # each weight update's parameter size over its sampled elements, read once: the per-layer table's and the
    # timeline's lost updates weigh by it (~50 ms a call for a 48-layer model)
    weights = T.sample_weights(layers) if not layers.empty else None
    memory = _memory(tabs, summary, order)
    records = M.memory_records(summary)
    verdict = _verdict(rec, summary, memory["measured"], records)
    findings = sorted_findings(rec.get("findings", []) if rec else [])
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    model = (
        (summary.get(T.SUMMARY_MODEL) or {}).get("name")
        or cfg.get("model")
        or (summary.get(T.SUMMARY_CAPTURE) or {}).get("model_class")
        or "model"
    )
    status = str(summary.get(T.SUMMARY_STATUS) or T.STATUS_COMPLETE)
    norm_type = (summary.get(T.SUMMARY_CAPTURE) or {}).get("grad_norm_type")
    training_fig = plots.training_figure(steps, norm_type if isinstance(norm_type, str) else None)
    layer_rows = S.layer_records(
        layers,
        T.shared_params(summary),
        T.frozen_params(summary, layers),
        order,
        weights,
        T.trainable_changed(summary),
    )
    update_format = timeline.update_format(layers, "bf16") or "bf16"
    hw = summary.get(T.SUMMARY_HARDWARE) or {}
    target = str((rec or {}).get("target") or "")
    recorded_on = {str(hw.get(k) or "").lower() for k in ("name", "preset")} - {""}
    return {
        # the verdict planned for another machine (precprof report --target): the header says so
        "planned_for": target if target and recorded_on and target.lower() not in recorded_on else "",
        # a run killed before its first forward pass names no precision: the model alone
        "title": " · ".join(filter(None, (model, S.trained_precision(summary)))),
        "version": __version__,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "sections": SECTIONS,
        "incomplete": status == T.STATUS_INCOMPLETE,
        "incomplete_reason": summary.get(T.SUMMARY_INCOMPLETE_REASON)
        or "the run did not finish (cause not recorded)",
        "stopped": _stopped(steps, cfg) + _one_rank_note(steps, summary),
        # an incomplete run whose training ran to its end lost files, not steps (a full disk, Ctrl-C while its
        # report rendered): its banner said "the steps recorded before the run stopped" all the same
        "training_finished": summary.get(T.SUMMARY_TRAINING_FINISHED) is True,
        "errors": [str(e) for e in summary.get(T.SUMMARY_ERRORS) or []],
        "skipped_tensors": list((summary.get(T.SUMMARY_CAPTURE) or {}).get("skipped_tensors") or []),
        "headline": _headline(summary, steps, layers),
        "verdict": verdict,
        "findings": findings,
        "severity_counts": {
            s: sum(1 for f in findings if str(f.get("severity", "")).lower() == s)
            for s in ("critical", "warning", "info")
        },
        "training": {
            "img": _img(
                training_fig, "Loss, loss scale with skipped steps, and gradient norm over training steps"
            ),
            "restarts": _restarts(steps),
            "loss_note": " ".join(t for t in (_loss_note(steps), _holes_note(steps)) if t),
            "timeline": _timeline(layers, steps, summary.get(T.SUMMARY_CAPTURE) or {}, weights),
        },
        "heatmaps": _heatmaps(tabs, rec, histogram_totals, summary, order),
        "whatif": _whatif(layers, summary, rec, order),
        "layers": layer_rows,
        # its rows of modules' inputs (no layer of their own: the header's "layers profiled" leaves them out)
        "layer_inputs": sum(bool(r["layer_input"]) for r in layer_rows),
        # the layers whose update-to-weight ratio was read (``analysis.update_ratio``), in forward order
        "update_ratios": [r for r in layer_rows if not _missing(r.get("update_ratio_median"))],
        # the layers with sampled steps left out of their ratio for a nan or inf update, in forward order
        "update_nonfinite": [r for r in layer_rows if r.get("update_nonfinite")],
        # columns of the per-layer table that only some runs fill: left out when no row has them
        "layers_cols": {
            "lost_updates": any(not _missing(r.get(f"lost_update_{update_format}")) for r in layer_rows),
            # the format of the weights whose lost updates the table shows: the run's own (a pure run), else bf16
            "update_format": update_format,
            # the dtype of that format where the run holds weights in it (a pure run), else "": a row of a layer
            # held in another dtype there (a layer kept in fp32) shows a what-if, greyed
            "update_held": _held_dtype(layer_rows, update_format),
            "nonfinite": any(r.get("nonfinite_first") for r in layer_rows),
        },
        "memory": memory,
        "verification": S.precision_check(layers, tabs["memory"], summary),
        "environment": environment.environment(
            _last_sampled(sampling_from_steps(_reduced_steps_counted(summary, steps), steps), steps),
            throughput(steps, compiled_steps(summary)),
        ),
    }


def _held_dtype(layer_rows: list[dict[str, Any]], fmt: str) -> str:
    """``fmt``'s dtype name ("bfloat16") where some layer holds its weights in it, else ""."""
    dtype = formats.get(fmt).dtype_name if fmt in ("bf16", "fp16") else ""
    return dtype if dtype and any(dtype in str(r.get("param_dtype") or "") for r in layer_rows) else ""
