"""Mixed precision asked for but not active: matmul layers still producing float32, and a mixture of experts'
expert weights multiplied in float32."""

from __future__ import annotations

import math
from collections.abc import Mapping

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import _bank_activations, _expert_banks, _Plan, _Run
from precprof.analysis.advisor.model import CRITICAL, INFO, WARNING, Finding, Number
from precprof.analysis.advisor.text import _listing, _pct


def _rule_mixed_precision_active(run: _Run, plan: _Plan) -> None:
    requested = taxonomy.summary_requested(run.summary, default=run.precision)
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    implied = ""
    if (
        requested
        and not run.precision
        and isinstance(capture, Mapping)
        and capture.get("mixed_precision_asked_as")
    ):
        # the user's own loop, wrapped by a framework set to it (capture.given.asked_precision): in its words
        implied = f" ({capture['mixed_precision_asked_as']})"
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
    autocast_off = run.autocast.get("enabled") is False
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


def _rule_experts_fp32(run: _Run, plan: _Plan) -> None:
    """Expert weights multiplied in float32 while the run asked for a 16-bit precision: seen in the dtype of what
    the expert matmuls hand on, the activations of the bank's own modules (its activation function); the bank's
    output says nothing (transformers adds the experts' outputs into a copy of its float32 input)."""
    requested = taxonomy.summary_requested(run.summary, default=run.precision)
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    if not requested and run.autocast.get("enabled"):
        # the user's own loop asks for nothing but turned autocast on: that is the request
        requested = {"bfloat16": "bf16", "float16": "fp16"}.get(str(run.autocast.get("dtype")), "")
        asked = f"{requested} autocast on"
    else:
        asked = f"{requested} requested"
    low = taxonomy.requested_low_dtype(requested)
    banks = _expert_banks(run)
    if low is None or not banks or run.layers.empty:
        return
    acts = run.kind(T.ACTIVATION)
    names = T.texts(acts[T.MODULE]).astype(object)
    dtypes = T.texts(acts[T.DTYPE]).astype(object)
    fp32: dict[str, list[str]] = {}
    for bank in banks:
        inner = names.isin(_bank_activations(run, bank)).to_numpy()
        seen = {d for v in dtypes[inner] for d in str(v).split("|") if d}
        if seen == {"float32"}:
            fp32[bank] = sorted(set(names[inner]))
    if not fp32:
        return
    n_params = capture.get("n_params") if isinstance(capture, Mapping) else None
    elements = sum(math.prod(v) for b in fp32 for v in banks[b])
    share = elements / n_params if isinstance(n_params, int) and n_params > 0 else None
    modules = run.sort(list(fp32))
    inner = sorted({m for ms in fp32.values() for m in ms})
    plan.add(
        Finding(
            "experts_fp32",
            WARNING,
            f"Expert weights multiplied in float32 under {requested}",
            f"With {asked}, the experts of {len(fp32)} mixture-of-experts module(s) "
            f"({_listing(modules, run.cfg.max_listed_modules)}"
            + (f"; {_pct(share)} of the model's parameters" if share is not None else "")
            + ") ran their matmuls in float32: what the expert matmuls hand on, the activations of "
            f"{_listing(inner, run.cfg.max_listed_modules)}, was float32 on every sampled step. Autocast casts "
            "the inputs of the ops it lists (linear, mm, bmm and others), and an op it does not list runs in its "
            "inputs' dtype: torch._grouped_mm, which transformers' default experts implementation "
            '("grouped_mm") calls, is not listed.',
            'Run the experts through ops autocast casts: in transformers, experts_implementation="batched_mm" '
            '(or "eager") in the model\'s config or from_pretrained; then check that these activations are '
            f"{requested} in a new run.",
            modules=modules,
            numbers={"banks": len(fp32), "expert_params": elements, "share_of_params": share},
        )
    )
