"""A script whose loop dies right after ``prof.step()`` (an uncaught exception, Ctrl-C, ``sys.exit``; no
``detach()``): its interpreter's exit writes every step the stream's writer was handed (``capture.stream``'s
``_drain_at_exit``), within a bounded wait that says so where the writer is stuck, and leaves no ``.tmp`` part.
The writer thread was a daemon, stopped by the interpreter's end in the middle of a part: 1-3 of 4 steps were
kept, beside a ``.tmp``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import forks

from precprof import tables as T

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

# A loop of 4 sampled steps that ends as the mode says. The run's thread writes the parts (as while the writer
# process starts, its first 0.4 s), and the parts of the flushes from the third on wait, inside their .tmp,
# for the interpreter's exit ("late": an exit handler registered after precprof's, so run before its drain,
# lets them go on) or for 30 s ("stuck": longer than the exit waits).
SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
import torch
from torch import nn
import precprof
from precprof import _atomic, _run_finisher
from precprof.capture import stream

# the machine's description in the first summary loads the report's modules (3 s): not this test's
_run_finisher.set_machine_describer(lambda device: {})
_run_finisher.set_run_finisher(lambda *a, **k: {})
_run_finisher.set_run_renderer(lambda *a, **k: None)

out, mode = sys.argv[1], sys.argv[2]
stream.USE_PROCESS = False
if mode == "stuck":
    stream.EXIT_WAIT_S, stream.EXIT_NOTE_S = 0.4, 0.2
go_on = threading.Event()
write_with = _atomic.write_with

def held(path, writer):
    def write(tmp):
        writer(tmp)
        if int(Path(path).name.split(".")[0]) >= 2:
            go_on.wait(30)
    return write_with(path, write)

_atomic.write_with = held
if mode == "late":
    atexit.register(go_on.set)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
prof = precprof.Profiler(model, optimizer=opt, out=out, sample_every=1).attach()
for i in range(6):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    prof.step(loss=float(i), tokens=4)
    if i == 3:
        print("exiting at", time.time(), file=sys.stderr)
        if mode == "late":
            raise KeyboardInterrupt  # as Ctrl-C in a loop without try/finally
        sys.exit(3)
"""


def _run(out: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """The child's end, and how long its exit took (from its loop's end)."""
    res = forks.run(
        [sys.executable, "-c", SCRIPT, str(out), mode], capture_output=True, text=True, env=ENV, timeout=120
    )
    ended = time.time()
    exiting = [float(line.split()[-1]) for line in res.stderr.splitlines() if line.startswith("exiting at ")]
    assert exiting, res.stderr
    return res, ended - exiting[0]


def _steps(out: Path) -> tuple[list[int], list[int], list[str]]:
    """The steps of the steps table, those of the layers table, and the run directory's .tmp files."""
    tables = T.read_run(out).tables
    tmp = [p.name for p in out.rglob("*") if p.name.endswith(".tmp")]
    return sorted(tables["steps"][T.STEP]), sorted(set(tables["layers"][T.STEP])), tmp


def test_an_uncaught_exception_after_step_keeps_every_step_handed_to_the_stream(tmp_path: Path) -> None:
    res, _ = _run(tmp_path / "run", "late")
    assert res.returncode == -2, res.stderr  # (the uncaught KeyboardInterrupt's exit)
    assert "KeyboardInterrupt" in res.stderr and "were not written" not in res.stderr, res.stderr
    assert _steps(tmp_path / "run") == ([0, 1, 2, 3], [0, 1, 2, 3], [])
    # the cause, not the first summary's "running ...: killed (SIGKILL, out of memory ...)" (capture.unsaved)
    assert T.read_summary(tmp_path / "run")[T.SUMMARY_INCOMPLETE_REASON] == (
        "interrupted (KeyboardInterrupt); not caught, it ended the script after step 3 (the last step "
        "prof.step() ended), before the run was saved: the steps flushed to its stream up to it are kept, and "
        f"`precprof report {tmp_path / 'run'}` renders them"
    )


def test_a_stuck_writer_at_exit_is_waited_for_a_bounded_time_and_said(tmp_path: Path) -> None:
    res, took = _run(tmp_path / "run", "stuck")
    assert res.returncode == 3, res.stderr  # sys.exit(3)
    assert took < 15  # the exit waited 0.4 s, not the 30 s the part waits
    run = tmp_path / "run"
    assert f"precprof: writing the last recorded steps of {run} before exiting (up to 0.4 s" in res.stderr
    assert (
        f"precprof: the last recorded steps of {run} were not written (its writer was still writing"
        in res.stderr
    )
    steps, layers, tmp = _steps(run)
    assert steps == layers == [0, 1] and tmp == []  # the part it was writing is removed
