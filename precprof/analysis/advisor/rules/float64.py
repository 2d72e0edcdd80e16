"""Matmul layers that ran in float64 (a ``model.double()`` model): float64 takes twice FP32's bytes, and autocast
leaves float64 ops alone, so a 16-bit precision asked for does nothing for them (the run said they "ran in fp32
outside autocast")."""

from __future__ import annotations

import pandas as pd

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import _Plan, _Run
from precprof.analysis.advisor.model import CRITICAL, INFO, WARNING, Finding, Number
from precprof.analysis.advisor.text import _listing, _pct


def float64_matmul_layers(run: _Run) -> tuple[list[str], int]:
    """(the matmul layers whose activations were float64 at the last sampled step, in forward order, how many
    matmul layers there were). A layer called with several dtypes is one of them only when none of its calls
    was float32 or 16-bit (``taxonomy.narrowest_dtype``): a float32 call is mixed_precision_inactive's, a 16-bit
    one made mixed precision active there, as ``taxonomy.mixed_precision_check`` counts it."""
    dtypes = taxonomy.matmul_activation_dtypes(run.layers)
    return run.sort(m for m, d in dtypes.items() if d == "float64"), len(dtypes)


def _float64_share(run: _Run) -> float | None:
    """The share of the parameter elements (each parameter once, at the last sampled step) that are float64; None
    without weight rows."""
    weights = run.kind(T.WEIGHT)
    if weights.empty:
        return None
    weights = weights[weights[T.STEP] == weights[T.STEP].max()]
    if T.PARAM in weights:
        weights = weights.drop_duplicates([T.MODULE, T.PARAM])
    numel = pd.to_numeric(weights[T.NUMEL], errors="coerce").fillna(0)
    total = float(numel.sum())
    return float(numel[T.texts(weights[T.DTYPE]).to_numpy() == "float64"].sum()) / total if total else None


def _rule_float64(run: _Run, plan: _Plan) -> None:
    """float64_layers: matmul layers that computed in float64. Where a 16-bit precision was asked for (or autocast
    was on in the user's own loop) it did nothing for them: critical where that is every matmul layer (as
    mixed_precision_inactive), a warning otherwise; info where none was, FP32 halving what they hold."""
    layers, n = float64_matmul_layers(run)
    if not layers:
        return
    requested = taxonomy.summary_requested(run.summary, default=run.precision)
    on = ""
    if taxonomy.requested_low_dtype(requested) is None and run.autocast.get("enabled"):
        # the user's own loop asks for nothing but turned autocast on: that is the request
        requested = {"bfloat16": "bf16", "float16": "fp16"}.get(str(run.autocast.get("dtype")), "")
        on = " (autocast on)"
    low = taxonomy.requested_low_dtype(requested) is not None
    share, params = len(layers) / n, _float64_share(run)
    listing = _listing(layers, run.cfg.max_listed_modules)
    numbers: dict[str, Number] = {
        "float64_layers": len(layers),
        "matmul_layers": n,
        "float64_param_share": params,
    }
    what = (
        f"{listing} computed in float64 (every output float64)"
        + (f"; {_pct(params)} of the parameter elements are float64" if params is not None else "")
        + ": their weights are float64 (model.double(), or parameters made with dtype=torch.float64)."
    )
    if low:
        numbers["requested"] = requested
        plan.add(
            Finding(
                "float64_layers",
                CRITICAL if share >= run.cfg.mp_inactive_share else WARNING,
                f"{len(layers)} of {n} matmul layers ran in float64, which {requested} autocast leaves alone",
                f"{what} The run asked for {requested}{on}, but autocast casts float32 tensors alone and leaves "
                f"float64 ops as they are: these layers ran in float64, 8 bytes a value, not in {requested}.",
                "Cast the model to float32 (model.float(), or leave out .double()) and feed it float32 inputs: "
                f"autocast then runs these matmuls in {requested}.",
                modules=layers,
                numbers=numbers,
            )
        )
        return
    plan.add(
        Finding(
            "float64_layers",
            INFO,
            f"{len(layers)} of {n} matmul layers trained in float64",
            f"{what} Float64 takes 8 bytes a value, FP32 4: in FP32 their parameters, gradients, optimizer states "
            "and activations take half (the verdict's memory line projects it for the whole run).",
            "Unless the training needs float64's precision, cast the model to float32 (model.float(), or leave "
            "out .double()) and feed it float32 inputs.",
            modules=layers,
            numbers=numbers,
        )
    )
