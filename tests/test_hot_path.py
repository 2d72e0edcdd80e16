"""The hot path of a sampled step: the engine's one-call reads, hooks that exist only on sampled steps, and a
``torch.compile``d model left alone on the other steps.

- ``HostRows.add_many`` (one C call for a list of tensors) and ``pp_add``'s flags give the rows that one
  ``add`` per tensor and the torch-op reference give;
- between sampled steps no module, parameter or optimizer of the model holds a precprof hook;
- compiled with inductor, a model with precprof attached compiles the same graphs as without it (Dynamo's
  own counters: frames, graphs, recompiles, graph breaks), an unsampled step gives bitwise the loss and
  weights it gives without precprof from the same state, and a sampled step (run eagerly) records every
  tensor kind; attached after the model was compiled and run, precprof still records every tensor kind.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pandas.testing as pd_testing
import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.stats import COL_HIST, StatsBuffer
from precprof.stats.transfer import to_host as transfer_to_host
from tests.test_stats import _kernel_or_skip, random_values


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3000, generator=g, dtype=torch.float64)
    return [
        base.float(),
        (base * 1e-30).float(),  # far below the others: the histogram window grows mid-batch
        (base * 1e30).to(torch.float64),
        base[:999].to(torch.bfloat16).reshape(27, 37).t(),  # not contiguous: flattened into a copy
        base.to(torch.float16)[::3],  # a strided view read in place
        torch.tensor(2.0**-149),  # 0-d
        torch.empty(0),
        base[:64].to(torch.float8_e4m3fn),  # not the kernel's: the torch-op path inside the batch
        torch.tensor([0.0, -0.0, math.inf, -math.nan, 65520.0, 2.0**-25]),
        random_values(500, 9, -140.0, 120.0).float(),
    ]


@pytest.mark.parametrize("which", ["mixed", "plain contiguous"])
def test_add_many_gives_the_rows_of_one_add_per_tensor(which: str) -> None:
    """Any mix of layouts and dtypes, and plain contiguous tensors of the kernel's dtypes only (its arrays made
    straight from what identifies them)."""
    _kernel_or_skip()
    xs = _cases()
    if which != "mixed":
        xs = [x for x in xs if x.is_contiguous() and x.numel() and x.dtype != torch.float8_e4m3fn]
        assert len(xs) >= 5
    rows = [i % 4 for i in range(len(xs))]
    many = StatsBuffer(4, "cpu")
    many.rows_of(torch.device("cpu")).add_many(xs, rows)
    one = StatsBuffer(4, "cpu")
    ops = StatsBuffer(4, "cpu", chunk=700)
    ops.use_kernel = False
    for x, r in zip(xs, rows, strict=True):
        one.accumulate(x, r)
        ops.accumulate(x, r)
    assert np.array_equal(many.to_host(), one.to_host())
    assert np.array_equal(many.to_host(), ops.to_host())


def test_add_many_again_reads_the_tensors_as_they_are_now() -> None:
    """``add_many`` of the same tensors keeps the arrays it read them from: a second call reads their new values,
    and a tensor given new data (another size, another dtype, not contiguous) is read as it is now."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(40, generator=g), torch.randn(8, 8, generator=g), torch.randn(5, generator=g).half()]
    rows = [0, 1, 2]
    many = StatsBuffer(3, "cpu")
    host = many.rows_of(torch.device("cpu"))
    changes = [
        lambda: xs[0].mul_(1e-20),  # the same memory, new values
        lambda: xs[0].resize_(7),  # the same memory, fewer elements
        lambda: xs[1].set_(torch.randn(3, 3, generator=g)),  # new memory and size
        lambda: xs.__setitem__(1, torch.randn(3, 3, generator=g).double()),  # another tensor, another dtype
        lambda: xs[2].set_(torch.randn(6, 4, generator=g).half().t()),  # not contiguous (then never kept)
        lambda: xs[2].mul_(2.0),
    ]
    for change in [lambda: None, *changes]:
        change()
        many.reset()
        host.add_many(xs, rows)
        one = StatsBuffer(3, "cpu")
        for x, r in zip(xs, rows, strict=True):
            one.accumulate(x, r)
        assert np.array_equal(many.to_host(), one.to_host())


def test_an_assigning_add_keeps_only_the_last_tensor() -> None:
    """A weight gradient's row after several accumulations holds the last one only (kernel and torch ops)."""
    xs = _cases()
    for use_kernel in (True, False):
        buf = StatsBuffer(2, "cpu")
        buf.use_kernel = use_kernel
        rows = buf.rows_of(torch.device("cpu"))
        for x in xs:
            rows.add(x, 1, assign=True)
            rows.add(x, 0)  # the row beside it keeps everything
        fresh = StatsBuffer(2, "cpu")
        fresh.accumulate(xs[-1], 1)
        for x in xs:
            fresh.accumulate(x, 0)
        assert np.array_equal(buf.to_host(), fresh.to_host()), use_kernel


def test_an_assigning_add_many_gives_the_rows_of_assigning_adds() -> None:
    """``add_many(assign=True)`` (a step's weight gradients in one call) clears each row first, as one assigning
    ``add`` per tensor does, kernel and torch ops alike; the rows beside keep what they held."""
    xs = _cases()
    for use_kernel in (True, False):
        many = StatsBuffer(len(xs), "cpu")
        one = StatsBuffer(len(xs), "cpu")
        for buf in (many, one):
            buf.use_kernel = use_kernel
            for i, x in enumerate(reversed(xs)):
                buf.accumulate(x, i)  # something to clear first
        many.rows_of(torch.device("cpu")).add_many(xs[:7], list(range(7)), assign=True)
        for i, x in enumerate(xs[:7]):
            one.rows_of(torch.device("cpu")).add(x, i, assign=True)
        assert np.array_equal(many.to_host(), one.to_host()), use_kernel


def test_the_cpu_rows_copied_as_held_decode_as_their_dense_copy() -> None:
    """A sampled step's CPU rows are copied as the rows hold them (counts, histogram window, block slots:
    ``StatsBuffer.host_windowed``) instead of as a dense [rows, width] array: the step's layers and histogram
    columns decode the same from either."""
    from precprof.flush import HeldRows, StepRows

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    prof = precprof.Profiler(model, sample_every=1, block_formats=True, block_groups=1).attach()
    x = torch.randn(6, 8) * torch.exp2(torch.randint(-30, 30, (6, 1)).float())
    (model(x) * 1e-20).sum().backward()  # gradients far below the activations: a wide window
    buf, rows = prof._buffer, prof._plan.rows
    held = buf.host_windowed()
    assert held is not None and held[2] > 0  # the window starts past bin 0
    data, slots = buf.from_host(transfer_to_host(buf.device_tensors()))
    active = np.flatnonzero(np.asarray(rows.calls) > 0)
    assert len(active) and buf.blocks_seen.any()
    made = [
        StepRows(0, rows, active, h, 1.0, {}, buf.block_slot, buf.blocks_seen).decode()
        for h in (
            HeldRows(*held[:3], held[3].numpy().copy()),
            HeldRows(data[:, :COL_HIST], data[:, COL_HIST:], 0, slots),
        )
    ]
    prof.detach()
    (cols_a, hist_a), (cols_b, hist_b) = made
    assert cols_a.keys() == cols_b.keys() and hist_a is not None and hist_b is not None
    for k in cols_a:
        np.testing.assert_array_equal(np.asarray(cols_a[k]), np.asarray(cols_b[k]), err_msg=k)
    for k in hist_a:
        np.testing.assert_array_equal(np.asarray(hist_a[k]), np.asarray(hist_b[k]), err_msg=k)


@pytest.mark.parametrize("engine", ["c", "torch"])
def test_a_reset_clears_and_a_copy_reads_the_bins_the_step_used(engine: str) -> None:
    """The CPU rows track the histogram bins used since their last reset (the kernel's merges, a merge after the
    window grew, the torch-op path): a reset clears those alone, and the copy of a step reads those alone
    (``HostRows.windowed``). Over steps whose values move across the whole exponent range, each step's copy
    holds what a fresh set of rows given the same tensors holds, and a reset leaves rows equal to fresh ones."""
    if engine == "c":
        _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    ranges = [(-30, -20), (100, 120), (-140, -120), (-5, 5), (0, 0)]

    def make() -> StatsBuffer:
        buf = StatsBuffer(6, "cpu", chunk=256)
        buf.use_kernel = engine == "c"
        return buf

    kept = make()
    for lo, hi in ranges:
        xs = [
            random_values(300, int(torch.randint(0, 99, (1,), generator=g)), lo, hi).float() for _ in range(4)
        ]
        at = [0, 3, 5, 3]
        if lo == hi:
            xs, at = [], []  # a step that read nothing
        fresh = make()
        for buf in (kept, fresh):
            for x, r in zip(xs, at, strict=True):
                buf.accumulate(x, r)
        rows = kept.rows_of(torch.device("cpu"))
        counts, window, wlo = rows.windowed()
        dense = np.zeros_like(fresh.to_host())
        dense[:, :COL_HIST] = counts
        dense[:, COL_HIST + wlo : COL_HIST + wlo + window.shape[1]] = window
        np.testing.assert_array_equal(dense, fresh.to_host())
        np.testing.assert_array_equal(kept.to_host(), fresh.to_host())
        kept.reset()
        np.testing.assert_array_equal(kept.to_host(), make().to_host())
    assert rows.windowed()[1].shape[1] == 0  # nothing used since the last reset


class _Tied(nn.Module):
    """Tied weights, a reentrant checkpoint and a parameter used outside any module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(self.body, self.emb(idx), use_reentrant=True)
        return self.head(x) * self.temperature


@pytest.mark.parametrize("accumulate", [1, 2])
def test_weight_gradients_read_when_backward_ends_are_those_the_hooks_saw(
    accumulate: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampled step's weight gradients are read together when each backward pass ends (one call of the
    engine): bf16 autocast, a GradScaler, gradient accumulation, tied weights and a reentrant checkpoint give the
    layers table that reading each one in its own hook gives (as under torch.distributed), and training is
    bitwise the same."""
    from precprof.capture import hooks

    def run(at_end: bool) -> tuple[Any, list[float], int]:
        monkeypatch.setattr(hooks, "_distributed", lambda: not at_end)
        torch.manual_seed(0)
        model = _Tied()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        batched = 0
        with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=2) as prof:
            rows = prof._buffer.rows_of(torch.device("cpu"))
            add_many = rows.add_many

            def spy(tensors: Any, rows_: Any, assign: bool = False) -> None:
                nonlocal batched
                batched += assign
                add_many(tensors, rows_, assign)

            rows.add_many = spy
            losses = []
            g = torch.Generator().manual_seed(1)
            for _ in range(4):
                for _ in range(accumulate):
                    idx = torch.randint(0, 16, (4, 6), generator=g)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(idx).float().logsumexp(-1).mean() / accumulate
                    scaler.scale(loss).backward()
                    losses.append(loss.item())
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                prof.step(loss=loss.detach())
        layers = prof.tables()["layers"]
        return layers[layers[T.TENSOR] == T.WEIGHT_GRAD].reset_index(drop=True), losses, batched

    at_end, losses, batched = run(True)
    each, losses_each, batched_each = run(False)
    assert batched == 2 * accumulate and batched_each == 0  # one read per backward of the 2 sampled steps
    assert len(at_end) == 2 * 6  # 6 gradients (the tied one once) on each sampled step
    pd_testing.assert_frame_equal(at_end, each)
    assert losses == losses_each


def test_a_backward_that_raised_on_a_sampled_step_leaves_the_next_ones_gradients_read() -> None:
    """A sampled step whose first backward raises midway (a hook of the user's), caught, then runs its forward and
    backward again: the gradients that pass announced were never read (its queued read runs only when a pass
    ends well), and the step's weight gradients were all missing, the retry's pass finding a read "queued". The
    step records the retry's gradients, as a step without the failed attempt does, and trains the same."""

    def run(fail_first: bool) -> tuple[Any, list[float]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
            for step in range(3):
                x = torch.randn(4, 8, generator=g)
                if fail_first and step == 1:
                    h = model[0](x)

                    def fail(grad: torch.Tensor) -> None:
                        raise RuntimeError("a check of the user's")

                    h.register_hook(fail)  # the last layers' gradients are in by then
                    with pytest.raises(RuntimeError, match="a check of the user's"):
                        model[1:](h).square().mean().backward()
                    opt.zero_grad(set_to_none=True)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step(loss=loss.detach())
                losses.append(loss.item())
        layers = prof.tables()["layers"]
        return layers[layers[T.TENSOR] == T.WEIGHT_GRAD].reset_index(drop=True), losses

    clean, clean_losses = run(False)
    failed, failed_losses = run(True)
    assert len(clean) == 3 * 6 and clean[T.STEP].value_counts().tolist() == [6, 6, 6]
    pd_testing.assert_frame_equal(failed, clean)
    assert failed_losses == clean_losses


class _Recast(nn.Module):
    """A layer that casts its weight to its input's dtype: its parameters' data may be replaced between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.extra = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.to(x.dtype) + self.extra.sum().to(x.dtype)


def test_a_parameter_whose_data_is_replaced_is_read_as_it_is_now() -> None:
    """Where each parameter is read is decided once and kept (``StepHooks._read_weights``) while the parameters'
    types, dtypes, devices and sizes stay: a parameter whose ``.data`` becomes another dtype, another size, new
    values, complex (skipped and counted) or empty (nothing to read) between sampled steps is read as it is at
    the next one."""
    torch.manual_seed(0)
    model = _Recast()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    changes = {
        2: lambda: setattr(model.w, "data", torch.full((4, 4), 3.0, dtype=torch.float64)),
        3: lambda: setattr(model.extra, "data", torch.tensor([-8.0, 0.0, 2.0, 0.5, 0.25])),
        4: lambda: model.extra.data.mul_(2.0),  # in place: the same tensor, new values
        5: lambda: setattr(model.w, "data", torch.full((4, 4), 0.125, dtype=torch.bfloat16)),
        6: lambda: setattr(model.extra, "data", torch.tensor([1 + 1j, 2.0])),
        7: lambda: setattr(model.extra, "data", torch.zeros(0)),
        8: lambda: setattr(model.extra, "data", torch.tensor([4.0, -1.0])),
    }
    expected = {}
    with (
        warnings.catch_warnings(),
        precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, weight_updates=False) as prof,
    ):
        warnings.simplefilter("ignore", UserWarning)  # (a complex sum cast to a real one)
        for step in range(9):
            if step in changes:
                changes[step]()
            expected.update(
                {
                    (step, name): (
                        p.numel(),
                        str(p.dtype).removeprefix("torch."),
                        float(p.detach().abs().max()),
                    )
                    for name, p in (("w", model.w), ("extra", model.extra))
                    if p.numel() and not p.is_complex()
                }
            )
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    layers = prof.tables()["layers"]
    weights = layers[layers[T.TENSOR] == T.WEIGHT]
    assert {(r.step, r.param): (r.numel, r.dtype, r.absmax) for r in weights.itertuples()} == expected
    skipped = {(s["tensor"], s["param"]): s["count"] for s in prof.summary()["skipped_tensors"]}
    assert skipped == {(T.WEIGHT, "extra"): 1, (T.WEIGHT_GRAD, "extra"): 1}  # the complex one, at step 6


def test_under_torch_distributed_each_weight_gradient_is_read_in_its_hook(tmp_path: Any) -> None:
    """With a process group up, a gradient may be a view of a DDP bucket whose all-reduce is in flight when the
    backward ends: each is read in its own hook there (as it accumulates), and still recorded."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        with precprof.Profiler(model, sample_every=1) as prof:
            model(torch.randn(4, 8)).sum().backward()
            assert prof._hooks is not None and not prof._hooks.grads_at_end
            prof.step()
        layers = prof.tables()["layers"]
        assert (layers[T.TENSOR] == T.WEIGHT_GRAD).sum() == 4
    finally:
        dist.destroy_process_group()


def _hooks_on(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Every hook a module, a parameter or the optimizer of the model holds, and what a hook dictionary holds
    of its own (precprof's copies without its hooks, ``_compat.CopiesLeaveOut``)."""
    n = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    n += sum(len(vars(d)) for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks))
    n += sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    n += len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    return n


class _Wrapped(torch.Tensor):
    """A tensor subclass: its hooks go through ``register_hook`` itself."""


@pytest.mark.parametrize("kind", ["output", "leaf", "subclass", "hooked before"])
def test_a_gradient_hook_without_a_handle_fires_as_a_registered_one(kind: str) -> None:
    """``_compat.add_grad_hook`` (a module output's gradient hook of a sampled step, without the handle
    ``register_hook`` makes) sees the gradient ``register_hook``'s hook sees, once per backward, in order with
    the hooks around it, and leaves the gradients as they were."""
    from precprof import _compat

    def run(direct: bool) -> tuple[list[Any], torch.Tensor]:
        torch.manual_seed(0)
        lin = nn.Linear(4, 3)
        x = torch.randn(2, 4, requires_grad=True)
        t = x if kind == "leaf" else lin(x)
        if kind == "subclass":
            t = t.as_subclass(_Wrapped)
        calls: list[Any] = []
        if kind == "hooked before":
            t.register_hook(lambda g: calls.append(("user before", g.clone())))
        ours = lambda g: calls.append(("ours", g.clone()))  # noqa: E731
        if direct:
            _compat.add_grad_hook(t, _compat.reserve_hook_ids(1)[0], ours)
        else:
            t.register_hook(ours)
        t.register_hook(lambda g: calls.append(("user after", g.clone())))
        (t * torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape)).sum().backward()
        return calls, x.grad

    calls, grad = run(True)
    want, want_grad = run(False)
    assert [c for c, _ in calls] == [c for c, _ in want]
    assert "ours" in [c for c, _ in calls]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(calls, want, strict=True))
    assert torch.equal(grad, want_grad)


def test_no_hook_anywhere_between_sampled_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    with precprof.Profiler(model, optimizer=opt, sample_every=3) as prof:
        for _ in range(7):
            seen.append((prof.sampling, _hooks_on(model, opt)))
            model(torch.randn(5, 8)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    assert [s for s, _ in seen] == [True, False, False, True, False, False, True]
    assert all(n > 0 for s, n in seen if s)
    assert all(n == 0 for s, n in seen if not s)
    assert _hooks_on(model, opt) == 0  # detached: none left
    layers = prof.tables()["layers"]
    assert sorted(set(layers[T.STEP])) == [0, 3, 6]
    kinds = set(layers[T.TENSOR])
    assert {T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT, T.WEIGHT_GRAD, T.WEIGHT_UPDATE} <= kinds


def test_consecutive_sampled_steps_keep_their_hooks_and_record_the_same() -> None:
    """A sampled step followed by another keeps its hooks in place (paused inside ``prof.step()``, not
    removed and installed again), and records what a step sampled on its own records: every step of a run
    sampling each step equals the same step of a run sampling every other one, bitwise."""
    runs = {}
    for every in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        counts = []
        # memory measured on every sampled step: its hooks too stay from one sampled step to the next
        with precprof.Profiler(model, optimizer=opt, sample_every=every, memory_every=1) as prof:
            for _ in range(5):
                counts.append(_hooks_on(model, opt) if prof.sampling else 0)
                model(torch.randn(5, 8, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step()
        assert _hooks_on(model, opt) == 0
        assert len(set(c for c in counts if c)) == 1  # the same hooks at every sampled step
        runs[every] = prof.tables()["layers"]
    every_step, every_other = runs[1], runs[2]
    assert sorted(set(every_step[T.STEP])) == [0, 1, 2, 3, 4]
    for step in (0, 2, 4):
        a = every_step[every_step[T.STEP] == step].reset_index(drop=True)
        b = every_other[every_other[T.STEP] == step].reset_index(drop=True)
        pd_testing.assert_frame_equal(a, b)


# ---------------------------------------------------------------------------------------------- compile
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)
    )


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def _train_step(compiled: Any, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "frames_ok": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(counters["recompiles"].get("total", 0)) if "recompiles" in counters else 0,
    }


@pytest.mark.slow
def test_a_compiled_model_compiles_the_same_graphs_and_its_unsampled_steps_are_bitwise_unchanged() -> None:
    """inductor on the CPU, bf16 autocast. Without precprof, then with it (sampled every 4th step): the same
    unique graphs, no graph break and no recompile; before each unsampled step the state of the run without
    precprof is set to the profiled run's, and the step's loss and weights come out bitwise equal."""
    import torch._dynamo

    steps = 9
    xs = _batches(steps)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    base_model = _model()
    base_opt = torch.optim.AdamW(base_model.parameters(), lr=1e-3)
    base_compiled = torch.compile(base_model)
    for x in xs[:3]:
        _train_step(base_compiled, base_model, base_opt, x)
    without = _dynamo_counts()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)
    base_model2 = _model()
    base_opt2 = torch.optim.AdamW(base_model2.parameters(), lr=1e-3)
    base_compiled2 = torch.compile(base_model2)
    compared = 0
    with precprof.Profiler(model, optimizer=opt, sample_every=4, memory=False) as prof:
        for x in xs:
            sampled = prof.sampling
            if not sampled:  # the same state, then one step each: bitwise the same
                base_model2.load_state_dict(model.state_dict())
                base_opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # not aliased
            loss = _train_step(compiled, model, opt, x)
            if not sampled:
                base_loss = _train_step(base_compiled2, base_model2, base_opt2, x)
                assert torch.equal(loss, base_loss)
                for a, b in zip(model.parameters(), base_model2.parameters(), strict=True):
                    assert torch.equal(a, b)
                compared += 1
            prof.step(loss=loss)
    assert compared == 6
    with_prof = _dynamo_counts()
    # one graph serves the profiled model and the reference model beside it (Dynamo inlines the modules and
    # takes their parameters as inputs): the profiled model ran the very graph a model without precprof runs
    assert with_prof["frames_ok"] == without["frames_ok"] == 1
    assert with_prof["graph_breaks"] == without["graph_breaks"] == 0
    assert with_prof["recompiles"] == without["recompiles"] == 0
    layers = prof.tables()["layers"]
    assert sorted(set(layers[T.STEP])) == [0, 4, 8]
    for kind in (T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT, T.WEIGHT_GRAD):
        assert set(layers.loc[layers[T.TENSOR] == kind, T.STEP]) == {0, 4, 8}, kind


@pytest.mark.slow
def test_attached_after_the_compiled_model_ran_it_still_records_every_tensor_kind() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="eager")
    for x in _batches(2):
        _train_step(compiled, model, opt, x)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for x in _batches(2):
            prof.step(loss=_train_step(compiled, model, opt, x))
    layers = prof.tables()["layers"]
    for kind in (T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT, T.WEIGHT_GRAD):
        got = layers[layers[T.TENSOR] == kind]
        assert set(got[T.STEP]) == {0, 1}, kind
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    assert set(acts[T.MODULE]) == {str(i) for i in range(6)} | {"0:input"}  # (the model's input, 0 reads it)


def test_a_sampled_step_of_a_compiled_model_runs_eagerly_and_restores_the_stance() -> None:
    import torch._dynamo.eval_frame as ef

    model = _model()
    compiled = torch.compile(model, backend="eager")
    stances = []
    with precprof.Profiler(model, sample_every=2, memory=False) as prof:
        for x in _batches(3):
            stances.append(ef._stance.stance)
            compiled(x).sum().backward()
            prof.step()
    assert stances == ["force_eager", "default", "force_eager"]
    assert ef._stance.stance == "default"
    assert copy.copy(prof.tables()["steps"][T.SAMPLED].tolist()) == [True, False, True]


def _stance_run(
    steps: int, set_at: int, before_forward: bool, profile: bool, **kw: Any
) -> tuple[list[str], str, int, precprof.Profiler | None]:
    """A compiled model's loop that sets ``fail_on_recompile`` in step ``set_at`` (warm: nothing may recompile
    from there), before its forward or at its end (before ``prof.step()``), with or without precprof. The stance
    each step began with, the stance after the loop, and the graphs Dynamo made (its own count)."""
    import torch._dynamo
    import torch._dynamo.eval_frame as ef

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.compiler.set_stance("default")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="eager")
    prof = precprof.Profiler(model, optimizer=opt, memory=False, **kw) if profile else None
    stances = []
    try:
        with prof if prof is not None else contextlib.nullcontext():
            for i, x in enumerate(_batches(steps)):
                if i == set_at and before_forward:
                    torch.compiler.set_stance("fail_on_recompile")
                stances.append(ef._stance.stance)
                loss = _train_step(compiled, model, opt, x)
                if i == set_at and not before_forward:
                    torch.compiler.set_stance("fail_on_recompile")
                if prof is not None:
                    prof.step(loss=loss)
        after = ef._stance.stance
    finally:
        torch.compiler.set_stance("default")
    return stances, after, int(torch._dynamo.utils.counters["stats"]["unique_graphs"]), prof


def test_a_stance_the_loop_sets_in_a_sampled_step_stays_the_loops_and_the_step_is_said(
    tmp_path: Path,
) -> None:
    """A loop that sets fail_on_recompile at the start of a sampled step replaces precprof's force_eager: the
    step's forward runs the compiled graph (no activation rows: no module hook fires in it, as torch runs it),
    and at the step's end precprof had put back the stance it found before the step, undoing the loop's for the
    rest of the run without a word. The loop's stance stays, and the summary and the page name the step."""
    stances, after, graphs, _ = _stance_run(5, 3, True, False)
    assert after == "fail_on_recompile" and graphs == 1  # the loop itself, without precprof
    stances, after, graphs, prof = _stance_run(5, 3, True, True, sample_every=3)
    assert prof is not None
    assert stances == ["force_eager", "default", "default", "fail_on_recompile", "fail_on_recompile"]
    assert after == "fail_on_recompile" and graphs == 1
    layers = prof.tables()["layers"]
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    assert set(layers[T.STEP]) == {0, 3} and set(acts[T.STEP]) == {0}  # step 3 ran compiled
    loop_stance = prof.summary()["loop_stance"]
    assert loop_stance["set_in_sampled_steps"] == [{"step": 3, "stance": "fail_on_recompile"}]
    assert loop_stance["fail_on_recompile_held_off"] == []
    # the loop is in order: its backward tells the step's forward ran, though no hook saw it
    assert prof.summary()["loop_order"] == {}
    prof.report(tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    assert "set by the loop before the forward of sampled step 3 (&#39;fail_on_recompile&#39;)" in page


def test_a_stance_the_loop_sets_after_a_sampled_steps_forward_loses_nothing_and_is_not_said(
    tmp_path: Path,
) -> None:
    """Set at the end of sampled step 0 (after its backward and optimizer step, before prof.step(), as precprof's
    own note advises): the step ran eagerly and has every module's activation row, yet the summary and the page
    said it was set during the step and that its rows lacked its activations. Such a change is not noted."""
    _, _, _, prof = _stance_run(5, 0, False, True)
    assert prof is not None
    layers = prof.tables()["layers"]
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    assert set(acts[acts[T.STEP] == 0][T.MODULE]) == {str(i) for i in range(6)} | {"0:input"}  # every module
    assert prof.summary()["loop_stance"]["set_in_sampled_steps"] == []
    prof.report(tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    assert "set by the loop" not in page and "lack its activations" not in page


def test_fail_on_recompile_before_the_first_compile_lets_the_first_unsampled_step_compile(
    tmp_path: Path,
) -> None:
    """ "Compile at step 0, then fail_on_recompile": without precprof the model compiled in step 0. With it, steps
    0 and 1 are sampled and run eagerly, so the model first compiles in step 2, which the loop's stance refused as
    a recompile (a RuntimeError). Step 2 now runs under "default" and compiles, as Dynamo's graph count says, and
    so does the next step not sampled, which compiles nothing: the loop's fail_on_recompile is back after it and
    after the loop."""
    stances, after, graphs, _ = _stance_run(5, 0, False, False)
    assert stances == ["default"] + ["fail_on_recompile"] * 4 and graphs == 1
    stances, after, graphs, prof = _stance_run(5, 0, False, True)
    assert prof is not None
    sampled = prof.tables()["steps"][T.SAMPLED].tolist()
    assert sampled[:3] == [True, True, False]  # (the default: the first two steps)
    held = [2, sampled.index(False, 3)]  # the first compiles, then the first step that compiles nothing
    own = ["default" if i in held else "fail_on_recompile" for i in range(5)]
    assert stances == ["force_eager" if s else o for s, o in zip(sampled, own, strict=True)]
    assert after == "fail_on_recompile" and graphs == 1
    assert prof.summary()["loop_stance"]["fail_on_recompile_held_off"] == held
    prof.report(tmp_path / "run")
    assert (
        f"was held off for steps 2 and {held[1]}, not sampled, which ran under &#39;default&#39; until one "
        "compiled nothing" in (tmp_path / "run" / "report.html").read_text()
    )


def test_fail_on_recompile_after_warming_train_and_eval_is_held_off_until_a_step_compiles_nothing() -> None:
    """Step 0 trains and validates through the compiled model (two graphs), then the loop forbids recompiles;
    it validates again at step 3. With precprof the sampled steps 0 and 1 ran eagerly, only step 2 was held off,
    and step 3's eval forward, its first compile, was refused as a recompile: a crash the loop never had. The
    steps not sampled run under "default" until one compiles nothing, and the run ends as without precprof,
    with the same two graphs."""
    assert _warm_then_guard(False, False, evals=(0, 3, 7, 8))[:2] == ("ok", 2)
    outcome, graphs, prof = _warm_then_guard(True, False, evals=(0, 3, 7, 8))
    assert (outcome, graphs) == ("ok", 2)
    assert prof is not None
    sampled = prof.tables()["steps"][T.SAMPLED].tolist()
    unsampled = [i for i, s in enumerate(sampled) if not s]
    assert unsampled[:3] == [2, 3, 4]  # (the default sampling: steps 0 and 1, then later ones)
    assert prof.summary()["loop_stance"]["fail_on_recompile_held_off"] == [2, 3, 4]  # 4 compiled nothing


def test_fail_on_recompile_set_in_a_sampled_step_before_the_first_compile_is_explained() -> None:
    """Set at the start of step 1, which is sampled, before anything compiled: torch refuses the model's first
    compile as a recompile before any hook of precprof's runs. The error says why, and what to do."""
    with pytest.raises(RuntimeError, match="fail_on_recompile") as caught:
        _stance_run(4, 1, True, True)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "this is the model's first compile, not a recompile" in notes
    assert "Set the stance between steps (before prof.step())" in notes


def _warm_then_guard(
    profile: bool, warm_before: bool, evals: tuple[int, ...] = (), odd_step: int = -1
) -> tuple[str, int, precprof.Profiler | None]:
    """The "warm, nothing may recompile now" loop: step 0 trains and, at the steps ``evals``, runs a validation
    forward (eval mode, no_grad) through the compiled model; then the loop sets fail_on_recompile. With
    ``warm_before`` the model compiled and ran one training step before the Profiler attached; at ``odd_step`` the
    batch has 3 rows, not 4 (a real recompile: dynamic=False). What came of it ("ok" or the error's first line)
    and the graphs Dynamo made (its own count)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.compiler.set_stance("default")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    if warm_before:
        _train_step(compiled, model, opt, _batches(1)[0])
    prof = precprof.Profiler(model, optimizer=opt, memory=False) if profile else None
    outcome = "ok"
    try:
        with prof if prof is not None else contextlib.nullcontext():
            for i, x in enumerate(_batches(10)):
                loss = _train_step(compiled, model, opt, x[:3] if i == odd_step else x)
                if i in evals:
                    model.eval()
                    with torch.no_grad():
                        compiled(x)
                    model.train()
                if i == 0:
                    torch.compiler.set_stance("fail_on_recompile")
                if prof is not None:
                    prof.step(loss=loss)
    except RuntimeError as e:
        outcome = str(e).partition(" filename:")[0]
    finally:
        torch.compiler.set_stance("default")
    return outcome, int(torch._dynamo.utils.counters["stats"]["unique_graphs"]), prof


def test_a_recompile_of_a_model_compiled_before_the_profiler_attached_is_refused() -> None:
    """The model compiled and ran before the Profiler attached, the loop forbade recompiles from step 0, and a
    batch of another shape at step 2 recompiles it: torch refuses it, as the loop asked. precprof held
    fail_on_recompile off for its first step not sampled, whatever had compiled, so the recompile went through
    (a second graph) and the page said the model first compiled there. Now the loop's guard stands."""
    refused = "Detected recompile when torch.compile stance is 'fail_on_recompile'."
    assert _warm_then_guard(False, True, odd_step=2)[:2] == (refused, 1)  # the loop itself, without precprof
    outcome, graphs, prof = _warm_then_guard(True, True, odd_step=2)
    assert (outcome, graphs) == (refused, 1)
    assert prof is not None and not prof.summary()["loop_stance"]["fail_on_recompile_held_off"]


def test_prof_step_inside_a_compiled_train_step_records_every_sampled_step_as_an_eager_loop_does() -> None:
    """The whole train step compiled, ``prof.step()`` in it: the step's bookkeeping ran traced, so the next
    sampled step could not be made eager; it ran compiled with the hooks traced (10 of 23 rows, no word) and the
    one after segfaulted in precprof's C kernel, fed from traced code. ``prof.step`` breaks the graph and runs
    eagerly: each sampled step has the rows, equal to those of the same loop not compiled, trained bitwise alike."""
    import torch._dynamo

    def run(compile_step: bool) -> tuple[pd.DataFrame, list[torch.Tensor]]:
        torch._dynamo.reset()
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        prof = precprof.Profiler(model, optimizer=opt, sample_every=3, memory=False).attach()

        def train_step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            return loss.detach()

        step = torch.compile(train_step, backend="eager") if compile_step else train_step
        losses = [step(x) for x in _batches(8)]
        prof.detach()
        return prof.tables()["layers"], losses

    compiled, compiled_losses = run(True)
    eager, eager_losses = run(False)
    assert all(torch.equal(a, b) for a, b in zip(compiled_losses, eager_losses, strict=True))
    assert compiled.groupby(T.STEP).size().to_dict() == eager.groupby(T.STEP).size().to_dict()
    assert sorted(set(eager[T.STEP])) == [0, 3, 6]
    pd.testing.assert_frame_equal(compiled, eager)


def test_the_summary_and_the_page_say_what_was_compiled(tmp_path: Path) -> None:
    """Regional compilation (each block's ``.compile()``, as torchtitan and transformers compile) and a whole
    compiled model: the summary says what ran compiled, and the page that the sampled steps ran it eagerly
    (neither said anything: a sampled step's statistics and time are eager PyTorch's)."""
    from precprof.report import render_report

    model = _model()
    for i in (0, 3):
        model[i].compile(backend="eager")
    with precprof.Profiler(model, sample_every=2, memory=False) as prof:
        for x in _batches(3):
            model(x).sum().backward()
            prof.step()
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    assert summary[T.SUMMARY_CAPTURE]["compiled"] == "2 of its modules (regional, backend eager)"
    page = render_report(prof.tables(), summary, tmp_path / "report.html").read_text()
    said = (
        "torch.compile</th><td>2 of its modules (regional, backend eager): the steps not sampled ran compiled"
    )
    assert said in page
    for backend in ("eager", "aot_eager", "inductor"):
        whole = precprof.Profiler(torch.compile(_model(), backend=backend)).summary()["compiled"]
        assert whole == f"the whole model (backend {backend})"
        in_place = _model()
        in_place.compile(backend=backend)
        assert precprof.Profiler(in_place).summary()["compiled"] == whole
        # its forward replaced by a compiled one, whole or per block: it said nothing (no caveat on the page)
        forward = _model()
        forward.forward = torch.compile(forward.forward, backend=backend)  # type: ignore[method-assign]
        assert precprof.Profiler(forward).summary()["compiled"] == whole
    blocks = _model()
    for i in (0, 3):
        blocks[i].forward = torch.compile(blocks[i].forward, backend="eager")  # type: ignore[method-assign]
    assert precprof.Profiler(blocks).summary()["compiled"] == "2 of its modules (regional, backend eager)"
    assert precprof.Profiler(_model()).summary()["compiled"] is None


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_the_dropout_caveat_is_inductors_alone(tmp_path: Path, backend: str) -> None:
    """A model with dropout compiled with the eager or aot_eager backend trains bitwise as without precprof
    (torch's own masks): the page said inductor drew other masks and the run was "not bitwise" the unprofiled
    one, because the summary named no backend and every compile was taken for inductor's. A run whose every step
    was sampled (eager) drew eager's masks where the unprofiled run drew inductor's: it says so too."""
    from precprof.report import render_report

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 8))
    compiled = torch.compile(model, backend=backend)
    with precprof.Profiler(compiled, sample_every=2, memory=False) as prof:
        compiled(torch.randn(4, 16)).sum().backward()  # a sampled step: eager, nothing compiled
        prof.step()
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    page = render_report(prof.tables(), summary, tmp_path / "report.html").read_text()
    row = page.split("torch.compile</th><td>", 1)[1].split("</td>", 1)[0]
    assert row.startswith(f"the whole model (backend {backend})")
    assert ("inductor&#39;s kernels draw their own random numbers" in row) == (backend == "inductor")


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.Sequential(nn.GELU(), nn.Linear(32, 32)),
        nn.Sequential(nn.ReLU(), nn.Linear(32, 8)),
    )


def _compiled_blocks(model: nn.Module) -> nn.Module:
    for i in (1, 2):
        model[i] = torch.compile(model[i], backend="eager")
    return model


def _checkpointed_blocks(model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i in (1, 2):
        model[i] = checkpoint_wrapper(model[i])
    return model


WRAPPINGS = {
    # torchtitan's regional compilation: each block replaced by torch.compile(block)
    "compiled blocks": _compiled_blocks,
    # nn.DataParallel, named ``module.`` as DDP is (DDP itself: tests/test_distributed.py)
    "DataParallel": nn.DataParallel,
    # torch.distributed's activation checkpointing as FSDP users apply it
    "checkpoint_wrapper": _checkpointed_blocks,
    "DataParallel of compiled blocks": lambda m: nn.DataParallel(_compiled_blocks(m)),
}


@pytest.mark.parametrize("wrapping", list(WRAPPINGS))
def test_wrapped_layers_keep_their_names(wrapping: str) -> None:
    """A wrapper whose forward is its module's is not a layer: torchtitan's regional compilation named layers
    ``2._orig_mod.0`` (126 such names in a Llama's report) where the same model compiled in place names them
    ``2.0``, DDP named every layer ``module.*`` so that a DDP run compared with a single process layer by
    nothing. The layers keep their own names, with the same rows as the bare model's, and the memory table's
    modules too."""

    def run(model: nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
        with precprof.Profiler(model, sample_every=1) as prof:
            for x in _batches(2):
                model(x).square().mean().backward()
                prof.step()
        return prof.tables()["layers"], prof.tables()["memory"]

    eager_layers, eager_memory = run(_blocks())
    wrapped = WRAPPINGS[wrapping](_blocks())
    assert {"_orig_mod", "module", "_checkpoint_wrapped_module"} & {
        part for name, _ in wrapped.named_modules() for part in name.split(".")
    }
    layers, memory = run(wrapped)
    assert set(layers[T.MODULE]) == set(eager_layers[T.MODULE])
    assert set(memory[T.MODULE]) <= set(eager_memory[T.MODULE]) | {""}
    key = [T.STEP, T.MODULE, T.TENSOR, T.PARAM]
    cols = [
        *key,
        T.NUMEL,
        T.ZEROS,
        T.ABSMAX,
        *[c for c in layers.columns if c.startswith(("underflow_", "overflow_"))],
    ]
    pd_testing.assert_frame_equal(
        layers[cols].sort_values(key).reset_index(drop=True),
        eager_layers[cols].sort_values(key).reset_index(drop=True),
        check_dtype=False,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_recompile_with_autocast_and_gradient_accumulation(dtype: torch.dtype) -> None:
    """bf16 or fp16 autocast, four micro-batches per step, memory tracking on (its saved-tensor hooks used to
    recompile per micro-batch): Dynamo's counters with precprof equal those without it, and no recompile."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def run(profile: bool) -> tuple[int, int, int]:
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        compiled = torch.compile(model, backend="eager")
        prof = precprof.Profiler(model, optimizer=opt, sample_every=3) if profile else None
        if prof is not None:
            prof.attach()
        for i, x in enumerate(_batches(24)):
            with torch.autocast("cpu", dtype=dtype):
                loss = compiled(x).float().square().mean() / 4
            loss.backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad(set_to_none=True)
                if prof is not None:
                    prof.step(loss=loss.detach())
        if prof is not None:
            prof.detach()
            assert len(set(prof.tables()["layers"][T.STEP])) == 2  # steps 0 and 3 of 6
        recompiles = int(counters["recompiles"].get("total", 0)) if "recompiles" in counters else 0
        return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values())), recompiles

    plain, profiled = run(False), run(True)
    assert profiled == plain and plain[2] == 0


def test_the_rows_that_name_a_step_are_made_once_and_follow_what_changes() -> None:
    """``CapturePlan.order`` and the weight-update columns' names are made once while nothing changes (the
    steps' rows share them) and made anew when the forward order or a weight's dtype changes: a step whose
    forward skips a module records it as not called, a weight cast to bf16 is named bf16 from then on."""

    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.skip = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) if self.skip else self.b(self.a(x))

    model = Skip()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        orders = []
        for step in range(4):
            model.skip = step == 2
            if step == 3:
                model.b.weight.data = model.b.weight.data.bfloat16()
            x = torch.randn(2, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == 3):
                model(x).float().sum().backward()
            opt.step()
            opt.zero_grad()
            orders.append(prof._plan.order())
            prof.step()
    assert orders[1] is orders[0] and orders[2] is not orders[1]
    assert orders[2]["b"] == -1 and orders[1]["b"] == orders[1]["a"] + 1 == orders[3]["b"]
    layers = prof.tables()["layers"]
    b = layers[layers[T.TENSOR] == T.ACTIVATION].set_index([T.STEP, T.MODULE])
    assert (2, "b") not in b.index and b.loc[(1, "b"), T.ORDER] == orders[1]["b"]
    wu = layers[(layers[T.TENSOR] == T.WEIGHT_UPDATE) & (layers[T.MODULE] == "b")].set_index(
        [T.STEP, T.PARAM]
    )
    assert wu.loc[(2, "weight"), T.DTYPE] == "float32" and wu.loc[(3, "weight"), T.DTYPE] == "bfloat16"
    assert wu.loc[(3, "bias"), T.DTYPE] == "float32"
    assert wu.loc[(2, "weight"), T.ORDER] == -1 and wu.loc[(1, "weight"), T.ORDER] == orders[1]["b"]
