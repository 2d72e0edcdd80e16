"""A convolution's input that no captured module made (the model's own batch, a function's output between
modules) has a row of its own (``<layer>:input``), as a linear layer's has, block formats on or off: fp16 autocast
casts it for the convolution. An fp32 run on un-normalised images said "23 values would become inf" (the first
conv's output) where the cast of the batch itself made 2,117 inf, and a real fp16 run blamed the conv's output.
Only a linear layer's input row gets the block-format what-if."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precprof
from precprof import tables as T

SCALE = 3e4  # un-normalised pixels: randn * 3e4 puts ~3% of the batch beyond fp16's 65504


class _Net(nn.Module):
    """conv1 reads the model's input; conv2 reads ``F.interpolate``'s output and fc ``F.adaptive_avg_pool2d``'s
    (functions between modules: no captured module made either)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(torch.relu(self.bn(self.conv1(x))), scale_factor=2.0)
        return self.fc(F.adaptive_avg_pool2d(self.conv2(h), 1).flatten(1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 8, 8, generator=g) * SCALE, torch.randint(0, 10, (4,), generator=g)


def _over(x: torch.Tensor) -> int:
    """Finite values a real cast to fp16 makes inf."""
    return int((torch.isinf(x.half()) & torch.isfinite(x)).sum())


def _train(model: nn.Module, steps: int, prof: precprof.Profiler | None = None, fp16: bool = False) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(steps):
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if prof is not None:
            prof.step(loss=loss.detach())


def _profiled(
    blocks: bool, steps: int = 2, fp16: bool = False
) -> tuple[precprof.Profiler, dict[str, Any], _Net]:
    """A profiled run of ``_Net``, and what the test's own hooks saw each step: each layer's input, and conv1's
    output."""
    torch.manual_seed(0)
    model = _Net()
    seen: dict[str, list[torch.Tensor]] = {"conv1:out": []}
    for name in ("conv1", "conv2", "fc"):
        seen[name] = []
        getattr(model, name).register_forward_pre_hook(
            lambda m, a, n=name: seen[n].append(a[0].detach().clone())
        )
    model.conv1.register_forward_hook(lambda m, a, out: seen["conv1:out"].append(out.detach().clone()))
    prof = precprof.Profiler(model, sample_every=1, memory=False, block_formats=blocks, block_groups=1)
    with prof:
        _train(model, steps, prof, fp16)
    return prof, seen, model


def _recommend(prof: precprof.Profiler) -> precprof.Recommendation:
    """The advisor on the run, with the capture's summary as a saved run holds it."""
    return precprof.recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})


@pytest.fixture(scope="module")
def fp32_run() -> tuple[precprof.Profiler, dict[str, Any], precprof.Recommendation]:
    prof, seen, _ = _profiled(blocks=False)
    return prof, seen, _recommend(prof)


def test_a_convolutions_input_no_module_made_has_its_row_block_formats_off(
    fp32_run: tuple[precprof.Profiler, dict[str, Any], precprof.Recommendation],
) -> None:
    """conv1's input (the batch), conv2's (F.interpolate's output) and fc's (a pooling function's) each have a
    row, its counts those of the tensor the layer's pre-hook saw: numel, largest value, and what a real cast to
    fp16 makes inf."""
    prof, seen, _ = fp32_run
    layers = prof.tables()["layers"]
    acts = layers[layers[T.TENSOR] == T.ACTIVATION].set_index([T.MODULE, T.STEP])
    for layer in ("conv1", "conv2", "fc"):
        for step, x in enumerate(seen[layer]):
            row = acts.loc[(T.input_module(layer), step)]
            assert row[T.NUMEL] == x.numel() and row[T.ABSMAX] == float(x.abs().max()), (layer, step)
            assert row[T.overflow_col("fp16")] == _over(x), (layer, step)
    assert sum(_over(x) for x in seen["conv1"]) > 20  # the batch itself overflows fp16
    summary = prof.summary()
    assert summary["gemm_inputs"] == {"conv1": [], "conv2": [], "fc": []}
    assert summary["model_inputs"] == ["conv1:input"]
    assert blocks_held(layers) == set()  # block formats off


def test_the_fp16_what_if_counts_the_batch_a_convolution_reads(
    fp32_run: tuple[precprof.Profiler, dict[str, Any], precprof.Recommendation],
) -> None:
    """The fp32 run's fp16 what-if counts the values of the batch that fp16 autocast's cast for conv1 makes inf,
    beside those of conv1's output, and names the model's input as the cause, as it does a linear layer's."""
    _, seen, rec = fp32_run
    batch, out = sum(_over(x) for x in seen["conv1"]), sum(_over(y) for y in seen["conv1:out"])
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.numbers["overflow_values"] == batch + out
    assert (
        f"conv1:input: max |x| {max(float(x.abs().max()) for x in seen['conv1']):.3g}, {batch:,} values"
        in (f.message)
    )
    assert "1 layer(s) read an input beyond" in f.message
    assert "conv1:input is the model's own input: keep the layer reading it (conv1) in fp32" in f.remedy
    assert f.modules == ["conv1:input", "conv1"]


def test_a_real_fp16_run_blames_the_batch_not_the_convolutions_output() -> None:
    """Under fp16 autocast conv1's output is inf where the cast batch was: the finding says the inf came from its
    input, the model's own, which overflowed (it blamed conv1's output, "0 values over 65504")."""
    prof, seen, _ = _profiled(blocks=False, steps=1, fp16=True)
    f = _recommend(prof).finding("fp16_activation_overflow")
    inf = int(torch.isinf(seen["conv1:out"][0]).sum())
    assert f is not None and inf > 0
    assert f"conv1: {inf:,} inf in fp16 from its input, which overflowed fp16 (conv1:input)" in f.message
    assert f.numbers["overflow_values"] == _over(seen["conv1"][0])


def blocks_held(layers: Any) -> set[str]:
    """The modules with block-format statistics in any row."""
    cols = [c for c in T.BLOCK_COLUMNS if c in layers]
    return set(layers.loc[layers[cols].notna().any(axis=1), T.MODULE]) if cols else set()


@pytest.mark.usefixtures("block_formats_on")
def test_only_a_linear_layers_input_row_gets_the_block_what_if_and_training_is_unchanged() -> None:
    """With block formats on, fc's input row holds block statistics, the convolutions' input rows none (no
    block-scaled GEMM reads them; nor are they an FP8 GEMM's operand: no fp8 finding names them). Training is
    bitwise the same as without the profiler (weights and BatchNorm's running statistics)."""
    prof, _, model = _profiled(blocks=True)
    torch.manual_seed(0)
    plain = _Net()
    _train(plain, 2)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    held = blocks_held(prof.tables()["layers"])
    assert "fc:input" in held and not held & {"conv1:input", "conv2:input", "conv1", "conv2"}
    rec = _recommend(prof)
    for f in rec.findings:
        if f.code.startswith(("fp8", "block")):
            assert "conv1:input" not in f.message and "conv2:input" not in f.message, f.code
            assert not {"conv1:input", "conv2:input"} & set(f.modules), f.code
