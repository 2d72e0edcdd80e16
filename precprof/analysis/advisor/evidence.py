"""The run as the rules see it (tables prepared once, module order and types) and the helpers that turn
counts and histograms into shares, scales and words.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar, cast

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis import lost_norm
from precprof.analysis.advisor.config import AdvisorConfig
from precprof.analysis.advisor.model import Finding, Number
from precprof.analysis.advisor.text import _listing, _log2i
from precprof.analysis.fp8_speed import Estimate
from precprof.formats import FP16, NumberFormat
from precprof.hardware import HardwareInfo

_V = TypeVar("_V")
_UNBLOCKED = "layers without the block-format columns"  # _Run.kind()'s copy, in its memo

# summary["model"]["dims"] keys that are tensor dimensions (others, like n_layer, are counts).
_DIM_KEYS = (
    "n_embd",
    "vocab_size",
    "padded_vocab_size",
    "hidden_size",
    "intermediate_size",
    "n_inner",
    "d_model",
    "d_ff",
    "ffn_dim",
    "embed_dim",
    "dim",
)


def _num(x: Any) -> Number:
    """A JSON-safe scalar: numpy scalars to Python, NaN/inf to None."""
    if x is None or isinstance(x, str):
        return x
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    x = float(x)
    return x if math.isfinite(x) else None


def _share(num: float, den: float) -> float | None:
    return float(num) / float(den) if den > 0 else None


def _dtype_has(df: pd.DataFrame, dtype: str) -> pd.Series:
    """Rows whose tensors included ``dtype`` (the dtype column joins several with "|"); decided once per
    distinct value, not per row."""
    col = df[T.DTYPE]
    having = [v for v in col.dropna().unique() if dtype in str(v).split("|")]
    return col.isin(having).astype(bool)


def _ancestors(module: str) -> list[str]:
    """The modules ``module`` is a descendant of: the root "" (of every other module) and each dotted prefix
    ("a" and "a.b" of "a.b.c"; not "a.b" of "a.b:input", a layer's own input row)."""
    if module == "":
        return []
    parts = module.split(".")
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts)))]


def _under_any(module: str, parents: set[str]) -> bool:
    """Whether ``module`` is a descendant of one of ``parents``: a set lookup per ancestor, so that a model of
    tens of thousands of modules (an MoE whose experts are Linear modules) is not compared pair by pair."""
    return any(a in parents for a in _ancestors(module))


def _n_modules(rows: Iterable[str]) -> int:
    """How many modules ``rows`` name: a layer's own input row (``T.input_module``) belongs to the layer that
    reads it, so "fc:input" and "fc" are one module (a count of rows read "303 module(s)" of a model of 303)."""
    return len({m.removesuffix(T.INPUT_SUFFIX) for m in rows})


def _attention_part(part: str) -> bool:
    """Whether one part of a module's name names an attention: it holds "attn" or "attention" (self_attn,
    attention.self, attn.c_attn). How rules/fp8 tells the attention whose score matmuls it does not count and
    rules/nonfinite the attention whose own code made a nan/inf."""
    return "attn" in part.lower() or "attention" in part.lower()


def _owner(module: str, model_inputs: Collection[str] = (), no_forward: Collection[str] = ()) -> str:
    """The module to act on for a row's module name: itself, or, for a layer's own input row
    (``T.input_module``: a function's output), the module whose forward ran that function, the layer's parent,
    or the nearest ancestor above it that has a forward of its own where the parent has none (``no_forward``: an
    ``nn.ModuleList`` or ``nn.ModuleDict``, whose children the forward above it calls; keeping it in fp32 by its
    forward keeps nothing); the layer itself at the top level, where the function ran in the root's forward
    (keeping the root would keep the whole model in fp32; keeping the layer keeps its read of the value in
    fp32), or where the row held the model's own input (``model_inputs``, passed on to it by containers: the
    parent computed nothing, and keeping it would keep every layer under it)."""
    if not module.endswith(T.INPUT_SUFFIX):
        return module
    layer = module[: -len(T.INPUT_SUFFIX)]
    if module in model_inputs:
        return layer
    parent = layer.rpartition(".")[0]
    while parent in no_forward:
        parent = parent.rpartition(".")[0]
    return parent or layer


def _modules_to_keep(
    modules: Iterable[str], model_inputs: Collection[str] = (), no_forward: Collection[str] = ()
) -> list[str]:
    """The modules to run in higher precision for rows whose values call for it: the innermost real modules,
    and for a layer's own input row its owner (``_owner``), whose descendants then need no entry."""
    ms = list(dict.fromkeys(modules))
    owners = list(
        dict.fromkeys(_owner(m, model_inputs, no_forward) for m in ms if m.endswith(T.INPUT_SUFFIX))
    )
    real = _innermost(m for m in ms if not m.endswith(T.INPUT_SUFFIX))
    held = set(owners)
    return list(dict.fromkeys([*owners, *(m for m in real if not _under_any(m, held))]))


def _model_inputs(run: _Run) -> set[str]:
    """The layers' own input rows that held the model's own input (summary capture.model_inputs; none in a run
    recorded before the capture said so)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    found = capture.get("model_inputs") if isinstance(capture, Mapping) else None
    return {str(m) for m in found} if isinstance(found, list) else set()


def _no_forward(run: _Run) -> set[str]:
    """The model's modules with no forward of their own, ModuleLists and ModuleDicts (summary
    capture.modules_without_forward; none in a run recorded before the capture said so)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    found = capture.get("modules_without_forward") if isinstance(capture, Mapping) else None
    return {str(m) for m in found} if isinstance(found, list) else set()


def _normalise_remedy(rows: list[str], model_inputs: Collection[str]) -> str:
    """What to normalise, after "keep these modules in fp32", for ``rows`` whose values go beyond fp16: their
    output, and the model's own input features, which no module computed (the layer that reads them is kept)."""
    own = [m for m in rows if m in model_inputs]
    text = " and normalise their output before the next fp16 matmul" if len(own) < len(rows) else ""
    if own:
        layers = [m.removesuffix(T.INPUT_SUFFIX) for m in own]
        text += (
            f"; {_listing(own, 4)} {'is' if len(own) == 1 else 'are'} the model's own input: keep the "
            f"layer{'' if len(own) == 1 else 's'} reading it ({_listing(layers, 4)}) in fp32, or normalise these "
            "input features"
        )
    return text


def _mask_rows(run: _Run, rows: pd.DataFrame) -> pd.Series:
    """Which of ``rows`` are a mask's output, whose inf the model meant: an activation holding inf and no nan,
    no value but 0 and inf (``torch.full((t, t), -inf).triu(1)``, a ``masked_fill(m, -inf)`` of zeros, fed to
    attention), of a module without parameters (no weight row under it) of no kind the taxonomy knows. An
    overflow leaves finite values beside its inf, and a layer, a norm, an activation function or a dropout
    passes on an inf it read, so none of them counts. A mask with finite values besides (ALiBi's slopes) is not
    told apart."""
    names = T.texts(rows[T.MODULE]).astype(str)  # (rows holding inf: few)
    weighted = set(T.texts(run.kind(T.WEIGHT)[T.MODULE]))
    holders = weighted | {a for m in weighted for a in _ancestors(m)}
    kinds = T.texts(rows[T.MODULE_TYPE]).astype(str).map(taxonomy.kind_of_type)
    inf, nan = rows[T.INF].fillna(0), rows[T.NAN].fillna(0)
    return (
        (rows[T.TENSOR] == T.ACTIVATION)
        & (inf > 0)
        & (nan == 0)
        & (rows[T.ZEROS].fillna(0) + inf == rows[T.NUMEL])
        & ~names.isin(holders)
        & ~names.str.endswith(T.INPUT_SUFFIX)
        & (kinds == taxonomy.OTHER)
    ).astype(bool)


def _innermost(modules: Iterable[str]) -> list[str]:
    """Drop modules that have a descendant in the set: the descendant is where the effect arises."""
    ms = list(dict.fromkeys(modules))
    inner = {a for o in ms for a in _ancestors(o)}
    return [m for m in ms if m not in inner]


@dataclass
class _Run:
    layers: pd.DataFrame
    hist: pd.DataFrame
    steps: pd.DataFrame
    summary: dict[str, Any]
    hw: HardwareInfo
    hw_is_target_preset: bool
    cfg: AdvisorConfig
    order: dict[str, int] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    memory: pd.DataFrame = field(default_factory=pd.DataFrame)
    # the input rows of the norms (``norm_inputs_aside``) and their histograms: only the rules of a
    # norm's input read them (rules/fp32_ops, rules/residual); every other rule reads ``:input`` rows as a matmul's
    norm_inputs: pd.DataFrame = field(default_factory=pd.DataFrame)
    norm_input_hist: pd.DataFrame = field(default_factory=pd.DataFrame)
    # kind() per tuple of kinds; not an init field, so a replace(run, layers=...) starts without it
    _kinds: dict[tuple[str, ...], pd.DataFrame] = field(default_factory=dict, init=False, repr=False)
    # hist_totals(), likewise
    _totals: pd.DataFrame | None = field(default=None, init=False, repr=False)
    # _first_activations(), likewise
    _first: dict[str, tuple[float, float]] | None = field(default=None, init=False, repr=False)
    # memo(): what several rules read of the layers, computed once per run (emptied with _kinds)
    _memo: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False)

    def memo(self, key: Hashable, make: Callable[[], _V]) -> _V:
        """``make()``, computed once per run and ``key`` (which names the function and any argument besides
        the run): what several rules read (the weights without a training gradient, the layers' shapes). It
        lives as long as the run, one ``recommend`` call: a user's two runs in one process never share one.
        Callers never modify what it returns."""
        if key not in self._memo:
            self._memo[key] = make()
        return cast(_V, self._memo[key])

    def sort(self, modules: Iterable[str]) -> list[str]:
        return sorted(set(modules), key=lambda m: (self.order.get(m, 1 << 30), m))

    def kind(self, *kinds: str) -> pd.DataFrame:
        """The layer rows of ``kinds``, without the block-format columns, which only ``layer_blocks`` reads
        (from ``layers``): two thirds of the columns, and each row selection copies every column it keeps.
        Computed once per run; callers never modify it."""
        got = self._kinds.get(kinds)
        if got is None:
            base = self._memo.get(_UNBLOCKED)
            if base is None:
                # copied once, into a few blocks of one dtype each: a row selection of the hundred columns
                # _prepare assigned one by one, each a block of its own, took twice as long, and so did every
                # selection the rules make of what it returned
                block = set(T.BLOCK_COLUMNS)
                base = self._memo[_UNBLOCKED] = self.layers[
                    [c for c in self.layers.columns if c not in block]
                ].copy()
            got = self._kinds[kinds] = base[_rows_of_kinds(base[T.TENSOR], kinds)]
        return got

    def norm_input_totals(self) -> pd.DataFrame:
        """``norm_input_hist`` summed over steps, as ``hist_totals``; computed once per run (and again after the
        rows of a divergence are left out)."""
        return self.memo("norm input totals", lambda: T.sum_histogram_frame(self.norm_input_hist))

    def hist_totals(self) -> pd.DataFrame:
        """The histograms summed over steps (``tables.sum_histogram_frame``: one row per (tensor kind, module,
        param, exponent), as the report's heatmaps read them). Every rule that does not read steps apart reads
        these thousands of rows, not the millions of the per-step table. Computed once per run; callers never
        modify it."""
        if self._totals is None:
            self._totals = T.sum_histogram_frame(self.hist)
        return self._totals

    def exponent_counts(self, *kinds: str) -> pd.Series:
        """Counts per exponent (index, ascending) of the histogram rows of ``kinds``, summed over steps and
        modules."""
        return _exponent_counts(self.hist_totals(), kinds)

    @property
    def run_config(self) -> dict[str, Any]:
        c = self.summary.get(T.SUMMARY_CONFIG) or {}
        return dict(c) if isinstance(c, Mapping) else {}

    @property
    def unsampled_cause(self) -> str | None:
        """Why this run sampled no step, where it did not (the rules say it when they measured nothing): its steps
        all ran while the statistics kernels compiled beside the training (``T.compile_held_steps``, in words),
        "interval 0" (a sampling interval of 0), else None (no cause known, or steps were sampled)."""
        capture = self.summary.get(T.SUMMARY_CAPTURE)
        capture = capture if isinstance(capture, Mapping) else {}
        held = T.compile_held_steps(capture, len(self.steps) or None)
        return held if held is not None else "interval 0" if capture.get("sample_every") == 0 else None

    @property
    def precision(self) -> str:
        """The precision mode the run asked for ("" for an own loop, which asks nothing)."""
        return str(self.run_config.get("precision") or "").lower()

    @property
    def precision_trained(self) -> str:
        """The mode it trained in (``taxonomy.precision_trained``): the one the profiler saw it train in
        (``Profiler.precision_seen``) where it asked for none or the framework trained in another (accelerate's fp16
        on a CPU trains in fp32), else the one it asked for."""
        return taxonomy.precision_trained(self.summary, self.precision).lower()

    @property
    def fp8_scaling(self) -> dict[str, str]:
        """Per torchao Float8Linear layer of the run, the scaling its recipe ran (``capture.fp8_recipe``:
        "tensorwise", "rowwise" or "mixed"); {} for a run without any, or recorded before the recipe was."""
        return {
            str(m): str(r.get("scaling", ""))
            for r in self._recipes("fp8_recipe")
            for m in r.get("layers") or []
        }

    @property
    def fp8_running(self) -> dict[str, str]:
        """Per linear layer of the run that trains with torchao's float8 training, how: "Float8Linear" (the
        module, ``convert_to_float8_training``'s) or "quantize_" (an nn.Linear whose weight ``quantize_`` made an
        FP8 training weight: a recipe of ``capture.fp8_recipe`` naming a ``weight_type``); {} for a run without
        any. A Float8Linear recorded before the recipe was is found by its module type."""
        out = {m: "Float8Linear" for m, t in self.types.items() if str(t) in taxonomy.FP8_MODULE_TYPES}
        for r in self._recipes("fp8_recipe"):
            for m in r.get("layers") or []:
                out[str(m)] = "quantize_" if r.get("weight_type") else "Float8Linear"
        return out

    @property
    def block_running(self) -> dict[str, str]:
        """Per layer of the run that runs torchao's MX layers, its block format (``capture.block_recipe``:
        "mxfp8"); {} for a run without any, or recorded before the recipe was."""
        return {
            str(m): str(r.get("format", ""))
            for r in self._recipes("block_recipe")
            for m in r.get("layers") or []
        }

    @property
    def wrapped_weight_layers(self) -> list[str]:
        """The layers of ``running_formats`` whose weight torchao's ``quantize_`` made a training weight (a recipe
        of ``capture.fp8_recipe`` or ``capture.block_recipe`` naming a ``weight_type``: the module stays an
        nn.Linear), in forward order."""
        return self.sort(
            str(m)
            for key in ("fp8_recipe", "block_recipe")
            for r in self._recipes(key)
            if r.get("weight_type")
            for m in r.get("layers") or []
        )

    def _recipes(self, key: str) -> list[Mapping[str, Any]]:
        """The recipes the capture recorded under ``key`` ("fp8_recipe", "block_recipe": one mapping per recipe,
        with the ``layers`` that ran it); [] for a run without any, or one recorded before they were (an older
        run's ``fp8_recipe`` is the what-if's recipe in words, no list)."""
        capture = self.summary.get(T.SUMMARY_CAPTURE) or {}
        recipes = capture.get(key) if isinstance(capture, Mapping) else None
        return [r for r in recipes if isinstance(r, Mapping)] if isinstance(recipes, list) else []

    @property
    def running_formats(self) -> dict[str, str]:
        """What each linear layer of the run already trains in, in forward order: its block format (torchao's MX
        and NVFP4 layers, ``block_running``), or "fp8" (torchao's float8 training, ``fp8_running``); layers of
        neither are absent."""
        running = {**dict.fromkeys(self.fp8_running, "fp8"), **self.block_running}
        return {m: running[m] for m in self.sort(running)}

    @property
    def autocast(self) -> Mapping[str, Any]:
        """What the hooks saw of autocast on the first recorded forward (``capture.autocast``: ``enabled``,
        ``dtype``, ``device_type``); {} when the summary has none, or null (no recorded forward pass saw it:
        nothing sampled), which is neither on nor off (``enabled`` None; a rule for "off" asks ``is False``)."""
        capture = self.summary.get(T.SUMMARY_CAPTURE) or {}
        seen = capture.get("autocast") if isinstance(capture, Mapping) else None
        return seen if isinstance(seen, Mapping) else {}


_NUMERIC_LAYER_COLS = (
    T.STEP,
    T.ORDER,
    T.CALLS,
    *T.COUNT_COLUMNS,
    T.ABSMAX,
    T.ABSMIN,
    T.SCALE,
    T.LOST_UPDATE_BF16,
    T.LOST_UPDATE_FP16,
    T.LOST_UPDATE_HELD,
)


_WHATIF = frozenset(T.WHATIF_COUNT_COLUMNS)


def _flag(v: Any) -> bool:
    # None, NaN and pd.NA are "not recorded": False (bool(nan) would be True).
    return False if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else bool(v)


def _norm_inputs_from(run: _Run) -> dict[str, list[str]]:
    """Per norm whose input row the run read, the captured modules whose outputs it received (summary
    capture.norm_inputs_from); a norm fed only sums no module returns (a residual stream) is not among them."""
    got = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("norm_inputs_from")
    return {str(k): [str(m) for m in v] for k, v in got.items()} if isinstance(got, dict) else {}


def norm_inputs_aside(
    layers: pd.DataFrame, hist: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``layers`` and ``hist`` (as ``_prepare`` made them) without the input rows of norms (``T.input_module`` of a
    module whose type is a norm: ``capture.plan.reads_norm_input``), and those rows apart:
    ``(layers, hist, norm input layers, norm input histograms)``. The rules read an ``:input`` row as what a matmul
    read (autocast's casts, the block and FP8 what-ifs, the kept gradients), which a norm's input is not."""
    names = layers[T.MODULE]
    is_input = names.str.endswith(T.INPUT_SUFFIX)
    if not is_input.any():
        return layers, hist, layers.iloc[:0], hist.iloc[:0]
    own = layers[~is_input]
    types = own.groupby(own[T.MODULE])[T.MODULE_TYPE].first()
    norms = {
        T.input_module(str(m)) for m, t in types.items() if taxonomy.kind_of_type(str(t)) == taxonomy.NORM
    }
    aside = names.isin(norms)
    if not aside.any():
        return layers, hist, layers.iloc[:0], hist.iloc[:0]
    h_aside = hist[T.MODULE].isin(norms)
    return (
        layers[~aside].reset_index(drop=True),
        hist[~h_aside].reset_index(drop=True),
        layers[aside].reset_index(drop=True),
        hist[h_aside].reset_index(drop=True),
    )


def _prepare(tables: Mapping[str, pd.DataFrame]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The three tables the rules read, normalised so that no rule has to guard against them.

    Invariants: every column of the schema is present; every layers and steps row has a numeric step (a row
    without one cannot be dated, and is dropped); counts are numbers (missing: 0; a ``weight_update`` row's
    what-if counts, not measured, stay NaN), ``scale`` is a number (missing: 1), the text columns are strings;
    the steps table is sorted by step and its ``skipped`` column is plain bool (missing: False).
    """
    # the text columns as categoricals (``T.as_categorical``, as ``precprof report`` reads a run directory): the
    # tables a training's end advises from hold one Python string a row, which every rule's row lookup hashed
    # again (a 24-layer model's 400 sampled steps, 5.9M histogram rows: advised in 7.4 s from text, 5.5 s so)
    tables = T.as_categorical(tables)
    # shallow copies: frame() may add missing columns, which must not reach the caller's tables; every column
    # changed below is assigned anew (a deep copy of a thousand sampled steps' rows took seconds)
    layers = T.frame("layers", _table(tables, "layers").copy(deep=False))
    # (a column already as it should be is not assigned again: each assignment makes a block of its own, and a
    # table of a hundred blocks is slow to select rows from; a dropna of nothing copied every row)
    for c in _NUMERIC_LAYER_COLS:
        col = layers[c]
        if (got := _numeric(col)) is not col:
            layers[c] = got
    if layers[T.STEP].hasnans:
        layers = layers.dropna(subset=[T.STEP])
    layers = layers.reset_index(drop=True)
    # (a weight_update row's what-if counts stay NaN: not measured, ``T.WHATIF_COUNT_COLUMNS``)
    measured = T.texts(layers[T.TENSOR]) != T.WEIGHT_UPDATE
    for c in T.COUNT_COLUMNS:
        if layers[c].hasnans:
            layers[c] = (
                layers[c].where(layers[c].notna() | ~measured, 0) if c in _WHATIF else layers[c].fillna(0)
            )
    if layers[T.SCALE].hasnans:
        layers[T.SCALE] = layers[T.SCALE].fillna(1.0)
    for c in (T.MODULE, T.MODULE_TYPE, T.TENSOR, T.PARAM, T.DTYPE):
        layers[c] = T.texts(layers[c])
    hist = T.frame("histograms", _table(tables, "histograms").copy(deep=False))
    for c in (T.STEP, T.EXPONENT, T.COUNT):
        hist[c] = _numeric(hist[c])
    if hist[T.EXPONENT].hasnans or hist[T.COUNT].hasnans:
        hist = hist.dropna(subset=[T.EXPONENT, T.COUNT])
    if hist[T.MODULE].isna().any():  # as in layers, and as the totals key it: a row without a module is ""
        hist[T.MODULE] = T.texts(hist[T.MODULE])
    steps = T.frame("steps", _table(tables, "steps").copy())
    for c in (T.STEP, T.LOSS, T.LOSS_SCALE, T.GRAD_NORM):
        steps[c] = pd.to_numeric(steps[c], errors="coerce")
    steps = steps.dropna(subset=[T.STEP])
    steps[T.SKIPPED] = steps[T.SKIPPED].map(_flag).astype(bool)
    steps = steps.sort_values(T.STEP, kind="stable").reset_index(drop=True)
    return layers, hist, steps


def _table(tables: Mapping[str, pd.DataFrame], name: str) -> pd.DataFrame:
    """Table ``name`` of ``tables``, an empty one where it is absent (built only then)."""
    return tables[name] if name in tables else T.empty(name)


def _numeric(col: pd.Series) -> pd.Series:
    """``col`` as numbers (a text or missing value: NaN); a numeric column as it is."""
    if pd.api.types.is_numeric_dtype(col.dtype) and not pd.api.types.is_bool_dtype(col.dtype):
        return col
    return pd.to_numeric(col, errors="coerce")


def _group_sum(codes: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The groups present among integer ``codes`` in [0, n) and the sum of ``values`` in each (a groupby's
    result, by two bincounts)."""
    present = np.flatnonzero(np.bincount(codes, minlength=n))
    return present, np.bincount(codes, weights=values, minlength=n)[present]


def _nonzero(df: pd.DataFrame) -> float:
    """Finite nonzero values in the rows of ``df`` (the denominator of every share)."""
    return float((df[T.NUMEL] - df[T.ZEROS] - df[T.NAN] - df[T.INF]).clip(lower=0).sum())


def _rows_of_kinds(tensor: pd.Series, kinds: Iterable[str]) -> np.ndarray:
    """Boolean mask of the rows whose tensor kind is one of ``kinds`` (on a categorical, by its codes)."""
    kinds = tuple(kinds)
    if isinstance(tensor.dtype, pd.CategoricalDtype):
        wanted = [i for i, c in enumerate(tensor.cat.categories) if c in kinds]
        return np.isin(tensor.cat.codes.to_numpy(), wanted)
    return tensor.isin(kinds).to_numpy()


def _text_codes(col: pd.Series, cats: pd.Index) -> np.ndarray:
    """Each value's position in ``cats`` (-1 where absent), a missing text read as "": a categorical column by
    its few categories (millions of rows are never turned into strings)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        names = ["" if c is None else str(c) for c in col.cat.categories] + [""]  # code -1: missing
        return cats.get_indexer(pd.Index(names, dtype=object))[col.cat.codes.to_numpy().astype(np.int64)]
    # a text column by its distinct values too (factorized: the histograms' millions of rows are hashed once,
    # not each turned into a Python string and looked up)
    codes, distinct = pd.factorize(col)
    names = [*(str(v) for v in distinct), ""]  # as ``T.texts`` writes them (code -1: missing)
    return cats.get_indexer(pd.Index(names, dtype=object))[codes.astype(np.int64)]


def _row_index(hist: pd.DataFrame, rows: pd.DataFrame) -> np.ndarray:
    """For each histogram row, the position in ``rows`` of its (step, module, tensor, param) tensor; -1 where
    ``rows`` has none (a repeated key in ``rows``: its first). Integer keys throughout: a join of the
    histograms' millions of rows by text tuples took seconds."""
    if hist.empty or rows.empty:
        return np.full(len(hist), -1, dtype=np.int64)
    step_r = pd.to_numeric(rows[T.STEP], errors="coerce").to_numpy(dtype=float)
    steps = pd.Index(pd.unique(step_r))
    key_r = steps.get_indexer(step_r).astype(np.int64)
    key_h = steps.get_indexer(pd.to_numeric(hist[T.STEP], errors="coerce").to_numpy(dtype=float)).astype(
        np.int64
    )
    ok = key_h >= 0
    for k in (T.MODULE, T.TENSOR, T.PARAM):
        # the rows' texts numbered in order of first appearance, and the histograms' by them
        code_r, distinct = pd.factorize(T.texts(rows[k]).astype(str).to_numpy(dtype=object))
        cats = pd.Index(distinct, dtype=object)
        code_h = _text_codes(hist[k], cats)
        ok &= code_h >= 0
        key_r = key_r * len(cats) + code_r
        key_h = key_h * len(cats) + np.where(code_h >= 0, code_h, 0)
    index = pd.Index(key_r)
    first = ~index.duplicated()
    pos = np.flatnonzero(first)
    at = pd.Index(key_r[first]).get_indexer(key_h)
    return np.where(ok & (at >= 0), pos[np.clip(at, 0, None)], -1)


def _exponent_counts(hist: pd.DataFrame, kinds: Iterable[str]) -> pd.Series:
    """Counts per exponent (index, ascending) of the rows of ``kinds``, summed over steps and modules."""
    sel = _rows_of_kinds(hist[T.TENSOR], kinds)
    e = hist[T.EXPONENT].to_numpy()[sel]
    if not len(e):
        return pd.Series(dtype=float, index=pd.Index([], dtype="int64", name=T.EXPONENT), name=T.COUNT)
    e = e.astype(np.int64)
    e0 = int(e.min())
    counts = hist[T.COUNT].to_numpy()[sel].astype(float)  # selected first: one conversion of the rows kept
    present, sums = _group_sum(e - e0, counts, int(e.max()) - e0 + 1)
    return pd.Series(sums, index=pd.Index(present + e0, name=T.EXPONENT), name=T.COUNT)


def _shifted_underflow(counts: pd.Series, fmt: NumberFormat, k: int) -> tuple[float, float]:
    """(values that surely underflow ``fmt`` at scale 2^k, values in the boundary bin) from an exponent histogram.

    A bin e lies in [2^(e+k), 2^(e+k+1)) after scaling: it vanishes entirely when 2^(e+k+1) <= underflow_max.
    In the next bin up only values exactly equal to underflow_max vanish (round-to-nearest-even to 0).
    """
    if counts.empty:
        return 0.0, 0.0
    lim = _log2i(fmt.underflow_max)  # underflow_max is a power of two for every format
    e = counts.index.to_numpy()
    sure = float(counts[(e + k + 1) <= lim].sum())
    boundary = float(counts[(e + k) == lim].sum())
    return sure, boundary


def _lost_norm_share(hist: pd.DataFrame, fmt: NumberFormat, k: int) -> pd.Series:
    """Per module: an upper bound of the share of the L2 norm held by the values that underflow ``fmt`` at
    scale 2^k (``precprof.analysis.lost_norm``, the bound every what-if is judged by): the binades wholly at
    or below fmt.underflow_max / 2^k, each value at its binade's upper edge against the others at their lower
    edges. Values lying exactly on the limit, which a histogram cannot tell apart, are not counted (the fp16 rule
    reports them apart)."""
    if hist.empty:
        return pd.Series(dtype=float)
    modules = hist[T.MODULE]
    if not isinstance(modules.dtype, pd.CategoricalDtype):
        modules = modules.astype("category")
    names = np.asarray(modules.cat.categories, dtype=object)
    codes = modules.cat.codes.to_numpy().astype(np.int64)  # -1: a row without a module belongs to none
    limit = np.full(len(names), float(_log2i(fmt.underflow_max) - k))
    share = lost_norm.lost_share_bound(hist[T.EXPONENT].to_numpy(), hist[T.COUNT].to_numpy(), codes, limit)
    by = pd.Series(share, index=pd.Index(names, name=T.MODULE))
    return by.dropna().sort_index()


def _shifted_overflow(counts: pd.Series, fmt: NumberFormat, k: int) -> float:
    """Values that surely overflow ``fmt`` at scale 2^k (whole bins at or above overflow_min)."""
    if counts.empty:
        return 0.0
    e = counts.index.to_numpy()
    return float(counts[(2.0 ** (e + k)) >= fmt.overflow_min].sum())


@dataclass
class _Plan:
    """Intermediate results the decision needs."""

    findings: list[Finding] = field(default_factory=list)
    loss_scale_log2: int = 16
    grad_absmax: float | None = None
    # grad_absmax is a lower bound: it comes from a step where some gradient was inf or nan (fp16 overflow at
    # the scale in effect), larger than every step without one measured; the loss scale is then the most a start
    # can be, and whether it avoids overflow the run cannot tell
    grad_absmax_bound: bool = False
    grad_absmax_clean: float | None = (
        None  # the largest gradient of the steps without inf or nan (None: no such)
    )
    # grad_absmax leaves out gradients of the layers keep_fp16 holds in fp32, which stay fp32 under autocast
    grad_absmax_kept_left_out: bool = False
    # ... and those of the modules autocast computed in fp32 on its own (a LayerNorm's weight gradient)
    grad_absmax_fp32_left_out: bool = False
    underflow_now: float | None = None
    underflow_at_1: float | None = None
    underflow_at_rec: float | None = None
    keep_fp16: list[str] = field(default_factory=list)
    # element-wise modules whose activations called for fp32 under fp16, each with the layer kept in its place
    # (None: the run does not tell which feeds it)
    fp16_passed_on: dict[str, str | None] = field(default_factory=dict)
    # matmul layers in keep_fp16 for the activations they cast to fp16 and flush there (fp16_activation_underflow)
    fp16_flush_kept: list[str] = field(default_factory=list)
    # matmul layers in keep_fp16 for an fp32 input beyond 65504 they cast to fp16 (a norm's output autocast leaves fp32)
    fp16_cast_kept: list[str] = field(default_factory=list)
    # ... for an fp32 input within 2x of 65504 (fp16_activation_near_overflow), not beyond it
    fp16_cast_near_kept: list[str] = field(default_factory=list)
    # the recorded modules whose backward writes zeros (a ReLU, a dropout) after the fp16 activation gradients
    # whose zeros fp16_gradient_underflow does not count: none, and a mask there is a function precprof does not see
    fp16_masks: list[str] = field(default_factory=list)
    # norms whose fp16 x.pow(2) overflowed (fp16_norm_overflow) -> the share of their output values that were 0
    fp16_norm_overflow: dict[str, float] = field(default_factory=dict)
    # modules recorded before such a norm whose fp16 activation gradients held no nonzero value, as many zeros as
    # the norm's zeroed output accounts for (its backward passes back 0 through a row it zeroed) -> the norm:
    # no loss scale changes those zeros, and fp16_gradient_underflow does not count them as flushes
    fp16_norm_starved: dict[str, str] = field(default_factory=dict)
    # matmul layers the run kept in fp32 under autocast (or held in fp32 in an fp16-pure run: kept_fp32_pure):
    # those fp16 still needs there (in keep_fp16 too), and those whose values fit fp16 (rules/kept)
    kept_fp32: list[str] = field(default_factory=list)
    released_fp32: list[str] = field(default_factory=list)
    kept_fp32_pure: bool = False
    # modules the guide keeps in fp32 whatever the format (norms, softmax, losses found in 16-bit)
    keep_fp32_ops: list[str] = field(default_factory=list)
    fp16_block: list[str] = field(default_factory=list)
    # the largest safe fp16 loss scale is below the run's and loses more gradient values than the run did
    fp16_scale_raises_underflow: bool = False
    bf16_block: list[str] = field(default_factory=list)
    keep_bf16: list[str] = field(default_factory=list)
    # weights this run holds in bf16 lose their updates there (bf16_lost_updates, critical): the modules held so
    # where only some are (a bf16 layer in an fp32 model; [] where the run holds its weights in bf16), and the
    # share lost. A bf16 verdict is then bf16 for compute, fp32 for the master weights, and says so
    bf16_held_lost: tuple[list[str], float] | None = None
    fp8_eligible: list[str] = field(default_factory=list)
    fp8_checked: int = 0
    # the linear layers the run already trains in an MX format (torchao's MX training): no FP8 candidates
    fp8_block_running: list[str] = field(default_factory=list)
    # why FP8 eligibility was not judged at all ("" when it was): no linear layer's shape was recorded
    fp8_unjudged: str = ""
    # Why each linear layer that is not FP8-eligible is not (module -> reason), and the share of the linear
    # layers' matmul FLOPs (2 x in x out per token and call, over the layers of known shape) the eligible
    # layers carry: the decision needs both.
    fp8_why_not: dict[str, str] = field(default_factory=dict)
    fp8_shape_blocked: set[str] = field(default_factory=set)  # those whose reason is their shape, not numbers
    fp8_tokens: dict[str, int] = field(default_factory=dict)  # those held back by their tokens per call alone
    fp8_tokens_vary: bool = (
        False  # ... at a later sampled step than the first (the tokens vary from step to step)
    )
    # those held back by calls of different tokens on a step (module -> (step, calls, their tokens in all, the
    # largest number dividing each call's)): no call's count need be that divisor
    fp8_uneven: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    # routed experts held back by the tokens routed to them (module -> tokens per call): no batch size lifts it
    fp8_expert_tokens: dict[str, int] = field(default_factory=dict)
    fp8_flops_share: float | None = None
    # steps whose gradients held nan/inf at the loss scale the scaler then skipped: left out of FP8's judgement
    fp8_scaler_nonfinite_steps: int = 0
    fp8_experts_share: float | None = None  # a mixture of experts' expert GEMMs: counted, left in bf16
    fp8_experts_uncounted: list[str] = field(default_factory=list)  # banks whose routed rows are unknown
    # nn.MultiheadAttention's projections, recurrent layers, convolutions: counted, left in bf16 (their share,
    # and whose they are, in words: "the attention projections' and the convolutions'")
    fp8_others_share: float | None = None
    fp8_others_whose: str = ""
    # the attention modules whose score matmuls neither the FLOPs share nor the speed estimate counts (computed
    # outside nn.MultiheadAttention, on sequence lengths the run does not record)
    fp8_scores_uncounted: list[str] = field(default_factory=list)
    # FP8's estimated speed on the eligible layers' GEMM shapes (analysis.fp8_speed.Estimate; None without
    # eligible layers of known shape and tokens)
    fp8_speed: Estimate | None = None
    # ... what its GEMMs are, in words (Estimate.explain): the converted ones, those left in bf16
    fp8_speed_words: tuple[str, str] = ("", "")
    # ... the GEMMs of a call each linear layer runs, of the three the estimate's layer tables timed: 2 frozen (no
    # weight gradient), 1 without an output gradient either, else 3
    fp8_gemms_run: dict[str, int] = field(default_factory=dict)
    growth_interval: int = 2000
    matmul_layers: list[str] = field(default_factory=list)
    n_params: int | None = None
    # Skipped steps that came with nan/inf from the model itself (the non-finite rule's verdict): no loss
    # scale would have saved them.
    model_skips: set[int] = field(default_factory=set)
    # (first, last) step of the non-finite loss the run ended with (rules/nonfinite._rule_diverged)
    diverged: tuple[int, int] | None = None
    diverged_sampled_before: int = 0  # sampled steps before it, which the format rules then read
    # the activation and weight rows of the first divergent step, which the format rules do not read but for the
    # fp16 overflow that began it (None: the run did not diverge, or no step was sampled before it)
    diverged_forward: pd.DataFrame | None = None
    skipped_after_divergence: int = 0  # steps the scaler skipped from the divergence on (the loss non-finite)
    # the optimizer steps a loss scaler skipped in a run none of whose steps went through (0: some did): its
    # model never trained (rules/scaler.py)
    never_stepped: int = 0
    never_stepped_from_model: int = (
        0  # ... of which came with nan/inf from the model itself (no scale avoids them)
    )
    # whether any gradient was recorded (a sampled step with a backward pass): without one, nothing was measured
    # against a format, and no reason may say it was
    gradients_measured: bool = True
    # whether a layer's output or a gradient was recorded: without one no format is "what the measurements
    # allow" (a run whose first forward pass failed may have recorded a weight and the model's input, no more)
    measured: bool = True
    weights_only: bool = False  # rows were recorded, but only weights and the model's inputs
    # gradients were recorded, but not one finite nonzero value among them (every one zero, inf or nan): they
    # place nothing against a format's range
    gradients_valueless: bool = False
    # every sampled step's forward pass was non-finite: its gradients are of a broken computation
    forward_broken: bool = False

    @property
    def gradients_usable(self) -> bool:
        """Whether the gradients recorded say anything of a format's range: some were, with a finite nonzero
        value among them, from a forward pass that was not already broken."""
        return self.gradients_measured and not self.gradients_valueless and not self.forward_broken

    def add(self, f: Finding) -> None:
        self.findings.append(f)


def _skipped_steps(steps: pd.DataFrame, scaled: bool = False) -> set[int]:
    """The steps whose optimizer step was skipped; with ``scaled``, only those a loss scaler skipped at a scale
    above 1 (their gradients' inf and nan are the scale's)."""
    if steps.empty or T.SKIPPED not in steps or T.STEP not in steps:
        return set()
    keep = T.flags(steps[T.SKIPPED]).to_numpy().copy()
    if scaled:
        if T.LOSS_SCALE not in steps:
            return set()
        keep &= (pd.to_numeric(steps[T.LOSS_SCALE], errors="coerce").fillna(1.0) > 1.0).to_numpy()
    return {int(s) for s in steps[keep][T.STEP]}


def _skipped_optimizers(run: _Run) -> tuple[list[dict[str, Any]], dict[int, list[int]]]:
    """With several optimizers under one loss scaler: each one's class and modules (``capture.optimizer.each``),
    and per step the places of those the scaler skipped (``T.SKIPPED_OPTIMIZERS``); ([], {}) otherwise."""
    each = ((run.summary.get(T.SUMMARY_CAPTURE) or {}).get("optimizer") or {}).get("each")
    steps = run.steps
    if not isinstance(each, list) or len(each) < 2 or T.SKIPPED_OPTIMIZERS not in steps or steps.empty:
        return [], {}
    out: dict[int, list[int]] = {}
    for step, text in zip(steps[T.STEP], steps[T.SKIPPED_OPTIMIZERS], strict=True):
        places = [k for k in T.optimizer_places(text) if k < len(each)]
        if places:
            out[int(step)] = places
    return [e if isinstance(e, dict) else {} for e in each], out


def _optimizer_of(module: str, each: list[dict[str, Any]]) -> int | None:
    """The place of the optimizer whose parameters ``module`` holds; a module without parameters (an activation)
    goes with the optimizer of the modules nearest it in the tree (None where none or several are)."""
    best, at = -1, set()
    for k, e in enumerate(each):
        for m in e.get("modules") or ():
            if m == module:
                return k
            a, b = m.split("."), module.split(".")
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            if n > best:
                best, at = n, {k}
            elif n == best:
                at.add(k)
    return at.pop() if best > 0 and len(at) == 1 else None


def _optimizer_named(each: list[dict[str, Any]], k: int) -> str:
    """Optimizer ``k`` of ``each`` (``_skipped_optimizers``) in words: "optimizer 0 (Adam: D.0, D.2)"."""
    e = each[k] if 0 <= k < len(each) else {}
    mods = [T.module_in_prose(str(m)) for m in e.get("modules") or ()]
    held = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
    return f"optimizer {k} ({e.get('class') or '?'}{': ' + held if held else ''})"


def _skipped_rows(run: _Run, frame: pd.DataFrame, scaled: bool = False) -> pd.Series:
    """The rows of ``frame`` (layer or histogram rows) of an optimizer step the loss scaler skipped: every row of
    a skipped step (``_skipped_steps``), but with several optimizers under the scaler, on a step it skipped some
    of them, only the rows of those optimizers' modules (the others' stepped: their gradients trained)."""
    skipped = run.memo(("skipped_steps", scaled), lambda: frozenset(_skipped_steps(run.steps, scaled)))
    if frame.empty or not skipped:
        return pd.Series(False, index=frame.index)
    rows = frame[T.STEP].isin(skipped)
    each, partial = _skipped_optimizers(run)
    if not partial:
        return rows
    owners = {m: _optimizer_of(m, each) for m in T.texts(frame[T.MODULE]).unique()}
    for step, places in partial.items():
        if step not in skipped:
            continue
        at = frame[T.STEP] == step
        held = {m for m, k in owners.items() if k is None or k in places}
        rows &= ~at | T.texts(frame[T.MODULE]).isin(held)
    return rows


def _static_scale(steps: pd.DataFrame) -> bool:
    """Whether the run's loss scaler kept its scale after the steps it skipped (a static scale: GradScaler with
    a back-off factor of 1, ``--loss-scale static:N``): a dynamic one lowers it after every skip. False when no
    skipped step is followed by another."""
    if steps.empty or T.LOSS_SCALE not in steps:
        return False
    st = steps.sort_values(T.STEP)
    scale = pd.to_numeric(st[T.LOSS_SCALE], errors="coerce").to_numpy(dtype=float)
    skipped = T.flags(st[T.SKIPPED]).to_numpy()[:-1]
    if not skipped.any():
        return False
    return bool(np.array_equal(scale[1:][skipped], scale[:-1][skipped]))


def _updated_steps(run: _Run) -> set[int]:
    """The sampled steps whose optimizer step was read (``weight_update`` rows)."""
    layers = run.layers
    if layers.empty:
        return set()
    return set(layers.loc[layers[T.TENSOR] == T.WEIGHT_UPDATE, T.STEP].astype(int))


def _steps_without_update(run: _Run) -> tuple[list[int], list[int]]:
    """The sampled steps with weight gradients whose optimizer did not step, and every sampled step with weight
    gradients that could tell, in step order: only in a run whose optimizer steps were seen (``weight_update``
    rows on some sampled step; where none was read, the sampled steps the capture saw read weight gradients and
    no optimizer step, ``capture.loop_order``'s ``T.LOOP_NOT_STEPPED``), from the first step its updates were read (``capture.updates_from``: an
    optimizer given later); a step the loss scaler skipped (no optimizer step by design) or a crash cut off is
    no such step. ``prof.step()`` called once per micro-batch makes the micro-batches such steps. Computed once
    per run (new lists each call)."""
    idle, told = run.memo("steps_without_update", lambda: _without_update(run))
    return list(idle), list(told)


def _without_update(run: _Run) -> tuple[list[int], list[int]]:
    layers = run.layers
    if layers.empty:
        return [], []
    updated = _updated_steps(run)
    with_grads = set(layers.loc[layers[T.TENSOR] == T.WEIGHT_GRAD, T.STEP].astype(int))
    if not updated:
        # no update read on any sampled step: those the capture saw read weight gradients and no optimizer step
        # (``T.LOOP_NOT_STEPPED``; every sampled step a micro-batch between optimizer steps) tell; else nothing
        # does (no optimizer given, its updates not sampled, a run recorded before the capture said)
        at, count = _not_stepped(run)
        if not at:
            return [], []
        if count > len(at):  # past the steps listed, whether the optimizer stepped is not known
            with_grads = {s for s in with_grads if s <= at[-1]}
        updated = with_grads - set(at)
    steps = run.steps
    excused: set[int] = set()
    for col in (T.SKIPPED, T.CUT_OFF):
        if not steps.empty and col in steps:
            excused |= set(steps.loc[T.flags(steps[col]), T.STEP].astype(int))
    since = ((run.summary.get(T.SUMMARY_CAPTURE) or {}).get("updates_from") or {}).get("step")
    told = sorted(s for s in with_grads - excused if not isinstance(since, int) or s >= since)
    return [s for s in told if s not in updated], told


def _not_stepped(run: _Run) -> tuple[list[int], int]:
    """The sampled steps the capture saw read weight gradients and no optimizer step (``capture.loop_order``'s
    ``T.LOOP_NOT_STEPPED``), listed (the first ``AT_MAX``), and how many there were."""
    order = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("loop_order") or {}
    entry = order.get(T.LOOP_NOT_STEPPED) if isinstance(order, Mapping) else None
    if not isinstance(entry, Mapping):
        return [], 0
    at = sorted(int(s) for s in entry.get("at") or [] if isinstance(s, int))
    steps = entry.get("steps")
    return at, max(steps, len(at)) if isinstance(steps, int) else len(at)


def _unfollowed_steps(run: _Run) -> tuple[list[int], list[str], int]:
    """The sampled steps in which an optimizer the Profiler was not given stepped the model's parameters (the
    capture's ``loop_order``, ``T.LOOP_NOT_FOLLOWED``: a new optimizer made mid-run without
    ``prof.use_optimizer``), listed (the first ``AT_MAX``), its classes, and how many there were: the entry's
    ``steps``, more than those listed past ``AT_MAX`` (a run recorded without it: those listed)."""
    order = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("loop_order") or {}
    entry = order.get(T.LOOP_NOT_FOLLOWED) if isinstance(order, Mapping) else None
    if not isinstance(entry, Mapping):
        return [], [], 0
    at = sorted(int(s) for s in entry.get("at") or [] if isinstance(s, int))
    classes = [str(c) for c in entry.get("optimizers") or []]
    steps = entry.get("steps")
    return at, classes, max(steps, len(at)) if isinstance(steps, int) else len(at)


def _matmul_leaves(run: _Run) -> list[str]:
    acts = run.kind(T.ACTIVATION)
    mods = [m for m in acts[T.MODULE].unique() if taxonomy.is_matmul_type(run.types.get(m, ""))]
    return run.sort(_innermost(mods))


def _grad_absmax(run: _Run) -> tuple[float | None, float | None, float | None]:
    """(largest finite unscaled gradient magnitude, lower bound implied by fp16 gradients that became inf,
    largest finite one of the steps none of whose gradients was inf or nan).

    An fp16 gradient that is inf at loss scale s was at least 65520/s before scaling. On a step where some
    gradient was inf or nan, the finite ones are lower bounds too: only the last figure is a step's measured
    maximum.
    """
    g = run.kind(*T.GRADIENT_KINDS)
    if g.empty:
        return None, None, None
    absmax = pd.to_numeric(g[T.ABSMAX], errors="coerce")
    finite = absmax[(absmax > 0) & np.isfinite(absmax.to_numpy(dtype=float))]
    amax = float(finite.max()) if not finite.empty else None
    infs = g[(g[T.INF] > 0) & _dtype_has(g, "float16") & (g[T.SCALE] > 0)]
    bound = float((FP16.overflow_min / infs[T.SCALE]).max()) if not infs.empty else None
    # a step whose gradients held inf or nan (an overflow's inf turns to nan in the matmuls after it)
    bad = (pd.to_numeric(g[T.INF], errors="coerce") > 0) | (pd.to_numeric(g[T.NAN], errors="coerce") > 0)
    overflowed = set(g.loc[bad, T.STEP])
    clean = finite[~g.loc[finite.index, T.STEP].isin(overflowed)]
    return amax, bound, (float(clean.max()) if not clean.empty else None)


def _tokens_per_call(run: _Run) -> int | None:
    """Rows of a linear layer's GEMM per forward call (batch x sequence): the run's configuration's
    ``batch_size`` x ``seq_len`` where it says both (the built-in loop); else measured, the most common of the
    linear layers' output elements per call over their ``out_features`` (a Trainer knows its batch size, not
    its sequences' length); None when neither tells."""
    c = run.run_config
    b, t = c.get("batch_size"), c.get("seq_len")
    if isinstance(b, int) and b > 0 and isinstance(t, int) and t > 0:
        return b * t
    return _measured_tokens_per_call(run)


def _measured_tokens_per_call(run: _Run) -> int | None:
    """The most common rows per call of the linear layers whose shapes the Profiler recorded, at the first
    sampled step (ties: the smallest); None without one. A mixture of experts' routed experts
    (``taxonomy.routed_expert``) are left out where other layers were recorded: each sees the tokens routed to
    it, and thousands of them outvoted the batch x sequence every other layer read."""
    dims = _recorded_dims(run)
    if run.layers.empty or not dims:
        return None
    dense = {m: d for m, d in dims.items() if not taxonomy.routed_expert(m)}
    dims = dense or dims
    acts = _first_activations(run)
    seen: dict[int, int] = {}
    for m, d in dims.items():
        out = d.get("out")
        if not out or m not in acts:
            continue
        numel, calls = acts[m]
        if not (math.isfinite(numel) and math.isfinite(calls)) or numel <= 0 or calls < 1:
            continue
        per = int(calls) * out
        if int(numel) % per == 0:
            rows = int(numel) // per
            seen[rows] = seen.get(rows, 0) + 1
    return min(seen, key=lambda r: (-seen[r], r)) if seen else None


def _first_activations(run: _Run) -> dict[str, tuple[float, float]]:
    """Per module, its output elements and calls at the first sampled step, ``(numel, calls)``: what a layer's
    shape and tokens per call are read from. Computed once per run, as a dict: the rules look up every linear
    layer, several times each (a ``.loc`` per lookup took seconds for an MoE of thousands of Linear experts)."""
    if run._first is None:
        layers = run.layers
        if layers.empty:
            run._first = {}
        else:
            first = layers[(layers[T.STEP] == layers[T.STEP].min()) & (layers[T.TENSOR] == T.ACTIVATION)]
            run._first = _numel_calls(first)
    return run._first


def _numel_calls(rows: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """Per module of ``rows``, its elements and calls summed, ``(numel, calls)``."""
    g = rows.groupby(T.MODULE, observed=True)[[T.NUMEL, T.CALLS]].sum()
    return {
        str(m): (float(n), float(c))
        for m, n, c in zip(g.index, g[T.NUMEL].to_numpy(float), g[T.CALLS].to_numpy(float), strict=True)
    }


def _expert_banks(run: _Run) -> dict[str, list[list[int]]]:
    """Modules holding a bank of expert weights (a mixture of experts' 3-D parameters, experts x out x in, as
    transformers 5 stores them), from the shapes the capture recorded: name -> the shapes of its 3-D parameters.
    A module whose kind says what it is (a Conv1d's weight is 3-D too) is not one, nor a 3-D parameter of one
    leading row (a position embedding's 1 x positions x width)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    mods = capture.get("modules") if isinstance(capture, Mapping) else None
    banks: dict[str, list[list[int]]] = {}
    for entry in mods if isinstance(mods, list) else []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("params"), Mapping):
            continue
        if taxonomy.kind_of_type(str(entry.get("type", ""))) != taxonomy.OTHER:
            continue
        shapes = [
            list(v)
            for v in entry["params"].values()
            if isinstance(v, list)
            and len(v) == 3
            and all(isinstance(d, int) and d > 0 for d in v)
            and v[0] >= 2
        ]
        if shapes:
            banks[str(entry.get("name", ""))] = shapes
    return banks


def _bank_activations(run: _Run, bank: str) -> list[str]:
    """The modules inside ``bank`` of elementwise kind (its activation function, a dropout after it), in the
    order recorded: what the expert matmuls hand on, one row per token routed to an expert. A router or any other
    layer inside the bank is not one (its output has a row per token, not per routed token, and its own dtype)."""
    acts = run.kind(T.ACTIVATION)
    if acts.empty:
        return []
    types = dict(zip(T.texts(acts[T.MODULE]), T.texts(acts[T.MODULE_TYPE]), strict=True))
    prefix = f"{bank}." if bank else ""
    return [
        m
        for m, t in types.items()
        if m.startswith(prefix) and m != bank and taxonomy.kind_of_type(t) == taxonomy.ELEMENTWISE
    ]


def _expert_gemms(run: _Run) -> dict[str, list[tuple[int, int, int]]]:
    """Per bank of experts (``_expert_banks``), its forward GEMMs of the first sampled step as (rows, in, out)
    each, rows being the tokens routed to the experts (each token once per expert it went to). Read from the
    bank's output (tokens x hidden: the hidden size) and its activation function's output (routed rows x the
    intermediate size, the smallest dimension of its weights other than the hidden size). Banks whose numbers
    do not divide are left out."""
    tokens = _tokens_per_call(run)
    banks = _expert_banks(run)
    if not tokens or not banks:
        return {}
    acts = _first_activations(run)
    out: dict[str, list[tuple[int, int, int]]] = {}
    for bank, shapes in banks.items():
        if bank not in acts:
            continue
        numel, calls = int(acts[bank][0]), max(int(acts[bank][1]), 1)
        if numel % (calls * tokens):
            continue
        hidden = numel // (calls * tokens)
        others = [b if a == hidden else a for _, a, b in shapes if hidden in (a, b)]
        if len(others) != len(shapes):
            continue
        inter = min(others)
        inner = [m for m in _bank_activations(run, bank) if m in acts and int(acts[m][0]) % inter == 0]
        if not inner:
            continue
        routed = int(acts[inner[0]][0]) // inter
        out[bank] = [(routed, b, a) for _, a, b in shapes]  # (rows, in, out) of a weight held (out, in)
    return out


def _captured_modules(run: _Run) -> dict[str, Mapping[str, Any]]:
    """The modules the capture recorded (summary["capture"]["modules"]), by name: each one's type and the shapes
    of its own parameters ({} for a run that did not record them)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    mods = capture.get("modules") if isinstance(capture, Mapping) else None
    return {
        str(e.get("name", "")): e
        for e in (mods if isinstance(mods, list) else [])
        if isinstance(e, Mapping) and isinstance(e.get("params") or {}, Mapping)
    }


def _computed_weights(run: _Run) -> dict[str, str]:
    """Layer -> how its weight is computed at each forward rather than held (``taxonomy.computed_weight_of``): a
    parametrization's layer by its type, an old hook-based weight_norm's or spectral_norm's by the parameters it
    holds instead (weight_g and weight_v, weight_orig)."""
    out = {
        m: taxonomy.PARAMETRIZATION for m, t in run.types.items() if str(t).startswith(taxonomy.PARAMETRIZED)
    }
    for name, entry in _captured_modules(run).items():
        how = taxonomy.computed_weight_of(str(entry.get("type", "")), list(entry.get("params") or {}))
        if how:
            out[name] = how
    return out


def _is_shape(v: object, ndim: int = 2) -> TypeGuard[list[int]]:
    """Whether ``v`` is a recorded shape of ``ndim`` dimensions (a list of ints, as summary.json holds it)."""
    return isinstance(v, list) and len(v) == ndim and all(isinstance(d, int) for d in v)


def _computed_weight_shape(run: _Run, name: str, mods: Mapping[str, Mapping[str, Any]]) -> list[int] | None:
    """The (out, in) shape of a Linear's weight computed at each forward (``_computed_weights``), from the
    parameter it is computed from, which torch keeps in the weight's shape: the old weight_norm's ``weight_v``,
    spectral_norm's ``weight_orig``; a parametrization's ``original`` (``original1``, the direction, for
    weight_norm's, whose ``original0`` is the (out, 1) magnitude), recorded under ``<name>.parametrizations.weight``.
    The computed weight is that module's output: a custom parametrization that changes the shape is told by its
    size, and left unknown (None)."""
    params = mods[name].get("params") or {}
    shape = next((params[p] for p in ("weight_v", "weight_orig") if _is_shape(params.get(p))), None)
    if shape is not None:
        return list(shape)
    plist = f"{name}.parametrizations.weight"
    originals = (mods.get(plist) or {}).get("params") or {}
    shape = next((originals[p] for p in ("original", "original1") if _is_shape(originals.get(p))), None)
    if shape is None:
        return None
    made = _first_activations(run).get(plist)
    if made is not None and made[1] >= 1 and made[0] != made[1] * shape[0] * shape[1]:
        return None
    return list(shape)


def _recorded_dims(run: _Run) -> dict[str, dict[str, int]]:
    """Dimensions of linear layers ({"in", "out"}) and embeddings ({"num_embeddings", "dim"}) from the
    parameter shapes the Profiler records in summary["capture"]["modules"] (Linear weights are (out, in), HF
    Conv1D weights (in, out), Embedding weights (num, dim)); a Linear whose weight is computed (weight_norm,
    spectral_norm) has the shape of what it is computed from (``_computed_weight_shape``)."""
    out: dict[str, dict[str, int]] = {}
    mods = _captured_modules(run)
    for name, entry in mods.items():
        t = str(entry.get("type", ""))
        shape = (entry.get("params") or {}).get("weight")
        if shape is None and taxonomy.is_linear_type(t):
            shape = _computed_weight_shape(run, name, mods)
        if not _is_shape(shape):
            continue
        if taxonomy.kind_of_type(t) == taxonomy.EMBEDDING:
            out[name] = {"num_embeddings": shape[0], "dim": shape[1]}
        elif t == "Conv1D":
            out[name] = {"in": shape[0], "out": shape[1]}
        elif taxonomy.is_linear_type(t):
            out[name] = {"in": shape[1], "out": shape[0]}
    return out


def _layer_dims(run: _Run) -> dict[str, dict[str, int]]:
    """Dimensions of linear layers ({"in", "out"}) and embeddings ({"num_embeddings", "dim"}).

    From the parameter shapes the Profiler records (``_recorded_dims``) when present. Otherwise inferred from
    numels: a (..., out) output with batch*seq tokens per call gives out = numel / (calls * tokens), and the
    other dim = weight numel / out; layers where that does not divide are left out.
    """
    out = _recorded_dims(run)
    tokens = _tokens_per_call(run)
    if tokens is None or run.layers.empty:
        return out
    first = run.layers[run.layers[T.STEP] == run.layers[T.STEP].min()]
    acts = _first_activations(run)
    w = first[(first[T.TENSOR] == T.WEIGHT) & (first[T.PARAM] == "weight")].groupby(T.MODULE)[T.NUMEL].sum()
    for m, wn in w.items():
        m = str(m)
        t = run.types.get(m, "")
        if (
            m in out
            or not (taxonomy.is_linear_type(t) or taxonomy.kind_of_type(t) == taxonomy.EMBEDDING)
            or m not in acts
        ):
            continue
        numel, calls = int(acts[m][0]), int(acts[m][1] or 1)
        per = calls * tokens
        if per <= 0 or numel % per:
            continue
        last = numel // per
        if last <= 0 or int(wn) % last:
            continue
        other = int(wn) // last
        out[m] = (
            {"num_embeddings": other, "dim": last}
            if taxonomy.kind_of_type(t) == taxonomy.EMBEDDING
            else {"in": other, "out": last}
        )
    return out


def _model_dims(run: _Run) -> dict[str, int]:
    """Tensor dimensions named in summary["model"] (flat, or under "dims"), plus the attention head dim."""
    model = run.summary.get(T.SUMMARY_MODEL) or {}
    if not isinstance(model, Mapping):
        return {}
    nested = model.get("dims")
    flat = {**model, **(nested if isinstance(nested, Mapping) else {})}
    dims = {
        k: v for k in _DIM_KEYS if isinstance(v := flat.get(k), int) and not isinstance(v, bool) and v > 0
    }
    width = flat.get("n_embd") or flat.get("hidden_size")
    heads = flat.get("n_head") or flat.get("num_attention_heads")
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width % heads == 0:
        dims["head_dim"] = width // heads
    return dims
