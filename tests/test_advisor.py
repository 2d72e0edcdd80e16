"""Advisor rules on synthetic tables built from real tensors.

Every table row here is computed from a real tensor by real casts (``x.to(torch.float16) == 0``) and
``torch.frexp``, independently of precprof.stats, so the advisor's numbers are checked against an independent
computation. Each test also compares the whole recommendation with a golden JSON file named after the test
(tests/golden/advisor/<test>.json); regenerate them with ``PRECPROF_UPDATE_GOLDEN=1 pytest tests/test_advisor.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from scenarios.loop import activations, backward_and_step, square_mean, train_profiled
from torch import nn

from precprof import cli
from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig, Finding, Recommendation, recommend
from precprof.analysis.snippets import snippets
from precprof.capture import Profiler
from precprof.hardware import HardwareInfo, preset
from precprof.report import numbers as report_numbers
from precprof.report import summarize as S
from precprof.report import timeline
from precprof.taxonomy import is_matmul_type as is_matmul_layer
from precprof.training import TrainConfig, train

GOLDEN = Path(__file__).parent / "golden" / "advisor"
UPDATE = os.environ.get("PRECPROF_UPDATE_GOLDEN") == "1"


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Each test draws its tensors from the same seed, whatever ran before it in this process (the golden
    files must not depend on the order pytest-xdist deals the tests in)."""
    torch.manual_seed(0)


_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_FMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


# ------------------------------------------------------------------------------------- table building
def tensor_stats(x: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
    """Counts of one tensor of unscaled values seen at loss scale ``scale``, by real casts."""
    x = x.float().flatten()
    xs = x * scale
    finite = torch.isfinite(xs)
    nz = finite & (xs != 0)
    row: dict[str, Any] = {
        T.NUMEL: x.numel(),
        T.ZEROS: int((xs == 0).sum()),
        T.NAN: int(torch.isnan(xs).sum()),
        T.INF: int(torch.isinf(xs).sum()),
        T.SCALE: scale,
    }
    fin = x[torch.isfinite(x)].abs()
    row[T.ABSMAX] = float(fin.max()) if fin.numel() else math.nan
    pos = fin[fin > 0]
    row[T.ABSMIN] = float(pos.min()) if pos.numel() else math.nan
    for fmt, dt in _DTYPES.items():
        c = xs.to(dt).float()
        row[T.underflow_col(fmt)] = int((nz & (c == 0)).sum())
        if fmt == "fp8_e4m3":
            # e4m3fn saturates instead of producing inf: count what lands beyond halfway to the next step
            row[T.overflow_col(fmt)] = int((finite & (xs.abs() > 464)).sum())
        else:
            row[T.overflow_col(fmt)] = int((finite & ~torch.isfinite(c)).sum())
    amax = float(xs[finite].abs().max()) if finite.any() else 0.0
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        if amax > 0 and math.isfinite(amax):
            k = math.floor(math.log2(_FMAX[fmt] / amax))
            c = (xs * 2.0**k).to(_DTYPES[fmt]).float()
            row[T.underflow_cs_col(fmt)] = int((nz & (c == 0)).sum())
        else:
            row[T.underflow_cs_col(fmt)] = 0
    return row


def tensor_hist(x: torch.Tensor) -> dict[int, int]:
    """floor(log2|x|) histogram of finite nonzero values, via frexp (x = m * 2^e with m in [0.5, 1))."""
    x = x.float().flatten()
    x = x[torch.isfinite(x) & (x != 0)]
    _, e = torch.frexp(x)
    vals, counts = torch.unique(e - 1, return_counts=True)
    return {int(v): int(c) for v, c in zip(vals, counts, strict=True)}


class RunBuilder:
    """Accumulates layers/histograms/steps rows for a synthetic run."""

    def __init__(self) -> None:
        self.layers: list[dict[str, Any]] = []
        self.hist: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []

    def add(
        self,
        step: int,
        order: int,
        module: str,
        module_type: str,
        tensor: str,
        x: torch.Tensor,
        *,
        param: str = "",
        scale: float = 1.0,
        dtype: str = "float32",
        calls: int = 1,
    ) -> None:
        row = {
            T.STEP: step,
            T.ORDER: order,
            T.MODULE: module,
            T.MODULE_TYPE: module_type,
            T.TENSOR: tensor,
            T.PARAM: param,
            T.DTYPE: dtype,
            T.CALLS: calls,
            **tensor_stats(x, scale),
        }
        self.layers.append(row)
        for e, c in tensor_hist(x).items():
            self.hist.append(
                {T.STEP: step, T.MODULE: module, T.TENSOR: tensor, T.PARAM: param, T.EXPONENT: e, T.COUNT: c}
            )

    def update(
        self, step: int, order: int, module: str, module_type: str, w: torch.Tensor, u: torch.Tensor
    ) -> None:
        """A weight_update row: lost updates counted by really adding u to w held in bf16/fp16."""
        nz = u != 0
        row = {
            T.STEP: step,
            T.ORDER: order,
            T.MODULE: module,
            T.MODULE_TYPE: module_type,
            T.TENSOR: T.WEIGHT_UPDATE,
            T.PARAM: "weight",
            T.DTYPE: "float32",
            T.CALLS: 1,
            **tensor_stats(u),
        }
        for col, dt in ((T.LOST_UPDATE_BF16, torch.bfloat16), (T.LOST_UPDATE_FP16, torch.float16)):
            w16 = w.to(dt)
            row[col] = int((nz & ((w16.float() + u).to(dt) == w16)).sum())
        self.layers.append(row)

    def step(self, step: int, loss: float, scale: float = 1.0, skipped: bool = False) -> None:
        self.steps.append(
            {T.STEP: step, T.LOSS: loss, T.LOSS_SCALE: scale, T.SKIPPED: skipped, T.SAMPLED: True}
        )

    def tables(self) -> dict[str, pd.DataFrame]:
        return {
            "layers": T.frame("layers", self.layers),
            "histograms": T.frame("histograms", self.hist),
            "steps": T.frame("steps", self.steps),
            "memory": T.empty("memory"),
        }


def mlp_run(
    *,
    steps: int = 2,
    act_scale: dict[str, float] | None = None,
    grad_log2: tuple[float, float] = (-12.0, -4.0),
    grad_log2_by_module: dict[str, tuple[float, float]] | None = None,
    width: int = 64,
    tokens: int = 32,
    seed: int = 0,
    act_type: str = "GELU",
) -> RunBuilder:
    """A 3-layer MLP (fc1, act, fc2, fc3) recorded in fp32: activations ~N(0,1) times act_scale[module],
    gradients log-uniform in 2^grad_log2, weights ~N(0, 0.02). ``act`` is a module of type ``act_type``."""
    g = torch.Generator().manual_seed(seed)
    act_scale = act_scale or {}
    b = RunBuilder()
    mods = [("fc1", "Linear"), ("act", act_type), ("fc2", "Linear"), ("fc3", "Linear")]
    for s in range(steps):
        for i, (m, t) in enumerate(mods):
            lo, hi = (grad_log2_by_module or {}).get(m, grad_log2)
            a = torch.randn(tokens, width, generator=g) * act_scale.get(m, 1.0)
            b.add(s, i, m, t, T.ACTIVATION, a)
            mag = 2.0 ** (lo + (hi - lo) * torch.rand(tokens, width, generator=g))
            sign = torch.where(torch.rand(tokens, width, generator=g) < 0.5, -1.0, 1.0)
            b.add(s, i, m, t, T.ACTIVATION_GRAD, mag * sign)
            if t == "Linear":
                w = torch.randn(width, width, generator=g) * 0.02
                b.add(s, i, m, t, T.WEIGHT, w, param="weight")
                b.add(
                    s,
                    i,
                    m,
                    t,
                    T.WEIGHT_GRAD,
                    torch.randn(width, width, generator=g) * 2.0 ** (hi - 2),
                    param="weight",
                )
        b.step(s, loss=2.0 - 0.1 * s)
    return b


# The hand-built tables stand in for the layers of a large model: under 100M parameters the advisor's default
# is fp32 (test_small_model_and_roundtrip), which would hide every other decision.
LARGE = 200_000_000


def summary_for(precision: str = "fp32", batch: int = 4, seq: int = 8, **model: Any) -> dict[str, Any]:
    return {
        T.SUMMARY_CONFIG: {
            "precision": precision,
            "loss_scaling": "none",
            "batch_size": batch,
            "seq_len": seq,
        },
        T.SUMMARY_MODEL: {"n_params": LARGE, **model},
    }


# ----------------------------------------------------------------------------------------------- golden
def _close(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-15), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def check_golden(request: pytest.FixtureRequest, rec: Recommendation) -> None:
    path = GOLDEN / f"{request.node.name}.json"
    got = json.loads(json.dumps(rec.to_dict()))
    if UPDATE or not path.exists():
        if not UPDATE:
            pytest.fail(f"golden file {path} missing; run with PRECPROF_UPDATE_GOLDEN=1 to create it")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
        return
    _close(json.loads(path.read_text()), got)


def codes(rec: Recommendation) -> dict[str, str]:
    return {f.code: f.severity for f in rec.findings}


def must(rec: Recommendation, code: str) -> Finding:
    f = rec.finding(code)
    assert f is not None, f"no finding {code}; have {codes(rec)}"
    return f


# ------------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def benign() -> dict[str, pd.DataFrame]:
    torch.manual_seed(0)
    return mlp_run().tables()


@pytest.mark.parametrize("target", ["a100", "v100", "t4", "cpu", "h100"])
def test_hardware_decision(
    request: pytest.FixtureRequest, benign: dict[str, pd.DataFrame], target: str
) -> None:
    cpu = HardwareInfo(device="cpu", name="CPU", bf16_supported=True, bf16_native=False, preset="cpu")
    rec = recommend(benign, hardware=cpu if target == "cpu" else target, summary=summary_for())
    # h100: all three layers are FP8-eligible and carry all the FLOPs of a (declared) 200M-parameter model, but
    # their GEMMs (32 tokens x 64 x 64) are far too small for FP8's casts to pay: bf16, and the speed decided
    expected = {"a100": "bf16", "v100": "fp16", "t4": "fp16", "cpu": "fp32", "h100": "bf16"}[target]
    assert rec.format == expected
    assert rec.target == target
    assert rec.fp16_loss_scale > 0 and math.log2(rec.fp16_loss_scale).is_integer()
    assert (rec.loss_scale is not None) == (expected == "fp16")
    if target in ("v100", "t4"):
        assert "bf16_unsupported" in codes(rec)
        assert rec.loss_scale == rec.fp16_loss_scale and rec.growth_interval == 2000
    if target == "cpu":
        assert codes(rec)["bf16_emulated"] == "warning"
        # the preset said "This CPU (CPU) has neither ...", of a machine that may well have them
        said = must(rec, "bf16_emulated").message
        assert (
            said.startswith("The cpu preset is a CPU with neither AVX512-BF16 nor AMX")
            and "This CPU" not in said
        )
    if target == "h100":
        assert rec.fp8_layers == [] and must(rec, "fp8_eligibility").modules == ["fc1", "fc2", "fc3"]
        assert "fp8_supported" in codes(rec)
        assert "Not FP8: the speed decided" in " ".join(rec.reasons)
        speed = must(rec, "fp8_speed").numbers["estimated_speedup"]
        assert isinstance(speed, float) and speed < 1
        # one story: under a bf16 verdict no finding says to convert layers to FP8
        assert not [
            f.code for f in rec.findings if "onvert" in f.remedy and "Nothing to convert" not in f.remedy
        ]
    assert [f.severity for f in rec.findings] == sorted(
        (f.severity for f in rec.findings), key=["critical", "warning", "info"].index
    )
    check_golden(request, rec)


def test_fp16_underflow_and_loss_scale(request: pytest.FixtureRequest) -> None:
    # activation gradients between 2^-34 and 2^-18: most are below fp16's 2^-24 at scale 1
    run = mlp_run(grad_log2=(-34.0, -18.0), seed=1)
    t = run.tables()
    rec = recommend(t, hardware="v100", summary=summary_for())
    assert rec.format == "fp16"
    k = int(math.log2(rec.loss_scale or 0))
    # independent: the largest gradient (activation and weight gradients) from the tensors themselves
    g = t["layers"]
    gmax = float(g[g[T.TENSOR].isin(T.GRADIENT_KINDS)][T.ABSMAX].max())
    assert gmax * 2.0**k < 65504 / 4 <= gmax * 2.0 ** (k + 1)
    # independent: underflow shares by really casting the scaled activation gradients
    torch_grads = _regenerate_act_grads(grad_log2=(-34.0, -18.0), seed=1)
    nz = (torch_grads != 0).sum().item()
    at1 = ((torch_grads.half() == 0) & (torch_grads != 0)).sum().item() / nz
    atk = (((torch_grads * 2.0**k).half() == 0) & (torch_grads != 0)).sum().item() / nz
    f = must(rec, "fp16_gradient_underflow")
    assert f.numbers["share_at_scale_1"] == pytest.approx(at1, abs=0)
    assert f.numbers["share_now"] == pytest.approx(at1, abs=0)  # fp32 run: scale in effect is 1
    assert f.numbers["share_at_recommended"] == pytest.approx(atk, abs=0)
    assert at1 > 0.5 and atk < 0.01
    assert f.severity == "warning"
    ls = must(rec, "fp16_loss_scale")
    assert ls.numbers["loss_scale_log2"] == k and ls.numbers["grad_absmax"] == gmax
    check_golden(request, rec)


def _regenerate_act_grads(grad_log2: tuple[float, float], seed: int) -> torch.Tensor:
    b = mlp_run(grad_log2=grad_log2, seed=seed)
    # rebuild the same tensors: mlp_run draws in a fixed order from its generator
    g = torch.Generator().manual_seed(seed)
    out = []
    lo, hi = grad_log2
    for _ in range(2):
        for t in ("Linear", "GELU", "Linear", "Linear"):
            torch.randn(32, 64, generator=g)
            mag = 2.0 ** (lo + (hi - lo) * torch.rand(32, 64, generator=g))
            sign = torch.where(torch.rand(32, 64, generator=g) < 0.5, -1.0, 1.0)
            out.append((mag * sign).flatten())
            if t == "Linear":
                torch.randn(64, 64, generator=g)
                torch.randn(64, 64, generator=g)
    x = torch.cat(out)
    # sanity: the regenerated tensors are the ones in the tables
    ag = pd.DataFrame(b.layers)
    assert float(ag[ag[T.TENSOR] == T.ACTIVATION_GRAD][T.ABSMAX].max()) == float(x.abs().max())
    return x


def test_shift_boundary_value_is_reported() -> None:
    # a value exactly on 2^-25 at the recommended scale rounds to 0 (tie to even) but shares its histogram
    # bin with values that survive: the advisor counts it as a boundary value, not as underflow.
    b = RunBuilder()
    grads = torch.tensor([2.0**-25, 1.5 * 2.0**-25, 2.0**-3])
    b.add(0, 0, "fc", "Linear", T.ACTIVATION, torch.ones(3))
    b.add(0, 0, "fc", "Linear", T.ACTIVATION_GRAD, grads)
    rec = recommend(
        b.tables(), hardware="v100", config=AdvisorConfig(fp16_margin_log2=0, max_loss_scale_log2=0)
    )
    f = must(rec, "fp16_gradient_underflow")
    assert rec.fp16_loss_scale == 1.0
    assert f.numbers["underflow_at_recommended"] == 0
    assert f.numbers["boundary_values_at_recommended"] == 2
    # the exact count sees the tie: 2^-25 -> 0, 1.5 * 2^-25 -> 2^-24
    assert f.numbers["share_now"] == pytest.approx(1 / 3)
    assert grads.half().tolist()[:2] == [0.0, 2.0**-24]


def test_fp16_activation_overflow_keep_list(request: pytest.FixtureRequest) -> None:
    # fc2's activations reach ~4e5 (overflow), act's ~4e4 (within 2x of 65504): a module that computes them (a
    # scale; an element-wise module such as a GELU is kept through the layer that feeds it)
    run = mlp_run(act_scale={"fc2": 1e5, "act": 1e4}, act_type="Scale")
    t = run.tables()
    rec = recommend(t, hardware="t4", summary=summary_for())
    assert rec.format == "fp16"
    assert rec.keep_fp32 == ["act", "fc2"]
    f = must(rec, "fp16_activation_overflow")
    assert f.modules == ["fc2"] and f.severity == "warning"  # what-if on fp32 tensors, not observed inf
    acts = t["layers"][(t["layers"][T.TENSOR] == T.ACTIVATION) & (t["layers"][T.MODULE] == "fc2")]
    assert f.numbers["overflow_values"] == int(acts[T.overflow_col("fp16")].sum()) > 0
    near = must(rec, "fp16_activation_near_overflow")
    assert near.modules == ["act"]
    assert 32752 <= float(near.numbers["absmax"] or 0) < 65520
    # on bf16 hardware the keep list is empty: bf16 holds these values
    rec_a = recommend(t, hardware="a100", summary=summary_for())
    assert rec_a.format == "bf16" and rec_a.keep_fp32 == []
    # a GELU there computes in its input's dtype: fc1, which feeds it, is kept in its place
    gelu = recommend(
        mlp_run(act_scale={"fc2": 1e5, "act": 1e4}).tables(), hardware="t4", summary=summary_for()
    )
    assert gelu.fp16_keep_fp32 == ["fc1", "fc2"]
    check_golden(request, rec)


def test_fp16_observed_inf_names_first_module(request: pytest.FixtureRequest) -> None:
    # an fp16 run: fc2's output became inf and the inf propagated to fc3 and the root
    b = RunBuilder()
    ok = torch.randn(8, 8)
    bad = ok.clone()
    bad[0, 0] = math.inf
    b.add(0, 0, "", "Net", T.ACTIVATION, bad, dtype="float16")
    b.add(0, 1, "fc1", "Linear", T.ACTIVATION, ok, dtype="float16")
    b.add(0, 2, "fc2", "Linear", T.ACTIVATION, bad, dtype="float16")
    b.add(0, 3, "fc3", "Linear", T.ACTIVATION, bad, dtype="float16")
    rec = recommend(b.tables(), hardware="v100", summary=summary_for("fp16"))
    f = must(rec, "fp16_activation_overflow")
    assert f.modules == ["fc2"] and f.severity == "critical"
    nf = must(rec, "nonfinite_forward")
    assert nf.modules == ["fc2"] and nf.numbers["step"] == 0 and nf.numbers["inf"] == 1
    check_golden(request, rec)


def test_an_fp16_output_of_inf_alone_is_said_to_have_no_finite_value() -> None:
    """fc2's fp16 output held inf and nothing else: no largest finite value (its absmax NaN, as the tables have
    it for a tensor without a finite value). The finding said "though its largest finite value is n/a"."""
    b = RunBuilder()
    ok = torch.randn(8, 8)
    b.add(0, 0, "fc1", "Linear", T.ACTIVATION, ok, dtype="float16")
    b.add(0, 1, "fc2", "Linear", T.ACTIVATION, torch.full((8, 8), math.inf), dtype="float16")
    t = b.tables()
    assert math.isnan(t["layers"].set_index(T.MODULE).loc["fc2", T.ABSMAX])
    f = must(recommend(t, hardware="v100", summary=summary_for("fp16")), "fp16_activation_overflow")
    assert f.modules == ["fc2"] and "n/a" not in f.message
    assert "fc2: 64 inf in fp16 and no finite value: its input held a value beyond 65504" in f.message


def test_fp16_blocked_when_most_layers_overflow(request: pytest.FixtureRequest) -> None:
    run = mlp_run(act_scale={"fc1": 1e5, "fc2": 1e5, "fc3": 1e5})
    rec = recommend(run.tables(), hardware="v100", summary=summary_for())
    assert rec.format == "fp32"
    assert rec.keep_fp32 == []
    assert any("3 of 3 matmul layers" in r for r in rec.reasons)
    check_golden(request, rec)


def test_fp16_blocked_when_a_layer_falls_below_fp16(request: pytest.FixtureRequest) -> None:
    # fc3's gradients sit near 2^0 but fc1's near 2^-45: 45 binades apart, more than fp16's 40. At the largest
    # safe scale (set by fc3) every fc1 gradient still flushes to zero: fc1 would learn nothing.
    run = mlp_run(grad_log2=(-2.0, 0.0), grad_log2_by_module={"fc1": (-46.0, -44.0), "act": (-46.0, -44.0)})
    t = run.tables()
    rec = recommend(t, hardware="v100", summary=summary_for())
    f = must(rec, "fp16_gradient_underflow")
    assert f.severity == "critical"
    assert "recovered fp32 accuracy" not in f.message  # the paper's scale of 8: no scale recovers this run
    k = int(math.log2(rec.fp16_loss_scale))
    # independent: fc1's and act's activation gradients, scaled and really cast, all vanish
    ag = t["layers"][t["layers"][T.TENSOR] == T.ACTIVATION_GRAD]
    assert float(ag[ag[T.MODULE] == "fc1"][T.ABSMAX].max()) * 2.0**k < 2.0**-25
    assert f.numbers["max_module_norm_share_at_recommended"] == pytest.approx(1.0)
    assert f.numbers["share_at_recommended"] == pytest.approx(0.5)  # 2 of 4 modules, same sizes
    assert rec.format == "fp32"
    assert recommend(t, hardware="a100", summary=summary_for()).format == "bf16"
    # without a summary the size comes from the weights: 12k parameters, the guide's fp32 default
    small = recommend(t, hardware="a100")
    assert small.format == "fp32" and small.measured_format == "bf16"
    check_golden(request, rec)


def test_fp16_wide_tail_is_not_blocking(request: pytest.FixtureRequest) -> None:
    # every module's gradients are log-uniform over 2^-70..2^0: half the values are far below fp16's range
    # at any safe scale, but they are a negligible tail of each tensor's norm
    run = mlp_run(grad_log2=(-70.0, 0.0))
    rec = recommend(run.tables(), hardware="v100", summary=summary_for())
    f = must(rec, "fp16_gradient_underflow")
    assert float(f.numbers["share_at_recommended"] or 0) > 0.10
    assert float(f.numbers["max_module_norm_share_at_recommended"] or 1) < 1e-3
    assert f.severity == "warning"  # still needs a loss scale: 60% underflow at scale 1
    assert rec.format == "fp16"
    check_golden(request, rec)


def _fp16_overflowing_run(
    init_scale: float, out: Path | None, steps: int = 3, growth_interval: int = 2000, lr: float = 1e-3
) -> list[bool]:
    """A real fp16 autocast run whose gradients (max about 1e3: the loss is 1e5 x an MSE) overflow fp16 at every
    scale from 2^16 down to 2^11; which steps GradScaler skipped. Profiled, every step sampled, into ``out``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    prof = Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, out=out).attach() if out else None
    skipped = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = 1e5 * nn.functional.mse_loss(model(x).float(), y)
        before = scaler.get_scale()
        backward_and_step(loss, opt, scaler)
        skipped.append(scaler.get_scale() < before)
        opt.zero_grad(set_to_none=True)
        if prof is not None:
            prof.step(loss=loss.detach())
    if prof is not None:
        prof.detach()
        prof.save()
    return skipped


def test_a_loss_scale_from_a_lower_bound_promises_nothing(tmp_path: Path) -> None:
    """Every sampled step overflowed fp16, so the largest gradient is known only as a lower bound (65520 / the
    lowest scale that overflowed). The advisor said "starting GradScaler at 2^11 avoids them" of the skips; a
    run started there skips every step too. It now gives 2^11 as the most a start can be, says that the run
    cannot tell whether it avoids the skips, and how to measure the gradients."""
    assert _fp16_overflowing_run(2.0**16, tmp_path / "run") == [True, True, True]
    rec = recommend(tmp_path / "run", hardware="v100")
    scale = must(rec, "fp16_loss_scale")
    k = int(scale.numbers["loss_scale_log2"])
    assert k == 11 and scale.numbers["grad_absmax"] == 65520 / 2**14  # the lowest scale that overflowed: 2^14
    assert scale.title == "fp16 loss scale 2^11 (2048) at the most"
    assert "is at least 4: fp16 gradients became inf at scale 1.64e+04" in scale.message
    assert "every sampled step had inf or nan gradients" in scale.message
    assert "init_scale=2048 at the most" in scale.remedy and "bf16 or fp32" in scale.remedy
    skips = must(rec, "scaler_skipped_steps")
    assert "init_scale=2048) avoids" not in skips.message and "starting GradScaler at" not in skips.message
    assert "whether a start there avoids them the run cannot tell" in skips.message
    assert skips.remedy.startswith(
        "Use a dynamic GradScaler (it backs off until steps go through) at init_scale=2048"
    )
    assert skips.numbers["avoidable"] is None and skips.numbers["above_start_limit"] == 3
    # the promise it made before, tested: a run started at 2^11 still skips every step
    assert _fp16_overflowing_run(2.0**k, None) == [True, True, True]


def _fp16_tail_run(out: Path) -> list[torch.Tensor]:
    """A real fp16 autocast run on the CPU (every activation gradient fp16: CPU autocast keeps GELU in fp16)
    with GradScaler at 2^16 and no skipped step: half of the first layer's units sit at -6, where GELU's slope
    is about 1e-8, so their gradients are a tail of tiny values that carries next to none of the layer's norm.
    Three steps, each sampled; the activation gradients as the test's own hooks saw them (scaled, fp16)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))
    with torch.no_grad():
        model[0].weight[:128].mul_(0.005)
        model[0].bias[:128].fill_(-6.0)
    seen: list[torch.Tensor] = []

    def keep(mod: nn.Module, args: Any, y: torch.Tensor) -> None:
        y.register_hook(lambda g: seen.append(g.detach().clone()))

    for m in model:
        m.register_forward_hook(keep)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, out=out) as prof:
        for step in range(3):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = 60 * model(x).float().square().mean()
            backward_and_step(loss, opt, scaler)
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.save()
    assert scaler.get_scale() == 2.0**16  # no step skipped
    return seen


def test_fp16_underflow_of_a_scaled_run_whose_gradients_are_all_fp16(tmp_path: Path) -> None:
    """Every activation gradient was fp16 (as CPU autocast leaves norms and GELU), and the run's loss scale was
    read from the other rows only: as 1, so a run scaled by 2^16 that lost nothing was warned "Scale the loss"
    (seen on diffusers' UNet and timm's ResNet). And a recommended scale below the run's whose extra losses carry
    none of the gradients' norm ruled fp16 out ("no fp16 loss scale fits": timm's ViT, whose tail of GELU
    gradients the finding itself called negligible). Now the run's scale is every row's, and a tail that
    carries no norm blocks nothing."""
    seen = _fp16_tail_run(tmp_path / "run")
    assert {g.dtype for g in seen} == {torch.float16}
    unscaled = torch.cat([g.float().flatten() / 2.0**16 for g in seen])
    unscaled = unscaled[unscaled != 0]

    def flushed(k: int) -> float:  # a real cast at 2^k of the values the run held
        return float(((unscaled * 2.0**k).to(torch.float16) == 0).float().mean())

    def kept_norm(k: int) -> float:
        back = (unscaled * 2.0**k).to(torch.float16).float() / 2.0**k
        return float(back.square().sum() / unscaled.square().sum())

    assert flushed(0) > 0.2 and flushed(16) == 0.0
    rec = recommend(tmp_path / "run", hardware="v100")
    f = must(rec, "fp16_gradient_underflow")
    assert f.numbers["run_scale_log2"] == 16 and f.numbers["share_now"] is None
    assert f.numbers["share_at_scale_1"] == pytest.approx(flushed(0), abs=0.01)
    assert f.severity == "info" and "Scale the loss" not in f.remedy
    assert f.remedy.startswith("Nothing to fix: at the run's loss scale 2^16 (65536), 0% of the values")
    # the tail the recommended 2^14 flushes, made to count (0.1% allowed instead of 1%): it holds no norm
    k = int(must(rec, "fp16_loss_scale").numbers["loss_scale_log2"])
    strict = recommend(tmp_path / "run", hardware="v100", config=AdvisorConfig(fp16_underflow_ok=0.001))
    f = must(strict, "fp16_gradient_underflow")
    assert k == 14 and flushed(14) > 0.001 and f.numbers["nonzero_values"] == unscaled.numel()
    # the histogram's count: the values surely flushed, and those lying on the rounding boundary (2^-25 at
    # 2^14), which a real cast rounds to 0 as well
    n = round(flushed(14) * unscaled.numel())
    sure, tie = f.numbers["underflow_at_recommended"], f.numbers["boundary_values_at_recommended"]
    assert sure <= n <= sure + tie and sure / unscaled.numel() > 0.001
    assert 1 - kept_norm(14) < 1e-6 and f.numbers["max_module_norm_share_at_recommended"] < 1e-6
    assert f.severity == "info" and "negligible tail" in f.remedy and "bf16 or fp32" not in f.remedy
    assert "Do not lower" not in must(strict, "fp16_loss_scale").remedy


def test_a_scaled_runs_underflow_says_its_own_scale_first(tmp_path: Path) -> None:
    """A GradScaler run at 2^16 whose activation gradients were all fp16 (no exact count) was titled 'fp16
    gradient underflow: 24.9% at scale 1, 0% at 2^14', the share it would lose without its scaler, read as what
    it lost (tester h65's LoRA model at 2^16: '0.191% at scale 1'); its own share, computed, was said nowhere,
    nor shown on the page. Now the title and the message give the share at the run's scale, and scale 1 as the
    what-if it is."""
    seen = _fp16_tail_run(tmp_path / "run")
    unscaled = torch.cat([g.float().flatten() / 2.0**16 for g in seen])
    unscaled = unscaled[unscaled != 0]

    def flushed(k: int) -> float:  # a real cast at 2^k of the values the run held
        return float(((unscaled * 2.0**k).to(torch.float16) == 0).float().mean())

    assert flushed(16) == 0.0 and flushed(0) > 0.2
    f = must(recommend(tmp_path / "run", hardware="v100"), "fp16_gradient_underflow")
    assert f.numbers["loss_scale_log2"] == 14 and f.numbers["run_scale_log2"] == 16
    # the shares the histograms give (those at 2^14 leave out the values lying on the rounding boundary, which
    # a real cast rounds to 0: a lower bound), as the text writes them
    at1, atk = f.numbers["share_at_scale_1"], f.numbers["share_at_recommended"]
    assert at1 == pytest.approx(flushed(0), abs=0.01) and 0 < atk <= flushed(14)
    assert f.numbers["share_at_run_scale"] == flushed(16) == 0.0
    at1_txt, atk_txt = f"{100 * at1:.3g}%", f"{100 * atk:.3g}%"
    assert (
        f.title == f"fp16 gradient underflow: 0% at the run's scale 2^16 (65536), {atk_txt} at 2^14 (16384)"
    )
    assert (
        f"0% at the run's loss scale 2^16 (65536), {at1_txt} at scale 1 had it scaled no loss, and {atk_txt} at the "
        "recommended scale 2^14 (16384)" in f.message
    )
    shown = dict(report_numbers.shown(f.code, f.numbers))
    assert shown["lost in FP16 at this run's loss scale (from the histograms)"] == "0%"
    assert shown["this run's loss scale"] == "65,536 (2^16)"


def test_thrashing_in_an_own_loop_reads_the_scalers_growth_interval(tmp_path: Path) -> None:
    """A Profiler given a GradScaler(growth_interval=2) that thrashes (it grows every 2 steps into an overflow):
    the advisor read the growth interval from the built-in loop's configuration only, said "with
    growth_interval 2000" and advised 4000. It reads the scaler's now."""
    skipped = _fp16_overflowing_run(2.0**4, tmp_path / "run", steps=24, growth_interval=2, lr=0.0)
    assert 3 <= sum(skipped) < 24
    assert T.read_summary(tmp_path / "run")[T.SUMMARY_CAPTURE]["scaler_growth_interval"] == 2
    f = must(recommend(tmp_path / "run", hardware="v100"), "scaler_thrashing")
    assert f.numbers["growth_interval"] == 2 and "with growth_interval 2;" in f.message
    assert f.numbers["recommended_growth_interval"] == 2000 and f.remedy.endswith("growth_interval to 2000.")


def test_a_disabled_grad_scaler_has_no_growth_interval() -> None:
    """nanoGPT hands its loop ``GradScaler(enabled=(dtype == "float16"))``: disabled outside fp16, where it has
    no growth interval (``get_growth_interval()`` raises). The summary read it and raised at the end of the run."""
    model = nn.Linear(4, 4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(AttributeError):
        scaler.get_growth_interval()
    with Profiler(model, scaler=scaler, sample_every=1) as prof:
        model(torch.ones(2, 4)).sum().backward()
        prof.step()
    summary = prof.summary()
    assert summary["scaler_enabled"] is False and summary["scaler_growth_interval"] is None
    # the one reading the HF and Lightning callbacks use too (they read it unguarded)
    from precprof import _compat

    assert _compat.scaler_growth_interval(None) is None
    assert _compat.scaler_growth_interval(torch.amp.GradScaler("cpu", growth_interval=7)) == 7


def test_gradients_summed_over_micro_batches_overflowed_nothing(tmp_path: Path) -> None:
    """fp16 autocast, four micro-batches a step: each micro-batch's fp16 weight gradient stays below 65504 at
    the scale, their fp32 sum (the ``.grad`` recorded) does not. Nothing overflowed, and GradScaler skipped
    nothing, but the advisor warned "Gradients overflow fp16 ... GradScaler skips those steps" of the sums
    (seen on a GPT-2 with gradient accumulation). An fp32 gradient of an fp16 run is what fp16 would do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        model(x).float().sum().backward()
    one = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    scale = 2.0 ** math.floor(math.log2(40000 / one))  # one micro-batch: below 65504; four: above
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same gradient every micro-batch and step
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    with Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, out=tmp_path / "run") as prof:
        for _ in range(2):
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().sum()
                scaler.scale(loss).backward()
            summed = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.save()
    assert scaler.get_scale() == scale  # nothing skipped: no fp16 gradient overflowed
    layers = T.read_tables(tmp_path / "run")["layers"]
    wg = layers[(layers[T.TENSOR] == T.WEIGHT_GRAD) & (layers[T.STEP] == 1)]
    for _, row in wg.iterrows():  # the what-if the rows count: a real cast of the summed .grad
        g = summed[f"{row[T.MODULE]}.{row[T.PARAM]}"]
        assert row[T.DTYPE] == "float32" and row[T.overflow_col("fp16")] == int(
            g.to(torch.float16).isinf().sum()
        )
    assert int(wg[T.overflow_col("fp16")].sum()) > 0
    f = must(recommend(tmp_path / "run", hardware="v100"), "fp16_gradient_overflow")
    assert f.severity == "info" and f.title.startswith("Gradients would overflow fp16")
    assert "these gradients are fp32 in this fp16 run" in f.message and "nothing overflowed here" in f.message


def test_scaler_skipped_steps_and_thrashing(request: pytest.FixtureRequest) -> None:
    # an fp16 run with GradScaler: starts at 2^16, skips while backing off to 2^11, later grows and overflows
    g = torch.Generator().manual_seed(3)
    b = RunBuilder()
    scales = [
        2.0**16,
        2.0**15,
        2.0**14,
        2.0**13,
        2.0**12,
        2.0**11,
        2.0**11,
        2.0**12,
        2.0**11,
        2.0**12,
        2.0**11,
    ]
    skipped = [True, True, True, True, True, False, False, True, False, True, False]
    for s, (sc, sk) in enumerate(zip(scales, skipped, strict=True)):
        grad = torch.randn(16, 16, generator=g) * 4.0  # max |g| ~ 16: overflows fp16 above ~2^12
        b.add(s, 0, "fc", "Linear", T.ACTIVATION, torch.randn(16, 16, generator=g), dtype="float16")
        b.add(s, 0, "fc", "Linear", T.ACTIVATION_GRAD, grad, scale=sc, dtype="float32")
        b.step(s, loss=1.0, scale=sc, skipped=sk)
    summ = summary_for("fp16")
    summ[T.SUMMARY_CONFIG]["growth_interval"] = 1
    rec = recommend(b.tables(), hardware="v100", summary=summ)
    k = int(math.log2(rec.loss_scale or 0))
    f = must(rec, "scaler_skipped_steps")
    assert f.numbers["skipped"] == 7
    # independent: skipped steps at a scale above the recommendation, before the first step that went through
    # (step 5): the start's; after it, growth probes
    assert f.numbers["avoidable"] == sum(
        1 for s, (sc, sk) in enumerate(zip(scales, skipped, strict=True)) if sk and sc > 2.0**k and s < 5
    )
    assert f.numbers["growth_probes"] == sum(
        1 for s, (sc, sk) in enumerate(zip(scales, skipped, strict=True)) if sk and sc > 2.0**k and s > 5
    )
    thr = must(rec, "scaler_thrashing")
    assert thr.numbers["later_skips"] == 2 and thr.numbers["growths"] == 2
    # each growth (steps 7 and 9) overflowed at once: the step at the grown scale was skipped
    grown = [s for s in range(1, len(scales)) if scales[s] > scales[s - 1]]
    assert thr.numbers["costly_growths"] == sum(skipped[s] for s in grown) == 2
    assert rec.growth_interval == 2000  # max(default, 2 x the run's 1)
    ov = must(rec, "fp16_gradient_overflow")
    assert ov.modules == ["fc"]
    check_golden(request, rec)


def test_a_run_whose_every_step_the_scaler_skipped_is_said_never_to_have_trained() -> None:
    """A small MLP under fp16 autocast with GradScaler(init_scale=2^40): its gradients overflow fp16 on each of
    the 4 steps, the scaler halves the scale each time, and no optimizer step goes through: the weights are the
    initial ones at the end. The run got two warnings and a verdict as a normal run's. The scaler's finding is
    critical and says the model never trained and why, by the run's numbers (the scale started too high: still
    above the most a start can be on the last step); the reasons open with it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x = torch.randn(32, 8)
    with Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, memory=False) as prof:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    steps = prof.tables()["steps"]
    assert T.flags(steps[T.SKIPPED]).all() and list(steps[T.LOSS_SCALE]) == [
        2.0**40,
        2.0**39,
        2.0**38,
        2.0**37,
    ]
    rec = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    f = must(rec, "scaler_skipped_steps")
    assert (
        f.severity == "critical"
        and f.title == "No optimizer step was taken: the loss scaler skipped all 4 steps"
    )
    limit = f.numbers["start_scale_limit"] or f.numbers["recommended_scale"]
    assert limit is not None and limit < 2.0**37 and f.numbers["lowest_scale"] == 2.0**37
    assert (
        "Not one optimizer step of the 4 went through: the weights never changed, the model did not train"
        in (f.message)
    )
    k = int(math.log2(limit))
    assert (
        "The loss scale started too high: the scaler halved it on each skip, from 2^40 (1099511627776) down to "
        f"2^37 (137438953472), still above 2^{k} ({2**k})" in f.message
    )
    assert rec.reasons[0].startswith(
        "This run never trained: the loss scaler skipped all 4 of its optimizer steps"
    )
    assert "Save scaler.state_dict()" not in f.remedy  # not resumed


def _scaler_steps(scales: list[float], skipped: list[bool], resumed: int | None) -> Recommendation:
    """The fp16 run of ``test_scaler_skipped_steps_and_thrashing`` (one Linear, gradients ~16) at ``scales``,
    resumed from a checkpoint at step ``resumed``."""
    g = torch.Generator().manual_seed(3)
    b = RunBuilder()
    for s, (sc, sk) in enumerate(zip(scales, skipped, strict=True)):
        b.add(s, 0, "fc", "Linear", T.ACTIVATION, torch.randn(16, 16, generator=g), dtype="float16")
        b.add(s, 0, "fc", "Linear", T.ACTIVATION_GRAD, torch.randn(16, 16, generator=g) * 4, scale=sc)
        b.step(s, loss=1.0, scale=sc, skipped=sk)
        b.steps[-1][T.RESUMED] = s == resumed
    return recommend(b.tables(), hardware="v100", summary=summary_for("fp16"))


def test_a_resume_that_put_the_loss_scale_back_to_its_start_is_said_with_the_remedy() -> None:
    """nanoGPT's checkpoint holds no GradScaler state: a run resumed at step 4 started its scaler over at 2^16,
    after it had backed off to 2^13, and skipped the steps at 2^16 to 2^14 again. The finding said "scale
    started at 65536" and nothing of the restart. It says where the scale went back and from what, how many
    steps were skipped again at scales already backed off from, and to save the scaler's state; a resumed run
    whose scale went on from where it was has no such words."""
    scales = [2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**12, 2.0**12]
    skipped = [True, True, True, False, True, True, True, True, False, False]
    f = must(_scaler_steps(scales, skipped, resumed=4), "scaler_skipped_steps")
    assert f.severity == "warning" and f.numbers["scale_resets"] == 1
    assert (
        "At the resume at step 4 the loss scale went back to its initial 2^16 (65536), from 2^13 (8192) on the "
        "step before: the checkpoint held no GradScaler state, so the scaler started over, and 3 steps were "
        "skipped again at scales it had already backed off from." in f.message
    )
    assert "Save scaler.state_dict() in the checkpoint" in f.remedy
    went_on = [2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**13, 2.0**13, 2.0**13, 2.0**13, 2.0**12, 2.0**12]
    f = must(_scaler_steps(went_on, skipped, resumed=4), "scaler_skipped_steps")
    assert "went back" not in f.message and "state_dict" not in f.remedy and "scale_resets" not in f.numbers


def test_a_run_that_never_stepped_at_or_below_the_recommended_scale_is_told_to_profile_at_a_low_one() -> None:
    """Every step skipped, each at or below the recommended scale (none a lower start avoids): the remedy said
    "Use GradScaler(init_scale=...)"; with no init_scale remedy where no skip is avoidable, it must not read
    "Nothing to change" beside a model that never trained."""
    f = must(
        _scaler_steps([2.0**8, 2.0**7, 2.0**6, 2.0**5], [True] * 4, resumed=None), "scaler_skipped_steps"
    )
    assert (
        f.severity == "critical" and f.numbers["avoidable"] == 0 and f.numbers["recommended_scale"] > 2.0**8
    )
    assert f.remedy.startswith("Profile a few steps at a low scale (--loss-scale static:1)")
    assert "init_scale" not in f.remedy and "Nothing to change" not in f.remedy


def test_lost_updates_bf16_pure(request: pytest.FixtureRequest) -> None:
    g = torch.Generator().manual_seed(4)
    b = mlp_run(steps=1)
    w = torch.randn(64, 64, generator=g) * 0.5
    u = torch.randn(64, 64, generator=g) * 1e-4  # far below bf16's 2^-9 relative step at |w| ~ 0.5
    b.update(0, 0, "fc1", "Linear", w, u)
    w2 = torch.randn(64, 64, generator=g) * 0.01
    u2 = torch.randn(64, 64, generator=g) * 1e-2  # large updates: survive
    b.update(0, 2, "fc2", "Linear", w2, u2)
    t = b.tables()
    rec = recommend(t, hardware="a100", summary=summary_for("bf16-pure"))
    f = must(rec, "bf16_lost_updates")
    assert f.severity == "critical"
    wu = t["layers"][t["layers"][T.TENSOR] == T.WEIGHT_UPDATE]
    assert f.numbers["share"] == pytest.approx(
        wu[T.LOST_UPDATE_BF16].sum() / (wu[T.NUMEL] - wu[T.ZEROS]).sum()
    )
    assert f.modules == ["fc1"]
    # same tables from an autocast run: a what-if (info), bf16 autocast keeps fp32 master weights
    rec2 = recommend(t, hardware="a100", summary=summary_for("bf16"))
    assert codes(rec2)["bf16_lost_updates"] == "info" and rec2.format == "bf16"
    check_golden(request, rec)


def test_lost_updates_leave_out_weights_whose_gradient_was_zero() -> None:
    """An expert no token reached, called with none: its weight gradient is 0 everywhere and AdamW's weight
    decay alone moves it (lr x wd = 1e-5 of the weight, always below bf16's resolution). The finding named such
    experts as the worst layers, 100% lost, ahead of the layers that trained. Their updates are left out of the
    share and the worst, and counted apart."""
    g = torch.Generator().manual_seed(5)
    b = RunBuilder()
    w = torch.randn(32, 32, generator=g)
    u = w * 10 ** (-4 + 3 * torch.rand(32, 32, generator=g))  # 1e-4 .. 1e-1 of the weight: some lost
    b.add(0, 0, "live", "Linear", T.WEIGHT_GRAD, torch.randn(32, 32, generator=g), param="weight")
    b.update(0, 0, "live", "Linear", w, u)
    w_idle = torch.randn(32, 32, generator=g)
    b.add(0, 1, "idle", "Linear", T.WEIGHT_GRAD, torch.zeros(32, 32), param="weight")
    b.update(0, 1, "idle", "Linear", w_idle, -1e-5 * w_idle)
    b.step(0, loss=1.0)
    f = must(recommend(b.tables(), hardware="a100", summary=summary_for("bf16")), "bf16_lost_updates")

    def lost(w: torch.Tensor, u: torch.Tensor) -> int:  # a real bf16 weight plus the update
        return int(((u != 0) & ((w.bfloat16().float() + u).bfloat16() == w.bfloat16())).sum())

    live_lost, idle_lost = lost(w, u), lost(w_idle, -1e-5 * w_idle)
    assert 0 < live_lost < w.numel() and idle_lost == int((w_idle != 0).sum())
    assert f.numbers["lost"] == live_lost and f.numbers["nonzero_updates"] == int((u != 0).sum())
    assert f.numbers["share"] == pytest.approx(live_lost / int((u != 0).sum()))
    assert f.modules == ["live"]
    assert (f.numbers["zero_gradient_updates"], f.numbers["zero_gradient_lost"]) == (
        int((w_idle != 0).sum()),
        idle_lost,
    )
    assert f"Left out: {int((w_idle != 0).sum()):,} update elements of 1 module(s) whose weight gradient" in (
        f.message
    )


def test_the_worst_lost_updates_are_listed_largest_first() -> None:
    """The lost-update finding's "worst:" list was every module above 1% in model order ("q_proj.lora_A 42.6%,
    q_proj.lora_B 2.34%, v_proj.lora_A 43.4%"), and a run with more of them than the list holds kept the first by
    name: it ranks them by share, largest first, ties in model order."""
    g = torch.Generator().manual_seed(7)
    b = RunBuilder()
    shares = {"a": 0.125, "b": 0.5, "c": 0.25, "d": 0.5, "e": 0.0}  # of each module's 32 x 32 updates, lost
    for order, (m, p) in enumerate(shares.items()):
        w = torch.randn(32, 32, generator=g).abs() + 0.5
        lost = torch.arange(w.numel()).reshape(32, 32) < p * w.numel()
        u = torch.where(lost, 1e-6, 1e-1) * w  # 1e-6 of the weight: below bf16's half ulp; 1e-1: lands
        b.add(0, order, m, "Linear", T.WEIGHT_GRAD, torch.randn(32, 32, generator=g), param="weight")
        b.update(0, order, m, "Linear", w, u)
    b.step(0, loss=1.0)
    f = must(recommend(b.tables(), hardware="a100", summary=summary_for("bf16")), "bf16_lost_updates")
    assert f.modules == ["b", "d", "c", "a"]
    assert "; worst: b 50%, d 50%, c 25%, a 12.5%." in f.message


def test_lost_updates_leave_out_the_updates_that_were_nan_or_inf() -> None:
    """A weight whose update was nan at 200 elements and inf at 10 (its weights went non-finite): the finding
    counted them among the intended updates, none lost ("72 of 3,384 intended weight-update elements" in a run
    whose every update after step 0 was nan), and so did the per-layer table. They are left out of both and said
    so; the 'over the run' figure counts them lost, as it counts the other kinds' values already inf/nan."""
    g = torch.Generator().manual_seed(6)
    b = RunBuilder()
    w = torch.randn(32, 32, generator=g)
    u = w * 10 ** (-4 + 3 * torch.rand(32, 32, generator=g))  # 1e-4 .. 1e-1 of the weight: some lost
    u.view(-1)[:200] = math.nan
    u.view(-1)[200:210] = -math.inf
    b.add(0, 0, "fc", "Linear", T.WEIGHT_GRAD, torch.randn(32, 32, generator=g), param="weight")
    b.update(0, 0, "fc", "Linear", w, u)
    b.step(0, loss=1.0)
    tabs = b.tables()
    f = must(recommend(tabs, hardware="a100", summary=summary_for("bf16")), "bf16_lost_updates")
    finite = u.isfinite() & (u != 0)
    w16 = w.bfloat16()
    lost = int((finite & ((w16.float() + u).bfloat16() == w16)).sum())
    assert 0 < lost < int(finite.sum()) == 1024 - 210
    assert (f.numbers["lost"], f.numbers["nonzero_updates"], f.numbers["nonfinite_updates"]) == (
        lost,
        int(finite.sum()),
        210,
    )
    assert f.numbers["share"] == pytest.approx(lost / int(finite.sum()))
    assert "Left out: 210 update elements that were nan or inf, of 1 module(s) (fc:" in f.message
    assert f.title.endswith(
        "of the finite weight updates vanish with bf16 master weights"
    )  # not "of weight updates"
    (row,) = S.layer_records(tabs["layers"])
    assert row["lost_update_bf16"] == pytest.approx(lost / int(finite.sum()))
    by_step = timeline.lost_by_step(tabs["layers"], "bf16")
    upd = by_step[by_step[T.TENSOR] == T.WEIGHT_UPDATE]
    assert upd["lost"].tolist() == [lost + 210] and upd[T.NUMEL].tolist() == [1024]


def test_bf16_gradient_underflow_falls_back_to_fp16(request: pytest.FixtureRequest) -> None:
    # gradients around 2^-150..2^-130 in fp32 (subnormal): bf16 flushes the smaller ones, fp16 with a big
    # scale cannot help either (clamped at 2^32), so the A100 gets tf32
    run = mlp_run(grad_log2=(-140.0, -130.0))
    t = run.tables()
    rec = recommend(t, hardware="a100", summary=summary_for())
    f = must(rec, "bf16_gradient_underflow")
    g = t["layers"][t["layers"][T.TENSOR].isin(T.GRADIENT_KINDS)]
    # independent: share of real bf16 casts, at scale 1, of finite nonzero gradient values
    assert f.numbers["share"] == pytest.approx(
        g[T.underflow_col("bf16")].sum() / (g[T.NUMEL] - g[T.ZEROS]).sum()
    )
    assert rec.format in ("fp16", "tf32")
    assert rec.format == "tf32"  # fp16 blocked as well: even 2^32 leaves these below 2^-25
    check_golden(request, rec)


def _large_gemms(summ: dict[str, Any], width: int = 16384) -> dict[str, Any]:
    """``summ`` declaring fc1..fc3 as ``width`` x ``width`` layers run on 8 x 1024 tokens: GEMMs large enough
    for FP8 to pay (analysis.fp8_speed: two of the three converted, a step estimated at 1.26x host-bound and
    1.25x GPU-bound; 4096-wide ones came out 0.95x once the H200's whole steps set the estimate), while the
    tables' small tensors stand in for their values."""
    summ[T.SUMMARY_CONFIG].update(batch_size=8, seq_len=1024)
    summ[T.SUMMARY_CAPTURE] = {
        "modules": [
            {"name": m, "type": "Linear", "params": {"weight": [width, width]}} for m in ("fc1", "fc2", "fc3")
        ]
    }
    return summ


def _cs_lost_norm(x: torch.Tensor, fmt: str) -> tuple[float, float]:
    """(share of the L2 norm, share of the nonzero values) a real cast to ``fmt`` loses under per-tensor current
    scaling: independent of precprof."""
    x = x.double().flatten()
    k = math.floor(math.log2(_FMAX[fmt] / float(x.abs().max())))
    gone = (x != 0) & ((x * 2.0**k).float().to(_DTYPES[fmt]).float() == 0)
    return float(x[gone].norm() / x.norm()), float(gone.sum() / (x != 0).sum())


def test_fp8_eligibility(request: pytest.FixtureRequest) -> None:
    b = mlp_run(steps=1)
    # fc3's output gradients span 2^-60..2^0: far beyond e5m2's 32 binades under current scaling. Half of their
    # values flush, carrying a negligible share of the norm: eligible (issue 34; before, the count ruled it out)
    g = torch.Generator().manual_seed(5)
    wide = 2.0 ** (-60 * torch.rand(32, 64, generator=g))
    # fc2's weight: one value 2^20 above a million others, which e4m3 under current scaling flushes: they hold
    # 0.2% of its norm, more than the 0.1% allowed
    spike = (2.0 + 2.0 * torch.rand(1024, 1024, generator=g)) * torch.where(
        torch.rand(1024, 1024, generator=g) < 0.5, -1.0, 1.0
    )
    spike[0, 0] = 1.5e6
    drop = {("fc3", T.ACTIVATION_GRAD), ("fc2", T.WEIGHT)}
    b.layers = [r for r in b.layers if (r[T.MODULE], r[T.TENSOR]) not in drop]
    b.hist = [r for r in b.hist if (r[T.MODULE], r[T.TENSOR]) not in drop]
    b.add(0, 3, "fc3", "Linear", T.ACTIVATION_GRAD, wide)
    b.add(0, 2, "fc2", "Linear", T.WEIGHT, spike, param="weight")
    t = b.tables()
    big = _large_gemms(summary_for(n_params=200_000_000))  # FP8 pays only for large GEMMs
    rec = recommend(t, hardware="h100", summary=big)
    assert rec.format == "fp8"
    assert rec.fp8_layers == ["fc1", "fc3"]
    f = must(rec, "fp8_eligibility")
    assert f.numbers["eligible_flops_share"] == pytest.approx(2 / 3)  # three equal layers, two eligible
    # independent: what real casts after current scaling lose; the rule's figures bound the norm from above
    # (within 4x: each lost value at its binade's upper edge, each kept one at its lower edge)
    norm5, values5 = _cs_lost_norm(wide, "fp8_e5m2")
    assert values5 > 0.4 and norm5 < 1e-9
    assert f.numbers["max_e5m2_share"] == pytest.approx(values5)
    lost5 = f.numbers["max_e5m2_lost_norm"]
    assert isinstance(lost5, float) and norm5 <= lost5 <= 4 * norm5 + 1e-300
    norm4, values4 = _cs_lost_norm(spike, "fp8_e4m3")
    assert values4 > 0.99 and norm4 > 1e-3
    lost4 = f.numbers["max_e4m3_lost_norm"]
    assert isinstance(lost4, float) and norm4 <= lost4 <= 4 * norm4
    assert f"fc2 (e4m3 loses up to {lost4 * 100:.3g}% of its input's or weight's norm)" in f.message
    # fc3 is said to lose under the bound's smallest figure, not "no measurable share": it is measured
    assert "fc3 flush more than 1% of their values yet lose under 0.000001% of the norm" in f.message
    assert "both the numbers and the speed allow FP8" in " ".join(rec.reasons)
    speed = must(rec, "fp8_speed").numbers
    assert speed["estimated_speedup"] > AdvisorConfig().fp8_speedup_min  # type: ignore[operator]
    assert speed["layers"] == 2 and speed["layers_bf16"] == 1  # fc2 stays in bf16, part of the step
    # a layer whose tensors held inf or nan on some step is not eligible, whichever kind held them
    bad = {k: v.copy() for k, v in t.items()}
    lay = bad["layers"]
    lay.loc[(lay[T.MODULE] == "fc1") & (lay[T.TENSOR] == T.WEIGHT_GRAD), T.INF] = 1
    rec_bad = recommend(bad, hardware="h100", summary=big)
    f_bad = must(rec_bad, "fp8_eligibility")
    assert f_bad.numbers["eligible"] == 1 and "fc1 (non-finite values)" in f_bad.message
    # no FP8 library on the target: bf16, and a warning
    h = preset("h100")
    h.fp8_library = None
    rec2 = recommend(t, hardware=h, summary=big)
    assert rec2.format == "bf16" and codes(rec2)["fp8_library_missing"] == "warning"
    # fp16's what-ifs are information in an fp32 run whose measurements allow fp8; their titles name the
    # verdict, and when a small model makes it fp32 (where fp8 is not considered), what the measurements allow
    demoted = [f for f in rec.findings if f.numbers.get("demoted_from")]
    assert demoted and all(f.title.endswith("(what fp16 would do; the verdict is fp8)") for f in demoted)
    small = recommend(t, hardware="h100", summary=_large_gemms(summary_for(n_params=1_000_000)))
    demoted = [f for f in small.findings if f.numbers.get("demoted_from")]
    assert small.format == "fp32"
    assert demoted, [f.title for f in small.findings]
    assert all(f.title.endswith("(what fp16 would do; fp8 fits, the verdict is fp32)") for f in demoted), [
        f.title for f in demoted
    ]
    # its "FP8, as measured" code converts fc1 and fc3, the layers the real casts above leave eligible (it took
    # the fp32 verdict's empty fp8_layers: "nothing is converted")
    assert small.measured_format == "fp8" and small.fp8_layers == []
    assert small.measured_fp8_layers == ["fc1", "fc3"]
    measured = {
        label: code for label, code in snippets(small.to_dict()) if label.endswith("FP8, as measured")
    }
    assert len(measured) == 5
    assert all("fp8_layers = {'fc1', 'fc3'}" in code for code in measured.values())
    assert not any("nothing is converted" in code for code in measured.values())
    check_golden(request, rec)


def test_fp8_eligibility_gives_the_norm_a_flushing_eligible_layer_loses() -> None:
    """A layer that flushes over 1% of its values and is eligible loses a measured share of the norm under the
    limit: the finding gave that share ("Largest norm lost: e4m3 0.0657%") and then said the layer loses "no
    measurable share of the norm". Here fc1's weight: N(0, 1) with one value of 1e4, whose scale flushes 2.5%
    of the values, 0.01% of the norm."""
    b = mlp_run(steps=1)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(512, 256, generator=g)
    w[7, 3] = 1e4
    b.layers = [r for r in b.layers if (r[T.MODULE], r[T.TENSOR]) != ("fc1", T.WEIGHT)]
    b.hist = [r for r in b.hist if (r[T.MODULE], r[T.TENSOR]) != ("fc1", T.WEIGHT)]
    b.add(0, 0, "fc1", "Linear", T.WEIGHT, w, param="weight")
    norm, values = _cs_lost_norm(w, "fp8_e4m3")  # real casts
    assert values > 0.01 and 1e-5 < norm < AdvisorConfig().lost_norm_max
    f = must(recommend(b.tables(), hardware="h100", summary=summary_for()), "fp8_eligibility")
    assert "fc1" in f.modules
    lost = f.numbers["max_e4m3_lost_norm"]
    assert isinstance(lost, float) and norm <= lost <= 4 * norm  # the bound, within a binade
    assert (
        f"fc1 flush more than 1% of their values yet lose at most {lost * 100:.3g}% of the norm" in f.message
    )
    assert f"Largest norm lost: e4m3 at most {lost * 100:.3g}% (fc1)" in f.message  # a bound: at most
    assert "no measurable" not in f.message


def test_fp8_median_over_steps_keeps_one_step_from_deciding() -> None:
    """A share reached on one sampled step of five does not rule a layer out: the rule reads the median."""
    b = mlp_run(steps=5)
    g = torch.Generator().manual_seed(7)
    spike = 2.0 + 2.0 * torch.rand(1024, 1024, generator=g)
    spike[0, 0] = 1.5e6
    b.layers = [
        r for r in b.layers if not (r[T.MODULE] == "fc2" and r[T.TENSOR] == T.WEIGHT and r[T.STEP] == 3)
    ]
    b.hist = [r for r in b.hist if not (r[T.MODULE] == "fc2" and r[T.TENSOR] == T.WEIGHT and r[T.STEP] == 3)]
    b.add(3, 2, "fc2", "Linear", T.WEIGHT, spike, param="weight")
    f = must(recommend(b.tables(), hardware="h100", summary=summary_for()), "fp8_eligibility")
    assert "fc2" in f.modules and f.numbers["sampled_steps"] == 5
    assert f.numbers["max_e4m3_lost_norm"] < AdvisorConfig().lost_norm_max  # type: ignore[operator]


def test_fp8_needs_most_of_the_flops_in_eligible_layers() -> None:
    # fc1 and fc2 held inf on a step: fc3 alone carries 1/3 of the matmul FLOPs
    b = mlp_run(steps=1)
    for r in b.layers:
        if r[T.MODULE] in ("fc1", "fc2") and r[T.TENSOR] == T.WEIGHT_GRAD:
            r[T.INF] = 1
    rec = recommend(b.tables(), hardware="h100", summary=_large_gemms(summary_for(n_params=200_000_000)))
    assert rec.format == "bf16" and rec.fp8_layers == []
    assert must(rec, "fp8_eligibility").modules == ["fc3"]
    assert must(rec, "fp8_eligibility").numbers["eligible_flops_share"] == pytest.approx(1 / 3)
    reasons = " ".join(rec.reasons)
    assert "what FP8 would do to the numbers decided" in reasons
    assert "carry 33.3% of the matmul FLOPs of the model's linear layers (matmuls in forward code" in reasons
    assert "left out), not more than 50%" in reasons


def _tied_head_run(head_first: bool = False) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """An embedding 64 x 32, a Linear 32 -> 48 and an output head 32 -> 64 tied to the embedding, recorded as
    the Profiler records a shared weight: once, under the module registered first."""
    b = RunBuilder()
    tokens = 32
    b.add(0, 0, "wte", "Embedding", T.ACTIVATION, torch.randn(tokens, 32))
    b.add(0, 1, "fc", "Linear", T.ACTIVATION, torch.randn(tokens, 48))
    b.add(0, 1, "fc", "Linear", T.ACTIVATION_GRAD, torch.randn(tokens, 48) * 1e-3)
    b.add(0, 1, "fc", "Linear", T.WEIGHT, torch.randn(48, 32) * 0.02, param="weight")
    b.add(0, 2, "head", "Linear", T.ACTIVATION, torch.randn(tokens, 64))
    b.add(0, 2, "head", "Linear", T.ACTIVATION_GRAD, torch.randn(tokens, 64) * 1e-3)
    owner = "head" if head_first else "wte"
    b.add(0, 2 if head_first else 0, owner, "Linear" if head_first else "Embedding", T.WEIGHT,
          torch.randn(64, 32) * 0.02, param="weight")  # fmt: skip
    b.step(0, loss=2.0)
    mods = [
        {"name": "wte", "type": "Embedding", "params": {} if head_first else {"weight": [64, 32]}},
        {"name": "fc", "type": "Linear", "params": {"weight": [48, 32]}},
        {"name": "head", "type": "Linear", "params": {"weight": [64, 32]} if head_first else {}},
    ]
    if head_first:
        mods = [mods[2], mods[0], mods[1]]
    summ = summary_for(batch=4, seq=8, n_params=200_000_000)
    summ[T.SUMMARY_CAPTURE] = {"modules": mods}
    return b.tables(), summ


@pytest.mark.parametrize("head_first", [False, True])
def test_fp8_tied_head_is_not_eligible(head_first: bool) -> None:
    # the old advisor found no shape for the tied head (its weight is recorded under wte) and called it
    # eligible: fp8 with fp8_layers=["head"], which --precision fp8 refuses
    tables, summ = _tied_head_run(head_first)
    rec = recommend(tables, hardware="h100", summary=summ)
    f = must(rec, "fp8_eligibility")
    assert "head (tied to the embedding wte" in f.message and f.numbers["tied"] == 1
    assert f.modules == ["fc"] and "head" not in rec.fp8_layers
    # fc (32 x 48) carries 1536 of 1536 + 2048 FLOPs per token: 43%, not most
    assert f.numbers["eligible_flops_share"] == pytest.approx(1536 / (1536 + 2048))
    assert rec.format == "bf16" and "head is tied to an embedding" in " ".join(rec.reasons)


def test_fp8_unknown_shape_and_tokens_are_not_eligible() -> None:
    tables, summ = _tied_head_run()
    # no modules list and no embedding weight to match: the head's shape is unknown
    layers = tables["layers"]
    tables = {**tables, "layers": layers[~((layers[T.MODULE] == "wte") & (layers[T.TENSOR] == T.WEIGHT))]}
    del summ[T.SUMMARY_CAPTURE]
    f = must(recommend(tables, hardware="h100", summary=summ), "fp8_eligibility")
    assert "head (weight shape unknown: its weight is recorded under another module" in f.message
    assert f.numbers["unknown_shape"] == 1 and f.modules == ["fc"]
    # 4 x 7 = 28 tokens per call: not a multiple of 16, so nothing is eligible
    tables, summ = _tied_head_run()
    summ[T.SUMMARY_CONFIG]["seq_len"] = 7
    layers = tables["layers"].copy()
    layers[T.NUMEL] = layers[T.NUMEL] * 28 // 32
    f = must(recommend({**tables, "layers": layers}, hardware="h100", summary=summ), "fp8_eligibility")
    assert "fc (28 tokens per call, not a multiple of 16)" in f.message and f.modules == []


def test_nonfinite_forward_and_backward(request: pytest.FixtureRequest) -> None:
    b = RunBuilder()
    x = torch.randn(8, 8)
    nan = x.clone()
    nan[1, 1] = math.nan
    # step 0 clean; step 1: block.fc2 produces nan, which reaches block (container), fc3, the root and the loss
    for s in (0, 1):
        bad = nan if s == 1 else x
        b.add(s, 0, "", "Net", T.ACTIVATION, bad)
        b.add(s, 1, "block", "Block", T.ACTIVATION, bad)
        b.add(s, 2, "block.fc1", "Linear", T.ACTIVATION, x)
        b.add(s, 3, "block.fc2", "Linear", T.ACTIVATION, bad)
        b.add(s, 4, "fc3", "Linear", T.ACTIVATION, bad)
        b.step(s, loss=math.nan if s == 1 else 1.0)
    # step 2: forward finite, a nan gradient at the loss end (fc3) and upstream of it
    b.add(2, 2, "block.fc1", "Linear", T.ACTIVATION_GRAD, nan)
    b.add(2, 4, "fc3", "Linear", T.ACTIVATION_GRAD, nan)
    b.add(2, 4, "fc3", "Linear", T.ACTIVATION, x)
    b.step(2, loss=1.0)
    rec = recommend(b.tables(), hardware="a100", summary=summary_for())
    f = must(rec, "nonfinite_forward")
    assert f.modules == ["block.fc2"] and f.numbers["step"] == 1 and f.numbers["nan"] == 1
    bw = must(rec, "nonfinite_backward")
    assert bw.modules == ["fc3"] and bw.numbers["step"] == 2
    check_golden(request, rec)


class SharedDropout(nn.Module):
    """T5's stack: one dropout module applied to the embeddings and again after the blocks, and ``hot``, a
    linear layer whose output overflows fp32 in between (its weights 1e38: a product with an input above 3.4 goes
    beyond fp32's largest value)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dropout = nn.Dropout(0.0)
        self.fc, self.hot, self.norm, self.head = (
            nn.Linear(16, 16),
            nn.Linear(16, 16),
            nn.LayerNorm(16),
            nn.Linear(16, 4),
        )
        with torch.no_grad():
            self.hot.weight.fill_(1e38)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hot(self.fc(self.dropout(x)))
        return self.head(self.dropout(self.norm(h)))


def test_nonfinite_forward_names_the_layer_not_a_module_called_again_after_it() -> None:
    """The dropout's row holds the nan of its second call (the norm of an inf row is nan) at the forward order
    of its first: the finding named it. The first module whose output held inf is ``hot``, checked here by hooks
    on each call."""
    model = SharedDropout()
    x = torch.randn(8, 16) * 10
    calls: list[tuple[str, bool]] = []
    outputs: dict[str, torch.Tensor] = {}
    for name, m in model.named_children():
        m.register_forward_hook(
            lambda m, i, o, name=name: calls.append((name, bool(torch.isfinite(o).all())))
        )
    model.hot.register_forward_hook(lambda m, i, o: outputs.setdefault("hot", o.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Profiler(model, optimizer=opt, sample_every=1) as prof:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        prof.step()
    assert calls[:3] == [("dropout", True), ("fc", True), ("hot", False)]
    assert calls[4] == ("dropout", False)  # its second call, after the norm
    layers = prof.tables()["layers"]
    drop = layers[(layers[T.MODULE] == "dropout") & (layers[T.TENSOR] == T.ACTIVATION)].iloc[0]
    assert drop[T.CALLS] == 2 and drop[T.NAN] > 0 and drop[T.ORDER] < 2  # first by its first call
    f = must(recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}), "nonfinite_forward")
    assert f.modules == ["hot"] and f.title.endswith("forward pass of hot")
    out = outputs["hot"]
    assert (f.numbers["nan"], f.numbers["inf"]) == (int(out.isnan().sum()), int(out.isinf().sum()))
    assert "it is the first module called once in forward order to do so" in f.message
    assert "dropout holds nan/inf too and comes earlier by its first call" in f.message


class Amplified(nn.Module):
    """x times an fp32 scale of 1e5 (fp32 under autocast, beyond fp16's 65504), then ``direct``: a Linear reads
    it (autocast casts it to fp16 there), else a residual through a LayerNorm, which leaves it fp32."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = LayerScale(32)
        with torch.no_grad():
            self.scale.gamma.fill_(1e5)
        self.norm, self.fc, self.norm2, self.head = (
            nn.LayerNorm(32),
            nn.Linear(32, 32),
            nn.LayerNorm(32),
            nn.Linear(32, 8),
        )
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.scale(x)
        if self.direct:
            return self.head(self.fc(h).float().clamp(-1, 1))
        h = h + self.fc(self.norm(h))
        return self.head(self.norm2(h))


@pytest.mark.parametrize("blocks", ["1", "0"])
@pytest.mark.parametrize("direct", [False, True])
def test_an_fp32_tensor_autocast_leaves_alone_is_no_fp16_overflow(
    direct: bool, blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 residual of 1e5 (an fp32 scale promotes it) read through LayerNorms: a bf16 run was told
    "Activations overflow fp16 in 1 module(s)", and so was the real fp16 autocast run, which held no inf and
    trained. fp16 autocast leaves that tensor fp32: no finding now. The same tensor read by a Linear, which
    autocast casts to fp16: the bf16 run's what-if names it, and the real fp16 run does overflow there. With
    the block-format what-if on and off (off, the capture did not record what the matmuls read, and the false
    finding came back)."""
    monkeypatch.setenv("PRECPROF_BLOCK_FORMATS", blocks)
    x = torch.randn(16, 32)
    runs = {
        prec: train_profiled(
            Amplified(direct), lambda _: (x, x), square_mean, precision=prec, loss_scale=scale, steps=2
        )
        for prec, scale in (("bf16", None), ("fp16", 1024.0))
    }
    real = activations(runs["fp16"].tables)
    real_bad = int((real[T.INF] + real[T.NAN]).sum())
    f = runs["bf16"].recommend().finding("fp16_activation_overflow")
    if not direct:
        assert real_bad == 0 and all(math.isfinite(v) for v in runs["fp16"].losses)
        assert f is None and runs["fp16"].recommend().finding("fp16_activation_overflow") is None
        return
    assert real_bad > 0  # the Linear's fp16 input overflowed: its output is nan
    assert f is not None and "scale" in f.modules  # fc's bf16 output, beyond 65504 too, with it


def _fp16_adam_run(mode: str, tmp_path: Path | None = None) -> tuple[Profiler, dict[str, Any]]:
    """An MLP trained 4 steps with AdamW on small gradients: ``pure`` (the model .half(), eps 1e-8), ``eps``
    (the same, eps 1e-4) or ``autocast`` (fp32 weights under fp16 autocast with a GradScaler). Returns the
    Profiler (sampling every step) and, for ``pure``, step 0's weight gradients and the optimizer's states
    after step 0, copied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    if mode != "autocast":
        model.half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4 if mode == "eps" else 1e-8)
    scaler = torch.amp.GradScaler("cpu") if mode == "autocast" else None
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    seen: dict[str, Any] = {}
    with Profiler(model, optimizer=opt, scaler=scaler, sample_every=1) as prof:
        for step in range(4):
            if scaler is not None:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = (model(x).float() - y).square().mean()
                backward_and_step(loss, opt, scaler)
            else:
                loss = (model(x.half()).float() - y).square().mean()
                loss.backward()
                if step == 0:
                    seen["grads"] = [p.grad.float().clone() for p in model.parameters()]  # type: ignore[union-attr]
                opt.step()
                if step == 0:
                    seen["states"] = [
                        (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                        for p in model.parameters()
                    ]
                    seen["weights"] = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            prof.step(loss=loss.detach())
    if tmp_path is not None:
        prof.save(tmp_path)
    return prof, seen


def test_adam_on_fp16_weights_is_found_writing_the_nan_and_told_why(tmp_path: Path) -> None:
    """The model .half() and AdamW with its default eps: the loss is nan from step 1 on. The finding named the
    first module's forward pass and said "a division, log or exp without a guard, or an fp16 overflow". What
    happened: eps (1e-8) is 0 in fp16, and (1 - beta2) g^2 rounds to 0 for |g| < 5.5e-3, so for most elements
    the second moment stays 0 and the update divides by zero: the optimizer step of step 0 wrote inf into
    weights that were finite, from finite gradients. Checked against the optimizer's own states: the weights
    that became non-finite are exactly those whose second moment is 0. Followed, the remedy trains."""
    prof, seen = _fp16_adam_run("pure", tmp_path)
    rec = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    f = must(rec, "nonfinite_forward")
    assert f.title == "nan/inf first appears in the weights: the optimizer step of step 0 wrote it"
    assert f.modules == ["0", "2"] and f.numbers["weights_step"] == 0 and f.numbers["step"] == 1
    # independent: the non-finite weights after step 0 are those whose second moment is 0
    bad = sum(int((~torch.isfinite(w)).sum()) for w in seen["weights"])
    v_zero = sum(int((v == 0).sum()) for _, v in seen["states"])
    assert bad == v_zero == f.numbers["nan"] + f.numbers["inf"]
    assert all(
        torch.equal(~torch.isfinite(w), v == 0)
        for w, (_, v) in zip(seen["weights"], seen["states"], strict=True)
    )
    assert f.numbers["eps"] == 1e-8 and f.numbers["beta2"] == 0.999
    bound = float(f.numbers["gradient_bound"] or 0)
    assert bound == pytest.approx(math.sqrt(2.0**-25 / 1e-3))
    # a lower bound from whole binades: at least the gradients below bound's binade, at most those below bound
    g = torch.cat([t.flatten() for t in seen["grads"]])  # both modules' parameters, biases too
    g = g[g != 0].abs()
    assert f.numbers["gradients"] == g.numel()
    floor = 2.0 ** math.floor(math.log2(bound))
    assert int((g < floor).sum()) <= int(f.numbers["gradients_below"] or 0) <= int((g < bound).sum())
    assert "AdamW's eps (1e-08) is 0 in fp16" in f.message and "divides by zero" in f.message
    assert f.remedy.startswith("Keep the weights and the optimizer's states in fp32")
    html = Path(prof.report(tmp_path / "report.html")).read_text()
    assert "AdamW (eps 1.00e-08, beta2 0.999)" in html
    # the remedy, followed: fp32 weights under fp16 autocast with a GradScaler, or an eps fp16 holds
    for mode in ("autocast", "eps"):
        prof, _ = _fp16_adam_run(mode)
        losses = prof.tables()["steps"][T.LOSS]
        assert losses.map(math.isfinite).all(), mode
        rec = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
        assert rec.finding("nonfinite_forward") is None and rec.finding("run_diverged") is None


class NanOutsideItsModules(nn.Module):
    """emb then out, and from step ``nan_from`` on a nan made by its own forward code after ``out``: no module's
    hook sees it, only the loss does."""

    def __init__(self, nan_from: int) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.nan_from, self.step = nan_from, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.emb(x))
        return logits * float("nan") if self.step >= self.nan_from else logits


@pytest.mark.parametrize("nan_from", [0, 2])
def test_a_nan_made_outside_the_modules_is_dated_by_the_loss(nan_from: int) -> None:
    """The nan comes from the model's own forward code after its last submodule. The finding blamed emb, the
    first module whose output was nan, one step late (the optimizer step of the nan step had written nan into
    every weight), and the backward finding said "the forward pass was finite" of a step whose loss was nan.
    It names the step of the first nan loss and code outside the captured modules. Checked against the losses
    and the modules' outputs as this loop's own hooks saw them."""
    torch.manual_seed(0)
    model = NanOutsideItsModules(nan_from)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    finite: dict[int, list[bool]] = {}
    for m in (model.emb, model.out):
        m.register_forward_hook(lambda m, i, o: finite[model.step].append(bool(torch.isfinite(o).all())))
    losses = []
    with Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(5):
            model.step = step
            finite[step] = []
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            losses.append(float(loss.detach()))
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    first_nan = next(s for s, v in enumerate(losses) if not math.isfinite(v))
    assert first_nan == nan_from and finite[first_nan] == [True, True]  # every module output finite then
    assert not all(finite[first_nan + 1])  # and nan in the modules from the next step on
    rec = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    f = must(rec, "nonfinite_forward")
    assert f.numbers["step"] == first_nan and f.numbers["finite_modules"] == 2 and f.modules == []
    assert f.message.startswith(f"At step {first_nan}, the loss was nan while every output and weight")
    assert "outside the captured modules" in f.message and "emb" not in f.message
    assert f.numbers["steps_affected"] == 5 - first_nan
    assert rec.finding("nonfinite_backward") is None  # that step's gradients are the nan loss's
    assert not [g for g in rec.findings if "forward pass was finite" in g.message]


class NanOutsideAfterAFunction(NanOutsideItsModules):
    """The same, with out reading a function's output (tanh), which block formats record as out's input row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.out(torch.tanh(self.emb(x)))
        return logits * float("nan") if self.step >= self.nan_from else logits


@pytest.mark.usefixtures("block_formats_on")
def test_a_layers_input_row_is_not_counted_as_a_module_of_its_own() -> None:
    """With block formats on, out's input has a row of its own ("out:input"). The finding said "every output and
    weight of the 3 module(s) recorded" of a model of two (the nan run of the report: 11 of 9 layers profiled).
    It counts the modules, each input row with the layer reading it."""
    torch.manual_seed(0)
    model = NanOutsideAfterAFunction(nan_from=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    with Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(3):
            model.step = step
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    layers = prof.tables()["layers"]
    assert T.input_module("out") in set(layers[T.MODULE])  # the row the count must not add
    leaves = [name for name, m in model.named_modules() if name and not list(m.children())]
    f = must(recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}), "nonfinite_forward")
    assert f.numbers["finite_modules"] == len(leaves) == 2
    assert "every output and weight of the 2 module(s) recorded" in f.message


@pytest.mark.parametrize("blown_by", ["adamw", "sgd"])
def test_beside_another_optimizer_adam_is_told_of_its_own_weights_only(blown_by: str) -> None:
    """An fp16 model stepped by two optimizers: SGD for the linear layers, AdamW (eps 1e-8, 0 in fp16) for the
    LayerNorm. The Adam clause matched "Adam" in "SGD + AdamW" and judged every non-finite weight: an SGD whose
    learning rate overflows its fp16 weights was explained by AdamW's eps. Now only the weights an Adam holds
    are judged and counted. ``adamw``: small gradients, AdamW writes inf into the LayerNorm (the elements whose
    second moment is 0) and SGD's weights stay finite; ``sgd``: large gradients, SGD's update overflows its
    weights and AdamW's stay finite. Checked against the weights after step 0 and the gradients of step 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64)).half()
    adam = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
    sgd = torch.optim.SGD(
        [*model[0].parameters(), *model[2].parameters()], lr=6e4 if blown_by == "sgd" else 1.0
    )
    x, y = torch.randn(32, 64).half(), torch.randn(32, 64)
    seen: dict[str, Any] = {}
    with Profiler(model, optimizer=[sgd, adam], sample_every=1) as prof:
        for step in range(3):
            loss = (model(x).float() - y).square().mean() * (1e4 if blown_by == "sgd" else 100.0)
            loss.backward()
            if step == 0:
                seen["ln_grads"] = torch.cat([p.grad.flatten().float() for p in model[1].parameters()])  # type: ignore[union-attr]
            sgd.step()
            adam.step()
            if step == 0:
                seen["finite"] = [bool(torch.isfinite(p).all()) for p in model.parameters()]
            sgd.zero_grad()
            adam.zero_grad()
            prof.step(loss=loss.detach())
    assert prof.summary()["optimizer"]["adam_modules"] == ["1"]
    f = must(recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}), "nonfinite_forward")
    assert f.title == "nan/inf first appears in the weights: the optimizer step of step 0 wrote it"
    if blown_by == "sgd":  # the linear layers' weights and biases, not the LayerNorm's
        assert seen["finite"] == [False, False, True, True, False, False] and f.modules == ["0", "2"]
        assert "eps" not in f.numbers and "AdamW" not in f.message and "overflows" in f.remedy
    else:
        assert seen["finite"] == [True, True, False, False, True, True] and f.modules == ["1"]
        g = seen["ln_grads"]
        assert f.numbers["eps"] == 1e-8 and f.numbers["gradients"] == int((g != 0).sum())
        assert "AdamW's eps (1e-08) is 0 in fp16" in f.message


class Standardize(nn.Module):
    """(x - mean) / std over the batch, without an eps: a batch of one row repeated is 0/0, nan."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)


def _standardized_run(
    sample_every: int, lr: float = 1e-2, bad_step: int | None = 6
) -> tuple[Profiler, list[float]]:
    """An fp32 MLP with a ``Standardize`` trained 12 steps with SGD, no loss scaler; at ``bad_step`` the batch is
    one row repeated, so its forward pass is 0/0. Returns the Profiler and the losses the loop computed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Standardize(), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    losses = []
    with Profiler(model, optimizer=opt, sample_every=sample_every) as prof:
        for step in range(12):
            xb = x[:1].expand(16, 8) if step == bad_step else x
            loss = (model(xb) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            prof.step(loss=loss.detach())
    return prof, losses


def test_a_nan_loss_at_an_unsampled_step_is_dated_by_the_steps_table_not_blamed_on_the_optimizer() -> None:
    """An fp32 run whose forward pass goes 0/0 at step 6, not sampled (sample_every=4): the weights are nan at
    the next sampled step, finite at step 4. The finding said "an optimizer step from step 4 to step 7 wrote
    it ... turned finite gradients into non-finite weights" and told to keep fp32 master weights, of weights
    already fp32 (tester t1). The steps table has every step's loss: finite to step 5, nan at step 6, before
    its optimizer step ran. Now it dates the nan there, says the optimizer steps before it were finite, and
    tells to sample that step; sampled (sample_every=1), the same run names the Standardize at step 6."""
    prof, losses = _standardized_run(4)
    first_nan = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    steps = prof.tables()["steps"]
    sampled = {int(s) for s in steps[steps[T.SAMPLED]][T.STEP]}
    assert first_nan == 6 and 6 not in sampled and 4 in sampled
    f = must(recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}), "nonfinite_forward")
    assert f.title == "nan/inf first appears at step 6, which was not sampled: its loss was nan"
    assert f.numbers["step"] == 6 and f.numbers["sampled_before"] == 4 and f.numbers["skipped"] == 0
    after = int(f.numbers["sampled_after"] or 0)
    assert after == min(s for s in sampled if s > 6)
    assert (
        "forward pass or the loss of step 6" in f.message
        and "optimizer steps before it were finite" in f.message
    )
    assert "sample_every=1" in f.remedy and "master weights" not in f.remedy and f.modules == []
    # sampled, the step names its module, as before
    prof, _ = _standardized_run(1)
    f = must(recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}), "nonfinite_forward")
    assert f.modules == ["1"] and f.numbers["step"] == 6 and "forward pass of" in f.title


def test_an_optimizer_overflowing_fp32_weights_is_not_told_to_keep_fp32_master_weights() -> None:
    """SGD at a learning rate of 1e38 on gradients above 10 writes inf into fp32 weights at step 0. The finding
    told to keep fp32 master weights, which they are; it says so only of 16-bit weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    finite_after = []
    with Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(3):
            loss = (model(x) - y).square().mean() * 1e3
            loss.backward()
            opt.step()
            opt.zero_grad()
            finite_after.append(all(bool(torch.isfinite(p).all()) for p in model.parameters()))
            prof.step(loss=loss.detach())
    assert finite_after[0] is False
    f = must(recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}), "nonfinite_forward")
    assert f.title == "nan/inf first appears in the weights: the optimizer step of step 0 wrote it"
    assert "(float32)" in f.remedy and "master weights" not in f.remedy and "learning rate" in f.remedy


class LayerScaleBlock(nn.Module):
    """A ConvNeXt-like residual block: x + gamma * fc(x), gamma an fp32 parameter of 1e-7 (ConvNeXt starts its
    at 1e-6): under autocast the product is fp32 (gamma promotes it) and tiny. ``tiny_bf16``: a second Linear
    whose output autocast makes 16-bit and tiny (weights of 1e-8), which a fp16 run would flush."""

    def __init__(self, tiny_16bit: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.scale = nn.Linear(32, 32), LayerScale(32)
        self.tiny = nn.Linear(32, 32) if tiny_16bit else None
        if self.tiny is not None:
            nn.init.normal_(self.tiny.weight, std=1e-9)
            nn.init.zeros_(self.tiny.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.scale(self.fc(x))
        return h + self.tiny(h).float() * 1e8 if self.tiny is not None else h


class LayerScale(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 1e-7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


@pytest.mark.parametrize("blocks", ["1", "0"])
@pytest.mark.parametrize(
    ("dtype", "tiny_16bit"), [("bfloat16", False), ("float16", False), ("bfloat16", True)]
)
def test_fp32_tensors_of_an_autocast_run_are_no_fp16_underflow(
    dtype: str, tiny_16bit: bool, blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ConvNeXt under fp16 autocast was warned "7.75% of activation values flush to zero in fp16 ... Keep these
    modules in fp32", of its layer-scaled branches: fp32 tensors (the fp32 layer scale promotes the product),
    which no autocast casts to fp16, and which flushed nowhere. Under autocast the what-if now counts the tensors
    autocast made 16-bit, and fp32 ones a matmul reads (autocast casts them there); a 16-bit output with values
    below 2^-25 is still found. With the block-format what-if on and off."""
    monkeypatch.setenv("PRECPROF_BLOCK_FORMATS", blocks)
    x = torch.randn(8, 32)
    precision, scale = ("fp16", 65536.0) if dtype == "float16" else ("bf16", None)
    run = train_profiled(
        LayerScaleBlock(tiny_16bit),
        lambda _: (x, x),
        square_mean,
        precision=precision,
        loss_scale=scale,
        steps=2,
    )
    acts = activations(run.tables)
    scale = acts[acts[T.MODULE] == "scale"]
    assert set(scale[T.DTYPE]) == {"float32"}
    first = scale[scale[T.STEP] == 0]  # before AdamW moves gamma to about its learning rate
    assert int(first[T.underflow_col("fp16")].sum()) > int(first[T.NUMEL].sum()) // 4  # what fp16 would flush
    f = run.recommend().finding("fp16_activation_underflow")
    if not tiny_16bit:
        assert f is None
        return
    tiny = acts[acts[T.MODULE] == "tiny"]
    assert set(tiny[T.DTYPE]) == {dtype} and int(tiny[T.underflow_col("fp16")].sum()) > 0
    assert f is not None and f.modules == ["tiny"]
    assert f.numbers["underflow_values"] == int(tiny[T.underflow_col("fp16")].sum())


class ConvScaled(nn.Module):
    """A convolution, an fp32 layer scale of 1e-7 per channel (its product stays fp32 under autocast), and a
    second convolution that reads that product: autocast casts it to 16 bits there, and fp16 flushes most of it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.scale = ChannelScale(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.scale(self.conv1(x)))


class ChannelScale(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((c, 1, 1), 1e-7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


@pytest.mark.parametrize("blocks", ["1", "0"])
def test_an_fp32_tensor_a_convolution_reads_is_fp16_underflow(
    blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny fp32 product of a layer scale, read by a convolution: fp16 autocast casts it to fp16 as the
    convolution's input, and most of it flushes. The capture recorded only what linear layers read, so under
    bf16 autocast the what-if left it out and nothing was said. The finding's count is the flush a real cast to
    fp16 makes of the convolution's input (counted by the test's own hook, step by step)."""
    monkeypatch.setenv("PRECPROF_BLOCK_FORMATS", blocks)
    model, flushed = ConvScaled(), []

    def count(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()
        flushed.append(int(((x != 0) & (x.to(torch.float16) == 0)).sum()))

    model.conv2.register_forward_pre_hook(count)
    x = torch.randn(2, 4, 8, 8)
    run = train_profiled(model, lambda _: (x, x), square_mean, precision="bf16", steps=2)
    acts = activations(run.tables)
    scale = acts[acts[T.MODULE] == "scale"]
    assert set(scale[T.DTYPE]) == {"float32"} and flushed[0] > scale[T.NUMEL].iloc[0] // 4
    assert run.summary[T.SUMMARY_CAPTURE]["gemm_inputs"]["conv2"] == ["scale"]
    f = run.recommend().finding("fp16_activation_underflow")
    assert f is not None and f.modules == ["scale"] and f.numbers["underflow_values"] == sum(flushed)


def test_scaler_inf_gradients_are_not_a_nonfinite_finding() -> None:
    b = RunBuilder()
    g = torch.randn(8, 8)
    g[0, 0] = math.inf
    b.add(0, 0, "fc", "Linear", T.ACTIVATION, torch.randn(8, 8), dtype="float16")
    b.add(0, 0, "fc", "Linear", T.ACTIVATION_GRAD, g, scale=65536.0, dtype="float16")
    b.step(0, loss=1.0, scale=65536.0, skipped=True)
    rec = recommend(b.tables(), hardware="v100", summary=summary_for("fp16"))
    assert "nonfinite_backward" not in codes(rec)
    assert "scaler_skipped_steps" in codes(rec)
    # the inf bounds the true gradient from below: >= 65520 / 65536
    ls = must(rec, "fp16_loss_scale")
    assert float(ls.numbers["grad_absmax"] or 0) == pytest.approx(
        max(65520 / 65536, float(g[torch.isfinite(g)].abs().max()))
    )


@pytest.mark.parametrize("size", [450.0, 0.1])
def test_a_long_back_off_is_an_overflow_when_the_gradients_exceed_fp16_at_its_starting_scale(
    size: float,
) -> None:
    """As in a real run with SGD at lr 1e3: after the first update the gradients grow to ~450 and GradScaler
    needs 9 back-offs from 2^16 before a step goes through. 450 x 2^16 is far beyond 65504: an overflow, not a
    nan from the model, although the back-off exceeds ``nonfinite_backoff_log2``. The same skips with
    gradients of 0.1 (0.1 x 2^16 < 65504) are not explained by the scale."""
    g = torch.Generator().manual_seed(5)
    b = RunBuilder()
    scales = [2.0**16, *(2.0 ** (16 - i) for i in range(9)), 2.0**7, 2.0**7]
    for s, sc in enumerate(scales):
        skipped = 1 <= s <= 9
        grad = torch.randn(8, 8, generator=g) * size
        if skipped:
            grad[0, 0] = math.inf
        b.add(s, 0, "fc", "Linear", T.ACTIVATION, torch.randn(8, 8, generator=g), dtype="float16")
        b.add(s, 0, "fc", "Linear", T.ACTIVATION_GRAD, grad, scale=sc, dtype="float16")
        b.step(s, loss=1.0, scale=sc, skipped=skipped)
    rec = recommend(b.tables(), hardware="v100", summary=summary_for("fp16"))
    sk = must(rec, "scaler_skipped_steps")
    assert sk.numbers["skipped"] == 9
    f = rec.finding("nonfinite_backward")
    if size > 1:
        assert f is None and sk.numbers["from_model"] == 0
    else:
        assert f is not None and (f.numbers["step"], f.numbers["skipped_steps"]) == (1, 9)
        assert sk.numbers["from_model"] == 9 and sk.numbers["avoidable"] == 0
        peak = float(f.numbers["grad_peak"] or 0)
        assert peak * 2.0**16 < 65504 and f"{peak:.3g} x 65536" in f.message


@pytest.mark.parametrize("all_fp32", [True, False])
def test_mixed_precision_inactive(request: pytest.FixtureRequest, all_fp32: bool) -> None:
    b = RunBuilder()
    for i, m in enumerate(["wte", "h.0.attn.c_attn", "h.0.mlp.c_fc", "lm_head"]):
        t = "Embedding" if m == "wte" else ("Conv1D" if "c_" in m else "Linear")
        dt = "float32" if all_fp32 or m == "lm_head" else "float16"
        b.add(0, i, m, t, T.ACTIVATION, torch.randn(4, 8), dtype=dt)
    rec = recommend(b.tables(), hardware="cpu", summary=summary_for("fp16"))
    if all_fp32:
        f = must(rec, "mixed_precision_inactive")
        assert f.severity == "critical"
        # the embedding is a gather, not a matmul: not counted
        assert f.modules == ["h.0.attn.c_attn", "h.0.mlp.c_fc", "lm_head"]
    else:
        f = must(rec, "mixed_precision_partial")
        assert f.modules == ["lm_head"] and f.numbers["share"] == pytest.approx(1 / 3)
    check_golden(request, rec)


def test_tensor_core_alignment(request: pytest.FixtureRequest) -> None:
    # batch 3 x seq 7 = 21 tokens; an embedding 50257 x 48 and a linear 48 -> 100
    b = RunBuilder()
    tokens = 21
    b.add(0, 0, "wte", "Embedding", T.ACTIVATION, torch.randn(tokens, 48))
    b.add(0, 0, "wte", "Embedding", T.WEIGHT, torch.zeros(50257 * 48), param="weight")
    b.add(0, 1, "fc", "Linear", T.ACTIVATION, torch.randn(2 * tokens, 100), calls=2)
    b.add(0, 1, "fc", "Linear", T.WEIGHT, torch.randn(100, 48), param="weight")
    b.add(0, 2, "head", "Linear", T.ACTIVATION, torch.randn(tokens, 64))
    b.add(0, 2, "head", "Linear", T.WEIGHT, torch.randn(64, 100), param="weight")
    summ = summary_for(batch=3, seq=7, dims={"n_embd": 48, "vocab_size": 50257, "n_head": 8, "n_layer": 3})
    rec = recommend(b.tables(), hardware="a100", summary=summ)
    f = must(rec, "tensor_core_alignment")
    assert f.severity == "warning"
    # wte's 50257 x 48 is a gather's table (the head has its own weight): the vocabulary is said as a model dim
    assert f.modules == ["fc", "head"]
    assert "wte" not in f.message and "vocab_size=50257" in f.message
    assert "fc (out=100)" in f.message and "head (in=100)" in f.message
    assert (
        f.numbers["dim_vocab_size"] == 50257 and f.numbers["dim_head_dim"] == 6 and f.numbers["tokens"] == 21
    )
    assert "n_layer" not in f.message
    check_golden(request, rec)


def test_small_model_and_roundtrip(tmp_path: Path, benign: dict[str, pd.DataFrame]) -> None:
    summ = summary_for(n_params=3 * 64 * 64)
    summ[T.SUMMARY_HARDWARE] = preset("a100").to_dict()
    summ[T.SUMMARY_HARDWARE]["preset"] = None
    rec = recommend(benign, summary=summ)
    f = must(rec, "small_model")
    assert f.numbers["n_params"] == 3 * 64 * 64
    # hardware=None uses the recording machine from the summary; a 12k-parameter model gets the guide's
    # default, fp32, with what the measurements allow and why
    assert rec.target == "A100" and rec.format == "fp32" and rec.measured_format == "bf16"
    assert "the guide's default is fp32" in rec.reasons[0] and rec.reasons[1].startswith("bf16: ")
    # round trip through JSON, and through a run directory
    again = Recommendation.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert again == rec
    T.write_tables(tmp_path, benign)
    T.write_summary(tmp_path, summ)
    assert recommend(tmp_path) == rec
    v100 = recommend(str(tmp_path), hardware="v100")
    assert v100.format == "fp32" and v100.measured_format == "fp16"
    text = rec.describe()
    assert text.startswith("Recommended for A100: fp32")
    # parameter count from the weight rows when the summary has none
    rec2 = recommend(benign, hardware="a100")
    assert must(rec2, "small_model").numbers["n_params"] == 3 * 64 * 64


@pytest.mark.parametrize(("width", "said"), [(64, "12,288"), (400, "480 K"), (640, "1.23 M")])
def test_a_small_models_parameters_are_counted_as_people_say_them(
    benign: dict[str, pd.DataFrame], width: int, said: str
) -> None:
    """ "Small model: 0.00739M parameters" and "The model has 10560 parameters" (no separator) beside the header's
    "10,560": the count reads "12,288" below 100,000, in K or M above, as the three 64-, 400- and 640-wide
    square layers' weights count (torch's numel)."""
    n = sum(nn.Linear(width, width, bias=False).weight.numel() for _ in range(3))
    rec = recommend(benign, summary=summary_for(n_params=n), hardware="a100")
    f = must(rec, "small_model")
    assert f.title == f"Small model: {said} parameters"
    assert f.message.startswith(f"The model has {said} parameters, below 100 M: ")
    assert rec.reasons[0].startswith(f"The model has {said} parameters, under 100 M: ")


def test_tf32_off_on_recording_machine() -> None:
    t = mlp_run(steps=1).tables()
    rec_hw = HardwareInfo.from_dict(
        {**preset("a100").to_dict(), "preset": None, "tf32_matmul_enabled": False}
    )
    summ = summary_for()
    summ[T.SUMMARY_HARDWARE] = rec_hw.to_dict()
    rec = recommend(t, summary=summ)
    assert codes(rec)["tf32_off"] == "warning"
    # planning for a preset target says nothing about this machine's flags
    assert "tf32_off" not in codes(recommend(t, hardware="a100", summary=summ))


def test_config_thresholds_move_the_decision(benign: dict[str, pd.DataFrame]) -> None:
    base = recommend(benign, hardware="v100")
    wide = recommend(benign, hardware="v100", config=AdvisorConfig(fp16_margin_log2=4))
    assert wide.fp16_loss_scale == base.fp16_loss_scale / 4
    capped = recommend(benign, hardware="v100", config=AdvisorConfig(max_loss_scale_log2=3))
    assert capped.fp16_loss_scale == 8.0
    assert "clamped" in must(capped, "fp16_loss_scale").message


def test_empty_tables_still_recommend() -> None:
    rec = recommend({}, hardware="v100")
    assert rec.format == "fp16" and rec.fp16_loss_scale == 2.0**16
    assert must(rec, "fp16_loss_scale").numbers["grad_absmax"] is None
    with pytest.raises(FileNotFoundError):
        recommend("/nonexistent/run")
    with pytest.raises(ValueError, match="known targets"):
        recommend({}, hardware="z80")


def test_is_matmul_layer() -> None:
    assert all(
        map(
            is_matmul_layer, ["Linear", "Conv1D", "Conv2d", "NonDynamicallyQuantizableLinear", "Float8Linear"]
        )
    )
    assert not any(
        map(is_matmul_layer, ["Embedding", "LayerNorm", "GELU", "Conv1DWrapper", "", "EmbeddingBag"])
    )


def test_alignment_from_profiler_shapes_and_flat_model_dims() -> None:
    # the shapes the Profiler records (summary["capture"]["modules"]) and the flat dims the training loop
    # writes into summary["model"]: Linear weights are (out, in), HF Conv1D (in, out), Embedding (num, dim)
    b = RunBuilder()
    b.add(0, 0, "wte", "Embedding", T.ACTIVATION, torch.randn(16, 96))
    b.add(0, 1, "h.0.attn.c_attn", "Conv1D", T.ACTIVATION, torch.randn(16, 288))
    b.add(0, 2, "h.0.mlp.c_fc", "Linear", T.ACTIVATION, torch.randn(16, 100))
    summ = summary_for(batch=2, seq=8)
    summ[T.SUMMARY_MODEL] = {"n_params": 10**6, "n_embd": 96, "n_head": 4, "n_layer": 1, "vocab_size": 250}
    summ[T.SUMMARY_CAPTURE] = {
        "modules": [
            {"name": "wte", "type": "Embedding", "params": {"weight": [250, 96]}},
            {"name": "h.0.attn.c_attn", "type": "Conv1D", "params": {"weight": [96, 288], "bias": [288]}},
            {"name": "h.0.mlp.c_fc", "type": "Linear", "params": {"weight": [100, 96], "bias": [100]}},
        ]
    }
    rec = recommend(b.tables(), hardware="h100", summary=summ)
    f = must(rec, "tensor_core_alignment")
    assert f.modules == ["h.0.mlp.c_fc"]  # wte is a gather's table, tied to no head
    assert "h.0.mlp.c_fc (out=100)" in f.message and "vocab_size=250" in f.message
    assert (
        f.numbers["dim_vocab_size"] == 250
        and "dim_n_embd" not in f.numbers
        and "dim_head_dim" not in f.numbers
    )
    assert f.numbers["tokens"] == 16


def test_tokens_per_call_without_a_sequence_length_are_measured() -> None:
    # a configuration with a batch size and no sequence length (a Trainer's): the rows of each GEMM are the
    # linear layers' output elements per call over their out_features, the most common value (here 2 x 5 =
    # 10 for the two layers run on the sequences, 2 for the classifier on the pooled rows), never the batch
    b = RunBuilder()
    b.add(0, 0, "fc1", "Linear", T.ACTIVATION, torch.randn(2 * 10, 64), calls=2)
    b.add(0, 1, "fc2", "Linear", T.ACTIVATION, torch.randn(10, 32))
    b.add(0, 2, "cls", "Linear", T.ACTIVATION, torch.randn(2, 16))
    summ = summary_for(batch=2)
    del summ[T.SUMMARY_CONFIG]["seq_len"]
    modules = [
        {"name": "fc1", "type": "Linear", "params": {"weight": [64, 32]}},
        {"name": "fc2", "type": "Linear", "params": {"weight": [32, 64]}},
        {"name": "cls", "type": "Linear", "params": {"weight": [16, 32]}},
    ]
    summ[T.SUMMARY_CAPTURE] = {"modules": modules}
    f = must(recommend(b.tables(), hardware="h100", summary=summ), "tensor_core_alignment")
    assert f.numbers["tokens"] == 10 and "batch x sequence = 10" in f.message
    # the classifier's own GEMM runs on the batch's 2 rows, which its finding names (1.6% of the FLOPs)
    assert f.modules == ["cls"] and "the GEMM rows of cls: 2 a call (the batch size)." in f.message
    # nothing to measure them from (no recorded shapes): no claim about them
    summ[T.SUMMARY_CAPTURE] = {}
    assert "tensor_core_alignment" not in codes(recommend(b.tables(), hardware="h100", summary=summ))


def test_alignment_judges_the_rows_each_linear_layers_gemm_runs_on() -> None:
    """A model that mean-pools its embedded 4 x 65 tokens: its linear layers run on the batch's 4 rows (as a
    UNet's time MLP does). The finding said "batch x sequence = 260", which no GEMM of the model has, with the
    remedy to change the batch size or the sequence length: a sequence of 64 made it go away while every layer
    still ran on 4 rows (reviewer h100). It judges each linear layer's rows, names those on the batch size, and
    says what sets them; a layer on batch x sequence is said as before, and one on rows that are a multiple of 8
    is not named."""
    modules = [
        {"name": "emb", "type": "Embedding", "params": {"weight": [256, 64]}},
        {"name": "fc1", "type": "Linear", "params": {"weight": [64, 64]}},
        {"name": "fc2", "type": "Linear", "params": {"weight": [256, 64]}},
    ]

    def advice(seq: int, batch: int = 4, trunk: bool = False) -> Recommendation:
        b = RunBuilder()
        b.add(0, 0, "emb", "Embedding", T.ACTIVATION, torch.randn(batch * seq, 64))
        if trunk:  # a linear layer on every token before the pooling
            b.add(0, 1, "proj", "Linear", T.ACTIVATION, torch.randn(batch * seq, 64))
        b.add(0, 2, "fc1", "Linear", T.ACTIVATION, torch.randn(batch, 64))
        b.add(0, 3, "fc2", "Linear", T.ACTIVATION, torch.randn(batch, 256))
        summ = summary_for(batch=batch, seq=seq)
        proj = [{"name": "proj", "type": "Linear", "params": {"weight": [64, 64]}}] * trunk
        summ[T.SUMMARY_CAPTURE] = {"modules": modules[:1] + proj + modules[1:]}
        return recommend(b.tables(), hardware="h100", summary=summ)

    f = must(advice(65), "tensor_core_alignment")
    assert f.severity == "warning" and f.modules == ["fc1", "fc2"]
    assert f.message.endswith(
        "these are not: the GEMM rows of fc1, fc2: 4 a call (the batch size, where batch x sequence is 260)."
    )
    assert "batch x sequence = 260" not in f.message
    assert f.remedy == (
        "For fc1, fc2: a batch size that is a multiple of 8 (their rows are the batch's, 4: the sequence length "
        "does not set them)."
    )
    assert f.numbers["row_layers"] == 2 and "tokens" not in f.numbers
    # the old remedy followed (64 tokens a sequence): the layers still run on 4 rows, and are still named
    assert must(advice(64), "tensor_core_alignment").modules == ["fc1", "fc2"]
    assert "tensor_core_alignment" not in codes(advice(65, batch=8))  # the new one followed
    # a layer on every token: batch x sequence is judged, as for a GPT, and the pooled layers beside it
    f = must(advice(65, trunk=True), "tensor_core_alignment")
    assert "these are not: batch x sequence = 260; the GEMM rows of fc1, fc2: 4 a call (the batch size)." in (
        f.message
    )
    assert f.numbers["tokens"] == 260 and f.modules == ["fc1", "fc2"]
    assert f.remedy.startswith("For the tokens: a batch size or sequence length that makes batch x sequence")
    # a loop of the user's own, which says no batch size nor sequence: the pooled model's 4 rows (its embedding
    # looked up 260 ids a call), and an MLP's on flat features (no embedding), are rows, not batch x sequence
    # (reviewer h103: "batch x sequence = 4" and pad_to_multiple_of for an MLP)
    for with_emb in (True, False):
        b = RunBuilder()
        if with_emb:
            b.add(0, 0, "emb", "Embedding", T.ACTIVATION, torch.randn(4 * 65, 64))
        b.add(0, 2, "fc1", "Linear", T.ACTIVATION, torch.randn(4, 64))
        b.add(0, 3, "fc2", "Linear", T.ACTIVATION, torch.randn(4, 256))
        own = {T.SUMMARY_CAPTURE: {"modules": modules if with_emb else modules[1:]}}
        f = must(recommend(b.tables(), hardware="h100", summary=own), "tensor_core_alignment")
        assert f.message.endswith("these are not: the GEMM rows of fc1, fc2: 4 a call."), with_emb
        assert "batch x sequence" not in f.message + f.remedy and "pad_to_multiple_of" not in f.remedy
        assert f.remedy.startswith(
            "For fc1, fc2: an input whose leading dimensions (all but the last) multiply"
        )
        assert "tokens" not in f.numbers


def test_a_real_run_whose_scaler_backs_off_below_1_keeps_its_verdict_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    """fp16 on CPU, SGD at lr 1e6 without clipping (issue 12): the first update blows the weights up, every
    later step overflows and is skipped, and GradScaler backs its scale off below 1. The advisor used to
    recurse forever writing a scale below 1 (2^-k), so such runs lost their recommendation, report.html said
    "could not be rendered (RecursionError)" and ``precprof report`` was a traceback. The whole path, end to
    end: training, summary.json, report.html, ``precprof report`` with and without a target. (The scale
    text itself, 2^-3 written as 0.125, is checked on a real run by scenario d2.)"""
    out = tmp_path / "huge"
    train(
        TrainConfig(
            model="gpt-nano",
            model_args={"n_layer": 1, "n_embd": 32, "n_head": 2},
            precision="fp16",
            device="cpu",
            optimizer="sgd",
            lr=1e6,
            grad_clip=0.0,
            init_scale=4.0,  # below 1 after three skipped steps (from 2^16: seventeen)
            steps=10,
            batch_size=2,
            seq_len=8,
            sample_every=1,
            out=out,
            progress=False,
        )
    )
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and not summary.get(T.SUMMARY_ERRORS)
    steps = T.read_tables(out)["steps"]
    assert float(steps[T.LOSS_SCALE].min()) < 1  # the run really went where the advisor used to recurse
    rec = Recommendation.from_dict(summary[T.SUMMARY_RECOMMENDATION])
    assert rec.format in ("fp32", "tf32", "bf16", "fp16", "fp8") and isinstance(rec.describe(), str)
    html = (out / T.REPORT_FILE).read_text()
    assert 'id="verdict"' in html and "could not be rendered" not in html
    # the non-finite facts agree with the steps table: the skips from the first non-finite step to the end
    f = rec.finding("nonfinite_forward") or rec.finding("nonfinite_backward")
    assert f is not None and f.numbers["skipped"] == 1
    skipped = sorted(int(s) for s in steps[steps[T.SKIPPED].astype(bool)][T.STEP])
    first = int(f.numbers["step"] or 0)
    assert f.numbers["skipped_from"] == first and f.numbers["skipped_to"] == 9
    assert f.numbers["skipped_steps"] == len([s for s in skipped if s >= first]) == 10 - first
    for argv in (["report", str(out)], ["report", str(out), "--target", "v100"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 0, capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err


def test_a_run_with_many_loss_scales_names_their_range_not_each_one() -> None:
    """A loss scale set by hand at every step (or a scaler that wanders) leaves thousands of distinct scales:
    the finding gives their range and count, never a list as long as the run."""
    from report_fixtures import synthetic_run

    tables, summary = synthetic_run("bf16", steps=40, sample_every=1)
    layers = tables["layers"].copy()
    grads = layers[T.TENSOR].isin(T.GRADIENT_KINDS)
    layers.loc[grads, T.SCALE] = 1024.0 + layers.loc[grads, T.STEP].astype(float)  # 40 distinct scales
    rec = recommend({**tables, "layers": layers}, summary=summary)
    (f,) = [f for f in rec.findings if f.code == "fp16_gradient_underflow"]
    # "..., 40 values" right after a count of gradient values read as a second count of them
    assert "at the run's 40 loss scales from 1024 to 1063 (exact counts)" in f.message, f.message
    assert "1030" not in f.message
    small = recommend(tables, summary=summary)  # few scales: each one
    (f,) = [f for f in small.findings if f.code == "fp16_gradient_underflow"]
    few = f.message.split(" (exact counts)")[0].split("at the run's ")[1]
    assert "values" not in few and few.startswith(("loss scale ", "loss scales ")), few


@pytest.mark.parametrize("categorical", [False, True])
def test_rules_read_the_same_from_histograms_summed_over_steps(categorical: bool) -> None:
    """The advisor's rules read the histograms summed over steps (``tables.sum_histogram_frame``, as the
    report's heatmaps do): the exponent counts and the lost-norm shares they compute from them are those of the
    per-step rows, whatever the edge rows (no module: the root's "" in both, as in the layers table; no tensor
    kind: no kind's; two params of one module; a bin recorded empty)."""
    from precprof.analysis.advisor import evidence as E
    from precprof.formats import FP16

    rows = [  # step, module, tensor, param, exponent, count
        (0, "a", T.ACTIVATION_GRAD, "", -30, 3),
        (1, "a", T.ACTIVATION_GRAD, "", -30, 4),
        (1, "a", T.ACTIVATION_GRAD, "", 2, 1),
        (0, "b", T.ACTIVATION_GRAD, "", -3, 7),
        (0, "b", T.WEIGHT_GRAD, "weight", -20, 2),
        (1, "b", T.WEIGHT_GRAD, "bias", -20, 5),
        (0, None, T.ACTIVATION_GRAD, "", -30, 6),
        (1, "a", None, "", 0, 100),
        (2, "a", T.ACTIVATION_GRAD, "", -64, 0),
    ]
    hist = pd.DataFrame(rows, columns=[T.STEP, T.MODULE, T.TENSOR, T.PARAM, T.EXPONENT, T.COUNT])
    if categorical:
        hist = hist.astype({c: "category" for c in (T.MODULE, T.TENSOR, T.PARAM)})
    _, prepared, _ = E._prepare({"histograms": hist})
    run = E._Run(pd.DataFrame(), prepared, pd.DataFrame(), {}, preset("cpu"), True, AdvisorConfig())
    totals = run.hist_totals()
    assert len(totals) < len(hist) and int(totals[T.COUNT].sum()) == int(hist[T.COUNT].sum())
    for kinds in [(T.ACTIVATION_GRAD,), (T.WEIGHT_GRAD,), (T.ACTIVATION_GRAD, T.WEIGHT_GRAD)]:
        pd.testing.assert_series_equal(run.exponent_counts(*kinds), E._exponent_counts(prepared, kinds))
    by_hand = {  # bound of each module's share of the L2 norm in bins that fp16 flushes at scale 1: the lost
        # values at their binade's upper edge (4^(e+1)), the kept ones at its lower edge (4^e)
        "": 1.0,
        "a": ((7 * 4.0**-29) / (7 * 4.0**-29 + 4.0**2)) ** 0.5,
        "b": 0.0,
    }
    for h in (prepared, totals):
        got = E._lost_norm_share(h[h[T.TENSOR] == T.ACTIVATION_GRAD], FP16, 0)
        assert got.to_dict() == pytest.approx(by_hand)
    assert run.exponent_counts(T.WEIGHT_GRAD).to_dict() == {-20: 7.0}
    assert run.exponent_counts(T.ACTIVATION_GRAD).to_dict() == {-64: 0.0, -30: 13.0, -3: 7.0, 2: 1.0}


def test_the_loss_change_is_told_only_from_a_finite_first_loss() -> None:
    """The fp16 finding's "the loss did not move" reads the change from the first recorded loss to the last; a
    run whose first loss is inf says nothing (inf - inf is no change to report), one that ends in inf moved."""
    from dataclasses import replace

    from precprof.analysis.advisor.evidence import _Run
    from precprof.analysis.advisor.rules.fp16 import _loss_change

    def run(losses: list[float]) -> _Run:
        empty = pd.DataFrame()
        steps = pd.DataFrame({T.STEP: range(len(losses)), T.LOSS: losses})
        base = _Run(empty, empty, steps, {}, preset("h100"), False, AdvisorConfig())
        return replace(base, steps=steps)

    assert _loss_change(run([2.0, float("nan"), 1.0])) == -0.5
    assert _loss_change(run([math.inf, 1.0, math.inf])) is None
    assert _loss_change(run([1.0, math.inf])) == math.inf
    assert _loss_change(run([0.0, 1.0])) is None and _loss_change(run([1.0])) is None


def _train_lm(
    model: nn.Module, out: Path, *, vocab: int, shape: tuple[int, int], steps: int
) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """``steps`` AdamW steps of a language model on random tokens of ``shape``, every step sampled into the run
    directory ``out``; its tables and summary."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with Profiler(model, optimizer=opt, sample_every=1, out=out) as prof:
        for _ in range(steps):
            idx = torch.randint(0, vocab, shape)
            loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    prof.save()
    return T.read_tables(out), T.read_summary(out)


class RotaryEmbedding(nn.Module):
    """A rotary position embedding as Hugging Face's: no weight, (cos, sin) of (sequence, 32) per call."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * torch.arange(1, 33) / 32
        return angle.cos(), angle.sin()


class Adapted(nn.Module):
    """A frozen Linear with a trainable low-rank adapter beside it (peft's LoRA: base_layer, lora_A, lora_B)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(32, 32).requires_grad_(False)
        self.lora_a = nn.Linear(32, 16, bias=False)
        self.lora_b = nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoraLM(nn.Module):
    """A frozen embedding and first layer, an adapted layer, a rotary embedding registered after them and an
    output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32).requires_grad_(False)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.attn = Adapted()
        self.rotary = RotaryEmbedding()
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        cos, sin = self.rotary(x)
        x = self.attn(torch.relu(self.frozen(x)) * cos + sin)
        return self.head(x)


def test_fp8_eligibility_of_a_real_adapter_run_names_the_true_tie_and_judges_frozen_layers_forward(
    tmp_path: Path,
) -> None:
    """A LoRA-like model trained for real (4 x 8 tokens a call). The rotary embedding has no weight, and its
    output over the tokens per call, 2 x 8 x 32 / 32 = 16, equals lora_b's in_features: the advisor took it
    for an embedding whose weight lora_b shares and called lora_b "tied to the embedding rotary" (seen on a peft
    Llama with rank 8). The capture now records which weights are shared (the head's is wte's). The frozen
    layers before the adapter had an output needing no gradient, and were "not eligible: no forward or backward
    statistics"; they run no backward GEMM and are judged on their forward."""
    torch.manual_seed(0)
    tables, summary = _train_lm(LoraLM(), tmp_path / "lora", vocab=64, shape=(4, 8), steps=3)
    assert summary[T.SUMMARY_CAPTURE]["shared_params"] == {"head": {"weight": "wte"}}
    rec = recommend(tables, hardware="h100", summary=summary)
    f = must(rec, "fp8_eligibility")
    assert "rotary" not in f.message
    assert f.numbers["tied"] == 1 and "head (tied to the embedding wte" in f.message
    assert f.numbers["forward_only"] == 2 and "(frozen, attn.base: frozen with nothing trainable" in f.message
    assert sorted(f.modules) == ["attn.base", "attn.lora_a", "attn.lora_b", "frozen"]


class BiasedLM(nn.Module):
    """A token embedding of 50 rows tied to the output head, a T5-style relative position bias (an embedding of
    32 buckets x 4 heads, a gather whose width is no GEMM's) and a gate of one output per token (an MoE's
    shared_expert_gate: 32 of the 7,776 matmul FLOPs per token)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 32)
        self.bias = nn.Embedding(32, 4)
        self.fc = nn.Linear(32, 96)
        self.fc2 = nn.Linear(96, 32)
        self.gate = nn.Linear(32, 1)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        buckets = torch.arange(idx.shape[1]) % 32
        x = x + self.bias(buckets).mean(-1)[None, :, None]
        x = self.fc2(torch.relu(self.fc(x))) * torch.sigmoid(self.gate(x))
        return self.head(x)


def test_alignment_names_a_tied_heads_vocabulary_and_no_gathers_table(tmp_path: Path) -> None:
    """A real run (4 x 16 tokens): the tied head's 50-row vocabulary is a GEMM dimension (named under the
    embedding that holds it); the position bias's 4 columns are a gather's and were reported as "dim=4" (a
    warning on a GPU target, seen on a T5); the gate's one output was "out=1" (seen on a Qwen2-MoE), a GEMM too
    small to pad."""
    torch.manual_seed(0)
    tables, summary = _train_lm(BiasedLM(), tmp_path / "run", vocab=50, shape=(4, 16), steps=2)
    f = must(recommend(tables, hardware="h100", summary=summary), "tensor_core_alignment")
    assert f.modules == ["wte"] and "wte (num_embeddings=50)" in f.message
    assert "bias" not in f.message and f.numbers["tokens"] == 64
    assert "gate" not in f.message and f.numbers["small_layers_left_out"] == 1


class PatchEmbed(nn.Module):
    """A vision model's patch embedding: a 1 x patches x width position table (a 3-D parameter) and a LayerNorm,
    whose output is float32 under autocast on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 16, 32) * 0.02)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.pos)


def test_a_position_table_is_no_bank_of_experts(tmp_path: Path) -> None:
    """A 3-D parameter of one leading row is a position table, not experts: its module's float32 LayerNorm under
    bf16 autocast is no expert matmul in float32."""
    torch.manual_seed(0)
    model = nn.Sequential(PatchEmbed(), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 16, 32)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    tables = prof.tables()
    norm = tables["layers"][
        (tables["layers"][T.MODULE] == "0.norm") & (tables["layers"][T.TENSOR] == T.ACTIVATION)
    ]
    assert set(norm[T.DTYPE]) == {"float32"}  # what the rule reads of a bank, here of a position table
    rec = recommend(tables, summary={T.SUMMARY_CAPTURE: prof.summary()})
    assert rec.finding("experts_fp32") is None


class Constants(nn.Module):
    """Four buffers: a causal mask (0 and 1, exact in any format), positions 0..299 as floats (bf16 holds the
    integers up to 256 exactly, then every second one), a bias table of thirds, and scales of at most 4
    significant bits (a cast from fp32 leaves such values as they were)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)))
        self.register_buffer("positions", torch.arange(300.0))
        self.register_buffer("table", torch.arange(1.0, 9.0) / 3)
        self.register_buffer("scales", torch.tensor([0.75, 1.5, 0.375, 0.6875]))  # 2 to 4 significant bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.mask + self.table + self.positions[:8]) * self.scales.repeat(2)


class Buffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.consts = Constants()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.consts(self.lin(x))


def test_buffers_a_cast_rounded_are_told_from_those_it_cannot_have_changed() -> None:
    """A model cast to bf16 trained for real: the mask's values and the short scales are as they were, no
    finding; the positions past 256 and the thirds were rounded, an information finding bounding the error by half
    a bf16 unit in the last place of the largest rounded value: 256..299 are 2 apart (1), 8/3 lies in [2, 4)
    (2^-7)."""
    torch.manual_seed(0)
    model = Buffered().to(torch.bfloat16)
    prof = _two_bf16_steps(model)
    bufs = {b["buffer"]: b for b in prof.summary()["low_precision_buffers"]}
    assert bufs["mask"]["exact"] is True and "rounding" not in bufs["mask"]
    assert bufs["scales"] == {**bufs["scales"], "exact": True}
    assert bufs["positions"] == {**bufs["positions"], "exact": False, "rounding": 1.0}
    assert bufs["table"]["rounding"] == 2.0**-7 and bufs["table"]["module_type"] == "Constants"
    rec = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    f = must(rec, "low_precision_constants")
    assert f.severity == "info" and f.numbers == {"buffers": 2, "buffer_error": 1.0}
    assert f.modules == ["consts"] and "consts.positions (bfloat16)" in f.message
    assert "mask" not in f.message and "scales" not in f.message
    assert rec.finding("low_precision_buffers") is None and rec.finding("low_precision_rope") is None


def _two_bf16_steps(model: nn.Module) -> Profiler:
    """Two AdamW steps of a bf16 ``model`` on inputs of 8 features, every step sampled."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            loss = model(torch.randn(4, 8, dtype=torch.bfloat16)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    return prof


def test_a_half_model_is_told_what_autocast_does_to_its_batch_norm() -> None:
    """A model cast whole to bf16, a BatchNorm and a LayerNorm in it: the finding says what training under
    autocast would change for the BatchNorm as a real autocast run of the same model shows it (checked here): it
    keeps its input's dtype, with fp32 weights and running statistics. It had said autocast runs both in fp32.
    torch's LayerNorm computes in fp32 inside and is not named (it was, as if it computed in bf16)."""
    torch.manual_seed(0)

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.LayerNorm(16), nn.Linear(16, 8))

    model = build()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[0](torch.randn(4, 8))
        assert model[1](h).dtype == torch.bfloat16  # autocast leaves the batch norm in its input's dtype
    assert model[1].weight.dtype == model[1].running_var.dtype == torch.float32
    prof = _two_bf16_steps(build().to(torch.bfloat16))
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    ops = must(
        recommend(prof.tables(), summary=summary, config=AdvisorConfig(small_model_params=0)), "bf16_fp32_ops"
    )
    # the LayerNorm computes in fp32 inside (its bf16 output is the fp32 computation rounded once): not named
    ln, x = model[2].to(torch.bfloat16), torch.randn(4, 16).bfloat16() * 30
    wide = nn.functional.layer_norm(x.float(), (16,), ln.weight.float(), ln.bias.float()).bfloat16()
    assert (ln(x).float() - wide.float()).abs().max() <= 2.0**-6  # within a bf16 unit at |y| < 4
    assert ops.modules == ["1"]
    assert (
        '("2" also produced bfloat16 outputs, but torch\'s LayerNorm computes its statistics in fp32'
        in ops.message
    )
    assert (
        "Autocast leaves BatchNorm1d in its input's dtype, its weights and running statistics in fp32"
        in ops.message
    )
    assert "BatchNorm1d in fp32" not in ops.message.replace("statistics in fp32", "")


class RootBuffers(nn.Module):
    """Rotary frequencies held by the root module, a temperature by a container (``body``, a Sequential): the
    modules the Profiler captures are the leaves and those with parameters, neither of these two."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.body.register_buffer("temperature", torch.tensor(0.7071))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angle = torch.arange(x.shape[0], dtype=x.dtype)[:, None] * self.inv_freq[None, :]
        return self.body(x + torch.cat([angle.sin(), angle.cos()], -1)) * self.body.temperature


def test_buffers_of_the_root_and_of_containers_are_read() -> None:
    """low_precision_rope and low_precision_constants read the buffers of the captured modules alone: rotary
    frequencies kept on the root and a constant on a container were never seen. Every module's are read; the
    bounds are checked against the fp32 values before the cast (a real bf16 cast)."""
    torch.manual_seed(0)
    fp32 = RootBuffers()
    before = {n: b.clone() for n, b in fp32.named_buffers()}
    model = fp32.to(torch.bfloat16)
    prof = _two_bf16_steps(model)
    rec = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    rope = must(rec, "low_precision_rope")
    assert rope.modules == [""] and "inv_freq (bfloat16)" in rope.message and ".inv_freq" not in rope.message
    off = float((before["inv_freq"] - model.inv_freq.float()).abs().max())
    assert 0 < off <= rope.numbers["frequency_error"]
    const = must(rec, "low_precision_constants")
    assert const.modules == ["body"] and "body.temperature (bfloat16)" in const.message
    # 0.7071 lies in [0.5, 1): a bf16 unit in the last place there is 2^-8, half of it 2^-9
    assert const.numbers["buffer_error"] == 2.0 ** (math.floor(math.log2(0.7071)) - 8)
    assert 0 < abs(0.7071 - float(model.body.temperature)) <= const.numbers["buffer_error"]


def test_weight_norm_and_spectral_norm_parametrizations_are_not_normalisation_layers() -> None:
    """A GAN or vocoder block cast with .to(torch.bfloat16): weight_norm and spectral_norm Linears beside a
    LayerNorm. torch's parametrizations (classes _WeightNorm and _SpectralNorm, under
    <layer>.parametrizations.weight) were taken for normalisation layers by the "Norm" in their names: keep_fp32
    named 3.parametrizations.weight.0 with a remedy (.float() on it) that casts spectral_norm's power-iteration
    vectors and leaves the weight it computes in bf16, and those vectors were called "running statistics" of a
    momentum. The norm alone is a normalisation layer; the vectors, bf16 in the model, are no finding. (An RMSNorm
    computing in its input's dtype: torch's LayerNorm computes in fp32 inside, and is no finding either.)"""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(
        weight_norm(nn.Linear(8, 32)),
        InputDtypeNorm(32),
        nn.ReLU(),
        spectral_norm(nn.Linear(32, 32)),
        nn.Linear(32, 8),
    ).to(torch.bfloat16)
    plist = model[3].parametrizations.weight
    assert plist[0]._u.dtype == torch.bfloat16 and type(plist[0]).__name__ == "_SpectralNorm"
    prof = _two_bf16_steps(model)
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    rec = recommend(prof.tables(), summary=summary, config=AdvisorConfig(small_model_params=0))
    assert rec.format == "bf16" and rec.keep_fp32 == ["1"]
    ops = must(rec, "bf16_fp32_ops")
    assert ops.modules == ["1"] and "parametrizations" not in ops.message + ops.remedy
    assert rec.finding("low_precision_buffers") is None
    assert all("_u" not in f.message for f in rec.findings)


class UpcastNorm(nn.Module):
    """An RMSNorm as transformers' Gemma: statistics in fp32, the result cast back to the input's dtype."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).type_as(x)


class InputDtypeNorm(nn.Module):
    """An RMSNorm computed in its input's dtype, its weight cast to it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.to(x.dtype)


class Norms(nn.Module):
    """Each norm after a Linear, whose output autocast makes bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(16, 16) for _ in range(4))
        self.ln, self.upcast, self.low = nn.LayerNorm(16), UpcastNorm(16), InputDtypeNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.low(self.l2(self.upcast(self.l1(self.ln(self.l0(x)))))))


def test_cuda_autocast_table_is_the_dispatchers() -> None:
    """The modules the fp32-ops rule says CUDA autocast runs in fp32 are those whose op has an AutocastCUDA
    kernel in this torch; BatchNorm's and InstanceNorm's have none."""
    from precprof.analysis.advisor.rules.fp32_ops import CUDA_AUTOCAST_FP32

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert all(has(op, "AutocastCUDA") for op in CUDA_AUTOCAST_FP32.values())
    assert not has("aten::batch_norm", "AutocastCUDA") and not has("aten::instance_norm", "AutocastCUDA")


def test_norms_under_autocast_are_told_by_what_chose_their_dtype() -> None:
    """Three norms under CPU bf16 autocast, each after a Linear (bf16 output), each returning bf16. The rule
    said of all "autocast on cpu ran them in bf16; CUDA autocast runs normalisation in fp32": true of
    nn.LayerNorm (layer_norm has an AutocastCUDA kernel), false of a module's own code, which autocast does
    not cast on any device (Gemma's norms drew it on every run). The norm that upcasts kept fp32 tensors for
    its backward (checked with saved-tensor hooks): no finding for it. The one computing in bf16 kept none:
    listed as its own code's choice, with how to upcast inside. nn.LayerNorm computes in fp32 inside whatever
    dtype CPU autocast leaves it: no finding for it either (it had been listed, "loses accuracy in bf16")."""
    torch.manual_seed(0)
    model = Norms()
    x = torch.randn(4, 8, 16)

    def saved(module: nn.Module) -> set[torch.dtype]:
        dtypes: set[torch.dtype] = set()
        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.add(t.dtype) or t, lambda t: t),
        ):
            module(x.bfloat16())
        return dtypes

    kept = {"upcast": saved(model.upcast), "low": saved(model.low)}
    assert torch.float32 in kept["upcast"] and kept["low"] == {torch.bfloat16}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Profiler(model, optimizer=opt, sample_every=1, memory_every=1) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    acts = prof.tables()["layers"]
    acts = acts[acts[T.TENSOR] == T.ACTIVATION]
    assert set(acts[acts[T.MODULE].isin(["ln", "upcast", "low"])][T.DTYPE]) == {"bfloat16"}
    rec = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    f = must(rec, "bf16_fp32_ops")
    assert f.severity == "info" and f.modules == ["low"]
    assert f.message.startswith("low produced bfloat16 outputs by their own code")
    assert "they computed in bf16" in f.message
    assert "(upcast also produced bfloat16 outputs and kept fp32 tensors" in f.message
    # torch's LayerNorm computes in fp32 inside whatever dtype CPU autocast leaves it (its output within a bf16
    # unit of the fp32 computation, a bf16 computation's much further off): said, not named
    assert (
        "(ln also produced bfloat16 outputs, but torch's LayerNorm computes its statistics in fp32"
        in f.message
    )
    h = torch.randn(64, 16).mul(3).add(100).bfloat16()
    ln = model.ln.bfloat16()
    wide = nn.functional.layer_norm(h.float(), (16,), ln.weight.float(), ln.bias.float()).bfloat16().float()
    low = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(
        (h - h.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
    )
    assert (ln(h).float() - wide).abs().max() <= 2.0**-6 < (low * ln.weight + ln.bias - wide).abs().max()
    assert f.remedy.startswith("Compute the statistics in fp32 inside the module")  # (low's alone)
    assert not {"ln", "upcast", "low"} & set(rec.keep_fp32)
    # without the memory table (memory=False) what the norms computed in is not known, and said so
    tables = {**prof.tables(), "memory": prof.tables()["memory"].iloc[0:0]}
    f = must(recommend(tables, summary={T.SUMMARY_CAPTURE: prof.summary()}), "bf16_fp32_ops")
    assert f.modules == ["upcast", "low"] and "whether that is bf16 inside is not known" in f.message


class CheckpointedNorms(nn.Module):
    """Two blocks (an upcasting norm, a Linear) run under activation checkpointing, as a Hugging Face model's
    decoder layers with gradient checkpointing on; ``final``: the same norm class after them, outside any
    checkpoint (transformers' final norm)."""

    def __init__(self, final: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.head = nn.Linear(16, 16), nn.Linear(16, 16)
        self.blocks = nn.ModuleList(nn.Sequential(UpcastNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.norm = UpcastNorm(16) if final else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        for blk in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False)
        return self.head(self.norm(h))


def test_norms_inside_activation_checkpoints_are_judged_by_their_class_measured_outside() -> None:
    """A bf16 model under bf16 autocast with its blocks checkpointed (tester h65, a LoRA Llama on a bf16 base):
    the rule listed transformers' RMSNorm of every checkpointed block ("by their own code ... whether that is bf16
    inside is not known"), with a remedy to upcast as transformers' RMSNorm does, while clearing the final norm,
    the same class outside the blocks: a checkpoint's first forward keeps nothing of its modules, so "kept no fp32
    tensor" is no evidence there. The class keeps fp32 tensors for its backward (saved-tensor hooks on one norm):
    with the final norm measured, no finding; without it, the blocks' norms stay "not known", and the finding says
    why (activation checkpointing)."""
    dtypes: set[torch.dtype] = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.add(t.dtype) or t, lambda t: t):
        UpcastNorm(16).bfloat16()(torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True))
    assert torch.float32 in dtypes
    x = torch.randn(4, 8, 16)
    found = {}
    for final in (True, False):
        model = CheckpointedNorms(final).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with Profiler(model, optimizer=opt, sample_every=1, memory_every=1) as prof:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x.bfloat16()).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.step(loss=loss)
        mem = prof.tables()["memory"]
        kept = set(mem[(mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.BYTES] > 0)][T.MODULE])
        assert not {"blocks.0.0", "blocks.1.0"} & kept and ("norm" in kept) == final
        found[final] = recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}).finding(
            "bf16_fp32_ops"
        )
    assert found[True] is None
    f = found[False]
    assert f is not None and f.modules == ["blocks.0.0", "blocks.1.0"]
    assert "whether that is bf16 inside is not known" in f.message and "activation checkpointing" in f.message


class SoftmaxAfterLinear(nn.Module):
    """Linear -> Softmax (or torch's LayerNorm: ``norm``) -> Linear; ``remedy``: the middle module as a remedy
    has it called (None: as is)."""

    def __init__(self, remedy: str | None, norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.mid = nn.LayerNorm(16) if norm else nn.Softmax(-1)
        self.remedy = remedy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        if self.remedy == "autocast off":  # the remedy as it read
            with torch.autocast("cpu", enabled=False):
                h = self.mid(h)
            return self.l1(h)
        return self.l1(self.mid(h.float() if self.remedy == "fp32 input" else h))


@pytest.mark.parametrize("remedy", [None, "autocast off", "fp32 input"])
def test_the_remedy_for_torchs_softmax_under_cpu_autocast_works_as_written(remedy: str | None) -> None:
    """nn.Softmax after a Linear under CPU bf16 autocast returns bf16: CPU autocast leaves softmax in its input's
    dtype. The remedy said to wrap it in torch.autocast(enabled=False), which leaves its bf16 input, and so its
    output, as they were: followed, the finding stayed. Called on an fp32 input as it now says, the softmax
    returns fp32, the next Linear under autocast takes it, and the finding is gone. (torch's LayerNorm there,
    which computes in fp32 inside, returns bf16 too, and is no finding: nothing to do.)"""
    x = torch.randn(4, 8, 16)
    run = train_profiled(SoftmaxAfterLinear(remedy), lambda _: (x, x), square_mean, precision="bf16", steps=2)
    acts = activations(run.tables)
    mid_dtypes = set(acts[acts[T.MODULE] == "mid"][T.DTYPE])
    f = run.recommend().finding("bf16_fp32_ops")
    if remedy == "fp32 input":
        assert mid_dtypes == {"float32"} and f is None
        return
    assert mid_dtypes == {"bfloat16"} and f is not None and f.modules == ["mid"]
    assert "Softmax (exponentials and a sum) loses accuracy in bf16" in f.message
    assert f.remedy.startswith(
        "Nothing to do on a GPU; on this device, call them on an fp32 input (x.float())"
    )
    if remedy is None:
        norm = train_profiled(
            SoftmaxAfterLinear(None, norm=True), lambda _: (x, x), square_mean, precision="bf16", steps=2
        )
        acts = activations(norm.tables)
        assert set(acts[acts[T.MODULE] == "mid"][T.DTYPE]) == {"bfloat16"}
        assert norm.recommend().finding("bf16_fp32_ops") is None


class RoutedExperts(nn.Module):
    """Four experts as 3-D weights with their router inside, each token sent to one: 2 x (64 x 32) x 2 FLOPs per
    token, most of the model's. ``act_module``: SiLU as a module of the bank (transformers' experts); else
    applied inline (much hand-written MoE code)."""

    def __init__(self, act_module: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 4)  # the router; its name sorts before silu's
        self.w_in = nn.Parameter(torch.randn(4, 64, 32) / 8)
        self.w_out = nn.Parameter(torch.randn(4, 32, 64) / 8)
        self.silu = nn.SiLU() if act_module else nn.functional.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 32)
        choice = self.gate(flat).argmax(-1)
        hidden, order = [], []
        for e in range(4):
            rows = (choice == e).nonzero()[:, 0]
            hidden.append(flat[rows] @ self.w_in[e].T)
            order.append(rows)
        h = self.silu(torch.cat(hidden))  # one call over every routed row, as transformers' experts
        out = torch.zeros_like(flat)
        start = 0
        for e, rows in enumerate(order):
            part = h[start : start + len(rows)] @ self.w_out[e].T
            out = out.index_put((rows,), part.to(out.dtype))
            start += len(rows)
        return out.reshape(x.shape)


class MoELM(nn.Module):
    def __init__(self, act_module: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.moe = RoutedExperts(act_module)
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        return self.head(x + self.moe(x))


@pytest.mark.parametrize("act_module", [True, False])
def test_experts_flops_are_read_from_their_activation_not_their_router(act_module: bool) -> None:
    """A mixture of experts with its router inside the bank: the rows routed to the experts were read from the
    first module inside, by name, whose output divided by the intermediate size: the router "gate" before
    "silu" (a row per token of 4 values: 4 routed rows of 64), counting a sixteenth of the experts' FLOPs. Read from the activation module,
    the share is the model's own: 2 x 64 x 32 x 2 per token for the experts, 2 x 32 x 4 and 2 x 32 x 64 for
    the router and the head. A bank applying its activation inline has no rows to read: the finding said
    "carrying X% of the linear layers' matmul FLOPs" as if there were no experts, and now names it as not
    counted."""
    torch.manual_seed(0)
    model = MoELM(act_module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            idx = torch.randint(0, 64, (4, 16))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(idx).flatten(0, 1).float(), idx.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    rec = recommend(prof.tables(), hardware="h100", summary={T.SUMMARY_CAPTURE: prof.summary()})
    f = must(rec, "fp8_eligibility")
    if act_module:
        experts, linear = 2 * 64 * 32 * 2, 2 * 32 * 4 + 2 * 32 * 64
        assert f.numbers["experts_uncounted"] == 0
        assert f.numbers["experts_flops_share"] == pytest.approx(experts / (experts + linear))
        return
    assert f.numbers["experts_uncounted"] == 1 and f.numbers["experts_flops_share"] is None
    assert "the experts of moe (3-D expert weights) are not counted" in f.message


def test_shares_are_written_without_exponents() -> None:
    """A finding's shares read as a user compares them: 0.000053%, not 5.3e-05% beside a table's <0.0001%; and
    a share short of all values never as "100%" (1,968,107 of 1,968,640 gradient values "100% ... flush", tester
    t2)."""
    from precprof.analysis.advisor.text import _pct
    from precprof.report.filters import pct

    assert [_pct(x) for x in (0.99973, 0.9995, 0.99999999, 1 - 1e-12, 1.0)] == [
        "99.97%",
        "99.95%",
        "99.999999%",
        ">99.9999%",
        "100%",
    ]
    assert [pct(x) for x in (0.99973, 0.43333, 1.0)] == ["99.97%", "43.3%", "100%"]  # the page's tables too

    assert [_pct(x) for x in (5.3e-7, 1.7e-7, 9.99e-7, 8e-9, 0.0, 0.000123, 0.0123, 0.5, None)] == [
        "0.000053%",
        "0.000017%",
        "0.00010%",
        "<0.000001%",
        "0%",
        "0.0123%",
        "1.23%",
        "50%",
        "n/a",
    ]


@pytest.mark.parametrize("pass_loss", [False, True])
def test_the_weights_turned_nonfinite_between_two_sampled_steps_name_the_two_optimizer_steps(
    pass_loss: bool,
) -> None:
    """SGD at lr 1e20 with every second step sampled: step 0's weights and gradients are finite, step 2's weights
    are not. Steps 0 and 1 could have done it (the test's own check after each optimizer step: step 1's did), and
    the finding said "an optimizer step from step 0 to step 1 (the steps between were not sampled)", where the
    one step between is step 1. A loop that passes its loss tells more: step 1's loss was inf, before its
    optimizer step ran (the weights step 0 wrote, finite, are too large for the forward pass), so the finding
    dates it at step 1's forward pass (tester t1's case of an unsampled step)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e20)
    finite_after: list[bool] = []
    losses: list[float] = []
    with Profiler(m, optimizer=opt, sample_every=2) as prof:
        for _ in range(4):
            loss = m(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            finite_after.append(all(bool(p.isfinite().all()) for p in m.parameters()))
            losses.append(loss.item())
            prof.step(loss if pass_loss else None)
    assert finite_after == [True, False, False, False]
    f = must(recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()}), "nonfinite_forward")
    if pass_loss:
        assert math.isfinite(losses[0]) and math.isinf(losses[1])
        assert f.title == "nan/inf first appears at step 1, which was not sampled: its loss was inf"
        assert "Step 1's optimizer step was not skipped, so it applied the inf gradients" in f.message
        assert "learning rate" in f.remedy
        return
    assert f.message.startswith("At step 2, the weights of 2 module(s) hold")
    assert (
        "the optimizer step of step 0 or of step 1 (step 1 was not sampled) turned finite gradients into "
        "non-finite weights" in f.message
    )


def test_a_module_named_by_numbers_alone_reads_as_a_name_in_prose() -> None:
    """An nn.Sequential's children are named "16", "58": a finding's "worst: 16 90.2%, 58 90.2%" read as counts
    beside shares (h104). Such a name is quoted; every other name reads as it did, and steps stay numbers."""
    from precprof.analysis.advisor.text import _listed, _listing, _name

    assert [_name(m) for m in ("16", "3.1", "fc", "model.layers.3.mlp", "", "0:input")] == [
        '"16"',
        '"3.1"',
        "fc",
        "model.layers.3.mlp",
        "(model)",
        "0:input",
    ]
    assert _listing(["0", "2", "head", "4"], 3) == '"0", "2", head and 1 more'
    assert _listed(["0", "1", "2"], 6) == "0, 1, 2"
