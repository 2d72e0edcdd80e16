"""Host-side schema of precprof's tables and the run directory.

Every column name used anywhere in precprof is a constant here. The four tables (pandas DataFrames):

``layers`` — one row per (step, module, tensor, param) on sampled steps:
    step, order (forward order of the module, 0 = first to run), module (qualified name, "" for the root),
    module_type, tensor (activation | activation_grad | weight | weight_grad | weight_update), param
    (parameter name relative to the module, "" for activations), dtype (torch dtype name, e.g. "bfloat16"),
    calls (how many tensors were aggregated: a module called twice per step has calls=2), numel, zeros, nan,
    inf, absmax (largest finite |x|, unscaled), absmin (smallest nonzero finite |x|, unscaled; NaN when there
    is none), scale (loss scale in effect when the tensor was seen: 1 in the forward pass),
    underflow_<fmt> / overflow_<fmt> for fmt in fp16, bf16, fp8_e4m3, fp8_e5m2 (exact counts of what a real
    cast of x*scale does), underflow_<fmt>_cs for fp8 formats (underflow after per-tensor current scaling,
    scale 2^floor(log2(fmax/amax)) per tensor), and for tensor == "weight_update" rows lost_update_bf16 /
    lost_update_fp16 (update elements that are nonzero but vanish when added to the weight held in that
    format) — NaN on other rows.

``histograms`` — step, module, tensor, param, exponent (floor(log2|x|) of the unscaled value), count.
    Zeros, nan and inf are not in it (they are columns of ``layers``).

``steps`` — step, loss, loss_scale (in effect during that step's backward), skipped (optimizer step skipped
    because of inf/nan gradients), grad_norm (NaN where unknown), time_s (host wall time of the step),
    sampled (whether layers/histograms were recorded), tokens (NaN where unknown), resumed (True on the step a
    run restarted from its checkpoint with ``Profiler(..., resume=True)``; False elsewhere).

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
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from precprof import _atomic, parts
from precprof.errors import DamagedRunDirError
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

LOSS = "loss"
LOSS_SCALE = "loss_scale"
SKIPPED = "skipped"
GRAD_NORM = "grad_norm"
TIME_S = "time_s"
SAMPLED = "sampled"
SAMPLE_REASON = (
    "sample_reason"  # why the step was sampled (precprof.capture.sampling.REASONS), "" if it was not
)
TOKENS = "tokens"
RESUMED = "resumed"  # the first step of a run resumed from its checkpoint (precprof.parts: segments)

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
# Stats: "flushed" (nonzero values that become 0), "saturated" (values clamped to the element max), "poisoned"
# (values in a block, for NVFP4 a tensor, holding nan/inf), "sum_x2" and "sum_err2" (float64 sums of x^2 and
# of (x - q)^2 over the values not poisoned; SQNR = 10 log10(sum_x2 / sum_err2)). Missing (NaN) where the
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
# the activation of a pseudo-module named after the layer, so the block formats judge that operand too
INPUT_SUFFIX = ":input"
INPUT_MODULE_TYPE = "(function output)"


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
# values of the phase column (allocator rows)
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASE_OPTIMIZER = "optimizer"
PHASE_OTHER = "other"  # before the first forward, after the optimizer step (zero_grad, scaler.update)
MEMORY_PHASES: tuple[str, ...] = (PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER, PHASE_OTHER)
LOSS_SCOPE = "(loss)"  # module of activations saved outside the model's forward (the loss), by default

# ------------------------------------------------------------------------------------------- the tables
COUNT_COLUMNS: tuple[str, ...] = (
    NUMEL,
    ZEROS,
    NAN,
    INF,
    *(c for f in WHATIF_FORMATS for c in (underflow_col(f), overflow_col(f))),
    *(underflow_cs_col(f) for f in FP8_FORMATS),
)

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
    *BLOCK_COLUMNS,
)
HISTOGRAMS_COLUMNS: tuple[str, ...] = (STEP, MODULE, TENSOR, PARAM, EXPONENT, COUNT)
STEPS_COLUMNS: tuple[str, ...] = (
    STEP,
    LOSS,
    LOSS_SCALE,
    SKIPPED,
    GRAD_NORM,
    TIME_S,
    SAMPLED,
    TOKENS,
    RESUMED,
    SAMPLE_REASON,
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
_TEXT_COLUMNS = {MODULE, MODULE_TYPE, TENSOR, PARAM, DTYPE, COMPONENT, PHASE, SAMPLE_REASON}


def flags(column: pd.Series) -> pd.Series:
    """A yes/no column (``skipped``, ``sampled``) as plain bool, whatever dtype it was read back in: missing
    (None, NaN) is False. ``fillna(False)`` on a float column is deprecated in pandas."""
    return column.map(lambda v: False if v is None or v != v else bool(v)).astype(bool)


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
        return column.fillna("").astype(str) if column.hasnans else column.astype(str)
    return column.astype(object).where(column.notna(), "").astype(str)


class LossTail:
    """The non-finite loss a run ended with: steps ``first``..``last`` (``steps`` recorded steps), after a
    last finite ``last_finite`` at ``last_finite_step``; ``kind`` is "nan" or "inf"."""

    def __init__(
        self, first: int, last: int, steps: int, last_finite: float, last_finite_step: int, kind: str
    ):
        self.first, self.last, self.steps, self.kind = first, last, steps, kind
        self.last_finite, self.last_finite_step = last_finite, last_finite_step


def nonfinite_loss_tail(steps: pd.DataFrame) -> LossTail | None:
    """The run of non-finite losses at the end of a steps table, None when its last loss is finite.

    A loss the loop did not pass reads as nan too (Parquet stores both as null), so a table with no finite loss
    (a loop that passes none), or with gaps on more than half the steps before its tail (a loop that passes its
    loss now and then), has no tail: only a run that had a finite loss all along and lost it at the end does.
    """
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
    """An empty table with the right columns."""
    return pd.DataFrame(
        {c: pd.Series(dtype="int64" if c in _INT_COLUMNS else "object") for c in TABLES[name]}
    )


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


# ---------------------------------------------------------------------------------------- run directory
REPORT_FILE = "report.html"
SUMMARY_FILE = "summary.json"
TABLE_FILES = {name: f"{name}.parquet" for name in TABLES}

# summary.json keys (top level)
SUMMARY_VERSION = "precprof_version"
SUMMARY_STATUS = "status"  # "complete" | "incomplete"
SUMMARY_INCOMPLETE_REASON = "incomplete_reason"  # the cause when status == "incomplete", else null
SUMMARY_CONFIG = "config"  # run configuration: model, precision, loss scaling, steps, command line, ...
SUMMARY_HARDWARE = "hardware"  # precprof.hardware.HardwareInfo.to_dict()
SUMMARY_VERSIONS = "versions"  # python, torch, cuda, transformers, ...
SUMMARY_MODEL = "model"  # name, class, parameter count, dims (for alignment checks)
SUMMARY_CAPTURE = "capture"  # sample_every, modules captured, mixed precision observed, profiler bytes
SUMMARY_FINAL = "final"  # headline numbers: final loss, steps, skipped steps, tokens/s, time
SUMMARY_MEMORY = "memory"  # per-component totals and the projection per precision mode
SUMMARY_RECOMMENDATION = "recommendation"  # precprof.analysis.advisor.Recommendation.to_dict()
SUMMARY_ERRORS = "errors"  # post-processing steps that failed (memory projection, advisor): one line each

STATUS_COMPLETE = "complete"
STATUS_INCOMPLETE = "incomplete"


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write summary.json atomically (a crash or a full disk mid-write never leaves a truncated file)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(summary, indent=2, default=_json_default, allow_nan=True) + "\n"
    return _atomic.write_text(run_dir / SUMMARY_FILE, text)


# summary.json sections that are JSON objects whenever they are present
_OBJECT_SECTIONS = (
    SUMMARY_CONFIG,
    SUMMARY_HARDWARE,
    SUMMARY_VERSIONS,
    SUMMARY_MODEL,
    SUMMARY_CAPTURE,
    SUMMARY_FINAL,
    SUMMARY_RECOMMENDATION,
)


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """summary.json of a run directory ({} when there is none).

    Raises DamagedRunDirError, naming the file and the fault, when it is not a JSON object or one of its
    sections has the wrong type (e.g. ``"config": 42``).
    """
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedRunDirError(
            f"{path} is damaged (not valid JSON: {e}); delete it to render the report from the tables alone"
        ) from None
    except OSError as e:
        raise DamagedRunDirError(f"{path} cannot be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise DamagedRunDirError(f"{path} is damaged: expected a JSON object, found {type(data).__name__}")
    for key in _OBJECT_SECTIONS:
        value = data.get(key)
        if value is not None and not isinstance(value, dict):
            raise DamagedRunDirError(
                f"{path} is damaged: {key!r} should be an object, found {json.dumps(value)[:40]}"
            )
    if not isinstance(data.get(SUMMARY_STATUS, ""), str):
        raise DamagedRunDirError(f"{path} is damaged: {SUMMARY_STATUS!r} should be a string")
    return data


def write_tables(run_dir: str | Path, tables: Mapping[str, pd.DataFrame]) -> None:
    """Write each table as Parquet, atomically per file (OSError, e.g. ENOSPC, leaves no partial file)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        out = frame(name, df)

        def write(tmp: Path, out: pd.DataFrame = out) -> None:
            out.to_parquet(tmp, index=False)

        _atomic.write_with(run_dir / TABLE_FILES[name], write)


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
        else:
            arrays.append(pa.array(v, from_pandas=True))
    return pa.Table.from_arrays(arrays, names=[str(c) for c in df.columns])


def missing_tables(run_dir: str | Path) -> list[str]:
    """Names of the four tables whose Parquet file is absent from ``run_dir`` (none while a stream holds them;
    a table saved whole beside a stream is read in place of its parts, ``read_run``)."""
    if parts.has_stream(run_dir):
        return []
    return [name for name, fname in TABLE_FILES.items() if not (Path(run_dir) / fname).exists()]


@dataclass
class RunTables:
    """A run directory's tables as read, and what the reading learned. ``streamed``: read from the parts
    written while training (the run never saved its tables: killed, or still running); then ``last_step``
    is the last step flushed and ``notices`` say what was skipped (``precprof.pipeline.rerender`` adds what
    else the reader of the report should know: a run written by a newer precprof, a run still being written). ``restarts``: the steps a resumed run
    restarted from. ``histogram_totals``: when read with ``histogram_totals=True``, the histogram counts
    summed over steps (``HISTOGRAM_TOTALS_COLUMNS``), and ``tables["histograms"]`` is then left empty."""

    tables: dict[str, pd.DataFrame]
    streamed: bool = False
    last_step: int | None = None
    notices: list[str] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)
    histogram_totals: pd.DataFrame | None = None


def read_run(run_dir: str | Path, *, categorical: bool = False, histogram_totals: bool = False) -> RunTables:
    """The four tables of a run directory, from its stream when it has one (``precprof.parts``: a damaged part
    is skipped with a notice; a table whose Parquet file is there beside the stream, saved whole, from that
    file), else from its Parquet files (a missing file gives an empty table of the right
    columns; a damaged one raises DamagedRunDirError, naming the file). ``categorical``: the layers' and the
    histograms' text columns as pandas categoricals (``CATEGORICAL_COLUMNS``; the report and the advisor read
    millions of rows that way), else as text like every other table. ``histogram_totals``: the histograms
    summed over steps by Arrow (``RunTables.histogram_totals``) instead of the per-step table, which stays
    empty: what the report's heatmaps draw, without the millions of rows in pandas (the advisor needs
    the steps)."""
    run_dir = Path(run_dir)
    cats = CATEGORICAL_COLUMNS if categorical else {}
    if parts.has_stream(run_dir):
        return _read_stream(run_dir, cats, histogram_totals)
    out: dict[str, pd.DataFrame] = {}
    totals = None
    for name, fname in TABLE_FILES.items():
        path = run_dir / fname
        if not path.exists():
            out[name] = empty(name)
            continue
        out[name], found = _read_file(path, name, cats, histogram_totals)
        totals = found if found is not None else totals
    if histogram_totals and totals is None:
        totals = sum_histograms(None)
    steps = out["steps"]
    restarts = sorted({int(s) for s in steps[STEP][flags(steps[RESUMED])]}) if not steps.empty else []
    return RunTables(out, restarts=restarts, histogram_totals=totals)


def _read_file(
    path: Path, name: str, cats: Mapping[str, tuple[str, ...]], histogram_totals: bool
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Table ``name`` from its Parquet file, and with ``histogram_totals`` the histograms' totals instead of
    their rows (the table is then empty). DamagedRunDirError, naming the file, for a foreign or damaged one."""
    _check_foreign(path, name)
    try:
        if name == "histograms" and histogram_totals:
            read_as = list(CATEGORICAL_COLUMNS[name])
            columns = list(HISTOGRAM_TOTALS_COLUMNS)
            return empty(name), sum_histograms(pq.read_table(path, columns=columns, read_dictionary=read_as))
        table = pq.read_table(path, read_dictionary=list(cats.get(name, ())) or None)
        return frame(name, _to_pandas(table, cats.get(name, ()))), None
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError and others for a damaged file
        msg = " ".join(str(e).split())[:160]
        raise DamagedRunDirError(
            f"{path} is damaged ({type(e).__name__}: {msg}); re-run, or delete it to render without it"
        ) from None


def _check_foreign(path: Path, name: str) -> None:
    """DamagedRunDirError, naming the file, when table ``name``'s Parquet file lacks its ``KEY_COLUMNS`` (a
    file of someone else's under precprof's name would render as an empty run, or fail deep in the report).
    Reads the file's footer only; a file that is no Parquet at all is left to the reader's own error."""
    try:
        columns = pq.read_schema(path).names
    except Exception:  # not Parquet, truncated: the read that follows names the fault
        return
    missing = [c for c in KEY_COLUMNS[name] if c not in columns]
    if missing:
        have = ", ".join(columns[:6]) + (", ..." if len(columns) > 6 else "") if columns else "none"
        raise DamagedRunDirError(
            f"{path} is not a precprof {name} table (no column {', '.join(missing)}; it has columns {have}); "
            "delete it to render the report without it"
        )


HISTOGRAM_TOTALS_COLUMNS: tuple[str, ...] = (TENSOR, MODULE, PARAM, EXPONENT, COUNT)


def sum_histograms(table: pa.Table | None) -> pd.DataFrame:
    """The histograms' counts summed over steps, one row per (tensor, module, param, exponent): columns
    ``HISTOGRAM_TOTALS_COLUMNS``, a missing text as "". Arrow's hash aggregation takes the 15M rows of
    gpt2-medium x 1,000 sampled steps in a fraction of a second, where pandas would first build them."""
    keys = list(HISTOGRAM_TOTALS_COLUMNS[:-1])
    if table is None or not table.num_rows:
        return pd.DataFrame(
            {
                c: pd.Series(dtype="int64" if c in (EXPONENT, COUNT) else "object")
                for c in HISTOGRAM_TOTALS_COLUMNS
            }
        )
    cols = {}
    for c in HISTOGRAM_TOTALS_COLUMNS:
        col = table.column(c) if c in table.column_names else None
        if col is None or pa.types.is_null(col.type):  # a column no row had a value in
            col = pa.nulls(table.num_rows, pa.int64() if c in (EXPONENT, COUNT) else pa.string())
        cols[c] = col
    # text keys grouped as dictionaries (their codes, never a string per row), merged across parts first
    g = pa.table(cols).unify_dictionaries().group_by(keys).aggregate([(COUNT, "sum")])
    for i, f in enumerate(g.schema):
        if pa.types.is_dictionary(f.type):
            g = g.set_column(i, f.name, g.column(i).cast(f.type.value_type))
    out = pd.DataFrame({k: g.column(k).to_pandas() for k in keys})
    for c in keys[:-1]:  # text keys: a missing one is "", one group with the ""s already there
        out[c] = texts(out[c])
    out[COUNT] = g.column(f"{COUNT}_sum").to_pandas()
    out[EXPONENT] = out[EXPONENT].astype("int64")
    out[COUNT] = out[COUNT].fillna(0).astype("int64")
    return out.groupby(keys, sort=False)[COUNT].sum().reset_index()


def sum_histogram_frame(histograms: pd.DataFrame) -> pd.DataFrame:
    """``sum_histograms`` of a histograms table already in pandas (the per-step table, or totals: summing
    totals again changes nothing): the report's heatmaps and the advisor's rules read this small result
    instead of the per-step rows."""
    h = histograms[[c for c in HISTOGRAM_TOTALS_COLUMNS if c in histograms.columns]]
    if h.empty:
        return sum_histograms(None)
    try:
        return sum_histograms(pa.Table.from_pandas(h, preserve_index=False))
    except (pa.ArrowException, TypeError, ValueError):  # a column Arrow cannot take: pandas alone
        keys = list(HISTOGRAM_TOTALS_COLUMNS[:-1])
        h = h.assign(**{c: texts(h[c]) for c in keys[:3]})  # a missing text is "": one group with ""
        return h.groupby(keys, sort=False)[COUNT].sum().reset_index()


# text columns read back as pandas categoricals: the histograms table repeats a few hundred module names over
# millions of rows (15M rows for gpt2-medium x 1,000 sampled steps), and categories compare, filter and group
# by their integer codes
CATEGORICAL_COLUMNS: dict[str, tuple[str, ...]] = {
    "histograms": (MODULE, TENSOR, PARAM),
    "layers": (MODULE, MODULE_TYPE, TENSOR, PARAM, DTYPE),
}


def _to_pandas(table: pa.Table, categorical: tuple[str, ...] = ()) -> pd.DataFrame:
    """An Arrow table as pandas, its columns ``categorical`` as categoricals whose categories are in text order
    (so that sorting by them sorts as text would), any other dictionary column as text."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type) and f.name not in categorical:
            table = table.set_column(i, f.name, table.column(i).cast(f.type.value_type))
    cat = [c for c in categorical if c in table.column_names]
    for c in cat:
        col = table.column(c)
        if not pa.types.is_dictionary(col.type) and not pa.types.is_null(col.type):
            table = table.set_column(table.column_names.index(c), c, pc.dictionary_encode(col))
    df = table.to_pandas()
    for c in cat:
        if isinstance(df[c].dtype, pd.CategoricalDtype):
            cats = df[c].cat.categories
            df[c] = df[c].cat.reorder_categories(sorted(cats, key=str))
    return df


def _read_stream(
    run_dir: Path, cats: Mapping[str, tuple[str, ...]], histogram_totals: bool = False
) -> RunTables:
    if histogram_totals:  # the text keys as dictionaries: read without a string per row
        cats = {**cats, "histograms": CATEGORICAL_COLUMNS["histograms"]}
    read = parts.read_stream(run_dir, tuple(TABLES), STEP, cats)
    out: dict[str, pd.DataFrame] = {}
    totals = None
    for name in TABLES:
        t = parts.concat(read.tables[name])
        if name == "histograms" and histogram_totals:
            out[name] = empty(name)
            totals = sum_histograms(t)
            continue
        out[name] = (
            frame(name, _to_pandas(t, cats.get(name, ()))) if t is not None and t.num_rows else empty(name)
        )
    restarts = [s.start for s in read.segments[1:]]
    steps = out["steps"]
    if not steps.empty:
        steps[RESUMED] = steps[STEP].isin(restarts).to_numpy()
        restarts = sorted({int(s) for s in steps[STEP][steps[RESUMED]]})
    last = int(steps[STEP].max()) if not steps.empty else None
    # a table saved whole beside the stream (a run whose larger tables did not fit on its disk, or that was
    # killed while it saved them) holds every step: it is read instead of its parts, which may stop early
    whole = [name for name, fname in TABLE_FILES.items() if (run_dir / fname).exists()]
    for name in whole:
        out[name], found = _read_file(run_dir / TABLE_FILES[name], name, cats, histogram_totals)
        totals = found if found is not None else totals
    if whole:
        read.notices.append(
            f"{', '.join(TABLE_FILES[n] for n in whole)} hold every step (saved whole); the other tables "
            f"are read from the parts streamed while the run trained"
            + (f", up to step {last}" if last is not None else "")
        )
    return RunTables(
        out,
        streamed=True,
        last_step=last,
        notices=read.notices,
        restarts=restarts,
        histogram_totals=totals,
    )


def read_tables(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """The four tables of a run directory (``read_run``)."""
    return read_run(run_dir).tables


def is_run_dir(path: str | Path) -> bool:
    """True if ``path`` looks like a precprof run directory."""
    p = Path(path)
    return p.is_dir() and (
        (p / SUMMARY_FILE).exists() or (p / TABLE_FILES["layers"]).exists() or parts.has_stream(p)
    )
