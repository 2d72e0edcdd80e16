"""The run directory's files: their names, summary.json (its keys; written atomically, read with its damage
named), and the four tables as Parquet files or, while a run streams, as its parts (``precprof.parts``).

Reading checks that a file is precprof's (``KEY_COLUMNS``), reads text columns as categoricals on request and
sums the histograms over steps in Arrow. The columns are ``precprof.schema``'s; saving on a disk that fills up
is ``precprof._saving``'s; owning the directory (checks, lock, resume) is ``precprof.rundir``'s. Read all of it
through the façade ``precprof.tables``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from precprof import _atomic, parts
from precprof.errors import DamagedRunDirError
from precprof.schema import (
    CALLS,
    COUNT,
    DTYPE,
    EXPONENT,
    KEY_COLUMNS,
    MODULE,
    MODULE_TYPE,
    PARAM,
    RESUMED,
    STEP,
    TABLES,
    TENSOR,
    WEIGHT_GRAD,
    empty,
    flags,
    frame,
    texts,
)

# ---------------------------------------------------------------------------------------- run directory
REPORT_FILE = "report.html"
SUMMARY_FILE = "summary.json"
# the traceback of the exception that stopped a run of the built-in loop (precprof train, compare): the terminal
# says it in one line and names this file; its first line tells precprof's from a user's own file of that name
TRACEBACK_FILE = "traceback.txt"
TRACEBACK_HEAD = "# precprof: the traceback of the error that stopped this run\n"
TABLE_FILES = {name: f"{name}.parquet" for name in TABLES}

# summary.json keys (top level)
SUMMARY_VERSION = "precprof_version"
SUMMARY_STATUS = "status"  # "complete" | "incomplete"
SUMMARY_INCOMPLETE_REASON = "incomplete_reason"  # the cause when status == "incomplete", else null
# true when training ran to its end: a run "incomplete" all the same lost files (a full disk, Ctrl-C while its
# report rendered), not steps; false when a crash or a signal stopped training (absent: an older or killed run)
SUMMARY_TRAINING_FINISHED = "training_finished"
SUMMARY_CONFIG = "config"  # run configuration: model, precision, loss scaling, steps, command line, ...
SUMMARY_HARDWARE = "hardware"  # precprof.hardware.HardwareInfo.to_dict()
SUMMARY_VERSIONS = "versions"  # python, torch, cuda, transformers, ...
SUMMARY_MODEL = "model"  # name, class, parameter count, dims (for alignment checks)
SUMMARY_CAPTURE = "capture"  # sample_every, modules captured, mixed precision observed, profiler bytes
SUMMARY_FINAL = "final"  # headline numbers: final loss, steps, skipped steps, tokens/s, time
SUMMARY_MEMORY = "memory"  # per-component totals and the projection per precision mode
SUMMARY_RECOMMENDATION = "recommendation"  # precprof.analysis.advisor.Recommendation.to_dict()
SUMMARY_WEIGHT_UPDATES = "weight_updates"  # update-to-weight ratio per layer (precprof.analysis.update_ratio)
SUMMARY_ERRORS = "errors"  # post-processing steps that failed (memory projection, advisor): one line each
SUMMARY_NONFINITE = "nonfinite_figures"  # where a text ("NaN", "Infinity") is a figure, not a name: last

STATUS_COMPLETE = "complete"
STATUS_INCOMPLETE = "incomplete"

# config["source"] of a run of the callbacks (``precprof.integrations``), whose sample_every is
# PrecprofCallback's argument; a run of the built-in loop has config["command_line"], a loop of the user's own
# neither
SOURCE_LIGHTNING = "lightning.Trainer"
SOURCE_TRANSFORMERS = "transformers.Trainer"
CALLBACK_SOURCES = frozenset({SOURCE_LIGHTNING, SOURCE_TRANSFORMERS})

# capture.loop_order's kind of a sampled step whose optimizer stepped before the model's forward
# (``capture/loop_order.py``): its weight-update rows are the step before's update
LOOP_BEFORE_FORWARD = "optimizer_before_forward"
# capture.loop_order's kind of a sampled step in which an optimizer the Profiler was not given stepped the model's
# parameters (a new optimizer made mid-run without ``prof.use_optimizer``): its updates were not read. Its entry
# lists the sampled steps (``at``, the first ``AT_MAX``; ``steps``: how many) and the optimizers' classes
LOOP_NOT_FOLLOWED = "optimizer_not_followed"
# capture.loop_order's kind of a sampled step that read weight gradients and in which no optimizer the Profiler
# follows stepped, nor another one the model's parameters, nor a loss scaler unscaled one (a step it skips):
# ``prof.step()`` called once per micro-batch under gradient accumulation makes the micro-batches such steps.
# No update is read in them; its entry lists them as ``LOOP_NOT_FOLLOWED``'s does. Said by no warning at the
# step (a loop that skips the optimizer on a bad batch has a few): the advisor judges (``steps_without_update``)
LOOP_NOT_STEPPED = "optimizer_not_stepped"
# capture.loop_order's kind of a sampled step in which the one optimizer the Profiler follows (or each of them)
# stepped more than once (``prof.step()`` at a logging interval): its rows hold several steps. Its entry has
# ``most``, the most steps of one optimizer in a sampled step
LOOP_SEVERAL_STEPS = "several_optimizer_steps"
# capture.loop_order's kind of a sampled step in which, of several optimizers the Profiler follows, one stepped
# more than once and another once (a WGAN's critic, n_critic steps per generator step, README's pattern): no
# fault, said by no warning. Its entry names the optimizers that stepped several times (``optimizers``: "optimizer
# 0 (Adam: D.0, D.2)", by place in the list the Profiler was given and the modules it updates) and ``most``
LOOP_CRITIC_STEPS = "several_steps_of_one_optimizer"
# summary.json's capture.step_passes: the passes of a sampled step over the run, what makes one layer's rows hold
# several calls (``capture/loop_order.py``): ``model_forwards`` ({"least", "most"} of the model's own training
# forwards a sampled step; 0 where the loop calls parts of the model itself, a GAN's G and D in a ModuleDict) and
# ``closures`` (the classes of the optimizers given a closure, LBFGS, which runs its forward and backward
# several times an optimizer step)
SUMMARY_STEP_PASSES = "step_passes"


def sample_every_setting(cfg: Mapping[str, Any], n: str = "N") -> str:
    """The setting of a sampling interval ``n`` as the run ``cfg`` (its summary's config) sets it: ``--sample-every
    N`` in a run of the built-in loop (``precprof train``, ``precprof compare``: its config is ``TrainConfig``'s,
    with its ``command_line``), ``PrecprofCallback(sample_every=N)`` under the callbacks (their config's
    ``source``), else the Profiler's argument of a loop of the user's own, which records no config."""
    if cfg.get("source") in CALLBACK_SOURCES:
        return f"PrecprofCallback(sample_every={n})"
    if "command_line" in cfg:
        return f"--sample-every {n}"
    return f"Profiler(sample_every={n})"


def compile_held_steps(capture: Mapping[str, Any], steps: int | None = None) -> str | None:
    """Where a run sampled no step because all its steps ran while the statistics kernels compiled beside the
    training (a short first run on a machine: a 3-step run on an H200 was told that "sample_every=0" had recorded
    nothing), that in words; else None. ``capture``: the summary's; ``steps``: the steps it recorded, when
    known (else its last step's number counts them)."""
    sampling = capture.get("sampling")
    sampling = sampling if isinstance(sampling, Mapping) else {}
    held = sampling.get("held_for_compile")
    if not isinstance(held, int) or held <= 0 or sampling.get("first_sampled_step") is not None:
        return None
    last = sampling.get("last_step")
    n = steps if steps is not None else last + 1 if isinstance(last, int) and last >= 0 else 0
    which = f"its {n} steps" if n > 1 else "its one step" if n == 1 else "its steps"
    return f"{which} ran while precprof's statistics kernels compiled beside the training, as they do on a machine's first run"


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


# JSON has no NaN and no infinity (RFC 8259): Python wrote them bare, which JSON.parse, jq and Go refuse. A NaN
# figure is one not measured (a step time of too few steps, a rate without tokens) and is written null, except
# a loss: NaN there is what the run reached (it diverged), and null would read as "not recorded" (jq's
# `.final.final_loss < 3` holds for null), so it is written "NaN". An infinity is a figure too (an SQNR of a
# cast that lost nothing, a loss that overflowed): "Infinity" and "-Infinity", as JavaScript's Number() reads.
NONFINITE_TEXT: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_LOSS_KEYS = frozenset({"final_loss", "final_loss_avg10", "initial_loss", "curve_loss"})
# A name can be one of those texts too (a module named NaN, an --out named Infinity): summary.json lists where
# it wrote a text for a figure (SUMMARY_NONFINITE), each place as a JSON Pointer (RFC 6901: "/final/final_loss",
# a list's item by its index, "~1" for a "/" in a key and "~0" for a "~"), and only those are read back as floats.
# sections of names and settings as the user gave them: in a summary without the list, never figures
_SETTINGS_SECTIONS = (SUMMARY_CONFIG, SUMMARY_HARDWARE, SUMMARY_VERSIONS, SUMMARY_MODEL)


def _standard(value: Any, path: tuple[str | int, ...], places: list[str]) -> Any:
    """``value`` (parsed JSON, found at ``path``) with each non-finite float as the comment above says, by the
    nearest key above it (a loss curve's items by the curve's key); the path of each text written for a
    figure is appended to ``places``."""
    if isinstance(value, float) and not math.isfinite(value):
        key = next((k for k in reversed(path) if isinstance(k, str)), None)
        if math.isnan(value) and key not in _LOSS_KEYS:
            return None
        places.append("".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in path))
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _standard(v, (*path, k), places) for k, v in value.items()}
    if isinstance(value, list):
        return [_standard(v, (*path, i), places) for i, v in enumerate(value)]
    return value


def _standard_doc(doc: Any) -> tuple[Any, list[str]]:
    """``doc`` as standard JSON values (``_standard``) and the places of the texts written for figures;
    objects JSON has no type for as ``_json_default`` makes them."""
    places: list[str] = []
    plain = json.loads(json.dumps(doc, default=_json_default, allow_nan=True))
    return _standard(plain, (), places), places


def json_text(doc: Any, places_key: str | None = None) -> str:
    """``doc`` as standard JSON text (summary.json, compare.json): no bare NaN or Infinity, non-finite figures
    written as ``_standard`` says; with ``places_key``, the object ``doc`` lists under it, last, the places of the
    texts written for figures."""
    standard, places = _standard_doc(doc)
    if places_key is not None:
        standard = {**standard, places_key: places}
    return json.dumps(standard, indent=2, allow_nan=False) + "\n"


def _texts_back(value: Any) -> Any:
    """``value`` read from a summary written before ``SUMMARY_NONFINITE`` with every text ``_standard`` writes
    for a figure as a float (a summary written before those texts, with bare NaN, holds the floats already)."""
    if isinstance(value, str):
        return NONFINITE_TEXT.get(value, value)
    if isinstance(value, dict):
        return {k: _texts_back(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_texts_back(v) for v in value]
    return value


def _figures_back(data: dict[str, Any]) -> dict[str, Any]:
    """summary.json's ``data`` with the texts written for figures as the floats they were: those at the places
    it lists, or, in a summary written before that list, every such text outside the settings sections."""
    places = data.pop(SUMMARY_NONFINITE, None)
    if not isinstance(places, list):
        return {k: v if k in _SETTINGS_SECTIONS else _texts_back(v) for k, v in data.items()}
    for place in places:
        _figure_back(data, place)
    return data


def _figure_back(data: Any, place: Any) -> None:
    """Turn the text at ``place`` (a JSON Pointer) of ``data`` back into its float, in place; a place that
    leads nowhere, or to anything but such a text, is left alone."""
    if not isinstance(place, str) or not place.startswith("/"):
        return
    steps = [s.replace("~1", "/").replace("~0", "~") for s in place[1:].split("/")]
    holder = data
    for step in steps[:-1]:
        holder = _child(holder, step)[1]
    key, value = _child(holder, steps[-1])
    if isinstance(value, str) and value in NONFINITE_TEXT:
        holder[key] = NONFINITE_TEXT[value]


def _child(holder: Any, step: str) -> tuple[str | int, Any]:
    """The key (an object's) or index (a list's) ``step`` names in parsed JSON, and the item there (None where
    there is none)."""
    if isinstance(holder, dict):
        return step, holder.get(step)
    if isinstance(holder, list) and step.isascii() and step.isdigit() and int(step) < len(holder):
        return int(step), holder[int(step)]
    return step, None


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write summary.json atomically (a crash or a full disk mid-write never leaves a truncated file), as
    standard JSON (``json_text``) with the places of its texts for figures last (``SUMMARY_NONFINITE``)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return _atomic.write_text(run_dir / SUMMARY_FILE, json_text(summary, SUMMARY_NONFINITE))


# summary.json sections that are JSON objects whenever they are present
_OBJECT_SECTIONS = (
    SUMMARY_CONFIG,
    SUMMARY_HARDWARE,
    SUMMARY_VERSIONS,
    SUMMARY_MODEL,
    SUMMARY_CAPTURE,
    SUMMARY_FINAL,
    SUMMARY_RECOMMENDATION,
    SUMMARY_WEIGHT_UPDATES,
)


def shared_params(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """The capture's ``shared_params`` of a summary (a module -> {param: the module its weight is recorded
    under}); {} for a run recorded before the capture wrote them."""
    capture = (summary or {}).get(SUMMARY_CAPTURE)
    shared = capture.get("shared_params") if isinstance(capture, Mapping) else None
    return dict(shared) if isinstance(shared, Mapping) else {}


def frozen_params(
    summary: Mapping[str, Any] | None, layers: pd.DataFrame | None = None
) -> dict[str, list[str]]:
    """Per captured module, its parameters that do not train (the capture's ``modules[].frozen``), for the
    modules with some; {} for a run recorded before the capture wrote them. With ``layers`` (the run's layers
    table), not those whose gradient a sampled step read (a ``weight_grad`` row with calls): the capture's word
    is its last attempt's, and a resumed run's layer trained before the restart and frozen after it was called
    frozen beside its own gradient rows."""
    capture = (summary or {}).get(SUMMARY_CAPTURE)
    modules = capture.get("modules") if isinstance(capture, Mapping) else None
    trained: set[tuple[str, str]] = set()
    if layers is not None and not layers.empty and CALLS in layers:
        grads = layers[(layers[TENSOR] == WEIGHT_GRAD) & (pd.to_numeric(layers[CALLS], errors="coerce") > 0)]
        trained = set(zip(texts(grads[MODULE]), texts(grads[PARAM]), strict=True))
    out: dict[str, list[str]] = {}
    for m in modules if isinstance(modules, list) else []:
        frozen = m.get("frozen") if isinstance(m, Mapping) else None
        if isinstance(frozen, list) and frozen and isinstance(m.get("name"), str):
            kept = [str(p) for p in frozen if (m["name"], str(p)) not in trained]
            if kept:
                out[m["name"]] = kept
    return out


def trainable_changed(summary: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per captured module, its parameters whose requires_grad changed during the run (the capture's
    ``modules[].trainable_changed``: param -> {"runs": [[first, last, requires_grad, had_gradient], ...], "end"}),
    for the modules with some; {} for a run recorded before the capture wrote them."""
    capture = (summary or {}).get(SUMMARY_CAPTURE)
    modules = capture.get("modules") if isinstance(capture, Mapping) else None
    out: dict[str, dict[str, Any]] = {}
    for m in modules if isinstance(modules, list) else []:
        changed = m.get("trainable_changed") if isinstance(m, Mapping) else None
        if isinstance(changed, Mapping) and changed and isinstance(m.get("name"), str):
            out[m["name"]] = {str(p): dict(v) for p, v in changed.items() if isinstance(v, Mapping)}
    return out


def not_in_optimizer(summary: Mapping[str, Any] | None) -> set[tuple[str, str]]:
    """The (module, param) of the captured parameters that were trainable on a sampled step in which an optimizer
    the Profiler follows stepped, and that no optimizer it follows held on any such step (the capture's
    ``trainable_not_in_optimizer``: {module: [param, ...]}); empty for a run recorded before the capture wrote it,
    one that followed no optimizer, and one whose optimizers held every trainable parameter."""
    capture = (summary or {}).get(SUMMARY_CAPTURE)
    loose = capture.get("trainable_not_in_optimizer") if isinstance(capture, Mapping) else None
    if not isinstance(loose, Mapping):
        return set()
    return {(str(m), str(p)) for m, ps in loose.items() if isinstance(ps, list) for p in ps}


def trainable_changes(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """The capture's ``trainable_changes`` (the model's trainable elements per run of sampled steps, ``numel``:
    [[first, last, elements], ...], the most at once and at the end), where requires_grad changed during the run;
    {} where it did not, or the run was recorded before the capture said so."""
    capture = (summary or {}).get(SUMMARY_CAPTURE)
    changes = capture.get("trainable_changes") if isinstance(capture, Mapping) else None
    return dict(changes) if isinstance(changes, Mapping) and changes.get("numel") else {}


def trainable_at(summary: Mapping[str, Any] | None, step: Any) -> int | None:
    """The model's trainable elements on sampled step ``step`` where requires_grad changed during the run
    (``trainable_changes``); None where it did not, or ``step`` is in none of its runs."""
    for run in trainable_changes(summary).get("numel") or []:
        if isinstance(run, list) and len(run) == 3 and isinstance(step, int) and run[0] <= step <= run[1]:
            return int(run[2])
    return None


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
    return _figures_back(data)


def write_tables(run_dir: str | Path, tables: Mapping[str, pd.DataFrame]) -> None:
    """Write each table as Parquet, atomically per file (OSError, e.g. ENOSPC, leaves no partial file)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        out = frame(name, df)

        def write(tmp: Path, out: pd.DataFrame = out) -> None:
            write_parquet(out, tmp)

        _atomic.write_with(run_dir / TABLE_FILES[name], write)


def write_parquet(df: pd.DataFrame, path: Path) -> None:
    """``df`` as a Parquet file, converted on this thread: Arrow converts a large frame on a pool of Python
    threads, which an interpreter that is exiting refuses ("cannot schedule new futures after interpreter
    shutdown"), and a run saved at exit (a script that died, the bare callbacks' atexit) was lost."""
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False, nthreads=1), path)


def release_memory() -> None:
    """Give back to the system what a run's save freed and the allocators keep: Arrow's memory pool and, on
    glibc, malloc's free pages. Called once the saved tables are dropped. A long run's save left hundreds of MB
    resident for the rest of the training process (a notebook, a trainer that evaluates after training): 1,000
    sampled steps of 41 modules kept 503 MB more than before the save, 108 MB with this."""
    with contextlib.suppress(Exception):  # an Arrow without it: its pool keeps what it keeps
        pa.default_memory_pool().release_unused()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def missing_tables(run_dir: str | Path) -> list[str]:
    """Names of the four tables whose Parquet file is absent from ``run_dir`` (none while a stream holds them;
    a table saved whole beside a stream is read in place of its parts, ``read_run``)."""
    if parts.has_stream(run_dir):
        return []
    return [name for name, fname in TABLE_FILES.items() if not (Path(run_dir) / fname).exists()]


def missing_summary(run_dir: str | Path) -> str | None:
    """What a report of ``run_dir`` cannot say because it has no summary.json, None when it has one: the page's
    banner and ``precprof report``'s note say it, as they name a missing table."""
    if (Path(run_dir) / SUMMARY_FILE).exists():
        return None
    return (
        "the report is read from the tables alone, which do not say which model the run trained, the precision "
        "it asked for, how it was started, whether it finished or the machine it recorded on; its verdict is "
        "planned for the machine that rendered the report (or the one --target named)"
    )


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
    _release_arrow_memory()
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
        elif c not in (EXPONENT, COUNT) and not pa.types.is_dictionary(col.type):
            # a text key as text (a pandas table's: ``sum_histogram_frame``) made a dictionary first: grouping
            # 9.8M rows of 965 modules' names took 1.26 s as text, 0.53 s encoding them and grouping the codes
            col = pc.dictionary_encode(col)
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
        return sum_histograms(pa.Table.from_pandas(h, preserve_index=False, nthreads=1))
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


def as_categorical(tables: Mapping[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """``tables`` with the text columns of ``CATEGORICAL_COLUMNS`` as categoricals (categories in text order),
    as ``read_run(categorical=True)`` reads them: the tables a training's end or a Profiler holds have one
    Python string a row, which each group-by and lookup of the report hashes again (a 24-layer model's 400
    sampled steps: rendered in 4.0 s with the conversion's 0.3 s, against 4.6). Shallow copies; a table whose
    columns are categoricals already is given as it is."""
    out = dict(tables)
    for name, columns in CATEGORICAL_COLUMNS.items():
        df = out.get(name)
        if not isinstance(df, pd.DataFrame):
            continue
        todo = [c for c in columns if c in df.columns and not isinstance(df[c].dtype, pd.CategoricalDtype)]
        if todo:
            out[name] = df.assign(**{c: df[c].astype("category") for c in todo})
    return out


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


def _release_arrow_memory() -> None:
    """Hand the memory Arrow's pool freed back to the system: reading a run's parts keeps what Arrow read them
    into, freed once the tables are in pandas, in the pool (mimalloc's), where nothing but Arrow reuses it. A
    24-layer model's 400 sampled steps (500K layer rows, 5.9M histogram rows) read to 2,048 MB of RSS, 813 MB
    of it that; the end of a run then analysed its tables on top of it (3.6 GB at its peak)."""
    pa.default_memory_pool().release_unused()


def _read_stream(
    run_dir: Path, cats: Mapping[str, tuple[str, ...]], histogram_totals: bool = False
) -> RunTables:
    if histogram_totals:  # the text keys as dictionaries: read without a string per row
        cats = {**cats, "histograms": CATEGORICAL_COLUMNS["histograms"]}
    read = parts.read_stream(run_dir, tuple(TABLES), STEP, cats)
    out: dict[str, pd.DataFrame] = {}
    totals = None
    for name in TABLES:
        t = parts.concat(read.tables.pop(name))  # (each table's Arrow data let go once it is in pandas)
        if name == "histograms" and histogram_totals:
            out[name] = empty(name)
            totals = sum_histograms(t)
            continue
        out[name] = (
            frame(name, _to_pandas(t, cats.get(name, ()))) if t is not None and t.num_rows else empty(name)
        )
        del t
    _release_arrow_memory()
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
    """The four tables of a run directory (``read_run``). FileNotFoundError, in ``not_a_run_dir``'s one line,
    for a path that is no run directory (a mistyped one read as four empty tables), as ``recommend`` says it."""
    if why := not_a_run_dir(run_dir):
        raise FileNotFoundError(why)
    return read_run(run_dir).tables


def not_a_run_dir(path: str | Path) -> str:
    """Why ``path`` is no precprof run directory, in one line for the user ("" when it is one): it does not
    exist, it is a file, or it holds none of a run's files (a path that did not exist was called "not a precprof
    run directory (no summary.json or tables in it)", as if it were a folder)."""
    p = Path(path)
    if is_run_dir(p):
        return ""
    if not p.exists():
        return f"{str(path)!r} does not exist: give the folder a precprof run was saved into"
    if not p.is_dir():
        return (
            f"{str(path)!r} is a file, not a precprof run directory: give the folder holding its summary.json"
        )
    return f"{str(path)!r} is not a precprof run directory (no summary.json or tables in it)"


def is_run_dir(path: str | Path) -> bool:
    """True if ``path`` looks like a precprof run directory."""
    p = Path(path)
    return p.is_dir() and (
        (p / SUMMARY_FILE).exists() or (p / TABLE_FILES["layers"]).exists() or parts.has_stream(p)
    )
