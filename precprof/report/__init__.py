"""The HTML report: ``render_report(tables, summary, out_path)`` and ``render_run_dir(run_dir)``.

``summarize`` aggregates the tables, ``plots`` draws figures (matplotlib Figure API, Agg), ``context``
assembles the sections, ``render`` fills the jinja templates shipped as ``precprof.templates``.
"""

from __future__ import annotations

from precprof.report.render import render_html, render_report, render_run_dir, templates_dir

__all__ = ["render_html", "render_report", "render_run_dir", "templates_dir"]
