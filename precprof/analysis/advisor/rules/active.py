"""Mixed precision asked for but not active: matmul layers still producing float32."""

from __future__ import annotations

from collections.abc import Mapping

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import _Plan, _Run
from precprof.analysis.advisor.model import CRITICAL, INFO, Finding, Number
from precprof.analysis.advisor.text import _listing, _pct


def _rule_mixed_precision_active(run: _Run, plan: _Plan) -> None:
    requested = taxonomy.summary_requested(run.summary, default=run.precision)
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    implied = ""
    if (
        not requested
        and isinstance(capture, Mapping)
        and capture.get("scaler")
        and capture.get("scaler_enabled")
    ):
        # the user's own loop: an enabled GradScaler is a request for fp16 (it exists for nothing else)
        requested = "fp16"
        implied = f" (implied by the enabled {capture['scaler']})"
    if taxonomy.requested_low_dtype(requested) is None:
        return
    fp32_layers, n_matmul = taxonomy.float32_matmul_layers(run.layers)
    fp32 = run.sort(fp32_layers)
    if not fp32 or not n_matmul:
        return
    share = len(fp32) / n_matmul
    nums: dict[str, Number] = {
        "requested": requested,
        "fp32_layers": len(fp32),
        "matmul_layers": n_matmul,
        "share": share,
    }
    listing = _listing(fp32, run.cfg.max_listed_modules)
    seen = capture.get("autocast") if isinstance(capture, Mapping) else None
    autocast_off = isinstance(seen, Mapping) and seen.get("enabled") is False
    if autocast_off:
        nums["autocast_enabled"] = 0
    if share >= run.cfg.mp_inactive_share:
        plan.add(
            Finding(
                "mixed_precision_inactive",
                CRITICAL,
                f"{requested} was requested but is not active",
                f"The run asked for {requested}{implied}, yet all {len(fp32)} matmul layers produced float32 "
                f"outputs ({listing})"
                + ("; torch autocast was off during the forward pass" if autocast_off else "")
                + ": the run trained in fp32. accelerate, for one, ignores fp16=True on CPU.",
                "Wrap the forward pass in torch.autocast(device_type, dtype=...) on a device that supports "
                "it, or train on a GPU where the requested precision applies.",
                modules=fp32,
                numbers=nums,
            )
        )
    else:
        plan.add(
            Finding(
                "mixed_precision_partial",
                INFO,
                f"{len(fp32)} of {n_matmul} matmul layers run in float32",
                f"With {requested} requested, {len(fp32)} of {n_matmul} matmul layers "
                f"({_pct(share)}) still produced float32 outputs: {listing}.",
                "Nothing to do if these layers are kept in fp32 on purpose; otherwise check that they run "
                "inside autocast.",
                modules=fp32,
                numbers=nums,
            )
        )
