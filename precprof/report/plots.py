"""The report's figures: matplotlib's object API on the Agg canvas, never pyplot (no global state, thread-safe,
no display needed). The backend is never switched: each figure gets its own ``FigureCanvasAgg``, so a user's
notebook or GUI backend is left alone.

Each public ``*_figure`` function takes tables (DataFrames) and returns a ``matplotlib.figure.Figure``, or None
when there is nothing to draw; ``png_bytes`` and ``data_uri`` turn a figure into what the HTML embeds.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import matplotlib
import matplotlib.transforms
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.colors import LogNorm, to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from precprof import formats
from precprof import tables as T
from precprof.analysis import current_scaling
from precprof.report import filters
from precprof.report import summarize as S

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
SKIP_COLOR = "#d62728"
RESTART_COLOR = "#2c7fb8"
# the side panel of the heatmaps: what a row loses in fp16, and values that were already inf/nan
LOST_COLORS: dict[str, str] = {"underflow": "#d62728", "overflow": "#111111", "inf/nan (recorded)": "#8e44ad"}
DPI = 100


# ------------------------------------------------------------------------------------------- embedding
def png_bytes(fig: Figure, dpi: int = DPI) -> bytes:
    """Render ``fig`` to PNG bytes with the Agg canvas."""
    FigureCanvasAgg(fig)  # attach the Agg canvas explicitly: no backend lookup, no pyplot
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def svg_bytes(fig: Figure) -> bytes:
    """Render ``fig`` to SVG bytes (for small line plots that should stay sharp when zoomed)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    """A ``data:`` URI that embeds ``data`` in the page (base64)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _pow2_label(x: float, _pos: Any = None) -> str:
    if not math.isfinite(x):
        return ""
    k = round(x)
    return f"$2^{{{k}}}$" if abs(x - k) < 1e-9 else ""


def pow2_text(v: float) -> str:
    """``2^k`` for powers of two, else the value with 3 significant digits (plain text, for captions)."""
    if v > 0 and math.isfinite(v):
        k = math.log2(v)
        if abs(k - round(k)) < 1e-9:
            return f"2^{round(k)}"
    return f"{v:.3g}"


def _pct(x: float, _pos: Any = None) -> str:
    if x <= 0:
        return "0%"
    p = 100 * x
    if p >= 1:
        return f"{p:.0f}%"
    return f"{p:g}%"


# -------------------------------------------------------------------------------------------- training
def training_figure(steps: pd.DataFrame) -> Figure | None:
    """Loss, loss scale (log2 axis, skipped steps marked) and gradient norm over steps, side by side; the steps
    a resumed run restarted from (``resumed``) as dashed lines on the loss and the loss scale."""
    if steps.empty:
        return None
    df = steps.sort_values(T.STEP)
    x = pd.to_numeric(df[T.STEP], errors="coerce").to_numpy(dtype=float)
    skipped = T.flags(df[T.SKIPPED]).to_numpy()
    restarts = x[T.flags(df[T.RESUMED]).to_numpy()] if T.RESUMED in df else np.zeros(0)
    fig = Figure(figsize=(13.5, 3.4))
    axes = fig.subplots(1, 3)
    fig.subplots_adjust(left=0.055, right=0.99, top=0.9, bottom=0.24, wspace=0.28)

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
    ax.plot(x, loss, color="#1f4e79", lw=1.4, marker="." if len(x) <= 60 else None, label="loss")
    bad = ~np.isfinite(loss)
    if bad.any():
        top = np.nanmax(loss[~bad]) if (~bad).any() else 1.0
        ax.plot(x[bad], np.full(bad.sum(), top), "X", color=SKIP_COLOR, ms=8, label="loss not finite")
    ax.set_title("Training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")

    ax = axes[1]
    mark_skipped(ax)
    mark_restarts(ax)
    ls = pd.to_numeric(df[T.LOSS_SCALE], errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(ls) & (ls > 0)
    sk = np.zeros_like(ok)
    if ok.any():
        y = np.log2(ls[ok])
        ax.step(x[ok], y, where="post", color="#1f4e79", lw=1.4, label="loss scale")
        sk = skipped & ok & bool((ls[ok] != 1).any())  # a run without loss scaling backs nothing off
        if sk.any():
            ax.plot(x[sk], np.log2(ls[sk]), "v", color=SKIP_COLOR, ms=7, label="skipped step (inf/nan grads)")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
        ax.yaxis.set_major_formatter(FuncFormatter(_pow2_label))
        if np.nanmax(y) - np.nanmin(y) < 1:
            ax.set_ylim(np.nanmin(y) - 1, np.nanmax(y) + 1)
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
    if fin.any():
        ax.plot(
            x[fin], gn[fin], color="#1f4e79", lw=1.4, marker="." if len(x) <= 60 else None, label="grad norm"
        )
        if np.nanmax(gn[fin]) / np.nanmin(gn[fin]) > 30:
            ax.set_yscale("log")
        inf = np.isinf(gn)
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
        ax.text(0.5, 0.5, "no gradient norm recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Gradient norm (unscaled)")
    ax.set_xlabel("step")
    ax.set_ylabel("‖g‖₂" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    for a in axes:
        a.grid(True, alpha=0.3)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
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
    if np.isinf(gn).any():
        handles.append(Line2D([], [], color=SKIP_COLOR, marker="^", ls="", label="gradient norm inf"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    return fig


# ----------------------------------------------------------------------------------------- heatmaps
@dataclass(frozen=True)
class Window:
    """A format's representable window in unscaled log2 units: values at or below 2^lo vanish, at or above 2^hi
    overflow; between lo and normal_lo they are subnormal (fewer significant bits)."""

    key: str
    label: str
    lo: float
    normal_lo: float
    hi: float
    color: str
    style: str


def format_window(fmt: str, scale: float = 1.0, label: str | None = None, style: str = "-") -> Window:
    """Window of ``fmt`` for values multiplied by ``scale`` before the cast, in unscaled log2 |value|."""
    f = formats.get(fmt)
    ls = math.log2(scale) if scale > 0 else 0.0
    return Window(
        key=fmt,
        label=label or formats.label(fmt),
        lo=math.log2(f.underflow_max) - ls,
        normal_lo=math.log2(f.smallest_normal) - ls,
        hi=math.log2(f.overflow_min) - ls,
        color=formats.get(fmt).color,
        style=style,
    )


def heatmap_windows(
    kind: str, scale: float, recommended_scale: float | None = None, fp8_amax: float | None = None
) -> list[Window]:
    """Windows drawn over a heatmap of ``kind``: fp16 at the scale in effect (and at the recommended scale when
    that differs), bf16 at scale 1, e4m3 and e5m2 under per-tensor current scaling, the recipe the FP8 advice
    assumes: at the largest magnitude of the rows, ``fp8_amax`` (each row gets its own on the heatmap,
    ``analysis.current_scaling.row_windows``); at scale 1 when it is unknown."""
    scaled = kind in T.GRADIENT_KINDS
    s = scale if scaled else 1.0
    wins = [format_window("fp16", s, f"FP16 at scale {pow2_text(s)}" if scaled else "FP16")]
    if scaled and recommended_scale and recommended_scale > 0 and recommended_scale != s:
        rec = format_window("fp16", recommended_scale)
        wins.append(
            replace(
                rec, label=f"FP16 at recommended {pow2_text(recommended_scale)}", color="#7f0000", style=":"
            )
        )
    fp8 = {"fp8_e4m3": "--", "fp8_e5m2": (0, (5, 1, 1, 1))}
    wins.append(format_window("bf16", 1.0, style="-."))
    for fmt, style in fp8.items():
        ok = fp8_amax is not None and math.isfinite(fp8_amax) and fp8_amax > 0
        k = formats.current_scaling_exponent(formats.get(fmt), fp8_amax) if ok else 0  # type: ignore[arg-type]
        what = "current scaling, per row" if ok else "scale 1"
        wins.append(format_window(fmt, 2.0**k, f"{formats.label(fmt)} ({what})", style=style))  # type: ignore[arg-type]
    return wins


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


ROW_LABEL_MAX = (
    64  # characters of a heatmap row name; a longer one keeps its start and end around an ellipsis
)
MARGIN_PAD_PX = 6  # white space kept between the outermost text and the figure's edge


def elide(text: str, limit: int = ROW_LABEL_MAX) -> str:
    """``text`` cut in the middle to ``limit`` characters (start and end kept, joined by an ellipsis)."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


def fit_margins(fig: Figure, *, max_left: float = 0.6, min_right: float = 0.55) -> None:
    """Set ``fig``'s subplot margins from the extent of its texts (labels, titles, the colour bar's label), so
    that every one lies inside the figure with ``MARGIN_PAD_PX`` to spare and no more margin than that is left.

    Texts anchored to the axes (row names, tick labels, axis labels) move with the axes, so one measurement
    gives the exact shift. Measures without rasterising (``get_tightbbox``); the figure's size is unchanged.
    """
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    w, h = fig.bbox.width, fig.bbox.height
    box = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # in pixels
    sp = fig.subplotpars
    left = sp.left - (box.x0 - MARGIN_PAD_PX) / w
    right = sp.right + (w - MARGIN_PAD_PX - box.x1) / w
    bottom = sp.bottom - (box.y0 - MARGIN_PAD_PX) / h
    top = sp.top + (h - MARGIN_PAD_PX - box.y1) / h
    fig.subplots_adjust(
        left=min(max(left, 0.0), max_left),
        right=max(min(right, 1.0), min_right),
        bottom=min(max(bottom, 0.0), 0.45),
        top=max(min(top, 1.0), 0.55),
    )


def _hbars(ax: Any, y: Any, left: Any, right: Any, height: float, colors: Any) -> None:
    """Horizontal bars from ``left`` to ``right`` centred on ``y``, as one collection: what ``barh`` draws,
    without a Rectangle artist per bar (``barh`` took 17 ms a call, a heatmap's 90-row panel far more). The
    axes' limits are the caller's to set."""
    y, left, right = (np.asarray(v, dtype=float).reshape(-1) for v in (y, left, right))
    if not len(y):
        return
    h = height / 2
    verts = np.stack(
        [
            np.column_stack([left, y - h]),
            np.column_stack([right, y - h]),
            np.column_stack([right, y + h]),
            np.column_stack([left, y + h]),
        ],
        axis=1,
    )
    ax.add_collection(
        PolyCollection(list(verts), facecolors=colors, edgecolors="none", linewidths=0), autolim=False
    )


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
    fp8_rows = current_scaling.row_windows(layers, kind, rows)  # FP8's windows slide with each row's amax
    anchors = any(w is not None for w in fp8_rows[formats.FP8_E4M3.name])
    amax = float(pd.to_numeric(layers.loc[layers[T.TENSOR] == kind, T.ABSMAX], errors="coerce").max())
    wins = heatmap_windows(kind, scale["last"], recommended_scale, amax if anchors else None)

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
        per_row = fp8_rows.get(w.key) if anchors else None
        if per_row is not None:  # current scaling: each row's window, a segment on its own row
            segs = [(xv, i) for i, tw in enumerate(per_row) if tw is not None for xv in (tw.lo, tw.hi)]
            segs = [(xv, i) for xv, i in segs if x0 < xv < x1]
            if segs:
                xs, ys = zip(*segs, strict=True)
                ax.vlines(xs, np.array(ys), np.array(ys) + 1, color=w.color, linestyles=w.style, lw=1.2)  # type: ignore[arg-type]
            continue
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


# --------------------------------------------------------------------------------------------- memory
def _unit(max_bytes: float) -> tuple[float, str]:
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= div:
            return float(div), name
    return 1.0, "bytes"


def memory_figure(
    measured: Mapping[str, Any], records: Sequence[Mapping[str, Any]], current_mode: str = ""
) -> Figure | None:
    """Horizontal stacked bars of bytes per component: this run as measured, what was allocated at its
    allocator's peak part by part (where the run has it: that bar ends at the tick), then the projection for
    every precision mode (this run's own first, so that measured vs projected shows the projection's error); the
    allocator peak as a black tick on this run's bars. Textbook records are left to a table.

    ``measured`` is ``summarize.measured_memory(memory_table)``; ``records`` are summary["memory"] records. The
    measured bar is ``measured``'s stack, the very rows the page's "Measured (this run)" table sums, so bar and
    table show one total (precprof's own buffers included, as their own segment; the projection leaves them out,
    since no format changes them). Only without a memory table is the records' measured stack drawn instead.
    Each bar's number is written as the page writes bytes (``filters.nbytes``).
    """
    bars: list[tuple[str, dict[str, float], float | None]] = []
    peak = (measured.get("peaks") or {}).get(T.ALLOCATOR_PEAK)
    order: list[tuple[str, str]] = []
    stacks: dict[tuple[str, str], dict[str, float]] = {}
    src_rank = {"measured": 0, "projected": 1, "textbook": 2}
    comps = {c: float(b) for c, b in (measured.get("components") or {}).items() if b}
    for r in records:
        if r["component"] in S.PEAK_COMPONENTS or r["source"] == "textbook" or not r["bytes"]:
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
    biggest = max(max(sum(st.values()), pk or 0) for _, st, pk in bars)
    div, unit = _unit(biggest)
    fig = Figure(figsize=(12, 0.42 * len(bars) + 1.6))
    ax = fig.subplots()
    label_in = 0.25 + 0.068 * max(len(b[0]) for b in bars)
    fig.subplots_adjust(
        left=min(0.4, label_in / 12),
        right=0.8,
        top=1 - 0.35 / (0.42 * len(bars) + 1.6),
        bottom=0.7 / (0.42 * len(bars) + 1.6),
    )
    for i, (_label, st, pk) in enumerate(bars):
        left = 0.0
        for c in comp_names:
            v = st.get(c, 0.0) / div
            if v > 0:
                ax.barh(i, v, left=left, color=colors[c], height=0.66, edgecolor="white", lw=0.5)
                left += v
        ax.text(left, i, " " + filters.nbytes(sum(st.values())), va="center", fontsize=8.5)
        if pk:
            ax.plot([pk / div, pk / div], [i - 0.4, i + 0.4], color="black", lw=2.2)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=9)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    ax.set_xlim(0, biggest / div * 1.15)
    ax.set_xlabel(f"memory ({unit})")
    ax.grid(True, axis="x", alpha=0.3)
    names = {T.PROFILER_BUFFERS: "profiler buffers (precprof's own)", T.OTHER_MEMORY: "other (not named)"}

    def legend(c: str) -> str:
        name, _, phase = c.partition(":")
        return f"{name} ({phase})" if phase else names.get(c, c.replace("_", " "))

    handles: list[Any] = [Patch(color=colors[c], label=legend(c)) for c in comp_names]
    if any(pk for _, _, pk in bars):
        handles.append(Line2D([], [], color="black", lw=2.2, label="allocator peak"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8.5, frameon=False)
    fit_margins(fig)  # the bar names on the left and the legend on the right, inside the figure
    return fig
