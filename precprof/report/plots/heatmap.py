"""The signature heatmap: layers by log2 magnitude for one tensor kind, with the format windows over it, a strip
naming the windows, and a side panel of what each row loses."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib
import matplotlib.transforms
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.colors import FuncNorm, to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from precprof import formats
from precprof import tables as T
from precprof.analysis import current_scaling
from precprof.report import filters as F
from precprof.report import summarize as S
from precprof.report.plots.common import (
    FIG_WIDTH_IN,
    MARGIN_PAD_PX,
    MIN_FONT_PT,
    _hbars,
    _pct,
    drawable,
    elide,
    fit_margins,
    plain,
    row_labels,
)
from precprof.report.plots.windows import Window, heatmap_windows

# the side panel of the heatmaps: what a row loses in the focus format, and values that were already inf/nan
LOST_COLORS: dict[str, str] = {"underflow": "#d62728", "overflow": "#111111", "inf/nan (recorded)": "#8e44ad"}
# the format whose losses choose the rows and fill the side panel: FP16 at the recorded loss scale, or FP8 under
# per-tensor current scaling (E4M3 for forward tensors, E5M2 for gradients, as FP8 training casts them)
FOCUS_FORMATS = ("fp16", "fp8")
# the colour scale: log below SHARE_KNEE (the tails, down to SHARE_FLOOR) over the first KNEE_AT of the colour
# map, linear above it (where a narrow row's values sit): 26% and 84% of a row are as far apart on the map as
# 0.1% and 10%, where a log scale to 100% drew them in one shade
SHARE_FLOOR = 1e-6
SHARE_KNEE = 0.1
KNEE_AT = 0.6
SHARE_TICKS = (1e-6, 1e-4, 1e-2, 0.1, 0.25, 0.5, 0.75, 1.0)
BINADES_MIN = 10  # the narrowest exponent range drawn
EDGE_REACH = 3  # an FP16 window edge this many binades or fewer beyond the data is drawn too


def _share_unit(x: Any) -> Any:
    """Share -> position on the colour scale in [0, 1]: log from SHARE_FLOOR to SHARE_KNEE, then linear."""
    x = np.asarray(x, dtype=float)
    lo, knee = math.log10(SHARE_FLOOR), math.log10(SHARE_KNEE)
    below = KNEE_AT * (np.log10(np.clip(x, SHARE_FLOOR, SHARE_KNEE)) - lo) / (knee - lo)
    above = KNEE_AT + (1 - KNEE_AT) * (np.clip(x, SHARE_KNEE, 1.0) - SHARE_KNEE) / (1.0 - SHARE_KNEE)
    return np.where(x <= SHARE_KNEE, below, above)


def _unit_share(u: Any) -> Any:
    u = np.asarray(u, dtype=float)
    lo, knee = math.log10(SHARE_FLOOR), math.log10(SHARE_KNEE)
    below = 10.0 ** (lo + np.clip(u, 0.0, KNEE_AT) / KNEE_AT * (knee - lo))
    above = SHARE_KNEE + (np.clip(u, KNEE_AT, 1.0) - KNEE_AT) / (1 - KNEE_AT) * (1.0 - SHARE_KNEE)
    return np.where(u <= KNEE_AT, below, above)


def share_norm() -> FuncNorm:
    """The heatmaps' colour norm (``_share_unit``)."""
    return FuncNorm((_share_unit, _unit_share), vmin=SHARE_FLOOR, vmax=1.0)


def focus_label(kind: str, focus: str) -> str:
    """What the side panel counts for ``kind``: "FP16 at the recorded scale", "FP8 E5M2, current scaling"."""
    if focus == "fp8":
        fmt = "fp8_e5m2" if kind in T.GRADIENT_KINDS else "fp8_e4m3"
        return f"{formats.label(fmt)}, current scaling"
    return "FP16 at the recorded scale" if kind in T.GRADIENT_KINDS else "FP16"


def lost_in_focus(
    layers: pd.DataFrame, kind: str, focus: str
) -> dict[tuple[str, str], tuple[float, float, float]]:
    """Per row: (underflow, overflow, inf/nan) shares in the focus format (``focus_label``)."""
    if focus == "fp8":
        fmt = "fp8_e5m2" if kind in T.GRADIENT_KINDS else "fp8_e4m3"
        return S.lost_share_by_row(layers, kind, fmt, current_scaling=True)
    return S.lost_share_by_row(layers, kind, "fp16")


@dataclass(frozen=True)
class RowSelection:
    """The rows a heatmap draws (``index``, in forward order) and how they were chosen, besides the first and last
    row: every one of the ``worse`` rows that lose more than ``cut`` in the focus format; ``tied_shown`` of the
    ``tied`` rows that each lose ``cut`` and ``less_shown`` of the ``less`` rows that lose less, each taken evenly
    in forward order. ``cut`` 0: every row that loses anything fitted (``worse``), and ``tied`` lose nothing.
    ``onset``: the first row that loses anything, drawn with the row before it, so that where the losses start
    shows (``None``: the first row already loses, or none does)."""

    index: list[int]
    worse: int = 0
    tied_shown: int = 0
    tied: int = 0
    less_shown: int = 0
    less: int = 0
    cut: float = 0.0
    onset: int | None = None

    def gaps(self) -> list[int]:
        """The drawn rows (0-based, top to bottom) that follow rows left out: a mark goes above each."""
        return [j for j in range(1, len(self.index)) if self.index[j] - self.index[j - 1] > 1]

    def gaps_dense(self) -> bool:
        """Whether most drawn rows follow rows left out (90 rows of a 480-layer model): a line between almost
        every two rows striped the whole figure, and marked nothing the row names do not say; none is drawn."""
        return len(self.gaps()) > (len(self.index) - 1) / 2

    def marked_gaps(self) -> list[int]:
        """The gaps a dashed line marks (``gaps``): none where they are most of the drawn rows."""
        return [] if self.gaps_dense() else self.gaps()


def _spread_layers(rows: list[tuple[str, str]], tied: list[int], left: int) -> list[int]:
    """``left`` of the ``tied`` rows, taken evenly over forward order by whole layers (a layer's weight and bias,
    its input row, are shown or left out together: a 60-layer model showed layers.4.bias without its weight, and
    a gap mark between nearly every two rows); row by row where a layer alone holds more rows than fit."""

    def layer(i: int) -> str:
        return rows[i][0].removesuffix(T.INPUT_SUFFIX)

    groups: list[list[int]] = []
    for i in tied:
        if groups and groups[-1][-1] == i - 1 and layer(groups[-1][-1]) == layer(i):
            groups[-1].append(i)
        else:
            groups.append([i])
    m = len(groups)

    def pick(take: int) -> list[int]:  # the centre of each of ``take`` equal stretches of the groups
        return [i for k in range(take) for i in groups[math.floor((k + 0.5) * m / take)]]

    take = min(m, left // max(1, round(len(tied) / m)))
    while take > 0 and len(picked := pick(take)) > left:
        take -= 1
    if take > 0:
        return picked
    # the centre of each of ``left`` equal stretches of the tied rows: a step of at least 1, so all distinct
    return [tied[math.floor((k + 0.5) * len(tied) / left)] for k in range(left)]


CONTEXT_SHARE = 4  # with more losing rows than fit, 1 in 4 of the rows drawn is for those that lose less


def _evenly(rows: list[tuple[str, str]], cands: list[int], take: int, first: list[int]) -> list[int]:
    """``take`` of ``cands``: those of ``first`` among them, then the others taken evenly (``_spread_layers``)."""
    kept = [i for i in first if i in cands][:take]
    rest = [i for i in cands if i not in kept]
    if take <= len(kept) or not rest:
        return kept
    return kept + _spread_layers(rows, rest, take - len(kept))


def _select_rows(
    rows: list[tuple[str, str]], lost: Mapping[tuple[str, str], tuple[float, ...]], max_rows: int
) -> RowSelection:
    """The rows to draw: all of them, or the first and last and up to ``max_rows - 2`` others, in forward order,
    chosen by what they lose in the focus format (``lost``: its shares). Every row that loses anything when they
    all fit, and the others taken evenly; else those that lose the most (rows tied at the cut taken evenly), with
    1 in ``CONTEXT_SHARE`` of the rows kept for those that lose less, taken evenly. The first row that loses
    anything is drawn with the row before it. A 130-block model that overflowed FP16 from block 48 on showed only
    rows that lost 100%, from block 61: where the losses start was left out, and the caption did not say so."""
    n = len(rows)
    if n <= max_rows:
        return RowSelection(list(range(n)))
    slots = max(max_rows - 2, 0)
    if slots == 0:
        return RowSelection([0, n - 1])

    def badness(i: int) -> float:
        return sum(0.0 if math.isnan(v) else v for v in lost.get(rows[i], ()))

    bad = [badness(i) for i in range(n)]
    onset = next((i for i in range(n) if bad[i] > 0), 0)  # 0: the first row loses already, or none does
    first = [i for i in (onset, onset - 1) if onset and 0 < i < n - 1]
    middle = range(1, n - 1)
    losing = [i for i in middle if bad[i] > 0]
    cut = 0.0
    if len(losing) + sum(bad[i] == 0 for i in first) > slots:
        cut = sorted((bad[i] for i in middle), reverse=True)[slots - slots // CONTEXT_SHARE - 1]
    worse = [i for i in middle if bad[i] > cut]
    tied = [i for i in middle if bad[i] == cut]
    less = [i for i in middle if bad[i] < cut]
    # the rows left after the worse ones: the tied ones up to what the rows that lose less keep
    tied_take = min(len(tied), slots - len(worse) - min(len(less), slots // CONTEXT_SHARE))
    less_take = slots - len(worse) - tied_take
    shown = set(_evenly(rows, tied, tied_take, first)) | set(_evenly(rows, less, less_take, first))
    index = sorted({0, n - 1, *worse, *shown})
    return RowSelection(
        index,
        worse=len(worse),
        tied_shown=len(shown & set(tied)),
        tied=len(tied),
        less_shown=len(shown & set(less)),
        less=len(less),
        cut=float(cut),
        onset=onset if onset and onset in index else None,
    )


@dataclass
class Heatmap:
    """A signature heatmap and what its caption needs to say: the rows shown and why (the focus format, whose
    losses chose them), the loss scale of its windows, the exponent range drawn."""

    figure: Figure
    kind: str
    rows_total: int
    rows_shown: int
    scale: dict[str, float]
    windows: list[Window]
    focus: str = "fp16"
    focus_label: str = "FP16"
    x_range: tuple[float, float] = (0.0, 0.0)
    rows: list[tuple[str, str]] = field(default_factory=list)  # the (module, param) rows drawn, top to bottom
    selection: RowSelection = field(default_factory=lambda: RowSelection([]))
    all_zero: int = 0  # rows drawn that held only zeros (``ALL_ZERO``)
    all_zero_total: int = 0  # rows of the kind, drawn or not, that held only zeros

    def zero_note(self) -> str:
        """The caption's sentence on the rows marked ``ALL_ZERO``, when some are: how many of those the run has
        are drawn, where not all are (a caption said "20 rows hold only zeros" of a run with 254 such rows)."""
        total = max(self.all_zero_total, self.all_zero)
        if total > self.all_zero:
            which = (
                f"{'One' if self.all_zero == 1 else self.all_zero} of the {total} rows that hold only zeros on "
                f"every sampled step {'is' if self.all_zero == 1 else 'are'} drawn"
            )
        else:
            which = (
                "One row holds" if self.all_zero == 1 else f"{self.all_zero} rows hold"
            ) + " only zeros on every sampled step"
        return (
            f"{which}, marked “{ALL_ZERO}” (a ReLU that never fires gives such "
            "rows: its output and the gradients behind it): no value to place by magnitude, and none lost; an "
            "empty row without the mark has no finite nonzero value recorded."
        )

    def rows_note(self) -> str:
        """The caption's sentences on the rows shown, when not all are: how many of each kind of row, and by
        what rule they were chosen. The counts add up to the rows there are (a caption had said "88 of the other
        130" of 262 rows, and nothing of the 130 that lost less)."""
        sel, fmt = self.selection, self.focus_label
        parts = ["the first and last"]
        if sel.cut == 0:
            if sel.worse:
                parts.append(_rows_part(sel.worse, sel.worse, f"{_lose(sel.worse)} anything in {fmt}"))
            nothing = "nothing" + ("" if sel.worse else f" in {fmt}")
            parts.append(_rows_part(sel.tied_shown, sel.tied, f"{_lose(sel.tied)} {nothing}"))
        else:
            cut = F.pct(sel.cut)
            if sel.worse:
                most = "the one that loses" if sel.worse == 1 else f"the {sel.worse} that lose"
                parts.append(f"{most} the most in {fmt} (more than {cut})")
            each = f"{_lose(sel.tied)} {cut}" if sel.tied == 1 else f"each lose {cut}"
            parts.append(_rows_part(sel.tied_shown, sel.tied, each + ("" if sel.worse else f" in {fmt}")))
            if sel.less:
                parts.append(_rows_part(sel.less_shown, sel.less, f"{_lose(sel.less)} less"))
        text = f"Showing {self.rows_shown} of {self.rows_total} rows, in forward order: {'; '.join(parts)}."
        if sel.onset is not None:
            name = T.module_in_prose(S.row_label(*self.rows[sel.index.index(sel.onset)]))
            before = " with the row before it" if sel.onset - 1 in sel.index else ""
            text += f" The first row that loses anything in {fmt}, {name}, is drawn{before}."
        mark = (
            "Rows are left out between most of those drawn (not marked)"
            if sel.gaps_dense()
            else "A dashed grey line marks where rows are left out"
        )
        return f"{text} {mark}; every row is in the tables below."


def _lose(k: int) -> str:
    return "loses" if k == 1 else "lose"


def _rows_part(shown: int, of: int, that: str) -> str:
    """One count of the caption: "all 40 that lose …", "48 of the 220 that lose …, taken evenly", "none of the
    3 that lose …"."""
    if shown == of:
        return f"the one that {that}" if of == 1 else f"all {of} that {that}"
    if shown == 0:
        return f"not the one that {that}" if of == 1 else f"none of the {of} that {that}"
    return f"{shown} of the {of} that {that}, taken evenly"


def _x_range(exps: np.ndarray, share: np.ndarray, fp16: Window) -> tuple[float, float]:
    """The exponents drawn: the binades that hold values (one more each side), reaching out to an FP16 window
    edge that lies within ``EDGE_REACH`` binades of them, and at least ``BINADES_MIN`` wide."""
    cols = np.flatnonzero((share > 0).any(axis=0))
    lo, hi = float(exps[cols[0]]), float(exps[cols[-1]] + 1)
    x0, x1 = lo - 1, hi + 1
    for edge in (fp16.lo, fp16.hi):
        if x0 - EDGE_REACH <= edge < x0:
            x0 = math.floor(edge) - 1
        if x1 < edge <= x1 + EDGE_REACH:
            x1 = math.ceil(edge) + 1
    if x1 - x0 < BINADES_MIN:
        pad = (BINADES_MIN - (x1 - x0)) / 2
        x0, x1 = math.floor(x0 - pad), math.ceil(x1 + pad)
    return float(x0), float(x1)


GAP_COLOR = "#555555"
ALL_ZERO = "all zero"  # the mark on a row whose every value was zero: blank, it read as a row without data
X_LABEL = "log2 |value|, unscaled (column k: [2^k, 2^(k+1)))"


def _mark_gaps(axes: tuple[Any, ...], sel: RowSelection) -> None:
    """A dashed line across each of ``axes`` above each drawn row that follows rows left out, unless that is most
    of them (``RowSelection.gaps_dense``)."""
    gaps = sel.marked_gaps()
    if gaps:
        for a in axes:
            a.hlines(
                gaps,
                0,
                1,
                transform=a.get_yaxis_transform(),
                colors=GAP_COLOR,
                linestyles=(0, (3, 2)),
                lw=0.9,
            )


def _fit_title(fig: Figure, ax_strip: Any, title: Text, head: str, under: str) -> bool:
    """The title, which starts over the heatmap, ends inside the figure: the leading components of the layer
    names it states go to a second line, cut in the middle as far as needed (a peft model's
    ``base_model.model.model.`` ran off the image). True when the title now has two lines."""
    if not under:
        return False
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    right = fig.bbox.width - MARGIN_PAD_PX
    ax_strip.get_tightbbox(renderer)  # places the title where the margins put the axes
    if title.get_window_extent(renderer).x1 <= right:
        return False
    for limit in range(len(under), 7, -1):
        title.set_text(f"{head}\n(layers under {plain(elide(under, limit))})")
        if title.get_window_extent(renderer).x1 <= right:
            break
    return True


def _fit_x_label(fig: Figure, ax: Any, ax_lost: Any) -> bool:
    """The heatmap's x label in two lines when in one it runs into the side panel's label (a narrow heatmap,
    beside long row names). True when broken."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    ax.xaxis.get_tightbbox(renderer)  # places both labels under their axes as drawn
    ax_lost.xaxis.get_tightbbox(renderer)
    mine, theirs = ax.xaxis.label.get_window_extent(renderer), ax_lost.xaxis.label.get_window_extent(renderer)
    if mine.x1 + MARGIN_PAD_PX <= theirs.x0 and mine.x0 >= 0:
        return False
    ax.set_xlabel(X_LABEL.replace(" (column", "\n(column"))
    return True


def _lost_panel(ax: Any, shares: np.ndarray, what: str) -> None:
    """The side panel: each row's shares lost in the focus format (``shares``: rows by underflow, overflow,
    inf/nan), stacked, on the colour bar's scale (log below 10%, linear above), each total of 1% or more written
    in its bar. On a log axis to 100% a row that lost 56% ended a twentieth of the panel short of one that lost
    everything, and 20% hardly shorter: the panel read as "all lost" where half was."""
    n = len(shares)
    y = np.arange(n) + 0.5
    ends = np.maximum(np.cumsum(shares, axis=1), SHARE_FLOOR)
    starts = np.hstack([np.full((n, 1), SHARE_FLOOR), ends[:, :-1]])
    for j, color in enumerate(LOST_COLORS.values()):
        _hbars(ax, y, starts[:, j], ends[:, j], 0.75, to_rgba(color, 0.85))
    ax.set_xscale("function", functions=(_share_unit, _unit_share))
    ax.set_xlim(SHARE_FLOOR, 1.0)
    ax.xaxis.set_major_formatter(FuncFormatter(_pct))
    ax.set_xticks([1e-4, SHARE_KNEE, 1.0])  # 0.01%, 10%, 100%: as many as the narrow panel keeps apart
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_ylim(n, 0)
    ax.set_yticks([])
    ax.tick_params(axis="x", labelsize=MIN_FONT_PT)
    ax.set_xlabel("lost in " + what.replace(", ", ",\n").replace(" at the", "\nat the"), fontsize=MIN_FONT_PT)
    ax.grid(True, axis="x", alpha=0.3)
    total = shares.sum(axis=1)
    for i in np.flatnonzero(total >= 0.01):  # a bar from 1% on is half the panel wide: room for its figure
        ax.text(
            total[i],
            y[i],
            (">99%" if 0.995 <= total[i] < 1 else _pct(total[i]))
            + " ",  # a row that kept some never reads 100%
            ha="right",
            va="center",
            fontsize=MIN_FONT_PT,
            color="white",
            clip_on=True,
        )
    if not (shares > 0).any():
        ax.text(
            0.5,
            0.5,
            "nothing\nlost",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=8,
            color="#2a7a2a",
        )


def signature_heatmap(
    histograms: pd.DataFrame,
    layers: pd.DataFrame,
    kind: str = T.ACTIVATION_GRAD,
    *,
    recommended_scale: float | None = None,
    max_rows: int = 90,
    focus: str = "fp16",
    shared: Mapping[str, Any] | None = None,
    order: Sequence[str] | None = None,
) -> Heatmap | None:
    """Layers (rows, forward order) by log2 |value| (columns) for one tensor kind, with format windows on top,
    drawn for the page's narrowest width (``FIG_WIDTH_PX``).

    Colour: share of the row's nonzero values in each binade (``share_norm``: log below 10%, linear above),
    summed over sampled steps; the columns drawn are those that hold values (``_x_range``). Vertical lines: where
    each format's window starts (underflow: at or below) and ends (overflow), in unscaled units; fp16 at the
    loss scale of the last sampled step for gradients; a window beyond the range drawn is named in the strip.
    Right panel: share of the row's values lost in the ``focus`` format ("fp16" at the recorded scales, or
    "fp8" under current scaling). With more than ``max_rows`` rows, the rows that lose the most there are shown.
    ``shared``: the capture's ``shared_params``, which place a never-running weight owner (``forward_order``);
    ``order``: ``summarize.forward_order(layers, shared)`` where the caller has it.
    """
    if focus not in FOCUS_FORMATS:
        raise ValueError(f"focus must be one of {', '.join(FOCUS_FORMATS)}, not {focus!r}")
    rows, exps, mat = S.heatmap_matrix(histograms, layers, kind, shared, order)
    if not rows or mat.size == 0 or mat.sum() <= 0:
        return None
    lost = lost_in_focus(layers, kind, focus)
    what = focus_label(kind, focus)
    rows_total = len(rows)
    zero = S.all_zero_rows(layers, kind)
    # the rows of the whole run that hold only zeros (none of their values placed), of which the caption says
    # how many are drawn
    zero_total = sum(1 for i, r in enumerate(rows) if r in zero and mat[i].sum() == 0)
    sel = _select_rows(rows, lost, max_rows)
    rows = [rows[i] for i in sel.index]
    mat = mat[sel.index]
    tot = mat.sum(axis=1, keepdims=True)
    share = np.divide(mat, tot, out=np.zeros_like(mat), where=tot > 0)
    scale = S.scale_in_effect(layers, kind)
    fp8_rows = current_scaling.row_windows(layers, kind, rows)  # FP8's windows slide with each row's amax
    anchors = any(w is not None for w in fp8_rows[formats.FP8_E4M3.name])
    amax = float(pd.to_numeric(layers.loc[layers[T.TENSOR] == kind, T.ABSMAX], errors="coerce").max())
    wins = heatmap_windows(kind, scale["last"], recommended_scale, amax if anchors else None)

    fp16 = wins[0]
    x0, x1 = _x_range(exps, share, fp16)
    n = len(rows)
    # characters the font lacks escaped before the names are cut to length, so the cut counts what is drawn
    labels, under = row_labels([drawable(S.row_label(m, p)) for m, p in rows])
    fs = MIN_FONT_PT if n > 40 else 8.0
    row_h = 0.14 if n > 40 else 0.19
    heat_h = max(1.6, n * row_h)
    strip_h = 0.24 * len(wins) + 0.25
    fig_h = heat_h + strip_h + 1.25
    width = FIG_WIDTH_IN
    fig = Figure(figsize=(width, fig_h))
    gs = fig.add_gridspec(
        2, 3, height_ratios=[strip_h, heat_h], width_ratios=[1.0, 0.34, 0.03], hspace=0.05, wspace=0.05
    )
    fig.subplots_adjust(left=0.35, right=0.9, top=1 - 0.35 / fig_h, bottom=0.7 / fig_h)
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
        norm=share_norm(),
    )
    ax.set_xlim(x0, x1)
    ax.set_ylim(n, 0)
    _mark_gaps((ax, ax_lost), sel)
    zero_rows = [i for i, r in enumerate(rows) if r in zero and tot[i, 0] == 0]
    for i in zero_rows:
        ax.text(
            (x0 + x1) / 2,
            i + 0.5,
            ALL_ZERO,
            ha="center",
            va="center",
            fontsize=fs,
            color="#444",
            gid=ALL_ZERO,
        )
    # row names as plain texts: tick objects cost ~3 ms each to build and measure, texts a fraction of that
    ax.set_yticks([])
    label_tf = matplotlib.transforms.blended_transform_factory(ax.transAxes, ax.transData)
    for i, lab in enumerate(labels):
        ax.text(
            -0.008,
            i + 0.5,
            plain(lab),
            transform=label_tf,
            ha="right",
            va="center",
            fontsize=fs,
            clip_on=False,
        )
    ax.set_xlabel(X_LABEL, fontsize=8.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    ax.tick_params(axis="x", labelsize=8)
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
    cb.set_ticks(list(SHARE_TICKS))
    cb.ax.tick_params(labelsize=MIN_FONT_PT)
    cb.set_label("share of the row's nonzero values (log below 10%, linear above)", fontsize=8)
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
            beyond = ("← " if w.lo < x0 else "") + ("→" if w.hi > x1 else "")
            rng = f"2^{round(w.lo)} … 2^{round(w.hi)}" + (
                f" {beyond.strip()}" if beyond else ""
            )  # 2^0, never 2^-0
            narrow = hi - lo < 0.3 * (x1 - x0)  # too short a bar for its text: the text goes beside it
            ax_strip.text(
                lo - 0.3 if narrow else (lo + hi) / 2,
                i,
                rng,
                ha="right" if narrow else "center",
                va="center",
                fontsize=MIN_FONT_PT,
                clip_on=True,
                bbox={"boxstyle": "round,pad=0.12", "fc": "white", "ec": "none", "alpha": 0.85},
            )
        else:
            side = "below" if w.lo >= x1 else "above"
            ax_strip.text(
                (x0 + x1) / 2,
                i,
                f"2^{round(w.lo)} … 2^{round(w.hi)}: all {side} this range",
                ha="center",
                va="center",
                fontsize=MIN_FONT_PT,
                color="#555",
            )
    if bars:
        ys, lefts, rights, colors, alphas = zip(*bars, strict=True)
        _hbars(
            ax_strip, ys, lefts, rights, 0.62, [to_rgba(c, a) for c, a in zip(colors, alphas, strict=True)]
        )
    ax_strip.set_yticks(range(len(wins)))
    ax_strip.set_yticklabels([w.label for w in wins], fontsize=8)
    for t, w in zip(ax_strip.get_yticklabels(), wins, strict=True):
        t.set_color(w.color)
    ax_strip.tick_params(axis="y", length=0)
    ax_strip.tick_params(axis="x", labelbottom=False)
    head = f"{S.KIND_LABELS.get(kind, kind).capitalize()} by layer and binade"
    title = ax_strip.set_title(
        head + (f" (layers under {plain(under)})" if under else ""), fontsize=9.5, loc="left"
    )
    for sp in ("top", "right", "left"):
        ax_strip.spines[sp].set_visible(False)
    # shade what fp16 (at the scale in effect) cannot hold, so the lost tails stand out
    if fp16.lo > x0:
        ax.axvspan(x0, fp16.lo, color=fp16.color, alpha=0.07, lw=0)
    if fp16.hi < x1:
        ax.axvspan(fp16.hi, x1, color=fp16.color, alpha=0.07, lw=0)

    # right panel: share lost in the focus format, stacked, on the colour bar's scale (ends at the total)
    shares = np.nan_to_num(np.array([lost.get(r, (0.0, 0.0, 0.0)) for r in rows], dtype=float).reshape(n, 3))
    _lost_panel(ax_lost, shares, what)
    # the legend sits in the empty cell above the panel, where it hides no bar
    ax_leg = fig.add_subplot(gs[0, 1:])
    ax_leg.axis("off")
    kinds = ("underflow", "inf/nan (recorded)") if focus == "fp8" else tuple(LOST_COLORS)
    handles: list[Artist] = [Patch(color=LOST_COLORS[k], alpha=0.85, label=k) for k in kinds]
    if sel.marked_gaps():
        handles.append(Line2D([], [], color=GAP_COLOR, ls=(0, (3, 2)), lw=0.9, label="rows left out"))
    ax_leg.legend(
        handles=handles,
        loc="lower left",
        fontsize=MIN_FONT_PT,
        frameon=False,
        title="right: lost",
        title_fontsize=MIN_FONT_PT,
        alignment="left",
        handlelength=1.0,
        borderaxespad=0.0,
    )
    # margins from the texts themselves: long row or format names on the left, the colour bar's label on the right
    fit_margins(fig)
    if _fit_title(fig, ax_strip, title, head, under) | _fit_x_label(fig, ax, ax_lost):
        fit_margins(fig)  # a text broken in two lines is taller
    return Heatmap(
        fig, kind, rows_total, n, scale, wins, focus, what, (x0, x1), rows, sel, len(zero_rows), zero_total
    )
