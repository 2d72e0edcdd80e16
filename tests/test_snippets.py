"""The configuration to paste (issue 16): the recommendation as code, executed here on a tiny CPU model."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest
import torch
from markupsafe import escape
from report_fixtures import gpt_layers, recommendation_dict, synthetic_run
from scenarios import fp32_ops
from torch import nn

from precprof import tables as T
from precprof.analysis import snippets as S
from precprof.analysis.advisor import AdvisorConfig, recommend
from precprof.analysis.advisor.model import Recommendation
from precprof.report import render_html

HOSTILE = 'a"; import os; os.system("x") #'

CUDA_LINE = 'device_type = "cuda"'
CPU_LINE = 'device_type = "cpu"'


def rec(fmt: str, **kw: Any) -> Recommendation:
    base: dict[str, Any] = {
        "format": fmt,
        "loss_scale": None,
        "fp16_loss_scale": 2.0**15,
        "growth_interval": None,
        "target": "h100",
    }
    base.update(kw)
    return Recommendation(**base)


BF16 = rec("bf16", keep_fp32=["head"])
FP16 = rec("fp16", loss_scale=2.0**12, fp16_loss_scale=2.0**12, growth_interval=500, keep_fp32=["head"])
FP32 = rec("fp32", measured_format="bf16")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return self.head(torch.relu(self.body(x)))


def execute(code: str, on_cpu_as_written: bool = False) -> dict[str, Any]:
    """Run a pytorch snippet on CPU with the names it assumes (a plan for CUDA with its device line changed, a
    plan for a CPU as written); returns its namespace."""
    assert code.count(CPU_LINE if on_cpu_as_written else CUDA_LINE) == 1
    torch.manual_seed(0)
    model = Tiny()
    out_dtypes: dict[str, torch.dtype] = {}
    for name in ("body", "head"):
        model.get_submodule(name).register_forward_hook(
            lambda mod, args, out, name=name: out_dtypes.__setitem__(name, out.dtype)
        )
    ns: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
        "loader": [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(2)],
        "loss_fn": lambda out, target: nn.functional.mse_loss(out.float(), target),
        "out_dtypes": out_dtypes,
    }
    exec(compile(code.replace(CUDA_LINE, 'device_type = "cpu"'), "<snippet>", "exec"), ns)
    return ns


@pytest.mark.parametrize("r", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
def test_every_framework_snippet_compiles(r: Recommendation) -> None:
    for fw in S.frameworks(r.format):
        compile(r.snippet(fw), f"<{fw}>", "exec")
    assert "torchao" not in S.frameworks(r.format)


def test_fp8_snippets_compile_and_filter_the_eligible_layers() -> None:
    r = rec("fp8", fp8_layers=["blocks.0.mlp.fc", "blocks.1.mlp.fc"], keep_fp32=["lm_head"])
    assert "torchao" in S.frameworks("fp8")
    for fw in S.frameworks("fp8"):
        code = r.snippet(fw)
        compile(code, f"<{fw}>", "exec")
        assert "convert_to_float8_training" in code, fw
        assert "{'blocks.0.mlp.fc', 'blocks.1.mlp.fc'}" in code, fw
    assert "torch.bfloat16" in r.snippet("pytorch")
    assert 'precision="bf16-mixed"' in r.snippet("lightning")
    assert "transformer-engine" in r.snippet("lightning")


class Wide(nn.Module):
    """Tiny, with dims torchao's FP8 GEMMs take (multiples of 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


FP8 = rec("fp8", fp8_layers=["body"], keep_fp32=["head"])


@pytest.mark.slow
def test_fp8_snippet_runs_compiled_with_the_eligible_layers_converted() -> None:
    """The FP8 verdict's speed is compiled FP8 against compiled bf16; eager FP8 is slower than bf16 (the README
    measures 112.7 ms a step against 41.6 ms), and the PyTorch snippet converted the layers without compiling.
    It compiles; run here as written (torchao's FP8 runs on the CPU), its device line changed."""
    float8 = pytest.importorskip("torchao.float8.float8_linear")
    torch.manual_seed(0)
    model = Wide()
    before = model.body.weight.detach().clone()
    ns: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "loader": [(torch.randn(16, 32), torch.randn(16, 16)) for _ in range(2)],
        "loss_fn": lambda out, target: nn.functional.mse_loss(out.float(), target),
    }
    exec(compile(FP8.snippet("pytorch").replace(CUDA_LINE, CPU_LINE), "<snippet>", "exec"), ns)
    assert (
        isinstance(ns["model"], torch._dynamo.eval_frame.OptimizedModule) and ns["model"]._orig_mod is model
    )
    assert isinstance(model.body, float8.Float8Linear) and not isinstance(model.head, float8.Float8Linear)
    assert torch.isfinite(ns["loss"]) and not torch.equal(model.body.weight, before)  # it trained


def test_fp8_trainer_snippets_compile_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face snippet asks the Trainer to compile (a real TrainingArguments takes the flag), the
    Lightning one fits the compiled module, the FSDP one compiles it after sharding."""
    pytest.importorskip("torchao.float8")
    transformers = pytest.importorskip("transformers")
    lightning = pytest.importorskip("lightning")
    seen: dict[str, Any] = {}
    stub = types.ModuleType("transformers")  # records the arguments; the Trainer would need a dataset
    stub.TrainingArguments = lambda **kw: seen.setdefault("args", kw)  # type: ignore[attr-defined]
    stub.Trainer = lambda **kw: types.SimpleNamespace(train=lambda: None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", stub)
    exec(compile(FP8.snippet("hf"), "<hf>", "exec"), {"model": Wide(), "train_dataset": []})
    assert seen["args"]["torch_compile"] is True and seen["args"]["bf16"] is True
    monkeypatch.undo()
    args = transformers.TrainingArguments(**{**seen["args"], "output_dir": "unused"}, use_cpu=True)
    assert args.torch_compile and args.bf16
    fitted: list[Any] = []
    monkeypatch.setattr(lightning.Trainer, "fit", lambda self, model, loader: fitted.append(model))
    model = Wide()
    exec(
        compile(FP8.snippet("lightning").replace(CUDA_LINE, CPU_LINE), "<lightning>", "exec"),
        {"model": model, "loader": []},
    )
    assert isinstance(fitted[0], torch._dynamo.eval_frame.OptimizedModule) and fitted[0]._orig_mod is model
    assert FP8.snippet("fsdp").rstrip().splitlines()[-1].startswith("model = torch.compile(model)")


def test_bf16_snippet_runs_autocast_bf16_with_the_kept_module_in_fp32() -> None:
    ns = execute(BF16.snippet("pytorch"))
    model = ns["model"]
    assert model.seen and all(seen == (True, torch.bfloat16) for seen in model.seen)
    assert ns["out_dtypes"] == {"body": torch.bfloat16, "head": torch.float32}
    assert "scaler" not in ns


def test_fp16_snippet_runs_autocast_fp16_with_the_recommended_scaler() -> None:
    code = FP16.snippet("pytorch")
    assert "init_scale=2.0**12, growth_interval=500" in code
    ns = execute(code)
    model, scaler = ns["model"], ns["scaler"]
    assert model.seen and all(seen == (True, torch.float16) for seen in model.seen)
    assert ns["out_dtypes"] == {"body": torch.float16, "head": torch.float32}
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.get_scale() == FP16.loss_scale  # two finite steps: no backoff, no growth before 500
    assert scaler.get_growth_interval() == 500


def test_fp32_snippet_runs_without_autocast_and_names_the_measured_format() -> None:
    code = FP32.snippet("pytorch")
    assert "the measurements allow BF16" in code
    ns = execute(code)
    assert all(not enabled for enabled, _ in ns["model"].seen)
    assert ns["out_dtypes"] == {"body": torch.float32, "head": torch.float32}
    assert "scaler" not in ns
    # the measured format's code is there too, and runs
    labels = [label for label, _ in S.snippets(FP32.to_dict())]
    assert "PyTorch: BF16, as measured" in labels
    ns = execute(FP32.snippet("pytorch", "bf16"))
    assert all(seen == (True, torch.bfloat16) for seen in ns["model"].seen)


def test_the_measured_formats_snippet_beside_the_small_models_fp32_keeps_what_that_format_needs() -> None:
    """A small model trained with its norms and softmax in bf16 (model.to(bfloat16)): the bf16 analysis keeps
    them in fp32, and a large model's bf16 snippet lists them. Under the small model's fp32 default, the "BF16, as
    measured" snippet listed none (it took the fp32 verdict's empty keep list): it lists the same modules now,
    those whose outputs the run recorded in bf16 of the kinds the guide keeps in fp32 (torch's LayerNorm, which
    computes in fp32 inside, left out)."""
    run = fp32_ops.run(pure=True)
    layers = run.tables["layers"]
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & (layers[T.DTYPE] == "bfloat16")]
    assert {"bn", "ln", "attn"} <= set(acts[T.MODULE])
    in_bf16 = ["bn", "attn"]
    large = run.recommend("a100")
    assert large.format == "bf16" and large.keep_fp32 == in_bf16
    small = run.recommend("a100", AdvisorConfig())
    assert small.format == "fp32" and small.measured_format == "bf16" and small.keep_fp32 == []
    assert small.measured_keep_fp32 == in_bf16
    code = dict(S.snippets(small.to_dict()))["PyTorch: BF16, as measured"]
    assert f"keep_fp32 = {in_bf16!r}" in code and code == small.snippet("pytorch", "bf16")
    assert "keep_fp32" not in small.snippet("pytorch")  # the fp32 code runs nothing under autocast


def test_a_plan_for_a_cpu_runs_there_as_written() -> None:
    """The advisor's plan for a CPU says so (``device``), and its code uses device_type "cpu" everywhere: the
    PyTorch snippet runs here unchanged; a plan for a GPU, or one stored before ``device`` existed, is CUDA's."""
    tables, summary = synthetic_run("fp16", steps=4)
    assert recommend(tables, hardware="cpu", summary=summary).device == "cpu"
    assert recommend(tables, hardware="h100", summary=summary).device == "cuda"
    cpu = rec("fp16", loss_scale=2.0**12, growth_interval=500, keep_fp32=["head"], device="cpu")
    for fw in S.frameworks("fp16"):
        code = cpu.snippet(fw)
        assert '"cuda"' not in code and '"cpu"' in code, fw
    ns = execute(cpu.snippet("pytorch"), on_cpu_as_written=True)
    assert ns["model"].seen and all(seen == (True, torch.float16) for seen in ns["model"].seen)
    assert ns["scaler"].get_scale() == 2.0**12
    old = FP16.to_dict()
    del old["device"]
    assert S.snippet(old).count(CUDA_LINE) == 1


def test_loss_scale_is_written_exactly() -> None:
    assert S.scale_literal(2.0**15) == "2.0**15"
    assert S.scale_literal(2.0**-3) == "2.0**-3"
    assert S.scale_literal(3000.0) == "3000.0"
    assert eval(S.scale_literal(2.0**-30)) == 2.0**-30


def test_hf_lightning_fsdp_settings() -> None:
    assert "fp16=True" in FP16.snippet("hf") and "init_scale=2.0**12" in FP16.snippet("hf")
    assert "bf16=True" in BF16.snippet("hf")
    assert "tf32=True" in rec("tf32").snippet("hf")
    assert 'MixedPrecision("16-mixed"' in FP16.snippet("lightning")
    assert 'precision="32-true"' in FP32.snippet("lightning")
    fsdp = BF16.snippet("fsdp")
    assert (
        "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)"
        in fsdp
    )
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in fsdp
    assert "ShardedGradScaler(" in FP16.snippet("fsdp")
    with pytest.raises(ValueError):
        BF16.snippet("torchao")
    with pytest.raises(ValueError):
        BF16.snippet("keras")


def test_hostile_module_name_is_only_a_string_literal() -> None:
    r = rec("fp16", loss_scale=2.0**12, growth_interval=500, keep_fp32=[HOSTILE], fp8_layers=[HOSTILE])
    for fmt in S.SNIPPET_FORMATS:
        for fw in S.frameworks(fmt):
            code = r.snippet(fw, fmt)
            compile(code, f"<{fw}>", "exec")
            assert HOSTILE not in code.replace(repr(HOSTILE), "")
    # executing it looks the name up as a module (and fails there); os.system never runs
    code = r.snippet("pytorch")
    calls: list[str] = []
    ns: dict[str, Any] = {"model": Tiny(), "optimizer": None, "loader": [], "loss_fn": None}
    real = os.system
    os.system = lambda cmd: calls.append(cmd) or 0  # type: ignore[assignment]
    try:
        with pytest.raises(AttributeError):
            exec(compile(code.replace(CUDA_LINE, 'device_type = "cpu"'), "<snippet>", "exec"), ns)
    finally:
        os.system = real
    assert calls == []


def test_report_shows_the_escaped_snippets() -> None:
    tabs, summary = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=6, sample_every=2, seed=1)
    rd = recommendation_dict()
    rd["keep_fp32"] = [*rd["keep_fp32"], "<b>x</b>"]
    page = render_html(tabs, summary, rd)
    code = Recommendation.from_dict(rd).snippet("pytorch")
    assert str(escape(code)) in page
    assert str(escape(repr("<b>x</b>"))) in page and "<b>x</b>" not in page
    for label in ("PyTorch", "Hugging Face Trainer", "Lightning", "FSDP"):
        assert f"<summary>{label}</summary>" in page
    assert "torchao (FP8)" not in page  # fp16 verdict
