"""How busy the machine was with other work while a run's steps were timed (``capture/machine_load.py``), and
``precprof compare`` refusing to compare the speeds of runs timed under different loads.

A run timed while another job kept a core busy is steadily slower: its steps are even (``step_time_spread``
small), and compare had read its tokens per second as its format's speed."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import precprof
from precprof import compare as C
from precprof import tables as T
from precprof.analysis import comparison as A
from precprof.capture import machine_load as L

# /proc/stat as Linux writes it: user nice system idle iowait irq softirq steal guest guest_nice
_STAT = (
    "cpu  {u} {n} {s} 9000 300 {i} {si} {st} 50 0\n"
    "cpu0 100 0 50 4500 150 0 5 0 0 0\n"
    "intr 12345 0 0\nctxt 999\nbtime 1700000000\nprocs_running 2\n"
)
# a process's /proc/<pid>/stat: its name in parentheses may hold both (field 14 utime, 15 stime)
_PID_STAT = "4242 (python (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 {ut} {st} 0 0 20 0 3 0 100 0 0"


@pytest.fixture(autouse=True)
def _measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite turns the measurement off (tests/conftest.py); these tests measure."""
    monkeypatch.delenv(L.ENV, raising=False)


def test_the_measurement_is_off_where_its_variable_says_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """PRECPROF_MACHINE_LOAD=0: nothing measured, as on a machine without /proc/stat."""
    stat = "cpu  1000 20 300 9000 5 7 11 2 0 0\n"
    assert L.take([], {L.PROC_STAT: stat}.get) is not None
    monkeypatch.setenv(L.ENV, "0")
    assert L.take([], {L.PROC_STAT: stat}.get) is None


def test_busy_and_process_jiffies_are_read_off_the_kernels_text() -> None:
    """Busy time is user + nice + system + irq + softirq + steal (guest is inside user; idle and iowait are
    not busy); a process's time is its utime + stime, counted after the last ')' of its name."""
    assert L.busy_ticks(_STAT.format(u=1000, n=20, s=300, i=7, si=11, st=2)) == 1000 + 20 + 300 + 7 + 11 + 2
    assert L.busy_ticks("intr 1 2\n") is None
    assert L.process_ticks(_PID_STAT.format(ut=250, st=40)) == 290
    assert L.process_ticks("4242 (short") is None


def test_other_work_is_the_machines_busy_time_less_the_runs_own() -> None:
    """Over 2 s at 100 ticks a second the machine's busy time grew by 5.1 s; this process used 2.0 s and its
    writer 0.6 s: 2.5 s of other work, 1.25 cores on average. A writer that started inside the window counts
    from zero; the clocks ticking apart never make it negative."""
    start = L.Snapshot(wall_s=10.0, busy=1_000, own_s=3.0, writers={7: 40})
    end = L.Snapshot(wall_s=12.0, busy=1_510, own_s=5.0, writers={7: 100})
    assert L.other_cpu_s(start, end, 100) == pytest.approx(510 / 100 - 2.0 - 60 / 100)
    late = L.Snapshot(wall_s=12.0, busy=1_510, own_s=5.0, writers={7: 100, 8: 30})
    assert L.other_cpu_s(start, late, 100) == pytest.approx(5.1 - 2.0 - 0.6 - 0.3)
    assert L.other_cpu_s(start, L.Snapshot(12.0, 1_100, 5.0), 100) == 0.0


def test_snapshots_read_proc_stat_and_each_writers_stat_and_nothing_without_proc_stat() -> None:
    files = {
        L.PROC_STAT: _STAT.format(u=1000, n=0, s=200, i=0, si=0, st=0),
        "/proc/7/stat": _PID_STAT.format(ut=30, st=10),
    }
    snap = L.take([7, 8], files.get)  # pid 8 ended: left out
    assert snap is not None and snap.busy == 1200 and dict(snap.writers) == {7: 40}
    assert L.take([7], {}.get) is None  # macOS, Windows: no /proc/stat
    load = L.MachineLoad(lambda: [])
    load.end()  # never begun: nothing measured
    assert load.figures()["other_cpu_cores"] is None and load.figures()["cpu_count"] == os.cpu_count()


_SPIN = "while True:\n    pass\n"


def _tiny_run(out: Path, spinners: int) -> float:
    """A Profiler in a loop of its own over a small MLP, 40 steps of 512 tokens, streamed into ``out``;
    ``spinners`` busy-loop processes (a core each) run from its first step to its last. Returns their CPU
    seconds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(512, 128), torch.randn(512, 128)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # (two threads beside a busy loop waited for each other: steps 40x slower, uneven)
    with precprof.Profiler(model, optimizer=opt, sample_every=20, out=out) as prof:
        spin = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(spinners)]
        try:
            for _ in range(40):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.step(loss=loss.detach(), tokens=512)
        finally:
            for p in spin:
                p.kill()
                p.wait()
            torch.set_num_threads(threads)
    prof.save(out)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


@pytest.mark.skipif(not Path(L.PROC_STAT).exists(), reason="/proc/stat is Linux's")
def test_a_run_timed_beside_busy_loops_is_not_compared_on_speed(tmp_path: Path) -> None:
    """bf16's twin (the same fp32 model here: only the load differs) trained while busy loops kept every core
    busy: its steps were even and its tokens per second steadily lower, and compare had taken their ratio as a
    speed-up. Each run records the cores other work kept busy while its steps were timed; the busy loops' CPU
    time is in the loaded run's, and compare names both figures and takes no speed-up."""
    spinners = 2 * (os.cpu_count() or 1)  # (a machine already busy with other work: the loops take a share)
    _tiny_run(tmp_path / "quiet", 0)
    spun_s = _tiny_run(tmp_path / "busy", spinners)
    figures = {}
    for name in ("quiet", "busy"):
        summary = json.loads((tmp_path / name / T.SUMMARY_FILE).read_text())
        load, final = summary[T.SUMMARY_CAPTURE]["machine_load"], summary[T.SUMMARY_FINAL]
        assert final["other_cpu_cores"] == load["other_cpu_cores"] and final["cpu_count"] == os.cpu_count()
        figures[name] = (load["other_cpu_cores"], load["window_s"])
    (quiet, _), (busy, window) = figures["quiet"], figures["busy"]
    # the busy loops ran inside the window: their CPU seconds are in its other work (a tick of slack each)
    assert busy * window >= spun_s - 0.02 * spinners - 0.05, (busy, window, spun_s)
    n = os.cpu_count() or 1
    if quiet > n - 0.5:  # other work's CPU time cannot grow on a machine it already fills (README)
        pytest.skip(f"other work kept {quiet:.2f} of the {n} cores busy during the quiet run already")
    assert busy - quiet > max(A.MIN_OTHER_CORES_APART, A.MAX_OTHER_CORES_SHARE * n), figures
    comp, _ = C.compare_runs([tmp_path / "quiet", tmp_path / "busy"], out=tmp_path / "cmp")
    r, ref = comp.run("busy"), comp.run("quiet")
    assert math.isfinite(r.tokens_per_s) and r.speedup is None and ref.speedup == 1.0
    # (on this 2-core machine, beside the suite's other worker, the busy run's steps can be uneven too, or even
    # faster: uneven steps are said first, and each run's speed is noise then; the load's own reason stands)
    said_load = A.load_differs(r, ref)
    assert r.speed_not_taken in (said_load, A.uneven_steps(ref) or A.uneven_steps(r)), r.speed_not_taken
    said = f"(on average {quiet:.2f} of its {n} cores while quiet's steps ran, {busy:.2f} while busy's)"
    assert said_load.startswith("quiet and busy were timed while other work kept different shares of")
    assert said in said_load, said_load
    assert said_load.endswith("(run the comparison on an otherwise idle machine)")
