"""What every figure of the report shares: turning a figure into what the page embeds (PNG, SVG, a data URI), the
resolution, the texts of axes (powers of two, percentages, names cut in the middle) and margins that fit the
texts.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import math
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib import font_manager
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.ft2font import FT2Font
from matplotlib.ticker import MaxNLocator
from PIL import Image
from PIL.PngImagePlugin import PngInfo

DPI = 100
# Every figure is drawn for the page's narrowest column (800 px window, 32 px margins: 736 px), so that it is shown
# at its own pixels there and at any wider window; its texts are never smaller than MIN_FONT_PT (10 px).
FIG_WIDTH_PX = 720
FIG_WIDTH_IN = FIG_WIDTH_PX / DPI
MIN_FONT_PT = 7.5
LOG_SPAN = 100.0  # a loss that spans two decades is drawn on a log axis
# zlib's level for the figures' PNGs: its fast deflate (levels 1-3), which on the report's figures (flat colours,
# text) packs opaque RGB smaller than the default level 6 does, in two thirds of its time
PNG_COMPRESS_LEVEL = 3


@contextlib.contextmanager
def glyphs_quiet() -> Iterator[None]:
    """Matplotlib's "Glyph ... missing from font(s)" warnings silenced while precprof measures or draws a figure
    (a module named in CJK printed a dozen multi-line warnings on the console): :func:`drawable` has already
    written such characters another way. The warning filters are the caller's again afterwards."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from", category=UserWarning)
        yield


@contextlib.contextmanager
def unhinted_text() -> Iterator[None]:
    """The report's figures laid out and drawn with FreeType's hinting off: the hinter took about a fifth of a
    page's time, run again for each of a heatmap's hundreds of texts, and changes nothing a reader sees at the
    page's 100 dpi. Only ``text.hinting`` is set (read as each text is measured or drawn), and put back as the
    caller had it afterwards."""
    rc = matplotlib.rcParams
    before = rc["text.hinting"]
    rc["text.hinting"] = "no_hinting"
    try:
        yield
    finally:
        rc["text.hinting"] = before


def agg_canvas(fig: Figure) -> FigureCanvasAgg:
    """``fig``'s Agg canvas, attached explicitly (no backend lookup, no pyplot) unless it has one already: the
    canvas keeps its renderer, and matplotlib keeps each renderer's text measurements, so that a figure whose
    margins were fitted to its texts (:func:`fit_margins`) draws them without measuring each again (a new canvas
    for the PNG measured a heatmap's hundreds of texts twice)."""
    canvas = fig.canvas
    return canvas if isinstance(canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)


class _Discard(io.BytesIO):
    """A file that keeps nothing: where ``savefig`` writes the raw pixels that :func:`png_bytes` reads from the
    canvas itself."""

    def write(self, data: Any) -> int:
        return len(memoryview(data))


def png_bytes(fig: Figure, dpi: int = DPI) -> bytes:
    """Render ``fig`` to PNG bytes with the Agg canvas (:func:`agg_canvas`).

    The pixels are matplotlib's; the file is written here: without the alpha channel where every pixel is opaque
    (as every figure of the report is), at zlib level ``PNG_COMPRESS_LEVEL``, with matplotlib's metadata. The
    same pixels in a file about a sixth smaller, encoded in about half the time of matplotlib's RGBA at level 6
    (a tenth of a heatmap's time)."""
    canvas = agg_canvas(fig)
    with glyphs_quiet():
        fig.savefig(_Discard(), format="rgba", dpi=dpi)  # draws the canvas as savefig(format="png") does
    rgba = np.asarray(canvas.buffer_rgba())
    image = Image.frombuffer("RGBA", (rgba.shape[1], rgba.shape[0]), rgba, "raw", "RGBA", 0, 1)
    if rgba[..., 3].min() == 255:
        image = image.convert("RGB")
    info = PngInfo()
    info.add_text("Software", f"Matplotlib version{matplotlib.__version__}, https://matplotlib.org/")
    buf = io.BytesIO()
    image.save(buf, format="png", dpi=(dpi, dpi), pnginfo=info, compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def svg_bytes(fig: Figure) -> bytes:
    """Render ``fig`` to SVG bytes (for small line plots that should stay sharp when zoomed)."""
    agg_canvas(fig)
    buf = io.BytesIO()
    with glyphs_quiet():
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


def step_label(x: float, _pos: Any = None) -> str:
    """A step number short enough to sit beside its neighbours: 2400, 30k, 62.5k, 1.5M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    return f"{x / 1e3:g}k" if abs(x) >= 1e4 else f"{x:g}"


def step_locator(nbins: int) -> MaxNLocator:
    """Ticks on a step axis: whole steps only, at most ``nbins`` intervals, one tick where only one fits (a run
    of one step had ticks at -0.45 … 0.45: matplotlib's locator falls back to fractions below two ticks)."""
    return MaxNLocator(integer=True, nbins=nbins, min_n_ticks=1)


def spans_decades(values: np.ndarray) -> bool:
    """Whether ``values`` (finite) are all positive and their largest is ``LOG_SPAN`` times their smallest or more:
    on a linear axis all but the largest lie on its zero line (a diverged run's loss went 5.5, 381, 3.4e9)."""
    return bool(len(values)) and bool((values > 0).all()) and values.max() >= LOG_SPAN * values.min()


def pow2_text(v: float) -> str:
    """``2^k`` for powers of two, else the value with 3 significant digits (plain text, for captions)."""
    if v > 0 and math.isfinite(v):
        k = math.log2(v)
        if abs(k - round(k)) < 1e-9:
            return f"2^{round(k)}"
    return f"{v:.3g}"


def _pct(x: float, _pos: Any = None) -> str:
    """A share as a percentage, in decimals at any size (a colour bar's "0.00001%" below its "0.0001%", where
    ``:g`` wrote "1e-05%")."""
    if x <= 0:
        return "0%"
    p = 100 * x
    if p >= 1:
        return f"{p:.0f}%"
    return np.format_float_positional(p, precision=6, unique=True, fractional=False, trim="-") + "%"


ROW_LABEL_MAX = (
    44  # characters of a heatmap row name; a longer one keeps its start and end around an ellipsis
)
MARGIN_PAD_PX = 6  # white space kept between the outermost text and the figure's edge


@functools.cache
def _font_chars(path: str) -> frozenset[int]:
    """The code points the font file at ``path`` has a glyph for."""
    return frozenset(FT2Font(path).get_charmap())


def drawable(text: str) -> str:
    """``text`` with each run of characters that the figures' font has no glyph for (CJK, emoji, a control
    character) written as their code points in brackets (``日本語_🚀`` as ``[U+65E5 U+672C U+8A9E]_[U+1F680]``):
    matplotlib drew an empty box for each, so that names differing in those characters read alike, and Python's
    escapes (``\\u65e5\\u672c\\u8a9e_\\U0001f680``) read as part of the name. Text the font covers is returned as
    it is."""
    chars = _font_chars(font_manager.findfont(font_manager.FontProperties()))
    if all(ord(c) in chars for c in text):
        return text
    out: list[str] = []
    missing: list[str] = []
    for c in [*text, ""]:
        if c and ord(c) not in chars:
            missing.append(f"U+{ord(c):04X}")
            continue
        if missing:
            out.append(f"[{' '.join(missing)}]")
            missing = []
        out.append(c)
    return "".join(out)


def plain(text: str) -> str:
    """``text`` as matplotlib draws it letter for letter: a user's name (a module's, a run's) may hold ``$``,
    which matplotlib reads as the start of math (``cost_$5_and_$6`` failed to parse, and no report was drawn),
    or characters the font lacks (:func:`drawable`)."""
    return drawable(text).replace("$", r"\$")


def elide(text: str, limit: int = ROW_LABEL_MAX) -> str:
    """``text`` cut in the middle to ``limit`` characters (start and end kept, joined by an ellipsis)."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


def row_labels(names: Sequence[str], limit: int = ROW_LABEL_MAX) -> tuple[list[str], str]:
    """Row labels of dotted layer names, each at most ``limit`` characters and as distinct as the names, and the
    leading components left out of all of them ("" when none).

    Names that fit are kept whole. Otherwise the leading components every name shares are left out (to be said
    once: a wrapper's ``base_model.model.``); then, in each name still too long, components that other names
    share at the same place are replaced by an ellipsis, the most shared (and the longest) first, never an index
    or the component it indexes (``layers.0``), so that what tells the layers apart stays (``model.layers.0…q_proj.lora_A.default.weight``: the layer's index, its
    projection and adapter); then :func:`elide`. A cut that made two different names alike is undone for them
    (they are elided as they are). A plain middle cut had made every LoRA weight of a peft model read
    ``base_model.model.mode….lora_A.default.weight``."""
    if all(len(n) <= limit for n in names):
        return list(names), ""
    parts = [n.split(".") for n in names]
    k = 0  # the leading components all share, each name keeping one at least
    while all(len(p) > k + 1 for p in parts) and len({p[k] for p in parts}) == 1:
        k += 1
    while k and any(p[k].isdigit() for p in parts):  # ``layers.0``, not a bare ``0``
        k -= 1
    prefix = ".".join(parts[0][:k]) + "." if k else ""
    parts = [p[k:] for p in parts]
    # how many layers share a component at a place: names alike but for their last component (a layer's
    # ``.weight`` and ``.bias``) are one layer, whose own name a long one had lost to ``…weight`` and ``…bias``
    layers = {tuple(p[:-1]) for p in parts}
    shared = Counter((i, c) for p in layers for i, c in enumerate(p))
    labels: list[str] = []
    for p in parts:
        keep = [True] * len(p)
        label = ".".join(p)
        # never the last component (the layer's own name, or its parameter's), an index or what it indexes
        cut = [i for i in range(len(p) - 1) if not (p[i].isdigit() or p[i + 1].isdigit())]
        for i in sorted(cut, key=lambda i: (-shared[(i, p[i])], -len(p[i]), i)):
            if len(label) <= limit or shared[(i, p[i])] < 2:
                break
            keep[i] = False
            label = _joined(p, keep)
        labels.append(elide(label, limit))
    by_label: dict[str, set[str]] = {}
    for label, p in zip(labels, parts, strict=True):
        by_label.setdefault(label, set()).add(".".join(p))
    return [
        lab if len(by_label[lab]) == 1 else elide(".".join(p), limit)
        for lab, p in zip(labels, parts, strict=True)
    ], prefix


def _joined(parts: Sequence[str], keep: Sequence[bool]) -> str:
    """``parts`` joined by dots, each run of parts not kept one ellipsis (no dot beside it)."""
    out = ""
    for i, (part, kept) in enumerate(zip(parts, keep, strict=True)):
        if not kept:
            if not out.endswith("…"):
                out += "…"
        else:
            out += ("." if i and not out.endswith("…") and out else "") + part
    return out


def fit_margins(fig: Figure, *, max_left: float = 0.6, min_right: float = 0.55) -> None:
    """Set ``fig``'s subplot margins from the extent of its texts (labels, titles, the colour bar's label), so
    that every one lies inside the figure with ``MARGIN_PAD_PX`` to spare and no more margin than that is left.

    Texts anchored to the axes (row names, tick labels, axis labels) move with the axes, so one measurement
    gives the exact shift. Measures without rasterising (``get_tightbbox``); the figure's size is unchanged.
    """
    renderer = agg_canvas(fig).get_renderer()
    w, h = fig.bbox.width, fig.bbox.height
    with glyphs_quiet():
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
