"""The decision: from the findings and the target machine to one format, loss scale and keep list."""

from __future__ import annotations

from precprof.analysis.advisor.evidence import _Plan, _Run
from precprof.analysis.advisor.model import Recommendation
from precprof.analysis.advisor.text import _g, _listing, _pct, _scale


def _decide(run: _Run, plan: _Plan) -> Recommendation:
    hw, cfg = run.hw, run.cfg
    target = hw.preset or hw.name
    k = plan.loss_scale_log2
    reasons: list[str] = []
    bf16_ok = hw.bf16_native
    where = f"{hw.name}" + (
        f" (compute capability {'.'.join(map(str, hw.compute_capability))})" if hw.compute_capability else ""
    )
    fmt: str
    if hw.fp8_supported and hw.fp8_library and plan.fp8_eligible and bf16_ok and not plan.bf16_block:
        fmt = "fp8"
        reasons.append(
            f"{where} has FP8 tensor cores and {hw.fp8_library}: {len(plan.fp8_eligible)} of "
            f"{plan.fp8_checked} linear layers keep e4m3/e5m2 underflow at or below "
            f"{_pct(cfg.fp8_underflow_max)} under per-tensor current scaling, so they can run in FP8; "
            "the rest runs in bf16 autocast."
        )
    elif bf16_ok and not plan.bf16_block:
        fmt = "bf16"
        why = "runs bf16 natively"
        if hw.fp8_supported and not plan.fp8_eligible and plan.fp8_checked:
            why += f", and none of its {plan.fp8_checked} linear layers is FP8-eligible"
        reasons.append(
            f"{where} {why}; bf16 has fp32's exponent range, so no loss scale is needed and the measured "
            "gradients do not underflow it."
        )
    elif hw.fp16_tensor_cores and not plan.fp16_block:
        fmt = "fp16"
        if not bf16_ok:
            reasons.append(f"{where} has fp16 tensor cores but no native bf16.")
        else:
            reasons.append("bf16 is ruled out: " + "; ".join(plan.bf16_block) + ".")
    elif hw.tf32_supported:
        fmt = "tf32"
    else:
        fmt = "fp32"
    if fmt in ("tf32", "fp32"):
        blocks = []
        if not bf16_ok:
            blocks.append(f"{where} has no native bf16")
        elif plan.bf16_block:
            blocks.append("bf16 is ruled out: " + "; ".join(plan.bf16_block))
        if not hw.fp16_tensor_cores:
            blocks.append("it has no fp16 tensor cores")
        elif plan.fp16_block:
            blocks.append("fp16 is ruled out: " + "; ".join(plan.fp16_block))
        reasons.append(
            "; ".join(blocks)
            + (
                ". TF32 keeps fp32's range and speeds up its matmuls (set_float32_matmul_precision('high'))."
                if fmt == "tf32"
                else ", so fp32 is the safe choice."
            )
        )
    if fmt == "fp16":
        gm = plan.grad_absmax
        reasons.append(
            f"Start GradScaler at init_scale={_scale(k)} (2^{k}): the largest gradient seen, {_g(gm)}, times "
            f"2^{k} stays below 65504 / {2**cfg.fp16_margin_log2}; activation-gradient underflow falls from "
            f"{_pct(plan.underflow_at_1)} at scale 1 to {_pct(plan.underflow_at_rec)}."
        )
        if plan.keep_fp16:
            reasons.append(
                f"Keep {_listing(plan.keep_fp16, cfg.max_listed_modules)} in fp32: their activations "
                "overflow or come within 2x of fp16's 65504."
            )
        reasons.append("Keep fp32 master weights and optimizer states (autocast with an fp32 model does).")
    if plan.n_params is not None and plan.n_params < cfg.small_model_params and fmt not in ("fp32", "tf32"):
        reasons.append(
            f"The model is small ({plan.n_params / 1e6:.3g}M parameters): if {fmt} is not faster in practice, "
            "fp32 is just as good."
        )
    keep = {"fp16": plan.keep_fp16, "bf16": plan.keep_bf16, "fp8": plan.keep_bf16}.get(fmt, [])
    return Recommendation(
        format=fmt,
        loss_scale=2.0**k if fmt == "fp16" else None,
        fp16_loss_scale=2.0**k,
        growth_interval=plan.growth_interval if fmt == "fp16" else None,
        keep_fp32=list(keep),
        fp8_layers=list(plan.fp8_eligible) if fmt == "fp8" else [],
        reasons=reasons,
        target=target,
    )
