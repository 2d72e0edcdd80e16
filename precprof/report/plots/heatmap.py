"""The signature heatmap: layers by log2 magnitude for one tensor kind, with the format windows over it, a strip
naming the windows, and a side panel of what each row loses."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import matplotlib
import matplotlib.transforms
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from precprof import tables as T
from precprof.report import summarize as S
from precprof.report.plots.common import _hbars, _pct, elide, fit_margins
from precprof.report.plots.windows import Window, heatmap_windows

# the side panel of the heatmaps: what a row loses in fp16, and values that were already inf/nan
LOST_COLORS: dict[str, str] = {"underflow": "#d62728", "overflow": "#111111", "inf/nan (recorded)": "#8e44ad"}


def _select_rows(
    rows: list[tuple[str, str]], lost: Mapping[tuple[str, str], tuple[float, ...]], max_rows: int
) -> list[int]:
    """Indices of the rows to draw: all of them, or the ``max_rows`` that lose the most in fp16 (plus the first
    and last), kept in forward order."""
    if len(rows) <= max_rows:
        return list(range(len(rows)))

    def badness(i: int) -> float:
        return sum(0.0 if math.isnan(v) else v for v in lost.get(rows[i], ()))

    keep = {0, len(rows) - 1}
    for i in sorted(range(len(rows)), key=lambda i: (-badness(i), i)):
        if len(keep) >= max_rows:
            break
        keep.add(i)
    return sorted(keep)


@dataclass
class Heatmap:
    """A signature heatmap and what its caption needs to say."""

    figure: Figure
    kind: str
    rows_total: int
    rows_shown: int
    scale: dict[str, float]
    windows: list[Window]


def signature_heatmap(
    histograms: pd.DataFrame,
    layers: pd.DataFrame,
    kind: str = T.ACTIVATION_GRAD,
    *,
    recommended_scale: float | None = None,
    max_rows: int = 90,
) -> Heatmap | None:
    """Layers (rows, forward order) by log2 |value| (columns) for one tensor kind, with format windows on top.

    Colour: share of the row's nonzero values in each binade (log scale), summed over sampled steps. Vertical
    lines: where each format's window starts (underflow: at or below) and ends (overflow), in unscaled units;
    fp16 at the loss scale of the last sampled step for gradients. Right panel: share of the row's values lost
    in fp16 at the recorded scales. With more than ``max_rows`` rows, the rows that lose the most are shown.
    """
    rows, exps, mat = S.heatmap_matrix(histograms, layers, kind)
    if not rows or mat.size == 0 or mat.sum() <= 0:
        return None
    lost = S.lost_share_by_row(layers, kind, "fp16")
    rows_total = len(rows)
    sel = _select_rows(rows, lost, max_rows)
    rows = [rows[i] for i in sel]
    mat = mat[sel]
    tot = mat.sum(axis=1, keepdims=True)
    share = np.divide(mat, tot, out=np.zeros_like(mat), where=tot > 0)
    scale = S.scale_in_effect(layers, kind)
    wins = heatmap_windows(kind, scale["last"], recommended_scale)

    fp16 = wins[0]
    x0 = float(min(exps[0], math.floor(fp16.lo))) - 1
    x1 = float(max(exps[-1] + 1, math.ceil(fp16.hi))) + 1
    n = len(rows)
    labels = [elide(S.row_label(m, p)) for m, p in rows]
    row_h = 0.17 if n > 40 else 0.22
    heat_h = max(1.6, n * row_h)
    strip_h = 0.27 * len(wins) + 0.2
    fig_h = heat_h + strip_h + 1.35
    width = 13.5
    label_in = 0.2 + 0.062 * max(len(s) for s in labels)
    fig = Figure(figsize=(width, fig_h))
    gs = fig.add_gridspec(
        2, 3, height_ratios=[strip_h, heat_h], width_ratios=[1.0, 0.2, 0.022], hspace=0.04, wspace=0.04
    )
    fig.subplots_adjust(
        left=min(0.45, label_in / width), right=0.93, top=1 - 0.4 / fig_h, bottom=0.75 / fig_h
    )
    ax_strip = fig.add_subplot(gs[0, 0])
    ax = fig.add_subplot(gs[1, 0], sharex=ax_strip)
    # not sharey: a shared axis would build a second set of ~n tick objects, the slowest part of the figure
    ax_lost = fig.add_subplot(gs[1, 1])
    cax = fig.add_subplot(gs[1, 2])

    masked = np.ma.masked_less_equal(share, 0)
    cmap = matplotlib.colormaps["Blues"].with_extremes(bad="white")
    im = ax.imshow(
        masked,
        aspect="auto",
        interpolation="nearest",
        extent=(float(exps[0]), float(exps[-1] + 1), n, 0),
        cmap=cmap,
        norm=LogNorm(vmin=1e-6, vmax=1.0),
    )
    ax.set_xlim(x0, x1)
    ax.set_ylim(n, 0)
    # row names as plain texts: tick objects cost ~3 ms each to build and measure, texts a fraction of that
    ax.set_yticks([])
    label_tf = matplotlib.transforms.blended_transform_factory(ax.transAxes, ax.transData)
    fs = 7.5 if n > 40 else 8.5
    for i, lab in enumerate(labels):
        ax.text(-0.006, i + 0.5, lab, transform=label_tf, ha="right", va="center", fontsize=fs, clip_on=False)
    ax.set_xlabel("log2 |value| (unscaled; column k holds values in [2^k, 2^(k+1)))")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=16))
    ax.grid(True, axis="x", color="#000", alpha=0.06)
    for w in wins:
        for xv in (w.lo, w.hi):
            if x0 < xv < x1:
                ax.axvline(xv, color=w.color, ls=w.style, lw=1.6 if w.key == "fp16" else 1.2)
    # percentages, as the right panel's: LogNorm's own labels (10^-6) are mathtext, ~15 ms each to lay out
    cb = fig.colorbar(im, cax=cax, format=FuncFormatter(_pct))
    cb.set_label("share of the layer's nonzero values (log scale)")
    cb.minorticks_off()  # each minor tick is a marker deep-copied at draw time: ~2 ms apiece

    # window strip: one bar per format, clipped to the plotted range, subnormal part lighter; names on the left
    ax_strip.set_ylim(len(wins) - 0.5, -0.5)
    bars: list[tuple[float, float, float, str, float]] = []
    for i, w in enumerate(wins):
        lo, hi = max(w.lo, x0), min(w.hi, x1)
        nlo = min(max(w.normal_lo, x0), x1)
        if lo < nlo:
            bars.append((i, lo, nlo, w.color, 0.28))
        if nlo < hi:
            bars.append((i, nlo, hi, w.color, 0.75))
        if hi > lo:
            rng = f"2^{round(w.lo)} … 2^{round(w.hi)}" + (  # round: 2^0, never 2^-0
                " (wider than this plot)" if w.lo < x0 and w.hi > x1 else ""
            )
            ax_strip.text(
                (lo + hi) / 2,
                i,
                rng,
                ha="center",
                va="center",
                fontsize=8,
                clip_on=True,
                bbox={"boxstyle": "round,pad=0.12", "fc": "white", "ec": "none", "alpha": 0.85},
            )
        else:
            side = "below" if w.lo >= x1 else "above"
            ax_strip.text(
                (x0 + x1) / 2,
                i,
                f"2^{round(w.lo)} … 2^{round(w.hi)}: entirely {side} this plot's range",
                ha="center",
                va="center",
                fontsize=8,
                color="#555",
            )
    if bars:
        ys, lefts, rights, colors, alphas = zip(*bars, strict=True)
        _hbars(
            ax_strip, ys, lefts, rights, 0.62, [to_rgba(c, a) for c, a in zip(colors, alphas, strict=True)]
        )
    ax_strip.set_yticks(range(len(wins)))
    ax_strip.set_yticklabels([w.label for w in wins], fontsize=8.5)
    for t, w in zip(ax_strip.get_yticklabels(), wins, strict=True):
        t.set_color(w.color)
    ax_strip.tick_params(axis="y", length=0)
    ax_strip.tick_params(axis="x", labelbottom=False)
    ax_strip.set_title(
        f"{S.KIND_LABELS.get(kind, kind).capitalize()}: where each layer's values fall, and each format's "
        "representable window (light: subnormal)",
        fontsize=11,
        loc="left",
    )
    for sp in ("top", "right", "left"):
        ax_strip.spines[sp].set_visible(False)
    # shade what fp16 (at the scale in effect) cannot hold, so the lost tails stand out
    ax.axvspan(x0, fp16.lo, color=fp16.color, alpha=0.07, lw=0)
    ax.axvspan(fp16.hi, x1, color=fp16.color, alpha=0.07, lw=0)

    # right panel: share lost in fp16 at the recorded scale, stacked on a log axis (ends at the total)
    shares = np.nan_to_num(np.array([lost.get(r, (0.0, 0.0, 0.0)) for r in rows], dtype=float).reshape(n, 3))
    floor = 1e-6
    y = np.arange(n) + 0.5
    ends = np.maximum(np.cumsum(shares, axis=1), floor)
    starts = np.hstack([np.full((n, 1), floor), ends[:, :-1]])
    for j, color in enumerate(LOST_COLORS.values()):
        _hbars(ax_lost, y, starts[:, j], ends[:, j], 0.75, to_rgba(color, 0.85))
    ax_lost.set_xscale("log")
    ax_lost.set_xlim(floor, 1.0)
    ax_lost.xaxis.set_major_formatter(FuncFormatter(_pct))
    ax_lost.set_xticks([1e-4, 1e-2, 1.0])
    ax_lost.xaxis.set_minor_locator(NullLocator())
    ax_lost.set_ylim(n, 0)
    ax_lost.set_yticks([])
    ax_lost.tick_params(axis="x", labelsize=7.5)
    ax_lost.set_xlabel("lost in FP16\n(recorded scale)", fontsize=8.5)
    ax_lost.grid(True, axis="x", alpha=0.3)
    # the legend sits in the empty cell above the panel, where it hides no bar
    ax_leg = fig.add_subplot(gs[0, 1:])
    ax_leg.axis("off")
    handles = [Patch(color=c, alpha=0.85, label=k) for k, c in LOST_COLORS.items()]
    ax_leg.legend(
        handles=handles,
        loc="lower left",
        fontsize=8,
        frameon=False,
        title="right panel: lost in FP16",
        title_fontsize=8.5,
        alignment="left",
    )
    if not (shares > 0).any():
        ax_lost.text(
            0.5,
            0.5,
            "nothing lost\nin FP16",
            transform=ax_lost.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="#2a7a2a",
        )
    # margins from the texts themselves: long row or format names on the left, the colour bar's label on the right
    fit_margins(fig)
    return Heatmap(fig, kind, rows_total, n, scale, wins)
