"""Memory as the report shows it: what this run held per component, what was allocated at its allocator's peak
part by part, the projection per precision mode as tables, and what the recommended format would save of the
peak. Pure pandas over the memory table and ``summary["memory"]``; no plotting, no HTML.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from precprof import tables as T
from precprof.analysis.memory_projection import (
    FLOAT_BYTES,
    held_per_step,
    output_bytes,
    representative_step,
)
from precprof.report import filters as F

# memory components that are totals of the whole process or device, not parts of a stack
PEAK_COMPONENTS = T.MEMORY_PEAK_COMPONENTS


# What each part of the allocator's peak is, in the report's words (``moment == "peak"`` rows); temporaries
# are labelled by the phase that allocated them.
PEAK_PART_LABELS: dict[str, str] = {
    T.PARAMETERS: "parameters",
    T.BUFFERS: "module buffers",
    T.MASTER_WEIGHTS: "master weights",
    T.OPTIMIZER_STATES: "optimizer states",
    T.GRADIENTS: "gradients",
    T.AUTOCAST_WEIGHT_COPIES: "autocast weight copies",
    T.ACTIVATIONS: "activations saved for backward",
    T.INPUTS: "model inputs (the batch)",
    T.OUTPUTS: "model outputs (logits)",
    T.PROFILER_BUFFERS: "precprof's buffers allocated by then",
    T.OTHER_MEMORY: "other (allocated before the step, not named)",
    T.ALLOCATOR_CACHE: "allocator cache (reserved, not allocated)",
}
TEMPORARY_LABELS: dict[str, str] = {
    T.PHASE_FORWARD: "temporaries allocated in forward, still alive",
    T.PHASE_BACKWARD: "temporaries allocated after forward: the loss, gradients of activations in flight, "
    "workspaces",
    T.PHASE_OPTIMIZER: "temporaries of the optimizer step",
    T.PHASE_OTHER: "temporaries allocated outside forward, backward and the optimizer step",
}


def peak_parts(memory: pd.DataFrame, step: int | None = None) -> dict[str, Any] | None:
    """What was allocated at the allocator's peak of ``step`` (when it has it; else of the last step that has
    it), part by part.

    Returns {"step", "phase" (of the peak), "allocated" (the parts' sum: the allocator's peak), "cache"
    (reserved - allocated then; 0 without a caching allocator), "parts": [{"part", "label", "bytes", "share",
    "dtypes": {dtype: bytes}}]
    (largest first, "other" and the cache last; share of ``allocated``), "named_share"} or None when no step has
    them (a CPU run outside the built-in loop, or a run recorded before they existed)."""
    rows = T.memory_at(memory, T.MOMENT_PEAK) if not memory.empty else memory
    if rows.empty:
        return None
    if step is None or not (rows[T.STEP] == step).any():
        step = rows[T.STEP].max()
    last = rows[rows[T.STEP] == step]
    b = pd.to_numeric(last[T.BYTES], errors="coerce").fillna(0)
    comp, module = T.texts(last[T.COMPONENT]), T.texts(last[T.MODULE])
    key = comp.where(comp != T.TEMPORARIES, T.TEMPORARIES + ":" + module)
    per = b.groupby(key).sum()
    by_dtype = b.groupby([key, T.texts(last[T.DTYPE])]).sum()
    cache = float(per.get(T.ALLOCATOR_CACHE, 0.0))
    allocated = float(per.sum()) - cache
    parts: list[dict[str, Any]] = []
    for k, v in per.items():
        name, _, phase = str(k).partition(":")
        if name == T.ALLOCATOR_CACHE:
            continue
        label = TEMPORARY_LABELS.get(phase, f"temporaries ({phase})") if name == T.TEMPORARIES else None
        parts.append(
            {
                "part": str(k),
                "label": label or PEAK_PART_LABELS.get(name, name.replace("_", " ")),
                "bytes": float(v),
                "share": float(v) / allocated if allocated else math.nan,
                # bytes per dtype ("" where the part has none: temporaries), what a projection scales
                "dtypes": {str(d): float(x) for d, x in by_dtype.loc[k].items()},
            }
        )
    parts.sort(key=lambda p: (p["part"] == T.OTHER_MEMORY, -p["bytes"]))
    other = float(per.get(T.OTHER_MEMORY, 0.0))
    return {
        "step": int(step),
        "phase": str(T.texts(last[T.PHASE]).iloc[0]),
        "allocated": allocated,
        "cache": cache,
        "parts": parts,
        "named_share": (allocated - other) / allocated if allocated else math.nan,
    }


# the share of the allocator's peak that the logits and what follows from them must reach for the memory section
# to name them as its lever: below it, checkpointing or the batch are the levers the parts table shows
LOGITS_LEVER_SHARE = 0.25


def logits_lever(memory: pd.DataFrame, at_peak: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The model's outputs as the lever of the allocator's peak (a language model's logits over a large
    vocabulary; any output large beside the rest, a decoder's under MSE too): the model's
    outputs alive at the peak, what the loss saved for backward there (the activations of ``(loss)``: the
    built-in loop's, or a ``Profiler.memory_scope()``'s), and the temporaries allocated after forward up to two
    fp32 tensors of the outputs' elements (cross-entropy's backward begins with the gradient of the log-softmax
    and of the logits, each of that size: more is not theirs to claim). None without outputs at the peak, or
    where these come to less than ``LOGITS_LEVER_SHARE`` of it.

    Returns {"elements" (of the outputs, float ones), "outputs", "loss", "fp32_grad" (4 bytes per element),
    "temporaries" (allocated after forward, all of them), "counted" (the sum: outputs, loss, and temporaries up
    to 2 fp32 gradients), "share" (of the peak), "allocated"}."""
    if not at_peak or not at_peak.get("allocated"):
        return None
    parts = {str(p["part"]): p for p in at_peak.get("parts") or []}
    out = parts.get(T.OUTPUTS)
    if out is None:
        return None
    dtypes = out.get("dtypes") or {}
    elements = sum(float(b) / FLOAT_BYTES[str(d)] for d, b in dtypes.items() if str(d) in FLOAT_BYTES)
    if elements <= 0:
        return None
    rows = T.memory_at(memory, T.MOMENT_PEAK)
    rows = rows[(rows[T.STEP] == at_peak["step"]) & (rows[T.COMPONENT] == T.ACTIVATIONS)]
    loss = float(pd.to_numeric(rows[T.BYTES], errors="coerce")[T.texts(rows[T.MODULE]) == "(loss)"].sum())
    temps = parts.get(f"{T.TEMPORARIES}:{T.PHASE_BACKWARD}")
    temporaries = float(temps["bytes"]) if temps else 0.0
    fp32_grad = 4.0 * elements
    counted = float(out["bytes"]) + loss + min(temporaries, 2 * fp32_grad)
    allocated = float(at_peak["allocated"])
    if counted < LOGITS_LEVER_SHARE * allocated:
        return None
    return {
        "elements": elements,
        "outputs": float(out["bytes"]),
        "loss": loss,
        "fp32_grad": fp32_grad,
        "temporaries": temporaries,
        "counted": counted,
        "share": counted / allocated,
        "allocated": allocated,
    }


# the modules the "Largest saved activations" table lists
TOP_ACTIVATIONS = 10


def measured_memory(memory: pd.DataFrame, order: Sequence[str] = ()) -> dict[str, Any]:
    """Totals per component at the measured step that stands for the run (``representative_step``: the one that
    held the most), its peaks, top activation modules (``top_saved``; ties in ``order``, the modules' forward
    order), and what was allocated at its allocator's peak (``peak_parts``).

    Returns {"step", "held": {step: bytes held} of every measured step, "components": {component: bytes},
    "loss_not_counted" (activations were measured, none under ``Profiler.memory_scope``),
    "peaks": {component: bytes}, "peak_steps": {component: step} (a peak the step does not have is the highest
    of the other steps': in a user's loop on CUDA a step below an earlier peak has only a lower bound,
    tables.ALLOCATOR_SEEN_MAX), "top_activations": [(module, bytes)], "top_activations_note": what they are of
    (``top_saved``), "total": bytes of the stacked components,
    "at_peak": ``peak_parts`` or None, "logits": ``logits_lever`` or None}.
    """
    step = representative_step(memory)
    at_peak = peak_parts(memory, step)
    logits = logits_lever(memory, at_peak)
    memory = T.memory_at(memory) if not memory.empty else memory
    if step is None:
        return {
            "step": None,
            "held": {},
            "components": {},
            "peaks": {},
            "peak_steps": {},
            "top_activations": [],
            "top_activations_note": "",
            "loss_not_counted": False,
            "total": 0.0,
            "at_peak": None,
            "logits": None,
        }
    last = memory[memory[T.STEP] == step]
    b = pd.to_numeric(last[T.BYTES], errors="coerce").fillna(0)
    per = b.groupby(last[T.COMPONENT]).sum()
    comps = {str(c): float(v) for c, v in per.items() if c not in PEAK_COMPONENTS and v > 0}
    peaks, peak_steps = _peaks(memory, step)
    acts = last[last[T.COMPONENT] == T.ACTIVATIONS]
    scopes = T.texts(acts[T.MODULE]).str.startswith("(")  # prof.memory_scope()'s names: "(loss)" by default
    top, note = top_saved(pd.to_numeric(acts[T.BYTES], errors="coerce").groupby(acts[T.MODULE]).sum(), order)
    return {
        "step": step,
        "held": {int(k): float(v) for k, v in held_per_step(memory).items()},
        "components": comps,
        "peaks": peaks,
        "peak_steps": peak_steps,
        "top_activations": top,
        "top_activations_note": note,
        # activations measured, and none saved under a memory scope: a loss computed in the user's loop,
        # outside the model's forward, was not counted
        "loss_not_counted": bool(len(acts)) and not scopes.any(),
        "total": float(sum(comps.values())),
        "at_peak": at_peak,
        "logits": logits,
    }


def top_saved(per_module: pd.Series, order: Sequence[str] = ()) -> tuple[list[tuple[str, float]], str]:
    """The ``TOP_ACTIVATIONS`` modules (and memory scopes) of ``per_module`` (bytes saved per module) that saved
    the most, largest first, ties in ``order`` (forward order, a container at its first child's place; the rest
    after, by name with its numbers as numbers), and what they are of in words where some are left out: how many
    saved any, and how many of those left out saved as much as the last shown (a 48-layer model's table showed
    10 of 48 tied attention modules, in no order, and not that it was the top 10 of 484)."""
    saved = per_module[per_module > 0]
    rank: dict[str, int] = {}
    for i, m in enumerate(order):
        parts = str(m).split(".")
        for k in range(len(parts), 0, -1):
            rank.setdefault(".".join(parts[:k]), i)
    ranked = sorted(
        ((str(m), float(b)) for m, b in saved.items()),
        key=lambda mb: (-mb[1], rank.get(mb[0], len(rank)), _natural(mb[0])),
    )
    top, rest = ranked[:TOP_ACTIVATIONS], ranked[TOP_ACTIVATIONS:]
    if not rest:
        return top, ""
    note = (
        f"The {len(top)} that saved the most of the {F.count(len(ranked))} modules (and memory scopes) that saved "
        "any, largest first"
    )
    last = top[-1][1]
    tied = sum(b == last for _, b in rest)
    if tied:
        shown = sum(b == last for _, b in top)
        note += (
            f"; {F.count(tied)} more saved {F.nbytes(last)} each, as the last {F.count(shown)} shown did, and are "
            "left out (ties are listed in forward order)"
        )
    return top, note + "."


def _natural(name: str) -> list[tuple[int, str]]:
    """A name's sort key with its numbers as numbers: layers.2 before layers.10."""
    return [(int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", name) if p]


def _peaks(memory: pd.DataFrame, step: int) -> tuple[dict[str, float], dict[str, int]]:
    """(peak per component, the step it is from): ``step``'s own (its phases' max, never their sum), else the
    highest of the other steps' (the counters' peak of a user's loop is the process's, which a later step may
    not reach again)."""
    rows = memory[memory[T.COMPONENT].isin(PEAK_COMPONENTS)]
    b = pd.to_numeric(rows[T.BYTES], errors="coerce")
    per = b.groupby([rows[T.COMPONENT], rows[T.STEP]]).max().dropna()
    peaks: dict[str, float] = {}
    steps: dict[str, int] = {}
    for comp, by_step in per.groupby(level=0):
        by_step = by_step.droplevel(0)
        at = step if step in by_step.index else int(by_step.idxmax())
        peaks[str(comp)], steps[str(comp)] = float(by_step[at]), int(at)
    return peaks, steps


def step_note(measured: Mapping[str, Any], new_shapes: Iterable[int] = ()) -> str:
    """Which measured step the memory section shows and why, when more than one was measured: the one that
    held the most, and what the last one held when it held less (a smaller last batch, measured for its new
    input shapes, ``new_shapes``); "" with one measured step."""
    held = {int(k): float(v) for k, v in (measured.get("held") or {}).items()}
    step = measured.get("step")
    if step is None or len(held) < 2:
        return ""
    note = f"Step {step} is shown: of the {len(held)} measured steps it held the most."
    last = max(held)
    if last != step and held[last] < held.get(int(step), 0.0):
        why = " (measured because its inputs had new shapes)" if last in set(new_shapes) else ""
        note += f" The last, step {last}{why}, held {F.nbytes(held[int(step)] - held[last])} less."
    return note


def ddp_buckets(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """DDP's gradient buckets on each rank, which no component of the memory table holds: {"bytes" (their sum,
    from DDP's bucket sizes), "as_view" (gradient_as_bucket_view: the .grad tensors are views into them, no
    copy; else the buckets are one more copy of the gradients)}. None outside DDP or without the sizes."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    dist = capture.get("distributed") if isinstance(capture, Mapping) else None
    if not isinstance(dist, Mapping) or dist.get("wrapper") != "DDP":
        return None
    size = dist.get("bucket_bytes")
    if not isinstance(size, (int, float)) or size <= 0:
        return None
    return {"bytes": float(size), "as_view": bool(dist.get("gradient_as_bucket_view"))}


def memory_records(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """summary["memory"] as flat records {mode, component, bytes, source}; tolerant of a dict-of-modes layout."""
    mem = summary.get(T.SUMMARY_MEMORY)
    if not mem:
        return []
    recs = (mem.get("records") or mem.get("projection") or []) if isinstance(mem, Mapping) else mem
    out = []
    for r in recs if isinstance(recs, Iterable) else []:
        if isinstance(r, Mapping) and "bytes" in r and "component" in r:
            out.append(
                {
                    "mode": str(r.get("mode", "")),
                    "component": str(r["component"]),
                    "bytes": float(r["bytes"] or 0),
                    "source": str(r.get("source", "projected")),
                }
            )
    return out


def memory_totals(records: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Total bytes per (mode, source), peaks excluded."""
    tot: dict[tuple[str, str], float] = {}
    for r in records:
        if r["component"] in PEAK_COMPONENTS:
            continue
        key = (r["mode"], r["source"])
        tot[key] = tot.get(key, 0.0) + r["bytes"]
    return tot


def memory_table(
    records: list[dict[str, Any]], source: str, peaks: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """Records of one source (or "measured+projected") as a table: components with bytes somewhere, and one row
    per (mode, source) with bytes per component, the total and the saving against fp32 of the same source.
    ``peaks`` (``projected_peaks``'s "modes"): each projected row's allocator peak in its mode, and that peak's
    saving against fp32's (the parts' total leaves out temporaries and the model's outputs: an fp32 run's
    parts said bf16 saved nothing, -3%, where its projected peak, and a real bf16 run's, was 10% lower).

    Returns {"components": [...], "rows": [{"mode", "source", "cells", "total", "saving_vs_fp32", "peak",
    "peak_saving_vs_fp32"}], "has_peaks"}; a row's "peak" is None where it has none.
    """
    sources = ("measured", "projected") if source == "measured+projected" else (source,)
    recs = [r for r in records if r["source"] in sources and r["component"] not in PEAK_COMPONENTS]
    comps = list(dict.fromkeys(r["component"] for r in recs if r["bytes"] > 0))
    grid: dict[tuple[str, str], dict[str, float]] = {}
    for r in recs:
        cell = grid.setdefault((r["mode"], r["source"]), {})
        cell[r["component"]] = cell.get(r["component"], 0.0) + r["bytes"]
    tot = memory_totals(records)
    peaks = peaks or {}
    fp32_peak = peaks.get("fp32")
    rows = []
    for (mode, src), cells in grid.items():
        total = sum(cells.values())
        base = tot.get(("fp32", "textbook" if src == "textbook" else "projected"))
        peak = peaks.get(mode) if src == "projected" else None
        rows.append(
            {
                "mode": mode,
                "source": src,
                "cells": [cells.get(c) for c in comps],
                "total": total,
                "saving_vs_fp32": (base - total) / base if base else math.nan,
                "peak": peak,
                "peak_saving_vs_fp32": (fp32_peak - peak) / fp32_peak
                if peak is not None and fp32_peak
                else math.nan,
            }
        )
    return {"components": comps, "rows": rows, "has_peaks": any(r["peak"] is not None for r in rows)}


# components the projection changes with the format (the model's outputs too, by ``output_bytes``); every other
# part of the peak (temporaries, inputs, precprof's own, other) is taken as measured
PROJECTED_COMPONENTS: tuple[str, ...] = (
    T.PARAMETERS,
    T.GRADIENTS,
    T.OPTIMIZER_STATES,
    T.MASTER_WEIGHTS,
    T.BUFFERS,
    T.ACTIVATIONS,
    T.AUTOCAST_WEIGHT_COPIES,
)


def projected_peaks(
    measured: Mapping[str, Any],
    records: list[dict[str, Any]],
    current: str,
    outputs_from_matmul: bool = False,
) -> dict[str, Any] | None:
    """The allocator's peak of this run and what it would be in each projected mode.

    Each component the projection changes is scaled, in the part of it alive at the peak, by its projection in
    the other mode over its projection in this run's mode (so that the projection's own error cancels); a
    component this run did not hold (autocast's weight copies in an fp32 run) is added whole. The model's
    outputs alive at the peak (the logits) take the bytes the mode holds them in (``output_bytes``, per dtype;
    ``outputs_from_matmul``: the summary's ``memory["outputs_from_matmul"]``): a 16-bit run's logits double in
    fp32. Temporaries (the gradients in flight), the batch and precprof's buffers are taken as measured.
    Without a breakdown of the peak every component held at the end of the step is taken as alive at the peak
    (no outputs: the step's end holds none).

    Returns {"peak", "basis": "parts at the peak" | "parts held at the step's end", "modes": {mode: bytes},
    "phase" (of the peak, "" without a breakdown), "not_at_peak": [components the step held, none of them
    alive at the peak]} or None without an allocator peak or a projection of this run's mode.
    """
    at_peak = measured.get("at_peak")
    peak = (
        float(at_peak["allocated"])
        if at_peak
        else float((measured.get("peaks") or {}).get(T.ALLOCATOR_PEAK) or 0)
    )
    if peak <= 0:
        return None
    held = {str(c): float(b) for c, b in (measured.get("components") or {}).items()}
    if at_peak:
        alive = {str(p["part"]): float(p["bytes"]) for p in at_peak.get("parts") or []}
        outputs = next(
            (
                p.get("dtypes") or {"": p["bytes"]}
                for p in at_peak.get("parts") or []
                if p["part"] == T.OUTPUTS
            ),
            {},
        )
        basis = "parts at the peak"
    else:
        alive, outputs = held, {}
        basis = "parts held at the step's end"
    outputs_now = sum(float(b) for b in outputs.values())
    proj: dict[str, dict[str, float]] = {}
    for r in records:
        if r["source"] == "projected" and r["component"] in PROJECTED_COMPONENTS:
            proj.setdefault(r["mode"], {})[r["component"]] = r["bytes"]
    base = proj.get(current)
    if not base:
        return None
    modes = {}
    for mode, comps in proj.items():
        delta = 0.0
        for c in PROJECTED_COMPONENTS:
            now, then = base.get(c, 0.0), comps.get(c, 0.0)
            if now > 0:
                delta += alive.get(c, 0.0) * (then / now - 1.0)
            else:
                delta += then
        if outputs_now:
            delta += output_bytes(outputs, mode, current, outputs_from_matmul) - outputs_now
        modes[mode] = peak + delta
    return {
        "peak": peak,
        "basis": basis,
        "modes": modes,
        "phase": str(at_peak["phase"]) if at_peak else "",
        # a part the step held that was freed, or not yet allocated, at the peak (the gradients, at a peak early
        # in backward): why the parts, added up, can come to more than the peak
        "not_at_peak": [c for c in PROJECTED_COMPONENTS if held.get(c, 0.0) > 0 and alive.get(c, 0.0) <= 0],
    }


def expected_saving(
    records: list[dict[str, Any]],
    measured_total: float,
    current: str,
    recommended: str,
    measured: Mapping[str, Any] | None = None,
    outputs_from_matmul: bool = False,
) -> dict[str, Any] | None:
    """Memory of the recommended mode against this run and against fp32, from the memory projection.

    With ``measured`` (``measured_memory``) and an allocator peak, the figures are peaks (``projected_peaks``,
    "basis": "peak"): a saving of memory is a saving of the peak. Otherwise (no peak recorded) they are the
    components held at the end of a step ("basis": "held"): this run's total is its measured record with what
    the projection assumed of it (``assumed`` records: the states of an optimizer the Profiler was not given;
    else its projection, else the measured tables); the recommended
    mode's is its projection (else textbook). The fp32 baseline is the fp32 projection. Returns {"current",
    "recommended", "saved", "share", "fp32", "share_vs_fp32", "same_mode"} or None when the recommended mode
    has no projection; held figures add "assumed" (bytes of this run's total that were assumed, not measured),
    peaks "fp32_parts" (the projection's FP32 total, which the memory section shows beside FP32's peak),
    "peak_phase", "not_at_peak" (``projected_peaks``'s: the parts the step held and the peak did not) and
    "assumed" (bytes of optimizer states the projection assumes, in every mode's parts, and this run's peak
    never held: no optimizer was given to the Profiler). ``outputs_from_matmul``: ``projected_peaks``'s.
    ``recommended`` may be "fp8": its projection is looked up under that name.
    """
    if not recommended:
        return None
    peaks = projected_peaks(measured, records, current, outputs_from_matmul) if measured else None
    tot = memory_totals(records)
    if peaks is not None and (recommended in peaks["modes"] or current == recommended):
        # a memory saving is a saving of the peak: what the run needs the device to hold
        rec_peak = peaks["modes"].get(recommended, peaks["peak"]) if current != recommended else peaks["peak"]
        fp32_peak = peaks["modes"].get("fp32")
        cur_peak = peaks["peak"]
        return {
            "basis": "peak",
            "peak_basis": peaks["basis"],
            "current": cur_peak,
            "recommended": rec_peak,
            "saved": cur_peak - rec_peak,
            "share": (cur_peak - rec_peak) / cur_peak if cur_peak else None,
            "fp32": fp32_peak,
            "share_vs_fp32": (fp32_peak - rec_peak) / fp32_peak if fp32_peak else None,
            "same_mode": current == recommended,
            # the projection table's FP32 total: its parts alone, what the peak adds the rest to
            "fp32_parts": tot.get(("fp32", "projected")),
            # Adam's states, assumed in every mode's parts (no optimizer given): never in this run's peak
            "assumed": tot.get((current, "assumed"), 0.0),
            "peak_phase": peaks["phase"],
            "not_at_peak": [PEAK_PART_LABELS.get(c, c) for c in peaks["not_at_peak"]],
        }

    def pick(mode: str, sources: tuple[str, ...]) -> float | None:
        for src in sources:
            if (mode, src) in tot:
                return tot[(mode, src)]
        return None

    cur = pick(current, ("measured", "projected"))
    if cur is None and measured_total > 0:
        cur = measured_total
    assumed = tot.get((current, "assumed"), 0.0) if cur is not None and (current, "measured") in tot else 0.0
    if cur is not None:
        # what the run held but did not measure (the states of an optimizer the Profiler was not given), as the
        # projections assume it
        cur += assumed
    rec = pick(recommended, ("projected", "measured", "textbook"))
    if rec is None and current == recommended:
        rec = cur
    if rec is None:
        return None
    fp32 = pick("fp32", ("projected", "measured"))
    return {
        "basis": "held",
        "assumed": assumed,
        "current": cur,
        "recommended": rec,
        "saved": cur - rec if cur is not None else None,
        "share": (cur - rec) / cur if cur else None,
        "fp32": fp32,
        "share_vs_fp32": (fp32 - rec) / fp32 if fp32 else None,
        "same_mode": current == recommended,
    }
