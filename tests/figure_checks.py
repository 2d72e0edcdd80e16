"""Checks on a drawn matplotlib figure that the report tests share: tick labels that run together, the rows a
heatmap chose."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def overlapping_tick_labels(fig: Figure, gap_px: float = 2.0) -> list[tuple[str, str]]:
    """Pairs of neighbouring tick labels on one axis of ``fig`` closer than ``gap_px`` (or overlapping): a
    run of 3,000 steps wrote "1200160020002400" under a third of the page's width."""
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    out = []
    for ax in fig.axes:
        for axis, lo_i, hi_i in ((ax.xaxis, 0, 2), (ax.yaxis, 1, 3)):
            lo, hi = sorted(axis.get_view_interval())
            boxes = sorted(
                (
                    (tuple(t.label1.get_window_extent(renderer).extents), t.label1.get_text())
                    for t in axis.get_major_ticks()
                    if t.label1.get_visible() and t.label1.get_text().strip() and lo <= t.get_loc() <= hi
                ),
                key=lambda b: b[0][lo_i],
            )
            for (a, ta), (b, tb) in itertools.pairwise(boxes):
                if b[lo_i] - a[hi_i] < gap_px:
                    out.append((ta, tb))
    return out


def check_rows_chosen(rows: list[Any], bad: dict[Any, float], keep: int, shown: list[Any]) -> None:
    """A heatmap's choice of ``keep`` of ``rows`` (forward order), checked from each row's lost share ``bad``
    alone. Besides the first and last (``keep - 2`` slots): when every row that loses anything fits, with the row
    before the first of them, all of them and the rows that lose nothing taken evenly; else every row that loses
    more than the ``slots - slots // 4``-th most (the cut), and of the rows at the cut and of those below it
    each a share taken evenly, a quarter of the slots (or all, when fewer) for those below. The first row that
    loses anything is always shown with the one before it. ``shown``: the rows drawn, in forward order."""
    assert shown == [r for r in rows if r in set(shown)]  # forward order
    assert len(shown) == keep and shown[0] == rows[0] and shown[-1] == rows[-1]
    middle, slots = rows[1:-1], keep - 2
    onset = next((i for i, r in enumerate(rows) if bad[r] > 0), 0)
    first = {rows[i] for i in (onset, onset - 1) if onset and 0 < i < len(rows) - 1}
    assert first <= set(shown)
    losing = [r for r in middle if bad[r] > 0]
    cut = 0.0
    if len(losing) + sum(bad[r] == 0 for r in first) > slots:
        cut = sorted((bad[r] for r in middle), reverse=True)[slots - slots // 4 - 1]
    worse = {r for r in middle if bad[r] > cut}
    tied = [r for r in middle if bad[r] == cut]
    less = [r for r in middle if bad[r] < cut]
    assert worse <= set(shown)
    assert len(set(shown) & set(less)) == slots - len(worse) - min(
        len(tied), slots - len(worse) - min(len(less), slots // 4)
    )
    for group in (tied, less):  # no run of a group's rows left out longer than an even spacing
        kept = [i for i, r in enumerate(group) if r in set(shown)]
        spread = len(kept) - len(first & set(group))
        if spread > 0:
            runs = np.diff([-1, *kept, len(group)]) - 1
            bound = math.ceil((len(group) - len(first & set(group))) / spread) - 1
            assert runs.max() <= bound, (len(group), len(kept), runs.tolist())
