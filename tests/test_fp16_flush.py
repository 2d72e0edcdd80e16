"""fp16_gradient_underflow's flushed evidence on real tiny training runs (CPU, seconds each): an exact zero in
an fp16 gradient is a flushed value or a true zero, and each claim is checked against the same model trained in
fp32, whose gradients the test's own hooks cast to fp16."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from scenarios import dead_layers, relu_zeros, tiny_gradients
from scenarios.loop import ProfiledRun, regression_batches, train_profiled
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig
from precprof.analysis.advisor.text import _pct


def _flushes(seen: list[torch.Tensor]) -> tuple[float, float]:
    """(share of exact zeros, share of the nonzero values a cast to fp16 flushes) of fp32 gradients."""
    g = torch.cat([t.float().flatten() for t in seen])
    nonzero = g[g != 0]
    return float((g == 0).float().mean()), float((nonzero.half() == 0).float().mean())


def test_relu_zeros_in_an_unscaled_fp16_run_are_not_flushes() -> None:
    """A healthy ReLU classifier trained in fp16 without a loss scaler was warned "fp16 gradients flushed to
    zero: 24% zeros at scale 1 ... This fp16 run trained without loss scaling": a fifth of its fp16 activation
    gradients are exact zeros and a few sit at fp16's smallest subnormal, which was the whole evidence. The zeros
    are ReLU's, in fp32 too, and the fp32 run's gradients would lose next to none in fp16. Zeros count as flushes
    now only in modules whose gradients run into the floor; weighted by 2^-12, this model's do, and the finding
    still fires."""
    _, seen32 = relu_zeros.run("fp32")
    zeros32, flushed32 = _flushes(seen32)
    assert zeros32 > 0.4 and flushed32 < 1e-3  # ReLU's zeros, in fp32; fp16 would flush almost nothing
    run, _ = relu_zeros.run("fp16")
    layers = run.tables["layers"]
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.DTYPE] == "float16")]
    # what the old evidence read: over a fifth zeros, and the smallest nonzero value among fp16's subnormals
    assert ag[T.ZEROS].sum() / ag[T.NUMEL].sum() > 0.2 and ag[T.ABSMIN].min() == 2.0**-24
    assert run.losses[-1] < run.losses[0] - 0.1  # it trains
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and not f.numbers["fp16_flushed"] and f.severity == "info"
    assert "flushed to zero" not in f.title and "without loss scaling" not in f.message

    weight = 2.0**-12
    _, seen32 = relu_zeros.run("fp32", weight=weight)
    zeros32, flushed32 = _flushes(seen32)
    assert flushed32 > 0.3  # a third of the fp32 run's nonzero gradients would flush in fp16
    run, _ = relu_zeros.run("fp16", weight=weight)
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["fp16_flushed"] and f.severity == "warning"
    assert f.message.startswith("This fp16 run trained without loss scaling: ")
    assert f.title.startswith("fp16 gradients flushed to zero: ")


def test_the_flushed_share_leaves_out_the_zeros_relus_backward_wrote() -> None:
    """Weighted by 2^-12, the ReLU classifier's fp16 gradients run into the floor, and every zero of the modules
    judged flushed counted as a flush: 54.6% said, ReLU's zeros in fc1, fc2 and fc3's gradients among them (half
    of those values are zeros in fp32 too). The gradient each ReLU received (act1's, act2's, act3's: a matmul's
    backward computed it) holds no such zero, and the share is counted there now: it matches the fp32 run's
    gradients of the ReLUs' outputs cast to fp16, which the test's own hooks read."""
    weight = 2.0**-12
    _, seen32 = relu_zeros.run("fp32", weight=weight, hooked=nn.ReLU)
    g = torch.cat([t.flatten() for t in seen32])
    assert not bool((g == 0).any())  # no mask touched these gradients
    flushed = float(((g.half() == 0) & (g != 0)).float().mean())
    _, linear32 = relu_zeros.run("fp32", weight=weight)
    masked, _ = _flushes(linear32)
    assert masked > 0.4  # ReLU's zeros in the Linear outputs' gradients, in fp32
    run, _ = relu_zeros.run("fp16", weight=weight)
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["fp16_flushed"]
    assert abs(f.numbers["fp16_flushed_zero_share"] - flushed) < 0.02 and 0.3 < flushed < 0.6
    assert "of the fp16 activation-gradient values of act1, act2, act3 are exact zeros" in f.message
    # why those zeros alone are counted is the finding's method, folded under it
    assert "The zeros counted are those of act1, act2, act3: a matmul's backward computed" in f.method
    assert "fc1, fc2, fc3 run into the floor too, but their zeros are not counted" in f.message


def test_layers_that_receive_no_gradient_under_a_grad_scaler_are_flushed() -> None:
    """A real fp16 run with a GradScaler at 2^16 in which fc1, the GELU and fc2 receive no gradient at all (every
    value zero on every step: the test's own hook on fc1 sees it; in fp32 none of them is zero) was told "Nothing
    to fix: at the run's loss scale 2^16, 0% of the values recorded flush": the flushed evidence read only rows
    held at loss scale 1, which a run with a scaler has none of. It reads every scale now, names the layers, and
    since the largest scale the gradients allow is not above the run's, points to a format with more range."""
    _, seen32 = dead_layers.run("fp32", loss_scale=None)
    assert all(bool((g != 0).all()) for g in seen32)
    run, seen = dead_layers.run("fp16", loss_scale=2.0**16)
    assert {g.dtype for g in seen} == {torch.float16} and all(bool((g == 0).all()) for g in seen)
    assert not run.tables["steps"][T.SKIPPED].any()
    layers = run.tables["layers"]
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.DTYPE] == "float16")]
    per = ag.groupby(T.MODULE)[[T.ZEROS, T.NUMEL]].sum()
    empty = set(per.index[per[T.ZEROS] == per[T.NUMEL]])
    assert empty == {"fc1", "act", "fc2"} and set(ag[T.SCALE]) == {2.0**16}
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["fp16_flushed"] and f.severity == "critical"
    assert f.title.startswith("fp16 gradients flushed to zero: ") and f.title.endswith("at loss scale 65536")
    assert f.message.startswith(
        "This fp16 run scaled its loss (loss scale 65536 where these gradients flushed)"
    )
    assert "fc1, act, fc2 held no nonzero value" in f.message and "without loss scaling" not in f.message
    # the share is at least the zeros of the three layers, out of every fp16 activation-gradient value
    assert f.numbers["fp16_flushed_zero_share"] >= per.loc[sorted(empty), T.NUMEL].sum() / per[T.NUMEL].sum()
    k = int(f.numbers["loss_scale_log2"])
    assert k <= 16 and "Nothing to fix" not in f.remedy
    assert f.remedy.startswith("No larger loss scale fits") and "bf16" in f.remedy


def test_a_grad_scaler_held_at_1_is_told_to_start_higher_not_that_the_run_had_none() -> None:
    """The same model with a dynamic GradScaler given to the Profiler at init_scale=1: the scale never grows in
    4 steps (growth_interval 2000), so every step is at scale 1 and the same layers receive no gradient. The
    finding opened "This fp16 run trained without loss scaling" and told to "Scale the loss", while
    fp16_no_loss_scaling rightly did not fire: the user's scaler started too low (tester t1). Now it says the
    GradScaler held 1 and tells to start it higher; without a scaler both findings still say it had none."""
    run, seen = dead_layers.run("fp16", loss_scale=1.0)
    assert all(bool((g == 0).all()) for g in seen)  # the test's own hook: fc1 received no gradient
    assert set(run.tables["steps"][T.LOSS_SCALE]) == {1.0} and run.summary["capture"]["scaler_enabled"]
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["fp16_flushed"] and f.severity == "critical"
    assert f.message.startswith(
        "This fp16 run's GradScaler held a loss scale of 1 on every step (it started there, and grows only after "
        "2,000 steps without an overflow, more than this run's 4): "
    )
    assert "without loss scaling" not in f.message and "Scale the loss" not in f.remedy
    k = int(f.numbers["loss_scale_log2"])
    assert f.remedy.startswith("Start your GradScaler higher than 1: ") and f"init_scale={2**k}" in f.remedy
    assert rec.finding("fp16_no_loss_scaling") is None
    # without a scaler, both findings say the run had none
    run, _ = dead_layers.run("fp16", loss_scale=None)
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.message.startswith("This fp16 run trained without loss scaling")
    assert f.remedy.startswith("Scale the loss: ") and rec.finding("fp16_no_loss_scaling") is not None


def test_fp32_gradients_of_a_layer_kept_out_of_autocast_are_no_fp16_underflow() -> None:
    """The same model with fc2 kept in fp32, as the advisor's keep_fp32 says: fc1 receives its gradients again
    (the test's own hook: under 5% zeros, against 100% before). Its re-profile counted the fp32 gradients of fc2,
    the LayerNorm and the scale after it (fp32 tensors: autocast casts none of them) as fp16 underflow: "16.2%
    still underflow fp16 at 2^15 ... 100% of fc2's gradient norm ... fp16 is ruled out", telling the user who
    followed the advice the opposite. Only gradients fp16 autocast holds in 16 bits count now."""
    run, seen = dead_layers.run("fp16", loss_scale=2.0**16, keep_fp32=["fc2"])
    zeros = torch.cat([g.flatten() for g in seen]) == 0
    assert float(zeros.float().mean()) < 0.05
    layers = run.tables["layers"]
    ag = layers[layers[T.TENSOR] == T.ACTIVATION_GRAD]
    fp32 = set(ag[ag[T.DTYPE] == "float32"][T.MODULE])
    assert fp32 == {"fc2", "ln", "tiny"} and set(ag[T.DTYPE]) == {"float16", "float32"}
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.severity == "info" and "fc2" not in f.modules
    # fc2 is named once: as one of the layers the advice keeps in fp32, whose gradients are left out
    told, left_out = f.message.split(" The counts of what fp16 would flush leave out the layers kept in fp32")
    assert "fc2" not in told and left_out.startswith(" (fp16_keep_fp32: fc2")
    # and the fp32 gradients the histograms' total leaves out are named beside it (a sum of the run's histograms
    # did not give the figure, and nothing said why)
    said = f"({f.numbers['nonzero_values']:,} nonzero values; left out: ln, tiny, whose gradients this run held in fp32"
    assert said in told
    # the values counted are the fp16 gradients' finite nonzero ones, none of the fp32 ones, nor those of the
    # layers the advice keeps in fp32 (fc3's: the ReLU after it, then fp32 too, computes its gradient in fp32)
    assert rec.fp16_keep_fp32 == ["fc2", "fc3"]
    a16 = ag[(ag[T.DTYPE] == "float16") & ~ag[T.MODULE].isin(rec.fp16_keep_fp32)]
    assert f.numbers["nonzero_values"] == int((a16[T.NUMEL] - a16[T.ZEROS] - a16[T.NAN] - a16[T.INF]).sum())
    assert rec.format == "fp16" and not any("ruled out" in r for r in rec.reasons)


def test_a_layer_kept_in_fp32_whose_outputs_near_fp16s_limit_stays_in_the_keep_list() -> None:
    """fc2, kept in fp32 as the advisor said (its outputs come within 2x of 65504), casts nothing to fp16 in its
    re-profile, which advised keep_fp32 = []: pasted, the snippet dropped fc2's fp32 wrapper and its dead layers
    with it. fc2's own outputs say it still needs fp32 (checked at step 0 with the scenario's weights and batch);
    it stays in the list, said to be kept already."""
    torch.manual_seed(0)
    model = dead_layers.DeadNet()
    x, _ = regression_batches(dead_layers.N_IN)(0)
    with torch.no_grad():
        step0 = float(model.fc2(model.act(model.fc1(x))).abs().max())
    assert 65504 / 2 <= step0 < 65504
    run, _ = dead_layers.run("fp16", loss_scale=2.0**16, keep_fp32=["fc2"])
    rec = run.recommend("t4")
    # (fc3 with it: it casts the scale's tiny outputs to fp16, fp16_activation_underflow)
    assert rec.format == "fp16" and rec.keep_fp32 == ["fc2", "fc3"]
    f = rec.finding("fp16_kept_fp32")
    assert f is not None and f.modules == ["fc2"] and "within 2x of 65504" in f.message
    assert "Keep fc2 in fp32 as this run already does (outside autocast)" in " ".join(rec.reasons)


def test_the_verdict_quotes_the_flushed_share_not_the_histograms() -> None:
    """The verdict's loss-scale reason read "activation-gradient underflow falls from 0% at scale 1 to 0%" on an
    unscaled fp16 run that had flushed most of its gradients: the histograms count nonzero values, and a flushed
    one is a zero. It quotes the share of exact zeros the finding judged flushed now, checked against the run's
    own table."""
    run, _ = relu_zeros.run("fp16", weight=2.0**-12)
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    # (held in fp16 at scale 1, the histograms hold nothing fp16 flushed: no share at scale 1 is counted)
    assert f is not None and f.numbers["fp16_flushed"] and f.numbers["share_at_scale_1"] is None
    share = f.numbers["fp16_flushed_zero_share"]
    layers = run.tables["layers"]
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.DTYPE] == "float16")]
    assert AdvisorConfig().fp16_flushed_zero_share < share <= ag[T.ZEROS].sum() / ag[T.NUMEL].sum()
    (reason,) = [r for r in rec.reasons if r.startswith("Start GradScaler at init_scale=")]
    assert "falls from" not in reason
    assert (
        f"were flushed to zero ({share * 100:.3g}% exact zeros among the values of act1, act2, act3 at loss scale 1"
        in reason
    )


def test_the_flushed_share_in_the_title_is_that_of_the_modules_the_message_names() -> None:
    """The ReLU classifier weighted by 2^-12 in fp16: the title read "fp16 gradients flushed to zero: 41.2% zeros at
    loss scale 1" while the message listed six modules at fp16's floor; 41.2% is the share of act1, act2 and act3
    alone, the modules whose zeros can only be flushes (of every module's fp16 gradients, 40% are zeros; of the six
    at the floor, 48%). The title names the modules whose share it gives now, as the message does, and the share
    is theirs, checked against the run's own rows."""
    run, _ = relu_zeros.run("fp16", weight=2.0**-12)
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["fp16_flushed"]
    layers = run.tables["layers"]
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.DTYPE] == "float16")]
    per = ag.groupby(T.MODULE)[[T.ZEROS, T.NUMEL]].sum()
    named = ["act1", "act2", "act3"]
    share = float(per.loc[named, T.ZEROS].sum() / per.loc[named, T.NUMEL].sum())
    every = float(per[T.ZEROS].sum() / per[T.NUMEL].sum())
    floor = ["fc1", "act1", "fc2", "act2", "fc3", "act3"]
    at_floor = float(per.loc[floor, T.ZEROS].sum() / per.loc[floor, T.NUMEL].sum())
    assert f.numbers["fp16_flushed_zero_share"] == pytest.approx(share, rel=1e-12)
    assert _pct(share) not in (_pct(every), _pct(at_floor))  # the populations' shares differ
    assert f.numbers["fp16_flushed_share_of"] == "act1, act2, act3"
    assert (
        f.title
        == f"fp16 gradients flushed to zero: {_pct(share)} of the values of act1, act2, act3 are zeros at loss scale 1"
    )
    assert (
        f"{_pct(share)} of the fp16 activation-gradient values of act1, act2, act3 are exact zeros"
        in f.message
    )
    assert (
        "of the nonzero values of fc1, act1, fc2, act2, fc3, act3 sit at its smallest subnormal" in f.message
    )


def _tiny_gradients_run(precision: str, loss_scale: float | None = None) -> tuple[ProfiledRun, torch.Tensor]:
    """tiny_gradients' MLP with its loss weighted by 2^-8: a few percent of its activation gradients lie below
    fp16's floor. Returns the run and every gradient of its layers' outputs, as the test's own hooks saw them."""
    torch.manual_seed(0)
    model = tiny_gradients.TinyGradNet()
    seen = relu_zeros.output_gradients(model, (nn.Linear, nn.Tanh))  # type: ignore[arg-type]
    run = train_profiled(
        model,
        regression_batches(tiny_gradients.N_IN),
        lambda pred, y: tiny_gradients.weighted_mse(pred, y, 2.0**-8),
        precision=precision,
        loss_scale=loss_scale,
        steps=4,
    )
    return run, torch.cat([g.float().flatten() for g in seen])


def test_an_unscaled_fp16_run_is_told_its_flushes_are_uncounted_and_to_scale_its_loss() -> None:
    """An fp16 run without a GradScaler (llm.c's --dtype float16) was told "fp16 gradient underflow: 0% at scale 1
    ... Nothing to fix" while its fp16 activation gradients had lost a few percent of their values: held in fp16,
    a value below 2^-25 is a zero before precprof reads it, and the histograms hold none of them. The same run in
    fp32 has no zero at all, and 2% or more of its gradients flush in a cast to fp16 (the test's own hooks); the
    fp16 run's zeros are those flushes. The share at scale 1 is unknown now, not 0%, and fp16_no_loss_scaling
    says the run scaled no loss and to scale it. With a GradScaler, or in fp32, that finding is absent."""
    _, g32 = _tiny_gradients_run("fp32")
    nonzero = g32[g32 != 0]
    flushes = float((nonzero.half() == 0).float().mean())
    assert bool((g32 != 0).all()) and flushes > 0.02
    run, g16 = _tiny_gradients_run("fp16")
    zeros = float((g16 == 0).float().mean())
    assert flushes * 0.8 < zeros < flushes * 1.2  # the fp16 run's zeros are the fp32 gradients' flushes
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["share_at_scale_1"] is None and f.numbers["share_now"] is None
    assert "0% at scale 1" not in f.title and "not countable" in f.title
    assert not f.remedy.startswith("Nothing to fix") and "GradScaler" in f.remedy
    unscaled = rec.finding("fp16_no_loss_scaling")
    assert unscaled is not None and unscaled.severity == "warning"
    assert unscaled.numbers["fp16_zero_share"] == pytest.approx(zeros, rel=1e-6)
    assert "configuration says loss scaling: none" in unscaled.message
    assert unscaled.remedy.startswith("Scale the loss: scaler = torch.amp.GradScaler(")
    # a user's own loop: no configuration, only what the Profiler was given (no GradScaler, no loss_scale)
    own = replace(run, summary={k: v for k, v in run.summary.items() if k != T.SUMMARY_CONFIG})
    unscaled = own.recommend("t4").finding("fp16_no_loss_scaling")
    assert unscaled is not None and "precprof was given no GradScaler and no loss_scale" in unscaled.message
    assert "give that GradScaler to the Profiler" in unscaled.remedy
    for precision, scale in (("fp16", 2.0**16), ("fp32", None)):
        other, _ = _tiny_gradients_run(precision, scale)
        assert other.recommend("t4").finding("fp16_no_loss_scaling") is None


class _FunctionalRelu(nn.Module):
    """relu_zeros' classifier with torch.relu in place of its ReLU modules: no module's gradient is free of the
    mask, as act1-act3's were (each Linear's output gradient holds ReLU's zeros). With ``act`` GELU (no exact
    zero in its backward) and a dropout of p=0 on the input (a module whose backward writes zeros, before every
    layer, as GPT's after its embeddings), the same gradients hold flushes and no mask."""

    def __init__(self, width: int = 64, act: Callable[[torch.Tensor], torch.Tensor] = torch.relu) -> None:
        super().__init__()
        self.act = act
        self.drop = nn.Dropout(0.0)
        self.fc1 = nn.Linear(relu_zeros.N_IN, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, width)
        self.head = nn.Linear(width, relu_zeros.N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc2(self.act(self.fc1(self.drop(x)))))
        return self.head(self.act(self.fc3(h)))


def _functional_run(
    precision: str, weight: float, act: Callable[[torch.Tensor], torch.Tensor] = torch.relu
) -> tuple[ProfiledRun, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _FunctionalRelu(act=act)
    seen = relu_zeros.output_gradients(model)
    run = train_profiled(
        model,
        relu_zeros.batches,
        lambda out, y: weight * nn.functional.cross_entropy(out.float(), y),
        precision=precision,
        steps=8,
        lr=3e-3,
    )
    return run, seen


def test_gradients_that_run_into_the_floor_behind_a_mask_are_flushed() -> None:
    """The ReLU classifier weighted by 2^-12 with torch.relu, not ReLU modules: every gradient that runs into
    fp16's floor (fc1-fc3's) holds ReLU's zeros too, so none of its zeros counted, the flushed share was 0 and the
    finding read "Nothing to fix" of a run that lost a third of its nonzero gradients (the fp32 run's, cast by the
    test). They are flushed now, said to be at most their share of zeros, which no mask-free gradient narrows."""
    _, seen32 = _functional_run("fp32", 2.0**-12)
    g = torch.cat(
        [t.flatten() for t in seen32[1:4]]
    )  # step 0: fc3, fc2 and fc1 (after head) in backward order
    lost = float(((g.half() == 0) & (g != 0)).float().mean())
    assert lost > 0.1 and float((g == 0).float().mean()) > 0.3  # a mask's zeros, and values fp16 flushes
    run, _ = _functional_run("fp16", 2.0**-12)
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["fp16_flushed"] and f.severity == "warning"
    assert f.numbers["fp16_flushed_zero_share"] is None  # no count of flushes: a mask wrote some zeros
    layers = run.tables["layers"]
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & layers[T.MODULE].isin(["fc1", "fc2", "fc3"])]
    at_most = float(ag[T.ZEROS].sum() / ag[T.NUMEL].sum())
    assert f.numbers["fp16_flushed_at_most"] == at_most >= lost
    # (no module writes those zeros: a function does, torch.relu, which precprof does not see)
    assert f.title == f"fp16 gradients flushed to zero at loss scale 1: up to {at_most * 100:.3g}%"
    assert "fc1, fc2, fc3 sit at its smallest subnormal, 2^-24" in f.message
    assert "of their values were flushed: their zeros, unless a function wrote some in backward" in f.message
    assert (
        "Why at most: these zeros are flushes unless a function their output passes through before the next layer "
        "wrote some in backward (torch.relu" in f.method
    )
    assert f.remedy.startswith("Scale the loss: GradScaler(init_scale=")
    # the verdict's loss-scale reason says so too (it said "underflow falls from 0% at scale 1 to 0%")
    (reason,) = [r for r in rec.reasons if r.startswith("Start GradScaler at init_scale=")]
    assert (
        f"ran into fp16's floor at loss scale 1 and were flushed to zero (up to {at_most * 100:.3g}%"
        in reason
    )


def test_flushed_gradients_of_a_model_without_a_mask_are_not_said_to_hold_a_mask() -> None:
    """The classifier with GELU, weighted by 2^-12 (as GPT's attention gradients, behind its fused attention): the
    fp16 finding said of fc1-fc3's zeros "a mask's zeros among them ... (ReLU's backward writes an exact zero
    wherever its unit was off)" in a model with no ReLU and no dropout after them. The fp32 run's gradients hold
    no exact zero, and a cast to fp16 flushes most of them: the fp16 run's zeros are flushes. The finding names a
    mask only where a module that writes zeros in backward runs after those gradients' modules (the dropout on
    the input runs before them); here it says the zeros are flushes unless a function wrote some."""
    gelu = nn.functional.gelu
    _, seen32 = _functional_run("fp32", 2.0**-12, gelu)
    zeros32, lost = _flushes(seen32[1:4])  # step 0: fc3, fc2 and fc1 (after head) in backward order
    assert zeros32 == 0 and lost > 0.3
    run, _ = _functional_run("fp16", 2.0**-12, gelu)
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.numbers["fp16_flushed"]
    layers = run.tables["layers"]
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & layers[T.MODULE].isin(["fc1", "fc2", "fc3"])]
    at_most = float(ag[T.ZEROS].sum() / ag[T.NUMEL].sum())
    assert f.numbers["fp16_flushed_at_most"] == at_most > 0.3
    assert f.title == f"fp16 gradients flushed to zero at loss scale 1: up to {at_most * 100:.3g}%"
    assert "mask's" not in f.message + f.method and "ReLU" not in f.message + f.method
    assert (
        f"At most {at_most * 100:.3g}% of their values were flushed: their zeros, unless a function"
        in f.message
    )
    (reason,) = [r for r in rec.reasons if r.startswith("Start GradScaler at init_scale=")]
    assert f"(up to {at_most * 100:.3g}% of those values, which the exponent histograms cannot see" in reason

    # relu_zeros' ReLU modules run after fc1-fc3: their zeros are named, with the modules that write them
    relu, _ = relu_zeros.run("fp16", weight=2.0**-12)
    f = relu.recommend("t4").finding("fp16_gradient_underflow")
    assert (
        f is not None and "fc1, fc2, fc3 run into the floor too, but their zeros are not counted" in f.message
    )
    assert (
        "The zeros of fc1, fc2, fc3 are not counted: they may hold the zeros act1, act2, act3 (ReLU) write"
        in f.method
    )


def _overflowing_run(static_scale: float | None) -> tuple[ProfiledRun, list[torch.Tensor]]:
    """relu_zeros' classifier with its loss scaled by 2^40: by a static GradScaler (``static_scale``), or by the
    loss itself in a loop without one (None: nothing checks for inf, no step is skipped). Returns the run and the
    Linear layers' output gradients as the test's own hooks saw them (head, fc3, fc2, fc1 on each step)."""
    torch.manual_seed(0)
    model = relu_zeros.ReluNet()
    seen = relu_zeros.output_gradients(model)
    weight = 1.0 if static_scale is not None else 2.0**40
    run = train_profiled(
        model,
        relu_zeros.batches,
        lambda out, y: weight * nn.functional.cross_entropy(out.float(), y),
        precision="fp16",
        loss_scale=static_scale,
        static=True,
        steps=6,
        lr=3e-3,
    )
    return run, seen


def test_steps_the_scaler_skipped_are_no_evidence_of_flushed_gradients() -> None:
    """A static loss scale of 2^40: every step's gradients overflow and the scaler skips every step. The advisor
    said "[critical] fp16 gradients flushed to zero ... fc1, fc2, fc3 held no nonzero value ... training stalled"
    and sent the user to bf16: their gradients hold nan and ReLU's zeros over it (the test's own hooks), which is
    no flushing, and the loss did not move because no step went through. The underflow rule reads the steps that
    went through now, and with none it says nothing; the overflow findings say what happened. The same loss
    scaled by 2^40 in a loop without a scaler skips nothing: its first step's nan and zeros are no module that
    "held no nonzero value" either."""
    run, seen = _overflowing_run(2.0**40)
    heads, hidden = seen[0::4], [g for i, g in enumerate(seen) if i % 4]
    assert len(heads) == 6 and all(bool(g.isinf().any()) for g in heads)  # every step overflows: skipped
    assert all(bool(((g == 0) | g.isnan() | g.isinf()).all()) for g in hidden)  # no finite nonzero value
    assert all(bool((g == 0).any()) and bool(g.isnan().any()) for g in hidden)
    rec = run.recommend("t4")
    assert rec.finding("fp16_gradient_underflow") is None
    assert (
        rec.finding("fp16_gradient_overflow") is not None and rec.finding("scaler_skipped_steps") is not None
    )

    unscaled, seen = _overflowing_run(None)
    assert bool(seen[0].isinf().any()) and not unscaled.tables["steps"][T.SKIPPED].any()
    assert all(bool(((g == 0) | g.isnan() | g.isinf()).all()) for g in seen[1:4])  # step 0, as above
    f = unscaled.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and not f.numbers["fp16_flushed"] and f.severity == "info"
    assert "held no nonzero value" not in f.message


def test_gradients_among_fp16s_subnormals_at_the_runs_scale_are_warned_of() -> None:
    """The ReLU classifier weighted by 2^-24 under a GradScaler at 2^16: at that scale every nonzero gradient of
    the ReLUs' outputs (the fp32 run's, which the test's hooks scale and cast to fp16) is an fp16 subnormal, and a
    few percent of them flush, fewer than the 20% that made the gradients "flushed to zero". The finding read
    "Nothing to fix: at the run's loss scale 2^16, 0% of the values recorded flush" (the values recorded are the
    survivors) beside fp16_loss_scale's 2^32. It warns now that they run into fp16's floor at the run's scale, with
    the shares flushed and subnormal, and that the recommended scale lifts them; at that scale nothing is said."""
    weight, scale = 2.0**-24, 2.0**16
    _, seen32 = relu_zeros.run("fp32", weight=weight, hooked=nn.ReLU)
    g = torch.cat([t.flatten() for t in seen32]) * scale
    nonzero = g[g != 0]
    flushed = float((nonzero.half() == 0).float().mean())
    subnormal = float((nonzero.abs() < 2.0**-14).float().mean())
    assert 0.01 < flushed < AdvisorConfig().fp16_flushed_zero_share and subnormal == 1.0
    run, _ = relu_zeros.run("fp16", weight=weight, loss_scale=scale)
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and f.severity == "warning" and f.numbers["fp16_flushed"]
    assert f.numbers["fp16_flushed_zero_share"] == pytest.approx(flushed, abs=0.005)
    assert f.numbers["fp16_subnormal_share"] == pytest.approx(subnormal, abs=0.01)
    assert f.title == (
        f"fp16 gradients run into fp16's floor at loss scale 65536: "
        f"{f.numbers['fp16_flushed_zero_share'] * 100:.3g}% of the values of act1, act2, act3 flushed to zero"
    )
    assert "sit among fp16's subnormals, below 2^-14" in f.message and "Nothing to fix" not in f.remedy
    k = int(f.numbers["loss_scale_log2"])
    assert k > 16 and f.remedy.startswith(f"Scale the loss: GradScaler(init_scale={2**k}), ")
    assert f"lifts them off fp16's floor ({k - 16} binade(s) above the run's 2^16" in f.remedy

    # the remedy followed: at 2^k a cast to fp16 flushes next to none of the fp32 run's gradients (a few in a
    # million), and the run is not warned
    lifted = torch.cat([t.flatten() for t in seen32]) * 2.0**k
    assert float(((lifted.half() == 0) & (lifted != 0)).float().mean()) < 1e-3
    run, _ = relu_zeros.run("fp16", weight=weight, loss_scale=2.0**k)
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and f.severity == "info" and not f.numbers["fp16_flushed"]
    assert "fp16_subnormal_share" not in f.numbers


def test_the_underflow_counts_leave_out_the_steps_the_scaler_skipped() -> None:
    """relu_zeros' classifier under a dynamic GradScaler started at 2^24: its gradients overflow there, and the
    scaler skips the first steps, halving its scale after each, until one goes through. The finding decided on
    the steps that went through, but its counts read every step: "264,647 nonzero values ... 0.014% at scale 1"
    held the skipped steps' finite values, read at scales the scaler then left. Its numbers are those of the
    steps that went through now, checked against the test's own hooks (every module's output gradient, the
    scale of each step from GradScaler's start and back-off), and it says how many it left out."""
    torch.manual_seed(0)
    model = relu_zeros.ReluNet()
    seen = relu_zeros.output_gradients(model, (nn.Linear, nn.ReLU))  # type: ignore[arg-type]
    params = list(model.parameters())
    finite: list[bool] = []  # whether each parameter's gradient was finite, on each step
    for p in params:
        p.register_hook(lambda g: finite.append(bool(g.isfinite().all())))
    steps = 8
    run = train_profiled(
        model,
        relu_zeros.batches,
        lambda out, y: nn.functional.cross_entropy(out.float(), y),
        precision="fp16",
        loss_scale=2.0**24,
        steps=steps,
        lr=3e-3,
    )
    per_step = [seen[7 * s : 7 * s + 7] for s in range(steps)]  # the 7 modules' gradients, each step
    assert len(seen) == 7 * steps and {g.dtype for g in seen} == {torch.float16}
    # a step whose weight gradients hold inf or nan is skipped, and the scale halves after it (GradScaler's
    # back-off)
    n = len(params)
    skipped = [not all(finite[n * s : n * s + n]) for s in range(steps)]
    scales = [2.0**24]
    for s in skipped[:-1]:
        scales.append(scales[-1] / 2 if s else scales[-1])
    assert list(run.tables["steps"][T.SKIPPED]) == skipped and 0 < sum(skipped) < steps
    went = [s for s in range(steps) if not skipped[s]]
    held = torch.cat([g.float().flatten() for s in went for g in per_step[s]])  # as fp16 held them, scaled
    unscaled = torch.cat([g.float().flatten() / scales[s] for s in went for g in per_step[s]])
    nonzero = unscaled[unscaled != 0]
    flushed_at_1 = (nonzero.half() == 0) & (nonzero.abs() != 2.0**-25)  # (a value on 2^-25 is said apart)

    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None
    assert f.numbers["nonzero_values"] == len(nonzero)
    assert f.numbers["share_at_scale_1"] == pytest.approx(int(flushed_at_1.sum()) / len(nonzero), rel=1e-12)
    assert f.numbers["fp16_zero_share"] == pytest.approx(int((held == 0).sum()) / held.numel(), rel=1e-12)
    assert f.numbers["run_scale_log2"] == round(math.log2(sorted(scales[s] for s in went)[len(went) // 2]))
    k = int(f.numbers["loss_scale_log2"])
    at_k = nonzero * 2.0**k
    assert f.numbers["underflow_at_recommended"] == int(((at_k.half() == 0) & (at_k.abs() != 2.0**-25)).sum())
    assert f.numbers["skipped_steps_left_out"] == sum(skipped)
    assert (
        f"Every gradient counted here is of the {len(went)} sampled step(s) the optimizer took; the "
        f"{sum(skipped)} the loss scaler skipped are left out" in f.message
    )


class _MaskedRegression(nn.Module):
    """A regression MLP over sequences of 8 positions of which only the first carries loss, as a masked LM's
    few labelled positions: the activation gradients of every other position are exact zeros, in fp32 too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.head = (
            nn.Linear(16, 64),
            nn.Tanh(),
            nn.Linear(64, 64),
            nn.Linear(64, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))


def _masked_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 8, 16, generator=torch.Generator().manual_seed(0))
    return x, x[..., :1] * 0.5


def _masked_loss(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2.0**-28 * nn.functional.mse_loss(pred[:, :1].float(), y[:, :1])  # small: values at fp16's floor


@pytest.mark.parametrize("steps", [4, 10])
def test_structural_zeros_and_a_loss_that_moves_little_are_no_stall(steps: int) -> None:
    """An fp16 run under a GradScaler whose zeros are structural (7 of 8 positions carry no loss: 87.5% zeros in
    fp32 as well) and whose loss fell 0.5% in 4 steps, as the fp32 run's did, was told critically "the loss did not
    move (it changed by 0.5% over the run): training stalled" (ALBERT's and Mixtral's 4-step runs, identical to
    fp32 to 4 decimals). A stall needs enough steps, and a loss without a trend its noise resolves."""
    torch.manual_seed(0)
    run = train_profiled(
        _MaskedRegression(), _masked_batch, _masked_loss, precision="fp16", loss_scale=2.0**16, steps=steps
    )
    assert abs(run.losses[-1] / run.losses[0] - 1) < 0.02 and run.losses[-1] < run.losses[0]
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and f.severity != "critical" and "training stalled" not in f.message
    why = "too few to call it stalled" if steps < 10 else "steadily against its step-to-step noise"
    assert why in f.message
    assert (
        "the loss fell by" in f.message
    )  # its direction said: "changed by 28%" of a loss that rose (tester t2)


def _scaler_run(
    init_scale: float,
    growth_factor: float = 2.0,
    growth_interval: int = 2000,
    autocast: bool = False,
    steps: int = 4,
) -> tuple[ProfiledRun, list[list[torch.Tensor]], list[float]]:
    """tiny_gradients' MLP (loss weighted by 2^-16) under GradScaler("cpu", init_scale, growth_factor,
    growth_interval), fp32 or fp16 autocast. Returns the run, every step's layer-output gradients as the test's
    own hooks saw them (scaled, as the backward held them) and each step's scale (GradScaler's, read before its
    backward)."""
    torch.manual_seed(0)
    model = tiny_gradients.TinyGradNet()
    seen = relu_zeros.output_gradients(model, (nn.Linear, nn.Tanh))  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_factor=growth_factor, growth_interval=growth_interval
    )
    batches = regression_batches(tiny_gradients.N_IN)
    per_step: list[list[torch.Tensor]] = []
    scales: list[float] = []
    losses: list[float] = []
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, memory=False)
    with prof:
        for step in range(steps):
            x, y = batches(step)
            scales.append(float(scaler.get_scale()))
            before = len(seen)
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = tiny_gradients.weighted_mse(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            per_step.append(seen[before:])
            losses.append(loss.item())
    summary = {
        T.SUMMARY_CONFIG: {"precision": "fp16" if autocast else "fp32"},
        T.SUMMARY_MODEL: {"n_params": sum(p.numel() for p in model.parameters())},
        T.SUMMARY_CAPTURE: prof.summary(),
    }
    return ProfiledRun(prof.tables(), summary, losses), per_step, scales


def _flushed_at(per_step: list[list[torch.Tensor]], scales: list[float], target: float) -> float:
    """The share of the nonzero gradient values (each step's, unscaled by its own scale) that fp16 flushes at
    ``target``, the values exactly on 2^-25 left out as the histograms leave them out."""
    v = torch.cat([g.double().flatten() / scales[s] for s, gs in enumerate(per_step) for g in gs])
    v = v[v != 0] * target
    return float(((v.half() == 0) & (v.abs() != 2.0**-25)).double().mean())


def test_the_underflow_share_is_of_the_scale_the_run_had_when_it_is_no_power_of_two() -> None:
    """GradScaler(init_scale=1000): 2^9.97, a scale no power of two. The finding said '... at the run's scale
    2^10 (1024)', a scale the run never had (t2's Accelerate run at 3,814,697 read 2^22 (4194304)). It names the
    run's own scale now, and its share is the one at that scale: the histograms of a row are its values' binades
    at the row's scale, moved by a whole number of binades, so the share there is exact, as the test's own
    hooks count it."""
    run, per_step, scales = _scaler_run(1000.0)
    assert set(scales) == {1000.0}
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None
    assert f.numbers["run_scale"] == 1000.0 and f.numbers["run_scale_log2"] == pytest.approx(
        math.log2(1000.0)
    )
    truth = _flushed_at(per_step, scales, 1000.0)
    assert 0.001 < truth < 0.999  # some flush at the run's scale, not all
    assert f.numbers["share_at_run_scale"] == pytest.approx(truth, rel=1e-12)
    assert "share_at_run_scale_at_most" not in f.numbers  # exact: no bound
    said = f"at the run's scale 1000 (2^{math.log2(1000.0):.2f})"
    assert said in f.title and "2^10 (1024)" not in f.title + f.message
    assert f"at the run's loss scale 1000 (2^{math.log2(1000.0):.2f})" in f.message


def test_a_share_at_the_runs_scale_from_rows_at_other_scales_is_bounded() -> None:
    """A scaler that grows by 3 each step holds its rows at 1000, 3000, 9000 and 27000: the run's scale (the
    median of its rows' scales, one it had: 9000) is no power of two away from the others', whose binades fall
    across fp16's flush point there. The share is given as the bound it is (the binade across the flush point
    may flush in part), and the truth (the test's own hooks) lies within it."""
    run, per_step, scales = _scaler_run(1000.0, growth_factor=3.0, growth_interval=1)
    assert scales == [1000.0, 3000.0, 9000.0, 27000.0]
    f = run.recommend("t4").finding("fp16_gradient_underflow")
    assert f is not None and f"at the run's scale 9000 (2^{math.log2(9000.0):.2f})" in f.title
    assert f.numbers["run_scale"] == 9000.0
    truth = _flushed_at(per_step, scales, 9000.0)
    lo, hi = f.numbers["share_at_run_scale_at_least"], f.numbers["share_at_run_scale_at_most"]
    assert f.numbers["share_at_run_scale"] is None
    assert lo < hi and lo <= truth <= hi
    assert f"between {_pct(lo)} and {_pct(hi)} at the run's scale 9000 (2^{math.log2(9000.0):.2f})" in f.title
    assert "(bounded: the values of the rows held at scales a fraction of a binade away" in f.message


def test_an_overflow_finding_pairs_each_step_with_its_scale() -> None:
    """GradScaler(init_scale=1e12) under fp16 autocast overflows and halves its scale on each step: the finding
    listed the steps in step order beside the scales in ascending order ('On 7 sampled step(s) (0, 3, 6, ...)
    ... at 7 loss scales from 3.8147e+06 to 1e+12'), which read as step 0 at 3.8147e+06. Each step is paired with
    its own scale now."""
    run, _, scales = _scaler_run(1e12, autocast=True, steps=4)
    f = run.recommend("t4").finding("fp16_gradient_overflow")
    assert f is not None and f.numbers["steps"] == 4
    assert "(0 at loss scale 1e+12, 1 at 5e+11, 2 at 2.5e+11, 3 at 1.25e+11)" in f.message
    assert [f"{s:g}" for s in scales] == ["1e+12", "5e+11", "2.5e+11", "1.25e+11"]  # halved after each skip
