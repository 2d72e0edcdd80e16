"""The training figure: loss, loss scale and gradient norm over the steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from precprof import tables as T
from precprof.report.plots.common import FIG_WIDTH_IN, _pow2_label, spans_decades, step_label, step_locator

SKIP_COLOR = "#d62728"
RESTART_COLOR = "#2c7fb8"


def training_figure(steps: pd.DataFrame, norm_type: str | None = None) -> Figure | None:
    """Loss, loss scale (log2 axis, skipped steps marked) and gradient norm over steps, side by side; the steps
    a resumed run restarted from (``resumed``) as dashed lines on the loss and the loss scale."""
    if steps.empty:
        return None
    df = T.finished_steps(steps).sort_values(T.STEP)  # a step a crash cut off has no loss to draw
    x = pd.to_numeric(df[T.STEP], errors="coerce").to_numpy(dtype=float)
    skipped = T.flags(df[T.SKIPPED]).to_numpy()
    restarts = x[T.flags(df[T.RESUMED]).to_numpy()] if T.RESUMED in df else np.zeros(0)
    # drawn for the page's narrowest width: the loss across the top, loss scale and gradient norm below it
    fig = Figure(figsize=(FIG_WIDTH_IN, 5.4))
    gs = fig.add_gridspec(2, 2, hspace=0.62, wspace=0.34)
    axes = [fig.add_subplot(gs[0, :]), fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[1, 1])]
    fig.subplots_adjust(left=0.1, right=0.98, top=0.95, bottom=0.2)

    def mark_skipped(ax: Any) -> None:
        if skipped.sum() > 200:  # one collection, not a patch per step: a long run may skip thousands
            ax.vlines(x[skipped], 0, 1, transform=ax.get_xaxis_transform(), color=SKIP_COLOR, alpha=0.12)
            return
        for s in x[skipped]:
            ax.axvspan(s - 0.5, s + 0.5, color=SKIP_COLOR, alpha=0.12, lw=0)

    def mark_restarts(ax: Any) -> None:
        for r in restarts:
            ax.axvline(r, color=RESTART_COLOR, ls="--", lw=1.3)

    loss = pd.to_numeric(df[T.LOSS], errors="coerce").to_numpy(dtype=float)
    ax = axes[0]
    mark_skipped(ax)
    mark_restarts(ax)
    given = ~T.flags(df[T.NO_LOSS]).to_numpy() if T.NO_LOSS in df else np.ones(len(x), dtype=bool)
    # the steps with a loss, joined: a loop that passes its loss every few steps drew no line at all (each
    # point alone between gaps, and no markers past 60 steps)
    gx, gy = _broken_at_holes(x[given], loss[given], x)
    ax.plot(
        gx,
        gy,
        color="#1f4e79",
        lw=1.4,
        marker="." if given.sum() <= 60 else None,
        label="loss",
    )
    bad = ~np.isfinite(loss) & given
    if bad.any() and (given & ~bad).any():
        top = np.nanmax(loss[given & ~bad])
        ax.plot(x[bad], np.full(bad.sum(), top), "X", color=SKIP_COLOR, ms=8, label="loss not finite")
    elif (
        bad.any()
    ):  # no loss to place them by: mid-height, on an axis without numbers (they read "loss 1.00")
        ax.plot(
            x[bad],
            np.full(bad.sum(), 0.5),
            "X",
            color=SKIP_COLOR,
            ms=8,
            transform=ax.get_xaxis_transform(),
            label="loss not finite",
        )
        ax.set_yticks([])
        ax.text(
            0.5,
            0.72,
            "no finite loss: every recorded loss is nan/inf",
            ha="center",
            transform=ax.transAxes,
            color="#555",
        )
    if not given.any():  # the loop passed none (prof.step() without loss=): an empty axis said nothing
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no loss recorded", ha="center", va="center", transform=ax.transAxes)
    if spans_decades(loss[given & ~bad]):
        ax.set_yscale("log")
    _one_value(ax, x[given & ~bad], loss[given & ~bad], lambda v: f"{v:.4g}")
    ax.set_title("Training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))

    ax = axes[1]
    mark_skipped(ax)
    mark_restarts(ax)
    ls = pd.to_numeric(df[T.LOSS_SCALE], errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(ls) & (ls > 0)
    sk = np.zeros_like(ok)
    if ok.any():
        y = np.log2(ls[ok])
        ax.step(*_broken_at_holes(x[ok], y, x), where="post", color="#1f4e79", lw=1.4, label="loss scale")
        sk = skipped & ok & bool((ls[ok] != 1).any())  # a run without loss scaling backs nothing off
        if sk.any():
            ax.plot(x[sk], np.log2(ls[sk]), "v", color=SKIP_COLOR, ms=7, label="skipped step (inf/nan grads)")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
        ax.yaxis.set_major_formatter(FuncFormatter(_pow2_label))
        if np.nanmax(y) - np.nanmin(y) < 1:
            ax.set_ylim(np.nanmin(y) - 1, np.nanmax(y) + 1)
        _one_value(ax, x[ok], y, _pow2_label)
        if bool(np.all(ls[ok] == 1)):
            ax.text(0.5, 0.6, "no loss scaling (scale 1)", ha="center", transform=ax.transAxes, color="#555")
    else:
        ax.text(0.5, 0.5, "no loss scale recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"Loss scale ({int(skipped.sum())} skipped step{'s' if skipped.sum() != 1 else ''})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale (log2)")

    ax = axes[2]
    mark_skipped(ax)
    gn = pd.to_numeric(df[T.GRAD_NORM], errors="coerce").to_numpy(dtype=float)
    fin = np.isfinite(gn) & (gn > 0)
    # a norm missing where the loss is not finite or the scaler found inf/nan is a nan norm, not one unrecorded;
    # so is one missing after a norm on every step so far (a loop that passes it each step: its first nan norm
    # may come a step before its loss's)
    first_gap = int(np.argmin(fin)) if not fin.all() else len(fin)
    every_step = first_gap >= 2
    # (not a step on which a scaler over several optimizers skipped some: those that stepped had finite gradients,
    # and a loop that never clipped took no norm)
    whole = (
        skipped & (T.texts(df[T.SKIPPED_OPTIMIZERS]).to_numpy() == "")
        if T.SKIPPED_OPTIMIZERS in df
        else skipped
    )
    # (a loss not finite says so of a norm only in a loop that passed one: one that never clipped had "not finite
    # on 1 of 60 steps" of a norm it never took, tester t2)
    passed = bool((~np.isnan(gn)).any())
    inf = np.isinf(gn) | (
        np.isnan(gn) & ((bad & passed) | whole | (every_step & (np.arange(len(gn)) >= first_gap)))
    )
    if fin.any():
        ax.plot(
            *_broken_at_holes(x[fin], gn[fin], x),
            color="#1f4e79",
            lw=1.4,
            marker="." if len(x) <= 60 else None,
            label="grad norm",
        )
        if np.nanmax(gn[fin]) / np.nanmin(gn[fin]) > 30:
            ax.set_yscale("log")
        _one_value(ax, x[fin], gn[fin], lambda v: f"{v:.4g}")
        if inf.any():
            ax.plot(
                x[inf],
                np.full(inf.sum(), np.nanmax(gn[fin]) * 1.5),
                "^",
                color=SKIP_COLOR,
                ms=7,
                label="inf/nan gradient",
            )
    else:
        ax.text(0.5, 0.5, _no_finite_norm(inf, skipped), ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])  # no value to read off it
    # the norm the loop clipped by: an inf-norm is the largest |g|, not what "gradient norm" reads as
    said = {None: "", "inf": ", max |g|"}.get(norm_type, f", {norm_type}-norm")
    ax.set_title(f"Gradient norm (unscaled{said})")
    ax.set_xlabel("step")
    ax.set_ylabel("‖g‖₂" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    steps = x[np.isfinite(x)]  # (a table without step numbers: none)
    span = (float(steps.min()), float(steps.max())) if len(steps) else (0.0, 1.0)
    pad = 0.05 * (span[1] - span[0]) or 0.5
    for a, bins in zip(axes, (8, 4, 4), strict=True):  # the two lower plots are a third of the page wide
        a.set_xlim(span[0] - pad, span[1] + pad)  # every step on each, where a plot has values for some only
        a.grid(True, alpha=0.3)
        a.xaxis.set_major_locator(step_locator(bins))
        a.xaxis.set_major_formatter(FuncFormatter(step_label))
    # the legend names only what this run's plots draw
    handles: list[Artist] = [Line2D([], [], color="#1f4e79", lw=1.4, label="recorded value")]
    if skipped.any():
        handles.append(Patch(color=SKIP_COLOR, alpha=0.25, label="skipped optimizer step"))
    if sk.any():
        handles.append(
            Line2D(
                [],
                [],
                color=SKIP_COLOR,
                marker="v",
                ls="",
                label="scaler skipped the step (inf/nan gradients)",
            )
        )
    if bad.any():
        handles.append(Line2D([], [], color=SKIP_COLOR, marker="X", ls="", label="loss not finite (nan/inf)"))
    if len(restarts):
        label = "resumed from a checkpoint" + (f" (step {int(restarts[0])})" if len(restarts) == 1 else "")
        handles.append(Line2D([], [], color=RESTART_COLOR, ls="--", lw=1.3, label=label))
    if fin.any() and inf.any():
        handles.append(
            Line2D([], [], color=SKIP_COLOR, marker="^", ls="", label="gradient norm not finite (nan/inf)")
        )
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 2), frameon=False, fontsize=8.5)
    for a in axes:
        a.title.set_fontsize(10)
        a.xaxis.label.set_fontsize(9)
        a.yaxis.label.set_fontsize(9)
        a.tick_params(labelsize=8.5)
    return fig


def _one_value(ax: Any, xs: np.ndarray, ys: np.ndarray, label: Callable[[float], str]) -> None:
    """A plot of one value (a run of one step, or the one step a loop passed a value for) marks it and ticks its
    axis at it alone, the tick reading the value: a lone dot between ticks 5.4, 5.6 and 5.8 read like a curve, and
    a loss scale drawn as steps showed nothing at all for one point."""
    if len(ys) != 1:
        return
    ax.plot(xs, ys, "o", color="#1f4e79", ms=5)
    ax.set_yticks([ys[0]], [label(float(ys[0]))])
    ax.minorticks_off()  # (a log axis would tick on either side of it)


def _no_finite_norm(inf: np.ndarray, skipped: np.ndarray) -> str:
    """What the gradient-norm plot says where no step has a finite norm: none recorded, or (``inf``, the steps
    whose norm was inf or nan) one that was not finite, as a run whose every step overflowed and was skipped has
    ("no gradient norm recorded" was said of a norm recorded as nan on every step)."""
    if not inf.any():
        return "no gradient norm recorded"
    where = (
        "on every step"
        if inf.all()
        else f"on {int(inf.sum())} of {len(inf)} steps,\nnone recorded on the others"
    )
    return f"not finite (nan/inf)\n{where}" + ("\n(every step skipped)" if skipped.all() else "")


def _broken_at_holes(xs: np.ndarray, ys: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``xs``, ``ys`` with a nan between two points that steps the table has no row for lie between (a resumed
    run whose killed job had not flushed its last steps): the line breaks there instead of drawing a straight
    segment that looks like data. Steps present without a loss still join (``T.NO_LOSS``)."""
    if len(xs) < 2:
        return xs, ys
    present = np.unique(steps)
    # for each segment, how many steps lie strictly between its ends, and how many of those the table has
    between = np.diff(xs) - 1
    have = np.searchsorted(present, xs[1:]) - np.searchsorted(present, xs[:-1], side="right")
    gaps = np.flatnonzero(have < between)
    if gaps.size == 0:
        return xs, ys
    return np.insert(xs.astype(float), gaps + 1, np.nan), np.insert(ys, gaps + 1, np.nan)
