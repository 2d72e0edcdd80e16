"""A sampled step's ``time_s`` in the steps table holds what the step waited for the stream's writer, as the
overhead budget's clock and the loop's own do."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precprof
from precprof import stream_child
from precprof import tables as T
from precprof.capture import stream


def _trained_behind(
    monkeypatch: pytest.MonkeyPatch, write: Any, tmp_path: Path, every: int, steps: int
) -> precprof.Profiler:
    """A small MLP trained ``steps`` steps, one in ``every`` sampled, its run streamed by the writer thread (as
    where the process cannot start), whose each flush goes through ``write``."""
    monkeypatch.setattr(stream, "USE_PROCESS", False)
    monkeypatch.setattr(stream_child, "write_flush", write)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, sample_every=every, memory=False, out=tmp_path / "run") as prof:
        for _ in range(steps):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return prof


def test_a_sampled_step_that_waits_for_a_slow_writer_says_so_in_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer (the thread here, as where the process cannot start) takes 300 ms a write and every step is
    sampled: from the fourth on, every other step waits for room in the writer's queue (it writes the two queued
    behind a write as one), five waits in twelve steps. (At 100 ms a write and eight steps, three waits, a CI run
    under load had steps slow enough for the writer to keep up with one of them.) The table had stamped the time
    before that wait: 2.4 ms where the step took 30 (the report's "a sampled step 2.28x an unsampled one" beside an
    overhead of 89%); each step's ``time_s`` now holds it, as the loop's clock around the step does.

    Checked exactly: every wait the stream timed (``waited_s``) lies inside its step's stamped interval, so the
    table's times hold them all. (A comparison with the loop's own clock had failed once in CI under load: the
    interpreter lock or the CPU taken away in the few lines after a step's stamp -- its flush handed on, the next
    step armed -- is in the loop's clock of that step and in the table's next row, or in none for the last.)"""
    write = stream_child.write_flush

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return write(*args, **kwargs)

    prof = _trained_behind(monkeypatch, slow, tmp_path, every=1, steps=12)
    timing = prof.summary()["stream"]
    steps = prof.tables()["steps"]
    table = steps[T.TIME_S].to_numpy()
    assert timing["waits"] >= 3 and timing["waited_s"] > 0.2, timing  # the steps waited for the writer
    assert table.sum() >= timing["waited_s"], (table, timing)
    assert table[:3].sum() < 0.5 * timing["waited_s"], (table, timing)  # the first steps found room: no wait


def test_a_sampled_steps_wait_for_a_writer_that_fell_behind_is_precprofs_not_a_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tester t5: a 3000-step run whose writer fell behind had its sampled steps' waits for it taken for pauses
    (time outside the step's work, as between notebook cells): 362 s left out, the overhead 81% where the steps
    took 99% more than without precprof, beside "100% of precprof's time was sampled steps waiting for the
    writer". One flush here takes the writer 2.5 s: the sampled step that waits for room holds over 4x the others
    and a second more, all of it precprof's. It is costed, not left out."""
    write = stream_child.write_flush
    flushes = [0]

    def stalls_once(*args: Any, **kwargs: Any) -> Any:
        flushes[0] += 1
        if flushes[0] == 5:
            time.sleep(2.5)
        return write(*args, **kwargs)

    prof = _trained_behind(monkeypatch, stalls_once, tmp_path, every=2, steps=24)
    summary = prof.summary()
    timing, sampling = summary["stream"], summary["sampling"]
    assert timing["waited_s"] > 1.0, timing  # a sampled step waited for the writer
    assert sampling["paused_count"] == 0 and sampling["paused_s"] == 0.0, sampling
    assert sampling["overhead_sampled"] > 0.5, sampling  # its 2.5 s counted: most of the run's time
