"""The Profiler: what it records, that it records it exactly, and that it never changes training."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.capture.grad_reads import UNSCALED_UNREAD
from precprof.capture.records import sample_stride
from precprof.report import environment
from precprof.stats import kernel as cpu_kernel
from precprof.stats import triton_engine


def _hooks_left(model: nn.Module) -> list[str]:
    left = []
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(m, attr):
                left.append(f"{name}.{attr}")
    for name, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            left.append(f"{name}._post_accumulate_grad_hooks")
    return left


class Scale(nn.Module):
    """out = x * w: the gradient that reaches x is known exactly."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _hand_values() -> torch.Tensor:
    """Gradient values on and around fp16's underflow boundary once scaled by 2^10."""
    k = 10
    vals = [
        2.0**-40,
        2.0**-35,  # *2^10 = 2^-25: a tie, flushes to 0
        2.0**-35 * (1 + 2**-20),  # just above the tie: rounds up to 2^-24
        2.0**-34,  # *2^10 = 2^-24: fp16's smallest subnormal
        2.0**-30,
        2.0**-20,
        0.5,
        3.0,
        0.0,
        -(2.0**-36),
        -(2.0**-35),
        2.0**5 * 1.5,  # *2^10 = 49152: fine in fp16
        2.0**6,  # *2^10 = 65536: overflows fp16
    ]
    del k
    return torch.tensor(vals, dtype=torch.float32)


def test_gradient_is_stored_unscaled_and_counted_at_the_scale() -> None:
    """loss = (out * g).sum() makes d loss / d out = g; under a static scale 2^k the hook sees g * 2^k."""
    g = _hand_values()
    k = 10
    model = nn.Sequential(Scale(len(g)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**k, growth_interval=10**9)
    x = torch.randn(len(g))
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1) as prof:
        out = model(x)
        loss = (out * g).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        prof.step(loss=loss)
    t = prof.tables()
    layers = t["layers"]
    row = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD)].iloc[0]
    assert row[T.SCALE] == 2.0**k
    raw = g * 2.0**k
    fin = torch.isfinite(raw)
    expected_uf = int(((raw != 0) & (raw.to(torch.float16) == 0)).sum())
    expected_of = int((fin & torch.isinf(raw.to(torch.float16))).sum())
    assert row[T.underflow_col("fp16")] == expected_uf == 4  # 2^-40, 2^-35 (a tie), -2^-36, -2^-35
    assert row[T.overflow_col("fp16")] == expected_of == 1
    assert row[T.ZEROS] == 1
    assert row[T.ABSMAX] == 2.0**6
    assert row[T.ABSMIN] == 2.0**-40
    # unscaled histogram equals frexp of g itself
    nz = g[g != 0]
    _, e = torch.frexp(nz)
    ref = pd.Series((e - 1).tolist()).value_counts().sort_index()
    h = t["histograms"]
    h = h[(h[T.TENSOR] == T.ACTIVATION_GRAD)].set_index(T.EXPONENT)[T.COUNT].sort_index()
    assert h.to_dict() == ref.to_dict()
    # the step row knows the scale; nothing overflowed in the scaled loss gradient's path to the weight?
    steps = t["steps"]
    assert steps[T.LOSS_SCALE].tolist() == [2.0**k]


def test_skipped_step_is_recorded_and_scale_halves() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(3, 4)
    inject = [False]

    def poison(g: torch.Tensor) -> torch.Tensor:
        # a leaf tensor hook runs before accumulation, so the accumulated gradient carries the inf
        if inject[0]:
            g = g.clone()
            g[0, 0] = math.inf
        return g

    model[0].weight.register_hook(poison)
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1) as prof:
        for i in range(3):
            inject[0] = i == 1
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            before = model[0].weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            if i == 1:
                assert torch.equal(before, model[0].weight.detach())
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    steps = prof.tables()["steps"]
    assert steps[T.SKIPPED].tolist() == [False, True, False]
    assert steps[T.LOSS_SCALE].tolist() == [2.0**8, 2.0**8, 2.0**7]
    layers = prof.tables()["layers"]
    wg = layers[(layers[T.TENSOR] == T.WEIGHT_GRAD) & (layers[T.STEP] == 1) & (layers[T.PARAM] == "weight")]
    assert wg[T.INF].tolist() == [1]
    # the optimizer did not step on the skipped step: no weight-update row for it
    wu = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    assert sorted(set(wu[T.STEP])) == [0, 2]


def test_inplace_relu_and_module_used_twice() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.lin(self.act(self.lin(x))))

    model = Twice()
    x = torch.randn(5, 8)
    with precprof.Profiler(model, sample_every=1) as prof:
        out = model(x)
        out.sum().backward()
        prof.step()
    layers = prof.tables()["layers"].set_index([T.MODULE, T.TENSOR, T.PARAM])
    assert layers.loc[("lin", T.ACTIVATION, ""), T.CALLS] == 2
    assert layers.loc[("lin", T.ACTIVATION, ""), T.NUMEL] == 80
    assert layers.loc[("lin", T.ACTIVATION_GRAD, ""), T.NUMEL] == 80
    assert layers.loc[("act", T.ACTIVATION, ""), T.NUMEL] == 80
    # independent computation of the two activation gradients of lin
    lin.zero_grad()
    h1 = lin(x)
    h1.retain_grad()
    a1 = torch.relu(h1)
    h2 = lin(a1)
    h2.retain_grad()
    torch.relu(h2).sum().backward()
    both = torch.cat([h1.grad.reshape(-1), h2.grad.reshape(-1)])
    assert layers.loc[("lin", T.ACTIVATION_GRAD, ""), T.ZEROS] == int((both == 0).sum())
    assert layers.loc[("lin", T.ACTIVATION_GRAD, ""), T.ABSMAX] == float(both.abs().max())
    assert _hooks_left(model) == []


def test_hooks_removed_after_exception_mid_forward() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            raise RuntimeError("user code failed")
            return self.b(y)  # pragma: no cover

    model = Boom()
    scaler = torch.amp.GradScaler("cpu")
    prof = precprof.Profiler(model, scaler=scaler, sample_every=1)
    with pytest.raises(RuntimeError, match="user code failed"), prof:
        model(torch.randn(2, 3))
    assert _hooks_left(model) == []
    assert "update" not in vars(scaler)  # the scaler's method is restored
    status, reason = prof.status
    assert status == T.STATUS_INCOMPLETE and "user code failed" in (reason or "")
    # what was recorded before the crash is kept: a's input (the model's) and output, and every weight (read at the
    # step's first forward)
    layers = prof.tables()["layers"]
    assert set(layers[layers[T.TENSOR] == T.ACTIVATION][T.MODULE]) == {"a:input", "a"}
    assert set(layers[T.MODULE]) == {"a:input", "a", "b"} and set(
        layers[layers[T.MODULE] == "b"][T.TENSOR]
    ) == {T.WEIGHT}
    # detach/attach again works and detach is idempotent
    prof.attach()
    prof.detach()
    prof.detach()
    assert _hooks_left(model) == []


def test_no_grad_eval_does_not_pollute_training_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(7, 4)
    with precprof.Profiler(model, sample_every=1) as prof:
        loss = model(x).sum()
        with torch.no_grad():
            model(torch.randn(100, 4))  # evaluation in between
        loss.backward()
        prof.step(loss=loss)
    layers = prof.tables()["layers"]
    act = layers[(layers[T.TENSOR] == T.ACTIVATION) & (layers[T.MODULE] == "0")]
    assert act[T.NUMEL].tolist() == [7 * 6]
    assert act[T.CALLS].tolist() == [1]


@pytest.mark.parametrize("where", ["before_step", "after_step", "after_the_last_step"])
def test_an_evaluation_in_eval_mode_with_grad_on_is_not_the_steps_training(where: str) -> None:
    """``model.eval()`` without ``no_grad`` (a validation loss in the loop): its forward was read as the step's
    training, every activation row mixed with the evaluation batch (calls 2, its absmax), its saved tensors
    the step's activations; after the last ``prof.step()`` it made a phantom step marked ``cut_off``. A forward
    in eval mode after the step's forward in train mode is an evaluation: not read, and counted; a step that ran
    only such a forward and no backward when the Profiler closed is no step. One before the step's training
    forward (``after_step``: the next step's start) was read as that step's training, merged with it: it is
    forgotten when the model runs in train mode before any backward, and counted."""

    def run(evaluate: bool) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        xv = torch.randn(64, 16, generator=g) * 100

        def validation() -> None:
            model.eval()
            model(xv).square().mean()
            model.train()

        with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
            for _ in range(3):
                loss = model(torch.randn(8, 16, generator=g)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                if evaluate and where == "before_step":
                    validation()
                prof.step(loss=loss.detach())
                if evaluate and where == "after_step":
                    validation()
            if evaluate and where == "after_the_last_step":
                validation()
        tables = prof.tables()
        return tables["layers"], tables["memory"], prof.summary()

    layers, memory, summary = run(True)
    plain_layers, plain_memory, _ = run(False)
    pd.testing.assert_frame_equal(layers, plain_layers)
    cols = [T.STEP, T.COMPONENT, T.MODULE, T.DTYPE, T.BYTES]
    keep = memory[T.COMPONENT] != T.PROFILER_BUFFERS
    plain_keep = plain_memory[T.COMPONENT] != T.PROFILER_BUFFERS
    pd.testing.assert_frame_equal(
        memory.loc[keep, cols].reset_index(drop=True),
        plain_memory.loc[plain_keep, cols].reset_index(drop=True),
    )
    # each of the 4 modules' forward in each validation of a sampled step (after_step: those at the start of
    # steps 1 and 2); the one after the last step is no step
    assert summary["eval_forwards_ignored"] == {"before_step": 4 * 3, "after_step": 4 * 2}.get(where, 0)


@pytest.mark.parametrize("switch_at", [0, 2])
def test_a_loop_that_trains_in_eval_mode_keeps_every_row(switch_at: int) -> None:
    """Fine-tuning with BatchNorm and dropout frozen: ``model.eval()`` after ``attach()`` (or from step 2 on)
    and the training forward, backward and step in eval mode. Decided by the mode at the step's start, its
    forwards were taken for evaluations and its activation rows and saved activations lost (the weights'
    kept). A step's first forward decides: every row is there, as in the same loop in train mode."""

    def run(eval_mode: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, memory_every=1) as prof:
            for step in range(4):
                if eval_mode and step == switch_at:
                    model.eval()
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        assert prof.summary()["eval_forwards_ignored"] == 0
        memory = prof.tables()["memory"]
        return prof.tables()["layers"], memory[memory[T.COMPONENT] == T.ACTIVATIONS].reset_index(drop=True)

    (layers, acts), (want_layers, want_acts) = run(True), run(False)
    pd.testing.assert_frame_equal(layers, want_layers)
    assert len(acts) and acts.equals(want_acts)  # the saved activations measured as in train mode


def test_a_micro_batch_trained_in_eval_mode_before_one_in_train_mode_is_kept() -> None:
    """Two micro-batches a step, the first forward and backward in eval mode, the second in train mode: the
    first is training (a backward ran through it before the model ran in train mode), not an evaluation before
    the step's training, and is read with the second, as when both run in train mode (the model has no layer
    that eval mode changes)."""

    def run(first_in_eval: bool) -> tuple[pd.DataFrame, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
            for _ in range(3):
                for micro in range(2):
                    model.train(not (first_in_eval and micro == 0))
                    model(torch.randn(4, 8, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        return prof.tables()["layers"], prof.summary()["eval_forwards_ignored"]

    (layers, ignored), (want, _) = run(True), run(False)
    assert ignored == 0
    assert set(layers.loc[layers[T.TENSOR] == T.ACTIVATION, T.CALLS]) == {2}  # read on both micro-batches
    pd.testing.assert_frame_equal(layers, want)


class _FrozenBackbone(nn.Module):
    """A frozen feature extractor and a trained head (a linear probe; a diffusion model's VAE and text encoder):
    the backbone under ``no_grad`` inside the forward, or (``no_grad=False``) frozen by ``requires_grad`` alone."""

    def __init__(self, no_grad: bool) -> None:
        super().__init__()
        self.no_grad = no_grad
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 2)
        with torch.no_grad():
            self.backbone[2].weight.mul_(30000.0)  # outputs near 1e5: past fp16's 65504
        self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad() if self.no_grad else contextlib.nullcontext():
            f = self.backbone(x)
        return self.head(f * 1e-4)


class _FrozenCheckpointed(_FrozenBackbone):
    """The frozen backbone under ``no_grad``, its call wrapped in a reentrant checkpoint (which, without grad, is
    never run again)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        with torch.no_grad():
            f = checkpoint(self.backbone, x, use_reentrant=True)
        return self.head(f * 1e-4)


@pytest.mark.filterwarnings(
    "ignore:None of the inputs have requires_grad=True"
)  # (the frozen input's, as meant)
def test_a_frozen_part_run_without_grad_inside_the_forward_is_the_steps_forward() -> None:
    """``with torch.no_grad(): f = self.backbone(x)`` inside the model's forward: the backbone's activations are
    the step's (an fp16 run would overflow them), and were never read (no row at all, "layers profiled 1"); now
    recorded as when the backbone is frozen by ``requires_grad`` alone. An evaluation under ``no_grad`` outside
    the forward is still not read."""

    def run(no_grad: bool | str) -> pd.DataFrame:
        torch.manual_seed(0)
        model = _FrozenCheckpointed(True) if no_grad == "checkpointed" else _FrozenBackbone(bool(no_grad))
        opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
            for _ in range(2):
                model(torch.randn(64, 16, generator=g) * 4).square().mean().backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    model(torch.randn(100, 16, generator=g))  # an evaluation: not read
                prof.step()
        return prof.tables()["layers"]

    layers = run(True)
    pd.testing.assert_frame_equal(layers, run(False))
    # a reentrant checkpoint around it: its only pass, which no backward repeats, was taken for a first pass
    pd.testing.assert_frame_equal(layers, run("checkpointed"))
    out = layers[(layers[T.MODULE] == "backbone.2") & (layers[T.TENSOR] == T.ACTIVATION)]
    assert out[T.NUMEL].tolist() == [64 * 32] * 2 and (out[T.CALLS] == 1).all()
    assert (out[T.overflow_col("fp16")] > 0).all()


def test_only_sampled_steps_record_layers_and_all_steps_record_losses() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 4)
    with precprof.Profiler(model, optimizer=opt, sample_every=3) as prof:
        losses = []
        for _ in range(7):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
            losses.append(loss.item())
    t = prof.tables()
    assert sorted(set(t["layers"][T.STEP])) == [0, 3, 6]
    assert t["steps"][T.STEP].tolist() == list(range(7))
    assert t["steps"][T.LOSS].tolist() == losses
    assert t["steps"][T.SAMPLED].tolist() == [True, False, False, True, False, False, True]


def test_module_filter_by_name_and_type() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    # (the model's input, which no captured module made, is recorded as the first layer's own input row)
    for flt, expected in (
        (["0"], {"0:input", "0"}),
        ([nn.ReLU], {"1"}),
        (["*"], {"", "0:input", "0", "1", "2"}),
    ):
        with precprof.Profiler(model, modules=flt, sample_every=1) as prof:
            model(torch.randn(2, 4)).sum().backward()
            prof.step()
        assert set(prof.tables()["layers"][T.MODULE]) == expected


def test_a_module_filter_that_picks_a_weight_normed_layer_records_its_parameters() -> None:
    """``modules=[nn.Linear]`` or the layers' names on a model with ``weight_norm`` / ``spectral_norm`` layers: the
    layers' real parameters live in ``<layer>.parametrizations.weight`` (``original0``/``original1``, or
    ``original``), which no filter for the layer picked, so only the bias rows were left of them, silently. They
    are recorded as a run without a filter records them: under ``<layer>.parametrizations.weight``."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(
        weight_norm(nn.Linear(16, 32)),
        nn.ReLU(),
        spectral_norm(nn.Linear(32, 32)),
        nn.ReLU(),
        nn.Linear(32, 8),
    )
    x = torch.randn(8, 16)
    originals = {
        ("0.parametrizations.weight", "original0"): model[0].parametrizations.weight.original0,
        ("0.parametrizations.weight", "original1"): model[0].parametrizations.weight.original1,
        ("2.parametrizations.weight", "original"): model[2].parametrizations.weight.original,
    }
    for flt in ([nn.Linear], ["0", "2", "4"]):
        model.zero_grad()
        with precprof.Profiler(model, modules=flt, sample_every=1) as prof:
            model(x).square().sum().backward()
            prof.step()
        layers = prof.tables()["layers"].set_index([T.MODULE, T.PARAM, T.TENSOR])
        for (module, param), p in originals.items():
            for kind, t in ((T.WEIGHT, p), (T.WEIGHT_GRAD, p.grad)):
                row = layers.loc[(module, param, kind)]
                assert row[T.NUMEL] == t.numel(), (flt, module, param, kind)
                assert row[T.ABSMAX] == t.abs().max().item(), (flt, module, param, kind)
        # the weight the layer used, computed from them: the parametrization's output
        computed = layers.loc[("0.parametrizations.weight", "", T.ACTIVATION)]
        assert computed[T.ABSMAX] == model[0].weight.abs().max().item()


class _Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = torch.jit.script(nn.Linear(32, 32))
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_a_torchscript_linear_layer_is_a_linear_layer() -> None:
    """``torch.jit.script(nn.Linear(...))`` is typed ``RecursiveScriptModule``: the layer was left out of every
    linear-layer analysis (no input read for the FP8 verdict, "linear layers checked 2" of 3). Its type is the
    class it was scripted from, and its input is read as the other layers' are (``b`` reads ``a``'s output)."""
    torch.manual_seed(0)
    model = _Scripted()
    assert type(model.b).__name__ == "RecursiveScriptModule"
    with precprof.Profiler(model, sample_every=1, memory=False) as prof:
        model(torch.randn(8, 16)).square().mean().backward()
        prof.step()
    layers = prof.tables()["layers"]
    assert set(layers.loc[layers[T.MODULE] == "b", T.MODULE_TYPE]) == {"Linear"}
    assert prof.summary()["gemm_inputs"] == {"a": [], "b": ["a"], "c": ["b"]}


class _ChangedInPlace(nn.Module):
    """GELU's output has one value raised in place before ``down`` reads it, as a hand-written ``h += r`` or a
    ``masked_fill_`` between modules does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.act, self.down = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))
        h[0, 3] += 3e4
        return self.down(h)


def _e4m3_flushed(x: torch.Tensor) -> int:
    """Nonzero values a real e4m3 cast flushes at the power-of-two current scale 2^floor(log2(448 / amax))."""
    s = 2.0 ** math.floor(math.log2(448.0 / float(x.abs().max())))
    return int((((x.double() * s).float().to(torch.float8_e4m3fn) == 0) & (x != 0)).sum())


@pytest.mark.parametrize("blocks", [True, False])
def test_an_output_changed_in_place_is_read_as_the_layer_reads_it(blocks: bool) -> None:
    """down read GELU's output after ``h[0, 3] += 3e4``: it was matched to GELU's row, recorded before the
    change (largest value 2.1, no value flushed in e4m3), where down's GEMM read 3e4 and e4m3 at its scale
    flushes hundreds of its values. The input changed since its maker's hook (its version counter) is down's own
    input row, whose counts are real casts of what down's pre-hook saw; GELU's row stays as GELU made it, block
    formats on or off (off, there was no such row: down was judged without its input)."""
    torch.manual_seed(0)
    model = _ChangedInPlace()
    made: list[torch.Tensor] = []
    read: list[torch.Tensor] = []
    model.act.register_forward_hook(lambda m, a, out: made.append(out.detach().clone()))
    model.down.register_forward_pre_hook(lambda m, a: read.append(a[0].detach().clone()))
    with precprof.Profiler(model, sample_every=1, memory=False, block_formats=blocks) as prof:
        model(torch.randn(64, 32)).square().mean().backward()
        prof.step()
    layers = prof.tables()["layers"].set_index([T.MODULE, T.TENSOR])
    assert prof.summary()["gemm_inputs"]["down"] == []
    e4m3 = T.underflow_cs_col("fp8_e4m3")
    assert layers.loc[("act", T.ACTIVATION), T.ABSMAX] == float(made[0].abs().max()) < 3
    assert layers.loc[("act", T.ACTIVATION), e4m3] == _e4m3_flushed(made[0]) == 0
    own = (T.input_module("down"), T.ACTIVATION)
    assert layers.loc[own, T.ABSMAX] == float(read[0].abs().max()) > 2e4
    assert layers.loc[own, e4m3] == _e4m3_flushed(read[0]) > 100
    assert layers.loc[own, T.NUMEL] == read[0].numel()


def test_weight_update_lost_in_bf16_counts_real_casts() -> None:
    """Updates far below bf16's resolution vanish when added to a bf16 weight; large ones do not."""
    p = nn.Parameter(torch.ones(8))
    model = nn.Module()
    model.p = p  # type: ignore[assignment]

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    m = Holder()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    # gradient per element: 2^-10 (lost in bf16, kept in fp16), 2^-12 (a tie in fp16: lost in both), 2^-4 (kept in both), 0 (no update),
    # 2^-30 (lost even in the fp32 master weight)
    g = torch.tensor([2.0**-10, 2.0**-10, 2.0**-4, 2.0**-4, 0.0, 0.0, 2.0**-30, 2.0**-12])
    with precprof.Profiler(m, optimizer=opt, sample_every=1) as prof:
        (m(torch.ones(8)) * g).sum().backward()
        opt.step()
        prof.step()
    wu = prof.tables()["layers"]
    wu = wu[wu[T.TENSOR] == T.WEIGHT_UPDATE].iloc[0]
    w0 = torch.ones(8)
    delta = (w0 - g) - w0  # the update fp32 master weights actually receive (1 - 2^-30 rounds to 1)
    intended = (g != 0) | (delta != 0)
    stuck = intended & (delta == 0)  # 2^-30: meant to move, lost even in the fp32 weight
    lost_bf16 = int(((delta != 0) & ((w0.bfloat16().float() + delta).bfloat16() == w0.bfloat16())).sum())
    lost_fp16 = int(((delta != 0) & ((w0.half().float() + delta).half() == w0.half())).sum())
    assert wu[T.NUMEL] == 8 and wu[T.ZEROS] == int((~intended).sum()) == 2
    assert wu[T.LOST_UPDATE_BF16] == lost_bf16 + int(stuck.sum()) == 4
    assert wu[T.LOST_UPDATE_FP16] == lost_fp16 + int(stuck.sum()) == 2


def _two_optimizer_updates(given: str) -> tuple[pd.DataFrame, dict[str, object]]:
    """An MLP whose matrices one AdamW steps and whose biases and norm another does (as Muon and AdamW split a
    model), trained 3 steps under bf16 autocast; ``given``: which the Profiler is told of ("matrices",
    "both"), or "one" for a single AdamW over every parameter (two groups: the same update per element).
    Returns the weight-update rows by (module, param) and the capture summary."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64))
    mat = [p for p in m.parameters() if p.ndim == 2]
    rest = [p for p in m.parameters() if p.ndim < 2]
    if given == "one":
        opts = [torch.optim.AdamW([{"params": mat}, {"params": rest}], lr=1e-3)]
    else:
        opts = [torch.optim.AdamW(mat, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]
    told: object = opts if given in ("one", "both") else opts[0]
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    with precprof.Profiler(m, optimizer=told, sample_every=1) as prof:  # type: ignore[arg-type]
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (m(x).float() - y).square().mean()
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
            prof.step(loss=loss.detach())
    layers = prof.tables()["layers"]
    rows = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE].astype({T.MODULE: str, T.PARAM: str})
    cols = [T.STEP, T.MODULE, T.PARAM, T.NUMEL, T.ZEROS, T.LOST_UPDATE_BF16, T.LOST_UPDATE_FP16]
    return rows[cols].sort_values(cols[:3]).reset_index(drop=True), prof.summary()


def test_each_optimizer_samples_the_updates_of_the_parameters_it_steps() -> None:
    """Two optimizers, the Profiler told of the one stepping the matrices: every bias and norm parameter, which
    the other moves outside its hooks, was counted as an intended update that never landed, "lost in bf16":
    "61.9% of weight updates vanish with bf16 master weights", in an fp32-weight run. Told of one, only its
    parameters are sampled; told of both, each parameter is read around its own optimizer's step, and the
    counts are those of one AdamW over every parameter."""
    one, _ = _two_optimizer_updates("one")
    both, summary = _two_optimizer_updates("both")
    matrices, _ = _two_optimizer_updates("matrices")
    assert set(one[T.PARAM]) == {"weight", "bias"} and len(one) == 3 * 6
    pd.testing.assert_frame_equal(both, one)
    assert set(matrices[T.PARAM]) == {"weight"} and set(matrices[T.MODULE]) == {"0", "3"}
    pd.testing.assert_frame_equal(
        matrices, one[one[T.MODULE].isin(["0", "3"]) & (one[T.PARAM] == "weight")].reset_index(drop=True)
    )
    assert summary["optimizer"] == {"class": "AdamW", "eps": 1e-8, "beta2": 0.999}


@pytest.mark.parametrize(
    ("model", "optimizer", "said"),
    [
        ("gpt2", None, "Profiler(model): expected a torch.nn.Module, got str 'gpt2'"),
        (
            None,
            "adam",
            "Profiler(optimizer=...): expected a torch.optim.Optimizer or a list of them, got str 'adam'",
        ),
        (None, ["sgd", "x"], "expected a torch.optim.Optimizer or a list of them, got str 'x'"),
    ],
)
def test_a_profiler_of_something_else_is_one_line_naming_it(model: Any, optimizer: Any, said: str) -> None:
    """A string where a module or an optimizer goes was an AttributeError from deep in attach(), with a
    traceback through precprof's hooks."""
    real = nn.Linear(4, 4)
    if optimizer is not None and isinstance(optimizer, list):
        optimizer = [torch.optim.SGD(real.parameters(), lr=0.1), optimizer[1]]
    with pytest.raises(TypeError) as e:
        precprof.Profiler(real if model is None else model, optimizer=optimizer)
    assert said in str(e.value) and "\n" not in str(e.value)


def _tiny_run(prof: precprof.Profiler, model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    with prof:
        for step in range(steps):
            torch.manual_seed(step)
            loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())


def _mlp4() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("spec", ["1*", nn.GELU])
def test_one_module_pattern_or_type_alone_is_that_one_not_its_characters(spec: Any) -> None:
    """``modules="1*"`` was iterated as the patterns "1" and "*", and "*" selected every module, silently."""
    model, opt = _mlp4()
    prof = precprof.Profiler(model, opt, sample_every=1, memory=False, modules=spec)
    _tiny_run(prof, model, opt)
    assert sorted(set(prof.tables()["layers"][T.MODULE])) == ["1"]


@pytest.mark.parametrize(
    ("kw", "error", "said"),
    [
        ({"modules": [3]}, TypeError, "Profiler(modules=[3]): 3 is neither a name pattern"),
        ({"modules": []}, ValueError, "Profiler(modules=[]): selects no module; leave it out (None)"),
        ({"sample_every": 1.5}, TypeError, "Profiler(sample_every=1.5): expected a whole number >= 0"),
        ({"sample_every": "2"}, TypeError, "Profiler(sample_every='2'): expected a whole number >= 0"),
        ({"sample_every": True}, TypeError, "Profiler(sample_every=True): expected a whole number >= 0"),
        ({"update_sample": 0}, ValueError, "Profiler(update_sample=0): expected a whole number >= 1"),
        ({"update_sample": 2.5}, TypeError, "Profiler(update_sample=2.5): expected a whole number >= 1"),
        ({"update_sample": -5}, ValueError, "Profiler(update_sample=-5): expected a whole number >= 1"),
        ({"first_step": -1}, ValueError, "Profiler(first_step=-1): expected a whole number >= 0"),
        ({"reducer": "bogus"}, TypeError, "Profiler(reducer='bogus'): expected 'auto' (ranks combined"),
        ({"scaler": "dynamic"}, TypeError, "Profiler(scaler='dynamic'): expected a torch.amp.GradScaler"),
        (
            {"overhead_budget": "3%"},
            TypeError,
            "Profiler(overhead_budget='3%'): expected a finite number > 0",
        ),
        ({"chunk": -1}, ValueError, "Profiler(chunk=-1): expected a whole number >= 0"),
        ({"memory": "no"}, TypeError, "Profiler(memory='no'): expected True or False"),
        ({"loss_scale": "1024"}, TypeError, "Profiler(loss_scale='1024'): expected a finite number > 0"),
        # a whole number is what is counted: a fraction says how to make one
        ({"sample_every": 2.5}, TypeError, "Profiler(sample_every=2.5): expected a whole number >= 0 ("),
        (
            {"memory_every": np.float64(1.5)},
            TypeError,
            "Profiler(memory_every=np.float64(1.5)): expected a whole number >= 1 (1: every sampled step) or None "
            "(every 4th, spacing out to every 32nd while they agree), got "
            "float64; round it: int(...)",
        ),
        # a GradScaler's state_dict (a dict: it has an update() too) is no scaler
        (
            {"scaler": {"scale": 1024.0}},
            TypeError,
            "Profiler(scaler={'scale': 1024.0}): expected a torch.amp",
        ),
        # a share of the run's time: 3 meant 3% (it sampled 36 of 40 steps)
        (
            {"overhead_budget": 3},
            ValueError,
            "Profiler(overhead_budget=3): expected a finite number > 0 and <= 1",
        ),
    ],
)
def test_a_profiler_argument_it_cannot_take_is_one_line_at_construction(
    kw: dict[str, Any], error: type[Exception], said: str, tmp_path: Path
) -> None:
    """Each was accepted (``sample_every=1.5`` sampled steps 0 and 3, ``update_sample=-5``, ``first_step=-1``
    numbered steps from -1, ``scaler="dynamic"`` ignored) or failed deep in the first sampled step
    (``update_sample=0``: a ZeroDivisionError in records.py; ``reducer="bogus"`` an AttributeError that left
    ``out`` "running"). Refused where it is given, before anything is claimed or hooked."""
    model, opt = _mlp4()
    with pytest.raises(error) as e:
        precprof.Profiler(model, opt, out=tmp_path / "run", **kw)
    assert str(e.value).startswith(said) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists() and not _hooks_left(model)


def test_the_arguments_a_profiler_takes_as_documented_are_taken() -> None:
    """What the checks let through: numpy integers, 0 and 1 for a flag, None where it means the default."""
    model, opt = _mlp4()
    prof = precprof.Profiler(
        model,
        opt,
        sample_every=np.int64(1),
        update_sample=np.int64(64),
        memory=0,
        chunk=0,
        modules=("0", nn.Linear),
        reducer=None,
        block_groups=None,
        first_step=3,
    )
    _tiny_run(prof, model, opt)
    steps = prof.tables()["steps"]
    assert steps[T.STEP].tolist() == [3, 4] and steps[T.SAMPLED].all()
    assert sorted(set(prof.tables()["layers"][T.MODULE])) == ["0", "0:input", "2", "2:input", "3"]


def test_numbers_from_configs_are_taken_as_the_plain_values_they_stand_for() -> None:
    """Values a config file, numpy or torch gives (tester t6): ``sample_every=2.0`` (``max_steps / 100``),
    ``np.float64(2.0)`` and ``torch.tensor(2)`` sampled every second step before the checks came and were then
    refused; ``memory=np.False_`` was refused as no bool. Taken as the plain value, and kept as it: the checks
    passed ``memory_every=np.int64(2)``, which the memory schedule then refused at attach, and ``memory_peak=0``,
    which the memory tracker took for "not False" (on CUDA it replayed the allocator's history)."""
    for every in (2.0, np.float64(2.0), torch.tensor(2)):
        model, opt = _mlp4()
        prof = precprof.Profiler(model, opt, sample_every=every, memory=np.False_, weight_updates=np.True_)
        _tiny_run(prof, model, opt, steps=4)
        assert prof.tables()["steps"][T.SAMPLED].tolist() == [True, False, True, False], every
        assert prof.sample_every == 2 and type(prof.sample_every) is int
        assert prof.memory_enabled is False and prof.weight_updates is True
    model, opt = _mlp4()
    prof = precprof.Profiler(
        model,
        opt,
        sample_every=1,
        memory_every=np.int64(2),
        memory_peak=0,
        overhead_budget=torch.tensor(0.05),
        loss_scale=np.float32(1.0),
        first_step=torch.tensor(10),
        compile_beside=1,
    )
    assert prof.memory_every == 2 and type(prof.memory_every) is int and prof.memory_peak is False
    assert prof.overhead_budget == pytest.approx(0.05) and prof.loss_scale == 1.0
    assert prof._compile_beside is True
    _tiny_run(prof, model, opt)
    assert prof.tables()["steps"][T.STEP].tolist() == [10, 11]
    assert type(prof.current_step) is int


@pytest.mark.parametrize("status", ["finished", "COMPLETE", 5])
def test_a_save_status_that_is_no_runs_status_is_refused_before_anything_is_written(
    status: Any, tmp_path: Path
) -> None:
    """``prof.save(DIR, status="finished")`` (or "COMPLETE", or 5) wrote summary.json with that status, which
    ``precprof report`` and ``compare`` read as no status they know. The documented ones are taken."""
    model, opt = _mlp4()
    prof = precprof.Profiler(model, opt, sample_every=1, memory=False)
    _tiny_run(prof, model, opt)
    with pytest.raises(ValueError) as e:
        prof.save(tmp_path / "bad", status=status)
    assert str(e.value) == (
        f"save(status={status!r}): expected 'complete' or 'incomplete' (with reason='why'), or None: the run's own"
    )
    assert not (tmp_path / "bad").exists()
    with pytest.raises(TypeError, match=r"save\(reason=3\): expected a str"):
        prof.save(tmp_path / "bad", status=T.STATUS_INCOMPLETE, reason=3)
    prof.save(tmp_path / "run", status=T.STATUS_INCOMPLETE, reason="stopped by hand")
    summary = T.read_summary(tmp_path / "run")
    assert (summary[T.SUMMARY_STATUS], summary[T.SUMMARY_INCOMPLETE_REASON]) == (
        "incomplete",
        "stopped by hand",
    )


def test_a_parameter_frozen_at_attach_and_unfrozen_later_is_read_once_it_trains() -> None:
    """Gradual unfreezing: the first layer frozen when the Profiler attaches, unfrozen at step 2. Its gradient
    and its updates were never read (the rows were planned at attach for the parameters requiring grad then),
    and nothing said so. From step 2 on they are, as ``p.grad`` has them; before, no gradient row, and the
    update sample says every sampled element had no update (SGD moved none)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = m[0].weight
    w.requires_grad_(False)
    grads: dict[int, torch.Tensor] = {}
    with precprof.Profiler(m, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(4):
            if step == 2:
                w.requires_grad_(True)
            nn.functional.cross_entropy(m(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            if w.grad is not None:
                grads[step] = w.grad.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    layers = prof.tables()["layers"]
    rows = layers[(layers[T.MODULE] == "0") & (layers[T.PARAM] == "weight")].set_index([T.TENSOR, T.STEP])
    assert sorted(grads) == [2, 3]
    assert sorted(rows.loc[T.WEIGHT_GRAD].index) == [2, 3]
    for step, g in grads.items():
        got = rows.loc[(T.WEIGHT_GRAD, step)]
        assert got[T.NUMEL] == 512 and got[T.ZEROS] == int((g == 0).sum())
        assert got[T.ABSMAX] == float(g.abs().max())
        update = rows.loc[
            (T.WEIGHT_UPDATE, step)
        ]  # 171 of 512 elements sampled: every third one (every second read the even columns alone)
        assert update[T.NUMEL] == 171 and update[T.ZEROS] == int((g.flatten()[::3] == 0).sum())
    frozen = rows.loc[T.WEIGHT_UPDATE].loc[[0, 1]]
    assert list(frozen[T.ZEROS]) == list(frozen[T.NUMEL]) == [171, 171]


def test_a_param_group_added_mid_run_has_its_updates_sampled() -> None:
    """``optimizer.add_param_group`` at step 2 (a layer unfrozen by adding its group): the optimizer's groups
    were read once at attach, so its updates were never sampled, without a word. From the step it is added
    on they are: the counts those of the update the loop saw land in the weight, cast by hand."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(m[2].parameters(), lr=0.1)
    w = m[0].weight
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    with precprof.Profiler(m, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": m[0].parameters(), "lr": 0.01})
            nn.functional.cross_entropy(m(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            before = (
                w.detach().flatten()[::3].clone()
            )  # 171 of 512 elements sampled: every third one (every second read the even columns alone)
            assert w.grad is not None
            grad = w.grad.flatten()[::3].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen[step] = (before, w.detach().flatten()[::3].clone(), grad)
            prof.step()
    layers = prof.tables()["layers"]
    updates = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    rows = updates[(updates[T.MODULE] == "0") & (updates[T.PARAM] == "weight")].set_index(T.STEP)
    assert sorted(rows.index) == [2, 3]
    assert len(updates[updates[T.MODULE] == "2"]) == 4 * 2
    for step in (2, 3):
        before, after, grad = seen[step]
        delta = after - before
        intended = (grad != 0) | (delta != 0)
        stuck = intended & (delta == 0)
        held = before.bfloat16()
        lost_bf16 = ((held.float() + delta).bfloat16() == held) & (delta != 0) | stuck
        assert rows.loc[step, T.NUMEL] == 171 and rows.loc[step, T.ZEROS] == int((~intended).sum())
        assert rows.loc[step, T.LOST_UPDATE_BF16] == int(lost_bf16.sum())


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes of an optimizer's state tensors (moments, momentum buffers, step counters), summed by hand."""
    return sum(
        t.nbytes for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    )


def _first_weight_updates(tables: dict[str, Any]) -> Any:
    """The ``weight_update`` rows of the first layer's weight (module "0"), by step."""
    layers = tables["layers"]
    updates = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    return updates[(updates[T.MODULE] == "0") & (updates[T.PARAM] == "weight")].set_index(T.STEP)


def _optimizer_state_bytes(tables: dict[str, Any]) -> Any:
    """The memory table's optimizer-state bytes, by step."""
    memory = tables["memory"]
    return memory[memory[T.COMPONENT] == T.OPTIMIZER_STATES].groupby(T.STEP)[T.BYTES].sum()


@pytest.mark.parametrize("sample_every", [1, 2, 3])
def test_a_new_optimizer_made_mid_run_is_followed_from_its_first_step(sample_every: int) -> None:
    """Adam switched for SGD with momentum at step 2 (the optimizer made again): precprof's hooks stayed on
    Adam's step, so no update of steps 2 and 3 was sampled, the memory table still counted Adam's moments as
    the optimizer states, and the summary named Adam. After ``prof.use_optimizer(sgd)``: SGD's updates are
    sampled (the counts those of the update the loop saw land, cast by hand), its momentum buffers are the
    states, the summary names it and says from which step. ``sample_every=2``: the switch between two sampled
    steps; 1: in a sampled step whose hooks are in place; 3: at the start of a step that is not sampled, which
    SGD steps, dated that step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    opt: torch.optim.Optimizer = adam
    w = m[0].weight
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    states: dict[int, int] = {}
    prof = precprof.Profiler(m, optimizer=adam, sample_every=sample_every, memory_every=1)
    with prof:
        for step in range(4):
            if step == 2:
                opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                prof.use_optimizer(opt)
            nn.functional.cross_entropy(m(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            before = (
                w.detach().flatten()[::3].clone()
            )  # 171 of 512 elements sampled: every third one (every second read the even columns alone)
            assert w.grad is not None
            grad = w.grad.flatten()[::3].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen[step] = (before, w.detach().flatten()[::3].clone(), grad)
            states[step] = _state_bytes(opt)
            prof.step()
    tables = prof.tables()
    rows = _first_weight_updates(tables)
    sampled = list(range(0, 4, sample_every))
    assert sorted(rows.index) == sampled
    for step in sampled:
        before, after, grad = seen[step]
        delta = after - before
        intended = (grad != 0) | (delta != 0)
        held = before.bfloat16()
        lost_bf16 = ((held.float() + delta).bfloat16() == held) & (delta != 0) | (intended & (delta == 0))
        assert rows.loc[step, T.NUMEL] == 171 and rows.loc[step, T.ZEROS] == int((~intended).sum())
        assert rows.loc[step, T.LOST_UPDATE_BF16] == int(lost_bf16.sum())
    held_states = _optimizer_state_bytes(tables)
    assert {s: int(held_states[s]) for s in sampled} == {s: states[s] for s in sampled}
    assert states[0] == 2 * 4 * 676 + 4 * 4 and states[3] == 4 * 676  # Adam's two moments; SGD's momentum
    summary = prof.summary()
    assert summary["optimizer"]["class"] == "SGD"
    assert summary["optimizer_changes"] == [{"step": 2, "from": "Adam", "to": "SGD"}]


@pytest.mark.parametrize("sample_every", [1, 3])
def test_an_optimizer_switched_after_the_old_one_stepped_is_followed_from_the_next_step(
    sample_every: int,
) -> None:
    """``prof.use_optimizer(sgd)`` after Adam's ``step()`` of step 2, before ``prof.step()``: step 2 lost Adam's
    update rows and its moments in the memory table (the hooks moved mid-step, the sampler's counts started
    again), and the change was dated 2, a step Adam made. Now step 2 keeps Adam's updates (cast by hand) and
    states, and the change is dated 3, SGD's first step. ``sample_every=3``: step 2 is not sampled, so no hook
    tells whether Adam stepped in it (an unsampled step has none, by design): the switch takes effect at once
    (it loses nothing, no update of step 2 being sampled), and was dated 2, one step early; its date is known
    at ``prof.step()``, when no parameter changed after the switch (the parameters' version counters)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt: torch.optim.Optimizer = torch.optim.Adam(m.parameters(), lr=1e-3)
    w = m[0].weight
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    states: dict[int, int] = {}
    prof = precprof.Profiler(m, optimizer=opt, sample_every=sample_every, memory_every=1)
    with prof:
        for step in range(5):
            nn.functional.cross_entropy(m(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            before = (
                w.detach().flatten()[::3].clone()
            )  # 171 of 512 elements sampled: every third one (every second read the even columns alone)
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen[step] = (before, w.detach().flatten()[::3].clone())
            states[step] = _state_bytes(opt)
            if step == 2:
                opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                prof.use_optimizer(opt)
            prof.step()
    tables = prof.tables()
    rows = _first_weight_updates(tables)
    sampled = list(range(0, 5, sample_every))
    assert sorted(rows.index) == sampled
    for step in sampled:
        before, after = seen[step]
        delta = after - before
        held = before.bfloat16()
        assert rows.loc[step, T.LOST_UPDATE_BF16] == int(
            (((held.float() + delta).bfloat16() == held) & (delta != 0)).sum()
        )
    held_states = _optimizer_state_bytes(tables)
    assert {s: int(held_states[s]) for s in sampled} == {s: states[s] for s in sampled}
    assert states[2] == 2 * 4 * 676 + 4 * 4 and states[3] == 4 * 676  # Adam's two moments; SGD's momentum
    assert prof.summary()["optimizer_changes"] == [{"step": 3, "from": "Adam", "to": "SGD"}]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("switch", ["before", "after"])
def test_a_switch_on_a_step_that_is_not_sampled_is_dated_by_the_new_optimizers_first_step(
    switch: str, fused: bool
) -> None:
    """``prof.use_optimizer(adam)`` on step 2, not sampled (no hook on the optimizers), before or after SGD's
    ``step()``: dated from the step Adam first stepped, as the loop saw it (after: it was dated 2, a step SGD
    made). A fused Adam moves no version counter of the parameters; its states, made at its first step, tell."""
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    adam = torch.optim.Adam(m.parameters(), lr=1e-3, fused=fused)
    opt: torch.optim.Optimizer = sgd
    stepped: dict[int, str] = {}
    with precprof.Profiler(m, optimizer=sgd, sample_every=4, memory=False) as prof:
        for step in range(4):
            assert prof.sampling == (step == 0)
            if step == 2 and switch == "before":
                opt = adam
                prof.use_optimizer(adam)
            m(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stepped[step] = type(opt).__name__
            if step == 2 and switch == "after":
                opt = adam
                prof.use_optimizer(adam)
            prof.step()
    first = min(s for s, name in stepped.items() if name == "Adam")
    assert first == (2 if switch == "before" else 3)
    assert prof.summary()["optimizer_changes"] == [{"step": first, "from": "SGD", "to": "Adam"}]


@pytest.mark.parametrize("attached", [False, True])
def test_an_optimizer_switched_before_the_old_one_ever_stepped_is_no_change(attached: bool) -> None:
    """``Profiler(m, optimizer=adam)``, then ``prof.use_optimizer(sgd)`` before ``with prof:`` (or inside it,
    before the first step): Adam never stepped, yet the summary said 'optimizer changed from Adam to SGD at
    step 0'. The run's optimizer is simply SGD; its updates are sampled from step 0 (the test checks that
    step 0's update is SGD's: the weight moved by lr times the gradient, exactly)."""
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(m.parameters(), lr=0.5)
    prof = precprof.Profiler(m, optimizer=adam, sample_every=1, memory=False)
    if not attached:
        prof.use_optimizer(sgd)
    with prof:
        if attached:
            prof.use_optimizer(sgd)
        for _ in range(2):
            m(torch.randn(4, 8)).square().mean().backward()
            before = m.weight.detach().clone()
            assert m.weight.grad is not None
            step = 0.5 * m.weight.grad
            sgd.step()
            torch.testing.assert_close(m.weight.detach(), before - step, rtol=0, atol=0)
            sgd.zero_grad(set_to_none=True)
            prof.step()
    layers = prof.tables()["layers"]
    updates = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    assert sorted(set(updates[T.STEP])) == [0, 1]
    summary = prof.summary()
    assert summary["optimizer"]["class"] == "SGD" and summary["optimizer_changes"] == []


@pytest.mark.parametrize("switch", [True, False])
def test_a_parametrization_removed_mid_run_is_followed_from_then_on(switch: bool) -> None:
    """weight_norm taken off mid-run (``remove_parametrizations``, as vocoders do before fine-tuning), and a new
    optimizer made for the layer's new ``weight``: that weight had no row, and the originals the model no longer
    held were read on, their values frozen. The capture follows the model from the step of ``use_optimizer``
    (step 2), or, without it, from the next sampled step (a change at step 1 of ``sample_every=2``: step 2); the
    summary says what changed, the parametrization's modules taken out with it."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(16, 32)), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1 if switch else 2, memory=False)
    change = 2 if switch else 1
    held = [name for name, _ in model.named_modules()]
    weights, grads = {}, {}  # the first layer's weight as each step's forward reads it, and its gradient
    gone = "0.parametrizations.weight.original0, 0.parametrizations.weight.original1"
    with prof, pytest.warns(UserWarning, match=rf"changed before step 2 \(new: 0.weight; gone: {gone}\)"):
        for step in range(4):
            if step == change:
                parametrize.remove_parametrizations(model[0], "weight")
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                if switch:
                    prof.use_optimizer(opt)
            with torch.no_grad():
                weights[step] = model[0].weight.clone()
            model(torch.randn(8, 16)).square().mean().backward()
            grads[step] = model[0].weight.grad.clone() if step >= change else None
            opt.step()
            opt.zero_grad()
            prof.step()
    layers = prof.tables()["layers"]
    later = layers[layers[T.STEP] >= 2]
    assert not later[T.MODULE].str.startswith("0.parametrizations").any()  # the originals: no longer read
    mine = later[(later[T.MODULE] == "0") & (later[T.PARAM] == "weight")].set_index([T.STEP, T.TENSOR])
    sampled = [2, 3] if switch else [2]
    for step in sampled:
        for kind, t in ((T.WEIGHT, weights[step]), (T.WEIGHT_GRAD, grads[step])):
            assert mine.loc[(step, kind), T.ABSMAX] == t.abs().max().item(), (step, kind)
            assert mine.loc[(step, kind), T.NUMEL] == t.numel()
    assert sorted(set(mine.index.get_level_values(T.STEP))) == sampled
    assert set(later.loc[later[T.MODULE] == "0", T.MODULE_TYPE]) == {"Linear"}
    left = [name for name in held if name not in dict(model.named_modules())]
    assert left and all(name.startswith("0.parametrizations") for name in left)
    assert prof.summary()["model_changes"] == [
        {"step": 2, "added": ["0.weight"], "removed": gone.split(", "), "modules": left}
    ]


class _Swapped(nn.Linear):
    """A linear layer of another class, made to replace one and hold its very parameters, as torchao's
    ``convert_to_float8_training`` makes its ``Float8Linear``."""

    @classmethod
    def replacing(cls, old: nn.Linear) -> _Swapped:
        new = cls(old.in_features, old.out_features, device="meta")
        new.weight, new.bias = old.weight, old.bias
        return new


def _see_outputs(
    seen: dict[tuple[int, str], torch.Tensor], modules: dict[str, nn.Module], step: list[int]
) -> None:
    """Each module's output at each step into ``seen``, by the test's own forward hooks."""
    for name, mod in modules.items():
        mod.register_forward_hook(
            lambda m, a, out, name=name: seen.update({(step[0], name): out.detach().clone()})
        )


def test_a_layer_swapped_for_one_holding_its_parameters_is_followed_from_then_on() -> None:
    """The last layer swapped at step 2 for a module of another class holding the same parameters: the plan
    compared parameters alone, so nothing changed for it; its hooks stayed on the old layer, which no longer
    ran, and the layer's outputs and their gradients had no row from then on, without a word. From the next
    sampled step (3) the new module is recorded, its outputs as the test's hooks on it see them, and the summary
    says which module changed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step, seen = [0], {}
    _see_outputs(seen, {"old": model[2]}, step)
    with (
        precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof,
        pytest.warns(UserWarning, match=r"the model's modules changed before step 3 \(2\)"),
    ):
        for step[0] in range(5):
            if step[0] == 2:
                model[2] = _Swapped.replacing(model[2])
                _see_outputs(seen, {"new": model[2]}, step)
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    assert prof.summary()["model_changes"] == [{"step": 3, "added": [], "removed": [], "modules": ["2"]}]
    layers = prof.tables()["layers"]
    acts = layers[(layers[T.MODULE] == "2") & (layers[T.TENSOR] == T.ACTIVATION)].set_index(T.STEP)
    assert sorted(acts.index) == [0, 1, 3, 4]  # (step 2's hooks were on the old layer, armed before the swap)
    for s, name in ((0, "old"), (1, "old"), (3, "new"), (4, "new")):
        assert acts.loc[s, T.ABSMAX] == float(seen[(s, name)].abs().max()), s
    assert list(acts[T.MODULE_TYPE]) == ["Linear", "Linear", "_Swapped", "_Swapped"]
    grads = layers[(layers[T.MODULE] == "2") & (layers[T.TENSOR] == T.ACTIVATION_GRAD)]
    assert sorted(grads[T.STEP]) == [0, 1, 3, 4]


def test_torchaos_float8_conversion_after_attach_is_followed() -> None:
    """``convert_to_float8_training`` after ``attach()``: its Float8Linear modules hold the Linear layers'
    parameters, and were not seen (every linear layer's output rows gone, the headline saying mixed precision
    was not active). From the next sampled step they are recorded under their names, as Float8Linear, their
    outputs as the test's hooks on them see them."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False).attach()
    try:
        float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(emulate=True))
        step, seen = [0], {}
        _see_outputs(seen, {"0": model[0], "2": model[2]}, step)
        with pytest.warns(UserWarning, match=r"modules changed before step 1 \(0, 2\)"):
            for step[0] in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(torch.randn(16, 32))
                out.float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
    finally:
        prof.detach()
    assert prof.summary()["model_changes"] == [{"step": 1, "added": [], "removed": [], "modules": ["0", "2"]}]
    layers = prof.tables()["layers"]
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & (layers[T.STEP] >= 1)].set_index([T.STEP, T.MODULE])
    for s in (1, 2):
        for name in ("0", "2"):
            row = acts.loc[(s, name)]
            assert row[T.MODULE_TYPE] == "Float8Linear"
            assert row[T.ABSMAX] == float(seen[(s, name)].float().abs().max()), (s, name)
            assert row[T.NUMEL] == seen[(s, name)].numel()


class _Distilled(nn.Module):
    """A forward that calls the model itself under ``no_grad`` (a self-distillation target) and returns the loss
    against it (``self_call``), or computes its loss from its own output without it; beside a complex parameter
    no optimizer step can sample."""

    def __init__(self, self_call: bool) -> None:
        super().__init__()
        self.self_call = self_call
        self.body = nn.Linear(8, 8)
        self.c = nn.Parameter(torch.zeros(4, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        h = self.body(x)
        if depth:
            return h
        target = torch.zeros_like(h)
        if self.self_call:
            with torch.no_grad():
                target = self(x, depth=1)
        return nn.functional.mse_loss(h, target + 1)


@pytest.mark.parametrize("self_call", [True, False])
def test_a_replan_keeps_what_the_run_counted_before_it(self_call: bool) -> None:
    """An adapter added at step 6 makes a re-plan at step 7, the first sampled step after it: the parts made again
    restarted what the run had counted. The self-call's module forwards said 2 of 16, the complex parameter's
    unsampled updates 1 of 8, and the loss the forward computes was forgotten once no later step measured memory
    (steps 1 and 5 did). Each is counted by the test's own hooks and loop, over the whole run."""
    torch.manual_seed(0)
    model = _Distilled(self_call)
    inner: list[bool] = []  # module forwards under no_grad: the model's own call and its body's
    for mod in (model, model.body):
        mod.register_forward_hook(lambda mod, args, out: inner.append(not torch.is_grad_enabled()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, change = 8, 6
    with (
        precprof.Profiler(model, optimizer=opt, sample_every=1) as prof,
        pytest.warns(UserWarning, match="changed before step 7"),
    ):
        for step in range(steps):
            if step == change:
                model.adapter = nn.Linear(2, 2)
            loss = model(torch.randn(4, 8))
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss)
    summary = prof.summary()
    assert [c["step"] for c in summary["model_changes"]] == [change + 1]
    assert summary["memory_steps"]["last_measured"] < change + 1  # no step measured memory after the re-plan
    assert summary["self_call_forwards_unread"] == sum(inner) == (2 * steps if self_call else 0)
    skipped = [t for t in summary["skipped_tensors"] if t["tensor"] == T.WEIGHT_UPDATE]
    assert [(t["param"], t["count"]) for t in skipped] == [("c", steps)]
    facts = prof.model_facts()
    assert facts is not None and facts["loss_in_forward"] is True


def test_the_forward_after_the_models_call_of_itself_is_measured() -> None:
    """The model's call of itself under no_grad (a self-distillation target) ended the memory tracker's recording
    of the outer forward at the inner call's end: the loss computed after it, and the tensors it saved, were not
    in the activations (2 KiB of 6), and the loss in the forward was not seen. The activations of a sampled step
    are what the test's own saved-tensor hooks see the same forward save (parameters left out)."""
    torch.manual_seed(0)
    model = _Distilled(self_call=True)
    x = torch.randn(64, 8)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(2):
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss)
    memory = prof.tables()["memory"]
    acts = memory[memory[T.COMPONENT] == "activations"].groupby(T.STEP)[T.BYTES].sum()
    assert acts.tolist() == [sum(saved.values())] * 2 == [6 * 1024] * 2
    facts = prof.model_facts()
    assert facts is not None and facts["loss_in_forward"] is True


def test_a_replan_at_use_optimizer_counts_its_step_once() -> None:
    """weight_norm removed before step 4's forward and the new optimizer given with ``use_optimizer``: the step was
    armed twice, so the memory cadence (every 2nd sampled step after the first two) counted it twice and measured
    steps 4, 6, 8 where it measures 5, 7, 9, and the complex parameter's unread weight was counted once more for
    the read ``remove_parametrizations`` made (11 of 10 steps). The cadence is the schedule's, the skips the
    test's own count of sampled steps."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2))
    model.register_parameter("c", nn.Parameter(torch.zeros(4, dtype=torch.cfloat)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 10
    with (
        precprof.Profiler(model, optimizer=opt, sample_every=1, memory_every=2) as prof,
        pytest.warns(UserWarning, match="changed before step 4"),
    ):
        for step in range(steps):
            if step == 4:
                parametrize.remove_parametrizations(model[0], "weight")
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                prof.use_optimizer(opt)
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    summary = prof.summary()
    assert summary["memory_steps"]["measured_steps"] == 6
    assert sorted(set(prof.tables()["memory"][T.STEP])) == [0, 1, 3, 5, 7, 9]
    counts = {(t["tensor"], t["param"]): t["count"] for t in summary["skipped_tensors"]}
    assert counts[(T.WEIGHT, "c")] == steps


def test_an_optimizer_given_after_the_profiler_was_made_without_one_has_its_updates_sampled() -> None:
    """A Profiler made without an optimizer, told of one at step 1: its updates are sampled from then on."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8))
    prof = precprof.Profiler(m, sample_every=1, memory=False)
    with prof:
        for step in range(3):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            if step == 1:
                prof.use_optimizer(opt)
            m(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    layers = prof.tables()["layers"]
    updates = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    assert sorted(set(updates[T.STEP])) == [1]  # step 2's SGD is another one, not given
    assert set(updates[T.NUMEL]) == {64, 8}
    assert prof.summary()["optimizer_changes"] == [{"step": 1, "from": None, "to": "SGD"}]


@pytest.mark.parametrize("resume_at", [2, 4])
def test_a_resumed_run_keeps_the_optimizer_changes_before_its_restart(tmp_path: Path, resume_at: int) -> None:
    """A run of 4 steps that switched from Adam to SGD at step 3, resumed into the same directory by a job that
    makes SGD again: resumed at step 4 it keeps the switch, and the restart makes no other (SGD went on);
    resumed at step 2, where Adam still stepped, the switch at 3 is replaced with the steps after 2, and the
    restart itself is the switch from Adam to SGD. The restart's Profiler never saw Adam: the summary named SGD
    alone."""
    m = nn.Linear(4, 4)

    def train(prof: precprof.Profiler, steps: range, switch_at: int | None = None) -> None:
        opt: torch.optim.Optimizer = prof.optimizers[0]
        with prof:
            for step in steps:
                if step == switch_at:
                    opt = torch.optim.SGD(m.parameters(), lr=0.1)
                    prof.use_optimizer(opt)
                m(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                prof.step()

    out = tmp_path / "run"
    first = precprof.Profiler(m, torch.optim.Adam(m.parameters()), sample_every=1, memory=False, out=out)
    train(first, range(4), switch_at=3)
    first.save()
    again = precprof.Profiler(
        m,
        torch.optim.SGD(m.parameters(), lr=0.1),
        sample_every=1,
        memory=False,
        out=out,
        resume=True,
        first_step=resume_at,
    )
    train(again, range(resume_at, 6))
    again.save()
    expected = {"step": 3 if resume_at == 4 else 2, "from": "Adam", "to": "SGD"}
    assert T.read_summary(out)[T.SUMMARY_CAPTURE]["optimizer_changes"] == [expected]


def test_an_optimizer_of_another_model_is_said_and_samples_nothing() -> None:
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with (
        pytest.warns(UserWarning, match="holds none of the model's parameters"),
        precprof.Profiler(model, optimizer=opt, sample_every=1) as prof,
    ):
        model(torch.randn(2, 4)).sum().backward()
        prof.step()
    layers = prof.tables()["layers"]
    assert T.WEIGHT_UPDATE not in set(layers[T.TENSOR]) and T.WEIGHT_GRAD in set(layers[T.TENSOR])


def test_save_writes_run_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = nn.Sequential(nn.Linear(4, 4))
    with precprof.Profiler(model, sample_every=1) as prof:
        model(torch.randn(2, 4)).sum().backward()
        prof.step()
    prof.save(tmp_path / "run", summary={T.SUMMARY_CONFIG: {"precision": "fp32"}})
    assert T.is_run_dir(tmp_path / "run")
    loaded = T.read_tables(tmp_path / "run")
    for name, df in prof.tables().items():
        pd.testing.assert_frame_equal(
            loaded[name].reset_index(drop=True), df.reset_index(drop=True), check_dtype=False
        )
    summary = T.read_summary(tmp_path / "run")
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert summary[T.SUMMARY_CONFIG] == {"precision": "fp32"}
    assert summary[T.SUMMARY_CAPTURE]["modules_captured"] == 1


def test_bf16_autocast_dtypes_are_recorded() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with precprof.Profiler(model, sample_every=1) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(4, 8))
        out.float().sum().backward()
        prof.step()
    layers = prof.tables()["layers"].set_index([T.MODULE, T.TENSOR, T.PARAM])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[0](torch.randn(4, 8))
        n = model[1](h)
    assert layers.loc[("0", T.ACTIVATION, ""), T.DTYPE] == str(h.dtype).removeprefix("torch.") == "bfloat16"
    assert layers.loc[("1", T.ACTIVATION, ""), T.DTYPE] == str(n.dtype).removeprefix("torch.")
    assert layers.loc[("0", T.WEIGHT, "weight"), T.DTYPE] == "float32"
    assert prof.summary()["autocast"] == {"enabled": True, "dtype": "bfloat16", "device_type": "cpu"}


def test_histogram_counts_match_numel_minus_specials() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    with precprof.Profiler(model, sample_every=1) as prof:
        model(torch.randn(32, 16)).sum().backward()
        prof.step()
    t = prof.tables()
    sums = t["histograms"].groupby([T.MODULE, T.TENSOR, T.PARAM])[T.COUNT].sum()
    for _, r in t["layers"].iterrows():
        if r[T.TENSOR] == T.WEIGHT_UPDATE:
            continue
        key = (r[T.MODULE], r[T.TENSOR], r[T.PARAM])
        assert sums.get(key, 0) == r[T.NUMEL] - r[T.ZEROS] - r[T.NAN] - r[T.INF]
    assert np.all(t["layers"][T.NUMEL] > 0)


def test_weight_update_samples_follow_a_parameter_whose_storage_was_replaced() -> None:
    """The samples are views of the parameters made once; a parameter given new storage (``p.data = ...``,
    as some loaders and quantizers do) is read from the new one, never from a stale view."""
    from precprof.capture.records import _ParamSlot
    from precprof.capture.updates import UpdateSampler

    lin = nn.Linear(16, 16)
    slots = [_ParamSlot("lin", n, p, 0, -1) for n, p in lin.named_parameters()]
    sampler = UpdateSampler(slots, 8, torch.device("cpu"))
    (group,) = sampler._groups

    def expected() -> torch.Tensor:
        return torch.cat(
            [
                p.detach().reshape(-1)[:: s.sample_stride][: s.sample_len]
                for s, p in zip(slots, lin.parameters(), strict=True)
            ]
        ).float()

    assert torch.equal(group.samples(), expected())
    with torch.no_grad():
        lin.weight.add_(1.0)  # in place: the same storage, the view sees it
    assert torch.equal(group.samples(), expected())
    lin.weight.data = torch.randn(16, 16)  # new storage
    assert torch.equal(group.samples(), expected())
    before = group.samples()
    with torch.no_grad():
        lin.weight.mul_(2.0)
    assert not torch.equal(before, group.samples())  # a snapshot, not a view
    lin.weight.data = torch.randn(
        16, 16
    ).t()  # non-contiguous: its flat sample is a copy, made anew each time
    assert torch.equal(group.samples(), expected())
    with torch.no_grad():
        lin.weight.add_(1.0)
    assert torch.equal(group.samples(), expected())


@pytest.mark.parametrize("case", ["plain", "one without gradient", "a transposed gradient"])
def test_the_update_samples_gradient_flags_are_each_sampled_elements(case: str) -> None:
    """``_DeviceGroup.grad_nonzero``: per sampled element of each parameter (every ``sample_stride``-th value,
    ``sample_len`` of them), whether its gradient is nonzero, against the samples taken by hand; plain
    contiguous gradients go through C-level maps, anything else one by one."""
    from precprof.capture.records import _ParamSlot
    from precprof.capture.updates import UpdateSampler

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p) * (torch.rand_like(p) < 0.5)
    if case == "one without gradient":
        params[1].grad = None
    if case == "a transposed gradient":
        params[0].grad = torch.randn(5, 7).t() * (torch.rand(7, 5) < 0.5)
    slots = [_ParamSlot("m", f"p{i}", p, i, -1) for i, p in enumerate(params)]
    sampler = UpdateSampler(slots, 16, torch.device("cpu"))
    (group,) = sampler._groups
    want = []
    for ps in slots:
        g = ps.tensor.grad
        flat = torch.zeros(ps.tensor.numel()) if g is None else g.reshape(-1)
        want.append(flat[:: ps.sample_stride][: ps.sample_len] != 0)
    assert [ps.sample_stride for ps in slots] == [3, 19, 1]
    assert torch.equal(group.grad_nonzero(), torch.cat(want))


def test_a_weights_update_sample_walks_through_its_columns() -> None:
    """A 256 x 256 weight sampled every 256th element read its first column alone, and a stride one more read
    column k at sample k: the first 256 columns of any wider weight (a bf16 Linear(1024, 256) whose first quarter
    of inputs lost every update read 100% lost, reviewer h78). The sample spreads across every quarter of the row's
    columns (every column where it has as many elements as a row), and across its rows; a vector and a tensor
    smaller than the sample keep theirs."""
    for rows, cols in [
        (256, 256),
        (256, 1024),
        (768, 768),
        (3072, 768),
        (4096, 4096),
        (50257, 768),
        (16, 4096),
        (50, 64),
        (30, 40),
        (128, 576),
    ]:
        n = rows * cols
        stride = sample_stride(n, 256, cols)
        index = torch.arange(0, n, stride)
        col, row = index % cols, index // cols
        assert len(index) <= 256 and stride >= -(-n // 256) and len(index) >= 128, (rows, cols, stride)
        if len(index) >= cols:
            assert len(set(col.tolist())) == cols, (rows, cols, stride)
        quarters = torch.bincount(col * 4 // cols, minlength=4)
        assert quarters.min() >= len(index) // 8, (rows, cols, stride, quarters)
        assert len(set(row.tolist())) >= min(len(index), rows) // 2, (rows, cols, stride)
    assert sample_stride(300, 16, 1) == 19 and sample_stride(35, 16, 5) == 3 and sample_stride(3, 16, 3) == 1


def test_a_gan_records_the_gradient_each_optimizer_applied() -> None:
    """PyTorch's DCGAN loop: the discriminator steps, then the generator's loss flows back through it and adds
    to its .grad, which no optimizer applies (it is zeroed at the next iteration). The discriminator's gradient
    rows were that leftover (absmax 0.159349 where optD applied 0.161338). A parameter's row now keeps the
    gradient present when its optimizer stepped; checked against the .grad read in each optimizer's pre-hook."""
    from cast_counts import counts

    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    D = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    optD = torch.optim.Adam(D.parameters(), lr=2e-4)
    optG = torch.optim.Adam(G.parameters(), lr=2e-4)
    names = {id(p): ("D." + n.rsplit(".", 1)[0], n.rsplit(".", 1)[1]) for n, p in D.named_parameters()}
    names |= {id(p): ("G." + n.rsplit(".", 1)[0], n.rsplit(".", 1)[1]) for n, p in G.named_parameters()}
    applied: dict[tuple[int, str, str], dict[str, float]] = {}
    step = [0]

    def read(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                applied[(step[0], *names[id(p)])] = counts(p.grad)

    for opt in (optD, optG):
        opt.register_step_pre_hook(read)
    bce = nn.BCEWithLogitsLoss()
    model = nn.ModuleDict({"G": G, "D": D})
    with precprof.Profiler(model, optimizer=[optD, optG], sample_every=1) as prof:
        for i in range(4):
            step[0] = i
            real, z = torch.randn(16, 4), torch.randn(16, 8)
            D.zero_grad()
            bce(D(real), torch.ones(16, 1)).backward()
            fake = G(z)
            bce(D(fake.detach()), torch.zeros(16, 1)).backward()
            optD.step()
            G.zero_grad()
            bce(D(fake), torch.ones(16, 1)).backward()  # adds to D's .grad too
            optG.step()
            prof.step()
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == len(applied) == 4 * 8
    for row in grads.itertuples(index=False):
        want = applied[(row.step, row.module, row.param)]
        got = row._asdict()
        assert {k: got[k] for k in want} == want, (row.step, row.module, row.param)


def test_a_module_filter_that_selects_nothing_says_so_and_names_the_modules() -> None:
    """``modules=["_orig_mod.0"]`` (a compiled model's own state-dict names) or FSDP1's wrapped names matched
    nothing: nothing recorded, a report rendered from no layer, no word. None selected is a one-line error
    naming the model's modules as precprof names them; a pattern idle beside others that select is a warning."""
    from precprof.errors import UserError

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(UserError) as e:
        precprof.Profiler(torch.compile(model), modules=["_orig_mod.0"]).attach()
    msg = str(e.value)
    assert msg.startswith(
        "Profiler(modules=[_orig_mod.0]) selects no module of the model; its modules are named 0, 1 ("
    )
    assert "\n" not in msg and not _hooks_left(model)
    with pytest.warns(UserWarning, match=r"pattern\(s\) 'zzz' match no module of the model") as caught:
        prof = precprof.Profiler(model, modules=["0", "zzz"]).attach()
    prof.detach()
    assert caught[0].filename == __file__  # said where the loop attached
    with pytest.raises(UserError, match=r"Profiler\(modules=\[Conv2d\]\) selects no module"):
        precprof.Profiler(model, modules=[nn.Conv2d]).attach()


class InputNamed(nn.Module):
    """A ModuleDict with keys "fc" and "fc:input" (torch allows ":" in a name), fc reading a function's output."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.ModuleDict({"fc": nn.Linear(4, 4), "fc:input": nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d["fc:input"](self.d["fc"](x * 2))


def test_a_module_named_like_a_layers_input_row_is_left_out_with_a_warning() -> None:
    """A module named "d.fc:input" beside "d.fc", whose input a function computed: the tables name that input's
    rows "d.fc:input" too, and the histograms merged the two (256 values under one key), the real layer had no
    row of its own and "layers profiled" read 5 of 6. The module is left out with a warning that names it and
    says what to do, its parameters too; the rest is profiled, and training goes on as without precprof."""
    model = InputNamed()
    assert [n for n, _ in model.named_modules()] == ["", "d", "d.fc", "d.fc:input"]
    with pytest.warns(
        UserWarning, match=r"module 'd.fc:input' is not profiled: its name ends in ':input'"
    ) as w:
        prof = precprof.Profiler(model, sample_every=1, memory=False, block_formats=True).attach()
    assert "rename it to have it profiled" in str(w[0].message) and "\n" not in str(w[0].message)
    try:
        x = torch.randn(3, 4)
        model(x).sum().backward()
        prof.step()
        model.d["fc"] = nn.Linear(4, 4)  # a layer swapped: the plan made again leaves the module out too
        with pytest.warns(UserWarning, match="the model's parameters changed"):
            for _ in range(2):  # (the step in progress keeps the hooks it began with: the next is re-planned)
                model(x).sum().backward()
                prof.step()
    finally:
        prof.detach()
    layers = prof.tables()["layers"]
    named = layers[layers[T.MODULE].astype(str) == "d.fc:input"]
    # the only rows of that name are d.fc's input row, the function's output x * 2 that d.fc read
    assert set(named[T.MODULE_TYPE].astype(str)) == {T.INPUT_MODULE_TYPE}
    assert set(named[T.TENSOR].astype(str)) == {T.ACTIVATION}
    assert int(named[T.NUMEL].sum()) == 2 * (x * 2).numel()  # (both steps)
    assert float(named[T.ABSMAX].max()) == float((x * 2).abs().max())
    assert {"d.fc"} <= set(layers[T.MODULE].astype(str))


def test_a_closure_that_runs_the_backward_inside_the_step_keeps_its_gradients() -> None:
    """``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization): the backward runs inside the
    step, after its pre-hook. Freezing a parameter's gradient row when its optimizer stepped must come after
    the step, or such a loop has no weight gradient at all (every Lightning run had none for a few commits)."""
    from cast_counts import counts

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    applied: dict[str, dict[str, float]] = {}

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        for n, p in model.named_parameters():
            applied[n] = counts(p.grad)
        return loss

    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        opt.step(closure)
        prof.step()
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == 4
    for row in grads.itertuples(index=False):
        want = applied[f"{row.module}.{row.param}"]
        assert {k: row._asdict()[k] for k in want} == want


def test_gradient_accumulation_is_counted_and_the_weight_gradient_what_if_says_it_is_of_the_sum(
    tmp_path: Path,
) -> None:
    """Four micro-batches per optimizer step: the weight-gradient rows are the accumulated sum (calls = 1),
    and nothing said so, while autocast computes each micro-batch's gradient in 16-bit, up to 2 binades smaller
    (with 8, a user's gradients that all flushed in fp16 counted 0 of 64 underflowing). The rows count the
    backward passes, and the weight-gradient heatmap says what its counts are of."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(2):
            for _ in range(4):
                (model(torch.randn(4, 8)).square().mean() / 4).backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    layers = prof.tables()["layers"]
    assert set(layers[layers[T.TENSOR] == T.WEIGHT_GRAD][T.CALLS]) == {4}
    assert set(layers[layers[T.TENSOR] == T.ACTIVATION_GRAD][T.CALLS]) == {4}
    page = prof.report(tmp_path / "run").read_text()
    assert "Gradient accumulation: up to 4 backward passes added into each weight gradient per step" in page
    assert "log2(4) = 2.0 binades" in page


def test_a_loop_that_steps_its_optimizer_after_prof_step_keeps_its_gradients() -> None:
    """``backward(); prof.step(); optimizer.step()``: each profiler step opens with the previous step's
    optimizer.step(), then runs its own backward. Keeping a gradient row from its optimizer's step on must
    only keep rows already read in the step, or such a loop records no weight gradient at all."""
    from cast_counts import counts

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[tuple[int, str], dict[str, float]] = {}
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(16, 4)).square().mean().backward()
            for n, p in model.named_parameters():
                seen[(step, n)] = counts(p.grad)
            prof.step()
            opt.step()  # the next profiler step's
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == 3 * 4
    for row in grads.itertuples(index=False):
        want = seen[(row.step, f"{row.module}.{row.param}")]
        assert {k: row._asdict()[k] for k in want} == want


def test_gradients_assigned_outside_autograd_are_read_as_the_optimizer_gets_them() -> None:
    """``torch.autograd.grad`` then ``p.grad = g`` (gradient surgery, SAM, a functional step) and FSDP1's
    ``use_orig_params=True`` assign ``.grad`` without accumulating: no post-accumulate-grad hook fires, and such
    a loop had no weight-gradient row. They are read in the optimizer's step pre-hook, counted as a real cast
    counts them (values at fp16's underflow and overflow boundaries)."""
    from cast_counts import counts

    torch.manual_seed(0)
    model = nn.Sequential(Scale(13), nn.Linear(13, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    applied: dict[tuple[int, str], dict[str, float]] = {}
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(2):
            loss = model(torch.randn(4, 13)).square().mean()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            model[0].w.grad = _hand_values() * (step + 1)
            for n, p in model.named_parameters():
                applied[(step, n)] = counts(p.grad)
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == 2 * 3 and set(grads[T.CALLS]) == {1}
    for row in grads.itertuples(index=False):
        want = applied[(row.step, f"{row.module}.{row.param}")]
        assert {k: row._asdict()[k] for k in want} == want
    assert prof.skipped_tensors() == []


def test_gradients_assigned_outside_autograd_and_unscaled_before_the_step_are_skipped_and_said() -> None:
    """With a GradScaler the same gradients are unscaled in place by ``scaler.step`` before the optimizer's
    hook sees them, unlike every other gradient row (read at the scale): not read, counted, and the summary
    says why."""
    torch.manual_seed(0)
    model = nn.Sequential(Scale(13), nn.Linear(13, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1) as prof:
        for _ in range(2):
            loss = model(torch.randn(4, 13)).square().mean()
            grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()))
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    layers = prof.tables()["layers"]
    assert not (layers[T.TENSOR] == T.WEIGHT_GRAD).any()
    skipped = prof.skipped_tensors()
    assert sorted((s["module"], s["param"], s["count"]) for s in skipped) == [
        ("0", "w", 2),
        ("1", "bias", 2),
        ("1", "weight", 2),
    ]
    assert {s["reason"] for s in skipped} == {UNSCALED_UNREAD}


# the engines whose readers take the weight-update samples: the torch path, the C kernel's, the Triton
# kernels' in Triton's interpreter (``capture/update_readers.py``)
UPDATE_ENGINES = [
    "torch",
    *(["c"] if cpu_kernel.load() is not None else []),
    *(
        ["triton"]
        if triton_engine.interpreting() and triton_engine.unavailable(torch.device("cpu")) is None
        else []
    ),
]


@pytest.mark.parametrize("engine", UPDATE_ENGINES)
def test_a_closure_steps_updates_are_judged_by_its_own_gradients(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``optimizer.step(closure)`` (Lightning's automatic optimization): the step's pre-hook runs before the
    closure's forward and backward, and the updates' intent was read from the gradients there, the previous
    step's: with an embedding whose looked-up rows change each step, lost-in-bf16 counts of 119 where 31 were
    true, and a skipped batch counted 100% lost. The intent is read once the closure has run. Truth: the
    weights before and after each step and the gradients the closure made, with a real bf16 cast."""
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", engine)
    torch.manual_seed(0)
    model = nn.Embedding(64, 4)  # 256 elements: every one sampled
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    truth: list[tuple[int, int]] = []
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, compile_beside=False) as prof:
        for step in range(4):
            ids = torch.randint(32 * (step % 2), 32 * (step % 2) + 32, (8, 4), generator=g)
            seen: dict[str, torch.Tensor] = {}

            def closure(ids: torch.Tensor = ids, seen: dict[str, torch.Tensor] = seen) -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = model(ids).sin().sum()
                loss.backward()
                seen["grad"] = model.weight.grad.clone()
                return loss

            before = model.weight.detach().clone()
            opt.step(closure)
            delta = model.weight.detach() - before
            intended = (seen["grad"] != 0) | (delta != 0)
            held = before.to(torch.bfloat16)
            lost = intended & ((delta == 0) | ((held.float() + delta).to(torch.bfloat16) == held))
            truth.append((int((~intended).sum()), int(lost.sum())))
            prof.step()
    rows = prof.tables()["layers"]
    rows = rows[rows[T.TENSOR] == T.WEIGHT_UPDATE].sort_values(T.STEP)
    assert list(zip(rows[T.ZEROS], rows[T.LOST_UPDATE_BF16], strict=True)) == truth
    assert len({t[0] for t in truth}) > 1  # the intent changed from step to step


@pytest.mark.parametrize("engine", UPDATE_ENGINES)
def test_an_update_with_learning_rate_zero_is_not_lost(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step of a warmup from 0 (``get_linear_schedule_with_warmup``) moves nothing, in fp32 as in
    bf16: every element was counted lost in bf16 and in fp16 (6.5% against 1.5% over a 20-step run), around
    the threshold that decides whether the fp16 finding shows. A step at lr 0 intends no update."""
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", engine)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, compile_beside=False) as prof:
        for _ in range(3):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            prof.step()
    rows = prof.tables()["layers"]
    rows = rows[rows[T.TENSOR] == T.WEIGHT_UPDATE]
    first = rows[rows[T.STEP] == 0]
    assert (first[T.ZEROS] == first[T.NUMEL]).all()
    assert (first[T.LOST_UPDATE_BF16] == 0).all() and (first[T.LOST_UPDATE_FP16] == 0).all()
    later = rows[rows[T.STEP] > 0]
    assert (later[T.ZEROS] < later[T.NUMEL]).all()


class _CallsItself(nn.Module):
    """A forward that calls the model itself first (with grad, or under ``no_grad`` as a self-distillation
    target), then runs a frozen part under ``no_grad``."""

    def __init__(self, inner_no_grad: bool) -> None:
        super().__init__()
        self.inner_no_grad = inner_no_grad
        self.body = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        if depth == 0:
            with torch.no_grad() if self.inner_no_grad else contextlib.nullcontext():
                x = x + self(x, depth=1)
        if depth == 0:
            with torch.no_grad():
                x = x + self.frozen(x)
        return self.body(x)


@pytest.mark.parametrize("inner_no_grad", [False, True])
def test_a_model_that_calls_itself_keeps_its_frozen_parts_rows(inner_no_grad: bool) -> None:
    """The model's own forward state was one flag, which the inner call's end cleared: the frozen part the outer
    forward ran next under ``no_grad`` had no row. The innermost call decides, and the enclosing one's state
    comes back: the frozen part is read once a step; a self-call under ``no_grad`` (a target) is not read, and
    nothing said so: its module forwards are counted, and the report's Environment says they were not read."""
    torch.manual_seed(0)
    model = _CallsItself(inner_no_grad)
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    acts = prof.tables()["layers"]
    acts = acts[acts[T.TENSOR] == T.ACTIVATION].set_index([T.STEP, T.MODULE])[T.CALLS]
    assert acts[(0, "frozen")] == acts[(1, "frozen")] == 1
    assert acts[(0, "body")] == (1 if inner_no_grad else 2)
    unread = 2 if inner_no_grad else 0  # the inner call runs body alone, once in each of the 2 sampled steps
    assert prof.summary()["self_call_forwards_unread"] == unread
    said = dict(environment.capture_rows(prof.summary(), {})).get("the model's call of itself", "")
    assert said.startswith(f"{unread} module forwards of the model called by itself under no_grad") == bool(
        unread
    )


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as it is usually copied (davda54/sam): ``step(closure)`` moves the weights
    up the gradient, runs the closure there, puts the weights back (a new storage) and steps the base SGD."""

    def __init__(self, params: Any, lr: float, rho: float = 0.05) -> None:
        super().__init__(params, {"rho": rho, "lr": lr})
        self.base = torch.optim.SGD(self.param_groups, lr=lr)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        for p in params:
            self.state[p]["old"] = p.data.clone()
            p.add_(p.grad * (self.param_groups[0]["rho"] / (norm + 1e-12)))
        self.zero_grad()
        with torch.enable_grad():
            closure()
        for p in params:
            p.data = self.state[p]["old"]
        self.base.step()


def test_an_optimizer_that_moves_the_weights_before_its_closure_is_sampled_from_where_they_were() -> None:
    """SAM's ``step(closure)`` perturbs the weights before it calls the closure: the update sample read its
    "before" once the closure ran, from the perturbed weights, and counted 24 of 128 updates lost in bf16
    where 125 were. The weights are read in the step's pre-hook, the intent once the closure ran. Truth: the
    weights before and after each step, the closure's gradients, real casts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = _SAM(model.parameters(), lr=1e-3)
    truth: dict[tuple[int, str], tuple[int, int, int]] = {}
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(3):
            x, y = torch.randn(32, 16), torch.randn(32, 1)
            seen: dict[str, torch.Tensor] = {}

            def closure(
                x: torch.Tensor = x, y: torch.Tensor = y, seen: dict[str, torch.Tensor] = seen
            ) -> Any:
                loss = (model(x) - y).square().mean()
                loss.backward()
                seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
                return loss

            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step(closure)
            for n, p in model.named_parameters():
                delta = p.detach() - before[n]
                intended = (seen[n] != 0) | (delta != 0)
                lost = [
                    int((intended & ((delta == 0) | ((held.float() + delta).to(dt) == held))).sum())
                    for dt in (torch.bfloat16, torch.float16)
                    for held in [before[n].to(dt)]
                ]
                truth[(step, n)] = (int((~intended).sum()), *lost)
            prof.step()
    rows = prof.tables()["layers"]
    rows = rows[rows[T.TENSOR] == T.WEIGHT_UPDATE]
    got = {
        (r.step, f"{r.module}.{r.param}"): (r.zeros, r.lost_update_bf16, r.lost_update_fp16)
        for r in rows.itertuples(index=False)
    }
    assert got == truth and len(got) == 3 * 4


class _SometimesSkips(nn.Module):
    """Its second layer runs on even calls only (a branch a step may skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.first(x)
        return self.second(x) if self.calls % 2 else x


def test_a_stale_gradient_of_a_layer_that_did_not_run_is_not_read() -> None:
    """``zero_grad(set_to_none=False)`` keeps a zero gradient on a layer the step did not run: the optimizer's
    hook took it for a gradient assigned outside autograd and wrote weight-gradient rows of zeros for a layer
    that took no part. Only a layer that ran has its unread gradient read."""
    torch.manual_seed(0)
    model = _SometimesSkips()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(4):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            prof.step()
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.WEIGHT_GRAD]
    assert sorted(set(zip(grads[T.STEP], grads[T.MODULE], strict=True))) == [
        (0, "first"), (0, "second"), (1, "first"), (2, "first"), (2, "second"), (3, "first"),
    ]  # fmt: skip


def test_forwards_inside_not_training_are_not_the_steps() -> None:
    """An evaluation with grad on (eval mode, no ``no_grad``) wrapped in ``prof.not_training()`` between two steps
    was read into the next step's rows (224 values and 4 calls instead of 128 and 2): what the user marked as not
    training is not read. Its forwards run without precprof's hooks, so they are not counted among the
    evaluations with grad on either (those the user did not mark: ``eval_forwards_ignored``)."""

    def run(evaluate: bool) -> tuple[pd.DataFrame, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(
            1
        )  # (the training batches, whether or not the evaluation draws its own)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
            for _ in range(3):
                if evaluate:
                    with prof.not_training():
                        model.eval()
                        model(torch.randn(32, 8)).sum()
                        model.train()
                model(torch.randn(4, 8, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        return prof.tables()["layers"], prof.summary()["eval_forwards_ignored"]

    (layers, evals), (plain, none) = run(True), run(False)
    pd.testing.assert_frame_equal(layers, plain)
    assert (evals, none) == (0, 0)


class _Encoder(nn.Module):
    """A tiny ``nn.TransformerEncoder`` language model, built so that eval mode under ``no_grad`` takes torch's
    fast path (batch_first, an even number of heads, relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


def _encoder_run(
    monkeypatch: pytest.MonkeyPatch, evaluate: Callable[[Any], Any] | None, profiled: bool = True
) -> tuple[list[torch.Tensor], int, pd.DataFrame | None]:
    """Three bf16 training steps of ``_Encoder``, each followed by an evaluation (eval mode, no_grad) inside
    ``evaluate(prof)`` (None: none): the evaluations' outputs, how many times the encoder layers' fast path
    ran (torch's ``_transformer_encoder_layer_fwd``), and the layers table."""
    fast = torch._transformer_encoder_layer_fwd
    ran = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        ran[0] += 1
        return fast(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counted)
    torch.manual_seed(0)
    model = _Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1).attach() if profiled else None
    outputs = []
    for _ in range(3):
        x = torch.randint(0, 64, (4, 12), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if evaluate is not None:
            model.eval()
            with evaluate(prof), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                outputs.append(model(x))
            model.train()
        if prof is not None:
            prof.step()
    if prof is None:
        return outputs, ran[0], None
    prof.detach()
    return outputs, ran[0], prof.tables()["layers"]


def test_an_evaluation_inside_not_training_runs_as_without_precprof(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 ``nn.TransformerEncoder`` evaluated (eval mode, no_grad) inside ``prof.not_training()`` left torch's
    fast path, which refuses a layer holding any forward hook: its outputs moved by 4e-4 on sampled steps. Inside
    it the model holds none of precprof's forward hooks, so the evaluation runs the fast path and gives the very
    outputs of the same model without precprof; the hooks are back for the next sampled step, whose training is
    read as in the same run without the evaluations."""
    got, fast, layers = _encoder_run(monkeypatch, lambda prof: prof.not_training())
    want, fast_plain, _ = _encoder_run(monkeypatch, lambda prof: contextlib.nullcontext(), profiled=False)
    _, _, plain = _encoder_run(monkeypatch, None)
    assert fast == fast_plain == 3 * 2  # (two layers an evaluation)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert layers is not None and plain is not None
    assert sorted(set(layers[T.STEP])) == [0, 1, 2]
    pd.testing.assert_frame_equal(layers, plain)


class _FrozenEncoderInside(nn.Module):
    """A frozen ``nn.TransformerEncoder`` (a text encoder) run in eval mode under ``no_grad`` inside the training
    forward over a padded batch, or (``frozen=False``) trained with the rest, in train mode."""

    def __init__(self, nested: bool, frozen: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).requires_grad_(not frozen)
        self.out = nn.Linear(32, 64)
        self.frozen = frozen

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        self.enc.train(not self.frozen)
        with torch.set_grad_enabled(not self.frozen and torch.is_grad_enabled()):
            e = self.enc(h, src_key_padding_mask=pad)
        return self.out(h + e)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")
@pytest.mark.parametrize(
    ("case", "nested", "frozen", "bf16"),
    [
        ("frozen", False, True, False),
        ("frozen bf16", False, True, True),
        ("frozen nested", True, True, False),
        ("trained", False, False, False),
    ],
)
def test_a_frozen_encoder_inside_the_training_forward_runs_torchs_fused_path_as_without_precprof(
    monkeypatch: pytest.MonkeyPatch, case: str, nested: bool, frozen: bool, bf16: bool
) -> None:
    """A frozen ``nn.TransformerEncoder`` in eval mode under ``no_grad`` inside the training forward trained
    otherwise with precprof (fp32: step 5's loss by 1e-6; CPU bf16 autocast: 4e-4), as tester t3 found: torch's
    ``TransformerEncoderLayer`` takes its fused path only when no module of it holds a forward hook, and
    precprof's hooks (the statistics' and the memory's) refused it on sampled steps. They step aside for such a
    call, so that losses and weights are bitwise those without precprof, sampled steps and unsampled ones, the
    fused path running as often; the layers' rows say why they were not read (counted per sampled step), the
    rest is read. With nested tensors (``enable_nested_tensor``), whose first sampled step crashed, the same. An
    encoder trained in train mode takes no fused path: its layers' rows are read as before, none skipped."""
    fast = torch._transformer_encoder_layer_fwd
    ran = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        ran[0] += 1
        return fast(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counted)

    def run(profiled: bool) -> tuple[torch.Tensor, list[torch.Tensor], int, precprof.Profiler | None]:
        ran[0] = 0
        torch.manual_seed(0)
        model = _FrozenEncoderInside(nested, frozen)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        g = torch.Generator().manual_seed(1)
        prof = precprof.Profiler(model, optimizer=opt, sample_every=2).attach() if profiled else None
        losses = []
        for _ in range(6):
            x = torch.randint(0, 64, (8, 12), generator=g)
            pad = torch.arange(12)[None] >= torch.randint(3, 13, (8,), generator=g)[:, None]
            pad[0] = False
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(model(x, pad).float().reshape(-1, 64), x.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if prof is not None:
                prof.step(loss=loss.detach())
        if prof is not None:
            prof.detach()
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()], ran[0], prof

    want, want_params, want_fast, _ = run(False)
    got, params, fast_runs, prof = run(True)
    assert torch.equal(got, want), (got - want).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    assert fast_runs == want_fast == (12 if frozen else 0)  # (two layers a step)
    assert prof is not None
    layers = prof.tables()["layers"]
    sampled = sorted(set(layers[T.STEP]))
    assert 1 < len(sampled) < 6  # (sampled steps and unsampled ones)
    skipped = {s["module"]: s for s in prof.summary()["skipped_tensors"]}
    inside = [f"enc.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "linear1", "norm2")]
    read = set(layers[layers[T.TENSOR] == T.ACTIVATION][T.MODULE])
    assert {"emb", "out"} <= read
    if not frozen:
        assert not skipped and set(inside) <= read
        return
    assert not read & set(inside)
    for name in inside:
        assert skipped[name]["tensor"] == T.ACTIVATION and skipped[name]["count"] == len(sampled)
        assert "torch's fused path" in skipped[name]["reason"]


def test_an_evaluation_under_no_grad_in_a_sampled_step_runs_as_without_precprof(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same evaluation without ``not_training()``, in eval mode under ``no_grad`` after the optimizer step of a
    sampled step (before ``prof.step()``): it ran through the hooks of the step, off torch's fast path, and with
    ``sample_every=2`` its outputs depended on whether the step was sampled. The model's call under ``no_grad``
    puts the modules' hooks aside until it returns: the fast path runs, the outputs are those without precprof,
    and the training is read as in the same run without the evaluations."""
    got, fast, layers = _encoder_run(monkeypatch, lambda prof: contextlib.nullcontext())
    want, fast_plain, _ = _encoder_run(monkeypatch, lambda prof: contextlib.nullcontext(), profiled=False)
    _, _, plain = _encoder_run(monkeypatch, None)
    assert fast == fast_plain == 3 * 2
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert layers is not None and plain is not None
    assert sorted(set(layers[T.STEP])) == [0, 1, 2]
    pd.testing.assert_frame_equal(layers, plain)


@pytest.mark.parametrize("where", ["before the training forward", "after the optimizer step"])
def test_an_evaluation_a_keyboard_interrupt_cut_short_leaves_the_hooks_in_place(where: str) -> None:
    """An evaluation under ``no_grad`` stopped by a KeyboardInterrupt the loop caught (torch then calls no forward
    hook, so the model's post-hook never put the modules' hooks back): they are back at the model's next call, or
    at the next sampled step's start, and the training is read as in the same run without the evaluations."""

    class Stop(nn.Module):
        armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                raise KeyboardInterrupt
            return x

    def evaluate(model: nn.Module, stop: Stop) -> None:
        stop.armed = True
        with contextlib.suppress(KeyboardInterrupt), torch.no_grad():
            model(torch.randn(4, 8))
        stop.armed = False

    def run(interrupt: bool) -> pd.DataFrame:
        torch.manual_seed(0)
        stop = Stop()
        model = nn.Sequential(nn.Linear(8, 16), stop, nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, memory_every=1) as prof:
            for _ in range(3):
                if interrupt and where.startswith("before"):
                    evaluate(model, stop)
                model(torch.randn(4, 8, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if interrupt and where.startswith("after"):
                    evaluate(model, stop)
                prof.step()
        return prof.tables()["layers"]

    layers, plain = run(True), run(False)
    assert sorted(set(layers[T.STEP])) == [0, 1, 2]
    pd.testing.assert_frame_equal(layers, plain)


def test_a_grad_scaler_skip_after_an_optimizer_switch_is_the_new_optimizers() -> None:
    """``prof.use_optimizer(sgd)`` at step 2 of an fp16-scaled loop: the GradScaler's skips were read from the old
    optimizer's found-inf flags (the scaler watch kept the optimizers given at attach), so a step whose gradients
    overflowed under the new optimizer was not marked skipped. The truth is the scaler's own: its scale backs off
    exactly on the steps it skipped."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt: torch.optim.Optimizer = torch.optim.Adam(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    skipped = []
    with precprof.Profiler(m, optimizer=opt, scaler=scaler, sample_every=1, memory=False) as prof:
        for step in range(5):
            if step == 2:
                opt = torch.optim.SGD(m.parameters(), lr=0.1)
                prof.use_optimizer(opt)
            loss = m(torch.randn(4, 8)).pow(2).mean() * (float("inf") if step == 3 else 1.0)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    assert skipped == [False, False, False, True, False]
    assert prof.tables()["steps"][T.SKIPPED].tolist() == skipped
