"""The HTML report: sections, numbers from the tables, escaping, figures, re-rendering a run directory.

Real gpt-nano runs (3 steps, every step sampled) in fp32, bf16 and fp16 are rendered by the training loop
itself; the rest uses synthetic tables (tests/report_fixtures.py) where a scenario is hard to get from a
3-step run (skipped steps, nan, many layers).
"""

from __future__ import annotations

import base64
import io
import itertools
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch
from figure_checks import check_rows_chosen
from markupsafe import escape
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import same_color
from PIL import Image
from report_fixtures import LayerSpec, gpt_layers, real_run, recommendation_dict, synthetic_run
from torch import nn

import precprof
from precprof import formats, pipeline
from precprof import tables as T
from precprof.analysis.advisor.rules import block_losses
from precprof.errors import UserError
from precprof.report import (
    blocks,
    environment,
    filters,
    plots,
    render,
    render_html,
    render_report,
    render_run_dir,
    templates_dir,
    timeline,
)
from precprof.report import memory_summary as M
from precprof.report import numbers as report_numbers
from precprof.report import summarize as S
from precprof.report.context import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
IMG_RE = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def esc(text: str) -> str:
    """Text as jinja's autoescape writes it."""
    return str(escape(text))


def section(page: str, sid: str) -> str:
    """The HTML of one section of the page, without the <wbr> line-break hints inside module names."""
    start = page.index(f'<section id="{sid}">')
    return page[start : page.index("</section>", start)].replace("<wbr>", "")


def decoded_images(page: str) -> list[Image.Image]:
    out = []
    for b64 in IMG_RE.findall(page):
        im = Image.open(io.BytesIO(base64.b64decode(b64)))
        im.load()  # raises on a truncated or corrupt PNG
        out.append(im)
    return out


# ----------------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="session")
def runs_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "report-runs"


@pytest.fixture(scope="module", params=["fp32", "bf16", "fp16"])
def run(request: pytest.FixtureRequest, runs_base: Path) -> Path:
    return real_run(request.param, runs_base)


def test_real_run_report_has_every_section_in_order(run: Path) -> None:
    page = (run / T.REPORT_FILE).read_text()
    positions = [page.index(f'<section id="{s.id}">') for s in SECTIONS]
    for s in SECTIONS:  # numbered as listed, in the navigation and in the headings
        assert (
            f'<a href="#{s.id}">{s.number}. {s.name}</a>' in page
            and f"<h2>{s.number}. {s.heading}</h2>" in page
        )
    assert positions == sorted(positions)
    # training, the time axis over sampled steps, three signature heatmaps, memory: inline PNGs that decode
    images = decoded_images(page)
    assert len(images) == 6
    # drawn for the page's narrowest column, shown there at their own pixels
    assert all(im.format == "PNG" and im.width == plots.FIG_WIDTH_PX and im.height >= 250 for im in images)
    assert page.count("<img ") == 6


def test_real_run_report_shows_recommendation_and_numbers_from_the_tables(run: Path) -> None:
    page = (run / T.REPORT_FILE).read_text()
    summary = T.read_summary(run)
    tabs = T.read_tables(run)
    rec = summary[T.SUMMARY_RECOMMENDATION]
    verdict = section(page, "verdict")
    label = formats.label(rec["format"])
    assert f'class="fmt fmt-{rec["format"]}">{label}</div>' in verdict
    for reason in rec["reasons"]:
        assert esc(reason) in verdict
    for f in rec["findings"]:
        assert esc(f["title"]) in verdict
        assert esc(f["remedy"]) in verdict
    if rec["fp16_loss_scale"]:
        assert filters.pow2(rec["fp16_loss_scale"]) in verdict

    # headline: the last loss of the steps table
    steps = tabs["steps"]
    assert f'<span class="v">{filters.num(steps[T.LOSS].iloc[-1], 4)}</span>' in page
    # per-layer table: every module, and the largest activation magnitude of the first matmul layer
    layers = tabs["layers"]
    per_layer = section(page, "layers")
    for m in layers[T.MODULE].unique():
        assert f"<code>{esc(m or S.ROOT_LABEL)}</code>" in per_layer
    fc = layers[(layers[T.MODULE] == "transformer.h.0.mlp.c_fc") & (layers[T.TENSOR] == T.ACTIVATION)]
    assert filters.log2mag(fc[T.ABSMAX].max()) in per_layer
    # what-if table: the e4m3 underflow share of that layer's activations, summed over the sampled steps
    share = fc[T.underflow_col("fp8_e4m3")].sum() / fc[T.NUMEL].sum()
    row = re.search(
        r"<tr(?: class=\"extra\")?><td class=\"mod\"[^>]*><code>transformer\.h\.0\.mlp\.c_fc</code></td><td[^>]*>[^<]*</td><td[^>]*>activations</td>(.*?)</tr>",
        section(page, "whatif"),
    )
    assert row is not None and f">{filters.pct(share)}</td>" in row.group(1)
    # memory: the measured total of the memory table
    measured = M.measured_memory(tabs["memory"])
    assert filters.nbytes(measured["total"]) in section(page, "memory")
    # environment: the command line the run was started with
    assert "gpt-nano" in section(page, "environment")


def test_real_run_precision_check_matches_the_mode(run: Path) -> None:
    page = (run / T.REPORT_FILE).read_text()
    precision = T.read_summary(run)[T.SUMMARY_CONFIG]["precision"]
    check = section(page, "verification")
    if precision == "fp32":
        assert "Full precision" in check and "float16" not in check
    else:
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[precision]
        assert "Mixed precision is active" in check and f'dt-{dtype}">{dtype}</span>' in check
        assert 'class="banner notactive"' not in page
    if precision == "fp16":
        # gradients were recorded at GradScaler's initial scale, and the what-if table says so
        assert "65,536 (2^16)" in section(page, "whatif")
        assert "FP16 window is drawn at the loss scale of the last sampled step, 65,536 (2^16)" in page


def test_crashed_run_renders_marked_incomplete_with_its_cause(tmp_path: Path) -> None:
    from precprof.training import Callback, TrainConfig, TrainRun, train

    class Boom(Callback):
        def on_step_end(self, run: TrainRun) -> None:
            if run.step == 1:
                raise RuntimeError("injected failure at step 1")

    out = tmp_path / "crash"
    torch.manual_seed(0)
    cfg = TrainConfig(
        model="gpt-nano",
        precision="bf16",
        steps=4,
        batch_size=2,
        seq_len=16,
        sample_every=1,
        progress=False,
        out=out,
        report=False,  # the page read is render_run_dir's below (the crash's own render was never read)
    )
    with pytest.raises(RuntimeError, match="injected"):
        train(cfg, callbacks=[Boom()])
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    steps = T.read_tables(out)["steps"]
    assert list(steps[T.STEP]) == [0, 1]  # both steps before the crash, intact
    page = render_run_dir(out).read_text()
    banner = page[page.index('id="incomplete"') : page.index("</div>", page.index('id="incomplete"'))]
    assert "Incomplete run" in banner and "injected failure at step 1" in banner
    assert len(decoded_images(page)) == 6


# ------------------------------------------------------------------------------------------ escaping
EVIL = "<script>alert(1)</script>"


class EvilNet(nn.Module):
    """A user's model with a child module named like an XSS payload (nn.Module allows it: no dots)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.add_module(EVIL, nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, EVIL)(torch.relu(self.inp(x)))


def _two_steps(model: nn.Module) -> precprof.Profiler:
    """Two sampled SGD steps of a model of 8 features in, profiled."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
    with prof:
        for _ in range(2):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    return prof


def test_module_names_and_config_are_escaped(tmp_path: Path) -> None:
    torch.manual_seed(0)
    prof = _two_steps(EvilNet())
    summary = {T.SUMMARY_CONFIG: {"command_line": 'train.py --name "<img src=x onerror=alert(2)>"'}}
    path = prof.report(tmp_path / "run" / "report.html", summary=summary)
    page = path.read_text()
    assert EVIL not in page and "<img src=x" not in page
    escaped = str(escape(EVIL))
    assert f"<code>{escaped}</code>" in section(page, "layers")
    assert "&lt;img src=x onerror=alert(2)&gt;" in section(page, "environment")
    # the page's own scripts: the head's line that marks the page as scripted, and the small sorting script
    assert page.count("<script>") == 2
    # the layer's statistics are there under its escaped name: 2 sampled steps x 4 values per row
    assert escaped in section(page, "whatif")


class _Times(nn.Module):
    """``x * c``: a module without parameters, so that its output's row is the first to hold tiny values."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.c


def test_an_nn_sequentials_numbered_modules_read_as_names_on_the_page(tmp_path: Path) -> None:
    """An nn.Sequential's children are named "0", "2": the findings' prose quoted them, the page did not: the
    heatmap's caption read "The first row that loses anything in FP16, 2, is drawn" and a finding's numbers
    "that module 1" beside its counts. Every place the page writes a module's name into prose, or among numbers,
    quotes a name of numbers alone, as the findings do; the per-layer tables, where a name is code, keep it bare."""
    torch.manual_seed(0)
    # what the layers after "2" compute falls below FP16's subnormals, and so do the gradients before it
    model = nn.Sequential(
        nn.Linear(8, 8),
        nn.Linear(8, 8),
        _Times(2.0**-40),
        nn.Linear(8, 8, bias=False),
        nn.Linear(8, 4, bias=False),
    )
    prof = _two_steps(model)
    page = prof.report(tmp_path / "run" / "report.html").read_text()
    # the finding's numbers: the module whose gradient norm fp16 loses most, among shares and counts
    findings = section(page, "verdict")
    assert '<span class="k">that module</span> &#34;0&#34;</li>' in findings
    assert "&#34;2&#34;&#39;s output gradient" in findings  # (the findings' prose, as it was)
    assert "<code>2</code>" in section(page, "layers")  # a table's name is code: as it is
    # the heatmap's caption, with fewer rows drawn than the model has
    tables = prof.tables()
    hm = plots.signature_heatmap(
        T.sum_histogram_frame(tables["histograms"]), tables["layers"], T.ACTIVATION, max_rows=4
    )
    assert hm is not None
    assert 'The first row that loses anything in FP16, "2", is drawn' in hm.rows_note(), hm.rows_note()


def test_a_kind_without_histograms_leaves_the_next_captions_reason_alone(tmp_path: Path) -> None:
    """A run whose loss is nan from its first step has no finite activation gradient to histogram: that heatmap is
    missing, and the captions of the heatmaps after it still say why their side panel shows FP16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(2):
            loss = model(torch.randn(4, 8)).square().mean() * float("nan")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    page = prof.report(tmp_path / "run" / "report.html").read_text()
    sig = section(page, "signature")
    assert "No activation-gradient value recorded was finite and nonzero" in sig  # (no heatmap)
    captions = re.findall(r"The right panel: the share of each row lost in ([^<]*?)\.(?: |<)", sig)
    assert captions, "no heatmap caption"
    assert all(c == "FP16 (FP16 has the narrowest range of the formats a run can train in)" for c in captions)


@pytest.mark.parametrize("how", ["zero", "nan"])
def test_a_gradient_kind_recorded_without_a_finite_nonzero_value_says_what_was_recorded(
    tmp_path: Path, how: str
) -> None:
    """Every gradient of an fp16 model flushed to zero (its loss weighted by 1e-12), or NaN from a NaN loss: the
    gradients were recorded, but their heatmaps have no magnitude to draw, and the page said "No histograms of
    activation gradients were recorded" beside findings that every value was zero. It says what was recorded:
    the counts a tensor hook of the test's own reads from the real gradients, each layer's output's and each
    parameter's, over the sampled steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    if how == "zero":
        model = model.half()
    seen = {T.ACTIVATION_GRAD: [0, 0, 0, 0], T.WEIGHT_GRAD: [0, 0, 0, 0]}  # values, zero, NaN, inf

    def count(kind: str, g: torch.Tensor) -> None:
        for i, n in enumerate((g.numel(), (g == 0).sum(), g.isnan().sum(), g.isinf().sum())):
            seen[kind][i] += int(n)

    def watch(mod: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: count(T.ACTIVATION_GRAD, g))

    for mod in model:
        mod.register_forward_hook(watch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = 3
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(steps):
            out = model(torch.randn(4, 16).to(next(model.parameters()).dtype)).float().mean()
            loss = out * (1e-12 if how == "zero" else float("nan"))
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None
                count(T.WEIGHT_GRAD, p.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    sig = section(prof.report(tmp_path / "run" / "report.html").read_text(), "signature")
    assert "No histograms" not in sig
    for kind, word, layers in (
        ("activation-gradient", T.ACTIVATION_GRAD, 3),
        ("weight-gradient", T.WEIGHT_GRAD, 2),
    ):
        n, zeros, nans, infs = seen[word]
        assert infs == 0 and zeros + nans == n
        where = f"{n:,} values over {steps} sampled step(s), from {layers} layer(s)"
        if how == "zero":
            assert zeros == n
            assert f"Every {kind} value recorded was an exact zero: {where}." in sig
        else:
            told = f"{zeros:,} were zero and {nans:,} NaN" if zeros else f"{nans:,} were NaN"
            assert f"No {kind} value recorded was finite and nonzero: of {where}, {told}." in sig


# ----------------------------------------------------------------------------------- synthetic runs
@pytest.fixture(scope="module")
def synthetic() -> tuple[dict[str, pd.DataFrame], dict]:
    return synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=12, sample_every=2, seed=1)


@pytest.fixture(scope="module")
def synthetic_page(synthetic: tuple[dict[str, pd.DataFrame], dict]) -> str:
    tabs, summary = synthetic
    return render_html(tabs, summary, recommendation_dict())


def test_the_page_draws_its_texts_unhinted_whatever_the_users_setting_and_leaves_that_setting(
    synthetic: tuple[dict[str, pd.DataFrame], dict], synthetic_page: str
) -> None:
    """The page's figures are drawn with FreeType's hinting off (a fifth of a page's time was the hinter): under
    the user's "force_autohint" they are the bytes drawn under Matplotlib's default setting, and the user's
    setting is theirs again after, also when the page failed."""
    tabs, summary = synthetic
    assert matplotlib.rcParams["text.hinting"] != "force_autohint"  # Matplotlib's default drew synthetic_page
    with matplotlib.rc_context({"text.hinting": "force_autohint"}):
        page = render_html(tabs, summary, recommendation_dict())
        assert matplotlib.rcParams["text.hinting"] == "force_autohint"
        with pytest.raises(AttributeError):  # a page that failed while drawing
            render_html({**tabs, "histograms": 3}, summary)
        assert matplotlib.rcParams["text.hinting"] == "force_autohint"
    assert IMG_RE.findall(page) == IMG_RE.findall(synthetic_page) != []


def test_findings_most_severe_first_with_numbers_and_remedies(synthetic_page: str) -> None:
    verdict = section(synthetic_page, "verdict")
    pos = [verdict.index(f'class="finding sev-{s}"') for s in ("critical", "warning", "info")]
    assert pos == sorted(pos)
    assert "largest magnitude</span> 524,288 (2^19)" in verdict
    assert "values that overflow</span> 1,200" in verdict
    assert "lost in FP16 without loss scaling</span> 41.3%" in verdict
    assert "this run&#39;s loss scale</span> 1 (2^0)" in verdict
    assert "share_at_run_scale" not in verdict and "share at run scale" not in verdict  # repeats: not shown
    # how a finding is judged, folded under its message (escaped: it is text), and only where it has one
    assert verdict.count('<details class="method">') == 1
    assert (
        '<details class="method"><summary>How this is judged</summary><p>A value underflows when |x| * scale '
        "&lt; 2^-25 (FP16&#39;s smallest subnormal, halved).</p></details>" in verdict
    )
    assert "init_scale = 32,768 (2^15)" in verdict and "growth_interval = 2,000" in verdict
    for m in recommendation_dict()["keep_fp32"]:
        assert f"<li><code>{m}</code></li>" in verdict


def test_a_findings_module_list_counts_modules_as_its_title_does(
    synthetic: tuple[dict[str, pd.DataFrame], dict],
) -> None:
    """A finding's list holds a layer's own input row ("blocks.3.fc:input") beside the layer: the title counts
    them as one module ("Activations overflow fp16 in 164 module(s)") where the list said "246 modules". The list
    counts modules the same way and says how many rows it holds; a list of modules alone reads as before."""
    tabs, summary = synthetic
    rec = recommendation_dict()
    layers = [f"blocks.{i}.fc" for i in range(10)]
    rows = [m for i, m in enumerate(layers) for m in ((f"{m}:input", m) if i % 2 else (m,))]  # 15 rows
    short = ["a.fc:input", "a.fc", "b.fc"]
    alone = [f"c.{i}" for i in range(14)]
    rec["findings"] = [
        {**rec["findings"][0], "code": code, "modules": mods}
        for code, mods in (("many", rows), ("short", short), ("alone", alone))
    ]
    page = section(render_html(tabs, summary, rec), "verdict")
    lists = re.findall(r'<div class="fmods">modules: (.*?)</div>', page, re.S)
    n = len({m.removesuffix(":input") for m in rows})
    assert (n, len(rows)) == (10, 15)
    assert lists[0].startswith(
        f'<details class="modlist"><summary>{n} modules in {len(rows)} rows (a layer&#39;s input row counted '
        "with the layer): "
    )
    assert lists[1].startswith("2 modules in 3 rows (a layer&#39;s input row counted with the layer): <code>")
    assert lists[2].startswith(f'<details class="modlist"><summary>{len(alone)} modules: <code>c.0</code>')


def test_a_per_layer_row_is_its_values_not_their_labels() -> None:
    """The tables of a row per layer name their columns once, in a style element the stacked layout reads, not
    in each cell: a what-if row was 1,040 bytes with a label per cell (an MoE of 8,227 modules made a 39 MB
    page). Past the first rows, their rows come marked for the "Show all" button, so that a browser never lays
    out thousands of rows before the page's script hides them (that MoE's page opened in 49 s, now in 4 s)."""
    tabs, summary = synthetic_run("fp16", layers=gpt_layers(n_layer=3), steps=2, sample_every=1)
    page = render_html(tabs, summary, recommendation_dict())
    for tid in ("whatif-table", "layer-table"):
        before, table = page.split(f'id="{tid}"', 1)
        head, body = table.split("</tbody>", 1)[0].split("<tbody>", 1)
        rows = re.findall(r"<tr[^>]*>.*?</tr>", body, re.S)
        assert len(rows) > render.FIRST_ROWS and "data-label" not in body
        assert len(body.encode()) / len(rows) < 700, tid
        marked = [re.match(r'<tr(?: class="([^"]*)")?>', r).group(1) or "" for r in rows]  # type: ignore[union-attr]
        assert ["extra" in c.split() for c in marked] == [i >= render.FIRST_ROWS for i in range(len(rows))]
        style = before.rsplit("<style>", 1)[1].split("</style>", 1)[0]
        assert style.count(f"#{tid} > tbody > tr > :nth-child(") == len(re.findall(r"<th[ >]", head))


class _Routed(nn.Module):
    """A norm, three experts with a fixed routing (step 0: expert 0; step 1: expert 2; expert 1 never), and a
    head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts[2 * self.step](self.norm(x)))


def test_a_module_skipped_on_a_step_keeps_its_place_in_forward_order(tmp_path: Path) -> None:
    """An MoE's per-layer table began with experts deep in its second layer, its embedding at row 4,527: a
    module that does not run on a step (an expert no token went to) writes order -1 in that step's rows (its
    weights, and the update AdamW still makes), and the smallest order of any step put it first. The order is
    now each module's smallest over the steps it ran in, as the test's own hooks see the calls: per step, the
    modules in the order of their first call, ties to the one called first in the run; a module that never ran
    comes last."""
    model = _Routed()
    seen: list[list[str]] = []
    for name, m in model.named_modules():
        if name:
            m.register_forward_pre_hook(
                lambda mod, args, name=name: None if name in seen[-1] else seen[-1].append(name)
            )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # weight decay moves every weight, run or not
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(2):
            model.step = step
            seen.append([])
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    layers = prof.tables()["layers"]
    assert (layers.loc[layers[T.MODULE] == "experts.1", T.ORDER] == -1).all()  # rows of a module not run
    calls = [(s.index(m), step, m) for step, s in enumerate(seen) for m in s]
    expected = list(dict.fromkeys(m for _, _, m in sorted(calls)))  # each at its smallest (index, step)
    assert expected == ["norm", "experts.0", "experts.2", "head"]
    assert S.forward_order(layers) == [*expected, "experts.1"]
    page = render_report(prof.tables(), {}, tmp_path / "report.html").read_text()
    table = page.split('id="layer-table"', 1)[1].split("</table>", 1)[0]
    names = [re.sub("<[^>]+>", "", c) for c in re.findall(r'<td class="mod"><code>(.*?)</code>', table)]
    assert names == [*expected, "experts.1"]


def test_forward_order_merges_the_steps_that_ran_other_modules() -> None:
    """Step 0 runs expert 0, step 1 experts 1 and 2: the smallest order over steps tied expert 2 with the head
    (2 each) and put the head first, as the step that ran it came first. Merged step by step, a module first
    run on a step goes just before the next module of that step already placed: the head stays last. Rows
    of order -1 (a module a step did not run) do not count; a module that never ran comes last."""
    calls = {0: ["a", "e0", "head"], 1: ["a", "e1", "e2", "head"]}
    rows = [(s, i, m) for s, seq in calls.items() for i, m in enumerate(seq)]
    rows += [(0, -1, "e1"), (0, -1, "e2"), (1, -1, "e0"), (0, -1, "e3"), (1, -1, "e3")]
    layers = pd.DataFrame(rows, columns=[T.STEP, T.ORDER, T.MODULE])
    assert S.forward_order(layers) == ["a", "e0", "e1", "e2", "head", "e3"]
    order = T.module_order(layers)
    assert order.drop("e3").tolist() == [0, 1, 4, 2, 3] and np.isnan(order["e3"])


class _SharedEmbedding(nn.Module):
    """T5's layout: ``shared`` owns the embedding and never runs; the encoder's and decoder's ``embed_tokens``
    read its weight (the same Parameter), which the capture records under ``shared``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(16, 8)
        self.encoder = nn.ModuleDict({"embed_tokens": nn.Embedding(16, 8), "ln": nn.LayerNorm(8)})
        self.decoder = nn.ModuleDict({"embed_tokens": nn.Embedding(16, 8), "head": nn.Linear(8, 16)})
        self.encoder["embed_tokens"].weight = self.shared.weight
        self.decoder["embed_tokens"].weight = self.shared.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        enc = self.encoder["ln"](self.encoder["embed_tokens"](idx))
        return self.decoder["head"](self.decoder["embed_tokens"](idx) + enc.mean(1, keepdim=True))


def test_a_weight_owner_that_never_runs_takes_its_first_users_place(tmp_path: Path) -> None:
    """T5's ``shared`` embedding never runs (``encoder.embed_tokens`` reads its weight, recorded under
    ``shared``): with forward order taken over the steps a module ran, it came last, and a finding on nan
    weights named a LayerNorm as the first in forward order instead of the embedding; the report's per-layer
    tables and weight heatmap listed it after the output head. It goes just before its first user, in the
    advisor and in every table of the report."""
    torch.manual_seed(0)
    model = _SharedEmbedding()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(3):
            if step == 2:  # as an optimizer step gone wrong would leave them: a finding names the weights
                with torch.no_grad():
                    model.shared.weight[3, 0] = math.nan
                    model.encoder["ln"].weight[0] = math.nan
            model(torch.randint(0, 16, (2, 4))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    tables, summary = prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}
    shared = T.shared_params(summary)
    assert shared == {
        "encoder.embed_tokens": {"weight": "shared"},
        "decoder.embed_tokens": {"weight": "shared"},
    }
    layers = tables["layers"]
    # (decoder.head:input: the sum head reads, which no module made)
    ran = ["encoder.embed_tokens", "encoder.ln", "decoder.embed_tokens", "decoder.head:input", "decoder.head"]
    assert S.forward_order(layers) == [*ran, "shared"]  # without the owners: never ran, last
    assert S.forward_order(layers, shared) == ["shared", *ran]
    assert T.module_order(layers, shared)[["shared", *ran]].tolist() == [0, 1, 2, 3, 4, 5]
    assert T.module_order(layers, {}).equals(T.module_order(layers))  # an older run: nothing to place
    rows, _, _ = S.heatmap_matrix(tables["histograms"], layers, T.WEIGHT, shared)
    assert rows[0] == ("shared", "weight")
    page = render_report(tables, summary, tmp_path / "report.html").read_text()
    for table in ("layer-table", "whatif-table"):
        body = page.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
        names = [re.sub("<[^>]+>", "", c) for c in re.findall(r'<td class="mod"><code>(.*?)</code>', body)]
        assert list(dict.fromkeys(names))[:2] == ["shared", "encoder.embed_tokens"], table
    from precprof.analysis.advisor import recommend

    found = [f for f in recommend(tables, summary=summary).findings if "first in forward order" in f.message]
    assert len(found) == 1 and found[0].modules[:2] == ["shared", "encoder.ln"], found
    assert "first in forward order: shared, Embedding" in found[0].message


def test_training_plot_marks_skipped_steps(synthetic: tuple[dict[str, pd.DataFrame], dict]) -> None:
    steps = synthetic[0]["steps"]
    fig = plots.training_figure(steps)
    assert fig is not None
    loss_ax, scale_ax, norm_ax = fig.axes
    assert scale_ax.get_title() == "Loss scale (3 skipped steps)"
    markers = [ln for ln in scale_ax.get_lines() if ln.get_marker() == "v"]
    assert len(markers) == 1
    skipped = steps[steps[T.SKIPPED]]
    np.testing.assert_array_equal(markers[0].get_xdata(), skipped[T.STEP].to_numpy(dtype=float))
    np.testing.assert_array_equal(markers[0].get_ydata(), np.log2(skipped[T.LOSS_SCALE].to_numpy()))
    assert loss_ax.get_xlabel() == "step" and "loss scale" in scale_ax.get_ylabel()
    assert norm_ax.get_title().startswith("Gradient norm")


def test_incomplete_synthetic_run_shows_banner_and_first_nan(tmp_path: Path) -> None:
    tabs, summary = synthetic_run("bf16", layers=gpt_layers(n_layer=1), steps=12, nan_at=5)
    out = render_report(tabs, summary, tmp_path / "r.html")
    page = out.read_text()
    assert "loss became nan at step 5; training stopped" in page
    per_layer = section(page, "layers")
    row = re.search(r'<tr class="nonfinite">.*?</tr>', per_layer, re.S)
    assert (
        row is not None
        and "transformer.h.0.mlp.c_proj" in row.group(0)
        and "step 5 (activations)" in row.group(0)
    )


def test_complete_run_has_no_banner(synthetic_page: str) -> None:
    assert 'id="incomplete"' not in synthetic_page
    assert 'class="banner notactive"' not in synthetic_page


def test_page_is_self_contained(synthetic_page: str) -> None:
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", synthetic_page)
    assert "<link" not in synthetic_page and "@import" not in synthetic_page
    assert len(decoded_images(synthetic_page)) == 6


def test_signature_heatmap_rows_windows_and_labels(synthetic: tuple[dict[str, pd.DataFrame], dict]) -> None:
    tabs, _ = synthetic
    layers, hist = tabs["layers"], tabs["histograms"]
    hm = plots.signature_heatmap(hist, layers, T.ACTIVATION_GRAD, recommended_scale=2.0**15)
    assert hm is not None
    ax_strip, ax, ax_lost, cax, _legend = hm.figure.axes
    assert ax.get_xlabel().startswith("log2 |value|")
    assert cax.get_ylabel() == "share of the row's nonzero values (log below 10%, linear above)"
    rows = S.row_order(layers, T.ACTIVATION_GRAD)
    assert [t.get_text() for t in ax.texts] == [S.row_label(m, p) for m, p in rows]
    assert rows[0][0] == "transformer.wte" and rows[-1][0] == "lm_head"  # forward order
    # fp16 at the last sampled step's scale (2^14 in the fixture's scaler series), then at the recommended one
    last_scale = layers.loc[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.STEP] == 11), T.SCALE].iloc[0]
    assert last_scale == 2.0**14
    fp16, fp16_rec, bf16, e4m3, e5m2 = hm.windows
    assert fp16.label == "FP16 at scale 2^14" and fp16.lo == -25 - 14 and abs(fp16.hi - (16 - 14)) < 1e-3
    assert fp16_rec.lo == -25 - 15 and bf16.lo == -134
    xs = {round(ln.get_xdata()[0], 6) for ln in ax.get_lines()}
    assert {-39.0, -40.0} <= xs  # the window edges inside the plotted range are drawn
    # FP8 under per-tensor current scaling (issue 34), never at scale 1: the strip at the largest row's amax,
    # each row's own window marked on its row; k = floor(log2(fmax / amax)) by plain arithmetic here
    g = layers[layers[T.TENSOR] == T.ACTIVATION_GRAD]
    amax = g.groupby([T.MODULE, T.PARAM])[T.ABSMAX].max()
    for w, fmax, lo in ((e4m3, 448.0, -10), (e5m2, 57344.0, -17)):
        assert "current scaling" in w.label
        assert w.lo == lo - math.floor(math.log2(fmax / float(amax.max())))
        x0, x1 = ax.get_xlim()
        want = {
            (float(lo - math.floor(math.log2(fmax / float(amax[(m, p)])))), i)
            for i, (m, p) in enumerate(rows)
            if float(amax[(m, p)]) > 0
        }
        want = {(x, i) for x, i in want if x0 < x < x1}
        (lc,) = [c for c in ax.collections if same_color(c.get_colors()[0], w.color)]
        got = {(float(seg[0][0]), int(seg[0][1])) for seg in lc.get_segments()}
        assert want and want <= got  # each row's lower edge, on its own row
    # activations are not loss-scaled: fp16 at scale 1, no recommended-scale window
    act = plots.signature_heatmap(hist, layers, T.ACTIVATION, recommended_scale=2.0**15)
    assert act is not None and [w.label for w in act.windows][:2] == ["FP16", "BF16"]
    # the strip names every window; the side panel says what it measures
    assert [t.get_text() for t in ax_strip.get_yticklabels()] == [w.label for w in hm.windows]
    assert ax_lost.get_xlabel().startswith("lost in FP16") and ax_lost.get_xscale() == "function"


class Times(nn.Module):
    """Multiplies by a constant: shrinks a layer's output so that a set share of it flushes to zero in fp16."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.c


def test_the_heatmaps_side_panel_reads_a_share_as_its_share(tmp_path: Path) -> None:
    """A row that lost 56% of its activations in FP16 ended a twentieth of the side panel short of its end, on a
    log axis from 0.0001% to 100%, and one that lost 20% hardly shorter: both read as "all lost". The panel is on
    the colour bar's scale, linear from 10% to 100%, where each bar ends between its ticks at its share, and a
    row that lost 1% or more has its share written in its bar. The shares are counted here by casting the layers'
    outputs to fp16."""
    torch.manual_seed(0)
    # a shrink by 2^-25 / q leaves the share of |N(0, 1)| values under q below fp16's flush point
    shrink = {2: 2.0**-25 / 0.77, 4: 2.0**-25 / 0.25}  # about 56% and 20% of each output flush
    model = nn.Sequential(
        nn.Linear(64, 512),
        nn.LayerNorm(512, elementwise_affine=False),  # N(0, 1) values
        Times(shrink[2]),
        Times(1 / shrink[2]),
        Times(shrink[4]),
        Times(1 / shrink[4]),
    )
    lost: dict[int, float] = {}

    def count(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _inp: object, out: torch.Tensor) -> None:
            nonzero = out.detach() != 0
            lost[i] = float(((out.detach().half() == 0) & nonzero).sum() / nonzero.sum())

        return hook

    for i in shrink:
        model[i].register_forward_hook(count(i))
    with precprof.Profiler(model, sample_every=1) as prof:
        model(torch.randn(64, 64)).square().mean().backward()
        prof.step()
    tabs = prof.tables()
    assert 0.5 < lost[2] < 0.6 and 0.15 < lost[4] < 0.25
    hm = plots.signature_heatmap(tabs["histograms"], tabs["layers"], T.ACTIVATION)
    assert hm is not None
    ax_lost = hm.figure.axes[2]
    FigureCanvasAgg(hm.figure).draw()
    to_axes = ax_lost.transData + ax_lost.transAxes.inverted()
    at = {
        t.get_text(): to_axes.transform((x, 0))[0]
        for t, x in zip(ax_lost.get_xticklabels(), ax_lost.get_xticks(), strict=True)
    }
    assert {"10%", "100%"} <= set(at)
    # its tick labels apart (tester t5: "0.01% 10% 100%" nearly touched, 6 px apart in the 720-px figure)
    renderer = hm.figure.canvas.get_renderer()
    boxes = sorted(
        tuple(t.get_window_extent(renderer).extents) for t in ax_lost.get_xticklabels() if t.get_text()
    )
    assert len(boxes) == 3 and all(b[0] - a[2] >= 8 for a, b in itertools.pairwise(boxes)), boxes
    texts = {round(t.get_position()[1] - 0.5): t for t in ax_lost.texts}
    bars = ax_lost.collections[-1]  # the last of the stacked bars ends at the row's total
    for i, share in lost.items():
        row = [r for r, _ in hm.rows].index(str(i))
        end = to_axes.transform((bars.get_paths()[row].vertices[:, 0].max(), 0))[0]
        assert end == pytest.approx(at["10%"] + (share - 0.1) / 0.9 * (at["100%"] - at["10%"]), abs=0.01)
        assert texts.pop(row).get_text().strip() == f"{100 * share:.0f}%"
    assert not texts  # no other row lost 1%


def test_signature_heatmap_keeps_the_worst_rows_when_there_are_too_many(
    synthetic: tuple[dict[str, pd.DataFrame], dict],
) -> None:
    tabs, _ = synthetic
    layers, hist = tabs["layers"], tabs["histograms"]
    lost = S.lost_share_by_row(layers, T.ACTIVATION_GRAD, "fp16")
    hm = plots.signature_heatmap(hist, layers, T.ACTIVATION_GRAD, max_rows=6)
    assert hm is not None and hm.rows_shown == 6 and hm.rows_total == len(lost)
    shown = [t.get_text() for t in hm.figure.axes[1].texts]
    rows = S.row_order(layers, T.ACTIVATION_GRAD)
    assert shown == [S.row_label(*r) for r in hm.rows]  # the rows' names, top to bottom
    # the worst, and of the five that tie at the cut three spread over them
    check_rows_chosen(rows, {r: sum(lost[r]) for r in rows}, 6, hm.rows)


def test_a_deep_model_that_loses_nothing_shows_rows_from_end_to_end_and_marks_the_gaps() -> None:
    """100 Linear layers between an embedding and a head, none losing anything in FP16: the heatmap kept the first 88 rows and the last, so that
    the head sat under layers.86 as if the model ended there, and the caption said it showed "the 88 that lose
    the most". The rows are taken evenly from end to end, a dashed line marks each place rows are left out, and
    the caption says how they were chosen."""
    layers = [LayerSpec("emb", "Embedding", {"weight": 4096})]
    layers += [LayerSpec(f"layers.{i}", "Linear", {"weight": 1024}) for i in range(100)]
    layers += [LayerSpec("head", "Linear", {"weight": 4096})]
    tabs, summary = synthetic_run("bf16", layers=layers, steps=2, sample_every=1)
    hist, table = T.sum_histogram_frame(tabs["histograms"]), tabs["layers"]
    kind, keep = T.ACTIVATION, 90
    rows = S.row_order(table, kind)
    lost = S.lost_share_by_row(table, kind, "fp16")
    bad = {r: sum(v for v in lost[r] if v == v) for r in rows}
    assert len(rows) == 102 and not any(bad[r] for r in rows[1:-1])  # between the ends all tie: nothing lost
    hm = plots.signature_heatmap(hist, table, kind, max_rows=keep)
    assert hm is not None
    check_rows_chosen(rows, bad, keep, hm.rows)
    # a dashed line on the heatmap and the side panel above each row drawn after rows left out
    where = [rows.index(r) for r in hm.rows]
    gaps = [j for j in range(1, keep) if where[j] - where[j - 1] > 1]
    assert len(gaps) == len(rows) - keep  # 12 single rows left out here
    for ax in hm.figure.axes[1:3]:
        lines = [c for c in ax.collections if isinstance(c, LineCollection)]
        (marks,) = [c for c in lines if same_color(c.get_colors()[0], plots.heatmap.GAP_COLOR)]
        assert sorted(seg[0][1] for seg in marks.get_segments()) == gaps
    assert "rows left out" in [t.get_text() for t in hm.figure.axes[4].get_legend().get_texts()]
    page = render.render_html(tabs, summary)
    caption = page.split(f'id="signature-{kind}"', 1)[1].split("</figcaption>", 1)[0]
    assert "lose the most" not in caption
    assert (
        f"Showing {keep} of {len(rows)} rows, in forward order: the first and last; {keep - 2} of the "
        f"{len(rows) - 2} that lose nothing in FP16, taken evenly." in caption
    )


def test_where_most_drawn_rows_follow_rows_left_out_no_line_stripes_the_figure() -> None:
    """A 480-layer model losing nothing: of its 90 rows drawn, 88 follow rows left out, and a dashed line above
    each striped the heatmap and its side panel from top to bottom, marking what the row names say. None is
    drawn nor in the legend, and the caption says the rows between are not marked; with few places (the test
    above) the lines stay."""
    layers = [LayerSpec("emb", "Embedding", {"weight": 64})]
    layers += [LayerSpec(f"layers.{i}", "Linear", {"weight": 16}) for i in range(480)]
    layers += [LayerSpec("head", "Linear", {"weight": 64})]
    tabs, _ = synthetic_run("bf16", layers=layers, steps=1, sample_every=1)
    table, kind = tabs["layers"], T.ACTIVATION
    hm = plots.signature_heatmap(T.sum_histogram_frame(tabs["histograms"]), table, kind)
    assert hm is not None and (hm.rows_shown, hm.rows_total) == (90, 482)
    rows = S.row_order(table, kind)
    where = [rows.index(r) for r in hm.rows]
    assert sum(where[j] - where[j - 1] > 1 for j in range(1, 90)) > 45
    for ax in hm.figure.axes[1:3]:
        assert not [
            c
            for c in ax.collections
            if isinstance(c, LineCollection) and same_color(c.get_colors()[0], plots.heatmap.GAP_COLOR)
        ]
    assert "rows left out" not in [t.get_text() for t in hm.figure.axes[4].get_legend().get_texts()]
    assert "Rows are left out between most of those drawn (not marked); every row is in" in hm.rows_note()


def test_a_deep_model_whose_losses_start_midway_shows_where_and_counts_every_row() -> None:
    """200 blocks whose outputs overflow FP16 from block 48 on, all of every even block's and half of every odd
    one's: the heatmap showed 88 of the 100%-rows only, from block 61, and its caption read "88 of the other
    76" of 202 rows. The first losing block and the one before it are drawn, as are rows from before them; the
    caption's counts are the rows that lose 100%, and those that lose less, and add up to every row."""
    layers = [LayerSpec("emb", "Embedding", {"weight": 4096})]
    layers += [LayerSpec(f"blocks.{i}", "Linear", {"weight": 1024}) for i in range(200)]
    layers += [LayerSpec("head", "Linear", {"weight": 4096})]
    tabs, _ = synthetic_run("bf16", layers=layers, steps=2, sample_every=1)
    table, kind, keep = tabs["layers"], T.ACTIVATION, 90
    act = table[T.TENSOR] == kind
    for col in (T.underflow_col("fp16"), T.overflow_col("fp16"), T.NAN, T.INF):
        table.loc[act, col] = 0
    block = table[T.MODULE].str.removeprefix("blocks.").where(table[T.MODULE].str.startswith("blocks."), "-1")
    block = block.astype(int)
    table.loc[act & (block >= 48), T.overflow_col("fp16")] = table[T.NUMEL] // np.where(block % 2, 2, 1)
    hm = plots.signature_heatmap(T.sum_histogram_frame(tabs["histograms"]), table, kind, max_rows=keep)
    assert hm is not None
    rows = S.row_order(table, kind)
    full = [r for r in rows[1:-1] if r[0].startswith("blocks.") and int(r[0].split(".")[1]) % 2 == 0]
    full = [r for r in full if int(r[0].split(".")[1]) >= 48]  # lose 100%: blocks 48, 50, ..., 198
    assert len(rows) == 202 and len(full) == 76
    shown = {m for m, _ in hm.rows}
    assert {"blocks.47", "blocks.48"} <= shown  # where the losses start, and the row before
    assert len({m for m in shown if m.startswith("blocks.") and int(m.split(".")[1]) < 47}) >= 5
    note = hm.rows_note()
    counts = re.match(
        r"Showing (\d+) of (\d+) rows, in forward order: the first and last; (\d+) of the (\d+) that each "
        r"lose 100% in FP16, taken evenly; (\d+) of the (\d+) that lose less, taken evenly\. The first row that "
        r"loses anything in FP16, blocks\.48, is drawn with the row before it\.",
        note,
    )
    assert counts, note
    n_shown, n_rows, full_shown, n_full, less_shown, n_less = map(int, counts.groups())
    assert (n_shown, n_rows) == (len(hm.rows), len(rows)) == (keep, 202)
    assert (n_full, n_less) == (len(full), len(rows) - 2 - len(full))
    assert (full_shown, less_shown) == (
        len(set(hm.rows) & set(full)),
        keep - 2 - len(set(hm.rows) & set(full)),
    )
    lost = S.lost_share_by_row(table, kind, "fp16")
    check_rows_chosen(rows, {r: sum(lost[r]) for r in rows}, keep, hm.rows)


def test_rows_that_hold_only_zeros_are_marked_in_the_heatmaps() -> None:
    """A ReLU that never fires (the Linear before it has a bias of -100): its output, the activation gradients
    before it and the weight gradients of every layer up to the next Linear's weight are exactly zero. Their
    heatmap rows were blank, as a row without data is. Each is marked "all zero", those rows only (the test's
    own hooks and the gradients say which), and the caption says what the mark means."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[2].bias.fill_(-100.0)
    zero_out: dict[str, list[bool]] = {}
    for name, m in model.named_children():
        m.register_forward_hook(
            lambda mod, a, out, name=name: zero_out.setdefault(name, []).append(bool((out == 0).all()))
        )
    zero_grad: dict[str, list[bool]] = {}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            for name, p in model.named_parameters():
                zero_grad.setdefault(name, []).append(bool((p.grad == 0).all()))
            opt.step()
            opt.zero_grad()
            prof.step()
    tables = prof.tables()
    hist = T.sum_histogram_frame(tables["histograms"])
    expected = {
        T.ACTIVATION: {m for m, z in zero_out.items() if all(z)},
        T.WEIGHT_GRAD: {n for n, z in zero_grad.items() if all(z)},
    }
    assert expected == {
        T.ACTIVATION: {"3"},
        T.WEIGHT_GRAD: {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight"},
    }
    page = render.render_html(tables, {})
    for kind, names in expected.items():
        hm = plots.signature_heatmap(hist, tables["layers"], kind)
        assert hm is not None and hm.all_zero == len(names)
        marks = [t for t in hm.figure.axes[1].texts if t.get_gid() == plots.heatmap.ALL_ZERO]
        assert all(t.get_text() == "all zero" for t in marks)
        assert {S.row_label(*hm.rows[int(t.get_position()[1])]) for t in marks} == names
        caption = page.split(f'id="signature-{kind}"', 1)[1].split("</figcaption>", 1)[0]
        which = "One row holds" if len(names) == 1 else f"{len(names)} rows hold"
        assert f"{which} only zeros on every sampled step, marked “all zero”" in caption
    # fewer rows drawn than there are: the caption says how many of the run's all-zero rows are drawn (tester t5:
    # "20 rows hold only zeros" of a run whose tables had 254 such rows)
    hm = plots.signature_heatmap(hist, tables["layers"], T.WEIGHT_GRAD, max_rows=3)
    assert hm is not None and hm.rows_shown == 3 and 0 < hm.all_zero < 5, hm
    drawn = "One of the 5 rows that hold only zeros on every sampled step is drawn"
    if hm.all_zero > 1:
        drawn = f"{hm.all_zero} of the 5 rows that hold only zeros on every sampled step are drawn"
    assert hm.zero_note().startswith(drawn + ", marked “all zero”"), hm.zero_note()


def test_heatmap_matrix_and_whatif_shares_agree_with_the_tables(
    synthetic: tuple[dict[str, pd.DataFrame], dict],
) -> None:
    tabs, _ = synthetic
    layers, hist = tabs["layers"], tabs["histograms"]
    rows, exps, mat = S.heatmap_matrix(T.sum_histogram_frame(hist), layers, T.WEIGHT_GRAD)
    totals = hist[hist[T.TENSOR] == T.WEIGHT_GRAD].groupby([T.MODULE, T.PARAM])[T.COUNT].sum()
    for (m, p), row in zip(rows, mat, strict=True):
        assert row.sum() == totals[(m, p)]
    assert exps[0] == hist[hist[T.TENSOR] == T.WEIGHT_GRAD][T.EXPONENT].min()

    w = S.whatif_by_layer(layers)
    for kind in (T.ACTIVATION_GRAD, T.WEIGHT):
        sub = layers[(layers[T.MODULE] == "transformer.h.0.attn.c_attn") & (layers[T.TENSOR] == kind)]
        got = w[(w[T.MODULE] == "transformer.h.0.attn.c_attn") & (w[T.TENSOR] == kind)].iloc[0]
        cols = [T.underflow_col("fp16"), T.underflow_cs_col("fp8_e5m2")]
        # FP8 at the loss scale only where it was 1 (the weights); the gradients' were at the run's loss scale
        cols += [T.overflow_col("fp8_e4m3"), T.underflow_col("fp8_e5m2")] if kind == T.WEIGHT else []
        for col in cols:
            assert got[col] == pytest.approx(sub[col].sum() / sub[T.NUMEL].sum())
    assert got[S.SCALE_MIN] == got[S.SCALE_MAX] == 1.0
    # the gradients' rows: the range of the scales their shares were counted at (2^16 down to 2^14 and back up
    # to 2^15 over the sampled steps), not the last step's 2^14 alone
    grads = w[w[T.TENSOR] == T.ACTIVATION_GRAD]
    assert (grads[S.SCALE_MIN] == 2.0**14).all() and (grads[S.SCALE_MAX] == 2.0**16).all()


def test_the_whatif_tables_scale_is_the_range_its_shares_were_counted_at(
    synthetic: tuple[dict[str, pd.DataFrame], dict], synthetic_page: str
) -> None:
    """An fp16 run (autocast, two micro-batches a step summed in the fp32 .grad) whose GradScaler starts at 2^19
    and backs off to 2^16 before a step goes through. The per-layer table gave each row one scale, the last
    sampled step's (2^16), beside FP16 overflow shares summed over every step at every scale: fc's weight
    gradients read "2^16" beside an overflow share none of which happened at 2^16, and a reader would lower a scale
    that already worked. Each row has the range of the scales its values were counted at now, one scale where it
    did not change (the forward kinds: 1); the page shows "2^a … 2^b"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**19)
    x = torch.randn(32, 8) * 4
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, memory=False) as prof:
        for _ in range(4):
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    layers, steps = prof.tables()["layers"], prof.tables()["steps"]
    assert list(steps[T.LOSS_SCALE]) == [2.0**k for k in range(19, 15, -1)]
    w = S.whatif_by_layer(layers).set_index([T.MODULE, T.TENSOR])
    for (module, kind), row in w.iterrows():
        rows = layers[(layers[T.MODULE] == module) & (layers[T.TENSOR] == kind)]
        lo, hi = (2.0**16, 2.0**19) if kind in T.GRADIENT_KINDS else (1.0, 1.0)
        assert (row[S.SCALE_MIN], row[S.SCALE_MAX]) == (rows[T.SCALE].min(), rows[T.SCALE].max()) == (lo, hi)
    # fc's weight-gradient overflow: all of it at 2^17 to 2^19, none at 2^16, the scale the table showed
    fc = layers[(layers[T.MODULE] == "0") & (layers[T.TENSOR] == T.WEIGHT_GRAD)]
    over = T.overflow_col("fp16")
    assert fc[over].sum() > 0 and fc.loc[fc[T.SCALE] == 2.0**16, over].sum() == 0
    assert w.loc[("0", T.WEIGHT_GRAD), over] == pytest.approx(fc[over].sum() / fc[T.NUMEL].sum())
    assert filters.pow2_range(2.0**16, 2.0**21) == "2^16 … 2^21" and filters.pow2_range(1.0, 1.0) == "1 (2^0)"
    assert filters.pow2_range(1e3, 4e3) == "1,000 … 4,000"
    # the page (the synthetic fp16 run: its scale went 2^16, 2^14, 2^15 and back to 2^14 over the sampled steps)
    html = section(synthetic_page, "whatif")
    table = html[html.index('id="whatif-table"') :]
    rows = S.whatif_by_layer(synthetic[0]["layers"])
    grads = int(rows[T.TENSOR].isin(T.GRADIENT_KINDS).sum())
    assert grads and table.count('<td data-v="65536">2^14 … 2^16</td>') == grads
    assert ">16,384 (2^14)</td>" not in table and "the lowest … the highest" in html


def test_the_whatif_tables_show_the_values_already_nan_or_inf(tmp_path: Path) -> None:
    """A Linear whose weight holds a row of nan and an inf, so its outputs are nan where that row feeds them: no
    cast loses a nan, so every format's column read 0% for tensors that were mostly nan, beside a training figure
    showing them lost. The tables have a "nan/inf" column, the share the tensors themselves hold; a run without
    nan or inf has none."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    with torch.no_grad():
        lin.weight[1] = math.nan
        lin.weight[2, 3] = math.inf
    x = torch.randn(5, 8)
    with precprof.Profiler(lin, sample_every=1, memory=False, out=tmp_path / "bad") as prof:
        out = lin(x)
        prof.step()
    page = prof.report().read_text()
    w, b = lin.weight.detach(), lin.bias.detach()
    weights = (int((~w.isfinite()).sum()) + int((~b.isfinite()).sum())) / (w.numel() + b.numel())
    outputs = int((~out.isfinite()).sum()) / out.numel()
    assert (weights, outputs) == (9 / 36, 10 / 20)  # the nan row, the inf; two of the four outputs, all nan
    rows = S.whatif_by_layer(prof.tables()["layers"]).set_index([T.MODULE, T.TENSOR])
    assert rows.loc[("", T.WEIGHT), S.NONFINITE] == pytest.approx(weights)
    assert rows.loc[("", T.ACTIVATION), S.NONFINITE] == pytest.approx(outputs)
    over = S.whatif_overview(prof.tables()["layers"]).set_index(T.TENSOR)
    assert over.loc[T.WEIGHT, S.NONFINITE] == pytest.approx(weights)
    html = section(page, "whatif")
    assert 'id="whatif-nonfinite"' in html and '<th rowspan="2">nan/inf</th>' in html
    assert f'data-label="nan/inf">{filters.pct(weights)}</td>' in html
    assert f'<td class="bad" data-v="{outputs}">{filters.pct(outputs)}</td>' in html
    good = nn.Linear(8, 4)
    with precprof.Profiler(good, sample_every=1, memory=False, out=tmp_path / "good") as prof:
        good(x)
        prof.step()
    html = section(prof.report().read_text(), "whatif")
    assert 'id="whatif-nonfinite"' not in html and ">nan/inf</th>" not in html


def _nan_loss_or_not(nan: bool) -> tuple[list[float], str, precprof.Recommendation]:
    """A small MLP trained 3 steps by AdamW, every step sampled, its loss times nan when ``nan``: the losses, the
    page rendered for an A100 and the recommendation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean() * (math.nan if nan else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            prof.step(loss=loss.detach())
    tabs = prof.tables()
    summary = {T.SUMMARY_CAPTURE: prof.summary(), T.SUMMARY_MODEL: {"n_params": 228}}
    rec = precprof.recommend(tabs, hardware="a100", summary=summary)
    return losses, render_html(tabs, summary, rec), rec


def test_the_verdict_box_does_not_say_the_measurements_allow_a_format_a_broken_run_never_measured() -> None:
    """A small model whose loss is nan from step 0: every sampled forward pass is non-finite, so its values say
    nothing of bf16's range and no gradient sized fp16's loss scale (the Why said both). The box said "the
    measurements allow BF16" beside "if you use FP16: init_scale = 65,536", a default. It says neither now; the
    same model trained with a finite loss still has both said as they were."""
    losses, page, rec = _nan_loss_or_not(nan=True)
    assert all(math.isnan(v) for v in losses)
    assert rec.format == "fp32" and rec.measured_format == ""
    assert "The measurements allow" not in rec.reasons[0] and "was not measured" in rec.reasons[0]
    verdict = section(page, "verdict")
    assert 'id="measured-format"' not in verdict and "the measurements allow" not in verdict
    assert (
        '<span id="scale-default">; a default, as no gradient of this run could size it: see Why</span>'
        in verdict
    )
    losses, page, rec = _nan_loss_or_not(nan=False)
    assert all(math.isfinite(v) for v in losses)
    assert rec.format == "fp32" and rec.measured_format == "bf16"
    verdict = section(page, "verdict")
    assert 'id="measured-format"' in verdict and 'id="scale-default"' not in verdict


def test_a_weight_a_parametrization_computes_is_counted_once_among_the_weights() -> None:
    """weight_norm(Linear(8, 16)): the weight its GEMM reads is computed, and the tables record it as the output
    of 0.parametrizations.weight and again of 0.parametrizations.weight.0 (the _WeightNorm inside it). The
    what-if totals counted it twice among the activations, where the weights held only what it is computed from.
    It is counted once, among the weights (its gradient among the weight gradients): the elements of each kind
    are those of the model's own tensors, counted from its shapes (batch of 4, two sampled steps); the
    activations hold the model's input too, which the first layer reads (its own input row)."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    outputs = 4 * 16 + 4 * 16 + 4 * 4  # each module's output: the Linear, the ReLU, the last Linear
    read = 4 * 8  # the model's input, 0's own input row (no gradient)
    weights = sum(p.numel() for p in model.parameters()) + model[0].weight.numel()  # and the computed weight
    over = S.whatif_overview(prof.tables()["layers"]).set_index(T.TENSOR)[T.NUMEL]
    assert over.to_dict() == {
        T.ACTIVATION: 2 * (outputs + read),
        T.ACTIVATION_GRAD: 2 * outputs,
        T.WEIGHT: 2 * weights,
        T.WEIGHT_GRAD: 2 * weights,
    }
    rows = S.whatif_by_layer(prof.tables()["layers"])
    computed = rows[rows[T.MODULE] == "0.parametrizations.weight"]
    assert sorted(computed[T.TENSOR]) == [T.WEIGHT, T.WEIGHT_GRAD]
    assert not rows[T.MODULE].str.startswith("0.parametrizations.weight.").any()


def test_fp8_at_an_fp16_loss_scale_is_not_applicable(tmp_path: Path) -> None:
    """An fp16 run at a loss scale of 65536: the what-if tables gave FP8 E4M3 overflow of 2.63% of its weight
    gradients, every one of them from the loss scale, which FP8 training never applies. FP8's underflow and
    overflow of a kind recorded at a scale other than 1 read "—", with a note naming the scale and the current
    scaling columns; the forward kinds (scale 1) and a bf16 run keep their numbers."""
    for precision, scaled in (("fp16", True), ("bf16", False)):
        tabs, summary = synthetic_run(precision, layers=gpt_layers(n_layer=1), steps=6, sample_every=1)
        layers = tabs["layers"]
        over = S.whatif_overview(layers).set_index(T.TENSOR)
        for kind in S.HIST_KINDS:
            rows = layers[layers[T.TENSOR] == kind]
            at_scale = bool((rows[T.SCALE] != 1).any())
            assert at_scale == (scaled and kind in T.GRADIENT_KINDS)
            for col in [*S.fp8_scaled_columns(), T.underflow_cs_col("fp8_e4m3"), T.overflow_col("fp16")]:
                share = rows[col].sum() / rows[T.NUMEL].sum()
                if at_scale and col in S.fp8_scaled_columns():
                    assert math.isnan(over.loc[kind, col])
                else:
                    assert over.loc[kind, col] == pytest.approx(share)
        page = render_html(tabs, summary)
        section = page.split('<section id="whatif">', 1)[1].split("</section>", 1)[0]
        note = re.search(r'id="whatif-fp8-scale">([^<]*)', section)
        assert (note is not None) == scaled
        if note:
            lo, hi = (
                layers.loc[layers[T.TENSOR].isin(T.GRADIENT_KINDS), T.SCALE].agg(f) for f in ("min", "max")
            )
            assert "activation gradients and weight gradients: “—”, not applicable" in note.group(1)
            scales = [f"{v:,.0f} (2^{round(math.log2(v))})" for v in dict.fromkeys((lo, hi))]
            assert "loss scale" + ("s of " if lo != hi else " of ") + " to ".join(scales) in note.group(1)
            assert "current scaling say what FP8 would lose" in note.group(1)


def test_layer_records_forward_order_and_extremes(synthetic: tuple[dict[str, pd.DataFrame], dict]) -> None:
    layers = synthetic[0]["layers"]
    recs = S.layer_records(layers)
    assert [r["module"] for r in recs] == [ly.name for ly in gpt_layers(n_layer=1)]
    proj = next(r for r in recs if r["module"] == "transformer.h.0.mlp.c_proj")
    sub = layers[layers[T.MODULE] == "transformer.h.0.mlp.c_proj"]
    acts = sub[sub[T.TENSOR] == T.ACTIVATION]
    assert proj["act_absmax"] == acts[T.ABSMAX].max()
    assert proj["act_dtype"] == "float16" and proj["weight_grad_dtype"] == "float32"
    hist_rows = sub[sub[T.TENSOR].isin(S.HIST_KINDS)]
    assert proj["overflow_fp16"] == hist_rows[T.overflow_col("fp16")].sum() > 0
    upd = sub[sub[T.TENSOR] == T.WEIGHT_UPDATE]
    intended = (upd[T.NUMEL] - upd[T.ZEROS].fillna(0)).clip(lower=0).sum()  # the fixture writes no zeros
    assert proj["lost_update_bf16"] == pytest.approx(upd[T.LOST_UPDATE_BF16].sum() / intended)


def test_the_zeros_column_says_what_it_counts(synthetic: tuple[dict[str, pd.DataFrame], dict]) -> None:
    """The per-layer "zeros" column was defined nowhere and summed the tensor kinds: gpt-nano's wpe showed
    221,184 zeros, every one a weight-gradient zero of a position no batch used (h76). Its header and the
    section's lead say what it counts (the four kinds of every sampled step, not the weight updates), and a cell
    whose zeros are all of one kind names it (the rows stay within their bytes: an MoE's page has thousands)."""
    layers = synthetic[0]["layers"].copy()
    proj, fc = "transformer.h.0.mlp.c_proj", "transformer.h.0.mlp.c_fc"
    zeros = {
        (proj, T.WEIGHT_GRAD): 7,
        (proj, T.ACTIVATION_GRAD): 3,
        (proj, T.WEIGHT_UPDATE): 50,
        (fc, T.WEIGHT_GRAD): 5,
    }
    layers[T.ZEROS] = [zeros.get((m, k), 0) for m, k in zip(layers[T.MODULE], layers[T.TENSOR], strict=True)]
    rows = layers.groupby([T.MODULE, T.TENSOR], observed=True).size()
    recs = {r["module"]: r for r in S.layer_records(layers)}
    n_wg, n_ag = (int(rows[(proj, k)]) for k in (T.WEIGHT_GRAD, T.ACTIVATION_GRAD))
    assert recs[proj]["zeros"] == 7 * n_wg + 3 * n_ag  # the updates' 50s are not counted
    assert recs[proj]["zeros_by_kind"] == {"act. grad": 3 * n_ag, "weight grad": 7 * n_wg}
    assert recs[fc]["zeros_by_kind"] == {"weight grad": 5 * int(rows[(fc, T.WEIGHT_GRAD)])}
    cols = {"lost_updates": False, "update_format": "bf16", "update_held": "", "nonfinite": False}
    page = (
        render.environment()
        .get_template("_layers.html.j2")
        .render(
            section={"id": "layers", "number": 1, "heading": "Per layer"},
            layers=list(recs.values()),
            layer_inputs=0,
            update_ratios=[],
            update_nonfinite=[],
            layers_cols=cols,
        )
    )
    assert (
        "“zeros”: the values exactly 0, summed over the activations, activation gradients, weights and"
        in page
    )
    assert (
        '<th title="values exactly 0 over the activations, activation gradients, weights and weight' in page
    )
    assert f'{5 * int(rows[(fc, T.WEIGHT_GRAD)])}<br><span class="what">weight grad</span>' in page
    assert (
        f'data-v="{7 * n_wg + 3 * n_ag}">{7 * n_wg + 3 * n_ag}</td>' in page
    )  # two kinds: the lead says which


def test_not_active_mixed_precision_is_flagged() -> None:
    # fp16 asked for, every activation float32 (accelerate's fp16 on CPU does this)
    tabs, summary = synthetic_run("fp32", layers=gpt_layers(n_layer=1), steps=2, sample_every=1)
    summary[T.SUMMARY_CONFIG]["precision"] = "fp16"
    check = S.precision_check(tabs["layers"], tabs["memory"], summary)
    assert not check["ok"] and check["verdict"].startswith(
        "Mixed precision was asked for (fp16) but is NOT active"
    )
    # a user's own loop asks nothing: bf16 is what the profiler saw (autocast on in a recorded forward pass, off
    # around every module with parameters), and the check said it 'was asked for (bf16)' under 'Seen: bf16'
    summary[T.SUMMARY_CONFIG] = {}
    summary[T.SUMMARY_CAPTURE] = {
        **(summary.get(T.SUMMARY_CAPTURE) or {}),
        "precision_seen": "bf16",
        "autocast": {"enabled": True, "dtype": "torch.bfloat16"},
    }
    check = S.precision_check(tabs["layers"], tabs["memory"], summary)
    assert not check["ok"] and not check["asked"] and check["requested"] == "bf16"
    assert check["verdict"] == (
        "Mixed precision was seen (bf16: autocast was on in a recorded forward pass) but is NOT active: every "
        "activation of a module with parameters is float32 (autocast off around them, or a library that "
        "ignores the setting on this device)."
    )


def test_empty_run_still_renders(tmp_path: Path) -> None:
    summary = {T.SUMMARY_ERRORS: ["advisor: KeyError: 'step'"]}
    page = render_report({}, summary, tmp_path / "empty.html").read_text()
    assert "Part of the analysis failed" in page and "advisor: KeyError: &#39;step&#39;" in page
    assert "No steps were recorded." in page
    assert "No per-layer statistics were recorded." in page
    assert "No recommendation is stored with this run" in page
    assert page.count("<img ") == 0


def test_rerender_recomputes_for_a_target(tmp_path: Path) -> None:
    tabs, summary = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    T.write_tables(tmp_path, tabs)
    T.write_summary(tmp_path, summary)  # no recommendation stored: the advisor runs
    out = pipeline.rerender(tmp_path, out=tmp_path / "t4.html", target="t4")
    verdict = section(out.read_text(), "verdict")
    # a 12k-parameter model: fp32 by default, the measurements allow fp16 on a t4
    assert "for target hardware: t4" in verdict and 'class="fmt fmt-fp32">FP32' in verdict
    assert 'class="fmt-inline fmt-fp16">FP16</span>' in verdict
    assert T.SUMMARY_RECOMMENDATION not in T.read_summary(tmp_path)  # re-rendering never rewrites data
    # without --out the run's own report.html stays as it was, and the header names both machines
    own = render_run_dir(tmp_path).read_bytes()
    planned = pipeline.rerender(tmp_path, target="V100")
    assert planned == tmp_path / "report-v100.html" and (tmp_path / "report.html").read_bytes() == own
    header = planned.read_text().split("<main>")[0]
    assert "recorded on " in header and "verdict planned for v100" in header
    assert "verdict planned for" not in own.decode().split("<main>")[0]
    # the tab of each page tells the targets apart
    assert re.search(r"<title>precprof report · [^<]* · for v100</title>", header)
    assert " · for " not in own.decode().split("</title>")[0]
    with pytest.raises(UserError, match="unknown hardware target"):
        pipeline.rerender(tmp_path, target="abacus")
    with pytest.raises(UserError, match="not a precprof run directory"):
        render_run_dir(tmp_path / "nothing-here")


def _finding_number_names() -> set[tuple[str, str]]:
    """(file, name) of every number a rule can put in a finding, read from the rules' source: the keys of
    dict literals passed as ``numbers=`` or assigned to ``nums``/``numbers`` (and of the literals inside their
    ``**`` entries), and ``nums["x"] = ...``."""
    import ast

    root = Path(precprof.__file__).parent / "analysis"
    names: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            value = None
            if isinstance(node, ast.keyword) and node.arg == "numbers":
                value = node.value
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                if isinstance(target, ast.Name) and target.id in ("nums", "numbers"):
                    value = node.value
                elif isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
                    holder = target.value
                    if (isinstance(holder, ast.Name) and holder.id in ("nums", "numbers")) or (
                        isinstance(holder, ast.Attribute) and holder.attr == "numbers"
                    ):
                        names.add((path.name, str(target.slice.value)))
            if isinstance(value, ast.Dict):
                names.update((path.name, str(k.value)) for k in value.keys if isinstance(k, ast.Constant))
                # and the dict literals of its ``**(...)`` entries: ``**({"x": ...} if found else {})``
                for k, v in zip(value.keys, value.values, strict=True):
                    if k is None:
                        names.update(
                            (path.name, str(key.value))
                            for inner in ast.walk(v)
                            if isinstance(inner, ast.Dict)
                            for key in inner.keys
                            if isinstance(key, ast.Constant)
                        )
    return names


def test_every_finding_number_has_a_label_on_the_page() -> None:
    names = _finding_number_names()
    assert len(names) > 70 and ("fp16.py", "share_at_recommended") in names  # the collector sees the rules
    per_finding = {k[1] for k in report_numbers.LABELS if isinstance(k, tuple)}  # (code, name): that code's
    unlabeled = sorted(n for f, n in names if n not in report_numbers.LABELS and n not in per_finding)
    assert not unlabeled, f"finding numbers without a label in precprof/report/numbers.py: {unlabeled}"
    # a per-finding label names a finding code the rules emit
    codes = {k[0] for k in report_numbers.LABELS if isinstance(k, tuple)}
    readme = (Path(precprof.__file__).parent.parent / "README.md").read_text()  # its table of finding codes
    assert all(f"| `{c}` |" in readme for c in codes), codes


def test_finding_numbers_as_shown() -> None:
    shown = dict(
        report_numbers.shown(
            "fp16_gradient_underflow",
            {
                "share_now": 0.0161,
                "share_at_run_scale": 0.0161,  # repeats share_now: left out
                "loss_scale_log2": 15,
                "fp16_zero_share": None,  # not measured: left out
                "max_module_norm_share_at_recommended": 0.0,
                "max_norm_share_module": "h.3.attn",
                "loss_change": -0.183,
                "fp16_flushed": 0,
            },
        )
    )
    assert shown == {
        "lost in FP16 at this run's loss scale (exact count)": "1.61%",
        "recommended loss scale": "32,768 (2^15)",
        "largest share of one module's gradient norm lost at the recommended loss scale": "0%",
        "that module": "h.3.attn",
        "loss change over the run": "-18.3%",
        "gradients pressed against FP16's floor": "no",
    }
    # at a run's loss scale of 1 the share without loss scaling is the same quantity as the exact count (16,005 of
    # 5,061,112 nonzero values from the histograms, 16,087 counted: those exactly on 2^-25 round to 0 too)
    exact, histogram = 16_087 / 5_061_112, 16_005 / 5_061_112
    for run_scale, shares in ((0, ["0.318%"]), (15, ["0.318%", "0.316%"])):
        numbers = {"share_now": exact, "share_at_scale_1": histogram, "run_scale_log2": run_scale}
        got = report_numbers.shown("fp16_gradient_underflow", numbers)
        assert [v for k, v in got if k.startswith("lost in FP16")] == shares, got
    assert report_numbers.shown("scaler_skipped_steps", {"steps": 11, "start_scale": 65536.0}) == [
        ("steps in the run", "11"),
        ("initial loss scale", "65,536 (2^16)"),
    ]
    assert report_numbers.shown("tensor_core_alignment", {"dim_vocab_size": 50257}) == [
        ("vocab size", "50,257")
    ]


def test_a_magnitude_at_a_format_limit_reads_apart_from_the_next_binade() -> None:
    """Magnitudes wrote log2 to one decimal: fp16's largest finite value 65504 = 2^15 x 1.99902 read "2^16.0",
    as 65536 (inf in fp16) does, and bf16's largest 3.39e38 = 2^127 x 1.9921875 read "2^128.0", beyond every
    format. Each now reads as 2^e times its place in the binade, cut to three decimals (never rounded up to 2)."""
    for x in (65504.0, 65519.0, 3.3895313892515355e38, 448.0, 2.0**-24 * 1.5):
        e = int(np.floor(np.log2(x)))
        m = x / 2.0**e
        assert 1.0 <= m < 2.0
        assert filters.log2mag(x).endswith(f"(2^{e}\u00a0·\u00a0{math.floor(m * 1000) / 1000:.3f})")
    assert filters.log2mag(65504.0) == "65,504 (2^15\u00a0·\u00a01.999)"  # no-break spaces
    assert filters.log2mag(65536.0) == "65,536 (2^16)"
    assert filters.log2mag(float(torch.finfo(torch.bfloat16).max)) == "3.39e+38 (2^127\u00a0·\u00a01.992)"
    assert float(torch.tensor(65504.0).half()) == 65504.0 and torch.tensor(65536.0).half().isinf()


def test_filters() -> None:
    assert filters.pct(0) == "0%" and filters.pct(0.413) == "41.3%" and filters.pct(1e-9) == "<0.0001%"
    assert filters.pct(math.nan) == filters.MISSING and filters.num(None) == filters.MISSING
    assert filters.pow2(32768.0) == "32,768 (2^15)" and filters.pow2(3.0) == "3"
    assert filters.nbytes(1536) == "1.50 KiB" and filters.nbytes(3 * 2**30) == "3.00 GiB"
    assert filters.log2mag(0.25) == "0.25 (2^-2)" and filters.num(1.5e-7) == "1.50e-07"
    assert filters.count(1234567.0) == "1,234,567" and filters.num(math.inf) == "inf"
    assert (
        filters.num(1560.4) == "1,560"
        and filters.num(306.25) == "306"
        and filters.num(2.5e9 + 0.5) == "2.50e+09"
    )
    assert filters.cmdline(["train.py", "--name", "a b"]) == "train.py --name 'a b'"
    assert filters.plain(list(range(20))).endswith(", 18, 19")  # every item, none cut (issue 35)
    assert filters.share_class(0.02) == "bad" and filters.share_class(0.0) == "zero"
    # the sorting script's keys: parseFloat reads each back to the value ("" sorts last)
    keys = {0.0: "0", 320.0: "320", 0.090625: "0.090625", 2.0**-24: repr(2.0**-24), -3.0: "-3", 1e20: "1e+20"}
    assert {v: filters.sortkey(v) for v in keys} == keys and float(filters.sortkey(2.0**-24)) == 2.0**-24
    assert (
        filters.sortkey(math.inf) == "1e308"
        and filters.sortkey(math.nan) == ""
        and filters.sortkey(None) == ""
    )


def test_row_helpers_write_what_the_macros_wrote() -> None:
    """``dotted``, ``share_cells`` and ``tr`` (Python, for the long tables' thousands of rows) write what the
    template macros and per-cell filters they replaced wrote, escaping what is user data."""
    env = render.environment()
    macros = env.from_string(
        '{% macro dotted(name) %}{% for part in name.split(".") %}{{ part }}{% if not loop.last %}.<wbr>'
        "{% endif %}{% endfor %}{% endmacro %}"
        '{% macro tr(loop, cls="") %}{% set c = (cls ~ (" extra" if loop.index > first_rows else "")) | trim %}'
        '<tr{% if c %} class="{{ c }}"{% endif %}>{% endmacro %}'
        "{% for n in names %}{{ dotted(n) }}|{{ tr(loop) }}{{ tr(loop, ' own') }}"
        '{% for s in shares %}<td class="{{ s | share_class }}" data-v="{{ s | sortkey }}">{{ s | pct }}</td>'
        "{% endfor %}#{% endfor %}"
    )
    helpers = env.from_string(
        "{% for n in names %}{{ n | dotted }}|{{ tr(loop) }}{{ tr(loop, ' own') }}{{ shares | share_cells }}#"
        "{% endfor %}"
    )
    names = ["model.h.0.<b>&x", "", "lm_head"] + [f"m{i}" for i in range(render.FIRST_ROWS)]
    shares = [0.0, 1e-9, 2e-4, 0.5, math.nan, None, math.inf]
    page = macros.render(names=names, shares=shares)
    assert helpers.render(names=names, shares=shares) == page
    assert 'model.<wbr>h.<wbr>0.<wbr>&lt;b&gt;&amp;x|<tr><tr class="own">' in page
    assert '<tr class="extra"><tr class="own extra">' in page and "&lt;0.0001%" in page


def test_orders_and_sample_weights_read_once_give_what_each_reads_itself() -> None:
    """The page reads the forward order, the update rows' sample weights and the what-if's rows once and hands
    them to the tables, the heatmaps and the timeline: each gives what it gives reading them itself."""
    tabs, summary = synthetic_run("bf16", layers=gpt_layers(n_layer=1), steps=3, sample_every=1)
    layers, shared = tabs["layers"], T.shared_params(summary)
    order, weights = S.forward_order(layers, shared), T.sample_weights(layers)
    assert order and len(weights) and timeline.update_format(layers, "bf16") == "bf16"
    assert repr(S.layer_records(layers, shared, None, order, weights)) == repr(
        S.layer_records(layers, shared)
    )
    counted = S.whatif_rows(layers)
    pd.testing.assert_frame_equal(
        S.whatif_by_layer(layers, shared, order, counted), S.whatif_by_layer(layers, shared)
    )
    pd.testing.assert_frame_equal(S.whatif_overview(layers, counted), S.whatif_overview(layers))
    hist = T.sum_histogram_frame(tabs["histograms"])
    for kind in S.HIST_KINDS:
        a, b = (
            S.heatmap_matrix(hist, layers, kind, shared, order),
            S.heatmap_matrix(hist, layers, kind, shared),
        )
        assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])
    pd.testing.assert_frame_equal(
        timeline.lost_by_step(layers, "fp16", weights), timeline.lost_by_step(layers, "fp16")
    )


@pytest.mark.parametrize("unit", [0, 1, 2, 3, 4])
def test_byte_sizes_near_a_thousand_of_a_unit_read_as_numbers(unit: int) -> None:
    """1000 to 1023 of a unit printed as "1e+03 KiB" and "1.01e+03 MiB" (3 significant digits in ``.3g``). Every
    size from 990 to 1030 of each unit reads back, in plain digits, to within half a unit of its 3rd digit."""
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    for k in np.arange(990.0, 1030.0, 0.25):
        v = k * 1024**unit
        text = filters.nbytes(v)
        number, name = text.split(" ")
        assert re.fullmatch(r"[0-9][0-9,]*(\.[0-9]+)?", number), text
        digits = number.replace(",", "")
        back = float(digits) * scale[name]
        # the last digit shown is within half a step of the value (3 significant, or every integer digit)
        step = (
            10.0 ** (math.floor(math.log10(float(digits))) - 2) if "." in digits or len(digits) <= 3 else 1.0
        )
        assert abs(back - v) <= (0.5 * step) * scale[name] + 0.5, (v, text)


def test_an_sqnr_beside_its_rule_shows_the_side_it_falls_on() -> None:
    """The what-if block table showed MXFP4's 17.987 dB as "18.0 dB", shaded as failing "at least 18 dB", and the
    next row's passing 18.046 dB as "18.0 dB" too. A cell shows the digits that tell it from its recipe's rule;
    the advisor's reason, the footnote, says the same number."""
    sqnr = 10 * math.log10(1.0 / 10 ** (-17.987 / 10))  # 17.987 dB: the signal's power over the noise's
    rec = {
        "block_what_if": {
            "layers": [
                {"module": "a", "choice": "bf16", "recipes": {"mxfp4": {"sqnr_db": sqnr, "fails": "SQNR"}}},
                {"module": "b", "choice": "mxfp4", "recipes": {"mxfp4": {"sqnr_db": 18.046}}},
                {"module": "c", "choice": "mxfp4", "recipes": {"mxfp4": {"sqnr_db": 31.24}}},
            ],
            "rules": {"fp4_sqnr_min_db": 18.0, "mxfp8_sqnr_min_db": 28.0},
        }
    }
    tab = blocks.table(rec)
    assert tab is not None
    assert [r["cells"][0]["sqnr"] for r in tab["rows"]] == ["17.99 dB", "18.0 dB", "31.2 dB"]
    assert block_losses.db_text(sqnr, 18.0) == "17.99 dB" and block_losses.db_text(sqnr) == "18.0 dB"


def test_byte_sizes_show_three_significant_digits_with_their_trailing_zeros() -> None:
    """The verdict's FP32 peak read "20 MiB" beside the memory section's FP32 total "20.5 MiB": two figures, one
    shown to fewer digits, as if rounded. Every size of 1 to 999 of a unit shows 3 significant digits now, its
    trailing zeros kept, and reads back to within half a unit of its 3rd digit."""
    assert filters.nbytes(20 * 2**20) == "20.0 MiB" and filters.nbytes(20.5 * 2**20) == "20.5 MiB"
    for k in np.geomspace(1.0, 999.0, 400):
        number, unit = filters.nbytes(k * 2**20).split(" ")
        digits = number.replace(".", "").lstrip("0")
        assert unit == "MiB" and len(digits) == 3, (k, number)
        step = 10.0 ** (math.floor(math.log10(float(number))) - 2)
        assert abs(float(number) - k) <= 0.5 * step + 1e-9, (k, number)


@pytest.mark.parametrize(
    "label",
    ["FP8 E4M3 underflow, current scaling", 'a "quoted" \\ label', "</style><script>x</script>", "μ · ½"],
)
def test_a_css_label_is_one_string_that_reads_back(label: str) -> None:
    """A column label written into a style element: one quoted CSS string, nothing in it that ends the string
    or the element, and CSS's own unescaping (a hex escape and the one space after it) gives the label back."""
    text = str(filters.css_string(label))
    body = text[1:-1]
    assert text[0] == text[-1] == '"' and not set('"<>') & set(body)
    assert re.sub(r"\\([0-9a-f]{1,6}) ?", lambda m: chr(int(m.group(1), 16)), body) == label


def test_templates_found_in_the_source_tree() -> None:
    # editable install or plain checkout: the repository's folder, which holds every template the page uses
    assert templates_dir().resolve() == (ROOT / "reports" / "templates").resolve()
    assert {"report.html.j2", "report.css", "report.js"} <= {p.name for p in templates_dir().iterdir()}


@pytest.fixture(scope="module")
def fresh_interpreter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One fresh interpreter for the two tests below (each interpreter's start, pandas, matplotlib and jinja's
    imports, took seconds of the suite): first the run directory read, advised and rendered, then whether torch
    was loaded; then a synthetic run rendered, and whether pyplot was loaded by any of those renders; then
    ``precprof.Profiler`` and ``precprof.training.train`` used. Its folder and the lines it printed."""
    tmp_path = tmp_path_factory.mktemp("fresh-interpreter")
    tables, summary = synthetic_run("fp16", steps=6)
    T.write_tables(tmp_path, tables)
    T.write_summary(tmp_path, summary)
    code = (
        "import sys, precprof\n"
        "from precprof import pipeline, training\n"
        "from precprof.cli import main\n"
        f"rec = precprof.recommend({str(tmp_path)!r})\n"
        f"page = pipeline.rerender({str(tmp_path)!r}, target='a100')\n"
        "try:\n"
        f"    main(['report', {str(tmp_path)!r}, '--out', {str(tmp_path / 'cli.html')!r}])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(rec.format, page.name, 'torch' in sys.modules)\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from report_fixtures import gpt_layers, synthetic_run\n"
        "from precprof.report import render_report\n"
        "tabs, summary = synthetic_run('bf16', layers=gpt_layers(n_layer=1)[:4], steps=2, sample_every=1)\n"
        f"render_report(tabs, summary, {str(tmp_path / 'r.html')!r})\n"
        "print('pyplot', 'matplotlib.pyplot' in sys.modules)\n"
        "precprof.Profiler\n"
        "print('torch' in sys.modules)\n"
        "print(training.train.__module__)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return tmp_path, res.stdout.splitlines()


def test_rendering_never_imports_pyplot(fresh_interpreter: tuple[Path, list[str]]) -> None:
    """The fresh interpreter's renders (the CLI's, ``rerender``'s, ``render_report``'s): pyplot never loaded."""
    tmp_path, lines = fresh_interpreter
    assert lines[-3] == "pyplot False", "pyplot was imported"
    assert (tmp_path / "r.html").stat().st_size > 10_000


@pytest.mark.parametrize(("run_mode", "twice"), [("fp32", False), ("fp16", True)])
def test_memory_saving_is_stated_once_against_an_fp32_run(run_mode: str, twice: bool) -> None:
    tabs, summary = synthetic_run(run_mode, layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    rec = {**recommendation_dict(), "format": "bf16", "loss_scale": None}
    verdict = section(render_html(tabs, summary, rec), "verdict")
    saving = verdict.split("expected memory saving</dt>")[1].split("</dd>")[0]
    assert "against this run" in saving
    # against an fp32 run, "against this run" is the saving against FP32: a second clause would repeat it
    assert ("less than FP32" in saving) is twice


def test_the_verdicts_peaks_and_the_memory_sections_parts_say_what_each_is() -> None:
    """The verdict box gave FP32's projected allocator peak (145 MiB), the memory section's projection FP32's
    parts held (42.6 MiB), neither saying it was not the other: a reader saw two FP32 memories that disagree.
    Each names the other's figure, the same figures the box and the table show."""
    tabs, summary = synthetic_run("bf16", layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    # this run's own mode projected too, as a real run's projection has it: its peak is then projected
    own = [{**r, "source": "projected"} for r in summary[T.SUMMARY_MEMORY] if r["source"] == "measured"]
    summary[T.SUMMARY_MEMORY] = [*summary[T.SUMMARY_MEMORY], *own]
    rec = {**recommendation_dict(), "format": "fp32", "loss_scale": None}
    page = render_html(tabs, summary, rec)

    def text(fragment: str) -> str:
        return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", fragment))

    saving = text(section(page, "verdict").split("expected memory saving</dt>")[1].split("</dd>")[0])
    peak = re.search(r"→ FP32 peak (\S+ \S+)\)", saving)
    parts = re.search(
        r"The memory section's projected totals add up those parts alone \(FP32: (\S+ \S+)\)", saving
    )
    assert peak is not None and parts is not None, saving
    memory = section(page, "memory")
    table = memory.split("<h3>Projected per precision mode</h3>", 1)[1].split("</table>", 1)[0]
    fp32_row = re.search(r'<td class="first" data-label="mode">fp32</td>.*?<strong>(.*?)</strong>', table)
    assert fp32_row is not None and fp32_row.group(1) == parts.group(1)
    lead = text(table.split("</p>", 1)[0])
    assert f"FP32's {parts.group(1)} here is a peak of {peak.group(1)} there" in lead, lead
    assert peak.group(1) != parts.group(1)  # the two quantities differ in this run: each says which it is


def test_a_peak_below_the_parts_names_the_part_it_did_not_hold() -> None:
    """The memory texts said an allocator peak "adds what else is alive at the peak" to the parts, beside an FP32
    peak 1.5 MiB below FP32's parts: the peak came early in backward, before any gradient was allocated, and the
    report said so nowhere. With a breakdown of the peak that holds no gradients, both the verdict box and the
    projection table say the parts need not be alive at once and name the gradients; the box's caveat is a
    block of its own, not a run-on of the figures' sentence."""
    tabs, summary = synthetic_run("fp32", layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    own = [{**r, "source": "projected"} for r in summary[T.SUMMARY_MEMORY] if r["source"] == "measured"]
    summary[T.SUMMARY_MEMORY] = [*summary[T.SUMMARY_MEMORY], *own]
    mem = tabs["memory"]
    held = T.memory_at(mem, "")
    step = int(held[T.STEP].max())
    comp = held.groupby(T.COMPONENT)[T.BYTES].sum()
    # the peak, early in backward: the weights, the optimizer's states and the saved activations, no gradient yet
    at_peak = [
        {T.STEP: step, T.COMPONENT: c, T.MODULE: "", T.BYTES: int(comp[c]), T.MOMENT: T.MOMENT_PEAK}
        for c in (T.PARAMETERS, T.OPTIMIZER_STATES, T.ACTIVATIONS)
    ]
    at_peak.append(
        {
            T.STEP: step,
            T.COMPONENT: T.TEMPORARIES,
            T.MODULE: T.PHASE_BACKWARD,
            T.BYTES: 1024,
            T.MOMENT: T.MOMENT_PEAK,
        }
    )
    rows = [{**r, T.PHASE: T.PHASE_BACKWARD} for r in at_peak]
    tabs["memory"] = T.frame("memory", pd.concat([mem, pd.DataFrame(rows)], ignore_index=True))
    parts = float(comp[[T.PARAMETERS, T.GRADIENTS, T.OPTIMIZER_STATES, T.ACTIVATIONS]].sum())
    peak = sum(r[T.BYTES] for r in at_peak)
    assert peak < parts  # the situation the texts must explain: the peak is below the parts added up
    rec = {**recommendation_dict(), "format": "bf16", "loss_scale": None}
    page = render_html(tabs, summary, rec)

    def text(fragment: str) -> str:
        return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", fragment))

    box = section(page, "verdict").split("expected memory saving</dt>")[1].split("</dd>")[0]
    basis = re.search(r'<div class="what" id="memory-saving-basis">(.*?)</div>', box)
    assert basis is not None, box
    assert basis.group(1).startswith("Allocator peaks, projected from the parts at the peak")
    assert "(this run's peak, in backward, held no gradients)" in basis.group(1)
    memory = section(page, "memory")
    lead = text(memory.split("<h3>Projected per precision mode</h3>", 1)[1].split("</p>", 1)[0])
    assert "add what else is alive" not in lead
    assert "parts held at different moments can add up to more than a peak" in lead, lead
    assert "(this run's peak, in backward, held no gradients)" in lead, lead


def test_a_rerender_drops_the_report_error_it_fixes(tmp_path: Path) -> None:
    tabs, summary = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    summary[T.SUMMARY_ERRORS] = [
        "report: UndefinedError: 'x' is undefined",
        "memory projection: ValueError: no parameters",
    ]
    T.write_tables(tmp_path, tabs)
    T.write_summary(tmp_path, summary)
    page = render_run_dir(tmp_path).read_text()
    # this render is the report: its earlier failure is gone; the projection's still stands
    assert "UndefinedError" not in page and "memory projection: ValueError: no parameters" in page
    assert T.read_summary(tmp_path)[T.SUMMARY_ERRORS] == summary[T.SUMMARY_ERRORS]  # data never rewritten


def test_reading_advising_and_rendering_a_run_never_import_torch(
    fresh_interpreter: tuple[Path, list[str]],
) -> None:
    """``import precprof``, the advisor, the report and the ``precprof report`` command read run directories
    without torch (seconds of imports); ``precprof.Profiler`` and ``precprof.training.train`` load it when first
    used."""
    tmp_path, lines = fresh_interpreter
    first, second, third = lines[-4], lines[-2], lines[-1]
    assert first.endswith("report-a100.html False"), lines
    assert second == "True" and third == "precprof.training.loop"
    assert (tmp_path / "cli.html").read_text().lstrip().lower().startswith("<!doctype html")


class DollarNet(nn.Module):
    """Layers whose names hold ``$``: matplotlib reads ``$...$`` as math, and a name it cannot parse as math
    (``cost_$5_and_$6``) had the report fail to draw."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"cost_$5_and_$6": nn.Linear(8, 16), "$x$": nn.Linear(16, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["$x$"](torch.relu(self.layers["cost_$5_and_$6"](x)))


def test_module_names_with_dollars_are_drawn_as_they_are(tmp_path: Path) -> None:
    from matplotlib.text import Text

    from precprof.report.plots import plain

    torch.manual_seed(0)
    prof = _two_steps(DollarNet())
    page = prof.report(tmp_path / "run" / "report.html").read_text()
    assert "layers.cost_$5_and_$6" in section(page, "layers")
    assert page.count("data:image/png;base64") >= 3  # the heatmaps were drawn
    for name in ("layers.cost_$5_and_$6", "layers.$x$", "$2^{3}$ plain"):
        assert Text(text=plain(name))._preprocess_math(plain(name)) == (name, False)  # letter for letter


class EmbedHead(nn.Module):
    """An embedding whose unused rows get no gradient (no intended update) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx)).squeeze(-1)


def _embed_head_run(
    dtype: torch.dtype, steps: int = 4
) -> tuple[dict[str, pd.DataFrame], precprof.Recommendation]:
    """A real loop training EmbedHead held in ``dtype`` at lr 1e-5 (updates far below half a bf16 ulp), only
    tokens 0..15 used, every step sampled and every update element recorded; its tables and the advisor's
    recommendation."""
    from precprof.analysis.advisor import AdvisorConfig

    torch.manual_seed(0)
    model = EmbedHead().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, update_sample=1 << 16)
    with prof:
        for _ in range(steps):
            idx, y = torch.randint(0, 16, (8, 4)), torch.randn(8, 4)
            loss = nn.functional.mse_loss(model(idx).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    tabs = prof.tables()
    summary = {T.SUMMARY_CAPTURE: prof.summary(), T.SUMMARY_MODEL: {"n_params": 2_113}}
    return tabs, precprof.recommend(tabs, config=AdvisorConfig(small_model_params=0), summary=summary)


def test_layer_table_lost_updates_are_the_findings_share() -> None:
    """The per-layer table's 'updates lost in BF16 weights' and the bf16_lost_updates finding divide by the
    same intended updates (nonzero gradient or moved weight): the embedding's 48 unused rows are no update
    lost, so the two numbers agree (by every sampled element the table said 22%, the finding 99.8%)."""
    tabs, rec = _embed_head_run(torch.bfloat16)
    upd = tabs["layers"][tabs["layers"][T.TENSOR] == T.WEIGHT_UPDATE]
    by = upd.groupby(T.MODULE)[[T.LOST_UPDATE_BF16, T.NUMEL, T.ZEROS]].sum()
    assert by.loc["embed", T.ZEROS] >= 48 * 32 * 4  # rows 16..63 get no gradient on any of the 4 steps
    table = {r["module"]: r["lost_update_bf16"] for r in S.layer_records(tabs["layers"])}
    finding = rec.finding("bf16_lost_updates")
    assert finding is not None and finding.severity == "critical"
    for m in ("embed", "head"):
        share = by.loc[m, T.LOST_UPDATE_BF16] / (by.loc[m, T.NUMEL] - by.loc[m, T.ZEROS])
        assert table[m] == pytest.approx(share) and share > 0.9
        shown = re.search(rf"\b{m} ([0-9.]+)%", finding.message)
        assert shown is not None and float(shown.group(1)) == pytest.approx(100 * table[m], abs=0.06)
    assert by.loc["embed", T.LOST_UPDATE_BF16] / by.loc["embed", T.NUMEL] < 0.5  # the old denominator's


def test_timeline_weight_update_row_shows_the_lost_updates() -> None:
    """The 'over the run' figure's weight-update row is the share of intended updates lost in the weights'
    format, step by step: bf16 for a run holding bf16 weights, fp16 (what fp16 master weights would lose) for
    fp32 weights; it read underflow_fp16 of the update rows, always 0, and was white while the findings said
    nearly every update was lost."""
    from precprof.report import timeline

    for dtype, fmt, col in (
        (torch.bfloat16, "bf16", T.LOST_UPDATE_BF16),
        (torch.float32, "fp16", T.LOST_UPDATE_FP16),
    ):
        tabs, rec = _embed_head_run(dtype)
        finding = rec.finding(f"{fmt}_lost_updates")
        assert finding is not None and finding.numbers["share"] > 0.5
        upd = tabs["layers"][tabs["layers"][T.TENSOR] == T.WEIGHT_UPDATE]
        per_step = upd.groupby(T.STEP)[[col, T.NUMEL, T.ZEROS]].sum()
        tl = timeline.timeline(tabs["layers"])
        assert tl is not None and tl.update_format == fmt and not tl.aggregated
        row = tl.share[tl.kinds.index(T.WEIGHT_UPDATE)]
        want = per_step[col] / (per_step[T.NUMEL] - per_step[T.ZEROS])
        assert list(tl.starts) == list(per_step.index)
        np.testing.assert_allclose(row, want.to_numpy())
        assert (row > 0.5).all()  # red on every step, as the finding says
        assert per_step[col].sum() == finding.numbers["lost"]
        assert tl.label(T.WEIGHT_UPDATE) == f"weight updates lost\nin {fmt.upper()} weights"
        fig = timeline.timeline_figure(tl)
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert f"weight updates lost\nin {fmt.upper()} weights" in labels


def test_a_run_that_sampled_no_step_says_why_it_has_no_memory(tmp_path: Path) -> None:
    """``sample_every=0``: no step sampled, so no memory measured, and the page said only "No memory was
    recorded."; it says why and what measures it."""
    import torch

    import precprof

    model = torch.nn.Linear(4, 4)
    with precprof.Profiler(model, sample_every=0, out=tmp_path / "run") as prof:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            prof.step()
    prof.save()
    page = render_run_dir(tmp_path / "run").read_text()
    assert "No memory was recorded. Memory is measured on sampled steps, and no step was sampled" in page


def test_a_run_that_sampled_no_step_records_autocast_as_not_observed(tmp_path: Path) -> None:
    """``sample_every=0`` under bf16 autocast (a callback's run: its config names the precision, no plan): no
    recorded forward pass saw autocast, and summary.json said ``{"enabled": false}``, autocast off, and the
    page's precision row "no autocast". It records null (not observed), and the page says that."""
    model = torch.nn.Linear(4, 4)
    with precprof.Profiler(model, sample_every=0, out=tmp_path / "run") as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(2, 4))
            assert out.dtype == torch.bfloat16
            out.float().sum().backward()
            prof.step()
    prof.save(summary={T.SUMMARY_CONFIG: {"precision": "bf16"}}, render=True)
    summary = T.read_summary(tmp_path / "run")
    assert (
        summary[T.SUMMARY_CAPTURE]["autocast"] is None
        and summary[T.SUMMARY_CAPTURE]["precision_seen"] is None
    )
    env = section((tmp_path / "run" / T.REPORT_FILE).read_text(), "environment")
    env = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", env))
    assert "bf16: autocast not observed (no recorded forward pass)" in env and "no autocast" not in env
    # the built-in loop's plan says it ran no autocast, sampled or not (reviewer r2: its fp32 and bf16-pure runs
    # of --sample-every 0 were "not observed")
    for precision, dtype in (("fp32", "float32"), ("bf16-pure", "bfloat16")):
        cfg = {"precision": precision, "plan": {"param_dtype": dtype}}
        said = environment.precision_text(cfg, {"autocast": None})
        assert said.endswith("no autocast") and "not observed" not in said, said


def test_a_loss_given_every_third_step_is_one_line() -> None:
    """A loop that passes its loss every third step over 300 steps: the curve was drawn through the gaps of
    the steps without one, every point alone and, past 60 points, without a marker: an empty plot. The steps
    with a loss are joined."""
    import pandas as pd

    n = 300
    steps = T.frame(
        "steps",
        pd.DataFrame(
            {
                T.STEP: range(n),
                T.LOSS: [5.0 - s / 100 if s % 3 == 0 else float("nan") for s in range(n)],
                T.LOSS_SCALE: [1.0] * n,
                T.SKIPPED: [False] * n,
                T.NO_LOSS: [s % 3 != 0 for s in range(n)],
            }
        ),
    )
    fig = plots.training_figure(steps)
    assert fig is not None
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "loss"]
    xs, ys = line.get_data()
    assert list(xs) == list(range(0, n, 3)) and all(y == y for y in ys)  # no nan breaks the line


def test_a_diverged_runs_loss_is_on_a_log_axis_and_its_nan_norms_are_marked() -> None:
    """A run whose loss went 5.5, 7.1, 381, 5.7e3, 1.6e6, 3.4e9, then nan: on a linear axis the first five steps
    lay on the zero line, and the gradient-norm plot stopped at step 5 with no mark of the nan norms after it.
    The loss axis is logarithmic, the norm plot spans the loss plot's steps, and each nan norm is marked."""
    finite = [5.5, 7.1, 381.0, 5.7e3, 1.6e6, 3.4e9]
    n = 30
    loss = np.array(finite + [math.nan] * (n - len(finite)))
    norm = np.array([1.1, 2.3, 110.0, 628.0, 6.0e3, 3.0e6] + [math.nan] * (n - len(finite)))
    steps = pd.DataFrame(
        {
            T.STEP: range(n),
            T.LOSS: loss,
            T.LOSS_SCALE: 1.0,
            T.SKIPPED: False,
            T.GRAD_NORM: norm,
            T.RESUMED: False,
        }
    )
    fig = plots.training_figure(steps)
    assert fig is not None
    loss_ax, scale_ax, norm_ax = fig.axes
    assert loss_ax.get_yscale() == "log" and "log" in loss_ax.get_ylabel()
    lo, hi = loss_ax.get_ylim()
    assert lo <= min(finite) and hi >= max(finite)
    assert norm_ax.get_xlim() == loss_ax.get_xlim() == scale_ax.get_xlim()
    assert loss_ax.get_xlim()[0] < 0 and loss_ax.get_xlim()[1] > n - 1
    (marks,) = [ln for ln in norm_ax.get_lines() if ln.get_marker() == "^"]
    np.testing.assert_array_equal(marks.get_xdata(), np.flatnonzero(np.isnan(norm)))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "gradient norm not finite (nan/inf)" in labels
    # a loop that never passed a norm, one loss nan: no norm was taken, none was not finite (tester t2)
    unclipped = steps.assign(**{T.LOSS: np.where(np.arange(n) == 20, math.nan, 2.0), T.GRAD_NORM: math.nan})
    fig = plots.training_figure(unclipped)
    assert fig is not None and [t.get_text() for t in fig.axes[2].texts] == ["no gradient norm recorded"]
    # a loop that passed no loss at all: the loss panel says so, with no numbers on an empty axis
    no_loss = steps.assign(**{T.LOSS: math.nan, T.NO_LOSS: True})
    fig = plots.training_figure(no_loss)
    assert fig is not None and [t.get_text() for t in fig.axes[0].texts] == ["no loss recorded"]
    assert list(fig.axes[0].get_yticks()) == []
    # a healthy loss (5.5 down to 2) stays on a linear axis
    healthy = steps.assign(**{T.LOSS: np.linspace(5.5, 2.0, n), T.GRAD_NORM: np.linspace(1.0, 0.5, n)})
    fig = plots.training_figure(healthy)
    assert fig is not None and fig.axes[0].get_yscale() == "linear"
    assert not [ln for ln in fig.axes[2].get_lines() if ln.get_marker() == "^"]
    # the norm went nan a step before the loss (step 4, the loss still 3.8e6): a loop that passes it every step
    # has that step marked too; a loop that passes it on some steps only has no mark where it passed none
    early = steps.assign(**{T.GRAD_NORM: np.where(np.arange(n) >= 4, math.nan, norm)})
    fig = plots.training_figure(early)
    assert fig is not None
    (marks,) = [ln for ln in fig.axes[2].get_lines() if ln.get_marker() == "^"]
    assert marks.get_xdata()[0] == 4
    sparse = healthy.assign(
        **{T.GRAD_NORM: np.where(np.arange(n) % 2 == 0, np.linspace(1.0, 0.5, n), math.nan)}
    )
    fig = plots.training_figure(sparse)
    assert fig is not None and not [ln for ln in fig.axes[2].get_lines() if ln.get_marker() == "^"]


def test_a_loss_never_finite_is_drawn_on_an_axis_without_numbers() -> None:
    """Tester t5: a run whose every loss was nan drew its marks at 1.00 on a loss axis ticked 0.96 to 1.04, which
    reads "loss 1.00" at every step. The marks are drawn on an axis without numbers, which says no loss was
    finite."""
    n = 8
    steps = pd.DataFrame(
        {
            T.STEP: range(n),
            T.LOSS: math.nan,
            T.LOSS_SCALE: 1.0,
            T.SKIPPED: False,
            T.GRAD_NORM: math.nan,
            T.RESUMED: False,
        }
    )
    fig = plots.training_figure(steps)
    assert fig is not None
    loss_ax = fig.axes[0]
    assert len(loss_ax.get_yticks()) == 0, loss_ax.get_yticks()
    (marks,) = [ln for ln in loss_ax.get_lines() if ln.get_marker() == "X"]
    assert list(marks.get_xdata()) == list(range(n))
    assert any("no finite loss" in t.get_text() for t in loss_ax.texts)


def test_the_root_module_has_one_name_in_findings_lists_numbers_and_sentences(
    synthetic: tuple[dict[str, pd.DataFrame], dict],
) -> None:
    """A parameter the root module owns (``F.linear(x, self.w)`` in the model's own forward) is the module "":
    a finding's module list showed it as an empty ``<code></code>``, its number "that module" as nothing, its
    sentence as "(root)" and the per-layer tables as "(model)". One name everywhere: the tables'."""
    from precprof.analysis.advisor import text

    tabs, summary = synthetic
    rec = recommendation_dict()
    finding = rec["findings"][0]
    finding["modules"] = ["", "lm_head"]
    finding["numbers"] = {**finding["numbers"], "max_norm_share_module": ""}
    verdict = section(render_html(tabs, summary, rec), "verdict")
    assert "<code></code>" not in verdict
    assert f"<code>{escape(S.module_label(''))}</code>, <code>lm_head</code>" in verdict
    assert f"that module</span> {escape(S.module_label(''))}" in verdict
    assert text._listing(["", "lm_head"], 4) == f"{S.module_label('')}, lm_head"
