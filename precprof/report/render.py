"""Render the HTML report: one self-contained file (inline CSS, inline PNG plots, a few lines of optional JS).

The templates live in ``reports/templates/`` of the repository and ship in the wheel as the package
``precprof.templates``; ``templates_dir()`` finds them in either place. Autoescape is on for everything: module
names, config values and findings are user data.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from precprof import _atomic, formats
from precprof import tables as T
from precprof.errors import UserError
from precprof.report import filters, numbers, plots
from precprof.report.context import build_context

TEMPLATE = "report.html.j2"
# a long table's rows shown before its buttons (the next rows, all of them), where the page's script runs; the
# page marks the others from the start, so that a browser never lays out the what-if table of thousands of
# modules at once
FIRST_ROWS = 25
# the rows its "Show the next" button adds: a few hundred lay out in a blink, where all of 25,000 rows took
# Chromium half a minute
MORE_ROWS = 500


def templates_dir() -> Path:
    """Folder holding ``report.html.j2``: the repository's ``reports/templates`` beside this source tree (a
    source tree in use renders with its own templates, even where another checkout is installed), else the
    installed ``precprof.templates`` package."""
    repo = Path(__file__).resolve().parents[2] / "reports" / "templates"
    if (repo / TEMPLATE).is_file():
        return repo
    try:
        spec = importlib.util.find_spec("precprof.templates")
    except ModuleNotFoundError:
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc)
        if (p / TEMPLATE).is_file():
            return p
    raise FileNotFoundError(
        f"precprof's report templates ({TEMPLATE}) are missing: neither the package precprof.templates nor "
        f"{repo} has them; reinstall precprof"
    )


def format_colors_css() -> str:
    """The formats' colours as CSS variables (``--fp16``, ``--e4m3``...), from ``precprof.formats`` alone."""
    pairs = "; ".join(f"--{f.name.removeprefix('fp8_')}: {f.color}" for f in formats.FORMATS.values())
    return f":root {{ {pairs}; }}"


def environment() -> jinja2.Environment:
    """The jinja environment of the report: autoescape on, undefined names are errors, the number filters.
    One per templates folder, kept: it keeps the templates it compiled (a third of a second a page), so that a
    process rendering several pages compiles them once; its loader still reloads a template whose file changed."""
    return _environment(str(templates_dir()))


@functools.lru_cache(maxsize=4)
def _environment(folder: str) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(filters.FILTERS)
    env.globals["finding_numbers"] = numbers.shown
    env.globals["format_colors_css"] = format_colors_css()
    env.globals["first_rows"] = FIRST_ROWS
    # a long table's <tr>, marked "extra" past the first rows (a function: a macro per row of thousands is slow)
    env.globals["tr"] = functools.partial(filters.row_open, first_rows=FIRST_ROWS)
    env.globals["more_rows"] = MORE_ROWS
    return env


def render_html(
    tables: Mapping[str, pd.DataFrame],
    summary: Mapping[str, Any],
    recommendation: Any = None,
    *,
    advisor_error: str | None = None,
    missing_tables: list[str] | None = None,
    missing_summary: str | None = None,
    stream: T.RunTables | None = None,
    live: str | None = None,
) -> str:
    """The report as an HTML string. ``recommendation``: a ``Recommendation`` or its dict form; None uses the
    one stored in ``summary`` (if any). ``advisor_error`` explains in the page why there is none;
    ``missing_tables`` names the Parquet files a run directory lacks (a notice at the top of the page), and
    ``missing_summary`` says what the page cannot say without its summary.json (``tables.missing_summary``);
    ``stream``: how the tables were read, when from the parts of a run that never saved them (the page says
    where the run was cut off and which parts it skipped; its ``histogram_totals``, when read, are drawn).
    ``live``: the run is still being written (``rundir.live_note``): the page says so, and neither that it was
    cut off nor that it is incomplete."""
    totals = stream.histogram_totals if stream is not None else None
    tables = T.as_categorical(tables)
    with plots.unhinted_text():
        ctx = build_context(tables, summary, recommendation, histogram_totals=totals)
    ctx["advisor_error"] = advisor_error
    ctx["missing_tables"] = [T.TABLE_FILES.get(t, t) for t in missing_tables or []]
    ctx["missing_summary"] = missing_summary
    ctx["stream"] = (
        {
            "last_step": stream.last_step,
            "notices": stream.notices,
            "during": _cut_during(tables, stream.last_step),
        }
        if stream is not None and stream.streamed
        else None
    )
    # what reading a saved run learned (a newer precprof wrote it, an older one advised it): a streamed run's
    # banner carries these already
    ctx["notices"] = list(stream.notices) if stream is not None and not stream.streamed and not live else []
    ctx["live"] = live
    if live:  # its summary says "running" (incomplete) until it ends: not a cut-off run
        ctx["incomplete"] = False
    return environment().get_template(TEMPLATE).render(**ctx)


def _cut_during(tables: Mapping[str, pd.DataFrame], last: int | None) -> bool:
    """Whether the last step a cut-off run flushed is the step it was cut off in: the banner says "cut off during
    step 5", where "after step 5" contradicted the one above it ("after step 4; step 5 was cut off")."""
    steps = tables.get("steps")
    if last is None or steps is None or T.CUT_OFF not in steps or T.STEP not in steps:
        return False
    return bool(T.flags(steps[T.CUT_OFF])[steps[T.STEP] == last].any())


def render_report(
    tables: Mapping[str, pd.DataFrame],
    summary: Mapping[str, Any],
    out_path: str | os.PathLike[str],
    recommendation: Any = None,
) -> Path:
    """Write the report of ``tables`` (the four frames of ``Profiler.tables()``) and ``summary`` to ``out_path``.

    The file is written atomically (a crash never leaves half a report). Returns the path written.
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic.write_text(out, render_html(tables, summary, recommendation))
    return out


def render_run_dir(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    recommendation: Any = None,
    advisor_error: str | None = None,
    read: T.RunTables | None = None,
    live: str | None = None,
    summary: Mapping[str, Any] | None = None,
) -> Path:
    """Render the report of a run directory (``precprof train`` output or ``Profiler.save``).

    Reads the tables and summary.json and renders the given ``recommendation``, else the stored one (none:
    the page says so, with ``advisor_error`` when there is a reason). Writes ``out`` (default
    RUN_DIR/report.html) and returns its path; summary.json is left as it is. A new recommendation (for
    another target machine) comes from ``precprof.pipeline.rerender``. ``read``: the run's tables when the
    caller read them already (``tables.read_run``). ``live``: the line saying the run is still being written
    (``rundir.live_note``), for the page's banner. ``summary``: the run's summary when the caller has a newer one
    than summary.json (a run still recording: ``pipeline.rerender``).
    """
    rd = Path(run_dir)
    if not T.is_run_dir(rd):
        raise UserError(
            f"{rd} is not a precprof run directory (it has neither {T.SUMMARY_FILE} nor layers.parquet)"
        )
    if read is None:
        read = T.read_run(rd, categorical=True, histogram_totals=True)
    tabs = read.tables
    summary = dict(summary) if summary is not None else T.read_summary(rd)
    # an error of an earlier stage that runs again now is no longer the page's: the report's own (this is the
    # report), the advisor's when a recommendation was just computed
    stale = ("report:",) + (("advisor:",) if recommendation is not None else ())
    errors = [e for e in summary.get(T.SUMMARY_ERRORS) or [] if not str(e).startswith(stale)]
    summary = {**summary, T.SUMMARY_ERRORS: errors}
    rec = recommendation if recommendation is not None else summary.get(T.SUMMARY_RECOMMENDATION)
    path = Path(out) if out is not None else rd / T.REPORT_FILE
    html = render_html(
        tabs,
        summary,
        rec,
        advisor_error=advisor_error,
        missing_tables=T.missing_tables(rd),
        missing_summary=T.missing_summary(rd),
        stream=read,
        live=live,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic.write_text(path, html)
    return path
