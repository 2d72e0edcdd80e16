"""Host-side schema of precprof's tables: their columns, the values some columns take, and their types.

Every column name used anywhere in precprof is a constant here (read them through the façade
``precprof.tables``; the run directory's files are ``precprof.runfiles``). The four tables (pandas DataFrames):

``layers`` — one row per (step, module, tensor, param) on sampled steps:
    step, order (forward order of the module, 0 = first to run), module (qualified name, "" for the root),
    module_type, tensor (activation | activation_grad | weight | weight_grad | weight_update), param
    (parameter name relative to the module, "" for activations), dtype (torch dtype name, e.g. "bfloat16"),
    calls (what was aggregated: a module's calls for activations, a module called twice per step has
    calls=2, and one returning a tuple counts once; on weight_update rows the optimizer steps with a nonzero
    learning rate and a gradient whose update the row adds up, 0 where its group's learning rate was 0 or it
    had no gradient at the step (a skipped batch), which torch's optimizers skip; tensors for the other
    kinds), numel, zeros, nan,
    inf, absmax (largest finite |x|, unscaled; NaN when no value is finite), absmin (smallest nonzero finite
    |x|, unscaled; NaN when there is none), scale (loss scale in effect when the tensor was seen: 1 in the
    forward pass),
    underflow_<fmt> / overflow_<fmt> for fmt in fp16, bf16, fp8_e4m3, fp8_e5m2 (exact counts of what a real
    cast of x*scale does), underflow_<fmt>_cs for fp8 formats (underflow after per-tensor current scaling,
    scale 2^floor(log2(fmax/max(amax, 1e-12))) per tensor, 1e-12 being torchao's floor on amax) — NaN on
    weight_update rows, not measured (an update is added to its weight, never cast: lost_update_*; 0 in runs
    recorded before, which read as no underflow where real casts of small updates flush them all), and for
    tensor == "weight_update" rows lost_update_bf16 / lost_update_fp16 (update elements that are nonzero but vanish when added to the weight held in that
    format), lost_update_held (intended update elements, a nonzero gradient or a moved weight, that did not
    change the weight in its own dtype: measured; NaN in runs recorded before it), update_rms / weight_rms (the RMS over the sample of the update and of the weight before it:
    update_rms / weight_rms is ||dw|| / ||w||) — NaN on other rows; on weight_update rows absmax and absmin
    are the update's (largest finite |dw|, smallest nonzero one) and nan / inf count the sampled updates that
    were nan or inf (a weight that became or was non-finite; 0 in runs recorded before they were counted),
    numel_gcd (a linear layer's activation rows: the largest number dividing the output elements of each of
    its calls; NaN on other rows).

``histograms`` — step, module, tensor, param, exponent (floor(log2|x|) of the unscaled value; one bin off at
    most under a loss scale that is not a power of two, shifted by its nearest one: capture's
    histogram_shift_exact is then false), count.
    Zeros, nan and inf are not in it (they are columns of ``layers``).

``steps`` — step, loss, loss_scale (in effect during that step's backward), skipped (optimizer step skipped
    because of inf/nan gradients; with several optimizers under one scaler, any of them), skipped_optimizers
    (with several: which the scaler skipped, their places in ``optimizer=[...]``, "0,2"; "" otherwise), grad_norm (NaN where unknown), time_s (host wall time of the step),
    sampled (whether layers/histograms were recorded), tokens (NaN where unknown), resumed (True on the step a
    run restarted from its checkpoint with ``Profiler(..., resume=True)``; False elsewhere), compiled (True on an
    unsampled step torch.compile compiled in, left out of the run's time and throughput).

``memory`` — step, component, module ("" except for activations), dtype ("" for allocator and device rows),
    bytes, phase (allocator rows only: forward | backward | optimizer | other, the part of the step whose peak
    the row holds; "" on other rows), moment. Components in MEMORY_PEAK_COMPONENTS are totals of the whole
    device, not parts of a stack: take their max over rows, never their sum.
    ``moment`` "" (or missing, in older runs): a component's own size (gradients when they exist, the saved
    activations of the largest group of forwards, ...). ``moment`` "peak": what was allocated at the moment of
    the step's allocator peak, by part (``MEMORY_PEAK_PARTS``; every byte in exactly one row, so these rows
    add up to the step's ``allocator_peak``, and with ``allocator_cache`` to what the allocator reserved at that
    moment); ``phase`` is the phase the peak fell in, and the module of a ``temporaries`` row is the phase that
    allocated them. Sum components over ``moment == ""`` rows or over ``moment == "peak"`` rows, never both.
    ``moment`` "cast_copies" (activations rows only): the part of a module's 16-bit activations that autocast
    copied from an fp32 tensor the step holds anyway (``MOMENT_CAST_COPIES``), which the projection of fp32
    leaves out: never summed with the others.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from precprof.formats import FP8_FORMATS, WHATIF_FORMATS

# ----------------------------------------------------------------------------------------------- columns
STEP = "step"
ORDER = "order"
MODULE = "module"
MODULE_TYPE = "module_type"
TENSOR = "tensor"
PARAM = "param"
DTYPE = "dtype"
CALLS = "calls"
NUMEL = "numel"
ZEROS = "zeros"
NAN = "nan"
INF = "inf"
ABSMAX = "absmax"
ABSMIN = "absmin"
SCALE = "scale"
EXPONENT = "exponent"
COUNT = "count"
LOST_UPDATE_BF16 = "lost_update_bf16"
LOST_UPDATE_FP16 = "lost_update_fp16"
# weight_update rows: intended updates that did not land in the weight as it is held (its own dtype): measured,
# where lost_update_bf16 / lost_update_fp16 of an fp32 weight are what-ifs
LOST_UPDATE_HELD = "lost_update_held"
# weight_update rows: the RMS over the sample of the update and of the weight before it (their ratio is
# ||dw|| / ||w||, the learning rate's effect per layer)
UPDATE_RMS = "update_rms"
WEIGHT_RMS = "weight_rms"
# a linear layer's activation rows: the largest number dividing the output elements of each of its calls
# (tokens x out_features: every call's tokens are a multiple of numel_gcd / out_features), what FP8's rule on the
# tokens per call reads (one call of 8 tokens and one of 24 average 16)
NUMEL_GCD = "numel_gcd"

LOSS = "loss"
LOSS_SCALE = "loss_scale"
SKIPPED = "skipped"
# which of several optimizers under one loss scaler it skipped at the step: their places in the Profiler's
# ``optimizer=[...]`` list, comma-separated ("0"; the summary's ``capture.optimizer.each`` names them); "" where
# none was, or with one optimizer (``skipped`` says it all)
SKIPPED_OPTIMIZERS = "skipped_optimizers"
GRAD_NORM = "grad_norm"
TIME_S = "time_s"
SAMPLED = "sampled"
SAMPLE_REASON = "sample_reason"  # why the step was sampled (REASONS below), "" if it was not
TOKENS = "tokens"
RESUMED = "resumed"  # the first step of a run resumed from its checkpoint (precprof.parts: segments)
# the step in progress when the run stopped (a crash, Ctrl-C): it recorded what it reached, but never finished, and
# its null loss is no loss at all (``finished_steps``)
CUT_OFF = "cut_off"
# the loop passed no loss for the step (``prof.step()`` without ``loss=``): its null loss is no loss, not a nan (a
# nan and a missing value are both null once written); missing in a table written before the column: a loss given
NO_LOSS = "no_loss"
# torch.compile compiled in the step (``capture.sampling.Sampler.observe``): a compile's time, not the training's,
# left out of the throughput, in every attempt of a resumed run (the summary's ``compiled_steps`` are the last
# attempt's); missing in a table written before the column
COMPILED = "compiled"

COMPONENT = "component"
BYTES = "bytes"
PHASE = "phase"
MOMENT = "moment"


def underflow_col(fmt: str) -> str:
    """Column with the count of values that become 0 when cast to ``fmt`` at the scale in effect."""
    return f"underflow_{fmt}"


def overflow_col(fmt: str) -> str:
    """Column with the count of finite values that overflow ``fmt`` at the scale in effect."""
    return f"overflow_{fmt}"


def underflow_cs_col(fmt: str) -> str:
    """Column with the underflow count of an fp8 cast after per-tensor current scaling."""
    return f"underflow_{fmt}_cs"


# Block-scaled what-if (precprof.block_formats): per row, per recipe and orientation, what quantising the
# tensor in that recipe loses. "row": blocks along the tensor's last dimension (the reduction dimension of the
# matmul that reads it: activations and weights in the forward GEMM, output gradients in the input-gradient
# GEMM); "col": blocks along the leading dimensions flattened (the transpose: the weight-gradient GEMM reads
# activations and output gradients along tokens, the input-gradient GEMM reads weights along out_features).
# Stats: "flushed" (nonzero values that become 0), "saturated" (values that overflow the element format as a
# real cast does: the scaled value, in the recipe's fp32 arithmetic as torchao's, rounded to nearest-even with
# the exponent unbounded lands above the max: E4M3 > 464, E5M2 >= 61440, FP6 E2M3 >= 7.75, E3M2 >= 30, FP4
# E2M1 >= 7; one clamped to the max that would round to it anyway does not count), "poisoned" (values in a
# block, for NVFP4 a tensor, holding nan/inf), "sum_x2" and "sum_err2" (float64 sums of x^2 and of (x - q)^2
# over the values not poisoned; SQNR = 10 log10(sum_x2 / sum_err2)). Missing (NaN) where the
# recipe was not evaluated for the row (a 1-D tensor has no "col" orientation). Names: block_formats.RECIPES.
BLOCK_RECIPES: tuple[str, ...] = (
    "mxfp8_e4m3",
    "mxfp8_e4m3_rceil",
    "mxfp8_e5m2",
    "mxfp6_e2m3",
    "mxfp6_e3m2",
    "mxfp4",
    "nvfp4",
)
BLOCK_STATS: tuple[str, ...] = ("flushed", "saturated", "poisoned", "sum_x2", "sum_err2")
BLOCK_ORIENTATIONS: tuple[str, ...] = ("row", "col")


def block_col(recipe: str, stat: str, orientation: str = "row") -> str:
    """Column of one block-format statistic, e.g. ``blk_row_mxfp4_flushed``."""
    return f"blk_{orientation}_{recipe}_{stat}"


BLOCK_COLUMNS: tuple[str, ...] = tuple(
    block_col(r, s, o) for o in BLOCK_ORIENTATIONS for r in BLOCK_RECIPES for s in BLOCK_STATS
)

# ----------------------------------------------------------------------------------------- tensor kinds
ACTIVATION = "activation"
ACTIVATION_GRAD = "activation_grad"
WEIGHT = "weight"
WEIGHT_GRAD = "weight_grad"
WEIGHT_UPDATE = "weight_update"
TENSOR_KINDS = (ACTIVATION, ACTIVATION_GRAD, WEIGHT, WEIGHT_GRAD, WEIGHT_UPDATE)
GRADIENT_KINDS = (ACTIVATION_GRAD, WEIGHT_GRAD)
# A linear layer's input that no captured module produced (an attention's output, a function's): recorded as
# the activation of a pseudo-module named after the layer, so the block formats judge that operand too; and the
# input of a norm of the user's own code, whatever made it (a pre-norm block's residual sum: fp16_norm_overflow)
INPUT_SUFFIX = ":input"
INPUT_MODULE_TYPE = "(function output)"
NORM_INPUT_MODULE_TYPE = "(norm input)"  # (the type of a norm's input row)

# why a step was sampled (the steps table's sample_reason; precprof.capture.sampling decides it, the report words it)
REASON_INTERVAL = "interval"  # every N-th step (sample_every=N)
REASON_FIRST = "first"  # the first steps of a budgeted run
REASON_BUDGET = "budget"  # within the budget
REASON_NONFINITE = "nonfinite loss"  # right after a non-finite loss
REASON_SKIPPED = "skipped step"  # right after a step the GradScaler skipped
REASON_SPIKE = "loss spike"  # right after a loss spike
REASONS = (REASON_INTERVAL, REASON_FIRST, REASON_BUDGET, REASON_NONFINITE, REASON_SKIPPED, REASON_SPIKE)
# the share of the run's time the Profiler may add by default (its overhead budget; the report names it beside a
# fixed interval's overhead)
DEFAULT_OVERHEAD_BUDGET = 0.03


# The root module's name (its qualified name is ""), in every table, sentence and list that shows it
ROOT_LABEL = "(model)"


def module_label(name: str) -> str:
    """A module's name as a page or a sentence shows it: the root module (named "") is ``ROOT_LABEL``."""
    return name if name else ROOT_LABEL


# a module name of numbers alone: an nn.Sequential's children ("16"), theirs ("3.1")
_NUMBERS = re.compile(r"[\d.]+")


def module_in_prose(name: str) -> str:
    """A module's name as a sentence, a caption or a cell among numbers writes it: ``module_label``, and a name of
    numbers alone in quotes, a name and not a number ('worst: 16 90.2%, 58 90.2%' read as counts beside shares in
    an nn.Sequential's findings; "The first row that loses anything in FP16, 46, is drawn"); every other name as it
    is ("layers.0", "0.weight", "0:input")."""
    label = module_label(name)
    return f'"{label}"' if _NUMBERS.fullmatch(label) else label


def params_text(n: float) -> str:
    """A parameter count as a sentence writes it: exact below 100,000 ("7,390", "10,560"), in thousands or
    millions to 3 digits above ("497 K", "1.2 M", "124 M"), billions from 10^9 ("1.5 B"); never "0.00739M"."""
    if n < 100_000:
        return f"{round(n):,}"
    for div, unit in ((1e9, "B"), (1e6, "M")):
        if n >= div * 0.9995:  # rounds to 1 of the unit or more at 3 digits
            return f"{float(f'{n / div:.3g}'):g} {unit}"
    return f"{float(f'{n / 1e3:.3g}'):g} K"


def input_module(module: str) -> str:
    """The pseudo-module whose activation rows hold ``module``'s input when no captured module produced it."""
    return module + INPUT_SUFFIX


# ------------------------------------------------------------------------------------ memory components
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
AUTOCAST_WEIGHT_COPIES = "autocast_weight_copies"
ALLOCATOR_PEAK = "allocator_peak"
ALLOCATOR_RESERVED_PEAK = "allocator_reserved_peak"
# the most memory allocated that the hooks saw in a phase whose peak stayed below the process's earlier peak
# (the process's peak counters are not reset in a user's loop): a lower bound of that phase's peak
ALLOCATOR_SEEN_MAX = "allocator_seen_max"
PROFILER_BUFFERS = "profiler_buffers"
MASTER_WEIGHTS = "master_weights"  # parameters the optimizer holds that are not the model's (fp32 masters)
BUFFERS = "buffers"  # module buffers (running stats, masks), each storage once, not parameters
DEVICE_USED = "device_used"  # NVML: memory used on the device by every process, at the end of the step
DEVICE_TOTAL = "device_total"  # NVML: the device's memory
# Not additive: peaks and whole-device numbers (max over rows, never a sum with the other components).
MEMORY_PEAK_COMPONENTS: frozenset[str] = frozenset(
    {ALLOCATOR_PEAK, ALLOCATOR_RESERVED_PEAK, ALLOCATOR_SEEN_MAX, DEVICE_USED, DEVICE_TOTAL}
)
# parts of the allocator's peak that are not components above (``moment == "peak"`` rows)
INPUTS = "inputs"  # tensors passed to the model's forward (the batch)
OUTPUTS = "outputs"  # tensors the model's forward returned (logits; a loss computed inside forward)
TEMPORARIES = "temporaries"  # allocated during the step and none of the above; module: the allocating phase
ALLOCATOR_CACHE = "allocator_cache"  # reserved but not allocated at the peak (CUDA's caching allocator)
OTHER_MEMORY = "other"  # allocated before the step and none of the above (a loop's own tensors, workspaces)
# The parts of a peak, in the order the report stacks them.
MEMORY_PEAK_PARTS: tuple[str, ...] = (
    PARAMETERS,
    BUFFERS,
    MASTER_WEIGHTS,
    OPTIMIZER_STATES,
    GRADIENTS,
    AUTOCAST_WEIGHT_COPIES,
    ACTIVATIONS,
    INPUTS,
    OUTPUTS,
    PROFILER_BUFFERS,
    TEMPORARIES,
    OTHER_MEMORY,
    ALLOCATOR_CACHE,
)
# values of the moment column
MOMENT_PEAK = "peak"
# of a step's activations rows, the 16-bit copies autocast made of an fp32 tensor the step holds anyway (saved by
# another op, or copied for another: q, k and v each cast their one input), which an fp32 run would not hold
# (``capture.cast_copies``): a part of the "" rows, never added to them
MOMENT_CAST_COPIES = "cast_copies"
# values of the phase column (allocator rows)
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASE_OPTIMIZER = "optimizer"
PHASE_OTHER = "other"  # before the first forward, after the optimizer step (zero_grad, scaler.update)
# inside ``Profiler.not_training()`` (an evaluation between steps): not the step's, and not one of its phases
PHASE_OUTSIDE = "outside"
MEMORY_PHASES: tuple[str, ...] = (PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER, PHASE_OTHER)
LOSS_SCOPE = "(loss)"  # module of activations saved outside the model's forward (the loss), by default

# ------------------------------------------------------------------------------------------- the tables
# the what-if formats' counts: NaN on ``weight_update`` rows (not measured there)
WHATIF_COUNT_COLUMNS: tuple[str, ...] = (
    *(c for f in WHATIF_FORMATS for c in (underflow_col(f), overflow_col(f))),
    *(underflow_cs_col(f) for f in FP8_FORMATS),
)
COUNT_COLUMNS: tuple[str, ...] = (NUMEL, ZEROS, NAN, INF, *WHATIF_COUNT_COLUMNS)

LAYERS_COLUMNS: tuple[str, ...] = (
    STEP,
    ORDER,
    MODULE,
    MODULE_TYPE,
    TENSOR,
    PARAM,
    DTYPE,
    CALLS,
    *COUNT_COLUMNS,
    ABSMAX,
    ABSMIN,
    SCALE,
    LOST_UPDATE_BF16,
    LOST_UPDATE_FP16,
    LOST_UPDATE_HELD,
    UPDATE_RMS,
    WEIGHT_RMS,
    NUMEL_GCD,
    *BLOCK_COLUMNS,
)
HISTOGRAMS_COLUMNS: tuple[str, ...] = (STEP, MODULE, TENSOR, PARAM, EXPONENT, COUNT)
STEPS_COLUMNS: tuple[str, ...] = (
    STEP,
    LOSS,
    LOSS_SCALE,
    SKIPPED,
    SKIPPED_OPTIMIZERS,
    GRAD_NORM,
    TIME_S,
    SAMPLED,
    TOKENS,
    RESUMED,
    SAMPLE_REASON,
    CUT_OFF,
    NO_LOSS,
    COMPILED,
)
MEMORY_COLUMNS: tuple[str, ...] = (STEP, COMPONENT, MODULE, DTYPE, BYTES, PHASE, MOMENT)

TABLES: dict[str, tuple[str, ...]] = {
    "layers": LAYERS_COLUMNS,
    "histograms": HISTOGRAMS_COLUMNS,
    "steps": STEPS_COLUMNS,
    "memory": MEMORY_COLUMNS,
}

# the columns a table of any precprof version has: a Parquet file without them is not precprof's (read_run)
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "layers": (STEP, MODULE, TENSOR),
    "histograms": (STEP, MODULE, TENSOR, EXPONENT, COUNT),
    "steps": (STEP,),
    "memory": (STEP, COMPONENT, BYTES),
}

_INT_COLUMNS = {STEP, ORDER, CALLS, EXPONENT, COUNT, BYTES, *COUNT_COLUMNS}
# columns of text: written as Arrow strings in every part, so that parts concatenate whatever they hold
_TEXT_COLUMNS = {
    MODULE,
    MODULE_TYPE,
    TENSOR,
    PARAM,
    DTYPE,
    COMPONENT,
    PHASE,
    SAMPLE_REASON,
    SKIPPED_OPTIMIZERS,
    MOMENT,
}
# columns of yes/no: written as Arrow bools (null where missing) in every part, as a saved table holds them
_BOOL_COLUMNS = {SKIPPED, SAMPLED, RESUMED, CUT_OFF, NO_LOSS, COMPILED}


def flags(column: pd.Series) -> pd.Series:
    """A yes/no column (``skipped``, ``sampled``) as plain bool, whatever dtype it was read back in: missing
    (None, NaN) is False. ``fillna(False)`` on a float column is deprecated in pandas."""
    if column.dtype == bool:  # plain bool already (the advisor's prepared steps): nothing is missing
        return column.copy(deep=False)
    return column.map(lambda v: False if v is None or v != v else bool(v)).astype(bool)


def param_sizes(layers: pd.DataFrame) -> pd.Series:
    """Per ``weight_update`` row of ``layers`` (indexed as those rows), the size of its parameter: its ``weight``
    rows' elements per read (the largest over the steps of ``layers`` that read it); NaN where no ``weight`` row
    of it is in ``layers``. A row's counts are of at most ``update_sample`` strided elements of the parameter
    (every element of a smaller one): weighing each parameter by its size, not by its sampled elements, is what
    makes a sum over parameters an estimate of the model's (``update_squares``, the lost-update shares)."""
    return _update_rows_and_sizes(layers)[1]


def _update_rows_and_sizes(layers: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
    """The ``weight_update`` rows of ``layers`` and their parameters' sizes (``param_sizes``)."""
    tensors = texts(layers[TENSOR])
    rows, weights = layers[tensors == WEIGHT_UPDATE], layers[tensors == WEIGHT]
    key = [MODULE, PARAM]
    reads = (
        pd.to_numeric(weights[CALLS], errors="coerce")
        if CALLS in weights
        else pd.Series(1.0, index=weights.index)
    )
    per_read = (pd.to_numeric(weights[NUMEL], errors="coerce") / reads.clip(lower=1)).to_numpy(dtype=float)
    # each (module, param) as an integer coded over both selections, its largest size per read by it (NaN
    # skipped; NaN where it has none): a group-by and a reindex by text tuples took most of this
    code_w, code_r = joint_codes((texts(weights[k]).astype(str), texts(rows[k]).astype(str)) for k in key)
    size = np.full(int(max(code_w.max(initial=0), code_r.max(initial=0))) + 1, np.nan)
    np.fmax.at(size, code_w, per_read)
    return rows, pd.Series(size[code_r] if len(rows) else np.zeros(0), index=rows.index, dtype=float)


def joint_codes(columns: Iterable[tuple[pd.Series, pd.Series]]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of two tables keyed by several columns (``columns``: each key's column in the one and in the
    other), each row's key as one nonnegative integer coded over both tables alike: equal keys, and only they,
    get equal codes, as a merge on those columns matches them (a missing value matches a missing one; 1 matches
    1.0). A join by integers: merges and group-bys of text columns were the advisor's and the report's slowest."""
    left = right = None
    for a, b in columns:
        codes, distinct = pd.factorize(np.concatenate([a.to_numpy(dtype=object), b.to_numpy(dtype=object)]))
        codes = codes.astype(np.int64) + 1  # (a missing value: 0)
        n = len(distinct) + 1
        if left is None or right is None:
            left, right = codes[: len(a)], codes[len(a) :]
        else:
            left, right = left * n + codes[: len(a)], right * n + codes[len(a) :]
    if left is None or right is None:
        raise ValueError("joint_codes needs at least one key column")
    return left, right


def sample_weights(layers: pd.DataFrame) -> pd.Series:
    """Per ``weight_update`` row of ``layers`` (indexed as those rows), how many of its parameter's elements
    each of its sampled elements stands for: the parameter's size (``param_sizes``) over the row's sampled
    elements, 1 where the size is not known or every element was sampled. A row's counts times it add over
    parameters and layers as the model's own counts do: a weight's 256 sampled elements of 65,536 beside a bias's
    16 of 16 stand for 65,536 and 16."""
    rows, sizes = _update_rows_and_sizes(layers)
    numel = pd.to_numeric(rows[NUMEL], errors="coerce").astype(float)
    return (sizes / numel).where(numel > 0).fillna(1.0)


def update_squares(layers: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """The squared norms behind the ``weight_update`` rows' ``update_rms`` and ``weight_rms`` (indexed as those
    rows of ``layers``): size x RMS^2, ||dw||^2 and ||w||^2 of each parameter estimated from its sampled elements.
    They add over a layer's parameters and over layers, where the RMS do not: ||dw|| / ||w|| of any set of rows
    is sqrt(sum of the first / sum of the second). Each parameter counts at its size (``param_sizes``), else at
    its sampled elements (256 of a weight's 65,536 beside all 16 of its bias had given the bias 6% of the layer's
    norm, where it holds 0.02%). NaN where the row has no sizes (a run recorded before them)."""
    rows, n = _update_rows_and_sizes(layers)
    n = n.fillna(pd.to_numeric(rows[NUMEL], errors="coerce").astype(float))
    upd = pd.to_numeric(rows[UPDATE_RMS], errors="coerce").astype(float)
    wgt = pd.to_numeric(rows[WEIGHT_RMS], errors="coerce").astype(float)
    return n * upd * upd, n * wgt * wgt


def module_order(layers: pd.DataFrame, shared: Mapping[str, Any] | None = None) -> pd.Series:
    """Per module of a layers table, its place in forward order (0, 1, ...), merged over the steps: each step's
    modules in their ``order``, a module a step runs first placed just before the next module of that step
    already placed (after all of them when none is). A routed expert runs on some steps only: the smallest
    order over steps put the output head before the experts of a step that ran more of them, and the -1 a step
    writes in the rows of a module it did not run (the weights and the update AdamW still makes) put those
    first. NaN for a module that never ran, except one that owns a weight others read (``shared``: the
    capture's ``shared_params``, user -> {param: owner}, e.g. T5's ``shared`` embedding, read by
    ``encoder.embed_tokens``): its weight is recorded under its name and read where its first user runs, so it
    goes just before that user."""
    module = texts(layers[MODULE])
    names = pd.unique(module)
    order = pd.to_numeric(layers[ORDER], errors="coerce")
    steps = pd.to_numeric(layers[STEP], errors="coerce").fillna(-1) if STEP in layers else 0
    ran = pd.DataFrame({"s": steps, "o": order, "m": module})[order >= 0]
    if ran.empty:
        return pd.Series(np.nan, index=names, dtype=float)
    ran = ran.drop_duplicates(["s", "m"]).sort_values(["s", "o"], kind="stable")
    first_step = ran.groupby("m", sort=False)["s"].min()
    nxt: dict[str, str | None] = {}  # a linked list of the modules placed: each one's next (None: the end)
    prv: dict[str, str | None] = {}
    last: str | None = None
    # only the steps that run a module for the first time add to it
    intro = ran[ran["s"].isin(set(first_step))].groupby("s", sort=True)["m"].agg(list)
    for seq in intro:
        after: str | None = None  # the next module of this step already placed (None: the end)
        for m in reversed(seq):
            if m in nxt:
                after = m
                continue
            before = prv[after] if after is not None else last
            nxt[m], prv[m] = after, before
            if before is not None:
                nxt[before] = m
            if after is not None:
                prv[after] = m
            else:
                last = m
            after = m
    rank: dict[str, float] = {}
    m = next((k for k, p in prv.items() if p is None), None)
    while m is not None:
        rank[m] = float(len(rank))
        m = nxt[m]
    placed, known = False, {str(n) for n in names}
    for user, params in (shared or {}).items():
        for owner in params.values() if isinstance(params, Mapping) else ():
            place = rank.get(str(user))
            if place is not None and str(owner) not in nxt and str(owner) in known:
                rank[str(owner)] = min(rank.get(str(owner), math.inf), place - 0.5)
                placed = True
    if placed:  # numbered again: 0, 1, ...
        rank = {k: float(i) for i, k in enumerate(sorted(rank, key=rank.__getitem__))}
    return pd.Series([rank.get(str(n), np.nan) for n in names], index=names, dtype=float)


def texts(column: pd.Series) -> pd.Series:
    """A text column (module, param, dtype) with missing values as "", whatever dtype it was read back in
    (a categorical stays one, its categories as text: millions of rows are not turned into strings)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        cats = [str(c) for c in column.cat.categories]
        codes = column.cat.codes.to_numpy()
        missing = bool((codes < 0).any())
        uniq = sorted(set(cats) | ({""} if missing else set()))  # text order; "" for missing values
        pos = {c: k for k, c in enumerate(uniq)}
        remap = np.array([pos[c] for c in cats] + [pos.get("", 0)], dtype=np.int64)  # code -1: the last
        cat = pd.Categorical.from_codes(remap[codes], categories=uniq)
        return pd.Series(cat, index=column.index, name=column.name)
    if isinstance(column.dtype, pd.StringDtype):  # text already: only its missing values change
        if column.hasnans:
            return column.fillna("").astype(str)
        return column.copy(deep=False) if column.dtype == _STR else column.astype(str)
    return column.astype(object).where(column.notna(), "").astype(str)


_STR = pd.Series([""]).astype(str).dtype  # what astype(str) makes of a text column


class LossTail:
    """The non-finite loss a run ended with: steps ``first``..``last`` (``steps`` recorded steps), after a
    last finite ``last_finite`` at ``last_finite_step``; ``kind`` is "nan" or "inf"."""

    def __init__(
        self, first: int, last: int, steps: int, last_finite: float, last_finite_step: int, kind: str
    ):
        self.first, self.last, self.steps, self.kind = first, last, steps, kind
        self.last_finite, self.last_finite_step = last_finite, last_finite_step


def finished_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """The rows of a steps table but the step a crash or Ctrl-C cut off (``CUT_OFF``), whose loss, never
    computed, would read as nan: a run stopped in a sampled step had "diverged" at its last step."""
    if steps.empty or CUT_OFF not in steps:
        return steps
    return steps[~flags(steps[CUT_OFF]).to_numpy()]


def optimizer_places(text: Any) -> list[int]:
    """The optimizers a ``SKIPPED_OPTIMIZERS`` cell names, by their places in ``optimizer=[...]`` ("0,2": [0, 2];
    "", None or NaN: [])."""
    if not isinstance(text, str):
        return []
    return [int(k) for k in text.split(",") if k.strip().isdigit()]


def given_losses(steps: pd.DataFrame) -> pd.DataFrame:
    """The rows of a steps table whose loss the loop passed (``NO_LOSS`` false or missing): the others' null
    loss is no loss, where a nan loss is null too once written."""
    if steps.empty or NO_LOSS not in steps:
        return steps
    return steps[~flags(steps[NO_LOSS]).to_numpy()]


def nonfinite_loss_tail(steps: pd.DataFrame) -> LossTail | None:
    """The run of non-finite losses at the end of a steps table, None when its last loss is finite.

    Only the steps the loop passed a loss for count (``given_losses``). A table written before ``NO_LOSS``
    holds a missing loss as a null, as a nan, so a table with no finite loss (a loop that passes none), or with
    gaps on more than half the steps before its tail (a loop that passes its loss now and then), has no tail:
    only a run that had a finite loss all along and lost it at the end does.
    """
    steps = given_losses(finished_steps(steps))
    if steps.empty or STEP not in steps or LOSS not in steps:
        return None
    rec = steps[[STEP, LOSS]].copy()
    rec[STEP] = pd.to_numeric(rec[STEP], errors="coerce")
    rec = rec.dropna(subset=[STEP]).sort_values(STEP, kind="stable")
    values = pd.to_numeric(rec[LOSS], errors="coerce").astype(float).tolist()
    finite = [math.isfinite(v) for v in values]
    if not finite or finite[-1] or not any(finite):
        return None
    i_ok = max(i for i, ok in enumerate(finite) if ok)
    before = finite[: i_ok + 1]
    if before.count(False) * 2 > len(before):
        return None
    at = [int(s) for s in rec[STEP]]
    kind = "inf" if math.isinf(values[i_ok + 1]) else "nan"
    return LossTail(at[i_ok + 1], at[-1], len(values) - i_ok - 1, values[i_ok], at[i_ok], kind)


def memory_at(memory: pd.DataFrame, moment: str = "") -> pd.DataFrame:
    """The rows of a memory table at one ``moment``: "" (each component's own size, and every row of a run
    recorded before the column existed) or ``MOMENT_PEAK`` (what was allocated at the step's peak)."""
    if MOMENT not in memory.columns:
        return memory if moment == "" else memory.iloc[0:0]
    return memory[texts(memory[MOMENT]) == moment]


def empty(name: str) -> pd.DataFrame:
    """An empty table with the right columns (a copy of one built once per table: building the hundred columns
    of the layers table took milliseconds, a copy of the empty frame microseconds)."""
    made = _EMPTY.get(name)
    if made is None:
        made = _EMPTY[name] = pd.DataFrame(
            {c: pd.Series(dtype="int64" if c in _INT_COLUMNS else "object") for c in TABLES[name]}
        )
    return made.copy()


_EMPTY: dict[str, pd.DataFrame] = {}  # empty()'s templates, never handed out themselves


def frame(name: str, rows: list[dict[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """Build table ``name`` from rows, with every schema column present and in schema order.

    Missing columns are filled with NaN (floats) so that tables from older runs or partial captures load.
    """
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    if df.empty and not len(df.columns):
        return empty(name)
    cols = TABLES[name]
    for c in cols:
        if c not in df.columns:
            df[c] = math.nan
    extra = [c for c in df.columns if c not in cols]
    return df[[*cols, *extra]].reset_index(drop=True)


def to_arrow(name: str, rows: list[dict[str, Any]] | pd.DataFrame | Mapping[str, Any]) -> pa.Table:
    """Table ``name`` as Arrow, for a part of a run's stream (``precprof.parts``): every schema column, text
    columns as strings (null where missing) whatever a part holds, so parts concatenate."""
    df = frame(name, rows if not isinstance(rows, Mapping) else pd.DataFrame(dict(rows)))
    arrays = []
    for c in df.columns:
        v = df[c]
        if c in _TEXT_COLUMNS:
            arrays.append(
                pa.array(v.astype(object).where(v.notna(), None), type=pa.string(), from_pandas=True)
            )
        elif c in _BOOL_COLUMNS:
            arrays.append(pa.array([None if x is None or x != x else bool(x) for x in v], type=pa.bool_()))
        else:
            arrays.append(pa.array(v, from_pandas=True))
    return pa.Table.from_arrays(arrays, names=[str(c) for c in df.columns])


def arrow_of_columns(name: str, cols: Mapping[str, np.ndarray | list[Any] | pa.Array]) -> pa.Table:
    """:func:`to_arrow` of columns that are already arrays of one length (a sampled step's decoded layer or
    histogram columns), the same table without building a pandas frame twice on the way: the stream writer's
    thread spent two thirds of a flush there, holding the interpreter lock the training wants. A schema column
    missing from ``cols`` is null (as :func:`frame`'s NaN becomes), text columns are strings."""
    n = len(next(iter(cols.values()))) if cols else 0
    names = [*TABLES[name], *(c for c in cols if c not in TABLES[name])]
    arrays = []
    for c in names:
        v = cols.get(c)
        text = c in _TEXT_COLUMNS
        if v is None:
            arrays.append(
                pa.nulls(n, pa.string() if text else pa.bool_() if c in _BOOL_COLUMNS else pa.float64())
            )
        elif isinstance(v, pa.Array):
            arrays.append(v.cast(pa.string()) if text and v.type != pa.string() else v)
        elif text:
            arrays.append(pa.array(np.asarray(v, dtype=object), type=pa.string(), from_pandas=True))
        else:
            arrays.append(pa.array(np.asarray(v), from_pandas=True))
    return pa.Table.from_arrays(arrays, names=[str(c) for c in names])
