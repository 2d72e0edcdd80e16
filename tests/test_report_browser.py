"""The report in a real browser: headless Chromium loads report.html from a file, offline, and every inline
image decodes; a screenshot of each of the three gpt-nano reports (fp32, bf16, fp16) is not blank; and at
1400 px and 800 px wide the page never scrolls sideways, no table header is cut, and at 1400 px no table
scrolls inside its box (at 800 px a wide table may, inside its own box only).

Skipped, with the reason, where no Chromium can be found (``.ci/run`` installs Debian's ``chromium``).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from report_fixtures import gpt_layers, real_run, recommendation_dict, synthetic_run

from precprof.report import render

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


# appended to a copy of the page: after load, writes the page's width against the window's, the header cells
# whose text is wider than the cell, and the scroll boxes wider than their frame, as JSON into the DOM
LAYOUT_PROBE = """<script>
window.addEventListener("load", function () {
  function name(el) { var t = el.querySelector("table"); return (t && (t.id || t.className)) || el.className; }
  var cut = Array.prototype.filter.call(document.querySelectorAll("th"), function (c) {
    return c.scrollWidth > c.clientWidth;
  }).map(function (c) { return c.textContent.trim(); });
  var scrolls = Array.prototype.filter.call(document.querySelectorAll(".scroll"), function (c) {
    return c.scrollWidth > c.clientWidth;
  }).map(name);
  document.body.setAttribute("data-layout", JSON.stringify({
    page: document.documentElement.scrollWidth, window: window.innerWidth, cut: cut, scrolls: scrolls}));
});
</script>"""
LAYOUT_WIDTHS = (1400, 800)


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
    assert blue.mean() > 0.005

    # every <img> decodes in the browser itself (naturalWidth > 0), with scripts on
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", PROBE + "</body>"))
    dom = chromium(["--dump-dom", probe.as_uri()], tmp_path / "p2").stdout
    m = re.search(r'data-probe="([^"]*)"', dom)
    assert m is not None, "the probe script did not run"
    widths = [int(w) for w in m.group(1).split(",")]
    # training curves, "over the run", three heatmaps, memory
    assert len(widths) == report.read_text().count("<img ") == 6
    assert all(w >= 800 for w in widths), widths
    assert '<html lang="en" class="js">' in dom  # the page's own script ran without an error before it

    if precision != "fp16":
        return
    # and the page reads without JavaScript: the same page with its script removed shows the same content
    text = report.read_text()
    nojs_page = tmp_path / "nojs.html"
    nojs_page.write_text(re.sub(r"<script>.*?</script>", "", text, flags=re.S))
    nojs = chromium(["--dump-dom", nojs_page.as_uri()], tmp_path / "p3").stdout
    assert '<html lang="en">' in nojs and 'id="verdict"' in nojs and nojs.count("<img ") == 6


def layout(page: Path, width: int, tmp: Path) -> dict:
    """The LAYOUT_PROBE's findings for ``page`` in a window ``width`` px wide."""
    probe = tmp / f"layout-{width}.html"
    probe.write_text(page.read_text().replace("</body>", LAYOUT_PROBE + "</body>"))
    dom = chromium([f"--window-size={width},1000", "--dump-dom", probe.as_uri()], tmp / f"pl{width}").stdout
    m = re.search(r'data-layout="([^"]*)"', dom)
    assert m is not None, "the layout probe did not run"
    return json.loads(html.unescape(m.group(1)))


def check_layout(page: Path, tmp: Path) -> None:
    for width in LAYOUT_WIDTHS:
        found = layout(page, width, tmp)
        assert found["window"] == width
        assert found["page"] <= width, f"the page scrolls sideways at {width} px: {found}"
        assert found["cut"] == [], f"table headers cut at {width} px: {found['cut']}"
        if width >= 1400:
            assert found["scrolls"] == [], f"tables scroll sideways at {width} px: {found['scrolls']}"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_page_fits_at_1400_and_800_px(precision: str, runs_base: Path, tmp_path: Path) -> None:
    browser()
    check_layout(real_run(precision, runs_base) / "report.html", tmp_path)


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
