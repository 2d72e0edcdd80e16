"""What the advisor names as the cause of an fp16 run's trouble, on tiny real CPU autocast runs: the fp16 overflow
that made a run diverge, a run that never trained because its forward pass overflowed, and the loss scale sized on
the gradients fp16 computes (not the fp32 ones autocast computes a LayerNorm's weight gradient in)."""

from __future__ import annotations

import torch
from scenarios.loop import backward_and_step
from torch import nn

from precprof import tables as T
from precprof.analysis.advisor import Recommendation, recommend
from precprof.capture import Profiler
from precprof.report import numbers as report_numbers


def _fp16_run(
    model: nn.Module, xs: list[torch.Tensor], scaler: torch.amp.GradScaler | None = None
) -> tuple[Recommendation, Profiler, list[bool]]:
    """``model`` trained under fp16 autocast on the CPU (SGD, an MSE against zeros), one step per input of ``xs``,
    every step sampled; the advisor's recommendation for a V100, the Profiler and the steps the scaler skipped."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    skipped = []
    with Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, memory=False) as prof:
        for x in xs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            before = scaler.get_scale() if scaler is not None else 0.0
            backward_and_step(loss, opt, scaler)
            opt.zero_grad()
            skipped.append(scaler is not None and scaler.get_scale() < before)
            prof.step(loss=loss.detach())
    rec = recommend(prof.tables(), hardware="v100", summary={T.SUMMARY_CAPTURE: prof.summary()})
    return rec, prof, skipped


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def test_the_fp16_overflow_that_made_a_run_diverge_is_its_cause() -> None:
    """Two steps train, then the input grows 1e5-fold: the first Linear's fp16 output holds inf at step 2 and the
    loss is inf there, the run's last step. Every row from the divergence on was dropped before the fp16 rules ran,
    so the overflow that caused it was never fp16_activation_overflow (a run whose inf came at step 0 got it); it
    is now, critical, naming the layer and the step. run_diverged says "the last recorded step" for a single one,
    not "on all 1 recorded steps"."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 8, generator=g) for _ in range(3)]
    xs[2] = xs[2] * 1e5
    rec, prof, _ = _fp16_run(_mlp(), xs)
    acts = prof.tables()["layers"]
    acts = acts[(acts[T.TENSOR] == T.ACTIVATION) & (acts[T.MODULE] == "0")]
    inf = int(acts.loc[acts[T.STEP] == 2, T.INF].sum())
    assert inf > 0 and int(acts.loc[acts[T.STEP] < 2, T.INF].sum()) == 0
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.severity == "critical" and f.modules == ["0"]
    assert f.numbers["diverged_step"] == 2 and f.numbers["observed_inf_modules"] == 1
    assert f'At step 2, where the run diverged, the {inf:,} inf of "0" were the first non-finite' in f.message
    assert "0" in rec.fp16_keep_fp32
    diverged = rec.finding("run_diverged")
    assert diverged is not None and diverged.numbers["step"] == 2
    assert "The loss became nan at step 2, the last recorded step;" in diverged.message
    assert "the optimizer took that step." in diverged.message


def test_a_run_that_never_trained_for_its_forward_overflow_is_not_told_to_fix_the_loss_scale() -> None:
    """The input is 1e5 times too large: the first Linear's fp16 output is inf on every step, GradScaler skips
    all 3 and the weights never change. The scaler's finding said the loss scale is not the cause, and the
    verdict's first reason said "fix the loss scale"; it now sends the reader to the nan/inf's source. The
    nonfinite_forward card labels its numbers: whether the step was skipped (a flag), and the run of skips
    around it (not "steps skipped 1" beside "skipped_steps 3")."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 8, generator=g) * 1e5 for _ in range(3)]
    rec, _, skipped = _fp16_run(_mlp(), xs, torch.amp.GradScaler("cpu", init_scale=2.0**16))
    assert skipped == [True, True, True]
    sk = rec.finding("scaler_skipped_steps")
    assert sk is not None and sk.numbers["from_model"] == sk.numbers["skipped"] == 3
    first = rec.reasons[0]
    assert first.startswith(
        "This run never trained: the loss scaler skipped all 3 of its optimizer steps, each"
    )
    assert "remove the source of the nan/inf" in first and "fix the loss scale" not in first
    fwd = rec.finding("nonfinite_forward")
    assert fwd is not None
    shown = dict(report_numbers.shown(fwd.code, fwd.numbers))
    assert shown["its optimizer step skipped"] == "yes" and "steps skipped" not in shown
    assert shown["consecutive steps skipped"] == "3"
    assert shown["first of the consecutive skipped steps around it"] == "step 0"
    assert not {"skipped", "skipped_from", "skipped_to", "skipped_steps"} & set(shown)


def _ln_head() -> nn.Module:
    """A LayerNorm on the fp32 input (autocast computes it, and its weight gradient, in fp32), then a Linear
    with large weights (fp16): the LayerNorm's weight gradient, summed over 256 rows of W^T g, is about 10x the
    largest gradient fp16 computes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8))
    nn.init.normal_(model[1].weight, std=2.0)
    return model


def test_the_fp16_loss_scale_is_sized_on_the_gradients_fp16_computes() -> None:
    """The largest gradient of the run is the LayerNorm's weight gradient, fp32 under autocast, which no loss
    scale overflows; it sized the scale 2^3 below what the fp16 gradients (the Linear's, and the LayerNorm's
    output gradient, which the fp16 Linear computes) allow. The message names the gradient that sized it;
    trained at the advised scale, GradScaler skips no step."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(256, 16, generator=g) for _ in range(2)]
    rec, prof, _ = _fp16_run(_ln_head(), xs)
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR].isin(T.GRADIENT_KINDS)]
    ln_weight = float(
        grads.loc[(grads[T.MODULE] == "0") & (grads[T.TENSOR] == T.WEIGHT_GRAD), T.ABSMAX].max()
    )
    fp16 = grads[(grads[T.MODULE] == "1") | (grads[T.TENSOR] == T.ACTIVATION_GRAD)]
    assert ln_weight > 4 * float(fp16[T.ABSMAX].max())  # the run has the problem
    f = rec.finding("fp16_loss_scale")
    assert f is not None and f.numbers["grad_absmax"] == float(fp16[T.ABSMAX].max())
    assert f.numbers["autocast_fp32_left_out"] == 1
    k = int(f.numbers["loss_scale_log2"])
    # the largest 2^k keeping the fp16 gradients below 65504 / 4; sized on the LayerNorm's, it was 2^2 lower at least
    fits = [j for j in range(-16, 33) if float(fp16[T.ABSMAX].max()) * 2.0**j < 65504 / 4]
    assert k == max(fits) and ln_weight * 2.0 ** (k - 2) >= 65504 / 4
    top = fp16.loc[fp16[T.ABSMAX].idxmax()]
    assert f'("1"\'s weight gradient, step {int(top[T.STEP])})' in f.message and top[T.MODULE] == "1"
    assert 'leaving out the weight gradients of "0", which autocast computed in fp32' in f.message
    # the advice followed: no step skipped at 2^k (a lower bound of the largest gradient would not promise this)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**k, growth_interval=1000)
    model = _ln_head()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x in xs:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        backward_and_step(loss, opt, scaler)
        opt.zero_grad()
    assert scaler.get_scale() == 2.0**k  # never backed off: no skip


def test_the_sampling_reasons_count_the_step_a_crash_cut_off() -> None:
    """A loop that raises after a sampled step's forward pass: the cut-off step keeps its rows (a sampled step),
    and the summary's sampling reasons counted only the steps that ended (interval: 1 beside 2 sampled)."""
    model = _mlp()
    prof = Profiler(model, sample_every=1, memory=False)
    try:
        with prof:
            for step in range(2):
                model(torch.randn(4, 8)).sum().backward()
                if step == 1:
                    raise RuntimeError("the loop gave up")
                prof.step()
    except RuntimeError:
        pass
    steps = prof.tables()["steps"]
    assert T.flags(steps[T.CUT_OFF]).sum() == 1
    sampling = prof.summary()["sampling"]
    assert sum(sampling["reasons"].values()) == prof.summary()["sampled_steps"] == 2
    assert sampling["cut_off"] == steps[T.SAMPLE_REASON].iloc[-1]


def test_a_gradient_autocast_computes_in_fp32_would_overflow_nothing() -> None:
    """The LayerNorm's weight gradient, fp32 under autocast, is 1.7e5 at loss scale 1; every gradient fp16
    computes is below 3,000. fp16_gradient_overflow said it "would overflow fp16 at this run's loss scale" and that
    "held in fp16, GradScaler would skip those steps": fp16 autocast computes it in fp32, .grad is finite, and
    GradScaler skips nothing. No gradient fp16 computes overflows, so no such finding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8))
    nn.init.normal_(model[1].weight, std=200.0)
    g = torch.Generator().manual_seed(0)
    rec, prof, _ = _fp16_run(model, [torch.randn(256, 16, generator=g)])
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR].isin(T.GRADIENT_KINDS)]
    ln_weight = grads[(grads[T.MODULE] == "0") & (grads[T.TENSOR] == T.WEIGHT_GRAD)]
    assert float(ln_weight[T.ABSMAX].max()) > 65504 and int(ln_weight[T.overflow_col("fp16")].sum()) > 0
    assert float(grads.drop(ln_weight.index)[T.ABSMAX].max()) < 3000
    assert rec.finding("fp16_gradient_overflow") is None


def test_the_loss_scale_names_no_weight_gradient_of_a_module_without_weights() -> None:
    """A dropout between two LayerNorms: autocast computes its gradient in fp32, as theirs, but it has no weight:
    the message listed "the weight gradients of 0, 1, 2" (HF ViT's embeddings.dropout, ConvNeXt's drop_path
    Identity); it names the dropout's output gradient alone (the count, 3, is of the modules whose gradients are
    left out)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Dropout(0.1), nn.LayerNorm(16), nn.Linear(16, 8))
    g = torch.Generator().manual_seed(0)
    rec, _, _ = _fp16_run(model, [torch.randn(32, 16, generator=g) for _ in range(2)])
    f = rec.finding("fp16_loss_scale")
    assert f is not None and f.numbers["autocast_fp32_left_out"] == 3
    assert 'leaving out the weight gradients of "0", "2", which autocast computed in fp32' in f.message
    assert 'and the output gradients of "0", "1", which no matmul run in fp16 reads' in f.message


def test_the_loss_scale_names_the_parameter_whose_gradient_is_the_largest() -> None:
    """A Linear fed inputs of 1e-3: its bias gradient (a sum of the output gradients) is 1,000x its weight
    gradient, and the largest gradient. fp16_loss_scale named it "0's weight gradient" (any weight_grad row
    was a weight's); it names the bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    g = torch.Generator().manual_seed(0)
    rec, prof, _ = _fp16_run(model, [torch.randn(32, 16, generator=g) * 1e-3 for _ in range(2)])
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR].isin(T.GRADIENT_KINDS)]
    top = grads.loc[grads[T.ABSMAX].astype(float).idxmax()]
    assert top[T.TENSOR] == T.WEIGHT_GRAD and top[T.PARAM] == "bias"
    f = rec.finding("fp16_loss_scale")
    assert f is not None and f'("0"\'s bias gradient, step {int(top[T.STEP])})' in f.message
