"""The block-scaled what-if as the page shows it: the plan's groups for the verdict, and per linear layer and
recipe the worst operand's SQNR and the largest flushed and saturated shares, as the advisor stored them
(``Recommendation.block_what_if``). Plain data; the templates write it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from precprof import tables as T
from precprof.report import filters as F
from precprof.report import summarize as S


def plan_groups(plan: Any, plan_labels: Mapping[str, str], running: Any = None) -> list[dict[str, Any]]:
    """The recommendation's block plan (layer -> format) as groups in the plan's order (the advisor's labels:
    NVFP4, MXFP4, MXFP8, BF16), each with its layers and, where the run already runs some of them in a block
    format (``running``: layer -> format, torchao's MX layers), what they run now ("4 run MXFP8 now")."""
    if not isinstance(plan, Mapping) or not plan:
        return []
    running = running if isinstance(running, Mapping) else {}
    order = list(plan_labels)
    groups: dict[str, list[str]] = {}
    for module, fmt in plan.items():
        groups.setdefault(str(fmt), []).append(str(module))
    return [
        {
            "format": f,
            "label": plan_labels.get(f, f.upper()),
            "modules": groups[f],
            "now": _now(groups[f], running, plan_labels),
        }
        for f in sorted(groups, key=lambda f: order.index(f) if f in order else len(order))
    ]


def _now(modules: list[str], running: Mapping[str, Any], plan_labels: Mapping[str, str]) -> str:
    """How many of ``modules`` the run already runs in each block format, in words ("" for none)."""
    now: dict[str, int] = {}
    for m in modules:
        if m in running:
            now[str(running[m])] = now.get(str(running[m]), 0) + 1
    every = len(modules) == sum(now.values())
    return ", ".join(
        f"{'all ' if every and n > 1 else ''}{n} run{'s' if n == 1 else ''} {plan_labels.get(f, f.upper())} now"
        for f, n in now.items()
    )


# the block recipes of the compact table (the details show every recipe the layers table holds)
BLOCK_TABLE_RECIPES: tuple[str, ...] = ("mxfp8_e4m3_rceil", "mxfp6_e2m3", "mxfp4", "nvfp4")


def db_text(v: Any, floor: Any = None) -> str:
    """An SQNR as the page writes it: "31.2 dB", "lossless" for inf, "not finite" for nan. Beside a rule's
    ``floor`` (at least 18 dB), as many more digits as show which side of it the value is: 17.987 dB is
    "17.99 dB", not "18.0 dB" shaded as failing "at least 18 dB"."""
    f = F._float(v)
    if f is None:
        return "not finite"
    if f == math.inf:
        return "lossless"
    least = F._float(floor)
    digits = 1
    while least is not None and digits < 4 and (float(f"{f:.{digits}f}") >= least) != (f >= least):
        digits += 1
    return f"{f:.{digits}f} dB"


def _block_cell(cell: Mapping[str, Any] | None, floor: Any = None) -> dict[str, Any] | None:
    """One recipe's cell: SQNR of the worst operand (to the digits that tell it from the recipe's ``floor``),
    the largest flushed and saturated shares, and whether the plan's rule for that recipe passes ("warn" when it
    does not, ``fails`` saying why: a layer's shape fails a recipe whose numbers all pass)."""
    if not cell:
        return None
    fails = str(cell.get("fails") or "")
    # the share of values in blocks that held nan/inf, left out of the sums; where every block held them,
    # nothing was measured (an SQNR of inf, from sums of 0, had read "lossless")
    poisoned = F._float(cell.get("poisoned_share")) or 0.0
    measured = cell.get("measured", True) is not False
    return {
        "sqnr": db_text(cell.get("sqnr_db"), floor) if measured else "not measured",
        "sqnr_v": cell.get("sqnr_db") if measured else None,
        "poisoned": poisoned,
        "measured": measured,
        "flushed": cell.get("flushed_share"),
        "saturated": cell.get("saturated_share"),
        "worst": cell.get("worst"),
        "cls": "warn" if fails else "",
        "fails": fails,
        "note": 0,
    }


def _number_fails(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Number the reasons the table's shaded cells fail, each reason once in order of first appearance (each
    cell's ``note``), and list them with the count of cells each shades: the page's footnotes."""
    notes: dict[str, dict[str, Any]] = {}
    for row in rows:
        for c in row["cells"]:
            if c and c["fails"]:
                note = notes.setdefault(c["fails"], {"n": len(notes) + 1, "text": c["fails"], "cells": 0})
                note["cells"] += 1
                c["note"] = note["n"]
    return list(notes.values())


def group_range(capture: Mapping[str, Any]) -> tuple[int, int]:
    """The fewest and most groups the layers took turns in over the run (adaptive groups change; ``changes``)."""
    seen = [int(capture.get("groups") or 1)]
    for c in capture.get("changes") or []:
        seen += [int(c[k]) for k in ("groups", "from") if isinstance(c.get(k), (int, float))]
    return min(seen), max(seen)


def _turns(capture: Any) -> str:
    """How the layers took turns at the what-if, in words ("" when every layer was evaluated on every sampled
    step): the number of groups (its range, where the budget changed it), on how many sampled steps each layer
    was evaluated, how many linear layers none reached, and the sampled steps that evaluated none (adaptive
    groups' control steps), as the capture recorded them. It had said "every 10th sampled step, exactly" of a
    run of 4 sampled steps, 2 of them control steps, whose turns reached 2 of its 9 linear layers; and "every 5th,
    exactly" of groups that went from 19 to 2 and back to 5."""
    if not isinstance(capture, Mapping):
        return ""
    lo, hi = group_range(capture)
    controls = _count(capture.get("control_steps")) or 0
    if hi <= 1 and not controls:
        return ""
    fixed = not capture.get("adaptive") and lo == hi
    if fixed:  # one group a sampled step, in order, no control steps
        text = f"the layers take turns: each is evaluated on every {F.ordinal(hi)} sampled step, exactly"
    elif lo == hi:
        text = f"the layers take turns in {hi} groups"
    else:
        text = f"the layers take turns, in {lo} to {hi} groups as the run went on"
    ev = capture.get("evaluations")
    if isinstance(ev, (list, tuple)) and len(ev) == 2 and all(isinstance(x, int) for x in ev):
        layers, done = _count(capture.get("layers")), _count(capture.get("layers_evaluated"))
        unit = "sampled step" if ev[1] == 1 else "sampled steps"
        if layers is not None and done is not None and done < layers:
            sep = "; " if fixed else ": "
            text += (
                f"{sep}{done} of the {layers} linear layers were evaluated, each on at most {ev[1]} {unit}"
            )
        elif not fixed:
            span = f"{ev[0]}" if ev[0] == ev[1] else f"{ev[0]} to {ev[1]}"
            text += f": each was evaluated on {span} {unit}"
    if controls:
        steps = "sampled step" if controls == 1 else "sampled steps"
        text += f"; {controls} {steps} evaluated none, to measure what the what-if adds"
    return text


def _count(v: Any) -> int | None:
    """A count of the capture's block setting (None when it is not one)."""
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _unevaluated(lb: Mapping[str, Any]) -> str:
    """What the row of a layer the what-if did not evaluate says in place of its numbers ("" for one it did, and
    for a run recorded before the advisor said): "not evaluated", with the operands read of it alone."""
    if lb.get("evaluated", True) is not False:
        return ""
    read = list(dict.fromkeys(str(op.get("operand")) for op in lb.get("operands") or []))
    if not read:
        return "not evaluated"
    return f"not evaluated: only its {' and '.join(read)} was read (see the per-operand rows)"


def table(rec: dict[str, Any] | None, capture: Any = None) -> dict[str, Any] | None:
    """The block-scaled what-if as the advisor stored it (``Recommendation.block_what_if``): per linear layer and
    recipe the worst operand's SQNR and the largest flushed and saturated shares, the plan (for the target when
    it runs block formats, else what a B200 would get), and per operand the details. None without it (no
    recommendation, an older run, or no block statistics). ``capture``: the run's ``block_formats`` capture
    setting (``{"groups": n, ...}``, ``capture.block_budget.BlockBudget.describe``: how the layers took turns)."""
    data = (rec or {}).get("block_what_if") or {}
    layers = data.get("layers") or []
    if not layers:
        return None
    labels = dict(data.get("labels") or {})
    plan_labels = dict(data.get("plan_labels") or {})
    present = {r for lb in layers for r in (lb.get("recipes") or {})}
    shown = [r for r in BLOCK_TABLE_RECIPES if r in present]
    every = [r for r in T.BLOCK_RECIPES if r in present]
    rules = data.get("rules") or {}

    def floor(recipe: str) -> Any:  # the SQNR the plan's rule asks of the recipe (the advisor's ``fails``)
        return rules.get("mxfp8_sqnr_min_db" if recipe.startswith("mxfp8") else "fp4_sqnr_min_db")

    running = data.get("running")
    running = running if isinstance(running, Mapping) else {}
    rows, details = [], []
    for lb in layers:
        choice = str(lb.get("choice") or "")
        now = running.get(str(lb.get("module", "")))
        recipes = lb.get("recipes") or {}
        rows.append(
            {
                "module": S.module_label(str(lb.get("module", ""))),
                "module_type": lb.get("module_type"),
                "plan": plan_labels.get(choice, choice),
                "plan_format": choice,
                "running": plan_labels.get(str(now), str(now).upper()) if now else "",  # what it runs now
                "why": lb.get("why") or "",
                "input_from": S.module_label(lb["input_from"]) if lb.get("input_from") is not None else None,
                "cells": [_block_cell(recipes.get(r), floor(r)) for r in shown],
                # a layer the plan keeps without evaluating it (a tied head whose turn did not come): "not
                # evaluated", and the operands read of it, which its operand rows show ("" for none)
                "unevaluated": _unevaluated(lb),
            }
        )
        for op in lb.get("operands") or []:
            cells = [_block_cell((op.get("recipes") or {}).get(r), floor(r)) for r in every]
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
    return {
        "recipes": [{"name": r, "label": labels.get(r, r)} for r in shown],
        "all_recipes": [{"name": r, "label": labels.get(r, r)} for r in every],
        "rows": rows,
        "fails": _number_fails(rows),
        "details": details,
        "turns": _turns(capture),
        "on_target": bool(data.get("on_target")),
        "target": str(data.get("target") or ""),
        "fp4_sqnr_min_db": rules.get("fp4_sqnr_min_db"),
        "lost_norm_max": rules.get("lost_norm_max"),
        "rule": rules.get("text") or "",
        "mxfp8_sqnr_min_db": rules.get("mxfp8_sqnr_min_db"),
    }
