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
    alone: the first and last; every other row that loses more than the ``keep - 2``-th most of them; the rest
    from the rows that lose exactly that much, spread evenly (no run of them left out longer than the even
    spacing), never the first ones only. ``shown``: the rows drawn, which must be in forward order."""
    middle = rows[1:-1]
    cut = sorted((bad[r] for r in middle), reverse=True)[keep - 3]
    must = {rows[0], rows[-1]} | {r for r in middle if bad[r] > cut}
    tied = [r for r in middle if bad[r] == cut]
    assert len(shown) == keep and must <= set(shown) <= must | set(tied)
    assert shown == [r for r in rows if r in set(shown)]  # forward order
    left = keep - len(must)
    kept = [i for i, r in enumerate(tied) if r in set(shown)]
    runs = np.diff([-1, *kept, len(tied)]) - 1  # tied rows left out before, between and after the kept ones
    assert runs.max() <= math.ceil(len(tied) / left) - 1, (len(tied), left, runs.tolist())
