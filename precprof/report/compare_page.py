"""The comparison page (compare.html): loss curves, throughput and memory per run, the verdict check."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof._version import __version__
from precprof.analysis.comparison import (
    DIVERGED,
    SETUP_SETTINGS,
    STATUS_MEANING,
    Comparison,
    RunResult,
    describe_run,
    describe_scale,
    finite,
    load_differs,
    setup_differences,
    smoothing_window,
    uneven_steps,
    unusable,
)
from precprof.analysis.throughput import BASIS_ALL, BASIS_UNSAMPLED
from precprof.modes import MODE_COLORS
from precprof.report import environment as env_words
from precprof.report import filters as F
from precprof.report.plots import (
    COMPONENT_COLORS,
    FIG_WIDTH_IN,
    data_uri,
    fit_margins,
    plain,
    png_bytes,
    spans_decades,
    step_label,
    step_locator,
    unhinted_text,
)
from precprof.report.render import environment

TEMPLATE = "compare.html.j2"
_LINESTYLES = ("-", "--", ":", "-.")


def _shade(color: str, k: int) -> str:
    """The k-th other shade of a "#rrggbb" colour: darker, lighter, darker still, ... (k = 1, 2, 3, ...)."""
    rgb = [int(color[j : j + 2], 16) for j in (1, 3, 5)]
    t = min(0.75, 0.38 * ((k + 1) // 2))
    to = 0 if k % 2 else 255
    return "#" + "".join(f"{round(c + (to - c) * t):02x}" for c in rgb)


def run_styles(runs: Sequence[RunResult]) -> dict[int, tuple[str, str]]:
    """Each run's colour and line style, by ``id(run)``: its format's colour, solid for the format's default
    loss scaling and dashed or dotted for another; a further run of a format already drawn (two recorded bf16
    runs, or fp16 twice) gets another shade of the colour and a line style of its own, so that no two runs
    look alike in the loss curves or the throughput bars."""
    out: dict[int, tuple[str, str]] = {}
    taken: dict[str, list[str]] = {}
    for i, r in enumerate(runs):
        color = MODE_COLORS.get(r.precision, "#555555")
        styles = taken.setdefault(color, [])
        ls = _LINESTYLES[0 if r.loss_scale == "auto" else 1 + (i % (len(_LINESTYLES) - 1))]
        if ls in styles:
            ls = next((s for s in _LINESTYLES if s not in styles), ls)
        out[id(r)] = (_shade(color, len(styles)) if styles else color, ls)
        styles.append(ls)
    return out


def _smooth(y: np.ndarray, w: int) -> np.ndarray:
    if w <= 1 or len(y) < 3:
        return y
    s = pd.Series(y).rolling(w, min_periods=1, center=True).mean()
    return s.to_numpy(dtype=float)


def loss_figure(comparison: Comparison) -> Any:
    """Loss curves overlaid (raw, faint; smoothed, solid) and each run's smoothed loss relative to the reference."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    # drawn for the page's narrowest width (plots.FIG_WIDTH_PX), one panel above the other
    fig = Figure(figsize=(FIG_WIDTH_IN, 6.4))
    ax_loss, ax_rel = fig.subplots(2, 1)
    fig.subplots_adjust(left=0.13, right=0.98, top=0.95, bottom=0.09, hspace=0.42)
    ref = comparison.run(comparison.reference)
    n = max((len(r.curve_loss) for r in comparison.runs), default=0)
    w = max(1, n // 25)
    ref_s = _smooth(np.asarray(ref.curve_loss, dtype=float), w)
    ref_steps = np.asarray(ref.curve_steps)
    finite_all: list[float] = []
    # (run, steps, its smoothed loss over the reference's, less one, where a skipped step enters the average)
    relative: list[tuple[RunResult, np.ndarray, np.ndarray, np.ndarray]] = []
    styles = run_styles(comparison.runs)
    not_finite = False
    never_finite: list[tuple[np.ndarray, str]] = []  # (first step, colour) of each run without a finite loss
    # the reference last and thinnest, on top of wider lines: curves that coincide all stay visible
    order = [i for i, r in enumerate(comparison.runs) if r is not ref] + [comparison.runs.index(ref)]
    for i in order:
        r = comparison.runs[i]
        if not r.curve_loss:
            continue
        x = np.asarray(r.curve_steps, dtype=float)
        y = np.asarray(r.curve_loss, dtype=float)
        color, ls = styles[id(r)]
        width = 1.3 if r is ref else 2.6
        ax_loss.plot(x, y, color=color, lw=0.7, alpha=0.3, ls=ls)
        ys = _smooth(y, w)
        ax_loss.plot(x, ys, color=color, lw=width, ls=ls, label=plain(r.label), zorder=3 if r is ref else 2)
        finite_all.extend(finite(y).tolist())
        bad = ~np.isfinite(y)
        if bad.any() and np.isfinite(y).any():
            not_finite = True
            ax_loss.plot(x[bad][:1], [np.nanmax(finite(y))], "X", color=color, ms=9)
        elif (
            bad.any()
        ):  # no loss of its own to place it by: drawn once the axis is scaled (at 0 it was off it)
            not_finite = True
            never_finite.append((x[bad][:1], color))
        if r is not ref and len(ref_s):
            m = min(len(ys), len(ref_s))
            if m and np.array_equal(x[:m], ref_steps[:m]):
                skipped = np.isin(x[:m], r.skipped_at + ref.skipped_at).astype(float)
                relative.append((r, x[:m], (ys[:m] - ref_s[:m]) / np.abs(ref_s[:m]), _smooth(skipped, w) > 0))
    _scale_loss_axis(ax_loss, np.asarray(finite_all, dtype=float))
    for x0, color in never_finite:  # near the top of the axis, whatever its scale: no loss to place it by
        ax_loss.plot(x0, [0.95], "X", color=color, ms=9, transform=ax_loss.get_xaxis_transform())
    ax_loss.set_title(
        f"Training loss (faint: per step; solid: {w}-step moving average)" if w > 1 else "Training loss"
    )
    ax_loss.set_xlabel("step")
    handles, labels = ax_loss.get_legend_handles_labels()
    by_label = dict(zip(labels, handles, strict=True))
    shown = [plain(r.label) for r in comparison.runs if plain(r.label) in by_label]
    marks = (
        [Line2D([], [], color="#555555", marker="X", ls="", label="loss not finite")] if not_finite else []
    )
    ax_loss.legend(
        [by_label[k] for k in shown] + marks,
        shown + [m.get_label() for m in marks],
        frameon=False,
        fontsize=9,
    )
    ax_rel.set_title(f"Loss relative to {plain(ref.label)} (smoothed)")
    if not relative:  # not an empty band on a step axis from 0 to 1
        ax_rel.set_axis_off()
        ax_rel.text(
            0.5,
            0.5,
            (
                f"{plain(ref.label)}, the reference, recorded no loss"
                if not len(ref_s)
                else "no other run recorded a loss"
                if all(not r.curve_loss for r in comparison.runs if r is not ref)
                else f"no other run recorded a loss on {plain(ref.label)}'s steps"
            ),
            ha="center",
            va="center",
            fontsize=10,
            color="#555555",
            transform=ax_rel.transAxes,
        )
        ax_loss.grid(True, alpha=0.3)
        ax_loss.xaxis.set_major_locator(step_locator(8))
        ax_loss.xaxis.set_major_formatter(FuncFormatter(step_label))
        fit_margins(fig)
        return fig
    tol = comparison.tolerance
    ax_rel.axhspan(-tol, tol, color="#2ca02c", alpha=0.12, lw=0, label=f"±{tol:.0%}: matched")
    ax_rel.axhline(0, color=MODE_COLORS.get(ref.precision, "#1f4e79"), lw=1.2)
    _draw_relative(ax_rel, relative, styles, tol)
    ax_rel.set_xlabel("step")
    ax_rel.set_ylabel(f"(loss − {plain(ref.label)}) / {plain(ref.label)}")
    ax_rel.yaxis.set_major_formatter(FuncFormatter(_signed_pct_label))
    ax_rel.legend(frameon=False, fontsize=9)
    for a in (ax_loss, ax_rel):
        a.grid(True, alpha=0.3)
        a.xaxis.set_major_locator(step_locator(8))
        a.xaxis.set_major_formatter(FuncFormatter(step_label))
    fit_margins(fig)  # the axis labels inside the image, however wide the tick labels beside them
    return fig


def _scale_loss_axis(ax: Any, values: np.ndarray) -> None:
    """The loss axis's scale and limits from every run's finite losses: logarithmic where they span decades (a
    run that diverged to 3.4e9 drew the others as flat lines on the zero line of a linear axis), else linear
    without the most extreme 1% of the values."""
    if len(values) and spans_decades(values):
        ax.set_yscale("log")
        ax.set_ylim(values.min() / 1.5, values.max() * 1.5)
    elif len(values):
        lo, hi = np.percentile(values, 0.5), np.percentile(values, 99.5)
        pad = 0.05 * (hi - lo if hi > lo else 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel("loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))


def _draw_relative(
    ax: Any,
    relative: Sequence[tuple[RunResult, np.ndarray, np.ndarray, np.ndarray]],
    styles: dict[int, tuple[str, str]],
    tol: float,
) -> None:
    """Each run's relative loss, the axis scaled to the tolerance band and the runs that did not diverge, less
    the points a step the loss scaler skipped enters: a run that diverged read "+6e+10%" at the top of an axis on
    which every other run was a flat line, and so did one fp16 loss spike at a skipped step (+100,000,000%).
    Where a diverged run leaves the axis, its legend entry says from which step; where a skipped step does, its
    run's entry says which."""
    kept = [rel[~near] for r, _x, rel, near in relative if r.outcome != DIVERGED]
    values = finite(np.concatenate(kept)) if kept else np.zeros(0)
    lo = min(-tol, float(values.min())) if len(values) else -tol
    hi = max(tol, float(values.max())) if len(values) else tol
    pad = 0.08 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    for r, x, rel, near in relative:
        label = plain(r.label)
        off = ~((rel >= lo) & (rel <= hi))  # a nan is off the axis too
        if r.outcome == DIVERGED and off.any():
            k = np.flatnonzero(off)[0]
            where = "above the axis" if rel[k] > hi else "below the axis" if rel[k] < lo else "not finite"
            label += f" (diverged: {where} from step {step_label(x[k])})"
        elif (off & near).any():
            label += f" ({_off_at_skips(x[off & near])})"
        color, ls = styles[id(r)]
        ax.plot(x, rel, color=color, lw=1.6, ls=ls, label=label)
    ax.set_ylim(lo, hi)


def _off_at_skips(steps: np.ndarray) -> str:
    """The legend's words for the steps where a run leaves the relative axis by a skipped step's loss: the steps,
    up to 3 of them, else how many."""
    if len(steps) > 3:
        return f"off the axis at {len(steps)} steps by a skipped step's loss"
    return f"off the axis at step {', '.join(step_label(s) for s in steps)}: a skipped step's loss"


def _signed_pct_label(v: float, _pos: Any = None) -> str:
    """A relative-loss tick: ``+0.5%``, ``-12.5%``, ``+1,500%``; never in powers of ten (``+6e+10%``)."""
    if not v:
        return "0%"
    p = 100 * v
    return f"{p:+,.0f}%" if abs(p) >= 100 else f"{p:+.3g}%"


def resources_figure(comparison: Comparison) -> Any | None:
    """Memory per component (stacked bars, on the measured step that held the most) and throughput, per run: the
    panels of what some run measured (a loop's own ``prof.step(loss=...)`` measures no throughput, and
    ``Profiler(memory=False)`` no memory: no panel of zeros for either)."""
    from matplotlib.figure import Figure

    memory, timed = memory_measured(comparison), throughput_measured(comparison)
    runs = [r for r in comparison.runs if r.memory or math.isfinite(r.tokens_per_s)]
    if not runs or not (memory or timed):
        return None
    height = 2.0 + 0.45 * len(runs)  # inches: bars plus fixed room for titles, axis labels and the legend
    fig = Figure(figsize=(FIG_WIDTH_IN, height))
    bottom = 1.3 if memory else 0.6  # room for the memory legend
    fig.subplots_adjust(left=0.16, right=0.97, top=1 - 0.4 / height, bottom=bottom / height, wspace=0.12)
    labels = [plain(r.label) for r in runs]
    y = np.arange(len(runs))[::-1]
    if memory and timed:
        ax_mem, ax_tp = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
        _memory_panel(fig, ax_mem, runs, labels, y)
        _throughput_panel(ax_tp, comparison, runs, y, [""] * len(runs))
    elif memory:
        _memory_panel(fig, fig.subplots(1, 1), runs, labels, y)
    else:
        _throughput_panel(fig.subplots(1, 1), comparison, runs, y, labels)
    return fig


def _memory_panel(fig: Any, ax_mem: Any, runs: list[RunResult], labels: list[str], y: np.ndarray) -> None:
    """Bytes per component per run, stacked, with each run's total; the legend below the figure."""
    comps = [c for c in COMPONENT_COLORS if any(r.memory.get(c) for r in runs)]
    comps += sorted(
        {c for r in runs for c in r.memory if c not in comps and c not in T.MEMORY_PEAK_COMPONENTS}
    )
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
        ax_mem.text(tot, yi, f" {tot:.3g} {unit}", va="center", fontsize=8)
    ax_mem.set_yticks(y, labels)
    # room right of the longest bar for its total ("10.8 MiB" ran into the frame at 1.18)
    ax_mem.set_xlim(0, max(left.max() * 1.32, 1e-9) if len(left) else 1)
    ax_mem.set_xlabel(unit)
    ax_mem.set_title("Memory per component\n(the largest measured step)", fontsize=9.5)
    fig.legend(
        *ax_mem.get_legend_handles_labels(),
        loc="lower left",
        bbox_to_anchor=(0.01, 0.0),
        ncol=min(len(comps), 3),
        frameon=False,
        fontsize=8,
    )
    ax_mem.grid(True, axis="x", alpha=0.3)


def memory_measured(comparison: Comparison) -> bool:
    """Whether any run measured the parts of its memory (``Profiler(memory=False)`` measures none)."""
    return any(v for r in comparison.runs for c, v in r.memory.items() if c not in T.MEMORY_PEAK_COMPONENTS)


def throughput_measured(comparison: Comparison) -> bool:
    """Whether any run measured its tokens per second (a loop that passes no token counts measures none)."""
    return any(math.isfinite(r.tokens_per_s) for r in comparison.runs)


def resources_title(comparison: Comparison) -> str:
    """The title of the memory and throughput section: what the runs measured of the two ("Memory" where no run
    recorded token counts), both where neither."""
    measured = [
        w
        for w, m in (("memory", memory_measured(comparison)), ("throughput", throughput_measured(comparison)))
        if m
    ]
    return " and ".join(measured or ["memory", "throughput"]).capitalize()


def no_bar(r: RunResult, ref: RunResult) -> str:
    """Why the throughput panel draws no bar for ``r`` ("" where it draws one): its own step times too uneven to
    time it, or (another run) timed otherwise than the reference. Where the reference's steps alone were
    uneven, the others' bars are drawn without a speed-up: the panel had drawn the reference alone, the one run
    whose speed said nothing, with "does not compare with fp32" beside the others."""
    if math.isfinite(r.tokens_per_s) and uneven_steps(r):
        return uneven_steps(r)
    if r is not ref and r.speed_not_taken and r.speed_not_taken != uneven_steps(ref):
        return r.speed_not_taken
    return ""


def speed_apart(comparison: Comparison) -> list[str]:
    """The caption's sentences for the runs the throughput panel draws no bar for, one per run; the reference's
    says that no run has a speed-up over it."""
    ref = comparison.run(comparison.reference)
    out = []
    for r in comparison.runs:
        why = no_bar(r, ref)
        if why and r is ref and any(o is not ref and math.isfinite(o.tokens_per_s) for o in comparison.runs):
            out.append(f"No bar for {r.label}, and no speed-up over it: {why}")
        elif why:
            out.append(f"No bar for {r.label}: {why}")
    return out


def _throughput_panel(
    ax_tp: Any, comparison: Comparison, runs: list[RunResult], y: np.ndarray, labels: list[str]
) -> None:
    """Tokens per second per run, with the speed-up over the reference; a run without them says so. ``labels``:
    the runs' tick labels ("" beside the memory panel, which names the runs)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ref = comparison.run(comparison.reference)
    # a run whose speed the page says does not compare with the reference's gets no bar: bf16's profiled steps
    # drew at 8.9x fp32's beside a table and a verdict check that said these speeds do not compare
    apart = [bool(no_bar(r, ref)) for r in runs]
    tps = np.array(
        [
            r.tokens_per_s if math.isfinite(r.tokens_per_s) and not a else 0
            for r, a in zip(runs, apart, strict=True)
        ]
    )
    styles = run_styles(comparison.runs)
    ax_tp.barh(y, tps, color=[styles[id(r)][0] for r in runs])
    profiled = {id(r) for r in runs if r.tokens_per_s_basis == BASIS_ALL}
    mixed = bool(profiled) and len(profiled) < len(runs)
    for yi, v, r, a in zip(y, tps, runs, apart, strict=True):
        if a:
            why = (
                " no bar: uneven step times"
                if uneven_steps(r)
                else f" no bar: other work on the\n machine than for {plain(ref.label)}"
                if load_differs(r, ref)
                else f" no bar: not timed\n as {plain(ref.label)} was"
            )
            ax_tp.text(0, yi, why, va="center", fontsize=8, color="#666666")
            continue
        if not math.isfinite(r.tokens_per_s):
            ax_tp.text(0, yi, " not measured", va="center", fontsize=8, color="#666666")
            continue
        sp = f" ({r.speedup:.2f}×)" if r.speedup is not None and r is not ref else ""
        mark = " *" if mixed and id(r) in profiled else ""
        ax_tp.text(v, yi, f" {v:,.0f}{sp}{mark}", va="center", fontsize=8)
    ax_tp.set_yticks(y, labels)
    ax_tp.set_xlim(0, max(tps.max() * 1.9, 1))
    # few ticks, written short (50k, 1.2M): "0 50000 100000150000200000" ran together and past the panel's edge
    ax_tp.xaxis.set_major_locator(MaxNLocator(nbins=4, min_n_ticks=2))
    ax_tp.xaxis.set_major_formatter(FuncFormatter(step_label))
    ax_tp.set_xlabel("tokens / s")
    # which steps were timed (throughput_basis says it in words under the runs table)
    basis = (
        "all steps, profiling included"
        if profiled and not mixed
        else "steps without layer\ncapture; *: all, profiled"
        if mixed
        else "steps without layer capture"
    )
    ax_tp.set_title(f"Throughput ({basis})" if mixed else f"Throughput\n({basis})", fontsize=9.5)
    ax_tp.grid(True, axis="x", alpha=0.3)


# ------------------------------------------------------------------------------------------- page
def _resources_alt(comparison: Comparison) -> str:
    shown = (
        ("memory per component", memory_measured(comparison)),
        ("throughput", throughput_measured(comparison)),
    )
    return " and ".join(w for w, m in shown if m) + " per run"


def _img(fig: Any, alt: str) -> dict[str, str] | None:
    if fig is None:
        return None
    return {"src": data_uri(png_bytes(fig)), "alt": alt}


def _rel(path: str | None, base_dir: Path | None) -> str | None:
    """A link from the page in ``base_dir`` to ``path``: relative wherever one exists (``../bf16/report.html``),
    so that the folder holding the page and the runs keeps its links when copied or moved; a file:// URL only
    where none does (another drive on Windows)."""
    if path is None:
        return None
    p = Path(path).resolve()
    if base_dir is not None:
        try:
            return quote(Path(os.path.relpath(p, base_dir.resolve())).as_posix())
        except ValueError:  # no relative path between two drives
            pass
    return p.as_uri()


def throughput_basis(comparison: Comparison) -> str:
    """Which steps the runs' tokens per second come from, in words: those without per-layer capture, or, in
    a run too short to have enough of them (a comparison of up to about 100 steps samples every step), every
    step, profiling included: the page said "profiling excluded" of both."""
    unsampled = {r.label for r in comparison.runs if r.tokens_per_s_basis == BASIS_UNSAMPLED}
    every = [r.label for r in comparison.runs if r.tokens_per_s_basis == BASIS_ALL]
    if not every:
        return "without per-layer capture (profiling excluded)"
    if not unsampled:
        return (
            "of all steps, profiling included: every step of these runs recorded per-layer statistics, as a "
            "short run does, so the speeds compare profiled steps"
        )
    return (
        "without per-layer capture (profiling excluded), except for "
        + ", ".join(every)
        + ", whose every step was profiled (its speed is not comparable)"
    )


# the optimizer's settings the environment says in the optimizer's row, when the runs share them but not it
_HYPER = (("lr", "learning rate"), ("weight_decay", "weight decay"))


def setup_rows(comparison: Comparison) -> list[tuple[str, str]]:
    """The Setup section: the settings every run had alike, in the words of the report's environment, then each
    setting the runs did not share, with every run's value (such a setting was left out without a word)."""
    cfg = comparison.config
    rows = [
        *([("model", str(cfg["model"]))] if cfg.get("model") else []),
        *(
            [("model settings", ", ".join(f"{k}={v}" for k, v in cfg["model_args"].items()))]
            if isinstance(cfg.get("model_args"), dict) and cfg["model_args"]
            else []
        ),
        *[(k, v) for k, v in env_words.config_rows(cfg) if k != "run directory"],
    ]
    if not any(k == "optimizer" for k, _ in rows):  # the environment says these with the optimizer only
        rows += [(what, F.num(cfg[k])) for k, what in _HYPER if cfg.get(k) is not None]
    differ = setup_differences(comparison.runs, list(SETUP_SETTINGS))
    return rows + [(what, f"differs by run: {values}") for what, values in differ]


def render(comparison: Comparison, base_dir: Path | None = None) -> str:
    """The comparison page (HTML string): the report's look (its CSS and number filters), autoescaped."""
    ref = comparison.run(comparison.reference)
    comps = [c for c in COMPONENT_COLORS if any(r.memory.get(c) for r in comparison.runs)]
    comps += sorted({c for r in comparison.runs for c in r.memory if c not in comps})
    # a whole step's peak, not a part of the total
    peaks = [c for c in comps if c in T.MEMORY_PEAK_COMPONENTS]
    comps = [c for c in comps if c not in peaks]
    runs = []
    for r in comparison.runs:
        d = r.to_dict()
        d["report_href"] = _rel(r.report, base_dir)
        d["dir_href"] = _rel(r.run_dir, base_dir)
        d["rec_format"] = (r.recommendation or {}).get("format")
        d["described"] = describe_run(r)
        d["unusable"] = unusable(r)  # a reference's that did not train: "did not train", "has no loss ..."
        d["scale_described"] = describe_scale(r) if r.loss_scaling == "dynamic" else None
        runs.append(d)
    cfg = comparison.config
    title = f"{cfg.get('model', 'model')} · {', '.join(r.label for r in comparison.runs)}"
    with unhinted_text():
        loss_img = _img(
            loss_figure(comparison), "loss curves of every run overlaid, and relative to the reference"
        )
        resources_img = _img(resources_figure(comparison), _resources_alt(comparison))
    ctx = {
        "version": __version__,
        "title": title,
        "generated": time.strftime("%Y-%m-%d %H:%M"),
        "reference": ref.label,
        "tolerance": comparison.tolerance,
        # the steps a final loss averages (``smoothing_window``), the reference's, for the page's definition
        "final_window": smoothing_window(ref.steps),
        "final_of": ref.steps,
        "summary_lines": comparison.summary_lines,
        "checks": [c.to_dict() for c in comparison.checks],
        "status_meaning": {
            s: m for s, m in STATUS_MEANING.items() if any(c.status == s for c in comparison.checks)
        },
        "runs": runs,
        "throughput_basis": throughput_basis(comparison),
        "throughput_measured": throughput_measured(comparison),
        "memory_measured": memory_measured(comparison),
        "recorded": comparison.recorded,
        "components": comps,
        "peak_components": peaks,
        # a step a loss scaler skipped is left out of the relative plot's scale (``_draw_relative``)
        "skipped_off_scale": any(r.skipped_at for r in comparison.runs),
        "loss_img": loss_img,
        "resources_title": resources_title(comparison),
        "resources_img": resources_img,
        # the runs the throughput panel draws no bar for, and why
        "speed_apart": speed_apart(comparison),
        # a bar with a speed-up over the reference (none where the reference's step times were uneven)
        "speedups": any(r.speedup is not None and r is not ref for r in comparison.runs),
        # the shared settings in the words of the report's environment (each run trained in this one process)
        "setup": setup_rows(comparison),
        "notes": comparison.notes,
        "command": cfg.get("command_line"),
        "wall_s": comparison.wall_s,
    }
    return str(environment().get_template(TEMPLATE).render(**ctx))
