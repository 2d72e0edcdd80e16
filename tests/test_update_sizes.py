"""The size of the sampled weight updates (``capture/update_sizes.py``): the ``weight_update`` rows' update and
weight RMS, largest and smallest nonzero |update|, against the test's own copies of the same strided elements
(the whole tensor for a parameter of at most 256 elements) read around ``optimizer.step()``, for SGD and Adam,
fp32 and bf16 weights, through the C kernel and the torch ops; and training unchanged by reading them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis import update_ratio
from precprof.analysis.advisor import evidence
from precprof.capture import update_readers
from precprof.capture.reducer import RankReducer
from precprof.report import filters, timeline
from precprof.stats import kernel as cpu_kernel
from precprof.stats import triton_engine, triton_updates
from precprof.stats.engine import ENGINE_ENV

STEPS = 3
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}
# the torch path, the C kernel's reader and the Triton kernels' (``stats.triton_updates``, in Triton's interpreter)
ENGINES = [
    "torch",
    *(["c"] if cpu_kernel.load() is not None else []),
    *(
        ["triton"]
        if triton_engine.interpreting() and triton_engine.unavailable(torch.device("cpu")) is None
        else []
    ),
]


def _model(dtype: torch.dtype) -> nn.Module:
    """A weight of 1200 elements (every 7th sampled: 172) and a bias of 30 (all of them), the bias starting
    at zero as ``nn.Linear`` biases often do: its weight RMS is 0 on the first step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 1)).to(dtype)
    with torch.no_grad():
        m[0].bias.zero_()
    return m


def _sample(p: torch.Tensor) -> torch.Tensor:
    """The strided sample precprof reads (256 elements at most per parameter; one as long as a row has every
    column: 1200 = 30 x 40 elements, every 7th, 172 of them), as fp64 copies."""
    flat = p.detach().reshape(-1)
    stride, cols = -(-flat.numel() // 256), p.shape[-1] if p.dim() > 1 else 1
    while len({i % cols for i in range(0, flat.numel(), stride)}) < cols:
        stride += 1
    return flat[::stride].double().clone()


def _train(
    opt_name: str, dtype: torch.dtype, profile: bool, reducer: Any = "auto"
) -> tuple[nn.Module, pd.DataFrame, pd.DataFrame]:
    """STEPS steps; returns the model, the weight-update rows (when profiled) and the test's own sizes per
    (step, module, param) from its copies of the samples before and after each optimizer step."""
    m = _model(dtype)
    opt = OPTIMIZERS[opt_name](m.parameters())
    x = torch.randn(16, 40).to(dtype)
    y = torch.randn(16, 1).to(dtype)
    names = dict(m.named_parameters())
    own = []
    prof = (
        # (the Triton engine's kernels compiled at attach, not beside the steps: every step sampled)
        precprof.Profiler(
            m, optimizer=opt, sample_every=1, memory=False, reducer=reducer, compile_beside=False
        )
        if profile
        else None
    )
    if prof is not None:
        prof.attach()
    for step in range(STEPS):
        loss = (m(x).float() - y.float()).square().mean()
        loss.backward()
        before = {n: _sample(p) for n, p in names.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        for n, p in names.items():
            d = _sample(p) - before[n]
            w = before[n]
            module, param = n.rsplit(".", 1)
            moved = d[d != 0].abs()
            own.append(
                {
                    T.STEP: step,
                    T.MODULE: module,
                    T.PARAM: param,
                    "numel": len(d),
                    "update_rms": float(d.square().mean().sqrt()),
                    "weight_rms": float(w.square().mean().sqrt()),
                    "absmax": float(d.abs().max()),
                    "absmin": float(moved.min()) if len(moved) else math.nan,
                }
            )
        if prof is not None:
            prof.step(loss=loss.detach())
    rows = pd.DataFrame()
    if prof is not None:
        layers = prof.tables()["layers"]
        prof.detach()
        rows = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE].astype({T.MODULE: str, T.PARAM: str})
    return m, rows, pd.DataFrame(own)


@pytest.mark.parametrize(
    ("opt_name", "dtype", "engine"),
    [
        (o, d, e)
        for o in sorted(OPTIMIZERS)
        for d in (torch.float32, torch.bfloat16)
        for e in ENGINES
        if e != "triton" or o == "adam"
    ],
)
def test_update_sizes_are_those_of_the_sampled_elements(
    opt_name: str, dtype: torch.dtype, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows had only counts (absmax and absmin NaN): no update RMS, no weight RMS, no ||dw|| / ||w||. (The
    Triton kernels in their interpreter, 3 s a case, after one optimizer: they read the weights before and after
    whichever made them.)"""
    monkeypatch.setenv(ENGINE_ENV, engine)
    _, rows, own = _train(opt_name, dtype, profile=True)
    got = rows.set_index([T.STEP, T.MODULE, T.PARAM]).sort_index()
    want = own.set_index([T.STEP, T.MODULE, T.PARAM]).sort_index()
    assert list(got.index) == list(want.index) and len(want) == STEPS * 4
    assert (got[T.NUMEL] == want["numel"]).all() and set(want["numel"]) == {172, 30, 1}
    for col in (T.UPDATE_RMS, T.WEIGHT_RMS, T.ABSMAX, T.ABSMIN):
        np.testing.assert_allclose(got[col].to_numpy(float), want[col].to_numpy(float), rtol=1e-6, atol=0)
    ratio = got[T.UPDATE_RMS] / got[T.WEIGHT_RMS]
    assert (ratio[want["weight_rms"] > 0] > 0).all()
    assert (got.loc[(0, "0", "bias"), T.WEIGHT_RMS] == 0) and got.loc[(0, "0", "bias"), T.UPDATE_RMS] > 0


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_reading_the_update_sizes_leaves_training_unchanged(opt_name: str) -> None:
    plain, _, _ = _train(opt_name, torch.bfloat16, profile=False)
    profiled, rows, _ = _train(opt_name, torch.bfloat16, profile=True)
    assert rows[T.UPDATE_RMS].notna().all()
    for (name, a), b in zip(plain.named_parameters(), profiled.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_update_sizes_reduced_over_ranks_are_those_of_one_process(tmp_path: Path) -> None:
    """Under a process group the sizes go through the collectives (sums added, the largest and the smallest
    update by a max): with one rank, the rows of a run without a group, the sizes the test computed."""
    import torch.distributed as dist

    _, alone, own = _train("adam", torch.float32, profile=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        _, reduced, _ = _train("adam", torch.float32, profile=True, reducer=RankReducer())
    finally:
        dist.destroy_process_group()
    cols = [T.STEP, T.MODULE, T.PARAM, T.NUMEL, T.UPDATE_RMS, T.WEIGHT_RMS, T.ABSMAX, T.ABSMIN]
    pd.testing.assert_frame_equal(reduced[cols].reset_index(drop=True), alone[cols].reset_index(drop=True))
    np.testing.assert_allclose(reduced[T.ABSMIN].to_numpy(float), own["absmin"].to_numpy(float), rtol=1e-6)


def _update_row(step: int, module: str, param: str, numel: int, update_rms: float, weight_rms: float) -> dict:
    return {
        T.STEP: step,
        T.MODULE: module,
        T.TENSOR: T.WEIGHT_UPDATE,
        T.PARAM: param,
        T.ORDER: {"a": 0, "z": 1}[module],
        T.NUMEL: numel,
        T.UPDATE_RMS: update_rms,
        T.WEIGHT_RMS: weight_rms,
        T.ABSMAX: 2 * update_rms,
    }


def test_a_layers_ratio_takes_its_parameters_together_and_no_step_of_zero_weights() -> None:
    """||dw|| / ||w|| per module and step from the sums of squares of its parameters' samples (a bias at zero
    beside its weight counts); a step whose weights were all zero has no ratio; median and max over steps."""
    rows = [
        _update_row(0, "a", "weight", 4, 0.1, 1.0),
        _update_row(0, "a", "bias", 2, 0.2, 0.0),
        _update_row(1, "a", "weight", 4, 0.01, 1.0),
        _update_row(1, "a", "bias", 2, 0.01, 0.5),
        _update_row(2, "a", "weight", 4, 0.03, 1.0),
        _update_row(0, "z", "weight", 8, 0.1, 0.0),  # zero-initialised: no ratio on its first step
        _update_row(1, "z", "weight", 8, 0.1, 0.2),
        {T.STEP: 0, T.MODULE: "a", T.TENSOR: T.WEIGHT, T.PARAM: "weight", T.NUMEL: 4, T.ABSMAX: 9.0},
    ]
    layers = T.frame("layers", rows)
    a = [
        math.sqrt(4 * 0.1**2 + 2 * 0.2**2) / 2,
        math.sqrt(4 * 0.01**2 + 2 * 0.01**2) / math.sqrt(4 + 2 * 0.25),
    ]
    a.append(0.03)
    per = update_ratio.layer_ratios(layers)
    assert per["a"]["median"] == pytest.approx(float(np.median(a)), rel=1e-12)
    assert per["a"]["max"] == pytest.approx(max(a), rel=1e-12) and per["a"]["steps"] == 3
    assert per["z"] == {"median": 0.5, "max": 0.5, "steps": 1.0, "absmax": 0.2}
    doc = update_ratio.summary(layers)
    assert doc is not None and [r["module"] for r in doc["layers"]] == ["a", "z"]
    assert doc["ratio_max"] == 0.5 and doc["ratio_max_layer"] == "z"
    assert doc["ratio_median"] == pytest.approx((float(np.median(a)) + 0.5) / 2, rel=1e-12)
    # a run recorded before the sizes: nothing to say
    assert update_ratio.summary(layers.drop(columns=[T.UPDATE_RMS, T.WEIGHT_RMS])) is None


def test_a_layers_ratio_counts_each_parameter_at_its_size_not_its_sample() -> None:
    """A weight of 65,536 elements (256 of them sampled) beside a bias of 16 (all sampled): the layer's ratio took
    them at 256 against 16, so a gate-style bias at -2 weighed 6% of the layer's norm where it holds 0.02%, and
    the ratio came out 15x low. Every weight and every bias element here is the same and moves by the same
    step (inputs of ones, SGD on the output's sum), so the samples' RMS are exact: precprof's ratio must be the
    layer's ||dw|| / ||w|| from the test's own copies of the whole parameters around each optimizer step."""
    lin = nn.Linear(4096, 16)
    with torch.no_grad():
        lin.weight.fill_(0.01)
        lin.bias.fill_(-2.0)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    truth = []
    with precprof.Profiler(lin, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(STEPS):
            lin(torch.ones(8, 4096)).sum().backward()
            before = [p.detach().double().clone() for p in lin.parameters()]
            opt.step()
            opt.zero_grad()
            du = sum(
                ((p.detach().double() - b) ** 2).sum() for p, b in zip(lin.parameters(), before, strict=True)
            )
            truth.append(math.sqrt(float(du) / float(sum((b**2).sum() for b in before))))
            prof.step()
    per = update_ratio.step_ratios(prof.tables()["layers"]).sort_values(T.STEP)
    assert per[T.STEP].tolist() == list(range(STEPS))
    assert per["ratio"].to_numpy() == pytest.approx(truth, rel=1e-5)


def test_the_summary_and_the_report_give_each_layers_ratio(tmp_path: Path) -> None:
    """summary.json's ``weight_updates`` and the report's table of update / weight per layer: the test's own
    ratios of the sampled elements, each parameter's sums of squares scaled to its size (the weight's 240
    samples stand for its 1200 elements), median and max over the sampled steps."""
    m = _model(torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = torch.randn(16, 40), torch.randn(16, 1)
    sums: dict[tuple[int, str], list[float]] = {}
    with precprof.Profiler(m, optimizer=opt, sample_every=2, memory=False, out=tmp_path / "run") as prof:
        for step in range(6):
            (m(x) - y).square().mean().backward()
            before = {n: _sample(p) for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            for n, p in m.named_parameters():
                du, dw = sums.setdefault((step, n.rsplit(".", 1)[0]), [0.0, 0.0])
                scale = p.numel() / before[n].numel()
                sums[(step, n.rsplit(".", 1)[0])] = [
                    du + scale * float((_sample(p) - before[n]).square().sum()),
                    dw + scale * float(before[n].square().sum()),
                ]
            prof.step()
    page = prof.report().read_text()  # detached: the run ends (attached, a look at it so far)
    doc = T.read_summary(tmp_path / "run")[T.SUMMARY_WEIGHT_UPDATES]
    for layer in doc["layers"]:
        ratios = [
            math.sqrt(du / dw) for (s, mod), (du, dw) in sums.items() if mod == layer["module"] and s % 2 == 0
        ]
        assert len(ratios) == layer["steps"] == 3
        assert layer["median"] == pytest.approx(float(np.median(ratios)), rel=1e-6)
        assert layer["max"] == pytest.approx(max(ratios), rel=1e-6)
    assert [r["module"] for r in doc["layers"]] == ["0", "2"]
    assert "Weight updates against the weights" in page
    assert f">{filters.sci(doc['layers'][0]['median'])}<" in page


@pytest.mark.parametrize("engine", ENGINES)
def test_nan_and_inf_updates_are_counted_not_read_as_zero(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight whose gradient holds nan and inf at some elements: SGD makes those updates nan and -inf. The
    rows had nan and inf 0 beside an update RMS of the finite updates alone, so a layer whose every update was
    nan read as one whose update was 0. Now nan and inf count them, as the test's own copies of the samples
    around the step do, and the sizes stay those of the finite updates. A bias whose every update is nan has no
    largest finite update: its absmax read 0.0, "did not move"; it is NaN, as its absmin."""
    monkeypatch.setenv(ENGINE_ENV, engine)
    classified: list[bool] = []  # what each in-place reader's ``classify`` returned

    def spy(real: Any) -> Any:
        def classify(self: Any, *args: Any) -> bool:
            classified.append(real(self, *args))
            return classified[-1]

        return classify

    for cls in (update_readers.HostSamples, triton_updates.TritonSamples):
        monkeypatch.setattr(cls, "classify", spy(cls.classify))
    m = _model(torch.float32)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(16, 40), torch.randn(16, 1)
    names = dict(m.named_parameters())
    own = {}
    with precprof.Profiler(m, optimizer=opt, sample_every=1, memory=False, compile_beside=False) as prof:
        (m(x) - y).square().mean().backward()
        grad = names["0.weight"].grad
        assert grad is not None
        grad.view(-1)[:50] = math.nan  # every 7th sampled: elements 0, 7, ..., 49
        grad.view(-1)[100:110] = math.inf  # element 105
        names["0.bias"].grad.fill_(math.nan)  # type: ignore[union-attr]
        before = {n: _sample(p) for n, p in names.items()}
        opt.step()
        for n, p in names.items():
            d = _sample(p) - before[n]
            finite = d[d.isfinite()]
            top = float(finite.abs().max()) if len(finite) else math.nan
            own[n] = (int(d.isnan().sum()), int(d.isinf().sum()), float(finite.square().sum() / len(d)), top)
        # each engine's reader read the samples in place (the torch path: none)
        readers = {type(g._reader).__name__ for g in prof._updates._groups}  # type: ignore[union-attr]
        assert readers == {{"c": "HostSamples", "triton": "TritonSamples"}.get(engine, "NoneType")}
        prof.step()
        assert classified == ([] if engine == "torch" else [True])  # ... and classified the step's updates
        layers = prof.tables()["layers"]
    rows = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE].astype({T.MODULE: str, T.PARAM: str})
    got = rows.set_index([T.MODULE, T.PARAM])
    assert own["0.weight"][:2] == (8, 1) and own["0.bias"][:2] == (30, 0) and math.isnan(own["0.bias"][3])
    for n, (nan, inf, sq, top) in own.items():
        row = got.loc[tuple(n.rsplit(".", 1))]
        assert (int(row[T.NAN]), int(row[T.INF])) == (nan, inf), n
        assert float(row[T.UPDATE_RMS]) == pytest.approx(math.sqrt(sq), rel=1e-6), n
        if math.isnan(top):
            assert math.isnan(float(row[T.ABSMAX])) and math.isnan(float(row[T.ABSMIN])), n
        else:
            assert float(row[T.ABSMAX]) == pytest.approx(top, rel=1e-6), n
    # the what-if formats' underflow and overflow are not measured on an update: NaN, where they held 0 (the
    # updates' "nothing underflows" beside real casts that flush them), and the advisor's tables keep them so
    assert rows[list(T.WHATIF_COUNT_COLUMNS)].isna().all().all()
    assert layers.loc[layers[T.TENSOR] != T.WEIGHT_UPDATE, list(T.WHATIF_COUNT_COLUMNS)].notna().all().all()
    prepared = evidence._prepare(prof.tables())[0]
    upd = prepared[T.TENSOR] == T.WEIGHT_UPDATE
    assert prepared.loc[upd, list(T.WHATIF_COUNT_COLUMNS)].isna().all().all()
    assert prepared.loc[upd, T.NAN].tolist() == rows[T.NAN].tolist()
    # (the time axis in a format of no lost-update count has no weight-update row: it read 0% lost)
    assert T.WEIGHT_UPDATE not in set(timeline.lost_by_step(layers, "fp8_e4m3")[T.TENSOR])


def test_a_step_with_a_nan_update_has_no_ratio_and_is_said_left_out(tmp_path: Path) -> None:
    """SGD, and on step 1 a nan put in layer 0's weight gradient: that weight element goes nan, and on step 2
    the loss, every gradient and every update are nan. The report's table had layer 0 at update / weight 0
    on step 2 ("the layer barely trains"); now a step whose sampled updates hold a nan has no ratio, and the
    page and summary.json say which steps were left out. The test's own copies of the samples around each
    step give the ratios of the steps kept and the steps left out."""
    m = _model(torch.float32)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x, y = torch.randn(16, 40), torch.randn(16, 1)
    sums: dict[tuple[int, str], list[float]] = {}
    bad: dict[str, set[int]] = {}
    with precprof.Profiler(m, optimizer=opt, sample_every=1, memory=False, out=tmp_path / "run") as prof:
        for step in range(STEPS):
            (m(x) - y).square().mean().backward()
            if step == 1:
                m[0].weight.grad[0, 0] = math.nan  # type: ignore[index]
            before = {n: _sample(p) for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            for n, p in m.named_parameters():
                mod, d = n.rsplit(".", 1)[0], _sample(p) - before[n]
                if not d.isfinite().all():
                    bad.setdefault(mod, set()).add(step)
                scale = p.numel() / len(d)
                du, dw = sums.get((step, mod), [0.0, 0.0])
                sums[(step, mod)] = [
                    du + scale * float(d.square().sum()),
                    dw + scale * float(before[n].square().sum()),
                ]
            prof.step()
    page = prof.report().read_text()
    assert bad == {"0": {1, 2}, "2": {2}}
    doc = T.read_summary(tmp_path / "run")[T.SUMMARY_WEIGHT_UPDATES]
    assert doc["nonfinite_steps"] == {mod: [len(s), STEPS] for mod, s in bad.items()}
    for layer in doc["layers"]:
        kept = [s for s in range(STEPS) if s not in bad[layer["module"]]]
        ratios = [math.sqrt(sums[(s, layer["module"])][0] / sums[(s, layer["module"])][1]) for s in kept]
        assert layer["steps"] == len(kept)
        assert layer["median"] == pytest.approx(float(np.median(ratios)), rel=1e-6)
    assert 'id="update-ratios-nonfinite"' in page
    assert "<code>0</code>: 2 of 3 steps; <code>2</code>: 1 of 3 steps." in page
