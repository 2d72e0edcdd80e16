"""The memory figure: bytes per component of this run, what its allocator's peak held, and each mode's
projection."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from precprof import tables as T
from precprof.report import filters
from precprof.report import summarize as S
from precprof.report.plots.common import FIG_WIDTH_IN, MIN_FONT_PT, fit_margins

COMPONENT_COLORS: dict[str, str] = {  # also the stacking order
    T.PARAMETERS: "#4c72b0",
    T.GRADIENTS: "#dd8452",
    T.OPTIMIZER_STATES: "#55a868",
    T.AUTOCAST_WEIGHT_COPIES: "#8172b3",
    T.ACTIVATIONS: "#c44e52",
    T.PROFILER_BUFFERS: "#937860",
    # the other parts of the allocator's peak
    T.INPUTS: "#64b5cd",
    T.OUTPUTS: "#ccb974",
    T.TEMPORARIES + ":" + T.PHASE_FORWARD: "#f2b6b7",
    T.TEMPORARIES + ":" + T.PHASE_BACKWARD: "#f0a35e",
    T.TEMPORARIES + ":" + T.PHASE_OPTIMIZER: "#a6d89b",
    T.TEMPORARIES + ":" + T.PHASE_OTHER: "#c9c9c9",
    T.OTHER_MEMORY: "#8c8c8c",
}
_OTHER_COLORS = ("#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd", "#a1c9f4", "#b0b0b0")


def _unit(max_bytes: float) -> tuple[float, str]:
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= div:
            return float(div), name
    return 1.0, "bytes"


def memory_figure(
    measured: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    current_mode: str = "",
    peaks: Mapping[str, float] | None = None,
) -> Figure | None:
    """Horizontal stacked bars of bytes per component: this run as measured, what was allocated at its
    allocator's peak part by part (where the run has it: that bar ends at the tick), then the projection for
    every precision mode (this run's own first, so that measured vs projected shows the projection's error); the
    allocator peak as a black tick on this run's bars. ``peaks`` (``projected_peaks``'s "modes"): each projected
    bar's mode's allocator peak, a dotted tick on it and its number beside the parts' (the parts alone leave out
    the temporaries and the model's outputs: an fp32 run's bars said bf16 saved nothing where its projected peak
    was 10% lower). Textbook records are left to a table, assumed ones out.

    ``measured`` is ``summarize.measured_memory(memory_table)``; ``records`` are summary["memory"] records. The
    measured bar is ``measured``'s stack, the very rows the page's "Measured (this run)" table sums, so bar and
    table show one total (precprof's own buffers included, as their own segment; the projection leaves them out,
    since no format changes them). Only without a memory table is the records' measured stack drawn instead.
    Each bar's number is written as the page writes bytes (``filters.nbytes``).
    """
    bars: list[tuple[str, dict[str, float], float | None]] = []
    projected_peak: dict[int, float] = {}  # bar -> its mode's projected allocator peak
    peak = (measured.get("peaks") or {}).get(T.ALLOCATOR_PEAK)
    order: list[tuple[str, str]] = []
    stacks: dict[tuple[str, str], dict[str, float]] = {}
    src_rank = {"measured": 0, "projected": 1, "textbook": 2}
    comps = {c: float(b) for c, b in (measured.get("components") or {}).items() if b}
    for r in records:
        # textbook records are a table's; assumed ones (the states of an optimizer the Profiler was not
        # given) were not measured: no bar of their own
        if r["component"] in S.PEAK_COMPONENTS or r["source"] in ("textbook", "assumed") or not r["bytes"]:
            continue
        if comps and r["source"] == "measured":  # one source for the measured bar: the table's rows
            continue
        key = (r["mode"], r["source"])
        if key not in stacks:
            stacks[key] = {}
            order.append(key)
        stacks[key][r["component"]] = stacks[key].get(r["component"], 0.0) + float(r["bytes"])
    if comps:
        bars.append((f"{current_mode or 'this run'} · this run, measured", comps, peak))
    at_peak = measured.get("at_peak")
    if at_peak and at_peak.get("parts"):
        parts = {str(p["part"]): float(p["bytes"]) for p in at_peak["parts"] if p["bytes"]}
        bars.append((f"{current_mode or 'this run'} · at the peak ({at_peak['phase']})", parts, peak))
    modes = list(dict.fromkeys(m for m, _ in order))
    if current_mode in modes:  # this run's mode first
        modes.remove(current_mode)
        modes.insert(0, current_mode)
    order.sort(key=lambda k: (modes.index(k[0]), src_rank.get(k[1], 3)))
    for mode, src in order:
        label = f"{mode} · this run, measured" if src == "measured" else f"{mode} · projected"
        if src == "projected" and (peaks or {}).get(mode):
            projected_peak[len(bars)] = float((peaks or {})[mode])
        bars.append((label, stacks[(mode, src)], peak if src == "measured" else None))
    if not bars:
        return None
    known = list(COMPONENT_COLORS)
    comp_names = sorted(
        dict.fromkeys(c for _, st, _ in bars for c in st),
        key=lambda c: known.index(c) if c in known else len(known),
    )
    colors: dict[str, str] = {}
    extra = iter(_OTHER_COLORS * 4)
    for c in comp_names:
        colors[c] = COMPONENT_COLORS.get(c) or next(extra)
    biggest = max(
        max(sum(st.values()), pk or 0, projected_peak.get(i, 0)) for i, (_, st, pk) in enumerate(bars)
    )
    div, unit = _unit(biggest)
    # drawn for the page's narrowest width: bar names on the left, the legend under the bars
    legend_rows = math.ceil((len(comp_names) + 1 + bool(projected_peak)) / 3)
    height = 0.34 * len(bars) + 0.9 + 0.2 * legend_rows
    fig = Figure(figsize=(FIG_WIDTH_IN, height))
    ax = fig.subplots()
    fig.subplots_adjust(
        left=0.35, right=0.97, top=1 - 0.15 / height, bottom=(0.55 + 0.2 * legend_rows) / height
    )
    for i, (_label, st, pk) in enumerate(bars):
        left = 0.0
        for c in comp_names:
            v = st.get(c, 0.0) / div
            if v > 0:
                ax.barh(i, v, left=left, color=colors[c], height=0.66, edgecolor="white", lw=0.5)
                left += v
        text = filters.nbytes(sum(st.values()))
        ppk = projected_peak.get(i)
        if ppk:
            text = f"parts {text} · peak {filters.nbytes(ppk)}"
            ax.plot([ppk / div, ppk / div], [i - 0.4, i + 0.4], color="black", lw=2.2, ls=":")
            left = max(left, ppk / div)
        ax.text(left, i, " " + text, va="center", fontsize=8)
        if pk:
            ax.plot([pk / div, pk / div], [i - 0.4, i + 0.4], color="black", lw=2.2)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    ax.set_xlim(0, biggest / div * (1.6 if projected_peak else 1.22))  # room for the numbers beside the bars
    ax.set_xlabel(f"memory ({unit})", fontsize=8.5)
    ax.grid(True, axis="x", alpha=0.3)
    names = {T.PROFILER_BUFFERS: "profiler buffers (precprof's own)", T.OTHER_MEMORY: "other (not named)"}

    def legend(c: str) -> str:
        name, _, phase = c.partition(":")
        return f"{name} ({phase})" if phase else names.get(c, c.replace("_", " "))

    handles: list[Any] = [Patch(color=colors[c], label=legend(c)) for c in comp_names]
    if any(pk for _, _, pk in bars):
        handles.append(Line2D([], [], color="black", lw=2.2, label="allocator peak"))
    if projected_peak:
        handles.append(Line2D([], [], color="black", lw=2.2, ls=":", label="projected allocator peak"))
    fit_margins(fig)  # the bar names on the left, inside the figure
    # the legend under the axis label: room kept for it below the axes (fit_margins took the bottom margin in)
    bottom = (0.55 + 0.2 * legend_rows) / height
    fig.subplots_adjust(bottom=bottom, top=max(fig.subplotpars.top, bottom + 0.1))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=MIN_FONT_PT, frameon=False)
    return fig
