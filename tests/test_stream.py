"""Streaming a run into its directory while it trains (precprof.parts, precprof.capture.stream): killed at any
moment, every flushed step is readable and reported; a torn part is skipped with a notice; a resumed run
equals an uninterrupted one; the recording's host memory stays bounded."""

from __future__ import annotations

import contextlib
import errno
import gc
import html as html_text
import inspect
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import forks
import numpy as np
import pandas as pd
import pytest
import stream_worker
import torch
from torch import nn

import precprof
from precprof import cli, parts, pipeline, rundir, runfiles
from precprof import tables as T
from precprof.analysis.comparison import runs
from precprof.capture import stream, unsaved, writer_process
from precprof.errors import RunNotSavedWarning, UserError
from precprof.report import filters as F

WORKER = Path(__file__).with_name("stream_worker.py")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def worker(mode: str, out: Path, checkpoint: Path | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, str(WORKER), mode, str(out), *([str(checkpoint)] if checkpoint else [])]
    return forks.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def streaming(proc: subprocess.Popen[str]) -> int:
    """Wait for a ``forever`` worker's first flushes on disk; the pid of its writer process (0: none)."""
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["streaming"], proc.stderr.read() if proc.stderr else ""
    return int(line[1])


def wait_ended(pid: int, timeout: float = 60) -> None:
    """Wait until process ``pid`` (not a child of this one) has ended: a killed training's writer process
    goes on writing the flushes it was handed, then ends."""
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended, not yet reaped
                    return
        except FileNotFoundError:
            return
        except OSError:  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.05)
    assert not pid or time.monotonic() < deadline, f"the writer process {pid} did not end"


def wait_ready(sink: Any) -> None:
    """Until the run's writer process said it is ready (or failed)."""
    deadline = time.monotonic() + 30
    while not sink._proc.is_ready() and sink._proc.failed is None and time.monotonic() < deadline:
        select.select([sink._proc.proc.stdout], [], [], 0.5)
    assert sink._proc.ready, sink._proc.failed


def train_step(model: nn.Module, opt: torch.optim.Optimizer, prof: precprof.Profiler, step: int) -> None:
    """One step of the tiny runs: its batch a function of ``step`` alone."""
    loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    prof.step(loss=loss.detach())


def tiny_run(out: Path | None, steps: int, sample_every: int = 1, **kw: object) -> precprof.Profiler:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = precprof.Profiler(model, opt, sample_every=sample_every, out=out, **kw)
    with prof:
        for step in range(steps):
            train_step(model, opt, prof, step)
    return prof


def test_a_streamed_run_equals_one_kept_in_memory(tmp_path: Path) -> None:
    kept = tiny_run(None, 7, sample_every=2).tables()
    streamed = tiny_run(tmp_path / "run", 7, sample_every=2)
    # a part per table per flush (4 flushes, or fewer parts where the writer, behind, found flushes queued and
    # wrote them as one), and the memory of the first two sampled steps (the others do not measure it:
    # capture/memory_schedule.py)
    found = Counter(p.name.split(".")[1] for p in (tmp_path / "run" / parts.STREAM_DIR).rglob("*.parquet"))
    n = found["steps"]
    assert 1 <= n <= 4 and found["layers"] == found["histograms"] == n and 1 <= found["memory"] <= 2, found
    assert sum(found.values()) == 3 * n + found["memory"], found
    tables = streamed.tables()
    for name in ("layers", "histograms", "memory"):
        pd.testing.assert_frame_equal(tables[name], kept[name], check_dtype=False)
    a, b = (
        tables["steps"].drop(columns=[T.TIME_S, T.RESUMED]),
        kept["steps"].drop(columns=[T.TIME_S, T.RESUMED]),
    )
    pd.testing.assert_frame_equal(a, b, check_dtype=False)
    streamed.save()  # the stream becomes the four tables
    assert not parts.has_stream(tmp_path / "run")
    again = T.read_tables(tmp_path / "run")
    pd.testing.assert_frame_equal(again["layers"], tables["layers"], check_dtype=False)
    assert T.read_summary(tmp_path / "run")[T.SUMMARY_STATUS] == T.STATUS_COMPLETE


def test_a_reattached_profiler_counts_on_and_streams_on(tmp_path: Path) -> None:
    """Detached (for an evaluation, say) and attached again, the Profiler goes on from the step it stopped at
    and streams on into the same run, through the same writer process: the run equals one that stayed
    attached. Saved, the run gives the process back, and the next run streams through it."""
    pids: list[int] = []

    def run(out: Path, pause_after: int | None) -> dict[str, pd.DataFrame]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        prof = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False)
        prof.attach()
        for step in range(7):
            if step == pause_after:
                prof.detach()
                with torch.no_grad():  # an evaluation, not recorded
                    model(torch.randn(4, 8))
                prof.attach()
            sink = prof._recorded.sink
            assert sink is not None and sink._proc is not None
            pids.append(sink._proc.proc.pid)
            train_step(model, opt, prof, step)
        prof.detach()
        tables = T.read_run(out).tables  # what a kill now leaves: the stream, never saved
        proc = sink._proc
        assert proc is not None and proc.users > 0 and proc.proc.poll() is None  # detached, still the run's
        prof.save()
        assert sink._proc is None and proc.proc.poll() is None  # given back, alive for the next run
        return tables

    once, paused = run(tmp_path / "once", None), run(tmp_path / "paused", 3)
    assert len(set(pids)) == 1  # one process through the detach, and for the next run
    assert paused["steps"][T.STEP].tolist() == list(range(7))
    assert sorted(set(paused["layers"][T.STEP])) == [0, 2, 4, 6]
    for name in ("layers", "histograms"):
        pd.testing.assert_frame_equal(paused[name], once[name])
    cols = [T.STEP, T.LOSS, T.SAMPLED]
    pd.testing.assert_frame_equal(paused["steps"][cols], once["steps"][cols])


def test_a_machine_that_cannot_be_described_does_not_stop_attach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first summary's machine is best effort: a failing detection leaves it out, and the run's end
    records it as before."""
    from precprof import _run_finisher

    def broken(device: str | None) -> dict[str, object]:
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(_run_finisher, "_describer", broken)
    prof = tiny_run(tmp_path / "run", 2)
    assert T.SUMMARY_HARDWARE not in T.read_summary(tmp_path / "run")  # killed now, it has no machine
    monkeypatch.undo()
    prof.save()
    assert T.read_summary(tmp_path / "run")[T.SUMMARY_HARDWARE]["device"] == "cpu"


def test_out_is_claimed_at_attach(tmp_path: Path) -> None:
    tiny_run(tmp_path / "run", 2).save()
    with pytest.raises(UserError, match="already holds a precprof run"):
        tiny_run(tmp_path / "run", 2)
    tiny_run(tmp_path / "run", 3, overwrite=True).save()
    assert len(T.read_tables(tmp_path / "run")["steps"]) == 3


_ATTACH_CUT_SHORT = """
import os, signal, sys, torch, traceback
from torch import nn
import precprof
from precprof.capture import assembly, profiler

def ctrl_c(self):
    os.kill(os.getpid(), signal.SIGINT)  # Python's own handler: a KeyboardInterrupt, the script ends with it
    for _ in range(1000):
        pass

def fails(*args, **kwargs):
    raise RuntimeError("a hook could not be registered")

if sys.argv[-1] == "ctrl-c":  # the last thing attach does, after the claim and the stream
    profiler.Profiler._begin_step = ctrl_c
    # Python's handler as a terminal's script has it, even where the tests run with SIGINT ignored (a shell's
    # `pytest &` without job control: the forked script inherited it, and its Ctrl-C did nothing)
    signal.signal(signal.SIGINT, signal.default_int_handler)
elif sys.argv[-1] == "error":  # the step hooks, made after the claim
    assembly.StepHooks = fails
failed = False
for out in sys.argv[1:-1]:  # the rerun trains each directory in turn, as a script run once for each would
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with precprof.Profiler(model, opt, out=out) as prof:
            for step in range(3):
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        prof.save()
        print("saved", out, flush=True)
    except Exception:
        if sys.argv[-1] != "none":
            raise
        traceback.print_exc()
        failed = True
sys.exit(1 if failed else 0)
"""

_CUTS = [(made_by, cut) for made_by in ("the-claim", "the-user") for cut in ("ctrl-c", "error")]


@pytest.fixture(scope="module")
def attaches_cut_short(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each cut's first run (a process of its own, the four at once), then the rerun: one new process that runs
    the script's training into each of the four directories (a process per directory cost 2 s of CPU each)."""
    root = tmp_path_factory.mktemp("attach-cut-short")
    outs = {case: root / "-".join(case) / "run" for case in _CUTS}
    for (made_by, _), out in outs.items():
        out.parent.mkdir()
        if made_by == "the-user":
            out.mkdir()
    first = {
        case: forks.popen(
            [sys.executable, "-c", _ATTACH_CUT_SHORT, str(out), case[1]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for case, out in outs.items()
    }
    said = {}
    for case, proc in first.items():
        _, err = proc.communicate(timeout=300)
        out = outs[case]
        said[case] = (proc.returncode, err, out.exists(), out.is_dir() and list(out.iterdir()) == [])
    again = forks.run(
        [sys.executable, "-c", _ATTACH_CUT_SHORT, *map(str, outs.values()), "none"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    return {"outs": outs, "first": said, "again": again}


@pytest.mark.parametrize("cut", ["ctrl-c", "error"])
@pytest.mark.parametrize("made_by", ["the-claim", "the-user"])
@pytest.mark.xdist_group("stream-attach-cut-short")  # (one worker runs the fixture's processes)
def test_an_attach_cut_short_leaves_no_run_to_refuse_the_rerun(
    attaches_cut_short: dict[str, Any], cut: str, made_by: str
) -> None:
    """A script whose ``Profiler(out=D).attach()`` was stopped by Ctrl-C (a real SIGINT) or an exception left D
    with an empty stream and a summary "running (pid ...) ... killed", and the same script run again was
    refused: "already holds a precprof run (incomplete); choose another out, or pass overwrite=True", for a
    run of no step. What the claim wrote goes with the failed attach: the directory as it was before (gone
    where the claim made it, an empty folder the user made stays), and the rerun trains and saves."""
    out = attaches_cut_short["outs"][made_by, cut]
    returncode, stderr, existed, empty_dir = attaches_cut_short["first"][made_by, cut]
    expected = "KeyboardInterrupt" if cut == "ctrl-c" else "RuntimeError: a hook could not be registered"
    assert returncode != 0 and expected in stderr, stderr
    if made_by == "the-user":
        assert empty_dir
    else:
        assert not existed
    again = attaches_cut_short["again"]
    assert f"saved {out}" in again.stdout.splitlines(), again.stderr  # the rerun of this directory
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert T.read_tables(out)["steps"][T.STEP].tolist() == [0, 1, 2]


def killed_after(out: Path, wait_s: float) -> Path:
    """A ``forever`` worker's run, SIGKILLed ``wait_s`` after its first flushes were on disk."""
    proc = worker("forever", out)
    writer = streaming(proc)
    time.sleep(wait_s)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    wait_ended(writer)  # what it was handed, on disk (read before, the page could say a later step)
    return out


@pytest.fixture(scope="module")
def killed_at_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed as soon as its first flushes were on disk: each test that reads it reads a copy."""
    return killed_after(tmp_path_factory.mktemp("killed-at-once") / "run", 0.0)


@pytest.mark.xdist_group("stream-killed-at-once")  # (one worker kills the fixture's run)
def test_killed_at_three_moments_every_flushed_step_is_readable(tmp_path: Path, killed_at_once: Path) -> None:
    # killed at once, a little later and later still (each a process that imports torch: five random moments
    # took 30-40 s of the suite)
    for i, wait_s in enumerate((0.0, 0.23, 0.57)):
        out = tmp_path / f"run{i}"
        if wait_s == 0.0:
            shutil.copytree(killed_at_once, out)
        else:
            killed_after(out, wait_s)
        read = T.read_run(out)
        steps = read.tables["steps"]
        assert read.streamed and read.last_step is not None and read.last_step >= 1
        # every committed flush is whole: steps 0..last without a gap, each sampled one with its layers
        assert steps[T.STEP].tolist() == list(range(read.last_step + 1))
        layer_steps = set(read.tables["layers"][T.STEP])
        assert layer_steps == set(steps[T.STEP])
        assert set(read.tables["histograms"][T.STEP]) == layer_steps
        for n in read.notices:  # only a flush the kill cut short may be skipped
            assert "cut off while it was written" in n
        html = pipeline.rerender(out).read_text()
        assert f"The run was cut off; its record ends after step {read.last_step}." in html
        assert "Traceback" not in html


@pytest.mark.xdist_group("stream-killed-at-once")
def test_precprof_report_on_a_killed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, killed_at_once: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(killed_at_once, out)
    res = forks.run(
        [sys.executable, "-m", "precprof", "report", str(out)], capture_output=True, text=True, env=ENV
    )
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    html = (out / T.REPORT_FILE).read_text()
    assert "The run was cut off; its record ends after step" in html
    assert (
        "ended before it could save, and no process holds the run directory now" in html
    )  # its process is gone
    # its sampling, counted from its steps table (the summary that counts it was never written: no counts)
    n = F.count(len(T.read_run(out).tables["steps"]))
    assert (
        f"every step: {n} of {n} steps (counted from the steps table: the run ended before it saved" in html
    )
    # the first summary names the machine the run recorded on, so that the advice is for that machine and
    # never for the one that reads the run (the reader's hardware is not even looked at)
    summary = T.read_summary(out)
    here = json.loads(json.dumps(pipeline.describe_machine("cpu")[T.SUMMARY_HARDWARE]))
    assert summary[T.SUMMARY_HARDWARE] == here

    def not_this_machine(*args: object) -> None:
        raise AssertionError("the advisor detected the reading machine")

    monkeypatch.setattr(precprof.hardware, "detect", not_this_machine)
    assert precprof.recommend(out).format


def test_a_run_killed_after_a_report_while_attached_keeps_every_flushed_step(tmp_path: Path) -> None:
    """A report taken while attached ended the stream (h67): killed two steps later, the directory held the
    steps up to the report only, under a summary that said "complete". The report is a look at the run so far:
    the stream goes on, and the killed run keeps every step flushed before the kill, still "running"."""
    out = tmp_path / "run"
    proc = worker("peek", out)
    writer = streaming(proc)  # steps up to PEEK_AT + 2 are on disk
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    wait_ended(writer)
    read = T.read_run(out)
    peek_at = stream_worker.PEEK_AT
    assert read.streamed and read.last_step is not None and read.last_step >= peek_at + 2
    steps = read.tables["steps"][T.STEP].tolist()
    assert steps == list(range(read.last_step + 1))  # each once, none missing
    assert set(read.tables["layers"][T.STEP]) == set(steps)  # every step sampled
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert not (out / T.TABLE_FILES["steps"]).exists()
    assert f"snapshot as of step {peek_at}" in (out / T.REPORT_FILE).read_text()  # the look it took
    html = pipeline.rerender(out).read_text()
    assert f"The run was cut off; its record ends after step {read.last_step}." in html


def test_a_save_into_another_runs_directory_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prof.save(D) and prof.report(D) into a directory holding another run replaced it without a word: a killed
    run's stream, its only record, was deleted for another model's steps (h69). An empty name wrote the run into
    the working directory, a file only warned. Each is refused in one line, as Profiler(out=) refuses it, before
    anything is written; overwrite=True replaces the run; a directory the Profiler saved into is its own."""
    killed = tmp_path / "killed"
    proc = worker("crash", killed, tmp_path / "ckpt.pt")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    streamed = T.read_run(killed).tables
    assert streamed["steps"][T.STEP].tolist() == list(range(len(streamed["steps"]))) != []
    prof = tiny_run(None, 3)
    for save in (prof.save, prof.report):
        with pytest.raises(rundir.RunDirError) as refused:
            save(killed)
        assert str(refused.value) == (
            f"path {killed}: {killed} already holds a precprof run (incomplete); choose another path, or pass "
            "overwrite=True to replace it"
        )
    again = T.read_run(killed)
    assert again.streamed
    for name in T.TABLES:  # the killed run, untouched
        pd.testing.assert_frame_equal(again.tables[name], streamed[name])
    (tmp_path / "afile").write_text("mine")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(rundir.RunDirError, match=r'path is empty; .* \(e\.g\. path="runs/mine"\)'):
        prof.report("")
    with pytest.raises(rundir.RunDirError, match="afile: is a file, not a directory; choose another path"):
        prof.report(tmp_path / "afile")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ckpt.pt", "killed"]
    assert (tmp_path / "afile").read_text() == "mine"
    prof.report(killed, overwrite=True)
    assert not parts.has_stream(killed) and T.read_summary(killed)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert T.read_tables(killed)["steps"][T.STEP].tolist() == [0, 1, 2]  # this Profiler's three steps
    other = tiny_run(None, 2)
    with pytest.raises(rundir.RunDirError, match=r"already holds a precprof run \(complete\)"):
        other.save(killed)
    prof.save(killed)  # its own run, saved again
    assert T.read_tables(killed)["steps"][T.STEP].tolist() == [0, 1, 2]


def test_a_killed_runs_fp8_eligibility_is_not_judged(tmp_path: Path) -> None:
    """The layers' shapes are in the summary a run writes when it saves: a killed run's report said "0 of 2
    qualify ... Not eligible: (weight shape unknown: none was recorded for it)", and on FP8 hardware that no
    layer can go to FP8. It says the check was not judged, and why; the same run saved judges both layers."""

    def run(out: Path, save: bool) -> precprof.Recommendation:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))  # FP8's multiples of 16
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with precprof.Profiler(model, opt, sample_every=1, out=out) as prof:
            for _ in range(3):
                model(torch.randn(16, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        if save:
            prof.save()
        else:
            prof._owned_run.release()  # as a killed job leaves it: its stream and first summary
        return precprof.recommend(out, hardware="h100")

    saved = run(tmp_path / "saved", save=True).finding("fp8_eligibility")
    assert saved is not None and saved.numbers["checked"] == 2
    killed = run(tmp_path / "killed", save=False)
    f = killed.finding("fp8_eligibility")
    assert f is not None and f.title == "FP8 eligibility not judged"
    assert (f.numbers["checked"], f.numbers["unknown_shape"]) == (0, 2)
    assert "the run has not saved summary.json" in f.message
    assert "Not eligible" not in f.message and "none of its" not in f.remedy
    assert killed.format != "fp8" and "FP8 eligibility was not judged" in f.remedy


def test_a_killed_runs_report_names_the_model_it_trained(tmp_path: Path) -> None:
    """A run killed before it saved read "Precision report · model · run": the model's class was only in the
    summary written at the end. The first summary names it, and its layers the precision they ran in. A budgeted
    run's "steps sampled" row was missing: the summary that says the budget and why each step was sampled was
    never written. The first summary has the budget, the steps table each step's reason."""
    out = tmp_path / "killed"
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, overhead_budget=0.05, out=out) as prof:
        for _ in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    prof._owned_run.release()  # as a killed job leaves it: its stream and first summary
    html = pipeline.rerender(out).read_text()
    # and the precision its layers ran in, which it never said (read from their dtypes: float32)
    assert "<h1>Precision report · Sequential · fp32</h1>" in html, re.findall(r"<h1>.*?</h1>", html)
    steps = T.read_run(out).tables["steps"]
    reasons = T.texts(steps[T.SAMPLE_REASON])
    n, first = int(T.flags(steps[T.SAMPLED]).sum()), int((reasons == "first").sum())
    assert n >= 2 and first >= 2, steps  # (the first steps of a budgeted run are sampled, whatever it)
    said = f"within 5% of the run's time: {n} of 3 steps ({first} first"
    text = html_text.unescape(html)
    assert said in text and "what the sampled steps took of the run's time is not known" in text


def test_an_exception_in_a_with_block_is_the_runs_cause_not_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside ``with Profiler(out=...)`` left the first summary's "running ...; if it still says
    this, the process ended before it could save: killed (SIGKILL, out of memory ...)" in summary.json and at the
    top of the report, though ``__exit__`` knew the cause. It says the exception in one line (escaped in the
    page: the user's text), after which step, and that the steps recorded up to it are kept; attached again (a
    notebook's next cell) the run says "running" again, and a Ctrl-C says "interrupted". A script that never
    used ``with`` says it at the interpreter's exit (``capture.unsaved``; a real one: tests/test_exit_drain.py)."""
    out = tmp_path / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False)
    kept = "before the run was saved: the steps recorded up to it are kept, and `precprof report"

    def reason() -> str:
        return str(T.read_summary(out)[T.SUMMARY_INCOMPLETE_REASON])

    with pytest.raises(KeyboardInterrupt), prof:
        for step in range(2):
            train_step(model, opt, prof, step)
        raise KeyboardInterrupt
    assert (
        reason()
        == f"interrupted (KeyboardInterrupt); raised after step 1 (the last step prof.step() ended), {kept} {out}` renders them"
    )
    assert prof.status == (T.STATUS_INCOMPLETE, "interrupted (KeyboardInterrupt)")  # what a save writes
    with pytest.raises(ValueError), prof:
        assert reason().startswith(f"running (pid {os.getpid()},")  # attached again: running
        for step in range(2, 4):
            train_step(model, opt, prof, step)
        raise ValueError("user <b>bug</b>\n  at step 3")
    said = f"ValueError: user <b>bug</b> at step 3; raised after step 3 (the last step prof.step() ended), {kept}"
    assert (
        reason() == f"{said} {out}` renders them"
        and T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    )
    assert T.read_run(out).tables["steps"][T.STEP].tolist() == [0, 1, 2, 3]  # the unsampled step 3 too
    prof._owned_run.release()  # as the script's end leaves it
    html = pipeline.rerender(out).read_text()
    banner = html.split('id="incomplete"', 1)[1].split("</div>", 1)[0]
    assert html_text.escape(said, quote=False) in banner and "<b>" not in banner and "killed" not in banner
    # no with: the interpreter's exit says the exception it printed, for a run still held, and only once
    prof2 = precprof.Profiler(model, opt, sample_every=1, out=tmp_path / "run2", memory=False).attach()
    train_step(model, opt, prof2, 0)

    def exits_with(code: str, module: str = "__main__") -> None:
        try:
            exec(compile(code, "train.py", "exec"), {"__name__": module})
        except Exception as e:
            monkeypatch.setattr(sys, "last_value", e, raising=False)
            monkeypatch.setattr(sys, "last_exc", e, raising=False)
        unsaved._at_exit()

    exits_with("raise RuntimeError('a failed test, as pytest keeps it')", "test_train")  # not the script's
    assert str(T.read_summary(tmp_path / "run2")[T.SUMMARY_INCOMPLETE_REASON]).startswith("running (pid")
    exits_with("raise RuntimeError('out of ideas')")
    assert str(T.read_summary(tmp_path / "run2")[T.SUMMARY_INCOMPLETE_REASON]).startswith(
        "RuntimeError: out of ideas; not caught, it ended the script after step 0 (the last step prof.step() "
        "ended), before the run was saved: the steps flushed to its stream up to it are kept"
    )
    assert reason().startswith(said)  # the detached run's own cause stays
    prof2.detach()
    prof2._owned_run.release()


def test_precprof_report_on_a_run_still_being_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "cut off after step 4, never saved its tables": the run is live, its lock names its process.
    The page is what was streamed, and it says the run is still being written; once the run saves, its
    directory has its own report and no lock file."""
    out = tmp_path / "run"
    prof = tiny_run(out, 5)  # detached, not saved yet: this process still holds the run directory
    with pytest.raises(SystemExit) as e:
        cli.main(["report", str(out)])
    stdout, err = capsys.readouterr()
    assert e.value.code in (0, None) and stdout.strip() == str(out / T.REPORT_FILE), err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"precprof: note: {out} is still being written by process {os.getpid()}"), line
    assert "run precprof report again" in line, line
    html = (out / T.REPORT_FILE).read_text()
    assert f"still being written by process {os.getpid()}" in html and "up to step 4" in html
    # one story at the top of the page: a run in progress, never "cut off" nor "ended before it could save"
    assert 'id="live"' in html and 'id="cut-off"' not in html and 'id="incomplete"' not in html
    assert "killed" not in html and "cut off" not in html
    assert len(T.read_run(out).tables["steps"]) == 5  # what was streamed, every step of it
    prof.save()  # the run ends: its own report, and the lock goes with it
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert not (out / rundir.LOCK_FILE).exists()
    with pytest.raises(SystemExit):
        cli.main(["report", str(out)])
    assert capsys.readouterr().err == ""


def test_a_run_whose_with_block_raised_reads_as_stopped_while_its_process_holds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``with Profiler(out=...)`` block that raised keeps its run (``prof.save()`` afterwards saves it whole):
    in a notebook the process goes on holding the lock. ``precprof report`` said "a run still in progress ...
    still being written by process N ... the run writes its own report when it ends" and hid the exception the
    summary gives, and compare called the run "running"; nothing more is written to it and it writes no report
    of its own. It reads as the stopped run it is (the page of the run after its process ends: the cause at the
    top, escaped), and the note says who holds it and what saves it."""
    out = tmp_path / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False)
    with pytest.raises(ValueError), prof:
        for step in range(3):
            train_step(model, opt, prof, step)
        raise ValueError("a <bad> batch")
    assert rundir.live_writer(out) == os.getpid()  # still held: the notebook's process goes on
    with pytest.raises(SystemExit) as e:
        cli.main(["report", str(out)])
    _, err = capsys.readouterr()
    assert e.value.code in (0, None)
    (line,) = err.strip().splitlines()
    assert line == (
        f"precprof: note: {out} is held by process {os.getpid()}, whose Profiler stopped before saving it: "
        "nothing more is written to it; prof.save() in that process saves the steps recorded as the run, and "
        "the process's end releases it"
    )
    html = (out / T.REPORT_FILE).read_text()
    banner = html.split('id="incomplete"', 1)[1].split("</div>", 1)[0]
    assert "ValueError: a &lt;bad&gt; batch; raised after step 2" in banner
    assert 'id="live"' not in html and "still being written" not in html and "in progress" not in html
    assert f"held by process {os.getpid()}, whose Profiler stopped" in html
    run = runs.read_run(runs.Variant("fp32", "auto"), out)
    assert run.status == T.STATUS_INCOMPLETE and run.reason is not None
    assert run.reason == "cut off after step 2: ValueError: a <bad> batch", run.reason  # as once it ended
    prof.save()  # as the note says: the steps recorded, saved as the run; the lock goes
    assert rundir.live_writer(out) is None and len(T.read_run(out).tables["steps"]) == 3
    assert not T.read_run(out).streamed


def test_a_profiler_detached_by_another_on_its_model_reads_as_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``prof = Profiler(model, out=RUN).attach()`` in a cell that raised, the cell run again: the new Profiler
    detaches the old one (a warning) and is refused the run. The old run's summary said "running (pid ...)" and
    ``precprof report`` said "still being written ... writes its own report when it ends" (tester t7): it says
    why it was detached, and reads as the stopped run it is."""
    out = tmp_path / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    old = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False).attach()
    for step in range(4):
        train_step(model, opt, old, step)
    new = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False)
    with (
        pytest.warns(UserWarning, match="was detached: another Profiler attached to the same model"),
        pytest.raises(rundir.RunDirError),
    ):
        new.attach()
    assert not old.attached
    reason = str(T.read_summary(out)[T.SUMMARY_INCOMPLETE_REASON])
    assert reason.startswith(
        "detached after step 3 (the last step prof.step() ended): another Profiler attached to the same model"
    ), reason
    assert reason.endswith(f"the steps recorded up to it are kept, and `precprof report {out}` renders them")
    with pytest.raises(SystemExit):
        cli.main(["report", str(out)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"precprof: note: {out} is held by process {os.getpid()}, whose Profiler stopped"
    ), line
    old.save()  # as the note says
    assert len(T.read_run(out).tables["steps"]) == 4


def notebook_cell(
    model: nn.Module, opt: torch.optim.Optimizer, out: Path, steps: range, raises: bool = False, **kw: Any
) -> precprof.Profiler:
    """A notebook's cell ``prof = Profiler(model, out=RUN); with prof: <train>``: its Profiler, which the
    cell binds before its ``with`` (the one it raised in, or the one whose attach was refused)."""
    prof = precprof.Profiler(model, opt, sample_every=1, out=out, memory=False, **kw)
    cell = pytest.raises(KeyError) if raises else contextlib.nullcontext()
    with cell, prof:
        for step in steps:
            train_step(model, opt, prof, step)
        if raises:
            raise KeyError("typo")
    return prof


def tiny_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def test_a_cell_that_raised_run_again_takes_its_run_over_with_overwrite(tmp_path: Path) -> None:
    """A notebook cell ``prof = Profiler(model, out=RUN); with prof: ...`` that raised, fixed and run again, was
    refused even with ``overwrite=True`` ("a Profiler in this process is still writing ... prof.detach(), then
    prof.save()": ``prof`` was by then the refused one), until the kernel restarted: the first Profiler, detached
    and unsaved, held the directory's lock. Run again without overwrite or resume it is refused in one line that
    says both; with ``overwrite=True`` the new Profiler takes the directory over and its run is whole; the first
    Profiler, still in reach, no longer owns it: its save and report are refused and write nothing."""
    out = tmp_path / "run"
    model, opt = tiny_model()
    first = notebook_cell(model, opt, out, range(3), raises=True)
    assert rundir.live_writer(out) == os.getpid()
    with pytest.raises(rundir.RunDirError) as e:
        notebook_cell(model, opt, out, range(4))  # the cell run again as it was
    (line,) = str(e.value).splitlines()
    assert line == (
        f"out {out}: a Profiler of this process that is no longer attached (a cell run again, a loop that "
        "stopped) holds this run directory's run, not saved; pass overwrite=True to replace that run, "
        "resume=True, first_step=3 to continue it, or choose another out (that Profiler's save(), if you still "
        "have it, "
        "saves the run first)"
    )
    assert T.read_run(out).tables["steps"][T.STEP].tolist() == [0, 1, 2]  # nothing of the refused one
    weights = [p.detach().clone() for p in model.parameters()]
    second = notebook_cell(model, opt, out, range(4), overwrite=True)
    with pytest.raises(rundir.RunDirError, match=r"was taken over by another Profiler"):
        first.save()  # (its stream is the new run's now)
    second.save()
    run = T.read_run(out)
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and not run.streamed
    assert run.tables["steps"][T.STEP].tolist() == [0, 1, 2, 3] and run.restarts == []
    assert sorted(set(run.tables["layers"][T.STEP])) == [0, 1, 2, 3]
    assert rundir.live_writer(out) is None and not (out / rundir.LOCK_FILE).exists()
    saved = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    for late in (first.save, first.report, first.attach):
        with pytest.raises(rundir.RunDirError, match=r"^\S+ was taken over by another Profiler") as e:
            late()
        assert len(str(e.value).splitlines()) == 1
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == saved  # nothing written over
    # the training the second Profiler watched is the one it would be without precprof
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        for p, w in zip(plain.parameters(), weights, strict=True):
            p.copy_(w)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    plain_opt.load_state_dict(opt.state_dict())
    for step in range(4):
        loss = plain(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_cell_that_raised_run_again_with_resume_continues_its_run(tmp_path: Path) -> None:
    """The same cell run again with ``resume=True`` continues the run the first Profiler left unsaved, which
    then holds the steps of both; without the flags, the first Profiler's own save (the refusal's last word)
    saves its run, and the cell run again is then refused as any run there is, ``overwrite=True`` replacing it."""
    out, other = tmp_path / "run", tmp_path / "other"
    model, opt = tiny_model()
    stopped = notebook_cell(model, opt, out, range(3), raises=True)  # (still in reach: not collected)
    resumed = notebook_cell(model, opt, out, range(3, 5), resume=True, first_step=3)
    with pytest.raises(rundir.RunDirError, match="was taken over"):
        stopped.save()
    resumed.save()
    run = T.read_run(out)
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert run.tables["steps"][T.STEP].tolist() == [0, 1, 2, 3, 4] and run.restarts == [3]
    assert rundir.live_writer(out) is None
    first = notebook_cell(model, opt, other, range(2), raises=True)
    with pytest.raises(rundir.RunDirError, match=r"that Profiler's save\(\), if you still have it"):
        notebook_cell(model, opt, other, range(2))
    first.save()  # as the refusal says
    assert T.read_run(other).tables["steps"][T.STEP].tolist() == [0, 1]
    with pytest.raises(rundir.RunDirError, match=r"already holds a precprof run \(incomplete\)"):
        notebook_cell(model, opt, other, range(2))
    notebook_cell(model, opt, other, range(2), overwrite=True).save()
    assert T.read_summary(other)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE


def test_a_profiler_whose_attach_was_refused_saves_nothing(tmp_path: Path) -> None:
    """The cell run again over a saved run: its Profiler's attach is refused, and it recorded nothing; its
    ``save()`` said "pass overwrite=True to replace it", and doing so replaced the first run's 4 steps with a
    "complete" run of none (t7). A Profiler that recorded nothing refuses to save, ``overwrite=True`` and
    ``status="incomplete"`` too, and writes nothing; one whose step 0 crashed with rows recorded still saves."""
    out = tmp_path / "run"
    model, opt = tiny_model()
    notebook_cell(model, opt, out, range(4)).save()
    saved = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    refused = precprof.Profiler(model, opt, sample_every=1, out=out, memory=False)
    with pytest.raises(rundir.RunDirError, match="already holds a precprof run"):
        refused.attach()
    for kw in ({}, {"overwrite": True}, {"status": T.STATUS_INCOMPLETE}, {"report": True}):
        with pytest.raises(RuntimeError) as e:
            refused.report(overwrite=True) if kw.pop("report", False) else refused.save(**kw)  # type: ignore[arg-type]
        assert str(e.value) == (
            "nothing recorded: this Profiler recorded no step (its attach was refused, or no step ended while it "
            "was attached); attach it (`with prof:` or prof.attach()) and call prof.step() after each optimizer "
            "step first"
        )
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == saved
    assert T.read_run(out).tables["steps"][T.STEP].tolist() == [0, 1, 2, 3]
    never = precprof.Profiler(model, opt)
    with pytest.raises(RuntimeError, match=r"^nothing recorded: this Profiler was never attached"):
        never.save(tmp_path / "never", status=T.STATUS_INCOMPLETE)
    assert not (tmp_path / "never").exists()
    crashed = precprof.Profiler(model, opt, sample_every=1, memory=False)
    with pytest.raises(KeyError), crashed:
        model(torch.randn(4, 8)).square().mean().backward()
        raise KeyError("typo")
    crashed.save(tmp_path / "crashed")
    assert T.read_run(tmp_path / "crashed").tables["steps"][T.STEP].tolist() == [0]
    assert T.read_summary(tmp_path / "crashed")[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE


def test_a_cell_that_raised_run_again_with_the_same_profiler_ends_complete(tmp_path: Path) -> None:
    """``with prof:`` raised after 3 steps (an error, Ctrl-C); the same cell run again with the same ``prof`` ended
    3 more steps normally, and the run still said "incomplete", the first block's cause, "the steps recorded
    before the run stopped" (t7). The status its ``__exit__`` set goes when it attaches again; one the user set
    stays."""
    for exc in (ValueError("bug"), KeyboardInterrupt()):
        out = tmp_path / type(exc).__name__
        model, opt = tiny_model()
        prof = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False)
        with pytest.raises(type(exc)), prof:
            for step in range(3):
                train_step(model, opt, prof, step)
            raise exc
        assert prof.status[0] == T.STATUS_INCOMPLETE
        with prof:
            for step in range(3, 6):
                train_step(model, opt, prof, step)
        assert prof.status == (T.STATUS_COMPLETE, None)
        prof.save()
        summary = T.read_summary(out)
        assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and not summary.get(T.SUMMARY_INCOMPLETE_REASON)
        assert T.read_run(out).tables["steps"][T.STEP].tolist() == [0, 1, 2, 3, 4, 5]
    model, opt = tiny_model()
    prof = precprof.Profiler(model, opt, sample_every=2, memory=False)
    with pytest.raises(ValueError), prof:
        train_step(model, opt, prof, 0)
        raise ValueError("bug")
    prof.mark_incomplete("loss went nan")  # the user's word
    with prof:
        train_step(model, opt, prof, 1)
    assert prof.status == (T.STATUS_INCOMPLETE, "loss went nan")


def test_a_profiler_collected_unsaved_lets_its_run_directory_go(tmp_path: Path) -> None:
    """The first Profiler of a cell run again, garbage-collected (its name bound to the new one), kept the
    directory's lock until the process ended (its descriptor was a bare int) and its summary said "running (pid
    ...); if it still says this, the process ended before it could save". Collected, it lets the directory go,
    and the summary says what became of the run: the exception that stopped it where one did, else that its
    Profiler was collected unsaved; ``precprof report`` renders its steps."""
    out, raised = tmp_path / "run", tmp_path / "raised"
    model, opt = tiny_model()
    prof = notebook_cell(model, opt, out, range(3))  # ended, never saved
    other = notebook_cell(model, opt, raised, range(2), raises=True)
    started = str(T.read_summary(out)[T.SUMMARY_INCOMPLETE_REASON])
    assert started.startswith(f"running (pid {os.getpid()}, started ")
    del prof, other
    gc.collect()
    assert rundir.live_writer(out) is None and rundir.live_writer(raised) is None
    who = started[len("running ") : started.index(")") + 1]
    assert T.read_summary(out)[T.SUMMARY_INCOMPLETE_REASON] == unsaved.COLLECTED.format(who=who, run=out)
    assert str(T.read_summary(raised)[T.SUMMARY_INCOMPLETE_REASON]).startswith(
        "KeyError: 'typo'; raised after step 1"
    )
    assert T.read_run(out).tables["steps"][T.STEP].tolist() == [0, 1, 2]
    html = pipeline.rerender(out).read_text()
    assert "garbage-collected" in html and "killed" not in html.split('id="incomplete"', 1)[1][:2000]
    with pytest.raises(rundir.RunDirError) as e:
        notebook_cell(model, opt, out, range(3))
    assert str(e.value) == (
        f"out {out}: {out} already holds a precprof run (incomplete); choose another out, or pass overwrite=True "
        "to replace it (resume=True, first_step=3 to continue it)"
    )
    notebook_cell(model, opt, raised, range(2, 4), resume=True, first_step=2).save()
    assert T.read_run(raised).tables["steps"][T.STEP].tolist() == [0, 1, 2, 3]
    notebook_cell(model, opt, out, range(3), overwrite=True).save()
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE


def test_a_profiler_still_attached_keeps_its_run_directory(tmp_path: Path) -> None:
    """A Profiler attached in this process writes its run: another Profiler given its ``out`` is refused with
    ``overwrite=True`` or ``resume=True`` too (no stealing a live run), and the refusal's fix works as it says:
    that Profiler's detach(), then overwrite=True."""
    out = tmp_path / "run"
    model, opt = tiny_model()
    other, other_opt = tiny_model()
    live = precprof.Profiler(model, opt, sample_every=1, out=out, memory=False).attach()
    train_step(model, opt, live, 0)
    for flags in ({}, {"overwrite": True}, {"resume": True, "first_step": 1}):
        with pytest.raises(rundir.RunDirError) as e:
            notebook_cell(other, other_opt, out, range(1, 2), **flags)
        assert str(e.value) == (
            f"out {out}: a Profiler in this process is still writing this run directory (it is attached); "
            "choose another out, or call that Profiler's detach() first, then pass overwrite=True to replace "
            "its run (resume=True, first_step= the step after its last, to continue it)"
        )
    train_step(model, opt, live, 1)  # it goes on, its run whole
    assert live.attached and rundir.live_writer(out) == os.getpid()
    live.detach()
    notebook_cell(other, other_opt, out, range(2), overwrite=True).save()
    assert T.read_run(out).tables["steps"][T.STEP].tolist() == [0, 1]
    with pytest.raises(rundir.RunDirError, match="was taken over"):
        live.save()


def test_a_report_while_attached_is_a_snapshot_and_the_run_streams_on(tmp_path: Path) -> None:
    """A notebook's look at the run so far, ``prof.report()`` (or ``save()``) while still attached, finished the
    run (h67): the stream became the four tables and stopped, the summary said "complete", and the next look
    wrote every step between the two again (steps 0-6, 5, 6, 7...). Now each look is a page of the steps so
    far, saying that the run is still recording; the stream goes on, and the run saved after detach() equals
    one that never looked, each step once."""
    looks = {3: "report", 4: "save", 6: "report"}  # after an unsampled step (3, 5 pending) and a sampled one

    def run(out: Path, look: bool) -> tuple[dict[str, pd.DataFrame], list[float]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses: list[float] = []
        with precprof.Profiler(model, opt, sample_every=2, out=out) as prof:
            for step in range(9):
                loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.step(loss=loss.detach())
                losses.append(loss.item())
                if look and step in looks:
                    page = prof.report() if looks[step] == "report" else prof.save()
                    # every step ended so far is in the directory, once, and the run is still streaming
                    assert T.read_run(out).tables["steps"][T.STEP].tolist() == list(range(step + 1))
                    assert parts.has_stream(out) and not (out / T.TABLE_FILES["steps"]).exists()
                    summary = T.read_summary(out)
                    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
                    assert summary[T.SUMMARY_INCOMPLETE_REASON].startswith("running (pid")
                    if looks[step] == "report":
                        html = page.read_text()
                        assert page == out / T.REPORT_FILE and 'id="live"' in html
                        assert (
                            f"{out} is still recording: this report is a snapshot as of step {step}" in html
                        )
                        assert 'id="cut-off"' not in html and 'id="incomplete"' not in html
        if look:  # (the run that never looked is only the tables to compare with: its page is not read)
            prof.report()
            html = (out / T.REPORT_FILE).read_text()
            assert 'id="live"' not in html and "still recording" not in html
        else:
            prof.save()
        assert not parts.has_stream(out) and T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
        return T.read_tables(out), losses

    looked, losses = run(tmp_path / "looked", look=True)
    plain, plain_losses = run(tmp_path / "plain", look=False)
    assert looked["steps"][T.STEP].tolist() == list(range(9))
    assert looked["steps"][T.LOSS].tolist() == pytest.approx(losses) and losses == plain_losses
    assert sorted(set(looked["layers"][T.STEP])) == [0, 2, 4, 6, 8]
    for name in ("layers", "histograms", "memory"):
        pd.testing.assert_frame_equal(looked[name], plain[name])
    cols = [T.STEP, T.LOSS, T.SAMPLED, T.SKIPPED]
    pd.testing.assert_frame_equal(looked["steps"][cols], plain["steps"][cols])


def test_a_report_while_attached_without_out_says_it_is_a_snapshot(tmp_path: Path) -> None:
    """``prof.report(DIR)`` while still attached, with no ``out`` to stream into, wrote the steps so far as a
    finished run (t4): status "complete", ``training_finished`` true, and a page that never said the run was
    still recording, where the same look with ``out=`` says so. It says what it is: incomplete, "still
    recording", a snapshot as of its last step; the save after detach() is the finished run, there."""
    out = tmp_path / "look"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for step in range(5):
            train_step(model, opt, prof, step)
            if step == 2:
                html = prof.report(out).read_text()
                summary = T.read_summary(out)
                assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
                assert summary[T.SUMMARY_TRAINING_FINISHED] is False
                assert summary[T.SUMMARY_INCOMPLETE_REASON].startswith(
                    f"{out} is still recording: this run is a snapshot as of step 2"
                )
                assert 'id="live"' in html and f"{out} is still recording" in html
                assert 'id="incomplete"' not in html
    assert prof.report(out) == out / T.REPORT_FILE  # detached: the finished run replaces the snapshot
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and summary[T.SUMMARY_TRAINING_FINISHED] is True
    assert T.read_tables(out)["steps"][T.STEP].tolist() == list(range(5))
    assert "still recording" not in (out / T.REPORT_FILE).read_text()


def test_a_report_rendered_while_the_run_ends_never_replaces_the_runs_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`precprof report` on a live run renders the parts streamed so far; if the run writes its own
    report.html meanwhile (it ended), the older page must not replace it."""
    out = tmp_path / "run"
    prof = tiny_run(out, 3)
    real = pipeline.render_run_dir

    def the_run_ends_meanwhile(*args: object, **kwargs: object) -> Path:
        page = real(*args, **kwargs)  # type: ignore[arg-type]
        prof.save(render=True)  # the run's own report.html, from its saved tables
        return page

    monkeypatch.setattr(pipeline, "render_run_dir", the_run_ends_meanwhile)
    assert pipeline.rerender(out) == out / T.REPORT_FILE
    html = (out / T.REPORT_FILE).read_text()
    assert "still being written" not in html and 'id="cut-off"' not in html
    assert [p for p in out.iterdir() if p.name.startswith(".") and p.name != rundir.LOCK_FILE] == []


def test_a_torn_last_part_is_skipped_with_a_notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "USE_PROCESS", False)  # a part for each flush (the process may join them)
    out = tmp_path / "run"
    prof = tiny_run(out, 5)  # detached, never saved: as a killed run leaves it
    assert prof.run_dir == out
    seg = parts.segments(out)[0].path
    last_layers = sorted(seg.glob("*.layers.parquet"))[-1]
    last_layers.write_bytes(last_layers.read_bytes()[:100])  # torn mid-write (a node failure)
    read = T.read_run(out)
    assert any(last_layers.name in n and "damaged" in n for n in read.notices)
    assert sorted(set(read.tables["layers"][T.STEP])) == [0, 1, 2, 3]
    assert read.last_step == 4
    # a torn steps part loses its flush: the other parts of that flush have no step to belong to
    last_steps = sorted(seg.glob("*.steps.parquet"))[-1]
    last_steps.write_bytes(b"PAR1 not a parquet file")
    read = T.read_run(out)
    assert read.last_step == 3 and sorted(set(read.tables["histograms"][T.STEP])) == [0, 1, 2, 3]
    html = pipeline.rerender(out).read_text()
    # (this process still holds the run: the page calls it a run in progress, streamed up to step 3)
    assert "damaged and was skipped" in html and "up to step 3" in html and 'id="live"' in html


def test_a_flush_the_writer_thread_was_writing_at_a_kill_loses_no_step_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while its writer process still started, a run's own writer thread was writing a flush: its layers
    and histograms parts were on disk, its steps part not, its memory part a ``.tmp`` (tester t5). That flush is
    skipped whole, with a notice, and every step of the flushes before it is read (a regression guard: it held
    already; the README says what such a kill loses)."""
    monkeypatch.setattr(stream, "USE_PROCESS", False)  # the thread writes, as while the process starts
    out = tmp_path / "run"
    tiny_run(out, 5)  # detached, never saved: as a killed run leaves it
    # its lock released, as a killed process's is (the Profiler, collected, lets go of it): left to whenever the
    # collector ran, the page was now a live run's ("up to step 3"), now a killed one's
    gc.collect()
    assert rundir.live_writer(out) is None
    seg = parts.segments(out)[0].path
    last = sorted(seg.glob("*.steps.parquet"))[-1].name.split(".")[0]
    (seg / f"{last}.steps.parquet").unlink()
    memory = seg / f"{last}.memory.parquet"
    if memory.exists():
        memory.rename(seg / f".{last}.memory.parquet.{os.getpid()}.tmp")
    assert (seg / f"{last}.layers.parquet").exists() and (seg / f"{last}.histograms.parquet").exists()
    read = T.read_run(out)
    assert read.tables["steps"][T.STEP].tolist() == [0, 1, 2, 3]
    assert sorted(set(read.tables["layers"][T.STEP])) == [0, 1, 2, 3]
    assert sorted(set(read.tables["histograms"][T.STEP])) == [0, 1, 2, 3]
    assert [n for n in read.notices if "cut off while it was written" in n], read.notices
    html = pipeline.rerender(out).read_text()
    assert "Traceback" not in html and "The run was cut off; its record ends after step 3." in html


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt.pt"
    procs = [worker("full", full), worker("crash", resumed, ckpt)]
    for p in procs:
        p.communicate(timeout=120)
    assert procs[0].returncode == 0 and procs[1].returncode == -signal.SIGKILL
    crashed = T.read_run(resumed)
    assert crashed.last_step == 9  # flushed through sampled step 9; step 10 died on the device side
    proc = worker("resume", resumed, ckpt)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    a, b = T.read_run(full), T.read_run(resumed)
    assert b.restarts == [6] and a.restarts == []
    for name in ("layers", "histograms"):
        pd.testing.assert_frame_equal(b.tables[name], a.tables[name])
    # precprof's own scratch grows with the tensors its process has read so far: not the training's memory
    mem_a, mem_b = (t.tables["memory"] for t in (a, b))
    own_a, own_b = (m[T.COMPONENT] == T.PROFILER_BUFFERS for m in (mem_a, mem_b))
    pd.testing.assert_frame_equal(mem_b[~own_b], mem_a[~own_a])
    assert mem_b[own_b][T.STEP].tolist() == mem_a[own_a][T.STEP].tolist()
    steps_a, steps_b = a.tables["steps"], b.tables["steps"]
    assert steps_b[T.STEP].tolist() == list(range(14))  # steps 6..9 recorded twice, counted once
    assert steps_b[T.RESUMED].tolist() == [s == 6 for s in range(14)]
    cols = [c for c in T.STEPS_COLUMNS if c not in (T.TIME_S, T.RESUMED)]
    pd.testing.assert_frame_equal(steps_b[cols], steps_a[cols])
    summary = T.read_summary(resumed)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert summary[T.SUMMARY_CAPTURE]["stream"]["resumed_from"] == 6
    html = pipeline.rerender(resumed).read_text()
    assert "resumed from a checkpoint at step 6" in html


def test_resume_adopts_a_run_that_saved_its_tables(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tiny_run(out, 6).save(status=T.STATUS_INCOMPLETE, reason="terminated (SIGTERM)")
    assert not parts.has_stream(out)
    with rundir.claim(out, resume=True) as run:  # what Profiler(out, resume=True) does first
        assert parts.has_stream(run.path)
    read = T.read_run(out)
    assert read.last_step == 5 and len(read.tables["layers"]) > 0 and read.restarts == []


@pytest.mark.parametrize("status", [T.STATUS_INCOMPLETE, T.STATUS_COMPLETE])
def test_a_saved_run_resumed_saves_and_reads_whole(tmp_path: Path, status: str) -> None:
    """A run saved (finished, or stopped and saved as incomplete as the callbacks do on Ctrl-C), then continued
    with ``Profiler(out=same, resume=True)`` from its step-4 checkpoint: the save failed ("Field resumed has
    incompatible types: bool vs double": the adopted table's bools beside a streamed part's all-null floats)
    and left a directory ``precprof report`` could not read. It saves the first attempt's steps 0-3 and the
    resumed steps 4-7, and reads and renders."""
    out = tmp_path / "run"
    tiny_run(out, 6).save(
        status=status, reason="terminated (SIGTERM)" if status != T.STATUS_COMPLETE else None
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = precprof.Profiler(model, opt, sample_every=1, out=out, resume=True, first_step=4)
    with prof:
        for step in range(4, 8):
            train_step(model, opt, prof, step)
    prof.save()
    read = T.read_run(out)
    steps = read.tables["steps"]
    assert steps[T.STEP].tolist() == list(range(8)) and read.restarts == [4]
    assert steps[T.RESUMED].tolist() == [s == 4 for s in range(8)] and steps[T.LOSS].notna().all()
    assert sorted(set(read.tables["layers"][T.STEP])) == list(range(8))
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert "resumed from a checkpoint at step 4" in pipeline.rerender(out).read_text()


def test_parts_with_a_column_of_nulls_read_with_the_type_of_another_part() -> None:
    """A column no row of a part had a value in, written as float64 nulls before the bool columns had a type of
    their own, concatenates with the bools of another part."""
    import pyarrow as pa

    a = pa.table({T.STEP: pa.array([0, 1]), T.RESUMED: pa.array([False, True])})
    b = pa.table({T.STEP: pa.array([2]), T.RESUMED: pa.nulls(1, pa.float64())})
    t = parts.concat([a, b])
    assert t is not None and t.column(T.RESUMED).to_pylist() == [False, True, None]


def test_the_recording_memory_stays_bounded(tmp_path: Path) -> None:
    from precprof.flush import Flush

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes: dict[str, list[int]] = {"stream": [], "memory": []}
    for how, out in (("stream", tmp_path / "run"), ("memory", None)):
        prof = precprof.Profiler(model, opt, sample_every=1, out=out, memory=False)
        with prof:
            for step in range(120):
                model(torch.randn(2, 32)).sum().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
                if step % 10 == 0 or step == 119:
                    sizes[how].append(prof._recorded.host_bytes)
            if how == "memory":  # one step's flush as the stream holds it: its rows and its Arrow tables
                prof.tables()
                kept = prof._recorded.kept
                one = Flush(kept.step_rows[:1], kept.layer_parts[:1], kept.hist_parts[:1])
                one.arrow()
                per_flush = one.nbytes  # decoded rows, an upper bound of the compact ones the stream holds
    # kept in memory, the recording grows with the run (120 sampled steps)
    assert sizes["memory"][-1] > 100 * sizes["memory"][0]
    # streamed, it holds what waits for the writer: at most the queue (2), the flushes being written (those it
    # found queued: 2 at most) and a new one
    assert max(sizes["stream"]) <= 5 * per_flush < sizes["memory"][-1] / 4
    assert len(T.read_tables(tmp_path / "run")["steps"]) == 120


# ------------------------------------------------------------------------------- merged parts, fast reads
def test_parts_merge_every_few_flushes_and_read_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parts, "COMPACT_EVERY", 3)
    kept = tiny_run(None, 8).tables()
    streamed = tiny_run(tmp_path / "run", 8)
    seg = parts.segments(tmp_path / "run")[0].path
    spans = sorted(
        tuple(int(n) for n in p.name.split(".")[0].split("-"))
        for p in seg.iterdir()
        if p.name.endswith(".parquet")
    )
    # parts numbered 0.. (one a flush, or one for the flushes a writer behind the training found queued), every
    # 3 of them merged, the last ones single: {0-2, 3-5, 6, 7} when the writer was never behind
    spans = sorted(set(spans))
    assert [s[0] for s in spans] == [0, *(s[-1] + 1 for s in spans[:-1])], spans  # each part once, in order
    merged = [s for s in spans if len(s) == 2]
    assert len(merged) >= 1 and all(a % 3 == 0 and b == a + 2 for a, b in merged), spans
    assert all(len(s) == 1 for s in spans[len(merged) :]) and len(spans) - len(merged) < 3, spans
    tables = streamed.tables()
    for name in ("layers", "histograms", "memory"):
        pd.testing.assert_frame_equal(tables[name], kept[name], check_dtype=False)
    drop = [T.TIME_S, T.RESUMED]
    pd.testing.assert_frame_equal(
        tables["steps"].drop(columns=drop), kept["steps"].drop(columns=drop), check_dtype=False
    )


def test_a_merge_left_behind_or_cut_off_counts_each_flush_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parts, "COMPACT_EVERY", 1000)  # no merge while it trains: the test makes them
    # a part for each flush: the thread writes them one by one (the process, behind, may write queued ones
    # as one)
    monkeypatch.setattr(stream, "USE_PROCESS", False)
    run = tmp_path / "run"
    tiny_run(run, 6, memory_every=1)  # every flush writes each of the 4 tables
    seg = parts.segments(run)[0].path
    full = T.read_run(run)
    singles = {p.name: p.read_bytes() for p in seg.iterdir() if p.name.endswith(".parquet")}
    assert len(singles) == 6 * 4

    def restore_singles() -> None:
        for name, data in singles.items():
            (seg / name).write_bytes(data)

    def same() -> None:
        got = T.read_run(run)
        assert got.notices == []
        for name, df in full.tables.items():
            pd.testing.assert_frame_equal(got.tables[name], df, check_dtype=False)

    # a kill after the merge was committed, before it deleted the single parts: the range counts, once
    assert parts.compact(seg, 0, 2, T.TABLES) == 3
    assert not (seg / "00000000.steps.parquet").exists()
    restore_singles()
    same()
    # a kill during a merge, before its steps part: the merge is ignored, the single parts count
    assert parts.compact(seg, 3, 5, T.TABLES) == 3
    (seg / "00000003-00000005.steps.parquet").unlink()
    restore_singles()
    same()
    assert {p.name.split(".")[0] for p in seg.iterdir()} >= {"00000000-00000002", "00000003-00000005"}


def test_parts_whose_column_types_differ_are_read_together(tmp_path: Path) -> None:
    """One flush wrote a column as integers, another as floats with a missing value: the dataset read falls
    back to reading part by part and promotes the types; nothing is lost and no notice is given."""
    import pyarrow as pa

    run = tmp_path / "run"
    seg = parts.new_segment(run, 0)
    a = pa.table({T.STEP: pa.array([0, 1], pa.int64()), T.LOSS: pa.array([1, 2], pa.int64())})
    b = pa.table({T.STEP: pa.array([2, 3], pa.int64()), T.LOSS: pa.array([None, 2.5], pa.float64())})
    parts.write_part(parts.part_path(seg.path, 0, "steps"), a)
    parts.write_part(parts.part_path(seg.path, 1, "steps"), b)
    read = parts.read_stream(run, ("steps",), T.STEP)
    assert read.notices == [] and read.parts == 2
    (t,) = read.tables["steps"]
    assert t.column(T.STEP).to_pylist() == [0, 1, 2, 3]
    assert t.column(T.LOSS).to_pylist() == [1.0, 2.0, None, 2.5]
    # only the columns asked for (a resume reads five of a long run's hundred layer columns), part by part here
    # and as one dataset where the types agree; a column no part has is left out
    for where, loss in ((run, b), (tmp_path / "same", a)):
        if where != run:
            seg2 = parts.new_segment(where, 0)
            parts.write_part(parts.part_path(seg2.path, 0, "steps"), a)
            parts.write_part(
                parts.part_path(seg2.path, 1, "steps"), loss.set_column(0, T.STEP, pa.array([2, 3]))
            )
        only = parts.read_stream(where, ("steps",), T.STEP, columns={"steps": (T.STEP, "absent")})
        (t,) = only.tables["steps"]
        assert t.column_names == [T.STEP] and t.column(T.STEP).to_pylist() == [0, 1, 2, 3]


@pytest.mark.parametrize("mode,nan_at", [("fp16", None), ("bf16", None), ("fp16", 7)])
def test_the_report_and_advisor_read_categoricals_as_they_read_text(
    tmp_path: Path, mode: str, nan_at: int | None
) -> None:
    """``read_run(categorical=True)`` (what `precprof report` reads) gives the same recommendation and the same
    page as the tables read as text."""
    from report_fixtures import synthetic_run

    from precprof.analysis import advisor
    from precprof.report.render import render_html

    tables, summary = synthetic_run(mode, steps=12, nan_at=nan_at)
    T.write_tables(tmp_path, tables)
    plain = T.read_run(tmp_path).tables
    cat = T.read_run(tmp_path, categorical=True).tables
    assert isinstance(cat["histograms"][T.MODULE].dtype, pd.CategoricalDtype)
    assert not isinstance(plain["histograms"][T.MODULE].dtype, pd.CategoricalDtype)
    rec_plain = advisor.recommend(plain, summary=summary).to_dict()
    rec_cat = advisor.recommend(cat, summary=summary).to_dict()
    assert rec_cat == rec_plain
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")  # when the page was made
    a = stamp.sub("", render_html(cat, summary, rec_plain))
    b = stamp.sub("", render_html(plain, summary, rec_plain))
    assert a == b


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_the_report_drawn_from_histogram_totals_is_the_same_page(tmp_path: Path, mode: str) -> None:
    """``read_run(histogram_totals=True)`` (what `precprof report` reads when it does not advise) sums the
    histograms in Arrow and leaves the per-step table empty: the page is the one drawn from the steps, for
    saved tables and for a stream."""
    from report_fixtures import synthetic_run

    from precprof.report.render import render_html

    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")  # when the page was made

    def page(read: T.RunTables) -> str:
        return stamp.sub("", render_html(read.tables, summary, rec, stream=read))

    tables, summary = synthetic_run(mode, steps=12)
    rec = summary.get(T.SUMMARY_RECOMMENDATION)
    T.write_tables(tmp_path, tables)
    totals = T.read_run(tmp_path, categorical=True, histogram_totals=True)
    assert totals.tables["histograms"].empty and len(totals.histogram_totals)
    assert page(totals) == page(T.read_run(tmp_path))
    if mode != "fp16":
        return  # (the stream below is the same run in either mode)

    tiny_run(tmp_path / "run", 5)  # never saved: read from its parts
    assert parts.has_stream(tmp_path / "run")
    summary = T.read_summary(tmp_path / "run")
    rec = None
    totals = T.read_run(tmp_path / "run", categorical=True, histogram_totals=True)
    plain = T.read_run(tmp_path / "run")
    assert totals.tables["histograms"].empty and totals.streamed
    assert page(totals) == page(plain)


def test_histogram_totals_sum_each_key_over_steps() -> None:
    """Against a sum by hand: keys whose text is missing (None) group with "", dictionaries of different
    parts are merged, and a run without histograms gives an empty frame of the right columns."""
    import pyarrow as pa

    first = pa.table(
        {
            T.STEP: [0, 0, 0, 0],
            T.MODULE: pa.array(["a", "a", None, "b"]).dictionary_encode(),
            T.TENSOR: ["weight_grad"] * 4,
            T.PARAM: ["weight", "weight", "", None],
            T.EXPONENT: [-3, -4, -3, 0],
            T.COUNT: [5, 1, 2, 7],
        }
    )
    second = pa.table(
        {
            T.STEP: [2, 2, 2],
            T.MODULE: pa.array(["", "a", "c"]).dictionary_encode(),
            T.TENSOR: ["weight_grad"] * 3,
            T.PARAM: ["", "weight", "bias"],
            T.EXPONENT: [-3, -3, 1],
            T.COUNT: [10, 100, 3],
        }
    )
    got = T.sum_histograms(parts.concat([first, second]))
    by_key = {
        (r[T.TENSOR], r[T.MODULE], r[T.PARAM], r[T.EXPONENT]): r[T.COUNT] for r in got.to_dict("records")
    }
    g = "weight_grad"
    assert by_key == {
        (g, "a", "weight", -3): 105,
        (g, "a", "weight", -4): 1,
        (g, "", "", -3): 12,
        (g, "b", "", 0): 7,
        (g, "c", "bias", 1): 3,
    }
    assert list(got.columns) == list(T.HISTOGRAM_TOTALS_COLUMNS)
    empty = T.sum_histograms(None)
    assert empty.empty and list(empty.columns) == list(T.HISTOGRAM_TOTALS_COLUMNS)


def test_a_flush_decoded_on_two_threads_at_once_holds_each_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled step's rows are decoded when first read, and a flush can be read on two threads at once (the
    stream writer's, and the live dashboards' on the training thread): each step's layer and histogram columns
    end up in it once, the same as one thread decodes."""
    from precprof import flush as columns
    from precprof.flush import Flush

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    prof = precprof.Profiler(model, sample_every=1, memory=False)
    with prof:
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            prof.step()
    kept = prof._recorded.kept
    assert sum(isinstance(p, columns.StepRows) for p in kept.layer_parts) == 3
    alone, shared = Flush(), Flush()
    alone.extend(kept)
    shared.extend(kept)
    want = alone.frames()
    decode = columns.StepRows.decode

    def slow_decode(self: columns.StepRows) -> Any:
        time.sleep(0.05)  # both threads inside the loop at once, were it not for the lock
        return decode(self)

    monkeypatch.setattr(columns.StepRows, "decode", slow_decode)
    threads = [threading.Thread(target=shared.decoded) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = shared.frames()
    assert len(shared.layer_parts) == len(shared.hist_parts) == 3  # one per sampled step
    for name in ("layers", "histograms"):
        pd.testing.assert_frame_equal(got[name], want[name])


@pytest.mark.usefixtures("block_formats_on")
def test_the_stream_writes_each_flush_as_the_frames_path_would_type_for_type() -> None:
    """The stream writer turns a flush's layer and histogram columns into Arrow without a pandas frame on the
    way (``Flush.arrow``): every table equals, schema and values, what ``to_arrow`` makes of ``frames()``, for
    flushes of one sampled step, of several (block columns on some steps only: NaN on the others), with fp16
    loss scaling, memory rows, a step that recorded no layer, and a skipped tensor."""
    from precprof.capture.recorded import Recorded
    from precprof.flush import Flush

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    flushes: list[Flush] = []
    take = Recorded.take

    def kept(self: Recorded) -> Flush:
        flush = take(self)
        flushes.append(flush)
        return flush

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Recorded, "take", kept)
        prof = precprof.Profiler(model, opt, scaler=scaler, sample_every=2, block_groups=2)
        with prof:
            for _ in range(6):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8)).float().square().mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                prof.step(loss=loss.detach())
    assert any(f.memory_rows for f in flushes) and any(f.layer_parts for f in flushes)
    whole = Flush()
    for f in flushes:
        whole.extend(f)
    for flush in [*flushes, whole]:
        frames = flush.frames()
        got = flush.arrow()
        for name in T.TABLES:
            if frames[name].empty and name != "steps":
                assert name not in got
                continue
            want = T.to_arrow(name, frames[name])
            assert got[name].schema == want.schema, (name, got[name].schema, want.schema)
            assert got[name].equals(want), name
    blocks = whole.frames()["layers"][T.BLOCK_COLUMNS[0]]
    assert blocks.isna().any() and blocks.notna().any()  # rows with block numbers and rows without


def test_columns_joined_from_arrow_lists_and_missing_pieces_make_the_frames_table() -> None:
    """Parts of a flush may hold a text column as Arrow strings (decoded for the stream), as a list, or not at
    all, and a number column as integers in one part and missing in another: joined, the Arrow table equals
    ``to_arrow`` of the pandas frame the same parts make (whose missing texts were the text "nan" before)."""
    import numpy as np
    import pyarrow as pa

    from precprof.flush import _join_columns, _joined

    parts = [
        {T.STEP: np.array([1, 1]), T.MODULE: pa.array(["a", "b"]), T.CALLS: np.array([1, 2])},
        {T.STEP: np.array([2]), T.MODULE: ["<c>"], T.NUMEL: np.array([7.0])},
        {T.STEP: np.array([3, 3]), T.CALLS: np.array([3, 4])},
    ]
    pandas_parts = [{k: v.to_pylist() if isinstance(v, pa.Array) else v for k, v in p.items()} for p in parts]
    want = T.to_arrow("layers", T.frame("layers", _join_columns(pandas_parts)))
    got = T.arrow_of_columns("layers", _joined(parts))
    assert got.schema == want.schema and got.equals(want)
    assert got.column(T.MODULE).to_pylist() == ["a", "b", "<c>", None, None]
    assert _join_columns(pandas_parts)[T.MODULE].isna().tolist() == [False] * 3 + [True] * 2  # not "nan"
    assert got.column(T.CALLS).to_pylist() == [1.0, 2.0, None, 3.0, 4.0]


def test_a_flush_that_cannot_become_arrow_ends_no_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the writer thread writes (``stream.USE_PROCESS`` off, as where the process cannot start), the
    stream's tables are made on the training thread (``StreamWriter.put``): when that fails, the step goes on,
    the writer's thread meets the failure again, says why, and keeps the rows in memory, where ``tables()``
    reads them."""

    def broken(name: str, cols: object) -> object:
        raise ValueError("no Arrow today")

    monkeypatch.setattr(stream, "USE_PROCESS", False)
    monkeypatch.setattr(T, "arrow_of_columns", broken)
    kept = tiny_run(None, 5, sample_every=2).tables()
    with pytest.warns(
        UserWarning, match=r"stopped writing \(ValueError: no Arrow today\): the steps from then"
    ):
        streamed = tiny_run(tmp_path / "run", 5, sample_every=2)
    sink = streamed._recorded.sink
    assert sink is not None and sink.writer == "thread" and sink.error == "ValueError: no Arrow today"
    tables = streamed.tables()
    assert len(tables["steps"]) == 5
    pd.testing.assert_frame_equal(tables["layers"], kept["layers"], check_dtype=False)


def test_a_writer_process_that_dies_ends_no_training_and_loses_no_row(tmp_path: Path) -> None:
    """The writer process ignores Ctrl-C and SIGTERM (the training's handler saves the run, then closes the
    pipe); killed (the OOM killer), the training goes on, ``error`` says the process ended, the flushes it had
    not written stay in memory, and ``tables()`` holds every step, as a run kept in memory does."""
    kept = tiny_run(None, 8, sample_every=2).tables()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = precprof.Profiler(model, opt, sample_every=2, out=tmp_path / "run")
    stopped = r"stopped writing after step \d \(the stream's writer process ended \(exit code -9\)\)"
    with pytest.warns(UserWarning, match=stopped), prof:  # (said once: at a flush, or at the detach)
        sink = prof._recorded.sink
        assert sink is not None
        for step in range(8):
            if step == 2:
                assert sink._proc is not None and sink.writer == "process"
                proc = sink._proc.proc
                wait_ready(sink)  # (its imports done, Ctrl-C ignored)
                proc.send_signal(signal.SIGINT)
                proc.send_signal(signal.SIGTERM)  # (what Slurm sends every process of a job)
            if step == 4:
                sink.drain()
                assert proc.poll() is None, "Ctrl-C or SIGTERM ended the writer process"
                assert sink.error is None and sink.parts_written > 0
                proc.kill()
                proc.wait()
            train_step(model, opt, prof, step)
    assert sink.error is not None and "the stream's writer process ended (exit code -9)" in sink.error
    assert sink.unwritten
    tables = prof.tables()
    for name in ("steps", "layers", "histograms"):
        assert len(tables[name]) == len(kept[name]), name
    pd.testing.assert_frame_equal(tables["layers"], kept["layers"], check_dtype=False)
    pd.testing.assert_frame_equal(
        tables["steps"].drop(columns=[T.TIME_S, T.RESUMED]),  # (resumed: False read from parts, else NaN)
        kept["steps"].drop(columns=[T.TIME_S, T.RESUMED]),
        check_dtype=False,
    )


def test_a_killed_writer_process_is_said_at_the_users_prof_step_line(tmp_path: Path) -> None:
    """Tester t4: the stream's writer process killed mid-run; in the user's own loop the warning that says so
    points at the user's line that met it, their ``prof.step()``, not into precprof."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 8)
    said: list[Any] = []
    with precprof.Profiler(model, opt, sample_every=1, out=tmp_path / "run") as prof:
        sink = prof._recorded.sink
        assert sink is not None and sink._proc is not None and sink.writer == "process"
        for step in range(6):
            if step == 2:
                sink.drain()
                wait_ready(sink)
                sink._proc.proc.kill()
                sink._proc.proc.wait()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                here = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
                prof.step()
            said += [(w, here) for w in caught if "stopped writing" in str(w.message)]
            if step == 2:
                sink.drain()  # (the writer thread met the ended process: said at the next step)
    assert len(said) == 1, [str(w.message) for w, _ in said]
    ((w, line),) = said
    assert "the stream's writer process ended (exit code -9)" in str(w.message)
    assert (w.filename, w.lineno) == (__file__, line)


def test_a_run_directory_removed_mid_run_says_which_steps_it_lost(tmp_path: Path) -> None:
    """The run directory removed while the Profiler streams into it (``rm -rf`` of it, tester t4): training
    goes on; the run was saved ``complete`` with the steps after the removal alone, the stream's error in the
    summary's capture block its only trace. Now the stream's stop is a warning on the next sampled step
    (which steps were lost, and why), and the save makes the run incomplete, saying which steps were lost, in
    summary.json, in the page's top notice and in the RunNotSavedWarning at the user's line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = tmp_path / "run"
    prof = precprof.Profiler(model, opt, sample_every=1, out=out)
    with prof:
        sink = prof._recorded.sink
        assert sink is not None
        for step in range(3):
            train_step(model, opt, prof, step)
        sink.drain()  # steps 0-2 are on disk
        shutil.rmtree(out)
        train_step(model, opt, prof, 3)
        sink.drain()  # the stream met the removal
        with pytest.warns(UserWarning, match="stopped writing after step 2") as said:
            train_step(model, opt, prof, 4)
        assert "steps 0-2, written there, are lost" in str(said[0].message), str(said[0].message)
        assert said[0].filename == __file__
        train_step(model, opt, prof, 5)
    with pytest.warns(RunNotSavedWarning, match="steps 0-2 were lost") as said:
        here = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        prof.report()
    assert (said[0].filename, said[0].lineno) == (__file__, here)
    summary = T.read_summary(out)
    reason = summary[T.SUMMARY_INCOMPLETE_REASON]
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE and summary[T.SUMMARY_TRAINING_FINISHED], summary
    assert reason.startswith(f"steps 0-2 were lost: the stream wrote them to {out}, which no longer"), reason
    assert "FileNotFoundError" in reason, reason
    assert prof.status == (T.STATUS_INCOMPLETE, reason)
    assert T.read_tables(out)["steps"][T.STEP].tolist() == [3, 4, 5]
    page = html_text.unescape(re.sub(r"<[^>]+>", "", (out / T.REPORT_FILE).read_text()))
    assert f"Incomplete run. {reason}" in " ".join(page.split()), reason


def test_a_save_that_did_not_fit_whole_leaves_every_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that stopped writing (a disk that filled while the run trained) keeps its later flushes in
    memory; a save that then wrote some tables whole but not layers.parquet (no room) already holds those rows.
    ``tables()`` and the save that follows (room made) added them again from memory: every step after the
    stream stopped was there twice (h69). Both equal the same run kept in memory."""
    kept = tiny_run(None, 7, sample_every=2).tables()
    monkeypatch.setattr(stream, "USE_PROCESS", False)  # the thread writes: the failure below is its own
    real, write_parquet = T.arrow_of_columns, runfiles.write_parquet

    def no_room_for_layers(df: pd.DataFrame, path: Path) -> None:
        if T.TABLE_FILES["layers"] in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_parquet(df, path)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = tmp_path / "run"
    prof = precprof.Profiler(model, opt, sample_every=2, out=out)
    with pytest.warns(UserWarning, match=r"stopped writing after step 2 \(ZeroDivisionError"), prof:
        sink = prof._recorded.sink
        assert sink is not None
        for step in range(7):
            if step == 3:  # steps 0-2 are on disk; from here the stream cannot write
                sink.drain()
                monkeypatch.setattr(T, "arrow_of_columns", lambda name, cols: 1 / 0)
            train_step(model, opt, prof, step)
    assert sink.error is not None and sink.unwritten
    monkeypatch.setattr(T, "arrow_of_columns", real)
    monkeypatch.setattr(runfiles, "write_parquet", no_room_for_layers)
    with pytest.warns(UserWarning, match="not saved whole"):
        prof.save()
    assert (out / T.TABLE_FILES["steps"]).exists() and not (out / T.TABLE_FILES["layers"]).exists()

    def assert_as_kept(tables: dict[str, pd.DataFrame]) -> None:
        assert tables["steps"][T.STEP].tolist() == list(range(7))
        for name in ("layers", "histograms", "memory"):
            pd.testing.assert_frame_equal(tables[name], kept[name], check_dtype=False)
        cols = [T.STEP, T.LOSS, T.SAMPLED]
        pd.testing.assert_frame_equal(tables["steps"][cols], kept["steps"][cols], check_dtype=False)

    assert_as_kept(prof.tables())
    monkeypatch.setattr(runfiles, "write_parquet", write_parquet)  # room made: the user saves again
    prof.save()
    assert not parts.has_stream(out)
    assert_as_kept(T.read_tables(out))


def test_the_writer_process_imports_nothing_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training started in a folder that holds a json.py (or any name of the standard library's): the
    writer process imports precprof and the standard library, not that file, and writes."""
    (tmp_path / "json.py").write_text("raise ImportError('the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(writer_process, "_current", None)  # a process started here, not an earlier test's
    model = nn.Sequential(nn.Linear(8, 4))
    prof = precprof.Profiler(model, sample_every=1, out=tmp_path / "run").attach()
    sink = prof._recorded.sink
    assert sink is not None and sink._proc is not None
    wait_ready(sink)
    for _ in range(4):
        model(torch.randn(2, 8)).sum().backward()
        prof.step()
    sink.drain()
    assert sink.writer == "process" and sink._proc.ready and sink.error is None, (
        sink.writer_note,
        sink.error,
    )
    prof.detach()
    assert len(prof.tables()["steps"]) == 4


def test_runs_of_one_python_share_one_writer_process_each_into_its_own_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs streaming at once (two Profilers, their steps interleaved) and a third after them, from
    another working directory with a relative ``out``: one writer process writes each into its own run, each
    equal to the run kept in memory. Used by no run for ``IDLE_S`` it ends; the next run starts another."""
    monkeypatch.setattr(writer_process, "_current", None)  # this test's process, not an earlier test's
    monkeypatch.setattr(writer_process, "IDLE_S", 0.3)
    kept = tiny_run(None, 6, sample_every=2).tables()
    profs, models, opts = [], [], []
    for name in ("a", "b"):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
        opts.append(torch.optim.SGD(models[-1].parameters(), lr=0.05))
        profs.append(precprof.Profiler(models[-1], opts[-1], sample_every=2, out=tmp_path / name).attach())
    procs = [p._recorded.sink._proc for p in profs]  # type: ignore[union-attr]
    assert procs[0] is procs[1] and procs[0] is not None and procs[0].users == 2
    wait_ready(profs[0]._recorded.sink)
    for step in range(6):
        for prof, model, opt in zip(profs, models, opts, strict=True):
            train_step(model, opt, prof, step)
    for prof in profs:
        prof.detach()
        prof.save()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    third = tiny_run(Path("run"), 6, sample_every=2)
    assert third._recorded.sink._proc is procs[0]  # type: ignore[union-attr]
    third.save()
    for run in (tmp_path / "a", tmp_path / "b", tmp_path / "elsewhere" / "run"):
        summary = T.read_summary(run)[T.SUMMARY_CAPTURE]["stream"]
        assert summary["writer"] == "process" and summary["error"] is None, summary
        got = T.read_tables(run)
        for name in ("layers", "histograms"):
            pd.testing.assert_frame_equal(got[name], kept[name], check_dtype=False)
        assert got["steps"][T.STEP].tolist() == list(range(6))
    proc = procs[0].proc
    proc.wait(30)  # idle: it ends
    later = tiny_run(tmp_path / "later", 3)
    assert later._recorded.sink._proc.proc.pid != proc.pid  # type: ignore[union-attr]
    later.save()


def test_flushes_queued_behind_a_busy_writer_are_written_as_one(tmp_path: Path) -> None:
    """The writer process held up (a merge, a slow disk): the flushes queued meanwhile go to it as one message
    and become one part per table, read as the run kept in memory."""
    kept = tiny_run(None, 5).tables()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = precprof.Profiler(model, opt, sample_every=1, out=tmp_path / "run").attach()
    sink = prof._recorded.sink
    assert sink is not None and sink._proc is not None
    wait_ready(sink)
    gate, entered, handed = threading.Event(), threading.Event(), []
    real = sink._proc.hand_over

    def held(*args: Any) -> Any:
        handed.append(len(args[5]))  # the flushes in the message
        entered.set()
        gate.wait(30)
        return real(*args)

    sink._proc.hand_over = held  # type: ignore[method-assign]
    try:
        for step in range(5):
            if step == 1:  # flush 0 handed over, and held
                assert entered.wait(30)
            if step == 3:  # flushes 1 and 2 queued behind it
                assert len(sink._queue.queue) == 2 and len(sink.held()) == 3, handed
                gate.set()
            train_step(model, opt, prof, step)
        prof.detach()
    finally:
        gate.set()
        del sink._proc.hand_over
    assert handed[:2] == [1, 2], handed
    assert sink.error is None and sink.writer == "process"
    seg = parts.segments(tmp_path / "run")[0].path
    assert (seg / "00000001.steps.parquet").exists()  # flushes 1 and 2, one part
    got = T.read_run(tmp_path / "run").tables
    assert got["steps"][T.STEP].tolist() == list(range(5))
    for name in ("layers", "histograms", "memory"):
        pd.testing.assert_frame_equal(got[name], kept[name], check_dtype=False)
    prof.save()


def test_a_merge_from_the_tables_kept_equals_one_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer process merges the parts from the tables it wrote (up to ``RECENT_BYTES``; the others read
    back), on a thread of its own; what it merges reads as the single parts did, and ``wait`` waits for it."""
    from precprof import stream_child
    from precprof.flush import Flush

    flushes: list[Flush] = []
    monkeypatch.setattr(stream.StreamWriter, "put", lambda self, f: flushes.append(f))
    tiny_run(tmp_path / "source", 9, memory_every=1)
    assert len(flushes) == 10  # a flush a step, and the detach's (the last step's memory rows)
    one = sum(
        t.nbytes
        for t in Flush(
            *[[*getattr(flushes[0], n)] for n in ("step_rows", "layer_parts", "hist_parts", "memory_rows")]
        )
        .arrow()
        .values()
    )
    # room for two flushes' tables of each three merged: the third is read back from its file
    monkeypatch.setattr(stream_child, "RECENT_BYTES", 2 * one + one // 2)
    singles, merged = (parts.new_segment(tmp_path / n, 0).path for n in ("singles", "merged"))
    merging = stream_child.Merging()
    for seq, flush in enumerate(flushes):
        stream_child.write_flush(singles, seq, flush, 1000)
        _, error = stream_child.write_flush(merged, seq, flush, 3, merging)
        assert error is None
        if seq == 4:
            assert len(merging.tables) <= 2
    assert merging.wait() is None and set(merging.tables) == {9}  # (kept for the next merge)
    spans = sorted(p.name.split(".")[0] for p in merged.glob("*.steps.parquet"))
    assert spans == ["00000000-00000002", "00000003-00000005", "00000006-00000008", "00000009"]
    a, b = T.read_run(tmp_path / "singles"), T.read_run(tmp_path / "merged")
    assert a.notices == b.notices == []
    for name in ("steps", "layers", "histograms", "memory"):
        pd.testing.assert_frame_equal(b.tables[name], a.tables[name])


def test_a_segment_merged_while_it_is_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader (a report of a run still training) lists the parts, then the writer merges them and deletes
    the singles before the reader opens them: the reader reads the segment again, every flush once, and says
    nothing is damaged."""
    monkeypatch.setattr(parts, "COMPACT_EVERY", 1000)
    monkeypatch.setattr(stream, "USE_PROCESS", False)  # a part for each flush
    run = tmp_path / "run"
    tiny_run(run, 6)
    full = T.read_run(run)
    seg = parts.segments(run)[0].path
    real = parts._read_parts
    merges = []

    def merged_meanwhile(*args: Any, **kw: Any) -> Any:
        if not merges:
            merges.append(parts.compact(seg, 0, 5, T.TABLES))
        return real(*args, **kw)

    monkeypatch.setattr(parts, "_read_parts", merged_meanwhile)
    got = T.read_run(run)
    assert merges == [6] and got.notices == []
    for name, df in full.tables.items():
        pd.testing.assert_frame_equal(got.tables[name], df, check_dtype=False)


def test_the_writer_process_ends_with_a_training_that_exits_unsaved(tmp_path: Path) -> None:
    """A script that streams and exits without saving (nor detaching): its writer process writes what it was
    handed and ends with it, leaving no process behind, and the run reads every step that was written."""
    script = (
        "import sys, torch, precprof\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Linear(8, 4))\n"
        "prof = precprof.Profiler(model, sample_every=1, out=sys.argv[1]).attach()\n"
        "for _ in range(5):\n"
        "    model(torch.randn(2, 8)).sum().backward()\n"
        "    prof.step()\n"
        "prof._recorded.sink.drain()\n"
        "print(prof._recorded.sink._proc.proc.pid, flush=True)\n"
    )
    done = forks.run(
        [sys.executable, "-c", script, str(tmp_path / "run")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])

    def running() -> bool:  # (an ended process no one reaped yet is a zombie: ended)
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(), "the writer process outlived its training"
    assert T.read_run(tmp_path / "run").tables["steps"][T.STEP].tolist() == list(range(5))


def test_a_forked_child_holds_no_pipe_of_the_writer_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DataLoader's workers, forked (Linux's default) and persistent, copy the process's pipes. Held open
    there, the process would not see its input end while they live (a save had waited 60 s for it). The
    child's copies are pointed at /dev/null at the fork: the process ends when the training lets it go, and
    the workers' batches are what they are without a profiler."""
    monkeypatch.setattr(writer_process, "_current", None)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8))
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    prof = precprof.Profiler(model, sample_every=2, out=tmp_path / "run")
    seen = []
    with prof:
        for _ in range(2):
            for (x,) in loader:  # the workers fork at the first epoch, and stay
                seen.append(x)
                model(x).square().mean().backward()
                prof.step()
    prof.save()
    assert torch.equal(torch.cat(seen), torch.cat([data.tensors[0]] * 2))
    wp = writer_process._current
    assert wp is not None and wp.users == 0 and loader._iterator is not None  # the workers are alive
    writer_process._end(wp, wait=30)
    assert wp.proc.poll() is not None, "a forked worker holds the writer process's input open"
    assert len(T.read_tables(tmp_path / "run")["steps"]) == 16


@pytest.mark.parametrize("python", ["missing", "echo", "fails", "killed"])
def test_where_the_writer_process_cannot_start_the_thread_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python: str
) -> None:
    """No Python to start (a frozen application), one that says something else than ready, one that fails
    saying why on stderr, or one killed while it starts (SIGKILL, the OOM killer): the writer thread writes the
    parts itself, the summary says so and why, in words (a process killed while starting was "RuntimeError: it
    said b''", tester t4), and the run reads as one kept in memory."""
    fails = tmp_path / "fails.sh"
    fails.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named pyarrow' >&2\nexit 3\n")
    killed = tmp_path / "killed.sh"
    killed.write_text("#!/bin/sh\nkill -9 $$\n")
    for script in (fails, killed):
        script.chmod(0o755)
    executable = {
        "missing": str(tmp_path / "no-python"),
        "echo": "/bin/echo",
        "fails": str(fails),
        "killed": str(killed),
    }[python]
    why = {
        "missing": "(FileNotFoundError",
        "echo": "(it printed '-c import sys",
        "fails": "(it ended before it was ready, exit code 3: ModuleNotFoundError: No module named pyarrow)",
        "killed": "(it was killed (SIGKILL) before it was ready)",
    }[python]
    monkeypatch.setattr(sys, "executable", executable)
    kept = tiny_run(None, 5, sample_every=2).tables()
    streamed = tiny_run(tmp_path / "run", 5, sample_every=2)
    streamed.save()
    stream = T.read_summary(tmp_path / "run")[T.SUMMARY_CAPTURE]["stream"]
    assert stream["error"] is None and stream["parts_written"] > 0
    assert stream["writer"] == "thread", stream
    assert f"the stream's writer process did not start {why}" in stream["writer_note"]
    got = T.read_tables(tmp_path / "run")
    pd.testing.assert_frame_equal(got["layers"], kept["layers"], check_dtype=False)


def test_a_step_waits_for_a_writer_behind_it_only_until_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``put`` on a full queue waits for the writer's thread to take a flush, woken by it (not polling), and
    every flush is written in order; bounded memory: never more than the queue and the flush being written."""
    from precprof.capture.stream import StreamWriter
    from precprof.flush import Flush

    monkeypatch.setattr(stream, "USE_PROCESS", False)  # the queue's own semantics, whoever writes
    writer = StreamWriter(tmp_path, parts.new_segment(tmp_path, 0), max_queued=1)
    gate = threading.Event()
    real = writer._write
    written: list[int] = []

    def slow(flush: Flush) -> None:
        gate.wait(10)
        real(flush)
        written.append(int(flush.step_rows[0][T.STEP]))

    writer._write = slow  # type: ignore[method-assign]
    flushes = [Flush(step_rows=[{T.STEP: i, T.LOSS: 1.0}]) for i in range(3)]
    writer.put(flushes[0])  # taken by the thread, which waits at the gate
    writer.put(flushes[1])  # queued: the queue is full
    done = threading.Event()
    third = threading.Thread(target=lambda: (writer.put(flushes[2]), done.set()))
    third.start()
    assert not done.wait(0.3)  # no room: the third waits
    assert len(writer.held()) == 2
    gate.set()
    assert done.wait(5)
    third.join()
    writer.close()
    assert written == [0, 1, 2] and writer.error is None


def _niceness_and_group(pid: int | str) -> tuple[int, str | None]:
    """A process's niceness (``/proc/PID/stat``'s 19th field) and its autogroup line, None without one."""
    nice = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    group = Path(f"/proc/{pid}/autogroup")
    return nice, group.read_text().strip() if group.exists() else None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_writer_process_runs_at_the_lowest_priority_and_the_training_at_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer takes only the CPU the training leaves (its start beside the first steps made the first
    sampled step of gpt-nano on 2 cores 4x slower): niceness 19, and, a session of its own, its autogroup's too
    (between autogroups niceness does not count). The training's own niceness and autogroup are as they were."""
    from precprof import _priority

    monkeypatch.setattr(writer_process, "_current", None)  # a process of this test's own
    monkeypatch.delenv(
        _priority.NICENESS_ENV
    )  # (the suite's own setting: the helpers at the tests' priority)
    before = _niceness_and_group("self")
    prof = precprof.Profiler(nn.Linear(8, 4), out=tmp_path / "run").attach()
    try:
        sink = prof._recorded.sink
        wait_ready(sink)
        nice, group = _niceness_and_group(sink._proc.proc.pid)  # type: ignore[union-attr]
        assert nice == _priority.LOWEST
        assert group is None or group.endswith(f"nice {_priority.LOWEST}"), group
        assert _niceness_and_group("self") == before
    finally:
        prof.detach()
    # a process inside the training's session (the Triton compile beside it) lowers itself, never its group
    code = (
        "import os\n"
        "from precprof._priority import lower_own_priority\n"
        "print(lower_own_priority(7), lower_own_priority(3), os.nice(0))\n"
    )
    res = forks.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    assert res.stdout.split() == [str(max(7, before[0]))] * 3  # raised once, never lowered
    assert _niceness_and_group("self") == before


def test_the_helpers_niceness_is_the_environments_where_it_says_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """PRECPROF_HELPER_NICENESS sets the helpers' niceness (a machine whose every core is busy at the training's
    priority starves a helper at 19); anything but a number from 0 to 19 leaves the lowest."""
    from precprof import _priority

    for value, niceness in (("0", 0), ("7", 7), ("19", 19), ("20", 19), ("-1", 19), ("low", 19)):
        monkeypatch.setenv(_priority.NICENESS_ENV, value)
        assert _priority.helper_niceness() == niceness
    monkeypatch.delenv(_priority.NICENESS_ENV)
    assert _priority.helper_niceness() == _priority.LOWEST


_SAVE_MEMORY = """
import sys, tempfile, torch, precprof
from torch import nn
from precprof import runfiles
if sys.argv[1] == "kept":
    runfiles.release_memory = lambda: None
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) * 1024
torch.set_num_threads(1)
torch.manual_seed(0)
layers = []
for _ in range(20):
    layers += [nn.Linear(32, 32), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, out=tempfile.mkdtemp() + "/r") as prof:
    for _ in range(100):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        prof.step()
before = rss()
prof.save()
print(rss() - before)
"""


def test_a_long_runs_save_gives_its_memory_back() -> None:
    """The save of a long streamed run reads every part into pandas; what Arrow's pool and malloc kept of it
    stayed resident for the rest of the training process (850 MB after a 3,000-sampled-step run, in a user's
    test). Given back: 300 sampled steps of 41 modules kept 299 MB without it, 76 MB with it; the 100 steps
    here keep 95-120 MB without it, under 10 MB with it (150 steps cost 3 s more of CPU and kept 15-35 MB)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc")
    grown = {}
    # a fresh Python, not a fork of tests/forks.py's server: its allocators as a user's process has them
    for how in ("kept", "released"):
        res = subprocess.run(
            [sys.executable, "-c", _SAVE_MEMORY, how], capture_output=True, text=True, timeout=300, check=True
        )
        grown[how] = int(res.stdout.split()[-1])
    assert grown["released"] < 0.5 * grown["kept"], grown


@pytest.mark.parametrize("saved", [False, True])
def test_resume_without_a_first_step_says_it_replaces_what_the_run_recorded(
    tmp_path: Path, saved: bool
) -> None:
    """``resume=True`` without ``first_step`` (0) on a run that recorded 30 steps replaced all of them without a
    word (a killed job's, or a saved run's). It warns, naming them and the fix; with first_step it does not."""
    out = tmp_path / "run"
    model = nn.Linear(4, 4)
    first = precprof.Profiler(model, sample_every=5, out=out).attach()
    for _ in range(30):
        model(torch.randn(2, 4)).sum().backward()
        first.step()
    first.detach()
    if saved:
        first.save()
    else:
        first._owned_run.release()  # as a killed job leaves it: its stream, its lock gone with it
    with pytest.warns(UserWarning, match=r"resume=True with first_step=0 replaces the 30 steps .* \(0-29\)"):
        again = precprof.Profiler(model, sample_every=5, out=out, resume=True).attach()
    again.detach()
    again.save()
    import warnings as w

    with w.catch_warnings():
        w.simplefilter("error")
        kept = precprof.Profiler(model, sample_every=5, out=out, resume=True, first_step=1).attach()
    kept.detach()
    kept.save()


def test_steps_a_killed_job_never_flushed_are_named_and_the_curve_breaks_there(tmp_path: Path) -> None:
    """Killed at step 634 having flushed up to 481, resumed from the checkpoint at 600: steps 482-599 were not in
    any table, nothing said so, and the loss curve joined 481 to 600 with a straight line that looked like data.
    The caption names the missing steps and why, and the line breaks there."""
    from precprof.report import context as C
    from precprof.report.plots import training as P

    out = tmp_path / "run"
    killed = tiny_run(out, 5, sample_every=2)  # steps 0-4 streamed, never saved: as a killed job leaves them
    killed._owned_run.release()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, sample_every=2, out=out, resume=True, first_step=8) as prof:
        for step in range(8, 11):
            train_step(model, opt, prof, step)
    page = prof.report().read_text()
    steps = T.read_tables(out)["steps"]
    assert steps[T.STEP].tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert C._holes_note(steps) == (
        "No record of steps 5-7 (3 in all): the job killed before it flushed them was resumed from a later "
        "checkpoint; the curve breaks there."
    )
    assert "No record of steps 5-7 (3 in all)" in page
    x = steps[T.STEP].to_numpy()
    y = steps[T.LOSS].to_numpy(dtype=float)
    bx, by = P._broken_at_holes(x, y, x)
    assert len(bx) == len(x) + 1 and math.isnan(bx[5]) and bx[4] == 4 and bx[6] == 8
    assert math.isnan(by[5]) and by[4] == y[4] and by[6] == y[5]
    # steps present without a loss still join (a loop that passes its loss every few steps)
    given = np.array([0, 3, 6]), np.array([1.0, 2.0, 3.0])
    assert len(P._broken_at_holes(*given, np.arange(7))[0]) == 3


def test_a_resumed_run_goes_on_thinning_from_its_earlier_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget samples a run's first ``DENSE_SAMPLES`` budgeted steps at its pace, then ever fewer; a resumed
    attempt began its own dense ones, so a preemptible job resumed every few hours never thinned. The attempt
    replays the budgeted samples of the steps before it (here every step past the first two is one where the
    thinning allows it, the dense ones 3)."""
    from precprof.capture import sampling as S

    monkeypatch.setattr(S, "DENSE_SAMPLES", 3)
    monkeypatch.setattr(S.Sampler, "_fits", lambda self, limit: True)
    monkeypatch.setattr(S.Sampler, "_base_in_doubt", lambda self: False)
    out = tmp_path / "run"
    killed = tiny_run(out, 8, sample_every=None)
    killed._owned_run.release()
    earlier = killed.tables()["steps"]
    budgeted = earlier[(earlier[T.STEP] < 6) & (earlier[T.SAMPLE_REASON] == S.REASON_BUDGET)][T.STEP].tolist()
    assert budgeted == [2, 3, 4]  # (5 too close to 4 once the 3 dense ones were taken: at least 2 apart)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, out=out, resume=True, first_step=6) as prof:
        replayed = S.Sampler(every=None)
        replayed.resumed(budgeted)
        assert (prof._sampler.budgeted_samples, prof._sampler.thin_gap) == (3, replayed.thin_gap) == (3, 2)
        assert prof._sampler._last_budget == 4  # the next budgeted sample is spaced from the last one
        for step in range(6, 9):
            train_step(model, opt, prof, step)
    prof.save()
    assert T.read_summary(out)["capture"]["sampling"]["thinned"]["after"] == 3


def _spiking_run(out: Path, steps: range, spike: int, **kw: object) -> precprof.Profiler:
    """The tiny run's ``steps`` under the budget, a loss 50 times its own handed to ``prof.step`` at ``spike``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, out=out, first_step=steps[0], memory=False, **kw) as prof:  # type: ignore[arg-type]
        for step in steps:
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach() * (50 if step == spike else 1))
    return prof


def test_a_loss_spike_right_after_a_resume_is_sampled(tmp_path: Path) -> None:
    """A loss spike is called against the recent losses (``SPIKE_MIN`` of them at least): a run resumed at step
    12 started with none, so a spike at step 14 went unsampled where the uninterrupted run sampled step 15 for
    it (tester t5). The attempt's window starts with the earlier attempts' losses of the steps before it."""
    from precprof.capture import sampling as S

    full = _spiking_run(tmp_path / "full", range(18), spike=14)
    assert _sample_reasons(full).get(15) == S.REASON_SPIKE
    out = tmp_path / "run"
    killed = _spiking_run(out, range(13), spike=-1)  # preempted at step 13, its checkpoint at step 12
    killed._owned_run.release()
    earlier = killed.tables()["steps"]
    resumed = _spiking_run(out, range(12, 18), spike=14, resume=True)
    window = list(resumed._sampler._losses)
    assert window[:12] == earlier[T.LOSS].iloc[:12].tolist()  # then the attempt's own
    assert _sample_reasons(resumed).get(15) == S.REASON_SPIKE
    steps = T.read_tables(out)["steps"]
    assert steps.loc[steps[T.STEP] == 15, T.SAMPLE_REASON].tolist() == [S.REASON_SPIKE]


def _sample_reasons(prof: precprof.Profiler) -> dict[int, str]:
    steps = prof.tables()["steps"]
    return {int(s): r for s, r in zip(steps[T.STEP], steps[T.SAMPLE_REASON], strict=True) if r}


@pytest.mark.parametrize("every", [None, 1])
def test_a_resumed_runs_sampling_row_says_it_is_the_last_attempts(tmp_path: Path, every: int | None) -> None:
    """A run resumed at step 800: the header said 107 sampled steps (the run's), the sampling row "14 of 2,200
    steps" (the last attempt's) without saying whose. It says so, under the budget and under ``sample_every``
    alike ("every step: 4 of 4 steps" stood below a header of 16, tester t3)."""
    from precprof.report.environment import capture_rows

    out = tmp_path / "run"
    killed = tiny_run(out, 5, sample_every=every)  # (None: the default budget)
    killed._owned_run.release()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, sample_every=every, out=out, resume=True, first_step=3) as prof:
        for step in range(3, 9):
            train_step(model, opt, prof, step)
    prof.save()
    summary = T.read_summary(out)
    row = dict(capture_rows(summary[T.SUMMARY_CAPTURE], summary.get(T.SUMMARY_CONFIG) or {}))["steps sampled"]
    assert re.search(r": \d+ of 6 steps of the attempt resumed at step 3( \(|$)", row), row


@pytest.mark.parametrize("every", [2, None])
def test_a_resumed_runs_header_says_its_overhead_is_the_last_attempts(
    tmp_path: Path, every: int | None
) -> None:
    """A resumed run's header said "precprof's overhead 6.4% of the run's time ... the 2 first steps": the
    sampler's figures of its last attempt (the summary's), beside a count of sampled steps of every attempt, and
    an environment row that says "of the attempt resumed at step 20" (tester t5). The header says whose they
    are, as the environment does."""
    from precprof.report.context import _headline

    out = tmp_path / "run"
    killed = tiny_run(out, 5, sample_every=every)  # (None: the default budget)
    killed._owned_run.release()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, sample_every=every, out=out, resume=True, first_step=3) as prof:
        for step in range(3, 40):
            train_step(model, opt, prof, step)
    prof.save()
    run = T.read_run(out)
    summary = T.read_summary(out)
    row = dict(_headline(summary, run.tables["steps"], run.tables["layers"])).get("precprof's overhead", "")
    assert "the run's time" not in row, row
    if row and not row.startswith("not measured"):  # a share said: whose
        assert "of the time of the attempt resumed at step 3" in row, row
    if every == 2:  # 19 sampled and 18 unsampled steps timed: the share is said
        assert row and not row.startswith("not measured"), row
