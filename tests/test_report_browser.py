"""The report in a real browser: headless Chromium loads report.html from a file, offline, and every inline
image decodes; a screenshot of each of the three gpt-nano reports (fp32, bf16, fp16) is not blank; and at
1400 px and 800 px wide the page never scrolls sideways, no table header is cut, and at 1400 px no table
scrolls inside its box (at 800 px a wide table may, inside its own box only).

Skipped, with the reason, where no Chromium can be found (``.ci/run`` installs Debian's ``chromium``).
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from report_fixtures import gpt_layers, real_run, recommendation_dict, synthetic_run

from precprof.report import plots, render
from precprof.report import summarize as S

pytestmark = pytest.mark.browser

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
WIDTH, HEIGHT = 1400, 4000
# appended to a copy of the page: after load, writes each image's decoded width into the DOM
PROBE = """<script>
window.addEventListener("load", function () {
  var w = Array.prototype.map.call(document.images, function (i) { return i.complete ? i.naturalWidth : -1; });
  document.body.setAttribute("data-probe", w.join(","));
});
</script>"""


# put first in a copy of the page's <head>: records every JavaScript error and console.error of the page
ERROR_PROBE = """<script>
window.__errors = [];
window.addEventListener("error", function (e) { window.__errors.push(String(e.message || e)); });
window.addEventListener("unhandledrejection", function (e) { window.__errors.push(String(e.reason)); });
(function () { var err = console.error; console.error = function () {
  window.__errors.push(Array.prototype.join.call(arguments, " ")); err.apply(console, arguments); }; })();
</script>"""
# appended to a copy of the page: after load (and the page's own script), measures what a reader would see and
# writes it as JSON into the DOM:
# - page: the page's width against the window's (a page wider than the window scrolls sideways);
# - cut: header cells whose text is wider than the cell;
# - clipped: elements whose content is wider than their box and hidden or scrolled (clipped sideways);
# - scrollboxes: elements that scroll their content vertically (rows hidden behind a scrollbar);
# - images: each image's shown width over its own pixels (below 0.7 it is shown too small to read), 0 when it
#   did not decode;
# - more: texts "... and N more" (a list cut short);
# - raw: label/value cells of key-value tables that look like machine names or k=v dumps;
# - errors: JavaScript errors and console.error calls;
# - print: with the page's print styles in force (@media print rules applied, @media screen ones dropped, and
#   the beforeprint event fired), the rows of every table that are not displayed, and <details> left closed;
# - labels: there (every stackable table stacked, one block per row), cells not labelled with their column;
# - long: per long table on screen, its rows, those shown, its button, and the rows shown once it is clicked
#   and without the page's script.
LAYOUT_PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  function name(el) {
    var t = el.querySelector && el.querySelector("table");
    return el.tagName.toLowerCase() + "#" + ((t && (t.id || t.className)) || el.id || el.className);
  }
  function visible(el) { return el.offsetParent !== null || el.tagName === "BODY"; }
  var all = Array.prototype.slice.call(document.querySelectorAll("body *"));
  var cut = Array.prototype.filter.call(document.querySelectorAll("th"), function (c) {
    return visible(c) && c.scrollWidth > c.clientWidth + 1;
  }).map(function (c) { return c.textContent.trim(); });
  var clipped = [], scrollboxes = [];
  all.forEach(function (el) {
    if (!visible(el) || el.tagName === "IMG") { return; }
    var s = getComputedStyle(el);
    if (s.overflowX !== "visible" && el.scrollWidth > el.clientWidth + 1) { clipped.push(name(el)); }
    if ((s.overflowY === "auto" || s.overflowY === "scroll") && el.scrollHeight > el.clientHeight + 1) {
      scrollboxes.push(name(el));
    }
  });
  var images = Array.prototype.map.call(document.images, function (i) {
    return {alt: i.alt.slice(0, 60), natural: i.naturalWidth, shown: i.getBoundingClientRect().width,
            ratio: i.naturalWidth ? i.getBoundingClientRect().width / i.naturalWidth : 0};
  });
  var text = document.body.innerText;
  var more = text.match(/(…|\\.\\.\\.) and \\d+ more/g) || [];
  var raw = [];
  document.querySelectorAll("table.kv tr").forEach(function (tr) {
    var k = tr.querySelector("th"), v = tr.querySelector("td");
    if (!k || !v) { return; }
    var kt = k.textContent.trim(), vt = v.textContent.trim();
    // a model's settings are the user's own k=v flags (-a n_layer=2); any other k=v is a dump
    var dump = kt !== "model settings" && /\\b[a-z][a-z0-9_]*=\\S/.test(vt);
    if (/_/.test(kt) || dump || vt === "" || vt === "—") { raw.push(kt + ": " + vt); }
  });
  var rows = document.querySelectorAll("tbody tr").length;
  // long tables on screen: the rows shown, the button's text, the rows shown once it is clicked (then clicked
  // back), and the rows shown without the page's script (the .js mark taken off, then put back)
  function shownRows(t) {
    return Array.prototype.filter.call(t.tBodies[0].rows, function (r) {
      return getComputedStyle(r).display !== "none";
    }).length;
  }
  var long = {};
  document.querySelectorAll("table.long").forEach(function (t) {
    var box = t.parentNode.nextElementSibling, rec = {rows: t.tBodies[0].rows.length, shown: shownRows(t),
      inputs: t.querySelectorAll("tbody tr.layer-input").length};
    box = box && box.classList.contains("more-rows") && !box.hidden ? box : null;
    var next = box && box.querySelector("button.next"), rest = box && box.querySelector("button.rest");
    next = next && !next.hidden ? next : null;
    rec.next = next ? next.textContent : null;
    rec.button = rest ? rest.textContent : null;
    if (next) { next.click(); rec.more = shownRows(t); rec.after_next = rest.textContent; }
    if (rest) { rest.click(); rec.opened = shownRows(t); rec.back = rest.textContent; rest.click(); rec.closed = shownRows(t); }
    document.documentElement.classList.remove("js");
    rec.unscripted = shownRows(t);
    document.documentElement.classList.add("js");
    long[t.id || t.className] = rec;
  });
  // print: the page's print rules in force, its screen-only rules off
  Array.prototype.forEach.call(document.querySelectorAll("style"), function (st) {
    st.textContent = st.textContent.replace(/@media\\s+print/g, "@media all").replace(/@media\\s+screen/g, "@media not all");
  });
  window.dispatchEvent(new Event("beforeprint"));
  // printed, every stackable table is stacked: each cell of a table with one header row shows its column's
  // label (the header's title, or the start of its text)
  var labels = [];
  document.querySelectorAll("table.stackable").forEach(function (t) {
    if (!t.tHead || t.tHead.rows.length !== 1) { return; }
    var heads = Array.prototype.map.call(t.tHead.rows[0].cells, function (th) {
      var c = th.cloneNode(true);
      c.querySelectorAll("br").forEach(function (b) { b.replaceWith(" "); });
      return {text: c.textContent.replace(/\\s+/g, " ").trim(), title: th.title};
    });
    Array.prototype.forEach.call(t.tBodies[0].rows, function (r) {
      Array.prototype.forEach.call(r.cells, function (td, i) {
        if (td.tagName !== "TD" || td.classList.contains("mod") || td.classList.contains("first")) { return; }
        var shown = getComputedStyle(td, "::before").content, h = heads[i];
        var got = shown.charAt(0) === '"' ? JSON.parse(shown) : "";
        if (!got || !h || !(got === h.title || h.text.indexOf(got) === 0)) {
          if (labels.length < 10) { labels.push((t.id || t.className) + "[" + i + "]: " + shown + " under " + (h && h.text)); }
        }
      });
    });
  });
  var unprinted = Array.prototype.filter.call(document.querySelectorAll("tbody tr"), function (r) {
    return getComputedStyle(r).display === "none" || r.hidden;
  }).length;
  var closed = Array.prototype.filter.call(document.querySelectorAll("details"), function (d) {
    return !d.open;
  }).length;
  document.body.setAttribute("data-layout", JSON.stringify({
    page: document.documentElement.scrollWidth, window: window.innerWidth, cut: cut, clipped: clipped,
    scrollboxes: scrollboxes, images: images, more: more, raw: raw, errors: window.__errors || ["no probe"],
    js: document.documentElement.classList.contains("js"), rows: rows,
    print: {unprinted: unprinted, closed: closed}, labels: labels, long: long}));
}, 0); });
</script>"""
LAYOUT_WIDTHS = (1400, 800)
# the queries FILTER_PROBE types into each table's filter box, one after the other, then clears it
FILTER_QUERIES = ("transformer.h.1", "h.1", "h.1.attn", "c_proj", "transformer.h.", "conv1d", "dropout")
# before the LAYOUT_PROBE (see ``layout``): types each query into each filter box and records the module names of
# the rows it leaves shown, as JSON in the DOM; the box cleared, the tables are as they were
FILTER_PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var found = {};
  document.querySelectorAll("input.filter").forEach(function (input) {
    var table = document.getElementById(input.getAttribute("data-table")), got = {};
    QUERIES.forEach(function (q) {
      input.value = q;
      input.dispatchEvent(new Event("input"));
      got[q] = Array.prototype.filter.call(table.tBodies[0].rows, function (r) { return r.style.display !== "none"; })
        .map(function (r) { return r.querySelector("td.mod code").textContent; });
    });
    input.value = "";
    input.dispatchEvent(new Event("input"));
    found[table.id] = got;
  });
  document.body.setAttribute("data-filter", JSON.stringify(found));
}, 0); });
</script>""".replace("QUERIES", json.dumps(list(FILTER_QUERIES)))


def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(
        "no headless Chromium on PATH (looked for: " + ", ".join(BROWSERS) + "); install Debian's chromium "
        "(apt-get install -y chromium) to run the browser tests"
    )


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium offline with a throwaway profile; --no-sandbox because CI runs as root."""
    cmd = [
        browser(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        "--proxy-server=127.0.0.1:9",  # nothing may be fetched: a self-contained page does not need to
        f"--user-data-dir={profile}",
        *args,
    ]
    env = {**os.environ, "HOME": str(profile)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)


@pytest.fixture(scope="session")
def runs_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "report-runs"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_screenshot_is_not_blank_and_images_decode(precision: str, runs_base: Path, tmp_path: Path) -> None:
    browser()  # skip before training when there is no browser
    run = real_run(precision, runs_base)
    report = run / "report.html"

    shot = tmp_path / f"report-{precision}.png"
    res = chromium(
        [f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", report.as_uri()], tmp_path / "p1"
    )
    assert shot.exists(), f"no screenshot: {res.stderr[-2000:]}"
    im = Image.open(shot).convert("RGB")
    assert im.size == (WIDTH, HEIGHT)
    px = np.asarray(im, dtype=np.int16)
    not_white = (px.min(axis=2) < 235).mean()
    assert not_white > 0.08, f"screenshot is nearly blank ({not_white:.1%} non-white pixels)"
    assert len(np.unique(px.reshape(-1, 3)[::37], axis=0)) > 200  # text, plots and colours, not a flat page
    # the page's CSS applied: the header band is the report's dark blue (#10263d)
    assert np.abs(px[20, 700] - np.array([0x10, 0x26, 0x3D])).max() <= 3
    # the first heatmap (blue "Blues" cells) is drawn within the first 4000 px
    blue = (px[..., 2] > px[..., 0] + 60) & (px[..., 2] > 120)
    assert blue.mean() > 0.002

    # every <img> decodes in the browser itself (naturalWidth > 0), with scripts on
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", PROBE + "</body>"))
    dom = chromium(["--dump-dom", probe.as_uri()], tmp_path / "p2").stdout
    m = re.search(r'data-probe="([^"]*)"', dom)
    assert m is not None, "the probe script did not run"
    widths = [int(w) for w in m.group(1).split(",")]
    # training curves, "over the run", three heatmaps, memory
    assert len(widths) == report.read_text().count("<img ") == 6
    assert all(w == plots.FIG_WIDTH_PX for w in widths), widths  # drawn for the narrowest page
    assert '<html lang="en" class="js">' in dom  # the page's own script ran without an error before it

    if precision != "fp16":
        return
    # and the page reads without JavaScript: the same page with its script removed shows the same content
    text = report.read_text()
    nojs_page = tmp_path / "nojs.html"
    nojs_page.write_text(re.sub(r"<script>.*?</script>", "", text, flags=re.S))
    nojs = chromium(["--dump-dom", nojs_page.as_uri()], tmp_path / "p3").stdout
    assert '<html lang="en">' in nojs and 'id="verdict"' in nojs and nojs.count("<img ") == 6


def layout(page: Path, width: int, tmp: Path, before: str = "") -> dict:
    """The LAYOUT_PROBE's findings for ``page`` in a window ``width`` px wide, JavaScript errors recorded from
    the first line of the page on. ``before``: another probe, appended before the LAYOUT_PROBE (its load
    handler runs first, before the LAYOUT_PROBE clicks the page's buttons); the page's DOM is then under
    "dom"."""
    probe = tmp / f"layout-{width}.html"
    text = page.read_text().replace("<head>", "<head>" + ERROR_PROBE, 1)
    probe.write_text(text.replace("</body>", before + LAYOUT_PROBE + "</body>"))
    dom = chromium([f"--window-size={width},1000", "--dump-dom", probe.as_uri()], tmp / f"pl{width}").stdout
    m = re.search(r'data-layout="([^"]*)"', dom)
    assert m is not None, "the layout probe did not run"
    found = json.loads(html.unescape(m.group(1)))
    if before:
        found["dom"] = dom
    return found


MIN_IMAGE_SCALE = 0.7  # an image shown below 70% of its own pixels has text too small to read


def check_layout(page: Path, tmp: Path, before: str = "") -> dict[int, str]:
    """At 1400 and 800 px: nothing clipped sideways, no rows behind a scrollbar, every plot shown at 70% of its
    pixels or more, no JavaScript error, no raw dump, no list cut short; and printed, every row and detail.
    ``before``: another probe in the same pages (see ``layout``); their DOMs by width."""
    doms = {}
    for width in LAYOUT_WIDTHS:
        found = layout(page, width, tmp, before)
        doms[width] = found.pop("dom", "")
        at = f"at {width} px"
        assert found["window"] == width
        assert found["errors"] == [], f"JavaScript errors {at}: {found['errors']}"
        assert found["js"], "the page's script did not run"
        assert found["page"] <= width, f"the page scrolls sideways {at}: {found['page']} px"
        assert found["cut"] == [], f"table headers cut {at}: {found['cut']}"
        assert found["clipped"] == [], f"content clipped sideways {at}: {found['clipped']}"
        assert found["scrollboxes"] == [], f"rows hidden behind a scrollbar {at}: {found['scrollboxes']}"
        small = [i for i in found["images"] if i["ratio"] < MIN_IMAGE_SCALE]
        assert small == [], f"plots shown below {MIN_IMAGE_SCALE:.0%} of their pixels {at}: {small}"
        assert found["more"] == [], f"lists cut short {at}: {found['more']}"
        assert found["raw"] == [], f"raw values {at}: {found['raw']}"
        assert found["print"] == {"unprinted": 0, "closed": 0}, f"printed {at}: {found['print']}"
        assert found["labels"] == [], f"stacked cells without their column's label {at}: {found['labels']}"
        for name, t in found["long"].items():  # the first rows, and buttons for the next ones and for all
            check_long_table(name, t)
            assert t["unscripted"] == t["rows"], (name, t)  # no script, no button: every row shows
    return doms


def check_long_table(name: str, t: dict[str, Any]) -> None:
    """A long table as the layout probe found it: its first rows shown; a button for the next ``MORE_ROWS``
    where more than that many are left, which shows them; a button for all, which shows every row and then
    offers the first rows again, which it shows."""
    first, more = render.FIRST_ROWS, render.MORE_ROWS
    every = f"Show all {t['rows']:,} rows"
    if t["inputs"]:  # the per-layer table's rows of layers' inputs
        every += f" ({t['rows'] - t['inputs']:,} layers and {t['inputs']:,} of their inputs)"
    if t["rows"] <= first:
        assert t["shown"] == t["rows"] and t["button"] is None and t["next"] is None, (name, t)
        return
    assert t["shown"] == first, (name, t)
    assert t["button"] == every, (name, t)
    if t["rows"] - first > more:
        assert t["next"] == f"Show the next {more} rows" and t["more"] == first + more, (name, t)
        want = every if t["rows"] > first + more else f"Show the first {first} rows"
        assert t["after_next"] == want, (name, t)
    else:
        assert t["next"] is None, (name, t)
    assert t["opened"] == t["rows"] and t["back"] == f"Show the first {first} rows", (name, t)
    assert t["closed"] == first, (name, t)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_page_fits_at_1400_and_800_px(precision: str, runs_base: Path, tmp_path: Path) -> None:
    browser()
    check_layout(real_run(precision, runs_base) / "report.html", tmp_path)


def test_the_layer_tables_rows_add_up_to_the_layers_profiled_and_their_inputs(
    tmp_path: Path, block_formats_on: None
) -> None:
    """gpt-nano's per-layer table, with the block formats evaluated (the default outside this suite), has a row
    of its own for each attention projection's input (the attention function's output, no module's): the
    header said "layers profiled 33" and the table's button "Show all 37 rows", and nothing said what the
    other 4 were. The rows counted in the page's HTML: the button and the table's lead say how many are
    layers (the header's count) and how many are inputs."""
    browser()
    page = real_run("fp32", tmp_path / "runs") / "report.html"
    text = page.read_text()
    table = re.search(r'<table[^>]*id="layer-table".*?<tbody>(.*?)</tbody>', text, flags=re.S)
    assert table is not None
    names = [
        html.unescape(re.sub(r"<[^>]+>", "", m))
        for m in re.findall(r'<td class="mod"><code>(.*?)</code></td>', table.group(1), flags=re.S)
    ]
    assert len(names) == table.group(1).count("<tr")
    inputs = sum(n.endswith(":input") for n in names)
    layers = len(names) - inputs
    header = re.search(r'layers profiled</span><span class="v">([\d,]+)<', text)
    assert header is not None and int(header.group(1).replace(",", "")) == layers
    assert inputs == 4 and len(names) > render.FIRST_ROWS  # the run has both, and the button
    lead = f"Of its {len(names)} rows, {inputs} are not layers but a layer's input"
    assert lead in text and f"“layers profiled” counts the other {layers}." in text
    for width in LAYOUT_WIDTHS:
        found = layout(page, width, tmp_path)["long"]["layer-table"]
        assert found["button"] == f"Show all {len(names)} rows ({layers} layers and {inputs} of their inputs)"


def test_page_of_a_run_that_went_nan_fits(tmp_path: Path) -> None:
    """A run that died with nan (incomplete banner, nan/inf columns filled, the widest magnitudes) and a module
    name far longer than a table column: still no sideways page, no cut header, no scrolling table at 1400."""
    browser()
    layers = gpt_layers(n_layer=1)
    layers[4].name = "encoder.block_with_a_descriptive_and_really_quite_long_name_chosen_by_its_author.proj"
    tabs, summary = synthetic_run("fp16", layers=layers, steps=8, sample_every=1, nan_at=5)
    page = render.render_report(tabs, summary, tmp_path / "report.html", recommendation_dict("fp16"))
    text = page.read_text()
    assert 'id="incomplete"' in text and "encoder.<wbr>block_with" in text
    check_layout(page, tmp_path)


def test_page_of_a_large_model_hides_no_row_and_cuts_no_list(tmp_path: Path) -> None:
    """A 20-block GPT (185 modules, 618 what-if rows, 81 linear layers FP8-eligible and named by a finding):
    every row is on the page (long tables show their first rows, then the next ones, then all; print shows them
    all), every module of a list is named, and the page still fits at both widths."""
    browser()
    layers = gpt_layers(n_layer=20)
    tabs, summary = synthetic_run("fp16", layers=layers, steps=4, sample_every=2)
    rec = recommendation_dict("fp16")
    linear = [ly.name for ly in layers if ly.type in ("Conv1D", "Linear")]
    rec["fp8_layers"] = linear
    rec["findings"][0]["modules"] = linear
    page = render.render_report(tabs, summary, tmp_path / "report.html", rec)
    text = page.read_text()
    verdict = text.split('id="verdict"', 1)[1].split("</section>", 1)[0]
    assert all(f"<code>{name}</code>" in verdict for name in linear)
    whatif = text.split('id="whatif-table"', 1)[1].split("</table>", 1)[0]
    # the what-if table holds every (layer, kind) row, more than its first rows and the next ones
    assert (
        whatif.count("<tr") - 1
        == len(S.whatif_by_layer(tabs["layers"]))
        > render.FIRST_ROWS + render.MORE_ROWS
    )
    doms = check_layout(page, tmp_path, before=FILTER_PROBE)
    # the filter boxes: a query that is whole parts of a module's name keeps that module's rows, "h.1" not h.10 to
    # h.19 ("transformer.h.1" kept 11 blocks' rows); any other query is looked for in the row's text, a type word
    # that also names a module ("dropout", as h.N.mlp.dropout; "norm" as Llama's model.norm) too: it kept the
    # rows of the modules it named alone, not transformer.drop nor attn.resid_dropout
    types = {ly.name: ly.type for ly in layers}
    for width, dom in doms.items():
        m = re.search(r'data-filter="([^"]*)"', dom)
        assert m is not None, "the filter probe did not run"
        for table, got in json.loads(html.unescape(m.group(1))).items():
            names = list(dict.fromkeys(n for shown in got.values() for n in shown))
            every = re.findall(
                r'<td class="mod"><code>(.*?)</code>', text.split(f'id="{table}"', 1)[1].split("</table>")[0]
            )
            rows = [html.unescape(n.replace("<wbr>", "")) for n in every]
            block_1 = [n for n in rows if n.startswith("transformer.h.1.")]
            assert block_1 and got["transformer.h.1"] == got["h.1"] == block_1, (
                width,
                table,
                got["h.1"][-3:],
            )
            assert got["h.1.attn"] == [n for n in block_1 if ".attn." in n]
            assert got["c_proj"] == [n for n in rows if n.split(":")[0].endswith(".c_proj")]
            assert got["transformer.h."] == [n for n in rows if "transformer.h." in n]
            assert got["conv1d"] == [n for n in rows if types.get(n.split(":")[0]) == "Conv1D"]
            assert got["dropout"] == [n for n in rows if types.get(n.split(":")[0]) == "Dropout"]
            assert len(names) < len(rows)


def test_page_with_a_200_character_module_name_fits(tmp_path: Path) -> None:
    """A 200-character module name (a key generated from a config path) in a finding's text, in its numbers
    ('that module'), in its inline module list and first in a folded one, in the verdict's lists and reasons:
    the name breaks where it must and the page does not scroll sideways at 1400 or 800 px (it widened the page
    to 1,776 px: findings' text has no <wbr> as tables do)."""
    browser()
    long = "blocks." + "L" * 200
    layers = gpt_layers(n_layer=1)
    layers[4].name = long
    tabs, summary = synthetic_run("fp16", layers=layers, steps=4, sample_every=1)
    rec = recommendation_dict("fp16")
    others = [ly.name for ly in layers if ly.name != long]
    rec["keep_fp32"] = [long, "lm_head"]
    rec["reasons"].append(f"The largest gradient norm share is lost in {long}.")
    rec["findings"][0].update(
        message=f"{long} produces values up to 2^19, beyond FP16's 65504; worst: {long} 12.5%.",
        modules=[long, *others[:2]],
    )
    rec["findings"][2].update(
        numbers={"share_at_scale_1": 0.413, "max_norm_share_module": long}, modules=[long, *others[:20]]
    )
    page = render.render_report(tabs, summary, tmp_path / "report.html", rec)
    text = page.read_text()
    fold = f'<details class="modlist"><summary>{1 + len(others[:20])} modules: <code>{long}</code>'
    assert len(others) > 12 and text.count(fold) == 1  # first in a folded list
    assert text.count(f"<code>{long}</code>") >= 4 and f"worst: {long} 12.5%" in text
    check_layout(page, tmp_path)


def test_compare_page_runs_table_fits_at_1400_and_800_px(tmp_path: Path) -> None:
    """The compare page (no script: its tables are never stacked at 1400 px) with four runs, one stopped with
    a long reason: the Runs table scrolled inside its box at 1400 px, the status cut and the 'report' column
    hidden; its long cells (loss scaling, advisor, status) now wrap and nothing is clipped at either width."""
    browser()
    from test_compare import _four_runs

    from precprof.report import compare_page

    comp = _four_runs(
        loss_scaling="dynamic",
        init_scale=2.0**16,
        final_scale=2.0**16,
        steps=105,
        steps_at_final_scale=105,
        tokens_per_s=12_345.0,
        recommendation={"format": "fp32"},
        report=str(tmp_path / "run" / "report.html"),
    )
    comp.runs[2] = dataclasses.replace(
        comp.runs[2], status="incomplete", reason="interrupted (Ctrl-C, SIGINT)"
    )
    page = tmp_path / "compare.html"
    page.write_text(compare_page.render(comp, base_dir=tmp_path))
    text = page.read_text()
    assert text.count("dynamic · stayed at 2^16, never changed in 105 steps") == 4
    assert (
        "incomplete: interrupted (terminated, SIGTERM)" in text and text.count('href="run/report.html"') == 4
    )
    for width in LAYOUT_WIDTHS:
        found = layout(page, width, tmp_path)
        assert found["errors"] == [] and found["page"] <= width, (width, found["page"], found["errors"])
        assert found["clipped"] == [], f"content clipped sideways at {width} px: {found['clipped']}"


# appended to a copy of the page: after load (and the page's own script), whether the per-layer table is stacked,
# and its type cells whose text runs past the cell (over the next one)
TYPE_PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var t = document.getElementById("layer-table"), over = [];
  t.querySelectorAll("tbody > tr > td:nth-child(3)").forEach(function (td) {
    if (td.offsetParent === null) { return; }
    var r = document.createRange();
    r.selectNodeContents(td);
    if (r.getBoundingClientRect().right > td.getBoundingClientRect().right + 1 || td.scrollWidth > td.clientWidth + 1) {
      over.push(td.textContent);
    }
  });
  document.body.setAttribute("data-types", JSON.stringify({stacked: t.classList.contains("stacked"),
    cells: t.querySelectorAll("tbody > tr > td:nth-child(3)").length, over: over}));
}, 0); });
</script>"""


def test_a_long_module_type_stays_in_its_cell_and_the_layer_table_at_1400_px(tmp_path: Path) -> None:
    """nn.MultiheadAttention's out_proj, of type NonDynamicallyQuantizableLinear: the type printed over the
    param dtype cell of the stacked per-layer table, and its width stacked the table at 1400 px too (16 columns
    as cards, four screens of them). The type wraps between its words, in a table that stays one at 1400 px."""
    browser()
    long = "NonDynamicallyQuantizableLinear"
    layers = gpt_layers(n_layer=2)
    for ly in layers:
        if ly.name.endswith("attn.c_proj"):
            ly.type = long
    tabs, summary = synthetic_run("bf16", layers=layers, steps=4, sample_every=2)
    page = render.render_report(tabs, summary, tmp_path / "report.html", recommendation_dict("bf16"))
    text = page.read_text()
    table = text.split('id="layer-table"', 1)[1].split("</table>", 1)[0]
    assert table.count(f'title="{long}"') == 2  # the full name where the cell wraps it
    # the type probe in the layout check's pages (one browser a width, not two), run before the layout probe's
    doms = check_layout(page, tmp_path, before=TYPE_PROBE)
    for width, stacked in ((1400, False), (800, True)):
        m = re.search(r'data-types="([^"]*)"', doms[width])
        assert m is not None, "the probe did not run"
        found = json.loads(html.unescape(m.group(1)))
        assert found["cells"] == len(layers)
        assert found["stacked"] is stacked, (width, found)
        assert found["over"] == [], (width, found)
