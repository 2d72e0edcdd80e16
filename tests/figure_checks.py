"""Checks on a drawn matplotlib figure that the report tests share: tick labels that run together."""

from __future__ import annotations

import itertools

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
