"""The fp16 advice on the overflows of a Llama-like model, each on a tiny real CPU fp16 autocast run: an fp32 output
that overflows only in the cast its matmul reader makes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from scenarios.loop import backward_and_step, keep_in_fp32
from torch import nn

from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig, Recommendation, recommend
from precprof.capture import Profiler


def _train(
    model: nn.Module,
    batch: Callable[[int], torch.Tensor],
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    keep: Sequence[str] = (),
    steps: int = 3,
) -> tuple[Recommendation, list[float]]:
    """``model`` trained ``steps`` steps under fp16 autocast on the CPU (AdamW, a GradScaler at 2^8, every step
    sampled), the modules ``keep`` names outside autocast; the advisor's recommendation for a V100 (fp16 its
    verdict) and the losses."""
    keep_in_fp32(model, keep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    losses = []
    with Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, memory=False) as prof:
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, batch(step))
            backward_and_step(loss, opt, scaler)
            opt.zero_grad()
            losses.append(float(loss.detach()))
            prof.step(loss=loss.detach())
    rec = recommend(
        prof.tables(),
        hardware="v100",
        config=AdvisorConfig(small_model_params=0),
        summary={T.SUMMARY_CAPTURE: prof.summary()},
    )
    return rec, losses


@contextlib.contextmanager
def _outputs(model: nn.Module, names: Sequence[str]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """The outputs of the named submodules, as the test's own hooks see them, call after call."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        model.get_submodule(n).register_forward_hook(lambda m, a, y, n=n: seen[n].append(y.detach().clone()))
        for n in names
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _llama() -> nn.Module:
    """A two-layer LlamaForCausalLM built from a tiny config, its final RMSNorm's output multiplied by 1e5 before
    lm_head: the norm computes in fp32 (Llama's upcasts; autocast leaves it), where 1e5 times its output is
    fine, and lm_head, a matmul, reads it under autocast, which casts it to fp16."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    model.model.norm.register_forward_hook(lambda m, a, y: y * 1e5)
    return model


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def test_an_fp32_norm_output_that_overflows_in_lm_heads_cast_names_lm_head() -> None:
    """Llama's final norm, fp32 under autocast, holds values beyond 65504 that are fine in fp32; lm_head's cast of
    them to fp16 makes inf, and its output nan. The advice was to keep model.norm in fp32, which it already is
    (followed, lm_head still casts and every step is nan); it names lm_head now, the matmul that casts, and the
    keep list holds lm_head: followed, the run is finite."""
    model = _llama()
    with _outputs(model, ["model.norm", "lm_head"]) as seen:
        rec, _ = _train(model, _tokens, _lm_loss)
    # the run has the problem: the norm's fp32 output is beyond fp16, lm_head's fp16 output nan
    assert all(y.dtype == torch.float32 and bool(y.isfinite().all()) for y in seen["model.norm"])
    over = sum(int((y.half().isinf()).sum()) for y in seen["model.norm"])
    assert over > 0 and all(y.dtype == torch.float16 and bool(y.isnan().any()) for y in seen["lm_head"])
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.severity == "critical" and f.modules == ["model.norm"]
    assert f.numbers["cast_inf_values"] == over
    assert "fp16 autocast cast them to fp16 for the matmul of lm_head, where they became inf" in f.message
    assert f.remedy.startswith(
        "Use bf16, or keep lm_head in fp32 (outside autocast): model.norm's output is fp32 (autocast leaves it in "
        "fp32) and goes beyond 65504 only in the cast to fp16 that lm_head makes of it for its matmul"
    )
    assert "(keeping model.norm in fp32 changes nothing: it is fp32 already)" in f.remedy
    assert rec.fp16_keep_fp32 == ["lm_head"]
    assert (
        "Keep lm_head in fp32: autocast would cast an fp32 input beyond 65504 to fp16 there, which makes it inf"
        in " ".join(rec.reasons)
    )
    # the old advice followed: the norm was fp32 already, lm_head still casts its output
    _, old = _train(_llama(), _tokens, _lm_loss, keep=["model.norm"])
    assert all(loss != loss for loss in old)  # nan
    # the new one: lm_head reads the values unrounded
    after, new = _train(_llama(), _tokens, _lm_loss, keep=["lm_head"])
    assert all(torch.isfinite(torch.tensor(new)))
    assert after.finding("fp16_activation_overflow") is None and after.fp16_keep_fp32 == ["lm_head"]
