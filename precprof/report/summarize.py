"""Aggregations of the run tables that the report shows: pure pandas, no plotting, no HTML.

Every function takes the tidy tables of precprof.tables (any number of sampled steps) and returns small frames
or plain records. Counts are summed over sampled steps and calls; shares are ``count / numel`` of the same
rows, so a share is "of all values seen on sampled steps". Gradient counts are at the loss scale that was in
effect on each step (the ``scale`` column), exactly as recorded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from precprof import formats, taxonomy
from precprof import tables as T
from precprof.analysis import lost_updates, update_ratio
from precprof.report.filters import step_runs

# tensor kinds with histograms, in the order the report shows them
HIST_KINDS: tuple[str, ...] = (T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT, T.WEIGHT_GRAD)
KIND_LABELS: dict[str, str] = {
    T.ACTIVATION: "activations",
    T.ACTIVATION_GRAD: "activation gradients",
    T.WEIGHT: "weights",
    T.WEIGHT_GRAD: "weight gradients",
    T.WEIGHT_UPDATE: "weight updates",
}
ROOT_LABEL = T.ROOT_LABEL
# the kinds a per-layer table's "zeros" counts, as its columns name them ("act. grad")
ZERO_KIND_LABELS: dict[str, str] = {
    T.ACTIVATION: "act.",
    T.ACTIVATION_GRAD: "act. grad",
    T.WEIGHT: "weight",
    T.WEIGHT_GRAD: "weight grad",
}
# the weight-update columns of the formats a share of lost updates is read in (``layer_records``)
LOST_UPDATE_COLUMNS = {"bf16": T.LOST_UPDATE_BF16, "fp16": T.LOST_UPDATE_FP16}
# memory components that are totals of the whole process or device, not parts of a stack
PEAK_COMPONENTS = T.MEMORY_PEAK_COMPONENTS


module_label = T.module_label  # a module's display name ("" is the root model)


def forward_order(layers: pd.DataFrame, shared: Mapping[str, Any] | None = None) -> list[str]:
    """Module names in forward order (``tables.module_order``, a never-running owner of a weight others read
    placed by ``shared``, the capture's ``shared_params``; first appearance breaks ties and fills gaps)."""
    if layers.empty:
        return []
    first = (
        pd.Series(np.arange(len(layers)), index=layers.index)
        .groupby(layers[T.MODULE], sort=False, observed=True)
        .min()
    )
    g = pd.DataFrame({"order": T.module_order(layers, shared), "first": first})
    g["order"] = g["order"].fillna(math.inf)
    return [str(m) for m in g.sort_values(["order", "first"]).index]


def row_order(
    layers: pd.DataFrame,
    kind: str,
    shared: Mapping[str, Any] | None = None,
    order: Sequence[str] | None = None,
) -> list[tuple[str, str]]:
    """(module, param) rows of tensor kind ``kind`` in forward order (``forward_order``, or ``order`` where the
    caller has it: a page reads it in six places); params in order of first appearance."""
    sub = layers.loc[layers[T.TENSOR] == kind, [T.MODULE, T.PARAM]]  # the columns it reads: a narrow copy
    if sub.empty:
        return []
    rank = {m: i for i, m in enumerate(forward_order(layers, shared) if order is None else order)}
    # a few hundred distinct rows, as plain text: a categorical would map to a categorical and sort by its codes
    keys = sub[[T.MODULE, T.PARAM]].apply(T.texts).drop_duplicates().astype(object)
    keys = keys.assign(_r=keys[T.MODULE].map(rank).fillna(len(rank)), _i=np.arange(len(keys)))
    keys = keys.sort_values(["_r", "_i"])
    return [(str(m), str(p)) for m, p in zip(keys[T.MODULE], keys[T.PARAM], strict=True)]


def row_label(module: str, param: str) -> str:
    """Display name of a (module, param) row: ``block.attn.c_attn.weight`` or the module alone."""
    if not param:
        return module_label(module)
    return f"{module}.{param}" if module else param


def _sum(df: pd.DataFrame, col: str) -> float:
    return float(pd.to_numeric(df[col], errors="coerce").fillna(0).sum()) if col in df else 0.0


def _share(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _last_scale(rows: pd.DataFrame) -> float:
    if rows.empty:
        return 1.0
    last = rows[rows[T.STEP] == rows[T.STEP].max()]
    s = pd.to_numeric(last[T.SCALE], errors="coerce").dropna()
    return float(s.median()) if len(s) else 1.0


def scale_in_effect(layers: pd.DataFrame, kind: str) -> dict[str, float]:
    """Loss scale in effect for rows of ``kind``: at the last sampled step, and its range over sampled steps.

    Forward tensors are always at scale 1. Returns {"last", "min", "max"}.
    """
    rows = layers.loc[layers[T.TENSOR] == kind, [T.STEP, T.SCALE]]
    s = pd.to_numeric(rows[T.SCALE], errors="coerce").dropna()
    if s.empty:
        return {"last": 1.0, "min": 1.0, "max": 1.0}
    return {"last": _last_scale(rows), "min": float(s.min()), "max": float(s.max())}


def heatmap_matrix(
    histograms: pd.DataFrame,
    layers: pd.DataFrame,
    kind: str,
    shared: Mapping[str, Any] | None = None,
    order: Sequence[str] | None = None,
) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """Rows (module, param) in forward order, exponents, and counts[row, exponent] summed over sampled steps.

    ``histograms``: the histograms table, or its ``tables.sum_histogram_frame`` (faster when called per kind).
    ``order``: ``forward_order(layers, shared)`` where the caller has it."""
    h = histograms[histograms[T.TENSOR] == kind]
    rows = row_order(layers, kind, shared, order)
    if h.empty:
        return rows, np.zeros(0, dtype=np.int64), np.zeros((len(rows), 0))
    # rows seen only in the histograms (older runs without layer rows) go last, in order of appearance
    known = set(rows)
    extra = h[[T.MODULE, T.PARAM]].apply(T.texts).drop_duplicates()
    rows += [
        (str(m), str(p)) for m, p in zip(extra[T.MODULE], extra[T.PARAM], strict=True) if (m, p) not in known
    ]
    g = h.groupby([T.MODULE, T.PARAM, T.EXPONENT], sort=False)[T.COUNT].sum().reset_index()
    exps = np.arange(int(g[T.EXPONENT].min()), int(g[T.EXPONENT].max()) + 1)
    idx = {r: i for i, r in enumerate(rows)}
    ri = np.array([idx[(str(m), str(p))] for m, p in zip(g[T.MODULE], T.texts(g[T.PARAM]), strict=True)])
    ci = g[T.EXPONENT].to_numpy(dtype=np.int64) - exps[0]
    mat = np.zeros((len(rows), len(exps)))
    np.add.at(mat, (ri, ci), g[T.COUNT].to_numpy(dtype=float))
    return rows, exps, mat


def lost_share_by_row(
    layers: pd.DataFrame, kind: str, fmt: str, current_scaling: bool = False
) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(underflow, overflow, inf/nan) shares per (module, param) row of ``kind``, summed over sampled steps.

    Underflow and overflow in ``fmt`` are at the recorded scales; inf/nan are values that were already
    non-finite when recorded (in an fp16 run, usually what overflow produced upstream). ``current_scaling``
    (FP8 formats): underflow under per-tensor current scaling, which puts each tensor's largest value just below
    the format's maximum, so that nothing overflows (overflow 0).
    """
    under = T.underflow_cs_col(fmt) if current_scaling else T.underflow_col(fmt)
    over = None if current_scaling else T.overflow_col(fmt)
    cols = [T.NUMEL, under, over or under, T.NAN, T.INF]
    sub = layers.loc[layers[T.TENSOR] == kind, [*dict.fromkeys(cols), T.MODULE, T.PARAM]]
    if sub.empty:
        return {}
    num = sub[list(dict.fromkeys(cols))].apply(pd.to_numeric, errors="coerce").fillna(0)
    if over is None:
        num["_no_overflow"] = 0.0
        cols[2] = "_no_overflow"
    num[T.MODULE] = sub[T.MODULE].to_numpy()
    num[T.PARAM] = T.texts(sub[T.PARAM]).to_numpy()
    g = num.groupby([T.MODULE, T.PARAM], sort=False)[cols].sum()
    out: dict[tuple[str, str], tuple[float, float, float]] = {}
    for (m, p), r in g.iterrows():  # type: ignore[misc]
        n = float(r[T.NUMEL])
        out[(str(m), str(p))] = (
            _share(r[cols[1]], n),
            _share(r[cols[2]], n),
            _share(r[T.NAN] + r[T.INF], n),
        )
    return out


def all_zero_rows(layers: pd.DataFrame, kind: str) -> set[tuple[str, str]]:
    """The (module, param) rows of ``kind`` whose every value was zero on every sampled step (a dead ReLU's
    output, the weight gradients behind it): the heatmaps have nothing of them to place on a log2 axis."""
    sub = layers.loc[layers[T.TENSOR] == kind, [T.MODULE, T.PARAM, T.NUMEL, T.ZEROS]]
    if sub.empty:
        return set()
    num = sub[[T.NUMEL, T.ZEROS]].apply(pd.to_numeric, errors="coerce").fillna(0)
    num[T.MODULE], num[T.PARAM] = sub[T.MODULE].to_numpy(), T.texts(sub[T.PARAM]).to_numpy()
    g = num.groupby([T.MODULE, T.PARAM], sort=False)[[T.NUMEL, T.ZEROS]].sum()
    zero = g[(g[T.NUMEL] > 0) & (g[T.ZEROS] == g[T.NUMEL])]
    return {(str(m), str(p)) for m, p in zero.index}


def without_magnitude(layers: pd.DataFrame, kind: str) -> dict[str, int] | None:
    """What was recorded of ``kind`` when none of it was finite and nonzero (every fp16 gradient flushed to zero,
    a loss that went NaN), so that its heatmap has nothing to place on a log2 axis: the values over the sampled
    steps, how many were zero, NaN and infinite, the sampled steps and the layers. None when no value of the kind
    was recorded, or some had a magnitude (the histograms are missing, not the values)."""
    sub = layers.loc[layers[T.TENSOR] == kind]
    cols = [c for c in (T.NUMEL, T.ZEROS, T.NAN, T.INF) if c in sub]
    tot = sub[cols].apply(pd.to_numeric, errors="coerce").fillna(0).sum()
    n = int(tot.get(T.NUMEL, 0))
    got = {"zeros": int(tot.get(T.ZEROS, 0)), "nan": int(tot.get(T.NAN, 0)), "inf": int(tot.get(T.INF, 0))}
    if n <= 0 or sum(got.values()) != n:
        return None
    return {"values": n, **got, "steps": sub[T.STEP].nunique(), "layers": sub[T.MODULE].nunique()}


# the what-if tables' share of values already nan or inf (``_shares``)
NONFINITE = "nonfinite"
# the per-layer what-if table's lowest and highest loss scale its row's values were counted at (``whatif_by_layer``)
SCALE_MIN, SCALE_MAX = "scale_min", "scale_max"


def whatif_columns() -> list[tuple[str, str, str]]:
    """(column, format, "underflow"|"overflow"|"underflow_cs") of the what-if tables, in display order."""
    cols: list[tuple[str, str, str]] = []
    for f in formats.WHATIF_FORMATS:
        cols += [(T.underflow_col(f), f, "underflow"), (T.overflow_col(f), f, "overflow")]
    cols += [(T.underflow_cs_col(f), f, "underflow_cs") for f in formats.FP8_FORMATS]
    return cols


def fp8_scaled_columns() -> list[str]:
    """The what-if columns of FP8 counted at the recorded loss scale (underflow and overflow; not those under
    current scaling): FP8 training scales each tensor, never the loss, so at a loss scale other than 1 they say
    nothing about FP8."""
    return [c for c, f, what in whatif_columns() if f in formats.FP8_FORMATS and what != "underflow_cs"]


def _loss_scaled(rows: pd.DataFrame) -> np.ndarray:
    """Whether each row was recorded at a loss scale other than 1 (a row without one is at scale 1)."""
    return (pd.to_numeric(rows[T.SCALE], errors="coerce").fillna(1.0) != 1).to_numpy()


def _shares(sub: pd.DataFrame, keys: list[str], count_cols: list[str]) -> pd.DataFrame:
    """The counts of ``sub`` summed per ``keys`` over its numel, and numel: NaN in the FP8 columns counted at the
    loss scale (``fp8_scaled_columns``) of a group any row of which was recorded at a scale other than 1 (an fp16
    run's 65536 made 2.63% of its weight gradients overflow FP8 E4M3, none of which would at scale 1). Beside
    them ``NONFINITE``, the share of values already nan or inf, which no cast loses: a tensor all nan read 0% in
    every format's column."""
    num = sub[[T.NUMEL, *count_cols]].apply(pd.to_numeric, errors="coerce")
    bad = [c for c in (T.NAN, T.INF) if c in sub]
    num[NONFINITE] = sub[bad].apply(pd.to_numeric, errors="coerce").fillna(0).sum(axis=1) if bad else 0.0
    for k in keys:
        num[k] = sub[k].to_numpy()
    num["_scaled"] = _loss_scaled(sub)
    g = num.groupby(keys, sort=False).sum(min_count=1)
    out = g[[*count_cols, NONFINITE]].div(g[T.NUMEL], axis=0)
    fp8 = [c for c in fp8_scaled_columns() if c in out]
    out[fp8] = out[fp8].mask(g["_scaled"] > 0)
    out[T.NUMEL] = g[T.NUMEL]
    return out


def computed_weights_as_weights(sub: pd.DataFrame) -> pd.DataFrame:
    """``sub`` (rows with module, module_type and tensor) with the weight a parametrization computes (weight_norm,
    spectral_norm) counted as the weight it is, once: the output of a layer's ``parametrizations.<name>``
    (a ``ParametrizationList``) is the weight its GEMM reads, and its gradient the weight's gradient, where the
    tables record them as an activation and an activation gradient; the parametrizations inside it (``_WeightNorm``
    at ``parametrizations.weight.0``) output the same tensor, or steps towards it, and are left out (the weight
    was counted twice among the activations)."""
    lists = set(T.texts(sub.loc[T.texts(sub[T.MODULE_TYPE]) == taxonomy.PARAMETRIZATION_LIST, T.MODULE]))
    if not lists:
        return sub
    modules = T.texts(sub[T.MODULE])
    inner = modules.map(lambda m: m.rpartition(".")[0] in lists).to_numpy(dtype=bool)
    sub = sub[~inner]
    listed = T.texts(sub[T.MODULE]).isin(lists).to_numpy()
    kinds = {T.ACTIVATION: T.WEIGHT, T.ACTIVATION_GRAD: T.WEIGHT_GRAD}
    tensor = sub[T.TENSOR].astype(object).where(~listed, sub[T.TENSOR].astype(object).map(kinds))
    return sub.assign(**{T.TENSOR: tensor.fillna(sub[T.TENSOR].astype(object))})


def whatif_rows(layers: pd.DataFrame) -> pd.DataFrame:
    """The rows the what-if tables count (``whatif_by_layer``, ``whatif_overview``): the kinds with histograms,
    the columns the tables read, a weight a parametrization computes among the weights
    (``computed_weights_as_weights``). Selected once for both tables of a page."""
    count_cols = [c for c, _, _ in whatif_columns()]
    sub = layers.loc[
        layers[T.TENSOR].isin(HIST_KINDS),
        [T.STEP, T.MODULE, T.MODULE_TYPE, T.TENSOR, T.SCALE, T.NUMEL, T.NAN, T.INF, *count_cols],
    ]
    return computed_weights_as_weights(sub)


def whatif_by_layer(
    layers: pd.DataFrame,
    shared: Mapping[str, Any] | None = None,
    order: Sequence[str] | None = None,
    rows: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Per (module, tensor kind): numel and the share of values lost in each what-if format.

    Columns: module, module_type, tensor, numel, ``SCALE_MIN`` and ``SCALE_MAX`` (the lowest and the highest loss
    scale the row's values were counted at, over its sampled steps: the shares are summed over all of them, so a
    row shows their range, not one step's scale: "scale 2^19" beside an fp16 overflow that happened at 2^21 to
    2^23 alone had a reader lower a scale that already worked), then one share column per entry of
    ``whatif_columns()`` (same names as the count columns; values are shares in [0, 1], NaN without data, and
    NaN in FP8's columns at the loss scale where it was not 1: ``_shares``), then ``NONFINITE`` (the share of
    values already nan or inf). ``order`` and ``rows``: ``forward_order(layers, shared)`` and
    ``whatif_rows(layers)`` where the caller has them.
    """
    count_cols = [c for c, _, _ in whatif_columns()]
    sub = whatif_rows(layers) if rows is None else rows
    cols = [T.MODULE, T.MODULE_TYPE, T.TENSOR, T.NUMEL, SCALE_MIN, SCALE_MAX, *count_cols, NONFINITE]
    if sub.empty:
        return pd.DataFrame(columns=cols)
    out = _shares(sub, [T.MODULE, T.TENSOR], count_cols).reset_index()
    types = sub.drop_duplicates(T.MODULE).set_index(T.MODULE)[T.MODULE_TYPE]
    out[T.MODULE_TYPE] = T.texts(out[T.MODULE].map(types))
    # a row without a scale was counted at 1, as ``_shares`` counts it (the forward kinds)
    scale = pd.to_numeric(sub[T.SCALE], errors="coerce").fillna(1.0)
    rng = scale.groupby([sub[T.MODULE].to_numpy(), sub[T.TENSOR].to_numpy()], sort=False).agg(["min", "max"])
    at = pd.MultiIndex.from_frame(out[[T.MODULE, T.TENSOR]])
    out[SCALE_MIN] = rng["min"].reindex(at).to_numpy()
    out[SCALE_MAX] = rng["max"].reindex(at).to_numpy()
    rank = {m: i for i, m in enumerate(forward_order(layers, shared) if order is None else order)}
    kind_rank = {k: i for i, k in enumerate(HIST_KINDS)}
    out = out.assign(_r=out[T.MODULE].map(rank), _k=out[T.TENSOR].map(kind_rank))
    out = out.sort_values(["_r", "_k"]).drop(columns=["_r", "_k"]).reset_index(drop=True)
    return out[cols]


def whatif_overview(layers: pd.DataFrame, rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per tensor kind (rows) the share lost in each what-if column, over all layers and sampled steps (FP8's
    columns at the loss scale NaN for a kind recorded at a scale other than 1: ``_shares``); a weight a
    parametrization computes among the weights (``computed_weights_as_weights``); then ``NONFINITE``.
    ``rows``: ``whatif_rows(layers)`` where the caller has it."""
    count_cols = [c for c, _, _ in whatif_columns()]
    sub = whatif_rows(layers) if rows is None else rows
    if sub.empty:
        return pd.DataFrame(columns=[T.TENSOR, T.NUMEL, *count_cols, NONFINITE])
    out = _shares(sub, [T.TENSOR], count_cols)
    out = out.reindex([k for k in HIST_KINDS if k in out.index]).reset_index()
    return out[[T.TENSOR, T.NUMEL, *count_cols, NONFINITE]]


def _dtype_lists(hist: pd.DataFrame) -> dict[tuple[str, str], str]:
    """(tensor kind, module) -> its dtypes in the order they first appear ("float32, bfloat16"), from the
    distinct triples (a module's dtypes rarely change: thousands of steps reduce to a row or two per key)."""
    rows = hist[[T.TENSOR, T.MODULE, T.DTYPE]].dropna(subset=[T.DTYPE]).drop_duplicates()
    out: dict[tuple[str, str], list[str]] = {}
    for kind, module, dtype in zip(
        rows[T.TENSOR].astype(str), rows[T.MODULE].astype(str), rows[T.DTYPE].astype(str), strict=True
    ):
        if dtype:
            out.setdefault((kind, module), []).append(dtype)
    return {k: ", ".join(v) for k, v in out.items()}


def _by_key(series: pd.Series) -> dict[Any, Any]:
    """A Series as a dict, its missing values (None, NaN) left out: a lookup per module is a dict's, not
    pandas' ``.loc`` (a model of thousands of modules spent seconds there)."""
    return {k: v for k, v in series.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}


def _lost_update_shares(df: pd.DataFrame, col: str, weights: pd.Series) -> dict[Any, Any]:
    """Per module, the share of its intended weight updates lost in ``col``'s format (``layer_records``), each
    parameter's sampled counts at its size (``weights``: ``tables.sample_weights`` of the weight-update rows)."""
    upd = df[df[T.TENSOR] == T.WEIGHT_UPDATE]
    upd = upd[upd[col].notna()]
    # the weights without a training gradient on their step are left out, as the advisor leaves them out
    upd = upd[~lost_updates.zero_gradient(df[df[T.TENSOR] == T.WEIGHT_GRAD], upd)]
    # over the intended updates (a nonzero gradient or a moved weight: numel - zeros of the update rows), the
    # advisor's *_lost_updates denominator: an embedding's rows without gradient are no update lost (a row
    # without a zeros count, which the capture always writes, counts every element as intended); a nan or inf
    # update is neither kept nor lost
    nonfinite = upd[T.NAN].fillna(0) + upd[T.INF].fillna(0)
    # each parameter's sampled counts at its size (a layer's bias, sampled whole, beside 256 elements of its
    # weight would weigh as much as the weight): the advisor's estimate of the layer's share
    w = weights.reindex(upd.index).fillna(1.0)
    intended = (upd[T.NUMEL] - upd[T.ZEROS].fillna(0) - nonfinite).clip(lower=0)
    upd = upd.assign(_lost=upd[col] * w, _intended=intended * w)
    by_upd = upd.groupby(T.MODULE, observed=True)[["_lost", "_intended"]].sum()
    by_upd = by_upd[by_upd["_intended"] > 0]
    return _by_key(by_upd["_lost"] / by_upd["_intended"])


def layer_records(
    layers: pd.DataFrame,
    shared: Mapping[str, Any] | None = None,
    frozen: Mapping[str, Sequence[str]] | None = None,
    order: Sequence[str] | None = None,
    weights: pd.Series | None = None,
    changed: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One record per module, forward order: type, dtypes, extreme magnitudes, fp16/bf16 losses, first nan/inf.

    Keys: module, module_type, param_dtype, act_dtype, act_grad_dtype, weight_grad_dtype, act_absmax,
    act_grad_absmax, act_grad_absmin, weight_grad_absmax, numel, zeros (values exactly 0, summed over the
    activations, activation gradients, weights and weight gradients of the sampled steps; weight updates not
    counted), zeros_by_kind (those of each kind, by its ``ZERO_KIND_LABELS`` label, the kinds with none left out), underflow_fp16,
    overflow_fp16,
    underflow_bf16, overflow_bf16, lost_update_bf16 (share of the intended weight updates, elements with a
    nonzero gradient or a moved weight, lost in a bf16 weight: the advisor's bf16_lost_updates share per
    module, of the weights with a training gradient on their step; NaN without weight_update rows or intended updates),
    lost_update_fp16 (the same in an fp16 weight: the table shows the one of the format the run holds its weights
    in, ``timeline.update_format``), update_ratio_median / update_ratio_max (the
    update-to-weight ratio ||dw|| / ||w|| over the sampled steps, ``analysis.update_ratio``; NaN without
    update sizes), update_absmax (the largest |update| of those steps), update_steps (how many),
    update_nonfinite ([sampled steps left out of the ratio for a nan or inf update, sampled steps with
    updates], ``update_ratio.nonfinite_steps``; None when none was left out),
    nonfinite_first (step and kind of the first nan/inf, "" when none), layer_input (the row is a module's input
    that no captured module produced, ``T.input_module``: no layer of its own), tied_to (the modules its
    parameters shared with another are recorded under, ``shared``: a head tied to its embedding has "emb"; ""
    when none), frozen (its parameters frozen throughout the run, ``frozen``: the capture's ``T.frozen_params``),
    trainable_changed ((label, tooltip) of its parameters whose requires_grad changed during the run, ``changed``:
    the capture's ``T.trainable_changed``, ``trainable_said``; None when none).
    A tied head's weight and a frozen layer's gradient have no rows of their own: without these two keys its
    row read as a layer without parameters. ``order`` and ``weights``: ``forward_order(layers, shared)`` and
    ``tables.sample_weights(layers)`` where the caller has them.
    """
    if layers.empty:
        return []
    order = forward_order(layers, shared) if order is None else list(order)
    df = layers[[T.STEP, T.MODULE, T.MODULE_TYPE, T.TENSOR, T.PARAM, T.DTYPE]].copy()
    num_cols = [T.NUMEL, T.ZEROS, T.NAN, T.INF, T.ABSMAX, T.ABSMIN, *LOST_UPDATE_COLUMNS.values()]
    count_cols = [c for f in ("fp16", "bf16") for c in (T.underflow_col(f), T.overflow_col(f))]
    for c in (*num_cols, *count_cols):
        df[c] = pd.to_numeric(layers[c], errors="coerce")
    df.loc[~(df[T.ABSMIN] > 0), T.ABSMIN] = math.nan
    hist = df[df[T.TENSOR].isin(HIST_KINDS)]
    by_kind = hist.groupby([T.TENSOR, T.MODULE], sort=False, observed=True)
    dtypes = _dtype_lists(hist)
    amax = _by_key(by_kind[T.ABSMAX].max())
    amin = _by_key(by_kind[T.ABSMIN].min())
    zeros_of = _by_key(by_kind[T.ZEROS].sum())
    sums = hist.groupby(T.MODULE, sort=False, observed=True)[[T.NUMEL, T.ZEROS, *count_cols]].sum(min_count=1)
    totals = {c: _by_key(sums[c]) for c in (T.NUMEL, T.ZEROS, *count_cols)}
    types = _by_key(df.drop_duplicates(T.MODULE).set_index(T.MODULE)[T.MODULE_TYPE])
    weights = T.sample_weights(layers) if weights is None else weights
    lost = {fmt: _lost_update_shares(df, col, weights) for fmt, col in LOST_UPDATE_COLUMNS.items()}
    ratios = update_ratio.layer_ratios(layers)
    left_out = update_ratio.nonfinite_steps(layers)
    bad = hist[hist[T.NAN].fillna(0) + hist[T.INF].fillna(0) > 0]
    first: dict[str, str] = {}
    if not bad.empty:
        s0 = bad.groupby(T.MODULE, observed=True)[T.STEP].transform("min")
        for m, g in bad[bad[T.STEP] == s0].groupby(T.MODULE, sort=False, observed=True):
            ks = [KIND_LABELS.get(str(k), str(k)) for k in pd.unique(g[T.TENSOR])]
            first[str(m)] = f"step {int(g[T.STEP].iloc[0])} ({', '.join(ks)})"
    nan = math.nan
    return [
        {
            "module": m,
            "module_type": str(types.get(m, "")),
            "param_dtype": dtypes.get((T.WEIGHT, m), ""),
            "act_dtype": dtypes.get((T.ACTIVATION, m), ""),
            "act_grad_dtype": dtypes.get((T.ACTIVATION_GRAD, m), ""),
            "weight_grad_dtype": dtypes.get((T.WEIGHT_GRAD, m), ""),
            "act_absmax": float(amax.get((T.ACTIVATION, m), nan)),
            "act_grad_absmax": float(amax.get((T.ACTIVATION_GRAD, m), nan)),
            "act_grad_absmin": float(amin.get((T.ACTIVATION_GRAD, m), nan)),
            "weight_grad_absmax": float(amax.get((T.WEIGHT_GRAD, m), nan)),
            "numel": float(totals[T.NUMEL].get(m, 0.0)),
            "zeros": float(totals[T.ZEROS].get(m, 0.0)),
            "zeros_by_kind": {
                ZERO_KIND_LABELS[k]: n
                for k in HIST_KINDS
                if (n := float(zeros_of.get((k, m), 0.0) or 0.0)) > 0
            },
            "underflow_fp16": float(totals[T.underflow_col("fp16")].get(m, 0.0)),
            "overflow_fp16": float(totals[T.overflow_col("fp16")].get(m, 0.0)),
            "underflow_bf16": float(totals[T.underflow_col("bf16")].get(m, 0.0)),
            "overflow_bf16": float(totals[T.overflow_col("bf16")].get(m, 0.0)),
            "lost_update_bf16": float(lost["bf16"].get(m, nan)),
            "lost_update_fp16": float(lost["fp16"].get(m, nan)),
            "update_ratio_median": ratios.get(str(m), {}).get("median", nan),
            "update_ratio_max": ratios.get(str(m), {}).get("max", nan),
            "update_absmax": ratios.get(str(m), {}).get("absmax", nan),
            "update_steps": ratios.get(str(m), {}).get("steps", 0.0),
            "update_nonfinite": left_out.get(str(m)),
            "nonfinite_first": first.get(m, ""),
            "layer_input": str(m).endswith(T.INPUT_SUFFIX),
            "tied_to": ", ".join(dict.fromkeys(str(o) for o in ((shared or {}).get(str(m)) or {}).values())),
            "frozen": list((frozen or {}).get(str(m)) or []),
            "trainable_changed": trainable_said((changed or {}).get(str(m)) or {}),
        }
        for m in order
    ]


def trainable_said(changed: Mapping[str, Any]) -> tuple[str, str] | None:
    """(label, tooltip) of a module's parameters whose requires_grad changed during the run (``changed``: param
    -> {"runs": [[first, last, requires_grad, had_gradient], ...], "end"}, ``T.trainable_changed``): "weight, bias
    had gradients on sampled steps 4-11" (a gradient is no update: a layer unfrozen after the HF Trainer built its
    optimizer from the trainable parameters gets gradients and is never updated, and "trained on steps 4-15" was
    said of it; and of sampled steps, which a sparse sampling makes 6-9 of a layer trainable on 4-11, tester
    t3); the tooltip says requires_grad over the sampled steps and at the end. None when ``changed`` is empty."""
    said: dict[tuple[str, str], list[str]] = {}
    for pname, v in changed.items():
        runs = [r for r in v.get("runs") or [] if isinstance(r, Sequence) and len(r) >= 4]
        trained, wanted = [r for r in runs if r[3]], [r for r in runs if r[2]]
        if trained:
            label = f"had gradients on sampled steps {step_runs(trained)}"
        elif wanted:
            label = f"requires_grad on sampled steps {step_runs(wanted)}, no gradient"
        else:  # (requires_grad set after the last sampled step)
            label = "frozen on every sampled step" + (", requires_grad at the end" if v.get("end") else "")
        states = ", ".join(  # (None: an earlier attempt's of a resumed run, which had no gradient there)
            f"{'not recorded' if r[2] is None else bool(r[2])} on {'sampled steps ' if k == 0 else ''}"
            f"{step_runs([r])}"
            for k, r in enumerate(runs)
        )
        tip = f"requires_grad changed during the run: {states}; {bool(v.get('end'))} at the end"
        said.setdefault((label, tip), []).append(str(pname))
    if not said:
        return None
    labels = [f"{', '.join(ps)} {label}" for (label, _), ps in said.items()]
    tips = [f"{', '.join(ps)}: {tip}" for (_, tip), ps in said.items()]
    return "; ".join(labels), ". ".join(tips)


def _dtype_census(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """[{dtype, tensors, numel}] over the (module, param) tensors of the last sampled step, most numel first."""
    if rows.empty:
        return []
    last = rows[rows[T.STEP] == rows[T.STEP].max()]
    numel = pd.to_numeric(last[T.NUMEL], errors="coerce")
    g = numel.groupby(last[T.DTYPE]).agg(["size", "sum"]).sort_values("sum", ascending=False)
    return [{"dtype": str(d), "tensors": int(r["size"]), "numel": float(r["sum"])} for d, r in g.iterrows()]


def requested_precision(summary: Mapping[str, Any]) -> str:
    """The precision mode the run asked for; for the user's own loop (no config says), the one the profiler saw
    it train in (``Profiler.precision_seen``); "" when neither is known."""
    seen = (summary.get(T.SUMMARY_CAPTURE) or {}).get("precision_seen")
    return _asked_precision(summary) or (str(seen) if seen else "")


def trained_precision(summary: Mapping[str, Any]) -> str:
    """The precision mode the run trained in (``taxonomy.precision_trained``), what the title, the header, the
    heatmaps and the memory section call the run's: the one the profiler saw where the run's framework ignored
    the one asked for (accelerate's fp16 on a CPU trains in fp32; the page called the run fp16), else the one it
    asked for; "" when neither is known. Only the precision check speaks of the request (``precision_check``)."""
    return taxonomy.precision_trained(summary, _asked_precision(summary))


def precision_from_layers(summary: Mapping[str, Any]) -> bool:
    """Whether ``trained_precision`` is the one the layers' dtypes show (``taxonomy.with_precision_seen``: a run
    killed before it saved, whose first summary names none), not one the run said."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    from_layers = (
        isinstance(capture, Mapping) and capture.get("precision_from") == taxonomy.PRECISION_FROM_LAYERS
    )
    return from_layers and trained_precision(summary) != _asked_precision(summary)


def asked_as(summary: Mapping[str, Any]) -> str:
    """How the run's framework asked for its precision, where its words are not precprof's: Lightning's
    ``precision="bf16-true"`` (precprof's bf16-pure), the HF Trainer's ``bf16=True``, the framework wrapping a loop
    of the user's own (``_wrapper_asked``: accelerate's ``mixed_precision="fp16"``); "" otherwise."""
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    lightning = cfg.get("lightning_precision")
    if lightning and str(lightning) != _asked_precision(summary):
        return f'Lightning\'s precision="{lightning}"'
    if cfg.get("source") == T.SOURCE_TRANSFORMERS:
        flags = [f"{k}=True" for k in ("bf16", "fp16") if cfg.get(k) is True]
        return f"TrainingArguments({', '.join(flags)})" if flags else ""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    return str(capture.get("mixed_precision_asked_as") or "") if _wrapper_asked(summary) else ""


def _asked_precision(summary: Mapping[str, Any]) -> str:
    """The precision mode the run's configuration asked for ("" for the user's own loop, which asks none)."""
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    for key in ("precision", "mixed_precision", "mode"):
        v = cfg.get(key)
        if v:
            return str(v)
    return ""


def _wrapper_asked(summary: Mapping[str, Any]) -> str:
    """The precision mode the framework wrapping a loop of the user's own was set to, where no configuration asks
    one: ``capture.mixed_precision_requested`` with the framework's words (``mixed_precision_asked_as``:
    accelerate's ``mixed_precision="fp16"``, Fabric's ``precision="bf16-mixed"``); "" otherwise. The verification
    holds the run to it (accelerate trains its fp16 in fp32 on a CPU); what the page calls the run's precision
    elsewhere stays the one it trained in."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    if (
        _asked_precision(summary)
        or not isinstance(capture, Mapping)
        or not capture.get("mixed_precision_asked_as")
    ):
        return ""
    return str(capture.get("mixed_precision_requested") or "")


def precision_check(layers: pd.DataFrame, memory: pd.DataFrame, summary: Mapping[str, Any]) -> dict[str, Any]:
    """What the tensors really were: dtype census per kind, optimizer state dtypes, and whether mixed precision
    is active (some activation of a module with parameters is in a 16- or 8-bit format).

    For an fp8 run it also confirms that FP8 GEMMs ran (``taxonomy.fp8_linear_layers``), for an MX run
    ("mxfp8": torchao's MX layers, whose outputs keep their input's dtype) that its MX GEMMs did.

    Returns {"requested", "asked": bool (whether a configuration asked for ``requested``, or the framework wrapping
    the user's own loop, ``_wrapper_asked``; a loop of its own asks nothing otherwise, and its ``requested`` is the
    precision the profiler saw it train in), "asked_as" (``asked_as``),
    "rows": [{"what", "census"}],
    "active": bool, "verdict": str, "ok": bool, "banner": str (the banner's headline when not ok, "" for the usual
    one)}.
    """
    asked = _asked_precision(summary) or _wrapper_asked(summary)
    requested = asked or requested_precision(summary)
    # "mxfp8" holds "fp8", and asks nothing of the activations' dtypes; nor does torchao's NVFP4Linear's "nvfp4"
    mx = requested.startswith(("mx", "nvfp4"))
    fp8_layers, n_linear = (
        taxonomy.fp8_linear_layers(layers, _recipe_layers(summary, "fp8_recipe"))
        if "fp8" in requested and not mx
        else ([], 0)
    )
    mx_layers = (
        taxonomy.block_linear_layers(layers, _recipe_layers(summary, "block_recipe")) if mx else ([], 0)
    )
    layers = layers[
        [T.STEP, T.MODULE, T.TENSOR, T.DTYPE, T.NUMEL]
    ]  # the columns it reads: filters stay narrow
    census_rows: list[dict[str, Any]] = []
    for kind, what in (
        (T.WEIGHT, "parameters"),
        (T.WEIGHT_GRAD, "gradients (of parameters)"),
        (T.ACTIVATION, "activations"),
        (T.ACTIVATION_GRAD, "activation gradients"),
    ):
        census_rows.append({"what": what, "census": _dtype_census(layers[layers[T.TENSOR] == kind])})
    memory = T.memory_at(memory) if not memory.empty else memory  # not the peak's parts: states once
    opt = memory[memory[T.COMPONENT] == T.OPTIMIZER_STATES] if not memory.empty else memory
    if not opt.empty:
        g = opt[opt[T.STEP] == opt[T.STEP].max()].groupby(T.DTYPE)[T.BYTES].sum()
        census_rows.append(
            {
                "what": "optimizer states",
                "census": [
                    {"dtype": str(d), "tensors": None, "numel": None, "bytes": float(b)} for d, b in g.items()
                ],
            }
        )
    with_params = set(layers.loc[layers[T.TENSOR] == T.WEIGHT, T.MODULE])
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & layers[T.MODULE].isin(with_params)]
    # a module called with several dtypes in a step (in and out of autocast) by the narrowest, as the capture's
    # mixed_precision_check and the advisor class it: low where one of its calls ran in 16 or 8 bits
    narrow = taxonomy.narrowest_dtypes(acts[T.DTYPE])
    low = acts[narrow.isin(formats.LOW_PRECISION_DTYPES).to_numpy()]
    active = not low.empty
    # a loop of its own that ran torchao's FP8 layers without autocast asked nothing of the activations: their FP8
    # GEMMs ran, their outputs keep their input's float32 (the built-in loop's fp8 asks for bf16 autocast too)
    fp8_alone = bool(fp8_layers) and not asked
    wants_low = not mx and not fp8_alone and any(t in requested for t in ("bf16", "fp16", "fp8"))
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    autocast = capture.get("autocast") if isinstance(capture, Mapping) else None
    on = isinstance(autocast, Mapping) and bool(autocast.get("enabled"))
    # modules with parameters that ran in float64 (a model.double() model): autocast leaves float64 ops alone
    f64 = acts.loc[(narrow == "float64").to_numpy(), T.MODULE].nunique()  # (a row without its dtype: "")
    wide = _wide_words(acts[~acts.index.isin(low.index)])
    if acts.empty:
        verdict, ok = "No activations of modules with parameters were recorded.", True
    elif wants_low and not active:
        # the user's own loop asks nothing: its ``requested`` is what the profiler saw (autocast on in a recorded
        # forward pass, around no module with parameters: a model that turns it off around its layers)
        said = (
            f"was asked for ({requested})"
            if asked
            else f"was seen ({requested}{': autocast was on in a recorded forward pass' if on else ''})"
        )
        off = f"autocast off{' around them' if on else ''}, or a library that ignores the setting on this device"
        verdict = f"Mixed precision {said} but is NOT active: every activation of a module with parameters is {wide}"
        verdict += (
            f": {_float64_said(f64, acts[T.MODULE].nunique())}. Cast the model to float32 (model.float(), or leave "
            f"out .double()) and autocast runs its matmuls in {requested}."
            + (f" The float32 ones: {off}." if "float32" in wide else "")
            if f64
            else f" ({off})."
        )
        ok = False
    elif active:
        n_mod = low[T.MODULE].nunique()
        dts = ", ".join(sorted(narrow[low.index].unique()))
        verdict = (
            f"Mixed precision is active: {n_mod} of {acts[T.MODULE].nunique()} modules with parameters "
            f"produce {dts} activations"
            + (f" ({_float64_said(f64, acts[T.MODULE].nunique())})" if f64 else "")
            + "."
            + _wide_matmuls_said(
                summary,
                set(low[T.MODULE]),
                set(acts.loc[(narrow == "float32").to_numpy(), T.MODULE]),
                dts,
                autocast,
            )
        )
        ok = True
    elif fp8_alone:
        verdict, ok = "No autocast: every activation of a module with parameters is float32.", True
    elif f64:
        verdict = (
            f"{'Double' if wide == 'float64' else 'Full'} precision: every activation of a module with parameters "
            f"is {wide}: "
            + _float64_said(
                f64, acts[T.MODULE].nunique(), "autocast, on in a recorded forward pass," if on else ""
            )
            + ". Float64 takes 8 bytes a value, FP32 4: model.float() halves what those modules hold."
        )
        ok = True
    else:
        verdict, ok = "Full precision: every activation of a module with parameters is float32.", True
    banner = ""  # the page's banner when not ok: "Mixed precision is not active." unless said otherwise
    if "fp8" in requested and not mx and ok:
        verdict, ok = _fp8_verdict(verdict, fp8_layers, n_linear, summary, active)
        banner = "" if ok else "FP8 did not run."
    if mx:
        verdict = _mx_verdict(verdict, *mx_layers, summary)
    return {
        "requested": requested,
        "asked": bool(asked),
        "asked_as": asked_as(summary),
        "rows": census_rows,
        "active": active,
        "verdict": verdict,
        "ok": ok,
        "banner": banner,
    }


# recurrent layers, whose gates are matmuls of their weights (taxonomy gives them no matmul kind)
_RECURRENT_TYPES = ("LSTM", "GRU", "RNN")


def _wide_matmuls_said(
    summary: Mapping[str, Any], low: set[str], fp32: set[str], dts: str, autocast: Any
) -> str:
    """The matmul and recurrent layers that ran in float32 (``fp32``) under active mixed precision, with their share of the
    matmul layers' weight values, in words ("" where every one did): CPU autocast leaves nn.GRU in fp32, and "1
    of 3 modules with parameters produce float16 activations" said nothing of the GRU holding 95% of the
    model's matmul weights (reviewer t3). A linear or recurrent layer does 2 x its weights' values FLOPs a token."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    entries = capture.get("modules") if isinstance(capture, Mapping) else None
    if not isinstance(entries, list):
        return ""
    weights: dict[str, tuple[str, int]] = {}
    for e in entries:
        kind = str(e.get("type", "")) if isinstance(e, Mapping) else ""
        if not (taxonomy.is_matmul_type(kind) or kind in _RECURRENT_TYPES):
            continue
        got = e.get("params")
        params: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
        weights[str(e.get("name"))] = (
            str(e.get("type")),
            sum(int(math.prod(v)) for v in params.values() if isinstance(v, list) and len(v) >= 2),
        )
    # (a layer in float64 is said apart: its weights are float64)
    wide = [m for m in weights if m in fp32 and m not in low]
    total = sum(n for _, n in weights.values())
    if not wide or not total:
        return ""
    share = sum(weights[m][1] for m in wide) / total
    one = len(wide) == 1
    names = ", ".join(f"{m} ({weights[m][0]})" for m in wide[:4]) + (
        f" and {len(wide) - 4} more" if len(wide) > 4 else ""
    )
    device = autocast.get("device_type") if isinstance(autocast, Mapping) else None
    return (
        f" Not in {dts}: the matmul layer{'' if one else 's'} {names}, holding {100 * share:.3g}% of the matmul "
        f"layers' weight values, ran in float32"
        + (f" (autocast on {device} left {'it' if one else 'them'} there)" if device else "")
        + "."
    )


def _wide_words(acts: pd.DataFrame) -> str:
    """The dtypes of activation rows that are not 16- or 8-bit, in words: "float32", "float64", or "float32 or
    float64" (a row of several tensors names each, joined with "|")."""
    seen = {d for v in T.texts(acts[T.DTYPE]).astype(str).unique() for d in v.split("|") if d}
    return " or ".join(sorted(seen)) or "float32"


def _float64_said(f64: int, of: int, autocast: str = "autocast") -> str:
    """Why ``f64`` of the ``of`` modules with parameters ran in float64, in words; ``autocast`` (the words for
    it, "" where it plays no part) leaves float64 ops alone."""
    which = "every module with parameters" if f64 == of else f"{f64} of {of} modules with parameters"
    return (
        f"{which} ran in float64, as {'its' if f64 == 1 else 'their'} weights are float64 (model.double(), or "
        "dtype=torch.float64)" + (f", and {autocast} leaves float64 ops alone" if autocast else "")
    )


# each scaling of a torchao recipe (``capture.model_facts.fp8_recipe_of``) in words
_SCALING_WORDS = {
    "tensorwise": "tensorwise (one scale per tensor)",
    "rowwise": "rowwise (one scale per row of each tensor)",
    "mixed": "mixed (rowwise and tensorwise casts, or a GEMM left in high precision)",
}


def _fp8_recipe_words(recipes: Any) -> str:
    """The FP8 recipes the run's Float8Linear layers ran, in words (" Recipe: rowwise (one scale per row of each
    tensor), scales rounded to powers of two, for 3 layers."); "" for a run that recorded none (an older run's
    ``fp8_recipe`` is the what-if's, a text)."""
    if not isinstance(recipes, list) or not recipes:
        return ""
    parts = [
        _SCALING_WORDS.get(str(r.get("scaling")), str(r.get("scaling")))
        + (", scales rounded to powers of two" if r.get("round_scales_to_power_of_2") else "")
        + f", for {len(r.get('layers') or [])} layer(s)"
        for r in recipes
        if isinstance(r, Mapping)
    ]
    return " torchao recipe: " + "; ".join(parts) + "."


def _mx_recipe_words(recipe: Mapping[str, Any]) -> str:
    """One MX recipe of the run (``capture.model_facts.block_recipe_of``) in words: "MXFP8 (float8_e4m3fn
    elements, blocks of 32, scales rounded up: rceil), emulated, for 4 layer(s)"."""
    rounding = {"rceil": "scales rounded up: rceil", "floor": "scales rounded down: floor (OCP)"}
    said = [
        f"{recipe.get('element')} elements" if recipe.get("element") else "",
        f"blocks of {recipe.get('block_size')}" if recipe.get("block_size") else "",
        rounding.get(str(recipe.get("scale_rounding")), f"scale rounding {recipe.get('scale_rounding')}")
        if recipe.get("scale_rounding")
        else "",
        "the weight gradient's GEMM in high precision (wgrad_with_hp)" if recipe.get("wgrad_with_hp") else "",
    ]
    return (
        f"{formats.label(str(recipe.get('format', 'mx')))} ({', '.join(s for s in said if s)})"
        + (", emulated (kernel_preference=EMULATED)" if recipe.get("emulated") else "")
        + f", for {len(recipe.get('layers') or [])} layer(s)"
    )


def _recipe_layers(summary: Mapping[str, Any], key: str) -> list[str]:
    """The layers the capture recorded running one of its ``key`` recipes ("block_recipe", "fp8_recipe"): an
    nn.Linear whose weight torchao's ``quantize_`` swapped runs it, though its module type is that of a plain
    one."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    recipes = capture.get(key) if isinstance(capture, Mapping) else None
    if not isinstance(recipes, list):
        return []
    return [str(m) for r in recipes if isinstance(r, Mapping) for m in r.get("layers") or []]


def _mx_kind(recipe: Mapping[str, Any], default: str = "") -> str:
    """What the run's layers of a recipe are, in words: "torchao MXFP8Linear", or for an nn.Linear whose weight
    ``quantize_`` swapped, "nn.Linear with torchao's MXFP8TrainingWeightWrapperTensor weight (quantize_)";
    ``default`` the module type of a recipe that names none (an FP8 recipe's: "Float8Linear")."""
    if recipe.get("weight_type"):
        return f"nn.{recipe.get('module_type')} with torchao's {recipe.get('weight_type')} weight (quantize_)"
    return f"torchao {recipe.get('module_type') or default}"


def _fp8_kinds(fp8_layers: list[str], summary: Mapping[str, Any]) -> str:
    """What an fp8 run's FP8 layers are, in words: "torchao Float8Linear", the quantize_ form's words
    (``_mx_kind``) for the layers of a recipe naming a weight type, both for both."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    recipes = capture.get("fp8_recipe") if isinstance(capture, Mapping) else None
    named = {
        str(m): _mx_kind(r, "Float8Linear")
        for r in (recipes if isinstance(recipes, list) else [])
        if isinstance(r, Mapping)
        for m in r.get("layers") or []
    }
    return ", ".join(sorted({named.get(m, "torchao Float8Linear") for m in fp8_layers}))


def _mx_verdict(verdict: str, mx_layers: list[str], n_linear: int, summary: Mapping[str, Any]) -> str:
    """An MX run's check: how many of its linear layers ran torchao's MX layers, and their recipes. Emulated
    layers quantise their operands as the hardware would, then multiply in high precision: the numbers are the
    format's, the speed is not."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    recipes = capture.get("block_recipe") if isinstance(capture, Mapping) else None
    recipes = [r for r in recipes if isinstance(r, Mapping)] if isinstance(recipes, list) else []
    if not mx_layers:
        return (
            f"{verdict} No linear layer ran as one of torchao's MX or NVFP4 layers, or as an nn.Linear whose "
            "weight torchao's quantize_ made an MX training weight."
        )
    types = ", ".join(sorted({_mx_kind(r) for r in recipes})) or "torchao MX layers"
    emulated = sum(len(r.get("layers") or []) for r in recipes if r.get("emulated"))
    kinds = {str(r.get("format", "mx")) for r in recipes}
    mx = "NVFP4" if kinds == {"nvfp4"} else "MX" if all(k.startswith("mx") for k in kinds) else "Block-scaled"
    ran = (
        f"{mx} was emulated: {len(mx_layers)} of {n_linear} linear layers are {types}, {emulated} of them "
        "emulated (they quantise their input, weight and output gradient block by block, then multiply in high "
        "precision: the numbers are the format's, the speed is not; their outputs keep their input's dtype)"
        if emulated
        else f"{mx} GEMMs ran: {len(mx_layers)} of {n_linear} linear layers are {types} (they quantise "
        "their input, weight and output gradient block by block for each of their three GEMMs; their outputs "
        "keep their input's dtype)"
    )
    recipe = "; ".join(_mx_recipe_words(r) for r in recipes)
    return f"{verdict} {ran}." + (f" torchao recipe: {recipe}." if recipe else "")


def _fp8_verdict(
    verdict: str, fp8_layers: list[str], n_linear: int, summary: Mapping[str, Any], active: bool = True
) -> tuple[str, bool]:
    """An fp8 run's check: whether FP8 GEMMs ran (torchao Float8Linear layers recorded, or nn.Linear layers the
    capture recorded running an FP8 recipe: ``quantize_``'s FP8 training weights), not only that activations are
    bf16, which a Float8Linear's and a bf16 layer's both are."""
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    plan = cfg.get("plan") if isinstance(cfg, Mapping) else None
    library = plan.get("fp8_library") if isinstance(plan, Mapping) else None
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    emulated = capture.get("fp8_emulated") if isinstance(capture, Mapping) else None
    recipe = _fp8_recipe_words(capture.get("fp8_recipe") if isinstance(capture, Mapping) else None)
    kinds = _fp8_kinds(fp8_layers, summary)
    # (without autocast, a loop of its own: an FP8 layer's output keeps its input's dtype)
    outputs = "their outputs are bf16" if active else "their outputs keep their input's dtype, float32 here"
    if fp8_layers and isinstance(emulated, int) and emulated > 0:
        return (
            f"{verdict} FP8 was emulated: {len(fp8_layers)} of {n_linear} linear layers are {kinds}, "
            f"{emulated} of them with emulate=True (they cast their input, weight and output gradient to FP8, "
            f"then multiply in high precision: the numbers are FP8's, the speed is not; {outputs})." + recipe
        ), True
    if fp8_layers:
        return (
            f"{verdict} FP8 GEMMs ran: {len(fp8_layers)} of {n_linear} linear layers are {kinds} "
            f"(they cast their input, weight and output gradient to FP8 for their matmuls; {outputs})."
            + recipe
        ), True
    if library == "transformer_engine":
        return (
            f"{verdict} FP8 ran through Transformer Engine ({cfg.get('fp8_layers', '?')} te.Linear layers, by "
            "the run's configuration): its layers are named Linear, so the tables cannot confirm them."
        ), True
    said = "FP8 was asked for" if _asked_precision(summary) else "The run was seen as FP8"
    return (
        f"{said} but no linear layer ran as a torchao Float8Linear or as an nn.Linear whose weight torchao's "
        f"quantize_ made an FP8 training weight (Float8TrainingOpConfig): its {n_linear} linear layers ran "
        "their matmuls in bf16. " + verdict
    ), False
