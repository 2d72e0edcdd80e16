"""One story on the page for FP8 (issue 34, item 3): an fp8 run's precision check confirms that FP8 GEMMs ran
(torchao Float8Linear layers recorded), not only that activations are bf16, and says so when they did not.

FP8 GEMMs need a GPU: the layers below are a stand-in class named like torchao's (``Float8Linear``, an nn.Linear
subclass, as torchao's is), captured by the real Profiler on the CPU under bf16 autocast, which is what the layers
table of a torchao run holds: their type, and bf16 outputs. torchao's own layers run on the CPU emulated
(``emulate=True``), which the last test checks the page says.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.report import summarize as S


class Float8Linear(nn.Linear):
    """Named as torchao.float8's layer: the report reads the module type the Profiler records."""


def _capture(fp8: bool) -> dict:
    torch.manual_seed(0)
    lin = Float8Linear if fp8 else nn.Linear
    return _train(nn.Sequential(lin(32, 64), nn.GELU(), lin(64, 32), nn.GELU(), nn.Linear(32, 16))).tables()


def _train(model: nn.Module) -> precprof.Profiler:
    """Two sampled steps of ``model`` (32 features in) under bf16 autocast on the CPU."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(16, 32)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    return prof


def test_an_fp8_run_confirms_its_fp8_gemms() -> None:
    tables = _capture(fp8=True)
    summary = {T.SUMMARY_CONFIG: {"precision": "fp8", "plan": {"fp8_library": "torchao"}}}
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    assert check["ok"] and check["active"]
    assert "FP8 GEMMs ran: 2 of 3 linear layers are torchao Float8Linear" in check["verdict"]


def test_an_fp8_run_without_float8_layers_says_its_matmuls_ran_in_bf16() -> None:
    tables = _capture(fp8=False)  # bf16 activations all the same: the dtypes cannot tell
    summary = {T.SUMMARY_CONFIG: {"precision": "fp8", "plan": {"fp8_library": "torchao"}}}
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    assert check["active"] and not check["ok"] and check["banner"] == "FP8 did not run."
    assert check["verdict"].startswith("FP8 was asked for but no linear layer ran as a torchao Float8Linear")
    # a bf16 run is not asked about FP8
    bf16 = S.precision_check(tables["layers"], tables["memory"], {T.SUMMARY_CONFIG: {"precision": "bf16"}})
    assert bf16["ok"] and "FP8" not in bf16["verdict"]


def test_emulated_float8_layers_are_not_said_to_run_fp8_gemms(tmp_path: Path) -> None:
    """torchao's Float8Linear with ``emulate=True`` casts to FP8 and multiplies in high precision: its numbers
    are FP8's, its speed is not. The check said "FP8 GEMMs ran" of it. Real torchao layers, on the CPU."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(emulate=True))
    assert [type(m).__name__ for m in model] == ["Float8Linear", "GELU", "Float8Linear"]
    _train(model).save(tmp_path / "run")
    summary = T.read_summary(tmp_path / "run")
    assert summary[T.SUMMARY_CAPTURE]["fp8_emulated"] == 2
    summary[T.SUMMARY_CONFIG] = {"precision": "fp8", "plan": {"fp8_library": "torchao"}}
    tables = T.read_tables(tmp_path / "run")
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    assert check["ok"] and "FP8 GEMMs ran" not in check["verdict"]
    assert (
        "FP8 was emulated: 2 of 2 linear layers are torchao Float8Linear, 2 of them with emulate=True"
        in (check["verdict"])
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_precision_check_says_the_recipe_the_float8_layers_ran(recipe: str, tmp_path: Path) -> None:
    """summary.json's capture.fp8_recipe was a fixed text, the what-if's per-tensor recipe, also of a run trained
    on torchao's rowwise recipe, and the check said nothing of it. It is read from the layers' own config now."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: n != "4")
    _train(model).save(tmp_path / "run")
    summary = T.read_summary(tmp_path / "run")
    capture = summary[T.SUMMARY_CAPTURE]
    [ran] = capture["fp8_recipe"]
    assert ran["scaling"] == recipe and ran["layers"] == ["0", "2"]
    assert ran["round_scales_to_power_of_2"] == config.round_scales_to_power_of_2
    assert (
        ran["casts"]["grad_output"]["dtype"]
        == str(config.cast_config_grad_output.target_dtype).split(".")[-1]
    )
    assert "per-tensor current scaling" in capture["fp8_whatif_recipe"]
    summary[T.SUMMARY_CONFIG] = {"precision": "fp8", "plan": {"fp8_library": "torchao"}}
    tables = T.read_tables(tmp_path / "run")
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    words = {"tensorwise": "tensorwise (one scale per tensor)", "rowwise": "rowwise (one scale per row"}[
        recipe
    ]
    assert check["ok"] and f"torchao recipe: {words}" in check["verdict"]
    assert "for 2 layer(s)" in check["verdict"]
