"""The "Over the run" strip's axes: ticks at round step numbers, one notation on its colour bar, and the exact
columns' labels kept apart."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof.report import timeline
from precprof.report.plots.common import FIG_WIDTH_PX, png_bytes


def _timeline(starts: list[int], ends: list[int] | None = None) -> timeline.Timeline:
    n = len(starts)
    share = np.geomspace(1e-7, 0.5, 2 * n).reshape(2, n)  # every decade of the colour bar's range
    return timeline.Timeline(
        kinds=[T.ACTIVATION, T.WEIGHT_GRAD],
        starts=np.array(starts),
        ends=np.array(ends if ends is not None else starts),
        share=share,
        exact={},
        n_steps=n,
        window=1 if ends is None else 2,
    )


def test_the_ticks_are_round_steps_where_those_steps_are() -> None:
    # the first 5 steps sampled, then every 5th: evenly spaced columns read "0 100 200 295 395 495" (h80)
    steps = [0, 1, 2, 3, 4, *range(5, 500, 5)]
    tl = _timeline(steps)
    xs, labels = timeline.step_ticks(tl)
    assert labels == ["0", "100", "200", "300", "400"], labels
    assert list(xs) == sorted(xs)
    for x, label in zip(xs, labels, strict=True):
        col = steps.index(int(label))  # each tick lies on the column of its own step
        assert col <= x <= col + 1, (label, x, col)
    fig = timeline.timeline_figure(tl)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == labels
    # a long run's windows: round steps as well, each inside the window that holds it
    starts = list(range(0, 3000, 30))
    tl = _timeline(starts, [s + 25 for s in starts])
    xs, labels = timeline.step_ticks(tl)
    assert labels == ["0", "500", "1000", "1500", "2000", "2500"], labels
    for x, label in zip(xs, labels, strict=True):
        col = int(label) // 30
        assert col <= x <= col + 1, (label, x, col)
    # a few columns: each labelled with its own step, as before
    assert timeline.step_ticks(_timeline([0, 37, 74]))[1] == ["0", "37", "74"]


def test_the_colour_bar_writes_every_share_in_decimals() -> None:
    fig = timeline.timeline_figure(_timeline(list(range(8))))
    fig.canvas.draw()
    bar = fig.axes[1]
    lo, hi = bar.get_ylim()
    ticks = [
        t.get_text() for t, v in zip(bar.get_yticklabels(), bar.get_yticks(), strict=True) if lo <= v <= hi
    ]
    # "1e-05%" below "0.0001%" before
    assert ticks[:3] == ["0.00001%", "0.0001%", "0.001%"] and not any("e" in t for t in ticks), ticks


def test_the_exact_columns_labels_keep_apart_where_the_worst_step_is_next_to_the_first_or_last() -> None:
    """200 sampled steps (windowed), the worst one two steps from the last, then two from the first: "worst 192"
    and "last 199" were drawn over each other as "worstlast / 192199" (h104). By the labels' drawn extents at the
    page's own pixels, none overlaps another, they read in their columns' order, and the first and last stay over
    their columns."""
    for worst in (197, 2):
        rows = [
            {
                T.STEP: step,
                T.MODULE: "0",
                T.TENSOR: kind,
                T.PARAM: "",
                T.NUMEL: 1000,
                T.underflow_col("fp16"): 50 if step == worst else 1,
                T.overflow_col("fp16"): 0,
                T.NAN: 0,
                T.INF: 0,
                T.ZEROS: 0,
            }
            for step in range(200)
            for kind in (T.ACTIVATION, T.ACTIVATION_GRAD)
        ]
        tl = timeline.timeline(pd.DataFrame(rows))
        assert tl is not None and sorted(tl.exact.values()) == ["first", "last", "worst"], tl
        fig = timeline.timeline_figure(tl)
        png_bytes(fig)  # drawn as the page draws it
        assert fig.bbox.width == FIG_WIDTH_PX
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        ax = fig.axes[0]
        notes = sorted(ax.texts, key=lambda t: t.get_window_extent(renderer).x0)
        said = [t.get_text().split("\n") for t in notes]
        assert said == [["first", "0"], ["worst", str(worst)], ["last", "199"]], said
        boxes = [t.get_window_extent(renderer) for t in notes]
        for a, b in itertools.pairwise(boxes):
            assert a.x1 < b.x0, (worst, said, boxes)
        for t, box in ((notes[0], boxes[0]), (notes[-1], boxes[-1])):  # centred on their own columns
            col = next(c for c, what in tl.exact.items() if what == t.get_text().split("\n")[0])
            x = ax.transData.transform((col + 0.5, 0))[0]
            assert abs((box.x0 + box.x1) / 2 - x) < 1, (t.get_text(), box, x)


def test_columns_of_uneven_spans_say_so() -> None:
    """A long run's sampling thins out: half the strip was its first 4,500 of 30,000 steps, and nothing said the
    columns were sampled steps spanning ever more steps (tester t2). The caption says so where the spans differ
    by 4x or more; not for a run sampled at an even pace."""
    thinned = [*range(0, 200), *range(200, 2200, 50)]
    assert "a column spans 1 to 50 steps, as the step labels show" in _timeline(thinned).note
    assert "a column spans" not in _timeline(list(range(0, 500, 5))).note
    assert "a column spans" not in _timeline([0, 1, 2, 3, 4, *range(5, 500, 5)]).note
    # the spans are said as they are, not why: a budget held back by a slow sampled step spaces its samples
    # unevenly too, without thinning (tester t1: "sampling thins out" stood beside a summary that had not thinned)
    assert "thins out" not in _timeline(thinned).note
