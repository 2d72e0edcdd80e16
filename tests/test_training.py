"""The training loop: every CPU precision mode on gpt-nano, llama-mini and hf:gpt2; loss falls; an injected
inf skips exactly one step (weights bitwise unchanged, scale halved); clipping sees unscaled gradients; the
fp32-state optimizers against torch's; interrupted runs are saved as incomplete."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from precprof import hardware
from precprof import tables as T
from precprof.errors import MissingDependencyError, UserError
from precprof.optim import FP32StateAdamW, FP32StateSGD
from precprof.training import (
    Callback,
    TrainConfig,
    TrainRun,
    default_out_dir,
    default_sample_every,
    grad_norm_,
    loss_from_output,
    make_scaler,
    parse_loss_scale,
    plan_precision,
    resolve_loss_scale,
    train,
)

pytestmark = pytest.mark.usefixtures("one_thread")
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
CPU_MODES = ["fp32", "bf16", "fp16", "bf16-pure", "fp16-pure"]
TINY_HF_GPT2 = {"n_layer": "1", "n_embd": "32", "n_head": "2", "vocab_size": "256", "n_positions": "64"}
MODELS: list[Any] = [
    ("gpt-nano", {}),
    ("llama-mini", {}),
    pytest.param(
        "hf:gpt2",
        TINY_HF_GPT2,
        marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed"),
    ),
]
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tiny(tmp_path: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        steps=3, batch_size=2, seq_len=16, out=tmp_path / "run", progress=False, report=False, device="cpu"
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("precision", CPU_MODES)
@pytest.mark.parametrize(("model", "model_args"), MODELS)
def test_three_steps_in_every_cpu_mode(
    tmp_path: Path, model: str, model_args: dict[str, str], precision: str
) -> None:
    seen: dict[str, Any] = {}

    class Watch(Callback):
        def after_backward(self, run: TrainRun) -> None:
            seen["param_dtypes"] = {p.dtype for p in run.model.parameters()}
            seen["loss_dtype"] = run.loss.dtype if run.loss is not None else None

    result = train(
        tiny(tmp_path, model=model, model_args=model_args, precision=precision), callbacks=[Watch()]
    )
    steps = result.steps
    assert list(steps[T.STEP]) == [0, 1, 2]
    assert steps[T.LOSS].map(math.isfinite).all()
    assert steps[T.TOKENS].tolist() == [32.0, 32.0, 32.0]
    expected_params = LOW[precision.split("-")[0]] if precision.endswith("-pure") else torch.float32
    assert seen["param_dtypes"] == {expected_params}
    assert seen["loss_dtype"] == torch.float32
    summary = T.read_summary(result.run_dir)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert summary[T.SUMMARY_CONFIG]["precision"] == precision
    scaled = precision.startswith("fp16")
    assert summary[T.SUMMARY_CONFIG]["loss_scaling"] == ("dynamic" if scaled else "none")
    assert (steps[T.LOSS_SCALE] == (2.0**16 if scaled else 1.0)).all()
    for name in T.TABLE_FILES.values():
        assert (result.run_dir / name).exists()
    if precision in ("bf16", "fp16"):
        # autocast really ran the matmuls in low precision (what the profiler recorded)
        layers = T.read_tables(result.run_dir)["layers"]
        acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & (layers[T.MODULE_TYPE].isin(["Linear", "Conv1D"]))]
        assert not acts.empty and set(acts[T.DTYPE]) == {str(LOW[precision]).removeprefix("torch.")}


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_pure_hf_llama_keeps_its_rotary_frequencies_in_fp32(tmp_path: Path) -> None:
    """bf16-pure on hf:llama casts the model as transformers' from_pretrained(..., dtype=torch.bfloat16) loads it:
    parameters bf16 (the fp32 initialisation rounded, as every mode starts from), the rotary frequencies fp32
    and exact, and a module the model keeps in fp32 (DeepSeek-V3's router) fp32 and as built. The loop's .to(torch.bfloat16) rounded them, and its own report then warned of it
    (low_precision_rope) with a remedy the user of precprof train cannot apply."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    from precprof.models.hf import cast_as_loaded

    sizes = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    torch.manual_seed(0)
    built = LlamaForCausalLM(AutoConfig.for_model("llama", vocab_size=256, **sizes))
    exact = {n: b.clone() for n, b in built.named_buffers()}
    weights = {n: p.detach().clone() for n, p in built.named_parameters()}
    cast = cast_as_loaded(built, torch.bfloat16)
    assert exact.keys() == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert all(torch.equal(b, exact[n]) and b.dtype == torch.float32 for n, b in cast.named_buffers())
    assert all(torch.equal(p, weights[n].bfloat16()) for n, p in cast.named_parameters())
    # DeepSeek-V3 keeps its router in fp32 (_keep_in_fp32_modules_strict), as from_pretrained loads it
    torch.manual_seed(0)
    deepseek = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=256,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        moe_intermediate_size=16,
        q_lora_rank=16,
        kv_lora_rank=16,
        **sizes,
    )
    built = AutoModelForCausalLM.from_config(deepseek)
    gate = built.model.layers[0].mlp.gate.weight.detach().clone()
    cast = cast_as_loaded(built, torch.bfloat16)
    assert cast.model.layers[0].mlp.gate.weight.dtype == torch.float32
    assert torch.equal(cast.model.layers[0].mlp.gate.weight, gate)
    assert cast.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    args = {"vocab_size": "256", **{k: str(v) for k, v in sizes.items()}}
    result = train(tiny(tmp_path, model="hf:llama", model_args=args, precision="bf16-pure", steps=2))
    summary = T.read_summary(result.run_dir)
    assert summary[T.SUMMARY_CAPTURE]["low_precision_buffers"] == []
    assert "low_precision_rope" not in {f["code"] for f in summary[T.SUMMARY_RECOMMENDATION]["findings"]}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_loss_falls_over_200_steps(tmp_path: Path, precision: str) -> None:
    # one block of gpt-nano: fp16 matmuls are emulated on CPU (about 15x slower than fp32), and this keeps the
    # three runs near 15 s; the drop toward the chain's entropy rate is the same with four blocks
    cfg = tiny(tmp_path, precision=precision, steps=200, batch_size=4, seq_len=16, sample_every=0)
    cfg.model_args = {"n_layer": "1"}
    result = train(cfg)
    losses = result.steps[T.LOSS]
    first, last = float(losses.iloc[:10].mean()), float(losses.iloc[-20:].mean())
    assert first > math.log(256) - 0.2  # starts near the uniform loss
    assert last < first - 1.0, (first, last)
    final = result.summary[T.SUMMARY_FINAL]
    assert final["loss_floor_nats"] == pytest.approx(1.718, abs=0.01)
    assert final["loss_floor_nats"] < last
    assert final["steps_done"] == 200 and final["skipped_steps"] == 0


class InjectInf(Callback):
    """Put an inf into one gradient at ``step``; record weights and scale around that step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.scales: list[float] = []
        self.adam_steps: list[float] = []

    def after_backward(self, run: TrainRun) -> None:
        assert run.scaler is not None
        self.scales.append(run.scaler.get_scale())
        if run.step == self.step:
            self.before = [p.detach().clone() for p in run.model.parameters()]
            self.adam_steps = [float(s["step"]) for s in run.optimizer.state.values()]
            p = next(p for p in run.model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("inf")

    def on_step_end(self, run: TrainRun) -> None:
        if run.step == self.step:
            self.after = [p.detach().clone() for p in run.model.parameters()]
            assert [float(s["step"]) for s in run.optimizer.state.values()] == self.adam_steps


@pytest.mark.parametrize("precision", ["fp16", "fp16-pure"])
def test_injected_inf_skips_the_step_and_halves_the_scale(tmp_path: Path, precision: str) -> None:
    cb = InjectInf(step=2)
    result = train(tiny(tmp_path, precision=precision, steps=4, init_scale=2.0**10), callbacks=[cb])
    assert all(torch.equal(a, b) for a, b in zip(cb.before, cb.after, strict=True)), "weights changed"
    assert cb.scales == [1024.0, 1024.0, 1024.0, 512.0]
    steps = result.steps.set_index(T.STEP)
    assert steps[T.SKIPPED].tolist() == [False, False, True, False]
    assert steps.loc[2, T.LOSS_SCALE] == 1024.0 and steps.loc[3, T.LOSS_SCALE] == 512.0
    assert result.summary[T.SUMMARY_FINAL]["skipped_steps"] == 1


def test_static_scale_skips_but_keeps_the_scale(tmp_path: Path) -> None:
    cb = InjectInf(step=1)
    result = train(tiny(tmp_path, precision="fp16", steps=3, loss_scale="static:128"), callbacks=[cb])
    assert all(torch.equal(a, b) for a, b in zip(cb.before, cb.after, strict=True))
    assert cb.scales == [128.0, 128.0, 128.0]
    assert result.steps[T.SKIPPED].tolist() == [False, True, False]
    assert (result.steps[T.LOSS_SCALE] == 128.0).all()


def test_no_scaling_in_fp16(tmp_path: Path) -> None:
    seen = []

    class Probe(Callback):
        def after_backward(self, run: TrainRun) -> None:
            seen.append(run.scaler)

    result = train(tiny(tmp_path, precision="fp16", loss_scale="none"), callbacks=[Probe()])
    assert seen == [None, None, None]
    assert (result.steps[T.LOSS_SCALE] == 1.0).all()


def test_grad_norm_is_unscaled_and_clipping_applies(tmp_path: Path) -> None:
    norms: list[float] = []

    class TrueNorm(Callback):
        def after_backward(self, run: TrainRun) -> None:
            assert run.scaler is not None
            scale = run.scaler.get_scale()
            sq = sum(float((p.grad.double() / scale).pow(2).sum()) for p in run.model.parameters())
            norms.append(math.sqrt(sq))

    result = train(
        tiny(tmp_path, precision="fp16", init_scale=2.0**8, grad_clip=1e-3), callbacks=[TrueNorm()]
    )
    recorded = result.steps[T.GRAD_NORM].tolist()
    assert recorded == pytest.approx(norms, rel=1e-5)
    assert all(n > 1e-3 for n in norms)  # so clipping was active on every step


def test_grad_norm_matches_clip_grad_norm() -> None:
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(5, 7)), nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2, 2))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        g = torch.randn_like(p) * 3
        p.grad, q.grad = g.clone(), g.clone()
    a[2].grad = None
    b[2].grad = None
    ours = grad_norm_(a, max_norm=0.5)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm=0.5)
    torch.testing.assert_close(ours, ref)
    for p, q in zip(a[:2], b[:2], strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    # fp16 gradients whose squares overflow fp16: the norm is accumulated in fp32
    h = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    h.grad = torch.full((4,), 1000.0, dtype=torch.float16)
    assert float(grad_norm_([h])) == pytest.approx(2000.0)
    assert float(grad_norm_([])) == 0.0
    # float64 gradients (a model of float64 parameters): vector_norm refused to narrow them to fp32 (a traceback
    # from precprof's loop); their norms are taken in float64, then clipped as torch clips them
    d = [nn.Parameter(torch.zeros(3, dtype=torch.float64)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    e = [nn.Parameter(torch.zeros_like(p)) for p in d]
    for p, q in zip(d, e, strict=True):
        p.grad = torch.arange(1.0, p.numel() + 1, dtype=torch.float64)
        q.grad = p.grad.clone()
    ours = grad_norm_(d, max_norm=1.0)
    ref = torch.nn.utils.clip_grad_norm_(e, max_norm=1.0)
    assert ours.dtype == torch.float32 and float(ours) == pytest.approx(float(ref), rel=1e-6)
    for p, q in zip(d, e, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_grad_norm_and_clipping_of_a_sparse_gradient() -> None:
    """nn.Embedding(sparse=True)'s gradient, uncoalesced (a row looked up twice holds two entries): vector_norm
    refused it (the built-in loop crashed at step 0, clipping on or off). Its norm is that of the dense gradient
    (duplicates summed before squaring), computed apart in float64; clipping scales it as torch clips the
    dense one."""
    torch.manual_seed(0)
    emb, lin = nn.Embedding(6, 3, sparse=True), nn.Linear(3, 2)
    lin(emb(torch.tensor([[1, 4, 1], [1, 5, 0]]))).square().sum().backward()
    g = emb.weight.grad
    assert g is not None and g.is_sparse and not g.is_coalesced() and g._nnz() == 6  # rows 1 (x3), 4, 5, 0
    dense = [g.to_dense(), lin.weight.grad, lin.bias.grad]
    ref = math.sqrt(sum(float(d.double().square().sum()) for d in dense))
    assert float(grad_norm_(list(emb.parameters()) + list(lin.parameters()))) == pytest.approx(ref, rel=1e-6)
    # the values alone, duplicates unsummed, give another norm: the test tells the two apart
    assert float(torch.linalg.vector_norm(g._values())) != pytest.approx(float(g.to_dense().norm()), rel=1e-3)
    copies = [nn.Parameter(torch.zeros_like(d)) for d in dense]
    for q, d in zip(copies, dense, strict=True):
        q.grad = d.clone()
    ours = grad_norm_([emb.weight, lin.weight, lin.bias], max_norm=0.1)
    theirs = torch.nn.utils.clip_grad_norm_(copies, max_norm=0.1)
    torch.testing.assert_close(ours, theirs)
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse  # clipped in place, still sparse
    torch.testing.assert_close(emb.weight.grad.to_dense(), copies[0].grad)
    torch.testing.assert_close(lin.weight.grad, copies[1].grad)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fp32_state_optimizers_match_torch_on_fp32_params(kind: str) -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 5))
    q = nn.Parameter(p.detach().clone())
    if kind == "adamw":
        ours: torch.optim.Optimizer = FP32StateAdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        ref: torch.optim.Optimizer = torch.optim.AdamW(
            [q], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False
        )
    else:
        ours = FP32StateSGD([p], lr=1e-2, momentum=0.9, weight_decay=0.1)
        ref = torch.optim.SGD([q], lr=1e-2, momentum=0.9, weight_decay=0.1, foreach=False)
    for _ in range(5):
        g = torch.randn(6, 5)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_state_adamw_on_low_precision_params(dtype: torch.dtype) -> None:
    """Reference: torch's AdamW on an fp32 copy that is re-loaded from the low-precision weight every step."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 8).to(dtype))
    w = nn.Parameter(p.detach().float())
    ours = FP32StateAdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    ref = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    for _ in range(4):
        g = torch.randn(8, 8).to(dtype)
        p.grad = g.clone()
        with torch.no_grad():
            w.copy_(p.float())  # no master weights: each step starts from the stored low-precision value
        w.grad = g.float()
        ours.step()
        ref.step()
        assert torch.equal(p.detach(), w.detach().to(dtype))
    assert ours.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fp32_state_optimizers_keep_an_fp64_parameter_in_fp64_and_refuse_a_complex_one(kind: str) -> None:
    """An fp64 parameter was updated in fp32 (``p.float()``) and rounded back: torch's optimizer on fp64 moved it
    by updates that fp32 rounded away. Now its update and states are fp64, torch's update exactly. A complex
    parameter's imaginary part was dropped (``p.float()``): refused in one line at construction, and when
    ``add_param_group`` hands it over later (a layer unfrozen mid-run), which took it and updated it with real
    arithmetic; the optimizer is left as it was."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.full((4, 3), 1.0, dtype=torch.float64))
    q = nn.Parameter(p.detach().clone())
    if kind == "adamw":
        ours: torch.optim.Optimizer = FP32StateAdamW([p], lr=1e-9, weight_decay=0.0)
        ref: torch.optim.Optimizer = torch.optim.AdamW([q], lr=1e-9, weight_decay=0.0, foreach=False)
    else:
        ours = FP32StateSGD([p], lr=1e-9, momentum=0.9)
        ref = torch.optim.SGD([q], lr=1e-9, momentum=0.9, foreach=False)
    for _ in range(3):
        g = torch.randn(4, 3, dtype=torch.float64)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert not torch.equal(q.detach(), torch.ones_like(q))  # updates below fp32's ulp at 1.0 (6e-8), kept
    assert torch.equal(p.detach(), q.detach())
    assert all(v.dtype == torch.float64 for v in ours.state[p].values() if v.dim())
    z = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    make = FP32StateAdamW if kind == "adamw" else FP32StateSGD
    with pytest.raises(ValueError, match="parameter 1 of group 0 is complex64") as e:
        make([nn.Parameter(torch.ones(2)), z])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="parameter 0 of group 1 is complex64"):
        ours.add_param_group({"params": (t for t in [z])})
    assert len(ours.param_groups) == 1 and z not in ours.state


def test_pure_bf16_loses_tiny_updates() -> None:
    """Without master weights an update below half an ulp of the bf16 weight vanishes; fp32 keeps it."""
    for dtype, changes in ((torch.bfloat16, False), (torch.float32, True)):
        p = nn.Parameter(torch.ones(4, dtype=dtype))
        opt = FP32StateSGD([p], lr=1e-4)
        p.grad = torch.ones(4, dtype=dtype)
        opt.step()
        assert (not torch.equal(p.detach(), torch.ones(4, dtype=dtype))) == changes


class Boom(Callback):
    def __init__(self, step: int, exc: BaseException) -> None:
        self.step, self.exc = step, exc

    def on_step_end(self, run: TrainRun) -> None:
        if run.step == self.step:
            raise self.exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [(KeyboardInterrupt(), "interrupted (Ctrl-C, SIGINT)"), (RuntimeError("boom"), "RuntimeError: boom")],
)
def test_interrupted_run_is_saved_incomplete(tmp_path: Path, exc: BaseException, reason: str) -> None:
    cfg = tiny(tmp_path, steps=10)
    with pytest.raises(type(exc)):
        train(cfg, callbacks=[Boom(2, exc)])
    summary = T.read_summary(cfg.out)  # type: ignore[arg-type]
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert reason in summary[T.SUMMARY_INCOMPLETE_REASON]
    steps = T.read_tables(cfg.out)["steps"]  # type: ignore[arg-type]
    assert list(steps[T.STEP]) == [0, 1, 2]
    assert summary[T.SUMMARY_FINAL]["steps_done"] == 3


def test_summary_contents(tmp_path: Path) -> None:
    result = train(tiny(tmp_path, steps=4, sample_every=2, command_line="precprof train --steps 4"))
    s = result.summary
    for key in (T.SUMMARY_CONFIG, T.SUMMARY_HARDWARE, T.SUMMARY_VERSIONS, T.SUMMARY_MODEL, T.SUMMARY_FINAL):
        assert key in s, key
    cfg = s[T.SUMMARY_CONFIG]
    assert cfg["model"] == "gpt-nano" and cfg["steps"] == 4 and cfg["sample_every"] == 2
    assert cfg["command_line"] == "precprof train --steps 4"
    assert cfg["data"]["name"] == "synthetic" and cfg["device"] == "cpu"
    assert s[T.SUMMARY_VERSIONS]["torch"] == torch.__version__
    assert s[T.SUMMARY_MODEL]["n_params"] == 496704 and s[T.SUMMARY_MODEL]["n_embd"] == 96
    assert s[T.SUMMARY_HARDWARE]["device"] == "cpu"
    final = s[T.SUMMARY_FINAL]
    assert final["final_loss"] == pytest.approx(float(result.steps[T.LOSS].iloc[-1]))
    assert result.final_loss == final["final_loss"]
    assert final["tokens_per_s"] > 0 and final["wall_s"] > 0
    assert sorted(result.steps.loc[result.steps[T.SAMPLED], T.STEP]) == [0, 2]


def loss_model_factory(tmp_path: Path, logits: str) -> str:
    """A factory file whose model returns its own loss, F.cross_entropy of ``logits`` (an expression of the
    model's logits ``z``), and the ``file:make`` name for ``--model``."""
    factory = tmp_path / "m.py"
    factory.write_text(
        "from torch import nn\n"
        "import torch.nn.functional as F\n"
        "class M(nn.Module):\n"
        "    def __init__(self, vocab_size):\n"
        "        super().__init__()\n"
        "        self.e = nn.Embedding(vocab_size, 16)\n"
        "        self.o = nn.Linear(16, vocab_size)\n"
        "    def forward(self, x, targets=None):\n"
        "        z = self.o(self.e(x)).flatten(0, 1)\n"
        f"        return F.cross_entropy({logits}, targets.flatten())\n"
        "def make(vocab_size):\n"
        "    return M(vocab_size)\n"
    )
    return f"{factory}:make"


def test_text_data_and_user_model_returning_a_loss(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("precprof measures what low precision does to training. " * 50)
    model = loss_model_factory(tmp_path, "z.float()")
    result = train(tiny(tmp_path, model=model, data=str(text), steps=5, lr=0.05))
    data = result.summary[T.SUMMARY_CONFIG]["data"]
    assert data["name"] == "text" and data["bytes"] == len(text.read_bytes())
    assert result.summary[T.SUMMARY_FINAL]["loss_floor_nats"] is None
    assert result.steps[T.LOSS].iloc[-1] < result.steps[T.LOSS].iloc[0]


def test_a_user_model_returning_a_bf16_loss_keeps_its_dtype_and_is_found(tmp_path: Path) -> None:
    # forward(x, targets) computes F.cross_entropy on bf16 logits in a bf16-pure run: the loop hands the loss
    # on in its own dtype (it used to cast it to fp32, hiding it), and the advisor says so
    model = loss_model_factory(tmp_path, "z")
    result = train(tiny(tmp_path, model=model, precision="bf16-pure", steps=4))
    assert result.summary[T.SUMMARY_CAPTURE]["loss_dtypes"] == {"bfloat16": 4}
    codes = {f["code"] for f in result.summary[T.SUMMARY_RECOMMENDATION]["findings"]}
    assert "bf16_loss" in codes
    assert all(torch.tensor(v).to(torch.bfloat16).item() == v for v in result.steps[T.LOSS])


def test_text_too_short_is_refused_before_training(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    cfg = tiny(tmp_path, data=str(short))
    with pytest.raises(UserError, match="seq-len"):
        train(cfg)
    assert not Path(cfg.out).exists()  # type: ignore[arg-type]


def test_loss_from_output() -> None:
    y = torch.randint(0, 5, (2, 3))
    logits = torch.randn(2, 3, 5)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), y.reshape(-1))
    torch.testing.assert_close(loss_from_output(logits, y), ref)
    torch.testing.assert_close(loss_from_output({"logits": logits.half()}, y), ref, atol=1e-2, rtol=1e-2)
    assert loss_from_output(torch.tensor(2.5), y).item() == 2.5
    assert loss_from_output({"loss": torch.tensor(1.0), "logits": logits}, y).item() == 1.0
    # nanoGPT's (logits, loss) from a model given the targets, either order, and a tuple holding logits alone
    assert loss_from_output((logits, torch.tensor(1.5)), y, passed_targets=True).item() == 1.5
    assert loss_from_output([torch.tensor(0.5), logits], y, passed_targets=True).item() == 0.5
    torch.testing.assert_close(loss_from_output((logits, None), y), ref)
    assert loss_from_output((torch.tensor(0.25),), y).item() == 0.25
    # logits and a scalar from a model that takes no targets: an auxiliary loss (a z-loss) or the loss? refused
    with pytest.raises(UserError, match="cannot tell whether the scalar is the loss or an auxiliary one"):
        loss_from_output((logits, torch.tensor(0.002)), y)
    with pytest.raises(UserError, match=r"returned tuple of shape \(\(2, 5\), 'NoneType'\).*among its items"):
        loss_from_output((torch.randn(2, 5), None), y)
    with pytest.raises(UserError, match="expected logits"):
        loss_from_output(torch.randn(2, 5), y)
    with pytest.raises(UserError, match="expected logits"):
        loss_from_output("nope", y)


def test_precision_plans_and_device_errors() -> None:
    cpu = hardware.detect("cpu")
    dev = torch.device("cpu")
    for mode in ("tf32", "fp8"):
        with pytest.raises(UserError, match="compute capability"):
            plan_precision(mode, dev, cpu)
    with pytest.raises(UserError, match="unknown precision"):
        plan_precision("fp64", dev, cpu)
    cuda = torch.device("cuda")
    v100 = hardware.preset("v100")
    with pytest.raises(UserError, match="bf16 support"):
        plan_precision("bf16", cuda, v100)
    with pytest.raises(UserError, match=r"8\.0"):
        plan_precision("tf32", cuda, v100)
    with pytest.raises(UserError, match=r"8\.9"):
        plan_precision("fp8", cuda, hardware.preset("a100"))
    assert plan_precision("tf32", cuda, hardware.preset("a100")).tf32
    pure = plan_precision("fp16-pure", dev, cpu)
    assert pure.param_dtype == torch.float16 and pure.autocast_dtype is None
    assert plan_precision("bf16", dev, cpu).autocast_dtype == torch.bfloat16
    if hardware.fp8_library() is None:
        with pytest.raises(MissingDependencyError):
            plan_precision("fp8", cuda, hardware.preset("h100"))
    else:
        plan = plan_precision("fp8", cuda, hardware.preset("h100"))
        assert plan.fp8_library and plan.autocast_dtype == torch.bfloat16


def test_loss_scale_parsing_and_scalers() -> None:
    assert parse_loss_scale("dynamic") == ("dynamic", None)
    assert parse_loss_scale("static:1024") == ("static", 1024.0)
    assert resolve_loss_scale("auto", "fp16-pure") == ("dynamic", None)
    assert resolve_loss_scale("auto", "bf16") == ("none", None)
    for bad in ("static:", "static:-1", "static:inf", "sometimes"):
        with pytest.raises(UserError, match="loss-scale"):
            parse_loss_scale(bad)
    cfg = TrainConfig(precision="fp16", loss_scale="static:64")
    scaler = make_scaler(
        cfg, plan_precision("fp16", torch.device("cpu"), hardware.detect("cpu")), torch.device("cpu")
    )
    assert scaler is not None
    assert scaler.get_growth_factor() == 1.0 and scaler.get_backoff_factor() == 1.0


def test_config_validation() -> None:
    for kw, match in (
        ({"steps": 0}, "steps"),
        ({"batch_size": 0}, "batch-size"),
        ({"lr": -1.0}, "lr"),
        ({"growth_factor": 1.0}, "growth-factor"),
        ({"backoff_factor": 1.5}, "backoff-factor"),
        ({"precision": "fp64"}, "precision"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"device": "tpu"}, "device"),
        ({"sample_every": -1}, "sample-every"),
    ):
        with pytest.raises(UserError, match=match):
            TrainConfig(**kw).validate()  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            train(TrainConfig(device="cuda", steps=1, progress=False))


def test_trains_arguments_are_refused_before_the_run_directory_is_claimed(tmp_path: Path) -> None:
    """``train(profiler_kwargs={"sample_evry": 1})`` raised once the run directory was claimed, leaving its
    summary.json "running (pid ...)" and the corrected rerun into it refused; ``steps=2.5`` passed the checks and
    failed in the loop (an incomplete run and a traceback); ``callbacks=[object()]`` recorded a whole incomplete
    run (t4). Each is one line, and nothing is left; a value the Profiler refuses leaves nothing either."""
    for kw, call, message in (
        ({"steps": 2.5}, {}, "--steps must be an integer, got 2.5"),
        ({"seq_len": "8"}, {}, "--seq-len must be an integer, got '8'"),
        (
            {},
            {"profiler_kwargs": {"sample_evry": 1}},
            "precprof.Profiler takes no 'sample_evry' (did you mean",
        ),
        ({}, {"profiler_kwargs": {"out": tmp_path}}, "the loop gives the Profiler its out itself"),
        ({}, {"callbacks": [Callback(), object()]}, "callbacks[1] (object) has no on_start, after_backward"),
        (
            {},
            {"profiler_kwargs": {"sample_every": -1}},
            "Profiler(sample_every=-1): expected a whole number >= 0",
        ),
    ):
        cfg = tiny(tmp_path, **{"steps": 2, **kw})
        with pytest.raises((UserError, ValueError)) as e:
            train(cfg, **call)
        assert message in str(e.value) and len(str(e.value).splitlines()) == 1, e.value
        assert not Path(cfg.out).exists(), kw  # type: ignore[arg-type]
    TrainConfig(steps=np.int64(3), sample_every=None).validate()  # an integer, NumPy's too


def test_defaults(tmp_path: Path) -> None:
    assert (
        default_sample_every(500) == 5
        and default_sample_every(30) == 1
        and default_sample_every(10_000) == 100
    )
    # a compiled model: every second step at least, so that the steps between run it compiled (a sampled step runs
    # it eagerly: fp8, compiled by default, was timed eager in a run of fewer than 150 steps)
    assert default_sample_every(30, compiled=True) == 2 and default_sample_every(500, compiled=True) == 5
    out = default_out_dir(TrainConfig(model="hf:gpt2", precision="bf16"), root=tmp_path)
    assert out.parent == tmp_path and out.name.startswith("hf-gpt2-bf16-")
    out.mkdir()
    again = default_out_dir(TrainConfig(model="hf:gpt2", precision="bf16"), root=tmp_path)
    assert again != out and again.name.startswith(out.name)
    # a user factory is named after its file, then the factory (issue 16)
    assert default_out_dir(TrainConfig(model="x/y/m.py:make"), root=tmp_path).name.startswith("m-make-fp32-")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16", "bf16-pure", "fp16-pure", "fp8"])
def test_every_mode_on_gpt2_small_cuda(tmp_path: Path, precision: str) -> None:
    hw = hardware.detect("cuda")
    if precision == "tf32" and not hw.tf32_supported:
        pytest.skip("TF32 needs compute capability 8.0+")
    if precision == "fp8" and not (hw.fp8_supported and hw.fp8_library):
        pytest.skip("fp8 needs compute capability 8.9+ and torchao or Transformer Engine")
    result = train(
        TrainConfig(
            model="gpt2-small",
            precision=precision,
            steps=3,
            batch_size=2,
            seq_len=128,
            device="cuda",
            out=tmp_path / "run",
            progress=False,
        )
    )
    assert isinstance(result.steps, pd.DataFrame) and len(result.steps) == 3
    assert result.steps[T.LOSS].map(math.isfinite).all()
    if precision == "fp8":
        assert result.summary[T.SUMMARY_CONFIG]["fp8_layers"] > 0
