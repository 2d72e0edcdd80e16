"""fp16's advice at the ends of the loss-scale range the advice allows (AdvisorConfig.min_loss_scale_log2 and
max_loss_scale_log2), on real tiny training runs (CPU, seconds each): a gradient that no allowed scale keeps in
fp16's range is said to be one, and what each sentence claims is checked by training at that scale."""

from __future__ import annotations

import math

import pytest
import torch
from markupsafe import escape
from scenarios import huge_activations, kept_gradients, weighted_loss
from scenarios.loop import regression_batches

from precprof import hardware
from precprof import tables as T
from precprof.analysis import snippets
from precprof.analysis.advisor import AdvisorConfig
from precprof.report import filters as F
from precprof.report import render

MARGIN = (
    65504 / 4
)  # the advice keeps the largest gradient times the loss scale below 65504 / 2^fp16_margin_log2


def _all(seen: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for g in seen])


def _fitting_log2(gmax: float) -> int:
    """The largest k with gmax * 2^k < 65504 / 4, by exact powers of two."""
    k = 0
    while math.ldexp(gmax, k) >= MARGIN:
        k -= 1
    while math.ldexp(gmax, k + 1) < MARGIN:
        k += 1
    return k


def test_gradients_too_large_for_every_allowed_scale_are_said_to_overflow_there() -> None:
    """A loss 2^40 times the usual: the largest gradient (4e11) needs a loss scale of 2^-25, and the advice goes
    down to 2^-16. It said "2^-16 is the largest power of two that keeps it below 65504 / 4 = 1.64e+04 (max|g| x
    2^-16 = 6.72e+06)" and "Start at the recommended loss scale 2^-16, which keeps the largest gradient below the
    limit", and the verdict was fp16 at 2^-16. It says now that no allowed scale keeps them in range and how many
    values overflow there; trained at 2^-16 every step overflows, at 2^-25 none does."""
    weight = 2.0**40
    run, seen = weighted_loss.run(weight)
    g = _all(seen)
    rec = run.recommend("t4")
    scale = rec.finding("fp16_loss_scale")
    assert scale is not None
    k, raw = scale.numbers["loss_scale_log2"], _fitting_log2(float(g.abs().max()))
    assert k == AdvisorConfig().min_loss_scale_log2 and scale.numbers["fitting_scale_log2"] == raw < k
    # at 2^k, whole binades at or above 2^16 surely overflow; a real cast turns at least those into inf
    sure = int((g.abs() >= 2.0 ** (16 - k)).sum())
    cast = int(torch.isinf((g * 2.0**k).float().half()).sum())
    assert scale.numbers["overflow_values"] == sure and 0 < sure <= cast
    assert (
        f"no loss scale the advice allows keeps it below 65504 / 4 = 1.64e+04: it needs 2^{raw}"
        in scale.message
    )
    assert f"at least {sure:,} gradient values overflow fp16 there" in scale.message
    overflow = rec.finding("fp16_gradient_overflow")
    assert overflow is not None and "keeps the largest gradient below the limit" not in overflow.remedy
    for f in (scale, overflow):
        assert (
            f.remedy.startswith("Use bf16 or fp32, or make the gradients smaller") and f"2^{raw}" in f.remedy
        )
    underflow = rec.finding("fp16_gradient_underflow")
    assert underflow is not None and "Nothing to fix" not in underflow.remedy
    assert rec.format == "fp32" and "no loss scale the advice allows keeps the gradients" in rec.reasons[0]

    # trained in fp16 at the clamped scale, every step overflows and the scaler skips it; at 2^raw none does
    at_k, _ = weighted_loss.run(weight, "fp16", loss_scale=2.0**k, static=True)
    assert at_k.tables["steps"][T.SKIPPED].all()
    at_raw, seen_raw = weighted_loss.run(weight, "fp16", loss_scale=2.0**raw, static=True)
    assert not at_raw.tables["steps"][T.SKIPPED].any() and bool(_all(seen_raw).isfinite().all())
    # bf16, the advice: no loss scale, no overflow, and it trains
    bf16, seen16 = weighted_loss.run(weight, "bf16")
    assert bool(_all(seen16).isfinite().all()) and bf16.losses[-1] < bf16.losses[0]


def test_gradients_that_fit_fp16_only_without_the_headroom_at_the_smallest_scale_are_said_to() -> None:
    """A loss 2^32 times the usual: the largest gradient needs 2^-17 to stay below 65504 / 4, and at 2^-16 it lies
    between that and 65504. It was "the largest power of two that keeps it below 1.64e+04" with a product above
    it; now it is within fp16's range without the headroom, and trained at 2^-16 no step overflows."""
    weight = 2.0**32
    run, seen = weighted_loss.run(weight)
    g = _all(seen)
    gmax = float(g.abs().max())
    rec = run.recommend("t4")
    scale = rec.finding("fp16_loss_scale")
    assert scale is not None
    k, raw = scale.numbers["loss_scale_log2"], _fitting_log2(gmax)
    assert raw < k == -16 and MARGIN <= math.ldexp(gmax, k) < 65504
    assert "largest power of two" not in scale.message
    assert scale.message.endswith(
        f"max|g| x 2^-16 = {math.ldexp(gmax, k):.3g}: within fp16's 65504, without the headroom."
    )
    overflow = rec.finding("fp16_gradient_overflow")
    assert overflow is not None
    assert overflow.remedy.endswith(
        "below fp16's 65504 but not below the headroom the advice keeps (fp16_loss_scale)."
    )
    assert rec.format == "fp16" and rec.loss_scale == 2.0**k
    at_k, seen_k = weighted_loss.run(weight, "fp16", loss_scale=2.0**k, static=True)
    assert not at_k.tables["steps"][T.SKIPPED].any() and bool(_all(seen_k).isfinite().all())


def test_gradients_below_the_largest_allowed_scale_are_stopped_by_the_cap_not_their_range() -> None:
    """A loss 2^-60 times the usual: its gradients span a few binades near 1e-19, all of them flushed at 2^32,
    the largest loss scale the advice allows. The remedy said "no single fp16 loss scale covers these gradients'
    range": it is the cap that stops fp16, and a scale of 2^75 (the one the gradients allow) holds them all.
    Trained at it, the fp16 run skips no step and its gradients are the fp32 run's; at 2^32 every activation
    gradient is zero; bf16, the advice, keeps them."""
    weight = 2.0**-60
    run, seen = weighted_loss.run(weight)
    g = _all(seen)
    raw = _fitting_log2(float(g.abs().max()))
    rec = run.recommend("t4")
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and f.severity == "critical" and f.numbers["loss_scale_log2"] == 32 < raw
    assert "covers these gradients' range" not in f.remedy
    assert f.remedy.startswith(
        f"Use bf16 or fp32: fp16 needs a loss scale of 2^{raw} to lift these gradients"
    )
    assert "AdvisorConfig.max_loss_scale_log2" in f.remedy and "GradScaler can hold" not in f.remedy
    assert rec.finding("bf16_gradient_underflow") is None and run.recommend("a100").format == "bf16"

    def zeros(seen: list[torch.Tensor]) -> float:
        return float((_all(seen) == 0).double().mean())

    assert zeros(seen) < 0.01
    _, seen_cap = weighted_loss.run(weight, "fp16", loss_scale=2.0**32, static=True)
    assert zeros(seen_cap) > 0.99
    at_raw, seen_raw = weighted_loss.run(weight, "fp16", loss_scale=2.0**raw, static=True)
    assert not at_raw.tables["steps"][T.SKIPPED].any() and zeros(seen_raw) < 0.01
    _, seen16 = weighted_loss.run(weight, "bf16")
    assert zeros(seen16) < 0.01


def test_gradients_below_both_formats_send_the_user_to_fp32_from_both_findings() -> None:
    """A loss 1e-38 times the usual: gradients among fp32's subnormals, below bf16's smallest value and far below
    what fp16 at any scale GradScaler can hold lifts into range. fp16_gradient_underflow said "Use bf16 or fp32"
    and bf16_gradient_underflow "Use fp16 with a loss scale or fp32": each sent the user to the other. Both say
    fp32 now, and why the other format will not do; the training runs show both formats lose the gradients."""
    weight = 1e-38
    run, seen = weighted_loss.run(weight)
    g = _all(seen)
    raw = _fitting_log2(float(g.abs().max()))
    nonzero = g[g != 0]
    bf16_lost = float((nonzero.float().bfloat16() == 0).double().mean())  # real casts
    assert raw > 127 and bf16_lost > 0.5
    rec = run.recommend("t4")
    f16, b16 = rec.finding("fp16_gradient_underflow"), rec.finding("bf16_gradient_underflow")
    assert f16 is not None and b16 is not None and f16.severity == b16.severity == "critical"
    assert (
        f16.remedy.startswith("Use fp32 (bf16, without a loss scale, flushes ")
        and "bf16 or" not in f16.remedy
    )
    assert f"fp16 needs a loss scale of 2^{raw}" in f16.remedy and "at most 2^127" in f16.remedy
    assert b16.remedy.startswith("Use fp32 for this model; fp16 is ruled out too: ")
    assert "fp16 with a loss scale" not in b16.remedy
    assert bf16_lost >= b16.numbers["share"] > 0.5  # whole binades below 2^-133: a lower bound of the casts'
    assert rec.format == "fp32"

    # the runs: bf16 and fp16 at the largest allowed scale lose most of the gradients fp32 keeps
    def zeros(seen: list[torch.Tensor]) -> float:
        return float((_all(seen) == 0).double().mean())

    assert zeros(seen) < 0.01
    _, seen_bf16 = weighted_loss.run(weight, "bf16")
    _, seen_fp16 = weighted_loss.run(weight, "fp16", loss_scale=2.0**32, static=True)
    assert zeros(seen_bf16) > 0.5 and zeros(seen_fp16) > 0.99


def test_the_verdict_box_gives_no_fp16_loss_scale_where_fp16_is_ruled_out() -> None:
    """Where the measurements rule fp16 out (gradients no allowed loss scale keeps in range), the verdict box
    still said "none needed for FP32 (if you use FP16: init_scale = 2^-16)", a scale at which every step
    overflows. It says fp16 is ruled out; a run that allows fp16 keeps the hint."""
    ruled_out, _ = weighted_loss.run(2.0**40)
    fine, _ = weighted_loss.run(1.0)
    for run, out in ((ruled_out, True), (fine, False)):
        rec = run.recommend("t4", config=AdvisorConfig())  # fp32 for a model this small, either way
        assert rec.format == "fp32" and rec.fp16_ruled_out is out
        page = " ".join(render.render_html(run.tables, run.summary, rec).split())
        assert ("(the measurements rule FP16 out: see Why)" in page) is out
        assert ("(if you use FP16: init_scale =" in page) is not out


def test_the_verdict_box_s_fp16_hint_names_the_layers_fp16_must_keep_in_fp32() -> None:
    """A layer whose outputs overflow fp16 (``amplify``, one of three matmul layers: fp16 is not ruled out),
    under a verdict of bf16: the box said "if you use FP16: init_scale = 2^k" and nothing else, and the fp16 code
    kept no layer in fp32 (the verdict's keep list is bf16's, empty); in fp16, amplify's output holds inf.
    The hint and the fp16 code name amplify now."""
    torch.manual_seed(0)
    model = huge_activations.HugeActivationNet()
    x, _ = regression_batches(huge_activations.N_IN)(0)
    out = model.amplify(torch.relu(model.embed(x))).detach()
    assert bool(torch.isinf(out.half()).any())  # what fp16 does to its output: a real cast
    run = huge_activations.run()
    rec = run.recommend("a100")
    assert rec.format == "bf16" and not rec.fp16_ruled_out and rec.keep_fp32 == []
    assert rec.fp16_keep_fp32 == ["amplify"]
    page = " ".join(render.render_html(run.tables, run.summary, rec).split())
    assert (
        f"(if you use FP16: init_scale = {F.pow2(rec.fp16_loss_scale)}, and keep <code>amplify</code> in FP32: see "
        "the FP16 findings)" in page
    )
    assert "keep_fp32 = ['amplify']" in rec.snippet("pytorch", "fp16")


def test_where_fp16_is_ruled_out_no_finding_or_snippet_gives_a_scale_to_start_it_at() -> None:
    """Gradients 2^-60 as large as usual: fp16_gradient_underflow rules fp16 out at 2^32, the largest loss scale
    the advice allows, yet fp16_loss_scale still said "Start GradScaler at init_scale=4294967296", the fp16
    snippet started its GradScaler "at the recommended initial scale", and a bf16 verdict's reasons never said
    why fp16 was out. Trained at that scale, fp16 flushes every activation gradient. Now the finding says fp16
    is ruled out and why, the reasons say it beside bf16, and the fp16 code says it is not a plan that works; a
    run that fp16 fits keeps its scale and its code as they were."""
    weight = 2.0**-60
    run, _ = weighted_loss.run(weight)
    rec = run.recommend("t4")
    scale = rec.finding("fp16_loss_scale")
    assert rec.fp16_ruled_out and scale is not None and scale.numbers["loss_scale_log2"] == 32
    assert not scale.remedy.startswith("Start GradScaler") and "init_scale=" not in scale.remedy
    assert scale.remedy.startswith("No loss scale to start fp16 at: fp16 is ruled out (100% of activation")
    assert scale.remedy.endswith("Use bf16 or fp32.")
    _, at_scale = weighted_loss.run(weight, "fp16", loss_scale=2.0**32, static=True)
    assert float((_all(at_scale) == 0).double().mean()) > 0.99  # what that scale does: a real run
    code = rec.snippet("pytorch", "fp16")
    assert code.startswith("# precprof: the measurements rule FP16 out for this model")
    assert "recommended" not in code and "init_scale=2.0**32" in code
    bf16 = run.recommend("a100")
    assert bf16.format == "bf16" and bf16.fp16_ruled_out
    assert any(
        r.startswith("Not FP16: fp16 is ruled out: 100% of activation-gradient values") for r in bf16.reasons
    )

    fits, _ = weighted_loss.run(1.0)
    rec = fits.recommend("t4")
    scale = rec.finding("fp16_loss_scale")
    assert not rec.fp16_ruled_out and scale is not None and scale.remedy.startswith("Start GradScaler")
    assert "rule FP16 out" not in fits.recommend("a100").snippet("pytorch", "fp16")


def test_a_loss_scale_sized_on_overflowed_gradients_is_said_to_be_the_most_a_start_can_be() -> None:
    """A static loss scale of 2^40: every step overflows, so the run knows its largest gradient only as a lower
    bound (65504 / 2^40) and the scale sized on it, 2^32, is the most a start can be. The verdict box said a bare
    "if you use FP16: init_scale = 2^32", summary.json's fp16_loss_scale nothing more, and scaler_skipped_steps
    "Use GradScaler(init_scale=4294967296) or lower" with 3 skips "a better initial scale avoids". Trained at
    2^32, every step overflows too. The box, the recommendation and the reasons say it is an upper limit and
    point at a dynamic GradScaler, and no skip is counted as avoidable; a run that overflowed nowhere keeps its
    bare scale."""
    over, _ = weighted_loss.run(1.0, "fp16", loss_scale=2.0**40, static=True)
    assert T.flags(over.tables["steps"][T.SKIPPED]).all()
    rec = over.recommend("t4", config=AdvisorConfig())  # fp32 for a model this small, fp16's scale beside it
    scale = rec.fp16_loss_scale
    assert rec.format == "fp32" and scale == 2.0**32 and rec.fp16_loss_scale_at_most
    assert rec.to_dict()["fp16_loss_scale_at_most"] is True  # summary.json's recommendation
    # the largest gradient as an fp32 run of the same weights computes it: at 2^32 it overflows fp16
    _, seen = weighted_loss.run(1.0)
    assert float(_all(seen).abs().max()) * scale > 65504
    at_scale, _ = weighted_loss.run(1.0, "fp16", loss_scale=scale, static=True)
    assert T.flags(at_scale.tables["steps"][T.SKIPPED]).all()
    page = " ".join(render.render_html(over.tables, over.summary, rec).split())
    assert (
        '(if you use FP16: init_scale = 4,294,967,296 (2^32)<span id="scale-at-most"> at the most, in a dynamic '
        "GradScaler:" in page
    )
    skips = rec.finding("scaler_skipped_steps")
    assert skips is not None and skips.numbers["skipped"] == 3
    assert skips.numbers["avoidable"] is None and skips.numbers["above_start_limit"] == 3
    assert skips.numbers["start_scale_limit"] == scale and skips.numbers["recommended_scale"] is None
    assert skips.remedy.startswith("Use a dynamic GradScaler") and "init_scale=4294967296 at the most" in (
        skips.remedy
    )
    fp16 = over.recommend("t4")  # the scenarios' default: no small-model rule, an fp16 verdict
    assert fp16.format == "fp16" and fp16.loss_scale == scale
    assert any(
        r.startswith("Start a dynamic GradScaler at init_scale=4294967296 (2^32) at the most")
        for r in fp16.reasons
    )
    assert "init_scale at the most" in fp16.describe().splitlines()[0]
    page = " ".join(render.render_html(over.tables, over.summary, fp16).split())
    assert 'id="scale-at-most"' in page

    fine, _ = weighted_loss.run(1.0, "fp16", loss_scale=2.0**10)
    assert not T.flags(fine.tables["steps"][T.SKIPPED]).any()
    rec = fine.recommend("t4", config=AdvisorConfig())
    assert not rec.fp16_loss_scale_at_most
    assert 'id="scale-at-most"' not in render.render_html(fine.tables, fine.summary, rec)


def test_the_fp16_code_of_a_scale_that_is_the_most_a_start_can_be_does_not_call_it_recommended() -> None:
    """A static loss scale of 2^40, every step skipped: the scale sized on the overflowed gradients, 2^32, is the
    most a start can be, as the verdict box says. The fp16 code beside it said "a GradScaler at the recommended
    initial scale" (the Trainer's "start at the recommended scale", Lightning's "the recommended GradScaler"),
    under an fp16 verdict and as the code of the FP16 the measurements allow beside a small model's FP32. It
    says the scale is an upper limit, in every framework, on the page too."""
    over, _ = weighted_loss.run(1.0, "fp16", loss_scale=2.0**40, static=True)
    assert T.flags(over.tables["steps"][T.SKIPPED]).all()  # every step's gradients came with inf or nan
    small, large = over.recommend("t4", config=AdvisorConfig()), over.recommend("t4")
    assert small.format == "fp32" and small.measured_format == "fp16" and large.format == "fp16"
    for rec in (small, large):
        assert rec.fp16_loss_scale_at_most and rec.fp16_loss_scale == 2.0**32
        for fw in snippets.frameworks("fp16"):
            code = rec.snippet(fw, "fp16")
            assert "recommended" not in code and "init_scale=2.0**32" in code, fw
            assert code.startswith(
                "# precprof: this run's largest gradients came with inf or nan (fp16 overflow), so init_scale "
                "below\n# is the most a start can be, not a scale known to fit"
            ), fw
        page = render.render_html(over.tables, over.summary, rec)
        assert str(escape(rec.snippet("pytorch", "fp16"))) in page and 'id="scale-at-most"' in page
    fine, _ = weighted_loss.run(1.0, "fp16", loss_scale=2.0**10)
    assert "recommended initial scale" in fine.recommend("t4").snippet("pytorch")


# a CPU that runs bf16 natively (AVX512-BF16/AMX), as the AMD EPYC the report was read on
BF16_CPU = hardware.HardwareInfo(device="cpu", name="AMD EPYC", bf16_supported=True, bf16_native=True)


@pytest.mark.parametrize(("target", "small_model_default"), [("a100", True), (BF16_CPU, False)])
def test_the_verdict_box_that_sends_to_why_for_fp16_finds_it_there(
    target: str | hardware.HardwareInfo, small_model_default: bool
) -> None:
    """The verdict box says "the measurements rule FP16 out: see Why" wherever fp16_ruled_out; the reasons said
    why only for a bf16 verdict on a GPU with fp16 tensor cores. Under the small model's fp32 default, or on a
    CPU, Why said nothing of fp16 (a 150-block model whose activations overflow fp16 in 106 layers)."""
    run, _ = weighted_loss.run(2.0**-60)
    rec = run.recommend(target, **({"config": AdvisorConfig()} if small_model_default else {}))
    assert rec.fp16_ruled_out and rec.format == ("fp32" if small_model_default else "bf16")
    page = " ".join(render.render_html(run.tables, run.summary, rec).split())
    assert "(the measurements rule FP16 out: see Why)" in page
    assert [
        r for r in rec.reasons if r.startswith("Not FP16: fp16 is ruled out: 100% of activation-gradient")
    ]


def _nonzero(seen: list[torch.Tensor]) -> int:
    return sum(int((g != 0).sum()) for g in seen)


@pytest.mark.usefixtures("block_formats_on")  # post and head read the stream: their own input rows
def test_the_loss_scale_and_underflow_leave_out_the_gradients_of_the_layers_kept_in_fp32() -> None:
    """An un-normalised residual stream: big writes 1e5 into it, post and head read it, and fp16 keeps the three in
    fp32. head's weight gradient (2.6e6) sized the loss scale at 2^-8, where the tiny gradients of big and post
    flushed and ruled fp16 out; kept in fp32, they compute those gradients in fp32. The scale is now sized on the
    gradients fp16 computes (embed's and the blocks'), the finding says what it left out, and trained in fp16 at
    that scale with the three kept, no step overflows, the kept layers' output gradients are fp32 values no fp16
    cast rounded, and the loss follows fp32's."""
    run, _ = kept_gradients.run(kept_gradients.ResidualStream)
    rec = run.recommend("v100")
    keep = ["big", "post", "head"]
    assert rec.fp16_keep_fp32 == keep and not rec.fp16_ruled_out and rec.format == "fp16"
    layers = run.tables["layers"]
    grads = layers[layers[T.TENSOR].isin([T.ACTIVATION_GRAD, T.WEIGHT_GRAD])]
    fp16 = float(grads[~grads[T.MODULE].isin(keep)][T.ABSMAX].max())
    assert float(grads[T.ABSMAX].max()) > 1000 * fp16  # head's weight gradient
    scale = rec.finding("fp16_loss_scale")
    assert scale is not None and scale.numbers["grad_absmax"] == fp16
    k = _fitting_log2(fp16)
    assert scale.numbers["loss_scale_log2"] == k and rec.loss_scale == 2.0**k
    assert scale.numbers["kept_fp32_left_out"] == 3
    said = "leaving out the layers kept in fp32 (fp16_keep_fp32: big, post, head), whose gradients stay fp32"
    assert said in scale.message
    under = rec.finding("fp16_gradient_underflow")
    assert (
        under is not None
        and under.severity == "info"
        and "The counts of what fp16 would flush leave out the layers kept" in under.message
    )
    acts = grads[(grads[T.TENSOR] == T.ACTIVATION_GRAD) & ~grads[T.MODULE].isin(keep)]
    assert under.numbers["nonzero_values"] == int((acts[T.NUMEL] - acts[T.ZEROS]).sum())

    at_k, seen = kept_gradients.run(kept_gradients.ResidualStream, "fp16", loss_scale=2.0**k, keep_fp32=keep)
    assert not at_k.tables["steps"][T.SKIPPED].any()
    for m in keep:
        assert all(g.dtype == torch.float32 for g in seen[m])
        assert not all(torch.equal(g, g.half().float()) for g in seen[m])  # no fp16 cast rounded them
    assert at_k.losses == pytest.approx(run.losses, rel=1e-3)


def test_the_output_gradient_of_a_kept_layer_an_fp16_matmul_reads_still_counts() -> None:
    """near, within 2x of 65504, is kept in fp32; reader, in fp16, reads its output. near's output gradient is
    fp32, but reader's backward computed it in fp16 and a cast made it fp32: its values are fp16's, flushes
    included. It counts, and the finding says why."""
    run, _ = kept_gradients.run(kept_gradients.NearReader)
    rec = run.recommend("v100")
    assert rec.fp16_keep_fp32 == ["near"]
    under = rec.finding("fp16_gradient_underflow")
    assert under is not None
    assert "but for the output gradient of near, which reader reads in fp16" in under.message
    layers = run.tables["layers"]
    acts = layers[layers[T.TENSOR] == T.ACTIVATION_GRAD]
    assert under.numbers["nonzero_values"] == int((acts[T.NUMEL] - acts[T.ZEROS]).sum())
    assert under.numbers["max_norm_share_module"] == "near"

    _, seen = kept_gradients.run(
        kept_gradients.NearReader, "fp16", loss_scale=rec.loss_scale, keep_fp32=["near"]
    )
    assert all(g.dtype == torch.float32 and torch.equal(g, g.half().float()) for g in seen["near"])
    assert _nonzero(seen["near"]) < sum(g.numel() for g in seen["near"])  # fp16 flushed some of them
