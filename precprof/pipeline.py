"""The one way a run ends, finished, crashed or interrupted: project, advise, save, render, summary last.

``finish_run(run_dir, tables, summary)`` is what ``Profiler.save``, the built-in loop and the integrations
call. Its order makes a run directory either complete or say why not:

1. memory projection and recommendation, in memory (best effort: a failure is one line in ``errors``);
2. the four Parquet tables, each atomically; then the stream of parts written while training (``precprof.parts``)
   is removed, since the tables hold its rows (until then a reader reads the stream);
3. report.html, atomically, rendered from the same in-memory tables and summary;
4. summary.json last, atomically. Until it is written, the run directory's summary is the one written when
   the directory was claimed (status "incomplete", "running ..."), or the previous one.

A failure to write (a full disk, a read-only file system) makes the run "incomplete" with that cause instead
of raising; Ctrl-C or SIGTERM while the report renders leaves an incomplete run whose tables are complete,
and is re-raised after summary.json is written. Writing the tables and the summary is never interrupted by a
signal (``precprof._signals.deferred``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from precprof import _atomic, _run_finisher, _saving, _signals, hardware, rundir, taxonomy
from precprof import tables as T
from precprof._notice import notice
from precprof.analysis import advisor, memory_projection, update_ratio
from precprof.analysis.final import final_block, machine_load
from precprof.analysis.throughput import compiled_steps
from precprof.errors import RunNotSavedWarning, UserError
from precprof.report.render import render_html, render_run_dir


def post_process(
    tables: Mapping[str, pd.DataFrame], summary: Mapping[str, Any], facts: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Memory projection, update-to-weight ratios and recommendation for summary.json; best effort, never
    raises an Exception."""
    out: dict[str, Any] = {}
    try:
        if not tables["memory"].empty:
            out[T.SUMMARY_MEMORY] = memory_projection.project(tables["memory"], dict(summary), facts=facts)
    except Exception as e:
        out.setdefault(T.SUMMARY_ERRORS, []).append(f"memory projection: {type(e).__name__}: {e}")
    try:
        updates = update_ratio.summary(tables["layers"], T.shared_params(summary))
        if updates is not None:
            out[T.SUMMARY_WEIGHT_UPDATES] = updates
    except Exception as e:
        out.setdefault(T.SUMMARY_ERRORS, []).append(f"weight updates: {type(e).__name__}: {e}")
    try:
        if not tables["layers"].empty or not tables["steps"].empty:
            rec = advisor.recommend(dict(tables), summary={**summary, **out})
            out[T.SUMMARY_RECOMMENDATION] = rec.to_dict()
    except Exception as e:
        out.setdefault(T.SUMMARY_ERRORS, []).append(f"advisor: {type(e).__name__}: {e}")
    return out


def _incomplete(summary: dict[str, Any], cause: str, before: str | None = None) -> None:
    """Mark ``summary`` incomplete; a cause already there (the crash, given as ``before`` or read from
    ``summary``) stays first."""
    if before is None and summary.get(T.SUMMARY_STATUS) != T.STATUS_COMPLETE:
        before = summary.get(T.SUMMARY_INCOMPLETE_REASON)
    summary[T.SUMMARY_STATUS] = T.STATUS_INCOMPLETE
    summary[T.SUMMARY_INCOMPLETE_REASON] = f"{before}; then {cause}" if before else cause


def finish_run(
    run_dir: str | Path,
    tables: Mapping[str, pd.DataFrame],
    summary: Mapping[str, Any],
    *,
    facts: dict[str, Any] | None = None,
    render: bool = True,
    report_path: str | os.PathLike[str] | None = None,
    live: str | None = None,
    lost: str | None = None,
) -> dict[str, Any]:
    """Write the run directory in the order of the module docstring; returns the summary as written (or, when
    none could be, as it would have been). ``live``: the line of a snapshot of a run still recording
    (``rundir.live_note``; ``Profiler.save`` while attached, without ``out``), for the page's banner. ``lost``:
    what the recording lost before the save (``Recorded.lost``: the steps its stream wrote, its folder removed
    mid-run): the run is incomplete with that cause, its ``training_finished`` as its status said.

    ``summary`` must already carry its status (``complete``: training ran to its end, which the summary's
    ``training_finished`` keeps whatever the saving does; ``incomplete``) and reason; its hardware block is
    detected for the capture's device when missing. ``report_path`` defaults to RUN_DIR/report.html. Raises only
    KeyboardInterrupt (after saving), never for a failure to write: that becomes the run's incomplete cause,
    saying what was not saved (``precprof._saving``: on a full disk what fits is kept, the configuration
    first), and a ``RunNotSavedWarning``.
    """
    # a Ctrl-C (``_signals``) is held from here until the tables are written: it stops the report alone
    with _signals.deferred():
        run_dir = Path(run_dir)
        full = dict(summary)
        full.setdefault(T.SUMMARY_STATUS, T.STATUS_COMPLETE)
        full.setdefault(T.SUMMARY_INCOMPLETE_REASON, None)
        # the caller's status says how training ended; a failure to save after it (a full disk, Ctrl-C while the
        # report renders) makes the run incomplete, and this says it lost files, not steps
        full[T.SUMMARY_TRAINING_FINISHED] = full[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
        if lost:
            _incomplete(full, lost)
        if T.SUMMARY_HARDWARE not in full:
            full.update(describe_machine((full.get(T.SUMMARY_CAPTURE) or {}).get("device")))
        # what precprof train records and a Profiler in the user's own loop did not (a notebook had no torch version
        # and no final loss, and the report no Software rows): the versions of this process, and the final figures
        # as the report's header reads them off the steps table (no wall-clock time: the loop around them is the
        # user's)
        if T.SUMMARY_VERSIONS not in full:
            full[T.SUMMARY_VERSIONS] = hardware.software_versions()
        if T.SUMMARY_FINAL not in full:
            full[T.SUMMARY_FINAL] = final_block(tables["steps"], math.nan, compiled_steps(full))
        if isinstance(full[T.SUMMARY_FINAL], dict):  # the other work on the machine, beside the steps' rate
            full[T.SUMMARY_FINAL] = {**full[T.SUMMARY_FINAL], **machine_load(full)}
        saving = _saving.Saving(run_dir)
        full.update(post_process(tables, full, facts))
        saving.write_tables(tables)
    interrupted: KeyboardInterrupt | None = None
    report = Path(report_path) if report_path is not None else run_dir / T.REPORT_FILE
    if render and not saving.tables_ok:
        saving.lost.append(report.name)  # rendered from the tables, when they are all there
    elif render:
        try:
            _signals.check()  # a Ctrl-C while the tables were written: stop now, as during the render
            report.parent.mkdir(parents=True, exist_ok=True)
            _atomic.write_text(report, render_html(tables, full, live=live))
            saving.saved.append(report.name)
        except KeyboardInterrupt as e:
            _signals.consume()
            interrupted = e
            _incomplete(
                full,
                f"interrupted before or while rendering {T.REPORT_FILE}; the tables are complete: "
                f"`precprof report {run_dir}` renders it",
            )
        except OSError as e:
            saving.report_failed(report.name, e)
        except Exception as e:  # a bug in rendering must not lose the run: the data is saved
            full.setdefault(T.SUMMARY_ERRORS, []).append(f"report: {type(e).__name__}: {e}")
            notice(
                f"precprof: {T.REPORT_FILE} could not be rendered ({type(e).__name__}: {e}); "
                f"the run is saved: try `precprof report {run_dir}`",
            )
    with _signals.deferred():
        written = _write_summary(run_dir, full, saving, report)
    if lost or saving.failure or saving.lost or saving.left_out or saving.summary_error:
        # at the user's line (Profiler.save, Profiler.report, a callback, the end of a `with`), never raised
        notice(
            RunNotSavedWarning(
                f"precprof: {run_dir} was not saved whole: {written[T.SUMMARY_INCOMPLETE_REASON]}"
            )
        )
    if interrupted is not None:
        raise interrupted
    _signals.check()  # a Ctrl-C while the run was written (whole, no report asked): the exit code says it
    return written


def _write_summary(
    run_dir: Path, full: dict[str, Any], saving: _saving.Saving, report: Path
) -> dict[str, Any]:
    """Write summary.json, the largest version of it that fits (``precprof._saving``), with the cause of what
    was not saved; returns ``full`` with that status and cause."""
    status, before = full[T.SUMMARY_STATUS], full[T.SUMMARY_INCOMPLETE_REASON]

    def attempt(doc: dict[str, Any], left_out: list[str]) -> dict[str, Any] | None:
        cause = saving.reason(left_out)
        out = dict(full)
        out[T.SUMMARY_STATUS], out[T.SUMMARY_INCOMPLETE_REASON] = status, before
        if cause is not None:
            _incomplete(out, cause, before if status != T.STATUS_COMPLETE else None)
        doc = {**doc, T.SUMMARY_STATUS: out[T.SUMMARY_STATUS]}
        doc[T.SUMMARY_INCOMPLETE_REASON] = out[T.SUMMARY_INCOMPLETE_REASON]
        try:
            T.write_summary(run_dir, doc)
        except OSError as e:
            saving.summary_error = e
            return None
        saving.summary_error, saving.left_out = None, left_out
        return out

    levels = list(_saving.summary_levels(full))
    done = attempt(*levels[0])
    # the page claims the status the summary was about to have, and is the largest file: it goes first
    if done is None and saving.drop_report(report, saving.summary_error):
        done = attempt(*levels[0])
    for doc, left in levels[1:]:
        if done is not None:
            return done
        done = attempt(doc, left)
    if done is not None:
        return done
    for _gone in saving.free_room():  # a summary without the rows rather than rows no one can read
        for doc, left in levels[-2:]:
            done = attempt(doc, left)
            if done is not None:
                return done
    failed = dict(full)
    e = saving.summary_error or OSError("no room")
    cause = saving.reason([]) or "summary.json could not be written"
    _incomplete(failed, f"{cause}; summary.json could not be written ({_saving.why(e)})")
    return failed


def rerender(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    target: str | None = None,
    *,
    recording: Mapping[str, Any] | None = None,
    facts: dict[str, Any] | None = None,
) -> Path:
    """Render a run directory's report again (``precprof report``): with the stored recommendation, or one
    computed now by the advisor when ``target`` (a hardware preset: "a100", "t4"...) is given, none is stored,
    or an older precprof stored it (``rundir.older_advice_note``, which the page's notices then carry).
    summary.json is never rewritten, and neither is the run's own report.html when planning for a target: that
    page goes to ``report-<target>.html`` beside it unless ``out`` says otherwise. Returns the HTML path.

    A run still being written (``rundir.live_writer``: its lock is held) is rendered from what it has streamed,
    and the page says so; a page that the run (or another reader) wrote while this one rendered is newer, and
    is never replaced by this one.

    ``recording``: the summary of the Profiler still recording into the run (``Profiler.report`` while attached:
    a look at the run so far), with ``facts`` (``Profiler.model_facts``). The page is rendered live from the
    stream, with that summary over summary.json's (whose status, "running", stays), projected and advised as
    ``finish_run`` would (``post_process``), and says that the run is still recording."""
    rd = Path(run_dir)
    if out is None and target is not None:
        out = rd / f"report-{target.strip().lower()}.html"
    # before reading: a live run is read from its stream
    live = recording is not None or rundir.live_writer(rd) is not None
    summary = T.read_summary(rd) if T.is_run_dir(rd) else {}
    if not live and rundir.says_running(summary):  # "running (pid ...)" of a process that is gone
        summary = {**summary, T.SUMMARY_INCOMPLETE_REASON: rundir.ended_unsaved(summary)}
    if recording is not None:
        now = {k: v for k, v in recording.items() if k not in (T.SUMMARY_STATUS, T.SUMMARY_INCOMPLETE_REASON)}
        summary = {**summary, **now}
    rec: Any = None
    advisor_error = None
    # advised again: for another machine, for a run without advice, or over an older precprof's advice
    older = rundir.older_advice_note(rd, summary)
    advise = (
        target is not None
        or recording is not None
        or not summary.get(T.SUMMARY_RECOMMENDATION)
        or older is not None
    )
    # read once, for the advisor and the page; the page alone needs only the histograms summed over steps
    read = T.read_run(rd, categorical=True, histogram_totals=not advise) if T.is_run_dir(rd) else None
    live_line = None
    if read is not None:
        # a run killed before it saved: its first summary, written before any forward pass, names no precision
        summary = taxonomy.with_precision_seen(summary, read.tables["layers"])
        for note in (rundir.newer_version_note(rd, summary), older):
            if note:
                read.notices.append(note)
        held = rundir.stopped_note(rd) if live and recording is None else None
        if held is not None:  # stopped, not in progress: the page of the run that stopped, and who holds it
            read.notices.append(held)
        live_line = rundir.live_note(rd, read.last_step, recording is not None) if live and not held else None
        if recording is not None:  # what the run's end adds to its summary, as of now
            summary.update(post_process(read.tables, summary, facts))
            advise = target is not None
    if read is not None and advise:
        machine: Any = None
        if target is not None:
            try:
                machine = hardware.preset(target)
            except ValueError as e:
                raise UserError(str(e)) from None
        try:
            rec = advisor.recommend(read.tables, hardware=machine, summary=summary)
        except Exception as e:  # the evidence still renders; the page says why there is no verdict
            advisor_error = f"{type(e).__name__}: {e}"
    if not live:
        return render_run_dir(
            rd, out=out, recommendation=rec, advisor_error=advisor_error, read=read, summary=summary
        )
    final = Path(out) if out is not None else rd / T.REPORT_FILE
    before = _written_at(final)
    page = render_run_dir(
        rd,
        out=_atomic.tmp_name(final),
        recommendation=rec,
        advisor_error=advisor_error,
        read=read,
        live=live_line,
        summary=summary,
    )
    if _written_at(final) != before:  # the run ended and wrote its own report meanwhile: that one stays
        with contextlib.suppress(OSError):
            page.unlink()
    else:
        os.replace(page, final)
    return final


def _written_at(path: Path) -> int | None:
    """``path``'s modification time in ns, None when it does not exist."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def describe_machine(device: str | None) -> dict[str, Any]:
    """The summary entries that name the machine a run records on: its ``hardware`` block for ``device``."""
    return {T.SUMMARY_HARDWARE: hardware.detect(device).to_dict()}


_run_finisher.set_run_finisher(finish_run)  # what Profiler.save calls
_run_finisher.set_machine_describer(describe_machine)  # what a streamed run's first summary records
_run_finisher.set_run_renderer(rerender)  # what Profiler.report renders a run still recording with
