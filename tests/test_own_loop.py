"""The user's own loop: the gradient norm taken from its clip_grad_norm_, the model's class and the precision
the profiler saw it train in; and a run that diverges, as the advisor and the report tell it.

Everything here is a real tiny training loop on CPU; the numbers are checked against norms computed
independently from the gradients and against the steps the loop itself saw.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from scenarios.loop import backward_and_step
from torch import nn

import precprof
from precprof import clipwatch
from precprof import tables as T
from precprof.analysis import advisor
from precprof.analysis.advisor import AdvisorConfig
from precprof.report import plots, render_run_dir

ORIGINAL_CLIP = torch.nn.utils.clip_grad_norm_


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def clipped_loop(
    profile: bool, steps: int = 5, other: nn.Module | None = None
) -> tuple[list[float], list[float], dict[str, torch.Tensor], precprof.Profiler | None]:
    """SGD with clip_grad_norm_ at 0.5 every step; returns the losses, the norms computed independently from
    the gradients before clipping, the final weights and the profiler."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = precprof.Profiler(model, opt, sample_every=2, memory=False) if profile else None
    losses, norms = [], []
    if prof is not None:
        prof.attach()
    try:
        for step in range(steps):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            grads = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.cat(grads))))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # looked up at call time, as nanoGPT does
            if other is not None:  # another model's clip in the same step is not this model's norm
                other(x).sum().backward()
                torch.nn.utils.clip_grad_norm_(other.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if prof is not None:
                prof.step(loss=loss.detach())
    finally:
        if prof is not None:
            prof.detach()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, prof


def test_grad_norm_comes_from_the_loops_clip_grad_norm() -> None:
    losses, norms, weights, prof = clipped_loop(profile=True)
    assert prof is not None
    steps = prof.tables()["steps"].sort_values(T.STEP)
    recorded = steps[T.GRAD_NORM].to_numpy(dtype=float)
    assert len(recorded) == len(norms) == 5
    # the norm clip_grad_norm_ measured, before it clipped, on every step (sampled or not)
    assert recorded == pytest.approx(norms, rel=1e-6)
    assert max(norms) > 0.5  # the clip really clipped: the recorded norm is not the clipped one
    # the wrapper stays (compiled code never sees it change), watching for no one after detach, and it changed
    # nothing in training
    assert torch.nn.utils.clip_grad_norm_ is ORIGINAL_CLIP is torch.nn.utils.clip_grad.clip_grad_norm_
    assert not clipwatch._watchers
    plain_losses, _, plain_weights, _ = clipped_loop(profile=False)
    assert losses == plain_losses
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)


def test_another_models_clip_is_not_this_models_norm() -> None:
    torch.manual_seed(1)
    _, norms, _, prof = clipped_loop(profile=True, steps=2, other=nn.Linear(8, 1))
    assert prof is not None
    recorded = prof.tables()["steps"].sort_values(T.STEP)[T.GRAD_NORM].to_numpy(dtype=float)
    assert recorded == pytest.approx(norms, rel=1e-6)


def _clipping_loop(steps: int, clip: Callable[[nn.Module], float]) -> tuple[precprof.Profiler, list[float]]:
    """TinyNet trained ``steps`` steps, clipped each step by ``clip(model)``, which returns the norm it clipped
    by; the Profiler (detached) and those norms."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    norms = []
    with precprof.Profiler(model, opt, memory=False) as prof:
        for step in range(steps):
            x, y = batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            norms.append(clip(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    return prof, norms


@pytest.mark.skipif(not hasattr(torch.nn.utils, "clip_grads_with_norm_"), reason="torch < 2.6")
def test_a_clip_split_in_two_is_recorded_too() -> None:
    """torch 2.6's ``get_total_norm`` then ``clip_grads_with_norm_`` (torchtitan's clip is built so): the norm
    was not recorded (every step's grad_norm nan). The norm the loop clipped with is; the wrapper stays, watching
    for no one after detach."""
    original = torch.nn.utils.clip_grads_with_norm_

    def clip(model: nn.Module) -> float:
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, total)
        return float(total)

    prof, norms = _clipping_loop(3, clip)
    recorded = prof.tables()["steps"].sort_values(T.STEP)[T.GRAD_NORM].to_numpy(dtype=float)
    assert recorded == pytest.approx(norms, rel=1e-6)
    assert torch.nn.utils.clip_grads_with_norm_ is original and not clipwatch._watchers


def test_an_inf_norm_clip_is_named_as_such() -> None:
    """``clip_grad_norm_(..., norm_type=inf)``: the largest |g| was stored and plotted as "the gradient norm"
    without a word of its type. The summary says it, and the plot's title."""
    from precprof.report.plots import training_figure

    def clip(model: nn.Module) -> float:
        largest = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=float("inf"))
        return largest

    prof, largest = _clipping_loop(2, clip)
    model = prof.model
    opt = prof.optimizers[0]
    assert prof.summary()["grad_norm_type"] == "inf"
    steps = prof.tables()["steps"]
    assert steps[T.GRAD_NORM].tolist() == pytest.approx(largest)
    fig = training_figure(steps, "inf")
    assert fig is not None and fig.axes[2].get_title() == "Gradient norm (unscaled, max |g|)"
    with precprof.Profiler(model, opt, memory=False) as two:
        nn.functional.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        two.step()
    assert two.summary()["grad_norm_type"] is None


def test_an_explicit_grad_norm_wins() -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with precprof.Profiler(model, opt, memory=False) as prof:
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        prof.step(grad_norm=torch.tensor(123.0))
    assert prof.tables()["steps"][T.GRAD_NORM].tolist() == [123.0]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16-pure", "bf16-pure")],
)
def test_precision_seen_and_model_class(mode: str, expected: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    if mode == "bf16-pure":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if mode == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
    prof = precprof.Profiler(model, opt, scaler=scaler, sample_every=1, memory=False)
    with prof:
        for step in range(2):
            x, y = batch(step)
            x, y = x.to(next(model.parameters()).dtype), y.to(next(model.parameters()).dtype)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = nn.functional.mse_loss(model(x).float(), y.float())
            backward_and_step(loss, opt, scaler)
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    capture = prof.summary()
    assert capture["precision_seen"] == expected and capture["model_class"] == "TinyNet"
    page = prof.report(tmp_path).read_text()
    header = page.split("<main>")[0]
    assert f"Precision report · TinyNet · {expected}</h1>" in header
    assert f'<span class="k">precision</span><span class="v">{expected}</span>' in page


def test_a_run_that_diverges_says_so(tmp_path: Path) -> None:
    """SGD at a learning rate far too high: the loss grows to inf, then nan; no loss scaler."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=40.0)
    losses = []
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for step in range(12):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y * 100)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    first_bad = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    assert 0 < first_bad < 11 and not any(math.isfinite(v) for v in losses[first_bad:])  # it really diverged
    run_dir = tmp_path / "run"
    prof.save(run_dir)
    rec = advisor.recommend(run_dir, config=AdvisorConfig(small_model_params=0))
    (div,) = [f for f in rec.findings if f.code == "run_diverged"]
    assert div.severity == "critical" and div.numbers["step"] == first_bad
    assert div.numbers["last_step"] == 11 and div.numbers["steps"] == 12 - first_bad
    assert div.numbers["last_finite_loss"] == pytest.approx(losses[first_bad - 1], rel=1e-6)
    # an fp32 run has no module to keep in fp32 (its remedy said to); a run in a 16-bit format has
    assert prof.summary()["precision_seen"] == "fp32" and "keep that module in fp32" not in div.remedy
    assert "the run trained in fp32" in div.remedy
    bf16 = T.read_summary(run_dir)
    bf16[T.SUMMARY_CAPTURE]["precision_seen"] = "bf16"
    again = advisor.recommend(
        T.read_tables(run_dir), summary=bf16, config=AdvisorConfig(small_model_params=0)
    )
    assert "keep that module in fp32" in again.finding("run_diverged").remedy  # type: ignore[union-attr]
    assert rec.reasons[0].startswith(f"This run diverged: its loss was non-finite from step {first_bad}")
    # the format rules read only the steps before it (all sampled here)
    assert f"rests on the {first_bad} sampled step(s) before it" in rec.reasons[0]

    page = render_run_dir(run_dir, recommendation=rec).read_text()
    kind = "nan" if math.isnan(losses[first_bad]) else "inf"
    assert f'<span class="k">final loss</span><span class="v">{kind} from step {first_bad}</span>' in page
    assert "The run diverged" in page
    # the loss plot marks the non-finite losses, and draws no loss-scaler markers on a run without one
    fig = plots.training_figure(T.read_tables(run_dir)["steps"])
    assert fig is not None
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "loss not finite (nan/inf)" in legend
    assert not any("scaler" in t or "skipped" in t for t in legend)


@pytest.mark.parametrize("every", [2, 0])
def test_steps_without_a_loss_are_no_divergence(tmp_path: Path, every: int) -> None:
    """``prof.step()`` without ``loss=`` (the loss is optional): a loop that passes it every other step, or on
    every step but the last, ended with a null loss, which read as nan once written: "This run diverged at step
    7", a critical finding and "final loss nan" in the header of a run that never had a non-finite loss. The
    steps table says which steps had no loss (``no_loss``); those are no loss, not a nan."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    given = []
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for step in range(8):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (step % every == 0) if every else step < 7:
                prof.step(loss=loss.detach())
                given.append((step, loss.item()))
            else:
                prof.step()
    run_dir = tmp_path / "run"
    prof.save(run_dir)
    steps = T.read_tables(run_dir)["steps"]
    assert T.flags(steps[T.NO_LOSS]).tolist() == [s not in dict(given) for s in range(8)]
    assert T.nonfinite_loss_tail(steps) is None
    rec = advisor.recommend(run_dir, config=AdvisorConfig(small_model_params=0))
    assert rec.finding("run_diverged") is None and not rec.reasons[0].startswith("This run diverged")
    page = render_run_dir(run_dir, recommendation=rec).read_text()
    last = given[-1][1]
    assert (
        f'<span class="k">final loss</span><span class="v">{precprof.report.filters.num(last, 4)}</span>'
        in page
    )
    fig = plots.training_figure(steps)
    assert fig is not None
    assert not any("not finite" in t.get_text() for t in fig.legends[0].get_texts())
    missing = 8 - len(given)
    assert f"{missing} of 8 steps have no loss: the loop passed none (prof.step() without loss=" in page


def test_a_loss_accumulator_reused_in_place_is_recorded_as_it_was_at_each_step() -> None:
    """A loop that sums its micro-batches' losses into one tensor, hands it to ``prof.step(loss=acc)`` and zeroes
    it in place: the loss waits on the device for the next flush, and every step that flushed later read 0 (28
    of 30 steps of a default run). Same for a reused grad-norm tensor."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    acc, norm = torch.zeros(()), torch.zeros(())
    want_loss, want_norm = [], []
    with precprof.Profiler(model, opt, memory=False) as prof:  # the default sampling: most steps not sampled
        for step in range(12):
            for micro in range(2):
                x, y = batch(2 * step + micro)
                loss = nn.functional.mse_loss(model(x), y) / 2
                loss.backward()
                acc += loss.detach()
            norm.copy_(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=acc, grad_norm=norm)
            want_loss.append(acc.item())
            want_norm.append(norm.item())
            acc.zero_()
            norm.zero_()
    steps = prof.tables()["steps"]
    assert not steps[T.SAMPLED].all()
    assert steps[T.LOSS].tolist() == pytest.approx(want_loss, rel=1e-6) and min(want_loss) > 0
    assert steps[T.GRAD_NORM].tolist() == pytest.approx(want_norm, rel=1e-6)


@pytest.mark.parametrize(
    ("kw", "error", "said"),
    [
        (
            {"loss": torch.tensor([2.0, 4.0, 6.0])},
            ValueError,
            "prof.step(loss=tensor of shape [3]): expected one number; pass the step's scalar loss",
        ),
        ({"loss": "1.2.3"}, TypeError, "prof.step(loss='1.2.3'): expected a number or a one-element tensor"),
        ({"loss": "1.5"}, TypeError, "prof.step(loss='1.5'): expected a number or a one-element tensor"),
        (
            {"grad_norm": torch.ones(2, 2)},
            ValueError,
            "prof.step(grad_norm=tensor of shape [2, 2]): expected one",
        ),
        (
            {"tokens": -64},
            ValueError,
            "prof.step(tokens=-64): expected the number of tokens the step ran, >= 0",
        ),
        ({"tokens": "64"}, TypeError, "prof.step(tokens='64'): expected the number of tokens the step ran"),
        # an empty tensor was taken and failed at the flush; a numpy array of shape [1] too (numpy's float()
        # takes 0-d arrays only), and one of strings
        ({"loss": torch.tensor([])}, ValueError, "prof.step(loss=tensor of shape [0]): expected one number"),
        ({"loss": np.array([2.5])}, ValueError, "prof.step(loss=array of shape [1], float64): expected one"),
        ({"loss": np.array("x")}, ValueError, "prof.step(loss=array of shape [], <U1): expected one number"),
        # a negative count in a CPU tensor (its value is on the host: read, no sync) gave tokens/s < 0
        ({"tokens": torch.tensor(-64)}, ValueError, "prof.step(tokens=tensor(-64)): expected the number of"),
    ],
)
def test_a_step_argument_it_cannot_record_is_one_line_and_the_run_goes_on(
    kw: dict[str, Any], error: type[Exception], said: str
) -> None:
    """``loss=tensor([2., 4., 6.])`` was recorded as 2.0 (its first element), ``tokens=-64`` as a negative
    tokens/s, ``loss="1.2.3"`` failed at the next flush in records.py and ``loss="1.5"`` was taken as 1.5. Each
    is refused where it is passed (host checks: a tensor's element count is metadata), the step not ended: the
    loop that passes what it takes goes on. A loss of shape [1] is one number."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for step in range(3):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 1:
                with pytest.raises(error) as e:
                    prof.step(**kw)
                assert str(e.value).startswith(said) and "\n" not in str(e.value)
            # a loss of shape [1], and a 0-d numpy array (a loss computed with numpy): one number each
            one = loss.detach().reshape(1) if step != 2 else np.array(loss.item())
            # tokens as a loop counts them: a float, a numpy int, a 0-d array (mask.sum().numpy())
            prof.step(loss=one, tokens=[32.0, np.int64(32), np.array(32)][step])
    steps = prof.tables()["steps"]
    assert steps[T.STEP].tolist() == [0, 1, 2] and steps[T.LOSS].notna().all()
    assert steps[T.LOSS].dtype == np.float64
    assert steps[T.TOKENS].tolist() == [32.0, 32.0, 32.0]


def test_a_loop_that_passes_its_loss_now_and_then_has_not_diverged() -> None:
    steps = pd.DataFrame({T.STEP: range(10), T.LOSS: [2.0 if s % 5 == 0 else math.nan for s in range(10)]})
    assert T.nonfinite_loss_tail(steps) is None
    steps = pd.DataFrame({T.STEP: range(4), T.LOSS: [math.nan] * 4})  # no loss passed at all
    assert T.nonfinite_loss_tail(steps) is None
    steps = pd.DataFrame({T.STEP: range(5), T.LOSS: [3.0, 2.0, 1.5, math.inf, math.nan]})
    tail = T.nonfinite_loss_tail(steps)
    assert tail is not None and (tail.first, tail.last, tail.steps, tail.kind) == (3, 4, 2, "inf")
    assert (tail.last_finite, tail.last_finite_step) == (1.5, 2)


def test_fp16_overflow_in_a_bf16_run_with_a_scaler_is_a_what_if(tmp_path: Path) -> None:
    """bf16 autocast with a GradScaler at 2^24: the scaled gradients pass fp16's 65504, but they are not fp16,
    so nothing overflowed and no step was skipped; the finding says what fp16 would do, as information."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with precprof.Profiler(model, opt, scaler=scaler, sample_every=1, memory=False) as prof:
        for step in range(3):
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    assert not prof.tables()["steps"][T.SKIPPED].any()
    prof.save(tmp_path / "run")
    rec = advisor.recommend(tmp_path / "run", config=AdvisorConfig(small_model_params=0))
    f = rec.finding("fp16_gradient_overflow")
    assert f is not None and f.severity == "info" and f.title.startswith("Gradients would overflow fp16")
    assert "this bf16 run's gradients are not fp16, so nothing overflowed here" in f.message


@pytest.mark.parametrize("assign", [False, True])
def test_a_loop_taking_its_gradients_with_autograd_grad_is_told_they_were_not_read(
    tmp_path: Path, assign: bool
) -> None:
    """``grads = torch.autograd.grad(loss, params)`` and an update by hand (functional training, MAML's inner
    loop): no gradient reaches ``.grad``, where precprof reads them, so the run had no weight-gradient row and
    the report said only "No histograms of weight gradients were recorded". The summary counts the steps and
    the report says why, with what to do; the same loop assigning them to ``.grad`` for an optimizer is read."""
    torch.manual_seed(0)
    model = TinyNet()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05) if assign else None
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for step in range(3):
            x, y = batch(step)
            grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
            assert all(p.grad is None for p in params)
            if opt is not None:
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    for p, g in zip(params, grads, strict=True):
                        p.sub_(0.05 * g)
            prof.step()
    layers = prof.tables()["layers"]
    assert (T.WEIGHT_GRAD in set(layers[T.TENSOR])) == assign
    assert T.ACTIVATION_GRAD in set(layers[T.TENSOR])
    assert prof.summary()["weight_grads_unread_steps"] == (0 if assign else 3)
    prof.report(tmp_path / "run")
    page = " ".join(html.unescape((tmp_path / "run" / T.REPORT_FILE).read_text()).split())
    said = "not read on 3 sampled step(s): their backward left no gradient in any parameter's .grad"
    assert (said in page) != assign
    assert ("torch.autograd.grad" in page) != assign


def test_layers_whose_weight_gradients_alone_went_unread_are_named(tmp_path: Path) -> None:
    """fc1 trained with ``torch.autograd.grad`` on a loss of its own and updated by hand, fc2 on the detached
    features with ``backward`` and an optimizer: fc1's output gradient is read, its weights' never reach
    ``.grad`` (the test's own check), while fc2's do. The note on unread weight gradients fired only when none
    at all was read on a step, so nothing said fc1's were missing from the advice. It names fc1 now."""
    torch.manual_seed(0)
    model = TinyNet()
    own = list(model.fc1.parameters())
    opt = torch.optim.SGD(model.fc2.parameters(), lr=0.05)
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for step in range(3):
            x, y = batch(step)
            h = torch.tanh(model.fc1(x))
            grads = torch.autograd.grad(h.pow(2).mean(), own)
            with torch.no_grad():
                for p, g in zip(own, grads, strict=True):
                    p.sub_(0.05 * g)
            nn.functional.mse_loss(model.fc2(h.detach()), y).backward()
            assert all(p.grad is None for p in own) and model.fc2.weight.grad is not None
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    layers = prof.tables()["layers"]
    read = set(layers[layers[T.TENSOR] == T.WEIGHT_GRAD][T.MODULE])
    out = set(layers[layers[T.TENSOR] == T.ACTIVATION_GRAD][T.MODULE])
    assert read == {"fc2"} and "fc1" in out
    summary = prof.summary()
    assert summary["weight_grads_unread_steps"] == 0 and summary["weight_grads_unread_modules"] == {"fc1": 3}
    prof.report(tmp_path / "run")
    page = " ".join(html.unescape((tmp_path / "run" / T.REPORT_FILE).read_text()).split())
    assert "not read for 1 layer(s) on the sampled steps that read the others' (fc1)" in page


class _SparseLookup(nn.Module):
    """An embedding with sparse gradients, read by a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)
        self.fc = nn.Linear(16, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


def test_a_sparse_gradient_precprof_skips_is_not_named_unread(tmp_path: Path) -> None:
    """``nn.Embedding(sparse=True)``: its weight's gradient reaches ``.grad`` every step, sparse (the test's own
    check), and precprof skips it and says so. The note on unread weight gradients named ``emb`` all the same,
    telling the user to give the optimizer that was given. A skipped gradient is no unread one."""
    torch.manual_seed(0)
    model = _SparseLookup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for _ in range(3):
            ids = torch.randint(0, 100, (4, 8))
            nn.functional.cross_entropy(model(ids).view(-1, 100), ids.view(-1)).backward()
            grad = model.emb.weight.grad
            assert grad is not None and grad.is_sparse and grad.coalesce().values().numel() > 0
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    summary = prof.summary()
    assert summary["weight_grads_unread_steps"] == 0 and summary["weight_grads_unread_modules"] == {}
    layers = prof.tables()["layers"]
    assert set(layers[layers[T.TENSOR] == T.WEIGHT_GRAD][T.MODULE]) == {"fc"}


@pytest.mark.parametrize("given", [False, True])
def test_an_optimizer_stepped_inside_backward_is_told_apart_and_read_when_given(
    tmp_path: Path, given: bool
) -> None:
    """PyTorch's recipe of an optimizer step fused into the backward pass: a post-accumulate-grad hook, registered
    before precprof's, steps a per-parameter optimizer and clears ``.grad``. The report blamed
    ``torch.autograd.grad``, which the loop does not use; it names this recipe too, and with the optimizers given
    the gradients are read as each one steps, equal to those the hook saw."""
    torch.manual_seed(0)
    model = TinyNet()
    opts = {p: torch.optim.SGD([p], lr=0.05) for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}

    def step_in_backward(p: torch.Tensor) -> None:
        seen[id(p)] = p.grad.detach().clone()
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    with precprof.Profiler(
        model, list(opts.values()) if given else None, sample_every=1, memory=False
    ) as prof:
        for step in range(3):
            x, y = batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            prof.step()
    assert prof.summary()["weight_grads_unread_steps"] == (0 if given else 3)
    layers = prof.tables()["layers"]
    grads = layers[(layers[T.TENSOR] == T.WEIGHT_GRAD) & (layers[T.STEP] == 2)]
    assert len(grads) == (len(seen) if given else 0)
    for _, row in grads.iterrows():
        p = dict(model.named_parameters())[f"{row[T.MODULE]}.{row[T.PARAM]}"]
        assert row[T.ZEROS] == int((seen[id(p)] == 0).sum()) and row[T.ABSMAX] == float(
            seen[id(p)].abs().max()
        )
    prof.report(tmp_path / "run")
    page = " ".join(html.unescape((tmp_path / "run" / T.REPORT_FILE).read_text()).split())
    assert ("an optimizer stepped inside the backward pass" in page) != given


def test_a_run_directory_another_profiler_writes_is_refused_with_advice_that_works(tmp_path: Path) -> None:
    """Two Profilers given the same ``out`` in one process: the second was refused with "save it first
    (prof.save() or prof.report()), or choose another out". Saved while attached, the first went on writing
    (a snapshot) and the refusal came back; detached and saved, the directory held its complete run, refused
    unless ``overwrite=True``. The refusal says what works, and doing what it says works."""
    from precprof.rundir import RunDirError

    out = tmp_path / "run"
    model, second = TinyNet(), TinyNet()
    first = precprof.Profiler(model, out=out, sample_every=1).attach()
    model(torch.randn(2, 8)).sum().backward()
    first.step()
    advice = (
        r"a Profiler in this process is still writing this run directory \(it is attached\); choose another "
        r"out, or call that Profiler's detach\(\) first, then pass overwrite=True to replace its run "
        r"\(resume=True, first_step= the step after its last, to continue it\)$"
    )
    with pytest.raises(RunDirError, match=advice):
        precprof.Profiler(second, out=out).attach()
    with (
        precprof.Profiler(second) as other,  # (one never attached has nothing to save: refused before)
        pytest.raises(
            RunDirError,
            match=r"choose another path, or call that Profiler's detach\(\) first, then pass "
            r"overwrite=True to replace its run$",
        ),
    ):
        other.save(out)  # (save()'s words)
    first.save()  # attached: a snapshot, the directory is still its own
    with pytest.raises(RunDirError, match=advice):
        precprof.Profiler(second, out=out).attach()
    first.detach()
    first.save()
    with precprof.Profiler(second, out=out, overwrite=True) as again:  # (its run replaces the first's)
        assert again.attached and again.run_dir == out
