"""The recorded tables as a stream of dashboard events: (tag, step, scalar) and (tag, step, exponent histogram).

Both sinks (TensorBoard, wandb) write exactly these events, so the two dashboards, and a live run and
``precprof export`` of the same run, show the same numbers. Tags (``<scope>`` is a layer's qualified name, or
``all`` for the sum over every captured layer; ``<kind>`` is a tensor kind of precprof.tables:
activation, activation_grad, weight, weight_grad, weight_update):

- ``precprof/loss``, ``precprof/loss_scale`` (in effect during the step's backward), ``precprof/skipped``
  (1 when the optimizer step was skipped for inf/nan gradients, else 0), ``precprof/skipped_steps`` (skipped
  steps so far, cumulative), ``precprof/grad_norm`` and ``precprof/step_time_s`` where known — every step;
- on sampled steps, per scope and kind:
  ``precprof/exponent/<scope>/<kind>`` — histogram over floor(log2|x|) of the unscaled values, one bucket per
  binade (bucket [e, e+1) holds 2^e <= |x| < 2^(e+1)); zeros, nan and inf are not in it but are the counts
  ``precprof/zeros|nan|inf/<scope>/<kind>``;
  ``precprof/underflow/<fmt>/<scope>/<kind>`` and ``precprof/overflow/<fmt>/<scope>/<kind>`` — the share of
  the elements (0..1) that a real cast to ``fmt`` (fp16, bf16, fp8_e4m3, fp8_e5m2) at the loss scale in
  effect flushes to zero / overflows (weight_update has neither, nor a histogram: its counts only);
  ``precprof/lost_update/<bf16|fp16>/<scope>`` — the share of the scope's weight updates that vanish when added
  to a weight held in that format, estimated from the sampled elements, each parameter at its size;
  ``precprof/update_ratio/<scope>`` — the optimizer's update against the weights, ||dw|| / ||w|| of the
  scope's parameters from their sampled elements, each parameter at its size (``precprof.analysis.update_ratio``:
  the report's "Weight updates against the weights" per layer); none on a step whose sampled weights were all
  zero, nor on one whose sampled updates held a nan or inf.

A layer's parameters (weight and bias) are summed into its ``weight`` / ``weight_grad`` / ``weight_update``
events. A layer's input row (``<layer>:input``, ``T.input_module``: a matmul's input no captured module made) is
a scope of its own with its activation events, and goes with its layer. What scales: the ``all`` aggregates are
written on every sampled step (4 kinds x 12 tags, and with an optimizer the 3 counts of weight_update, the 2
lost_update shares and the update ratio: 54), less what has nothing to show: a step the scaler skipped has no
weight_update rows (48), a kind with no finite nonzero value no histogram (every weight gradient inf: 47), and the
update ratio's cases above (docs/dashboards.md). Per-layer events (up to as many per layer) are written for the
layers ``layers`` selects: ``"auto"`` (the default) writes them when the first sampled step has at most
``AUTO_LAYER_LIMIT`` layers (input rows not counted, as the report's "layers profiled" counts) and none
otherwise, ``"all"``, ``"none"``, or a list of ``fnmatch`` patterns of qualified names (a layer's input row
with it, or by its own name). The choice is made once, from the first sampled step, so tags stay stable over a
run.

A NaN loss is written once a finite loss has been seen (a diverging run shows it); a run that never passes a
loss writes no loss series. Pure host-side pandas: never touches a device.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof.errors import UserError
from precprof.formats import WHATIF_FORMATS

PREFIX = "precprof"
ALL_LAYERS = "all"  # the scope of the aggregates over every captured layer
ROOT_LAYER = T.ROOT_LABEL  # the scope of the root module, whose qualified name is ""
AUTO_LAYER_LIMIT = 32  # "auto" writes per-layer events for models with at most this many captured layers
LOST_UPDATE_FORMATS = {"bf16": T.LOST_UPDATE_BF16, "fp16": T.LOST_UPDATE_FP16}
# ||dw||^2 and ||w||^2 of the weight_update rows (T.update_squares): summed over a scope's rows as the counts are
SQ_UPDATE, SQ_WEIGHT = "_sq_update", "_sq_weight"
# the weight_update rows' lost updates and elements, each parameter's sample at its size (T.sample_weights)
LOST_UPDATE_ESTIMATES = {fmt: f"_{col}_estimate" for fmt, col in LOST_UPDATE_FORMATS.items()}
UPDATE_SIZE = "_update_size"

LayerSelection = str | Sequence[str]


@dataclass(frozen=True)
class Scalar:
    tag: str
    step: int
    value: float


@dataclass(frozen=True)
class Histogram:
    """Counts per binade: ``counts[i]`` values with floor(log2|x|) == ``first + i`` (contiguous, no gaps)."""

    tag: str
    step: int
    first: int
    counts: np.ndarray

    @property
    def edges(self) -> np.ndarray:
        """Bucket edges in log2 units: first, first + 1, ..., first + len(counts)."""
        return np.arange(self.first, self.first + len(self.counts) + 1, dtype=np.float64)


Event = Scalar | Histogram


def tag(*parts: str) -> str:
    """``precprof/<part>/...``; a layer named "" (the root module) is ``(model)``."""
    return "/".join([PREFIX, *(p if p else ROOT_LAYER for p in parts)])


def check_layers(layers: Any, option: str = "layers") -> LayerSelection:
    """``layers`` as given, or a one-line UserError naming the allowed values (``option``: the argument's
    name as the caller gave it)."""
    if isinstance(layers, str):
        if layers in ("auto", "all", "none"):
            return layers
    elif isinstance(layers, (list, tuple)) and all(isinstance(p, str) for p in layers):
        return tuple(layers)
    raise UserError(
        f"{option}={layers!r}: expected 'auto', 'all', 'none' or a list of layer-name patterns "
        "(e.g. ['transformer.h.0.*'])"
    )


class EventStream:
    """Turns rows of the steps, layers and histograms tables into events, a slice at a time.

    ``feed`` may be called with the whole tables of a run, or repeatedly with the rows recorded since the last
    call (the live writer): both give the same events, because the only state carried over is the cumulative
    skipped-step count, whether a loss has been seen and the layer selection.
    """

    def __init__(self, layers: LayerSelection = "auto") -> None:
        self.layers = check_layers(layers)
        self._selected: set[str] | None = None  # decided at the first sampled step
        self._skipped_total = 0
        self._loss_seen = False

    # ------------------------------------------------------------------------------------------ steps
    def resume(self, kept: pd.DataFrame) -> None:
        """Go on from a resumed run's steps rows before its restart: their skipped count, and whether a loss was
        seen (a live stream after a restart started both afresh: "skipped_steps" 0 where export said 2)."""
        if kept.empty:
            return
        self._skipped_total = int(T.flags(kept[T.SKIPPED]).sum()) if T.SKIPPED in kept else 0
        losses = pd.to_numeric(kept[T.LOSS], errors="coerce") if T.LOSS in kept else pd.Series(dtype=float)
        self._loss_seen = self._loss_seen or bool(losses.notna().any())

    def _step_events(self, steps: pd.DataFrame) -> list[Event]:
        out: list[Event] = []
        if steps.empty:
            return out
        steps = steps.sort_values(T.STEP, kind="stable")
        skipped = T.flags(steps[T.SKIPPED]).tolist()
        # a step the loop passed no loss for has none to draw (its null loss is no nan)
        given = (~T.flags(steps[T.NO_LOSS])).tolist() if T.NO_LOSS in steps else [True] * len(steps)
        for rec, skip, has_loss in zip(steps.to_dict("records"), skipped, given, strict=True):
            step = int(rec[T.STEP])
            loss = _float(rec[T.LOSS])
            if not math.isnan(loss):
                self._loss_seen = True
            if self._loss_seen and has_loss:
                out.append(Scalar(tag("loss"), step, loss))
            out.append(Scalar(tag("loss_scale"), step, _float(rec[T.LOSS_SCALE])))
            self._skipped_total += int(skip)
            out.append(Scalar(tag("skipped"), step, float(skip)))
            out.append(Scalar(tag("skipped_steps"), step, float(self._skipped_total)))
            for col, name in ((T.GRAD_NORM, "grad_norm"), (T.TIME_S, "step_time_s")):
                v = _float(rec.get(col))
                if not math.isnan(v):
                    out.append(Scalar(tag(name), step, v))
        return out

    # ----------------------------------------------------------------------------------------- layers
    def _select(self, layers: pd.DataFrame) -> set[str]:
        if self._selected is None:
            first = layers[layers[T.STEP] == layers[T.STEP].min()]
            names = set(T.texts(first[T.MODULE]))
            # a layer's input row ("0:input", T.input_module) is no layer: the report's "layers profiled" leaves
            # it out, and so does the limit (32 nn.Linear counted 33 with the model's input and got no tags)
            real = {n for n in names if not n.endswith(T.INPUT_SUFFIX)}
            if self.layers == "all" or (self.layers == "auto" and len(real) <= AUTO_LAYER_LIMIT):
                self._selected = names
            elif isinstance(self.layers, tuple):
                chosen = {n for n in real if any(fnmatch.fnmatchcase(n, p) for p in self.layers)}
                # an input row goes with its layer (pattern "2" writes "2:input" too), or by its own name
                self._selected = chosen | {
                    n
                    for n in names - real
                    if n.removesuffix(T.INPUT_SUFFIX) in chosen
                    or any(fnmatch.fnmatchcase(n, p) for p in self.layers)
                }
            else:
                self._selected = set()
        return self._selected

    def _layer_events(self, layers: pd.DataFrame, hist: pd.DataFrame) -> list[Event]:
        if layers.empty:
            return []
        layers = layers.assign(
            **{T.MODULE: T.texts(layers[T.MODULE])},
            **_update_squares(layers),
            **_lost_update_estimates(layers),
        )
        selected = self._select(layers)
        out: list[Event] = []
        count_cols = [
            T.NUMEL,
            T.ZEROS,
            T.NAN,
            T.INF,
            *(c for f in WHATIF_FORMATS for c in (T.underflow_col(f), T.overflow_col(f))),
            *LOST_UPDATE_FORMATS.values(),
            *LOST_UPDATE_ESTIMATES.values(),
            UPDATE_SIZE,
            SQ_UPDATE,
            SQ_WEIGHT,
        ]
        per_layer = layers[layers[T.MODULE].isin(selected)]
        for scope_frame, keys in ((layers, [T.STEP, T.TENSOR]), (per_layer, [T.STEP, T.MODULE, T.TENSOR])):
            if scope_frame.empty:
                continue
            sums = scope_frame.groupby(keys, sort=True)[count_cols].sum(min_count=1)
            for key, row in sums.iterrows():
                step, scope, kind = _key(key)
                out.extend(_count_events(int(step), scope, kind, row))
        if not hist.empty:
            hist = hist.assign(**{T.MODULE: T.texts(hist[T.MODULE])})
            out.extend(_hist_events(hist, [T.STEP, T.TENSOR]))
            out.extend(_hist_events(hist[hist[T.MODULE].isin(selected)], [T.STEP, T.MODULE, T.TENSOR]))
        return out

    def feed(
        self,
        steps: pd.DataFrame | None = None,
        layers: pd.DataFrame | None = None,
        histograms: pd.DataFrame | None = None,
    ) -> list[Event]:
        """Events of these rows, ordered by step (step events first, then layer events, each sorted by tag)."""
        events = self._step_events(steps if steps is not None else T.empty("steps"))
        events += self._layer_events(
            layers if layers is not None else T.empty("layers"),
            histograms if histograms is not None else T.empty("histograms"),
        )
        order = {id(e): i for i, e in enumerate(events)}
        return sorted(events, key=lambda e: (e.step, isinstance(e, Histogram), e.tag, order[id(e)]))


def table_events(tables: dict[str, pd.DataFrame], layers: LayerSelection = "auto") -> list[Event]:
    """Every event of a run's four tables (``precprof export``)."""
    return EventStream(layers).feed(tables.get("steps"), tables.get("layers"), tables.get("histograms"))


def by_step(events: Iterable[Event]) -> dict[int, list[Event]]:
    """Events grouped by step, steps ascending (wandb logs one dict per step)."""
    out: dict[int, list[Event]] = {}
    for e in events:
        out.setdefault(e.step, []).append(e)
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------------- helpers
def _float(v: Any) -> float:
    try:
        return math.nan if v is None else float(v)
    except (TypeError, ValueError):
        return math.nan


def _key(key: Any) -> tuple[int, str, str]:
    """(step, scope, kind) of a groupby key over (step, tensor) or (step, module, tensor)."""
    if len(key) == 2:
        return int(key[0]), ALL_LAYERS, str(key[1])
    return int(key[0]), str(key[1]), str(key[2])


def _count_events(step: int, scope: str, kind: str, row: pd.Series) -> list[Event]:
    out: list[Event] = []
    numel = _float(row[T.NUMEL])
    for col in (T.ZEROS, T.NAN, T.INF):
        v = _float(row[col])
        if not math.isnan(v):
            out.append(Scalar(tag(col, scope, kind), step, v))
    if not numel > 0:
        return out
    if kind == T.WEIGHT_UPDATE:
        size = _float(row[UPDATE_SIZE])
        for fmt, col in LOST_UPDATE_ESTIMATES.items():
            v = _float(row[col])
            if not math.isnan(v) and size > 0:
                out.append(Scalar(tag("lost_update", fmt, scope), step, v / size))
        sq_update, sq_weight = _float(row[SQ_UPDATE]), _float(row[SQ_WEIGHT])
        # all-zero sampled weights: no ratio, the update is not small or large against nothing; nor a nan or inf
        # update (the sums hold the finite ones alone)
        nonfinite = _float(row[T.NAN]) + _float(row[T.INF]) > 0
        if sq_weight > 0 and not nonfinite:
            out.append(Scalar(tag("update_ratio", scope), step, math.sqrt(sq_update / sq_weight)))
        return out
    for fmt in WHATIF_FORMATS:
        for what, col in (("underflow", T.underflow_col(fmt)), ("overflow", T.overflow_col(fmt))):
            v = _float(row[col])
            if not math.isnan(v):
                out.append(Scalar(tag(what, fmt, scope, kind), step, v / numel))
    return out


def _update_squares(layers: pd.DataFrame) -> dict[str, pd.Series]:
    """The columns ``SQ_UPDATE`` and ``SQ_WEIGHT``: a weight_update row's ||dw||^2 and ||w||^2 over its sampled
    elements, NaN on other rows, on rows without sizes (a run recorded before them) and where either is."""
    if T.UPDATE_RMS not in layers.columns or T.WEIGHT_RMS not in layers.columns:
        nothing = pd.Series(math.nan, index=layers.index, dtype=float)
        return {SQ_UPDATE: nothing, SQ_WEIGHT: nothing}
    sq_update, sq_weight = (s.reindex(layers.index) for s in T.update_squares(layers))
    keep = sq_update.notna() & sq_weight.notna()
    return {SQ_UPDATE: sq_update.where(keep), SQ_WEIGHT: sq_weight.where(keep)}


def _lost_update_estimates(layers: pd.DataFrame) -> dict[str, pd.Series]:
    """The columns ``LOST_UPDATE_ESTIMATES`` and ``UPDATE_SIZE``: a weight_update row's updates lost in each format
    and its elements, each times how many of its parameter's elements a sampled one stands for
    (``tables.sample_weights``), so that a scope's share is the model's, not the sample's (256 sampled elements of
    a 65,536-element weight beside a 16-element bias's 16 weigh 65,536 to 16); NaN on other rows."""
    nothing = pd.Series(math.nan, index=layers.index, dtype=float)
    if T.NUMEL not in layers.columns:
        return {UPDATE_SIZE: nothing, **{c: nothing for c in LOST_UPDATE_ESTIMATES.values()}}
    w = T.sample_weights(layers).reindex(layers.index)
    out = {UPDATE_SIZE: pd.to_numeric(layers[T.NUMEL], errors="coerce") * w}
    for fmt, col in LOST_UPDATE_FORMATS.items():
        lost = pd.to_numeric(layers[col], errors="coerce") if col in layers.columns else nothing
        out[LOST_UPDATE_ESTIMATES[fmt]] = lost * w
    return out


def _hist_events(hist: pd.DataFrame, keys: list[str]) -> list[Event]:
    out: list[Event] = []
    if hist.empty:
        return out
    sums = hist.groupby([*keys, T.EXPONENT], sort=True)[T.COUNT].sum()
    for key, part in sums.groupby(level=list(range(len(keys))), sort=True):
        step, scope, kind = _key(key)
        exps = part.index.get_level_values(T.EXPONENT).to_numpy(dtype=np.int64)
        first = int(exps.min())
        counts = np.zeros(int(exps.max()) - first + 1, dtype=np.int64)
        np.add.at(counts, exps - first, part.to_numpy(dtype=np.int64))
        out.append(Histogram(tag("exponent", scope, kind), step, first, counts))
    return out
