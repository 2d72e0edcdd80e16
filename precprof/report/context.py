"""The report's structure: from tables, summary and recommendation to the plain data the templates show.

Layers, as in ydata-profiling: ``summarize`` computes, ``plots`` draws, this module assembles one dict per
section, ``render`` fills the templates. Nothing here writes HTML.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from precprof import __version__, formats
from precprof import tables as T
from precprof.analysis import snippets as snippet_code
from precprof.analysis.throughput import throughput
from precprof.report import filters as F
from precprof.report import plots, timeline
from precprof.report import summarize as S

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
    current = S.requested_precision(summary)
    # the run's training memory: precprof's own buffers and scratch are not part of what a format changes
    own = float((measured.get("components") or {}).get(T.PROFILER_BUFFERS) or 0.0)
    saving = S.expected_saving(records, float(measured.get("total") or 0.0) - own, current, fmt)
    return {
        "format": fmt,
        "format_label": formats.label(fmt),
        "measured_format": str(rec.get("measured_format") or ""),
        "measured_label": formats.label(str(rec.get("measured_format") or "")),
        "loss_scale": _f(rec.get("loss_scale")),
        "fp16_loss_scale": _f(rec.get("fp16_loss_scale")),
        "growth_interval": rec.get("growth_interval"),
        "keep_fp32": list(rec.get("keep_fp32") or []),
        "fp8_layers": list(rec.get("fp8_layers") or []),
        "block_plan": _block_plan_groups(
            rec.get("block_plan"), (rec.get("block_what_if") or {}).get("plan_labels") or {}
        ),
        "reasons": [str(r) for r in rec.get("reasons") or []],
        "target": rec.get("target"),
        "current": current,
        "saving": saving,
        "snippets": snippet_code.snippets(rec),
    }


def _block_plan_groups(plan: Any, plan_labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The recommendation's block plan (layer -> format) as groups in the plan's order (the advisor's labels:
    NVFP4, MXFP4, MXFP8, BF16), each with its layers."""
    if not isinstance(plan, Mapping) or not plan:
        return []
    order = list(plan_labels)
    groups: dict[str, list[str]] = {}
    for module, fmt in plan.items():
        groups.setdefault(str(fmt), []).append(str(module))
    return [
        {"format": f, "label": plan_labels.get(f, f.upper()), "modules": groups[f]}
        for f in sorted(groups, key=lambda f: order.index(f) if f in order else len(order))
    ]


def _headline(summary: Mapping[str, Any], steps: pd.DataFrame, layers: pd.DataFrame) -> list[tuple[str, str]]:
    final = summary.get(T.SUMMARY_FINAL) or {}
    out: list[tuple[str, str]] = []
    prec = S.requested_precision(summary)
    if prec:
        out.append(("precision", prec))
    n_steps = len(steps) if not steps.empty else final.get("steps")
    if n_steps is not None:
        out.append(("steps", F.count(n_steps)))
    if not layers.empty:
        out.append(("sampled steps", F.count(layers[T.STEP].nunique())))
    if not steps.empty:
        out.append(("skipped steps", F.count(int(T.flags(steps[T.SKIPPED]).sum()))))
        loss = pd.to_numeric(steps[T.LOSS], errors="coerce").dropna()
        tail = T.nonfinite_loss_tail(steps)
        if tail is not None:  # diverged: the last finite loss is not the final one
            out.append(("final loss", f"{tail.kind} from step {tail.first}"))
        elif len(loss):
            out.append(("final loss", F.num(loss.iloc[-1], 4)))
    # throughput of the steps precprof left alone, first step out (analysis.throughput), and what a profiled
    # step cost beside it; a wall-clock rate would count sampled steps and warm-up
    tp = throughput(steps)
    if math.isfinite(tp["tokens_per_s"]):
        basis = f"{tp['tokens_per_s_basis']}, median of {F.count(tp['tokens_per_s_steps'])}"
        out.append((f"tokens/s ({basis})", F.num(tp["tokens_per_s"])))
    elif final.get("tokens_per_s") is not None:
        out.append(("tokens/s", F.num(final["tokens_per_s"])))
    if math.isfinite(tp["sampled_step_cost"]):
        out.append(("a sampled step", f"{tp['sampled_step_cost']:.2f}× an unsampled one"))
    if final.get("time_s") is not None:
        out.append(("time (s)", F.num(final["time_s"])))
    if not layers.empty:
        # a layer's own input row (T.input_module) is not a layer
        modules = layers[T.MODULE].dropna().unique()
        out.append(("layers profiled", F.count(sum(not str(m).endswith(T.INPUT_SUFFIX) for m in modules))))
    return out


def _heatmaps(
    tables: Mapping[str, pd.DataFrame], rec: dict[str, Any] | None, totals: pd.DataFrame | None = None
) -> list[dict[str, Any]]:
    layers = tables["layers"]
    hist = T.sum_histogram_frame(totals if totals is not None else tables["histograms"])
    rec_scale = None
    if rec:
        rec_scale = (
            _f(rec.get("loss_scale")) if rec.get("format") == "fp16" else _f(rec.get("fp16_loss_scale"))
        )
    out: list[dict[str, Any]] = []
    for kind in HEATMAP_KINDS:
        hm = plots.signature_heatmap(hist, layers, kind, recommended_scale=rec_scale)
        title = S.KIND_LABELS[kind].capitalize()
        if hm is None:
            out.append({"kind": kind, "title": title, "img": None, "notes": []})
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
        else:
            notes.append("Forward tensors are not loss-scaled: every window is at scale 1.")
        notes.append(
            "The BF16 window is static (scale 1). FP8 E4M3 and E5M2 are drawn under per-tensor current scaling, "
            "the recipe the FP8 advice assumes (Transformer Engine's and torchao's, scale 2^floor(log2(fmax/amax))): "
            "each row's window slides so that its largest value over the sampled steps lands just below the "
            "format's max, and is marked on that row; the strip shows it for the row with the largest value. The "
            "what-if table's “current scaling” columns count that recipe."
        )
        if hm.rows_shown < hm.rows_total:
            notes.append(
                f"Showing {hm.rows_shown} of {hm.rows_total} rows: the first and last, and those that lose the most "
                "in FP16; every row is in the tables below."
            )
        alt = (
            f"Heatmap of {S.KIND_LABELS[kind]}: {hm.rows_shown} rows in forward order by log2 magnitude, "
            "with FP16, BF16, FP8 E4M3 and E5M2 windows"
        )
        out.append({"kind": kind, "title": title, "img": _img(hm.figure, alt), "notes": notes})
    return out


def _whatif(layers: pd.DataFrame, summary: Mapping[str, Any], rec: dict[str, Any] | None) -> dict[str, Any]:
    cols = S.whatif_columns()
    headers = []
    for col, fmt, what in cols:
        label = formats.label(fmt)
        sub = {
            "underflow": "underflow",
            "overflow": "overflow",
            "underflow_cs": "underflow, current scaling",
        }[what]
        headers.append({"col": col, "format": fmt, "label": label, "what": sub})
    by_layer = S.whatif_by_layer(layers)
    rows = []
    for r in by_layer.to_dict("records"):
        rows.append(
            {
                "module": S.module_label(str(r[T.MODULE])),
                "module_type": r[T.MODULE_TYPE],
                "kind": S.KIND_LABELS.get(str(r[T.TENSOR]), str(r[T.TENSOR])),
                "numel": r[T.NUMEL],
                "scale": r[T.SCALE],
                "shares": [r[h["col"]] for h in headers],
            }
        )
    overview = []
    for r in S.whatif_overview(layers).to_dict("records"):
        overview.append(
            {
                "kind": S.KIND_LABELS.get(str(r[T.TENSOR]), str(r[T.TENSOR])),
                "numel": r[T.NUMEL],
                "shares": [r[h["col"]] for h in headers],
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
        "blocks": _blocks(rec, (summary.get(T.SUMMARY_CAPTURE) or {}).get("block_formats")),
    }


# the block recipes of the compact table (the details show every recipe the layers table holds)
BLOCK_TABLE_RECIPES: tuple[str, ...] = ("mxfp8_e4m3_rceil", "mxfp6_e2m3", "mxfp4", "nvfp4")


def db_text(v: Any) -> str:
    """An SQNR as the page writes it: "31.2 dB", "lossless" for inf, "not finite" for nan."""
    f = F._float(v)
    if f is None:
        return "not finite"
    return "lossless" if f == math.inf else f"{f:.1f} dB"


def _block_cell(cell: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """One recipe's cell: SQNR of the worst operand, the largest flushed and saturated shares, and whether the
    plan's rule for that recipe passes ("warn" when it does not)."""
    if not cell:
        return None
    return {
        "sqnr": db_text(cell.get("sqnr_db")),
        "sqnr_v": cell.get("sqnr_db"),
        "flushed": cell.get("flushed_share"),
        "saturated": cell.get("saturated_share"),
        "worst": cell.get("worst"),
        "cls": "warn" if cell.get("fails") else "",
    }


def _blocks(rec: dict[str, Any] | None, capture: Any = None) -> dict[str, Any] | None:
    """The block-scaled what-if as the advisor stored it (``Recommendation.block_what_if``): per linear layer and
    recipe the worst operand's SQNR and the largest flushed and saturated shares, the plan (for the target when
    it runs block formats, else what a B200 would get), and per operand the details. None without it (no
    recommendation, an older run, or no block statistics). ``capture``: the run's ``block_formats`` capture
    setting (``{"groups": n}``: each layer evaluated on every n-th sampled step)."""
    data = (rec or {}).get("block_what_if") or {}
    layers = data.get("layers") or []
    if not layers:
        return None
    labels = dict(data.get("labels") or {})
    plan_labels = dict(data.get("plan_labels") or {})
    present = {r for lb in layers for r in (lb.get("recipes") or {})}
    shown = [r for r in BLOCK_TABLE_RECIPES if r in present]
    every = [r for r in T.BLOCK_RECIPES if r in present]
    rows, details = [], []
    for lb in layers:
        choice = str(lb.get("choice") or "")
        recipes = lb.get("recipes") or {}
        rows.append(
            {
                "module": S.module_label(str(lb.get("module", ""))),
                "module_type": lb.get("module_type"),
                "plan": plan_labels.get(choice, choice),
                "plan_format": choice,
                "why": lb.get("why") or "",
                "input_from": S.module_label(lb["input_from"]) if lb.get("input_from") is not None else None,
                "cells": [_block_cell(recipes.get(r)) for r in shown],
            }
        )
        for op in lb.get("operands") or []:
            cells = [_block_cell((op.get("recipes") or {}).get(r)) for r in every]
            if any(c is not None for c in cells):
                details.append(
                    {
                        "module": S.module_label(str(lb.get("module", ""))),
                        "operand": op.get("operand"),
                        "gemm": op.get("gemm"),
                        "axis": op.get("axis"),
                        "cells": cells,
                    }
                )
    rules = data.get("rules") or {}
    return {
        "recipes": [{"name": r, "label": labels.get(r, r)} for r in shown],
        "all_recipes": [{"name": r, "label": labels.get(r, r)} for r in every],
        "rows": rows,
        "details": details,
        "groups": int(capture.get("groups") or 1) if isinstance(capture, Mapping) else 1,
        "on_target": bool(data.get("on_target")),
        "target": str(data.get("target") or ""),
        "fp4_sqnr_min_db": rules.get("fp4_sqnr_min_db"),
        "lost_norm_max": rules.get("lost_norm_max"),
        "rule": rules.get("text") or "",
        "mxfp8_sqnr_min_db": rules.get("mxfp8_sqnr_min_db"),
    }


# config/capture keys shown under "numerics settings" (matched as whole words of the key)
_NUMERICS_WORDS = frozenset(
    {"autocast", "precision", "scaler", "amp", "tf32", "fp8", "dtype", "fp16", "bf16"}
)


# capture keys whose name alone does not say what the number is: (label, formatter)
_CAPTURE_LABELS: dict[str, tuple[str, Any]] = {
    "param_bytes": ("parameters (bytes)", F.nbytes),
    "profiler_buffer_bytes": ("profiler buffers (bytes)", F.nbytes),
    "profiler_scratch_bytes": ("profiler scratch (bytes)", F.nbytes),
    "profiler_buffer_share_of_params": ("profiler buffers, as a share of the parameters' bytes", F.pct),
    "n_params": ("parameters", F.count),
    "block_formats": ("block-format what-if", lambda v: _block_setting(v)),
}


def _block_setting(v: Any) -> str:
    """The capture's ``block_formats`` setting in words (``capture.block_budget.BlockBudget.describe``)."""
    if not isinstance(v, Mapping):
        return "on" if v else "off"
    n = int(v.get("groups") or 1)
    turns = (
        "every linear layer on every sampled step"
        if n <= 1
        else f"each linear layer on every {F.ordinal(n)} sampled step ({n} groups taking turns)"
    )
    if not v.get("adaptive"):
        return f"on, {turns} (block_groups={n})"
    out = f"on, {turns}: as many groups as keep the what-if within {F.pct(float(v.get('budget') or 0))} of a sampled step"
    cost = v.get("every_layer_cost")
    if isinstance(cost, (int, float)) and math.isfinite(cost):
        out += f" (every layer at once was measured to add {F.pct(float(cost))})"
    return out


def _is_tf32_key(key: str) -> bool:
    return "tf32" in key.lower()


def _environment(summary: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(summary.get(T.SUMMARY_CONFIG) or {})
    hw = dict(summary.get(T.SUMMARY_HARDWARE) or {})
    capture = dict(summary.get(T.SUMMARY_CAPTURE) or {})
    if hw and hw.get("device") != "cuda":
        # TF32 is a CUDA matmul/cuDNN mode: its flags say nothing on another device
        hw = {k: v for k, v in hw.items() if not _is_tf32_key(k)}
        cfg = {k: v for k, v in cfg.items() if not _is_tf32_key(k)}
    capture = {
        (_CAPTURE_LABELS[k][0] if k in _CAPTURE_LABELS else k): (
            _CAPTURE_LABELS[k][1](v) if k in _CAPTURE_LABELS and v is not None else v
        )
        for k, v in capture.items()
    }
    # the per-module list is the per-layer table's business; here only its length
    if isinstance(capture.get("modules"), list):
        capture["modules"] = f"{len(capture['modules'])} modules (see the per-layer table)"
    command = None
    for src in (cfg, summary):
        for key in ("command", "command_line", "cmdline", "argv"):
            if src.get(key):
                command = src[key]
                break
        if command is not None:
            break
    settings: list[tuple[str, Any]] = []
    for key, label in (
        ("tf32_matmul_enabled", "TF32 matmul (torch.backends.cuda.matmul.allow_tf32)"),
        ("tf32_cudnn_enabled", "TF32 cuDNN (torch.backends.cudnn.allow_tf32)"),
        ("float32_matmul_precision", "torch.get_float32_matmul_precision()"),
    ):
        if key in hw:
            settings.append((label, hw[key]))
    for src_name, src in (("config", cfg), ("capture", capture)):
        for k, v in src.items():
            if any(
                w in k.lower() for w in ("autocast", "precision", "loss_scal", "scaler", "amp", "tf32", "fp8")
            ):
                settings.append((f"{k} ({src_name})", v))
    device = hw.get("name") or hw.get("device")
    if hw.get("compute_capability"):
        device = f"{device} (compute capability {hw['compute_capability']})"
    return {
        "device": device,
        "command": command,
        "settings": settings,
        "groups": [
            ("Hardware", hw),
            ("Versions", dict(summary.get(T.SUMMARY_VERSIONS) or {})),
            ("Run configuration", cfg),
            ("Model", dict(summary.get(T.SUMMARY_MODEL) or {})),
            ("Capture", capture),
        ],
    }


def _memory(tables: Mapping[str, pd.DataFrame], summary: Mapping[str, Any]) -> dict[str, Any]:
    measured = S.measured_memory(tables["memory"])
    records = S.memory_records(summary)
    fig = plots.memory_figure(measured, records, S.requested_precision(summary))
    mem = summary.get(T.SUMMARY_MEMORY)
    mem = mem if isinstance(mem, Mapping) else {}
    claim = mem.get("textbook_claim")
    return {
        "img": _img(fig, "Stacked bars of memory per component: this run as measured and projected per mode"),
        "measured": measured,
        "projection": S.memory_table(records, "measured+projected"),
        "textbook": S.memory_table(records, "textbook"),
        "claim": claim.get("text")
        if isinstance(claim, Mapping)
        else (claim if isinstance(claim, str) else None),
        "assumptions": [str(a) for a in mem.get("assumptions") or []],
        "has_projection": bool(records),
        "peak_note": str((mem.get("model") or {}).get("peak_note") or ""),
    }


def _restarts(steps: pd.DataFrame) -> list[int]:
    """The steps a resumed run restarted from."""
    if steps.empty or T.RESUMED not in steps:
        return []
    return sorted({int(s) for s in steps[T.STEP][T.flags(steps[T.RESUMED])]})


def _timeline(layers: pd.DataFrame, steps: pd.DataFrame) -> dict[str, Any] | None:
    """The time axis over sampled steps (``report.timeline``): a figure and what it aggregated."""
    tl = timeline.timeline(layers)
    if tl is None or tl.n_steps < 2:
        return None
    alt = f"Share of values lost in FP16 per tensor kind over {tl.n_steps} sampled steps"
    return {
        "img": _img(timeline.timeline_figure(tl, _restarts(steps)), alt),
        "note": tl.note,
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
    memory = _memory(tabs, summary)
    records = S.memory_records(summary)
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
    training_fig = plots.training_figure(steps)
    hw = summary.get(T.SUMMARY_HARDWARE) or {}
    target = str((rec or {}).get("target") or "")
    recorded_on = {str(hw.get(k) or "").lower() for k in ("name", "preset")} - {""}
    return {
        # the verdict planned for another machine (precprof report --target): the header says so
        "planned_for": target if target and recorded_on and target.lower() not in recorded_on else "",
        "title": f"{model} · {S.requested_precision(summary) or 'run'}",
        "version": __version__,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "sections": SECTIONS,
        "incomplete": status == T.STATUS_INCOMPLETE,
        "incomplete_reason": summary.get(T.SUMMARY_INCOMPLETE_REASON)
        or "the run did not finish (cause not recorded)",
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
            "timeline": _timeline(layers, steps),
        },
        "heatmaps": _heatmaps(tabs, rec, histogram_totals),
        "whatif": _whatif(layers, summary, rec),
        "layers": S.layer_records(layers),
        "memory": memory,
        "verification": S.precision_check(layers, tabs["memory"], summary),
        "environment": _environment(summary),
    }
