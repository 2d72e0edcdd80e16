"""How a run of a user's own loop ends badly (an exception, Ctrl-C, sys.exit, a kill) and what its run directory
and report say of it (tester t3)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import precprof
from precprof import pipeline
from precprof import tables as T
from precprof.capture import records


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, prof: precprof.Profiler, steps: int, bad: int
) -> None:
    """``steps`` steps of the tiny run; at step ``bad`` its batch has the wrong width (a shape error)."""
    for step in range(steps):
        x = torch.randn(4, 7 if step == bad else 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        prof.step(loss=loss.detach())


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt, SystemExit])
def test_a_loop_without_with_that_raised_saves_an_incomplete_run_with_its_cause(
    tmp_path: Path, raised: type[BaseException]
) -> None:
    """``prof.attach()`` ... ``finally: prof.detach(); prof.save()`` (the README's form for a loop that is not under
    ``with``) around a loop stopped at step 3 by a shape error, Ctrl-C or ``sys.exit(3)``: the run was saved as
    "complete", training finished, its page without a word of the error, where ``with Profiler(...)`` says the
    cause. It is incomplete now, with the cause, as under ``with``, and the banner says where it stopped."""
    model, opt = _model()
    out = tmp_path / "run"
    prof = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False).attach()

    def stop(step: int) -> None:
        if raised is KeyboardInterrupt:
            raise KeyboardInterrupt
        if raised is SystemExit:
            sys.exit(3)

    with pytest.raises(raised):
        try:
            _train(model, opt, prof, 3, bad=-1)
            stop(3)
            _train(model, opt, prof, 6, bad=3)  # (the RuntimeError: step 3 of these is the bad one)
        finally:
            prof.detach()
            prof.save(render=True)
    summary = T.read_summary(out)
    cause = {
        RuntimeError: "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x7 and 8x16)",
        KeyboardInterrupt: "interrupted (KeyboardInterrupt)",
        SystemExit: "SystemExit: 3",
    }[raised]
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE and summary[T.SUMMARY_INCOMPLETE_REASON] == cause
    assert summary["training_finished"] is False
    steps = T.read_run(out).tables["steps"]
    finished = 6 if raised is RuntimeError else 3  # (the RuntimeError's loop ran 3 steps more first)
    done = steps[~T.flags(steps[T.CUT_OFF])]  # (the sampled step 6 the shape error cut off keeps its rows)
    assert done[T.STEP].tolist() == list(range(finished))
    html = (out / T.REPORT_FILE).read_text()
    banner = html.split('id="incomplete"', 1)[1].split("</div>", 1)[0]
    assert cause in banner and f"after step {finished - 1} ({finished} steps" in banner


def test_a_loop_detached_in_finally_without_a_save_says_its_exception_not_a_kill(tmp_path: Path) -> None:
    """``finally: prof.detach()`` and no save (the script ends on the exception): summary.json said "running ...;
    if it still says this ... killed (SIGKILL, out of memory ...)" where the Profiler knew the exception."""
    model, opt = _model()
    out = tmp_path / "run"
    prof = precprof.Profiler(model, opt, sample_every=2, out=out, memory=False).attach()
    with pytest.raises(RuntimeError):
        try:
            _train(model, opt, prof, 6, bad=4)
        finally:
            prof.detach()
    reason = str(T.read_summary(out)[T.SUMMARY_INCOMPLETE_REASON])
    assert reason.startswith(
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x7 and 8x16); raised after step 3 (the last "
        "step prof.step() ended), before the run was saved"
    ), reason
    prof._owned_run.release()  # as the script's end leaves it
    page = pipeline.rerender(out).read_text()
    assert "killed" not in page.split('id="incomplete"', 1)[1].split("</div>", 1)[0]


def test_a_loop_ended_by_its_data_running_out_is_complete(tmp_path: Path) -> None:
    """A loop ended by its iterator's ``StopIteration`` (handled where ``detach()`` runs) ran to its end: complete;
    and a detach after an exception that was handled and left behind is complete too."""
    model, opt = _model()
    prof = precprof.Profiler(model, opt, sample_every=2, memory=False).attach()
    batches = iter(range(3))
    try:
        while True:
            next(batches)
            _train(model, opt, prof, 1, bad=-1)
    except StopIteration:
        prof.detach()
    assert prof.status == (T.STATUS_COMPLETE, None)
    prof.attach()
    try:
        raise ValueError("handled before the loop")
    except ValueError:
        pass
    _train(model, opt, prof, 2, bad=-1)
    prof.detach()
    assert prof.status == (T.STATUS_COMPLETE, None)


def test_a_streamed_run_flushes_its_unsampled_steps_every_few_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run sampled rarely (``sample_every=200``) held its unsampled steps in the process until the next sampled
    step (or 256 steps): a kill (the OOM killer) 150 steps in left step 0 alone on disk, the report "cut off after
    step 0". The steps go to the stream at least every ``STREAM_STEPS_EVERY_S`` now (0 here: at each step), on
    disk while the run still trains, with no sampled step in between."""
    monkeypatch.setattr(records, "STREAM_STEPS_EVERY_S", 0.0)
    model, opt = _model()
    out = tmp_path / "run"
    prof = precprof.Profiler(model, opt, sample_every=200, out=out, memory=False).attach()
    _train(model, opt, prof, 6, bad=-1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the writer process writes beside the training
        read = T.read_run(out)
        if read.last_step is not None and read.last_step >= 5:
            break
        time.sleep(0.05)
    steps = read.tables["steps"]
    assert read.streamed and steps[T.STEP].tolist() == list(range(6))
    assert T.flags(steps[T.SAMPLED]).tolist() == [True] + [False] * 5
    prof.detach()
    prof.save()
    assert T.read_run(out).tables["steps"][T.STEP].tolist() == list(range(6))


_KILLED_RARELY_SAMPLED = """
import os, signal, sys, torch
from torch import nn
import precprof
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
prof = precprof.Profiler(model, opt, sample_every=10, out=sys.argv[1], memory=False).attach()
for step in range(46):
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    prof.step(loss=loss.detach())
os.kill(os.getpid(), signal.SIGKILL)  # 46 steps run, no save; those after the last sampled one still in the process
"""


def test_a_killed_run_says_where_its_record_ends_not_where_it_stopped(tmp_path: Path) -> None:
    """A run sampled once in 10 steps and SIGKILLed (the OOM killer) 46 steps in: its unsampled steps reach the
    disk at the next sampled step or every ``STREAM_STEPS_EVERY_S``, so the last step on disk is not where it
    stopped. The page said "The run was cut off after step 39" or so; it says the record ends there and that the
    run may have gone further, as compare's reason for it does."""
    import signal
    import subprocess

    from precprof.analysis.comparison import runs as comparison_runs

    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-c", _KILLED_RARELY_SAMPLED, str(out)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    deadline = time.monotonic() + 30
    read = T.read_run(out)
    while read.last_step is None and time.monotonic() < deadline:  # the writer process ends on its own
        time.sleep(0.1)
        read = T.read_run(out)
    assert (
        read.streamed and read.last_step is not None and read.last_step < 45
    )  # the last steps never on disk
    html = pipeline.rerender(out).read_text()
    last = read.last_step
    assert f"The run was cut off; its record ends after step {last}." in html
    assert (
        "(it may have run further: a step reaches the disk at the next sampled step or within seconds" in html
    )
    assert (
        f"cut off after step {last}" not in html and f"before the run stopped, after step {last}" not in html
    )
    assert (
        f"reached the disk before the run stopped: its record ends after step {last} ({last + 1} "
        f"step{'s' if last else ''})"
        in html  # (step 0 alone on a loaded machine: its flush at step 10 unwritten)
    )
    status, reason = comparison_runs._status(T.read_summary(out), read, live=False)
    assert status == T.STATUS_INCOMPLETE and reason is not None
    assert reason.startswith(f"record ends after step {last}: killed before it saved its tables"), reason
