"""fp16_gradient_underflow's flushed evidence on real tiny training runs (CPU, seconds each): an exact zero in
an fp16 gradient is a flushed value or a true zero, and each claim is checked against the same model trained in
fp32, whose gradients the test's own hooks cast to fp16."""

from __future__ import annotations

import torch
from scenarios import relu_zeros

from precprof import tables as T


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
