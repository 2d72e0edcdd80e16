"""A run that already trains with torchao's MX layers (h72): torchao 0.18's ``MXFP8Linear``, emulated on the CPU
(``KernelPreference.EMULATED``: the casts to MXFP8 are real, the matmuls run in high precision), and an nn.Linear
whose weight ``quantize_(model, MXFP8TrainingOpConfig)`` made torchao's MX training weight (the module kept, its
weight a tensor subclass; h104). Such a run read as fp32: "it already uses FP32", a snippet saying the loop stays as
it is, a block plan proposing NVFP4 for layers that already ran MXFP8, without a word, and the FP8 eligibility
listing them as candidates as if they were plain; torchao's Float8Linear alone was recognised.

One real run, shared by the tests: two MXFP8Linear layers with different recipes, an nn.Linear trained in MXFP8
through ``quantize_`` and a plain nn.Linear head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis import snippets
from precprof.analysis.advisor import recommend
from precprof.analysis.advisor.rules import blocks as rb
from precprof.capture import model_facts
from precprof.report import context as report_context
from precprof.report import summarize as S

mxfp8_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")
kernels = pytest.importorskip("torchao.quantization.quantize_.common.kernel_preference")
moe_config = pytest.importorskip("torchao.prototype.moe_training.config")
nvfp4_training = pytest.importorskip("torchao.prototype.moe_training.nvfp4_training.nvfp4_training")
quantization = pytest.importorskip("torchao.quantization")


def _mx(n_in: int, n_out: int, **recipe: Any) -> nn.Module:
    return mxfp8_linear.MXFP8Linear(
        n_in, n_out, kernel_preference=kernels.KernelPreference.EMULATED, **recipe
    )


def _quantized(model: nn.Module, *names: str) -> nn.Module:
    """``model`` with the weights of the layers ``names`` made torchao's MX training weights by ``quantize_``
    (torchao's emulated rceil recipe): the modules stay nn.Linear."""
    recipe = moe_config.MXFP8TrainingOpConfig.from_recipe(moe_config.MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantization.quantize_(model, recipe, filter_fn=lambda m, fqn: fqn in names)
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three SGD steps of a 3-layer MLP whose first two layers are MXFP8Linear: the first with torchao's default
    recipe (rceil scales), the second with OCP's floor scales and its weight gradient in high precision (both with
    biases, which MXFP8Linear adds), the third an nn.Linear with a bias of 5.0 made MX by ``quantize_`` (torchao
    0.18's MX training weight drops the bias); every layer's block formats evaluated on every step. 32 tokens a
    step: MX blocks run along the tokens too."""
    torch.manual_seed(0)
    floor = mx_config.ScaleCalculationMode.FLOOR
    model = nn.Sequential(
        _mx(32, 64), nn.GELU(), _mx(64, 32, scale_calculation_mode=floor, wgrad_with_hp=True), nn.GELU()
    )
    model.extend([nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)])
    with torch.no_grad():
        model[4].bias.fill_(5.0)
    _quantized(model, "4")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp_path_factory.mktemp("mx") / "run"
    prof = precprof.Profiler(model, opt, sample_every=1, memory=False, block_formats=True, block_groups=1)
    with prof:
        for _ in range(3):
            loss = model(torch.randn(32, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.save(out)
    return out


def test_a_run_with_mx_layers_reads_as_mx_and_records_their_recipes(run: Path) -> None:
    """The run's precision is its MX format, and each recipe its layers ran is recorded as their constructor
    set it (the FP8 recipe of Float8Linear layers is recorded the same way); the precision check says the MX
    layers ran, emulated, rather than that mixed precision was asked for and is not active."""
    summary = T.read_summary(run)
    capture = summary[T.SUMMARY_CAPTURE]
    assert capture["precision_seen"] == "mxfp8"
    common = {"format": "mxfp8", "module_type": "MXFP8Linear", "element": "float8_e4m3fn", "block_size": 32}
    weight = {"module_type": "Linear", "weight_type": "MXFP8TrainingWeightWrapperTensor"}
    assert capture["block_recipe"] == [
        {**common, "scale_rounding": "rceil", "wgrad_with_hp": False, "emulated": True, "layers": ["0"]},
        {**common, "scale_rounding": "floor", "wgrad_with_hp": True, "emulated": True, "layers": ["2"]},
        {
            **common,
            **weight,
            "scale_rounding": "rceil",
            "wgrad_with_hp": False,
            "emulated": True,
            "layers": ["4"],
        },
    ]
    tables = T.read_tables(run)
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    assert check["ok"] and check["requested"] == "mxfp8"
    assert "NOT active" not in check["verdict"] and "Float8Linear" not in check["verdict"]
    assert (
        "MX was emulated: 3 of 4 linear layers are nn.Linear with torchao's MXFP8TrainingWeightWrapperTensor "
        "weight (quantize_), torchao MXFP8Linear, 3 of them emulated" in check["verdict"]
    )
    assert (
        "blocks of 32, scales rounded down: floor (OCP), the weight gradient's GEMM in high"
        in check["verdict"]
    )


_DROPS = "torchao.prototype.moe_training.tensor.MXFP8TrainingWeightWrapperTensor.__torch_function__"


def test_the_bias_the_mx_training_weight_leaves_out_is_said(run: Path) -> None:
    """Layer 4's bias of 5.0 never reached its output (torchao 0.18's MX training weight computes F.linear as the
    matmul alone) and never trained, and nothing said it; the MXFP8Linear layers 0 and 2 add theirs and are not
    named. The finding names the layer, the function at fault, the bias's size and largest value, and the fix."""
    capture = T.read_summary(run)[T.SUMMARY_CAPTURE]
    assert capture["bias_dropped"] == [
        {
            "layer": "4",
            "weight_type": "MXFP8TrainingWeightWrapperTensor",
            "config": "MXFP8TrainingOpConfig",
            "function": _DROPS,
            "values": 32,
            "absmax": 5.0,
            "own_forward": False,
        }
    ]
    rec, _, _ = _recommended(run)
    (found,) = [f for f in rec.findings if f.code == "bias_dropped"]
    assert found.severity == "warning" and found.modules == ["4"]
    assert found.numbers == {"bias_dropped_layers": 1, "bias_dropped_values": 32, "bias_dropped_absmax": 5.0}
    assert (
        'quantize_ with MXFP8TrainingOpConfig made the weights of 1 nn.Linear layer(s) ("4") torchao\'s '
        f"MXFP8TrainingWeightWrapperTensor, whose {_DROPS} computes F.linear(input, weight, bias) as the matmul "
        "of input and weight alone: their biases (32 values, the largest |bias| 5) are never added"
        in found.message
    )
    assert "torchao's MXFP8Linear (torchao.prototype.moe_training.mxfp8_linear)" in found.remedy


def test_which_torchao_training_weights_drop_the_bias() -> None:
    """Every recipe of ``MXFP8TrainingOpConfig`` gives an nn.Linear a weight whose F.linear leaves the bias out
    (torchao 0.18); ``Float8TrainingOpConfig``'s adds it, as MXFP8Linear does: the capture says so of the former
    alone, and, where the layer runs on the CPU (the MX recipes but the emulated one need Triton), only where its
    output indeed lacks the bias (a zero weight and a bias of 5: outputs of 0, not 5). A layer without a bias, or
    whose module adds it itself, is none."""
    configs = [moe_config.MXFP8TrainingOpConfig.from_recipe(r) for r in moe_config.MXFP8TrainingRecipe]
    configs.append(moe_config.Float8TrainingOpConfig())
    said = []
    for config in configs:
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32, bias=False), _mx(32, 32))
        with torch.no_grad():
            model[0].weight.zero_()
            model[0].bias.fill_(5.0)
        quantization.quantize_(model, config, filter_fn=lambda m, fqn: fqn in ("0", "1"))
        dropped = [d["layer"] for d in model_facts.dropped_biases(model)]
        if (
            getattr(config, "kernel_preference", kernels.KernelPreference.EMULATED)
            == kernels.KernelPreference.EMULATED
        ):
            with torch.no_grad():
                lacks = bool(model[0](torch.randn(32, 32)).abs().max() < 1)
            assert dropped == (["0"] if lacks else [])
        said.append(dropped == ["0"])
    assert said == [True] * (len(configs) - 1) + [False]
    # a subclass of nn.Linear whose own forward passes the bias to F.linear loses it too (it was left out: reviewer
    # h83); its forward is not run, so it is named as one whose forward decides
    own = nn.Sequential(_OwnForward(32, 32))
    with torch.no_grad():
        own[0].weight.zero_()
        own[0].bias.fill_(5.0)
    quantization.quantize_(own, configs[-2])  # the emulated MX recipe: runs on the CPU
    with torch.no_grad():
        assert float(own[0](torch.randn(4, 32)).abs().max()) < 1  # the bias is lost
    (row,) = model_facts.dropped_biases(own)
    assert row["layer"] == "0" and row["own_forward"] is True


class _OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


_RECOMMENDED: dict[Path, Any] = {}


def _recommended(run: Path) -> tuple[Any, dict, dict]:
    """The recommendation for a B200 (which runs block formats; made once a run), the tables and the summary of
    ``run``."""
    summary = T.read_summary(run)
    tables = T.read_tables(run)
    if run not in _RECOMMENDED:
        _RECOMMENDED[run] = recommend(tables, hardware="b200", summary=summary)
    return _RECOMMENDED[run], tables, summary


def test_the_block_plan_says_which_layers_already_run_an_mx_format(run: Path) -> None:
    """Layers 0, 2 and 4 ran MXFP8 (the run's own MXFP8Linear, and an nn.Linear made MX by quantize_); the plan
    gives each a format: the finding, its title, the verdict's reason and box, and the table's plan column say
    what they run now, and what the plan does to it. The plan had proposed formats for them as if the run were
    fp32, without a word."""
    rec, tables, summary = _recommended(run)
    mx = ("0", "2", "4")
    assert rec.block_what_if["running"] == dict.fromkeys(mx, "mxfp8")
    choice = {lb["module"]: lb["choice"] for lb in rec.block_what_if["layers"]}
    labels = rb.PLAN_LABELS
    (found,) = [f for f in rec.findings if f.code == "block_format_plan"]
    assert found.title.endswith("; 3 run MXFP8 now")
    assert (
        "This run already runs MXFP8 on 3 of these layers (torchao's MX layers); the plan " in found.message
    )
    for to in {choice[m] for m in mx}:
        them = [m for m in mx if choice[m] == to]
        said = (
            f"keeps {len(them)} in MXFP8"
            if to == "mxfp8"
            else f"moves {len(them)} from MXFP8 to {labels[to]}"
        )
        named = ", ".join(f'"{m}"' for m in them)
        assert f"{said} ({named})" in found.message
    moved = sum(choice[m] != "mxfp8" for m in mx)
    assert found.numbers["running_block_format"] == 3 and found.numbers["moved_block_format"] == moved
    assert any("This run already runs MXFP8 on 3 of these layers" in r for r in rec.reasons)
    ctx = report_context.build_context(tables, summary, rec)
    now = {m: g["now"] for g in ctx["verdict"]["block_plan"] for m in g["modules"]}
    assert all("MXFP8 now" in now[m] for m in mx)
    rows = {r["module"]: r["running"] for r in ctx["whatif"]["blocks"]["rows"]}
    assert rows == {"0": "MXFP8", "2": "MXFP8", "4": "MXFP8", "6": ""}


def test_the_fp32_snippet_of_an_mx_run_does_not_say_the_loop_stays_as_it_is(run: Path) -> None:
    """The run converted three layers to MX: FP32's code may not tell it to leave its loop as it is."""
    rec, _, _ = _recommended(run)
    code = snippets.snippet(rec.to_dict(), "pytorch", "fp32")
    assert "the loop stays as it is" not in code
    assert (
        "# FP32 for all but the 3 block-format layer(s) the run converted (torchao's MX or NVFP4 layers):"
        in code
    )


def test_the_bf16_and_fp16_snippets_of_an_mx_run_say_its_mx_layers_stay_mx(run: Path) -> None:
    """BF16's and FP16's code (and TF32's and FP8's) for a run whose layers 0, 2 and 4 train in MXFP8 said nothing
    of them: autocast leaves them MX (an MX layer quantises its operands with autocast or without), so the code
    says it keeps them so, names them, and what to remove to train them as the rest, by how each was made."""
    rec, _, _ = _recommended(run)
    rec = rec.to_dict()
    assert rec["wrapped_weight_layers"] == ["4"]
    for fmt in ("bf16", "fp16", "tf32", "fp8"):
        for framework in snippets.frameworks(fmt):
            code = snippets.snippet(rec, framework, fmt)
            compile(code, framework, "exec")
            said = " ".join(line[2:] for line in code.splitlines() if line.startswith("# "))
            assert (
                "Block formats kept: this run trains the 3 layer(s) below in MXFP8 with torchao's MX or NVFP4 "
                "layers, and this code keeps them so (autocast does not undo that conversion" in said
            ), (fmt, framework)
            assert (
                "remove the conversion that made them (MXFP8Linear for 2, quantize_ with MXFP8TrainingOpConfig for 1)"
                in said
            )
            assert "block_format_in_this_run = ['0', '2', '4']" in code
    assert "Block formats kept" not in snippets.snippet(rec, "pytorch", "fp32")


def test_a_linear_whose_weight_quantize_made_mx_is_an_mx_layer() -> None:
    """An nn.Linear whose weight ``quantize_`` made torchao's MX training weight (the module type stays Linear)
    runs MXFP8: a model of such layers alone reads as an MX run with their recipe, not as fp32 (h104)."""
    model = _quantized(nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32)), "0")
    assert model_facts.low_precision_linear(model) == "mxfp8"
    (recipe,) = model_facts.block_recipes(model)
    assert recipe["layers"] == ["0"] and recipe["weight_type"] == "MXFP8TrainingWeightWrapperTensor"
    assert (recipe["module_type"], recipe["element"], recipe["block_size"]) == ("Linear", "float8_e4m3fn", 32)
    assert recipe["scale_rounding"] == "rceil" and recipe["emulated"] and not recipe["wgrad_with_hp"]
    assert model_facts.low_precision_linear(nn.Sequential(nn.Linear(32, 32))) is None


def test_layers_already_in_mx_are_no_fp8_candidates(run: Path) -> None:
    """The FP8 eligibility finding judged the MX layers (0, 2 and the quantize_ layer 4) as plain linear layers,
    candidates for per-tensor FP8: they are left out, named as training in MXFP8 already, and neither the FLOPs
    share nor the speed estimate counts them; the plain head alone is judged (h104)."""
    rec, tables, summary = _recommended(run)
    (found,) = [f for f in rec.findings if f.code == "fp8_eligibility"]
    assert found.title == "1 of 1 linear layers are FP8-eligible; 3 more train in MXFP8"
    assert found.modules == ["6"] and found.numbers["checked"] == 1 and found.numbers["block_running"] == 3
    assert found.numbers["eligible_flops_share"] == 1.0
    assert (
        '; 3 more linear layers ("0", "2", "4") already train in MXFP8 (torchao\'s MX training), not judged'
        in (found.message)
    )
    # a run whose every linear layer trains in MX: none is left for FP8, and the verdict says why, not that no
    # linear layer was recorded
    capture = summary[T.SUMMARY_CAPTURE]
    every = [{**capture["block_recipe"][0], "layers": ["0", "2", "4", "6"]}]
    all_mx = {**summary, T.SUMMARY_CAPTURE: {**capture, "block_recipe": every}}
    rec = recommend(tables, hardware="h100", summary=all_mx)
    (found,) = [f for f in rec.findings if f.code == "fp8_eligibility"]
    assert found.title == "No linear layer left for FP8: all 4 train in MXFP8"
    assert found.modules == [] and found.numbers == {"eligible": 0, "checked": 0, "block_running": 4}
    said = " ".join([*rec.reasons, *(f.remedy for f in rec.findings if f.code.startswith("fp8"))])
    assert "every one of its 4 linear layers already trains in a block-scaled format" in said
    assert "no linear layer was recorded" not in said


def test_torchao_nvfp4_linear_layers_read_as_nvfp4() -> None:
    """torchao's NVFP4Linear (quantize_ with NVFP4TrainingConfig swaps nn.Linear for it) is a block-format layer:
    its recipe is NVFP4's (E2M1 elements, blocks of 16), not plain (h104). Its kernels are Triton's alone (it
    refuses a CPU tensor), so the run's side is checked on the MX run's tables with NVFP4's recipe in its stead:
    the precision check, the block plan and the FP8 eligibility say NVFP4 and its blocks of 16."""
    model = nn.Sequential(nvfp4_training.NVFP4Linear(32, 32), nn.Linear(32, 16))
    assert model_facts.low_precision_linear(model) == "nvfp4"
    (recipe,) = model_facts.block_recipes(model)
    assert recipe == {
        "format": "nvfp4",
        "module_type": "NVFP4Linear",
        "element": "float4_e2m1fn_x2",
        "block_size": 16,
        "scale_rounding": None,
        "wgrad_with_hp": False,
        "emulated": False,
        "layers": ["0"],
    }


def test_a_run_of_nvfp4_layers_says_nvfp4(run: Path) -> None:
    """The MX run's tables with NVFP4Linear's recipe for layers 0, 2 and 4 (an NVFP4 run cannot be recorded on the
    CPU): the precision check, the block plan and the FP8 eligibility say NVFP4, not MX, and its blocks of 16."""
    summary = T.read_summary(run)
    tables = T.read_tables(run)
    recipe = model_facts.block_recipes(nn.Sequential(nvfp4_training.NVFP4Linear(32, 32)))[0]
    capture = {
        **summary[T.SUMMARY_CAPTURE],
        "precision_seen": "nvfp4",
        "block_recipe": [{**recipe, "layers": ["0", "2", "4"]}],
    }
    summary = {**summary, T.SUMMARY_CAPTURE: capture}
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    assert check["ok"] and "NVFP4 GEMMs ran: 3 of 4 linear layers are torchao NVFP4Linear" in check["verdict"]
    assert (
        "torchao recipe: NVFP4 (float4_e2m1fn_x2 elements, blocks of 16), for 3 layer(s)" in check["verdict"]
    )
    rec = recommend(tables, hardware="b200", summary=summary)
    (plan,) = [f for f in rec.findings if f.code == "block_format_plan"]
    assert "This run already runs NVFP4 on 3 of these layers (torchao's NVFP4 layers)" in plan.message
    (fp8,) = [f for f in rec.findings if f.code == "fp8_eligibility"]
    assert fp8.title.endswith("; 3 more train in NVFP4")
    assert "already train in NVFP4 (torchao's NVFP4 training)" in fp8.message
    assert "the scale per block of 16 values they run with" in fp8.message
