"""FP8 eligibility per linear layer, judged by what per-tensor FP8 would do to training, and FP8's estimated speed.

A linear layer is FP8-eligible when ``--precision fp8`` would convert it (``taxonomy.fp8_ineligible_reason``:
an nn.Linear not tied to an embedding, dimensions and tokens per call multiples of 16), no tensor of it held
nan/inf, and per-tensor current scaling (``analysis.current_scaling``) loses at most
``AdvisorConfig.lost_norm_max`` of the L2 norm of what its FP8 GEMMs read to underflow: its input (the output of
the module that made it, ``capture.gemm_inputs``, or its own input row) and its weight in e4m3, its output
gradient in e5m2. Its own output stays bf16 and is not judged (it is the next layer's input, judged there when
that layer is linear). The lost share is an upper bound from each step's histogram and the exact count of flushed values
(``analysis.lost_norm``, the bound the fp16 and block rules use too), and the rule reads its median over the
sampled steps: a share that one step in ten reaches does not flip a layer between runs. Nothing saturates under
current scaling (the scale puts each tensor's largest value at or below the format's max). The count of flushed
values is reported beside it, not judged: tens of percent of a gradient's values may flush while carrying a
millionth of its norm (GPT-2's ``mlp.c_fc`` behind GELU). What the norm of a whole tensor cannot see is an
outlier that sets its scale: one value of 3e4 in an N(0, 1) input holds nearly all of its norm, and puts 95% of
the other values below e4m3's smallest normal, where they keep 0 to 3 significant bits. A layer is not eligible
when a tensor's largest 0.1% of values push more than ``AdvisorConfig.fp8_pushed_subnormal_max`` of its values
there (``_pushed_share``, exact from the histogram): a tensor whose values spread wide by nature (the GELU tail,
a weight over 40 binades) has them there under any scale, and is not held back. The share of a tensor's values
below the smallest normal at its scale, whatever put them there, is reported beside it, not judged: outlier
channels (more than the largest 0.1%, as LLM.int8's outlier features) that set the scale for the rest are seen
there, not by the outlier check; it is an upper bound (a power-of-two scale, read before rounding). A tensor read
in several calls a step (gradient accumulation) is read at its largest call's scale, as the run keeps no call's
own: the outlier check does not judge it (``_pooled``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from precprof import formats, taxonomy
from precprof import tables as T
from precprof.analysis import current_scaling, fp8_speed, lost_norm
from precprof.analysis.advisor.evidence import (
    _attention_part,
    _captured_modules,
    _computed_weights,
    _dtype_has,
    _expert_banks,
    _expert_gemms,
    _innermost,
    _Plan,
    _row_index,
    _Run,
    _skipped_rows,
    _tokens_per_call,
)
from precprof.analysis.advisor.model import INFO, WARNING, Finding
from precprof.analysis.advisor.rules.blocks import BLOCK_SIZE, _first_activations, inputs_of
from precprof.analysis.advisor.rules.shapes import (
    ATTENTION,
    CONVOLUTION,
    RECURRENT,
    _fp8_shapes,
    _Fp8Shape,
    _multiplied_outside,
    _Unconverted,
    _unconverted_matmuls,
    _unseen_weights,
    uneven_calls_text,
)
from precprof.analysis.advisor.text import _listing, _name, _pct
from precprof.formats import FP8_E4M3, FP8_E5M2, FP16, NumberFormat

# the format each tensor a linear layer's FP8 GEMMs read takes in the usual hybrid recipe (torchao's Float8Linear
# and Transformer Engine's defaults): e4m3 forward (its input, the output of the module that made it, and its
# weight), e5m2 for its output gradient. The layer's own output stays in bf16.
KIND_FORMAT: dict[str, NumberFormat] = {
    T.ACTIVATION: FP8_E4M3,
    T.WEIGHT: FP8_E4M3,
    T.ACTIVATION_GRAD: FP8_E5M2,
}
FORWARD, BACKWARD = "forward", "backward"
# the share of a tensor's largest values taken as outliers when asking whether they set its scale: LLMs'
# "massive activations" are a few values in a few tokens (arXiv 2402.17762), well under 0.1% of a GEMM input
OUTLIER_SHARE = 1e-3
INPUT = "input"  # the tensor column of a layer's input rows in ``fp8_losses``


def gemm_inputs(run: _Run, linear: list[str], dims: Mapping[str, Mapping[str, int]]) -> dict[str, list[str]]:
    """Per linear layer, the recorded modules whose outputs its GEMM read as its input (``blocks.inputs_of``:
    the capture's ``gemm_inputs``, or its own input row); [] where none was recorded."""
    act_modules = [str(m) for m in run.kind(T.ACTIVATION)[T.MODULE].unique()]
    leaves = [m for m in _innermost(act_modules) if not m.endswith(T.INPUT_SUFFIX)]
    first = _first_activations(run)
    return {m: inputs_of(run, m, leaves, dims, first) for m in linear}


def fp8_losses(run: _Run, modules: list[str], inputs: Mapping[str, list[str]]) -> pd.DataFrame:
    """Per (module, tensor, param, step) of ``modules``: what per-tensor current scaling in the FP8 format its
    GEMMs would read it in loses: its weight and its input (tensor ``INPUT``: the output of each module in
    ``inputs[module]``, which its GEMM read) in e4m3, its output gradient in e5m2. Columns: ``lost_norm`` (upper
    bound of the share of the L2 norm lost to underflow), ``lost_values`` (share of the nonzero finite values
    flushed, exact; of an FSDP weight's shards, those of the binades wholly under its limit: ``_sharded``),
    ``pushed`` and ``below`` (``_pushed_share``; ``pushed`` of a row of one call, its value for a row of several
    in ``pushed_pooled``: ``_pooled``), ``floored`` (its largest value is under torchao's amax
    floor, ``formats.FP8_AMAX_FLOOR``: the scale its figures assume is the floor's, not its own amax's), ``side``
    ("forward": input and weight; "backward": output gradient)."""
    lay = run.layers
    sources = {s for m in modules for s in inputs.get(m, [])}
    own = lay[T.MODULE].isin(modules) & (
        (lay[T.TENSOR] == T.ACTIVATION_GRAD) | ((lay[T.TENSOR] == T.WEIGHT) & (lay[T.PARAM] == "weight"))
    )
    sel = own | (lay[T.MODULE].isin(sources) & (lay[T.TENSOR] == T.ACTIVATION))
    e4, e5 = T.underflow_cs_col(FP8_E4M3.name), T.underflow_cs_col(FP8_E5M2.name)
    keys = [T.STEP, T.MODULE, T.TENSOR, T.PARAM]
    rows = lay.loc[sel, [*keys, T.ABSMAX, T.CALLS, T.NUMEL, T.ZEROS, T.NAN, T.INF, e4, e5]]
    if rows.empty:
        return pd.DataFrame(
            columns=[*keys, "side", "lost_norm", "lost_values", "pushed", "pushed_pooled", "below", "floored"]
        )
    rows = rows.assign(**{k: T.texts(rows[k]).astype(object) for k in (T.MODULE, T.TENSOR, T.PARAM)})
    # one row per tensor and step (a table merged from ranks may repeat one): counts add, amax is the largest
    agg = {c: "sum" for c in (T.CALLS, T.NUMEL, T.ZEROS, T.NAN, T.INF, e4, e5)}
    numeric = all(rows[c].dtype.kind in "iuf" for c in [*agg, T.ABSMAX])
    if numeric and not rows[T.STEP].hasnans and not rows.duplicated(keys).any():
        # each key once (a single rank's table): what the group-by gives, a sum of one value, NaN as 0
        rows = rows[[*keys, *agg, T.ABSMAX]].fillna({c: 0 for c in agg}).reset_index(drop=True)
        # (its keys typed as the group-by's index makes them)
        rows = rows.assign(**{k: pd.Index(rows[k].to_numpy(dtype=object)) for k in keys[1:]})
    else:
        rows = rows.groupby(keys, sort=False).agg({**agg, T.ABSMAX: "max"}).reset_index()
    is_grad = (rows[T.TENSOR] == T.ACTIVATION_GRAD).to_numpy()
    amax = pd.to_numeric(rows[T.ABSMAX], errors="coerce").to_numpy(dtype=float)
    limit = np.where(
        is_grad,
        current_scaling.underflow_limit_log2(FP8_E5M2, amax),
        current_scaling.underflow_limit_log2(FP8_E4M3, amax),
    )
    flushed = np.where(is_grad, rows[e5].to_numpy(dtype=float), rows[e4].to_numpy(dtype=float))
    h = run.hist
    group = _row_index(h, rows)  # each histogram row's tensor (-1: not one of these)
    # a run recorded before the counts took torchao's amax floor counted a tensor under it at its own amax's
    # scale: the values of the binades wholly under the limit flush all the same, and are at least that many
    below_limit = lost_norm.count_below(h[T.EXPONENT].to_numpy(), h[T.COUNT].to_numpy(), group, limit)
    flushed = np.where(current_scaling.under_floor(amax), np.maximum(flushed, below_limit), flushed)
    # FSDP's weight rows sum each rank's shard counted at its own amax's scale, which flushes no more than the
    # whole tensor's (its amax, the row's, is at least the shard's): the whole tensor flushes at least the values
    # of the binades wholly under its limit, and at most those and its limit's binade (the values exactly on it)
    shards = _sharded(run) & (rows[T.TENSOR] == T.WEIGHT).to_numpy()
    lost = flushed
    if shards.any():
        upto_edge = lost_norm.count_below(h[T.EXPONENT].to_numpy(), h[T.COUNT].to_numpy(), group, limit + 1)
        lost = np.where(shards, np.maximum(flushed, upto_edge), flushed)
        flushed = np.where(shards, np.maximum(flushed, below_limit), flushed)
    share = lost_norm.lost_share_bound(
        h[T.EXPONENT].to_numpy(),
        h[T.COUNT].to_numpy(),
        group,
        limit,
        lost=lost,
        exact=(rows[T.CALLS].to_numpy(dtype=float) <= 1) & ~shards,
    )
    nonzero = (rows[T.NUMEL] - rows[T.ZEROS] - rows[T.NAN] - rows[T.INF]).clip(lower=0).to_numpy(dtype=float)
    pushed, below = _pushed_share(h, group, nonzero, amax, is_grad)
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.where(nonzero > 0, flushed / nonzero, np.nan)
    out = rows[keys].copy()
    out["side"] = np.where(is_grad, BACKWARD, FORWARD)
    out["lost_norm"] = share
    out["lost_values"] = values
    pooled = _pooled(rows[T.CALLS].to_numpy(dtype=float), rows[T.TENSOR].to_numpy())
    out["pushed"] = np.where(pooled, np.nan, pushed)
    out["pushed_pooled"] = np.where(pooled, pushed, np.nan)
    out["below"] = below
    out["floored"] = current_scaling.under_floor(amax)
    # each layer's rows: its weight and output gradient, and the outputs it read as its input, as its own
    mine = out[out[T.TENSOR] != T.ACTIVATION]
    outputs = out[out[T.TENSOR] == T.ACTIVATION]
    read = pd.DataFrame([(m, s) for m in modules for s in inputs.get(m, [])], columns=["_reader", T.MODULE])
    as_input = outputs.merge(read, on=T.MODULE)
    again = made_more_often(run, modules, inputs)
    if not again.empty:  # a maker's row of a step it ran more often than the layer: outputs it never read
        key = pd.MultiIndex.from_frame(as_input[[T.STEP, "_reader", T.MODULE]].astype(object))
        as_input = as_input[~key.isin(pd.MultiIndex.from_frame(again.astype(object)))]
    as_input = as_input.drop(columns=T.MODULE).rename(columns={"_reader": T.MODULE})
    as_input[T.TENSOR] = INPUT
    return pd.concat([mine[mine[T.MODULE].isin(modules)], as_input[out.columns]], ignore_index=True)


def _sharded(run: _Run) -> bool:
    """Whether the run's weight rows are FSDP's shards (FSDP2, FSDP1 but ``NO_SHARD``), each rank's counted at its
    own amax's scale (``capture.distributed.semantics``): their FP8 current-scaling counts are the shards', not
    the whole tensor's that a tensorwise recipe casts at one scale."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    dist = capture.get("distributed") if isinstance(capture, Mapping) else None
    if not isinstance(dist, Mapping):
        return False
    wrapper = dist.get("wrapper")
    return wrapper == "FSDP2" or (wrapper == "FSDP1" and dist.get("sharding") != "NO_SHARD")


def made_more_often(run: _Run, modules: list[str], inputs: Mapping[str, list[str]]) -> pd.DataFrame:
    """The steps on which a module whose output a layer of ``modules`` read as its input (``inputs``, as the
    capture found it: ``capture.gemm_inputs``) ran more
    often than the layer, as rows of (``T.STEP``, ``"_reader"``: the layer, ``T.MODULE``: the maker): the maker's
    row adds up outputs the layer never read (a model reusing one ``self.act`` after each layer, whose second
    output went into the layer's histogram with its first), so it measures no input of the layer on that step.
    The capture reads such a layer's own input from the next sampled step on (``capture.gemm_inputs``), or at
    once when the maker had already run more often (T5's dropout, applied to the embeddings and to the
    encoder's output, which the cross-attention's k and v read). Computed once per run, layers and inputs."""
    key = ("made_more_often", tuple(modules), tuple((m, tuple(inputs.get(m, []))) for m in modules))
    return run.memo(key, lambda: _made_more_often(run, modules, inputs))


def _made_more_often(run: _Run, modules: list[str], inputs: Mapping[str, list[str]]) -> pd.DataFrame:
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    listed = capture.get("gemm_inputs") if isinstance(capture, Mapping) else None
    listed = listed if isinstance(listed, Mapping) else {}  # (a guess of an older run's is left as it is)
    pairs = [
        (m, s) for m in modules if m in listed for s in inputs.get(m, []) if not s.endswith(T.INPUT_SUFFIX)
    ]
    cols = [T.STEP, "_reader", T.MODULE]
    if not pairs:
        return pd.DataFrame(columns=cols)
    acts = run.kind(T.ACTIVATION)
    names = T.texts(acts[T.MODULE]).astype(object).rename(T.MODULE)
    calls = pd.to_numeric(acts[T.CALLS], errors="coerce").groupby([acts[T.STEP], names]).sum()
    # per (step, module) its calls, and per module its steps in order: looked up per pair (two merges of these
    # few rows took a tenth of the FP8 rule)
    at = dict(zip(calls.index, calls.tolist(), strict=True))
    steps: dict[str, list[Any]] = {}
    for step, m in calls.index:
        steps.setdefault(m, []).append(step)
    rows = [
        (step, reader, maker)
        for reader, maker in pairs
        for step in steps.get(maker, [])
        if (step, reader) in at and at[(step, maker)] > at[(step, reader)]
    ]
    return pd.DataFrame(rows, columns=cols)


def _pooled(calls: np.ndarray, tensor: np.ndarray) -> np.ndarray:
    """Which rows the outlier check cannot judge: those of several calls a step (gradient accumulation's
    micro-batches, a layer called more than once, several ranks), but a weight's: every call of a step reads the
    same weight (the optimizer changes it between steps; DDP's ranks hold the same one; FSDP's shards make the one
    a cast reads, whose largest value, the row's, is the shards': each shard's current-scaling count, at its own
    amax, is not the whole tensor's, and ``fp8_losses`` bounds that from the histogram), so its pooled row is each
    call's (under DDP every weight was
    left unjudged, its row summing the 2 ranks' calls). Such a row sums the calls' histograms and keeps
    the largest value of them all, so ``_pushed_share`` reads every call at the scale of the call with the
    largest value, where a tensorwise recipe (torchao's Float8Linear, Transformer Engine's current scaling) scales
    each call by its own: one micro-batch of outlier channels in twelve put 75% of the step's values "pushed"
    where each call alone pushes under 1%. The run keeps no call's own largest value, and what the largest 0.1%
    push is a difference of two counts, which pooling moves either way (a call of large values beside one with
    an outlier hides the outlier's), so it bounds nothing: such a row does not decide. Its ``below`` stays an
    upper bound (a call's own scale is at least the pooled one)."""
    return (calls > 1) & (tensor != T.WEIGHT)


def _pushed_share(
    h: pd.DataFrame, group: np.ndarray, nonzero: np.ndarray, amax: np.ndarray, is_grad: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor (``group`` maps the histogram rows ``h`` to them): the share of its nonzero finite values its
    largest values push below its FP8 format's smallest normal under current scaling, where a value keeps at
    most 3 of e4m3's 4 significant bits (2 of e5m2's 3), or flushes: the values below the smallest normal
    under the scale amax sets, less those below it under the scale that all but its largest ``OUTLIER_SHARE``
    of values would set (their largest taken at its binade's upper edge: a smaller share, never a larger one);
    and the share below the smallest normal under the scale amax sets, whatever put them there (an outlier
    channel, more than OUTLIER_SHARE of the values, that sets the scale of the rest; or a wide spread).
    The binades meet the smallest normal exactly, the scale being a power of two: before rounding (a value just
    under it may round up to it), and under the power-of-two scale (fmax/amax, torchao's default, is as large or
    larger, and puts as many there or fewer). A tensor of several calls is read at its largest call's scale
    (``_pooled``): its ``below`` is an upper bound of the calls', each cast at its own."""
    exponent, count = h[T.EXPONENT].to_numpy(), h[T.COUNT].to_numpy()
    rank = np.maximum(np.floor(OUTLIER_SHARE * nonzero), 1.0) + 1.0
    bulk_amax = np.exp2(lost_norm.rank_edge_log2(exponent, count, group, len(nonzero), rank))

    def below(a: np.ndarray) -> np.ndarray:
        # log2 of the smallest normal in unscaled units: an integer, as the scale is a power of two
        normal = np.where(
            is_grad,
            math.log2(FP8_E5M2.smallest_normal) - current_scaling.exponents(FP8_E5M2, a),
            math.log2(FP8_E4M3.smallest_normal) - current_scaling.exponents(FP8_E4M3, a),
        )
        return lost_norm.count_below(exponent, count, group, normal)

    all_below, bulk_below = below(amax), below(bulk_amax)
    with np.errstate(invalid="ignore", divide="ignore"):
        pushed = np.where(nonzero > 0, np.clip((all_below - bulk_below) / nonzero, 0.0, 1.0), np.nan)
        share = np.where(nonzero > 0, np.clip(all_below / nonzero, 0.0, 1.0), np.nan)
    return np.where(np.isnan(bulk_amax), 0.0, pushed), share


def fp8_summary(losses: pd.DataFrame) -> pd.DataFrame:
    """Per (module, side): the median over sampled steps of the lost-norm bound (the larger of the input's and
    the weight's on the forward side), its worst step, the median share of values flushed, and of the tensor
    whose largest values push the most of it below the smallest normal (``fp8_losses``' ``pushed``), that
    share (``pushed``) and its name (``pushed_tensor``), the same of the tensors read in several calls a step
    (``pushed_pooled``, ``pushed_pooled_tensor``: not judged), of the tensor with the most of its values
    below the smallest normal (``fp8_losses``' ``below``), that share (``below``) and its name
    (``below_tensor``), and whether a tensor's largest value on a step was under torchao's amax floor
    (``floored``). Rows in the order the (module, side) pairs first come in ``losses``; medians and maxima
    skip NaN, a tensor named is the first of the largest share (the first tensor where all are NaN).

    By arrays, not groupby: a dozen group-bys and sorts of a few hundred rows took a tenth of the advisor's
    time on a tiny run."""
    cols = [
        "norm",
        "norm_worst",
        "values",
        "pushed",
        "pushed_tensor",
        "pushed_pooled",
        "pushed_pooled_tensor",
        "below",
        "below_tensor",
        "floored",
        "steps",
    ]
    if losses.empty:
        return pd.DataFrame(columns=cols)
    # each row's (module, tensor, side) tensor and (module, side) pair, numbered in order of first appearance
    module, _ = pd.factorize(losses[T.MODULE].to_numpy(dtype=object))
    tensor, tensors = pd.factorize(losses[T.TENSOR].to_numpy(dtype=object))
    side, _ = pd.factorize(losses["side"].to_numpy(dtype=object))
    n_t, n_s = max(len(tensors), 1), int(side.max()) + 1
    group, first_row = _first_codes((module.astype(np.int64) * n_t + tensor) * n_s + side)
    pair, first_pair = _first_codes(module.astype(np.int64) * n_s + side)
    n = len(first_row)
    steps = pd.to_numeric(losses[T.STEP], errors="coerce").to_numpy(dtype=float)
    seen = ~np.isnan(steps)
    _, step_code = np.unique(steps[seen], return_inverse=True)
    distinct = np.unique(group[seen].astype(np.int64) * (int(step_code.max(initial=0)) + 1) + step_code)
    per_steps = np.bincount(distinct // (int(step_code.max(initial=0)) + 1), minlength=n)
    floored = np.bincount(group, weights=losses["floored"].to_numpy(dtype=bool), minlength=n) > 0
    norm, norm_worst = _group_median_max(group, losses["lost_norm"].to_numpy(dtype=float), n)
    median = {c: _group_median_max(group, losses[c].to_numpy(dtype=float), n)[0] for c in _MEDIAN_COLS}
    # per (module, side): the largest of its tensors' figures, and the tensor of the largest share
    per_pair = pair[first_row]  # each tensor's pair
    per_tensor = np.asarray(tensors, dtype=object)[tensor[first_row]]
    m = len(first_pair)
    out: dict[str, Any] = {
        "norm": _pair_max(per_pair, norm, m),
        "norm_worst": _pair_max(per_pair, norm_worst, m),
        "values": _pair_max(per_pair, median["lost_values"], m),
    }
    # ties (and pairs whose shares are all NaN) go to the tensor that comes first by ``pushed``, largest first
    rank = np.empty(n, dtype=np.int64)
    rank[_descending(median["pushed"], np.arange(n))] = np.arange(n)
    for c in ("pushed", "pushed_pooled", "below"):
        out[c], out[f"{c}_tensor"] = _pair_largest(per_pair, median[c], per_tensor, m, rank)
    out["floored"] = np.bincount(per_pair, weights=floored, minlength=m) > 0
    out["steps"] = np.zeros(m, dtype=np.int64)
    np.maximum.at(out["steps"], per_pair, per_steps.astype(np.int64))
    index = pd.MultiIndex.from_frame(losses[[T.MODULE, "side"]].iloc[first_pair].reset_index(drop=True))
    return pd.DataFrame({c: out[c] for c in cols}, index=index)


_MEDIAN_COLS = ("lost_values", "pushed", "pushed_pooled", "below")


def _first_codes(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's group among the distinct ``key`` values, numbered in order of first appearance, and each
    group's first row."""
    codes, _ = pd.factorize(key)
    first = np.full(int(codes.max()) + 1 if len(codes) else 0, len(codes), dtype=np.int64)
    np.minimum.at(first, codes, np.arange(len(codes)))
    return codes.astype(np.int64), first


def _group_median_max(group: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group of ``n`` (``group``: each value's), the median and the largest of its values, NaN skipped (NaN
    where all are): a groupby's median and max."""
    ok = ~np.isnan(values)
    g, v = group[ok], values[ok]
    order = np.lexsort((v, g))
    g, v = g[order], v[order]
    count = np.bincount(g, minlength=n)
    start = np.concatenate(([0], np.cumsum(count)[:-1]))
    med, top = np.full(n, np.nan), np.full(n, np.nan)
    has = count > 0
    lo = start[has] + (count[has] - 1) // 2
    hi = start[has] + count[has] // 2
    med[has] = (v[lo] + v[hi]) / 2
    odd = has.copy()
    odd[has] = count[has] % 2 == 1
    med[odd] = v[start[odd] + count[odd] // 2]
    top[has] = v[start[has] + count[has] - 1]
    return med, top


def _pair_max(pair: np.ndarray, values: np.ndarray, m: int) -> np.ndarray:
    """Per pair of ``m``, the largest of its ``values``, NaN skipped (NaN where all are)."""
    out = np.full(m, np.nan)
    ok = ~np.isnan(values)
    np.fmax.at(out, pair[ok], values[ok])
    return out


def _descending(values: np.ndarray, then: np.ndarray, *by: np.ndarray) -> np.ndarray:
    """The order of rows by ``by`` (the first the outermost), then ``values`` largest first (NaN last), then
    ``then``: a stable descending ``sort_values``."""
    missing = np.isnan(values)
    return np.lexsort((then, np.where(missing, 0.0, -values), missing, *reversed(by)))


def _pair_largest(
    pair: np.ndarray, values: np.ndarray, names: np.ndarray, m: int, rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per pair of ``m``, its largest ``values`` (NaN where all are) and the name of its row holding it, the
    row of the lowest ``rank`` among ties (where all are NaN, of them all)."""
    order = _descending(values, rank, pair)
    first = np.ones(len(order), dtype=bool)
    first[1:] = pair[order][1:] != pair[order][:-1]
    top = order[first]
    best, named = np.full(m, np.nan), np.empty(m, dtype=object)
    best[pair[top]] = values[top]
    named[pair[top]] = names[top]
    return best, named


def _at_most(bound: float) -> str:
    """An upper bound of a share in words: "none", "at most 0.0657%", "under 0.000001%"."""
    if bound == 0:
        return "none"
    text = _pct(bound)
    return text.replace("<", "under ", 1) if text.startswith("<") else f"at most {text}"


def _get(by_key: Mapping[Any, Mapping[str, Any]], m: str, side: str, col: str) -> float | None:
    """Column ``col`` of ``fp8_summary``'s row (``m``, ``side``), from ``by_key`` (the summary as a dict, made
    once: a MultiIndex lookup per layer took a second on thousands of layers); None when absent or not finite."""
    row = by_key.get((m, side))
    v = float(row[col]) if row is not None else math.nan
    return v if np.isfinite(v) else None


def _floor_words(by_key: Mapping[Any, Mapping[str, Any]], m: str, side: str) -> str:
    """Why a tensor under torchao's amax floor loses what it does ("" when none of layer ``m``'s on ``side``
    is): torchao's scale stops growing at the floor, so such a tensor's values land far below the format's
    smallest normal, or under its smallest subnormal."""
    if not _get(by_key, m, side, "floored"):
        return ""
    return (
        f": its largest value is under {formats.FP8_AMAX_FLOOR:g}, torchao's floor on amax, where its scale stops "
        f"growing (fmax/{formats.FP8_AMAX_FLOOR:g}; Transformer Engine's current scaling has no such floor)"
    )


OUTLIER_REASON = "an outlier sets its"  # how ``_outlier_reason`` begins
_TENSOR_WORDS = {INPUT: "input", T.WEIGHT: "weight", T.ACTIVATION_GRAD: "output gradient"}


def _outlier_reason(by_key: Mapping[Any, Mapping[str, Any]], m: str, most: float) -> str:
    """Why layer ``m`` is not eligible when its largest values push over ``most`` of a tensor's values below the
    FP8 format's smallest normal ("" when none does): the forward side's first, then the backward's."""
    for side, fmt in ((FORWARD, FP8_E4M3), (BACKWARD, FP8_E5M2)):
        pushed = _get(by_key, m, side, "pushed")
        if pushed is None or pushed <= most:
            continue
        name = "e4m3" if fmt is FP8_E4M3 else "e5m2"
        bits = fmt.mantissa_bits + 1
        what = _TENSOR_WORDS.get(str(by_key[(m, side)]["pushed_tensor"]), "tensor")
        return (
            f"{OUTLIER_REASON} {what}'s {name} scale: its largest {_pct(OUTLIER_SHARE)} of values push "
            f"{_pct(pushed)} of them below {name}'s smallest normal, where a value keeps at most {bits - 1} of its "
            f"{bits} significant bits"
        )
    return ""


def _most(
    by_key: Mapping[Any, Mapping[str, Any]], linear: list[str], col: str = "below"
) -> tuple[float | None, str]:
    """The largest share ``col`` of ``fp8_summary`` (``below``: of a tensor's values below its FP8 format's
    smallest normal at the scale its largest value sets) over the layers ``linear`` read, and whose tensor it is
    in words ("2's input"); (None, "") where none was read."""
    most = [
        (w, m, side)
        for side in (FORWARD, BACKWARD)
        for m in linear
        if (w := _get(by_key, m, side, col)) is not None
    ]
    if not most:
        return None, ""
    w, m, side = max(most)
    what = _TENSOR_WORDS.get(str(by_key[(m, side)][f"{col}_tensor"]), "tensor")
    return w, f"{_name(m)}'s {what}"


def _below(
    by_key: Mapping[Any, Mapping[str, Any]], linear: list[str], most: float
) -> list[tuple[float, str, str]]:
    """Each tensor of the layers ``linear`` read with more than ``most`` of its values below its FP8 format's
    smallest normal (``fp8_summary``'s ``below``), as (share, layer, tensor in words), the largest first."""
    out = [
        (w, m, _TENSOR_WORDS.get(str(by_key[(m, side)]["below_tensor"]), "tensor"))
        for m in linear
        for side in (FORWARD, BACKWARD)
        if (w := _get(by_key, m, side, "below")) is not None and w > most
    ]
    return sorted(out, key=lambda t: -t[0])


# the figure of a tensor's values below the smallest normal, whatever put them there, in the message's words (the
# method says what it is and why it does not decide: ``_not_judged_method``)
BELOW_WORDS = (
    "Values below FP8's smallest normal at a tensor's own scale, whatever put them there (not judged)"
)


def _not_judged_method(most: float) -> str:
    """What the message's figures that do not decide are, and why they do not (the method's words): the values
    flushed, and the values below the smallest normal whatever put them there (``BELOW_WORDS``)."""
    return (
        "Two figures are reported beside these, not judged. The share of a tensor's values flushed to zero: a "
        "tail of tiny gradient values (GPT-2's mlp.c_fc behind GELU) may flush by the tens of percent and carry a "
        "millionth of the norm. The share of a tensor's values below the format's smallest normal at the "
        "power-of-two scale its largest value on a step sets, whatever put them there: an upper bound (fewer "
        "where the scale is not rounded to a power of two, torchao's default, where each call of a step is "
        "scaled on its own, and after rounding); where it is over "
        f"{_pct(most)}, more values than the largest {_pct(OUTLIER_SHARE)} put them there: outlier channels "
        "that set the scale for the rest (as LLM.int8's outlier features), which the outlier check does not "
        "see, or a spread over many binades, as a weight's or a gradient's may have by nature."
    )


def _bound(share: float | None) -> str:
    """An upper bound of a share in words: "at most 0.0059%", "under 0.000001%"; "0%" (nothing flushed, none
    lost), "n/a" where none was measured."""
    if share is None or not math.isfinite(share) or share == 0:
        return _pct(share)
    return _at_most(share)


def _below_words(by_key: Mapping[Any, Mapping[str, Any]], linear: list[str], most: float, limit: int) -> str:
    """The tensors with more than ``most`` of their values below the smallest normal, by name, so that an
    outlier channel in a layer other than the one of the largest share is found ("" when there are none)."""
    below = _below(by_key, linear, most)
    if not below:
        return ""
    shown = ", ".join(f"{_name(m)}'s {what} {_pct(w)}" for w, m, what in below[:limit])
    rest = f" and {len(below) - limit} more" if len(below) > limit else ""
    return f"; over {_pct(most)} in {len(below)} tensor(s): {shown}{rest}"


def _pooled_layers(by_key: Mapping[Any, Mapping[str, Any]], linear: list[str]) -> list[str]:
    """The layers of ``linear`` with a tensor the outlier check did not judge: read in several calls a step
    (``_pooled``), an input or an output gradient (a weight it judges)."""
    return [
        m for m in linear if any(_get(by_key, m, s, "pushed_pooled") is not None for s in (FORWARD, BACKWARD))
    ]


# what the outlier check measures, in the message's words (the method says why it is bounded)
PUSHED_WORDS = f"Most values a tensor's largest {_pct(OUTLIER_SHARE)} push below FP8's smallest normal"


def _pushed_words(most: float | None, module: str | None, pooled: list[str]) -> str:
    """The largest share of a tensor's values its largest push below the smallest normal, ``most`` (of
    ``module``'s tensor), in words that say it is of the tensors judged alone when the check left some of
    ``pooled`` unjudged (``_pooled_words`` gives theirs), and say why none was judged when none was."""
    if most is None:
        return (
            PUSHED_WORDS
            + ": none judged"
            + (" (a tensor read in several calls a step is not: see below)" if pooled else "")
        )
    return (
        PUSHED_WORDS
        + (
            ", of the tensors judged (weights, and inputs and output gradients read in one call a step; not "
            "those read in several: see below)"
            if pooled
            else ""
        )
        + f": {_pct(most)}"
        + (f" ({_name(module)})" if module is not None else "")
    )


def _called_again(run: _Run, layers: list[str]) -> dict[str, int]:
    """The layers of ``layers`` called more than once in a forward (a layer shared across calls, ALBERT's
    blocks): on a sampled step, more calls of their own (``activation`` rows) than the step's backward passes,
    with the most calls per backward. A step's backward passes are the most ``weight_grad`` calls of any
    parameter on that step (the micro-batches, summed over ranks, as the calls are): taken from the step, not
    from the layer, so that a shared layer whose weight is frozen (LoRA on an ALBERT-like model), which has no
    gradient of its own, is recognised too."""
    acts, grads = run.kind(T.ACTIVATION), run.kind(T.WEIGHT_GRAD)
    called = acts.groupby([T.texts(acts[T.MODULE]).to_numpy(), acts[T.STEP].to_numpy()])[T.CALLS].sum()
    per_param = grads.groupby(
        [T.texts(grads[T.MODULE]).to_numpy(), T.texts(grads[T.PARAM]).to_numpy(), grads[T.STEP].to_numpy()]
    )[T.CALLS].sum()
    passes = per_param.groupby(level=2).max()
    calls = called.rename_axis(["module", "step"]).reset_index(name="calls")
    calls["passes"] = calls["step"].map(passes)
    both = calls[(calls["passes"] > 0) & (calls["calls"] > calls["passes"])]
    per = (both["calls"] / both["passes"]).groupby(both["module"]).max()
    return {m: math.ceil(float(per[m])) for m in layers if m in per.index}


def _calls_by_step(run: _Run, kind: str) -> pd.Series:
    """A kind's calls per (module, step), summed over its rows (a layer's tensors, the ranks' as recorded)."""
    rows = run.kind(kind)
    return rows.groupby([T.texts(rows[T.MODULE]).to_numpy(), rows[T.STEP].to_numpy()])[T.CALLS].sum()


# why a layer's input or output gradient was read in several calls a step (``_pass_causes``), and whether a run
# of the same model can read it in one: the causes the remedy "one micro-batch each, on one rank" undoes
_SPLIT = ("micro", "ranks")


def _pass_causes(run: _Run, layers: list[str]) -> tuple[dict[str, str], dict[str, str]] | None:
    """Why each of ``layers`` was read in several calls a step, from what the capture saw of the sampled steps'
    passes (``capture.step_passes``, ``capture.loop_order``; None for a run recorded without them: the words
    then are ``_pooled_words_before``'s): per layer a cause, and per cause its words. A layer with more calls on a
    step than the model's own forwards there (times the ranks) is called more than once in a forward
    (``shared``: ALBERT's blocks); otherwise the loop's: an optimizer stepping several times a ``prof.step()``
    (``several``, a fault the loop order says; ``critic``, a WGAN's critic), an optimizer's closure evaluated
    several times a step (``closure``: LBFGS), parts of the model the loop calls itself, several times a step
    (``parts``: a GAN's discriminator on real and generated data, where the model's own forward never runs),
    more output gradients than calls (``retain``: backward passes through one forward, ``retain_graph=True``),
    gradient accumulation's micro-batches (``micro``: the model's forwards a step) and the ranks (``ranks``),
    ``other`` where none of these shows."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    passes = capture.get(T.SUMMARY_STEP_PASSES) if isinstance(capture, Mapping) else None
    if not isinstance(passes, Mapping):
        return None
    order = capture.get("loop_order") or {}
    order = order if isinstance(order, Mapping) else {}
    dist = capture.get("distributed") or {}
    world = dist.get("world_size") if isinstance(dist, Mapping) else None
    world = world if isinstance(world, int) and world > 1 else 1
    forwards = passes.get("model_forwards") or {}
    most_forwards = forwards.get("most") if isinstance(forwards, Mapping) else None
    most_forwards = most_forwards if isinstance(most_forwards, int) else 0
    closures = [str(c) for c in passes.get("closures") or []]
    calls, grads = _calls_by_step(run, T.ACTIVATION), _calls_by_step(run, T.ACTIVATION_GRAD)
    words: dict[str, str] = {}
    if most_forwards > 0:
        per_forward = calls / (most_forwards * world)
        shared = per_forward[per_forward > 1].groupby(level=0).max()
        if len(shared):
            words["shared"] = (
                f"called more than once in a forward: up to {math.ceil(float(shared.max()))} calls a forward"
            )
    else:
        shared = pd.Series(dtype=float)
    several, critic = order.get(T.LOOP_SEVERAL_STEPS), order.get(T.LOOP_CRITIC_STEPS)
    if isinstance(several, Mapping):
        loop = "several"
        words[loop] = (
            f"up to {several.get('most')} optimizer steps a prof.step(), each with forwards and backward passes "
            "of its own"
        )
    elif isinstance(critic, Mapping):
        loop = "critic"
        named = " and ".join(str(o) for o in critic.get("optimizers") or []) or "an optimizer"
        words[loop] = (
            f"{named} stepping up to {critic.get('most')} times a prof.step() (a critic's steps beside the "
            "other optimizer's one), each step with forwards and backward passes of its own"
        )
    elif closures:
        loop = "closure"
        most = passes.get("closure_evaluations")
        most = most if isinstance(most, int) else most_forwards
        evaluations = f"up to {most} times" if most > 1 else "several times"
        words[loop] = (
            f"{' and '.join(closures)}'s closure, evaluated {evaluations} an optimizer step, each evaluation a "
            "forward and backward"
        )
    else:
        loop = ""
    both = pd.concat([calls.rename("calls"), grads.rename("grads")], axis=1).fillna(0)
    retained = set(both.index[both["grads"] > both["calls"]].get_level_values(0))
    # where the model's own forward never ran (a LightningModule's training_step calling its parts): a layer with
    # as many calls on a step as the step's backward passes into the weights (the most weight-gradient calls of a
    # parameter) is read once a micro-batch; with more (a GAN's discriminator, also called for the generator's
    # loss after its own optimizer stepped), the loop calls it in forwards of other kinds
    weights = run.kind(T.WEIGHT_GRAD)
    backwards = (
        weights.groupby(
            [
                T.texts(weights[T.MODULE]).to_numpy(),
                T.texts(weights[T.PARAM]).to_numpy(),
                weights[T.STEP].to_numpy(),
            ]
        )[T.CALLS]
        .sum()
        .groupby(level=2)
        .max()
    )
    own = both.reset_index(names=["module", "step"])
    own["backwards"] = own["step"].map(backwards).fillna(0)
    each_rank = set(calls.index[calls > world].get_level_values(0))  # several calls on a rank
    # the model's forwards a step into fewer backward passes (two views of a batch, or several losses, summed
    # into one backward): the loop's passes, no micro-batches (a run told to stop an accumulation it never did:
    # reviewer r2); in one process only: a wrapper's weight gradients may be read once a step whatever the
    # micro-batches (FSDP's reduce-scattered shards; FSDP1 with use_orig_params=True, NO_SHARD too, read as the
    # optimizer gets them), so that one backward a step is no sign of fewer backward passes (reviewer r3)
    into = float(backwards.max()) if len(backwards) and world == 1 and not _sharded(run) else 0.0
    fewer = most_forwards > 1 and 0 < into < most_forwards
    parts = set(own.loc[(own["calls"] > 1) & (own["calls"] != own["backwards"]), "module"])
    cause: dict[str, str] = {}
    for m in layers:
        if m in shared.index:
            cause[m] = "shared"
        elif loop:
            cause[m] = loop
        elif most_forwards == 0 and m in parts:
            cause[m] = "parts"
            words["parts"] = (
                "called in several forwards a step by the loop, which calls parts of the model itself, not the "
                "model's own forward, more often than its backward passes into the weights before their optimizer "
                "stepped (a GAN's discriminator on real and generated data, and for the generator's loss)"
            )
        elif m in retained:
            cause[m] = "retain"
            words["retain"] = (
                "more output gradients than calls a step: several backward passes through one forward "
                "(retain_graph=True, several losses backpropagated one by one)"
            )
        elif fewer:
            cause[m] = "forwards"
            words["forwards"] = (
                f"{most_forwards} forwards of the model a step into {into:g} backward pass"
                f"{'' if into == 1 else 'es'} (several views or losses of a batch summed before one backward)"
            )
        elif most_forwards > 1 or world > 1 or (most_forwards == 0 and m in each_rank):
            micro = most_forwards > 1 or (most_forwards == 0 and m in each_rank)
            cause[m] = "micro" if micro else "ranks"
            forwards = (
                f"{most_forwards} forwards a step" if most_forwards > 1 else "a forward and backward each"
            )
            split = ([f"gradient accumulation's micro-batches ({forwards})"] if micro else []) + (
                [f"{world} ranks"] if world > 1 else []
            )
            words[cause[m]] = ", ".join(split)
            # the run that reads one call a step (the remedy's words)
            words["remedy"] = ", ".join(
                (["a run without gradient accumulation"] if micro else [])
                + (["on one rank"] if world > 1 else [])
            )
        else:
            cause[m] = "other"
            words["other"] = "several passes through the layer a step"
    return cause, words


def _not_judged(layers: list[str], limit: int, why: str, most: float | None, where: str) -> str:
    """The sentence that opens ``_pooled_words``: which layers the outlier check could not judge, and ``why``."""
    return (
        f". The outlier check could not judge an input or output gradient of {len(layers)} layer(s) "
        f"({_listing(layers, limit)}): it was read in several calls a step ({why}), which the run records "
        "together, as one histogram under the largest value of them all, where a tensorwise recipe scales each "
        "call on its own; read at the largest call's scale, their largest values "
        f"push {_pct(most)} ({where}), which does not decide"
    )


def _pooled_words(run: _Run, by_key: Mapping[Any, Mapping[str, Any]], linear: list[str], limit: int) -> str:
    """The words saying that the outlier check did not judge an input or output gradient of the layers whose
    tensors were read in several calls a step (``_pooled``), why (``_pass_causes``), and how to judge them ("" when
    there are none): a run of one micro-batch on one rank where gradient accumulation or the ranks made the calls;
    one ``prof.step()`` per optimizer step where the loop called it every few; where the loop itself makes them (a
    closure, a critic's steps, parts of the model called several times, backward passes through one forward) or
    the layer is called more than once in a forward, no run of that loop or model reads one call a step: said, with
    no remedy the run already follows."""
    layers = _pooled_layers(by_key, linear)
    if not layers:
        return ""
    found = _pass_causes(run, layers)
    if found is None:
        return _pooled_words_before(run, by_key, linear, layers, limit)
    cause, words = found
    most, where = _most(by_key, linear, "pushed_pooled")
    groups: dict[str, list[str]] = {}
    for m in layers:
        groups.setdefault(cause[m], []).append(m)
    why = (
        words[next(iter(groups))]
        if len(groups) == 1
        else "; ".join(f"{_listing(ms, limit)}: {words[c]}" for c, ms in groups.items())
    )
    said = _not_judged(layers, limit, why, most, where)
    alone = len(groups) == 1
    if "shared" in groups:
        said += (
            ". A layer called more than once in a forward cannot be judged per call, in this run or any other: "
            "the run records its calls of a step together"
        )
    split = [m for m in layers if cause[m] in _SPLIT]
    if split:
        said += (
            f". To judge {'them' if alone else _listing(split, limit)}, profile a few steps of one micro-batch "
            f"each ({words['remedy']})"
        )
    if "several" in groups:
        said += (
            f". To judge {'them' if alone else _listing(groups['several'], limit)}, call prof.step() once per "
            "optimizer step"
        )
    loops = [m for m in layers if cause[m] in ("critic", "closure", "parts", "retain", "forwards", "other")]
    if loops:
        said += (
            f". {'They' if alone else _listing(loops, limit)} cannot be judged per call in a run of "
            "this loop: the run records a layer's calls of a step together"
        )
    return said


def _pooled_words_before(
    run: _Run, by_key: Mapping[Any, Mapping[str, Any]], linear: list[str], layers: list[str], limit: int
) -> str:
    """``_pooled_words`` of a run recorded without the sampled steps' passes (``capture.step_passes``, by an older
    precprof): the causes told apart by the weight gradients' calls (``_called_again``) alone."""
    most, where = _most(by_key, linear, "pushed_pooled")
    again = _called_again(run, layers)
    rest = [m for m in layers if m not in again]
    why = (
        "gradient accumulation's micro-batches, a layer called more than once, several ranks"
        if rest
        else f"a layer called more than once in a forward: up to {max(again.values())} calls a step per backward"
    )
    said = _not_judged(layers, limit, why, most, where)
    if again:
        shared = run.sort(again)
        said += (
            f". {_listing(shared, limit)} {'is' if len(shared) == 1 else 'are'} called more than once in a "
            f"forward (up to {max(again.values())} calls a step per backward): a layer"
            if rest
            else ". A layer"
        ) + (
            " called more than once a step cannot be judged per call, in this run or any other: the run records "
            "its calls of a step together"
        )
    if rest:
        said += (
            f". To judge {'them' if not again else _listing(rest, limit)}, profile a few steps of one "
            "micro-batch each (a run without gradient accumulation, on one rank)"
        )
    return said


def _unread_words(run: _Run, unread: list[str], limit: int) -> str:
    """The words naming the layers whose input no row records (``unread``; "" when there are none), and why: made
    by no module precprof watches, or, for those the capture lists with no maker (``capture.gemm_inputs``), an
    output changed in place after its maker returned it, or of a maker that ran more often in the step than the
    layer, which no row holds as the layer read it. A run recorded now has a row of every matmul layer's own input;
    one recorded by an older precprof with the block-format what-if off has none."""
    if not unread:
        return ""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    listed = capture.get("gemm_inputs") if isinstance(capture, Mapping) else None
    listed = listed if isinstance(listed, Mapping) else {}
    made = [m for m in unread if m in listed]
    none = [m for m in unread if m not in listed]
    causes = ([f"{_listing(none, limit)}: made by no module precprof watches"] if none else []) + (
        [
            f"{_listing(made, limit)}: a module's output changed in place after the module returned it, or made "
            "by a module that ran more often in the step than the layer, which no row holds as the layer read it"
        ]
        if made
        else []
    )
    return (
        f". The input of {len(unread)} layer(s) was not recorded ({'; '.join(causes)}, and the run has no row of the "
        "layer's own input, as a run recorded by an older precprof with the block-format what-if off has none): they "
        "are judged on their weight and output gradient"
    )


def _made_again_words(run: _Run, again: pd.DataFrame, inputs: Mapping[str, list[str]], limit: int) -> str:
    """The words naming the layers whose input's maker ran more often in a step than they did
    (``made_more_often``), whose row is left out of their input on those steps ("" when there are none)."""
    if again.empty:
        return ""
    layers = run.sort(set(again["_reader"]))
    makers = run.sort(set(again[T.MODULE]))
    # the steps on which such a layer read the maker's output, its own input row not recorded then
    acts = run.kind(T.ACTIVATION)
    own = set(zip(acts[T.STEP], T.texts(acts[T.MODULE]), strict=True))
    unread = {
        s for s, m in zip(again[T.STEP], again["_reader"], strict=True) if (s, T.input_module(m)) not in own
    }
    return (
        f". The input of {len(layers)} layer(s) ({_listing(layers, limit)}) is an output of a module that ran more "
        f"often in a step than the layer ({_listing(makers, limit)}): its row adds up the outputs of all its calls, "
        "of which the layer read one, so it is not the layer's input"
        + (
            f" (not judged on {len(unread)} sampled step(s); the layer's own input is read from the next one on)"
            if all(T.input_module(m) in inputs.get(m, []) for m in layers)
            else "; the run has no row of the layer's own input (a run recorded by an older precprof with the "
            "block-format what-if off has none): it is judged on its weight and output gradient"
        )
    )


def _rowwise_words(run: _Run, linear: list[str], limit: int) -> str:
    """The words saying which layers the run trained on a recipe that scales per row, which the outlier check
    does not judge ("" when none did)."""
    rowwise = [m for m in linear if run.fp8_scaling.get(m, "tensorwise") != "tensorwise"]
    if not rowwise:
        return ""
    return (
        f". {len(rowwise)} layer(s) ({_listing(rowwise, limit)}) ran torchao's rowwise recipe (or one mixing "
        "rowwise casts in, capture.fp8_recipe in summary.json): it scales each row of a tensor on its own, so an "
        "outlier sets only its own row's scale, and the per-tensor outlier check does not apply to them and "
        "does not hold them back. Their figures here are those of the per-tensor what-if, not of their recipe "
        "(which casts the output gradient to e4m3 per row)"
    )


def _outlier_remedy(plan: _Plan) -> str:
    """How to run the layers whose scale an outlier sets in FP8 ("" when there are none)."""
    held = [m for m, why in plan.fp8_why_not.items() if why.startswith(OUTLIER_REASON)]
    if not held:
        return ""
    return (
        f" The {len(held)} layer(s) whose scale an outlier sets can run in FP8 with torchao's rowwise recipe "
        '(Float8LinearConfig.from_recipe_name("rowwise")): it scales each token of the input and of the output '
        "gradient on its own, so the outlier sets only its own token's scale; it is slower than the tensorwise "
        "FP8 the speed estimate assumes: measure it."
    )


TOKENS_REASON = f"tokens per call, not a multiple of {taxonomy.FP8_DIM_MULTIPLE}"  # taxonomy's words
EXPERT_TOKENS_REASON = (
    f"routed experts: the tokens routed to each per call are not a multiple of {taxonomy.FP8_DIM_MULTIPLE}, "
    "and follow the routing"
)


def _uneven_reason(step: int, calls: int, tokens: int, divisor: int) -> str:
    """Why a layer whose ``calls`` at ``step`` had different tokens (``tokens`` in all) is not FP8-eligible: the
    largest number dividing each call's, ``divisor``, is no multiple of FP8's, so one call's tokens is not. That
    number may be no call's count (calls of 12 and 20 tokens: 4)."""
    return uneven_calls_text(step, calls, tokens, divisor, str(taxonomy.FP8_DIM_MULTIPLE))


def token_counts(plan: _Plan) -> str:
    """The tokens per call that hold layers back from FP8, as a list ("68, 100")."""
    return ", ".join(map(str, sorted(set(plan.fp8_tokens.values()))))


def held_back_remedy(plan: _Plan) -> str:
    """How to lift what holds layers back from FP8 that a setting lifts ("" when nothing does): their tokens per
    call, an outlier that sets their scale."""
    return (
        _batch_tokens_remedy(plan)
        + _uneven_calls_remedy(plan)
        + _expert_tokens_remedy(plan)
        + _outlier_remedy(plan)
    )


def _uneven_calls_remedy(plan: _Plan) -> str:
    """How to lift calls of different tokens on a step that hold layers back ("" when none does): each call's
    tokens a multiple of FP8's, which the step's batch x sequence being one does not make (8 and 24 sum to 32)."""
    if not plan.fp8_uneven:
        return ""
    m = taxonomy.FP8_DIM_MULTIPLE
    by: dict[tuple[int, int, int, int], list[str]] = {}
    for layer, calls in plan.fp8_uneven.items():
        by.setdefault(calls, []).append(layer)
    measured = "; ".join(
        f"{_listing(layers, 4)}: {calls} calls of {tokens} tokens in all at step {step}, each a multiple of "
        f"{divisor} and no larger number"
        for (step, calls, tokens, divisor), layers in by.items()
    )
    return (
        f" The layers whose calls had different tokens ({measured}) qualify once every call's tokens are a multiple "
        f"of {m}, not only their sum: the input of each call (each batch size the model is called on, each chunk a "
        f"sequence is split into) padded or cut to a multiple of {m}, or torchao padding it "
        "(Float8LinearConfig(pad_inner_dim=True))."
    )


def _expert_tokens_remedy(plan: _Plan) -> str:
    """How to lift the routed tokens that hold a mixture of experts' experts back ("" when none does)."""
    if not plan.fp8_expert_tokens:
        return ""
    counts = sorted(set(plan.fp8_expert_tokens.values()))
    shown = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    m = taxonomy.FP8_DIM_MULTIPLE
    return (
        f" The {len(plan.fp8_expert_tokens)} routed experts held back by the tokens routed to them ({shown} per "
        "call on the sampled steps) take whatever share of the batch the router gives them, so no batch size "
        f"makes every share a multiple of {m}: torchao pads them (Float8LinearConfig(pad_inner_dim=True)), or a "
        "grouped GEMM over all experts (torchao's MoE training) runs them as one matmul."
    )


def _batch_tokens_remedy(plan: _Plan) -> str:
    """How to lift the batch x sequence that holds layers back from FP8 ("" when it holds none)."""
    if not plan.fp8_tokens:
        return ""
    m = taxonomy.FP8_DIM_MULTIPLE
    return (
        f" The layers held back by their tokens per call ({token_counts(plan)}) "
        f"qualify once batch x sequence is a multiple of {m}: a batch size or sequence length that makes it one, "
        f"pad_to_multiple_of={m} in a Hugging Face data collator, or torchao padding it "
        "(Float8LinearConfig(pad_inner_dim=True))."
        + (
            " As they vary from step to step, every batch must be one: a last, smaller batch too "
            "(DataLoader(drop_last=True))."
            if plan.fp8_tokens_vary
            else ""
        )
    )


# each kind of ``_Unconverted`` module in words: (its matmuls, whose FLOPs they are)
_UNCONVERTED_WORDS = {
    ATTENTION: ("nn.MultiheadAttention's projections and score matmuls", "the attention's"),
    RECURRENT: ("the recurrent layers' gates", "the recurrent layers'"),
    CONVOLUTION: ("the convolutions", "the convolutions'"),
}


def _and(parts: list[str]) -> str:
    """``parts`` as a list in words: "a", "a and b", "a, b and c"."""
    if len(parts) < 2:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _layer_calls(
    calls: Mapping[str, list[fp8_speed.Shape]], converted: bool
) -> tuple[str, list[fp8_speed.Shape]]:
    """Linear layers' GEMMs (``calls``: each layer's, one a call), and them in words: "5 converted linear
    layers", "2 calls of 1 linear layer not converted"."""
    gemms = [g for shapes in calls.values() for g in shapes]
    n = sum(1 for shapes in calls.values() if shapes)
    layers = f"linear layer{'s' if n != 1 else ''}"
    words = f"{n} converted {layers}" if converted else f"{n} {layers} not converted"
    return (words if len(gemms) == n else f"{len(gemms)} calls of {words}"), gemms


# the GEMMs of each kind of ``_Unconverted`` module, as the speed estimate counts them (one; several take an s)
_GEMM_WORDS = {
    ATTENTION: "attention projection",
    RECURRENT: "recurrent gate GEMM",
    CONVOLUTION: "convolution",
}


def _bf16_gemms(
    linear: Mapping[str, list[fp8_speed.Shape]],
    experts: Mapping[str, list[fp8_speed.Shape]],
    unconverted: Mapping[str, _Unconverted],
) -> tuple[str, list[fp8_speed.Shape]]:
    """The GEMMs the speed estimate leaves in bf16 (the linear layers not converted, ``linear``: each one's calls;
    the experts'; the projections, gates and convolutions float8 conversion does not swap, and the score matmuls
    of nn.MultiheadAttention, Q K^T and the weights x V of each call, as the FLOPs share counts them), and them
    counted in words by whose they are: "the 6 GEMMs left in bf16 (2 calls of 1 linear layer not converted and 4
    attention projections)" ("" when there are none)."""
    words, gemms = _layer_calls(linear, converted=False)
    parts = [words] if gemms else []
    for what, more in [
        ("expert GEMM", [g for shapes in experts.values() for g in shapes]),
        *[
            (_GEMM_WORDS[kind], [g for u in unconverted.values() if u.kind == kind for g in u.gemms])
            for kind in _GEMM_WORDS
        ],
        ("attention score matmul", [g for u in unconverted.values() for g in u.scores]),
    ]:
        parts += [f"{len(more)} {what}{'s' if len(more) != 1 else ''}"] if more else []
        gemms += more
    n = len(gemms)
    return (f"the {n} GEMM{'s' if n != 1 else ''} left in bf16 ({_and(parts)})" if n else ""), gemms


def _unconverted_listing(unconverted: Mapping[str, _Unconverted], limit: int) -> str:
    """The modules whose matmuls float8 conversion does not reach, by kind ("nn.MultiheadAttention's projections
    (enc.layers.0.self_attn, enc.layers.1.self_attn) and the convolutions (0, 3)")."""
    return _and(
        [
            f"{words} ({_listing([m for m, u in unconverted.items() if u.kind == kind], limit)})"
            for kind, (words, _) in _UNCONVERTED_WORDS.items()
            if any(u.kind == kind for u in unconverted.values())
        ]
    )


def _attention_uncounted(run: _Run, unconverted: Mapping[str, _Unconverted]) -> list[str]:
    """The attention modules whose score matmuls (Q K^T and the weights x V) no count includes: those computed
    outside nn.MultiheadAttention (a Hugging Face attention module, a block calling F.scaled_dot_product_attention),
    from no weight, on sequence lengths the run does not record (its rows are batch x sequence, never the two
    apart). Such an attention is told by the name of a matmul inside it, a part of it holding "attn" or
    "attention" (self_attn.q_proj, attention.self.query, attn.c_attn): a module of no matmul so named, as
    Llama's post_attention_layernorm, is none. Float8 conversion leaves its score matmuls in bf16. A matmul at or
    below an nn.MultiheadAttention whose scores are counted is no sign of one, wherever that module sits under the
    named part (blk.attn.mha.out_proj in a wrapper blk.attn): its attention is in the share already. Nor is an
    attention that ran no forward on any sampled step, neither it nor a module under it (a decoder-only
    BartForCausalLM's cross-attention, encoder_attn, without encoder states): it did no score matmul."""
    counted = [m for m, u in unconverted.items() if u.scores]
    ran = set(T.texts(run.kind(T.ACTIVATION, T.ACTIVATION_GRAD)[T.MODULE]))
    attention: dict[str, None] = {}
    for m, entry in _captured_modules(run).items():
        if not taxonomy.is_matmul_type(str(entry.get("type", ""))):
            continue
        if any(f"{m}.".startswith(f"{c}.") for c in counted):
            continue
        parts = m.split(".")
        at = [i for i, p in enumerate(parts) if _attention_part(p)]
        if at:
            attention[".".join(parts[: at[0] + 1])] = None
    return [a for a in attention if any(r == a or r.startswith(f"{a}.") for r in ran)]


def _scores_left_out(attention: list[str]) -> str:
    """The words saying that the share leaves out the score matmuls of ``attention`` (``_attention_uncounted``;
    "" when there is none), with what they would add."""
    if not attention:
        return ""
    return (
        f". The share leaves out the score matmuls (Q K^T and the weights x V) of {_listing(attention, 4)}, "
        "which float8 conversion leaves in bf16: the run does not record their sequence lengths"
    )


def _scores_method(attention: list[str]) -> str:
    """What the score matmuls ``_scores_left_out`` names would add to the FLOPs ("" when there is none)."""
    if not attention:
        return ""
    return (
        " The score matmuls the share leaves out do 4 x L x d FLOPs per token an attention layer (L: the tokens "
        "a query attends to, d: heads x head_dim; 2 x L x d where a causal kernel skips the masked half), beside "
        "2 x in x out per token of each linear layer, 24 x d^2 in a GPT block: of all of such a model's matmuls, "
        "the eligible share is about the one given x 6d / (6d + L) (at d = 768 and L = 2048, x 0.69)."
    )


# the matmuls the FLOPs share does not count, said wherever the share is: those of the model's forward code, done
# with no layer's weight (a selective scan's einsum, attention scores from F.scaled_dot_product_attention in a
# module of any name), which the run does not record. The share of all of the step's matmuls is lower by theirs:
# a Mamba-like model's layers carried "98.6% of the matmul FLOPs" where torch's count gave 53.9% (reviewer t3).
# Not measured: FlopCounterMode, a dispatch mode, would have to stay entered across the user's code from the
# forward to the backward of a sampled step (compiled code runs past it), and costs every op of that step
FORWARD_CODE_UNCOUNTED = "matmuls in forward code, as torch.einsum, bmm, @ and attention scores, left out"
FORWARD_CODE_WORDS = (
    "; matmuls its forward code does itself (torch.einsum, bmm, @, attention scores) are left out, as the run "
    "does not record them: of all of the step's matmuls the eligible layers carry less, by those"
)


# why a linear layer whose own forward never ran, its weight multiplied by the code around it, is not eligible
# (``_multiplied_outside``)
OUTSIDE_REASON = (
    "its own forward never ran on a sampled step, yet its weight got gradients: the code around it multiplies that "
    "weight itself (as Mamba's mixer does dt_proj.weight @ x), and float8 conversion swaps the module, whose "
    "forward is never called, so that matmul stays in bf16 (its FLOPs not counted)"
)


def _unseen_words(unseen: Mapping[str, list[str]], limit: int) -> str:
    """The words saying that the matrix parameters of modules of no matmul kind are not counted
    (``_unseen_weights``; "" when there is none): whether their own code multiplies them the run does not show,
    so it is said as a possibility."""
    if not unseen:
        return ""
    params = sorted({p for ps in unseen.values() for p in ps})
    return (
        f"; the matrix parameters of {_listing(list(unseen), limit)} ({', '.join(params[:limit])}) are not "
        "counted: where their own code multiplies them (F.linear, @), that matmul is no module's that this count "
        "sees and stays in bf16; the run does not show whether it does (an element-wise use is no matmul)"
    )


def _not_eligible(bad: list[tuple[str, str]], limit: int) -> str:
    """The layers that are not FP8-eligible, those with the same reason together ("a, b and 3 more (68 tokens
    per call, not a multiple of 16); c (dims ...)"), at most ``limit`` reasons."""
    by: dict[str, list[str]] = {}
    for m, why in bad:
        by.setdefault(why, []).append(m)
    parts = [f"{_listing(ms, limit)} ({why})" for why, ms in by.items()]
    rest = sum(len(ms) for ms in list(by.values())[limit:])
    return "; ".join(parts[:limit]) + (f" and {rest} more" if rest else "")


def _unjudged(run: _Run, plan: _Plan, linear: list[str], shapes: Mapping[str, _Fp8Shape]) -> bool:
    """Whether the run has not saved its summary (cut off before it did, or still running), whose capture.modules
    holds the layers' shapes, and no linear layer's shape is known: its FP8 eligibility is not judged, and a
    finding says why. Such a run read "0 of 9 qualify ... Not eligible: (all 9) (weight shape unknown)", a
    verdict the data does not support."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    if (
        run.summary.get(T.SUMMARY_STATUS) != T.STATUS_INCOMPLETE
        or "modules" in capture
        or any(shapes[m].in_features is not None for m in linear)
    ):
        return False
    layers = "linear layer" if len(linear) == 1 else f"{len(linear)} linear layers"
    plan.fp8_unjudged = (
        f"the shapes of its {layers} were not recorded: the run has not saved summary.json, which records them "
        "(it stopped before it saved, or is still running)"
    )
    plan.add(
        Finding(
            "fp8_eligibility",
            INFO,
            "FP8 eligibility not judged",
            f"Whether a linear layer is FP8-eligible depends on its shape (both dimensions multiples of "
            f"{taxonomy.FP8_DIM_MULTIPLE}), and {plan.fp8_unjudged}. No layer is judged eligible or not.",
            "Record a run that saves (prof.save() or prof.report() at its end, or precprof train) to judge them.",
            numbers={"checked": 0, "unknown_shape": len(linear)},
        )
    )
    return True


def _all_zero_grads(run: _Run) -> set[str]:
    """The modules whose every recorded output-gradient value was an exact zero (the FP8 cast of a later layer's
    backward flushed them, a dead ReLU after them): recorded, with no value to judge a format on."""
    ag = run.kind(T.ACTIVATION_GRAD)
    per = ag.groupby(T.texts(ag[T.MODULE]).astype(object))[[T.NUMEL, T.ZEROS]].sum()
    return {str(m) for m in per.index[(per[T.NUMEL] > 0) & (per[T.ZEROS] >= per[T.NUMEL])]}


def _gemms_run(run: _Run, linear: list[str], with_grad: set[str]) -> dict[str, int]:
    """How many of a call's three GEMMs each linear layer runs: 1 without an output gradient on any sampled step
    (in a run that recorded some: ``with_grad``), 2 without a weight gradient (frozen, in a run that recorded
    some: a LoRA model's base layers compute their input's gradient alone), else 3."""
    wg = run.layers.loc[(run.layers[T.TENSOR] == T.WEIGHT_GRAD) & (run.layers[T.PARAM] == T.WEIGHT), T.MODULE]
    trained = set(T.texts(wg).astype(object))
    return {
        m: 1 if with_grad and m not in with_grad else 2 if trained and m not in trained else fp8_speed.GEMMS
        for m in linear
    }


def fp16_overflow_steps(run: _Run) -> dict[int, str]:
    """Per sampled step whose forward overflowed fp16, the module that overflowed: the first in forward order of
    the fp16 outputs holding inf (it propagates downstream, as nan after a matmul or a norm), when its finite
    values reach within the fp16 rule's headroom of 65504 (``AdvisorConfig.fp16_activation_headroom_log2``): an
    inf made by a log(0) or a -inf mask reaches no such value, and is no overflow."""
    acts = run.kind(T.ACTIVATION)
    seen = acts[_dtype_has(acts, "float16") & (acts[T.INF] > 0)]
    limit = FP16.max / 2.0**run.cfg.fp16_activation_headroom_log2
    out: dict[int, str] = {}
    for step, at in seen.groupby(T.STEP):
        first = run.sort(_innermost(at[T.MODULE]))[0]
        amax = pd.to_numeric(at.loc[T.texts(at[T.MODULE]) == first, T.ABSMAX], errors="coerce").max()
        if amax >= limit:
            out[int(step)] = first
    return out


def _overflow_words(overflowed: Mapping[int, str], steps: int, limit: int) -> str:
    """The words saying that the nan/inf of the steps that overflowed fp16 (``fp16_overflow_steps``) are left
    out, and where they came from ("" when no step did)."""
    if not overflowed:
        return ""
    origins = sorted(set(overflowed.values()))
    return (
        f". The nan/inf of {len(overflowed)} of the {steps} sampled step(s) come from fp16 overflowing in "
        f"{_listing(origins, limit)} (values beyond 65504, inf in fp16) and from what that inf became after it, "
        "forward and backward: they are left out, as FP8 training keeps activations in bf16, where those values "
        "are finite"
    )


def _rule_fp8(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    every = [m for m in plan.matmul_layers if taxonomy.is_linear_type(run.types.get(m, ""))]
    if not every:
        return
    # the layers the run already trains in an MX format (torchao's MX training): no candidates for per-tensor
    # FP8, whose one scale per tensor is coarser than their one per block; the FLOPs share and the speed
    # estimate leave them out (they run as they do under either verdict)
    blocks = run.block_running
    linear = [m for m in every if m not in blocks]
    plan.fp8_block_running = [m for m in every if m in blocks]
    shapes = _fp8_shapes(run, every, dims)
    if _unjudged(run, plan, every, shapes):
        return
    if not linear:
        _all_in_block_formats(run, plan)
        return
    # (the values the layers hold and compute: a weight update's nan is the next step's weight's)
    read = run.layers[T.MODULE].isin(linear) & (run.layers[T.TENSOR] != T.WEIGHT_UPDATE)
    lay = run.layers.loc[read, [T.STEP, T.MODULE, T.TENSOR, T.NAN, T.INF]]
    # the gradients of a step a loss scaler skipped overflowed at its scale: FP8 training (bf16 autocast, no
    # loss scale) has none of those; what the model itself computed non-finite is in the forward pass
    # (with several optimizers under it, only those of the optimizers it skipped: ``_skipped_rows``)
    scaled_out = _skipped_rows(run, lay, scaled=True) & lay[T.TENSOR].isin(T.GRADIENT_KINDS)
    plan.fp8_scaler_nonfinite_steps = int(lay[scaled_out & ((lay[T.NAN] + lay[T.INF]) > 0)][T.STEP].nunique())
    lay = lay[~scaled_out]
    # the outputs and gradients of a step whose forward overflowed fp16 (what that inf became downstream, and
    # in the backward, at any scale): FP8 training keeps activations in bf16, where those values are finite. A
    # weight's nan/inf is there before the forward, and counts
    overflowed = fp16_overflow_steps(run)
    lay = lay[~(lay[T.STEP].isin(overflowed) & (lay[T.TENSOR] != T.WEIGHT))]
    nonfinite = (lay[T.NAN] + lay[T.INF]).groupby(T.texts(lay[T.MODULE]).astype(object)).sum()
    inputs = gemm_inputs(run, linear, dims)
    losses = fp8_losses(run, linear, inputs)
    # (their output gradients, which held nan/inf at the scale, are not judged either: FP8 scales no loss)
    summary = fp8_summary(losses[~((losses["side"] == BACKWARD) & _skipped_rows(run, losses, scaled=True))])
    by_key = summary.to_dict("index")
    lim = cfg.lost_norm_max
    # modules whose output gradient was recorded: in a run that recorded some, a layer without one on any sampled
    # step had an output that needed none (a frozen layer that nothing trainable feeds, as a LoRA model's first
    # layers, or an output that does not reach the loss): it runs no backward GEMM, and is judged on its forward
    grads = run.layers.loc[run.layers[T.TENSOR] == T.ACTIVATION_GRAD, [T.STEP, T.MODULE]]
    with_grad = set(T.texts(grads[T.MODULE]).astype(object))
    # a layer whose every output gradient came on a step the loss scaler skipped: judged on its forward alone
    scaled_only = with_grad - set(
        T.texts(grads.loc[~_skipped_rows(run, grads, scaled=True), T.MODULE]).astype(object)
    )
    zero_grad = _all_zero_grads(run)
    rows: list[tuple[str, str]] = []
    forward_only: list[str] = []
    skipped_only: list[str] = []
    batch_tokens = _tokens_per_call(run)
    computed = _computed_weights(run)
    for m in linear:
        sh = shapes[m]
        held_tokens = sh.odd_tokens[1] if sh.odd_tokens is not None else sh.tokens or 0
        fwd, bwd = _get(by_key, m, FORWARD, "norm"), _get(by_key, m, BACKWARD, "norm")
        if fwd is not None and with_grad and m not in with_grad:
            forward_only.append(m)
        elif fwd is not None and m in scaled_only:
            skipped_only.append(m)
        # the shape rule is taxonomy's, the one --precision fp8 (convert_fp8) applies to the live model
        # (calls of different tokens: judged on the largest number dividing them all, not on their mean)
        tokens = held_tokens if sh.uneven_calls else sh.tokens
        why = taxonomy.fp8_ineligible_reason(sh.in_features, sh.out_features, sh.tied_to is not None, tokens)
        if not why and sh.odd_tokens is not None:
            why = taxonomy.fp8_ineligible_reason(sh.in_features, sh.out_features, False, sh.odd_tokens[1])
        uneven = (
            (sh.odd_tokens[0], *sh.call_tokens, held_tokens)
            if why.endswith(TOKENS_REASON) and sh.odd_tokens is not None and sh.call_tokens is not None
            else None
        )
        if uneven is not None:  # no call need have had the divisor's count of tokens
            why = _uneven_reason(*uneven)
        elif why.endswith(TOKENS_REASON) and sh.odd_tokens is not None:  # a later step's
            why += f" at step {sh.odd_tokens[0]}: they vary from step to step"
        if m in computed:
            why = f"its weight is computed by {computed[m]}: float8 conversion fails on it"
        elif not taxonomy.fp8_convertible_type(run.types.get(m, "")):
            why = f"a {run.types.get(m, '')}, not an nn.Linear: float8 conversion does not swap it"
        elif sh.tied_to is not None:
            why = f"tied to the embedding {_name(sh.tied_to)}: the shared weight is a gather's too"
        elif sh.in_features is None:
            why += (
                ": its weight is recorded under another module (shared, maybe tied to an embedding)"
                if sh.shared
                else ": none was recorded for it"
            )
        elif (TOKENS_REASON in why or uneven) and taxonomy.routed_expert(m) and held_tokens != batch_tokens:
            # routed: a share of the batch (an expert that sees every token, as a multi-gate mixture's, is not)
            plan.fp8_expert_tokens[m] = held_tokens
            why = EXPERT_TOKENS_REASON
        elif uneven is not None:
            plan.fp8_uneven[m] = uneven
        elif TOKENS_REASON in why:
            plan.fp8_tokens[m] = held_tokens
            plan.fp8_tokens_vary |= sh.odd_tokens is not None and not sh.uneven_calls
        if why:
            plan.fp8_shape_blocked.add(m)
        elif nonfinite.get(m, 0) > 0:
            why = "non-finite values"
        elif fwd is None:
            why = "no forward statistics"
        elif bwd is None and m in zero_grad:
            why = "every recorded value of its output gradient was zero: what FP8 does to it is not measured"
        elif bwd is None and m not in scaled_only and (m in with_grad or not with_grad):
            why = "no backward statistics" + ("" if with_grad else ": no backward pass was recorded")
        elif fwd > lim:
            why = f"e4m3 loses up to {_pct(fwd)} of its input's or weight's norm" + _floor_words(
                by_key, m, FORWARD
            )
        elif bwd is not None and bwd > lim:
            why = f"e5m2 loses up to {_pct(bwd)} of its output gradient's norm" + _floor_words(
                by_key, m, BACKWARD
            )
        elif run.fp8_scaling.get(m, "tensorwise") == "tensorwise":  # a rowwise recipe scales each row alone
            why = _outlier_reason(by_key, m, cfg.fp8_pushed_subnormal_max)
        rows.append((m, why))
    # linear layers whose own forward never ran, their weight multiplied by the code around them: counted among
    # the model's linear layers, and not eligible
    outside = _multiplied_outside(run)
    rows += [(m, OUTSIDE_REASON) for m in outside if taxonomy.is_linear_type(run.types.get(m, ""))]
    plan.fp8_shape_blocked.update(m for m, why in rows if why == OUTSIDE_REASON)
    plan.fp8_checked = len(rows)
    plan.fp8_eligible = [m for m, why in rows if not why]
    plan.fp8_why_not = {m: why for m, why in rows if why}
    # each layer's matmul FLOPs per token of a call, at the tokens each of its calls had
    tokens = _tokens_per_call(run)
    known = {m: f for m in linear if (f := shapes[m].flops_per_token(tokens)) is not None}
    # a mixture of experts' banks of expert weights: matmuls float8 conversion does not swap (it swaps nn.Linear
    # alone), counted in the step's FLOPs (per token of a call, as the layers': their routed rows over the tokens)
    experts = _expert_gemms(run) if tokens else {}
    expert_flops = {
        b: sum(2 * rows * k * n for rows, k, n in gemms) / tokens for b, gemms in experts.items() if tokens
    }
    # the matmuls of nn.MultiheadAttention's projections, recurrent layers and convolutions: float8 conversion
    # leaves them in bf16 as well, and counts them in the step's FLOPs
    unconverted, not_counted = _unconverted_matmuls(run)
    other_flops = {m: u.flops_per_token(tokens) for m, u in unconverted.items() if tokens}
    unseen = _unseen_weights(run, {**unconverted, **dict.fromkeys(not_counted)})
    convolutions = [m for m in outside if not taxonomy.is_linear_type(run.types.get(m, ""))]
    plan.fp8_scores_uncounted = _attention_uncounted(run, unconverted)
    total = sum(known.values()) + sum(expert_flops.values()) + sum(other_flops.values())
    plan.fp8_flops_share = sum(known.get(m, 0) for m in plan.fp8_eligible) / total if total > 0 else None
    experts_share = sum(expert_flops.values()) / total if expert_flops and total > 0 else None
    plan.fp8_experts_share = experts_share
    plan.fp8_others_share = sum(other_flops.values()) / total if other_flops and total > 0 else None
    plan.fp8_others_whose = _and(
        [
            whose
            for kind, (_, whose) in _UNCONVERTED_WORDS.items()
            if any(u.kind == kind for u in unconverted.values())
        ]
    )
    # banks whose GEMMs cannot be read (no activation module of their own to count the routed rows from): their
    # FLOPs are missing from the total, and the share is said to be without them
    uncounted = run.sort([b for b in _expert_banks(run) if b not in expert_flops])
    plan.fp8_experts_uncounted = uncounted

    def calls(modules: list[str]) -> list[tuple[int, int, int]]:
        """The forward (tokens, in, out) of each call of these modules, those of unknown shape left out."""
        return [
            (sh.tokens, sh.in_features, sh.out_features)
            for m in modules
            if (sh := shapes[m]).tokens and sh.in_features and sh.out_features
            for _ in range(max(sh.calls, 1))
        ]

    # the step's speed: the eligible layers FP8 would convert, beside the GEMMs left in bf16, each layer's calls
    # counting the GEMMs it runs (a LoRA model's eligible layers were its frozen base layers, timed as if trained)
    runs = plan.fp8_gemms_run = _gemms_run(run, linear, with_grad)
    converted, conv_gemms = _layer_calls({m: calls([m]) for m in plan.fp8_eligible}, converted=True)
    kept_layers = {m: calls([m]) for m in linear if m not in set(plan.fp8_eligible)}
    kept, kept_gemms = _bf16_gemms(kept_layers, experts, unconverted)
    plan.fp8_speed = fp8_speed.estimate(
        conv_gemms,
        kept_gemms,
        gemms=[runs[m] for m in plan.fp8_eligible for _ in calls([m])],
        others_gemms=[runs[m] for m, shapes in kept_layers.items() for _ in shapes]
        + [fp8_speed.GEMMS] * (len(kept_gemms) - sum(map(len, kept_layers.values()))),
    )
    plan.fp8_speed_words = (f"the {converted}", kept)
    unknown = [m for m in linear if m not in known]
    tied = [m for m in linear if shapes[m].tied_to is not None]
    # tied layers first: the cause a shape table does not show
    bad = sorted(((m, why) for m, why in rows if why), key=lambda mw: mw[0] not in tied)

    def worst(side: str, col: str) -> tuple[float | None, str | None]:
        if summary.empty:
            return None, None
        s = (
            summary.xs(side, level="side")[col].dropna()
            if side in summary.index.get_level_values(1)
            else None
        )
        if s is None or s.empty:
            return None, None
        return float(s.max()), (str(s.idxmax()) if s.max() > 0 else None)

    fmax, fmod = worst(FORWARD, "norm")
    bmax, bmod = worst(BACKWARD, "norm")
    fval, fvmod = worst(FORWARD, "values")
    unjudged_grads = bmax is None and bool(skipped_only)  # (every output gradient was on a skipped step)
    bval, bvmod = worst(BACKWARD, "values")
    steps = int(summary["steps"].max()) if not summary.empty else 0
    # layers whose input no row records (made by no captured module, with the block-format what-if off, which
    # records a layer's own input): judged on their weight and output gradient
    unread = [m for m in linear if not inputs[m] and m not in plan.fp8_shape_blocked]
    again = made_more_often(run, linear, inputs)
    # a layer the count of flushed values would have ruled out (the rule before issue 34: over 1% of values)
    counted = [
        m
        for m in plan.fp8_eligible
        if max(_get(by_key, m, FORWARD, "values") or 0.0, _get(by_key, m, BACKWARD, "values") or 0.0) > 0.01
    ]
    # the most of the norm they lose: measured, and under the limit, as they are eligible
    counted_norm = max(
        (
            max(_get(by_key, m, FORWARD, "norm") or 0.0, _get(by_key, m, BACKWARD, "norm") or 0.0)
            for m in counted
        ),
        default=0.0,
    )
    # the largest share of a tensor's values its largest push below the smallest normal (None: none was read)
    pushed = [
        (w, m)
        for side in (FORWARD, BACKWARD)
        for m in linear
        if (w := _get(by_key, m, side, "pushed")) is not None
    ]
    pmax, pmod = max(pushed) if pushed else (None, None)
    pmod = pmod if pmax else None
    lowest, low_where = _most(by_key, linear)
    method = (
        "A linear layer is FP8-eligible when --precision fp8 would convert it (an nn.Linear not tied to an "
        f"embedding, both dimensions and the tokens per call multiples of {taxonomy.FP8_DIM_MULTIPLE}), none of "
        "its tensors held nan/inf, and per-tensor current scaling with power-of-two scales (scale "
        f"{current_scaling.SCALE_WORDS}) loses at most {_pct(lim)} of "
        "the L2 norm of what its FP8 GEMMs read: its input and weight (e4m3) and its output gradient (e5m2), "
        "its input being the output of the module that made it, or the layer's own input row; its output "
        f"stays bf16. The figure is the median over the {steps} sampled step(s) of an upper bound from the "
        "step's exponent histogram (each flushed value at its binade's upper edge, the exact count of flushed "
        "values), so the largest norm lost is at most the figure given. Nothing saturates under current scaling. "
        f"Why {_pct(lim)}: {LOST_NORM_EVIDENCE} Nor may an outlier set a tensor's scale: its largest "
        f"{_pct(OUTLIER_SHARE)} of values may push at most {_pct(cfg.fp8_pushed_subnormal_max)} of its values "
        "below the format's smallest normal, where they keep few significant bits while the norm, which the "
        "outlier holds, loses almost nothing (as with the massive activations of large language models). "
        f"{_not_judged_method(cfg.fp8_pushed_subnormal_max)}"
        + _floored_method(_floored(by_key, linear, plan.fp8_shape_blocked))
        + _scores_method(plan.fp8_scores_uncounted)
    )
    # the decision first (which layers qualify, which do not and why), then the figures; what eligible means and
    # how each figure is measured is the method's (the message had them first, and the decision last)
    msg = (
        f"{len(plan.fp8_eligible)} of {len(rows)} qualify"
        + (f": {_listing(plan.fp8_eligible, cfg.max_listed_modules)}" if plan.fp8_eligible else "")
        + (". Not eligible: " + _not_eligible(bad, cfg.max_listed_modules) if bad else "")
        + f". The eligible layers carry {_pct(plan.fp8_flops_share)} of the "
        + (
            "matmul FLOPs of the model's layers, those of the modules float8 conversion leaves in bf16 included"
            if other_flops
            else "matmul FLOPs of the model's layers, the experts' included"
            if expert_flops
            else "matmul FLOPs of the model's linear layers"
        )
        + " (2 x in x out per token"
        + (f"; {len(unknown)} layer(s) of unknown shape not counted" if unknown else "")
        + (
            "; nn.MultiheadAttention's score matmuls, Q K^T and the weights x V, 4 x query tokens x key tokens x "
            "embed dim per call"
            if any(u.scores for u in unconverted.values())
            else ""
        )
        + ")"
        + _block_running_words(run, plan)
        + _scores_left_out(plan.fp8_scores_uncounted)
        + (
            f"; {_unconverted_listing(unconverted, cfg.max_listed_modules)}, {_pct(plan.fp8_others_share)} of "
            "them, stay in bf16: float8 conversion swaps nn.Linear modules alone"
            if other_flops
            else ""
        )
        + (
            f"; the matmuls of {_listing(not_counted, cfg.max_listed_modules)} are not counted (this run does "
            "not tell their rows per call): they stay in bf16 all the same"
            if not_counted
            else ""
        )
        + _unseen_words(unseen, cfg.max_listed_modules)
        + (
            f"; the convolutions {_listing(convolutions, cfg.max_listed_modules)} ran no forward of their own, yet "
            "their weights got gradients: the code around them computes with those weights itself (F.conv1d), "
            "matmuls not counted that stay in bf16"
            if convolutions
            else ""
        )
        + (
            f"; the experts of {len(expert_flops)} mixture-of-experts module(s) "
            f"({_listing(run.sort(list(expert_flops)), cfg.max_listed_modules)}), {_pct(experts_share)} of "
            "them, stay in bf16: float8 conversion swaps nn.Linear alone"
            if expert_flops
            else ""
        )
        + (
            f"; the experts of {_listing(uncounted, cfg.max_listed_modules)} (3-D expert weights) are not counted: "
            "the rows routed to a bank are read from an activation module inside it, and they have none; their "
            "matmuls stay in bf16 under FP8 all the same"
            if uncounted
            else ""
        )
        + FORWARD_CODE_WORDS
        + (
            f". The gradients of {plan.fp8_scaler_nonfinite_steps} step(s) the loss scaler skipped held nan/inf "
            "at its scale and are left out: FP8 training scales no loss"
            if plan.fp8_scaler_nonfinite_steps
            else ""
        )
        + _overflow_words(overflowed, run.layers[T.STEP].nunique(), cfg.max_listed_modules)
        + _floored_words(by_key, linear, plan.fp8_shape_blocked, cfg.max_listed_modules)
        + f". Largest norm lost: e4m3 {_bound(fmax)}"
        + (f" ({_name(fmod)})" if fmod is not None else "")
        + (
            ", e5m2 not measured (no output gradient was judged)"
            if unjudged_grads
            else f", e5m2 {_bound(bmax)}"
        )
        + (f" ({_name(bmod)})" if bmod is not None else "")
        + f". Values flushed (not judged): up to {_pct(fval)} forward"
        + (f" ({_name(fvmod)})" if fvmod is not None else "")
        + ("" if unjudged_grads else f" and {_pct(bval)} of the output gradients")
        + (f" ({_name(bvmod)})" if bvmod is not None else "")
        + (
            f"; {_listing(counted, cfg.max_listed_modules)} flush more than 1% of their values yet lose "
            + _at_most(counted_norm)
            + f" of the norm, where {_pct(lim)} is allowed"
            if counted
            else ""
        )
        + ". "
        + _pushed_words(pmax, pmod, _pooled_layers(by_key, linear))
        + (
            f". {BELOW_WORDS}: "
            + (f"at most {_pct(lowest)} of a tensor's ({low_where})" if lowest else "none")
            + _below_words(by_key, linear, cfg.fp8_pushed_subnormal_max, cfg.max_listed_modules)
            if lowest is not None
            else ""
        )
        + _pooled_words(run, by_key, linear, cfg.max_listed_modules)
        + _rowwise_words(run, linear, cfg.max_listed_modules)
        + (
            f". {len(forward_only)} layer(s) had no output gradient on any sampled step "
            f"({_listing(forward_only, cfg.max_listed_modules)}: frozen with nothing trainable before them, or "
            "an output that does not reach the loss): they run no backward GEMM and are judged on their forward "
            "alone"
            if forward_only
            else ""
        )
        + (
            f". {len(skipped_only)} layer(s) had an output gradient only on the steps the loss scaler skipped "
            f"({_listing(skipped_only, cfg.max_listed_modules)}), which are left out: they are judged on their "
            "forward alone"
            if skipped_only
            else ""
        )
        + _unread_words(run, unread, cfg.max_listed_modules)
        + _made_again_words(run, again, inputs, cfg.max_listed_modules)
        + "."
    )
    plan.add(
        Finding(
            "fp8_eligibility",
            WARNING if run.hw.fp8_supported and not plan.fp8_eligible else INFO,
            f"{len(plan.fp8_eligible)} of {len(rows)} linear layers are FP8-eligible"
            + _block_running_title(run, plan),
            msg,
            # the decision replaces this remedy when the verdict is not fp8 (decide._fp8_story)
            ("Convert" if run.hw.fp8_supported else "On FP8 hardware (compute capability 8.9+), convert")
            + " the eligible layers to FP8 (torchao convert_to_float8_training with a module filter) and keep "
            "the others in bf16"
            + (
                f" ({_listing(tied, cfg.max_listed_modules)}: tied to an embedding, "
                f"{'it stays' if len(tied) == 1 else 'they stay'} in bf16)."
                if tied
                else "."
            )
            + held_back_remedy(plan),
            modules=plan.fp8_eligible,
            numbers={
                "eligible": len(plan.fp8_eligible),
                "checked": len(rows),
                **({"block_running": len(plan.fp8_block_running)} if plan.fp8_block_running else {}),
                "tied": len(tied),
                "forward_only": len(forward_only) + len(skipped_only),
                **({"fp16_overflow_steps": len(overflowed)} if overflowed else {}),
                "unknown_shape": len(unknown),
                **({"multiplied_outside": len(outside)} if outside else {}),
                "eligible_flops_share": plan.fp8_flops_share,
                "experts_flops_share": experts_share,
                "experts_uncounted": len(uncounted),
                "max_e4m3_lost_norm": fmax,
                "max_e5m2_lost_norm": bmax,
                "max_e4m3_share": fval,
                "max_e5m2_share": bval,
                "max_pushed_subnormal": pmax,
                "max_pushed_pooled": _most(by_key, linear, "pushed_pooled")[0],
                "max_below_normal": lowest,
                "amax_floor_layers": len(_floored(by_key, linear, plan.fp8_shape_blocked)),
                "below_normal_tensors": len(_below(by_key, linear, cfg.fp8_pushed_subnormal_max)),
                "pushed_subnormal_max": cfg.fp8_pushed_subnormal_max,
                "lost_norm_max": lim,
                "sampled_steps": steps,
                **(
                    {
                        "unconverted_flops_share": plan.fp8_others_share,
                        "unconverted_uncounted": len(not_counted) + len(unseen) + len(convolutions),
                    }
                    if other_flops or not_counted or unseen or convolutions
                    else {}
                ),
            },
            method=method,
        )
    )
    _speed_finding(run, plan)


def _block_formats_run(run: _Run, modules: list[str]) -> str:
    """The block formats ``modules`` train in, in words ("MXFP8"; "MXFP8 or NVFP4")."""
    return " or ".join(dict.fromkeys(formats.label(run.block_running[m]) for m in modules))


def _block_training(run: _Run, modules: list[str]) -> tuple[str, str]:
    """Whose training ``modules`` run, and the values each of their scales covers: ("torchao's MX training",
    "32"), ("torchao's NVFP4 training", "16"), ("torchao's MX and NVFP4 training", "16 or 32")."""
    kinds = {run.block_running[m] for m in modules}
    nv = {k for k in kinds if k == "nvfp4"}
    whose = " and ".join(["MX"] * bool(kinds - nv) + ["NVFP4"] * bool(nv))
    sizes = sorted({BLOCK_SIZE.get(k, 32) for k in kinds})
    return f"torchao's {whose} training", " or ".join(map(str, sizes))


def _block_running_title(run: _Run, plan: _Plan) -> str:
    """The title's words on the linear layers left out as already in an MX format ("; 2 more train in MXFP8")."""
    n = len(plan.fp8_block_running)
    return f"; {n} more train in {_block_formats_run(run, plan.fp8_block_running)}" if n else ""


def _block_running_words(run: _Run, plan: _Plan) -> str:
    """Why the linear layers the run already trains in an MX format are not judged ("" for none): a run whose
    layers torchao's MX training ran listed them as FP8-eligible as if they were plain bf16 layers."""
    running = plan.fp8_block_running
    if not running:
        return ""
    n = len(running)
    whose, values = _block_training(run, running)
    return (
        f"; {n} more linear layer{'s' if n != 1 else ''} ({_listing(running, run.cfg.max_listed_modules)}) "
        f"already train{'s' if n == 1 else ''} in {_block_formats_run(run, running)} ({whose}), "
        "not judged here, nor counted in the FLOPs share or the speed estimate: per-tensor FP8, with one scale per "
        f"tensor, would be coarser than the scale per block of {values} values they run with; the block-format "
        "finding judges them (whether they keep their format)"
    )


def _all_in_block_formats(run: _Run, plan: _Plan) -> None:
    """The finding of a run whose every linear layer already trains in an MX format: none is left to judge for
    per-tensor FP8 (they were listed as FP8-eligible, as if they were plain bf16 layers)."""
    running = plan.fp8_block_running
    n = len(running)
    fmt = _block_formats_run(run, running)
    whose, values = _block_training(run, running)
    plan.add(
        Finding(
            "fp8_eligibility",
            INFO,
            f"No linear layer left for FP8: all {n} train in {fmt}",
            f"Every linear layer of the run ({_listing(running, run.cfg.max_listed_modules)}) already trains in "
            f"{fmt} ({whose}): none is a candidate for per-tensor FP8, whose one scale per tensor would be "
            f"coarser than the scale per block of {values} values they run with. The block-format finding judges "
            "them (whether they keep their format).",
            "Nothing to convert to per-tensor FP8; see the block-format finding for their format.",
            numbers={"eligible": 0, "checked": 0, "block_running": n},
        )
    )


def _floored(by_key: Mapping[Any, Mapping[str, Any]], linear: list[str], blocked: set[str]) -> list[str]:
    """The layers of ``linear`` a tensor of which had its largest value under torchao's amax floor, those FP8 would
    not convert for their shape or type (``blocked``: a 64 x 1 head) left out: no scale of torchao's reaches them."""
    return [
        m
        for m in linear
        if m not in blocked and any(_get(by_key, m, s, "floored") for s in (FORWARD, BACKWARD))
    ]


def _floored_words(
    by_key: Mapping[Any, Mapping[str, Any]], linear: list[str], blocked: set[str], limit: int
) -> str:
    """The words naming the layers a tensor of which lies under torchao's amax floor ("" when none does)."""
    layers = _floored(by_key, linear, blocked)
    if not layers:
        return ""
    floor = f"{formats.FP8_AMAX_FLOOR:g}"
    return (
        f". The largest value of a tensor of {len(layers)} layer(s) ({_listing(layers, limit)}) was under "
        f"{floor}, torchao's floor on amax: its figures are at torchao's scale, fmax/{floor}, not fmax/amax. A "
        f"loss weighted so small that its gradients are under {floor} (an auxiliary term's coefficient) needs a "
        "larger weight, or a static loss scale, under torchao's FP8"
    )


def _floored_method(floored: list[str]) -> str:
    """What torchao's floor on amax does to a tensor under it, for the method ("" when no layer has one)."""
    if not floored:
        return ""
    floor = f"{formats.FP8_AMAX_FLOOR:g}"
    return (
        f" A tensor whose largest value is under {floor} is scaled by fmax/{floor}, where torchao's scale stops "
        f"growing, not by fmax/amax: its values land far below the format's smallest normal, or under its "
        "smallest subnormal (a gradient of 1e-23 flushes entirely in e5m2)."
    )


LOST_NORM_EVIDENCE = (
    "the values lost carry so little of the tensor that the cast changes it less than the bf16 rounding every "
    "mixed-precision run already applies (a bf16 cast moves a Gaussian or Laplace tensor by 0.17% of its norm; "
    "e4m3's own rounding moves it by 2.7% and e5m2's by 5.3%, measured with torch's casts on 4M values), and it "
    "is the bound the fp16 and block-format rules apply."
)


def _speed_scores_left_out(plan: _Plan) -> str:
    """The words saying which score matmuls the speed estimate's GEMMs leave out, as the FLOPs share does ("" when
    none): those of attention computed outside nn.MultiheadAttention (``_attention_uncounted``)."""
    if not plan.fp8_scores_uncounted:
        return ""
    return (
        f" The score matmuls of {_listing(plan.fp8_scores_uncounted, 4)} (Q K^T and the weights x V) are not among "
        "the GEMMs counted, as the FLOPs share leaves them out (the run does not record their sequence lengths): "
        "they stay in bf16 in the rest, as the attention of the whole steps the constants were fitted on did."
    )


def _frozen_said(plan: _Plan, limit: int) -> str:
    """The sentence on the converted layers that run fewer than the three GEMMs the layer tables timed ("" when
    none do): a LoRA model's eligible layers are its frozen base layers, whose backward computes no weight
    gradient."""
    runs = plan.fp8_gemms_run
    frozen = [m for m in plan.fp8_eligible if runs.get(m) == 2]
    alone = [m for m in plan.fp8_eligible if runs.get(m) == 1]
    if not frozen and not alone:
        return ""
    n = len(plan.fp8_eligible)
    parts = []
    if frozen:
        many = "All" if len(frozen) == n else f"{len(frozen)} of the"
        parts.append(
            f"{many} {n} converted layers are frozen (no weight gradient on any sampled step: "
            f"{_listing(frozen, limit)}) and run their forward and input-gradient GEMMs alone"
        )
    if alone:
        parts.append(
            f"{len(alone)} frozen layer(s) with no output gradient either ({_listing(alone, limit)}) run the "
            "forward GEMM alone"
        )
    said = "; ".join(parts)
    share = " or ".join(["two thirds"] * bool(frozen) + ["a third"] * bool(alone))
    kept = any(n < fp8_speed.GEMMS for m, n in runs.items() if m not in set(plan.fp8_eligible))
    return (
        f" {said[:1].upper()}{said[1:]}: each is counted at that share of its layer's times, {share} (the three "
        "GEMMs do the same work, 2 M K N FLOPs each, but were timed together, not apart)"
        + (", as are the frozen layers left in bf16." if kept else ".")
    )


def speed_keep_remedy(where: str = "in bf16 on this model") -> str:
    """The speed finding's remedy where FP8 would not pay; the decision names ``where`` the layers run (with the
    rest of the model, in the verdict's format: ``decide._with_the_rest``)."""
    return f"Keep these layers {where}; FP8 pays for larger GEMMs (wider layers or more tokens per call)."


def _speed_finding(run: _Run, plan: _Plan) -> None:
    est = plan.fp8_speed
    if est is None or not run.hw.fp8_supported:  # the question is asked on FP8 hardware only
        return
    cfg = run.cfg
    cut = cfg.fp8_speedup_min
    pays = est.speedup > cut
    # the conservative end decides; the other end above the threshold: FP8 may pay on such a step
    may = not pays and max(est.speedup_launch_bound, est.speedup_gpu_bound) > cut
    verdict = (
        "would pay"
        if pays
        else f"may pay only on a {'GPU' if est.speedup_gpu_bound > cut else 'host'}-bound step"
        if may
        else "would not pay"
    )
    ends = f"{est.speedup_launch_bound:.2f}x (host-bound) to {est.speedup_gpu_bound:.2f}x (GPU-bound)"
    lo, hi = fp8_speed.TABLE_INTENSITY
    beyond = {
        "below": f" Their intensity is below that of every layer shape timed ({lo:.0f} to {hi:.0f} at "
        f"{fp8_speed.TABLE_TOKENS} tokens): extrapolated, towards smaller GEMMs, where FP8 only loses more.",
        "above": f" Their intensity is above that of every layer shape timed ({lo:.0f} to {hi:.0f} at "
        f"{fp8_speed.TABLE_TOKENS} tokens): extrapolated; the largest timed GEMMs gained 1.5x in FP8.",
    }.get(est.beyond, "")
    plan.add(
        Finding(
            "fp8_speed",
            INFO,
            f"FP8 {verdict} at these GEMM shapes: an estimated {ends} of bf16's speed a training step",
            f"An estimate, not a measurement of this run (tensorwise FP8, compiled, against bf16, compiled): "
            f"{est.explain(*plan.fp8_speed_words)}{_frozen_said(plan, cfg.max_listed_modules)}{beyond}"
            f"{_speed_scores_left_out(plan)} The layer times and the "
            "rest's constants were measured on an "
            f"{est.constants.device} (analysis/fp8_speed.py); FP8 is advised only above "
            f"{cut:g}x at the lower end. Sources: {fp8_speed.sources()}",
            "Measure it on the target: precprof compare --precisions bf16,fp8 (both compiled) times both."
            if pays or may
            else speed_keep_remedy(),
            modules=[],
            numbers={
                "estimated_speedup": est.speedup,
                "layers_speedup": est.layers_speedup,
                "gemm_share": est.gemm_share,
                "flops_share": est.flops_share if est.others else None,  # (1: every GEMM counted converted)
                "intensity": est.intensity,
                "layers": est.layers,
                "layers_bf16": est.others,
                "frozen_layers": sum(plan.fp8_gemms_run.get(m) != fp8_speed.GEMMS for m in plan.fp8_eligible),
                "speedup_min": cut,
            },
        )
    )
