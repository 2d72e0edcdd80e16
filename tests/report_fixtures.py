"""Synthetic run directories for the report tests and the report benchmark.

The tables follow precprof.tables' schema and the facts the capture records: histograms are unscaled, gradient
counts are at the loss scale in effect (column ``scale``), exponent = floor(log2|x|). Each tensor's magnitudes
follow a discretised normal in log2 space whose centre depends on the layer and the tensor kind, so the
heatmaps have the shape of a real transformer run: activations around 2^0, activation gradients around
2^-24 (half of them below fp16's smallest subnormal at scale 1), weight gradients a few binades higher, and
one MLP projection with outliers that overflow fp16.

Underflow/overflow counts are derived from the histograms bin by bin (a bin counts as lost when it lies
entirely beyond the threshold), which is exact for the power-of-two underflow thresholds and within one bin
for overflow: good enough for a fixture, and consistent between the heatmap and the tables, which is what
the report tests check.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from precprof import formats, tables
from precprof import tables as T


@dataclass
class LayerSpec:
    """One module in forward order: qualified name, class name, parameters (name -> numel), output numel."""

    name: str
    type: str
    params: dict[str, int] = field(default_factory=dict)
    out_numel: int = 4096


def gpt_layers(n_layer: int = 2, n_embd: int = 64, vocab: int = 256, tokens: int = 256) -> list[LayerSpec]:
    """The module list of a nanoGPT/HF GPT-2 style model (``transformer.h.N.attn.c_attn`` ...), forward order."""
    e = n_embd
    out: list[LayerSpec] = [
        LayerSpec("transformer.wte", "Embedding", {"weight": vocab * e}, tokens * e),
        LayerSpec("transformer.wpe", "Embedding", {"weight": 1024 * e}, tokens * e),
        LayerSpec("transformer.drop", "Dropout", {}, tokens * e),
    ]
    for i in range(n_layer):
        h = f"transformer.h.{i}"
        out += [
            LayerSpec(f"{h}.ln_1", "LayerNorm", {"weight": e, "bias": e}, tokens * e),
            LayerSpec(f"{h}.attn.c_attn", "Conv1D", {"weight": e * 3 * e, "bias": 3 * e}, tokens * 3 * e),
            LayerSpec(f"{h}.attn.c_proj", "Conv1D", {"weight": e * e, "bias": e}, tokens * e),
            LayerSpec(f"{h}.attn.resid_dropout", "Dropout", {}, tokens * e),
            LayerSpec(f"{h}.ln_2", "LayerNorm", {"weight": e, "bias": e}, tokens * e),
            LayerSpec(f"{h}.mlp.c_fc", "Conv1D", {"weight": e * 4 * e, "bias": 4 * e}, tokens * 4 * e),
            LayerSpec(f"{h}.mlp.act", "NewGELUActivation", {}, tokens * 4 * e),
            LayerSpec(f"{h}.mlp.c_proj", "Conv1D", {"weight": 4 * e * e, "bias": e}, tokens * e),
            LayerSpec(f"{h}.mlp.dropout", "Dropout", {}, tokens * e),
        ]
    out += [
        LayerSpec("transformer.ln_f", "LayerNorm", {"weight": e, "bias": e}, tokens * e),
        LayerSpec("lm_head", "Linear", {"weight": vocab * e}, tokens * vocab),
    ]
    return out


def layers_from_module(model: Any, tokens: int = 1024) -> list[LayerSpec]:
    """LayerSpecs of a real ``torch.nn.Module`` (e.g. built on the meta device): registration order as forward
    order, direct parameters only, output numel estimated from the last dimension of the first weight."""
    out: list[LayerSpec] = []
    for name, mod in model.named_modules():
        if not name or any(True for _ in mod.children()):
            continue  # leaves only, as the profiler's default module selection does
        params = {p: int(t.numel()) for p, t in mod.named_parameters(recurse=False)}
        w = dict(mod.named_parameters(recurse=False)).get("weight")
        width = int(w.shape[-1]) if w is not None and w.dim() >= 1 else 768
        if type(mod).__name__ == "Linear" and w is not None:
            width = int(w.shape[0])
        out.append(LayerSpec(name, type(mod).__name__, params, tokens * width))
    return out


# log2 centre and spread of each tensor kind; per-layer offsets are added below
_CENTRE = {T.ACTIVATION: -1.0, T.ACTIVATION_GRAD: -23.0, T.WEIGHT: -5.0, T.WEIGHT_GRAD: -16.0}
_SPREAD = {T.ACTIVATION: 2.2, T.ACTIVATION_GRAD: 3.2, T.WEIGHT: 1.6, T.WEIGHT_GRAD: 3.0}
LO_EXP, HI_EXP = -48, 20


def _hist(rng: np.random.Generator, n: int, centre: float, spread: float) -> dict[int, int]:
    """Counts per exponent bin for n nonzero values whose log2 magnitude is ~ N(centre, spread)."""
    edges = np.arange(LO_EXP, HI_EXP + 1)
    z = (edges + 0.5 - centre) / spread
    pdf = np.exp(-0.5 * z * z)
    pdf /= pdf.sum()
    counts = rng.multinomial(n, pdf)
    return {int(e): int(c) for e, c in zip(edges, counts, strict=True) if c}


def _lost(hist: dict[int, int], scale: float) -> dict[str, int]:
    """Underflow/overflow counts per what-if format from a histogram of unscaled values seen at ``scale``."""
    out: dict[str, int] = {}
    ls = math.log2(scale)
    amax_exp = max(hist) if hist else 0
    for name in formats.WHATIF_FORMATS:
        f = formats.get(name)
        under = math.log2(f.underflow_max) - ls  # bin e is lost when 2^(e+1) <= threshold
        over = math.floor(math.log2(f.overflow_min) - ls)
        out[T.underflow_col(name)] = sum(c for e, c in hist.items() if e + 1 <= under)
        out[T.overflow_col(name)] = sum(c for e, c in hist.items() if e >= over)
    for name in formats.FP8_FORMATS:
        f = formats.get(name)
        k = formats.current_scaling_exponent(f, 2.0 ** (amax_exp + 1))
        under = math.log2(f.underflow_max) - k
        out[T.underflow_cs_col(name)] = sum(c for e, c in hist.items() if e + 1 <= under)
    return out


MODES = {
    # precision -> (activation dtype of matmul layers, other activations, param dtype, weight grad dtype)
    "fp32": ("float32", "float32", "float32", "float32"),
    "bf16": ("bfloat16", "float32", "float32", "float32"),
    "fp16": ("float16", "float32", "float32", "float32"),
}
_MATMUL_TYPES = {"Linear", "Conv1D", "Embedding"}


def loss_scale_series(n: int, mode: str, init: float = 2.0**16, growth_interval: int = 4) -> list[float]:
    """A GradScaler-like series: overflow (skip + halve) on steps 0-1, growth every ``growth_interval``
    clean steps, and one more overflow at step 9."""
    if mode != "fp16":
        return [1.0] * n
    out, s, clean = [], init, 0
    for i in range(n):
        out.append(s)
        if i in (0, 1, 9):
            s /= 2
            clean = 0
        else:
            clean += 1
            if clean == growth_interval:
                s *= 2
                clean = 0
    return out


def synthetic_run(
    mode: str = "fp16",
    layers: Sequence[LayerSpec] | None = None,
    steps: int = 12,
    sample_every: int = 2,
    seed: int = 0,
    nan_at: int | None = None,
) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """Tables and summary of a synthetic training run in precision ``mode`` (fp32, bf16 or fp16).

    ``nan_at``: the run dies at that step with a nan in the last block's MLP output (status incomplete).
    """
    rng = np.random.default_rng(seed)
    layers = list(layers) if layers is not None else gpt_layers()
    act_mm, act_other, param_dtype, wgrad_dtype = MODES[mode]
    n_steps = steps if nan_at is None else nan_at + 1
    scales = loss_scale_series(n_steps, mode)
    skipped_steps = {0, 1, 9} if mode == "fp16" else set()
    outlier = next((ly.name for ly in reversed(layers) if ly.name.endswith("mlp.c_proj")), layers[-1].name)
    nan_module = outlier
    lrows: list[dict[str, Any]] = []
    hrows: list[dict[str, Any]] = []
    sampled = [s for s in range(n_steps) if s % sample_every == 0 or s == n_steps - 1]
    for step in sampled:
        scale = scales[step]
        for order, ly in enumerate(layers):
            depth = order / max(1, len(layers) - 1)
            mm = ly.type in _MATMUL_TYPES
            kinds: list[tuple[str, str, int, str]] = [
                (T.ACTIVATION, "", ly.out_numel, act_mm if mm else act_other),
                (T.ACTIVATION_GRAD, "", ly.out_numel, act_mm if mm else act_other),
            ]
            for p, n in ly.params.items():
                kinds += [(T.WEIGHT, p, n, param_dtype), (T.WEIGHT_GRAD, p, n, wgrad_dtype)]
            for kind, param, numel, dtype in kinds:
                centre = _CENTRE[kind] + (2.0 if ly.name == outlier and kind == T.ACTIVATION else 0.0)
                if kind == T.ACTIVATION_GRAD:
                    centre -= 4.0 * depth  # gradients shrink towards the output in this fixture's model
                if param == "bias":
                    centre += 1.0
                spread = _SPREAD[kind] * (1.8 if ly.name == outlier and kind == T.ACTIVATION else 1.0)
                zero_frac = 0.5 if ly.type == "NewGELUActivation" and kind == T.ACTIVATION_GRAD else 0.01
                zeros = int(numel * zero_frac)
                hist = _hist(rng, numel - zeros, centre, spread)
                s = scale if kind in T.GRADIENT_KINDS else 1.0
                nan = 0
                if (
                    nan_at is not None
                    and step == n_steps - 1
                    and ly.name == nan_module
                    and kind == T.ACTIVATION
                ):
                    nan = 3
                lo, hi = min(hist), max(hist)
                row = {
                    T.STEP: step,
                    T.ORDER: order,
                    T.MODULE: ly.name,
                    T.MODULE_TYPE: ly.type,
                    T.TENSOR: kind,
                    T.PARAM: param,
                    T.DTYPE: dtype,
                    T.CALLS: 1,
                    T.NUMEL: numel,
                    T.ZEROS: zeros,
                    T.NAN: nan,
                    T.INF: 0,
                    T.ABSMAX: 2.0 ** (hi + 0.7),
                    T.ABSMIN: 2.0 ** (lo + 0.2),
                    T.SCALE: s,
                    **_lost(hist, s),
                }
                lrows.append(row)
                hrows += [
                    {
                        T.STEP: step,
                        T.MODULE: ly.name,
                        T.TENSOR: kind,
                        T.PARAM: param,
                        T.EXPONENT: e,
                        T.COUNT: c,
                    }
                    for e, c in hist.items()
                ]
            for p, n in ly.params.items():
                lost = int(n * (0.02 + 0.1 * depth))
                lrows.append(
                    {
                        T.STEP: step,
                        T.ORDER: order,
                        T.MODULE: ly.name,
                        T.MODULE_TYPE: ly.type,
                        T.TENSOR: T.WEIGHT_UPDATE,
                        T.PARAM: p,
                        T.DTYPE: param_dtype,
                        T.CALLS: 1,
                        T.NUMEL: n,
                        T.SCALE: 1.0,
                        T.LOST_UPDATE_BF16: lost,
                        T.LOST_UPDATE_FP16: lost // 4,
                    }
                )
    loss0 = 5.6
    srows = []
    for step in range(n_steps):
        loss = loss0 * math.exp(-step / 15) + 0.05 * float(rng.standard_normal())
        if nan_at is not None and step == n_steps - 1:
            loss = math.nan
        srows.append(
            {
                T.STEP: step,
                T.LOSS: loss,
                T.LOSS_SCALE: scales[step],
                T.SKIPPED: step in skipped_steps,
                T.GRAD_NORM: math.inf if step in skipped_steps else 1.5 * math.exp(-step / 20) + 0.2,
                T.TIME_S: 0.05 + 0.01 * float(rng.random()),
                T.SAMPLED: step in sampled,
                T.TOKENS: 256.0,
            }
        )
    n_params = sum(sum(ly.params.values()) for ly in layers)
    mrows = _memory_rows(layers, n_params, mode, last_step=n_steps - 1)
    tabs = {
        "layers": tables.frame("layers", lrows),
        "histograms": tables.frame("histograms", hrows),
        "steps": tables.frame("steps", srows),
        "memory": tables.frame("memory", mrows),
    }
    summary = _summary(mode, n_steps, n_params, steps, nan_at, tabs["steps"], skipped_steps)
    return tabs, summary


def _memory_rows(
    layers: Iterable[LayerSpec], n_params: int, mode: str, last_step: int
) -> list[dict[str, Any]]:
    act_bytes = 2 if mode in ("bf16", "fp16") else 4
    rows: list[dict[str, Any]] = [
        {
            T.STEP: last_step,
            T.COMPONENT: T.PARAMETERS,
            T.MODULE: "",
            T.DTYPE: "float32",
            T.BYTES: 4 * n_params,
        },
        {
            T.STEP: last_step,
            T.COMPONENT: T.GRADIENTS,
            T.MODULE: "",
            T.DTYPE: "float32",
            T.BYTES: 4 * n_params,
        },
        {
            T.STEP: last_step,
            T.COMPONENT: T.OPTIMIZER_STATES,
            T.MODULE: "",
            T.DTYPE: "float32",
            T.BYTES: 8 * n_params,
        },
    ]
    for ly in layers:
        rows.append(
            {
                T.STEP: last_step,
                T.COMPONENT: T.ACTIVATIONS,
                T.MODULE: ly.name,
                T.DTYPE: "float32" if act_bytes == 4 else ("bfloat16" if mode == "bf16" else "float16"),
                T.BYTES: act_bytes * ly.out_numel,
            }
        )
    if mode != "fp32":
        rows.append(
            {
                T.STEP: last_step,
                T.COMPONENT: T.AUTOCAST_WEIGHT_COPIES,
                T.MODULE: "",
                T.DTYPE: "bfloat16" if mode == "bf16" else "float16",
                T.BYTES: 2 * n_params,
            }
        )
    total = sum(r[T.BYTES] for r in rows)
    rows.append(
        {
            T.STEP: last_step,
            T.COMPONENT: T.ALLOCATOR_PEAK,
            T.MODULE: "",
            T.DTYPE: "",
            T.BYTES: int(total * 1.15),
        }
    )
    rows.append(
        {T.STEP: last_step, T.COMPONENT: T.PROFILER_BUFFERS, T.MODULE: "", T.DTYPE: "", T.BYTES: 2_000_000}
    )
    return rows


def _memory_projection(n_params: int, act_fp32: int, mode: str) -> list[dict[str, Any]]:
    """Flat records in the shape precprof.analysis.memory_projection writes to summary["memory"]."""
    recs: list[dict[str, Any]] = []
    per_param = {  # bytes per parameter: params, grads, optimizer states (Adam), low-precision copies
        "fp32": (4, 4, 8, 0),
        "bf16": (4, 4, 8, 2),
        "fp16": (4, 4, 8, 2),
        "bf16-pure": (2, 2, 8, 0),
    }
    act_factor = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5, "bf16-pure": 0.5}
    for m, (p, g, o, c) in per_param.items():
        src = "measured" if m == mode else "projected"
        for comp, b in (
            (T.PARAMETERS, p * n_params),
            (T.GRADIENTS, g * n_params),
            (T.OPTIMIZER_STATES, o * n_params),
            (T.AUTOCAST_WEIGHT_COPIES, c * n_params),
            (T.ACTIVATIONS, int(act_factor[m] * act_fp32)),
        ):
            recs.append({"mode": m, "component": comp, "bytes": b, "source": src})
        tb = {"fp32": 16, "bf16": 18, "fp16": 18, "bf16-pure": 12}[m]
        recs.append(
            {"mode": m, "component": "weights+grads+adam", "bytes": tb * n_params, "source": "textbook"}
        )
    return recs


def _summary(
    mode: str,
    n_steps: int,
    n_params: int,
    steps_asked: int,
    nan_at: int | None,
    steps_df: pd.DataFrame,
    skipped: set[int],
) -> dict[str, Any]:
    incomplete = nan_at is not None
    return {
        T.SUMMARY_VERSION: "0.1.0",
        T.SUMMARY_STATUS: T.STATUS_INCOMPLETE if incomplete else T.STATUS_COMPLETE,
        T.SUMMARY_INCOMPLETE_REASON: (
            f"loss became nan at step {nan_at}; training stopped" if incomplete else None
        ),
        T.SUMMARY_CONFIG: {
            "model": "gpt-nano",
            "precision": mode,
            "loss_scaling": "dynamic" if mode == "fp16" else "none",
            "steps": steps_asked,
            "batch_size": 4,
            "seq_len": 64,
            "command": f"precprof train --model gpt-nano --precision {mode} --steps {steps_asked}",
        },
        T.SUMMARY_HARDWARE: {
            "device": "cpu",
            "name": "Synthetic CPU",
            "compute_capability": None,
            "bf16_supported": True,
            "tf32_matmul_enabled": False,
            "tf32_cudnn_enabled": True,
            "float32_matmul_precision": "highest",
        },
        T.SUMMARY_VERSIONS: {"python": "3.11.7", "torch": "2.13.0+cpu", "precprof": "0.1.0"},
        T.SUMMARY_MODEL: {"name": "gpt-nano", "class": "GPT", "parameters": n_params},
        T.SUMMARY_CAPTURE: {"sample_every": 2, "autocast_dtype": None if mode == "fp32" else mode},
        T.SUMMARY_FINAL: {
            "steps": n_steps,
            "final_loss": float(steps_df[T.LOSS].iloc[-1]),
            "skipped_steps": len(skipped),
        },
        T.SUMMARY_MEMORY: _memory_projection(n_params, 2_000_000, mode),
    }


def recommendation_dict(mode: str = "fp16") -> dict[str, Any]:
    """A recommendation in the shape of ``precprof.analysis.advisor.Recommendation.to_dict()``."""
    return {
        "format": "fp16",
        "loss_scale": 2.0**15,
        "fp16_loss_scale": 2.0**15,
        "growth_interval": 2000,
        "keep_fp32": ["transformer.h.1.mlp.c_proj", "lm_head"],
        "fp8_layers": ["transformer.h.0.mlp.c_fc"],
        "reasons": [
            "The target has FP16 tensor cores but no BF16: FP16 with loss scaling.",
            "At scale 2^15, 0.02% of activation-gradient values still underflow (was 41.3% at scale 1).",
        ],
        "findings": [
            {
                "code": "fp16_activation_overflow",
                "severity": "critical",
                "title": "Activations overflow FP16",
                "message": "transformer.h.1.mlp.c_proj produces values up to 2^19, beyond FP16's 65504.",
                "remedy": "Keep transformer.h.1.mlp.c_proj in FP32 or use BF16.",
                "modules": ["transformer.h.1.mlp.c_proj"],
                "numbers": {"absmax": 524288.0, "overflow_values": 1200, "modules": 1},
            },
            {
                "code": "tf32_off",
                "severity": "info",
                "title": "TF32 is off",
                "message": "TF32 matmuls are disabled.",
                "remedy": "torch.backends.cuda.matmul.allow_tf32 = True",
                "modules": [],
                "numbers": {},
            },
            {
                "code": "fp16_gradient_underflow",
                "severity": "warning",
                "title": "Activation gradients underflow at scale 1",
                "message": "41.3% of activation-gradient values underflow in FP16 without loss scaling.",
                "remedy": "Use a loss scale of 2^15.",
                "method": "A value underflows when |x| * scale < 2^-25 (FP16's smallest subnormal, halved).",
                "modules": ["transformer.h.0.attn.c_attn"],
                "numbers": {"share_at_scale_1": 0.413, "share_at_run_scale": 0.413, "run_scale_log2": 0},
            },
        ],
        "target": "t4",
    }


def real_run(precision: str, base: Any, steps: int = 3) -> Any:
    """A real ``precprof train`` run of gpt-nano (tiny batch, every step sampled), report rendered by the
    training loop itself. Cached under ``base``: test modules that ask for the same run share it."""
    from pathlib import Path

    out = Path(base) / f"gpt-nano-{precision}"
    if (out / "summary.json").exists() and (out / "report.html").exists():
        return out
    import torch

    from precprof.training import TrainConfig, train

    torch.manual_seed(0)
    train(
        TrainConfig(
            model="gpt-nano",
            precision=precision,
            steps=steps,
            batch_size=2,
            seq_len=16,
            sample_every=1,
            progress=False,
            out=out,
            report=True,
        )
    )
    return out
