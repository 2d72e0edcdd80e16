"""Tensor-core alignment and FP8 eligibility from the layers' shapes."""

from __future__ import annotations

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import (
    _model_dims,
    _nonzero,
    _Plan,
    _Run,
    _share,
    _tokens_per_call,
)
from precprof.analysis.advisor.model import INFO, WARNING, Finding, Number
from precprof.analysis.advisor.text import _name, _pct
from precprof.formats import FP8_E4M3, FP8_E5M2


def _rule_alignment(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    a = cfg.alignment
    bad: dict[str, str] = {}
    for m, d in dims.items():
        off = [f"{lbl}={v}" for lbl, v in d.items() if v % a]
        if off:
            bad[m] = ", ".join(off)
    model_off = {k: v for k, v in _model_dims(run).items() if v % a}
    tokens = _tokens_per_call(run)
    tok_off = tokens is not None and tokens % a != 0
    if not (bad or model_off or tok_off):
        return
    parts = []
    if model_off:
        parts.append("model dims " + ", ".join(f"{k}={v}" for k, v in model_off.items()))
    if bad:
        parts.append(
            "layers "
            + "; ".join(f"{_name(m)} ({bad[m]})" for m in run.sort(bad)[: cfg.max_listed_modules])
            + (f" and {len(bad) - cfg.max_listed_modules} more" if len(bad) > cfg.max_listed_modules else "")
        )
    if tok_off:
        parts.append(f"batch x sequence = {tokens}")
    numbers: dict[str, Number] = {"alignment": a, "layers": len(bad), "tokens": tokens}
    numbers.update({f"dim_{k}": v for k, v in model_off.items()})
    plan.add(
        Finding(
            "tensor_core_alignment",
            WARNING if run.hw.device == "cuda" else INFO,
            f"Dimensions not a multiple of {a}",
            f"Tensor cores run fp16/bf16 matmuls at full speed when every dimension is a multiple of {a} "
            f"({cfg.fp8_alignment} for FP8); these are not: {'; '.join(parts)}.",
            f"Pad them to a multiple of {a} or 64 (nanoGPT pads GPT-2's vocabulary from 50257 to 50304).",
            modules=run.sort(bad),
            numbers=numbers,
        )
    )


def _rule_fp8(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    linear = [m for m in plan.matmul_layers if taxonomy.is_linear_type(run.types.get(m, ""))]
    if not linear:
        return
    e4, e5 = T.underflow_cs_col(FP8_E4M3.name), T.underflow_cs_col(FP8_E5M2.name)
    lay = run.layers[run.layers[T.MODULE].isin(linear)]
    rows: list[tuple[str, float | None, float | None, str]] = []
    for m in linear:
        mine = lay[lay[T.MODULE] == m]
        fwd = mine[mine[T.TENSOR].isin((T.ACTIVATION, T.WEIGHT))]
        bwd = mine[mine[T.TENSOR] == T.ACTIVATION_GRAD]
        f_share = _share(float(fwd[e4].sum()), _nonzero(fwd))
        b_share = _share(float(bwd[e5].sum()), _nonzero(bwd))
        why = ""
        if (mine[T.NAN] + mine[T.INF]).sum() > 0:
            why = "non-finite values"
        elif f_share is None or b_share is None:
            why = "no forward or backward statistics"
        elif f_share > cfg.fp8_underflow_max:
            why = f"e4m3 forward underflow {_pct(f_share)}"
        elif b_share > cfg.fp8_underflow_max:
            why = f"e5m2 gradient underflow {_pct(b_share)}"
        elif m in dims and any(v % cfg.fp8_alignment for v in dims[m].values()):
            why = f"dims {dims[m]['in']}x{dims[m]['out']} not multiples of {cfg.fp8_alignment}"
        rows.append((m, f_share, b_share, why))
    plan.fp8_checked = len(rows)
    plan.fp8_eligible = [m for m, _, _, why in rows if not why]
    bad = [(m, why) for m, _, _, why in rows if why]
    fmax = max((f for _, f, _, _ in rows if f is not None), default=None)
    bmax = max((b for _, _, b, _ in rows if b is not None), default=None)
    plan.add(
        Finding(
            "fp8_eligibility",
            WARNING if run.hw.fp8_supported and not plan.fp8_eligible else INFO,
            f"{len(plan.fp8_eligible)} of {len(rows)} linear layers are FP8-eligible",
            f"Under per-tensor current scaling (scale 2^floor(log2(fmax/amax)), Transformer Engine's "
            f"current-scaling recipe), a layer is eligible when at most {_pct(cfg.fp8_underflow_max)} of its "
            "nonzero weight and output values underflow e4m3 and of its output gradients underflow e5m2 "
            "(its input is the previous module's output, checked there). "
            f"{len(plan.fp8_eligible)} of {len(rows)} qualify; worst shares: e4m3 {_pct(fmax)}, e5m2 {_pct(bmax)}"
            + (
                ". Not eligible: " + "; ".join(f"{_name(m)} ({w})" for m, w in bad[: cfg.max_listed_modules])
                if bad
                else ""
            )
            + ".",
            ("Convert" if run.hw.fp8_supported else "On FP8 hardware (compute capability 8.9+), convert")
            + " the eligible layers to FP8 (torchao convert_to_float8_training with a module filter) and keep "
            "the others in bf16.",
            modules=plan.fp8_eligible,
            numbers={
                "eligible": len(plan.fp8_eligible),
                "checked": len(rows),
                "max_e4m3_share": fmax,
                "max_e5m2_share": bmax,
                "threshold": cfg.fp8_underflow_max,
            },
        )
    )
