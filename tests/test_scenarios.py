"""The advisor on real tiny training runs (CPU, seconds each): every claim is checked by a second, measured run.

The scenarios live in tests/scenarios/ and read as examples of the Profiler and ``precprof.recommend``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from scenarios import (
    accelerate_cpu_fp16,
    backward_nan,
    benign,
    fp32_ops,
    huge_activations,
    huge_gradients,
    lost_updates,
    low_precision_loss,
    nan_injection,
    own_loop,
    summed_loss,
    tiny_gradients,
)
from scenarios.loop import regression_batches, train_profiled
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis import update_ratio
from precprof.analysis.advisor import CRITICAL, AdvisorConfig
from precprof.capture import records
from precprof.hardware import HardwareInfo
from precprof.report import context as report_context
from precprof.report import numbers, timeline
from precprof.report import summarize as S
from precprof.report.environment import capture_rows
from precprof.report.render import environment, render_html

ROOT = Path(__file__).resolve().parents[1]


def _rows(run_tables: dict[str, pd.DataFrame], kind: str) -> pd.DataFrame:
    layers = run_tables["layers"]
    return layers[layers[T.TENSOR] == kind]


def _num(value: object) -> float:
    assert isinstance(value, (int, float)), f"expected a number, got {value!r}"
    return float(value)


def _fp16_zero_share(run_tables: dict[str, pd.DataFrame]) -> float:
    """Measured: the share of exact zeros among fp16 activation gradients (tanh/linear grads are zero only
    when they underflowed)."""
    ag = _rows(run_tables, T.ACTIVATION_GRAD)
    ag = ag[ag[T.DTYPE] == "float16"]
    assert not ag.empty, "the fp16 run produced no fp16 activation gradients"
    return float(ag[T.ZEROS].sum() / ag[T.NUMEL].sum())


def test_a_tiny_gradients_get_a_loss_scale_that_works() -> None:
    rec = tiny_gradients.run().recommend("v100")
    assert rec.format == "fp16", rec.reasons and rec.loss_scale is not None
    k = math.log2(rec.loss_scale)
    assert k.is_integer() and k > 16  # far above GradScaler's default start
    under = rec.finding("fp16_gradient_underflow")
    assert under is not None
    assert _num(under.numbers["share_at_scale_1"]) > 0.5
    assert _num(under.numbers["share_at_recommended"]) < 0.01
    assert under.numbers["overflow_at_recommended"] == 0
    # measured, not taken from the rule: fp16 runs at scale 1 and at the recommended scale
    at_1 = tiny_gradients.run("fp16", loss_scale=None)
    at_k = tiny_gradients.run("fp16", loss_scale=rec.loss_scale)
    z1, zk = _fp16_zero_share(at_1.tables), _fp16_zero_share(at_k.tables)
    assert z1 > 0.5
    assert zk < 0.01 and zk < z1
    # without overflow: the scaler never skipped a step and no gradient became inf
    assert not at_k.tables["steps"][T.SKIPPED].any()
    grads = at_k.tables["layers"][at_k.tables["layers"][T.TENSOR].isin(T.GRADIENT_KINDS)]
    assert int(grads[T.INF].sum() + grads[T.NAN].sum()) == 0


def test_a_every_gradient_flushed_is_critical_and_the_advice_recovers_it() -> None:
    """fp16 without loss scaling, the loss weighted by 2^-30: every fp16 activation gradient is an exact zero and
    the loss never moves. The flush test wanted a smallest nonzero value among fp16's subnormals, which a run that
    lost all of them has not: the worst case got an info finding, "n/a" shares and a verdict saying "the
    measured gradients do not underflow" bf16. It is critical now, the verdict says nothing was measured, and
    the fallback scale it gives brings the gradients back."""
    weight = 2.0**-30
    dead = tiny_gradients.run("fp16", steps=6, weight=weight)
    ag = _rows(dead.tables, T.ACTIVATION_GRAD)
    assert set(ag[T.DTYPE]) == {"float16"} and (ag[T.ZEROS] == ag[T.NUMEL]).all()  # every value zero
    wg = _rows(dead.tables, T.WEIGHT_GRAD)
    assert (wg[T.ZEROS] == wg[T.NUMEL]).all()  # nothing trains: every weight's gradient is zero too
    rec = dead.recommend("v100")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.severity == "critical" and f.numbers["fp16_flushed"]
    assert f.message.startswith("This fp16 run trained without loss scaling, and every one of its fp16")
    assert f.numbers["fp16_smallest_nonzero"] is None
    assert not any("the measured gradients do not underflow" in r for r in rec.reasons)
    assert not any("the largest gradient seen, n/a" in r for r in rec.reasons)
    assert (
        rec.format == "fp16" and rec.loss_scale == 2.0**24 and "GradScaler(init_scale=16777216)" in f.remedy
    )
    assert any(r.startswith("Start GradScaler at init_scale=") and "flush point" in r for r in rec.reasons)
    scale = float(rec.loss_scale)
    fixed = tiny_gradients.run("fp16", loss_scale=scale, steps=6, weight=weight)
    assert _fp16_zero_share(fixed.tables) < 0.05
    wg = _rows(fixed.tables, T.WEIGHT_GRAD)
    assert (wg[T.ZEROS] < wg[T.NUMEL]).all()


def test_a_the_runs_loss_scale_is_the_one_it_trained_at() -> None:
    """A GradScaler that backs off from 2^16 through five skipped steps to the 2^11 it then trains at: "the run's
    loss scale", against which a recommended scale is judged, was the median of the distinct scales it visited
    (2^13 here); it is the scale of the steps taken."""
    run = tiny_gradients.run("fp16", loss_scale=2.0**16, steps=10, weight=2.0**6)
    steps = run.tables["steps"]
    taken = steps[~T.flags(steps[T.SKIPPED])]
    assert steps[T.SKIPPED].sum() == 5 and set(taken[T.LOSS_SCALE]) == {2.0**11}
    f = run.recommend("v100").finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["run_scale_log2"] == 11


def _relu_mlp(gain: float) -> nn.Module:
    """Four Linear layers with ReLUs between them, the second one's weight multiplied by ``gain``."""
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Linear(16, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 1),
    )
    with torch.no_grad():
        m[2].weight.mul_(gain)
    return m


def test_b_gradients_that_overflow_into_fp32_weight_gradients_are_counted() -> None:
    """fp16 autocast with a GradScaler, one layer's weight 3000 times too large: the fp16 matmuls computing the
    weight gradients overflow and the infs land in the fp32 .grad, which made the scaler skip most of its steps.
    The finding counted the fp16 activation gradients' infs alone: fewer steps than the scaler skipped, and not
    the modules whose weight gradients overflowed. It names every step the scaler skipped, and those modules."""

    run = train_profiled(
        _relu_mlp(3000.0),
        regression_batches(16),
        lambda p, y: nn.functional.mse_loss(p.float(), y),
        precision="fp16",
        loss_scale=2.0**16,
        steps=12,
    )
    steps, layers = run.tables["steps"], run.tables["layers"]
    skipped = sorted(int(s) for s in steps[T.flags(steps[T.SKIPPED])][T.STEP])
    grads = layers[layers[T.TENSOR].isin(T.GRADIENT_KINDS)]
    inf_wg = grads[(grads[T.TENSOR] == T.WEIGHT_GRAD) & (grads[T.INF] > 0) & (grads[T.DTYPE] == "float32")]
    assert (
        len(skipped) >= 6 and not inf_wg.empty
    )  # infs in fp32 weight gradients: the fp16 matmuls overflowed
    f = run.recommend("v100").finding("fp16_gradient_overflow")
    assert f is not None and f.severity == "warning"
    with_inf = grads[grads[T.INF] > 0]
    assert f.numbers["steps"] == len(skipped) == with_inf[T.STEP].nunique()
    assert f.numbers["values"] == int(with_inf[T.INF].sum())
    assert set(inf_wg[T.MODULE]) <= set(f.modules)
    # FP8 (bf16 autocast, no loss scale) has none of those infs: they kept the layers from being FP8-eligible
    # ("non-finite values"); the three layers of a multiple-of-16 shape are eligible
    fp8 = run.recommend("h100").finding("fp8_eligibility")
    assert fp8 is not None and fp8.numbers["eligible"] == 3 and "non-finite values" not in fp8.message
    assert f"The gradients of {len(skipped)} step(s) the loss scaler skipped held nan/inf" in fp8.message


def test_b_huge_activations_keep_the_layer_in_fp32() -> None:
    rec = huge_activations.run().recommend("v100")
    over = rec.finding("fp16_activation_overflow")
    assert over is not None and over.modules == ["amplify"]
    assert rec.format != "fp16" or rec.keep_fp32 == ["amplify"]
    assert rec.format == "fp16", rec.reasons
    # measured: fp16 without the keep list overflows in amplify (inf), with it nothing overflows
    bad = huge_activations.run("fp16", loss_scale=rec.loss_scale)
    acts = _rows(bad.tables, T.ACTIVATION).set_index([T.STEP, T.MODULE])
    assert (acts.xs("amplify", level=T.MODULE)[T.INF] > 0).all()
    assert bad.tables["steps"][T.SKIPPED].all()
    # and the advisor, given that fp16 run, names amplify as where nan/inf starts
    rec_bad = bad.recommend("v100")
    assert rec_bad.finding("nonfinite_forward").modules == ["amplify"]  # type: ignore[union-attr]
    assert rec_bad.keep_fp32 == ["amplify"]
    # every sampled step's forward pass was inf: no reason may say what its gradients measured (it said "the
    # largest gradient seen, n/a" and, for bf16, "the measured gradients do not underflow it")
    said = " ".join(rec_bad.reasons + bad.recommend("a100").reasons)
    assert "n/a" not in said and "the measured gradients do not underflow" not in said
    assert "every sampled step's forward pass was already non-finite" in said
    good = huge_activations.run("fp16", loss_scale=rec.loss_scale, keep_fp32=rec.keep_fp32)
    layers = good.tables["layers"]
    assert int(layers[T.INF].sum() + layers[T.NAN].sum()) == 0
    assert not good.tables["steps"][T.SKIPPED].any()
    assert all(math.isfinite(v) for v in good.losses)
    kept = _rows(good.tables, T.ACTIVATION)
    assert set(kept[kept[T.MODULE] == "amplify"][T.DTYPE]) == {"float32"}
    assert set(kept[kept[T.MODULE] == "head"][T.DTYPE]) == {"float16"}  # the rest still runs in fp16


class _NaiveLogSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(x, dim=-1))


def test_b_an_inf_from_log_of_an_underflowed_softmax_is_not_called_values_beyond_65504() -> None:
    """A model cast to fp16 computing log(softmax(x)): softmax underflows to 0, log gives -inf. The finding said
    the module produced activations beyond 65504 (its largest finite value is about 17) and told the user to
    normalise its output; it says the inf came from inside it, and that a fused op avoids it. Keeping the module
    in fp32, what it advises, trains: checked by running it."""
    import torch.nn.functional as F

    def net(keep: bool) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), _NaiveLogSoftmax())
        with torch.no_grad():
            m[2].weight.mul_(40.0)
        m = m.half()
        if keep:
            m[3].float().register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
        return m

    def run(keep: bool) -> tuple[precprof.Profiler, list[float]]:
        m = net(keep)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).half()
        y = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(1))
        losses = []
        with precprof.Profiler(m, optimizer=opt, sample_every=1, memory=False) as prof:
            for _ in range(4):
                loss = F.nll_loss(m(x).float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step(loss=loss.detach())
                losses.append(loss.item())
        return prof, losses

    prof, losses = run(False)
    acts = prof.tables()["layers"]
    row = acts[(acts[T.MODULE] == "3") & (acts[T.TENSOR] == T.ACTIVATION) & (acts[T.STEP] == 0)].iloc[0]
    assert row[T.INF] > 0 and float(row[T.ABSMAX]) < 100 and not math.isfinite(losses[0])
    rec = precprof.recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}, hardware="t4")
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.modules == ["3"] and f.title == "fp16 activations turn inf inside 1 module(s)"
    assert "inf in fp16 though its largest finite value is" in f.message and "beyond" not in f.message
    assert "F.log_softmax" in f.remedy and "normalise" not in f.remedy
    # the header's final loss is the last one, nan: it read "inf", step 0's, the only one not stored as null
    from precprof.report.context import _headline

    steps = prof.tables()["steps"]
    assert math.isnan(losses[-1]) and dict(_headline({}, steps, acts))["final loss"] == "nan"
    _, fixed = run(True)
    assert all(math.isfinite(v) for v in fixed) and fixed[-1] < fixed[0]


def test_b_following_keep_fp32_clears_the_finding() -> None:
    """A layer whose output overflows fp16: the advisor keeps it, the ReLU after it and the layer after that in
    fp32. Done as written (those modules outside autocast, on fp32 inputs), the re-profile still told the user
    to keep the ReLU in fp32, because its fp32 output was counted as cast by the Linear that reads it, a Linear
    that runs outside autocast and casts nothing. The advice followed leaves no overflow finding."""

    def run(keep: list[str]) -> object:
        return train_profiled(
            _relu_mlp(1e5),
            regression_batches(16),
            lambda p, y: nn.functional.mse_loss(p.float(), y),
            precision="fp16",
            loss_scale=2.0**-8,
            steps=3,
            keep_fp32=keep,
        )

    first = run([]).recommend("v100", config=AdvisorConfig(small_model_params=0))  # type: ignore[attr-defined]
    assert first.finding("fp16_activation_overflow") is not None and "2" in first.keep_fp32
    again = run(first.keep_fp32)
    layers = again.tables["layers"]  # type: ignore[attr-defined]
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    assert int(acts[T.INF].sum()) == 0 and set(acts[acts[T.MODULE].isin(first.keep_fp32)][T.DTYPE]) == {
        "float32"
    }
    rec = again.recommend("v100", config=AdvisorConfig(small_model_params=0))  # type: ignore[attr-defined]
    assert rec.finding("fp16_activation_overflow") is None, rec.finding("fp16_activation_overflow")


class _RawFeatures(nn.Module):
    """head(body(x)) with ``body`` a Sequential: its first layer reads the model's own input, passed on by the
    container, whose forward computes nothing. body.0's weight is scaled down so that its output stays far
    inside fp16's range: only the input is over it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU()
        )
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.body[0].weight.mul_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _raw_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """regression_batches' with two input columns 4e4 times larger (un-normalised raw features)."""
    x, y = regression_batches(8)(step)
    return x * torch.tensor([4e4, 4e4, 1, 1, 1, 1, 1, 1]), y


def test_an_over_range_model_input_keeps_the_layer_that_reads_it(block_formats_on: None) -> None:
    """The model's own input, with values over 65504, reaches body.0 through the Sequential ``body``. Its row,
    ``body.0:input``, was taken for a function's output in body's forward: body was kept in fp32, every matmul
    under it counted as kept (3 of 4) and fp16 ruled out. body computed nothing: the layer that reads the
    input, body.0, is kept (1 of 4), and the remedy speaks of input features, not of a module's output."""
    run = train_profiled(_RawFeatures(), _raw_batches, nn.functional.mse_loss, steps=3)
    assert run.summary[T.SUMMARY_CAPTURE]["model_inputs"] == ["body.0:input"]
    rec = run.recommend("t4")
    assert rec.format == "fp16" and rec.keep_fp32 == ["body.0"], rec.reasons
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.modules == ["body.0:input"]
    over = sum(int(torch.isinf(_raw_batches(s)[0].half()).sum()) for s in range(3))  # a real cast
    assert over > 0 and f.numbers["overflow_values"] == over
    assert (
        "body.0:input is the model's own input: keep the layer reading it (body.0) in fp32, or normalise these "
        "input features" in f.remedy
    )
    assert "normalise their output" not in f.remedy


@pytest.mark.parametrize("call", ["keyword", "dict"])
def test_a_model_input_given_by_keyword_is_the_models_own_input(block_formats_on: None, call: str) -> None:
    """The same over-range input given as ``model(x=x)`` or ``model(**batch)``: the capture looked for the
    model's own input among the positional arguments only, so ``body.0:input`` was taken for a function's output
    in body's forward and the whole Sequential kept in fp32, as before the positional case was fixed. A keyword
    input is the model's own too: body.0 is kept, as with ``model(x)``."""
    model = _RawFeatures()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
    with prof:
        for step in range(3):
            x, y = _raw_batches(step)
            out = model(x=x) if call == "keyword" else model(**{"x": x})
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    assert prof.summary()["model_inputs"] == ["body.0:input"]
    rec = precprof.recommend(
        prof.tables(),
        hardware="t4",
        summary={T.SUMMARY_CAPTURE: prof.summary()},
        config=AdvisorConfig(small_model_params=0),  # a tiny model standing in for a large one
    )
    assert rec.format == "fp16" and rec.keep_fp32 == ["body.0"], rec.reasons
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and "body.0:input is the model's own input" in f.remedy


class _KeywordCall(nn.Module):
    """A linear layer given its input by keyword, ``self.fc(input=h)``, on values 1e5 times larger."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(input=x * 1e5)


@pytest.mark.parametrize("root", [False, True])
def test_a_layer_given_its_input_by_keyword_has_its_input_read(block_formats_on: None, root: bool) -> None:
    """``self.fc(input=h)``, or a model that is one ``nn.Linear`` called ``model(input=x)``: the pre-hook read
    the positional arguments only, so the layer had no ``:input`` row (the values it reads, here over fp16's
    range) and the model no ``model_inputs``. Read by keyword as by position: the overflows are a real cast's."""
    torch.manual_seed(0)
    model: nn.Module = nn.Linear(8, 4) if root else _KeywordCall()
    name = ":input" if root else "fc:input"
    over = {}
    with precprof.Profiler(model, sample_every=1, memory=False) as prof:
        for step in range(2):
            x = torch.randn(4, 8)
            big = x * 1e5
            over[step] = int(torch.isinf(big.half()).sum())
            (model(input=big) if root else model(x)).square().mean().backward()
            prof.step()
    layers = prof.tables()["layers"]
    rows = layers[layers[T.MODULE] == name].set_index(T.STEP)
    assert rows[T.NUMEL].to_dict() == {0: 32, 1: 32}
    assert rows["overflow_fp16"].to_dict() == over and over[0] > 0
    assert prof.summary()["model_inputs"] == ([":input"] if root else [])


def test_a_model_input_kept_in_fp32_is_not_counted_as_cast(block_formats_on: None) -> None:
    """The same model under fp16 autocast with ``body`` run outside it: body.0 reads the input in fp32 and
    casts nothing. The capture read autocast's state at the first recorded forward, body.0's, outside autocast,
    and took the run for one without autocast: every fp32 tensor counted as cast, and the re-profile still
    said to keep body.0 in fp32 for its fp16 overflow. autocast is seen where it is on (head's output is fp16 in
    this run). body.0 stays in the keep list all the same, said to be kept already: the input it reads unrounded
    would overflow fp16 were it released (a real cast; the list had dropped it, and a pasted snippet the wrapper)."""
    run = train_profiled(
        _RawFeatures(),
        _raw_batches,
        nn.functional.mse_loss,
        precision="fp16",
        loss_scale=2.0**-4,
        keep_fp32=["body"],
        steps=3,
    )
    acts = run.tables["layers"][run.tables["layers"][T.TENSOR] == T.ACTIVATION]
    dtypes = acts.groupby(T.MODULE, observed=True)[T.DTYPE].first()
    assert dtypes["head"] == "float16" and dtypes["body.0"] == "float32"
    assert run.summary[T.SUMMARY_CAPTURE]["autocast"]["enabled"] is True
    rec = run.recommend("t4")
    assert rec.finding("fp16_activation_overflow") is None and rec.keep_fp32 == ["body.0"]
    over = sum(int(torch.isinf(_raw_batches(step)[0].half()).sum()) for step in range(3))
    f = rec.finding("fp16_kept_fp32")
    assert (
        over > 0
        and f is not None
        and f"body.0: {over} values an fp16 cast makes inf in body.0's input" in f.message
    )


class _SqrtOfSquare(nn.Module):
    """fc2(sqrt(h * h)), h = ReLU(fc1(x)), with ``direct`` fc2(sqrt(h * h + 0 * sum(fc1.weight))): the
    forward is finite; sqrt's backward at 0 is inf, times 0 a nan in ReLU's output gradient wherever h == 0.
    ReLU's backward zeroes exactly those places: no weight gradient gets it. ``direct`` adds a path around the
    ReLU that carries it into fc1's gradient."""

    def __init__(self, direct: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        around = self.fc1.weight.sum() * 0.0 if self.direct else 0.0  # its gradient: inf times 0
        return self.fc2(torch.sqrt(h * h + around))


@pytest.mark.parametrize("direct", [False, True])
def test_a_backward_nan_no_weight_gradient_took_in_is_a_warning(direct: bool) -> None:
    """A nan in an activation gradient that ReLU's backward masks: every weight gradient finite, the run trains.
    It was a critical finding, "the optimizer step was not skipped for it", as if the update had been poisoned.
    It is a warning saying it was masked; a nan that does reach a weight gradient stays critical and says
    which. Counted here with a tensor hook on ReLU's output and the parameters' own gradients."""
    model = _SqrtOfSquare(direct)
    grads: list[torch.Tensor] = []

    def keep_grad(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: grads.append(g.detach()))

    model.act.register_forward_hook(keep_grad)
    finite: list[bool] = []
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = regression_batches(16)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(2):
            x, y = batches(step)
            nn.functional.mse_loss(model(x), y).backward()
            finite.append(all(bool(p.grad.isfinite().all()) for p in model.parameters()))
            opt.zero_grad(set_to_none=True)  # no update: the nan stays out of the weights in both variants
            prof.step()
    rec = precprof.recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    f = rec.finding("nonfinite_backward")
    assert f is not None and f.numbers["step"] == 0
    nan_in_act = int(grads[0].isnan().sum())
    assert nan_in_act > 0
    if not direct:
        assert finite == [True, True]
        assert f.severity == "warning" and f.modules == ["act"] and f.numbers["nan"] == nan_in_act
        assert "masked" in f.title and "the weight gradients stayed finite" in f.message
        assert "not skipped" not in f.message
    else:
        assert finite == [False, False]
        assert f.severity == CRITICAL and f.numbers["weight_grad_modules_nonfinite"] == 1
        assert "it reached the weight gradients of 1 module(s) (fc1)" in f.message


def test_c_benign_model_gets_bf16_on_bf16_hardware() -> None:
    run = benign.run()
    for target in (
        "a100",
        "h100",
        HardwareInfo(device="cpu", name="CPU with AMX", bf16_supported=True, bf16_native=True),
    ):
        rec = run.recommend(target)
        assert rec.format in ("bf16", "fp8")
        assert rec.keep_fp32 == [] and rec.loss_scale is None
        assert not [f for f in rec.findings if f.severity == CRITICAL]
    assert run.recommend("a100").format == "bf16"
    # a bf16 autocast run of the same model: mixed precision is active, bf16 again
    rec = benign.run("bf16").recommend("a100")
    assert rec.format == "bf16"
    assert rec.finding("mixed_precision_inactive") is None and rec.finding("mixed_precision_partial") is None


def test_d_injected_nan_names_the_first_module() -> None:
    run = nan_injection.run()
    rec = run.recommend("a100")
    f = rec.finding("nonfinite_forward")
    assert f is not None and f.severity == CRITICAL
    assert f.modules == ["inject"]
    assert f.numbers["step"] == nan_injection.NAN_STEP
    # independent: the first (step, forward order) with nan in the tables is the injected module
    acts = _rows(run.tables, T.ACTIVATION)
    first = acts[acts[T.NAN] > 0].sort_values([T.STEP, T.ORDER]).iloc[0]
    assert (first[T.STEP], first[T.MODULE]) == (nan_injection.NAN_STEP, "inject")


def _skipped_steps(steps: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in steps[steps[T.SKIPPED].astype(bool)][T.STEP])


@pytest.mark.parametrize("sample_every", [1, 5])
def test_d2_backward_nan_under_dynamic_scaling_is_dated_and_its_skips_counted(sample_every: int) -> None:
    """The nan enters in the backward pass at step 20 and stays 20 steps; GradScaler skips all of them. The
    finding must say step 20 (not the step where the backed-off scale fell below 1), name the module and the
    tensor, and say that the steps were skipped, with the count the steps table has. Step 20 is sampled
    either way; with sample_every 5 the message says the date comes from a sampled step."""
    run = backward_nan.run(sample_every=sample_every)
    skipped = _skipped_steps(run.tables["steps"])
    assert skipped == list(range(backward_nan.FIRST, backward_nan.LAST + 1))  # what really happened
    rec = run.recommend("v100")
    f = rec.finding("nonfinite_backward")
    assert f is not None and f.severity == CRITICAL and f.modules == ["inject"]
    assert f.numbers["step"] == backward_nan.FIRST and f.numbers["skipped"] == 1
    assert (f.numbers["skipped_from"], f.numbers["skipped_to"]) == (backward_nan.FIRST, backward_nan.LAST)
    assert f.numbers["skipped_steps"] == len(skipped)
    assert "the activation gradient of inject (Inject)" in f.message
    assert "skipped every step from 20 to 39 (20 steps" in f.message and "not skipped" not in f.message
    # the scale backed off below 1, written as GradScaler takes it (this recursed forever once)
    assert "from 2^16 (65536) to 2^-3 (0.125)" in f.message
    if sample_every == 1:
        assert f.message.startswith("At step 20,") and "sampled_before" not in f.numbers
    else:
        assert f.message.startswith("First recorded at sampled step 20 ")
        assert f.numbers["sampled_before"] == 15
    # independent: the last module in forward order with a nan gradient at step 20 is the injected one
    grads = _rows(run.tables, T.ACTIVATION_GRAD)
    at = grads[(grads[T.STEP] == backward_nan.FIRST) & (grads[T.NAN] > 0)]
    assert at.sort_values(T.ORDER).iloc[-1][T.MODULE] == "inject"
    assert rec.finding("nonfinite_forward") is None
    # no init_scale avoids a skip the model's own nan caused
    sc = rec.finding("scaler_skipped_steps")
    assert sc is not None and sc.numbers["from_model"] == len(skipped) and sc.numbers["avoidable"] == 0


def test_d2_backward_nan_under_a_static_scale_is_still_the_models() -> None:
    """The same nan, armed to the end of the run, under a static 2^16 (no back-off): its skips persist, and the
    finite gradients beside the nan come within 2^4 of fp16's limit at that scale. An overflow under a static
    scale looks like that too, but comes with infs; this nan comes with none, so it stays the model's, and
    the scaler "kept the scale at" 2^16 (it had said "backed the scale off from 2^16 to 2^16")."""
    run = backward_nan.run(last=backward_nan.STEPS - 1, static=True)
    steps = run.tables["steps"]
    assert _skipped_steps(steps) == list(range(backward_nan.FIRST, backward_nan.STEPS))
    assert set(steps[T.LOSS_SCALE]) == {2.0**16}
    layers = run.tables["layers"]
    armed = layers[layers[T.TENSOR].isin(T.GRADIENT_KINDS) & (layers[T.STEP] >= backward_nan.FIRST)]
    assert armed[T.INF].sum() == 0 and armed[T.NAN].sum() > 0
    finite = armed[T.ABSMAX][armed[T.ABSMAX].map(math.isfinite)]
    assert finite.max() * 2.0**16 * 2**4 >= 65504  # what alone would have read as an overflow's top
    rec = run.recommend("v100")
    f = rec.finding("nonfinite_backward")
    assert f is not None and f.severity == CRITICAL and f.modules == ["inject"]
    assert "kept the scale at 2^16 (65536)" in f.message and "backed the scale off" not in f.message


def test_d3_backward_nan_between_sampled_steps_is_an_upper_bound() -> None:
    """Armed from step 22 with layers sampled every 5 steps: the layer statistics first see the nan at step
    25, the steps table sees the skips from 22. The finding gives 25 as the first *sampled* step, names 20 as
    the sampled step before it, and counts the skips from 22 as the steps table has them."""
    first, last = 22, 41
    run = backward_nan.run(sample_every=5, first=first, last=last)
    skipped = _skipped_steps(run.tables["steps"])
    assert skipped == list(range(first, last + 1))
    grads = _rows(run.tables, T.ACTIVATION_GRAD)
    seen = int(grads[grads[T.NAN] > 0][T.STEP].min())
    assert seen == 25 and 20 in set(grads[T.STEP])  # sampled at 20 (finite), then at 25
    f = run.recommend("v100").finding("nonfinite_backward")
    assert f is not None and f.modules == ["inject"]
    assert f.numbers["step"] == seen and f.numbers["sampled_before"] == 20
    assert (f.numbers["skipped_from"], f.numbers["skipped_to"], f.numbers["skipped_steps"]) == (
        first,
        last,
        len(skipped),
    )
    assert f.message.startswith("First recorded at sampled step 25 ")
    assert "the one before is step 20" in f.message and "The skips began at step 22" in f.message


def test_e_accelerate_fp16_on_cpu_is_not_active() -> None:
    pytest.importorskip("accelerate")
    run, accelerator = accelerate_cpu_fp16.run()
    assert accelerator.mixed_precision == "fp16"  # what the user was told
    f = run.recommend("cpu").finding("mixed_precision_inactive")
    assert f is not None and f.severity == CRITICAL
    assert f.modules == ["0", "2", "4"]
    assert "autocast was off" in f.message
    # and indeed every Linear produced float32
    acts = _rows(run.tables, T.ACTIVATION)
    assert set(acts[acts[T.MODULE_TYPE] == "Linear"][T.DTYPE]) == {"float32"}


def test_f_advised_scale_skips_fewer_steps_than_the_default() -> None:
    # the gpt-mini check in miniature: a summed loss has gradients that overflow fp16 at 2^16
    fp32 = summed_loss.run()
    rec = fp32.recommend("v100")
    assert rec.format == "fp16", rec.reasons and rec.loss_scale is not None and rec.loss_scale < 2.0**16
    default = summed_loss.run("fp16", loss_scale=2.0**16)
    advised = summed_loss.run("fp16", loss_scale=rec.loss_scale)
    skipped_default = int(default.tables["steps"][T.SKIPPED].sum())
    skipped_advised = int(advised.tables["steps"][T.SKIPPED].sum())
    assert skipped_advised < skipped_default
    assert skipped_advised == 0
    # the advisor's account of the default run: how many skips, and that starting at 2^k avoids them
    f = default.recommend("v100").finding("scaler_skipped_steps")
    assert f is not None and f.numbers["skipped"] == skipped_default
    assert f.numbers["avoidable"] == skipped_default
    # and the advised fp16 run ends within 2% of fp32's loss (the default run, with steps lost, does not)
    assert abs(advised.losses[-1] - fp32.losses[-1]) / fp32.losses[-1] < 0.02
    assert abs(default.losses[-1] - fp32.losses[-1]) / fp32.losses[-1] > 0.02


def test_scenario_runs_are_deterministic() -> None:
    a, b = tiny_gradients.run(steps=2), tiny_gradients.run(steps=2)
    assert a.losses == b.losses
    torch.testing.assert_close(
        torch.tensor(a.tables["layers"][T.ABSMAX].to_numpy(dtype=float)),
        torch.tensor(b.tables["layers"][T.ABSMAX].to_numpy(dtype=float)),
        equal_nan=True,
        rtol=0,
        atol=0,
    )


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("PRECPROF_RUN_SLOW") != "1",
    reason="hours on a 2-core CPU (fp16 is emulated there): set PRECPROF_RUN_SLOW=1, or run bench/advisor_gpt_mini.py",
)
def test_gpt_mini_300_steps_at_the_advised_scale(tmp_path: Path) -> None:
    """Issue 5: gpt-mini, 300 steps: fp16 started at the recommended init_scale skips fewer steps than
    GradScaler's default 2^16 (or both skip none), and its final loss is within 2% of fp32's."""
    spec = importlib.util.spec_from_file_location("advisor_gpt_mini", ROOT / "bench" / "advisor_gpt_mini.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    verdict = bench.run_benchmark(workdir=tmp_path)["verdict"]
    assert verdict["advised_skips_fewer"] or verdict["skipped_default"] == verdict["skipped_advised"] == 0
    assert verdict["within_2_percent"], verdict


def test_recommend_takes_a_profiler() -> None:
    import precprof

    torch.manual_seed(0)
    model = benign.BenignNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = regression_batches(benign.N_IN)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(2):
            x, y = batches(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = benign.mse_first(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    rec = precprof.recommend(prof, hardware="a100", summary={T.SUMMARY_CONFIG: {"precision": "bf16"}})
    # a small model: fp32 by default, bf16 measured safe
    assert rec.format == "fp32" and rec.measured_format == "bf16"
    assert rec.finding("mixed_precision_inactive") is None
    # the Profiler's module shapes reach the alignment rule: head is Linear(64, 8), fc1 Linear(16, 64)
    assert rec.finding("tensor_core_alignment") is None
    assert precprof.recommend(prof, hardware="a100").measured_format == "bf16"


def test_g_lost_updates_in_bf16_weights_are_counted_and_critical() -> None:
    """A pure-bf16 loop at lr 1e-5: the updates that did not land are counted exactly (against independent
    hooks over every element), the finding is critical and names the cause; the same loop with fp32 weights
    moves them and gets only the what-if."""
    pure, truth = lost_updates.run(torch.bfloat16, lr=1e-5)
    assert truth.stuck > 0.9 * truth.intended  # almost nothing landed (only weights near zero move)
    wu = pure.tables["layers"]
    wu = wu[wu[T.TENSOR] == T.WEIGHT_UPDATE]
    assert int(wu[T.LOST_UPDATE_BF16].sum()) == truth.stuck
    assert int((wu[T.NUMEL] - wu[T.ZEROS]).sum()) == truth.intended > 0
    rec = pure.recommend()
    found = {f.code: f for f in rec.findings}
    lost = found["bf16_lost_updates"]
    assert lost.severity == "critical" and lost.numbers["share"] == truth.stuck / truth.intended
    assert lost.numbers["lost"] == truth.stuck and "left their bf16 weight unchanged" in lost.message
    # the bf16 verdict beside it names its condition: bf16 for compute, fp32 weights
    assert rec.format == "bf16"
    said = "bf16 for compute, fp32 for the master weights: this run holds its weights in bf16, where "
    assert any(
        r.startswith(said + f"{100 * lost.numbers['share']:.3g}% of their updates") for r in rec.reasons
    )

    master, truth32 = lost_updates.run(torch.float32, lr=1e-5)
    assert truth32.moved_any and truth32.stuck < 1e-3 * truth32.intended
    found32 = {f.code: f for f in master.recommend().findings}
    assert found32["bf16_lost_updates"].severity == "info"
    assert found32["bf16_lost_updates"].numbers["share"] > 0.5  # what bf16 weights would have lost


def test_g_the_lost_update_share_is_the_models_not_the_samples() -> None:
    """A bf16-pure model whose 64x64 layer loses every update (weights in [1, 2)) beside its bias and 8 shifts of
    64 zeros, which keep theirs: the update sample holds 256 of the layer's 4,096 weights and every element of
    the others, and the share summed the sample's counts, 30.8% where 87.7% of the model's updates were lost
    (tester h75: 22.1% for 91.8%). The finding, its what-if in fp32 weights, the per-layer table, the timeline and
    the dashboards' events count each parameter at its size, against independent hooks over every element."""
    from precprof.export.events import table_events

    pure, truth = lost_updates.run_sampled(torch.bfloat16)
    share = truth["stuck"].sum() / truth["intended"].sum()
    wu = _rows(pure.tables, T.WEIGHT_UPDATE)
    sampled = wu[T.LOST_UPDATE_BF16].sum() / (wu[T.NUMEL] - wu[T.ZEROS]).sum()
    assert share > 0.85 and sampled < 0.35  # the sample's own share is far from the model's
    lost = pure.recommend().finding("bf16_lost_updates")
    assert lost is not None and lost.severity == "critical"
    assert lost.numbers["share"] == pytest.approx(share, rel=1e-9)
    assert lost.numbers["sampled_share"] == pytest.approx(sampled, rel=1e-9)
    assert lost.numbers["update_sample"] == 256
    # a cap, which the page says it is: a 32x32 weight's strided sample holds 205 (h104 read "... per parameter
    # 256" beside rows of 205 and 228)
    assert ("elements sampled per parameter, at most", "256") in numbers.shown(
        "bf16_lost_updates", lost.numbers
    )
    assert wu[T.NUMEL].max() <= 256 and -(-1024 // records.sample_stride(1024, 256, 32)) == 205
    assert f"an estimated {100 * share:.3g}% of the intended weight-update elements" in lost.message
    assert (
        "estimated from a sample of at most 256 strided elements of each parameter, spread across its columns"
        in lost.method
    )
    by = truth.groupby(T.MODULE)[["stuck", "intended"]].sum()
    table = {r["module"]: r["lost_update_bf16"] for r in S.layer_records(pure.tables["layers"])}
    assert table["wide"] == pytest.approx(
        by.loc["wide", "stuck"] / by.loc["wide", "intended"]
    )  # weight and bias
    assert f"wide {100 * table['wide']:.3g}%" in lost.message
    tl = timeline.timeline(pure.tables["layers"])
    assert tl is not None and tl.update_format == "bf16"
    per_step = truth.groupby(T.STEP)[["stuck", "intended"]].sum()
    np.testing.assert_allclose(
        tl.share[tl.kinds.index(T.WEIGHT_UPDATE)], (per_step["stuck"] / per_step["intended"]).to_numpy()
    )
    events = {(e.tag, e.step): getattr(e, "value", None) for e in table_events(pure.tables)}
    for step, row in per_step.iterrows():  # (every update was intended: the events' share is of all of them)
        assert events[("precprof/lost_update/bf16/all", step)] == pytest.approx(
            row["stuck"] / row["intended"]
        )

    # fp32 weights: the what-if's share is the model's too
    master, truth32 = lost_updates.run_sampled(torch.float32)
    whatif = master.recommend().finding("bf16_lost_updates")
    assert whatif is not None and whatif.severity == "info"
    would = truth32["whatif_bf16"].sum() / truth32["intended"].sum()
    assert whatif.numbers["share"] == pytest.approx(would, rel=1e-9) and would > 0.85


def test_g_lost_updates_leave_out_a_skipped_layers_momentum_updates() -> None:
    """A pure-bf16 loop that skips a layer on odd steps (LayerDrop) and zeroes its gradients with
    ``zero_grad(set_to_none=False)``: the skipped layer's .grad is a zero tensor, AdamW moves it by momentum
    alone, and no backward reached it, so it has no weight-gradient row. Its moved elements were counted as
    training updates kept (a stuck one reads as no update), which lowered the share (tester h70: 16% for 18.8%;
    the layer 8.48% for 15.4% on the steps it trained). They are counted apart, in the finding and the table."""
    pure, truth = lost_updates.run_layers(torch.bfloat16, lr=1e-3, steps=8, skip="2")
    skipped = (truth[T.MODULE] == "2") & (truth[T.STEP] % 2 == 1)
    assert not truth.loc[skipped, "trained"].any() and truth.loc[skipped, "intended"].sum() > 0
    trained = truth[~skipped]
    assert trained["trained"].all()
    lost = pure.recommend().finding("bf16_lost_updates")
    assert lost is not None and lost.severity == "critical"
    assert (lost.numbers["lost"], lost.numbers["nonzero_updates"]) == (
        trained["stuck"].sum(),
        trained["intended"].sum(),
    )
    assert lost.numbers["share"] == pytest.approx(trained["stuck"].sum() / trained["intended"].sum())
    assert lost.numbers["zero_gradient_updates"] == truth.loc[skipped, "intended"].sum()
    assert "Left out: " in lost.message and "module(s) whose weight gradient was zero" in lost.message
    by = trained.groupby(T.MODULE)[["stuck", "intended"]].sum()
    table = {r["module"]: r["lost_update_bf16"] for r in S.layer_records(pure.tables["layers"])}
    for m in ("0", "2", "4"):
        assert table[m] == pytest.approx(by.loc[m, "stuck"] / by.loc[m, "intended"])
        # the worst, as the table has them, each name a name: '"0" 12.5%' (h104 read "worst: 16 90.2%, 58 90.2%")
        assert f'"{m}" {100 * table[m]:.3g}%' in lost.message
    tl = timeline.timeline(pure.tables["layers"])
    assert tl is not None and tl.update_format == "bf16"
    per_step = trained.groupby(T.STEP)[["stuck", "intended"]].sum()
    row = tl.share[tl.kinds.index(T.WEIGHT_UPDATE)]
    np.testing.assert_allclose(row, (per_step["stuck"] / per_step["intended"]).to_numpy())


def test_g_a_pure_bf16_runs_lost_updates_leave_out_a_layer_kept_in_fp32() -> None:
    """A pure-bf16 MLP whose last layer is kept in fp32 (HF's ``_keep_in_fp32_modules``, an MoE router): that
    layer's weights moved, yet the critical finding ('left their bf16 weight unchanged') added its bf16 what-if
    to the measured counts and named it among the worst (tester h70). The share is of the bf16 weights; the
    fp32 layer's what-if is said apart, and the layer is not listed."""
    pure, truth = lost_updates.run_layers(torch.bfloat16, lr=1e-4, fp32=("4",))
    in_bf16 = truth[truth[T.DTYPE] == "bfloat16"]
    in_fp32 = truth[truth[T.DTYPE] == "float32"]
    assert set(in_fp32[T.MODULE]) == {"4"} and in_fp32["stuck"].sum() == 0  # every fp32 update landed
    assert in_fp32["whatif_bf16"].sum() > 0.5 * in_fp32["intended"].sum()  # and would not have in bf16
    lost = pure.recommend().finding("bf16_lost_updates")
    assert lost is not None and lost.severity == "critical"
    assert (lost.numbers["lost"], lost.numbers["nonzero_updates"]) == (
        in_bf16["stuck"].sum(),
        in_bf16["intended"].sum(),
    )
    assert lost.numbers["share"] == pytest.approx(in_bf16["stuck"].sum() / in_bf16["intended"].sum())
    assert (lost.numbers["held_apart_updates"], lost.numbers["held_apart_lost"]) == (
        in_fp32["intended"].sum(),
        in_fp32["whatif_bf16"].sum(),
    )
    assert lost.modules == ["0", "2"] and 'worst: "0" ' in lost.message and '"4" ' not in lost.message
    assert 'module(s) whose weights are held in float32 ("4")' in lost.message
    # the per-layer table's cell of the fp32 layer is its bf16 what-if: greyed and said so, not a loss in red
    page = render_html(pure.tables, pure.summary)
    cells = re.findall(r'<td data-v="[^"]+" class="([^"]*)"( title="[^"]*")?>([^<]*%[^<]*)</td>', page)
    assert [(c, text.endswith("(what-if)")) for c, _, text in cells] == [
        ("bad", False),
        ("bad", False),
        ("zero", True),
    ]


def test_g_an_fp16_pure_runs_layer_table_shows_the_updates_lost_in_fp16() -> None:
    """A pure-fp16 MLP (AdamW, eps 1e-4 as fp16 needs) loses updates in its fp16 weights; the per-layer table
    showed only 'updates lost in BF16 weights', a what-if for a format the run does not use (tester h70). It
    shows the share lost in FP16, per layer, as the fp16_lost_updates finding counts it."""
    pure, truth = lost_updates.run_layers(torch.float16, lr=1e-4, eps=1e-4)
    assert (truth[T.DTYPE] == "float16").all() and truth["trained"].all()
    by = truth.groupby(T.MODULE)[["stuck", "intended"]].sum()
    assert (by["stuck"] > 0).all() and (by["stuck"] < by["intended"]).all()
    lost = pure.recommend().finding("fp16_lost_updates")
    assert lost is not None and lost.severity == "critical"
    assert lost.numbers["share"] == pytest.approx(by["stuck"].sum() / by["intended"].sum())
    table = {r["module"]: r["lost_update_fp16"] for r in S.layer_records(pure.tables["layers"])}
    for m in ("0", "2", "4"):
        assert table[m] == pytest.approx(by.loc[m, "stuck"] / by.loc[m, "intended"])
    page = render_html(pure.tables, pure.summary)
    assert "updates lost in FP16 weights, of those intended" in page
    assert "updates lost in BF16 weights" not in page
    cells = re.findall(r'<td data-v="([^"]+)" class="[^"]*">[^<]*%</td>', page)
    assert [float(v) for v in cells] == pytest.approx([table[m] for m in ("0", "2", "4")])


def test_g_an_fp16_pure_run_that_loses_few_updates_is_told_so_at_info() -> None:
    """Below the 1% at which a lost update warns, a pure-fp16 run's loss went unsaid (an fp16-pure GPT-NeoX lost
    0.1-1% of its updates a step, and no finding named it), while a bf16-pure run's was an info line. It is one
    too, its share the truth's; the fp16 what-if of a run with fp32 weights stays unsaid below the line."""
    pure, truth = lost_updates.run_layers(torch.float16, lr=3e-3, eps=1e-4)
    stuck, intended = truth["stuck"].sum(), truth["intended"].sum()
    assert 0 < stuck < 0.01 * intended
    lost = pure.recommend().finding("fp16_lost_updates")
    assert lost is not None and lost.severity == "info"
    assert lost.numbers["share"] == pytest.approx(stuck / intended)
    assert "this fp16-pure run holds its weights in fp16" in lost.message
    fp32, _ = lost_updates.run_layers(torch.float32, lr=3e-3)
    layers = fp32.tables["layers"]
    wu = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    whatif = wu[T.LOST_UPDATE_FP16].sum() / (wu[T.NUMEL] - wu[T.ZEROS]).sum()
    assert 0 < whatif < 0.01  # updates fp16 weights would have lost: a what-if below the line
    assert fp32.recommend().finding("fp16_lost_updates") is None


def _ratio_median(truth: pd.DataFrame) -> float:
    """The median over the layers of each layer's median update-to-weight ratio ||dw|| / ||w|| over its steps,
    from the truth's squared norms (a layer's weight and bias together)."""
    per = truth.groupby([T.MODULE, T.STEP])[["du", "dw"]].sum()
    ratio = np.sqrt(per["du"] / per["dw"])
    return float(np.median(ratio.groupby(level=0).median()))


def test_g_an_fp32_run_whose_updates_do_not_land_is_warned() -> None:
    """An fp32 MLP, SGD, its gradients clipped to a norm of 1e-6: the updates fall below half an fp32 ulp of the
    weights, which hardly move. The only findings were info what-ifs ('would be lost if the weights were held in
    bf16', remedy 'keep fp32 master weights', which it has; tester h70). A warning says that the run's own fp32
    weights did not change, measured, with the update-to-weight ratio and a remedy on the learning rate and the
    clip; the what-if says how many of its updates the fp32 weights lost already."""
    run, truth = lost_updates.run_layers(torch.float32, lr=1e-2, sgd=True, clip=1e-6)
    assert (truth[T.DTYPE] == "float32").all() and truth["trained"].all()
    assert truth["stuck"].sum() > 0.5 * truth["intended"].sum()  # most updates did not land in fp32
    found = run.recommend()
    stuck = found.finding("fp32_lost_updates")
    assert stuck is not None and stuck.severity == "warning"
    assert (stuck.numbers["lost"], stuck.numbers["nonzero_updates"]) == (
        truth["stuck"].sum(),
        truth["intended"].sum(),
    )
    assert stuck.numbers["ratio_median"] == pytest.approx(_ratio_median(truth), rel=1e-6)
    assert "learning rate" in stuck.remedy and "clip" in stuck.remedy
    # the what-ifs' remedy was 'Keep fp32 master weights', which the run has and which lost them too: it names the
    # update scale, as fp32_lost_updates does
    for fmt in ("bf16", "fp16"):
        whatif = found.finding(f"{fmt}_lost_updates")
        assert whatif is not None and whatif.severity == "info"
        assert whatif.numbers["lost_in_fp32"] == truth["stuck"].sum()
        assert "Keep fp32 master weights" not in whatif.remedy
        assert whatif.remedy.startswith("Raise the learning rate, or loosen a gradient clip")
        assert f"lost {100 * stuck.numbers['share']:.3g}% of them too (fp32_lost_updates)" in whatif.remedy
    # the same run with its updates landing (AdamW at 1e-3): no such warning
    healthy, truth = lost_updates.run_layers(torch.float32, lr=1e-3)
    found = healthy.recommend()
    assert truth["stuck"].sum() == 0 and found.finding("fp32_lost_updates") is None
    whatif = found.finding("bf16_lost_updates")  # there, fp32 master weights are the remedy
    assert whatif is not None and whatif.remedy.startswith("Keep fp32 master weights (bf16 autocast does)")
    # the run holds no weight in bf16: the bf16 verdict has no condition on its weights
    assert found.format == "bf16" and not any("master weights" in r for r in found.reasons)


def test_g_a_run_made_bf16_mid_run_has_its_lost_updates_measured_from_that_step() -> None:
    """An fp32 MLP trained with SGD, then ``model.to(torch.bfloat16)`` before step 4 of 6: its bf16 weights
    really lose updates from there, but bf16_lost_updates was an info what-if ('would be lost if the weights
    were held in bf16', remedy 'keep fp32 master weights'), 'pure' decided by the majority of rows over the
    whole run (tester h67). The rows held in bf16 are measured, critical, from the step named; the fp32 steps'
    what-if is said apart."""
    run, truth = lost_updates.run_layers(torch.float32, lr=1e-2, sgd=True, bf16_from=4)
    in_bf16 = truth[truth[T.DTYPE] == "bfloat16"]
    in_fp32 = truth[truth[T.DTYPE] == "float32"]
    assert set(in_bf16[T.STEP]) == {4, 5} and set(in_fp32[T.STEP]) == {0, 1, 2, 3}
    assert in_bf16["stuck"].sum() > 0.5 * in_bf16["intended"].sum()
    lost = run.recommend().finding("bf16_lost_updates")
    assert lost is not None and lost.severity == "critical"
    assert (lost.numbers["lost"], lost.numbers["nonzero_updates"]) == (
        in_bf16["stuck"].sum(),
        in_bf16["intended"].sum(),
    )
    assert (lost.numbers["held_apart_updates"], lost.numbers["held_apart_lost"]) == (
        in_fp32["intended"].sum(),
        in_fp32["whatif_bf16"].sum() + in_fp32["stuck"].sum(),  # (a few did not land in fp32 either)
    )
    assert lost.numbers["held_from_step"] == 4
    assert "holds its weights in bf16 from step 4 on" in lost.message
    assert "whose weights were held in float32 before step 4" in lost.message


def test_g_a_bf16_layer_that_joins_the_optimizer_mid_run_is_no_switch_to_bf16() -> None:
    """An fp32 MLP whose layer 2 is held in bf16 (a pretrained table loaded so) and frozen, added to the optimizer
    at step 3 (gradual unfreezing): no weight changed dtype, yet bf16_lost_updates said the run 'holds its
    weights in bf16 from step 3 on, where they became bf16 (float32 before: a model.to(torch.bfloat16) mid-run)'
    (tester h73): the first bf16 row of any weight came after rows of the others. A switch is a weight whose
    own earlier rows were in another dtype. Layer 2's updates lost in its bf16 weights are measured, critical,
    and the fp32 layers' what-if is said apart (they were pooled with them, an info 'would be lost if the
    weights were held in bf16', before the switch was read into it)."""
    run, truth = lost_updates.run_layers(torch.float32, lr=1e-4, bf16=("2",), joins=3)
    held = truth[truth[T.DTYPE] == "bfloat16"]
    assert set(held[T.MODULE]) == {"2"} and set(held[T.STEP]) == {3, 4, 5}
    assert set(truth.loc[truth[T.MODULE] == "2", T.DTYPE]) == {"bfloat16"}  # never another dtype
    assert held["stuck"].sum() > 0.5 * held["intended"].sum()
    lost = run.recommend().finding("bf16_lost_updates")
    assert lost is not None and "held_from_step" not in lost.numbers
    assert "became bf16" not in lost.message and "mid-run" not in lost.message
    assert lost.severity == "critical" and lost.modules == ["2"]
    assert (lost.numbers["lost"], lost.numbers["nonzero_updates"]) == (
        held["stuck"].sum(),
        held["intended"].sum(),
    )
    in_fp32 = truth[truth[T.DTYPE] == "float32"]
    assert (lost.numbers["held_apart_updates"], lost.numbers["held_apart_lost"]) == (
        in_fp32["intended"].sum(),
        in_fp32["whatif_bf16"].sum() + in_fp32["stuck"].sum(),
    )
    assert 'this run holds these weights in bf16 ("2")' in lost.message
    assert lost.remedy.startswith('Hold "2" in fp32 too')


def test_g_a_bf16_verdict_beside_a_few_bf16_weights_that_lose_their_updates_names_fp32_master_weights() -> (
    None
):
    """An fp32 MLP whose layer 2 is held in bf16 loses that layer's updates (bf16_lost_updates, critical: 'hold
    2 in fp32 too'), while the verdict said bf16, 'the measurements allow BF16' in the box of the small model's
    fp32, and nothing of the weights (h103). The verdict names the condition, bf16 for compute and fp32 for the
    master weights of layer 2, in its reasons and in the box."""
    run, truth = lost_updates.run_layers(torch.float32, lr=1e-4, steps=3, bf16=("2",))
    held = truth[truth[T.DTYPE] == "bfloat16"]
    share = held["stuck"].sum() / held["intended"].sum()
    assert set(held[T.MODULE]) == {"2"} and share > 0.5
    said = (
        f'bf16 for compute, fp32 for the master weights: this run holds "2" in bf16, where {100 * share:.3g}% of its '
        ""
        "updates vanish (bf16_lost_updates); hold it in fp32 too (.float() before the optimizer is made)"
    )
    for cfg in (None, AdvisorConfig()):  # the tree's bf16, and the small model's fp32 that allows bf16
        rec = run.recommend(config=cfg)
        lost = rec.finding("bf16_lost_updates")
        assert lost is not None and lost.severity == "critical"
        assert lost.numbers["share"] == pytest.approx(share)
        assert rec.measured_format == "bf16" and rec.format == ("bf16" if cfg is None else "fp32")
        assert any(r.startswith(said) or r.startswith(f"bf16: {said}") for r in rec.reasons), rec.reasons
    # the verdict box of the advisor as users get it (fp32, bf16 allowed), rendered alone: a whole page's context
    # takes seconds
    box_of = report_context._verdict(rec.to_dict(), run.summary, {}, [])
    page = (
        environment()
        .get_template("_verdict.html.j2")
        .render(
            section={"id": "verdict", "number": 1, "heading": "Verdict"},
            verdict=box_of,
            skipped_tensors=[],
            findings=[],
            severity_counts={},
        )
    )
    box = re.search(r'<div class="sub" id="verdict-master-weights">(.*?)</div>', page)
    assert 'id="measured-format"' in page and box is not None
    assert box.group(1) == (
        f"BF16 for compute, with FP32 master weights: {100 * share:.3g}% of the updates to the weights this run "
        "holds in BF16 vanish there (see the critical finding bf16_lost_updates and Why)"
    )


@pytest.mark.parametrize("idle", ["frozen", "warmup"])
def test_g_steps_and_groups_at_learning_rate_0_are_left_out_of_the_update_ratio(idle: str) -> None:
    """A param group frozen by lr=0 (module 2) and a warmup from 0 (step 0's learning rate is 0) made no update,
    and the lost-update counts leave them out; the update-to-weight ratio took them as 0 ('the layer barely
    trains'), module 2's median 0 pulling the run's median down, step 0 a ratio of 0 in every layer (tester
    h70). They are left out of it: the ratios are those of the steps and groups whose learning rate was not 0."""
    run, truth = lost_updates.run_layers(
        torch.float32, lr=1e-3, **({"frozen": ("2",)} if idle == "frozen" else {"warmup": 3})
    )
    assert (truth.loc[truth["lr"] == 0, "du"] == 0).all() and (truth["lr"] == 0).any()
    trained = truth[truth["lr"] > 0]
    per = trained.groupby([T.MODULE, T.STEP])[["du", "dw"]].sum()
    ratio = np.sqrt(per["du"] / per["dw"]).groupby(level=0)
    summary = update_ratio.summary(run.tables["layers"])
    assert summary is not None
    got = {r["module"]: r for r in summary["layers"]}
    assert set(got) == set(ratio.groups)  # module 2 (frozen) has no ratio; every other module does
    for m, r in got.items():
        assert r["median"] == pytest.approx(ratio.median()[m], rel=1e-6)
        assert r["steps"] == ratio.size()[m]  # the warmup's step 0 is no step of the ratio
    assert summary["ratio_median"] == pytest.approx(_ratio_median(trained), rel=1e-6)


def test_h_unscaled_fp16_that_flushes_its_gradients_is_warned(tmp_path: Path) -> None:
    """fp16 without loss scaling on a model whose gradients are 2^-20 of the usual (tests/compare_models.py):
    they flush to zero, training stalls, and the counts at scale 1 see nothing (a flushed value is a zero).
    The advisor warns from the evidence (the zeros, in modules that hold no nonzero gradient value, and the loss
    not moving), critically as training stalled, and recommends the scale that the fp16:advised run of test_compare trains with."""
    from precprof.training import TrainConfig, train

    cfg = TrainConfig(
        model=str(Path(__file__).parent / "compare_models.py") + ":tiny_gradient_lm",
        precision="fp16",
        loss_scale="none",
        optimizer="sgd",
        lr=2e5,
        steps=20,
        batch_size=4,
        seq_len=16,
        sample_every=5,
        progress=False,
        report=False,
        out=tmp_path / "run",
    )
    train(cfg)
    rec = T.read_summary(tmp_path / "run")[T.SUMMARY_RECOMMENDATION]
    found = {f["code"]: f for f in rec["findings"]}
    under = found["fp16_gradient_underflow"]
    # critical, as training stalled, and said first (it opened with "0% ... flush": the exact counts of the
    # gradients that were not fp16, which see nothing of what flushed)
    assert under["severity"] == "critical" and under["title"].startswith("fp16 gradients flushed to zero")
    assert under["message"].startswith("This fp16 run trained without loss scaling")
    assert "training stalled" in under["message"]
    nums = under["numbers"]
    assert nums["fp16_flushed"] and nums["fp16_zero_share"] > 0.5
    assert abs(nums["loss_change"]) < 0.02
    # the independent check: the same tensors' zeros in the layers table. The modules flushed hold no nonzero
    # value at all (the one other, scale_grad, has no zero), so no smallest nonzero value of theirs is shown. The
    # flushed share is theirs: scale_grad's output no matmul read, so a zero there could be a mask's, and its
    # values are not counted (its gradient comes from the loss)
    layers = T.read_tables(tmp_path / "run")["layers"]
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.DTYPE] == "float16")]
    assert nums["fp16_zero_share"] == ag[T.ZEROS].sum() / ag[T.NUMEL].sum()
    per = ag.groupby(T.MODULE)[[T.ZEROS, T.NUMEL]].sum()
    empty = sorted(per.index[per[T.ZEROS] == per[T.NUMEL]])
    assert empty == ["act", "fc", "head"] and (per.loc[["scale_grad"], T.ZEROS] == 0).all()
    flushed = per.loc[empty, T.ZEROS].sum() / per.loc[empty, T.NUMEL].sum()
    assert nums["fp16_flushed_zero_share"] == flushed == 1.0 and nums["fp16_smallest_nonzero"] is None
    assert "(fc, act, head held no nonzero value)" in under["message"]
    assert f"GradScaler(init_scale={int(rec['fp16_loss_scale'])})" in under["remedy"]


def test_i_gradscaler_without_autocast_is_mixed_precision_inactive() -> None:
    """A user's loop with an enabled GradScaler and no autocast: fp16 was asked for and never ran."""
    run = own_loop.scaler_loop(autocast=False)
    found = {f.code: f for f in run.recommend().findings}
    f = found["mixed_precision_inactive"]
    assert f.severity == CRITICAL and "implied by the enabled GradScaler" in f.message
    with_autocast = own_loop.scaler_loop(autocast=True)
    assert "mixed_precision_inactive" not in {f.code for f in with_autocast.recommend().findings}


def test_j_clipping_before_unscale_is_found() -> None:
    """The norm measured before ``scaler.unscale_`` is 2^12 times the true one; measured after, it is not."""
    bad = own_loop.scaler_loop(autocast=False, clip=True, unscale_first=False)
    f = {f.code: f for f in bad.recommend().findings}["grad_norm_scaled"]
    assert f.numbers["scaled_steps"] == f.numbers["steps"] == 4 and f.numbers["loss_scale"] == 2.0**12
    assert 2.0**12 <= f.numbers["median_ratio"] < 2.0**13  # the histogram's lower edge: within [1, 2) x scale
    good = own_loop.scaler_loop(autocast=False, clip=True, unscale_first=True)
    assert "grad_norm_scaled" not in {f.code for f in good.recommend().findings}
    # a scale that is no power of two is named as the run had it, not rounded to one it never had (2^10 for 1000)
    odd = own_loop.scaler_loop(autocast=False, clip=True, unscale_first=False, init_scale=1000.0)
    f = {f.code: f for f in odd.recommend().findings}["grad_norm_scaled"]
    assert f.numbers["loss_scale"] == 1000.0 and "loss scale 1000 (2^9.97))" in f.message


def test_k_manual_static_loss_scale_is_read_at_its_scale() -> None:
    """(loss * 1024).backward() with the gradients divided after, declared as Profiler(loss_scale=1024):
    the gradient histograms are the unscaled run's, bin for bin, and the steps record the scale."""
    plain = own_loop.manual_scaling(None)
    scaled = own_loop.manual_scaling(1024.0)
    assert plain.losses == scaled.losses
    h0, h1 = plain.tables["histograms"], scaled.tables["histograms"]
    grads = [T.ACTIVATION_GRAD, T.WEIGHT_GRAD]
    a = h0[h0[T.TENSOR].isin(grads)].reset_index(drop=True)
    b = h1[h1[T.TENSOR].isin(grads)].reset_index(drop=True)
    assert len(a) and a.equals(b)
    assert set(scaled.tables["steps"][T.LOSS_SCALE]) == {1024.0}
    # a scale that is no power of two shifts the histograms by a rounded log2: within one binade, and said so
    # (the summary said exact, so the report left its caveat out)
    assert scaled.summary[T.SUMMARY_CAPTURE]["histogram_shift_exact"] is True
    odd = own_loop.manual_scaling(1000.0)
    assert odd.summary[T.SUMMARY_CAPTURE]["histogram_shift_exact"] is False
    rows = dict(capture_rows(odd.summary[T.SUMMARY_CAPTURE], {}))
    assert rows["histograms"].startswith("unscaled by a loss scale that is not a power of two")
    with pytest.raises(ValueError, match=r"with a GradScaler \(scaler=\) leave it out"):
        precprof.Profiler(torch.nn.Linear(2, 2), scaler=torch.amp.GradScaler("cpu"), loss_scale=8.0)


def test_l_what_the_guide_keeps_in_fp32_found_in_bf16() -> None:
    """A model cast to bf16: norms and softmax ran in bf16, BatchNorm's running statistics and AdamW's states
    are bf16; each is a finding naming what it found (the BatchNorm both name, said so), and the modules go into
    keep_fp32. Under autocast none.
    torch's LayerNorm computes in fp32 inside, its bf16 output rounded once: said so, not named."""
    pure = fp32_ops.run(pure=True)
    rec = pure.recommend("a100")
    assert rec.format == "bf16"
    found = {f.code: f for f in rec.findings}
    ops = found["bf16_fp32_ops"]
    assert (
        set(ops.modules) == {"bn", "attn"}
        and "(ln also produced bfloat16 outputs, but torch's" in ops.message
    )
    bufs = found["low_precision_buffers"]
    assert set(bufs.modules) == {"bn"} and "bn.running_mean (bfloat16)" in bufs.message
    # the BatchNorm both findings name: one cast back fixes both, said in the buffers' finding
    assert "bn also computed in 16-bit (bf16_fp32_ops): one .float() of each keeps both" in bufs.message
    opt = found["low_precision_optimizer_states"]
    assert opt.numbers["low_precision_bytes"] > 0.9 * opt.numbers["bytes"]  # all but the fp32 step counters
    assert {"bn", "attn"} <= set(rec.keep_fp32) and "ln" not in rec.keep_fp32
    mixed = fp32_ops.run(pure=False)
    found = {f.code: f for f in mixed.recommend("a100").findings}
    assert not set(found) & {"low_precision_buffers", "low_precision_optimizer_states"}
    # CPU autocast itself ran the norms in bf16 (CUDA autocast would not): information, no keep list
    if "bf16_fp32_ops" in found:
        assert found["bf16_fp32_ops"].severity == "info" and "CUDA autocast" in found["bf16_fp32_ops"].message
    assert not set(mixed.recommend("a100").keep_fp32) & {"bn", "ln", "attn"}


def test_m_no_fp16_scale_that_raises_underflow_is_proposed() -> None:
    """Where the only overflow-safe fp16 scale (2^-12 here) flushes more gradient values than the run lost at
    its own scale, every fp16 remedy says bf16 or fp32 instead of proposing it."""
    rec = huge_gradients.run().recommend("v100")
    found = {f.code: f for f in rec.findings}
    under = found["fp16_gradient_underflow"]
    assert under.numbers["loss_scale_log2"] < under.numbers["run_scale_log2"] == 0
    assert under.numbers["share_at_recommended"] > under.numbers["share_at_run_scale"] + 0.01
    for code in ("fp16_gradient_underflow", "fp16_gradient_overflow", "fp16_loss_scale"):
        assert "bf16 or fp32" in found[code].remedy, code
        assert "Start" not in found[code].remedy, code
    assert rec.format != "fp16"


def test_a_loss_computed_in_bf16_by_a_function_is_found() -> None:
    """F.cross_entropy on a bf16 model's logits: no loss module to see, but the loss tensor was bf16. The
    finding gives the spacing of bf16 at the final loss, and the run shows it: every recorded loss sits on the
    bf16 grid, and it is off the fp32 loss of the same logits by more than half that spacing (each token's
    log-probability was rounded too, not only the mean: measured 1.4 spacings at worst). With the logits cast
    to fp32 first (the remedy) the loss is the fp32 one and nothing is found."""
    bf16 = low_precision_loss.run(fp32_loss=False)
    found = {f.code: f for f in bf16.recommend("a100").findings}
    loss = found["bf16_loss"]
    assert loss.severity == "warning" and "bfloat16 on 12 of 12 steps" in loss.message
    final = bf16.losses[-1]
    spacing = 2.0 ** (math.floor(math.log2(final)) - 7)
    assert loss.numbers["final_loss"] == final and loss.numbers["spacing"] == spacing
    assert f"{spacing:.3g} apart" in loss.message
    # the problem is real in this run: the losses are bf16 values, rounded from the fp32 loss of their logits
    assert all(torch.tensor(got).to(torch.bfloat16).item() == got for got in bf16.losses)
    off = [abs(got - exact) for got, exact in zip(bf16.losses, bf16.fp32_losses, strict=True)]
    assert max(off) > spacing / 2
    assert "bf16_fp32_ops" not in found  # no module computed it: only the loss tensor told
    fixed = low_precision_loss.run(fp32_loss=True)
    assert fixed.losses == fixed.fp32_losses
    assert not {"bf16_loss", "fp16_loss"} & {f.code for f in fixed.recommend("a100").findings}
    assert fixed.summary[T.SUMMARY_CAPTURE]["loss_dtypes"] == {"float32": 12}


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.proj = torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.proj.weight.mul_(2.0**-20)  # brings the values back into range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.exp(self.a(x)) * 2.0**14)  # a function's output past fp16's range


def test_a_function_output_past_fp16_keeps_the_module_that_ran_it_in_fp32() -> None:
    """With block formats on, proj's input (a function's output, no module's) has a row of its own,
    ``block.proj:input``; its values overflow fp16, and what the advisor keeps in fp32 for fp16 is the module
    whose forward ran the function, ``block``, a real module the snippet can look up (not the row's name)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("block", _Block())
    for i in range(4):  # layers fp16 can run
        model.add_module(f"out{i}", torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    batches = regression_batches(8, seed=2)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=True)
    with prof:
        for step in range(2):
            x, y = batches(step)
            loss = torch.nn.functional.mse_loss(model(x).mean(-1, keepdim=True), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    layers = prof.tables()["layers"]
    row = layers[(layers[T.MODULE] == "block.proj:input") & (layers[T.TENSOR] == T.ACTIVATION)]
    assert len(row) == 2 and (row[T.ABSMAX] > 65504).all()
    rec = precprof.recommend(
        prof.tables(),
        hardware="t4",
        summary={T.SUMMARY_CAPTURE: prof.summary()},
        config=AdvisorConfig(small_model_params=0),  # a tiny model standing in for a large one
    )
    assert rec.format == "fp16", rec.reasons
    found = {f.code: f for f in rec.findings}
    assert "block.proj:input" in found["fp16_activation_overflow"].modules
    assert "block" in rec.keep_fp32 and not any(m.endswith(T.INPUT_SUFFIX) for m in rec.keep_fp32)
    # block.a reads the model's own input; block.proj a function's output in block's forward
    assert prof.summary()["model_inputs"] == ["block.a:input"]
    for name in rec.keep_fp32:
        model.get_submodule(name)  # what the configuration snippet does with each


class _ListStream(torch.nn.Module):
    """An un-normalised residual stream: ``big`` writes about 1e5 into it, and the layers of the ModuleList
    ``post`` (called one by one by this forward, never through ``post``) and ``head`` read it."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(8, 8)
        self.post = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.big.weight.mul_(1e6)
            for m in (*self.post, self.head):
                m.weight.mul_(1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.big(x)
        for layer in self.post:
            h = h + layer(h)  # the add runs in this forward: the input rows post.0:input and post.1:input
        return self.head(h)


def test_a_layer_of_a_module_list_whose_input_overflows_fp16_is_kept_itself(block_formats_on: None) -> None:
    """post.0's input is a function's output (an add in the root's forward) past fp16's range. Its name's parent,
    the ModuleList ``post``, has no forward that runs: keeping it in fp32 kept nothing, and fp16 training at the
    advised scale was nan on every step. The advisor keeps post.0 and post.1 themselves (the add ran in the root,
    which would keep the whole model), and fp16 autocast with that list trains with finite losses."""
    torch.manual_seed(0)
    fp32 = train_profiled(
        _ListStream(), regression_batches(8, seed=3), torch.nn.functional.mse_loss, steps=2, lr=1e-6
    )
    assert fp32.summary[T.SUMMARY_CAPTURE]["modules_without_forward"] == ["post"]
    rec = fp32.recommend("v100")
    over = rec.finding("fp16_activation_overflow")
    assert over is not None and {"post.0:input", "post.1:input"} <= set(over.modules)
    assert rec.fp16_keep_fp32 == ["big", "post.0", "post.1", "head"], rec.fp16_keep_fp32
    torch.manual_seed(0)
    fp16 = train_profiled(
        _ListStream(),
        regression_batches(8, seed=3),
        torch.nn.functional.mse_loss,
        precision="fp16",
        loss_scale=rec.fp16_loss_scale,
        keep_fp32=rec.fp16_keep_fp32,
        steps=3,
        lr=1e-6,
    )
    assert all(math.isfinite(v) for v in fp16.losses), fp16.losses


def test_g_a_norm_whose_fp16_weight_never_moves_is_named_as_hardly_training() -> None:
    """An fp16-pure model, AdamW at 5e-5 (betas (0, 0.999): a step is at most 2.45 lr in 6 steps): a LayerNorm's
    weights sit at 1.0, where half an fp16 ulp (2^-12 below 1) exceeds every step, so none of their updates
    lands, while the linear layers' small weights take theirs. The finding names that parameter as hardly
    training, its share the truth's (read around optimizer.step()), where its layer's share (its bias takes its
    updates) would hide it; where the model's share is under the line a user sets (``lost_update_warn``), that
    parameter alone makes the finding a warning, not an info line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.LayerNorm(512), nn.GELU(), nn.Linear(512, 512), nn.GELU())
    model.append(nn.Linear(512, 1))
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.mul_(0.05)
    model = model.half()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, eps=1e-4, betas=(0.0, 0.999))
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, update_sample=1 << 20)
    g = torch.Generator().manual_seed(3)
    truth: dict[str, list[int]] = {}
    with prof:
        for _ in range(6):
            x, y = torch.randn(32, 64, generator=g).half(), torch.randn(32, 1, generator=g)
            loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            before = {n: (p.detach().clone(), p.grad.detach().clone()) for n, p in model.named_parameters()}
            opt.step()
            for n, p in model.named_parameters():
                w0, grad = before[n]
                moved = p.detach() != w0
                intended = (grad != 0) | moved
                t = truth.setdefault(n, [0, 0])
                t[0] += int((intended & ~moved).sum())
                t[1] += int(intended.sum())
            opt.zero_grad()
            prof.step(loss=loss.detach())
    assert truth["1.weight"][0] == truth["1.weight"][1] > 0  # no update of the norm's weight landed
    share = sum(t[0] for t in truth.values()) / sum(t[1] for t in truth.values())
    found = precprof.recommend(prof, hardware="h100").finding("fp16_lost_updates")
    assert found is not None and found.numbers["share"] == pytest.approx(share)
    assert found.severity == "critical" and found.modules[0] == "1"
    # the layer's share ("1" about 52%: its bias takes every update) hides its weight's: named too
    assert '"1" 52.' in found.message and 'so they hardly train: "1".weight 100%' in found.message, (
        found.message
    )
    lenient = precprof.recommend(prof, hardware="h100", config=AdvisorConfig(lost_update_warn=0.1))
    lost = lenient.finding("fp16_lost_updates")
    assert share < 0.1 and lost is not None and lost.severity == "warning" and lost.modules[0] == "1"
    assert lost.numbers["param_share_max"] == 1.0
    assert 'so they hardly train: "1".weight 100%' in lost.message, lost.message
