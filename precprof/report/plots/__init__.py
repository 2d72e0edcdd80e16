"""The report's figures: matplotlib's object API on the Agg canvas, never pyplot (no global state, thread-safe,
no display needed). The backend is never switched: each figure gets its own ``FigureCanvasAgg``, so a user's
notebook or GUI backend is left alone.

Each public ``*_figure`` function takes tables (DataFrames) and returns a ``matplotlib.figure.Figure``, or None
when there is nothing to draw; ``png_bytes`` and ``data_uri`` turn a figure into what the HTML embeds.

The package, one module per figure: ``common`` (embedding, text and margins), ``training``, ``heatmap`` (with
``windows``, the format windows it draws), ``memory``.
"""

from precprof.report.plots.common import (
    DPI,
    FIG_WIDTH_IN,
    FIG_WIDTH_PX,
    MARGIN_PAD_PX,
    MIN_FONT_PT,
    ROW_LABEL_MAX,
    data_uri,
    drawable,
    elide,
    fit_margins,
    plain,
    png_bytes,
    pow2_text,
    row_labels,
    spans_decades,
    step_label,
    step_locator,
    svg_bytes,
    unhinted_text,
)
from precprof.report.plots.heatmap import LOST_COLORS, Heatmap, share_norm, signature_heatmap
from precprof.report.plots.memory import COMPONENT_COLORS, memory_figure
from precprof.report.plots.training import RESTART_COLOR, SKIP_COLOR, training_figure
from precprof.report.plots.windows import Window, format_window, heatmap_windows

__all__ = [
    "COMPONENT_COLORS",
    "DPI",
    "FIG_WIDTH_IN",
    "FIG_WIDTH_PX",
    "LOST_COLORS",
    "MARGIN_PAD_PX",
    "MIN_FONT_PT",
    "RESTART_COLOR",
    "ROW_LABEL_MAX",
    "SKIP_COLOR",
    "Heatmap",
    "Window",
    "data_uri",
    "drawable",
    "elide",
    "fit_margins",
    "format_window",
    "heatmap_windows",
    "memory_figure",
    "plain",
    "png_bytes",
    "pow2_text",
    "row_labels",
    "share_norm",
    "signature_heatmap",
    "spans_decades",
    "step_label",
    "step_locator",
    "svg_bytes",
    "training_figure",
    "unhinted_text",
]
