"""The input of a norm, read on sampled steps into a row of its own (``<norm>:input``): in a pre-norm
transformer that input is a residual sum, which no module returns and no other row holds, and in fp16 a
hand-written RMSNorm's x.pow(2) of a value |x| >= 256 is inf and zeroes its row. Checked on
``scenarios/prenorm_overflow``'s LM, trained fp16-pure, against the test's own hooks and real casts."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from scenarios import prenorm_overflow
from torch import nn

from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig, Recommendation, recommend
from precprof.analysis.advisor.text import _g
from precprof.capture import Profiler
from precprof.capture.plan import CapturePlan, norm_input_dtypes, reads_norm_input
from precprof.training import TrainConfig, train

NORMS = [f"blocks.{k}.norm" for k in range(6)] + ["norm"]
STEPS = 3


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))


def _fit(model: nn.Module, prof: Profiler | None) -> list[float]:
    """``model`` (fp16) trained ``STEPS`` steps by SGD on next-token cross-entropy, the logits upcast; the
    losses."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        logits = model(ids[:, :-1]).float()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if prof is not None:
            prof.step(loss=loss.detach())
    return losses


class _Seen:
    """Each named norm's inputs and outputs, as the test's own hooks see them, call after call."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.outputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.handles = []
        for n in names:
            m = model.get_submodule(n)
            self.handles.append(
                m.register_forward_pre_hook(lambda _m, a, n=n: self.inputs[n].append(a[0].detach().clone()))
            )
            self.handles.append(
                m.register_forward_hook(lambda _m, a, y, n=n: self.outputs[n].append(y.detach().clone()))
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def naive() -> Iterator[tuple[dict[str, object], dict[str, object], _Seen, list[float], nn.Module]]:
    torch.manual_seed(0)
    model = prenorm_overflow.factory().half()
    seen = _Seen(model, NORMS + [f"blocks.{k}.down" for k in range(6)])
    with Profiler(model, sample_every=1, memory=False, block_formats=False) as prof:
        losses = _fit(model, prof)
    seen.remove()
    yield prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}, seen, losses, model


def test_a_user_norms_input_row_counts_what_it_was_called_with(naive: tuple) -> None:
    """Each norm's ``:input`` row holds, over the sampled steps, exactly the values its forward received: their
    count, exact zeros, largest magnitude, and the fp16 exponent histogram's count at |x| >= 256 (the test's
    own pre-hooks, summed over calls). Its dtype is fp16 and it comes right before its norm in the forward order.
    The first block's norm receives the embedding's output as it made it: no row of its own (the embedding's
    holds it; read once), and the summary says which module fed it."""
    tables, summary, seen, _, _ = naive
    layers, hist = tables["layers"], tables["histograms"]
    names = layers[T.MODULE].astype(str)
    assert summary[T.SUMMARY_CAPTURE]["norm_inputs_from"] == {"blocks.0.norm": ["emb"]}
    assert not (names == "blocks.0.norm:input").any()
    for n in NORMS[1:]:
        xs = seen.inputs[n]
        assert len(xs) == STEPS and all(x.dtype == torch.float16 for x in xs)
        rows = layers[names == T.input_module(n)]
        assert list(rows[T.STEP]) == list(range(STEPS))
        assert set(rows[T.DTYPE].astype(str)) == {"float16"} and set(rows[T.TENSOR].astype(str)) == {
            T.ACTIVATION
        }
        assert int(rows[T.NUMEL].sum()) == sum(x.numel() for x in xs)
        assert int(rows[T.ZEROS].sum()) == sum(int((x == 0).sum()) for x in xs)
        assert float(rows[T.ABSMAX].max()) == max(float(x.abs().max()) for x in xs)
        assert int(rows[T.NAN].sum()) == 0 and int(rows[T.INF].sum()) == 0
        h = hist[(hist[T.MODULE].astype(str) == T.input_module(n)) & (hist[T.EXPONENT] >= 8)]
        assert int(h[T.COUNT].sum()) == sum(int((x.abs() >= 256).sum()) for x in xs)
        assert (rows[T.ORDER].to_numpy() + 1 == layers.loc[names == n, T.ORDER].to_numpy()[: len(rows)]).all()
    # torch's own modules get none: a matmul's own input rows are those its input made by no module
    made = set(names[names.str.endswith(T.INPUT_SUFFIX)])
    assert made == {T.input_module(n) for n in NORMS[1:]}


def test_a_residual_sum_that_overflows_a_naive_fp16_norm_is_found_from_the_norms_input(naive: tuple) -> None:
    """The residual stream reaches |x| >= 256 a few blocks in, while no module outputs a value that large (no
    MLP's down does: the old rule, which looked at the output of the leaf before the norm, found nothing but
    "modules the guide keeps in fp32 ran in fp16"). fp16_norm_overflow, one critical finding leading the list,
    now names the norms whose output was more than 1% zeros their input did not hold, in forward order, with the
    values of |x| >= 256 their inputs held and their outputs' zeros, each counted by the test's own hooks; the
    norms that zeroed less are not named."""
    tables, summary, seen, _, _ = naive
    assert all(float(y.abs().max()) < 256 for k in range(6) for y in seen.outputs[f"blocks.{k}.down"])
    rec = recommend(tables, hardware="v100", config=AdvisorConfig(small_model_params=0), summary=summary)

    def count(xs: list[torch.Tensor], f: Callable[[torch.Tensor], torch.Tensor]) -> int:
        return sum(int(f(x).sum()) for x in xs)

    named = [
        n
        for n in NORMS
        if count(seen.outputs[n], lambda y: y == 0) - count(seen.inputs[n], lambda x: x == 0)
        > 0.01 * sum(y.numel() for y in seen.outputs[n])
    ]
    assert len(named) >= 3 and named != NORMS
    f = rec.findings[0]
    assert f.code == "fp16_norm_overflow" and f.severity == "critical" and f.modules == named
    assert [g.code for g in rec.findings].count("fp16_norm_overflow") == 1
    zeros = sum(count(seen.outputs[n], lambda y: y == 0) for n in named)
    values = sum(y.numel() for n in named for y in seen.outputs[n])
    big = sum(count(seen.inputs[n], lambda x: x.abs() >= 256) for n in named)
    assert f.numbers == {
        "zeros": zeros,
        "values": values,
        "share": zeros / values,
        "input_zeros": sum(count(seen.inputs[n], lambda x: x == 0) for n in named),
        "input_values_at_least_256": big,
        "norms": len(named),
    }
    share = max(
        count(seen.outputs[n], lambda y: y == 0) / sum(y.numel() for y in seen.outputs[n]) for n in named
    )
    assert (
        f.title
        == f"x.pow(2) overflows fp16 in {len(named)} norms: up to {share * 100:.3g}% of a norm's output is 0"
    )
    top = max(float(x.abs().max()) for n in named for x in seen.inputs[n])
    assert (
        "(NaiveRMSNorm) compute their statistics in fp16: their inputs, the fp16 tensors their forwards received, "
        f"hold {big:,} values of |x| >= 256 (max {_g(top)})" in f.message
    )
    assert "each norm's input is the residual stream" in f.message
    assert f.remedy.startswith(
        "Compute the norms in fp32 inside NaiveRMSNorm: upcast their input before the square"
    )


def test_the_norms_input_rows_change_no_other_finding(naive: tuple) -> None:
    """The advisor reads a norm's input row in that rule alone: without those rows (as a run recorded before
    them), every other finding and its numbers are the same."""
    tables, summary, _, _, _ = naive
    inputs = {T.input_module(n) for n in NORMS}
    older = {
        **tables,
        "layers": tables["layers"][~tables["layers"][T.MODULE].astype(str).isin(inputs)],
        "histograms": tables["histograms"][~tables["histograms"][T.MODULE].astype(str).isin(inputs)],
    }
    cfg = AdvisorConfig(small_model_params=0)
    now = recommend(tables, hardware="v100", config=cfg, summary=summary)
    before = recommend(older, hardware="v100", config=cfg, summary=summary)
    assert before.finding("fp16_norm_overflow") is None  # (the residual sums no row held before)
    others = [(f.code, f.modules, f.numbers) for f in now.findings if f.code != "fp16_norm_overflow"]
    assert others == [
        (f.code, f.modules, f.numbers) for f in before.findings if f.code != "fp16_norm_overflow"
    ]
    assert (now.format, now.loss_scale, now.keep_fp32) == (before.format, before.loss_scale, before.keep_fp32)


def test_reading_the_norms_inputs_changes_no_loss_and_no_weight(naive: tuple) -> None:
    """The same training without precprof: the losses and every weight bitwise equal."""
    _, _, _, losses, profiled = naive
    torch.manual_seed(0)
    model = prenorm_overflow.factory().half()
    assert _fit(model, None) == losses
    for (name, p), q in zip(model.named_parameters(), profiled.parameters(), strict=True):
        assert torch.equal(p, q), name
    # torch's norms, whose fp16 inputs are read too
    plain, profiled = (prenorm_overflow.factory(torch_norm=True, emb_std=12000.0).half() for _ in range(2))
    with Profiler(profiled, sample_every=1, memory=False, block_formats=False) as prof:
        losses = _fit(profiled, prof)
    assert any(str(m).endswith("norm:input") for m in prof.tables()["layers"][T.MODULE])
    assert _fit(plain, None) == losses
    for (name, p), q in zip(plain.named_parameters(), profiled.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_the_fix_trains_finite_and_is_not_found(tmp_path: Path, one_thread: None) -> None:
    """The remedy followed (each norm on x.float(), cast back), by the built-in loop as ``precprof train -m
    prenorm_overflow.py:factory -p fp16-pure`` runs it: no norm output holds a zero its input did not, the losses
    are finite, and
    fp16_norm_overflow is not said; the naive model's run through the same loop says it."""
    told = {}
    for fp32_norm in (False, True):
        out = tmp_path / f"fp32_norm={fp32_norm}"
        train(
            TrainConfig(
                model=f"{prenorm_overflow.__file__}:factory",
                model_args={"fp32_norm": fp32_norm},
                precision="fp16-pure",
                device="cpu",
                steps=3,
                batch_size=4,
                seq_len=16,
                sample_every=1,
                out=out,
                progress=False,
                report=False,
            )
        )
        rec = Recommendation.from_dict(T.read_summary(out)[T.SUMMARY_RECOMMENDATION])
        told[fp32_norm] = rec.finding("fp16_norm_overflow")
        layers = T.read_tables(out)["layers"]
        names = layers[T.MODULE].astype(str)
        outputs = layers[names.isin(NORMS) & (layers[T.TENSOR] == T.ACTIVATION)]
        inputs = layers[names.isin([T.input_module(n) for n in NORMS])]
        if fp32_norm:  # a zero out for each zero in (the residual stream holds a few exact zeros)
            assert (
                int(outputs[T.ZEROS].sum()) == int(inputs[T.ZEROS].sum()) < 0.001 * int(inputs[T.NUMEL].sum())
            )
            steps = T.read_tables(out)["steps"]
            assert steps[T.LOSS].notna().all() and bool(
                torch.isfinite(torch.tensor(list(steps[T.LOSS]))).all()
            )
    assert told[False] is not None and told[True] is None


class PreNorm(nn.Module):
    """A wrapper named like a norm, holding one and the sublayer it feeds: its output is the sublayer's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, d), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(x))


def test_a_norm_gets_an_input_row_but_a_wrapper_named_like_one() -> None:
    """Every norm that holds no module gets an input row (a user's matmul gets its own as before); a wrapper named
    like a norm that holds modules does not (its output, its sublayer's ReLU's, holds zeros no square made). A
    user's norm reads its input in any floating dtype, torch's in fp16 alone (they compute in fp32 inside: their
    row is the fp16 residual stream's): fp32 and bf16 steps leave torch's rows unread."""
    model = nn.Sequential(
        nn.LayerNorm(8),
        nn.RMSNorm(8),
        nn.GroupNorm(2, 8),
        prenorm_overflow.NaiveRMSNorm(8),
        nn.Linear(8, 8),
        PreNorm(8),
    )
    assert [reads_norm_input(m, type(m).__name__) for m in model] == [True, True, True, True, False, False]
    assert [norm_input_dtypes(m) == {torch.float16} for m in model[:4]] == [True, True, True, False]
    assert {torch.float32, torch.bfloat16, torch.float16} <= norm_input_dtypes(model[3])
    plan = CapturePlan.of(model, None, block_formats=False)
    inputs = {info.module for info in plan.rows.info if info.module.endswith(T.INPUT_SUFFIX)}
    assert inputs == {"0:input", "1:input", "2:input", "3:input", "4:input", "5.norm:input", "5.fn.0:input"}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m = TwoNorms(8).to(dtype)
        with Profiler(m, sample_every=1, memory=False, block_formats=False) as prof:
            for _ in range(2):
                m(torch.randn(4, 8, dtype=dtype)).float().sum().backward()
                prof.step()
        rows = prof.tables()["layers"]
        got = set(rows.loc[rows[T.MODULE_TYPE].astype(str) == T.NORM_INPUT_MODULE_TYPE, T.MODULE].astype(str))
        assert got == ({"torchs:input", "own:input"} if dtype == torch.float16 else {"own:input"}), (
            dtype,
            got,
        )


class TwoNorms(nn.Module):
    """torch's LayerNorm and a user's RMSNorm, each reading the model's batch (no module made it)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.torchs, self.own = nn.LayerNorm(d), prenorm_overflow.NaiveRMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.torchs(x) + self.own(x)


def _profiled(model: nn.Module, autocast: bool = False) -> tuple[Recommendation, _Seen, list[float], dict]:
    """``model`` trained ``STEPS`` steps (every one sampled; under fp16 autocast when ``autocast``), seen by the
    test's own hooks on its norms and MLPs; the advisor's recommendation, the hooks, the losses, the summary."""
    seen = _Seen(model, NORMS + [f"blocks.{k}.down" for k in range(6)] + ["emb"])
    with Profiler(model, sample_every=1, memory=False, block_formats=False) as prof:
        if autocast:
            with torch.autocast("cpu", dtype=torch.float16):
                losses = _fit(model, prof)
        else:
            losses = _fit(model, prof)
    seen.remove()
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    rec = recommend(
        prof.tables(), hardware="v100", config=AdvisorConfig(small_model_params=0), summary=summary
    )
    return rec, seen, losses, summary


def test_a_residual_stream_near_fp16s_limit_is_warned_from_the_norms_inputs() -> None:
    """An fp16-pure pre-norm model (its norms on x.float(): no square overflows) whose residual stream reaches
    4-5e4 while no module but the embedding outputs more than 32752: fp16_activation_near_overflow, which reads
    modules' outputs, named the embedding alone. fp16_residual_near_overflow names the norms whose inputs,
    residual sums, came within 2x of 65504, with the largest value the test's pre-hooks saw; not blocks.0.norm,
    whose input is the embedding's output as it made it (that row tells). Its remedy, fp16 autocast with fp32
    weights, keeps the sums in fp32, and so does its fp16-weight form (the model still half(), the embedding's
    output upcast, the forward under fp16 autocast): none of it is said, and the losses are finite."""
    model = prenorm_overflow.factory(fp32_norm=True, emb_std=12000.0, down_std=400.0).half()
    rec, seen, _, summary = _profiled(model)
    assert summary[T.SUMMARY_CAPTURE]["norm_inputs_from"] == {"blocks.0.norm": ["emb"]}
    top = {n: max(float(x.abs().max()) for x in seen.inputs[n]) for n in NORMS}
    assert all(float(y.abs().max()) < 32752 for k in range(6) for y in seen.outputs[f"blocks.{k}.down"])
    near = [n for n in NORMS[1:] if 32752 <= top[n] < 65520]
    assert len(near) >= 3 and all(torch.isfinite(x).all() for n in NORMS for x in seen.inputs[n])
    f = rec.finding("fp16_residual_near_overflow")
    assert f is not None and f.severity == "warning" and f.modules == near
    assert f.numbers["absmax"] == max(top[n] for n in near) and f.numbers["limit"] == 32752.0
    assert f"{near[0]}: {_g(top[near[0]])}" in f.message
    assert f.remedy.startswith(
        "Keep the residual stream in fp32: train under torch.autocast(dtype=torch.float16)"
    )
    assert rec.finding("fp16_residual_overflow") is None
    modules = rec.finding("fp16_activation_near_overflow")
    assert modules is not None and modules.modules == ["emb"]

    half = prenorm_overflow.factory(fp32_norm=True, emb_std=12000.0, down_std=400.0).half()
    half.fp32_stream = True
    for model in (prenorm_overflow.factory(fp32_norm=True, emb_std=12000.0, down_std=400.0), half):
        fixed, seen, losses, _ = _profiled(model, autocast=True)
        assert all(x.dtype == torch.float32 for n in NORMS for x in seen.inputs[n])
        assert fixed.finding("fp16_residual_near_overflow") is None
        assert fixed.finding("fp16_residual_overflow") is None
        assert all(math.isfinite(v) for v in losses)


def test_a_residual_stream_that_overflows_fp16_is_said_before_the_norm_that_returns_nan() -> None:
    """The same model with larger MLP outputs (each under 65504): at step 0 a residual sum goes beyond 65504, the
    input of a norm holds inf that no module output before it, and that norm returns nan. nonfinite_forward named
    the norm as where nan first appears; it says now that the norm's input already held inf, and
    fp16_residual_overflow, critical, names the norm, the step and the inf its input held (the test's own
    pre-hook counts them)."""
    model = prenorm_overflow.factory(fp32_norm=True, emb_std=12000.0, down_std=1500.0).half()
    rec, seen, _, _ = _profiled(model)
    order = ["emb"] + [m for k in range(6) for m in (f"blocks.{k}.norm", f"blocks.{k}.down")] + ["norm"]
    first = next(n for n in order if n in NORMS and bool(torch.isinf(seen.inputs[n][0]).any()))
    before = order[: order.index(first)]
    assert all(bool(torch.isfinite(y).all()) for m in before for y in seen.outputs.get(m, [])[:1])
    assert bool(torch.isnan(seen.outputs[first][0]).any())
    inf = int(torch.isinf(seen.inputs[first][0]).sum())
    f = rec.finding("fp16_residual_overflow")
    assert f is not None and f.severity == "critical" and f.modules[0] == first
    assert f.numbers["step"] == 0 and f.numbers["inf"] == inf
    assert f.title == f"The residual stream overflows fp16 before {first}"
    assert f"At step 0, the fp16 input of {first} (the tensor it received" in f.message
    nonfinite = rec.finding("nonfinite_forward")
    assert nonfinite is not None and nonfinite.modules[0] == first
    assert f"already held 0 nan and {inf:,} inf: the non-finite values began in the sum before it" in (
        nonfinite.message
    )
    assert rec.finding("fp16_norm_overflow") is None  # (zeros of rows holding inf: no square made them)


def test_a_transformers_llamas_fp16_residual_stream_near_the_limit_is_warned() -> None:
    """Code precprof did not write: transformers' LlamaForCausalLM (its LlamaRMSNorm computes in fp32 inside) cast
    to fp16, its embedding and MLP outputs scaled so that the residual stream grows to 3.5-4e4 over 4 layers. The
    norms whose inputs came within 2x of 65504 are named, with the largest value the test's own pre-hooks saw;
    the first layer's input norm, fed the embedding's output as it made it, is not (that output's row tells)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 12000.0)
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.normal_(0, 9000.0)
    model = model.half()
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    seen = _Seen(model, norms)
    tables, summary = _lm_steps(model, (4, 32))
    seen.remove()
    assert summary[T.SUMMARY_CAPTURE]["norm_inputs_from"] == {
        "model.layers.0.input_layernorm": ["model.embed_tokens"]
    }
    top = {n: max(float(x.abs().max()) for x in seen.inputs[n]) for n in norms}
    near = [n for n in norms[1:] if 32752 <= top[n] < 65520]
    assert len(near) >= 4
    rec = recommend(tables, config=AdvisorConfig(small_model_params=0), summary=summary)
    f = rec.finding("fp16_residual_near_overflow")
    assert f is not None and f.modules == near and f.numbers["absmax"] == max(top[n] for n in near)
    if top[norms[0]] >= 32752:  # the embedding's output: its own row tells
        embedding = rec.finding("fp16_activation_near_overflow")
        assert embedding is not None and "model.embed_tokens" in embedding.modules
    assert rec.finding("fp16_norm_overflow") is None and rec.finding("fp16_residual_overflow") is None


def _t5_fp16(scale: float) -> Recommendation:
    """transformers' T5 (its T5LayerNorm squares in fp32 inside) cast to fp16, its shared embedding times
    ``scale``, 2 steps profiled without memory tracking (so no saved tensor tells how its norms compute)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        model.shared.weight.mul_(scale)
    model = model.half()
    tables, summary = _lm_steps(model, (2, 16))
    return recommend(tables, config=AdvisorConfig(small_model_params=0), summary=summary)


def _lm_steps(model: nn.Module, shape: tuple[int, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """2 steps of ``model`` (a transformers LM, fp16) on one batch of token ids of ``shape``, SGD, every step
    profiled without memory tracking: the tables and the summary."""
    ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with Profiler(model, optimizer=opt, sample_every=1, memory=False, block_formats=False) as prof:
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    return prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}


def test_a_norm_whose_large_fp16_input_made_no_zeros_computed_in_fp32() -> None:
    """fp16_fp32_ops warned of an fp16 T5's 12 T5LayerNorms that "whether they computed in fp16 inside is not
    known" when no step measured what they kept for their backward, though they compute their variance in fp32.
    Their inputs tell when they hold |x| >= 256: squared in fp16 that is inf and zeroes the row, and their outputs
    held no such zeros, so they computed in fp32; the finding is gone. With inputs under 256 nothing tells, and the
    warning stays; a naive norm whose large inputs zeroed its rows stays listed (the naive model of the tests
    above, also without memory tracking)."""
    assert _t5_fp16(100.0).finding("fp16_fp32_ops") is None
    small = _t5_fp16(1.0).finding("fp16_fp32_ops")
    assert small is not None and len(small.modules) == 12 and "is not known" in small.message


def test_a_naive_norms_zeros_keep_it_listed_among_the_fp16_ops(naive: tuple) -> None:
    """The naive model's norms (fp16 squares) stay listed, and none is said to compute in fp32; the same model
    with its norms on x.float() has those whose inputs reached 256 said to compute in fp32 inside (the test's own
    pre-hooks tell which), the others listed as not known."""
    tables, summary, _, _, _ = naive
    rec = recommend(tables, hardware="v100", config=AdvisorConfig(small_model_params=0), summary=summary)
    f = rec.finding("fp16_fp32_ops")
    assert (
        f is not None and f.modules == NORMS and "computed their statistics in fp32 inside" not in f.message
    )

    rec, seen, _, _ = _profiled(prenorm_overflow.factory(fp32_norm=True).half())
    wide = [n for n in NORMS if max(float(x.abs().max()) for x in seen.inputs[n]) >= 256]
    assert 0 < len(wide) < len(NORMS)
    f = rec.finding("fp16_fp32_ops")
    assert f is not None and f.modules == [n for n in NORMS if n not in wide]
    assert (
        f"({', '.join(wide)} also produced float16 outputs, and their fp16 inputs held values of |x| >= 256, whose "
        "fp16 square is inf, without the zeros a norm squaring in fp16 makes of such a row: they computed their "
        "statistics in fp32 inside.)"
    ) in f.message


def test_torchs_norms_in_fp16_read_the_residual_stream_and_are_not_told_they_computed_in_fp16() -> None:
    """The pre-norm LM with torch's nn.RMSNorm (as the built-in models use torch's LayerNorm), fp16-pure: its
    residual stream, near 65504, was read by no row (torch's norms had none), so fp16_residual_near_overflow could
    not fire; and on the CPU, where torch's fp16 norms keep fp16 tensors for their backward, fp16_fp32_ops told
    them "they computed in fp16". They compute in fp32 inside (checked: each output equals the fp32 computation
    of its input, rounded once to fp16): the warning names the residual stream, and no fp16_fp32_ops names them."""
    model = prenorm_overflow.factory(torch_norm=True, emb_std=12000.0, down_std=400.0).half()
    rec, seen, losses, summary = _profiled(model)
    assert summary[T.SUMMARY_CAPTURE]["norms_fp32_inside"] == NORMS
    for n in NORMS:
        norm = model.get_submodule(n)
        for x, y in zip(seen.inputs[n], seen.outputs[n], strict=True):
            h = x.float()
            wide = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()).half()
            assert ((y.float() - wide.float()).abs() <= wide.float().abs() * 2.0**-10).all(), (
                n
            )  # an fp16 unit
    top = {n: max(float(x.abs().max()) for x in seen.inputs[n]) for n in NORMS}
    near = [n for n in NORMS[1:] if 32752 <= top[n] < 65520]
    assert near and all(math.isfinite(v) for v in losses)
    f = rec.finding("fp16_residual_near_overflow")
    assert f is not None and f.modules == near and f.numbers["absmax"] == max(top[n] for n in near)
    ops = rec.finding("fp16_fp32_ops")
    assert ops is None or not set(ops.modules) & set(NORMS), ops


def test_a_fp16_torch_norm_beside_a_naive_one_is_cleared_in_the_finding_that_names_the_naive_one() -> None:
    """A model holding a naive fp16 RMSNorm and torch's LayerNorm, cast to fp16: fp16_fp32_ops names the naive
    norm alone and says why the LayerNorm is not named."""
    m = nn.Sequential(
        nn.Linear(8, 8), prenorm_overflow.NaiveRMSNorm(8), nn.Linear(8, 8), nn.LayerNorm(8)
    ).half()
    with Profiler(m, sample_every=1, memory=False, block_formats=False) as prof:
        for _ in range(2):
            m(torch.randn(4, 8, dtype=torch.float16)).float().sum().backward()
            prof.step()
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    rec = recommend(prof.tables(), config=AdvisorConfig(small_model_params=0), summary=summary)
    ops = rec.finding("fp16_fp32_ops")
    assert ops is not None and ops.modules == ["1"]
    assert (
        '("3" also produced float16 outputs, but torch\'s LayerNorm computes its statistics in fp32 inside'
        in (ops.message)
    )


class _CheckpointedNorm(nn.Module):
    """An embedding, a block (a norm, a Linear) run under a reentrant checkpoint or not (``reentrant`` None), a
    head: the block's norm is ``norm``."""

    def __init__(self, norm: nn.Module, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.block, self.reentrant = nn.Sequential(norm, nn.Linear(16, 16)), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.reentrant is None:
            return self.head(self.block(h))
        return self.head(torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", ["torch", "own"])
def test_a_norm_in_a_reentrant_checkpoint_is_recorded_as_without_it(norm: str, dtype: torch.dtype) -> None:
    """A reentrant checkpoint's first pass (no grad) gave the norm's input row a place in the forward order
    before the recomputation knew whether it would be read: torch's norm in fp32 (never read) and a norm fed the
    embedding's output (its row holds it) had no row, and every later module's order was one off. The rows and
    their order are those of the same model without the checkpoint."""
    got = []
    for reentrant in (None, True):
        make = nn.LayerNorm(16) if norm == "torch" else prenorm_overflow.NaiveRMSNorm(16)
        model = _CheckpointedNorm(make, reentrant).to(dtype)
        with Profiler(model, sample_every=1, memory=False, block_formats=False) as prof:
            for step in range(2):
                ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
                model(ids).float().square().mean().backward()
                prof.step()
        layers = prof.tables()["layers"]
        acts = layers[layers[T.TENSOR] == T.ACTIVATION]
        got.append(acts[[T.STEP, T.MODULE, "order", T.NUMEL, T.ZEROS]].sort_values([T.STEP, "order"]))
    plain, checkpointed = (g.reset_index(drop=True) for g in got)
    assert list(plain[plain[T.STEP] == 0][T.MODULE]) == ["emb", "block.0", "block.1", "head"]
    pd.testing.assert_frame_equal(plain, checkpointed)


def test_torchs_norms_are_asked_whether_they_compute_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether torch's norms compute in fp32 inside is asked of this torch's kernels (an fp16 row of +-300, whose
    fp16 square is inf): this torch's three do. A kernel that squared in fp16 (here an RMSNorm's functional form
    replaced by one) makes its modules judged as a user's norm is: named by fp16_fp32_ops."""
    from precprof.capture import plan

    assert all(plan._fp32_inside_here(i) for i in range(len(plan._FP32_INSIDE)))
    # BatchNorm is not among them (what a 16-bit cast changes there, its running statistics and what autocast
    # keeps in fp32, its finding says): it stays named
    assert not plan.computes_fp32_inside(nn.BatchNorm1d(16))
    x = torch.tensor([[300.0, -300.0]], dtype=torch.float16)
    assert torch.equal(nn.RMSNorm(2, elementwise_affine=False).half()(x), torch.tensor([[1.0, -1.0]]).half())

    def squares_in_fp16(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    assert torch.equal(squares_in_fp16(x), torch.zeros_like(x))
    table = [(c, squares_in_fp16 if c is nn.RMSNorm else f) for c, f in plan._FP32_INSIDE]
    monkeypatch.setattr(plan, "_FP32_INSIDE", tuple(table))
    plan._fp32_inside_here.cache_clear()
    try:
        assert not plan.computes_fp32_inside(nn.RMSNorm(2)) and plan.computes_fp32_inside(nn.LayerNorm(2))
        m = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.Linear(8, 8), nn.LayerNorm(8)).half()
        with Profiler(m, sample_every=1, memory=False, block_formats=False) as prof:
            for _ in range(2):
                m(torch.randn(4, 8, dtype=torch.float16)).float().sum().backward()
                prof.step()
        summary = {T.SUMMARY_CAPTURE: prof.summary()}
        assert summary[T.SUMMARY_CAPTURE]["norms_fp32_inside"] == ["3"]
        ops = recommend(prof.tables(), config=AdvisorConfig(small_model_params=0), summary=summary).finding(
            "fp16_fp32_ops"
        )
        assert ops is not None and ops.modules == ["1"]
    finally:
        plan._fp32_inside_here.cache_clear()
