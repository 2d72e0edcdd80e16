"""The fp16 advice on the overflows of a Llama-like model, each on a tiny real CPU fp16 autocast run: an fp32 output
that overflows only in the cast its matmul reader makes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from scenarios import norm_overflow
from scenarios.loop import backward_and_step, keep_in_fp32
from torch import nn

from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig, Recommendation, recommend
from precprof.capture import Profiler
from precprof.training import TrainConfig, train


def _train(
    model: nn.Module,
    batch: Callable[[int], torch.Tensor],
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    keep: Sequence[str] = (),
    steps: int = 3,
    recorded: list[tuple[dict[str, Any], dict[str, Any]]] | None = None,
) -> tuple[Recommendation, list[float]]:
    """``model`` trained ``steps`` steps under fp16 autocast on the CPU (AdamW, a GradScaler at 2^8, every step
    sampled), the modules ``keep`` names outside autocast; the advisor's recommendation for a V100 (fp16 its
    verdict) and the losses (and the run's tables and summary appended to ``recorded``)."""
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
    tables, summary = prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}
    if recorded is not None:
        recorded.append((tables, summary))
    rec = recommend(tables, hardware="v100", config=AdvisorConfig(small_model_params=0), summary=summary)
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


def test_an_fp32_norm_output_near_fp16s_limit_names_lm_head_not_the_norm() -> None:
    """The same norm's output within 2x of 65504 (its largest |x| scaled to 40000): no overflow yet, a warning. It
    said "Keep these modules in fp32" of model.norm, fp32 already, and the verdict's keep list held model.norm;
    both name lm_head now, whose cast to fp16 takes the values near fp16's limit."""
    model = _llama()
    model.model.norm._forward_hooks.clear()  # (the 1e5 hook)
    model.model.norm.register_forward_hook(lambda m, a, y: y * (40000.0 / y.detach().abs().max()))
    with _outputs(model, ["model.norm", "lm_head"]) as seen:
        rec, _ = _train(model, _tokens, _lm_loss)
    # the run has the problem: the norm's output is fp32, near 65504 and below it; lm_head's fp16 output is finite
    assert all(y.dtype == torch.float32 and 32752 <= float(y.abs().max()) < 65504 for y in seen["model.norm"])
    assert all(y.dtype == torch.float16 and bool(y.isfinite().all()) for y in seen["lm_head"])
    assert rec.finding("fp16_activation_overflow") is None
    f = rec.finding("fp16_activation_near_overflow")
    assert f is not None and f.modules == ["model.norm"]
    assert f.remedy.startswith(
        "Keep lm_head in fp32 (outside autocast): model.norm's output is fp32 (autocast leaves it in fp32) and comes "
        "within 2x of 65504 only in the cast to fp16 that lm_head makes of it for its matmul"
    )
    assert "(keeping model.norm in fp32 changes nothing: it is fp32 already)" in f.remedy
    assert f.remedy.endswith(", or use bf16.")
    assert rec.fp16_keep_fp32 == ["lm_head"]
    reasons = " ".join(rec.reasons)
    assert (
        "Keep lm_head in fp32: autocast would cast an fp32 input within 2x of 65504 to fp16 there" in reasons
    )
    assert "Keep model.norm" not in reasons


class _Attention(nn.Module):
    """Llama's attention, small: q, k, v and o projections, the scores q @ k^T computed by its own forward without
    the 1/sqrt(head_dim) scale, their causal softmax, and the product with v. Its q and k weights are 300 times the
    usual: in fp16 the scores go beyond 65504. ``fp32_scores``: the scores and their softmax computed in fp32
    outside autocast (q.float() @ k.float()^T; under autocast the matmul would cast them back), as the advice says. The scores of each call are kept, as its forward made them."""

    def __init__(self, d: int = 32, heads: int = 4, fp32_scores: bool = False) -> None:
        super().__init__()
        self.heads, self.fp32_scores = heads, fp32_scores
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        with torch.no_grad():
            self.q_proj.weight.mul_(300.0)
            self.k_proj.weight.mul_(300.0)
        self.scores: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        with torch.autocast("cpu", enabled=not self.fp32_scores):
            scores = q.float() @ k.float().transpose(-2, -1) if self.fp32_scores else q @ k.transpose(-2, -1)
        self.scores.append(scores.detach().clone())
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(mask, float("-inf")).softmax(-1).to(v.dtype)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, t, d))


class _Decoder(nn.Module):
    """An input projection, one pre-norm block with the attention above (self_attn), a head."""

    def __init__(self, fp32_scores: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.norm, self.head = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 1)
        self.self_attn = _Attention(fp32_scores=fp32_scores)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.self_attn(self.norm(h))
        return self.head(h)


def _features(step: int) -> torch.Tensor:
    return torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(step))


def _mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def test_attention_scores_that_overflow_fp16_name_the_attentions_code_and_its_fixes() -> None:
    """The scores q @ k^T of self_attn's own forward go beyond 65504 in fp16: inf, softmax nan, o_proj's input
    (a function's output) nan, every step. nonfinite_forward named o_proj:input, "keep it in fp32" (followed, the
    scores still overflow in self_attn's code and every step is nan); it names the code in self_attn's forward now,
    and the scores' fixes: computed in fp32 there, the run is finite."""
    model = _Decoder()
    with _outputs(model, ["self_attn.q_proj", "self_attn.k_proj"]) as seen:
        rec, losses = _train(model, _features, _mse)
    # the run has the problem: q and k finite in fp16, their product beyond fp16's range, the loss nan
    assert all(y.dtype == torch.float16 and bool(y.isfinite().all()) for ys in seen.values() for y in ys)
    assert all(s.dtype == torch.float16 and bool(s.isinf().any()) for s in model.self_attn.scores)
    assert all(loss != loss for loss in losses)
    f = rec.finding("nonfinite_forward")
    assert f is not None and f.modules == ["self_attn.o_proj:input", "self_attn"]
    assert f.title == "nan/inf first appears in the forward pass in self_attn's code (self_attn.o_proj:input)"
    assert (
        "self_attn.o_proj:input is no module's output: code in self_attn's forward made it (a function called "
        "between its submodules), from the values of modules that held no nan/inf: the nan/inf began in that code, "
        "not in self_attn.o_proj." in f.message
    )
    assert f.remedy.startswith(
        "Fix the attention scores in self_attn's forward (keeping self_attn.o_proj in fp32 changes nothing"
    )
    assert (
        "Compute the scores and their softmax in fp32, outside autocast (which would cast q.float() back to fp16 "
        "for the matmul): under torch.autocast(device_type, enabled=False), q.float() @ k.float().transpose(-2, -1)"
        in f.remedy
    )
    assert "keep it in fp32" not in f.remedy
    # the old advice followed: o_proj reads what the scores made, nan
    _, old = _train(_Decoder(), _features, _mse, keep=["self_attn.o_proj"])
    assert all(loss != loss for loss in old)
    # the new one: the scores in fp32
    after, new = _train(_Decoder(fp32_scores=True), _features, _mse)
    assert all(torch.isfinite(torch.tensor(new))) and after.finding("nonfinite_forward") is None


class _NaiveRMSNorm(nn.Module):
    """An RMSNorm written as x.pow(2).mean(-1) in its input's dtype (fp16 under autocast), or, ``fp32``, on
    x.float() and cast back, as Llama's does."""

    def __init__(self, d: int, fp32: bool = False) -> None:
        super().__init__()
        self.weight, self.fp32 = nn.Parameter(torch.ones(d)), fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if self.fp32 else x
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class _UpNormHead(nn.Module):
    """A Linear whose weights are 400 times the usual (fp16 outputs beyond 256), the norm above, a head."""

    def __init__(self, fp32: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.norm, self.head = nn.Linear(8, 32), _NaiveRMSNorm(32, fp32), nn.Linear(32, 1)
        with torch.no_grad():
            self.up.weight.mul_(400.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.up(x)))


def _rows(step: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(step))


def test_a_norm_whose_fp16_square_overflows_is_critical_and_names_the_square() -> None:
    """A hand-written RMSNorm squares its fp16 input: a row holding |x| >= 256 squares to inf, its mean is inf,
    and x * rsqrt(inf) zeros the whole row; no finding said so. fp16_norm_overflow, critical, names the norm,
    its x.pow(2), the count of values its input holds at or above 256 and the zeros (the test's own hooks count
    both); its fix, the norm computed on x.float(), makes no zeros and no finding. The norm's input is up's output
    as up made it: the run records that (capture.norm_inputs_from) and reads it once, in up's row; a run that
    does not record it (made before it did) is told from the output of the leaf before the norm, up: the same
    numbers."""
    model = _UpNormHead()
    recorded: list[tuple[dict[str, Any], dict[str, Any]]] = []
    with _outputs(model, ["up", "norm"]) as seen:
        rec, _ = _train(model, _rows, _mse, recorded=recorded)
    big = sum(int((y.abs() >= 256).sum()) for y in seen["up"])
    zeros = sum(int((y == 0).sum()) for y in seen["norm"])
    values = sum(y.numel() for y in seen["norm"])
    assert all(y.dtype == torch.float16 for y in seen["up"]) and big > 0
    assert zeros > values // 2 and all(int((y == 0).sum()) == 0 for y in seen["up"])
    f = rec.finding("fp16_norm_overflow")
    assert f is not None and f.severity == "critical" and f.modules == ["norm"]
    assert f.numbers["zeros"] == zeros and f.numbers["input_values_at_least_256"] == big
    assert f.title == f"norm's x.pow(2) overflows fp16: {zeros / values * 100:.3g}% of its output is 0"
    assert f"its input, the fp16 output of up, holds {big:,} values of |x| >= 256" in f.message
    ((tables, summary),) = recorded
    layers = tables["layers"]
    inputs = layers.loc[layers[T.MODULE].astype(str).str.endswith(T.INPUT_SUFFIX), T.MODULE]
    assert set(inputs.astype(str)) == {"up:input"}
    assert summary[T.SUMMARY_CAPTURE]["norm_inputs_from"] == {"norm": ["up"]}
    older = {
        T.SUMMARY_CAPTURE: {k: v for k, v in summary[T.SUMMARY_CAPTURE].items() if k != "norm_inputs_from"}
    }
    told = recommend(tables, hardware="v100", config=AdvisorConfig(small_model_params=0), summary=older)
    g = told.finding("fp16_norm_overflow")
    assert g is not None and g.numbers == f.numbers
    assert f"its input, the fp16 output of up, holds {big:,} values of |x| >= 256" in g.message
    assert [(x.code, x.numbers) for x in told.findings] == [(x.code, x.numbers) for x in rec.findings]
    assert f.remedy.startswith("Compute the norm in fp32 inside norm: upcast its input before the square")
    fixed = _UpNormHead(fp32=True)
    with _outputs(fixed, ["norm"]) as after_seen:
        after, _ = _train(fixed, _rows, _mse)
    assert all(int((y == 0).sum()) == 0 for y in after_seen["norm"])
    assert after.finding("fp16_norm_overflow") is None


def _train_lm(out: Path, fp32_norm: bool, loss_scale: str = "auto") -> Recommendation:
    """scenarios/norm_overflow's LM (an embedding of std 300, a hand-written RMSNorm) trained 4 steps fp16-pure by
    the built-in loop on the CPU, as ``precprof train -m norm_overflow.py:factory -p fp16-pure`` does: its
    dynamic GradScaler starts at 2^16 and backs off on the steps whose gradients overflow."""
    train(
        TrainConfig(
            model=f"{norm_overflow.__file__}:factory",
            model_args={"d": 32, "fp32_norm": fp32_norm},
            precision="fp16-pure",
            loss_scale=loss_scale,
            device="cpu",
            steps=4,
            batch_size=2,
            seq_len=16,
            sample_every=1,
            out=out,
            progress=False,
            report=not fp32_norm and loss_scale == "auto",
        )
    )
    return Recommendation.from_dict(T.read_summary(out)[T.SUMMARY_RECOMMENDATION])


def test_the_zeros_of_a_norms_fp16_overflow_are_told_as_its_own_and_not_as_underflow(
    tmp_path: Path, one_thread: None
) -> None:
    """tester t5's run: a tiny LM whose embedding (std 300) feeds a naive fp16 RMSNorm, fp16-pure. The norm's
    x.pow(2) overflows and zeroes its whole output (fp16_norm_overflow, right), but the other findings misread its
    consequences: fp16_gradient_underflow called emb's gradient, zero because x * rsqrt(inf) has a zero
    derivative, fp16 underflow and told the user to start GradScaler at a larger init_scale, which changes nothing
    (the test's own backward at 2^16 and 2^24 proves it); no_gradient said of norm and up that what zeroed their
    gradients the run does not tell, and left out emb, whose nan on the step the scaler skipped read as a
    gradient. fp16_norm_overflow leads the findings now; fp16_gradient_underflow leaves emb's zeros out, says
    whose they are and prescribes no loss scale for them; no_gradient names the norm's overflow for emb, norm and
    up; the verdict box points to fp16_norm_overflow, and an fp16 verdict starts with it."""
    # the truth, from the model itself: no loss scale gives emb or norm's weight a finite nonzero gradient
    torch.manual_seed(0)
    model = norm_overflow.factory(d=32).half()
    ids = torch.randint(0, 256, (2, 16))
    for k in (16, 24):
        model.zero_grad()
        logits = model(ids)
        (torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()) * 2.0**k).backward()
        assert bool((model.norm(model.emb(ids)) == 0).all())
        for p in (model.emb.weight, model.norm.weight, model.up.weight):
            assert p.grad is not None and not bool((torch.isfinite(p.grad) & (p.grad != 0)).any())

    out = tmp_path / "naive"
    rec = _train_lm(out, fp32_norm=False)
    assert rec.findings[0].code == "fp16_norm_overflow" and rec.findings[0].numbers["share"] == 1.0

    tables = T.read_tables(out)
    layers, steps = tables["layers"], tables["steps"]
    skipped = {int(s) for s in steps[steps[T.SKIPPED].astype(bool)][T.STEP]}
    emb = layers[(layers[T.MODULE] == "emb") & (layers[T.TENSOR] == T.ACTIVATION_GRAD)]
    emb_zeros = int(emb.loc[~emb[T.STEP].isin(skipped), T.ZEROS].sum())
    assert skipped and emb_zeros == int(emb.loc[~emb[T.STEP].isin(skipped), T.NUMEL].sum()) > 0
    under = rec.finding("fp16_gradient_underflow")
    assert under is not None and under.severity == "info" and not under.numbers["fp16_flushed"]
    assert under.numbers["norm_overflow_left_out"] == 1 and under.numbers["norm_overflow_zeros"] == emb_zeros
    assert under.message.startswith(
        f"The activation gradients of emb held no nonzero value ({emb_zeros:,} exact zeros), and not for "
        "underflow: norm's x.pow(2) overflowed fp16 (fp16_norm_overflow)"
    )
    assert "emb received no gradient" not in under.remedy and "Scale the loss" not in under.remedy
    assert under.remedy.endswith(
        "The zeros of emb are no underflow: computing norm in fp32 (fp16_norm_overflow) removes them."
    )

    dead = rec.finding("no_gradient")
    assert dead is not None and dead.modules == ["emb", "norm", "up"]
    assert dead.title == "No gradient reached the weights of 3 of 5 layers: norm's x.pow(2) overflowed fp16"
    assert "The x.pow(2) of norm overflowed fp16 and zeroed its output (fp16_norm_overflow)" in dead.message
    assert "up reads that output" in dead.message and "the output gradient of emb came back through norm" in (
        dead.message
    )
    assert "the run does not tell" not in dead.message and dead.remedy.startswith("Compute norm in fp32")
    html = (out / T.REPORT_FILE).read_text()
    assert "the x.pow(2) of norm overflowed fp16 and zeroed its output" in html
    assert "see the critical finding fp16_norm_overflow, then no_gradient" in html
    # on fp16 hardware the verdict's first words on fp16 are the norm's
    v100 = recommend(out, hardware="v100", config=AdvisorConfig(small_model_params=0))
    assert v100.format == "fp16"
    assert v100.reasons[1].startswith(
        "First compute norm in fp32 (x.float() before the square): norm's x.pow(2)"
    )

    # the control: the norm on x.float(), as Llama's: none of these findings, and the loss-scale advice is the
    # exponent histograms' (real underflow), with nothing flushed and no norm in it
    fixed = _train_lm(tmp_path / "fp32-norm", fp32_norm=True)
    assert fixed.finding("fp16_norm_overflow") is None and fixed.finding("no_gradient") is None
    under = fixed.finding("fp16_gradient_underflow")
    assert under is not None and under.severity == "info" and not under.numbers["fp16_flushed"]
    assert "norm_overflow_left_out" not in under.numbers and "fp16_norm_overflow" not in under.message
    assert under.remedy.startswith("Nothing to fix")


def test_an_unscaled_fp16_run_leaves_a_norms_zeros_out_of_its_share_of_zeros(
    tmp_path: Path, one_thread: None
) -> None:
    """The same LM, fp16-pure without a loss scaler: fp16_no_loss_scaling gave the share of zeros among the fp16
    activation gradients, "the flushed ones among them", with emb's in it, which the norm's overflow made, not
    fp16's floor. It leaves them out now and says whose they are, as fp16_gradient_underflow does."""
    out = tmp_path / "unscaled"
    rec = _train_lm(out, fp32_norm=False, loss_scale="none")
    assert rec.findings[0].code == "fp16_norm_overflow"
    ag = T.read_tables(out)["layers"]
    ag = ag[(ag[T.TENSOR] == T.ACTIVATION_GRAD) & (ag[T.MODULE] != "emb")]
    unscaled = rec.finding("fp16_no_loss_scaling")
    assert unscaled is not None
    assert unscaled.numbers["fp16_zero_share"] == pytest.approx(ag[T.ZEROS].sum() / ag[T.NUMEL].sum())
    assert (
        "the flushed ones among them; those of emb, zero for the overflow of norm's x.pow(2) (fp16_norm_overflow), "
        "left out)" in unscaled.message
    )
    under = rec.finding("fp16_gradient_underflow")
    assert under is not None and under.numbers["norm_overflow_left_out"] == 1
    assert under.message.startswith("The activation gradients of emb held no nonzero value")
