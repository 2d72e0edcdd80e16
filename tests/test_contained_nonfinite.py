"""nan/inf in the forward pass that never reach the loss, on real tiny training runs (CPU, seconds each): a
causal mask's -inf, an fp16 overflow the model clamps away. Each is checked by the test's own hooks: what the
module held, that the loss and every gradient were finite."""

from __future__ import annotations

import math

import pytest
import torch
from scenarios import causal_mask
from scenarios.loop import ProfiledRun

from precprof.analysis.advisor import Finding, Recommendation


def _watched(model: causal_mask.MaskedLM) -> tuple[dict[str, list[torch.Tensor]], list[bool]]:
    """The outputs of the mask and of fc, call by call, and whether each gradient a parameter received was
    finite, as the test's own hooks see them."""
    outputs: dict[str, list[torch.Tensor]] = {"mask": [], "fc": []}
    for name in outputs:
        getattr(model, name).register_forward_hook(
            lambda m, i, y, name=name: outputs[name].append(y.detach().clone())
        )
    finite: list[bool] = []
    for p in model.parameters():
        p.register_hook(lambda g: finite.append(bool(g.isfinite().all())))
    return outputs, finite


def _training(
    model: causal_mask.MaskedLM, precision: str
) -> tuple[ProfiledRun, dict[str, list[torch.Tensor]]]:
    """The run and the mask's and fc's outputs; asserts that the mask held 0 and -inf alone and that the loss
    and every gradient of every step were finite."""
    outputs, finite = _watched(model)
    run = causal_mask.run(model, precision)
    for y in outputs["mask"]:
        assert bool((y.isneginf() | (y == 0)).all()) and bool(y.isneginf().any())
    assert all(math.isfinite(v) for v in run.losses)
    assert finite and all(finite)
    return run, outputs


def _gradients_read(rec: Recommendation) -> Finding:
    """The fp16 loss-scale finding, asserted to be sized on the gradients of every sampled step."""
    f = rec.finding("fp16_loss_scale")
    assert f is not None and f.numbers["steps_excluded"] == 0 and f.numbers["grad_absmax"] is not None
    assert not [r for r in rec.reasons if "not measured" in r]
    return f


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_causal_masks_inf_is_no_nonfinite_forward_pass(precision: str) -> None:
    """A module without parameters returns the -inf causal mask that attention adds to its scores; the loss and
    every gradient are finite. The run got a critical nonfinite_forward blaming the mask, no measured format,
    and "every sampled step's forward pass was already non-finite, and its gradients with it" (the loss scale
    fell back to a default). A mask's -inf is a value the model meant: no finding, the gradients are read."""
    torch.manual_seed(0)
    run, _ = _training(causal_mask.MaskedLM(), precision)
    rec = run.recommend("a100")
    assert rec.finding("nonfinite_forward") is None and rec.finding("nonfinite_backward") is None
    assert rec.measured_format == "bf16"
    _gradients_read(rec)


def test_an_overflow_after_a_mask_is_still_found_where_it_happens() -> None:
    """fc's output overflows fp16 and the norm after it makes nan of the inf: the loss is nan. The mask comes
    first in forward order and holds inf on every step, yet the cause is fc's overflow (the test's hook: inf in
    its fp16 output, finite inputs)."""
    torch.manual_seed(0)
    model = causal_mask.MaskedLM(gain=1e5)
    outputs, _ = _watched(model)
    run = causal_mask.run(model, "fp16")
    assert all(math.isnan(v) for v in run.losses)
    inf = int(outputs["fc"][0].isinf().sum())
    assert inf > 0 and outputs["fc"][0].dtype == torch.float16
    rec = run.recommend("t4")
    f = rec.finding("nonfinite_forward")
    assert f is not None and f.severity == "critical" and f.modules == ["fc"]
    assert f.numbers["step"] == 0 and f.numbers["inf"] == inf and f.numbers["nan"] == 0
    over = rec.finding("fp16_activation_overflow")
    assert over is not None and over.modules == ["fc"]


def test_an_overflow_the_model_clamps_away_keeps_the_gradients() -> None:
    """fc's output overflows fp16 and the model clamps it back into range, as HF's T5 does in fp16: the loss and
    every gradient are finite. The run was told its forward pass was non-finite on every step (critical), its
    gradients discarded: no measured format, a default loss scale. It is now a warning that the inf did not reach
    the loss, the overflow finding still names fc, and the gradients size the loss scale."""
    torch.manual_seed(0)
    run, outputs = _training(causal_mask.MaskedLM(gain=1e5, clamp=True), "fp16")
    inf = int(outputs["fc"][0].isinf().sum())
    assert inf > 0 and outputs["fc"][0].dtype == torch.float16
    rec = run.recommend("t4")
    f = rec.finding("nonfinite_forward")
    assert f is not None and f.severity == "warning" and f.modules == ["fc"]
    assert f.title == "nan/inf in the forward pass of fc did not reach the loss"
    assert (f.numbers["step"], f.numbers["inf"], f.numbers["nan"]) == (0, inf, 0)
    assert f.numbers["steps_affected"] == len(run.losses)
    over = rec.finding("fp16_activation_overflow")
    assert over is not None and over.severity == "critical" and over.modules == ["fc"]
    assert rec.measured_format != ""
    _gradients_read(rec)


class _NanAfterTheModules(causal_mask.MaskedLM):
    """The logits times nan, in the model's own forward after its last module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * float("nan")


def test_a_nan_made_outside_the_modules_is_not_blamed_on_the_mask() -> None:
    """The nan comes from the model's own code after its last module; the mask, first in forward order, was the
    only module holding inf at step 0 (the test's hooks: fc's output finite) and was named as the cause. The
    finding names code outside the modules, and says what the mask held."""
    torch.manual_seed(0)
    model = _NanAfterTheModules()
    outputs, _ = _watched(model)
    run = causal_mask.run(model)
    assert all(math.isnan(v) for v in run.losses) and bool(outputs["fc"][0].isfinite().all())
    f = run.recommend("a100").finding("nonfinite_forward")
    assert f is not None and f.title == "nan/inf first appears in the loss, outside the recorded modules"
    assert f.numbers["step"] == 0 and f.modules == []
    assert "was finite but for the inf of mask, a mask holding 0 and inf alone" in f.message
