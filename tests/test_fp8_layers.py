"""A loop of its own that already trains with torchao's float8 training (torchao 0.18 on the CPU): Float8Linear
layers (``convert_to_float8_training``) and an nn.Linear whose weight ``quantize_(model, Float8TrainingOpConfig())``
made an FP8 training weight. The block plan read as if they ran bf16 ("3 NVFP4, 1 BF16" without a word of FP8),
the FP32 snippet said the loop stays as it is (their conversion still made them FP8), and the precision check said
"Asked for fp8." of a run that asked nothing.

One real run, shared by the tests: layers 0 and 4 (the output head) Float8Linear, layer 2 made FP8 by quantize_,
two steps under bf16 autocast, every layer's block formats evaluated on every step.
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
from precprof.report import context as report_context
from precprof.report import render
from precprof.report import summarize as S

float8 = pytest.importorskip("torchao.float8")
training_config = pytest.importorskip("torchao.prototype.moe_training.config")
quantization = pytest.importorskip("torchao.quantization")

FP8 = ("0", "2", "4")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in ("0", "4"))
    quantization.quantize_(
        model, training_config.Float8TrainingOpConfig(), filter_fn=lambda m, fqn: fqn == "2"
    )
    assert [type(m).__name__ for m in model[::2]] == ["Float8Linear", "Linear", "Float8Linear"]
    assert type(model[2].weight).__name__ == "Float8TrainingWeightWrapperTensor"
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp_path_factory.mktemp("fp8") / "run"
    prof = precprof.Profiler(model, opt, sample_every=1, memory=False, block_formats=True, block_groups=1)
    with prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(torch.randn(32, 32))
            loss = y.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.save(out)
    return out


_RECOMMENDED: dict[tuple[Path, str], Any] = {}


def _recommended(run: Path, hardware: str = "b200") -> tuple[Any, dict, dict]:
    """The recommendation for ``hardware`` (made once a run and target), the tables and the summary of ``run``."""
    summary = T.read_summary(run)
    tables = T.read_tables(run)
    if (run, hardware) not in _RECOMMENDED:
        _RECOMMENDED[run, hardware] = recommend(tables, hardware=hardware, summary=summary)
    return _RECOMMENDED[run, hardware], tables, summary


def test_the_block_plan_says_which_layers_already_run_fp8(run: Path) -> None:
    """The plan gives the FP8 layers block formats: the finding, its title, the verdict's reason and box, and the
    table's plan column say they run FP8 now, that a block format is a what-if against that FP8, not bf16, and
    what the plan does to them; the head, which no block format suits, is said to get none, not to move to bf16
    as if FP8 had been judged. On a Hopper the what-if's finding says the same."""
    rec, tables, summary = _recommended(run)
    assert rec.running_formats == dict.fromkeys(FP8, "fp8")
    assert rec.block_what_if["running"] == dict.fromkeys(FP8, "fp8")
    choice = {lb["module"]: lb["choice"] for lb in rec.block_what_if["layers"]}
    assert choice["4"] == "bf16"  # the output head: no FP4, and out_features 16 is no multiple of MX's 32
    (found,) = [f for f in rec.findings if f.code == "block_format_plan"]
    assert found.title.endswith("; 3 run FP8 now")
    said = (
        "This run already runs FP8 on 3 of these layers (torchao's float8 training: Float8Linear layers and "
        "nn.Linear layers whose weights quantize_ made FP8 training weights): for them a block format is a "
        "what-if against the FP8 they run, not against bf16"
    )
    assert said in found.message and "(torchao's MX" not in found.message
    for to in {choice[m] for m in FP8} - {"bf16"}:
        them = [m for m in FP8 if choice[m] == to]
        named = ", ".join(f'"{m}"' for m in them)
        assert f"moves {len(them)} from FP8 to {rb.PLAN_LABELS[to]} ({named})" in found.message
    assert (
        'gives 1 no block format ("4": the plan\'s BF16 is where no block format passes its rule'
        in found.message
    )
    assert "moves 1 from FP8 to BF16" not in found.message
    assert found.numbers["running_fp8"] == 3 and found.numbers["running_block_format"] == 0
    assert found.numbers["moved_block_format"] == 0
    assert any(said in r for r in rec.reasons)
    ctx = report_context.build_context(tables, summary, rec)
    now = {m: g["now"] for g in ctx["verdict"]["block_plan"] for m in g["modules"]}
    assert all("FP8 now" in now[m] for m in FP8)
    rows = {r["module"]: r["running"] for r in ctx["whatif"]["blocks"]["rows"]}
    assert rows == dict.fromkeys(FP8, "FP8")
    rec, _, _ = _recommended(run, "h100")
    (found,) = [f for f in rec.findings if f.code == "block_format_what_if"]
    assert found.title.endswith("; 3 run FP8 now") and said in found.message


def test_snippets_of_another_format_take_the_fp8_layers_out_of_their_conversion(run: Path) -> None:
    """FP32's and BF16's code for a run whose layers torchao converted to FP8: autocast does not undo that
    conversion, so the code says to remove it and names the layers, in every framework; FP8's code does not.
    FP32's had said the loop stays as it is, or, with the block what-if, counted them as MX layers. A summary
    written before running_formats reads its block what-if's MX layers as before."""
    rec = _recommended(run, "h100")[0].to_dict()
    for fmt in ("fp32", "bf16"):
        for framework in snippets.frameworks(fmt):
            code = snippets.snippet(rec, framework, fmt)
            compile(code, framework, "exec")
            assert "# No FP8: this run trained the 3 layer(s) below with torchao's float8 training" in code
            assert "fp8_in_this_run = ['0', '2', '4']" in code
            assert "the loop stays as it is" not in code and "block-format layer(s)" not in code
    assert "No FP8" not in snippets.snippet(rec, "pytorch", "fp8")
    older = {k: v for k, v in rec.items() if k != "running_formats"}
    older["block_what_if"] = {"running": {"0": "mxfp8"}}
    code = snippets.snippet(older, "pytorch", "fp32")
    assert "FP32 for all but the 1 block-format layer(s)" in code and "No FP8" not in code


def _comments(code: str) -> str:
    """The snippet's comments as one text (a comment wraps at 110 characters)."""
    return " ".join(line.strip()[2:] for line in code.splitlines() if line.strip().startswith("# "))


def test_the_fp8_snippet_of_a_run_already_in_fp8_through_quantize_does_not_convert_it_again(
    run: Path,
) -> None:
    """FP8's code for a run whose layer 2 quantize_ made FP8 (Float8TrainingOpConfig): it had called
    convert_to_float8_training over that model, which swaps such an nn.Linear for a Float8Linear around its FP8
    training weight. It says the run trains in FP8 already, and how, in every framework; where the plan lists
    eligible layers not in FP8 yet, it converts them with quantize_ (run here on such a model: layer 4 gets an FP8
    training weight, layer 2 stays an nn.Linear) and names the run's FP8 layers the plan does not list."""
    rec = _recommended(run, "h100")[0].to_dict()
    assert rec["wrapped_weight_layers"] == ["2"]
    for framework in snippets.frameworks("fp8"):
        code = snippets.snippet(rec, framework, "fp8")
        compile(code, framework, "exec")
        assert "convert_to_float8_training(" not in code and "import convert_to_float8_training" not in code
        assert (
            "FP8 already: this run trains 3 layer(s) in FP8 with torchao, 1 through quantize_ "
            "(Float8TrainingOpConfig: FP8 training weights), 2 as Float8Linear (convert_to_float8_training); "
            "keep those conversions, which this code does not repeat"
        ) in _comments(code)
        assert "fp8_in_this_run = ['0', '2', '4']" in code
    # a plan that lists layer 4, not in FP8 yet, and not layer 0 (a Float8Linear of the run)
    more = {**rec, "running_formats": {"0": "fp8", "2": "fp8"}, "fp8_layers": ["2", "4"]}
    code = snippets.snippet(more, "torchao", "fp8")
    assert "fp8_layers = {'4'}" in code and "fp8_not_eligible = ['0']" in code
    # a plan that lists no eligible layer names the run's FP8 layer as not eligible too (it read "no other
    # FP8-eligible layer", as if it were one: reviewer h83)
    none = {**rec, "running_formats": {"2": "fp8"}, "fp8_layers": [], "measured_fp8_layers": []}
    code_none = snippets.snippet(none, "torchao", "fp8")
    assert "fp8_not_eligible = ['2']" in code_none and "no other FP8-eligible" not in code_none
    assert "convert them with quantize_ as well" in _comments(code)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
    quantization.quantize_(
        model, training_config.Float8TrainingOpConfig(), filter_fn=lambda m, fqn: fqn == "2"
    )
    scope: dict[str, Any] = {"model": model}
    exec(code.replace("model = torch.compile(model)", "pass  #"), scope)  # (dynamo's import: a second)
    assert [type(m).__name__ for m in model[::2]] == ["Linear", "Linear", "Linear"]
    assert {type(model[i].weight).__name__ for i in (2, 4)} == {"Float8TrainingWeightWrapperTensor"}


def test_the_fp8_training_weight_keeps_its_bias(run: Path) -> None:
    """Layer 2's bias, which torchao's FP8 training weight (quantize_) adds in its F.linear, and the Float8Linear
    layers' biases are not said to be dropped, as the MX training weight's is (tests/test_mx_layers.py)."""
    rec, _, summary = _recommended(run)
    assert summary[T.SUMMARY_CAPTURE]["bias_dropped"] == []
    assert rec.finding("bias_dropped") is None


def test_a_loop_of_its_own_reads_as_fp8_seen_not_asked(run: Path) -> None:
    """The precision check of a loop that asked for nothing says what it saw, not "Asked for fp8."; a run whose
    configuration asked for fp8 says it was asked for. Where no FP8 layer is found, the check names both of
    torchao's ways to FP8: Float8Linear and quantize_'s FP8 training weight."""
    tables, summary = T.read_tables(run), T.read_summary(run)
    asked = {**summary, T.SUMMARY_CONFIG: {"precision": "fp8"}}
    verification = render.environment().get_template("_verification.html.j2")
    section = {"id": "verification", "number": 1, "heading": "Precision check"}
    for s, line in ((summary, "Seen: <strong>fp8</strong> (what the run trained in"), (asked, "Asked for")):
        check = S.precision_check(tables["layers"], tables["memory"], s)
        assert check["ok"] and "FP8 GEMMs ran: 3 of 3 linear layers" in check["verdict"]
        page = verification.render(section=section, verification=check)
        assert line in page and ("Asked for" in page) == (s is asked)
    # the same tables with no layer recorded as FP8: the check's last word names quantize_ too
    layers = tables["layers"].assign(
        **{T.MODULE_TYPE: tables["layers"][T.MODULE_TYPE].replace("Float8Linear", "Linear")}
    )
    for s, said in ((asked, "FP8 was asked for"), (summary, "The run was seen as FP8")):
        capture = {k: v for k, v in s[T.SUMMARY_CAPTURE].items() if k != "fp8_recipe"}
        check = S.precision_check(layers, tables["memory"], {**s, T.SUMMARY_CAPTURE: capture})
        assert not check["ok"] and check["verdict"].startswith(
            f"{said} but no linear layer ran as a torchao Float8Linear or as an nn.Linear whose weight torchao's "
            "quantize_ made an FP8 training weight (Float8TrainingOpConfig): its 3 linear layers ran their "
            "matmuls in bf16."
        )
