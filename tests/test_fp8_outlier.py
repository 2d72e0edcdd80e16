"""An outlier that sets a tensor's per-tensor FP8 scale. One value of 3e4 in an N(0, 1) GEMM input (a "massive
activation", as large language models' residual streams hold) holds nearly all of its L2 norm, so what e4m3
flushes is 0.07% of the norm, under the 0.1% the rule allows, and the layer was called FP8-eligible; yet the
scale 2^-7 it sets puts 95% of the other values below e4m3's smallest normal, and the cast moves every other
token by 7% of its norm, against 2.7% without the outlier. The rule now counts the values a tensor's largest
0.1% push there (exact from the exponent histogram). Real tiny runs on the CPU, checked against real casts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis import lost_norm
from precprof.analysis.advisor import AdvisorConfig, Recommendation

TOKENS, WIDTH = 512, 256
E4M3_MAX, E4M3_MIN_NORMAL = 448.0, 2.0**-6


def activation(outlier: float | None) -> torch.Tensor:
    """N(0, 1) tokens x width, one value at ``outlier`` (token 7)."""
    x = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(0))
    if outlier is not None:
        x[7, 3] = outlier
    return x


class Source(nn.Module):
    """Emits the activation the linear layer reads (a residual stream): a module precprof watches."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("x", x)
        self.g = nn.Parameter(torch.ones(()))

    def forward(self) -> torch.Tensor:
        return self.x * self.g


class Model(nn.Module):
    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.src = Source(x)
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self) -> torch.Tensor:
        return self.lin(self.src())


def advice(x: torch.Tensor) -> Recommendation:
    """Two profiled steps of ``Model(x)`` in fp32 (lr 0: the input is the same on both), advised for an H100."""
    model = Model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for _ in range(2):
            loss = model().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    return precprof.recommend(prof, hardware="h100")


def scale(x: torch.Tensor) -> float:
    """The power-of-two current scale of e4m3: 2^floor(log2(448 / amax))."""
    return 2.0 ** math.floor(math.log2(E4M3_MAX / float(x.abs().max())))


def below_normal(x: torch.Tensor, s: float) -> float:
    """Share of the nonzero values below e4m3's smallest normal once multiplied by ``s``."""
    return float(((x.abs() * s < E4M3_MIN_NORMAL) & (x != 0)).double().mean())


def cast_error_per_token(x: torch.Tensor) -> torch.Tensor:
    """Per token, the relative L2 error of a real e4m3 cast under per-tensor current scaling."""
    s = scale(x)
    q = (x.double() * s).float().to(torch.float8_e4m3fn).double() / s
    return (q - x.double()).norm(dim=1) / x.double().norm(dim=1)


def test_an_outlier_that_sets_the_scale_holds_the_layer_back_with_its_numbers() -> None:
    x = activation(3e4)
    # independent: the whole-tensor norm e4m3 flushes is under the limit, the bulk is below the smallest normal
    s = scale(x)
    flushed = (x.double() * s).float().to(torch.float8_e4m3fn) == 0
    assert float(x[flushed].double().norm() / x.double().norm()) < AdvisorConfig().lost_norm_max
    share = below_normal(x, s)
    others = torch.ones(TOKENS, dtype=torch.bool)
    others[7] = False
    assert share > 0.9 and below_normal(x[others], scale(x[others])) < 1e-3  # the outlier put them there
    # and the cast moves each other token by more than twice what e4m3 moves it by without the outlier
    err, plain = cast_error_per_token(x)[others].median(), cast_error_per_token(activation(None)).median()
    assert err > 2 * plain
    rec = advice(x)
    f = rec.finding("fp8_eligibility")
    assert f is not None and f.modules == [] and rec.fp8_layers == []
    pushed = f.numbers["max_pushed_subnormal"]
    # the values the outlier pushed: all but those below the smallest normal under the bulk's own scale, which
    # the rule bounds from above by a binade (its largest value taken at its binade's upper edge)
    assert isinstance(pushed, float) and share - 2e-3 <= pushed <= share
    assert (
        f"lin (an outlier sets its input's e4m3 scale: its largest 0.1% of values push {pushed * 100:.3g}% of "
        "them below e4m3's smallest normal, where a value keeps at most 3 of its 4 significant bits)"
        in f.message
    )
    assert 'from_recipe_name("rowwise")' in f.remedy
    assert "what FP8 would do to the numbers decided" in " ".join(rec.reasons)


@pytest.mark.parametrize("outlier", [None, 10.0, 1e4])
def test_without_an_outlier_that_sets_the_scale_the_layer_stays_eligible(outlier: float | None) -> None:
    """No outlier, an ordinary one (10), one that puts 38% of the values below the normal range, where the cast
    moves each other token by 2.9% against 2.7% (under the 50% allowed): eligible."""
    x = activation(outlier)
    share = below_normal(x, scale(x))
    assert share < AdvisorConfig().fp8_pushed_subnormal_max
    f = advice(x).finding("fp8_eligibility")
    assert f is not None and f.modules == ["lin"]
    pushed = f.numbers["max_pushed_subnormal"]
    assert isinstance(pushed, float) and pushed <= share
    assert (
        f"Most values a tensor's largest 0.1% push below FP8's smallest normal: {pushed * 100:.3g}%"
        in f.message
    )


def test_outlier_channels_that_set_the_scale_are_measured_beside_the_largest_values_check() -> None:
    """Four channels of the input 1e4 times the others (4 of 256, 1.6% of the values: LLM.int8's outlier
    features) set the e4m3 scale and put nearly all the other values below e4m3's smallest normal; the check of
    the largest 0.1% of values hardly sees it (those all lie in the channels, at the scale the channels set), and
    the finding said "Most pushed there" of that check alone. It says now how much of a tensor lies below the
    smallest normal at its scale, measured from the histogram, which does not decide: the layer stays
    eligible."""
    x = activation(None)
    channels = torch.zeros(WIDTH, dtype=torch.bool)
    channels[[3, 70, 140, 200]] = True
    x[:, channels] *= 1e4
    share, rest = below_normal(x, scale(x)), x[:, ~channels]
    assert share > 0.9 and below_normal(rest, scale(rest)) < 1e-3  # the channels put them there
    f = advice(x).finding("fp8_eligibility")
    assert f is not None and f.modules == ["lin"]
    pushed, below = f.numbers["max_pushed_subnormal"], f.numbers["max_below_normal"]
    assert isinstance(pushed, float) and pushed < 0.01  # what the largest 0.1% push: next to nothing
    assert below == pytest.approx(share, rel=1e-12)  # exact: the binades meet the smallest normal
    # a bound of what real casts flush or leave subnormal: at this scale, and at torchao's default, 448 / amax
    assert below >= cast_below_normal(x, scale(x)) >= cast_below_normal(x, E4M3_MAX / float(x.abs().max()))
    assert cast_below_normal(x, E4M3_MAX / float(x.abs().max())) < 0.8 * below
    assert (
        f"Most values a tensor's largest 0.1% push below FP8's smallest normal: {pushed * 100:.3g}%. Values below "
        "FP8's smallest normal at a tensor's own scale, whatever put them there (not judged): at most "
        f"{share * 100:.3g}% of a tensor's (lin's input); over 50% in 1 tensor(s): lin's input" in f.message
    )
    assert "fewer where the scale is not rounded to a power of two, torchao's default" in f.method


def cast_below_normal(x: torch.Tensor, s: float) -> float:
    """Share of the nonzero values a real e4m3 cast at scale ``s`` leaves below its smallest normal (or flushes)."""
    q = (x.double() * s).float().to(torch.float8_e4m3fn).float()
    return float(((q.abs() < E4M3_MIN_NORMAL) & (x != 0)).double().mean())


def test_micro_batches_read_together_do_not_hold_a_layer_back() -> None:
    """Gradient accumulation over 12 micro-batches, one of them with 4 outlier channels (x1e4): the run sums the
    calls' histograms under the largest value of them all, so the outlier check read every micro-batch at the
    channels' scale, and held lin back ("push 75.5% below e4m3's smallest normal"), where a tensorwise recipe
    scales each call on its own and each call alone is eligible. A step of several calls is not judged now: the
    finding says so and how to judge it, and the share below the smallest normal is an upper bound of what real
    per-call casts leave there (23% of the step's values, here 95%)."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(128, WIDTH, generator=g) for _ in range(12)]
    xs[0][:, [3, 70, 140, 200]] *= 1e4
    per_call = sum(cast_below_normal(x, scale(x)) * x.numel() for x in xs) / sum(x.numel() for x in xs)
    assert 0.05 < per_call < 0.25 and cast_below_normal(xs[1], scale(xs[1])) < 1e-3
    model = Model(xs[0].clone())  # each micro-batch copied into its buffer
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            for x in xs:
                model.src.x.copy_(x)
                (model().pow(2).mean() / len(xs)).backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None and f.modules == ["lin"]
    below, pooled = f.numbers["max_below_normal"], f.numbers["max_pushed_pooled"]
    assert isinstance(below, float) and below > 3 * per_call
    assert isinstance(pooled, float) and pooled > AdvisorConfig().fp8_pushed_subnormal_max
    assert (
        "The outlier check could not judge an input or output gradient of 1 layer(s) (lin): it was read in "
        "several calls a step (gradient accumulation's micro-batches" in f.message
    )
    assert f"their largest values push {pooled * 100:.3g}% (lin's input), which does not decide" in f.message
    assert "a run without gradient accumulation" in f.message


def test_the_share_pushed_says_it_is_of_the_judged_tensors_alone() -> None:
    """Two micro-batches a step in bf16: every layer's input and output gradient is read in two calls, which the
    outlier check does not judge; it judges the weights. The finding said "Most pushed there: 0%" beside "could
    not judge 2 layer(s)", as if 0% were of every tensor: it says the figure is of the tensors judged, and which
    tensors of the layers it could not judge. The figure is the weights': at most the share of a weight's values
    a real e4m3 cast at its scale leaves below the smallest normal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights the run read are those after it
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            for _ in range(2):  # gradient accumulation: two micro-batches a step
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(torch.randn(32, 64)).float().square().mean() / 2
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None and f.modules == ["0", "2"]
    pushed, pooled = f.numbers["max_pushed_subnormal"], f.numbers["max_pushed_pooled"]
    assert isinstance(pushed, float) and isinstance(pooled, float)
    weights = [model[0].weight.detach(), model[2].weight.detach()]
    assert pushed <= max(cast_below_normal(w, scale(w)) for w in weights)
    assert "Most values a tensor's largest 0.1% push below FP8's smallest normal: " not in f.message
    assert (
        "Most values a tensor's largest 0.1% push below FP8's smallest normal, of the tensors judged (weights, and inputs and output gradients read in one call a "
        "step; not those read in several: see below): " in f.message
    )
    assert (
        'The outlier check could not judge an input or output gradient of 2 layer(s) ("0", "2"): it was read in '
        ""
        "several calls a step" in f.message
    )


class _Shared(nn.Module):
    """One linear layer called 3 times a forward (ALBERT's sharing), and a head called once."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for _ in range(3):
            h = h + nn.functional.gelu(self.fc(h))
        return self.head(h)


def _mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, 32), nn.Tanh(), nn.Linear(32, o))


def _loop_of_several_passes(kind: str) -> precprof.Profiler:
    """Two steps of a loop of one micro-batch on one rank whose layers are read in several calls a step, none
    called twice in one forward: LBFGS's closure evaluated 4 times (``lbfgs``); a GAN whose loop calls D on real
    and generated data, and backpropagates G's graph twice (``gan``: retain_graph=True); a WGAN whose critic steps
    twice per ``prof.step()`` (``critic``); and, as a contrast, gradient accumulation over 2 micro-batches of a
    loop that calls a part of the model itself (``parts accumulated``: a LightningModule's training_step); the model
    on two views of a batch, their losses summed into one backward (``two views``)."""
    torch.manual_seed(0)
    if kind == "lbfgs":
        model = _mlp(16, 1)
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        x, y = torch.randn(64, 16), torch.randn(64, 1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
            for _ in range(2):

                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = (model(x) - y).square().mean()
                    loss.backward()
                    return loss

                opt.step(closure)  # type: ignore[no-untyped-call]
                prof.step()
        return prof
    if kind == "two views":  # the model on two views of a batch, their losses summed into one backward
        model = _mlp(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
            for _ in range(2):
                x = torch.randn(16, 16)
                (model(x).square().mean() + model(x.flip(0) * 0.5).square().mean()).backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        return prof
    if kind == "parts accumulated":
        net = _mlp(16, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with precprof.Profiler(
            nn.ModuleDict({"net": net}), optimizer=opt, sample_every=1, memory=False
        ) as prof:
            for _ in range(2):
                for _ in range(2):
                    net(torch.randn(16, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        return prof
    G, D = _mlp(8, 16), _mlp(16, 1)
    oD, oG = torch.optim.Adam(D.parameters(), 1e-3), torch.optim.Adam(G.parameters(), 1e-3)
    with precprof.Profiler(
        nn.ModuleDict({"G": G, "D": D}), optimizer=[oD, oG], sample_every=1, memory=False
    ) as prof:
        for _ in range(2):
            for _ in range(2 if kind == "critic" else 1):
                fake = G(torch.randn(16, 8))
                oD.zero_grad()
                D(torch.randn(16, 16)).square().mean().backward()
                D(fake.detach()).mean().backward()
                oD.step()
            out = D(fake)
            oG.zero_grad()
            out.mean().backward(retain_graph=kind == "gan")
            if kind == "gan":
                out.square().mean().backward()
            oG.step()
            prof.step()
    return prof


@pytest.mark.parametrize("kind", ["lbfgs", "gan", "critic", "parts accumulated", "two views"])
def test_the_layers_read_in_several_calls_a_step_are_said_by_the_loops_passes(kind: str) -> None:
    """One micro-batch on one rank, no layer called twice in a forward. The finding blamed "gradient
    accumulation's micro-batches, a layer called more than once, several ranks" and told LBFGS's run to profile
    "one micro-batch each (a run without gradient accumulation, on one rank)", which it is; said D of a GAN was
    "called more than once in a forward (up to 2 calls a step per backward)", though the loop calls it once a
    forward, three times a step; and for the critic "up to 7 calls a step per backward", D's calls over the
    critic's first step's weight gradient alone (tester t2). Now the cause is the loop's, from what the capture
    saw of its passes (``capture.step_passes``, ``capture.loop_order``), and no remedy the run follows."""
    prof = _loop_of_several_passes(kind)
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None
    assert "could not judge an input or output gradient of" in f.message
    if kind == "parts accumulated":  # the remedy stays where it applies
        assert (
            "(gradient accumulation's micro-batches (a forward and backward each))" in f.message
            and f.message.count(
                ". To judge them, profile a few steps of one micro-batch each (a run without gradient "
                "accumulation)."
            )
            == 1
        ), f.message
        return
    for wrong in ("micro-batch", "on one rank", "called more than once", "per backward", "several ranks"):
        assert wrong not in f.message, (wrong, f.message)
    if kind == "lbfgs":
        assert prof.summary()[T.SUMMARY_STEP_PASSES] == {
            "model_forwards": {"least": 4, "most": 4},
            "closures": ["LBFGS"],
            "closure_evaluations": 4,
        }
        assert (
            '2 layer(s) ("0", "2"): it was read in several calls a step (LBFGS\'s closure, evaluated up to 4 '
            "times an optimizer step, each evaluation a forward and backward)" in f.message
        )
    elif kind == "two views":  # reviewer r2: "gradient accumulation's micro-batches", and its remedy
        assert (
            "it was read in several calls a step (2 forwards of the model a step into 1 backward pass (several "
            "views or losses of a batch summed before one backward))" in f.message
        ), f.message
    elif kind == "gan":
        assert prof.summary()[T.SUMMARY_STEP_PASSES]["model_forwards"] == {"least": 0, "most": 0}
        assert (
            "(G.0, G.2: more output gradients than calls a step: several backward passes through one forward "
            "(retain_graph=True, several losses backpropagated one by one); D.0, D.2: called in several forwards "
            "a step by the loop, which calls parts of the model itself" in f.message
        )
        assert "G.0, G.2, D.0, D.2 cannot be judged per call in a run of this loop" in f.message
    else:
        assert (
            "(optimizer 0 (Adam: D.0, D.2) stepping up to 2 times a prof.step() (a critic's steps beside the "
            "other optimizer's one)" in f.message
        )
    if kind != "gan":
        assert f.message.count("They cannot be judged per call in a run of this loop") == 1


def test_lightnings_closure_run_once_a_step_is_no_cause_its_micro_batches_are(tmp_path: Path) -> None:
    """Reviewer r1: Lightning's automatic optimization hands ``optimizer.step`` a closure that runs the last
    micro-batch's training step once; with ``accumulate_grad_batches=4`` the finding blamed "SGD's closure,
    evaluated up to 4 times an optimizer step" and withheld the remedy. A closure counts as passes of its own only
    where it ran more than once in an optimizer step (LBFGS); here the cause is the micro-batches, with the
    remedy, as a loop written by hand gets."""
    L = pytest.importorskip("lightning")
    from precprof.integrations.lightning import PrecprofCallback

    class Module(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return self(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16)), batch_size=16)
    out = tmp_path / "run"
    trainer = L.Trainer(
        max_steps=2,
        accumulate_grad_batches=4,
        callbacks=[PrecprofCallback(out=out, sample_every=1, report=False, memory=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(Module(), data)
    passes = T.read_summary(out)[T.SUMMARY_CAPTURE][T.SUMMARY_STEP_PASSES]
    assert passes["model_forwards"] == {"least": 4, "most": 4} and passes["closures"] == [], passes
    f = precprof.recommend(out, hardware="h100").finding("fp8_eligibility")
    assert f is not None and "(gradient accumulation's micro-batches (4 forwards a step))" in f.message, (
        f.message
    )
    assert "closure" not in f.message
    assert (
        "To judge them, profile a few steps of one micro-batch each (a run without gradient accumulation)"
        in (f.message)
    )


@pytest.mark.parametrize(("micro_batches", "frozen"), [(1, False), (2, False), (1, True)])
def test_a_layer_called_several_times_a_forward_is_not_sent_to_a_run_of_one_micro_batch(
    micro_batches: int, frozen: bool
) -> None:
    """A layer called 3 times a forward, in a run of one micro-batch on one rank: the finding told the user to
    'profile a few steps of one micro-batch each (a run without gradient accumulation, on one rank)', which this
    run is, and no run of the model gives one call a step. It says such a layer cannot be judged per call; under
    gradient accumulation, the remedy stays for the layers called once a forward (head), fc apart. With fc's
    weight frozen (LoRA on an ALBERT-like model), fc has no weight gradient to count the backward passes by: the
    step's are counted from the other layers, and the remedy stays away from it too."""
    torch.manual_seed(0)
    model = _Shared()
    model.fc.requires_grad_(not frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            for _ in range(micro_batches):
                x = torch.randint(0, 64, (64,))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x)
                (nn.functional.cross_entropy(logits.float(), x) / micro_batches).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None
    said = "called more than once in a forward cannot be judged per call, in this run or any other"
    if micro_batches == 1:
        assert "The outlier check could not judge an input or output gradient of 1 layer(s) (fc)" in f.message
        assert "(called more than once in a forward: up to 3 calls a forward)" in f.message
        assert f". A layer {said}" in f.message
        assert "a run without gradient accumulation" not in f.message, f.message
        return
    assert "could not judge an input or output gradient of 2 layer(s) (fc, head)" in f.message, f.message
    assert (
        "(fc: called more than once in a forward: up to 3 calls a forward; head: gradient accumulation's "
        "micro-batches (2 forwards a step))" in f.message
    )
    assert f". A layer {said}" in f.message
    assert (
        ". To judge head, profile a few steps of one micro-batch each (a run without gradient accumulation)."
        in f.message
    )


def test_a_weight_spread_wide_by_nature_is_not_held_back() -> None:
    """A weight whose values spread over 40 binades has most of them below e4m3's smallest normal under any
    scale: its largest values do not put them there, and it stays eligible (as issue 34's gradient tail)."""
    g = torch.Generator().manual_seed(3)
    model = Model(activation(None))
    with torch.no_grad():
        model.lin.weight.mul_(torch.exp2(-torch.randint(0, 40, model.lin.weight.shape, generator=g).float()))
    w = model.lin.weight.detach()
    assert below_normal(w, scale(w)) > 0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        loss = model().pow(2).mean()
        loss.backward()
        opt.step()
        prof.step(loss=loss)
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None and f.modules == ["lin"]
    pushed = f.numbers["max_pushed_subnormal"]
    assert isinstance(pushed, float) and pushed < 0.05


def _hist(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """floor(log2 |x|) histogram of the nonzero values, via frexp."""
    e, c = torch.unique(torch.frexp(x[x != 0])[1] - 1, return_counts=True)
    return e.numpy(), c.numpy()


def test_count_below_and_rank_edge_against_the_values() -> None:
    """The histogram helpers the rule reads, on two tensors at once, against the values themselves."""
    g = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(5000, generator=g) * 2.0 ** (-20 * torch.rand(5000, generator=g)),
        activation(3e4).flatten(),
    ]
    rows = [_hist(x) for x in xs]
    exponent = np.concatenate([e for e, _ in rows])
    count = np.concatenate([c for _, c in rows])
    group = np.concatenate([np.full(len(e), i) for i, (e, _) in enumerate(rows)])
    limits = np.array([-7.0, 1.0])
    below = lost_norm.count_below(exponent, count, group, limits)
    assert below.tolist() == [int((x.abs() < 2.0**t).sum()) for x, t in zip(xs, limits, strict=True)]
    ranks = np.array([1.0, 2.0])
    edges = lost_norm.rank_edge_log2(exponent, count, group, 2, ranks)
    for x, r, edge in zip(xs, ranks, edges, strict=True):
        v = float(x.abs().sort(descending=True).values[int(r) - 1])  # the r-th largest
        assert 2.0 ** (edge - 1) <= v < 2.0**edge  # its binade's upper edge
    assert np.isnan(lost_norm.rank_edge_log2(exponent, count, group, 2, np.array([1e9, 1.0]))[0])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_layer_trained_on_torchaos_rowwise_recipe_is_not_told_to_switch_to_it(recipe: str) -> None:
    """The outlier of 3e4 in ``lin``'s input, ``lin`` converted with torchao's recipe. Tensorwise: held back, with
    the rowwise recipe as the remedy. Rowwise: each token gets its own scale (torchao's own cast, below), so the
    outlier sets only its own token's and the per-tensor check does not apply; the finding said "Not eligible: lin
    (an outlier sets its input's e4m3 scale ...)" and told the user to switch to the recipe the run trained on.
    The run records its recipe (capture.fp8_recipe), and the precision check says it."""
    f8 = pytest.importorskip("torchao.float8")
    utils = pytest.importorskip("torchao.float8.float8_scaling_utils")
    mm = pytest.importorskip("torchao.float8.float8_training_tensor")
    x = activation(3e4)
    model = Model(x)
    f8.convert_to_float8_training(
        model, config=f8.Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=lambda m, n: n == "lin"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for _ in range(2):
            loss = model().float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    recipes = prof.summary()["fp8_recipe"]
    assert [(r["scaling"], r["layers"]) for r in recipes] == [(recipe, ["lin"])]
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None
    if recipe == "tensorwise":
        assert f.modules == [] and "Not eligible: lin (an outlier sets its input's e4m3 scale" in f.message
        assert 'from_recipe_name("rowwise")' in f.remedy
        return
    # independent: torchao's rowwise cast leaves almost none of the other tokens' values below e4m3's normal
    cast = utils.hp_tensor_to_float8_dynamic(
        x,
        torch.float8_e4m3fn,
        mm.LinearMMConfig(),
        scaling_granularity=f8.config.ScalingGranularity.AXISWISE,
        axiswise_dim=-1,
        round_scales_to_power_of_2=True,
    )
    assert float((cast._data.float().abs() < E4M3_MIN_NORMAL).double().mean()) < 0.01
    assert f.modules == ["lin"]
    assert "1 layer(s) (lin) ran torchao's rowwise recipe" in f.message
    assert "per-tensor outlier check does not apply to them" in f.message
    assert "rowwise" not in f.remedy


class TwoSources(nn.Module):
    """Two linear layers, each reading its own activation: ``a`` and ``b``."""

    def __init__(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        super().__init__()
        self.src_a, self.src_b = Source(xa), Source(xb)
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH, bias=False)
        self.b = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self) -> torch.Tensor:
        return self.a(self.src_a()) + self.b(self.src_b())


def test_every_tensor_with_most_of_its_values_below_the_normal_range_is_named() -> None:
    """Outlier channels in two layers' inputs (x1e4 in ``a``'s, x5e3 in ``b``'s) put most of each input below
    e4m3's smallest normal. The finding named only the tensor of the largest share, so an outlier channel in
    another layer went unnamed; it names each tensor over the limit now, with its share (real counts below)."""
    channels = [3, 70, 140, 200]
    xa, xb = activation(None), activation(None)
    xa[:, channels] *= 1e4
    xb[:, channels] *= 5e3
    share_a, share_b = below_normal(xa, scale(xa)), below_normal(xb, scale(xb))
    most = AdvisorConfig().fp8_pushed_subnormal_max
    assert share_a > share_b > most
    model = TwoSources(xa, xb)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for _ in range(2):
            loss = model().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None and f.numbers["below_normal_tensors"] == 2
    assert (
        f"over {most * 100:.3g}% in 2 tensor(s): a's input {share_a * 100:.3g}%, b's input {share_b * 100:.3g}%"
        in f.message
    )


class SharedDropout(nn.Module):
    """HF's T5Stack in small: one dropout applied to the embeddings (``src``, an outlier among them) and again to
    the encoder's output, which the cross-attention's ``k`` reads."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.src = Source(x)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(WIDTH)
        torch.manual_seed(0)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self) -> torch.Tensor:
        return self.k(self.drop(self.norm(self.drop(self.src()))))


class SharedAct(nn.Module):
    """A model that reuses one ``self.act`` after each layer: ``fc2`` reads its first output, which the act's
    second call, after ``fc2``, adds to its row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


def profiled_inputs(
    model: nn.Module, layer: str, steps: int, x: torch.Tensor | None = None
) -> tuple[Any, list]:
    """``steps`` profiled fp32 steps of ``model`` (called with ``x``, if any), and the tensor ``layer`` read on
    each step, taken by a pre-hook of ours."""
    read: list[torch.Tensor] = []
    model.get_submodule(layer).register_forward_pre_hook(
        lambda _, args: read.append(args[0].detach().clone())
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(steps):
            loss = (model() if x is None else model(x)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    return prof, read


def own_input_rows(prof: Any, layer: str) -> pd.DataFrame:
    """The activation rows of ``layer``'s own input row (``T.input_module``), by step."""
    lay = prof.tables()["layers"]
    rows = lay[(lay[T.MODULE] == T.input_module(layer)) & (lay[T.TENSOR] == T.ACTIVATION)]
    return rows.set_index(T.STEP)


@pytest.mark.usefixtures("block_formats_on")
def test_a_layer_whose_inputs_maker_ran_twice_is_judged_on_the_tensor_it_read() -> None:
    """T5's cross-attention k and v read the output of encoder.dropout, which T5 calls twice a step (on the
    embeddings and on the encoder's output): the run mapped them to that dropout's row, which pools both, and
    the FP8 finding said it 'could not judge' them, read in several calls a step, and told the user to profile
    without gradient accumulation, on one rank (neither of which the run had). k's own input row holds what it
    read now, equal to what a hook of ours saw, and nothing is pooled."""
    torch.manual_seed(1)
    prof, read = profiled_inputs(SharedDropout(activation(3e4)), "k", steps=2)
    assert prof.summary()["gemm_inputs"]["k"] == []
    lay = prof.tables()["layers"]
    drop = lay[(lay[T.MODULE] == "drop") & (lay[T.TENSOR] == T.ACTIVATION)]
    assert set(drop[T.CALLS]) == {2}  # the dropout's row pools the embeddings and the encoder's output
    rows = own_input_rows(prof, "k")
    assert list(rows.index) == [0, 1] and set(rows[T.CALLS]) == {1}
    for step, x in enumerate(read):
        assert rows.loc[step, T.NUMEL] == x.numel()
        assert rows.loc[step, T.ABSMAX] == pytest.approx(float(x.abs().max()), rel=1e-6)
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None and f.modules == ["k"]
    assert f.numbers["max_pushed_pooled"] is None
    assert "could not judge" not in f.message and "gradient accumulation" not in f.message
    # the share below e4m3's smallest normal is the input's it read (the pooled row's outlier put 95% there)
    below = f.numbers["max_below_normal"]
    assert isinstance(below, float) and below < 0.01
    shares = [below_normal(x, scale(x)) / float((x != 0).double().mean()) for x in read]  # of nonzero values
    assert (
        sum(shares) / 2 <= below + 1e-12
    )  # (the median of the two steps': of k's input, at most the largest)


@pytest.mark.usefixtures("block_formats_on")
def test_a_layer_whose_inputs_maker_ran_again_after_it_reads_its_own_input() -> None:
    """A shared ``self.act``: ``fc2`` reads its first output, and its second call adds to its row after ``fc2``
    read it. That row is left out of fc2's input (said), and from the second step on fc2's own input row holds
    what it read, equal to what a hook of ours saw; fc3, which reads the act's second output, reads its own
    input from the first step."""
    prof, read = profiled_inputs(SharedAct(), "fc2", steps=3, x=torch.randn(32, WIDTH))
    assert prof.summary()["gemm_inputs"]["fc2"] == ["act"] and prof.summary()["gemm_inputs"]["fc3"] == []
    rows = own_input_rows(prof, "fc2")
    assert list(rows.index) == [1, 2] and set(rows[T.CALLS]) == {1}
    for step in (1, 2):
        assert rows.loc[step, T.ABSMAX] == pytest.approx(float(read[step].abs().max()), rel=1e-6)
    assert list(own_input_rows(prof, "fc3").index) == [0, 1, 2]
    f = precprof.recommend(prof, hardware="h100").finding("fp8_eligibility")
    assert f is not None and f.modules == ["fc1", "fc2", "fc3"]
    assert "could not judge" not in f.message
    assert (
        "The input of 1 layer(s) (fc2) is an output of a module that ran more often in a step than the layer "
        "(act): its row adds up the outputs of all its calls, of which the layer read one" in f.message
    )
    assert (
        "(not judged on 1 sampled step(s); the layer's own input is read from the next one on)" in f.message
    )


def test_without_its_own_input_row_such_a_layer_is_said_judged_without_its_input() -> None:
    """With the block-format what-if off, T5's k reads its own input row too, as with it on. A run recorded
    before, with it off, had no row of a layer's own input (k's taken out of the tables here): k is judged on
    its weight and output gradient, and the finding says why: not 'made by no module precprof watches', nor
    pooled."""
    torch.manual_seed(1)
    prof, _ = profiled_inputs(SharedDropout(activation(3e4)), "k", steps=2)
    assert prof.summary()["gemm_inputs"] == {"k": []}
    assert list(own_input_rows(prof, "k").index) == [0, 1]
    assert (
        "was not recorded" not in precprof.recommend(prof, hardware="h100").finding("fp8_eligibility").message
    )
    older = {
        name: t[t[T.MODULE] != T.input_module("k")] if T.MODULE in t else t
        for name, t in prof.tables().items()
    }
    f = precprof.recommend(older, hardware="h100", summary={T.SUMMARY_CAPTURE: prof.summary()}).finding(
        "fp8_eligibility"
    )
    assert f is not None and f.modules == ["k"] and f.numbers["max_pushed_pooled"] is None
    assert (
        "The input of 1 layer(s) was not recorded (k: a module's output changed in place after the module "
        "returned it, or made by a module that ran more often in the step than the layer, which no row holds as "
        "the layer read it, and the run has no row of the layer's own input, as a run recorded by an older "
        "precprof with the block-format what-if off has none)"
    ) in f.message
