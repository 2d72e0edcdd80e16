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
updates round away (the ``lost_update_*`` counts say how many).

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
    sq = pd.DataFrame(
        {
            T.MODULE: T.texts(rows[T.MODULE]).astype(str).to_numpy(),
            T.STEP: pd.to_numeric(rows[T.STEP], errors="coerce").to_numpy(),
            "du": du.to_numpy(),
            "dw": dw.to_numpy(),
            T.ABSMAX: pd.to_numeric(rows[T.ABSMAX], errors="coerce").to_numpy(dtype=float),
        }
    ).dropna(subset=["du", "dw"])
    per = sq.groupby([T.MODULE, T.STEP], sort=False).agg(
        du=("du", "sum"), dw=("dw", "sum"), absmax=(T.ABSMAX, "max")
    )
    per = per[per["dw"] > 0]
    out = pd.DataFrame({"ratio": np.sqrt(per["du"] / per["dw"]), T.ABSMAX: per["absmax"]})
    return out.reset_index()


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
    return {str(m): {k: float(v) for k, v in r.items()} for m, r in stats.iterrows()}


def summary(layers: pd.DataFrame, shared: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """summary.json's ``weight_updates``: the per-layer ratios (``layer_ratios``) in forward order (``shared``:
    the capture's shared parameters, as ``tables.module_order`` takes them), and over the layers the median of
    their medians and the largest ratio with its layer; None without any."""
    per = layer_ratios(layers)
    if not per:
        return None
    rank = T.module_order(layers, shared)
    names = sorted(per, key=lambda m: (rank.get(m, math.inf), m))
    top = max(names, key=lambda m: per[m]["max"])
    return {
        "ratio_median": float(np.median([per[m]["median"] for m in names])),
        "ratio_max": per[top]["max"],
        "ratio_max_layer": top,
        "layers": [
            {
                "module": m,
                **{k: v if math.isfinite(v) else None for k, v in per[m].items()},
                "steps": int(per[m]["steps"]),
            }
            for m in names
        ],
    }
