"""A model trained in float64 (``model.double()``) is named "fp64", not "fp32": the precision check says float64,
the memory projection halves its float64 tensors in FP32, and under bf16 autocast (which leaves float64 ops alone)
the run is said to have run in float64, not "in fp32 outside autocast"."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof import taxonomy
from precprof.analysis import advisor
from precprof.analysis import memory_projection as MP
from precprof.report import memory_summary as M
from precprof.report import summarize as S


def _double_run(autocast: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two steps of a float64 model (own loop, AdamW), under bf16 autocast or not: (its tables, its summary)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with precprof.Profiler(model, opt, sample_every=1) as prof:
        for _ in range(2):
            x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    return prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}


@pytest.fixture(scope="module")
def plain() -> tuple[dict[str, Any], dict[str, Any]]:
    return _double_run(autocast=False)


@pytest.fixture(scope="module")
def autocast() -> tuple[dict[str, Any], dict[str, Any]]:
    return _double_run(autocast=True)


def test_a_float64_run_is_fp64_and_fp32_would_halve_it(plain: tuple[dict[str, Any], dict[str, Any]]) -> None:
    tables, summary = plain
    layers, memory = tables["layers"], tables["memory"]
    assert set(layers[T.DTYPE].astype(str)) == {"float64"}
    # named fp64 where the hooks saw it, off the layers (a killed run), and as what the run trained in
    assert summary[T.SUMMARY_CAPTURE]["precision_seen"] == "fp64" == taxonomy.precision_in_layers(layers)
    assert S.trained_precision(summary) == "fp64"
    check = S.precision_check(layers, memory, summary)
    assert check["ok"] and check["verdict"].startswith("Double precision: every activation")
    assert "float32" not in check["verdict"] and "model.float() halves" in check["verdict"]
    # the projection: measured as fp64, FP32 holds each float64 parameter, gradient and state in 4 bytes
    proj = MP.project(memory, summary)
    assert proj["measured_mode"] == "fp64" and "float64" in " ".join(proj["assumptions"])
    rec = {(r["mode"], r["component"], r["source"]): r["bytes"] for r in proj["records"]}
    for comp in (T.PARAMETERS, T.GRADIENTS):
        assert rec[("fp64", comp, "measured")] == 8 * 212 and rec[("fp32", comp, "projected")] == 4 * 212
    assert (
        rec[("fp32", T.OPTIMIZER_STATES, "projected")] < rec[("fp64", T.OPTIMIZER_STATES, "measured")] * 0.6
    )
    measured = float(sum(rec[("fp64", c, "measured")] for c in (T.PARAMETERS, T.GRADIENTS)))
    saving = M.expected_saving(proj["records"], measured, "fp64", "fp32")
    assert saving is not None and not saving["same_mode"] and 0.45 < saving["share"] < 0.55
    # the advisor says it, and recommends no float64
    found = advisor.recommend(tables, summary=summary).finding("float64_layers")
    assert found is not None and found.severity == "info" and found.numbers["float64_layers"] == 2
    assert "model.float()" in found.remedy


def test_an_activation_row_without_its_dtype_is_no_float64_and_breaks_no_verdict(
    plain: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """A row whose dtype was not read back (NaN: the advisor's property test made one) failed the precision
    check's count of float64 modules with a TypeError, and with it the whole page."""
    tables, summary = plain
    layers = tables["layers"].copy()
    acts = layers.index[layers[T.TENSOR] == T.ACTIVATION]
    layers[T.DTYPE] = layers[T.DTYPE].astype(object)
    layers.loc[acts[:1], T.DTYPE] = math.nan
    check = S.precision_check(layers, tables["memory"], summary)
    assert check["verdict"].startswith("Double precision") and "1 of 2 modules" not in check["verdict"]


def test_a_float64_model_under_bf16_autocast_ran_in_float64_not_outside_autocast(
    autocast: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    tables, own = autocast
    layers, memory = tables["layers"], tables["memory"]
    assert own[T.SUMMARY_CAPTURE]["autocast"]["enabled"]  # autocast was on: it left every float64 op alone
    assert set(layers[T.DTYPE].astype(str)) == {"float64"}
    assert own[T.SUMMARY_CAPTURE]["precision_seen"] == "fp64"
    # precprof train --precision bf16: asked for bf16, trained in fp64
    asked = {**own, T.SUMMARY_CONFIG: {"precision": "bf16"}}
    assert S.trained_precision(asked) == "fp64" and MP.project(memory, asked)["measured_mode"] == "fp64"
    check = S.precision_check(layers, memory, asked)
    assert (
        not check["ok"]
        and "NOT active: every activation of a module with parameters is float64:" in (check["verdict"])
    )
    assert "is float32" not in check["verdict"] and "model.float()" in check["verdict"]
    # the own loop (nothing asked): its autocast is named, and the verdict stays float64
    said = S.precision_check(layers, memory, own)["verdict"]
    assert said.startswith("Double precision") and "autocast, on in a recorded forward pass," in said
    assert not taxonomy.mixed_precision_check("bf16", layers)["mixed_precision_active"]
    for summary, severity in ((asked, "critical"), (own, "critical")):
        rec = advisor.recommend(tables, summary=summary)
        assert rec.finding("fp16_kept_fp32") is None  # it said the layers "ran in fp32 outside autocast"
        assert not any("outside autocast" in r for r in rec.reasons)
        found = rec.finding("float64_layers")
        assert found is not None and found.severity == severity and "leaves float64 ops" in found.message
        assert "model.float()" in found.remedy


class _Mixed(nn.Module):
    """A float64 layer holding most of the parameter elements (4,160 of 5,392) after two float32 ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 64)
        self.big = nn.Linear(64, 64).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(self.b(torch.tanh(self.a(x))).double()).float()


def test_a_model_mixing_float64_and_float32_layers_under_autocast_trains_in_autocasts_mode() -> None:
    """Named by the majority of its parameter elements, such a run was "fp64" (title, measured mode, "model.double()"
    in the projection) while its float32 layers ran in bf16 and the precision check said mixed precision was active
    (reviewer h108): it is a bf16 run, whose float64 layer the advisor names."""
    torch.manual_seed(0)
    model = _Mixed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, opt, sample_every=1) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(6, 8)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    tables, summary = prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}
    layers = tables["layers"]
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    dtypes = {str(m): set(acts.loc[acts[T.MODULE] == m, T.DTYPE].astype(str)) for m in ("a", "b", "big")}
    assert dtypes == {"a": {"bfloat16"}, "b": {"bfloat16"}, "big": {"float64"}}
    assert summary[T.SUMMARY_CAPTURE]["precision_seen"] == "bf16" == taxonomy.precision_in_layers(layers)
    assert S.trained_precision(summary) == "bf16"
    assert MP.project(tables["memory"], summary)["measured_mode"] == "bf16"
    assert S.precision_check(layers, tables["memory"], summary)["verdict"].startswith(
        "Mixed precision is active"
    )
    found = advisor.recommend(tables, summary=summary).finding("float64_layers")
    assert found is not None and found.modules == ["big"] and found.severity == "warning"


class _CastLinear(nn.Linear):
    """A linear layer that computes in its input's dtype (its weight cast to it, as adapters and some quantised
    layers do): fed float32 and float64 inputs in one step, its activation row joins both dtypes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_layer_called_with_two_dtypes_is_classed_by_the_narrowest_everywhere(autocast: bool) -> None:
    """Each layer of the model is called twice a step, on float32 and on float64 inputs: its row is
    "float32|float64" (no autocast) or "bfloat16|float64" (bf16 autocast, which leaves the float64 call alone).
    float64_layers split the row and called the layer float64 ("every output float64"; critical, "bf16 autocast
    leaves alone") while mixed_precision_check compared it whole and called bf16 active in both runs, and the
    report's precision check, comparing whole too, said "NOT active" in the autocast run. A layer is classed by
    the narrowest dtype of its calls, in all three: the first run is a float32 one (bf16 not active, its layers
    float32), the second a bf16 one; neither has a float64 layer."""
    torch.manual_seed(0)
    model = nn.Sequential(_CastLinear(8, 8), nn.Tanh(), _CastLinear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with precprof.Profiler(model, opt, sample_every=1) as prof:
        x = torch.randn(6, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().pow(2).mean() + model(x.double()).float().pow(2).mean()
        loss.backward()
        opt.step()
        prof.step(loss=loss.detach())
    tables = prof.tables()
    summary = {T.SUMMARY_CAPTURE: prof.summary(), T.SUMMARY_CONFIG: {"precision": "bf16"}}
    layers = tables["layers"]
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & layers[T.MODULE].isin(["0", "2"])]
    low = "bfloat16" if autocast else "float32"
    assert {frozenset(str(d).split("|")) for d in acts[T.DTYPE]} == {frozenset({low, "float64"})}
    check = taxonomy.mixed_precision_check("bf16", layers)
    assert check["mixed_precision_active"] == autocast
    assert check["matmul_layers_float32"] == (0 if autocast else 2) and check["matmul_layers"] == 2
    rec = advisor.recommend(tables, summary=summary)
    assert rec.finding("float64_layers") is None
    inactive = rec.finding("mixed_precision_inactive")
    assert (inactive is None) == autocast
    assert autocast or (inactive is not None and inactive.modules == ["0", "2"])
    verdict = S.precision_check(layers, tables["memory"], summary)["verdict"]
    assert "ran in float64" not in verdict
    assert verdict.startswith(
        "Mixed precision is active: 2 of 2 modules with parameters produce bfloat16 activations."
        if autocast
        else "Mixed precision was asked for (bf16) but is NOT active: every activation of a module with parameters "
        "is float32 or float64 ("
    ), verdict
