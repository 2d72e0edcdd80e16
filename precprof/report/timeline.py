"""The report's time axis over sampled steps: what each tensor kind loses in FP16, step by step, with as many
columns as a page can show. The weight-update row is the share of intended updates (nonzero gradient or moved
weight) that did not land in a 16-bit weight: in the format the run holds its weights in (bf16 or fp16: a pure
run), else in FP16 weights (what FP16 master weights would lose), the advisor's ``*_lost_updates`` share.

A run of a few sampled steps gets one column per step. A long run (more sampled steps than ``MAX_COLUMNS``) has
its steps dealt into windows of consecutive sampled steps, each column the counts of its steps summed and
divided by their elements summed (so a window's share is of every value it saw); the first, the last and the
worst sampled step (the largest share lost over every kind) keep a column of their own, exact. ``Timeline.note``
says what was aggregated.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.text import Annotation
from matplotlib.ticker import FuncFormatter, MaxNLocator

from precprof import formats
from precprof import tables as T
from precprof.analysis import lost_updates
from precprof.report import summarize as S
from precprof.report.plots.common import FIG_WIDTH_IN, MIN_FONT_PT, _pct, fit_margins

MAX_COLUMNS = 120
FORMAT = "fp16"
FLOOR = 1e-7  # shares below it are drawn as nothing lost
NOTE_RISE_PT = 4.0  # the exact columns' labels: their height above the axes
NOTE_GAP_PT = 4.0  # and the least room between two of them


@dataclass
class Timeline:
    """Shares lost (``share[kind][column]``) over columns of sampled steps: ``starts``/``ends`` the first and last
    step of each column, ``exact`` the columns that hold one step kept as it is (first, last, worst)."""

    kinds: list[str]
    starts: np.ndarray
    ends: np.ndarray
    share: np.ndarray
    exact: dict[int, str]
    n_steps: int
    window: int
    update_format: str = ""  # the weights' format whose lost updates the weight-update row shows

    def label(self, kind: str) -> str:
        """A row's name; the weight-update row says what it counts."""
        if kind == T.WEIGHT_UPDATE and self.update_format:
            return f"weight updates lost\nin {self.update_format.upper()} weights"
        return S.KIND_LABELS.get(kind, kind)

    @property
    def aggregated(self) -> bool:
        return self.window > 1

    @property
    def note(self) -> str:
        if not self.aggregated:
            return f"One column per sampled step ({self.n_steps}).{self._uneven}"
        kept = ", ".join(f"{what} (step {int(self.starts[i])})" for i, what in sorted(self.exact.items()))
        return (
            f"{self.n_steps:,} sampled steps in {len(self.starts)} columns: windows of up to {self.window} "
            f"consecutive sampled steps, each the values lost summed over its steps divided by the values seen; "
            f"kept exact, one step a column: {kept}.{self._uneven}"
        )

    @property
    def _uneven(self) -> str:
        """Where the columns span very different numbers of steps (a long run's sampling thins out: half the
        figure was the first 4,500 of 30,000 steps, and nothing said so, tester t2), that the axis is of sampled
        steps; "" where they are about even."""
        spans = np.diff(self.starts.astype(float))
        if len(spans) < 4:
            return ""
        lo, hi = float(np.median(spans)), float(spans.max())
        if hi < 4 * max(lo, 1.0):
            return ""
        return (
            f" The columns are evenly spaced sampled steps, not steps: a column spans {int(spans.min()):,} to "
            f"{int(hi):,} steps, as the step labels show."
        )


def update_format(layers: pd.DataFrame, fmt: str = FORMAT) -> str:
    """The format whose lost updates the weight-update row shows: bf16 or fp16 when most weight-update rows
    hold their weight in it (a pure run, as the advisor judges it), else ``fmt``; "" when no weight-update row
    has a lost-update count for it."""
    if layers.empty or T.TENSOR not in layers:
        return ""
    # the columns it reads: a narrow copy (all of a large run's hundred columns took ~12 ms a call)
    read = [c for c in (T.DTYPE, T.LOST_UPDATE_BF16, T.LOST_UPDATE_FP16) if c in layers]
    upd = layers.loc[layers[T.TENSOR] == T.WEIGHT_UPDATE, read]
    held = fmt
    if T.DTYPE in upd and not upd.empty:
        for f in ("bf16", "fp16"):
            if bool((upd[T.DTYPE] == formats.get(f).dtype_name).mean() > 0.5):
                held = f
    col = T.LOST_UPDATE_BF16 if held == "bf16" else T.LOST_UPDATE_FP16
    if (
        held not in ("bf16", "fp16")
        or col not in upd
        or pd.to_numeric(upd[col], errors="coerce").isna().all()
    ):
        return ""
    return held


def lost_by_step(layers: pd.DataFrame, fmt: str = FORMAT, weights: pd.Series | None = None) -> pd.DataFrame:
    """Per (step, tensor kind): values lost in ``fmt`` at the recorded scale (underflow, overflow, and values
    already inf/nan) and values seen, summed over the step's rows. Weight-update rows count instead the updates
    lost in ``update_format``'s weights, and those already inf/nan, over the intended updates (numel - zeros), of
    the weights with a training gradient on their step (``lost_updates.zero_gradient``), each parameter's sampled
    counts at its size (``tables.sample_weights``: an estimate of the model's updates, not the sample's); a run
    without lost-update counts for those weights has no weight-update row (its what-if counts of ``fmt`` are not
    measured: NaN). ``weights``: ``tables.sample_weights(layers)`` where the caller has it."""
    cols = [T.underflow_col(fmt), T.overflow_col(fmt), T.NAN, T.INF]
    if layers.empty or any(c not in layers for c in [*cols, T.NUMEL]):
        return pd.DataFrame(columns=[T.STEP, T.TENSOR, "lost", T.NUMEL])
    held = update_format(layers, fmt)
    if not held:  # (a weight_update row's what-if counts are not measured: NaN, no row of the axis)
        layers = layers[layers[T.TENSOR] != T.WEIGHT_UPDATE]
    num = layers[[*cols, T.NUMEL]].apply(pd.to_numeric, errors="coerce").fillna(0)
    lost = num[cols].sum(axis=1)
    seen = num[T.NUMEL]
    if held:
        is_upd = layers[T.TENSOR] == T.WEIGHT_UPDATE
        col = T.LOST_UPDATE_BF16 if held == "bf16" else T.LOST_UPDATE_FP16
        zeros = pd.to_numeric(layers[T.ZEROS], errors="coerce").fillna(0) if T.ZEROS in layers else 0
        lost_upd = pd.to_numeric(layers[col], errors="coerce").fillna(0) + num[T.NAN] + num[T.INF]
        # a weight without a training gradient on its step counts nothing, as in the advisor's share
        # what zero_gradient reads, as narrow copies (not all of a large run's hundred columns)
        keys = [c for c in (T.STEP, T.MODULE, T.PARAM, T.NUMEL, T.ZEROS) if c in layers]
        idle = lost_updates.zero_gradient(
            layers.loc[layers[T.TENSOR] == T.WEIGHT_GRAD, keys], layers.loc[is_upd, keys]
        )
        kept = ~idle.reindex(layers.index, fill_value=False)
        # each parameter's sampled counts at its size, as the advisor's share counts them
        w = (T.sample_weights(layers) if weights is None else weights).reindex(layers.index, fill_value=1.0)
        lost = lost.where(~is_upd, lost_upd * w).where(kept, 0)
        seen = seen.where(~is_upd, (seen - zeros).clip(lower=0) * w).where(kept, 0)
    out = pd.DataFrame(
        {
            T.STEP: pd.to_numeric(layers[T.STEP], errors="coerce").to_numpy(),
            T.TENSOR: layers[T.TENSOR].to_numpy(),
            "lost": lost.to_numpy(),
            T.NUMEL: seen.to_numpy(),
        }
    ).dropna(subset=[T.STEP])
    return out.groupby([T.STEP, T.TENSOR], sort=True)[["lost", T.NUMEL]].sum().reset_index()


def timeline(
    layers: pd.DataFrame, max_columns: int = MAX_COLUMNS, fmt: str = FORMAT, weights: pd.Series | None = None
) -> Timeline | None:
    """The columns of the time axis (module docstring); None without sampled steps. ``weights``:
    ``tables.sample_weights(layers)`` where the caller has it (``lost_by_step``)."""
    per = lost_by_step(layers, fmt, weights)
    if per.empty:
        return None
    kinds = [k for k in T.TENSOR_KINDS if (per[T.TENSOR] == k).any()]
    steps = np.sort(per[T.STEP].unique()).astype(np.int64)
    lost = per.pivot_table(index=T.STEP, columns=T.TENSOR, values="lost", aggfunc="sum", fill_value=0)
    seen = per.pivot_table(index=T.STEP, columns=T.TENSOR, values=T.NUMEL, aggfunc="sum", fill_value=0)
    lost = lost.reindex(index=steps, columns=kinds, fill_value=0).to_numpy(dtype=float)
    seen = seen.reindex(index=steps, columns=kinds, fill_value=0).to_numpy(dtype=float)
    n = len(steps)
    # columns: consecutive runs of steps; the exact steps alone in theirs
    exact_idx: dict[int, str] = {}
    if n > max_columns:
        total = np.divide(lost.sum(axis=1), seen.sum(axis=1), out=np.zeros(n), where=seen.sum(axis=1) > 0)
        exact_idx = {0: "first", n - 1: "last"}
        if total.max() > 0:  # a run that lost nothing has no worst step
            worst = int(np.argmax(total))
            exact_idx.setdefault(worst, "worst")
            if exact_idx[worst] != "worst":
                exact_idx[worst] += " and worst"
    window = (
        max(1, math.ceil((n - len(exact_idx)) / max(1, max_columns - 2 * len(exact_idx)))) if exact_idx else 1
    )
    bounds: list[tuple[int, int]] = []
    i = 0
    while i < n:
        if i in exact_idx:
            bounds.append((i, i + 1))
            i += 1
            continue
        j = i
        while j < n and j - i < window and j not in exact_idx:
            j += 1
        bounds.append((i, j))
        i = j
    share = np.zeros((len(kinds), len(bounds)))
    for c, (a, b) in enumerate(bounds):
        lo, se = lost[a:b].sum(axis=0), seen[a:b].sum(axis=0)
        share[:, c] = np.divide(lo, se, out=np.full(len(kinds), np.nan), where=se > 0)
    col_of = {a: c for c, (a, b) in enumerate(bounds) if b - a == 1}
    return Timeline(
        kinds=kinds,
        starts=np.array([steps[a] for a, _ in bounds]),
        ends=np.array([steps[b - 1] for _, b in bounds]),
        share=share,
        exact={col_of[i]: what for i, what in exact_idx.items()},
        n_steps=n,
        window=window,
        update_format=update_format(layers, fmt) if T.WEIGHT_UPDATE in kinds else "",
    )


def step_ticks(tl: Timeline, most: int = 6) -> tuple[np.ndarray, list[str]]:
    """Where the time axis's ticks go (in columns, a column ``c`` spanning ``c`` to ``c + 1``) and their labels.
    Up to ``most`` columns: each column, labelled with its step (a window's first and last). More: round step
    numbers (0, 100, 200, ...), each placed where its step lies between the columns' steps (a column at its
    steps' middle): labelling evenly spaced columns with their steps gave "0 100 200 295 395 495", the steps
    that sampling happened to give those columns."""
    n = len(tl.starts)
    if n <= most:
        labels = [f"{a}" if a == b else f"{a}–{b}" for a, b in zip(tl.starts, tl.ends, strict=True)]
        return np.arange(n) + 0.5, labels
    first, last = int(tl.starts[0]), int(tl.ends[-1])
    located = MaxNLocator(nbins=most, integer=True, steps=[1, 2, 2.5, 5, 10]).tick_values(first, last)
    values = [int(v) for v in located if first <= v <= last]
    mids = (tl.starts.astype(float) + tl.ends.astype(float)) / 2
    xs: list[float] = []
    kept: list[int] = []
    for v in values:
        x = float(np.interp(v, mids, np.arange(n) + 0.5))
        if not xs or x - xs[-1] >= n / (2 * most):  # steps the columns crowd together: one label of them
            xs.append(x)
            kept.append(v)
    return np.array(xs), [f"{v}" for v in kept]


def _apart(fig: Figure, notes: list[Annotation]) -> None:
    """Move the exact columns' labels (``notes``, left to right) apart where they would overlap, by their drawn
    extents: the exact columns are next to each other whenever the worst step is within a few windows of the
    first or last ("worst 192" and "last 199" read "worstlast / 192199"). The first and last labels stay over
    their columns; the worst one moves away from them, as little as keeps ``NOTE_GAP_PT`` between them (the
    columns' order is the labels')."""
    if len(notes) < 2:
        return
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    to_pt = 72.0 / fig.dpi
    for left, right in itertools.pairwise(notes):
        a, b = left.get_window_extent(renderer), right.get_window_extent(renderer)
        need = a.x1 + NOTE_GAP_PT / to_pt - b.x0  # pixels
        if need <= 0:
            continue
        # the first label stays, the one after it moves right; else the last stays, the one before it left
        moved, by = (right, need) if left is notes[0] else (left, -need)
        x, y = moved.xyann
        moved.xyann = (x + by * to_pt, y)


def timeline_figure(tl: Timeline, restarts: list[int] | None = None) -> Figure:
    """Tensor kinds (rows) by columns of sampled steps, coloured by the share lost in FP16 (log scale); exact
    columns of a long run marked above, restarts of a resumed run drawn as dashed lines."""
    n = len(tl.starts)
    height = 1.3 + 0.36 * len(tl.kinds)
    fig = Figure(figsize=(FIG_WIDTH_IN, height))  # drawn for the page's narrowest width
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.24, right=0.86, top=1 - 0.42 / height, bottom=0.62 / height)
    # nothing lost (below the floor) is white, like a column without data
    data = np.ma.masked_invalid(np.where(tl.share < FLOOR, FLOOR / 2, tl.share))
    im = ax.imshow(
        data,
        aspect="auto",
        interpolation="nearest",
        cmap=matplotlib.colormaps["Reds"].with_extremes(under="white", bad="#eeeeee"),
        norm=LogNorm(
            vmin=FLOOR, vmax=max(1e-3, float(np.nanmax(tl.share)) if np.isfinite(tl.share).any() else 1)
        ),
        extent=(0, n, len(tl.kinds), 0),
    )
    ax.set_yticks(np.arange(len(tl.kinds)) + 0.5)
    ax.set_yticklabels([tl.label(k) for k in tl.kinds], fontsize=8.5)
    xs, labels = step_ticks(tl)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel(
        "step" + (" (columns: windows of consecutive sampled steps)" if tl.aggregated else ""), fontsize=8.5
    )
    notes: list[Annotation] = []
    for c, what in sorted(tl.exact.items()):
        notes.append(
            ax.annotate(
                f"{what}\n{tl.starts[c]}",
                (c + 0.5, 0),
                xytext=(0, NOTE_RISE_PT),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=MIN_FONT_PT,
                annotation_clip=False,
            )
        )
        ax.axvline(c, color="#555", lw=0.4)
        ax.axvline(c + 1, color="#555", lw=0.4)
    for r in restarts or []:
        col = int(np.searchsorted(tl.ends, r))
        if col < n:
            ax.axvline(col, color="#2c7fb8", ls="--", lw=1.4)
    fit_margins(fig)  # the kinds' names on the left, the step labels below
    fig.subplots_adjust(right=0.8)  # room for the colour bar, added beside the axes where they now are
    _apart(fig, notes)
    box = ax.get_position()
    cax = fig.add_axes((box.x1 + 0.015, box.y0, 0.014, box.height))
    # the heatmaps' percentages: "100%" at the top of a run that lost every value, not "1e+02%"
    cb = fig.colorbar(im, cax=cax, format=FuncFormatter(_pct))
    held = tl.update_format.upper()
    cb.set_label(
        "lost in FP16"
        + (f"\n(updates: in {held}\nweights)" if held and held != FORMAT.upper() else "")
        + "\n(white: nothing)",
        fontsize=MIN_FONT_PT,
    )
    cb.ax.tick_params(labelsize=MIN_FONT_PT)
    cb.minorticks_off()
    return fig
