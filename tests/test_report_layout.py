"""The report's figures keep every text inside the image, and the memory figure's measured bar is the table's sum.

A text outside the figure is cut off in the PNG the page embeds: the heatmap's format names on the left (short
row names, a diverged run's wide x range) and its colour-bar label on the right used to be. Each test draws the
figure and measures every visible text's extent in pixels against the figure's own box.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from figure_checks import check_rows_chosen, overlapping_tick_labels
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from report_fixtures import gpt_layers, synthetic_run

from precprof import tables as T
from precprof.report import context as report_context
from precprof.report import filters, plots, render
from precprof.report import memory_summary as M
from precprof.report import summarize as S

TEMPLATES = Path(__file__).resolve().parents[1] / "reports" / "templates"


def drawn_texts(fig: Figure) -> list[tuple[str, tuple[float, float, float, float]]]:
    """Each text ``fig`` draws, with its extent in pixels (x0, y0, x1, y1), clipped where the text clips."""
    FigureCanvasAgg(fig).draw()  # positions tick labels, as the PNG export does
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    # matplotlib keeps tick labels for ticks beyond an axis' view limits, and does not draw them
    undrawn: set[int] = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            span = (hi - lo) or 1.0
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 * span <= tick.get_loc() <= hi + 1e-9 * span:
                    undrawn |= {id(tick.label1), id(tick.label2)}
    out = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip() or id(t) in undrawn:
            continue
        box = t.get_window_extent(renderer)
        x0, y0, x1, y1 = box.x0, box.y0, box.x1, box.y1
        clip = t.get_clip_box() if t.get_clip_on() else None
        if clip is not None:
            x0, x1, y0, y1 = max(x0, clip.x0), min(x1, clip.x1), max(y0, clip.y0), min(y1, clip.y1)
            if x0 >= x1 or y0 >= y1:
                continue  # clipped away entirely
        out.append((t.get_text(), (x0, y0, x1, y1)))
    return out


def texts_outside(fig: Figure) -> list[str]:
    """The drawn texts of ``fig`` whose extent leaves the figure (half a pixel of tolerance)."""
    W, H = fig.bbox.width, fig.bbox.height
    return [
        f"{text!r} at x {x0:.0f}..{x1:.0f}, y {y0:.0f}..{y1:.0f} (figure {W:.0f}x{H:.0f})"
        for text, (x0, y0, x1, y1) in drawn_texts(fig)
        if x0 < -0.5 or y0 < -0.5 or x1 > W + 0.5 or y1 > H + 0.5
    ]


def renamed(names: dict[int, str]) -> list:
    layers = gpt_layers(n_layer=1)
    return [replace(ly, name=names.get(i, ly.name)) for i, ly in enumerate(layers)]


LONG = "model.encoder.block_with_a_very_long_descriptive_name_given_by_its_author." * 2 + "projection"
CASES = {
    # a run that went nan, with one layer name far longer than any margin could hold (it is elided)
    "long-names": renamed({4: LONG, 5: LONG + ".inner"}),
    # one-character names: the format names of the window strip are the widest text on the left
    "short-names": [replace(ly, name=str(i)) for i, ly in enumerate(gpt_layers(n_layer=1))],
    # a peft-wrapped model: every name under base_model.model.model., which the title states once; the title ran
    # off the image, and the narrow heatmap's x label into the side panel's
    "peft-names": [replace(ly, name="base_model.model.model." + ly.name) for ly in gpt_layers(n_layer=1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", [T.ACTIVATION_GRAD, T.WEIGHT_GRAD])
def test_heatmap_texts_lie_inside_the_figure(case: str, kind: str) -> None:
    tabs, _ = synthetic_run("fp16", layers=CASES[case], steps=6, sample_every=1, nan_at=4)
    assert T.flags(tabs["steps"][T.LOSS].isna()).any()  # the run went nan
    hm = plots.signature_heatmap(tabs["histograms"], tabs["layers"], kind, recommended_scale=2.0**-16)
    assert hm is not None
    assert texts_outside(hm.figure) == []
    labels = [t.get_text() for t in hm.figure.findobj(Text)]
    assert (
        "share of the row's nonzero values (log below 10%, linear above)" in labels
    )  # the colour bar's label
    assert any(lab.startswith("FP8 E5M2") for lab in labels)
    # the heatmap's x label and the side panel's keep apart
    boxes = dict(drawn_texts(hm.figure))
    (x_label,) = [b for t, b in boxes.items() if t.startswith("log2 |value|")]
    (lost_label,) = [b for t, b in boxes.items() if t.startswith("lost in")]
    assert x_label[2] < lost_label[0] or x_label[1] > lost_label[3]
    if case == "peft-names":
        (title,) = [t for t in boxes if "by layer and binade" in t]
        assert "base_model.model.model." in title.replace("…", "")
    if case == "long-names":
        long_rows = [lab for lab in labels if lab.startswith("model.encoder")]
        assert long_rows and all(len(lab) <= plots.ROW_LABEL_MAX and "…" in lab for lab in long_rows)
        assert any("projection" in lab[-20:] for lab in long_rows)  # the name's end is kept


def test_heatmap_margin_is_no_wider_than_its_labels() -> None:
    """Short names leave no wide empty band on the left: the margin follows the widest left-hand text."""
    tabs, _ = synthetic_run("fp16", layers=CASES["short-names"], steps=4, sample_every=1)
    hm = plots.signature_heatmap(tabs["histograms"], tabs["layers"], T.ACTIVATION_GRAD)
    assert hm is not None
    leftmost = min(x0 for _, (x0, _, _, _) in drawn_texts(hm.figure))
    assert plots.MARGIN_PAD_PX - 1 <= leftmost <= plots.MARGIN_PAD_PX + 1


def test_a_fitted_figure_draws_its_texts_without_measuring_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fit_margins`` measures every text; the PNG is drawn on the same canvas, whose renderer keeps those
    measurements: a new canvas for the PNG measured a heatmap's hundreds of texts a second time."""
    from matplotlib.backends.backend_agg import RendererAgg

    measured: list[str] = []
    measure = RendererAgg.get_text_width_height_descent

    def counting(self: RendererAgg, s: str, prop: Any, ismath: Any) -> Any:
        measured.append(s)
        return measure(self, s, prop, ismath)

    monkeypatch.setattr(RendererAgg, "get_text_width_height_descent", counting)
    fig = Figure(figsize=(plots.FIG_WIDTH_IN, 2))
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [3, 1, 2])
    ax.set_ylabel("a label")
    plots.fit_margins(fig)
    assert "a label" in measured
    canvas, n = fig.canvas, len(measured)
    assert plots.png_bytes(fig).startswith(b"\x89PNG")
    assert fig.canvas is canvas and measured[n:] == []


@pytest.mark.parametrize("face", ["white", "none"])
def test_a_figures_png_holds_matplotlibs_pixels(face: str) -> None:
    """``png_bytes`` writes the PNG itself (RGB where every pixel is opaque, at a faster zlib level): the pixels
    are those of matplotlib's own PNG, and a figure that is transparent somewhere keeps its alpha channel."""
    import io

    from PIL import Image

    fig = Figure(figsize=(3, 2), facecolor=face)
    fig.add_subplot().plot([0, 1, 2], [3, 1, 2], label="a line")
    ours = Image.open(io.BytesIO(plots.png_bytes(fig)))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=plots.DPI)
    theirs = Image.open(buf)
    assert ours.mode == ("RGB" if face == "white" else "RGBA")
    assert ours.size == theirs.size and round(ours.info["dpi"][0]) == plots.DPI
    assert np.array_equal(np.asarray(ours.convert("RGBA")), np.asarray(theirs.convert("RGBA")))


def test_row_labels_keep_what_tells_layers_apart() -> None:
    """A peft LoRA model's weight gradients: a plain middle cut made all eight rows
    ``base_model.model.mode….lora_A.default.weight`` (or ``_B``). The labels leave out the prefix all share
    (said once, in the title) and the components every row has, and keep the layer, projection and adapter."""
    names = [
        f"base_model.model.model.layers.{i}.self_attn.{q}_proj.lora_{a}.default.weight"
        for i in (0, 11)
        for q in "qv"
        for a in "AB"
    ]
    labels, under = plots.row_labels(names)
    assert under == "base_model.model.model."
    assert labels[0] == "layers.0…q_proj.lora_A.default.weight"
    assert labels[-1] == "layers.11…v_proj.lora_B.default.weight"
    assert len(set(labels)) == len(names) and all(len(lab) <= plots.ROW_LABEL_MAX for lab in labels)
    # names that fit are kept whole, prefix and all
    assert plots.row_labels(["transformer.h.0.attn.c_attn", "lm_head"]) == (
        ["transformer.h.0.attn.c_attn", "lm_head"],
        "",
    )
    # two names that differ only where a cut would fall stay apart
    a, b = "x." + "a" * 30 + ".mid.y.end", "x." + "a" * 30 + ".mid.z.end"
    labels, _ = plots.row_labels([a, b, "x.q." + "b" * 40 + ".mid.y.end"], limit=30)
    assert len(set(labels)) == 3 and all(len(lab) <= 30 for lab in labels)


def test_a_long_layer_name_keeps_itself_in_its_weight_and_bias_rows() -> None:
    """One layer whose ``name.weight`` is longer than a row label: its rows read ``…weight`` and ``…bias``, as if
    its own name were a component other layers share (its weight and bias were counted as two names). Both rows
    keep the layer's name, cut in its middle, and the parameter; the short names stay whole."""
    layer = "sentiment_classifier_head_projection_layer"
    names = ["embed.weight", "block.weight", "block.bias", f"{layer}.weight", f"{layer}.bias"]
    labels, under = plots.row_labels(names)
    assert under == "" and labels[:3] == names[:3]
    for label, param in zip(labels[3:], ("weight", "bias"), strict=True):
        assert len(label) <= plots.ROW_LABEL_MAX < len(f"{layer}.{param}")
        assert label.startswith(layer[:15]) and label.endswith(f"_layer.{param}") and "…" in label


def test_elide_keeps_start_and_end() -> None:
    assert plots.elide("abc", 5) == "abc"
    assert plots.elide("abcdefghij", 5) == "ab…ij"
    assert len(plots.elide("x" * 200)) == plots.ROW_LABEL_MAX


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_memory_bar_and_table_show_one_total(mode: str) -> None:
    """The measured bar is drawn from the rows the page's table sums (profiler buffers included), even where the
    summary's measured records leave precprof's own buffers out; its number is the table's, character for
    character."""
    tabs, summary = synthetic_run(mode, layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    measured = M.measured_memory(tabs["memory"])
    records = M.memory_records(summary)
    assert T.PROFILER_BUFFERS in measured["components"]
    rec_measured = sum(r["bytes"] for r in records if r["source"] == "measured")
    assert filters.nbytes(rec_measured) != filters.nbytes(measured["total"])  # the two sources differ here
    # the table's total, computed independently from the memory table's last step
    mem = tabs["memory"]
    last = mem[mem[T.STEP] == mem[T.STEP].max()]
    table_total = float(last.loc[~last[T.COMPONENT].isin(S.PEAK_COMPONENTS), T.BYTES].sum())
    assert measured["total"] == table_total

    fig = plots.memory_figure(measured, records, mode)
    assert fig is not None
    assert texts_outside(fig) == []
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    values = [t.get_text().strip() for t in ax.texts]
    assert names[0] == f"{mode} · this run, measured" and names.count(f"{mode} · this run, measured") == 1
    assert values[0] == filters.nbytes(table_total)
    # each projected bar's number is the sum of its records
    for name, value in zip(names[1:], values[1:], strict=True):
        m = name.removesuffix(" · projected")
        want = sum(
            r["bytes"]
            for r in records
            if r["mode"] == m and r["source"] == "projected" and r["component"] not in S.PEAK_COMPONENTS
        )
        assert value == filters.nbytes(want), name
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "profiler buffers (precprof's own)" in legend


def test_the_peak_bar_and_table_show_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """What was allocated at the allocator's peak: its own bar, ending at the peak's tick, and a table of every
    part with its share, "other" last and the cache apart; the parts are never counted as components again."""
    tabs, summary = synthetic_run("bf16", layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    mem = tabs["memory"]
    step = int(mem[T.STEP].max())
    parts = [
        (T.PARAMETERS, "", "float32", 1000),
        (T.OPTIMIZER_STATES, "", "float32", 400),
        (T.ACTIVATIONS, "transformer.h.0.mlp.c_fc", "bfloat16", 3000),
        (T.TEMPORARIES, T.PHASE_BACKWARD, "", 1500),
        (T.OTHER_MEMORY, "", "", 200),
        (T.ALLOCATOR_CACHE, "", "", 700),
    ]
    rows = [
        {
            T.STEP: step,
            T.COMPONENT: c,
            T.MODULE: m,
            T.DTYPE: dt,
            T.BYTES: b,
            T.PHASE: T.PHASE_BACKWARD,
            T.MOMENT: T.MOMENT_PEAK,
        }
        for c, m, dt, b in parts
    ]
    with_peak = T.frame("memory", pd.concat([mem, pd.DataFrame(rows)], ignore_index=True))
    measured = M.measured_memory(with_peak)
    assert measured["components"] == M.measured_memory(mem)["components"]
    check = S.precision_check(tabs["layers"], with_peak, summary)["rows"]
    assert check == S.precision_check(tabs["layers"], mem, summary)["rows"]  # optimizer states counted once
    at = measured["at_peak"]
    assert (at["step"], at["phase"], at["allocated"], at["cache"]) == (step, T.PHASE_BACKWARD, 6100, 700)
    assert [p["part"] for p in at["parts"]] == [
        T.ACTIVATIONS,
        T.TEMPORARIES + ":" + T.PHASE_BACKWARD,
        T.PARAMETERS,
        T.OPTIMIZER_STATES,
        T.OTHER_MEMORY,
    ]
    assert at["named_share"] == pytest.approx(5900 / 6100)

    fig = plots.memory_figure(measured, M.memory_records(summary), "bf16")
    assert fig is not None and texts_outside(fig) == []
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    values = [t.get_text().strip() for t in ax.texts]
    assert names[1] == "bf16 · at the peak (backward)" and values[1] == filters.nbytes(6100)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "temporaries (backward)" in legend and "other (not named)" in legend

    # the page, from this repository's templates (an installed precprof may carry others)
    monkeypatch.setattr(render, "templates_dir", lambda: TEMPLATES)
    page = render.render_html({**tabs, "memory": with_peak}, summary)
    section = page[page.index('<section id="memory"') :]
    section = section[: section.index("</section>")]
    assert "At the allocator's peak" in section
    for label, share in (
        ("activations saved for backward", 3000 / 6100),
        (M.TEMPORARY_LABELS[T.PHASE_BACKWARD], 1500 / 6100),
        ("other (allocated before the step, not named)", 200 / 6100),
    ):
        assert f"<td>{label}</td><td>" in section and filters.pct(share) in section, label
    assert filters.nbytes(6100) in section and filters.nbytes(700) in section


def test_every_figure_is_drawn_for_the_narrow_page() -> None:
    """At 800 px the page's column is 736 px: every figure is drawn at most ``FIG_WIDTH_PX`` wide, so the page
    shows it at its own pixels (a 1,350-px figure was shown at 54%, its text 4-6 px), with no text smaller than
    ``MIN_FONT_PT`` and every text inside the figure."""
    from precprof.report import timeline

    tabs, summary = synthetic_run("fp16", layers=gpt_layers(n_layer=2), steps=8, sample_every=1)
    hist = T.sum_histogram_frame(tabs["histograms"])
    figs = {"training": plots.training_figure(tabs["steps"])}
    tl = timeline.timeline(tabs["layers"])
    assert tl is not None
    figs["timeline"] = timeline.timeline_figure(tl)
    for kind in (T.ACTIVATION_GRAD, T.ACTIVATION, T.WEIGHT_GRAD):
        hm = plots.signature_heatmap(hist, tabs["layers"], kind)
        assert hm is not None
        figs[kind] = hm.figure
    figs["memory"] = plots.memory_figure(M.measured_memory(tabs["memory"]), M.memory_records(summary), "fp16")
    for name, fig in figs.items():
        assert fig is not None
        assert fig.bbox.width <= plots.FIG_WIDTH_PX + 0.5, (name, fig.bbox.width)
        assert texts_outside(fig) == [], name
        sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        assert min(sizes) >= plots.MIN_FONT_PT, (name, min(sizes))


def heat_axes(fig: Figure) -> Any:
    return next(a for a in fig.axes if a.images)


def test_heatmap_draws_the_binades_that_hold_values() -> None:
    """Weights sit in a band of ~15 binades; FP16's window at scale 1 spans 41 and BF16's 262: the heatmap draws
    the band (and an FP16 edge within reach of it), not the empty range around it."""
    tabs, _ = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=4, sample_every=1)
    hist = T.sum_histogram_frame(tabs["histograms"])
    hm = plots.signature_heatmap(hist, tabs["layers"], T.WEIGHT)
    assert hm is not None
    _rows, exps, mat = S.heatmap_matrix(hist, tabs["layers"], T.WEIGHT)
    held = exps[(mat > 0).any(axis=0)]
    x0, x1 = hm.x_range
    assert heat_axes(hm.figure).get_xlim() == (x0, x1)
    assert x0 <= held.min() and x1 >= held.max() + 1  # every value drawn
    reach = 2 + 2 * 3  # a binade each side, and an FP16 edge up to 3 binades beyond
    assert (x1 - x0) <= (held.max() + 1 - held.min()) + reach, (x0, x1, held.min(), held.max())
    fp16 = hm.windows[0]
    assert x1 - x0 < 0.8 * (fp16.hi - fp16.lo)  # the old range held FP16's whole window, and more


def test_heatmap_colours_tell_26_from_84_percent() -> None:
    """A row with a quarter of its values in one binade and one with five sixths: two colours, as far apart on
    the colour map as 0.1% and 10% (a log scale to 100% drew them nearly alike, both near its top)."""
    tabs, _ = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=4, sample_every=1)
    hm = plots.signature_heatmap(T.sum_histogram_frame(tabs["histograms"]), tabs["layers"], T.ACTIVATION_GRAD)
    assert hm is not None
    im = heat_axes(hm.figure).images[0]
    u26, u84 = float(im.norm(0.26)), float(im.norm(0.84))
    assert u84 - u26 >= 0.2
    assert u84 - u26 >= 0.8 * (float(im.norm(0.1)) - float(im.norm(0.001)))

    def luminance(rgba: tuple[float, ...]) -> float:
        r, g, b = rgba[:3]
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    assert luminance(im.cmap(u26)) - luminance(im.cmap(u84)) >= 0.2
    # the tails stay visible: one value in a million is coloured, below the linear half
    assert 0 <= float(im.norm(1e-6)) < float(im.norm(1e-3)) < float(im.norm(0.1)) <= 0.6 + 1e-9


def test_an_fp8_run_chooses_its_heatmap_rows_by_what_fp8_loses() -> None:
    """Too many rows for one heatmap: an FP8 run keeps those that lose the most in FP8 under current scaling
    (E5M2 for gradients), not in FP16; the caption says which rows are shown and why."""
    tabs, summary = synthetic_run("bf16", layers=gpt_layers(n_layer=4), steps=4, sample_every=2)
    hist, layers = T.sum_histogram_frame(tabs["histograms"]), tabs["layers"]
    kind, keep = T.ACTIVATION_GRAD, 10
    rows = S.row_order(layers, kind)
    assert len(rows) > keep

    def badness(lost: dict) -> dict[tuple[str, str], float]:
        return {r: sum(v for v in lost.get(r, ()) if v == v) for r in rows}

    fp8 = badness(S.lost_share_by_row(layers, kind, "fp8_e5m2", current_scaling=True))
    fp16 = badness(S.lost_share_by_row(layers, kind, "fp16"))
    assert fp8 != fp16  # the two formats lose in different rows here
    hm = plots.signature_heatmap(hist, layers, kind, max_rows=keep, focus="fp8")
    assert hm is not None and hm.focus_label == "FP8 E5M2, current scaling"
    check_rows_chosen(rows, fp8, keep, hm.rows)
    hm16 = plots.signature_heatmap(hist, layers, kind, max_rows=keep)  # an FP16 run, as before
    check_rows_chosen(rows, fp16, keep, hm16.rows)
    assert hm.rows != hm16.rows
    summary = {**summary, T.SUMMARY_CONFIG: {**summary.get(T.SUMMARY_CONFIG, {}), "precision": "fp8"}}
    page = render.render_html(tabs, summary)
    caption = page.split('id="signature-activation_grad"', 1)[1].split("</figcaption>", 1)[0]
    assert "lost in FP8 E5M2, current scaling (this run trained in FP8)" in caption


@pytest.mark.parametrize("n_steps", [12, 3_000, 250_000])
def test_the_training_plots_tick_labels_never_run_together(n_steps: int) -> None:
    """The loss scale and gradient norm plots, a third of the narrow page each, had ten step ticks: at 3,000
    steps their labels ran into one another ("0 400 800 1200160020002400 2800"). Every axis of the training
    figure keeps its tick labels apart, from a dozen steps to a quarter of a million."""
    step = np.arange(n_steps)
    steps = pd.DataFrame(
        {
            T.STEP: step,
            T.LOSS: 5.0 / np.sqrt(step + 1.0),
            T.LOSS_SCALE: 2.0 ** (16 + (step > n_steps // 2)),
            T.GRAD_NORM: 1.0 + 0.5 / np.sqrt(step + 1.0),
            T.SKIPPED: step == n_steps // 3,
            T.RESUMED: False,
        }
    )
    fig = plots.training_figure(steps)
    assert fig is not None
    assert overlapping_tick_labels(fig) == []
    assert texts_outside(fig) == []


@pytest.mark.parametrize("n_steps", [1, 2])
def test_a_run_of_one_or_two_steps_has_whole_step_ticks(n_steps: int) -> None:
    """A run of one step: the loss plot's step axis read -0.45 … 0.45, the loss scale's and gradient norm's
    -0.5 … 0.5. Every step axis of the training figure ticks whole steps only, each step of the run among them."""
    step = np.arange(n_steps)
    steps = pd.DataFrame(
        {
            T.STEP: step,
            T.LOSS: 1.25 - 0.1 * step,
            T.LOSS_SCALE: 2.0**16,
            T.GRAD_NORM: 1.0 + step,
            T.SKIPPED: False,
            T.RESUMED: False,
        }
    )
    fig = plots.training_figure(steps)
    assert fig is not None
    FigureCanvasAgg(fig).draw()
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert all(t == round(t) for t in ticks), ticks
        assert set(step.tolist()) <= {round(t) for t in ticks}
        labels = [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]
        assert set(labels) >= {str(s) for s in step}, labels


def test_a_one_step_runs_plots_mark_each_value_and_tick_their_axes_at_it_alone() -> None:
    """A run of one step: its loss, a lone dot, sat between ticks 1.20, 1.25 and 1.30 (read like a curve), its
    gradient norm likewise, and its fp16 loss scale, drawn as steps, showed nothing at all between 2^15 and 2^17.
    Each plot marks its one value and ticks its value axis at that value alone, the tick reading it; a run of two
    steps keeps its axes as they were, a range of ticks for values that change."""
    loss, scale, norm = 1.25, 2.0**16, 0.3307

    def run(n: int) -> pd.DataFrame:
        step = np.arange(n)
        return pd.DataFrame(
            {
                T.STEP: step,
                T.LOSS: loss - 0.1 * step,
                T.LOSS_SCALE: scale,
                T.GRAD_NORM: norm + step,
                T.SKIPPED: False,
                T.RESUMED: False,
            }
        )

    fig = plots.training_figure(run(1))
    assert fig is not None
    FigureCanvasAgg(fig).draw()
    # the loss scale's axis is in log2: 2^16 sits at 16 and reads as a power of two
    for ax, at, text in zip(fig.axes, (loss, 16.0, norm), ("1.25", "$2^{16}$", "0.3307"), strict=True):
        lo, hi = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
        assert ticks == [at], (ax.get_title(), ticks)
        assert [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi] == [text]
        marked = [
            ln for ln in ax.get_lines() if ln.get_marker() not in ("None", "", None) and ln.get_visible()
        ]
        assert any(list(ln.get_xdata()) == [0] and list(ln.get_ydata()) == [at] for ln in marked), (
            ax.get_title()
        )
    fig = plots.training_figure(run(2))
    assert fig is not None
    FigureCanvasAgg(fig).draw()
    loss_ax, _, norm_ax = fig.axes
    for ax in (loss_ax, norm_ax):
        lo, hi = ax.get_ylim()
        assert len([t for t in ax.get_yticks() if lo <= t <= hi]) > 2


def test_the_timeline_tick_labels_never_run_together() -> None:
    """The per-step strip of values lost, over a long run's sampled steps."""
    from precprof.report import timeline

    tabs, _ = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=3_000, sample_every=30)
    tl = timeline.timeline(tabs["layers"])
    assert tl is not None
    assert overlapping_tick_labels(timeline.timeline_figure(tl)) == []


def test_the_timeline_colour_bar_reads_100_percent_not_a_power_of_ten() -> None:
    """A diverged run lost every value from step 6 on: the colour bar's top tick read "1e+02%"."""
    from precprof.report import timeline

    share = np.array([[1e-6, 1e-3, 1.0], [0.0, 0.01, 1.0]])  # shares lost: the last step lost everything
    tl = timeline.Timeline(
        kinds=[T.ACTIVATION, T.WEIGHT_GRAD],
        starts=np.arange(3),
        ends=np.arange(3),
        share=share,
        exact={},
        n_steps=3,
        window=1,
    )
    fig = timeline.timeline_figure(tl)
    fig.canvas.draw()
    bar = fig.axes[1]
    lo, hi = bar.get_ylim()
    ticks = [
        t.get_text() for t, v in zip(bar.get_yticklabels(), bar.get_yticks(), strict=True) if lo <= v <= hi
    ]
    assert ticks[-2:] == ["1%", "100%"] and not any("e+" in t for t in ticks), ticks


def test_names_the_font_cannot_draw_are_escaped_and_warn_nothing() -> None:
    """A module named in CJK or with an emoji: matplotlib printed multi-line "Glyph 23618 missing from font(s)"
    warnings during train and report, and drew each such character as an empty box. Each character the font has
    no glyph for is drawn as its code point, those in a row in one bracket (Python's escapes, "\\u5c42", read as
    part of the name, h76), no glyph warning reaches the caller, and its warning filters are left as they were."""
    import warnings

    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    chars = set(FT2Font(font_manager.findfont(font_manager.FontProperties())).get_charmap())
    if ord("层") in chars:
        pytest.skip("the default font draws CJK here")
    layers = renamed({4: "blocks.层_\U0001f525.attn", 5: "blocks.ünï_λ", 6: "日本語_🚀_слой"})
    tabs, _ = synthetic_run("bf16", layers=layers, steps=2, sample_every=1)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = plots.signature_heatmap(tabs["histograms"], tabs["layers"], T.ACTIVATION)
        assert hm is not None
        plots.png_bytes(hm.figure)
        raw = Figure()
        raw.add_subplot().set_title("层 \U0001f525")  # a text that did not go through the plots' escaping
        plots.png_bytes(raw)
    assert warnings.filters == before
    assert [str(w.message) for w in caught if "Glyph" in str(w.message)] == []
    texts = [t for t, _ in drawn_texts(hm.figure)]
    assert all(ord(c) in chars for t in texts for c in t)  # every character drawn has its glyph
    assert "blocks.[U+5C42]_[U+1F525].attn" in texts and "blocks.ünï_λ" in texts  # what the font has, kept
    assert "[U+65E5 U+672C U+8A9E]_[U+1F680]_слой" in texts


def test_tied_rows_are_kept_or_left_out_by_whole_layers() -> None:
    """Sixty layers that lose nothing, two rows each (weight, bias), 90 rows drawn at most: the spread kept
    ``layers.4.bias`` without its weight and marked a gap between nearly every two rows. Whole layers are kept,
    taken evenly from end to end, and the rows stay within the limit."""
    from precprof.report.plots.heatmap import _select_rows

    rows = [(f"layers.{i}", p) for i in range(60) for p in ("weight", "bias")]
    sel = _select_rows(rows, {}, 90)
    kept = [rows[i] for i in sel.index]
    assert len(sel.index) <= 90
    inner = {m for m, _ in kept[1:-1]}
    assert all((m, "weight") in kept and (m, "bias") in kept for m in inner)
    layers = sorted(int(m.split(".")[1]) for m in inner)
    assert layers[0] <= 2 and layers[-1] >= 57  # from end to end
    assert len(sel.gaps()) < 30


def test_the_largest_saved_activations_say_what_they_are_the_top_of_and_list_ties_in_forward_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tiny real run of 16 blocks whose layers save the same bytes each: the table showed 10 of 48 tied
    modules in no order, and not that they were the top 10 of 484 (h104). It lists them largest first, ties in
    forward order (not by name), and says of how many modules, and how many ties were
    left out, counted from the run's own memory table."""
    import torch
    from torch import nn

    import precprof

    torch.manual_seed(0)
    # named against forward order: x31 runs first, x0 last (by name or number, x0 would lead)
    blocks = [m for _ in range(16) for m in (nn.Linear(8, 8), nn.Tanh())]
    model = nn.Sequential(OrderedDict((f"x{31 - i}", m) for i, m in enumerate(blocks)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with precprof.Profiler(model, opt, sample_every=1) as prof:
        for _ in range(1):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    tabs, summary = prof.tables(), prof.run_summary()
    mem = T.memory_at(tabs["memory"])
    acts = mem[(mem[T.STEP] == mem[T.STEP].max()) & (mem[T.COMPONENT] == T.ACTIVATIONS)]
    per = acts.groupby(T.MODULE)[T.BYTES].sum()
    per = per[per > 0]
    order = S.forward_order(tabs["layers"], T.shared_params(summary))
    measured = M.measured_memory(tabs["memory"], order)
    top = measured["top_activations"]
    assert len(top) == M.TOP_ACTIVATIONS and len(per) > M.TOP_ACTIVATIONS
    assert [b for _, b in top] == sorted(per.to_numpy(dtype=float), reverse=True)[: M.TOP_ACTIVATIONS]
    last = top[-1][1]
    tied = [m for m in order if per.get(m) == last]  # in forward order
    shown = [m for m, b in top if b == last]
    assert shown == tied[: len(shown)] and len(tied) > len(shown), (shown, tied)
    assert shown == sorted(shown, key=lambda m: -int(m[1:])), shown
    note = (
        f"The 10 that saved the most of the {len(per)} modules (and memory scopes) that saved any, largest first; "
        f"{len(tied) - len(shown)} more saved {filters.nbytes(last)} each, as the last {len(shown)} shown did, "
        "and are left out (ties are listed in forward order)."
    )
    assert measured["top_activations_note"] == note
    # the page's memory section, from this repository's templates, with the table in that order and the note
    # below it: the report's own ordering (context._memory, whose table it is)
    monkeypatch.setattr(render, "templates_dir", lambda: TEMPLATES)
    memory = report_context._memory(tabs, summary)
    assert memory["measured"]["top_activations"] == top
    page = (
        render.environment()
        .get_template("_memory.html.j2")
        .render(memory=memory, section={"id": "memory", "number": 6, "heading": "Memory"})
    )
    section = page[page.index("<h3>Largest saved activations</h3>") :]
    section = section[: section.index("</div>")]
    assert [m.replace("<wbr>", "") for m in re.findall(r"<code>(.*?)</code>", section)] == [m for m, _ in top]
    assert f'<p class="what" id="memory-top-activations">{note}</p>' in section
