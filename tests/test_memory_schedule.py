"""Which sampled steps measure memory (``capture/memory_schedule.py``): the first two, every N-th after them,
and any whose inputs have shapes no measured step had; the rows of a measured step are those of a Profiler
that measures every step."""

from __future__ import annotations

import copy
import html
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from precprof import _compat
from precprof import tables as T
from precprof.capture import Profiler
from precprof.capture.memory_schedule import MemorySchedule, signature
from precprof.report import filters as F
from precprof.report import memory_summary as M


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _train(
    model: nn.Module, batches: list[int], evals: dict[tuple[int, str], int] | None = None, **kw: object
) -> Profiler:
    """``evals``: (step, "before" or "after" its training) -> the batch of a validation loss with grad on in
    eval mode (``model.eval()`` without ``no_grad``) run there, before ``prof.step()``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = Profiler(model, optimizer=opt, block_formats=False, **kw)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)

    def evaluate(step: int, where: str) -> None:
        if (b := (evals or {}).get((step, where))) is not None:
            model.eval()
            model(torch.randn(b, 16)).square().mean().item()
            model.train()

    with prof:
        for step, b in enumerate(batches):
            evaluate(step, "before")
            x = torch.randn(b, 16, generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            evaluate(step, "after")
            prof.step(loss=loss.detach())
    return prof


def _rows(mem: pd.DataFrame, step: int) -> list[tuple[object, ...]]:
    at = mem[mem[T.STEP] == step]
    cols = [T.COMPONENT, T.MODULE, T.DTYPE, T.PHASE, T.MOMENT, T.BYTES]
    return sorted(map(tuple, at[cols].astype(str).to_numpy().tolist()))


def test_the_cadence_counts_sampled_steps_only() -> None:
    sched = MemorySchedule(every=4)
    measured = []
    for s in range(40):
        if sched.begin(s, sampled=s % 2 == 0):
            measured.append(s)
        sched.done(s)
    # sampled steps 0, 2, 4, ...: the first two, then every 4th sampled step after the second
    assert measured == [0, 2, 10, 18, 26, 34] == sched.measured
    sched.begin(40, sampled=True)  # begun, never ended: not counted
    info = sched.describe()
    assert info["measured_steps"] == 6 and info["sampled_steps"] == 20 and info["last_measured"] == 34
    every = MemorySchedule(every=1)
    assert [s for s in range(6) if every.begin(s, sampled=True)] == list(range(6))


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4"])
def test_a_bad_memory_every_is_one_clear_error(bad: object) -> None:
    with pytest.raises(
        (TypeError, ValueError), match=r"Profiler\(memory_every=.*\): expected a whole number >= 1"
    ):
        Profiler(_mlp(), memory_every=bad)  # type: ignore[arg-type]


def test_signature_reads_positional_and_keyword_tensors() -> None:
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)
    assert signature((a,), {"ids": b, "n": 3}) == (((2, 3), torch.float32), ((4,), torch.int64))
    assert signature((a,), {}) != signature((torch.zeros(3, 3),), {})


def test_measured_steps_have_the_rows_of_a_profiler_that_measures_every_step() -> None:
    base = _mlp()
    batches = [4] * 9
    every = _train(copy.deepcopy(base), batches, sample_every=1, memory_every=1)
    some = _train(copy.deepcopy(base), batches, sample_every=1, memory_every=3)
    mem_all, mem = every.tables()["memory"], some.tables()["memory"]
    assert sorted(set(mem[T.STEP])) == [0, 1, 4, 7]  # no row at all on the other sampled steps
    assert sorted(set(mem_all[T.STEP])) == list(range(9))
    for step in (0, 1, 4, 7):
        got = _rows(mem, step)
        assert any(r[0] == T.ACTIVATIONS for r in got)
        assert got == _rows(mem_all, step)
    info = some.summary()["memory_steps"]
    assert info["every"] == 3 and info["measured_steps"] == 4 and info["last_measured"] == 7
    assert info["measured_for_new_shapes"] == []
    # the statistics themselves are recorded on every sampled step
    assert sorted(set(some.tables()["layers"][T.STEP])) == list(range(9))


def test_new_shapes_are_measured_in_the_step_that_runs_them() -> None:
    base = _mlp()
    batches = [4, 4, 4, 8, 4, 4, 4, 2, 8]
    some = _train(copy.deepcopy(base), batches, sample_every=1, memory_every=10)
    every = _train(copy.deepcopy(base), batches, sample_every=1, memory_every=1)
    mem, mem_all = some.tables()["memory"], every.tables()["memory"]
    # steps 0 and 1 by the cadence, 3 (batch 8) and 7 (batch 2) for their shapes; step 8's batch of 8 was
    # measured at step 3 already
    assert sorted(set(mem[T.STEP])) == [0, 1, 3, 7]
    for step in (3, 7):
        assert _rows(mem, step) == _rows(mem_all, step)
    acts = mem[mem[T.COMPONENT] == T.ACTIVATIONS].groupby(T.STEP)[T.BYTES].sum()
    assert acts[3] == 2 * acts[1] and acts[7] == acts[1] // 2  # activations scale with the batch
    info = some.summary()["memory_steps"]
    assert info["measured_for_new_shapes"] == [3, 7]


@pytest.mark.parametrize("where", ["after", "before"])
def test_an_evaluation_with_grad_on_is_not_measured_for_its_shapes(where: str) -> None:
    """A validation loss in eval mode with grad on (``model.eval()`` without ``no_grad``) on a batch of 7 where
    training runs 4, at step 3, which is not due to measure memory. The capture ignores it; the memory schedule
    watched it: after the step's training it armed the tracker, and step 3's rows were the evaluation's
    (activations of 7 samples, no gradients), listed as measured for new shapes; before it, the rows were the
    training's but the step was listed all the same. Step 3 is not measured, and the evaluation's shapes are
    not known: a training step of batch 7 (step 5) is measured for them."""
    base = _mlp()
    batches = [4, 4, 4, 4, 4, 7]
    prof = _train(copy.deepcopy(base), batches, {(3, where): 7}, sample_every=1, memory_every=10)
    every = _train(copy.deepcopy(base), batches, sample_every=1, memory_every=1)
    mem, mem_all = prof.tables()["memory"], every.tables()["memory"]
    summary = prof.summary()
    assert summary["eval_forwards_ignored"] == 3  # the evaluation, left out of the statistics
    assert sorted(set(mem[T.STEP])) == [0, 1, 5]
    assert summary["memory_steps"]["measured_for_new_shapes"] == [5]
    assert summary["memory_steps"]["measured_steps"] == 3
    for step in (0, 1, 5):
        assert _rows(mem, step) == _rows(mem_all, step)
    acts = mem[mem[T.COMPONENT] == T.ACTIVATIONS].groupby(T.STEP)[T.BYTES].sum()
    assert acts[5] == acts[1] * 7 // 4


def test_a_loop_that_trains_in_eval_mode_is_measured_for_new_shapes() -> None:
    """The evaluation rule leaves a step whose forwards all run in eval mode (BatchNorm and dropout frozen) to
    its training: its new shapes are measured."""
    model = _mlp().eval()
    prof = _train(model, [4, 4, 4, 8], sample_every=1, memory_every=10)
    assert prof.summary()["memory_steps"]["measured_for_new_shapes"] == [3]
    assert prof.summary()["eval_forwards_ignored"] == 0


def test_without_watching_shapes_the_cadence_alone_decides() -> None:
    sched = MemorySchedule(every=10, watch_shapes=False)
    model = _mlp()
    armed: list[int] = []
    for step, b in enumerate([4, 4, 4, 8]):
        sched.begin(step, True, model, lambda root, args, kwargs, s=step: armed.append(s))
        model(torch.randn(b, 16))
        sched.done(step)
    assert armed == [] and sched.measured == [0, 1]
    assert not model._forward_pre_hooks  # nothing watches the inputs


def test_the_watch_is_on_the_root_only_on_sampled_steps() -> None:
    model = _mlp()
    sched = MemorySchedule(every=4)
    sched.begin(0, True, model, lambda root, args, kwargs: None)
    assert len(model._forward_pre_hooks) == 1
    sched.begin(1, False, model)
    assert not model._forward_pre_hooks
    sched.begin(2, True, model, lambda root, args, kwargs: None)
    sched.unwatch()
    assert not model._forward_pre_hooks


def test_under_no_grad_the_watch_does_not_arm() -> None:
    model = _mlp()
    sched = MemorySchedule(every=10)
    armed: list[int] = []
    for step in range(3):  # the first two are measured; the third is not due
        sched.begin(step, True, model, lambda root, args, kwargs: armed.append(1))
        model(torch.randn(4, 16))
    with torch.no_grad():
        model(torch.randn(7, 16))  # an evaluation inside a sampled step: keeps nothing for backward
    assert armed == []
    model(torch.randn(7, 16))
    assert armed == [1]


def test_a_failure_to_measure_from_the_forward_leaves_training_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Arming the tracker inside the user's forward (new shapes) fails: the forward, the training and the
    statistics go on exactly as without precprof; the step has no memory rows, and the summary says why."""
    from precprof.capture.memory_tracker import MemoryTracker

    base = _mlp()
    batches = [4, 4, 4, 8, 4]
    plain = copy.deepcopy(base)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for b in batches:
        loss = plain(torch.randn(b, 16, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    arm = MemoryTracker._arm

    def broken(self: MemoryTracker) -> None:
        arm(self)  # hooks installed, the peak begun: then it fails, half done
        if self.schedule.measuring and self.schedule._for_shapes:  # only when armed from the forward
            raise RuntimeError("allocator history unavailable")

    monkeypatch.setattr(MemoryTracker, "_arm", broken)
    model = copy.deepcopy(base)
    prof = _train(model, batches, sample_every=1, memory_every=10)
    got = prof.tables()["steps"][T.LOSS].tolist()
    assert got == losses
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    mem = prof.tables()["memory"]
    assert 3 not in set(mem[T.STEP])  # the step with new shapes went unmeasured
    assert sorted(set(prof.tables()["layers"][T.STEP])) == list(range(5))  # its statistics were recorded
    summary = prof.summary()
    assert summary["memory_error"] == "RuntimeError: allocator history unavailable"
    assert summary["memory_steps"]["measured_for_new_shapes"] == []
    assert not model._forward_pre_hooks and not model._forward_hooks  # detached: nothing left behind
    assert _compat.top_saved_tensors_hooks() is None  # no saved-tensor hooks left


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """What a forward saves for backward, each storage once, parameters left out: autograd's own hooks."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.square().mean().backward()  # the loss, computed outside the model's forward, is not counted
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def test_a_loaders_smaller_last_batch_is_not_the_memory_the_report_shows(tmp_path: Path) -> None:
    """A loader without drop_last ends on a smaller batch, measured for its new shapes: the memory section,
    the projection and the verdict showed that step's (activations of 4 samples for a run of 64), and the
    allocator's peak over every step beside the parts of the last step's. They show the step that held the
    most, its own peak and parts, and say which and why."""
    model = _mlp()
    full, small = (_saved_bytes(copy.deepcopy(model), torch.randn(b, 16)) for b in (64, 4))
    prof = _train(model, [64] * 5 + [4], sample_every=1, memory_every=3, memory_peak=True)
    prof.report(tmp_path / "run")
    mem = prof.tables()["memory"]
    assert sorted(set(mem[T.STEP])) == [0, 1, 4, 5]  # 0, 1 and 4 by the cadence, 5 for its batch of 4
    summary = T.read_summary(tmp_path / "run")
    block = summary[T.SUMMARY_MEMORY]
    assert block["step"] == 4 and block["measured"][T.ACTIVATIONS] == full != small
    measured = M.measured_memory(mem)
    assert measured["step"] == 4 and measured["components"][T.ACTIVATIONS] == full
    assert measured["at_peak"]["step"] == 4 and measured["peak_steps"][T.ALLOCATOR_PEAK] == 4
    peak4 = mem[(mem[T.STEP] == 4) & (mem[T.COMPONENT] == T.ALLOCATOR_PEAK)][T.BYTES].max()
    assert measured["peaks"][T.ALLOCATOR_PEAK] == peak4 == measured["at_peak"]["allocated"]
    less = measured["held"][4] - measured["held"][5]
    assert less == full - small  # parameters, gradients and states are the same in both
    page = (tmp_path / "run" / "report.html").read_text()
    note = re.search(r'<p class="what" id="memory-step">([^<]*)</p>', page)
    assert note is not None and html.unescape(note.group(1)) == (
        "Step 4 is shown: of the 4 measured steps it held the most. The last, step 5 (measured because its "
        f"inputs had new shapes), held {F.nbytes(less)} less."
    )


def _grad_bytes(mem: pd.DataFrame, step: int) -> int:
    at = mem[(mem[T.STEP] == step) & (mem[T.COMPONENT] == T.GRADIENTS)]
    return int(at[T.BYTES].sum())


def test_the_default_cadence_spaces_out_while_measured_steps_agree() -> None:
    """By default the cadence starts at every 4th sampled step and doubles its spacing each time a step it
    measures holds what the last one of the same shapes held, up to every 32nd: 5 of 60 steady steps measured
    instead of 16, each with the rows of a Profiler that measures every step, so the memory the report reads is
    the same."""
    from precprof.report.environment import memory_setting

    base = _mlp()
    batches = [4] * 60
    prof = _train(copy.deepcopy(base), batches, sample_every=1)
    every = _train(copy.deepcopy(base), batches, sample_every=1, memory_every=1)
    fixed = _train(copy.deepcopy(base), batches, sample_every=1, memory_every=4)
    mem, mem_all = prof.tables()["memory"], every.tables()["memory"]
    assert sorted(set(mem[T.STEP])) == [0, 1, 9, 25, 57]
    assert len(set(fixed.tables()["memory"][T.STEP])) == 16  # a fixed cadence: 0, 1, 5, 9, ..., 57
    for step in (0, 1, 9, 25, 57):
        assert _rows(mem, step) == _rows(mem_all, step)
    assert _rows(mem, 57) == _rows(mem_all, 30)  # what every step between held
    info = prof.summary()["memory_steps"]
    assert info["adaptive"] and info["every"] == 4 and info["every_now"] == 32 and info["max_every"] == 32
    assert [c["every"] for c in info["spacing_changes"]] == [8, 16, 32]
    assert not fixed.summary()["memory_steps"]["adaptive"]
    said = memory_setting(info)
    assert "spacing out to every 32nd" in said and "(every 32nd at the end)" in said and "5 of 60" in said
    assert "spacing out" not in memory_setting(fixed.summary()["memory_steps"])


def test_a_measured_step_that_differs_brings_the_cadence_back_to_every_4th() -> None:
    """Rows that differ from the last measured step's of the same shapes (a cache that grows, no parameter
    frozen) at step 25, the next one the spaced-out cadence measures: the spacing goes back to 4 and spaces out
    again from there."""
    sched = MemorySchedule(every=None)
    model = _mlp()
    for step in range(60):
        sched.begin(step, True, model, lambda root, args, kwargs: None)
        model(torch.randn(4, 16))
        sched.done(step)
        if sched.measured and sched.measured[-1] == step:
            held = 64 if step < 20 else 96
            sched.result(step, [{T.STEP: step, T.COMPONENT: T.ACTIVATIONS, T.BYTES: held}])
    assert sched.measured == [0, 1, 9, 25, 29, 37, 53]
    assert sched.widened == [(1, 8), (9, 16), (25, 4), (29, 8), (37, 16), (53, 32)]


def _train_freezing(frozen: Callable[[int], bool], steps: int = 60) -> Profiler:
    """An MLP trained with SGD for ``steps`` sampled steps, its first layer frozen on the steps ``frozen`` says."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    prof = Profiler(model, optimizer=opt, block_formats=False, sample_every=1)
    gen = torch.Generator().manual_seed(1)
    with prof:
        for step in range(steps):
            model[0].requires_grad_(not frozen(step))
            loss = model(torch.randn(4, 16, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    return prof


def test_a_layer_frozen_has_the_next_sampled_step_measured() -> None:
    """The first layer frozen from step 13 to 29, with the cadence spaced out to every 16th (next due: 25): step
    13 trains fewer parameters than any measured step did, so step 14 is measured, holds fewer gradient bytes
    than step 9, and the spacing goes back to 4 and spaces out again from there. Unfrozen at step 30, it trains
    as many as steps 0-9 did: nothing is forced, and the cadence's next step (42) finds the difference."""
    prof = _train_freezing(lambda step: 13 <= step < 30)
    mem = prof.tables()["memory"]
    assert sorted(set(mem[T.STEP])) == [0, 1, 9, 14, 18, 26, 42, 46, 54]
    assert _grad_bytes(mem, 14) < _grad_bytes(mem, 9) == _grad_bytes(mem, 42)
    changes = [(c["step"], c["every"]) for c in prof.summary()["memory_steps"]["spacing_changes"]]
    assert changes == [(1, 8), (9, 16), (14, 4), (18, 8), (26, 16), (42, 4), (46, 8), (54, 16)]


def test_a_loop_that_freezes_a_layer_every_other_step_spaces_out_as_a_steady_one() -> None:
    """A GAN-like loop whose trainable parameters alternate every step: steps 0 and 1 measured both sets, so no
    step is forced, and the cadence spaces out as a steady run's, from step 1 (which held less than step 0: no
    widening there): every step it measures is odd, its rows equal to step 1's."""
    prof = _train_freezing(lambda step: step % 2 == 1)
    mem = prof.tables()["memory"]
    assert sorted(set(mem[T.STEP])) == [0, 1, 5, 13, 29]
    assert _grad_bytes(mem, 0) > _grad_bytes(mem, 1) == _grad_bytes(mem, 29)


def test_without_watching_shapes_the_default_cadence_stays_fixed() -> None:
    """Under torch.distributed the shapes are not watched: every rank must measure the same steps, and what one
    rank measured may differ from another's, so the cadence never spaces out."""
    sched = MemorySchedule(every=None, watch_shapes=False)
    model = _mlp()
    rows = [{T.STEP: 0, T.COMPONENT: T.PARAMETERS, T.BYTES: 64}]
    for step in range(20):
        sched.begin(step, True, model, lambda root, args, kwargs: None)
        model(torch.randn(4, 16))
        sched.done(step)
        if sched.measured and sched.measured[-1] == step:
            sched.result(step, [{**r, T.STEP: step} for r in rows])
    assert sched.measured == [0, 1, 5, 9, 13, 17] and sched.spacing == 4
