"""The update-to-weight ratio per layer: ||dw|| / ||w|| of each sampled step's optimizer update, from the
``weight_update`` rows' ``update_rms`` and ``weight_rms`` (the sampled elements of each parameter, read before
and after ``optimizer.step()``), and its median and maximum over the sampled steps.

A module's parameters (a weight and its bias) are taken together on each step, by their sums of squares:
sqrt(sum numel * update_rms^2) / sqrt(sum numel * weight_rms^2), each parameter counted at its size (its
``weight`` rows' elements), not at its sampled elements (at most 256 of a weight's 65,536 beside all 16 of its
bias had given the bias 6% of the layer's norm, where it holds 0.02%). A step whose sampled weights were all zero
(a zero-initialised layer's first step) has no ratio: the update is not small or large against nothing. The
usual reading for Adam-like optimizers is a ratio near 1e-3: far above, the learning rate moves a layer's
weights by a large share per step; far below, the layer barely trains, and in a low-precision weight its
updates round away (the ``lost_update_*`` counts say how many). A step on which some sampled update of a
module's parameters was nan or inf (its weights became non-finite, or were already) has no ratio either: the
sums hold its finite updates alone, and a layer whose every update was nan read as one whose update was 0
(``nonfinite_steps`` counts those steps). A parameter whose learning rate was 0 on the step (a warmup from 0, a
param group frozen by ``lr=0``: its row's ``calls``, the optimizer steps that updated it, is 0) made no update:
it is left out, as the lost-update counts leave it out, rather than read as a layer that barely trains. So is a
parameter that had no gradient at the optimizer's step (a batch the loop skipped, Lightning's ``training_step``
returning None: the optimizer stepped on no gradient and moved nothing; ``capture/update_steps.py``).

Pure pandas over the layers table; nothing here reads torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from precprof import tables as T


def step_ratios(layers: pd.DataFrame) -> pd.DataFrame:
    """Per (module, sampled step) with a ratio: ``ratio`` (||dw|| / ||w||, the module's parameters together) and
    ``absmax`` (the largest |update|). Empty when the table has no update sizes (a run recorded before them)."""
    if T.UPDATE_RMS not in layers.columns or layers.empty:
        return pd.DataFrame(columns=[T.MODULE, T.STEP, "ratio", T.ABSMAX])
    rows = layers[T.texts(layers[T.TENSOR]) == T.WEIGHT_UPDATE]
    du, dw = T.update_squares(layers)
    # (a run recorded before ``calls`` counted the optimizer steps wrote 1)
    calls = rows[T.CALLS] if T.CALLS in rows else pd.Series(1, index=rows.index)
    updated = pd.to_numeric(calls, errors="coerce").fillna(1).to_numpy() > 0
    sq = pd.DataFrame(
        {
            T.MODULE: T.texts(rows[T.MODULE]).astype(str).to_numpy(),
            T.STEP: pd.to_numeric(rows[T.STEP], errors="coerce").to_numpy(),
            "du": du.to_numpy(),
            "dw": dw.to_numpy(),
            T.ABSMAX: pd.to_numeric(rows[T.ABSMAX], errors="coerce").to_numpy(dtype=float),
            "bad": _nonfinite(rows).to_numpy(),
        }
    )[updated].dropna(subset=["du", "dw"])
    per = sq.groupby([T.MODULE, T.STEP], sort=False).agg(
        du=("du", "sum"), dw=("dw", "sum"), absmax=(T.ABSMAX, "max"), bad=("bad", "sum")
    )
    per = per[(per["dw"] > 0) & (per["bad"] == 0)]
    out = pd.DataFrame({"ratio": np.sqrt(per["du"] / per["dw"]), T.ABSMAX: per["absmax"]})
    return out.reset_index()


def _nonfinite(rows: pd.DataFrame) -> pd.Series:
    """Per ``weight_update`` row, its sampled updates that were nan or inf (0 in a run recorded before they were
    counted)."""
    cols = [c for c in (T.NAN, T.INF) if c in rows.columns]
    return rows[cols].apply(pd.to_numeric, errors="coerce").fillna(0).sum(axis=1)


def nonfinite_steps(layers: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Per module with a nan or inf among its sampled updates: (the sampled steps with one, the sampled steps
    with updates of it), in forward order of the table's rows."""
    if layers.empty:
        return {}
    rows = layers[T.texts(layers[T.TENSOR]) == T.WEIGHT_UPDATE]
    steps = pd.DataFrame(
        {
            T.MODULE: T.texts(rows[T.MODULE]).astype(str).to_numpy(),
            T.STEP: pd.to_numeric(rows[T.STEP], errors="coerce").to_numpy(),
            "bad": _nonfinite(rows).to_numpy() > 0,
        }
    )
    per = steps.groupby([T.MODULE, T.STEP], sort=False)["bad"].any().groupby(level=0, sort=False)
    bad, every = per.sum(), per.size()
    return {str(m): (int(b), int(n)) for m, b, n in zip(bad.index, bad, every, strict=True) if b > 0}


def layer_ratios(layers: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per module with a ratio on some sampled step: ``median`` and ``max`` of its ratio over those steps,
    ``steps`` (how many), ``absmax`` (the largest |update| on any of them)."""
    per = step_ratios(layers)
    if per.empty:
        return {}
    g = per.groupby(T.MODULE, sort=False)
    stats = pd.DataFrame(
        {
            "median": g["ratio"].median(),
            "max": g["ratio"].max(),
            "steps": g.size(),
            "absmax": g[T.ABSMAX].max(),
        }
    )
    return {str(m): {k: float(v) for k, v in r.items()} for m, r in stats.to_dict("index").items()}


def summary(layers: pd.DataFrame, shared: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """summary.json's ``weight_updates``: the per-layer ratios (``layer_ratios``) in forward order (``shared``:
    the capture's shared parameters, as ``tables.module_order`` takes them), and over the layers the median of
    their medians and the largest ratio with its layer (None without any), and ``nonfinite_steps`` per layer
    with steps left out for a nan or inf update (``nonfinite_steps``: [left out, sampled]); None without
    either."""
    per = layer_ratios(layers)
    bad = nonfinite_steps(layers)
    if not per and not bad:
        return None
    rank = T.module_order(layers, shared)
    names = sorted(per, key=lambda m: (rank.get(m, math.inf), m))
    top = max(names, key=lambda m: per[m]["max"]) if names else None
    return {
        "ratio_median": float(np.median([per[m]["median"] for m in names])) if names else None,
        "ratio_max": per[top]["max"] if top is not None else None,
        "ratio_max_layer": top,
        **({"nonfinite_steps": {m: list(n) for m, n in bad.items()}} if bad else {}),
        "layers": [
            {
                "module": m,
                **{k: v if math.isfinite(v) else None for k, v in per[m].items()},
                "steps": int(per[m]["steps"]),
            }
            for m in names
        ],
    }
