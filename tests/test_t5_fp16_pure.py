"""A Hugging Face T5 trained in fp16 weights (``model.half()``, as ``torch_dtype=torch.float16`` loads one), its
feed-forward output ``wo`` beyond fp16's range: the overflow, and the remedy T5 itself uses
(``_keep_in_fp32_modules = ["wo"]``: wo's weights in fp32; T5 casts wo's input to its weight's dtype), judged on
real tiny training runs on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

import precprof
from precprof.analysis.advisor import AdvisorConfig

transformers = pytest.importorskip("transformers")

WO = "encoder.block.1.layer.1.DenseReluDense.wo"
DROP = "encoder.block.1.layer.1.dropout"  # T5LayerFF's dropout of wo's output, before the residual add


def _t5_pure_fp16(
    keep_wo: bool, steps: int = 4
) -> tuple[precprof.Recommendation, list[float], float, set[torch.dtype]]:
    """A T5 of 2 layers (d_model 64, d_ff 128) whose second encoder block's wi and wo weights are 160x (its wo
    output reaches ~1e5), cast to fp16; ``keep_wo``: that wo kept in fp32 (``.float()``), as transformers'
    ``_keep_in_fp32_modules`` keeps it in a model loaded with ``torch_dtype=torch.float16`` (a model built from
    its config with that dtype is not: every weight is fp16). Trained ``steps`` steps of AdamW on a reversal task,
    every step sampled. Returns the advisor's recommendation, the losses and wo's largest fp32 output |x| (seen by
    a hook of the test's own, NaN with wo in fp16) and the dtypes of DROP's output (its gradient's dtype)."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32, decoder_start_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("encoder.block.1.layer.1.DenseReluDense.w"):
                p.mul_(160.0)
    model = model.half()
    if keep_wo:
        model.get_submodule(WO).float()
    top = [float("nan")]

    def seen(mod: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        if out.dtype == torch.float32:
            top[0] = max(float(out.detach().abs().max()), 0.0 if top[0] != top[0] else top[0])

    model.get_submodule(WO).register_forward_hook(seen)
    dtypes: set[torch.dtype] = set()
    model.get_submodule(DROP).register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    gen = torch.Generator().manual_seed(1)
    losses = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with warnings.catch_warnings(), prof:
        warnings.simplefilter("ignore")
        for _ in range(steps):
            x = torch.randint(1, 128, (8, 16), generator=gen)
            loss = model(input_ids=x, labels=torch.flip(x, [1])).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    summary = {"capture": prof.summary(), "model": {"n_params": sum(p.numel() for p in model.parameters())}}
    tables = prof.tables()
    _advised.clear()
    _advised.append(
        lambda hw: precprof.recommend(
            tables, hardware=hw, config=AdvisorConfig(small_model_params=0), summary=summary
        )
    )
    return _advised[0](None), losses, top[0], dtypes


_advised: list = []  # the advisor on the last run of _t5_pure_fp16, for another target: _advised[0]("t4")


def test_t5_wo_kept_in_fp32_in_an_fp16_pure_run_is_not_told_to_be_kept_in_fp32_again() -> None:
    """With wo's weights in fp32 (T5's own remedy), wo computes in fp32 and its output (max |x| ~1e5) stays fp32:
    the dropout after it and the residual add promote, T5's clamp does not apply to an fp32 stream, and the
    next fp16 matmuls read the layer norm's fp16 output; the run trains (finite losses). precprof warned
    fp16_activation_overflow "values in fp32/bf16 tensors would become inf ... keep these modules in fp32 (outside
    autocast)": advice the run already follows, for a cast nothing in it makes. That overflow is no finding now;
    fp16_kept_fp32 says wo ran in fp32 and still needs it (its values go beyond 65504), in the words of an
    fp16-pure run (its weights in fp32, no autocast), and fp16_keep_fp32 keeps it."""
    rec, losses, top, _ = _t5_pure_fp16(keep_wo=True)
    assert all(torch.isfinite(torch.tensor(losses))) and top > 65520.0  # trains, with wo's output beyond fp16
    assert rec.finding("fp16_activation_overflow") is None
    kept = rec.finding("fp16_kept_fp32")
    assert kept is not None and kept.modules == [WO] and kept.numbers["still_needed"] == 1
    assert "autocast" not in kept.title + kept.message + kept.remedy.split("; under bf16")[0]
    assert f"{WO} ran in fp32 in this fp16-pure run (every output fp32)" in kept.message
    assert kept.remedy.startswith(
        f"Keep {WO} in fp32 (its weights in fp32, .float(), and its input cast to fp32"
    )
    assert WO in rec.fp16_keep_fp32


def test_t5_wo_overflowing_in_an_fp16_pure_run_is_named_with_a_remedy_for_a_model_without_autocast() -> None:
    """The same T5 with wo in fp16: wo's output holds inf at step 0 (T5's clamp after the block turns them into
    64504, so that step's loss is finite), and a dropout's zeros times inf make nan, so the run diverges.
    fp16_activation_overflow names wo, critical, and its remedy keeps wo in fp32 in words that apply where there
    is no autocast to leave (its weights in fp32, its input cast to them); the run above proves that remedy."""
    rec, losses, _, _ = _t5_pure_fp16(keep_wo=False)
    assert not all(torch.isfinite(torch.tensor(losses)))
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.severity == "critical" and f.modules == [WO]
    assert "outside autocast" not in f.remedy
    assert (
        "keep these modules in fp32 (their weights in fp32, .float(), and their input cast to fp32"
        in f.remedy
    )
    assert WO in rec.fp16_keep_fp32


def test_t5_fp32_gradients_after_a_layer_held_in_fp32_are_not_counted_as_fp16_underflow() -> None:
    """With wo held in fp32, the dropout after it computes in fp32 (its output, and so its gradient, fp32 on every
    step: the test's own hook), and its gradient is tiny (the residual stream, ~1e5, is divided by its norm's
    rms on the way back). fp16_gradient_underflow read "98.6% of 245,760 nonzero activation-gradient values that
    were not fp16 flush to zero in fp16", all of them that dropout's: a what-if for gradients this fp16 run holds
    in fp32, and would hold so with the advice followed (fp16_keep_fp32 keeps wo). They are left out and named
    now, as an autocast run's are; the fp16 gradients' own floor (scale 1) is what the finding says."""
    rec, _, _, dtypes = _t5_pure_fp16(keep_wo=True)
    assert dtypes == {torch.float32}
    f = rec.finding("fp16_gradient_underflow")
    assert f is not None and DROP not in f.modules
    assert "that were not fp16" not in f.title + f.message
    assert f"left out: {DROP}, whose gradients an fp16 run holds in fp32" in f.message


def test_t5_wo_held_in_fp32_in_an_fp16_pure_run_is_said_without_autocast_in_the_verdict_and_scale() -> None:
    """The verdict's reasons on wo (held in fp32 by an fp16-pure run) said "as this run already does (outside
    autocast)" under an fp16 verdict (a T4) and "ran in fp32 outside autocast" under bf16; fp16_loss_scale said
    wo's gradients "stay fp32 under autocast". The run has no autocast: the texts say its weights are fp32."""
    _t5_pure_fp16(keep_wo=True)
    for hw, fmt in (("t4", "fp16"), ("a100", "bf16")):
        rec = _advised[0](hw)
        assert rec.format == fmt
        said = " ".join(rec.reasons)
        assert WO in said and "outside autocast" not in said
        f = rec.finding("fp16_loss_scale")
        assert f is not None and "under autocast" not in f.message
    rec = _advised[0]("t4")
    assert (
        f"Keep {WO} in fp32 as this run already does (its weights in fp32): its own values still need it"
        in " ".join(rec.reasons)
    )
